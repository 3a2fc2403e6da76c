"""A plain Trainer script that never imports hf_muon: tiny Llama on this file's own bytes.

Only ``TrainingArguments`` flags are needed. A few script flags serve the launcher tests:
``--eval_before false`` (DeepSpeed ZeRO-1/2 cannot evaluate before training), ``--dump_params PATH``
(each rank writes its full fp32 parameters to ``PATH.rank<R>.pt`` after training), ``--report PATH``
(each rank writes what it saw to ``PATH.rank<R>.json``: ranks' output lines interleave), ``--from_config``
(build the model with ``AutoModelForCausalLM.from_config``: under ZeRO-3 that is ``zero.Init``, which
partitions parameters as they are created), ``--kill_rank R:N`` (rank R sends itself SIGKILL at the end
of optimizer step N, after printing the time), ``--copy_args`` (train with ``dataclasses.replace(args)``: a
second ``TrainingArguments`` in the process). ``--resume_from_checkpoint`` is passed to ``train()``.
"""

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, replace

import torch
from torch.utils.data import Dataset
from transformers import (AutoModelForCausalLM, HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer,
                          TrainerCallback, TrainingArguments)


class Bytes(Dataset):
    def __init__(self, text: bytes, seq: int = 32):
        ids = torch.tensor(list(text), dtype=torch.long)
        self.blocks = ids[: len(ids) // seq * seq].view(-1, seq)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


@dataclass
class ScriptArgs:
    eval_before: bool = True
    dump_params: str | None = None
    report: str | None = None
    from_config: bool = False
    kill_rank: str | None = None
    copy_args: bool = False


class KillRank(TrainerCallback):
    """SIGKILL this process at the end of optimizer step ``step`` (a rank dying mid-run)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            print(f"KILLING rank {args.process_index} at step {state.global_step} time={time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def full_parameters(model: torch.nn.Module) -> dict:
    """Every parameter whole, in fp32, on CPU: gathered from ZeRO-3 partitions or FSDP2 shards."""
    params = dict(model.named_parameters())
    if any(hasattr(p, "ds_id") for p in params.values()):  # ZeRO-3
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().float().cpu().clone() for n, p in params.items()}
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
            for n, p in params.items()}


def innermost_optimizer(optimizer):
    """Accelerate and DeepSpeed wrap the optimizer (sometimes twice): the one that does the math."""
    while getattr(optimizer, "optimizer", None) is not None and optimizer.optimizer is not optimizer:
        optimizer = optimizer.optimizer
    return optimizer


def main() -> None:
    args, script = HfArgumentParser((TrainingArguments, ScriptArgs)).parse_args_into_dataclasses()
    if script.copy_args:
        args = replace(args)
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config) if script.from_config else LlamaForCausalLM(config)
    built_partitioned = any(hasattr(p, "ds_id") for p in model.parameters())  # under zero.Init
    data = Bytes(open(__file__, "rb").read() * 4)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data)
    if script.kill_rank:
        rank, step = map(int, script.kill_rank.split(":"))
        if rank == args.process_index:
            trainer.add_callback(KillRank(step))
    print(f"RANK={args.process_index} NUM_PROCESSES={trainer.accelerator.num_processes} "
          f"WORLD_SIZE={args.world_size} DISTRIBUTED_TYPE={trainer.accelerator.distributed_type}")
    before = trainer.evaluate()["eval_loss"] if script.eval_before else float("nan")
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    after = trainer.evaluate()["eval_loss"]
    optimizer = innermost_optimizer(trainer.optimizer)
    param = next(trainer.model.parameters())
    print(f"WRAPPER={type(trainer.model_wrapped).__name__} PARAM={type(param.data).__name__} DTYPE={param.dtype} "
          f"FSDP={trainer.is_fsdp_enabled} DEEPSPEED={trainer.is_deepspeed_enabled}")
    print(f"OPTIMIZER={type(optimizer).__module__}.{type(optimizer).__name__}")
    for group in optimizer.param_groups:
        if "algorithm" in group and "param_names" in group:
            print(f"GROUP algorithm={group['algorithm']} names={','.join(group['param_names'])}")
    stats = getattr(optimizer, "exchange_stats", None)  # hf_muon.Muon: Newton–Schulz runs on this rank
    if stats is not None:
        print(f"NS_TENSORS={stats.tensors_orthogonalized} RANK={args.process_index}")
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if losses:
        print(f"TRAIN_LOSS_FIRST={losses[0]:.4f} TRAIN_LOSS_LAST={losses[-1]:.4f}")
    print(f"EVAL_LOSS_BEFORE={before:.4f} EVAL_LOSS_AFTER={after:.4f}")
    if script.report:
        # each rank must get its own shard of the data (a rank that believes it is alone reads them all)
        first_batch = next(iter(trainer.get_train_dataloader()))["input_ids"]
        report = dict(
            num_processes=trainer.accelerator.num_processes, world_size=args.world_size,
            distributed_type=str(trainer.accelerator.distributed_type), built_partitioned=built_partitioned,
            wrapper=type(trainer.model_wrapped).__name__, param=type(param.data).__name__, dtype=str(param.dtype),
            fsdp=trainer.is_fsdp_enabled, deepspeed=trainer.is_deepspeed_enabled,
            optimizer=f"{type(optimizer).__module__}.{type(optimizer).__name__}",
            ns_tensors=None if stats is None else stats.tensors_orthogonalized,
            groups=[(g["algorithm"], g.get("param_names")) for g in optimizer.param_groups if "algorithm" in g],
            # ZeRO-3: parameters kept gathered between uses (below stage3_param_persistence_threshold)
            persistent=[n for n, p in trainer.model.named_parameters() if getattr(p, "ds_persist", False)],
            first_batch=first_batch[:, :8].tolist(),
            train_losses=losses, eval_loss_after=after, global_step=trainer.state.global_step,
            telemetry=[{k: v for k, v in e.items() if k.startswith("muon/")} for e in trainer.state.log_history
                       if "loss" in e],
        )
        with open(f"{script.report}.rank{args.process_index}.json", "w") as f:
            json.dump(report, f)
    if script.dump_params:
        torch.save(full_parameters(trainer.model), f"{script.dump_params}.rank{args.process_index}.pt")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
