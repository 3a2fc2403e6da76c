"""Scale the output features of model parameters in the tensors an optimizer updates, wherever their
pieces live: a plain tensor (one process, DDP), an FSDP2 ``DTensor`` sharded ``Shard(0)`` on a 1-D
mesh, or DeepSpeed ZeRO's flat fp32 partitions that :class:`hf_muon.Muon` was handed.

Used after a step (QK-clip rescales query and key heads). Only the tensors in the optimizer's
*current* ``param_groups`` are touched: DeepSpeed ZeRO-1/2 calls ``step()`` once per group with
``param_groups`` narrowed to it (and copies that group's fp32 partition into the model right after),
ZeRO-3 once per sub-group with one flat tensor. The caller learns which parameters were reached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..distributed.layout import row_sharded
from ..distributed.providers import FlatPartition
from ..distributed.sharding import is_dtensor


@dataclass(frozen=True)
class FeatureScaling:
    """Multiply output feature ``j`` of model parameter ``param`` by ``factors[j]``.

    ``axis`` is the axis of the whole tensor that indexes output features: 0 for an ``nn.Linear``
    weight or any bias, 1 for a transformers ``Conv1D`` weight (``[in, out]``)."""

    param: Tensor
    factors: Tensor
    axis: int


def _scale_whole(t: Tensor, factors: Tensor, axis: int) -> None:
    shape = [1] * t.ndim
    shape[axis] = t.shape[axis]
    t.mul_(factors.to(t.dtype).view(shape))


def _scale_piece(piece: Tensor, start: int, shape: tuple[int, ...], factors: Tensor, axis: int) -> None:
    """``piece`` holds elements ``[start, start + len)`` of the flattened whole tensor of ``shape``."""
    if piece.numel() == 0:
        return
    inner = math.prod(shape[axis + 1:])
    index = torch.arange(start, start + piece.numel(), device=piece.device)
    feature = torch.div(index, inner, rounding_mode="floor") % shape[axis]
    piece.mul_(factors.to(device=piece.device, dtype=piece.dtype)[feature])


def _scale_dtensor(p: Tensor, factors: Tensor, axis: int) -> None:
    from torch.distributed.tensor import Shard

    if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
        raise NotImplementedError(f"scaling output features supports DTensors sharded (Shard(0),) on a 1-D mesh "
                                  f"(FSDP2); got {p.placements} on a {p.device_mesh.ndim}-D mesh")
    shard = p.to_local()
    layout = row_sharded(tuple(p.shape), False, p.device_mesh.size())
    start, _ = layout.ranges[p.device_mesh.get_local_rank()]
    _scale_piece(shard.view(-1), start, tuple(p.shape), factors, axis)


def _bound_partitions(optimizer) -> dict[int, FlatPartition]:
    """id(flat) -> partition, for the backend flats hf_muon.Muon has bound (both of its halves)."""
    return {id(flat): part for flat, part in getattr(optimizer, "_partitions", {}).values()}


@torch.no_grad()
def scale_output_features(optimizer: torch.optim.Optimizer, scalings: list[FeatureScaling]) -> set[int]:
    """Apply each of ``scalings`` to the pieces of its parameter that ``optimizer.param_groups`` hold now.

    Returns ``id(scaling.param)`` of the scalings reached: wholly scaled (a plain or ``DTensor``
    parameter in a group), or present in a flat partition in a group (scaled where this rank holds
    elements of it; a ZeRO rank may hold none). A backend flat hf_muon.Muon has not bound yet is
    not readable: the parameters in it are simply not reached (the caller decides what that means).
    """
    wanted = {id(s.param): s for s in scalings}
    partitions = _bound_partitions(optimizer)
    reached: set[int] = set()
    for group in optimizer.param_groups:
        for t in group["params"]:
            if id(t) in wanted:
                s = wanted[id(t)]
                if is_dtensor(t):
                    _scale_dtensor(t, s.factors, s.axis)
                else:
                    _scale_whole(t.data, s.factors, s.axis)
                reached.add(id(t))
            elif id(t) in partitions:
                part = partitions[id(t)]
                for p, (offset, length), layout in zip(part.params, part.spans, part.layouts):
                    s = wanted.get(id(p))
                    if s is None:
                        continue
                    start, end = layout.ranges[part.rank]
                    if end - start != length:
                        raise RuntimeError(f"{part.backend}: a piece of {length} elements where the layout says "
                                           f"{end - start}; the partition bookkeeping is inconsistent")
                    _scale_piece(t.data.narrow(0, offset, length), start, layout.shape, s.factors, s.axis)
                    reached.add(id(p))
    return reached
