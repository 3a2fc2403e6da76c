"""Run under ``DS_ACCELERATOR=cpu torchrun --nproc_per_node W``: hf_muon.Muon inside DeepSpeed ZeRO
must give the single-process answer.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/dist/zero_same_answer.py \
        --stages 0,1,2,3,3init --accumulation 1 --out result.json

Runs every requested ZeRO stage in turn in the same ranks (DeepSpeed's start-up is the slow part)
and writes, per stage, the figures the pytest side asserts on. ``--cases cases.json`` runs several
cases' arguments in turn, as ``same_answer.py`` does.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist

from hf_muon import Muon
from same_answer import (MODELS, build, counting_newton_schulz, flops_per_byte_arg, link_rate_figures, loss_fn,
                         matrices_per_step, reference_accumulation, run_cases, train)

BATCH = 24  # divisible by W * accumulation for W in (1, 2, 3) and accumulation in (1, 4)
# fp32 Newton–Schulz (the dtype policy picks bf16 on CPUs with bf16 matmul): then ZeRO and the
# single-process reference agree to fp32 round-off, and any larger gap is a bug in the exchange.
OPTIMIZER = dict(lr=2e-2, weight_decay=0.1, ns_dtype=torch.float32)


def zero_config(stage: int, world: int, accumulation: int, dtype: str, sub_group_size: int | None = None,
                round_robin: bool = False) -> dict:
    return {
        "train_micro_batch_size_per_gpu": BATCH // (world * accumulation),
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              "reduce_bucket_size": 5000, "allgather_bucket_size": 5000,
                              **({"sub_group_size": sub_group_size} if sub_group_size else {}),
                              **({"round_robin_gradients": True} if round_robin else {})},
        "bf16": {"enabled": dtype.startswith("bf16")},
        "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 8},
        # fp32 accumulation of bf16 gradients makes DeepSpeed use its BF16_Optimizer at stages 0-1
        **({"data_types": {"grad_accum_dtype": "fp32"}} if dtype == "bf16_fp32_accum" else {}),
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def run_stage(base, batches, stage: str, accumulation: int, dtype: str, rank: int, world: int,
              model_name: str = "block", sub_group_size: int | None = None,
              exchange_flops_per_byte: float | str | None = None, round_robin: bool = False,
              adjust_lr: str = "match_rms_adamw") -> dict:
    """``stage`` is 0-3, or "3init": ZeRO-3 with the model built under ``zero.Init`` (shapes hidden)."""
    import deepspeed

    config = zero_config(int(stage[0]), world, accumulation, dtype, sub_group_size, round_robin)
    if stage == "3init":
        torch.manual_seed(0)  # the same initial values as ``base``
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = build(model_name)
        assert all(p.numel() == 0 for p in model.parameters()), "zero.Init did not partition the model"
    else:
        model = copy.deepcopy(base)
    counting, calls = counting_newton_schulz()
    opt = Muon(model, orthogonalize_fn=counting, exchange_flops_per_byte=exchange_flops_per_byte, adjust_lr=adjust_lr,
               **OPTIMIZER)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    calls["n"] = 0  # training steps only: FP16_UnfusedOptimizer runs one step inside initialize()
    for batch in batches:
        for micro in batch.chunk(world)[rank].chunk(accumulation):
            engine.backward(loss_fn(engine, micro))  # DeepSpeed divides by the accumulation steps
            engine.step()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage.startswith("3")):
        trained = [p.detach().float().clone() for p in params]
    muon_numel = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in opt._group_tensors[0])
    return {"trained": trained, "ns_calls": calls["n"], "ns_flops": calls["flops"],
            "exchanges": len(opt._partition_exchanges), "bytes_sent": opt.exchange_stats.bytes_sent,
            "bytes_received": opt.exchange_stats.bytes_received, "muon_numel": muon_numel,
            "muon_tensors": len(opt._group_tensors[0]), "inner": type(engine.optimizer).__name__,
            "ns_matrices": matrices_per_step(opt), "link_rates": link_rate_figures(opt),
            "stacked_groups": sum(g["algorithm"] == "muon" and g["stacked"] for g in opt.param_groups)}


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--dtype", choices=["fp32", "bf16", "bf16_fp32_accum", "fp16"], default="fp32")
    parser.add_argument("--model", choices=MODELS, default="block")
    parser.add_argument("--sub_group_size", type=int, help="ZeRO-3's sub_group_size (default: DeepSpeed's)")
    parser.add_argument("--exchange_flops_per_byte", type=flops_per_byte_arg, default=None)
    parser.add_argument("--round_robin", action="store_true",
                        help="round_robin_gradients: hf_muon refuses it where DeepSpeed links parameters wrongly; "
                             "a refusal is recorded as the stage's figures")
    # "original": a Conv1D's (GPT-2's) scale is read from its columns, which the partition must carry
    parser.add_argument("--adjust_lr", default="match_rms_adamw")
    parser.add_argument("--out", required=True)
    return parser


def run_case(args: argparse.Namespace, rank: int, world: int) -> dict:
    """The single-process reference, then each of ``args.stages``: the figures of both ranks by stage."""
    torch.manual_seed(0)
    base = build(args.model)
    batches = [torch.randint(0, 64, (BATCH, 16)) for _ in range(args.steps)]
    reference = copy.deepcopy(base)
    train(reference, Muon(reference, distributed=False, adjust_lr=args.adjust_lr, **OPTIMIZER), batches,
          reference_accumulation(args.model, world, args.accumulation), 0, 1)

    results = {}
    for stage in args.stages.split(","):
        try:
            r = run_stage(base, batches, stage, args.accumulation, args.dtype, rank, world, args.model,
                          args.sub_group_size, args.exchange_flops_per_byte, args.round_robin, args.adjust_lr)
        except RuntimeError as error:  # every rank refuses at the same point (after the binding's all-gather)
            if not args.round_robin:
                raise
            results[stage] = {"refused": str(error)}
            continue
        worst = max(((t - q).abs().max() / q.abs().max()).item()
                    for t, q in zip(r.pop("trained"), reference.parameters()) if q.numel())
        figures = torch.tensor([worst, r["ns_calls"], r["bytes_sent"], r["bytes_received"], r["ns_flops"],
                                r["exchanges"], *r["link_rates"]], dtype=torch.float64)
        gathered = [torch.zeros_like(figures) for _ in range(world)]
        dist.all_gather(gathered, figures)
        results[stage] = {
            "world": world, "steps": args.steps, "muon_tensors": r["muon_tensors"], "muon_numel": r["muon_numel"],
            "inner_optimizer": r["inner"], "ns_matrices": r["ns_matrices"], "stacked_groups": r["stacked_groups"],
            "max_rel_diff": [g[0].item() for g in gathered],
            "ns_calls": [g[1].item() for g in gathered], "bytes_sent": [g[2].item() for g in gathered],
            "bytes_received": [g[3].item() for g in gathered], "ns_flops": [g[4].item() for g in gathered],
            "exchanges": [g[5].item() for g in gathered], "link_rates": [g[6:].tolist() for g in gathered],
        }
    return results


if __name__ == "__main__":
    run_cases(arguments(), run_case)
