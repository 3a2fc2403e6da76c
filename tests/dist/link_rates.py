"""Run under ``torchrun --nproc_per_node W``: ``measure_link_rates`` with ranks that arrive apart.

    torchrun --nproc_per_node 2 tests/dist/link_rates.py --late_s 1 --out rates.json

Rank 1 starts ``--late_s`` seconds after the others, so rank 0's first all-to-all waits that long:
every rank must still make the same collective calls, and all must return the same rates. Rank 0
writes each rank's rates and its own Newton–Schulz and link times.
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist

from hf_muon.distributed.layout import replicated
from hf_muon.distributed.rates import measure_link_rates
from same_answer import write_and_shut_down


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--late_s", type=float, default=1.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # fail, never hang
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 1:
        time.sleep(args.late_s)
    layouts = [replicated((64, 96), False, world), replicated((3, 32, 48), True, world)]
    rates = measure_link_rates(layouts, None, world, 5, torch.float32, 4, 2**20, "cpu")
    figures = torch.tensor([rates.ns_flops_per_s, rates.link_bytes_per_s, rates.flops_per_byte], dtype=torch.float64)
    gathered = [torch.zeros_like(figures) for _ in range(world)]
    dist.all_gather(gathered, figures)
    write_and_shut_down(rank, args.out, {"rates": [g.tolist() for g in gathered], "ranks": list(rates.ranks)})


if __name__ == "__main__":
    main()
