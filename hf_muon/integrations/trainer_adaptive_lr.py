"""``--optim_args adaptive_lr=true``: the Trainer's run measures the gradient noise scale and scales
both halves' learning rates from it (:class:`hf_muon.optimizer.noise_scale.GradientNoiseScale`).

The estimator needs the prepared model (DDP or DeepSpeed's engine) and the Trainer's batch sizes,
so it is attached when training begins, after a resume has loaded the checkpoint: the estimate
saved in ``hf_muon_state/`` waits on the optimizer until then. Its figures join the telemetry
(``muon/noise_scale``, ``muon/lr_multiplier``).
"""

from __future__ import annotations

from typing import Any


def requested(trainer: Any) -> bool:
    from .transformers import _is_muon, parse_optim_args

    return _is_muon(trainer.args.optim) and parse_optim_args(trainer.args.optim_args).get("adaptive_lr", False)


class PendingNoiseState:
    """Holds a checkpoint's noise-scale state until the estimator exists (``load_portable`` fills it)."""

    def __init__(self) -> None:
        self.state: dict | None = None

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def estimator_for_checkpoint(trainer: Any) -> Any:
    """What ``save_portable``/``load_portable`` get as ``noise_scale`` for this Trainer (``None``: off)."""
    from .trainer_checkpoints import muon_of

    if not requested(trainer):
        return None
    muon = muon_of(trainer.optimizer)
    found = getattr(muon, "noise_scale_estimator", None)
    if found is None:  # resuming: training has not begun yet
        found = muon.pending_noise_state = PendingNoiseState()
    return found


def attach(trainer: Any) -> None:
    """Build and attach the estimator for a Trainer that starts training (every rank)."""
    from ..optimizer.noise_scale import GradientNoiseScale
    from .trainer_checkpoints import muon_of

    muon = muon_of(trainer.optimizer)
    if muon is None or getattr(muon, "noise_scale_estimator", None) is not None:
        return
    args = trainer.args
    noise = GradientNoiseScale(trainer.model_wrapped, muon, micro_batch_size=args.per_device_train_batch_size,
                               accumulation_steps=args.gradient_accumulation_steps, world_size=args.world_size,
                               max_grad_norm=args.max_grad_norm or None,
                               # fp16: Trainer unscales before clipping (Accelerate's GradScaler)
                               grad_scaler=getattr(trainer.accelerator, "scaler", None)).attach()
    pending = getattr(muon, "pending_noise_state", None)
    if pending is not None and pending.state is not None:
        noise.load_state_dict(pending.state)
    muon.noise_scale_estimator = noise
    muon.add_telemetry_source(lambda: {"muon/noise_scale": noise.noise_scale, "muon/lr_multiplier": noise.last_lr_multiplier})


def install(trainer: Any) -> None:
    """Add the callback that attaches the estimator, if ``adaptive_lr=true`` (called once the Trainer is built)."""
    if not requested(trainer):
        return
    from transformers import TrainerCallback

    class AttachNoiseScale(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            attach(trainer)

    trainer.add_callback(AttachNoiseScale())

