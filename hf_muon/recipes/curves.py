"""Loss curves of ``Trainer`` runs and the step at which a curve reaches a target loss (shared by
``examples/demo.py`` and figure 5 of ``hf-muon bench``). Standard library only."""

from __future__ import annotations

from typing import Any, Iterable

Curve = list[tuple[float, float]]


def loss_curves(log_history: Iterable[dict[str, Any]]) -> tuple[Curve, Curve]:
    """Train and eval loss curves, ``[(step, loss), ...]``, from ``trainer.state.log_history`` (or the
    ``log_history`` of ``trainer_state.json``); one eval point per step (the last one logged)."""
    history = list(log_history)
    train = [(entry["step"], entry["loss"]) for entry in history if "loss" in entry]
    evals = {entry["step"]: entry["eval_loss"] for entry in history if "eval_loss" in entry}
    return train, sorted(evals.items())


def steps_to_reach(curve: Iterable[tuple[float, float]], target: float) -> float | None:
    """First step at which ``curve`` gets down to ``target``, interpolated linearly between evals;
    ``None`` if it never does."""
    previous: tuple[float, float] | None = None
    for step, loss in curve:
        if loss <= target:
            if previous is None:
                return float(step)
            previous_step, previous_loss = previous
            return previous_step + (previous_loss - target) / (previous_loss - loss) * (step - previous_step)
        previous = (step, loss)
    return None
