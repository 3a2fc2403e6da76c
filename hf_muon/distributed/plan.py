"""The owner plan: which rank runs Newton–Schulz on each tensor, balancing FLOPs, not counts.

The cost of a tensor is what the kernel really executes (``TensorLayout.ns_flops``: Gram-aware, in
the Newton–Schulz dtype), so the balance holds for the work each owner actually does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .exchange import ExchangeVolume, exchange_volume
from .layout import ExchangedMatrix, TensorLayout, exchanged_matrices


def assign_owners(layouts: list[TensorLayout], world: int, ns_steps: int,
                  ns_dtype: torch.dtype = torch.float32, flops_per_byte: float | None = None,
                  itemsize: int = 4, overlap: bool = True) -> list[int]:
    """One owner rank per tensor.

    A tensor held whole by exactly one rank stays there (moving it adds traffic; see
    ``flops_per_byte`` for when it pays).
    The rest go, largest cost first, to the least-loaded rank (longest-processing-time greedy),
    preferring on a tie a rank that already holds the whole tensor, then the lowest rank. The
    result depends only on the arguments, so every rank that passes the same ones computes the
    same plan without talking.

    ``flops_per_byte``: Newton–Schulz FLOPs that take as long as one byte on a rank's link (the NS
    FLOP rate over the link bandwidth; ``itemsize`` bytes per element on the wire). When given, a
    tensor held whole by one rank may still move: while the rank with the longest time holds such
    tensors, its largest one whose move to the rank with the shortest time brings both below that
    longest time moves there. A rank's time is its NS FLOPs and ``flops_per_byte`` times its
    exchange bytes (per phase the larger direction, summed over the two phases: pieces and results
    travel in separate collectives), the larger of the two with ``overlap`` (the pipelined
    exchange), their sum without. FSDP2 shards a stack of 8 experts over its first 8 ranks only:
    at 64 ranks those 8 would otherwise run every expert's Newton–Schulz while 56 idle. ``None``:
    never moved.
    """
    if flops_per_byte is not None and not flops_per_byte > 0:
        raise ValueError(f"flops_per_byte must be > 0 (or None), got {flops_per_byte}")
    costs = [layout.ns_flops(ns_steps, ns_dtype) for layout in layouts]
    load = [0.0] * world
    owners = [-1] * len(layouts)
    free, pinned = [], []
    for i, layout in enumerate(layouts):
        holder = layout.sole_holder
        if holder is not None:
            owners[i] = holder
            load[holder] += costs[i]
            pinned.append(i)
        else:
            free.append(i)
    for i in sorted(free, key=lambda i: (-costs[i], i)):
        layout = layouts[i]
        owner = min(range(world), key=lambda r: (load[r], not layout.holds_all(r), r))
        owners[i] = owner
        load[owner] += costs[i]
    if flops_per_byte is not None and world > 1 and pinned:
        _unpin(layouts, owners, load, costs, pinned, world, flops_per_byte * itemsize, overlap)
    return owners


class _Links:
    """Each rank's exchange traffic in elements, by phase. Pieces go to owners in one collective and
    results come back in another, so a rank's link time is the larger direction of each phase, summed."""

    def __init__(self, layouts: list[TensorLayout], owners: list[int], world: int) -> None:
        from .exchange import exchange_volume  # its per-rank byte rules, counted in elements here

        volume = exchange_volume(layouts, owners, world, 1, [list(range(len(layouts)))])
        self.phases = [volume.gather_sent, volume.gather_received, volume.return_sent, volume.return_received]

    def elements(self, r: int, holder: int = 0, owner: int = 0) -> int:
        """Rank ``r``'s link time in elements, with ``holder`` and ``owner`` more elements as the
        holder and as the new owner of a matrix that one rank holds whole."""
        g_out, g_in, r_out, r_in = (phase[r] for phase in self.phases)
        return max(g_out + holder, g_in + owner) + max(r_out + owner, r_in + holder)

    def move(self, holder: int, owner: int, numel: int) -> None:
        """A matrix of ``numel`` elements held whole by ``holder`` is now owned by ``owner``."""
        for phase, rank in zip(self.phases, (holder, owner, owner, holder)):
            phase[rank] += numel


def _rank_time(flops: float, elements: int, flops_per_element: float, overlap: bool) -> float:
    """A rank's time in FLOPs: its Newton–Schulz and its link, overlapped (the larger) or one after the other."""
    parts = (flops, flops_per_element * elements)
    return max(parts) if overlap else sum(parts)


def _unpin(layouts: list[TensorLayout], owners: list[int], load: list[float], costs: list[float],
           pinned: list[int], world: int, flops_per_element: float, overlap: bool) -> None:
    """Move tensors held whole by one rank off the rank with the longest time while that shortens it
    (see :func:`assign_owners`); ``owners`` and ``load`` are updated in place."""
    links = _Links(layouts, owners, world)
    movable: dict[int, list[int]] = {}
    for i in sorted(pinned, key=lambda i: (-costs[i], i)):
        movable.setdefault(owners[i], []).append(i)

    def time(r: int, flops: float = 0.0, holder: int = 0, owner: int = 0) -> float:
        return _rank_time(load[r] + flops, links.elements(r, holder, owner), flops_per_element, overlap)

    while True:
        busiest = max(range(world), key=lambda r: (time(r), -r))
        target = min((r for r in range(world) if r != busiest), key=lambda r: (time(r), r))
        longest = time(busiest)
        # a moved matrix travels whole both ways: to its new owner, and back as the result
        move = next((i for i in movable.get(busiest, ())
                     if max(time(busiest, -costs[i], holder=layouts[i].numel),
                            time(target, costs[i], owner=layouts[i].numel)) < longest), None)
        if move is None:
            return
        movable[busiest].remove(move)
        owners[move] = target
        load[busiest] -= costs[move]
        load[target] += costs[move]
        links.move(busiest, target, layouts[move].numel)


def ns_load(layouts: list[TensorLayout], owners: list[int], world: int, ns_steps: int,
            ns_dtype: torch.dtype = torch.float32) -> list[float]:
    """Newton–Schulz FLOPs each rank runs under ``owners``."""
    load = [0.0] * world
    for layout, owner in zip(layouts, owners):
        load[owner] += layout.ns_flops(ns_steps, ns_dtype)
    return load


# How many buckets the overlapped exchange aims for. With n buckets, bucket k+1's pieces travel while
# bucket k is orthogonalized and bucket k-1's results return, so only the first gather and the last
# scatter (about 1/n of the traffic) are not hidden behind Newton–Schulz. More buckets hide more but
# split each shape's Newton–Schulz batch n ways (one layer in four per bucket at n = 4 on a 4-layer
# model) and add two collectives' latency each: 4 hides 3/4 of the traffic and keeps batches of
# several layers on deeper models.
PIPELINE_BUCKETS = 4


def _split_by_cost(items: list[int], costs: list[float], parts: int) -> list[list[int]]:
    """``items`` cut, in order, into ``parts`` runs of about equal total cost (some may be empty)."""
    total = sum(costs[i] for i in items)
    runs: list[list[int]] = [[] for _ in range(parts)]
    before = 0.0
    for i in items:
        # each item goes to the run its cost midpoint falls in
        middle = (before + costs[i] / 2) / total if total > 0 else 0.0
        runs[min(parts - 1, int(middle * parts))].append(i)
        before += costs[i]
    return runs


def plan_buckets(layouts: list[TensorLayout], owners: list[int], world: int, ns_steps: int, itemsize: int,
                 bucket_bytes: int, min_buckets: int = 1, ns_dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """The exchange's buckets: tensor indices (ascending), processed one bucket after another.

    Each owner's tensors, in layout order (layer by layer), are cut into runs of equal Newton–Schulz
    cost, and bucket ``b`` takes every owner's run ``b``: every bucket then holds about ``1/n`` of each
    owner's work and a similar mix of shapes, so no rank idles while another orthogonalizes, and the
    bytes a bucket moves follow its work. ``n`` is at least ``min_buckets`` (``PIPELINE_BUCKETS`` for
    the overlapped exchange; 1 for the synchronous one: one bucket when everything fits) and grows
    until every bucket's whole tensors (``itemsize`` bytes per element) fit ``bucket_bytes``, or each
    owner's run is a single tensor (a tensor larger than the cap then has a bucket to itself among
    other owners' single tensors). Depends only on its arguments: every rank plans the same buckets.
    """
    if bucket_bytes <= 0 or min_buckets < 1:
        raise ValueError(f"bucket_bytes and min_buckets must be > 0 and >= 1, got {bucket_bytes} and {min_buckets}")
    if not layouts:
        return []
    costs = [layout.ns_flops(ns_steps, ns_dtype) for layout in layouts]
    sizes = [layout.numel * itemsize for layout in layouts]
    per_owner = [[i for i in range(len(layouts)) if owners[i] == r] for r in range(world)]
    most = max(len(mine) for mine in per_owner)
    parts = min(most, max(min_buckets, -(-sum(sizes) // bucket_bytes)))
    while True:
        buckets: list[list[int]] = [[] for _ in range(parts)]
        for mine in per_owner:
            runs = [[i] for i in mine] if parts >= most else _split_by_cost(mine, costs, parts)
            for bucket, run in zip(buckets, runs):
                bucket.extend(run)
        buckets = [sorted(bucket) for bucket in buckets if bucket]
        if parts >= most or all(sum(sizes[i] for i in bucket) <= bucket_bytes for bucket in buckets):
            return buckets
        parts += 1


def exchange_pays(load: list[float], collective_bytes: list[int], flops_per_byte: float,
                  overlap: bool = True) -> bool:
    """Whether an exchange planned as ``load`` (Newton–Schulz FLOPs per rank, :func:`ns_load`) and
    ``collective_bytes`` (``ExchangeVolume.collective_bytes``) beats each rank running all of that
    Newton–Schulz itself, which only ranks that each hold every tensor whole can do (DDP).

    The exchange's time is ``hf-muon plan``'s: the busiest owner's Newton–Schulz and, times
    ``flops_per_byte``, the sum over its collectives of the most bytes one rank moves in each, the
    larger of the two with ``overlap``, their sum without. Under DDP over IB 400G, Llama-3-8B's
    exchange pays at 8 ranks and not at 64."""
    link = flops_per_byte * sum(collective_bytes)
    exchanged = max(max(load), link) if overlap else max(load) + link
    return exchanged < sum(load)


@dataclass(frozen=True)
class ExchangePlan:
    """One exchange planned from its layouts alone, so the same on every rank.

    ``items``: what it moves (:func:`layout.exchanged_matrices`: stacks matrix by matrix);
    ``owners``: an owner rank per item; ``buckets``: item indices per bucket at the planned wire
    width; ``volume``: what that moves per rank; ``pays``: ``False`` where every rank holds every
    tensor whole and, by :func:`exchange_pays`, each rank orthogonalizing everything itself is faster."""

    items: list[ExchangedMatrix]
    owners: list[int]
    buckets: list[list[int]]
    volume: ExchangeVolume
    pays: bool

    @property
    def item_layouts(self) -> list[TensorLayout]:
        return [item.layout for item in self.items]


def plan_exchange(layouts: list[TensorLayout], world: int, ns_steps: int, ns_dtype: torch.dtype, wire_itemsize: int,
                  bucket_bytes: int, overlap: bool = True, flops_per_byte: float | None = None,
                  piece_itemsize: int = 4) -> ExchangePlan:
    """The owners, buckets and volume of an exchange of ``layouts``, and whether it pays: what the
    optimizer runs (``sharding.exchange_over``) and ``hf-muon plan`` costs, from one function.

    ``wire_itemsize``: bytes per element on the wire; ``piece_itemsize``: of the pieces the owners
    assemble (:func:`exchange.exchange_volume`); ``overlap``, ``flops_per_byte``: see
    :func:`assign_owners`."""
    items = exchanged_matrices(layouts)
    item_layouts = [item.layout for item in items]
    owners = assign_owners(item_layouts, world, ns_steps, ns_dtype, flops_per_byte, wire_itemsize, overlap)
    buckets = plan_buckets(item_layouts, owners, world, ns_steps, wire_itemsize, bucket_bytes,
                           PIPELINE_BUCKETS if overlap else 1, ns_dtype)
    volume = exchange_volume(item_layouts, owners, world, wire_itemsize, buckets, piece_itemsize)
    pays = (flops_per_byte is None or world < 2 or not all(layout.everywhere for layout in layouts)
            or exchange_pays(ns_load(item_layouts, owners, world, ns_steps, ns_dtype), volume.collective_bytes,
                             flops_per_byte, overlap))
    return ExchangePlan(items, owners, buckets, volume, pays)
