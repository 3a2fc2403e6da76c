"""Muon's figures: exact in a plain loop, in every Trainer log, off when asked."""

import os
import sys

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_muon import Muon
from hf_muon.optimizer.telemetry import TELEMETRY_KEYS
from test_trainer import TINY, tiny_llama


def update_rms(before: dict, model, opt, algorithm: str, stepped=None) -> float:
    """RMS of what the last step changed in ``algorithm``'s parameters (those in ``stepped``, by name,
    if given), weight decay taken out."""
    names = {id(p): n for n, p in model.named_parameters()}
    sq, n = 0.0, 0
    for g in opt.param_groups:
        if g["algorithm"] != algorithm:
            continue
        for p in g["params"]:
            if stepped is not None and names[id(p)] not in stepped:
                continue
            old = before[names[id(p)]]
            change = old * (1 - g["lr"] * g["weight_decay"]) - p.detach()
            sq += change.double().square().sum().item()
            n += p.numel()
    return (sq / n) ** 0.5


def test_figures_are_the_last_steps_update():
    model = tiny_llama()
    opt = Muon(model, lr=1e-2, adamw_lr=1e-3, weight_decay=0.1)
    ids = torch.randint(0, 256, (4, 16))
    for _ in range(3):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        figures = opt.telemetry()
        assert set(figures) == set(TELEMETRY_KEYS)
        assert figures["muon/update_rms"] == pytest.approx(update_rms(before, model, opt, "muon"), rel=1e-3)
        assert figures["muon/adamw_update_rms"] == pytest.approx(update_rms(before, model, opt, "adamw"), rel=1e-3)
        assert (figures["muon/lr"], figures["muon/adamw_lr"]) == (1e-2, 1e-3)
        assert figures["muon/ns_ms"] > 0 and figures["muon/exchange_bytes"] == 0 and figures["muon/skipped_steps"] == 0
    ids_bad = ids.clone()
    model(ids_bad, labels=ids_bad).loss.backward()
    next(model.parameters()).grad[0, 0] = float("nan")
    with pytest.warns(UserWarning, match="skipped a step"):
        opt.step()
    figures = opt.telemetry()
    # the skipped step changed nothing: it read as the step before
    assert figures["muon/skipped_steps"] == 1
    assert figures["muon/update_rms"] == figures["muon/adamw_update_rms"] == figures["muon/ns_ms"] == 0


def test_figures_cover_the_tensors_the_step_updated():
    """Muon(model) keeps frozen parameters in its groups: they counted in the RMS's denominator with a
    zero update (0.00124 logged for 0.00176 with half the layers frozen), and a tensor frozen after it
    had stepped kept adding its last AdamW update."""
    model = tiny_llama()
    opt = Muon(model, lr=1e-2, adamw_lr=1e-3, weight_decay=0.1)
    ids = torch.randint(0, 256, (4, 16))

    def step():
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        return opt.telemetry(), before, trained

    step()  # every tensor has state now
    for p in model.model.layers[0].parameters():
        p.requires_grad_(False)
    model.model.embed_tokens.weight.requires_grad_(False)
    figures, before, trained = step()
    for algorithm, key in (("muon", "muon/update_rms"), ("adamw", "muon/adamw_update_rms")):
        assert figures[key] == pytest.approx(update_rms(before, model, opt, algorithm, trained), rel=1e-3)
        assert figures[key] > 1.2 * update_rms(before, model, opt, algorithm)  # all tensors: diluted


def test_figures_of_a_float64_model():
    # the AdamW half's norms were asked in float32, which a float64 update cannot narrow to: an error
    model = tiny_llama().double()
    opt = Muon(model, lr=1e-2, adamw_lr=1e-3, ns_dtype=torch.float64)
    ids = torch.randint(0, 256, (2, 8))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(ids, labels=ids).loss.backward()
    opt.step()
    figures = opt.telemetry()
    assert figures["muon/update_rms"] == pytest.approx(update_rms(before, model, opt, "muon"), rel=1e-6)
    assert figures["muon/adamw_update_rms"] == pytest.approx(update_rms(before, model, opt, "adamw"), rel=1e-6)


def test_telemetry_off_records_nothing_and_says_so():
    model = tiny_llama()
    opt = Muon(model, telemetry=False)
    ids = torch.randint(0, 256, (2, 8))
    model(ids, labels=ids).loss.backward()
    opt.step()
    assert opt._telemetry.last == {}
    with pytest.raises(RuntimeError, match="telemetry=True"):
        opt.telemetry()


@pytest.mark.parametrize("optim_args, logged", [("adamw_lr=1e-3", True), ("telemetry=false", False)])
def test_every_trainer_log_carries_the_figures(tmp_path, optim_args, logged):
    sys.path.insert(0, os.path.dirname(TINY))
    try:
        from train_tiny import Bytes
    finally:
        sys.path.pop(0)
    args = TrainingArguments(output_dir=str(tmp_path), optim="muon", optim_args=optim_args, learning_rate=1e-2,
                             max_steps=4, logging_steps=2, per_device_train_batch_size=4, report_to="none",
                             save_strategy="no", use_cpu=True, lr_scheduler_type="constant")
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=Bytes(open(TINY, "rb").read()))
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 2
    for entry in logs:
        assert (set(TELEMETRY_KEYS) <= set(entry)) == logged, entry
        if logged:  # both halves' rates: the Trainer's own learning_rate is the first group's only
            assert (entry["muon/lr"], entry["muon/adamw_lr"]) == (1e-2, 1e-3)
            assert entry["muon/update_rms"] > 0 and entry["muon/adamw_update_rms"] > 0


def test_trainer_records_update_norms_only_before_logged_steps(tmp_path, monkeypatch):
    from hf_muon.optimizer import telemetry

    sys.path.insert(0, os.path.dirname(TINY))
    try:
        from train_tiny import Bytes
    finally:
        sys.path.pop(0)
    args = TrainingArguments(output_dir=str(tmp_path), optim="muon", learning_rate=1e-2, max_steps=7, logging_steps=3,
                             per_device_train_batch_size=4, report_to="none", save_strategy="no", use_cpu=True)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=Bytes(open(TINY, "rb").read()))
    recorded = []
    original = telemetry.StepFigures.add_batch
    monkeypatch.setattr(telemetry.StepFigures, "add_batch",
                        lambda self, *a: recorded.append(trainer.state.global_step + 1) or original(self, *a))
    trainer.train()
    assert sorted(set(recorded)) == [3, 6, 7]  # the logged steps, and the last one
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in logs] == [3, 6] and all(e["muon/update_rms"] > 0 for e in logs)
