"""What each optimizer step did, for the Trainer's loggers and plain training loops.

Recording costs no host sync: each Muon group's last step leaves the norms of the updates this rank
orthogonalized (one reduction kernel per Newton–Schulz batch, kept on the device), the time
Newton–Schulz took (CUDA events on GPUs, a wall clock elsewhere) and the exchange's bytes. AdamW's
update is a function of its state after the step, so its RMS is computed only when read. Reading (:meth:`Telemetry.read`) reduces
across ranks: every rank must call it, as the Trainer does at each logging step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

TELEMETRY_KEYS = ("muon/update_rms", "muon/adamw_update_rms", "muon/lr", "muon/adamw_lr", "muon/ns_ms",
                  "muon/exchange_bytes", "muon/skipped_steps")


class Stopwatch:
    """Time of a region: CUDA events on a GPU (read later, no sync now), ``perf_counter`` elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.begun, self.seconds_ = time.perf_counter(), 0.0

    def stop(self) -> Stopwatch:
        if self.cuda:
            self.end.record()
        else:
            self.seconds_ = time.perf_counter() - self.begun
        return self

    def seconds(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1000
        return self.seconds_


@dataclass
class StepFigures:
    """One Muon group's figures from its last step, on this rank.

    ``norms`` and ``weights``: per Newton–Schulz batch, the norm of each ``O`` this rank orthogonalized
    and its ``(lr * scale)^2`` (owners only, so a sum over ranks counts each tensor once); ``numel``:
    how many elements those matrices hold (the RMS's denominator: what the step updated);
    ``watches``: Newton–Schulz regions; ``exchange_bytes``: bytes this rank sent and received; ``replicated``: every rank orthogonalized
    every tensor (no exchange in a multi-rank run), so a sum over ranks counts each ``world`` times.
    """

    norms: list[Tensor] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    numel: int = 0
    watches: list[Stopwatch] = field(default_factory=list)
    exchange_bytes: int = 0
    replicated: bool = False

    def add_batch(self, ortho: Tensor, weights: list[float]) -> None:
        """One batch Newton–Schulz returned (``[n, rows, cols]``) and each matrix's ``(lr * scale)^2``:
        one reduction kernel now, the rest when read."""
        # in the batch's own dtype: the kernel accumulates in float32 either way, and only rounding the
        # n results to bf16 (2^-9 relative) is lost, where asking for float32 output costs 3x the time
        self.norms.append(torch.linalg.vector_norm(ortho.reshape(ortho.shape[0], -1), dim=1))
        self.weights += weights
        self.numel += ortho.numel()

    def update_sq(self) -> Tensor | None:
        """Sum of squares of ``lr * scale * O`` over what this rank orthogonalized."""
        if not self.norms:
            return None
        norms = torch.cat([n.float() for n in self.norms])
        return (norms.square() * torch.tensor(self.weights, dtype=torch.float32, device=norms.device)).sum()


def adamw_update_sq(optimizer: Any, group: dict, lr: float, tensors: list[Tensor]) -> tuple[Tensor | None, int]:
    """Sum of squares of the update AdamW's last step made to ``tensors`` of ``group`` at learning rate
    ``lr`` (without weight decay), recomputed from its state, and how many elements that covers."""
    from ..distributed.sharding import local

    exp_avgs, exp_avg_sqs, steps = [], [], []
    for p in tensors:
        state = optimizer.state.get(p, {})
        if "exp_avg" in state:  # an FSDP2 shard's own elements: the sum over ranks is taken once, in read()
            exp_avgs.append(local(state["exp_avg"]))
            exp_avg_sqs.append(local(state["exp_avg_sq"]))
            steps.append(float(state["step"]))
    if not exp_avgs:
        return None, 0
    beta1, beta2 = group["betas"]
    total = None
    for step in sorted(set(steps)):  # tensors of one step count share the bias corrections
        chosen = [i for i, s in enumerate(steps) if s == step]
        m = [exp_avgs[i] for i in chosen]
        denom = torch._foreach_sqrt([exp_avg_sqs[i] for i in chosen])
        torch._foreach_div_(denom, math.sqrt(1 - beta2 ** step))
        torch._foreach_add_(denom, group["eps"])
        update = torch._foreach_div(m, denom)
        scale = lr / (1 - beta1 ** step)
        # at least float32 (a norm in bf16 keeps 3 digits); float64 stays float64 (it cannot narrow)
        dtype = torch.float64 if any(u.dtype == torch.float64 for u in update) else torch.float32
        sq = torch.stack(torch._foreach_norm(update, 2, dtype=dtype)).square().sum() * scale ** 2
        total = sq if total is None else total + sq
    return total, sum(t.numel() for t in exp_avgs)


class Telemetry:
    """The figures of an :class:`hf_muon.Muon`'s last step; see :meth:`read`."""

    def __init__(self) -> None:
        self.last: dict[tuple, StepFigures] = {}
        # whether steps record the update norms (the Trainer turns it on only before logged steps)
        self.record_norms = True
        # each group's learning rate in its last step (a scheduler has moved group["lr"] on since)
        self.lrs: dict[int, float] = {}
        # callables returning extra figures (QK-clip's largest logit, the adaptive lr's noise scale)
        self.sources: list[Callable[[], dict[str, float]]] = []
        # per AdamW group, the tensors its last step updated (frozen or unused ones have state but
        # take no part in that step's figures)
        self.adamw_stepped: dict[int, set[int]] = {}

    def new_step(self) -> None:
        """Forget the last step's figures: a step that updates nothing reads as zeros, a group that
        stopped stepping does not keep its old figures. (Not under DeepSpeed ZeRO, which steps one
        group, or one part of one, per ``step()``: each overwrites its own.)"""
        self.last.clear()
        self.adamw_stepped.clear()

    def begin(self, key: tuple) -> StepFigures | None:
        """Fresh figures for one group's step (``key``: the group, and the flat partition if any: ZeRO-3
        steps each of a group's sub-groups on its own); ``None`` in a step that records nothing."""
        if not self.record_norms:
            return None
        self.last[key] = StepFigures()
        return self.last[key]

    def read(self, optimizer: Any, process_group: dist.ProcessGroup | None) -> dict[str, float]:
        """The last step's figures, reduced over the ranks (a collective: every rank calls it)."""
        from .param_split import MUON, shape_of

        device = next((f.norms[0].device for f in self.last.values() if f.norms), torch.device("cpu"))
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1
        world = dist.get_world_size(process_group) if distributed else 1
        muon_sq = torch.zeros((), dtype=torch.float32, device=device)
        muon_numel = 0.0
        for figures in self.last.values():
            sq = figures.update_sq()
            if sq is not None:
                muon_sq = muon_sq + sq.to(device) / (world if figures.replicated else 1)
                muon_numel += figures.numel / (world if figures.replicated else 1)
        adamw_sq = torch.zeros((), dtype=torch.float32, device=device)
        adamw_numel = 0
        for group in optimizer.param_groups:
            index = group["matrices_index"]
            if group["algorithm"] == MUON or index not in self.lrs:
                continue
            stepped = self.adamw_stepped.get(index, set())
            if optimizer._held_by_backend(group):  # flat partitions: every tensor of the group steps
                tensors, model_tensors = optimizer.stepped_tensors(group), optimizer.model_tensors(group)
            else:
                tensors = model_tensors = [p for p in group["params"] if id(p) in stepped]
            sq, _ = adamw_update_sq(optimizer, group, self.lrs[index], tensors)
            if sq is not None:
                # a plain tensor in a multi-rank run is a replica (DDP); flat partitions and DTensor shards are disjoint
                replicas = world if distributed and not optimizer._held_by_backend(group) and not _sharded(group) else 1
                adamw_sq = adamw_sq + sq.to(device) / replicas
                adamw_numel += sum(math.prod(shape_of(t)) for t in model_tensors)
        ns_seconds = sum(w.seconds() for f in self.last.values() for w in f.watches)
        sums = torch.stack([muon_sq, adamw_sq, torch.tensor(float(sum(f.exchange_bytes for f in self.last.values())),
                                                            device=device), torch.tensor(muon_numel, device=device)])
        slowest = torch.tensor([ns_seconds], dtype=torch.float64, device=device)
        if distributed:
            dist.all_reduce(sums, group=process_group)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=process_group)
        muon_sq, adamw_sq, exchanged, muon_numel = sums.tolist()
        lrs = {g["algorithm"]: self.lrs[g["matrices_index"]] for g in reversed(optimizer.param_groups)
               if g["matrices_index"] in self.lrs}  # the first stepped group of each half
        figures = {
            "muon/update_rms": math.sqrt(muon_sq / muon_numel) if muon_numel else 0.0,
            "muon/adamw_update_rms": math.sqrt(adamw_sq / adamw_numel) if adamw_numel else 0.0,
            # the rates the last step used (the Trainer's learning_rate is the scheduler's next one)
            "muon/lr": float(lrs.get(MUON, 0.0)),
            "muon/adamw_lr": float(lrs.get("adamw", 0.0)),
            "muon/ns_ms": slowest.item() * 1000,  # the slowest rank's Newton–Schulz time in the last step
            "muon/exchange_bytes": exchanged / world,  # per rank, last step
            "muon/skipped_steps": float(optimizer.skipped_steps),
        }
        for source in self.sources:
            figures.update(source())
        return figures


def _sharded(group: dict) -> bool:
    from ..distributed.sharding import is_dtensor

    return any(is_dtensor(p) for p in group["params"])
