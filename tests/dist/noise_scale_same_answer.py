"""Run under ``[DS_ACCELERATOR=cpu] torchrun --nproc_per_node 2``: GradientNoiseScale at 2 ranks must
measure what one process computes from the same micro-batches.

    torchrun --nproc_per_node 2 tests/dist/noise_scale_same_answer.py --backend ddp --out result.json

Before each step every rank computes, on a hook-free copy of the current weights, every micro-batch's
gradient of the global batch (all ranks' micro-batches): ``|G_small|^2`` is their mean squared norm,
``|G_big|^2`` the squared norm of their mean. The distributed step (DDP, or DeepSpeed ZeRO-2 with its
flat partitions and one ``step()`` per param group) must report the same two numbers.
"""

from __future__ import annotations

import argparse
import copy
import datetime

import torch
import torch.distributed as dist
from torch import nn

from hf_muon import Muon
from hf_muon.optimizer.noise_scale import GradientNoiseScale, estimate_from_norms
from same_answer import Block, loss_fn, write_and_shut_down

MICRO, ACCUMULATION = 2, 2
OPTIMIZER = dict(lr=1e-2, weight_decay=0.1, ns_dtype=torch.float32)


def reference_norms(model: nn.Module, micro_batches: list[torch.Tensor]) -> tuple[float, float]:
    grads = []
    for micro in micro_batches:
        model.zero_grad()
        loss_fn(model, micro).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double())
    small = sum(g.square().sum() for g in grads).item() / len(grads)
    big = (sum(grads) / len(grads)).square().sum().item()
    return small, big


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["ddp", "zero2"], required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # fail, never hang
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Block()
    shadow = copy.deepcopy(model)  # no hooks: the one-process reference
    batches = [torch.randint(0, 64, (MICRO * ACCUMULATION * world, 16)) for _ in range(args.steps)]
    opt = Muon(model, **OPTIMIZER)
    if args.backend == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
    else:
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
                  "zero_optimization": {"stage": 2, "reduce_bucket_size": 5000, "allgather_bucket_size": 5000},
                  "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default: a clipped |G_big| is not measured
                  "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
        wrapped, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    noise = GradientNoiseScale(wrapped, opt, micro_batch_size=MICRO, accumulation_steps=ACCUMULATION,
                               warmup_steps=1).attach()
    reference = GradientNoiseScale(shadow, torch.optim.SGD(shadow.parameters()), MICRO, ACCUMULATION, world,
                                   warmup_steps=1)  # fed by hand
    norms, expected = [], []
    for batch in batches:
        shadow.load_state_dict(model.state_dict())
        micro_batches = list(batch.chunk(world * ACCUMULATION))  # rank r's micro-batches: r*GAS .. r*GAS+GAS-1
        expected.append(reference_norms(shadow, micro_batches))
        reference.update(estimate_from_norms(*expected[-1], MICRO, MICRO * ACCUMULATION * world))
        mine = micro_batches[rank * ACCUMULATION:(rank + 1) * ACCUMULATION]
        if args.backend == "ddp":
            opt.zero_grad()
            for i, micro in enumerate(mine):
                if i < len(mine) - 1:
                    with wrapped.no_sync():
                        (loss_fn(wrapped, micro) / ACCUMULATION).backward()
                else:
                    (loss_fn(wrapped, micro) / ACCUMULATION).backward()
            opt.step()
        else:
            for micro in mine:
                wrapped.backward(loss_fn(wrapped, micro))  # DeepSpeed divides by the accumulation steps
                wrapped.step()
        norms.append(noise.last_norms)
    write_and_shut_down(rank, args.out, {
        "steps": noise.steps, "measured_steps": noise.measured_steps, "norms": norms, "reference": expected,
        "noise_scale": noise.noise_scale, "reference_noise_scale": reference.noise_scale,
        "lr_multiplier": noise.lr_multiplier})


if __name__ == "__main__":
    main()
