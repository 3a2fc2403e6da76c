"""Checkpoints that move between layouts, and resumes that are never silently fresh.

Multi-process part: the tiny Llama trains 8 steps under a source layout (checkpoint at step 4,
global batch 12 everywhere), a new launch under another layout resumes from step 4; its final
parameters must be the uninterrupted one-process run's (fp32 Newton–Schulz, lr 1e-3: uninterrupted
layouts agree within 2e-6 there); resumed under its own layout, the uninterrupted run's bit for bit.
In-process part: the same through ``save_portable``/``load_portable``
and the refusals (other model, other split, damaged, partial, newer, no state at all).
"""

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_muon  # noqa: F401
from hf_muon import Muon
from hf_muon.checkpoint import CheckpointError, load_portable, portable_dir, save_portable
from hf_muon.launching import free_port
from test_deepspeed_launch import (ACC_CONFIGS, ACCELERATE, TINY, accelerate, check_run, check_telemetry,
                                   check_zero3_persistence, max_rel_diff, reports, run_ok)

PY = sys.executable
TOLERANCE = 1e-5
STEPS = 8
COMMON = ["--optim", "muon", "--optim_args", "ns_dtype=float32", "--max_steps", str(STEPS), "--save_strategy",
          "steps", "--save_steps", "4", "--learning_rate", "1e-3", "--report_to", "none", "--logging_steps", "1",
          "--eval_before", "false", "--disable_tqdm", "true", "--seed", "0"]


def one_process(*args):
    return lambda: [PY, TINY, *args]


def zero1_three_ranks(*args):
    return lambda: [*ACCELERATE, "--config_file", os.path.join(ACC_CONFIGS, "deepspeed_zero1.yaml"), "--num_processes",
                    "3", "--main_process_port", str(free_port()), "-m", "hf_muon.run", TINY, *args]


# layout -> (command builder, per-device batch, gradient accumulation); global batch 12 in each
LAYOUTS = {
    "one": (one_process, 12, 1),
    "gas4": (one_process, 3, 4),
    "ddp": (lambda *a: accelerate("ddp_cpu.yaml", *a), 6, 1),
    "fsdp2": (lambda *a: accelerate("fsdp2.yaml", *a), 6, 1),
    "zero1": (lambda *a: accelerate("deepspeed_zero1.yaml", *a), 6, 1),
    "zero1x3": (zero1_three_ranks, 4, 1),
    "zero2": (lambda *a: accelerate("deepspeed_zero2.yaml", *a), 6, 1),
    "zero3": (lambda *a: accelerate("deepspeed_zero3.yaml", *a), 6, 1),
}
PAIRS = [("zero2", "one"), ("zero2", "zero3"), ("ddp", "zero2"), ("zero3", "ddp"), ("one", "fsdp2"),
         ("fsdp2", "one"), ("zero1x3", "zero3"), ("gas4", "one")]


def layout_args(layout: str, prefix: str, *extra: str) -> list[str]:
    _, batch, accumulation = LAYOUTS[layout]
    return ["--output_dir", prefix, "--dump_params", prefix, "--report", prefix, "--per_device_train_batch_size",
            str(batch), "--gradient_accumulation_steps", str(accumulation), *COMMON, *extra]


def train(layout: str, prefix: str, *extra: str) -> str:
    command = LAYOUTS[layout][0]
    return run_ok(command(*layout_args(layout, prefix, *extra)))


def load_rank0(prefix: str) -> dict:
    return torch.load(f"{prefix}.rank0.pt")


_SOURCES: dict[str, str] = {}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The uninterrupted 8-step run of a layout (run once per module), as its output prefix."""
    def get(layout: str) -> str:
        if layout not in _SOURCES:
            prefix = str(tmp_path_factory.mktemp(layout) / "run")
            train(layout, prefix)
            _SOURCES[layout] = prefix
        return _SOURCES[layout]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("written, resumed", PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_checkpoint_resumes_under_another_layout(tmp_path, source, written, resumed):
    reference = load_rank0(source("one"))
    written_prefix = source(written)
    checkpoint = os.path.join(written_prefix, "checkpoint-4")
    meta = json.load(open(os.path.join(portable_dir(checkpoint), "meta.json")))
    assert meta["written_under"]["world_size"] == {"zero1x3": 3, "one": 1, "gas4": 1}.get(written, 2)
    prefix = str(tmp_path / "resumed")
    out = train(resumed, prefix, "--resume_from_checkpoint", checkpoint)
    assert "resumed optimizer state from" in out
    ranks = 1 if resumed in ("one", "gas4") else 2
    final = torch.load(f"{prefix}.rank0.pt")
    for r in range(1, ranks):
        assert max_rel_diff(torch.load(f"{prefix}.rank{r}.pt"), final) == 0.0
    report = json.load(open(f"{prefix}.rank0.json"))
    assert report["global_step"] == STEPS
    if ranks > 1:  # Newton–Schulz ran once per hidden matrix for each of the 4 resumed steps, and only those
        ns = sum(json.load(open(f"{prefix}.rank{r}.json"))["ns_tensors"] for r in range(ranks))
        assert ns == 14 * 4, ns
    vs_one, vs_written = max_rel_diff(final, reference), max_rel_diff(final, load_rank0(written_prefix))
    print(f"{written} -> {resumed}: max rel. diff {vs_one:.1e} vs one process, {vs_written:.1e} vs {written}")
    assert vs_one <= TOLERANCE and vs_written <= TOLERANCE


# The engine each 2-rank layout's reports name (train_tiny.py --report)
ENGINES = {"ddp": "ddp", "fsdp2": "fsdp", "zero1": "deepspeed", "zero2": "deepspeed", "zero3": "deepspeed"}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(ENGINES))
def test_resume_in_the_same_layout_is_bit_identical(tmp_path, source, layout):
    """Each engine through the launcher and config a user would use: the Trainer saved at step 4 of 8,
    a new launch resumes from it, and its final parameters are the uninterrupted run's bit for bit
    (hf_muon_state/ restores the exact fp32 weights and state)."""
    engine, full = ENGINES[layout], source(layout)
    for r in check_run(full, STEPS, engine):
        assert r["train_losses"][-1] < r["train_losses"][0], r["train_losses"]
        if layout == "zero3":
            check_zero3_persistence(r)
    check_telemetry(reports(full), exchanged=None if layout in ("zero1", "zero2") else True)
    resumed = str(tmp_path / "resumed")
    train(layout, resumed, "--resume_from_checkpoint", os.path.join(full, "checkpoint-4"))
    check_run(resumed, STEPS, engine, ns_steps=STEPS - 4)  # only steps 5-8 ran
    full_params = [load_rank0(full), torch.load(f"{full}.rank1.pt")]
    assert max_rel_diff(full_params[1], full_params[0]) == 0.0  # the ranks agree
    assert max_rel_diff(load_rank0(resumed), full_params[0]) == 0.0


KILL_BOUND = 60  # seconds from a rank's death to the end of the whole job (README, "Reliability")


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_and_the_restart_is_bit_identical(tmp_path, source):
    """ZeRO-2, 2 ranks, checkpoints every 2 steps; rank 1 is SIGKILLed at the end of step 5. The launch
    must end (non-zero, saying which rank died of which signal) within KILL_BOUND seconds of the death;
    resuming from checkpoint-4 must finish bit-identical to an uninterrupted ZeRO-2 run of the same seed
    (which is itself a second run of that layout: determinism)."""
    import time

    from test_deepspeed_launch import launch

    prefix = str(tmp_path / "killed")
    every_2 = ["--save_steps", "2"]  # given after COMMON's --save_steps 4: argparse keeps the last
    result = launch(LAYOUTS["zero2"][0](*layout_args("zero2", prefix, *every_2, "--kill_rank", "1:5")))
    ended = time.time()
    assert result.returncode != 0
    killed_at = float(result.output.split("KILLING rank 1 at step 5 time=")[1].split()[0])
    assert ended - killed_at < KILL_BOUND, f"the job took {ended - killed_at:.0f}s to end after the kill"
    assert "SIGKILL" in result.output or "Signal 9" in result.output, result.output[-3000:]
    checkpoints = sorted(os.listdir(prefix))
    assert "checkpoint-4" in checkpoints and "checkpoint-6" not in checkpoints, checkpoints
    restarted = str(tmp_path / "restarted")
    train("zero2", restarted, *every_2, "--resume_from_checkpoint", os.path.join(prefix, "checkpoint-4"))
    uninterrupted = source("zero2")
    for rank in range(2):
        a, b = torch.load(f"{restarted}.rank{rank}.pt"), torch.load(f"{uninterrupted}.rank{rank}.pt")
        assert all(torch.equal(a[n], b[n]) for n in a), "the restart is not bit-identical"
    print(f"killed rank: job ended {ended - killed_at:.1f}s after the kill")


# ---------------------------------------------------------------------------------------------------------------
# In-process: save_portable / load_portable in one process, and what they refuse


def tiny_llama(hidden: int = 32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))


def train_steps(model, optimizer, steps: int, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 64, (4, 16), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def saved_run(tmp_path, **muon_kwargs):
    model = tiny_llama()
    optimizer = Muon(model, lr=1e-2, ns_dtype="float32", **muon_kwargs)
    train_steps(model, optimizer, 3)
    save_portable(optimizer, model, str(tmp_path))
    return model, optimizer


def test_portable_state_round_trips_exactly_in_one_process(tmp_path):
    model, optimizer = saved_run(tmp_path)
    optimizer.skipped_steps = 2
    save_portable(optimizer, model, str(tmp_path))
    fresh = tiny_llama()
    fresh_optimizer = Muon(fresh, lr=1e-2, ns_dtype="float32")
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)  # the weights must come from the checkpoint too
    load_portable(fresh_optimizer, fresh, str(tmp_path))
    assert fresh_optimizer.skipped_steps == 2
    train_steps(model, optimizer, 2, seed=7)
    train_steps(fresh, fresh_optimizer, 2, seed=7)
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
        for key, value in optimizer.state[a].items():
            assert torch.equal(value, fresh_optimizer.state[b][key]), (name, key)


@pytest.mark.parametrize("saved_after", [0, 2])
def test_parameters_saved_without_state_resume_as_if_not_stopped(tmp_path, saved_after):
    """A parameter that never got a gradient (a head the loss does not use) has no optimizer state, and
    no parameter has any before the first step. Such checkpoints were refused, even in the same layout
    ("has no exp_avg for unused_head.weight (saved before its first update?)")."""
    def build():
        model = tiny_llama()
        torch.manual_seed(5)
        model.unused_head = torch.nn.Linear(32, 3)
        return model

    model = build()
    optimizer = Muon(model, lr=1e-2, ns_dtype="float32")
    train_steps(model, optimizer, saved_after)
    save_portable(optimizer, model, str(tmp_path))
    fresh = build()
    fresh_optimizer = Muon(fresh, lr=1e-2, ns_dtype="float32")
    load_portable(fresh_optimizer, fresh, str(tmp_path))
    assert not fresh_optimizer.state[fresh.unused_head.weight]  # its state comes with its first gradient
    train_steps(model, optimizer, 2, seed=7)
    train_steps(fresh, fresh_optimizer, 2, seed=7)
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name


def test_persistent_buffers_travel_in_the_portable_state(tmp_path, caplog):
    """Running statistics and counters: a resume under FSDP or DeepSpeed does not read the backend's
    weight files, so a BatchNorm's statistics started over there (an audit found it through a frozen
    embedding: 0.106 from the run that did not stop, with the log saying "resumed")."""
    import json

    def build(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))

    model = build(0)
    optimizer = Muon(model, lr=1e-2)
    for _ in range(3):
        model(torch.randn(6, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    save_portable(optimizer, model, str(tmp_path))
    fresh = build(1)
    load_portable(Muon(fresh, lr=1e-2), fresh, str(tmp_path))
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name  # num_batches_tracked stays an int64 3
    # a checkpoint written before buffers travelled loads, and says what it could not restore
    meta_path = tmp_path / "hf_muon_state" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["buffers"]
    meta_path.write_text(json.dumps(meta))
    older = build(1)
    with caplog.at_level("WARNING", logger="hf_muon"):
        load_portable(Muon(older, lr=1e-2), older, str(tmp_path))
    assert "written without the model's buffers (1.num_batches_tracked ...)" in caplog.text


def test_a_zero_partition_takes_one_step_count_and_says_whose_differs():
    """ZeRO keeps one AdamW step count per flat partition: parameters saved with fewer steps (they
    started late) were merged into the first one's count, silently. A parameter saved without state
    keeps zeros, as at its first update."""
    from hf_muon.distributed.layout import TensorLayout
    from hf_muon.distributed.providers import FlatPartition
    from hf_muon.optimizer.shards import PendingState

    part = FlatPartition(spans=((0, 4), (4, 2), (6, 3)), layouts=tuple(TensorLayout((n,), False, ((0, n),))
                                                                       for n in (4, 2, 3)),
                         group=None, rank=0, world=1, params=("a", "b", "c"))
    pending = PendingState(read=lambda name, kind, start, end: torch.full((end - start,), float(ord(name))),
                           names={id(t): t for t in ("a", "b", "c")}, steps={"a": 2.0, "b": 3.0},
                           stateful={"a", "b"})
    state = {"exp_avg": torch.zeros(9), "exp_avg_sq": torch.zeros(9), "step": torch.tensor(0.0)}
    with pytest.warns(UserWarning, match=r"continues at 3, but 1 of its parameters were saved with fewer steps \(a;"):
        pending.fill_partition(state, part)
    assert state["step"] == 3
    assert state["exp_avg"].tolist() == [97.0] * 4 + [98.0] * 2 + [0.0] * 3


def test_portable_state_keeps_no_ns_settings_so_older_checkpoints_load(tmp_path):
    """meta.json holds only what the schedule moves (lr): a checkpoint written before ns_precondition
    existed has the same groups, and the resuming run's Newton–Schulz settings apply."""
    model, _ = saved_run(tmp_path)
    with open(os.path.join(portable_dir(str(tmp_path)), "meta.json")) as f:
        groups = json.load(f)["groups"]
    assert all(not any(key.startswith("ns_") for key in group) for group in groups)
    fresh = tiny_llama()
    optimizer = Muon(fresh, lr=1e-2, ns_dtype="float32", ns_precondition="aol")
    load_portable(optimizer, fresh, str(tmp_path))
    assert {(g["ns_steps"], g["ns_precondition"]) for g in optimizer.param_groups} == {(4, "aol")}
    train_steps(fresh, optimizer, 1)


def test_a_different_split_is_refused(tmp_path):
    saved_run(tmp_path)
    model = tiny_llama()
    with pytest.raises(CheckpointError, match=r"mlp.*muon in the checkpoint, adamw now"):
        load_portable(Muon(model, force_adamw=r"mlp"), model, str(tmp_path))


def test_allow_fresh_state_takes_the_weights_of_another_split(tmp_path, caplog):
    saved, _ = saved_run(tmp_path)
    model = tiny_llama()
    optimizer = Muon(model, force_adamw=r"mlp")
    with caplog.at_level("WARNING", logger="hf_muon"):
        load_portable(optimizer, model, str(tmp_path), allow_fresh_state=True)
    assert "CONTINUING WITH FRESH OPTIMIZER STATE" in caplog.text
    assert not optimizer.state and optimizer._pending_state is None
    for a, b in zip(saved.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_a_different_model_is_refused(tmp_path):
    saved_run(tmp_path)
    model = tiny_llama(hidden=48)
    with pytest.raises(CheckpointError, match=r"(?s)shape \[.*\] in the checkpoint, \[.*\] now.*cannot be loaded"):
        load_portable(Muon(model), model, str(tmp_path), allow_fresh_state=True)


def test_missing_parameters_are_refused(tmp_path):
    saved_run(tmp_path)
    model = tiny_llama()
    model.lm_head.weight.requires_grad_(False)
    with pytest.raises(CheckpointError, match="in the checkpoint but not trained now: lm_head.weight"):
        load_portable(Muon([p for p in model.parameters() if p.requires_grad], model=model), model, str(tmp_path))


@pytest.mark.parametrize("damage, message", [
    ("truncate_meta", "is damaged"),
    ("drop_tensor", "is partial"),
    ("newer", "newer hf_muon"),
    ("no_state", "has no hf_muon optimizer state"),
    ("garbage_tensors", "cannot be read"),
])
def test_damaged_checkpoints_are_refused(tmp_path, damage, message):
    saved_run(tmp_path)
    folder = portable_dir(str(tmp_path))
    meta_path, tensors_path = os.path.join(folder, "meta.json"), os.path.join(folder, "tensors.safetensors")
    if damage == "truncate_meta":
        text = open(meta_path).read()
        open(meta_path, "w").write(text[: len(text) // 2])
    elif damage == "drop_tensor":
        tensors = load_file(tensors_path)
        del tensors["momentum_buffer/model.layers.0.mlp.up_proj.weight"]
        save_file(tensors, tensors_path)
    elif damage == "newer":
        meta = json.load(open(meta_path))
        meta["version"] += 1
        json.dump(meta, open(meta_path, "w"))
    elif damage == "no_state":
        os.remove(meta_path)
    elif damage == "garbage_tensors":
        open(tensors_path, "wb").write(b"\0" * 64)
    model = tiny_llama()
    with pytest.raises(CheckpointError, match=message):
        load_portable(Muon(model), model, str(tmp_path))


def test_native_state_dict_of_another_split_is_refused():
    model = tiny_llama()
    optimizer = Muon(model)
    train_steps(model, optimizer, 1)
    other = Muon(model, force_adamw=r"mlp")
    with pytest.raises(ValueError, match="param groups|split changed|other parameters"):
        other.load_state_dict(optimizer.state_dict())


def test_trainer_resume_without_state_stops_unless_asked_to_go_fresh(tmp_path):
    """A checkpoint with neither hf_muon_state/ nor a loadable optimizer.pt (as a ZeRO checkpoint looks
    to one process): the resume stops naming the conversion command; allow_fresh_state goes on, loudly."""
    import shutil
    import subprocess

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    args = ["--per_device_train_batch_size", "4", "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2",
            "--report_to", "none", "--eval_before", "false", "--disable_tqdm", "true", "--optim", "muon"]
    first = subprocess.run([PY, TINY, "--output_dir", str(tmp_path / "a"), *args], env=env, capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoint = tmp_path / "a" / "checkpoint-2"
    shutil.rmtree(checkpoint / "hf_muon_state")
    os.remove(checkpoint / "optimizer.pt")
    resume = [PY, TINY, "--output_dir", str(tmp_path / "b"), "--resume_from_checkpoint", str(checkpoint), *args]
    refused = subprocess.run(resume, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0
    assert "CheckpointError" in refused.stderr and "hf-muon convert-checkpoint" in refused.stderr
    fresh = subprocess.run(resume[:-2] + ["--optim_args", "allow_fresh_state=true", *resume[-2:]], env=env,
                           capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "CONTINUING WITH FRESH OPTIMIZER STATE" in fresh.stderr


# ---------------------------------------------------------------------------------------------------------------
# hf-muon convert-checkpoint: checkpoints without hf_muon_state/ (older hf_muon) from every layout's own files


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_convert_reads_each_layouts_own_files_exactly(tmp_path, source, layout):
    """Remove hf_muon_state/ from a checkpoint, convert the backend's own files back: the result must be
    what hf_muon wrote itself, bit for bit (weights, every state tensor, step counts, group learning rates)."""
    import shutil
    import subprocess

    from safetensors.torch import load_file

    checkpoint = os.path.join(source(layout), "checkpoint-4")
    legacy, converted = tmp_path / "legacy", tmp_path / "converted"
    shutil.copytree(checkpoint, legacy)
    shutil.rmtree(portable_dir(str(legacy)))
    done = subprocess.run([PY, "-m", "hf_muon.cli", "convert-checkpoint", str(legacy), str(converted)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hf_muon_state/ written from" in done.stdout
    expected = load_file(os.path.join(portable_dir(checkpoint), "tensors.safetensors"))
    got = load_file(os.path.join(portable_dir(str(converted)), "tensors.safetensors"))
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    meta_expected = json.load(open(os.path.join(portable_dir(checkpoint), "meta.json")))
    meta_got = json.load(open(os.path.join(portable_dir(str(converted)), "meta.json")))
    assert {n: (e["step"], e["algorithm"], e["shape"]) for n, e in meta_expected["params"].items()} == \
        {n: (e["step"], e["algorithm"], e["shape"]) for n, e in meta_got["params"].items()}
    assert sorted(map(str, meta_expected["groups"])) == sorted(map(str, meta_got["groups"]))


@pytest.mark.slow
def test_a_converted_zero3_checkpoint_resumes_in_one_process(tmp_path, source):
    import shutil

    from hf_muon.checkpoint.convert import convert_checkpoint

    legacy = tmp_path / "legacy"
    shutil.copytree(os.path.join(source("zero3"), "checkpoint-4"), legacy)
    shutil.rmtree(portable_dir(str(legacy)))
    convert_checkpoint(str(legacy), str(legacy))  # in place
    prefix = str(tmp_path / "resumed")
    train("one", prefix, "--resume_from_checkpoint", str(legacy))
    assert max_rel_diff(load_rank0(prefix), load_rank0(source("one"))) <= TOLERANCE


def test_convert_reads_weights_transformers_saves_in_another_form(tmp_path):
    """transformers 5 trains Mixtral's experts stacked (``experts.gate_up_proj``, router ``gate.weight``)
    but saves them one tensor per expert (``block_sparse_moe.experts.0.w1.weight``): converting a
    one-process checkpoint failed with "no model.layers.0.mlp.gate.weight (a tied weight ...?)". The
    weights are now read through the model's own loading: the result is what hf_muon writes itself."""
    import transformers as T

    from hf_muon.checkpoint.convert import convert_checkpoint

    torch.manual_seed(0)
    model = T.MixtralForCausalLM(T.MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=3,
                                                 num_experts_per_tok=2, vocab_size=64))
    if not any(p.ndim == 3 for p in model.parameters()):
        pytest.skip("this transformers keeps Mixtral's experts as Linears of their own")
    optimizer = Muon(model, lr=1e-2, ns_dtype="float32")
    train_steps(model, optimizer, 2)
    legacy = tmp_path / "legacy"
    model.save_pretrained(legacy)
    torch.save(optimizer.state_dict(), legacy / "optimizer.pt")
    assert not any("gate_up_proj" in k for k in load_file(legacy / "model.safetensors"))  # saved per expert
    convert_checkpoint(str(legacy), str(tmp_path / "converted"))
    save_portable(optimizer, model, str(tmp_path / "written"))
    expected = load_file(os.path.join(portable_dir(str(tmp_path / "written")), "tensors.safetensors"))
    got = load_file(os.path.join(portable_dir(str(tmp_path / "converted")), "tensors.safetensors"))
    assert expected.keys() == got.keys() and any("experts.gate_up_proj" in k for k in got)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    # a weight missing from the files: transformers would initialize it at random, so it is refused
    weights = load_file(legacy / "model.safetensors")
    del weights["model.layers.0.self_attn.o_proj.weight"]
    save_file(weights, legacy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"incomplete \(model.layers.0.self_attn.o_proj.weight missing"):
        convert_checkpoint(str(legacy), str(tmp_path / "again"))


def test_the_deepspeed_tag_is_latest_or_the_highest_step(tmp_path):
    # A string sort put global_step4 after global_step10: convert-checkpoint read the older optimizer
    # state without a "latest" file, and the older scheduler even with one.
    from hf_muon.checkpoint.convert import deepspeed_tag_dir

    assert deepspeed_tag_dir(str(tmp_path)) is None
    for tag in ("global_step4", "global_step10", "global_step10_universal", "global_step9"):
        (tmp_path / tag).mkdir()
    assert deepspeed_tag_dir(str(tmp_path)) == str(tmp_path / "global_step10")
    (tmp_path / "latest").write_text("global_step4\n")
    assert deepspeed_tag_dir(str(tmp_path)) == str(tmp_path / "global_step4")


def test_convert_refuses_what_it_cannot_read(tmp_path):
    from hf_muon.checkpoint.convert import convert_checkpoint

    model, _ = saved_run(tmp_path / "ok")
    with pytest.raises(CheckpointError, match="already has hf_muon_state"):
        convert_checkpoint(str(tmp_path / "ok"), str(tmp_path / "out"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no optimizer state hf_muon can read"):
        convert_checkpoint(str(tmp_path / "empty"), str(tmp_path / "out"))
    optimizer = torch.optim.AdamW(model.parameters())
    (tmp_path / "adamw").mkdir()
    torch.save(optimizer.state_dict(), tmp_path / "adamw" / "optimizer.pt")
    with pytest.raises(CheckpointError, match="not a state written by hf_muon.Muon"):
        convert_checkpoint(str(tmp_path / "adamw"), str(tmp_path / "out"))


@pytest.mark.slow
def test_deepspeed_universal_checkpoint_carries_hf_muons_state(tmp_path, source):
    """DeepSpeed's own universal-checkpoint loader (``"load_universal": true``) resumes hf_muon's state from
    ``convert-checkpoint --to deepspeed-universal`` (ds_to_universal knows only Adam's state names): the
    run is bit-identical to resuming the same checkpoint through hf_muon_state/."""
    import subprocess

    from test_deepspeed_launch import DS_CONFIGS, torchrun

    checkpoint = os.path.join(source("zero2"), "checkpoint-4")
    universal = tmp_path / "universal"
    done = subprocess.run([PY, "-m", "hf_muon.cli", "convert-checkpoint", "--to", "deepspeed-universal", checkpoint,
                           str(universal)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert not os.path.exists(portable_dir(str(universal)))  # DeepSpeed's loader must do the work
    config = json.load(open(os.path.join(DS_CONFIGS, "zero1.json")))
    config["checkpoint"] = {"load_universal": True}
    json.dump(config, open(tmp_path / "zero1_universal.json", "w"))
    runs = {}
    for name, cfg, resume in [("universal", str(tmp_path / "zero1_universal.json"), str(universal)),
                              ("portable", os.path.join(DS_CONFIGS, "zero1.json"), checkpoint)]:
        prefix = str(tmp_path / name)
        out = run_ok(torchrun("--deepspeed", cfg, "--resume_from_checkpoint", resume,
                              *layout_args("zero2", prefix)[:-len(COMMON)], *COMMON))
        assert ("resumed optimizer state from" in out) == (name == "portable")
        runs[name] = load_rank0(prefix)
    assert all(torch.equal(runs["universal"][n], runs["portable"][n]) for n in runs["portable"])
