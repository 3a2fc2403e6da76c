"""Gather each tensor's pieces on its owner, orthogonalize there once, send the pieces back.

Only the Nesterov-blended update travels (momentum never leaves its rank). Tensors are processed
in buckets whose full size stays under ``bucket_bytes``, so the owner's temporary memory is
bounded; each bucket is two ``all_to_all_single`` calls (pieces in, results out), issued by every
rank in the same order. Every rank derives all split sizes from the shared layouts, so nothing
but the data itself is communicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from .layout import TensorLayout

DEFAULT_BUCKET_BYTES = 256 * 2**20


@dataclass
class ExchangeStats:
    """What this rank did, summed over steps: bytes it sent and received, tensors it orthogonalized."""

    bytes_sent: int = 0
    bytes_received: int = 0
    tensors_orthogonalized: int = 0


def _buckets(layouts: list[TensorLayout], itemsize: int, cap: int) -> list[list[int]]:
    buckets, current, size = [], [], 0
    for i, layout in enumerate(layouts):
        nbytes = layout.numel * itemsize
        if current and size + nbytes > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def _span(layout: TensorLayout, rank: int) -> slice:
    start, end = layout.ranges[rank]
    return slice(start, end)


def _length(layout: TensorLayout, rank: int) -> int:
    start, end = layout.ranges[rank]
    return end - start


def _all_to_all(chunks: list[list[Tensor]], recv_sizes: list[int], dtype: torch.dtype, device, group, stats) -> list[Tensor]:
    """Send ``chunks[d]`` (concatenated) to rank ``d``; return what each rank sent here, split by source."""
    send_sizes = [sum(c.numel() for c in per_dest) for per_dest in chunks]
    flat = [c.reshape(-1).to(dtype) for per_dest in chunks for c in per_dest]
    send = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
    recv = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    stats.bytes_sent += send.numel() * send.element_size()
    stats.bytes_received += recv.numel() * recv.element_size()
    return list(recv.split(recv_sizes))


def _gather_bucket(
    bucket: list[int], pieces: list[Tensor], layouts: list[TensorLayout], owners: list[int], *,
    group: dist.ProcessGroup | None, rank: int, world: int, stats: ExchangeStats, dtype: torch.dtype, device,
) -> dict[int, Tensor]:
    """One all-to-all: every piece of the tensors in ``bucket`` travels to its owner. Returns the whole
    tensors (global shapes, the pieces' dtype) this rank owns, by index. The one place a tensor's
    pieces are assembled: the exchange and checkpoints both gather through it."""
    needs_gather = [i for i in bucket if not layouts[i].holds_all(owners[i])]
    send = [[] for _ in range(world)]
    recv_sizes = [0] * world
    for i in needs_gather:
        owner, layout = owners[i], layouts[i]
        if owner != rank and layout.holds(rank):
            send[owner].append(pieces[i])
        if owner == rank:
            for src in range(world):
                if src != rank:
                    recv_sizes[src] += _length(layout, src)
    received = (
        _all_to_all(send, recv_sizes, dtype, device, group, stats)
        if any(layouts[i].holds(r) and r != owners[i] for i in needs_gather for r in range(world))
        else [torch.empty(0, dtype=dtype, device=device)] * world
    )
    offsets = [0] * world
    wholes: dict[int, Tensor] = {}
    for i in bucket:
        if owners[i] != rank:
            continue
        layout = layouts[i]
        if layout.holds_all(rank):
            wholes[i] = pieces[i].reshape(layout.shape)
            continue
        whole = torch.empty(layout.numel, dtype=pieces[i].dtype, device=device)
        for src in range(world):
            span = _span(layout, src)
            if src == rank:
                whole[span] = pieces[i]
            elif span.stop > span.start:
                whole[span] = received[src][offsets[src]: offsets[src] + span.stop - span.start]
                offsets[src] += span.stop - span.start
        wholes[i] = whole.view(layout.shape)
    return wholes


def gather_on_owners(
    pieces: list[Tensor], layouts: list[TensorLayout], owners: list[int], *, group: dist.ProcessGroup | None,
    rank: int, world: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES, stats: ExchangeStats | None = None,
):
    """Yield ``(index, whole tensor)`` for each tensor this rank owns, gathering bucket by bucket
    (so the caller can write each bucket away before the next arrives). Every rank must call it
    with the same ``layouts`` and ``owners`` and run it to the end."""
    stats = stats if stats is not None else ExchangeStats()
    dtype = pieces[0].dtype if pieces else torch.float32
    device = pieces[0].device if pieces else torch.device("cpu")
    for bucket in _buckets(layouts, torch.empty(0, dtype=dtype).element_size(), bucket_bytes):
        yield from _gather_bucket(bucket, pieces, layouts, owners, group=group, rank=rank, world=world,
                                  stats=stats, dtype=dtype, device=device).items()


def orthogonalize_distributed(
    pieces: list[Tensor],
    layouts: list[TensorLayout],
    owners: list[int],
    orthogonalize_fn: Callable[[list[Tensor], list[int]], list[Tensor]],
    *,
    group: dist.ProcessGroup | None,
    rank: int,
    world: int,
    stats: ExchangeStats,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    comm_dtype: torch.dtype | None = None,
) -> list[Tensor]:
    """Orthogonalize tensors whose pieces are spread over ranks; return this rank's piece of each result.

    Args:
        pieces: this rank's flat piece of each tensor (``layouts[i].ranges[rank]`` long, maybe empty).
        layouts, owners: the same lists on every rank.
        orthogonalize_fn: maps whole tensors (global shapes) and their indices in ``pieces`` to their
            orthogonalized updates (the indices say which tensor each is: fused ones are cut in blocks).
        comm_dtype: dtype on the wire (e.g. ``torch.bfloat16`` halves traffic); default: the pieces'.
    """
    dtype = comm_dtype or (pieces[0].dtype if pieces else torch.float32)
    device = pieces[0].device if pieces else torch.device("cpu")
    results: list[Tensor | None] = [None] * len(pieces)
    for bucket in _buckets(layouts, torch.empty(0, dtype=dtype).element_size(), bucket_bytes):
        # 1. pieces -> owners (an owner that already holds all of a tensor needs nothing)
        wholes = _gather_bucket(bucket, pieces, layouts, owners, group=group, rank=rank, world=world,
                                stats=stats, dtype=dtype, device=device)
        owned = list(wholes)
        # 2. one Newton–Schulz per owned tensor (batched by shape inside orthogonalize_fn)
        ortho = dict(zip(owned, orthogonalize_fn([wholes[i] for i in owned], owned))) if owned else {}
        stats.tensors_orthogonalized += len(owned)
        # 3. results -> every rank that holds a piece
        send = [[] for _ in range(world)]
        recv_sizes = [0] * world
        for i in bucket:
            owner, layout = owners[i], layouts[i]
            if owner == rank:
                flat = ortho[i].reshape(-1)
                for dst in range(world):
                    if dst != rank and layout.holds(dst):
                        send[dst].append(flat[_span(layout, dst)])
                results[i] = flat[_span(layout, rank)]
            elif layout.holds(rank):
                recv_sizes[owner] += _length(layout, rank)
        if any(layouts[i].holds(r) and r != owners[i] for i in bucket for r in range(world)):
            received = _all_to_all(send, recv_sizes, dtype, device, group, stats)
            offsets = [0] * world
            for i in bucket:
                owner, layout = owners[i], layouts[i]
                if owner != rank and layout.holds(rank):
                    n = _length(layout, rank)
                    results[i] = received[owner][offsets[owner]: offsets[owner] + n]
                    offsets[owner] += n
    return [r if r is not None else torch.empty(0, dtype=dtype, device=device) for r in results]


@dataclass
class ExchangeVolume:
    """What :func:`orthogonalize_distributed` moves per step, per rank, without running it.

    ``bytes_sent``/``bytes_received``: per rank, what its ``ExchangeStats`` would add in one step.
    ``collective_bytes``: per ``all_to_all_single`` call, in issue order, the most any one rank sends
    or receives in it (the slowest rank sets the call's time). ``peak_buffer_bytes``: per rank, the
    largest sum over one bucket of the buffers the exchange allocates (send/receive buffers, the
    owner's assembled tensors and its results): the owner's temporary memory."""

    bytes_sent: list[int]
    bytes_received: list[int]
    collective_bytes: list[int]
    peak_buffer_bytes: list[int]
    buckets: int


def exchange_volume(layouts: list[TensorLayout], owners: list[int], world: int, comm_itemsize: int,
                    piece_itemsize: int = 4, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> ExchangeVolume:
    """Sizes per rank of one :func:`orthogonalize_distributed` call, from the layouts and owners alone.

    Follows the exchange's own rules: the same buckets (``_buckets`` at ``comm_itemsize``), a gather
    only for tensors whose owner lacks some of them, results sent back to every other holder, and a
    collective only where some rank other than the owner holds a piece. Pure arithmetic (numpy over
    ranks), so it runs for thousands of ranks; tests check it against ``ExchangeStats``."""
    import numpy as np

    if len(owners) != len(layouts):
        raise ValueError(f"{len(owners)} owners for {len(layouts)} layouts")
    sent, received = np.zeros(world, dtype=np.int64), np.zeros(world, dtype=np.int64)
    peak = np.zeros(world, dtype=np.int64)
    collectives: list[int] = []
    buckets = _buckets(layouts, comm_itemsize, bucket_bytes)
    for bucket in buckets:
        gather_out, gather_in = np.zeros(world, dtype=np.int64), np.zeros(world, dtype=np.int64)
        back_out, back_in = np.zeros(world, dtype=np.int64), np.zeros(world, dtype=np.int64)
        owned = np.zeros(world, dtype=np.int64)  # elements of whole tensors the owner allocates
        gathers = returns = False
        for i in bucket:
            layout, owner = layouts[i], owners[i]
            lengths = np.fromiter((end - start for start, end in layout.ranges), dtype=np.int64, count=world)
            others = lengths.copy()
            others[owner] = 0
            elsewhere = int(others.sum())
            if elsewhere == 0:
                continue  # held by its owner alone: no traffic
            returns = True
            back_in += others
            back_out[owner] += elsewhere
            owned[owner] += layout.numel  # the orthogonalized result
            if not layout.holds_all(owner):
                gathers = True
                gather_out += others
                gather_in[owner] += elsewhere
                owned[owner] += layout.numel  # the assembled whole
        for used, out, into in ((gathers, gather_out, gather_in), (returns, back_out, back_in)):
            if used:
                collectives.append(int(np.maximum(out, into).max()) * comm_itemsize)
                sent += out * comm_itemsize
                received += into * comm_itemsize
        bucket_buffers = (gather_out + gather_in + back_out + back_in) * comm_itemsize + owned * piece_itemsize
        peak = np.maximum(peak, bucket_buffers)
    return ExchangeVolume(sent.tolist(), received.tolist(), collectives, peak.tolist(), len(buckets))
