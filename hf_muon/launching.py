"""Launch helpers shared by the runner, the tests and the benchmark: one copy of each.

* :func:`free_port` — a free TCP port on the loopback interface;
* :func:`start`, :func:`stop`, :func:`wait_all`, :func:`run` — a launcher (torchrun, accelerate,
  deepspeed, a script) in its own session with its output in a file (never a pipe: a stuck worker
  then cannot block the caller on EOF), waited for with a hard timeout after which its whole process
  group gets SIGTERM, then SIGKILL; :func:`run` retries once when the port was taken between the
  probe and the launcher's bind ("address already in use");
* :func:`shutdown_process_group` — the end of a gloo (CPU) job: destroy the process group so that
  it really goes away, and exit before the interpreter's teardown can abort (see its docstring).

Importing this module does not import torch.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Mapping, Sequence, Union

ADDRESS_IN_USE = "address already in use"
Command = Union[Sequence[str], Callable[[], Sequence[str]]]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (another process may still take it before you bind:
    :func:`run` retries that case once)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------------
# Process groups with hard timeouts


def start(cmd: Sequence[str], log: IO, env: Mapping[str, str] | None = None,
          cwd: str | os.PathLike | None = None) -> subprocess.Popen:
    """Start ``cmd`` in a new session (its own process group) with stdout and stderr in the file ``log``."""
    return subprocess.Popen(list(cmd), cwd=cwd, env=None if env is None else dict(env), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """Stop ``proc`` and everything it started: SIGTERM to its process group (launchers forward it
    to their workers), SIGKILL to whatever is left after ``grace_s`` seconds.

    After a normal exit this only removes processes a launcher may have left behind. ``proc`` must
    have been started in its own session (:func:`start`)."""
    try:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is gone: nothing left to stop
    except PermissionError:
        pass  # the group id was reused by a process that is not ours: leave it alone
    proc.wait()


def wait_all(procs: Sequence[subprocess.Popen], timeout_s: float, poll_s: float = 0.5,
             on_poll: Callable[[], None] | None = None) -> bool:
    """Wait until every process exited, or one failed (the others are then not waited for).

    Returns False if ``timeout_s`` ran out first. ``on_poll`` is called once per poll (progress bars)."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            return True
        if on_poll is not None:
            on_poll()
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


@dataclass
class Result:
    """What :func:`run` saw. ``returncode`` is None when the command timed out and was stopped."""

    cmd: list[str]
    returncode: int | None
    output: str
    timed_out: bool
    attempts: int = 1

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _run_once(cmd: list[str], timeout_s: float, env: Mapping[str, str] | None, cwd: str | os.PathLike | None,
              log_path: Path | None, on_poll: Callable[[], None] | None, poll_s: float) -> tuple[int | None, str, bool]:
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "w+")
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        header = log.tell()
    else:
        log, header = tempfile.TemporaryFile("w+"), 0
    with log:
        proc = start(cmd, log, env=env, cwd=cwd)
        try:
            finished = wait_all([proc], timeout_s, poll_s=poll_s, on_poll=on_poll)
        finally:
            stop(proc)  # on time: only stragglers; late: the whole group
        log.seek(header)
        output = log.read()
    return (proc.returncode if finished else None), output, not finished


def run(cmd: Command, timeout_s: float, env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
        log_path: str | os.PathLike | None = None, on_poll: Callable[[], None] | None = None,
        poll_s: float = 0.5, retry_address_in_use: bool = True) -> Result:
    """Run ``cmd`` to the end or for at most ``timeout_s`` seconds; never raises for a failed command.

    ``cmd`` is a list, or a function returning one: it is called again for the retry, so a command
    built with a fresh :func:`free_port` gets a new port. Output (stdout and stderr) goes to
    ``log_path`` (after a ``$ cmd`` line) or to a temporary file, and comes back in ``Result.output``.
    ``on_poll`` is called every ``poll_s`` seconds while it runs. One retry when a failed run said
    "address already in use" (the port was taken after the probe)."""
    attempts = 0
    while True:
        attempts += 1
        args = [str(a) for a in (cmd() if callable(cmd) else cmd)]
        code, output, timed_out = _run_once(args, timeout_s, env, cwd, None if log_path is None else Path(log_path),
                                            on_poll, poll_s)
        retry = retry_address_in_use and attempts == 1 and code not in (0, None) and ADDRESS_IN_USE in output.lower()
        if not retry:
            return Result(args, code, output, timed_out, attempts)


# ---------------------------------------------------------------------------------------------------------------
# The end of a gloo job

_GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")  # the names torch 2.x gives a gloo backend's threads


def gloo_threads_alive() -> int | None:
    """How many threads of a gloo backend this process still runs; None where ``/proc`` does not say."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    alive = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                alive += f.read().strip() in _GLOO_THREADS
        except OSError:
            continue  # the thread ended meanwhile
    return alive


def shutdown_process_group(exit_code: int | None = None) -> bool:
    """The end of a gloo (CPU) job: destroy every process group; with ``exit_code``, end the process
    too. Returns whether it destroyed a group. Jobs without gloo (NCCL only, or no process group)
    are left alone. Safe to call twice (the second call does nothing), and from ``atexit``.

    **Why.** A gloo worker thread (``pt_gloo_runloop``) releases a finished collective only after the
    caller's ``wait()`` has returned; the work's captured thread-local state holds Python objects,
    so the release takes the GIL. If the main thread has meanwhile returned from the script and
    Python has begun finalizing, CPython ends that thread with ``pthread_exit``; its forced unwinding
    through torch's ``noexcept`` destructors (``~AsyncWork`` -> ``~ThreadLocalState`` -> ``decref``)
    calls ``std::terminate``: "terminate called without an active exception", SIGABRT, exit -6,
    after the job did all its work (seen in a core dump: the main thread in ``Py_FinalizeEx``, the
    worker in ``take_gil`` -> ``PyThread_exit_thread``). The window is short, so it hits more often
    on a busy machine. ``dist.destroy_process_group()`` does not close it: the backend, and with it
    the join of its threads, outlives the call whenever something still holds the group (DDP's
    reducer, a module's optimizer or mesh, default arguments such as ``group=group.WORLD`` in
    ``torch.distributed.nn.functional`` or ``deepspeed.comm`` evaluated when imported after
    ``init_process_group``), and a barrier is one more such collective.

    **What it does.** Destroys the groups and collects garbage (the backend stops here if nothing
    else holds it). With ``exit_code``, which only the owner of the process may pass (the end of
    ``hf_muon.run`` or of a worker script), and a gloo group destroyed here or gloo threads still
    running, it then does what Python's exit does before finalizing (join non-daemon threads, run
    the ``atexit`` handlers, collect garbage), flushes Python's and C's stdio and ends with
    ``os._exit(exit_code)``: the finalization, where the abort happens, is skipped. Without gloo the
    process exits normally.
    """
    destroyed = False
    if "torch.distributed" in sys.modules:  # never import torch here: no torch, no process group
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and _uses_gloo(dist):
            dist.destroy_process_group()
            destroyed = True
            import gc

            gc.collect()  # the group's last references may sit in reference cycles
    if exit_code is not None and (destroyed or gloo_threads_alive()):
        _exit_now(exit_code)
    return destroyed


def _uses_gloo(dist) -> bool:
    """Whether one of the process groups runs gloo (an NCCL-only job is left as it is)."""
    groups = list(getattr(dist.distributed_c10d._world, "pg_map", None) or [None])
    try:
        return any("gloo" in str(dist.get_backend(g)).lower() for g in groups)
    except Exception:  # noqa: BLE001 - a group torch cannot describe any more: treat it as gloo
        return True


def _exit_now(code: int) -> None:
    """What ``sys.exit(code)`` does at the top of ``__main__``, minus the interpreter's finalization."""
    import atexit
    import gc

    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads, as Python's exit does
        atexit._run_exitfuncs()  # each handler's error is printed, as at a normal exit
        gc.collect()  # files left open in reference cycles are flushed when collected
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream has nothing left to flush
                pass
        try:  # C and C++ code's buffered stdio, which os._exit would drop
            import ctypes

            ctypes.CDLL(None).fflush(None)
        except Exception:  # noqa: BLE001 - no C library to ask: nothing buffered there that we know of
            pass
        os._exit(code)
