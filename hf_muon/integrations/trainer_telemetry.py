"""Muon's figures in every Trainer log: ``trainer.state.log_history`` and each ``report_to`` logger.

``Trainer.log`` is wrapped: a training log (the one with ``loss``, written at each logging step, on
every rank) gets :meth:`hf_muon.Muon.telemetry`'s figures before the Trainer stores and reports it.
The Trainer's own ``learning_rate`` is the first group's; ``muon/lr`` and ``muon/adamw_lr`` give
both halves'. ``--optim_args telemetry=false`` turns it off.

The update norms (the one part that costs a pass over the updates) are recorded only in the steps
whose figures will be logged: with ``logging_strategy="steps"`` a step pre-hook knows which.
"""

from __future__ import annotations

from typing import Any

from .compat import internal, wrap_once
from .trainer_checkpoints import muon_of

LIBRARY = "transformers"


def add_figures(trainer: Any, logs: dict[str, float]) -> None:
    """Put the optimizer's last-step figures into a training log (every rank calls this: it reduces)."""
    optimizer = muon_of(getattr(trainer, "optimizer", None))
    if optimizer is None or not optimizer.telemetry_enabled or "loss" not in logs:
        return
    logs.update(optimizer.telemetry())


def logged_next(trainer: Any) -> bool:
    """Whether the step about to run will be logged (``logging_strategy="steps"``; else: assume so)."""
    args, state = trainer.args, trainer.state
    if str(getattr(args.logging_strategy, "value", args.logging_strategy)) != "steps" or not state.logging_steps:
        return True
    step = state.global_step + 1
    return step % state.logging_steps == 0 or (args.logging_first_step and step == 1) or step >= state.max_steps


def install(trainer: Any) -> None:
    """Record the update norms only before logged steps, once training begins (called as the Trainer is built)."""
    from transformers import TrainerCallback

    class RecordBeforeLoggedSteps(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            optimizer = muon_of(trainer.optimizer)
            if optimizer is not None and optimizer.telemetry_enabled:
                optimizer.register_step_pre_hook(
                    lambda opt, a, k: setattr(opt._telemetry, "record_norms", logged_next(trainer)))

    trainer.add_callback(RecordBeforeLoggedSteps())


def on_trainer(trainer_module: Any) -> None:
    """Import hook of ``transformers.trainer`` (idempotent)."""
    trainer_cls = internal(trainer_module, "Trainer", LIBRARY)

    def wrap_log(original):
        def log(self: Any, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
            add_figures(self, logs)
            return original(self, logs, *args, **kwargs)

        return log

    wrap_once(trainer_cls, "log", wrap_log, LIBRARY)
