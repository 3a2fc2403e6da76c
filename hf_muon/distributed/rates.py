"""The two rates the owner plan weighs: Newton–Schulz FLOP/s and all-to-all bytes/s.

``Muon(exchange_flops_per_byte="auto")`` measures both at the first step, on the plan's own
products and over the exchange's own process group, and every rank takes the slowest rank's
timings, so all ranks compute the same ratio and hence the same owner plan. ``hf-muon plan``'s
``cpu`` preset times the same products (``matmul_rate``) and the same collective.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..kernels.newton_schulz import ns_matmuls, resolve_method
from .layout import TensorLayout, exchanged_matrices
from .sharding import group_ranks

_MAX_BATCH = 8  # enough matrices per bmm to time batched throughput; more only takes longer
_BATCH_FLOPS = 2e9  # above this a batch is already long enough to time; larger ones take one matrix


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued kernels (nothing to wait for on a CPU), so a clock read after it
    times the work, not the launch."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def best_seconds(fn: Callable[[], object], repeats: int, device: torch.device | str = "cpu",
                 before: Callable[[], object] | None = None, collective: bool = False) -> float:
    """The shortest of ``repeats`` timed calls of ``fn`` after one untimed warm-up (first-call
    allocation, kernel selection, connection set-up), each preceded by ``before`` (untimed). A call
    whose warm-up took over half a second is timed once, unless it is a ``collective``: then every
    rank must make the same calls, whatever its own clock said."""
    device = torch.device(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    if not collective and time.perf_counter() - start > 0.5:
        repeats = 1  # a call this long is timed once more: first-call costs are small beside it
    best = float("inf")
    for _ in range(repeats):
        if before is not None:
            before()
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def ns_products(shapes: list[tuple[int, int]], steps: int, dtype: torch.dtype) -> Counter[tuple[int, int, int]]:
    """How often each product ``(m, k, n)`` occurs in the Newton–Schulz runs of ``shapes``."""
    products: Counter[tuple[int, int, int]] = Counter()
    for (rows, cols), count in Counter(shapes).items():
        for mkn in ns_matmuls(rows, cols, steps, resolve_method(rows, cols, steps, dtype), dtype):
            products[mkn] += count
    return products


def products_seconds(products: Counter[tuple[int, int, int]], dtype: torch.dtype, device: torch.device | str = "cpu",
                     repeats: int = 3) -> tuple[float, float]:
    """``(FLOPs, seconds)`` of ``products`` on ``device``: each distinct product timed batched (up to
    8 matrices, the count weighting the rest) with ``torch.bmm``."""
    gen = torch.Generator().manual_seed(0)
    flops = seconds = 0.0
    for (m, k, n), count in products.items():
        batch = max(1, min(count, _MAX_BATCH, int(_BATCH_FLOPS // (2 * m * k * n))))
        x = torch.randn(batch, m, k, generator=gen).to(device, dtype)
        y = torch.randn(batch, k, n, generator=gen).to(device, dtype)
        out = torch.empty(batch, m, n, dtype=dtype, device=device)
        per_matrix = best_seconds(lambda: torch.bmm(x, y, out=out), repeats, device) / batch
        flops += count * 2 * m * k * n
        seconds += count * per_matrix
    return flops, seconds


def matmul_rate(shapes: list[tuple[int, int]], steps: int, dtype: torch.dtype, repeats: int = 3,
                device: torch.device | str = "cpu") -> float:
    """FLOP/s of ``device`` on the Newton–Schulz products of ``shapes`` (``(rows, cols)``, with
    repeats) in ``dtype``: the products' total FLOPs over their total time."""
    if not shapes:
        raise ValueError("no shapes to measure the matmul rate on")
    flops, seconds = products_seconds(ns_products(shapes, steps, dtype), dtype, device, repeats)
    return flops / seconds


def all_to_all_seconds(elements_per_peer: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                       group: dist.ProcessGroup | None = None, repeats: int = 5) -> float:
    """The shortest time of an ``all_to_all_single`` in which every rank of ``group`` sends
    ``elements_per_peer`` elements of ``dtype`` to each rank, as the exchange's collectives do; the
    ranks start each call together (a barrier). Every rank of ``group`` must call it."""
    world = dist.get_world_size(group)
    send = torch.ones(elements_per_peer * world, dtype=dtype, device=device)
    recv = torch.empty_like(send)
    return best_seconds(lambda: dist.all_to_all_single(recv, send, group=group), repeats, device,
                        before=lambda: dist.barrier(group=group), collective=True)


@dataclass(frozen=True)
class LinkRates:
    """What ``Muon(exchange_flops_per_byte="auto")`` measured over one process group: the slowest
    rank's Newton–Schulz rate on the plan's products and the all-to-all bytes per second one rank
    moves (sends, and receives as much), for ``ranks`` (global ranks)."""

    ranks: tuple[int, ...]
    ns_dtype: torch.dtype
    wire_itemsize: int
    ns_flops_per_s: float
    link_bytes_per_s: float

    @property
    def flops_per_byte(self) -> float:
        """Newton–Schulz FLOPs that take as long as one byte on the link: the owner plan's ratio."""
        return self.ns_flops_per_s / self.link_bytes_per_s


def measure_link_rates(layouts: list[TensorLayout], group: dist.ProcessGroup | None, world: int, ns_steps: int,
                       ns_dtype: torch.dtype, wire_itemsize: int, bucket_bytes: int,
                       device: torch.device | str) -> LinkRates:
    """Time the Newton–Schulz products of ``layouts``' matrices (each stacked matrix on its own)
    in ``ns_dtype`` on ``device``, and an all-to-all over ``group`` in which each rank sends one
    bucket (``bucket_bytes``, at most 64 MiB) of ``wire_itemsize``-byte elements, then take the
    largest of each time over the ranks (one all-reduce), so that every rank gets the same rates.
    A collective: every rank of ``group`` calls it at the same point, with the same arguments."""
    if world < 2:
        raise ValueError(f"measuring a link needs at least 2 ranks, got {world}")
    device = torch.device(device)
    shapes = [shape for item in exchanged_matrices(layouts) for shape in item.layout.ns_matrices]
    if not shapes:
        raise ValueError("no matrices to measure Newton–Schulz on")
    flops, ns_s = products_seconds(ns_products(shapes, ns_steps, ns_dtype), ns_dtype, device)
    wire_dtype = {2: torch.bfloat16, 4: torch.float32}.get(wire_itemsize)
    if wire_dtype is None:
        raise ValueError(f"no wire dtype of {wire_itemsize} bytes per element (2 or 4)")
    per_peer = max(1, min(bucket_bytes, 64 * 2**20) // wire_itemsize // world)
    link_s = all_to_all_seconds(per_peer, wire_dtype, device, group)
    slowest = torch.tensor([ns_s, link_s], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    ns_s, link_s = slowest.tolist()
    moved = per_peer * (world - 1) * wire_itemsize  # the chunk a rank sends itself never leaves it
    return LinkRates(tuple(group_ranks(group)), ns_dtype, wire_itemsize,
                     flops / ns_s, moved / link_s)
