"""Run under ``torchrun --nproc_per_node 2``: edges of the DDP/FSDP2 exchange found by an audit, each
of which one process cannot show.

    torchrun --nproc_per_node 2 tests/dist/exchange_edges.py --out edges.json

* ``distributed_false_fsdp2``: ``Muon(distributed=False)`` on FSDP2 shards ran Newton–Schulz on each
  rank's rows (the update's size off, silently); now refused on every rank.
* ``plain_beside_fsdp2``: a plain tensor (a learned scalar in an AdamW group) beside FSDP2's DTensors
  made the finite-gradient check fail as "a Muon param group mixes DTensor and plain tensors"; now
  it trains to the one-process answer.
* ``replicas_bf16``: bf16 matrices, float32 Newton–Schulz, plain tensors on 2 ranks (DDP's layout),
  the same gradients on both: the owner kept its float32 result while the other rank got it in bf16,
  so the replicas drifted apart; and with one bf16 matrix first, fp32 ones travelled in bf16 too.
  Now every rank holds the same bits, and the fp32 matrices the one-process answer.
"""

from __future__ import annotations

import argparse
import copy
import datetime

import torch
import torch.distributed as dist
from torch import nn

from hf_muon import Muon
from same_answer import build, loss_fn, wrap, write_and_shut_down


def distributed_false_fsdp2(world: int) -> dict:
    torch.manual_seed(0)
    model = wrap("fsdp2", build("block").double(), world)
    opt = Muon(model, lr=2e-2, distributed=False, ns_dtype=torch.float64)
    loss_fn(model, torch.randint(0, 64, (4, 16))).backward()
    try:
        opt.step()
    except ValueError as error:
        return {"refused": str(error)}
    return {"refused": None}


def plain_beside_fsdp2(world: int) -> dict:
    """The same batch on every rank: FSDP2's averaged gradients and the scalar's are one process's."""
    torch.manual_seed(0)
    base = build("block").double()
    batches = [torch.randint(0, 64, (4, 16)) for _ in range(3)]

    def run(model: nn.Module) -> list[torch.Tensor]:
        temperature = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
        opt = Muon([*_split(model), {"params": [temperature], "algorithm": "adamw"}], lr=2e-2,
                   ns_dtype=torch.float64)
        for batch in batches:
            opt.zero_grad()
            (loss_fn(model, batch) * temperature).backward()
            opt.step()
        return [temperature.detach().clone()]

    reference = copy.deepcopy(base)
    expected = run(reference) + [p.detach() for p in reference.parameters()]
    model = wrap("fsdp2", copy.deepcopy(base), world)
    got = run(model) + [p.full_tensor().detach() for p in model.parameters()]
    return {"max_diff": max((a - b).abs().max().item() for a, b in zip(got, expected))}


def _split(model: nn.Module) -> list[dict]:
    """The model's matrices for Muon and the rest for AdamW, as groups (to put another group beside them)."""
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return [{"params": matrices, "algorithm": "muon"}, {"params": rest, "algorithm": "adamw"}]


def replicas_bf16(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    dtypes = [torch.bfloat16, torch.float32, torch.float32, torch.bfloat16]
    shapes = [(24, 24), (32, 16), (16, 48), (16, 24)]
    params = [nn.Parameter(torch.randn(s).to(d)) for s, d in zip(shapes, dtypes)]
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    gradients = [[torch.randn(s).to(d) for s, d in zip(shapes, dtypes)] for _ in range(3)]  # same on every rank
    for tensors, distributed in ((params, True), (reference, False)):
        opt = Muon([{"params": tensors, "algorithm": "muon"}], lr=2e-2, ns_dtype=torch.float32,
                   distributed=distributed)
        for step in gradients:
            for p, g in zip(tensors, step):
                p.grad = g.clone()
            opt.step()
    flat = torch.cat([p.detach().float().reshape(-1) for p in params])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    fp32 = [i for i, d in enumerate(dtypes) if d == torch.float32]
    return {"replicas_max_diff": max((e - everyone[0]).abs().max().item() for e in everyone),
            "fp32_max_rel_diff": max(((params[i] - reference[i]).abs().max() / reference[i].abs().max()).item()
                                     for i in fp32)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # fail, never hang
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {"distributed_false_fsdp2": distributed_false_fsdp2(world),
               "plain_beside_fsdp2": plain_beside_fsdp2(world),
               "replicas_bf16": replicas_bf16(rank, world)}
    write_and_shut_down(rank, args.out, results)


if __name__ == "__main__":
    main()
