"""Learning rate scaled in real time from the gradient noise scale (McCandlish et al. 2018,
"An Empirical Model of Large-Batch Training", appendix A), with no extra backward pass.

Two gradient norms are measured every optimizer step:

* ``|G_small|^2``: each micro-batch's own gradient on each rank (``B_small`` examples), seen by
  per-parameter tensor hooks before DDP/ZeRO reduce it, summed on device (no host sync per
  micro-batch) and averaged over the step's ``W * GAS`` micro-batches.
* ``|G_big|^2``: the averaged gradient the optimizer steps with (``B_big = W * GAS * B_small``),
  read in an optimizer step pre-hook.

From them, unbiased estimates of the true gradient's squared norm and of the noise's trace::

    |G|^2 = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    S     = (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

each smoothed by its own bias-corrected EMA (as McCandlish/OpenAI do; the ratio of two noisy
estimates is biased), and ``B_noise = EMA(S) / EMA(|G|^2)``.

The learning-rate multiplier is ``m = clip(sqrt(B_big / B_noise), *bounds)`` (the square-root
batch-size rule of adaptive/normalized optimizers: Muon's orthogonalized update and AdamW are both
scale-free in the gradient), 1 for the first ``warmup_steps`` measured steps. It multiplies every
param group's ``lr`` (both halves of :class:`hf_muon.Muon`) inside ``step()`` only: the pre-hook sets
``lr *= m``, the post-hook puts the scheduler's value back, so schedulers and logs see their own lr.
``m`` used at step ``t`` comes from the measurements of steps ``< t`` (ZeRO-1/2 call ``step()`` once
per group, and the lr must be set before the first one).

Gradient scaling undone: the hooks see ``dL_i/dθ / GAS`` for micro-batch ``i`` (Trainer: loss / GAS,
or token sum / global token count x W with equal tokens per micro-batch; DeepSpeed's
``engine.backward``: loss / GAS), so they multiply by ``GAS``. A ``torch.amp.GradScaler``'s loss
scale is taken out of both norms before they enter the EMAs (where steps at different scales would
not cancel): the scale ``GradScaler.step`` hands the optimizer, or, where ``scaler.unscale_`` ran
before ``step()`` (clipping) and only ``|G_big|`` is unscaled, the ``grad_scaler`` given.

Supported: one process with GAS >= 2, DDP (any GAS), DeepSpeed ZeRO-1/2 in fp32/bf16. Refused with a
message: FSDP2 (its sharded parameters' hooks see the reduce-scattered gradient, not a rank's
micro-batch gradient), ZeRO-3 (not verified), DeepSpeed fp16 (the hooks see loss-scaled gradients,
the optimizer unscaled ones), and one process with GAS 1 (one batch size only: nothing to compare).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = ["GradientNoiseScale", "NoiseScaleEstimate", "estimate_from_norms", "lr_multiplier_from_noise_scale"]

STATE_VERSION = 1


@dataclass(frozen=True)
class NoiseScaleEstimate:
    """One step's unbiased estimates: ``true_grad_sq`` (``|G|^2``) and ``noise_trace`` (``S = tr Σ``)."""

    true_grad_sq: float
    noise_trace: float


def estimate_from_norms(small_sq: float, big_sq: float, b_small: float, b_big: float) -> NoiseScaleEstimate:
    """McCandlish et al.'s unbiased ``|G|^2`` and ``S`` from the squared norms of gradients of batches of
    ``b_small`` and ``b_big`` examples (``E|G_B|^2 = |G|^2 + S / B``)."""
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got b_small={b_small}, b_big={b_big}")
    true_grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    noise_trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return NoiseScaleEstimate(true_grad_sq, noise_trace)


def lr_multiplier_from_noise_scale(noise_scale: float, global_batch_size: float,
                                   bounds: tuple[float, float]) -> float:
    """``clip(sqrt(global_batch_size / noise_scale), *bounds)``.

    A noise scale at or below 0 (no measurable noise) gives the upper bound; ``inf`` or NaN (no
    measurable signal: the smoothed ``|G|^2`` is not positive) gives the lower bound."""
    low, high = bounds
    if math.isnan(noise_scale) or noise_scale == math.inf:
        return low
    if noise_scale <= 0:
        return high
    return min(high, max(low, math.sqrt(global_batch_size / noise_scale)))


class GradientNoiseScale:
    """Measures the gradient noise scale of a training run and scales its learning rate from it.

    Build it after the optimizer exists, before training; ``attach()`` installs the hooks::

        noise = GradientNoiseScale(model, optimizer, micro_batch_size=16, accumulation_steps=4,
                                   world_size=2).attach()
        ...  # train as usual: every optimizer.step() measures, and steps with lr * noise.lr_multiplier
        noise.noise_scale, noise.lr_multiplier   # for logging

    Args:
        model: the trained module (or a wrapper whose ``parameters()`` are its parameters: DDP,
            a DeepSpeed engine). Hooks go on every parameter that requires a gradient.
        optimizer: the optimizer whose ``step()`` uses the averaged gradients (unwrapped: the one
            Accelerate/DeepSpeed call; :class:`hf_muon.Muon` or any ``torch.optim.Optimizer``).
        micro_batch_size: examples per micro-batch per rank (``B_small``). Any unit works (examples,
            tokens) as long as it is the same one ``global_batch_size`` is counted in.
        accumulation_steps: micro-batches per optimizer step on each rank (GAS). The hooks' gradients
            are multiplied by it (the loss of each micro-batch was divided by it).
        world_size: data-parallel ranks; ``None``: ``torch.distributed``'s world (1 without it).
        ema: EMA factor of the smoothed ``|G|^2`` and ``S``, in ``[0, 1)``.
        bounds: ``(min, max)`` of the learning-rate multiplier, ``0 < min <= 1 <= max``.
        warmup_steps: measured steps during which the multiplier stays 1 (the EMAs settle).
        max_grad_norm: the gradient clipping threshold applied before ``step()`` (Trainer's
            ``max_grad_norm``); a step whose measured ``|G_big|`` is at it was clipped, its norm is not
            the gradient's, and it is left out of the estimate (counted in ``clipped_steps``).
            ``None``: the DeepSpeed engine's ``gradient_clipping`` when ``model`` is one (DeepSpeed's
            default is 1.0), else no clipping; 0: no clipping.
        adapt_lr: ``False`` measures only (the multiplier is computed but not applied).
        process_group: the data-parallel group (``None``: the default world).
        grad_scaler: the ``torch.amp.GradScaler`` of an fp16 loop: its scale is taken out of the
            micro-batch norms where the optimizer gets unscaled gradients. With :class:`hf_muon.Muon`
            it is needed only where ``scaler.unscale_`` runs before ``step()`` (to clip; without it
            such a step raises), since ``GradScaler.step`` otherwise hands Muon its scale, which is
            taken out of both norms. Any other optimizer gets unscaled gradients from
            ``GradScaler.step`` and cannot tell: pass it whenever a GradScaler is used.

    Attributes:
        steps: optimizer steps seen. measured_steps: steps that entered the estimate.
        clipped_steps / skipped_steps: steps left out (clipped; another number of micro-batches
            than ``accumulation_steps``, or non-finite norms).
        last: the last measured step's raw ``NoiseScaleEstimate`` (``None`` before one).
        last_norms: its ``(|G_small|^2, |G_big|^2)``: the micro-batch gradients' mean squared norm (GAS
            undone) and the averaged gradient's.
    """

    def __init__(self, model: nn.Module, optimizer: Optimizer, micro_batch_size: int, accumulation_steps: int = 1,
                 world_size: int | None = None, *, ema: float = 0.95, bounds: tuple[float, float] = (0.5, 2.0),
                 warmup_steps: int = 10, max_grad_norm: float | None = None, adapt_lr: bool = True,
                 process_group: dist.ProcessGroup | None = None, grad_scaler: Any = None) -> None:
        if world_size is None:
            world_size = dist.get_world_size(process_group) if dist.is_available() and dist.is_initialized() else 1
        if micro_batch_size < 1 or accumulation_steps < 1 or world_size < 1:
            raise ValueError(f"micro_batch_size, accumulation_steps and world_size must be >= 1, got "
                             f"{micro_batch_size}, {accumulation_steps}, {world_size}")
        if world_size * accumulation_steps < 2:
            raise ValueError(
                "GradientNoiseScale needs two batch sizes: with one process and gradient_accumulation_steps=1 "
                "the micro-batch is the whole batch, so the noise cannot be told from the signal. Use "
                "gradient_accumulation_steps >= 2 (same global batch: halve the per-device batch size), or "
                "several data-parallel ranks, or leave adaptive_lr off.")
        if not 0 <= ema < 1:
            raise ValueError(f"ema must be in [0, 1), got {ema}")
        low, high = bounds
        if not 0 < low <= 1 <= high:
            raise ValueError(f"bounds must satisfy 0 < min <= 1 <= max, got {bounds}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        self.model = model
        self.optimizer = optimizer
        self.micro_batch_size = micro_batch_size
        self.accumulation_steps = accumulation_steps
        self.world_size = world_size
        self.global_batch_size = micro_batch_size * accumulation_steps * world_size
        self.ema = ema
        self.bounds = (float(low), float(high))
        self.warmup_steps = warmup_steps
        engine_clipping = getattr(model, "gradient_clipping", None)  # a DeepSpeed engine clips inside step()
        if max_grad_norm is None and callable(engine_clipping):
            max_grad_norm = float(engine_clipping())
        self.max_grad_norm = max_grad_norm or None
        self.adapt_lr = adapt_lr
        self.grad_scaler = grad_scaler
        self._last_multiplier = 1.0
        self._scale_sq = (1.0, 1.0)  # the loss scale squared in |G_small|^2 and |G_big|^2 (GradScaler)
        self.process_group = process_group
        # smoothed estimates; the weight makes the EMA unbiased (Adam-style bias correction)
        self.steps = 0
        self.measured_steps = 0
        self.clipped_steps = 0
        self.skipped_steps = 0
        self._ema_true_grad_sq = 0.0
        self._ema_noise_trace = 0.0
        self._ema_weight = 0.0
        self._multiplier = 1.0
        self.last: NoiseScaleEstimate | None = None
        self.last_norms: tuple[float, float] | None = None
        # per-step accumulators
        self._small_sq_sum: Tensor | None = None  # on device: sum over micro-batches of |g_small|^2
        self._micro_batches = 0
        self._big_sharded: list[Tensor] = []
        self._big_replicated: list[Tensor] = []
        self._groups_seen: set[Any] = set()
        self._saved_lrs: list[tuple[dict, float]] = []
        self._handles: list[Any] = []

    # ------------------------------------------------------------------------------ public values

    @property
    def noise_scale(self) -> float:
        """``B_noise = EMA(S) / EMA(|G|^2)`` in the unit of the batch sizes; NaN before a measurement,
        ``inf`` while the smoothed ``|G|^2`` is not positive."""
        if self._ema_weight == 0:
            return math.nan
        if self._ema_true_grad_sq <= 0:
            return math.inf
        return self._ema_noise_trace / self._ema_true_grad_sq

    @property
    def lr_multiplier(self) -> float:
        """The factor the next ``step()`` multiplies every group's lr by (1 when ``adapt_lr=False``)."""
        return self._multiplier if self.adapt_lr else 1.0

    @property
    def last_lr_multiplier(self) -> float:
        """The factor the last ``step()`` multiplied the lrs by (the one in ``muon/lr``; 1 before any)."""
        return self._last_multiplier

    # ------------------------------------------------------------------------------ hooks

    def attach(self) -> GradientNoiseScale:
        """Install the gradient hooks on the model's parameters and the step hooks on the optimizer."""
        if self._handles:
            raise RuntimeError("GradientNoiseScale.attach() was already called")
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("GradientNoiseScale: the model has no parameter that requires a gradient")
        # |G_small| and |G_big| must cover the same tensors: those the optimizer steps (another optimizer
        # may train the rest, e.g. the embeddings)
        stepped = self._stepped_tensor_ids()
        if stepped & {id(p) for p in params}:
            params = [p for p in params if id(p) in stepped]
        self._refuse_unsupported(params)
        self._groups_total = {self._group_key(i, g) for i, g in enumerate(self.optimizer.param_groups)}
        for p in params:
            self._handles.append(p.register_hook(self._on_micro_batch_grad))
        # one parameter counts the backward passes (its hook fires once per backward)
        self._handles.append(params[0].register_hook(self._count_micro_batch))
        self._handles.append(self.optimizer.register_step_pre_hook(self._before_step))
        self._handles.append(self.optimizer.register_step_post_hook(self._after_step))
        return self

    def detach(self) -> None:
        """Remove every hook (the lr is left as the scheduler set it)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _stepped_tensor_ids(self) -> set[int]:
        """``id`` of the model tensors the optimizer steps: hf_muon.Muon's own record (a backend may swap
        its groups' tensors for flat partitions), else the param groups' tensors."""
        tensors = getattr(self.optimizer, "_group_tensors", None)
        if tensors is None:
            tensors = [group["params"] for group in self.optimizer.param_groups]
        return {id(t) for group in tensors for t in group}

    def _refuse_unsupported(self, params: list[Tensor]) -> None:
        from ..distributed.sharding import is_dtensor

        if any(is_dtensor(p) for p in params):
            raise NotImplementedError(
                "GradientNoiseScale does not support FSDP2: hooks on its sharded parameters see the gradient "
                "after the reduce-scatter (averaged over ranks), not one rank's micro-batch gradient, so "
                "|G_small|^2 cannot be measured. Train with DDP or DeepSpeed ZeRO-1/2, or leave adaptive_lr off.")
        if any(hasattr(p, "ds_id") for p in params):
            raise NotImplementedError(
                "GradientNoiseScale does not support DeepSpeed ZeRO-3 (what its parameters' hooks see is not "
                "verified). Use ZeRO-1/2 or DDP, or leave adaptive_lr off.")
        fp16 = getattr(self.model, "fp16_enabled", None)
        if callable(fp16) and fp16():
            raise NotImplementedError(
                "GradientNoiseScale does not support DeepSpeed fp16: the hooks see loss-scaled gradients and the "
                "optimizer unscaled ones, so the two norms do not compare. Use bf16 or fp32, or leave adaptive_lr off.")

    def _count_micro_batch(self, grad: Tensor) -> None:
        self._micro_batches += 1

    def _on_micro_batch_grad(self, grad: Tensor) -> None:
        # |dL_i/dθ / GAS|^2 summed on device; multiplied by GAS^2 once per step
        sq = grad.detach().float().square().sum()
        if self._small_sq_sum is None:
            self._small_sq_sum = sq
        else:
            self._small_sq_sum = self._small_sq_sum + sq

    @staticmethod
    def _group_key(index: int, group: dict) -> Any:
        # hf_muon.Muon numbers its groups; ZeRO-1/2 shows them one at a time, so the position is not it
        return group.get("matrices_index", index)

    def _before_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        from ..distributed.sharding import is_dtensor, local

        # GradScaler.step sets grad_scale to None when scaler.unscale_ already ran (clipping): the
        # gradients here are unscaled, the micro-batch ones the hooks saw were not
        takes_scale = hasattr(optimizer, "found_inf")  # hf_muon.Muon: GradScaler.step hands it the scale
        # unscaled before step(): by scaler.unscale_, or by GradScaler.step for an optimizer that does not
        # take the scale itself (torch.optim.AdamW); the micro-batch norms still carry it
        unscaled = getattr(optimizer, "grad_scale", None) is None if takes_scale else self._unscaled_by_grad_scaler(optimizer)
        if takes_scale and unscaled and self.grad_scaler is None:
            raise RuntimeError(
                "GradientNoiseScale: a GradScaler unscaled the gradients before step() (scaler.unscale_, e.g. "
                "to clip them), but the micro-batch gradients were measured loss-scaled: pass "
                "grad_scaler=scaler so their scale is taken out")
        if unscaled:
            self._scale_sq = (float(self.grad_scaler.get_scale()) ** 2, 1.0)
        elif takes_scale:
            # GradScaler.step hands the optimizer scaled gradients and the scale: both norms carry it. It
            # would cancel in one step's ratio, but not in the EMAs of steps at different scales (the
            # scale halves at each overflow and doubles after growth_interval steps)
            scale_sq = float(optimizer.grad_scale) ** 2
            self._scale_sq = (scale_sq, scale_sq)

        self._last_multiplier = self.lr_multiplier
        if not hasattr(self, "_model_tensor_ids"):
            self._model_tensor_ids = {id(p) for p in self.model.parameters()}
        groups = optimizer.param_groups
        sharded, replicated = [], []
        for i, group in enumerate(groups):
            if "matrices_index" not in group and len(groups) != len(self._groups_total):
                raise RuntimeError("GradientNoiseScale: step() was given a subset of the param groups of an "
                                   "optimizer that does not number them (DeepSpeed ZeRO-1/2); use hf_muon.Muon")
            self._groups_seen.add(self._group_key(i, group))
            for p in group["params"]:
                if p.grad is None:
                    continue
                # whole tensors are the same on every rank (DDP, DeepSpeed stage 0's fp32 copies); DTensor
                # shards and ZeRO flat partitions are disjoint pieces, summed over ranks
                whole = id(p) in self._model_tensor_ids or self._is_whole_copy(group, p)
                (sharded if is_dtensor(p.grad) or not whole else replicated).append(local(p.grad).detach())
            if self.adapt_lr and self._multiplier != 1.0:
                self._saved_lrs.append((group, group["lr"]))
                group["lr"] = group["lr"] * self._multiplier
        # one foreach reduction per kind, not one per tensor
        for grads, into in ((sharded, self._big_sharded), (replicated, self._big_replicated)):
            if grads:
                into.append(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum())

    def _unscaled_by_grad_scaler(self, optimizer: Optimizer) -> bool:
        """Whether ``grad_scaler`` unscaled ``optimizer``'s gradients in the step being taken."""
        if self.grad_scaler is None:
            return False
        from torch.amp.grad_scaler import OptState

        # GradScaler keeps each optimizer's stage (READY, UNSCALED, STEPPED) in this dict
        states = getattr(self.grad_scaler, "_per_optimizer_states", None)
        if not isinstance(states, dict):
            raise RuntimeError(f"GradientNoiseScale: this torch's GradScaler ({torch.__version__}) keeps no "
                               "_per_optimizer_states, so whether it unscaled the gradients cannot be read")
        return id(optimizer) in states and states[id(optimizer)].get("stage") is OptState.UNSCALED

    def _is_whole_copy(self, group: dict, p: Tensor) -> bool:
        is_flat = getattr(self.optimizer, "_is_backend_flat", None)
        if is_flat is not None:
            return not is_flat(group, p)
        return p.ndim != 1  # another optimizer: only a 1-D tensor that is no parameter can be a flat partition

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        for group, lr in self._saved_lrs:
            group["lr"] = lr
        self._saved_lrs = []
        if self._groups_seen >= self._groups_total:
            self._finish_step()

    # ------------------------------------------------------------------------------ estimate

    def _finish_step(self) -> None:
        """All groups stepped: combine over ranks (one all-reduce), update the EMAs and the multiplier.
        Every rank gets here at the same step, so the collective matches."""
        device = self._device()
        zero = torch.zeros((), device=device)
        small = self._small_sq_sum if self._small_sq_sum is not None else zero
        sharded = torch.stack(self._big_sharded).sum() if self._big_sharded else zero
        replicated = torch.stack(self._big_replicated).sum() if self._big_replicated else zero
        sums = torch.stack([small.to(device), sharded.to(device), torch.tensor(float(self._micro_batches), device=device)])
        if self.world_size > 1:
            dist.all_reduce(sums, group=self.process_group)
        # the one host sync per step
        small_total, sharded_total, micro_total, replicated_total = torch.cat([sums, replicated.view(1).to(device)]).double().tolist()
        (small_scale_sq, big_scale_sq), self._scale_sq = self._scale_sq, (1.0, 1.0)
        big_sq = (sharded_total + replicated_total) / big_scale_sq
        self._small_sq_sum, self._micro_batches = None, 0
        self._big_sharded, self._big_replicated, self._groups_seen = [], [], set()
        self.steps += 1
        expected = self.world_size * self.accumulation_steps
        if int(micro_total) != expected:
            self.skipped_steps += 1
            if self.skipped_steps == 1:
                warnings.warn(
                    f"GradientNoiseScale: an optimizer step had {int(micro_total)} micro-batch backward passes over "
                    f"all ranks where {expected} (world_size x accumulation_steps) were configured; such steps are "
                    "left out of the estimate (an epoch's last, shorter accumulation; a GradScaler that skipped "
                    "another optimizer's step on an overflow, so that its micro-batches count in the next; or "
                    "reentrant activation checkpointing, which runs several backward passes per micro-batch: use "
                    "use_reentrant=False).")
            return
        small_sq = small_total * self.accumulation_steps**2 / expected  # undo the 1/GAS, mean over micro-batches
        small_sq /= small_scale_sq
        if not (math.isfinite(small_sq) and math.isfinite(big_sq)):
            self.skipped_steps += 1
            return
        if self.max_grad_norm is not None and math.sqrt(big_sq) >= self.max_grad_norm * (1 - 1e-4):
            self.clipped_steps += 1
            return
        self.last_norms = (small_sq, big_sq)
        self.last = estimate_from_norms(small_sq, big_sq, self.micro_batch_size, self.global_batch_size)
        self.update(self.last)

    def update(self, estimate: NoiseScaleEstimate) -> None:
        """Fold one step's estimate into the EMAs and recompute the multiplier (the hooks call this;
        exposed for estimators fed by hand)."""
        beta = self.ema
        self._ema_true_grad_sq = beta * self._ema_true_grad_sq + (1 - beta) * estimate.true_grad_sq
        self._ema_noise_trace = beta * self._ema_noise_trace + (1 - beta) * estimate.noise_trace
        self._ema_weight = beta * self._ema_weight + (1 - beta)
        self.measured_steps += 1
        if self.measured_steps > self.warmup_steps:
            self._multiplier = lr_multiplier_from_noise_scale(self.noise_scale, self.global_batch_size, self.bounds)

    def _device(self) -> torch.device:
        for t in (self._small_sq_sum, *self._big_sharded, *self._big_replicated):
            if t is not None:
                return t.device
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Plain Python numbers (JSON-serializable): the EMAs with their bias-correction weight, step
        counts, the current multiplier and the batch sizes. The same on every rank."""
        return {"version": STATE_VERSION, "steps": self.steps, "measured_steps": self.measured_steps,
                "clipped_steps": self.clipped_steps, "skipped_steps": self.skipped_steps,
                "ema_true_grad_sq": self._ema_true_grad_sq, "ema_noise_trace": self._ema_noise_trace,
                "ema_weight": self._ema_weight, "lr_multiplier": self._multiplier,
                "global_batch_size": self.global_batch_size, "micro_batch_size": self.micro_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. The batch sizes may differ from the saved run's (``B_noise`` does
        not depend on them); the multiplier is then recomputed for this run's global batch."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"GradientNoiseScale state of version {state.get('version')!r}; this hf_muon reads "
                             f"version {STATE_VERSION}")
        self.steps, self.measured_steps = int(state["steps"]), int(state["measured_steps"])
        self.clipped_steps, self.skipped_steps = int(state["clipped_steps"]), int(state["skipped_steps"])
        self._ema_true_grad_sq = float(state["ema_true_grad_sq"])
        self._ema_noise_trace = float(state["ema_noise_trace"])
        self._ema_weight = float(state["ema_weight"])
        self._multiplier = float(state["lr_multiplier"])
        if state.get("global_batch_size") != self.global_batch_size and self.measured_steps > self.warmup_steps:
            self._multiplier = lr_multiplier_from_noise_scale(self.noise_scale, self.global_batch_size, self.bounds)
