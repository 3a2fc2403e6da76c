"""Newton–Schulz time and traffic per rank under DeepSpeed ZeRO: hf_muon vs DeepSpeed's own Muon.

    python benchmarks/zero_owner_ns.py [--steps 5 --out runs/zero_owner_ns.json]

For ZeRO-2 and ZeRO-3 (``reduce_scatter: false``, which DeepSpeed's Muon needs at stage 3), at W=1
and W=2 on CPU (gloo, ``DS_ACCELERATOR=cpu``), trains the same small Llama with three optimizers:
DeepSpeed's AdamW (the traffic baseline), ``hf_muon.Muon`` (``--optim muon``'s optimizer) and
DeepSpeed's built-in Muon (``"type": "Muon"``). Per rank and optimizer step it reports:

* NS time: wall time in Newton–Schulz (hf_muon: its ``orthogonalize`` calls; DeepSpeed: its
  ``muon_update``, i.e. momentum plus Newton–Schulz, the closest function it has);
* bytes passed to all ``torch.distributed`` collectives (``hf_muon.bench.commcount``), and the
  extra over AdamW's; for hf_muon also the exchange's own bytes sent + received.

Medians over ``--steps`` steps after two warm-up steps; every cell is its own ``torchrun``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

OPTIMIZERS = ("deepspeed_adamw", "hf_muon", "deepspeed_muon")


def ds_config(stage: int, optimizer: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "reduce_scatter": False, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if optimizer != "hf_muon":
        kind, params = ("AdamW", {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}) if optimizer == "deepspeed_adamw" else (
            "Muon", {"lr": 1e-2, "momentum": 0.95, "weight_decay": 0.01})
        config["optimizer"] = {"type": kind, "params": params}
    return config


def worker(args: argparse.Namespace) -> None:
    from hf_muon.bench import commcount

    counter = commcount.install()  # before deepspeed is imported (see commcount)
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_muon.kernels import orthogonalize
    from deepspeed.runtime.zero.muon import original_muon
    from hf_muon import Muon

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config)
    muon_numel = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and ".layers." in n)
    ns_seconds = [0.0]

    def timed(fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                ns_seconds[0] += time.perf_counter() - start
        return wrapper

    optimizer = None
    if args.optimizer == "hf_muon":
        optimizer = Muon(model, lr=1e-2, weight_decay=0.01, orthogonalize_fn=timed(orthogonalize))
    elif args.optimizer == "deepspeed_muon":
        original_muon.muon_update = timed(original_muon.muon_update)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=model.parameters(),
                                      config=ds_config(args.stage, args.optimizer))
    ids = torch.randint(0, 512, (4, 128), generator=torch.Generator().manual_seed(rank))
    per_step = []
    for step in range(2 + args.steps):
        counter.reset()
        ns_seconds[0] = 0.0
        sent = optimizer.exchange_stats.bytes_sent + optimizer.exchange_stats.bytes_received if optimizer else 0
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        if step >= 2:
            exchange = (optimizer.exchange_stats.bytes_sent + optimizer.exchange_stats.bytes_received - sent
                        if optimizer else 0)
            per_step.append({"ns_s": ns_seconds[0], "collective_bytes": sum(counter.bytes.values()),
                             "exchange_bytes": exchange})
    result = {key: statistics.median(s[key] for s in per_step) for key in per_step[0]}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"per_rank": gathered, "muon_numel": muon_numel}))
    from hf_muon.launching import shutdown_process_group

    shutdown_process_group(exit_code=0)  # gloo's teardown at interpreter exit aborts now and then


def run_cell(stage: int, optimizer: str, world: int, steps: int) -> dict:
    from hf_muon.launching import free_port, run

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cell.json")
        # a fresh port per cell (and per retry): a fixed one can still be held by the previous cell's workers
        def cmd():
            return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
                    str(free_port()), __file__, "--worker", "--stage", str(stage), "--optimizer",
                    optimizer, "--steps", str(steps), "--out", out]
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // world))}
        result = run(cmd, 900, env=env)
        if result.returncode != 0:
            tail = [line for line in result.output.splitlines() if "Error" in line][-1:]
            return {"failed": tail[0] if tail else ("timed out" if result.timed_out else f"exit code {result.returncode}")}
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="hf_muon")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="runs/zero_owner_ns.json")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results = {}
    for stage in (2, 3):
        for world in (1, 2):
            for optimizer in OPTIMIZERS:
                print(f"ZeRO-{stage} W={world} {optimizer} ...", flush=True)
                results[f"zero{stage}/W{world}/{optimizer}"] = run_cell(stage, optimizer, world, args.steps)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\n{'cell':<30} {'NS ms/rank':>12} {'collective MB/rank':>19} {'extra over AdamW MB':>20} "
          f"{'exchange MB':>12}")
    for key, r in results.items():
        if "failed" in r:
            print(f"{key:<30} failed: {r['failed']}")
            continue
        stage_world = key.rsplit("/", 1)[0]
        base = results.get(f"{stage_world}/deepspeed_adamw", {}).get("per_rank")
        for rank, cell in enumerate(r["per_rank"]):
            extra = cell["collective_bytes"] - base[rank]["collective_bytes"] if base else float("nan")
            print(f"{key + f' rank {rank}':<30} {1e3 * cell['ns_s']:>12.1f} {cell['collective_bytes'] / 1e6:>19.2f} "
                  f"{extra / 1e6:>20.2f} {cell['exchange_bytes'] / 1e6:>12.2f}")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
