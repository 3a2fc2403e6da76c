"""--optim muon in TrainingArguments, HfArgumentParser and Trainer, in-process and through hf_muon.run.

The hooks are installed for each test by conftest's ``hf_muon_hooks`` fixture and taken back after it.
How registration reaches processes that never import hf_muon: tests/test_registration.py.
"""

import os
import pickle
import subprocess
import sys

import pytest
import torch

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
    ("momentum=0.9,ns_steps=5,momentum=0.5", "sets momentum twice"),  # the last one won, silently
])
def test_bad_optim_args_raise(bad, message):
    with pytest.raises(ValueError, match=message):
        parse_optim_args(bad)


@pytest.mark.parametrize("bad, message", [
    ("momentum=0.9,warp=9", "not a Muon setting"),
    ("ns_steps=five", "not a valid value"),
    ("momentum=1.5", "momentum must be in"),
    ("ns_steps=0", "ns_steps must be"),
    ("ns_coefficients=cubic", "ns_coefficients must be one of"),
    ("ns_dtype=int8", "ns_dtype must be one of"),
    ("adjust_lr=spectral", "adjust_lr must be one of"),
    ("adamw_lr=-1", "adamw_lr must be a finite number >= 0"),
    ("adamw_lr=nan", "adamw_lr must be a finite number >= 0"),
    ("adamw_lr=inf", "adamw_lr must be a finite number >= 0"),
    ("qk_clip_tau=0", "tau must be a finite number > 0"),
    ("force_adamw=lm_head[", "not a valid regular expression"),
])
def test_optim_args_mistakes_stop_training_arguments(tmp_path, bad, message):
    # before any data or model work: TrainingArguments itself refuses, saying what is wrong
    with pytest.raises(ValueError, match=message):
        TrainingArguments(output_dir=str(tmp_path), optim="muon", optim_args=bad, report_to="none")
    with pytest.raises(ValueError, match=message):
        HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--optim", "muon", "--optim_args", bad])
    # other optimizers keep their own optim_args untouched
    TrainingArguments(output_dir=str(tmp_path), optim="adamw_torch", optim_args=bad, report_to="none")


def test_building_the_optimizer_says_what_it_built(tmp_path):
    import logging

    logger = logging.getLogger("hf_muon")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)  # a handler of the user's: hf_muon then adds none of its own
    level = logger.level
    try:
        args = TrainingArguments(output_dir=str(tmp_path), optim="muon", learning_rate=1e-2, report_to="none",
                                 optim_args="adamw_lr=1e-3,ns_dtype=float32")
        logger.setLevel(logging.INFO)
        Trainer(model=tiny_llama(), args=args).create_optimizer()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines = [r.getMessage() for r in records]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "Muon 14 tensors" in line and "AdamW 7 tensors" in line, line
    assert "in float32" in line and "lr 0.01 (Muon" in line and "0.001 (AdamW)" in line, line


def test_a_trainer_run_prints_the_line_on_rank_0(tmp_path):

    code = ("import hf_muon, sys; sys.path.insert(0, 'tests'); from test_trainer import tiny_llama; "
            "from transformers import Trainer, TrainingArguments; "
            f"args = TrainingArguments(output_dir={str(tmp_path)!r}, optim='muon', report_to='none'); "
            "Trainer(model=tiny_llama(), args=args).create_optimizer()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [l for l in proc.stderr.splitlines() if l.startswith("[hf_muon] Muon 14 tensors")], proc.stderr[-2000:]


def test_other_optimizers_still_work(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), optim="adamw_torch", report_to="none")
    assert isinstance(Trainer(model=tiny_llama(), args=args).create_optimizer(), torch.optim.AdamW)


@pytest.mark.slow  # 40 s of training in-process
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
