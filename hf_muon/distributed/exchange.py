"""Gather each tensor's pieces on its owner, orthogonalize there once, send the pieces back.

Only the Nesterov-blended update travels (momentum never leaves its rank). Tensors are processed
in buckets (``plan.plan_buckets``) whose whole size stays under ``bucket_bytes``, so the owner's
temporary memory is bounded; each bucket is two ``all_to_all_single`` calls (pieces in, results
out), issued by every rank in the same order. Every rank derives all split sizes from the shared
layouts, so nothing but the data itself is communicated.

Overlapped (the default), the buckets form a pipeline of asynchronous collectives: bucket k+1's
pieces travel while bucket k is orthogonalized and bucket k-1's results return, so at most three
buckets are in flight. Synchronous, each bucket's pieces go out, are orthogonalized and come back
before the next bucket starts. Both run the same collectives on the same data in the same order;
only when each is waited for differs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from .layout import TensorLayout

DEFAULT_BUCKET_BYTES = 256 * 2**20


@dataclass
class ExchangeStats:
    """What this rank did, summed over steps: bytes it sent and received, tensors it orthogonalized
    (each matrix of a stacked tensor counts as one: the exchange moves and assigns them one by one)."""

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


class _Transfer:
    """One ``all_to_all_single``, issued and maybe still in flight. Holds its buffers until waited for
    (an asynchronous collective reads and writes them meanwhile)."""

    def __init__(self, work: dist.Work | None, send: Tensor, recv: Tensor, recv_sizes: list[int]) -> None:
        self._work, self._send, self._recv, self._recv_sizes = work, send, recv, recv_sizes

    def wait(self) -> list[Tensor]:
        """What each rank sent here, split by source (blocks until it has arrived)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._send = None  # the send buffer may go once the collective is done
        return list(self._recv.split(self._recv_sizes))


def widest_dtype(tensors: list[Tensor]) -> torch.dtype:
    """The wire dtype when none is asked for: the widest of the tensors' (float32 if none), so an fp32
    update never travels in the bf16 of a neighbour."""
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors), tensors[0].dtype) if tensors \
        else torch.float32


def _start_all_to_all(chunks: list[list[Tensor]], recv_sizes: list[int], dtype: torch.dtype, device, group,
                      stats: ExchangeStats, async_op: bool) -> _Transfer:
    """Send ``chunks[d]`` (concatenated) to rank ``d``; what each rank sends here arrives in the transfer."""
    send_sizes = [sum(c.numel() for c in per_dest) for per_dest in chunks]
    flat = [c.reshape(-1).to(dtype) for per_dest in chunks for c in per_dest]
    send = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
    recv = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group, async_op=async_op)
    stats.bytes_sent += send.numel() * send.element_size()
    stats.bytes_received += recv.numel() * recv.element_size()
    return _Transfer(work if async_op else None, send, recv, recv_sizes)


def _nothing_received(world: int, dtype: torch.dtype, device) -> _Transfer:
    """The transfer of a bucket no rank has to send anything for: no collective at all."""
    return _Transfer(None, torch.empty(0, dtype=dtype, device=device), torch.empty(0, dtype=dtype, device=device),
                     [0] * world)


def _travels(layouts: list[TensorLayout], owners: list[int], bucket: list[int], world: int) -> bool:
    """Whether some rank holds a piece of a tensor in ``bucket`` that it does not own. Read from the
    shared layouts, so every rank agrees whether the bucket's collective runs."""
    return any(layouts[i].holds(r) and r != owners[i] for i in bucket for r in range(world))


def _start_gather(
    bucket: list[int], pieces: list[Tensor], layouts: list[TensorLayout], owners: list[int], *,
    group: dist.ProcessGroup | None, rank: int, world: int, stats: ExchangeStats, dtype: torch.dtype, device,
    async_op: bool = False,
) -> _Transfer:
    """Send every piece of the tensors in ``bucket`` to its owner (an owner that already holds all of a
    tensor needs nothing)."""
    send: list[list[Tensor]] = [[] for _ in range(world)]
    recv_sizes = [0] * world
    for i in bucket:
        owner, layout = owners[i], layouts[i]
        if layout.holds_all(owner):
            continue
        if owner != rank and layout.holds(rank):
            send[owner].append(pieces[i])
        if owner == rank:
            for src in range(world):
                if src != rank:
                    recv_sizes[src] += _length(layout, src)
    if not _travels(layouts, owners, [i for i in bucket if not layouts[i].holds_all(owners[i])], world):
        return _nothing_received(world, dtype, device)
    return _start_all_to_all(send, recv_sizes, dtype, device, group, stats, async_op)


def _assemble(bucket: list[int], pieces: list[Tensor], layouts: list[TensorLayout], owners: list[int],
              received: list[Tensor], *, rank: int, world: int, device) -> dict[int, Tensor]:
    """The whole tensors (global shapes, the pieces' dtype) this rank owns in ``bucket``, by index, from
    its own pieces and ``received`` (the bucket's gather, by source rank). The one place a tensor's
    pieces are put together: the exchange and checkpoints both go through it."""
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


def _gather_bucket(
    bucket: list[int], pieces: list[Tensor], layouts: list[TensorLayout], owners: list[int], *,
    group: dist.ProcessGroup | None, rank: int, world: int, stats: ExchangeStats, dtype: torch.dtype, device,
) -> dict[int, Tensor]:
    """One blocking all-to-all: every piece of the tensors in ``bucket`` travels to its owner. Returns
    the whole tensors this rank owns, by index (see :func:`_assemble`)."""
    transfer = _start_gather(bucket, pieces, layouts, owners, group=group, rank=rank, world=world, stats=stats,
                             dtype=dtype, device=device)
    return _assemble(bucket, pieces, layouts, owners, transfer.wait(), rank=rank, world=world, device=device)


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


def _start_scatter(
    bucket: list[int], ortho: dict[int, Tensor], layouts: list[TensorLayout], owners: list[int],
    results: list[Tensor | None], *, group: dist.ProcessGroup | None, rank: int, world: int, stats: ExchangeStats,
    dtype: torch.dtype, device, async_op: bool,
) -> _Transfer:
    """Send each orthogonalized tensor this rank owns in ``bucket`` (``ortho``) in pieces to every
    other rank that holds a piece, and keep this rank's own piece in ``results``."""
    send: list[list[Tensor]] = [[] for _ in range(world)]
    recv_sizes = [0] * world
    for i in bucket:
        owner, layout = owners[i], layouts[i]
        if owner == rank:
            flat = ortho[i].reshape(-1)
            for dst in range(world):
                if dst != rank and layout.holds(dst):
                    send[dst].append(flat[_span(layout, dst)])
            # through the wire dtype as the other ranks get theirs: every rank applies the same bits
            results[i] = flat[_span(layout, rank)].to(dtype)
        elif layout.holds(rank):
            recv_sizes[owner] += _length(layout, rank)
    if not _travels(layouts, owners, bucket, world):
        return _nothing_received(world, dtype, device)
    return _start_all_to_all(send, recv_sizes, dtype, device, group, stats, async_op)


def _finish_scatter(bucket: list[int], transfer: _Transfer, layouts: list[TensorLayout], owners: list[int],
                    results: list[Tensor | None], rank: int) -> None:
    """Wait for ``bucket``'s results and put this rank's pieces of the tensors others own in ``results``."""
    received = transfer.wait()
    offsets = [0] * len(received)
    for i in bucket:
        owner, layout = owners[i], layouts[i]
        if owner != rank and layout.holds(rank):
            n = _length(layout, rank)
            results[i] = received[owner][offsets[owner]: offsets[owner] + n]
            offsets[owner] += n


def _wait_quietly(transfers: list[_Transfer | None]) -> None:
    """After a failure: let the collectives this rank already issued finish before their buffers go.
    Every other rank issues them too (the order is the same everywhere), or fails and exits, which
    ends them with an error; either way the wait ends (at the latest at the group's timeout). Their
    own errors are dropped: the first failure is the one to report."""
    for transfer in transfers:
        if transfer is not None:
            try:
                transfer.wait()
            except Exception:  # noqa: BLE001 - secondary to the error being raised
                pass


def orthogonalize_distributed(
    pieces: list[Tensor],
    layouts: list[TensorLayout],
    owners: list[int],
    orthogonalize_fn: Callable[[list[Tensor], list[int]], list[Tensor]],
    *,
    buckets: list[list[int]],
    group: dist.ProcessGroup | None,
    rank: int,
    world: int,
    stats: ExchangeStats,
    comm_dtype: torch.dtype | None = None,
    overlap: bool = True,
) -> list[Tensor]:
    """Orthogonalize tensors whose pieces are spread over ranks; return this rank's piece of each result.

    Args:
        pieces: this rank's flat piece of each tensor (``layouts[i].ranges[rank]`` long, maybe empty).
        layouts, owners, buckets: the same lists on every rank (``buckets``: from ``plan.plan_buckets``).
        orthogonalize_fn: maps whole tensors (global shapes) and their indices in ``pieces`` to their
            orthogonalized updates (the indices say which tensor each is: fused ones are cut in blocks).
        comm_dtype: dtype on the wire (e.g. ``torch.bfloat16`` halves traffic); default: the widest of the
            pieces' (:func:`widest_dtype`). Each rank's results, the owner's too, are in it.
        overlap: pipeline the buckets with asynchronous collectives (bucket k+1's pieces travel while
            bucket k is orthogonalized and bucket k-1's results return); ``False``: one bucket at a
            time, each collective waited for at once. The results are the same bit for bit.

    If ``orthogonalize_fn`` raises, the collectives already issued are waited for and the error
    propagates; the other ranks' next collective then fails when this process exits (or at the
    group's timeout), as in the synchronous exchange.
    """
    dtype = comm_dtype or widest_dtype(pieces)
    device = pieces[0].device if pieces else torch.device("cpu")
    results: list[Tensor | None] = [None] * len(pieces)
    where = dict(group=group, rank=rank, world=world, stats=stats, dtype=dtype, device=device, async_op=overlap)

    def gather(k: int) -> _Transfer | None:
        return _start_gather(buckets[k], pieces, layouts, owners, **where) if k < len(buckets) else None

    # In flight while bucket k is orthogonalized: bucket k+1's gather and bucket k-1's scatter (with
    # bucket k's wholes, three buckets' worth of buffers). Issue order, the same on every rank:
    # gather 0 | gather 1, scatter 0 | gather 2, scatter 1 | ... (synchronous: gather k, scatter k).
    incoming = gather(0) if overlap else None
    returning: tuple[list[int], _Transfer] | None = None
    try:
        for k, bucket in enumerate(buckets):
            if not overlap:
                incoming = gather(k)
            received = incoming.wait()
            incoming = gather(k + 1) if overlap else None
            wholes = _assemble(bucket, pieces, layouts, owners, received, rank=rank, world=world, device=device)
            del received
            owned = list(wholes)
            ortho = dict(zip(owned, orthogonalize_fn([wholes[i] for i in owned], owned))) if owned else {}
            del wholes
            stats.tensors_orthogonalized += len(owned)
            scatter = _start_scatter(bucket, ortho, layouts, owners, results, **where)
            if returning is not None:
                _finish_scatter(*returning, layouts, owners, results, rank)
            returning = (bucket, scatter)
            if not overlap:
                _finish_scatter(*returning, layouts, owners, results, rank)
                returning = None
        if returning is not None:
            _finish_scatter(*returning, layouts, owners, results, rank)
            returning = None
    except Exception:  # Ctrl-C does not wait
        _wait_quietly([incoming, returning[1] if returning is not None else None])
        raise
    return [r if r is not None else torch.empty(0, dtype=dtype, device=device) for r in results]


@dataclass
class ExchangeVolume:
    """What :func:`orthogonalize_distributed` moves per step, per rank, without running it.

    ``bytes_sent``/``bytes_received``: per rank, what its ``ExchangeStats`` would add in one step.
    ``collective_bytes``: per ``all_to_all_single`` call, in issue order, the most any one rank sends
    or receives in it (the slowest rank sets the call's time). ``peak_buffer_bytes``: per rank, the
    largest sum over one bucket of the buffers the exchange allocates (send/receive buffers, the
    owner's assembled tensors and its results): the owner's temporary memory. ``gather_sent``,
    ``gather_received``, ``return_sent``, ``return_received``: per rank, ``bytes_sent`` and
    ``bytes_received`` split by phase (pieces to owners, results back), which are separate calls."""

    bytes_sent: list[int]
    bytes_received: list[int]
    collective_bytes: list[int]
    peak_buffer_bytes: list[int]
    buckets: int
    gather_sent: list[int]
    gather_received: list[int]
    return_sent: list[int]
    return_received: list[int]


def exchange_volume(layouts: list[TensorLayout], owners: list[int], world: int, comm_itemsize: int,
                    buckets: list[list[int]], piece_itemsize: int = 4) -> ExchangeVolume:
    """Sizes per rank of one :func:`orthogonalize_distributed` call, from the layouts and owners alone.

    Follows the exchange's own rules: the same ``buckets`` (``plan.plan_buckets``), a gather
    only for tensors whose owner lacks some of them, results sent back to every other holder, and a
    collective only where some rank other than the owner holds a piece. Pure arithmetic (numpy over
    ranks), so it runs for thousands of ranks; tests check it against ``ExchangeStats``."""
    import numpy as np

    if len(owners) != len(layouts):
        raise ValueError(f"{len(owners)} owners for {len(layouts)} layouts")
    sent, received = np.zeros(world, dtype=np.int64), np.zeros(world, dtype=np.int64)
    phases = np.zeros((4, world), dtype=np.int64)  # gather out, gather in, return out, return in
    peak = np.zeros(world, dtype=np.int64)
    collectives: list[int] = []
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
        phases += np.stack([gather_out, gather_in, back_out, back_in]) * comm_itemsize
        bucket_buffers = (gather_out + gather_in + back_out + back_in) * comm_itemsize + owned * piece_itemsize
        peak = np.maximum(peak, bucket_buffers)
    return ExchangeVolume(sent.tolist(), received.tolist(), collectives, peak.tolist(), len(buckets), *phases.tolist())
