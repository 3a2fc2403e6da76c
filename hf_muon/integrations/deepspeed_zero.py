"""Where each Muon matrix's piece sits in the flat fp32 partition DeepSpeed ZeRO hands to ``step()``.

Inside ZeRO a client optimizer never sees a matrix: each param group holds one flat fp32 tensor,
this rank's partition. Both layouts are read from DeepSpeed's own bookkeeping, never re-derived
(round-robin ordering, alignment padding and sub-groups differ between versions):

* ZeRO-1/2 and ``BF16_Optimizer``: ``link_hp_params`` gives every model parameter an
  ``_hp_mapping`` (its fragment's offset in the flat partition and in the parameter) and its
  ``_dp_group``. The fragments of the other ranks are learned once with one small all-gather.
* ZeRO-3: parameters carry ``_z3_optimizer``; its ``fp16_groups[s]`` lists the parameters of the
  sub-group whose flat partition is ``fp32_partitioned_groups_flat[s]``, ``grad_position`` gives
  each one's offset there, and ``partition_numel()`` the per-rank split of its elements.

Nothing here imports deepspeed: it reads attributes DeepSpeed put on tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed.layout import TensorLayout
from ..optimizer.param_split import shape_of


@dataclass(frozen=True)
class FlatPartition:
    """The Muon matrices with a piece in one flat ZeRO partition.

    ``spans[i]`` is ``(offset, length)`` of matrix ``i``'s piece in the flat tensor (length 0 if this
    rank holds none of it); ``layouts[i]`` says which elements of it each rank of ``group`` holds.
    """

    spans: tuple[tuple[int, int], ...]
    layouts: tuple[TensorLayout, ...]
    group: dist.ProcessGroup | None
    rank: int
    world: int


def is_zero_partition(flat: Tensor, matrices: list[Tensor]) -> bool:
    """Whether ``flat`` is a ZeRO flat partition standing in for ``matrices`` (DeepSpeed was here)."""
    return flat.ndim == 1 and any(hasattr(p, "_hp_mapping") or hasattr(p, "_z3_optimizer") for p in matrices)


def bind_flat_partition(flat: Tensor, matrices: list[Tensor], stacked: bool) -> FlatPartition:
    """Read where each of ``matrices`` (the model parameters of a Muon group) sits in ``flat``."""
    z3 = next((p._z3_optimizer for p in matrices if hasattr(p, "_z3_optimizer")), None)
    if z3 is not None:
        return _bind_stage3(flat, z3, stacked)
    return _bind_stage1_2(flat, [p for p in matrices if p.requires_grad], stacked)


def _same_storage(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _bind_stage1_2(flat: Tensor, matrices: list[Tensor], stacked: bool) -> FlatPartition:
    groups = {id(getattr(p, "_dp_group", None)) for p in matrices}
    if len(groups) != 1 or not hasattr(matrices[0], "_dp_group"):
        raise RuntimeError("hf_muon.Muon: DeepSpeed did not link every Muon matrix of a group to one data-parallel group")
    group = matrices[0]._dp_group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    spans, local_ranges = [], []
    for p in matrices:
        mapping = p._hp_mapping
        if mapping is None:
            spans.append((0, 0))
            local_ranges.append((0, 0))
            continue
        if not _same_storage(mapping.hp_fragment, flat):
            raise RuntimeError(
                "hf_muon.Muon: a Muon matrix's ZeRO fragment is not in the flat partition step() received; "
                "this DeepSpeed optimizer wrapper is not supported (use ZeRO stage 1, 2 or 3 without ZenFlow)"
            )
        start, numel = mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel
        spans.append((mapping.hp_fragment_address.start, numel))
        local_ranges.append((start, start + numel))
    # Each rank knows only its own fragments: learn the others' once (a few integers per matrix).
    mine = torch.tensor(local_ranges, dtype=torch.int64).reshape(-1, 2)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    layouts = []
    for i, p in enumerate(matrices):
        shape = shape_of(p)
        ranges = tuple((int(everyone[r][i, 0]), int(everyone[r][i, 1])) for r in range(world))
        layouts.append(_checked(TensorLayout(shape, stacked, ranges)))
    return FlatPartition(tuple(spans), tuple(layouts), group, rank, world)


def _bind_stage3(flat: Tensor, z3, stacked: bool) -> FlatPartition:
    sub_group = next((s for s, t in enumerate(z3.fp32_partitioned_groups_flat) if t is flat), None)
    if sub_group is None:
        raise RuntimeError(
            "hf_muon.Muon: step() got a tensor that is not one of ZeRO-3's flat fp32 partitions "
            "(optimizer offload with NVMe swapping is not supported)"
        )
    group = z3.sub_group_process_groups[sub_group]
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    spans, layouts = [], []
    for p in z3.fp16_groups[sub_group]:
        shape = shape_of(p)
        numel, part = math.prod(shape), p.partition_numel()
        ranges = tuple((min(r * part, numel), min((r + 1) * part, numel)) for r in range(world))
        _, offset, _ = z3.grad_position[z3.get_param_id(p)]
        start, end = ranges[rank]
        spans.append((offset, end - start))
        layouts.append(_checked(TensorLayout(shape, stacked, ranges)))
    return FlatPartition(tuple(spans), tuple(layouts), group, rank, world)


def _checked(layout: TensorLayout) -> TensorLayout:
    """The ranks' pieces must tile the matrix exactly, or the owner would orthogonalize garbage."""
    covered = sorted(r for r in layout.ranges if r[1] > r[0])
    position = 0
    for start, end in covered:
        if start != position:
            break
        position = end
    if position != layout.numel:
        raise RuntimeError(f"hf_muon.Muon: ZeRO fragments {layout.ranges} do not tile a tensor of shape {layout.shape}")
    return layout
