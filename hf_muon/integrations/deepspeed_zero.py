"""DeepSpeed ZeRO's layout provider: real shapes, the ``use_muon`` flag, and where each Muon matrix's
piece sits in the flat fp32 partition ZeRO hands to ``step()``.

Inside ZeRO a client optimizer never sees a matrix: each param group holds one flat fp32 tensor,
this rank's partition. Both layouts are read from DeepSpeed's own bookkeeping, never re-derived
(round-robin ordering, alignment padding and sub-groups differ between versions):

* ZeRO-1/2 and ``BF16_Optimizer``: ``link_hp_params`` gives every model parameter an
  ``_hp_mapping`` (its fragment's offset in the flat partition and in the parameter) and its
  ``_dp_group``. The fragments of the other ranks are learned once with one small all-gather, with
  a check that each mapping agrees with where the parameter's data sit in the flat buffer (DeepSpeed
  0.19 gets it wrong under ``round_robin_gradients``: refused).
* ZeRO-3: parameters carry ``_z3_optimizer``; its ``fp16_groups[s]`` lists the parameters of the
  sub-group whose flat partition is ``fp32_partitioned_groups_flat[s]``, ``grad_position`` gives
  each one's offset there, and ``partition_numel()`` the per-rank split of its elements.

Those internals are read through ``compat.internal``: a DeepSpeed that renamed one fails with a
message naming it and the tested version. ``hf_muon/__init__.py`` registers :data:`PROVIDER` by
module path, so the optimizer uses it without importing it. Nothing here imports deepspeed: it
reads attributes DeepSpeed put on tensors.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed.layout import TensorLayout
from ..distributed.providers import FlatPartition, LayoutProvider
from .compat import internal

NAME = "DeepSpeed ZeRO"


def _ds(owner: Any, name: str) -> Any:
    """A DeepSpeed internal, or :class:`~hf_muon.integrations.compat.IncompatibleVersionError` naming it."""
    return internal(owner, name, "deepspeed")


def ds_shape(p: Tensor) -> tuple[int, ...] | None:
    """The real shape DeepSpeed keeps in ``ds_shape`` (``zero.Init`` makes ``p.shape`` ``[0]``), or ``None``."""
    shape = getattr(p, "ds_shape", None)
    return tuple(shape) if shape is not None else None


def _shape(p: Tensor) -> tuple[int, ...]:
    return ds_shape(p) or tuple(p.shape)


def _user_stacklevel() -> int:
    """``stacklevel`` of the first caller outside hf_muon and torch: a warning then names user code,
    however deep in the optimizer's construction the check runs."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in ("hf_muon", "torch"):
        frame, level = frame.f_back, level + 1
    return level


def check_use_muon(group: dict[str, Any]) -> None:
    """Keep DeepSpeed's own Muon off hf_muon's tensors.

    In ZeRO-1/2 DeepSpeed runs its own Newton–Schulz on a group whose parameters have a truthy
    ``use_muon`` (because our class is named Muon), and ``BF16_Optimizer`` reads a ``use_muon`` group
    key: refuse the key, remove the attribute with a warning."""
    if "use_muon" in group:
        raise ValueError(
            "param group has a 'use_muon' key: that key makes DeepSpeed run its own Muon on the group. "
            "Use 'algorithm': 'muon' or 'adamw' instead"
        )
    for p in group["params"]:
        if getattr(p, "use_muon", None) is not None:
            warnings.warn("removing the 'use_muon' attribute DeepSpeed's Muon set on a parameter",
                          stacklevel=_user_stacklevel())
            del p.use_muon


def is_zero_partition(flat: Tensor, matrices: list[Tensor]) -> bool:
    """Whether ``flat`` is a ZeRO flat partition standing in for ``matrices`` (DeepSpeed was here)."""
    return flat.ndim == 1 and any(hasattr(p, "_hp_mapping") or hasattr(p, "_z3_optimizer") for p in matrices)


def bind_flat_partition(flat: Tensor, matrices: list[Tensor], stacked: bool) -> FlatPartition:
    """Read where each of ``matrices`` (the model parameters of a Muon group) sits in ``flat``."""
    z3 = next((_ds(p, "_z3_optimizer") for p in matrices if hasattr(p, "_z3_optimizer")), None)
    if z3 is not None:
        return _bind_stage3(flat, z3, stacked)
    # DeepSpeed leaves frozen and zero-element parameters out of its groups (``is_optimized_parameter``)
    return _bind_stage1_2(flat, [p for p in matrices if p.requires_grad and p.numel() > 0], stacked)


def _same_storage(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _bind_stage1_2(flat: Tensor, matrices: list[Tensor], stacked: bool) -> FlatPartition:
    dp_groups = [_ds(p, "_dp_group") for p in matrices]
    if len({id(g) for g in dp_groups}) != 1:
        raise RuntimeError("hf_muon.Muon: DeepSpeed did not link every Muon matrix of a group to one data-parallel group")
    group = dp_groups[0]
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    spans, local_ranges, shifts = [], [], []
    views = len({p.data.untyped_storage().data_ptr() for p in matrices}) == 1
    for p in matrices:
        mapping = _ds(p, "_hp_mapping")
        if mapping is None:
            spans.append((0, 0))
            local_ranges.append((0, 0))
            shifts.append(_NO_SHIFT)
            continue
        if not _same_storage(_ds(mapping, "hp_fragment"), flat):
            raise RuntimeError(
                "hf_muon.Muon: a Muon matrix's ZeRO fragment is not in the flat partition step() received; "
                "this DeepSpeed optimizer wrapper is not supported (use ZeRO stage 1, 2 or 3 without ZenFlow)"
            )
        lp_address = _ds(mapping, "lp_fragment_address")
        start, numel = _ds(lp_address, "start"), _ds(lp_address, "numel")
        hp_start = _ds(_ds(mapping, "hp_fragment_address"), "start")
        spans.append((hp_start, numel))
        local_ranges.append((start, start + numel))
        # where the mapping puts the parameter's first element in the group's flat buffer, against
        # where its data (a view of that buffer) sits: a constant apart for every parameter
        said = rank * flat.numel() + hp_start - start
        shifts.append(p.data.storage_offset() - said if views else _NO_SHIFT)
    # Each rank knows only its own fragments: learn the others' once (a few integers per matrix).
    mine = torch.tensor([(*r, s) for r, s in zip(local_ranges, shifts)], dtype=torch.int64).reshape(-1, 3)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    _check_linkage(everyone)
    layouts = []
    for i, p in enumerate(matrices):
        shape = _shape(p)
        ranges = tuple((int(everyone[r][i, 0]), int(everyone[r][i, 1])) for r in range(world))
        layouts.append(_checked(TensorLayout(shape, stacked, ranges)))
    return FlatPartition(tuple(spans), tuple(layouts), group, rank, world, NAME, tuple(matrices))


# a parameter without a fragment on this rank, or whose data is not a view of the flat buffer
_NO_SHIFT = -(2**62)

ROUND_ROBIN_MESSAGE = (
    "hf_muon.Muon: DeepSpeed's ZeRO-1/2 linkage (_hp_mapping) puts parameters where they are not in "
    "the flat partition: the parameters' data sit in one order, the mapping counts them in another. "
    "DeepSpeed {version} does this with \"round_robin_gradients\": true when no parameter needs alignment "
    "padding (it reorders the flat buffer, then links the parameters in their original order), and "
    "Muon would orthogonalize slices of other matrices. DeepSpeed's own safe_get_full_fp32_param, "
    "safe_set_full_fp32_param and universal checkpoints read the same mapping. Set "
    "\"round_robin_gradients\": false in the \"zero_optimization\" section of the DeepSpeed config."
)


def _check_linkage(everyone: list[Tensor]) -> None:
    """Refuse, on every rank alike, a ZeRO-1/2 linkage that disagrees with where the data sit.

    ``everyone[r]`` holds rank r's ``(start, end, shift)`` per matrix, ``shift`` being where the
    parameter's data sit in the flat buffer minus where ``_hp_mapping`` says they start (the flat
    buffer's own offset when they agree: one value for every parameter on every rank)."""
    shifts = {int(s) for rows in everyone for s in rows[:, 2].tolist() if s != _NO_SHIFT}
    if len(shifts) > 1:
        raise RuntimeError(ROUND_ROBIN_MESSAGE.format(version=getattr(sys.modules.get("deepspeed"), "__version__", "")))


def _bind_stage3(flat: Tensor, z3, stacked: bool) -> FlatPartition:
    sub_group = next((s for s, t in enumerate(_ds(z3, "fp32_partitioned_groups_flat")) if t is flat), None)
    if sub_group is None:
        raise RuntimeError(
            "hf_muon.Muon: step() got a tensor that is not one of ZeRO-3's flat fp32 partitions "
            "(optimizer offload with NVMe swapping is not supported)"
        )
    group = _ds(z3, "sub_group_process_groups")[sub_group]
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    grad_position, get_param_id = _ds(z3, "grad_position"), _ds(z3, "get_param_id")
    spans, layouts = [], []
    params = tuple(_ds(z3, "fp16_groups")[sub_group])
    for p in params:
        shape = _shape(p)
        numel, part = math.prod(shape), _ds(p, "partition_numel")()
        ranges = tuple((min(r * part, numel), min((r + 1) * part, numel)) for r in range(world))
        _, offset, _ = grad_position[get_param_id(p)]
        start, end = ranges[rank]
        spans.append((offset, end - start))
        layouts.append(_checked(TensorLayout(shape, stacked, ranges)))
    return FlatPartition(tuple(spans), tuple(layouts), group, rank, world, NAME, params)


def load_parameter(p: Tensor, whole: Tensor) -> bool:
    """Set a ZeRO-managed parameter to ``whole``: the 16-bit (or fp32) model copy and DeepSpeed's fp32
    master partition, through DeepSpeed's public ``GatheredParameters`` and ``safe_set_full_fp32_param``."""
    if not (hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")):
        return False
    from deepspeed import zero
    from deepspeed.utils import safe_set_full_fp32_param

    if hasattr(p, "ds_id"):  # ZeRO-3: partitioned; rank 0 writes the gathered whole, DeepSpeed re-partitions it
        with zero.GatheredParameters([p], modifier_rank=0):
            if dist.get_rank() == 0:
                p.data.copy_(whole.view(p.shape))
    else:  # ZeRO-1/2: every rank holds the whole model copy
        p.data.copy_(whole.view(p.shape))
    if p.requires_grad:
        safe_set_full_fp32_param(p, whole.view(_shape(p)).to(torch.float32))
    return True


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


class DeepSpeedZeroProvider(LayoutProvider):
    """DeepSpeed ZeRO stages 1-3 (and ``BF16_Optimizer``) as a layout provider for ``hf_muon.Muon``."""

    name = NAME
    supported = "plain ZeRO stage 0, 1, 2 or 3 (not ZenFlow, not NVMe optimizer swapping)"

    def shape_of(self, p: Tensor) -> tuple[int, ...] | None:
        return ds_shape(p)

    def check_group(self, group: dict[str, Any]) -> None:
        check_use_muon(group)

    def owns(self, flat: Tensor, matrices: list[Tensor]) -> bool:
        return is_zero_partition(flat, matrices)

    def bind(self, flat: Tensor, matrices: list[Tensor], stacked: bool) -> FlatPartition | None:
        if not is_zero_partition(flat, matrices):
            return None
        return bind_flat_partition(flat, matrices, stacked)

    def load_parameter(self, p: Tensor, whole: Tensor) -> bool:
        return load_parameter(p, whole)


PROVIDER = DeepSpeedZeroProvider()
