"""Figure 2's single-process throughput with the optimizers interleaved step by step, in one process.

    python benchmarks/step_interleaved.py [--steps 6] [--out runs/step_interleaved.json]

Figure 2 (``hf-muon bench --only fig2_4``) launches one ``Trainer`` run per optimizer and interleaves
the launches in rounds; a neighbour's load that lands on one launch still moves its ratio (single
rounds range from 0.87 to 1.14 on this 2-core machine). Here each contender trains its own copy of
figure 2's model (same seed, same config) in the same process, and every step runs the same
64k tokens (figure 2's micro-batches and accumulation) under each contender in turn, in an order
that rotates from step to step. A step is what ``Trainer`` runs: forward and backward over the
micro-batches, gradient clipping at 1.0, the optimizer step, zeroing the gradients. Each
contender's tokens/s is divided by AdamW's in the same step; the script reports the median
(min–max) of those paired ratios, the median step and optimizer-step times, and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hf_muon import Muon
from hf_muon.bench.common import machine_info, summarize
from hf_muon.bench.run import FULL
from hf_muon.bench.train_worker import CONTENDER_LABELS, ByteBlocks, TorchMuonWithAdamW, build_model
from hf_muon.optimizer.param_split import split_parameters

CONTENDERS = ("adamw", "hf_muon", "torch_muon")


def make_optimizer(contender: str, model: torch.nn.Module, lr: float, wd: float) -> torch.optim.Optimizer:
    """As figure 2's worker builds them for one process."""
    if contender == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, foreach=True)
    if contender == "hf_muon":
        return Muon(model, lr=lr, weight_decay=wd)
    split = split_parameters(model)
    return TorchMuonWithAdamW([p for _, p in split.muon], [p for _, p in split.adamw], lr, wd)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, micro_batches: list[torch.Tensor]) -> tuple[float, float]:
    """One optimizer step over ``micro_batches``: (step seconds, optimizer-step seconds)."""
    start = time.perf_counter()
    for ids in micro_batches:
        (model(input_ids=ids, labels=ids).loss / len(micro_batches)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # Trainer's default max_grad_norm
    before_step = time.perf_counter()
    opt.step()
    after_step = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start, after_step - before_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="measured steps per contender (default 6)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps per contender, not measured (default 1)")
    parser.add_argument("--out", default="runs/step_interleaved.json")
    args = parser.parse_args()
    cfg = FULL["fig2_4"]
    seq_len, micro, tokens = cfg["seq_len"], cfg["micro_batch"], cfg["tokens_per_step"]
    accumulation = tokens // (micro * seq_len)
    blocks = ByteBlocks(seq_len, cfg["corpus_mb"]).blocks
    models = {c: build_model(cfg["model"], seq_len, cfg["seed"]) for c in CONTENDERS}
    optimizers = {c: make_optimizer(c, models[c], cfg["lr"], cfg["weight_decay"]) for c in CONTENDERS}
    times: dict[str, list[tuple[float, float]]] = {c: [] for c in CONTENDERS}
    generator = torch.Generator().manual_seed(cfg["seed"])
    for step in range(args.warmup + args.steps):
        picks = torch.randint(len(blocks), (accumulation, micro), generator=generator)
        micro_batches = [blocks[p] for p in picks]
        order = CONTENDERS[step % len(CONTENDERS):] + CONTENDERS[:step % len(CONTENDERS)]
        for contender in order:
            times[contender].append(train_step(models[contender], optimizers[contender], micro_batches))
        line = "  ".join(f"{c} {times[c][-1][0]:.2f} s" for c in CONTENDERS)
        print(f"step {step}{' (warm-up)' if step < args.warmup else ''}: {line}", flush=True)
    measured = {c: times[c][args.warmup:] for c in CONTENDERS}
    adamw = [s for s, _ in measured["adamw"]]
    results = {
        "config": {**cfg, "accumulation": accumulation, "steps": args.steps, "warmup": args.warmup},
        "machine": machine_info(),
        "contenders": {
            c: {"label": CONTENDER_LABELS[c], "step_s": summarize([s for s, _ in measured[c]]),
                "optimizer_step_s": summarize([o for _, o in measured[c]]),
                "tokens_per_s": summarize([tokens / s for s, _ in measured[c]]),
                # tokens/s over AdamW's in the same step: AdamW's step time over this one's
                "ratio_to_adamw": summarize([a / s for a, (s, _) in zip(adamw, measured[c])])}
            for c in CONTENDERS},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\n{tokens} tokens per step, {args.steps} steps each after {args.warmup} warm-up, "
          f"{torch.get_num_threads()} threads")
    print(f"{'contender':<28}{'step (median)':>15}{'optimizer step':>16}{'tokens/s':>10}  ratio to AdamW, same step")
    for c, r in results["contenders"].items():
        ratio = r["ratio_to_adamw"]
        print(f"{r['label']:<28}{r['step_s']['median']:>13.3f} s{r['optimizer_step_s']['median'] * 1e3:>13.1f} ms"
              f"{r['tokens_per_s']['median']:>10.0f}  {ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})")
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
