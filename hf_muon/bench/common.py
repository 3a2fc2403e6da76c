"""Shared pieces of the benchmark: summaries, shapes, machine facts, child processes, progress bars."""

from __future__ import annotations

import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence


# Figure 1's contenders (names as the report prints them)
ADAMW = "torch.optim.AdamW (foreach)"
HF_MUON = "hf_muon.Muon"  # as shipped: Frobenius normalization, 5 quintic steps
HF_MUON_AOL = "hf_muon.Muon (ns_precondition=aol, 4 steps)"
HF_MUON_FP32 = "hf_muon.Muon (ns_dtype=fp32)"
TORCH_MUON = "torch.optim.Muon (bf16, per matrix)"
CONTENDERS = (ADAMW, HF_MUON, HF_MUON_AOL, HF_MUON_FP32, TORCH_MUON)


def summarize(samples: Sequence[float]) -> dict[str, Any]:
    """Median and min–max of repeated measurements (the samples are kept too)."""
    values = [float(s) for s in samples]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0, "samples": []}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values),
            "samples": values}


def ffn_width(d: int) -> int:
    """Llama's SwiGLU width rule: 8d/3 rounded up to a multiple of 256."""
    return 256 * ((8 * d // 3 + 255) // 256)


def llama_matrices(d: int, layers: int, heads: int, kv_heads: int, ff: int | None = None) -> list[tuple[int, int]]:
    """Weight shapes (out, in) of a Llama block stack: GQA attention (q, k, v, o) and a SwiGLU MLP
    (gate, up, down) of width ``ff`` (``None``: :func:`ffn_width`, 8d/3 rounded up to 256; Llama's own
    ratio is 2.6875d, e.g. 1376 at d=512). Embeddings and the output head are not hidden matrices
    (AdamW's in Muon)."""
    head_dim = d // heads
    ffn = ffn_width(d) if ff is None else ff
    block = [(d, d), (kv_heads * head_dim, d), (kv_heads * head_dim, d), (d, d), (ffn, d), (ffn, d), (d, ffn)]
    return block * layers


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    import torch

    info = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": loadavg(),
    }
    for name in ("transformers", "accelerate", "deepspeed"):
        try:
            from importlib.metadata import version

            info[name] = version(name)
        except Exception:  # noqa: BLE001 - a missing package is reported, not fatal
            info[name] = None
    return info


def child_env(threads: int | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a benchmark child process: offline, passive OpenMP waiting (busy-waiting threads
    slow everything down many times over when the CPU is shared), optional thread count."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["PYTHONUNBUFFERED"] = "1"
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
        env["MKL_NUM_THREADS"] = str(threads)
    env.update(extra or {})
    return env


def run_child(cmd: list[str], log_path: Path, timeout_s: float, env: dict[str, str] | None = None,
              cwd: str | Path | None = None, on_poll: Callable[[], None] | None = None) -> tuple[bool, str]:
    """Run ``cmd`` with its output in ``log_path``; kill its whole process group after ``timeout_s``.
    ``on_poll`` is called about once a second while it runs (progress bars).

    Returns ``(ok, reason)``: reason is ``""`` on success, else a one-line cause (exit code or
    timeout, and the most telling line of the log). See :func:`hf_muon.launching.run`."""
    from ..launching import run

    result = run(cmd, timeout_s, env=env, cwd=cwd, log_path=log_path, on_poll=on_poll, poll_s=1.0)
    if on_poll is not None:
        on_poll()
    if result.timed_out:
        return False, f"timed out after {timeout_s:.0f} s ({last_line(log_path)})"
    if result.returncode != 0:
        return False, f"exit code {result.returncode}: {last_line(log_path)}"
    return True, ""


_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt|Exit)\b:?")


def last_line(log_path: Path) -> str:
    """The most telling line of a log: the last exception line, else the last one saying "failed" or
    "error", else the last non-empty one."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    lines = [ln for ln in lines if not ln.startswith("$ ")]
    for test in (lambda ln: _EXCEPTION_LINE.match(ln), lambda ln: "failed" in ln.lower() or "error" in ln.lower()):
        for line in reversed(lines):
            if test(line):
                return line[:300]
    return lines[-1][:300] if lines else "empty log"


def progress(total: int, desc: str, unit: str = "it"):
    """A tqdm progress bar on stderr (shown by ``hf-muon bench``)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=True)


class Timer:
    def __enter__(self) -> "Timer":
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds = time.perf_counter() - self.start
