"""Layouts: for each Muon tensor, which elements of its flattened form each rank holds.

A backend is described only here. Replicated (DDP): every rank holds all elements. FSDP2
``Shard(0)``: contiguous row blocks, ``torch.chunk`` sizes. ZeRO-3: ``ceil(numel / W)`` elements
per rank. The exchange and the owner plan never look at the backend, only at these ranges.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..kernels.newton_schulz import orthogonalize_flops


@dataclass(frozen=True)
class TensorLayout:
    """One Muon tensor: its global shape and, per rank, the ``[start, end)`` of its flat elements held
    there. ``blocks``: for a fused projection its owner orthogonalizes block by block (see
    ``hf_muon.models.fused``), each block's ``(rows, cols)``; ``None``: the tensor's own matrices."""

    shape: tuple[int, ...]
    stacked: bool
    ranges: tuple[tuple[int, int], ...]
    blocks: tuple[tuple[int, int], ...] | None = None  # of each matrix, for a stack

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def matrix_shape(self) -> tuple[int, int, int]:
        """``(batch, rows, cols)`` as Newton–Schulz sees it (see ``as_matrices``)."""
        if self.stacked:
            return math.prod(self.shape[:-2]), self.shape[-2], self.shape[-1]
        return 1, self.shape[0], math.prod(self.shape[1:])  # not numel // rows: a tensor may have 0 rows

    @property
    def ns_matrices(self) -> list[tuple[int, int]]:
        """``(rows, cols)`` of each matrix Newton–Schulz runs on for this tensor: its blocks, or its
        matrices (one, or a stack's)."""
        batch, rows, cols = self.matrix_shape
        return list(self.blocks) * batch if self.blocks is not None else [(rows, cols)] * batch

    def ns_flops(self, steps: int, dtype: torch.dtype = torch.float32) -> float:
        """FLOPs the kernel runs to orthogonalize this tensor in ``dtype`` (the kernel's own cost
        model: Gram iterations for wide matrices, their bf16/fp16 restarts), one run per matrix of
        :attr:`ns_matrices`: a fused projection's blocks cost more than its whole matrix would (Phi-3's
        9216 x 3072 qkv: 1.73x in bf16), and the owner plan must weigh what its owner runs."""
        batch, rows, cols = self.matrix_shape
        if self.blocks is None:
            return float(batch * orthogonalize_flops(rows, cols, steps, dtype))
        return float(batch * sum(orthogonalize_flops(r, c, steps, dtype) for r, c in self.blocks))

    def holds(self, rank: int) -> bool:
        start, end = self.ranges[rank]
        return end > start

    def holds_all(self, rank: int) -> bool:
        return self.ranges[rank] == (0, self.numel)

    @property
    def sole_holder(self) -> int | None:
        """The rank holding the whole tensor when no other rank holds any of it, else ``None``."""
        held = [r for r, (start, end) in enumerate(self.ranges) if end > start]
        return held[0] if len(held) == 1 and self.holds_all(held[0]) else None

    @property
    def everywhere(self) -> bool:
        """Every rank holds the whole tensor (DDP: gradients all-reduced)."""
        return all(r == (0, self.numel) for r in self.ranges)


@dataclass(frozen=True)
class ExchangedMatrix:
    """One item the exchange moves and one owner orthogonalizes: a whole tensor, or one matrix of a
    stack (``offset``: where its elements start in the stacked tensor's flat form)."""

    source: int
    offset: int
    layout: TensorLayout


def exchanged_matrices(layouts: list[TensorLayout]) -> list[ExchangedMatrix]:
    """The exchange's items for ``layouts``: each plain tensor whole, and each stacked tensor (a MoE's
    experts, ``[..., rows, cols]``) cut into its matrices, each with its own owner. A stack of 8
    experts then keeps up to 8 owners busy instead of 1, and no rank gathers a whole stack (3.8 GB
    in fp32 for a Mixtral-8x7B layer). The matrices are contiguous in the flat form, so each rank's
    piece of matrix ``e`` is the part of its range inside ``[e * m, (e + 1) * m)``."""
    items = []
    for i, layout in enumerate(layouts):
        if not layout.stacked:
            items.append(ExchangedMatrix(i, 0, layout))
            continue
        batch, rows, cols = layout.matrix_shape
        m = rows * cols
        for e in range(batch):
            lo, hi = e * m, (e + 1) * m
            ranges = tuple((min(max(start, lo), hi) - lo, min(max(end, lo), hi) - lo) for start, end in layout.ranges)
            items.append(ExchangedMatrix(i, lo, TensorLayout((rows, cols), False, ranges, layout.blocks)))
    return items


def with_blocks(layouts: list[TensorLayout],
                blocks: Sequence[Sequence[tuple[int, int]] | None] | None) -> list[TensorLayout]:
    """``layouts`` with each fused projection's block shapes (``blocks[i]``, ``None`` for a tensor
    orthogonalized whole; ``blocks`` ``None``: no fused projections), so that the owner plan and the
    buckets cost the Newton–Schulz each owner will run."""
    if blocks is None:
        return list(layouts)
    if len(blocks) != len(layouts):
        raise ValueError(f"{len(blocks)} block lists for {len(layouts)} layouts")
    return [layout if cut is None else replace(layout, blocks=tuple((int(r), int(c)) for r, c in cut))
            for layout, cut in zip(layouts, blocks)]


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


def group_flat_sharded(shapes: list[tuple[int, ...]], stacked: bool, world: int,
                       alignment: int = 2) -> list[TensorLayout]:
    """DeepSpeed ZeRO-1/2's split of one param group, as the planner predicts it (at run time the
    layouts are read from DeepSpeed itself, ``integrations.deepspeed_zero``).

    DeepSpeed 0.19 (``stage_1_and_2.py``) flattens the group's tensors in order, pads the flat buffer
    to a multiple of ``alignment * W`` elements (``nccl_start_alignment_factor = 2``; per-parameter
    padding only with ``parameter_alignment``, off by default) and gives rank ``r`` the ``r``-th of
    ``W`` equal partitions, so a matrix may straddle ranks."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    total = sum(math.prod(s) for s in shapes)
    unit = alignment * world
    partition = math.ceil(total / unit) * unit // world
    layouts, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        first, last = offset // partition if partition else 0, (offset + n - 1) // partition if n else -1
        ranges = [(0, 0)] * world
        for r in range(first, last + 1):
            ranges[r] = (max(r * partition, offset) - offset, min((r + 1) * partition, offset + n) - offset)
        layouts.append(TensorLayout(tuple(shape), stacked, tuple(ranges)))
        offset += n
    return layouts
