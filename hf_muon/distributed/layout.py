"""Layouts: for each Muon tensor, which elements of its flattened form each rank holds.

A backend is described only here. Replicated (DDP): every rank holds all elements. FSDP2
``Shard(0)``: contiguous row blocks, ``torch.chunk`` sizes. ZeRO-3: ``ceil(numel / W)`` elements
per rank. The exchange and the owner plan never look at the backend, only at these ranges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels.newton_schulz import orthogonalize_flops


@dataclass(frozen=True)
class TensorLayout:
    """One Muon tensor: its global shape and, per rank, the ``[start, end)`` of its flat elements held there."""

    shape: tuple[int, ...]
    stacked: bool
    ranges: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def matrix_shape(self) -> tuple[int, int, int]:
        """``(batch, rows, cols)`` as Newton–Schulz sees it (see ``as_matrices``)."""
        if self.stacked:
            return math.prod(self.shape[:-2]), self.shape[-2], self.shape[-1]
        return 1, self.shape[0], self.numel // self.shape[0]

    def ns_flops(self, steps: int, dtype: torch.dtype = torch.float32) -> float:
        """FLOPs the kernel runs to orthogonalize this tensor in ``dtype`` (the kernel's own cost
        model: Gram iterations for wide matrices, their bf16/fp16 restarts), one run per matrix."""
        batch, rows, cols = self.matrix_shape
        return float(batch * orthogonalize_flops(rows, cols, steps, dtype))

    def holds(self, rank: int) -> bool:
        start, end = self.ranges[rank]
        return end > start

    def holds_all(self, rank: int) -> bool:
        return self.ranges[rank] == (0, self.numel)


def replicated(shape: tuple[int, ...], stacked: bool, world: int) -> TensorLayout:
    """Every rank holds the whole tensor (DDP: gradients already all-reduced)."""
    n = math.prod(shape)
    return TensorLayout(tuple(shape), stacked, ((0, n),) * world)


def row_sharded(shape: tuple[int, ...], stacked: bool, world: int) -> TensorLayout:
    """``Shard(0)`` as FSDP2 lays it out: ``torch.chunk`` row blocks of ``ceil(rows / W)``."""
    rows, row_numel = shape[0], math.prod(shape[1:])
    chunk = math.ceil(rows / world)
    ranges = tuple(
        (min(r * chunk, rows) * row_numel, min((r + 1) * chunk, rows) * row_numel) for r in range(world)
    )
    return TensorLayout(tuple(shape), stacked, ranges)


def flat_sharded(shape: tuple[int, ...], stacked: bool, world: int) -> TensorLayout:
    """ZeRO-3's split: rank ``r`` holds elements ``[r * ps, (r + 1) * ps)``, ``ps = ceil(numel / W)``."""
    n = math.prod(shape)
    ps = math.ceil(n / world)
    return TensorLayout(tuple(shape), stacked, tuple((min(r * ps, n), min((r + 1) * ps, n)) for r in range(world)))
