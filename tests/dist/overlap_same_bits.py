"""Run under ``torchrun --nproc_per_node 2`` (``DS_ACCELERATOR=cpu`` for ZeRO): the overlapped exchange
must give the synchronous exchange's parameters bit for bit.

    torchrun --nproc_per_node 2 tests/dist/overlap_same_bits.py --backends ddp,fsdp2 --out result.json
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/dist/overlap_same_bits.py --backends zero1,zero2,zero3 ...

For each backend and wire dtype (fp32, bf16), trains the same model twice from the same start,
``Muon(overlap_exchange=True)`` and ``False``, with a ``bucket_bytes`` small enough for several
buckets, and records per rank whether the trained parameters (this rank's pieces) are identical,
whether the exchange counted the same bytes, and the bucket plans both modes ran.
``--fail_on_rank R``: Newton–Schulz raises on rank R in the middle of the first step (the job must
end, not hang). ``--cases cases.json`` runs several cases' arguments in turn, as ``same_answer.py``
does.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
from torch import nn

from hf_muon import Muon
from hf_muon.distributed import plan as owner_plan
from hf_muon.distributed import sharding
from same_answer import MODELS, build, loss_fn, run_cases, train, wrap
from zero_same_answer import BATCH, zero_config

STEPS = 3
OPTIMIZER = dict(lr=2e-2, weight_decay=0.1, ns_dtype=torch.float32)


PLANS: list = []  # (buckets, whether a rank holds nothing of some tensor) of each plan, once recording


def record_plans() -> None:
    """Wrap the bucket planner the exchange uses (once per process) so the plans that really ran are
    seen in ``PLANS``: in ``plan_exchange`` (the first plan) and in ``exchange_over`` (another wire
    width's)."""
    real = owner_plan.plan_buckets
    if getattr(real, "records", False):
        return

    def plan(layouts, *args):
        buckets = real(layouts, *args)
        PLANS.append((buckets, any(not layout.holds(r) for layout in layouts for r in range(len(layout.ranges)))))
        return buckets

    plan.records = True
    owner_plan.plan_buckets = sharding.plan_buckets = plan


def failing_newton_schulz(rank: int, fail_on_rank: int):
    from hf_muon.kernels import orthogonalize

    calls = {"n": 0}

    def ns(G, *a, **k):
        calls["n"] += 1
        if rank == fail_on_rank and calls["n"] == 2:
            raise RuntimeError("Newton-Schulz failed on purpose")
        return orthogonalize(G, *a, **k)

    return ns


def train_torch(backend: str, base: nn.Module, batches, rank: int, world: int, **muon) -> tuple[list[torch.Tensor], Muon]:
    model = copy.deepcopy(base)
    wrapped = wrap(backend, model, world)
    opt = Muon(model, **muon)
    train(wrapped, opt, batches, 1, rank, world)
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in model.parameters()], opt


def train_zero(stage: int, base: nn.Module, batches, rank: int, world: int, **muon) -> tuple[list[torch.Tensor], Muon]:
    import deepspeed

    model = copy.deepcopy(base)
    opt = Muon(model, **muon)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=zero_config(stage, world, 1, "fp32"))
    for batch in batches:
        engine.backward(loss_fn(engine, batch.chunk(world)[rank]))
        engine.step()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        return [p.detach().clone() for p in params], opt


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", default="ddp,fsdp2")
    parser.add_argument("--model", choices=MODELS, default="block")
    parser.add_argument("--fail_on_rank", type=int, default=None)
    parser.add_argument("--out", required=True)
    return parser


def run_case(args: argparse.Namespace, rank: int, world: int) -> dict:
    """Each of ``args.backends`` with fp32 and bf16 on the wire: the figures of both ranks."""
    torch.manual_seed(0)
    base = build(args.model)
    batches = [torch.randint(0, 64, (BATCH, 16)) for _ in range(STEPS)]
    record_plans()
    results = {}
    for backend in args.backends.split(","):
        for comm_dtype in (None, torch.bfloat16):
            # small enough that both modes cut the same several buckets on these tiny models
            itemsize = 2 if comm_dtype is not None else 4
            muon = dict(OPTIMIZER, comm_dtype=comm_dtype, bucket_bytes=7500 * itemsize)
            if args.fail_on_rank is not None:
                muon["orthogonalize_fn"] = failing_newton_schulz(rank, args.fail_on_rank)
            trained, stats, ran = {}, {}, {}
            for overlap in (True, False):
                del PLANS[:]
                run = train_zero if backend.startswith("zero") else train_torch
                what = int(backend[4:]) if backend.startswith("zero") else backend
                trained[overlap], opt = run(what, base, batches, rank, world, overlap_exchange=overlap, **muon)
                stats[overlap] = (opt.exchange_stats.bytes_sent, opt.exchange_stats.bytes_received)
                ran[overlap] = list(PLANS)
            identical = all(torch.equal(a, b) for a, b in zip(trained[True], trained[False]))
            figures = torch.tensor([identical, stats[True] == stats[False], stats[True][0]], dtype=torch.float64)
            gathered = [torch.zeros_like(figures) for _ in range(world)]
            dist.all_gather(gathered, figures)
            results[f"{backend}/{'bf16' if comm_dtype else 'fp32'}"] = {
                "identical": [bool(g[0]) for g in gathered], "bytes_equal": [bool(g[1]) for g in gathered],
                "bytes_sent": [g[2].item() for g in gathered],
                "buckets": max(len(buckets) for buckets, _ in ran[True]),
                "same_plan": [b for b, _ in ran[True]] == [b for b, _ in ran[False]],
                "some_rank_holds_nothing": any(nothing for _, nothing in ran[True]),
            }
    return results


if __name__ == "__main__":
    run_cases(arguments(), run_case)
