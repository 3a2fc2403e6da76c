"""Single-process optimizer step time on a Llama-like set of matrices, ours vs the alternatives.

    python benchmarks/optimizer_step.py [--d 512 --layers 4 --repeats 7]

Contenders run in the same process on the same tensors: torch.optim.AdamW (foreach),
hf_muon.Muon (Newton–Schulz batched by shape; its default dtype policy picks float32 on CPU, and
bf16 is shown too) and torch.optim.Muon (bf16, one matrix at a time). Reports the median and min–max of ``--repeats`` timed steps after warm-up, and each time as a
ratio to AdamW's. Timings on a shared machine are noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from hf_muon import Muon


def llama_matrices(d: int, layers: int, heads: int, kv_heads: int) -> list[tuple[int, int]]:
    """Weight shapes (out, in) of a Llama block stack: GQA attention and a SwiGLU MLP."""
    head_dim = d // heads
    ffn = 256 * ((8 * d // 3 + 255) // 256)
    block = [(d, d), (kv_heads * head_dim, d), (kv_heads * head_dim, d), (d, d), (ffn, d), (ffn, d), (d, ffn)]
    return block * layers


def time_steps(make_opt, shapes, repeats: int, warmup: int = 2) -> list[float]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    opt = make_opt(params)
    times = []
    for i in range(warmup + repeats):
        for p in params:
            p.grad = torch.randn_like(p)
        start = time.perf_counter()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv_heads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    shapes = llama_matrices(args.d, args.layers, args.heads, args.kv_heads)
    n = sum(a * b for a, b in shapes)
    print(f"{len(shapes)} matrices, {n / 1e6:.2f}M parameters, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    contenders = {
        "torch.optim.AdamW(foreach)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True),
        "hf_muon.Muon": lambda ps: Muon([{"params": ps, "algorithm": "muon"}], lr=1e-3, weight_decay=0.01),
        "hf_muon.Muon(ns_dtype=bf16)": lambda ps: Muon([{"params": ps, "algorithm": "muon"}], lr=1e-3,
                                                       weight_decay=0.01, ns_dtype=torch.bfloat16),
        "torch.optim.Muon": lambda ps: torch.optim.Muon(ps, lr=1e-3, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
    }
    results = {name: time_steps(make, shapes, args.repeats) for name, make in contenders.items()}
    base = statistics.median(results["torch.optim.AdamW(foreach)"])
    print(f"{'optimizer':<28} {'median ms':>10} {'min-max ms':>16} {'x AdamW':>8}")
    for name, times in results.items():
        med = statistics.median(times)
        print(f"{name:<28} {1e3 * med:>10.1f} {1e3 * min(times):>7.1f}-{1e3 * max(times):<8.1f} {med / base:>8.2f}")


if __name__ == "__main__":
    main()
