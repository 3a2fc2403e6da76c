"""--optim muon in TrainingArguments, HfArgumentParser and Trainer, in-process and through hf_muon.run."""

import os
import pickle
import subprocess
import sys

import pytest
import torch

import hf_muon  # noqa: F401  (registers muon as transformers loads)
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.training_args import OptimizerNames

from hf_muon import Muon
from hf_muon.integrations.transformers import parse_optim_args

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TINY = os.path.join(HERE, "scripts", "train_tiny.py")
TINY_ARGS = ["--max_steps", "12", "--learning_rate", "1e-2", "--per_device_train_batch_size", "8",
             "--report_to", "none", "--save_strategy", "no", "--use_cpu", "--logging_steps", "50"]


def tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg)


def test_optim_name_is_a_real_enum_member(tmp_path):
    assert OptimizerNames("muon") is OptimizerNames.MUON
    args = TrainingArguments(output_dir=str(tmp_path), optim="muon", report_to="none")
    assert args.optim == OptimizerNames.MUON
    assert pickle.loads(pickle.dumps(args)).optim == "muon"  # training_args.bin
    (parsed,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--optim", "muon", "--optim_args", "momentum=0.9"])
    assert parsed.optim == "muon"


def test_trainer_builds_muon_with_its_hyperparameters(tmp_path):
    model = tiny_llama()
    args = TrainingArguments(output_dir=str(tmp_path), optim="muon", learning_rate=3e-3, weight_decay=0.1,
                             adam_beta1=0.8, adam_beta2=0.98, adam_epsilon=1e-7, report_to="none",
                             optim_args="momentum=0.9,nesterov=false,ns_steps=6,ns_coefficients=polar_express,"
                                        "ns_dtype=float32,adamw_lr=1e-3,force_adamw=layers\\.1\\.mlp\\.down_proj")
    opt = Trainer(model=model, args=args).create_optimizer()
    assert isinstance(opt, Muon)
    for g in opt.param_groups:
        assert g["lr"] == (3e-3 if g["algorithm"] == "muon" else 1e-3)
        assert (g["momentum"], g["nesterov"], g["ns_steps"], g["ns_coefficients"]) == (0.9, False, 6, "polar_express")
        assert g["betas"] == (0.8, 0.98) and g["eps"] == 1e-7 and g["ns_dtype"] == "float32"
        decays = {n: g["weight_decay"] for n in g["param_names"]}
        for n, wd in decays.items():
            assert wd == (0.0 if ("norm" in n or n.endswith("bias")) else 0.1), n
    adamw_names = {n for g in opt.param_groups if g["algorithm"] == "adamw" for n in g["param_names"]}
    assert "model.layers.1.mlp.down_proj.weight" in adamw_names and "lm_head.weight" in adamw_names


@pytest.mark.parametrize("bad, message", [
    ("momentum=0.9,warp=9", "not a Muon setting"),
    ("momentum", "not key=value"),
    ("ns_steps=five", "not a valid value"),
    ("nesterov=maybe", "not a valid value"),
])
def test_bad_optim_args_raise(tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        parse_optim_args(bad)
    args = TrainingArguments(output_dir=str(tmp_path), optim="muon", optim_args=bad, report_to="none")
    with pytest.raises(ValueError, match=message):
        Trainer(model=tiny_llama(), args=args).create_optimizer()


def test_other_optimizers_still_work(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), optim="adamw_torch", report_to="none")
    assert isinstance(Trainer(model=tiny_llama(), args=args).create_optimizer(), torch.optim.AdamW)


def test_trainer_end_to_end_lowers_eval_loss_and_keeps_the_right_state(tmp_path):
    sys.path.insert(0, os.path.dirname(TINY))
    try:
        from train_tiny import Bytes
    finally:
        sys.path.pop(0)
    model = tiny_llama()
    data = Bytes(open(TINY, "rb").read() * 4)
    args = TrainingArguments(output_dir=str(tmp_path), optim="muon", learning_rate=1e-2, max_steps=15,
                             per_device_train_batch_size=8, report_to="none", save_strategy="no", use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data)
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert after < before - 0.5
    opt = trainer.optimizer.optimizer
    assert isinstance(opt, Muon)
    for g in opt.param_groups:
        for p in g["params"]:
            expected = {"momentum_buffer"} if g["algorithm"] == "muon" else {"step", "exp_avg", "exp_avg_sq"}
            assert set(opt.state[p]) == expected
    muon_count = sum(len(g["params"]) for g in opt.param_groups if g["algorithm"] == "muon")
    assert muon_count == 2 * 7


def run(cmd, env_extra=None, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "HF_MUON_REGISTER"}
    env.update(env_extra or {})
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def check_trained_with_muon(out):
    assert "OPTIMIZER=hf_muon.optimizer.muon.Muon" in out
    line = next(l for l in out.splitlines() if l.startswith("EVAL_LOSS_BEFORE"))
    before, after = (float(part.split("=")[1]) for part in line.split())
    assert after < before


def test_unmodified_script_fails_without_the_runner(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HF_MUON_REGISTER"}
    proc = subprocess.run([sys.executable, TINY, "--output_dir", str(tmp_path), "--optim", "muon", *TINY_ARGS],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode != 0 and "muon" in proc.stderr


def test_runner_registers_for_an_unmodified_script(tmp_path):
    out = run([sys.executable, "-m", "hf_muon.run", TINY, "--output_dir", str(tmp_path), "--optim", "muon", *TINY_ARGS])
    check_trained_with_muon(out)


def test_runner_reaches_a_child_process_the_script_starts(tmp_path):
    # relaunch.py never parses --optim; the Python it starts does. Only the environment travels.
    relaunch = os.path.join(HERE, "scripts", "relaunch.py")
    out = run([sys.executable, "-m", "hf_muon.run", relaunch, "--output_dir", str(tmp_path), "--optim", "muon",
               *TINY_ARGS])
    check_trained_with_muon(out)


def test_runner_through_accelerate_launch(tmp_path):
    # `accelerate launch` is itself a CLI that starts the training script in a new Python process.
    out = run([sys.executable, "-m", "hf_muon.run", "-m", "accelerate.commands.launch", "--cpu",
               "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               TINY, "--output_dir", str(tmp_path), "--optim", "muon", *TINY_ARGS])
    check_trained_with_muon(out)
