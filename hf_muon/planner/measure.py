"""This machine's rates for the ``cpu`` preset, measured at plan time on the plan's own products.

The matmul rate is what ``torch.bmm`` achieves on the very ``(m, k, n)`` products Newton–Schulz
executes for the plan's shapes (batched as the optimizer batches same-shape matrices), so a
one-process prediction can be checked against ``hf-muon bench``'s figure 1 on the same machine.
The timing itself is ``hf_muon.distributed.rates``', which ``Muon(exchange_flops_per_byte="auto")``
uses at the first step.
"""

from __future__ import annotations

import time

import torch

from ..distributed.rates import all_to_all_seconds, best_seconds, matmul_rate
from .presets import Accelerator


def memory_bandwidth(elements: int = 2**25, repeats: int = 5) -> float:
    """Bytes/s of an fp32 ``a += b`` over ``elements`` (128 MiB per tensor: past the caches), counting
    two reads and one write per element, as the optimizer's element-wise updates move memory."""
    a, b = torch.ones(elements), torch.ones(elements)
    return 3 * 4 * elements / best_seconds(lambda: a.add_(b), repeats)


def measure_cpu(shapes: list[tuple[int, int]], steps: int, dtype: torch.dtype, threads: int | None = None) -> Accelerator:
    """The ``cpu`` accelerator: matmul rate on ``shapes``' products in ``dtype`` (stored for both dtypes'
    fields: a plan reads only its Newton–Schulz dtype's) and memory bandwidth, both measured now with
    ``threads`` threads (default: torch's current number)."""
    previous = torch.get_num_threads()
    threads = threads or previous
    torch.set_num_threads(threads)
    try:
        rate, bandwidth = matmul_rate(shapes, steps, dtype), memory_bandwidth()
    finally:
        torch.set_num_threads(previous)
    name = (f"cpu (measured, {threads} thread{'s' if threads > 1 else ''}: {rate / 1e9:.0f} GFLOP/s "
            f"{str(dtype).replace('torch.', '')})")
    return Accelerator(name, rate, rate, bandwidth, 0.0, measured=True)


def _loopback_worker(rank: int, world: int, store_path: str, sizes: list[int], repeats: int, out_path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        seconds = []
        for size in sizes:  # elements of fp32 sent to each other rank, as the exchange's all-to-all does
            seconds.append(all_to_all_seconds(size, torch.float32, repeats=repeats))
        if rank == 0:
            torch.save(seconds, out_path)
    finally:
        dist.destroy_process_group()


def measure_loopback(timeout_s: float = 120.0) -> tuple[float, float]:
    """``(bytes/s, seconds per call)`` of a 2-process gloo ``all_to_all_single`` on this machine: the
    link a CPU run of the exchange (``torchrun --nproc_per_node 2``) crosses. Bandwidth from a 32 MiB
    exchange per rank, latency from an 8-byte one."""
    import os
    import tempfile

    import torch.multiprocessing as mp

    small, big = 2, 2**23  # fp32 elements per peer
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "seconds.pt")
        context = mp.start_processes(_loopback_worker, args=(2, store, [small, big], 5, out), nprocs=2,
                                     join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise RuntimeError(f"measuring the gloo loopback link took over {timeout_s:.0f} s; "
                                   "give --link_gbs and --latency_us instead")
        latency, big_s = torch.load(out)
    return 4 * big / max(big_s - latency, 1e-9), latency
