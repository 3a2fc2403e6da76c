"""Muon step time under DDP with one param group against one group per layer (per-layer learning rates).

    torchrun --nproc_per_node 2 benchmarks/param_groups.py
    PYTHONPATH=path/to/older/checkout torchrun --nproc_per_node 2 benchmarks/param_groups.py  # to compare

Llama-like layers (q, k, v, o, gate, up, down) with random gradients; ``opt.step()`` timed between
barriers, median of the steps after the warm-up ones. Groups whose plans cost alike share one exchange
and Newton–Schulz batches, so the two should match; with an exchange per group the per-layer step
waits for each layer's busiest owner in turn. Prints the medians (ms) and their ratio on rank 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from hf_muon import Muon


def layers(d: int, ff: int, kv: int, count: int) -> nn.ModuleList:
    torch.manual_seed(0)

    def linear(n_in: int, n_out: int) -> nn.Linear:
        return nn.Linear(n_in, n_out, bias=False)

    return nn.ModuleList(
        nn.ModuleDict(dict(q=linear(d, d), k=linear(d, kv), v=linear(d, kv), o=linear(d, d), gate=linear(d, ff),
                           up=linear(d, ff), down=linear(ff, d)))
        for _ in range(count)
    )


def step_ms(model: nn.ModuleList, per_layer: bool, steps: int, warmup: int) -> float:
    groups = ([{"params": list(layer.parameters()), "lr": 1e-3 * 0.9 ** i} for i, layer in enumerate(model)]
              if per_layer else [{"params": list(model.parameters())}])
    opt = Muon(groups, lr=1e-3, ns_dtype=torch.bfloat16)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--ff", type=int, default=1376)
    parser.add_argument("--kv", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    one = step_ms(layers(args.d, args.ff, args.kv, args.layers), False, args.steps, args.warmup)
    per_layer = step_ms(layers(args.d, args.ff, args.kv, args.layers), True, args.steps, args.warmup)
    if dist.get_rank() == 0:
        print(json.dumps({"one_group_ms": round(one, 1), "per_layer_ms": round(per_layer, 1),
                          "per_layer / one_group": round(per_layer / one, 3)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
