"""Muon's figures in every Trainer log: ``trainer.state.log_history`` and each ``report_to`` logger.

``Trainer.log`` is wrapped: a training log (the one with ``loss``, written at each logging step, on
every rank) gets :meth:`hf_muon.Muon.telemetry`'s figures before the Trainer stores and reports it.
The Trainer's own ``learning_rate`` is the first group's; ``muon/lr`` and ``muon/adamw_lr`` give
both halves'. ``--optim_args telemetry=false`` turns it off.
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


def on_trainer(trainer_module: Any) -> None:
    """Import hook of ``transformers.trainer`` (idempotent)."""
    trainer_cls = internal(trainer_module, "Trainer", LIBRARY)

    def wrap_log(original):
        def log(self: Any, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
            add_figures(self, logs)
            return original(self, logs, *args, **kwargs)

        return log

    wrap_once(trainer_cls, "log", wrap_log, LIBRARY)
