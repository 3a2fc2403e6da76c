"""Run an unmodified training script with ``--optim muon`` available.

    python -m hf_muon.run examples/pretrain_clm.py --optim muon ...
    python -m hf_muon.run -m my_package.train --optim muon ...
    accelerate launch -m hf_muon.run train.py --optim muon ...     (also torchrun -m, deepspeed --module)

It sets ``HF_MUON_REGISTER=1`` so registration reaches every child Python the script starts
(launchers and CLIs that re-launch themselves), then runs the script as ``__main__``.

On a machine without a GPU, a Trainer launched on several ranks (DDP, FSDP, DeepSpeed) gets the
gloo process group Accelerate would not set up (see ``hf_muon/integrations/accelerate_cpu.py``).
When the script returns, the runner destroys the process group and, where a gloo backend would
otherwise be torn down during the interpreter's shutdown (which aborts now and then), ends the
process itself with exit code 0 (:func:`hf_muon.launching.shutdown_process_group`).
"""

from __future__ import annotations

import os
import runpy
import sys

from .integrations.import_hook import ENV_VAR, register_when_transformers_loads

USAGE = "usage: python -m hf_muon.run SCRIPT.py [ARGS...]  |  python -m hf_muon.run -m MODULE [ARGS...]"


def _move_local_rank(argv: list[str]) -> list[str]:
    """``deepspeed --module hf_muon.run`` puts ``--local_rank=N`` before the script: hand it to the script.

    The ``deepspeed`` launcher inserts it right after the module name; without the runner the script
    itself would have received it, so it goes after the script (or module) name.
    """
    if not argv or not argv[0].startswith("--local_rank"):
        return argv
    width = 1 if "=" in argv[0] else 2
    flag, rest = argv[:width], argv[width:]
    head = 2 if rest[:1] == ["-m"] else 1
    return [*rest[:head], *flag, *rest[head:]] if len(rest) >= head else argv


def main(argv: list[str] | None = None) -> None:
    """Run ``SCRIPT [ARGS]`` (or ``-m MODULE [ARGS]``) with Muon registered."""
    argv = _move_local_rank(list(sys.argv[1:] if argv is None else argv))
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        raise SystemExit(0 if argv else 2)
    os.environ[ENV_VAR] = "1"
    register_when_transformers_loads()
    if argv[0] == "-m" and len(argv) < 2:
        raise SystemExit(USAGE)
    if argv[0] != "-m" and not os.path.isfile(argv[0]):
        raise SystemExit(f"hf_muon.run: no such script: {argv[0]}\n{USAGE}")
    succeeded = False
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = argv[0]
            sys.argv = [script, *argv[1:]]
            # as `python script.py` does: the script's folder first, and not the current one that
            # `python -m hf_muon.run` put there
            here = os.path.dirname(os.path.abspath(script))
            if sys.path and sys.path[0] in ("", os.getcwd()):
                sys.path[0] = here
            else:
                sys.path.insert(0, here)
            runpy.run_path(script, run_name="__main__")
        succeeded = True
    except SystemExit as stop:
        succeeded = stop.code is None or stop.code == 0
        if not succeeded:
            raise
    finally:
        # The end of a CPU (gloo) launch: the process group must be gone before the interpreter's
        # teardown, or gloo aborts the process now and then (see hf_muon/launching.py). After a
        # successful script that may end the process here, exit code 0; a failure propagates.
        from .launching import shutdown_process_group

        shutdown_process_group(exit_code=0 if succeeded else None)


if __name__ == "__main__":
    main()
