"""Gradient noise scale and the adaptive learning rate (hf_muon.optimizer.noise_scale)."""

import json
import math
import os
import sys

import pytest
import torch
from torch import nn

from hf_muon.optimizer.noise_scale import (GradientNoiseScale, NoiseScaleEstimate, estimate_from_norms,
                                           lr_multiplier_from_noise_scale)

from test_distributed import torchrun

HERE = os.path.dirname(os.path.abspath(__file__))


class Linear(nn.Module):
    """``loss = θ · (G + ε)``: its gradient is the true gradient plus noise of a known variance."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(d))

    def forward(self, direction: torch.Tensor) -> torch.Tensor:
        return (self.theta * direction).sum()


def test_estimator_converges_to_the_known_noise_scale():
    # per-example gradient G + ε, ε ~ N(0, σ² I): S = d σ², B_noise = d σ² / |G|² = 64
    torch.manual_seed(0)
    d, sigma, b_small, gas = 1000, 0.8, 4, 8
    true = torch.full((d,), 0.1)
    model = Linear(d)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    noise = GradientNoiseScale(model, optimizer, micro_batch_size=b_small, accumulation_steps=gas, ema=0.99,
                               warmup_steps=0).attach()
    for _ in range(400):
        for _ in range(gas):  # a micro-batch of b_small examples: noise variance σ² / b_small
            direction = true + sigma / math.sqrt(b_small) * torch.randn(d)
            (model(direction) / gas).backward()
        optimizer.step()
        optimizer.zero_grad()
    expected = d * sigma**2 / true.square().sum().item()
    assert noise.measured_steps == 400
    assert noise.noise_scale == pytest.approx(expected, rel=0.1)
    assert noise.lr_multiplier == pytest.approx(math.sqrt(b_small * gas / expected), rel=0.06)


def test_unbiased_formulas_on_exact_expectations():
    # E|G_B|² = |G|² + S / B exactly: the estimates are exact
    g2, s = 3.0, 50.0
    est = estimate_from_norms(g2 + s / 2, g2 + s / 16, 2, 16)
    assert est.true_grad_sq == pytest.approx(g2) and est.noise_trace == pytest.approx(s)
    with pytest.raises(ValueError):
        estimate_from_norms(1.0, 1.0, 4, 4)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def grad_of(model, batch, params=None) -> torch.Tensor:
    model.zero_grad()
    model(**batch).loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in (params or list(model.parameters()))])


def check_norms_in_a_plain_loop(model, optimizer, params=None, gas: int = 3, mb: int = 2) -> None:
    """The hooks' ``|G_small|^2`` and ``|G_big|^2`` over ``params`` (default: all) equal each micro-batch's
    own gradient computed apart, in a plain accumulation loop."""
    torch.manual_seed(1)
    batches = [{"input_ids": (ids := torch.randint(0, 64, (mb, 16))), "labels": ids} for _ in range(gas)]
    micro = [grad_of(model, b, params) for b in batches]
    model.zero_grad()
    noise = GradientNoiseScale(model, optimizer, micro_batch_size=mb, accumulation_steps=gas).attach()
    for b in batches:
        (model(**b).loss / gas).backward()
    optimizer.step()
    small = sum(g.square().sum() for g in micro).item() / gas
    big = (sum(micro) / gas).square().sum().item()
    assert noise.last_norms == pytest.approx((small, big), rel=1e-5)
    noise.detach()


def test_hooks_measure_each_micro_batch_and_undo_accumulation_in_a_plain_loop():
    model = tiny_llama()
    check_norms_in_a_plain_loop(model, torch.optim.SGD(model.parameters(), lr=0.0))


@pytest.mark.parametrize("optimizer_kind", ["hf_muon", "sgd"])
def test_both_norms_cover_the_tensors_the_optimizer_steps(optimizer_kind):
    """An optimizer of the decoder layers only (another trains the embeddings): |G_small| covered every
    trainable parameter and |G_big| the optimizer's, so the noise scale read 7.99 instead of 0.12."""
    from hf_muon import Muon

    model = tiny_llama()
    layers = [p for n, p in model.named_parameters() if ".layers." in n]
    optimizer = Muon(layers, model=model, lr=0.0) if optimizer_kind == "hf_muon" else torch.optim.SGD(layers, lr=0.0)
    check_norms_in_a_plain_loop(model, optimizer, layers, gas=2)


@pytest.mark.filterwarnings("ignore:hf_muon.Muon skipped a step")  # the overflow the test makes
@pytest.mark.parametrize("optimizer_kind,unscale_first", [("hf_muon", False), ("hf_muon", True), ("adamw", False)])
def test_a_grad_scalers_loss_scale_is_taken_out(optimizer_kind, unscale_first):
    """fp16's usual loop unscales before clipping (``scaler.unscale_``): |G_big| was unscaled and the
    micro-batch norms not, so the noise scale read inf and the multiplier sat at its lower bound.
    Without ``unscale_`` both norms were scaled: one step's ratio held, but the EMAs mixed steps at
    different scales (an overflow halves it): 262.6 where an unscaled loop measures 447.0. With
    torch.optim.AdamW (which GradScaler.step unscales for) the micro-batch norms stayed scaled: inf. An
    fp32 model, so loss scaling by powers of 2 is exact: every step must measure what the plain loop
    does. (AdamW would step on the overflow's inf: there the scale grows at every step instead.)"""
    from hf_muon import Muon

    gas, mb = 2, 2
    torch.manual_seed(1)
    steps = [[{"input_ids": (ids := torch.randint(0, 64, (mb, 16))), "labels": ids} for _ in range(gas)]
             for _ in range(4)]

    def measure(scaler, pass_scaler=True):
        model = tiny_llama()
        optimizer = Muon(model, lr=1e-2) if optimizer_kind == "hf_muon" else torch.optim.AdamW(model.parameters())
        noise = GradientNoiseScale(model, optimizer, micro_batch_size=mb, accumulation_steps=gas, ema=0.5,
                                   warmup_steps=0, grad_scaler=scaler if pass_scaler else None).attach()
        seen = []
        for i, batches in enumerate(steps):
            for b in batches:
                loss = model(**b).loss / gas
                (scaler.scale(loss) if scaler else loss).backward()
            if i == 2 and optimizer_kind == "hf_muon":  # an overflow: the step is skipped and the scale halves
                next(model.parameters()).grad[0, 0] = float("inf")
            if scaler is None:
                optimizer.step()
            else:
                if unscale_first:
                    scaler.unscale_(optimizer)
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad()
            seen.append((noise.last_norms, noise.noise_scale))
        return seen, scaler.get_scale() if scaler else None

    plain, _ = measure(None)
    growth = {"growth_interval": 1} if optimizer_kind == "adamw" else {}
    scaled, final_scale = measure(torch.amp.GradScaler("cpu", init_scale=1024.0, **growth))
    assert final_scale == (512.0 if optimizer_kind == "hf_muon" else 16384.0)  # it changed between steps
    assert math.isfinite(plain[-1][1]) and plain[-1][1] > 0
    for (norms, noise_scale), (want_norms, want_noise_scale) in zip(scaled, plain):
        assert norms == pytest.approx(want_norms, rel=1e-4)
        assert noise_scale == pytest.approx(want_noise_scale, rel=1e-4)
    if unscale_first:
        with pytest.raises(RuntimeError, match="pass grad_scaler=scaler"):
            measure(torch.amp.GradScaler("cpu", init_scale=1024.0), pass_scaler=False)


def test_hooks_under_the_trainer_undo_its_loss_scaling_exactly(tmp_path):
    # Trainer (transformers 5.x) normalizes each micro-batch's token-sum loss by the step's token count:
    # equal tokens per micro-batch make that mean loss / GAS; the hooks must give the manual figures.
    from torch.utils.data import Dataset, SequentialSampler
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(2)
    data = torch.randint(0, 64, (8, 16))

    class Blocks(Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            return {"input_ids": data[i], "labels": data[i]}

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    gas, mb = 2, 2
    reference = tiny_llama()
    micro = [grad_of(reference, {"input_ids": data[i:i + mb], "labels": data[i:i + mb]}) for i in (0, 2)]
    small = sum(g.square().sum() for g in micro).item() / gas
    big = (sum(micro) / gas).square().sum().item()

    model = tiny_llama()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=mb, gradient_accumulation_steps=gas,
                             max_steps=1, learning_rate=0.0, max_grad_norm=0.0, report_to="none", save_strategy="no",
                             use_cpu=True, dataloader_drop_last=True)
    trainer = InOrder(model=model, args=args, train_dataset=Blocks())
    trainer.create_optimizer()
    noise = GradientNoiseScale(model, trainer.optimizer, micro_batch_size=mb, accumulation_steps=gas).attach()
    trainer.train()
    assert noise.steps == 1 and noise.measured_steps == 1
    assert noise.last_norms == pytest.approx((small, big), rel=1e-4)


def test_multiplier_rule_and_bounds():
    assert lr_multiplier_from_noise_scale(64.0, 32, (0.5, 2.0)) == pytest.approx(math.sqrt(0.5))
    assert lr_multiplier_from_noise_scale(1e6, 32, (0.5, 2.0)) == 0.5
    assert lr_multiplier_from_noise_scale(1.0, 32, (0.5, 2.0)) == 2.0
    assert lr_multiplier_from_noise_scale(-3.0, 32, (0.5, 2.0)) == 2.0  # no measurable noise
    assert lr_multiplier_from_noise_scale(math.inf, 32, (0.5, 2.0)) == 0.5  # no measurable signal
    model = Linear(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad in [(0.0, 2.0), (1.5, 2.0), (0.5, 0.9)]:
        with pytest.raises(ValueError, match="bounds"):
            GradientNoiseScale(model, opt, 1, 2, bounds=bad)


def test_one_process_without_accumulation_is_refused():
    model = Linear(4)
    with pytest.raises(ValueError, match="two batch sizes"):
        GradientNoiseScale(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=8,
                           accumulation_steps=1, world_size=1)
    for warmup_steps in (-1, 2.5):  # -1 was accepted
        with pytest.raises(ValueError, match="warmup_steps must be an integer >= 0"):
            GradientNoiseScale(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=8,
                               accumulation_steps=2, world_size=1, warmup_steps=warmup_steps)


def test_lr_multiplied_inside_step_only_for_every_group():
    # both halves of hf_muon.Muon step with lr * m; the scheduler's lr is back after step()
    from hf_muon import Muon

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=True), nn.Linear(8, 8, bias=False))
    optimizer = Muon(model, lr=0.01, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    noise = GradientNoiseScale(model, optimizer, micro_batch_size=1, accumulation_steps=2).attach()
    noise._multiplier = 2.0  # as if measured
    seen = []
    optimizer.register_step_pre_hook(lambda opt, a, k: seen.append([g["lr"] for g in opt.param_groups]))
    for _ in range(2):
        model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    assert seen == [[0.01, 0.01]]  # our pre-hook ran first: the later hook sees lr * m (0.005 * 2)
    assert [g["lr"] for g in optimizer.param_groups] == [0.005, 0.005] == scheduler.get_last_lr()
    assert {g["algorithm"] for g in optimizer.param_groups} == {"muon", "adamw"}


def test_state_round_trip():
    model = Linear(10)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    a = GradientNoiseScale(model, opt, 2, 4, warmup_steps=1)
    for s in (10.0, 30.0, 20.0):
        a.update(NoiseScaleEstimate(true_grad_sq=1.0, noise_trace=s))
    state = json.loads(json.dumps(a.state_dict()))  # plain numbers
    b = GradientNoiseScale(model, opt, 2, 4, warmup_steps=1)
    b.load_state_dict(state)
    assert (b.noise_scale, b.lr_multiplier, b.measured_steps) == (a.noise_scale, a.lr_multiplier, a.measured_steps)
    for x in (a, b):
        x.update(NoiseScaleEstimate(true_grad_sq=2.0, noise_trace=5.0))
    assert b.noise_scale == a.noise_scale and b.lr_multiplier == a.lr_multiplier
    with pytest.raises(ValueError, match="version"):
        b.load_state_dict({**state, "version": 99})


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp", "zero2"])
def test_two_ranks_equal_one_process_from_the_same_micro_batches(tmp_path, backend):
    out = tmp_path / "r.json"
    torchrun(os.path.join(HERE, "dist", "noise_scale_same_answer.py"), ["--backend", backend, "--out", str(out)],
             env={"DS_ACCELERATOR": "cpu"}, timeout=300)  # a hang guard: DeepSpeed starts slowly on a busy machine
    r = json.loads(out.read_text())
    assert r["steps"] == r["measured_steps"] >= 3
    for got, want in zip(r["norms"], r["reference"]):
        assert got == pytest.approx(want, rel=1e-4)
    assert r["noise_scale"] == pytest.approx(r["reference_noise_scale"], rel=1e-3)


def test_refuses_layouts_it_cannot_measure():
    model = Linear(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.theta.ds_id = 0  # what a DeepSpeed ZeRO-3 parameter carries
    with pytest.raises(NotImplementedError, match="ZeRO-3"):
        GradientNoiseScale(model, opt, 1, 2).attach()
    del model.theta.ds_id

    class Fp16Engine(Linear):
        def fp16_enabled(self):
            return True

    engine = Fp16Engine(4)
    with pytest.raises(NotImplementedError, match="fp16"):
        GradientNoiseScale(engine, torch.optim.SGD(engine.parameters(), lr=0.1), 1, 2).attach()


def test_steps_it_cannot_measure_are_left_out_and_counted():
    model = Linear(8)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    noise = GradientNoiseScale(model, opt, 1, 2, max_grad_norm=1.0).attach()
    for _ in range(3):  # one backward too many (reentrant checkpointing, a short last accumulation)
        model(torch.randn(8)).backward()
    with pytest.warns(UserWarning, match="micro-batch backward passes"):
        opt.step()
    opt.zero_grad()
    for _ in range(2):  # |G_big| = 10 * |mean direction| > 1: clipped before step(), not the gradient's norm
        model(10 * torch.ones(8)).backward()
    opt.step()
    assert (noise.steps, noise.skipped_steps, noise.clipped_steps, noise.measured_steps) == (2, 1, 1, 0)
    assert math.isnan(noise.noise_scale) and noise.lr_multiplier == 1.0


def test_state_travels_in_the_portable_checkpoint(tmp_path, caplog):
    from hf_muon import Muon
    from hf_muon.checkpoint import load_portable, save_portable

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    optimizer = Muon(model, lr=0.01)
    noise = GradientNoiseScale(model, optimizer, 1, 2, warmup_steps=0).attach()
    for _ in range(3):
        for _ in range(2):
            (model(torch.randn(4, 8)).square().mean() / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    save_portable(optimizer, model, str(tmp_path / "with"), noise_scale=noise)
    save_portable(optimizer, model, str(tmp_path / "without"))
    fresh = GradientNoiseScale(model, Muon(model, lr=0.01), 1, 2, warmup_steps=0)
    load_portable(fresh.optimizer, model, str(tmp_path / "with"), noise_scale=fresh)
    assert fresh.state_dict() == noise.state_dict() and fresh.measured_steps == 3
    other = GradientNoiseScale(model, Muon(model, lr=0.01), 1, 2)
    with caplog.at_level("WARNING", logger="hf_muon"):
        load_portable(other.optimizer, model, str(tmp_path / "without"), noise_scale=other)
    assert "no gradient noise scale state" in caplog.text and other.measured_steps == 0


def test_trainer_adaptive_lr_logs_resumes_and_is_off_by_default(tmp_path):
    """--optim_args adaptive_lr=true: the estimator is attached when training begins, its figures are in
    every log, and a resume from a checkpoint continues the estimate exactly."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
    try:
        from train_tiny import Bytes
    finally:
        sys.path.pop(0)
    from transformers import Trainer, TrainingArguments

    from test_trainer import TINY, tiny_llama

    def run(optim_args, resume=None):
        args = TrainingArguments(output_dir=str(tmp_path / optim_args), optim="muon", optim_args=optim_args,
                                 learning_rate=1e-2, max_steps=12, logging_steps=2, per_device_train_batch_size=4,
                                 gradient_accumulation_steps=2, report_to="none", save_strategy="steps", save_steps=6,
                                 use_cpu=True, max_grad_norm=0, seed=0, lr_scheduler_type="constant")
        trainer = Trainer(model=tiny_llama(), args=args, train_dataset=Bytes(open(TINY, "rb").read() * 4))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run("adaptive_lr=true")
    noise = full.optimizer.optimizer.noise_scale_estimator
    assert noise.measured_steps == 12 and math.isfinite(noise.noise_scale)
    logs = [e for e in full.state.log_history if "loss" in e]
    assert logs[-1]["muon/noise_scale"] == noise.noise_scale
    # each entry's multiplier is the one in its muon/lr (it was the next step's: 0.5 beside a rate of 1x)
    assert [e["muon/lr"] for e in logs] == pytest.approx([1e-2 * e["muon/lr_multiplier"] for e in logs], rel=1e-9)
    assert any(e["muon/lr_multiplier"] != 1.0 for e in logs)
    resumed = run("adaptive_lr=true", resume=str(tmp_path / "adaptive_lr=true" / "checkpoint-6"))
    again = resumed.optimizer.optimizer.noise_scale_estimator
    assert (again.steps, again.measured_steps) == (12, 12)
    assert again.noise_scale == pytest.approx(noise.noise_scale, rel=1e-6)
    plain = run("ns_steps=5")
    assert not hasattr(plain.optimizer.optimizer, "noise_scale_estimator")
    assert all("muon/noise_scale" not in e for e in plain.state.log_history)
