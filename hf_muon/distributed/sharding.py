"""Recognise how the tensors ``step()`` is given are distributed, and build their exchange.

Told apart from the tensors themselves: FSDP2 ``DTensor`` parameters sharded on dim 0 (over their
mesh's group); plain tensors while ``torch.distributed`` runs with several ranks (DDP: every rank
holds the same all-reduced gradient; over the default world, or the process group the optimizer was
given); anything else is single-process and needs no exchange. Flat partitions a backend hands over
(DeepSpeed ZeRO) are described by a layout provider (see ``providers``) and use ``exchange_over``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from .exchange import DEFAULT_BUCKET_BYTES, ExchangeStats, orthogonalize_distributed, widest_dtype
from .layout import TensorLayout, replicated, row_sharded, with_blocks
from .plan import PIPELINE_BUCKETS, plan_buckets, plan_exchange


def _dtensor_cls():
    from torch.distributed.tensor import DTensor

    return DTensor


def is_dtensor(t: Tensor) -> bool:
    return dist.is_available() and isinstance(t, _dtensor_cls())


def local(t: Tensor) -> Tensor:
    """This rank's part of ``t`` (the tensor itself unless it is a ``DTensor``)."""
    return t.to_local() if is_dtensor(t) else t


def process_group_of(
    params: list[Tensor], process_group: dist.ProcessGroup | None = None
) -> tuple[dist.ProcessGroup | None, int, int] | None:
    """``(group, rank, world)`` the tensors are spread over, or ``None`` when single-process.

    ``DTensor``s use their mesh's group; replicated tensors use ``process_group`` (default: the
    world)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    sharded = [p for p in params if is_dtensor(p)]
    if sharded:
        from torch.distributed.tensor import Shard

        mesh = sharded[0].device_mesh
        for p in sharded:
            if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
                raise NotImplementedError(
                    f"hf_muon.Muon supports DTensor parameters sharded as (Shard(0),) on a 1-D mesh (FSDP2); "
                    f"got {p.placements} on a {p.device_mesh.ndim}-D mesh"
                )
        if len(sharded) != len(params):
            raise ValueError("a Muon param group mixes DTensor and plain tensors; shard the whole model with FSDP2")
        return mesh.get_group(), mesh.get_local_rank(), mesh.size()
    world = dist.get_world_size(process_group)
    return (process_group, dist.get_rank(process_group), world) if world > 1 else None


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group`` (``None``: the default world)."""
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def layouts_of(params: list[Tensor], stacked: bool | list[bool], world: int) -> list[TensorLayout]:
    """Where each tensor's elements live: row blocks for DTensors, replicated otherwise. ``stacked``:
    whether the tensors (or each tensor) stack independent matrices on their leading dimension."""
    flags = [stacked] * len(params) if isinstance(stacked, bool) else stacked
    return [(row_sharded if is_dtensor(p) else replicated)(tuple(p.shape), s, world) for p, s in zip(params, flags)]


# ``exchange_over``'s ``flops_per_byte`` may be measured rather than given: called with the
# exchange's layouts, group, world and wire bytes per element when the exchange is planned.
MeasuredFlopsPerByte = Callable[[list[TensorLayout], dist.ProcessGroup | None, int, int], float | None]


def wire_itemsize(comm_dtype: torch.dtype | None) -> int:
    """Bytes per element the owner plan counts on the wire: ``comm_dtype``'s, else the fp32 updates'."""
    return comm_dtype.itemsize if comm_dtype is not None else 4


def exchange_over(
    layouts: list[TensorLayout],
    group: dist.ProcessGroup | None,
    rank: int,
    world: int,
    ns_steps: int,
    stats: ExchangeStats,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    comm_dtype: torch.dtype | None = None,
    ns_dtype: torch.dtype = torch.float32,
    overlap: bool = True,
    flops_per_byte: float | MeasuredFlopsPerByte | None = None,
) -> Callable | None:
    """The exchange ``muon_update`` calls for tensors laid out as ``layouts`` over ``group``, or
    ``None`` (each rank orthogonalizes every tensor itself) where every rank holds every tensor whole
    and, by ``flops_per_byte``'s cost model, that is faster (:func:`plan.plan_exchange`).

    ``ns_dtype`` is the Newton–Schulz dtype the owner plan and the buckets cost; it must be the same
    on every rank. ``overlap``: pipeline the buckets (at least ``PIPELINE_BUCKETS`` of them) with
    asynchronous collectives; ``False``: one bucket at a time, as few buckets as ``bucket_bytes`` allows.
    Make an exchange once and call it every step: planning is Python work that grows with
    tensors x ranks (0.3 s for Llama-3-8B's layouts under FSDP2 at 1024 ranks).

    A stacked tensor is exchanged matrix by matrix (see :func:`layout.exchanged_matrices`): each of
    its matrices has its own owner. ``flops_per_byte``: see :func:`plan.assign_owners`, or a
    :data:`MeasuredFlopsPerByte` that measures it (a collective over ``group``: every rank plans at once)."""
    wire = wire_itemsize(comm_dtype)
    if callable(flops_per_byte):
        flops_per_byte = flops_per_byte(layouts, group, world, wire)
    plan = plan_exchange(layouts, world, ns_steps, ns_dtype, wire, bucket_bytes, overlap, flops_per_byte)
    if not plan.pays:
        return None
    items, item_layouts, owners = plan.items, plan.item_layouts, plan.owners
    buckets = {wire: plan.buckets}  # by bytes per element on the wire

    # Where each item's piece lies in this rank's piece of its tensor: fixed, so derived once here.
    cuts = []
    for item in items:
        start, end = item.layout.ranges[rank]
        cuts.append((item.source, item.offset + start - layouts[item.source].ranges[rank][0], max(end - start, 0)))
    items_of: list[list[int]] = [[] for _ in layouts]
    for k, item in enumerate(items):
        items_of[item.source].append(k)

    def item_pieces(pieces: list[Tensor]) -> list[Tensor]:
        """This rank's piece of each item: a view of its piece of the item's tensor."""
        return [pieces[source].narrow(0, where, n) if n else pieces[source][:0] for source, where, n in cuts]

    def source_pieces(out: list[Tensor]) -> list[Tensor]:
        """Each tensor's piece of the result: its items' pieces in order (a copy only for a stack)."""
        return [out[ks[0]] if len(ks) == 1 else torch.cat([out[k] for k in ks]) for ks in items_of]

    def exchange(blended: list[Tensor], newton_schulz: Callable[[list[Tensor], list[int]], list[Tensor]]) -> list[Tensor]:
        """``newton_schulz(wholes, indices)`` sees whole tensors and their indices in ``blended``; a
        stack's matrices come one at a time, each as a stack of one (``[1, rows, cols]``)."""
        size = (comm_dtype or widest_dtype(blended)).itemsize
        if size not in buckets:  # the layouts never change: plan once per wire dtype size
            buckets[size] = plan_buckets(item_layouts, owners, world, ns_steps, size, bucket_bytes,
                                         PIPELINE_BUCKETS if overlap else 1, ns_dtype)

        def items_newton_schulz(wholes: list[Tensor], which: list[int]) -> list[Tensor]:
            stacks = [w.unsqueeze(0) if layouts[items[i].source].stacked else w for w, i in zip(wholes, which)]
            out = newton_schulz(stacks, [items[i].source for i in which])
            return [o.view(w.shape) for o, w in zip(out, wholes)]

        out = orthogonalize_distributed(
            item_pieces([b.reshape(-1) for b in blended]), item_layouts, owners, items_newton_schulz,
            buckets=buckets[size], group=group, rank=rank, world=world, stats=stats, comm_dtype=comm_dtype,
            overlap=overlap,
        )
        return [o.view(b.shape) for o, b in zip(source_pieces(out), blended)]

    return exchange


def make_exchange(
    params: list[Tensor],
    stacked: bool | list[bool],
    ns_steps: int,
    stats: ExchangeStats,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    comm_dtype: torch.dtype | None = None,
    ns_dtype: torch.dtype = torch.float32,
    process_group: dist.ProcessGroup | None = None,
    overlap: bool = True,
    flops_per_byte: float | MeasuredFlopsPerByte | None = None,
    blocks: list[list[tuple[int, int]] | None] | None = None,
) -> Callable | None:
    """The exchange for whole or FSDP2-sharded ``params``, or ``None``: in a single process, or
    where :func:`exchange_over` finds each rank is faster alone (DDP, ``flops_per_byte`` given).

    ``stacked``: for all ``params``, or one flag per tensor (groups of stacked experts and of plain
    matrices share an exchange). Replicated ``params`` are exchanged over ``process_group`` (default:
    the world); ``overlap``, ``flops_per_byte``: see :func:`exchange_over`; ``blocks``: each fused
    projection's block shapes, which its owner orthogonalizes apart (see :func:`layout.with_blocks`)."""
    where = process_group_of(params, process_group)
    if where is None:
        return None
    group, rank, world = where
    return exchange_over(with_blocks(layouts_of(params, stacked, world), blocks), group, rank, world, ns_steps, stats,
                         bucket_bytes, comm_dtype, ns_dtype, overlap, flops_per_byte)


def all_ranks_agree(flag: bool, params: list[Tensor], process_group: dist.ProcessGroup | None = None) -> bool:
    """``flag`` and-ed over the ranks ``params`` are spread over (a no-op in a single process)."""
    where = process_group_of(params, process_group)
    if where is None:
        return flag
    t = torch.tensor([1 if flag else 0], device=local(params[0]).device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=where[0])
    return bool(t.item())
