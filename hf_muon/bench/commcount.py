"""Count the bytes this process passes to ``torch.distributed`` collectives (installed in training workers).

``install()`` wraps the collectives of ``torch.distributed`` (and its ``distributed_c10d`` module, where
DeepSpeed's ``deepspeed.comm`` torch backend looks some of them up) so every call adds the size of
the buffer it moves to a per-operation counter. Install it before ``deepspeed`` is imported: its torch
backend keeps references to ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` from when it
is created. Collectives made from C++ (the DDP reducer) are not seen; DeepSpeed, FSDP2's Python
code and hf_muon's exchange call the Python functions.

The size of a call is the larger of what it sends and what it receives on this rank: an
all-reduce or broadcast of a tensor counts the tensor, an all-gather counts the gathered (output)
buffer, a reduce-scatter the input buffer, an all-to-all the larger side. With that rule AdamW
under ZeRO-2 moves 2x its fp32 parameter bytes per step (reduce the gradients, gather the
parameters), matching /work/shared/DESIGN.md. A collective that calls another wrapped one is
counted once (only the outermost call).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import defaultdict
from typing import Any, Callable

# operation -> (category, how to size a call from its bound arguments)
GRADIENT_REDUCTION = "gradient reduction"
PARAMETER_GATHERING = "parameter gathering"
ALL_TO_ALL = "all-to-all"
OTHER = "other"


def _nbytes(t: Any) -> int:
    try:
        return int(t.numel()) * int(t.element_size())
    except AttributeError:
        return 0


def _sum(ts: Any) -> int:
    if ts is None:
        return 0
    if hasattr(ts, "numel"):
        return _nbytes(ts)
    return sum(_sum(t) for t in ts)


def _arg(bound: inspect.BoundArguments, *names: str) -> Any:
    for name in names:
        if name in bound.arguments:
            return bound.arguments[name]
    return None


_OPS: dict[str, tuple[str, Callable[[inspect.BoundArguments], int]]] = {
    "all_reduce": (GRADIENT_REDUCTION, lambda b: _sum(_arg(b, "tensor"))),
    "all_reduce_coalesced": (GRADIENT_REDUCTION, lambda b: _sum(_arg(b, "tensors"))),
    "reduce": (GRADIENT_REDUCTION, lambda b: _sum(_arg(b, "tensor"))),
    "reduce_scatter": (GRADIENT_REDUCTION, lambda b: _sum(_arg(b, "input_list"))),
    "reduce_scatter_tensor": (GRADIENT_REDUCTION, lambda b: _sum(_arg(b, "input"))),
    "_reduce_scatter_base": (GRADIENT_REDUCTION, lambda b: _sum(_arg(b, "input"))),
    "all_gather": (PARAMETER_GATHERING, lambda b: _sum(_arg(b, "tensor_list"))),
    "all_gather_into_tensor": (PARAMETER_GATHERING, lambda b: _sum(_arg(b, "output_tensor"))),
    "_all_gather_base": (PARAMETER_GATHERING, lambda b: _sum(_arg(b, "output_tensor"))),
    "all_gather_coalesced": (PARAMETER_GATHERING, lambda b: _sum(_arg(b, "output_tensor_lists"))),
    "broadcast": (PARAMETER_GATHERING, lambda b: _sum(_arg(b, "tensor"))),
    "all_to_all": (ALL_TO_ALL, lambda b: max(_sum(_arg(b, "output_tensor_list")), _sum(_arg(b, "input_tensor_list")))),
    "all_to_all_single": (ALL_TO_ALL, lambda b: max(_sum(_arg(b, "output")), _sum(_arg(b, "input")))),
    "scatter": (OTHER, lambda b: max(_sum(_arg(b, "tensor")), _sum(_arg(b, "scatter_list")))),
    "gather": (OTHER, lambda b: max(_sum(_arg(b, "tensor")), _sum(_arg(b, "gather_list")))),
    "send": (OTHER, lambda b: _sum(_arg(b, "tensor"))),
    "recv": (OTHER, lambda b: _sum(_arg(b, "tensor"))),
    "isend": (OTHER, lambda b: _sum(_arg(b, "tensor"))),
    "irecv": (OTHER, lambda b: _sum(_arg(b, "tensor"))),
}
CATEGORIES = (GRADIENT_REDUCTION, PARAMETER_GATHERING, ALL_TO_ALL, OTHER)


class CommCounter:
    """Bytes and calls per operation since :meth:`reset` (this process only)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self._local = threading.local()

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {"bytes": dict(self.bytes), "calls": dict(self.calls)}

    @staticmethod
    def by_category(bytes_by_op: dict[str, int]) -> dict[str, int]:
        out = {c: 0 for c in CATEGORIES}
        for op, n in bytes_by_op.items():
            out[_OPS[op][0] if op in _OPS else OTHER] += n
        return out

    def _wrap(self, name: str, fn: Callable) -> Callable:
        if getattr(fn, "_hf_muon_counted", False):
            return fn
        signature = inspect.signature(fn)
        size = _OPS[name][1]

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                try:
                    n = size(signature.bind_partial(*args, **kwargs))
                except TypeError:
                    n = 0
                self.bytes[name] += n
                self.calls[name] += 1
            self._local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = depth

        counted._hf_muon_counted = True  # type: ignore[attr-defined]
        return counted


COUNTER = CommCounter()
_INSTALLED: list[bool] = []


def install() -> CommCounter:
    """Wrap the collectives of ``torch.distributed`` (idempotent) and return the global counter."""
    if _INSTALLED:
        return COUNTER
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name in _OPS:
        fn = getattr(c10d, name, None) or getattr(dist, name, None)
        if fn is None:
            continue
        wrapped = COUNTER._wrap(name, fn)
        # the same wrapper in both namespaces (torch.distributed re-exports c10d's functions)
        for module in (c10d, dist):
            if hasattr(module, name):
                setattr(module, name, wrapped)
    _INSTALLED.append(True)
    return COUNTER
