"""Run under ``torchrun --nproc_per_node W`` (``DS_ACCELERATOR=cpu`` for DeepSpeed): QK-clip on a sharded
model must give the single-process answer, and leave every head's logit at most tau.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/dist/qk_clip_same_answer.py \
        --backends zero1,zero2,zero3,fsdp2,ddp --out result.json

A tiny Qwen2 (GQA 4/2, q/k biases: the biases live in AdamW partitions) trains a few steps with a tau
that clips heads every step; the last step runs at lr 0, so it only clips, and a forward pass after it
must see no logit above tau. Every rank also trains the one-process reference.

``--dtype float64`` (DDP, FSDP2; DeepSpeed trains in fp32 at most): the model, its updates and
Newton–Schulz in float64. In fp32 the runs differ from one process by more than fp32 round-off, and by
how much depends on the CPU's kernels (1.3e-4 on an AVX512-BF16 Xeon, under 1e-5 on earlier machines):
AdamW's first steps are about lr * sign(gradient), so embedding and lm_head entries whose gradient is
near round-off take lr-sized steps either way. ``--baseline ddp`` compares each later backend with the
same launch's fp32 DDP run instead (the same micro-batches on each rank), whose answer the float64 run
ties to one process.
"""

from __future__ import annotations

import argparse
import copy
import datetime

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from hf_muon import Muon
from hf_muon.models.qk_clip import QKClip
from same_answer import write_and_shut_down
from zero_same_answer import BATCH, zero_config

TAU = 0.6
OPTIMIZER = dict(lr=2e-2, weight_decay=0.1)  # with ns_dtype: the model's dtype, as --dtype says


def build_model(dtype: torch.dtype) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # logits of order 1, so a tau of TAU clips some heads every step
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.mul_(4.0)
                proj.bias.normal_(0, 0.5)
    return model.to(dtype)


def train(model, forward, backward, step, optimizer, clip, batches, rank: int, world: int) -> list[int]:
    """Train on ``batches`` (this rank's share of each); the last step at lr 0. Returns clipped heads per step."""
    clipped = []
    for i, batch in enumerate(batches):
        if i == len(batches) - 1:
            for group in optimizer.param_groups:
                group["lr"] = 0.0
        ids = batch.chunk(world)[rank]
        backward(forward(ids).loss)
        step()
        clipped.append(clip.clipped_heads)
    return clipped


def max_logit_now(model_call, clip: QKClip, ids: torch.Tensor) -> float:
    """The largest logit over all ranks of a training-mode forward on ``ids`` (this rank's share)."""
    with torch.no_grad():
        model_call(ids)
    top = torch.stack([m.max() for m in clip.head_max_logits()]).max()
    if dist.is_initialized():
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return top.item()


def run_reference(batches, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[int], float]:
    model = build_model(dtype)
    model.train()
    optimizer = Muon(model, distributed=False, ns_dtype=dtype, **OPTIMIZER)  # one process among W: no collectives
    clip = QKClip(model, tau=TAU).attach(optimizer)
    def step():
        optimizer.step()
        optimizer.zero_grad()

    clipped = train(model, lambda ids: model(ids, labels=ids), lambda loss: loss.backward(), step, optimizer,
                    clip, batches, 0, 1)
    after = max(m.max().item() for m in _forward_maxima(model, clip, batches[-1]))
    return [p.detach().clone() for p in model.parameters()], clipped, after


def _forward_maxima(model, clip, ids):
    with torch.no_grad():
        model(ids)
    return clip.head_max_logits()


def run_deepspeed(base, batches, stage: int, rank: int, world: int):
    import deepspeed

    model = copy.deepcopy(base)
    model.train()
    optimizer = Muon(model, ns_dtype=torch.float32, **OPTIMIZER)
    clip = QKClip(model, tau=TAU).attach(optimizer)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=zero_config(stage, world, 1, "fp32"))
    clipped = train(engine, lambda ids: engine(ids, labels=ids), engine.backward, engine.step, optimizer, clip,
                    batches, rank, world)
    after = max_logit_now(lambda ids: engine(ids), clip, batches[-1].chunk(world)[rank])
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        trained = [p.detach().float().clone() for p in params]
    return trained, clipped, after, clip.max_attention_logit


def run_torch(base, batches, backend: str, rank: int, world: int):
    model = copy.deepcopy(base)
    model.train()
    clip = QKClip(model, tau=TAU)
    dtype = next(model.parameters()).dtype
    if backend == "ddp":
        optimizer = Muon(model, ns_dtype=dtype, **OPTIMIZER)
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
        optimizer = Muon(model, ns_dtype=dtype, **OPTIMIZER)
    clip.attach(optimizer)

    def step():
        optimizer.step()
        optimizer.zero_grad()

    clipped = train(wrapped, lambda ids: wrapped(ids, labels=ids), lambda loss: loss.backward(), step, optimizer,
                    clip, batches, rank, world)
    after = max_logit_now(lambda ids: wrapped(ids), clip, batches[-1].chunk(world)[rank])
    trained = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]
    return trained, clipped, after, clip.max_attention_logit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", default="zero3,fsdp2")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--baseline", choices=["one_process", "ddp"], default="one_process",
                        help="what max_rel_diff compares with; ddp: the first backend, whose own diff is then 0")
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=None)  # the deepspeed launcher passes it
    args = parser.parse_args()
    backends = args.backends.split(",")
    if args.baseline == "ddp" and backends[0] != "ddp":
        parser.error("--baseline ddp compares with the DDP run: list ddp first in --backends")
    if args.dtype == "float64" and any(b.startswith("zero") for b in backends):
        parser.error("DeepSpeed trains in fp32 at most: run the zero backends with --dtype float32")
    dtype = getattr(torch, args.dtype)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # fail, never hang
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (BATCH, 16), generator=g) for _ in range(args.steps)]
    reference, ref_clipped, ref_after = run_reference(batches, dtype)
    base = build_model(dtype)

    results = {"tau": TAU, "world": world, "steps": args.steps,
               "reference": {"clipped_heads": ref_clipped, "max_logit_after": ref_after}}
    for backend in backends:
        if backend.startswith("zero"):
            trained, clipped, after, last_max = run_deepspeed(base, batches, int(backend[-1]), rank, world)
        else:
            trained, clipped, after, last_max = run_torch(base, batches, backend, rank, world)
        if args.baseline == "ddp" and backend == "ddp":
            reference = trained
        diffs = {n: ((t - q).abs().max() / q.abs().max()).item()
                 for (n, _), t, q in zip(base.named_parameters(), trained, reference)}
        # A key bias adds q·b_k to every logit of a query's row, which softmax ignores: its gradient is
        # zero up to round-off, and AdamW turns that round-off into lr-sized steps. Compared apart.
        worst = max(d for n, d in diffs.items() if not n.endswith("k_proj.bias"))
        worst_k_bias = max(d for n, d in diffs.items() if n.endswith("k_proj.bias"))
        figures = torch.tensor([worst, worst_k_bias], dtype=torch.float64)
        gathered = [torch.zeros_like(figures) for _ in range(world)]
        dist.all_gather(gathered, figures)
        results[backend] = {"max_rel_diff": [g_[0].item() for g_ in gathered],
                            "k_bias_max_rel_diff": [g_[1].item() for g_ in gathered], "clipped_heads": clipped,
                            "max_logit_after": after, "last_step_max_logit": last_max}
    write_and_shut_down(rank, args.out, results)


if __name__ == "__main__":
    main()
