"""Launchers and shipped configs end to end on CPU: 2 ranks, a tiny Llama, the Trainer, ``--optim muon``.

Every file in ds_configs/ and examples/accelerate_configs/ runs here or in test_checkpoints.py (whose
launches, through the accelerate configs, also resume Trainer checkpoints bit for bit under DDP,
ZeRO-1/2/3 and FSDP2), through ``accelerate launch``, ``torchrun`` and ``deepspeed``; a two-machine
launch is simulated on loopback; DeepSpeed configs that would drop hf_muon are refused. Each launch has
a hard timeout that stops its whole process group.
"""

import json
import math
import os
import subprocess
import sys
import tempfile

import pytest
import torch

import hf_muon  # noqa: F401  (installs the import hooks, as in a user's process)
from hf_muon import launching
from hf_muon.launching import free_port, stop, wait_all

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TINY = os.path.join(HERE, "scripts", "train_tiny.py")
DS_CONFIGS = os.path.join(ROOT, "ds_configs")
ACC_CONFIGS = os.path.join(ROOT, "examples", "accelerate_configs")
PY = sys.executable
ACCELERATE = [PY, "-m", "accelerate.commands.launch"]
DEEPSPEED = [PY, "-m", "deepspeed.launcher.runner"]
TRAIN = ["--per_device_train_batch_size", "4", "--report_to", "none", "--logging_steps", "1",
         "--learning_rate", "1e-2", "--eval_before", "false", "--disable_tqdm", "true"]
MUON_TENSORS = 14  # hidden matrices of the tiny Llama: 7 per layer, 2 layers
LAUNCH_TIMEOUT = 300


def launch_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "HF_MUON_"))}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    return env


def start(cmd: list[str], log):
    """A launcher in its own session, output in ``log`` (see :mod:`hf_muon.launching`)."""
    return launching.start(cmd, log, env=launch_env(), cwd=ROOT)


def launch(cmd, timeout: int = LAUNCH_TIMEOUT) -> launching.Result:
    """Run a launch to the end; a hang is stopped after ``timeout`` seconds and fails the test. ``cmd``
    may be a function building the command: a retry (port taken after the probe) gets a fresh port."""
    result = launching.run(cmd, timeout, env=launch_env(), cwd=ROOT)
    if result.timed_out:
        pytest.fail(f"hung for {timeout}s and was stopped: {' '.join(result.cmd)}\n{result.output[-4000:]}")
    return result


def run(cmd, timeout: int = LAUNCH_TIMEOUT) -> tuple[int, str]:
    """``(returncode, output)`` of a launch (see :func:`launch`)."""
    result = launch(cmd, timeout)
    return result.returncode, result.output


def run_ok(cmd) -> str:
    result = launch(cmd)
    rc, out = result.returncode, result.output
    assert rc == 0, f"{' '.join(result.cmd)} failed ({rc}):\n{out[-5000:]}"
    return out


# Each returns a function building the command, so that a retry ("address already in use") gets a new port.
def torchrun(*args: str):
    return lambda: [PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                    "--master_port", str(free_port()), "-m", "hf_muon.run", TINY, *args]


def accelerate(config: str, *args: str):
    return lambda: [*ACCELERATE, "--config_file", os.path.join(ACC_CONFIGS, config), "--main_process_port",
                    str(free_port()), "-m", "hf_muon.run", TINY, *args]


def deepspeed(*args: str):
    return lambda: [*DEEPSPEED, "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port",
                    str(free_port()), "--module", "hf_muon.run", TINY, *args]


def reports(prefix: str) -> list[dict]:
    """What each rank saw (``train_tiny.py --report``), rank 0 first."""
    found = []
    for rank in range(2):
        with open(f"{prefix}.rank{rank}.json") as f:
            found.append(json.load(f))
    return found


def check_run(prefix: str, steps: int, engine: str, optimizer: str = "hf_muon.optimizer.muon.Muon",
              ns_steps: int | None = None) -> list[dict]:
    """Both ranks saw a 2-rank world under ``engine`` (``deepspeed``, ``fsdp`` or ``ddp``), reached step
    ``steps`` with ``optimizer`` and finite losses, and between them ran Newton–Schulz exactly once per
    hidden matrix per optimizer step this launch took (``ns_steps``, default ``steps``)."""
    ranks = reports(prefix)
    for r in ranks:
        assert (r["num_processes"], r["world_size"]) == (2, 2), r
        assert (r["deepspeed"], r["fsdp"]) == (engine == "deepspeed", engine == "fsdp"), r
        assert r["optimizer"] == optimizer, r
        assert r["global_step"] == steps and len(r["train_losses"]) == steps, r
        assert all(math.isfinite(x) for x in r["train_losses"]) and math.isfinite(r["eval_loss_after"]), r
    assert ranks[0]["first_batch"] != ranks[1]["first_batch"], "both ranks read the same data"
    expected = MUON_TENSORS * (steps if ns_steps is None else ns_steps)
    assert sum(r["ns_tensors"] for r in ranks) == expected, ranks
    return ranks


def load(prefix: str) -> list[dict]:
    return [torch.load(f"{prefix}.rank{r}.pt") for r in range(2)]


def max_rel_diff(a: dict, b: dict) -> float:
    """Largest ``||a - b|| / ||b||`` over the parameters (same names required)."""
    assert a.keys() == b.keys()
    return max(((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-12)).item() for n in a)


# ---------------------------------------------------------------------------------------------------------------
# In-process: the HfMuon config type, the config checks, the CPU-state decision (no launch, seconds)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def test_importing_hf_muon_stays_cheap_and_deepspeed_import_registers_hfmuon():
    code = ("import sys, hf_muon; heavy = [m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy; import deepspeed, torch; from deepspeed.runtime.zero import utils; "
            "from hf_muon.integrations.deepspeed_config import HfMuon; from hf_muon import Muon; "
            "assert torch.optim.HfMuon is HfMuon and HfMuon in utils.ZERO_SUPPORTED_OPTIMIZERS; "
            "assert Muon in utils.ZERO_SUPPORTED_OPTIMIZERS; print('OK')")
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120, env=launch_env(), cwd=ROOT)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_hfmuon_splits_deepspeeds_flat_tensor_list_by_the_engines_model():
    from hf_muon.integrations.deepspeed_config import _ENGINE_MODULE, HfMuon

    model = tiny_llama()
    tensors = [p for p in model.parameters() if p.requires_grad]  # what DeepSpeed passes: no names, no model
    with pytest.raises(ValueError, match="needs the model"):
        HfMuon(tensors, lr=1e-3)
    token = _ENGINE_MODULE.set(model)  # what the patched DeepSpeedEngine._configure_basic_optimizer does
    try:
        opt = HfMuon(tensors, lr=1e-3, weight_decay=0.0, momentum=0.9)
        with pytest.raises(ValueError, match="not parameters of the model"):
            HfMuon([*tensors, torch.nn.Parameter(torch.zeros(4, 4))], lr=1e-3)
        with pytest.raises(ValueError, match="does not take"):
            HfMuon(tensors, lr=1e-3, adam_w_mode=True)
    finally:
        _ENGINE_MODULE.reset(token)
    names = {g["algorithm"]: set(g["param_names"]) for g in opt.param_groups}
    assert names["adamw"] >= {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    assert len(names["muon"]) == MUON_TENSORS and "model.layers.0.self_attn.q_proj.weight" in names["muon"]
    assert all(g["momentum"] == 0.9 for g in opt.param_groups)


def test_hfmuon_refuses_a_model_without_hidden_matrices():
    from hf_muon.integrations.deepspeed_config import HfMuon

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4))
    with pytest.raises(ValueError, match="no hidden weight matrix"):
        HfMuon(list(model.parameters()), model=model)


def ds_file(name: str) -> dict:
    with open(os.path.join(DS_CONFIGS, name)) as f:
        return json.load(f)


OFFLOAD = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}


@pytest.mark.parametrize("config, optim, message", [
    ({"optimizer": {"type": "AdamW", "params": {}}}, "muon", "silently ignore --optim muon"),
    ({"optimizer": {"type": "Muon"}}, "muon", "always DeepSpeed's own Muon"),
    ({"optimizer": {"type": "muon"}}, "muon", "always DeepSpeed's own Muon"),
    ({"optimizer": {"type": "HfMuon"}}, "muon", "so does --optim muon"),
    ({"optimizer": {"type": "hfmuon"}}, "adamw_torch", "exactly"),
    ({"optimizer": {"type": "HfMuon", "params": {"lr": "auto", "warp": 9}}}, "adamw_torch", "does not take"),
    ({"optimizer": {"type": "HfMuon", "params": {"momentum": "auto"}}}, "adamw_torch", "give \\['momentum'\\]"),
    (OFFLOAD, "muon", "DeepSpeedCPUAdam"),
    ({**OFFLOAD, "zero_force_ds_cpu_optimizer": True}, "muon", "zero_force_ds_cpu_optimizer\": false"),
])
def test_config_checks_refuse_with_what_to_change(config, optim, message):
    from hf_muon.integrations.deepspeed_config import check_deepspeed_config

    with pytest.raises(ValueError, match=message):
        check_deepspeed_config(config, optim)


@pytest.mark.parametrize("name, optim", [
    ("zero1.json", "muon"), ("zero2.json", "muon"), ("zero3.json", "muon"), ("zero3_offload.json", "muon"),
    ("zero2_optimizer_block.json", "adamw_torch"),
])
def test_shipped_configs_pass_the_checks(name, optim):
    from hf_muon.integrations.deepspeed_config import check_deepspeed_config

    config = ds_file(name)
    check_deepspeed_config(config, optim)
    assert "optimizer" not in config or config["optimizer"]["type"] == "HfMuon"
    stage = config["zero_optimization"]["stage"]
    if stage == 3:  # Trainer fills 10 * hidden_size; DeepSpeed's default (1e5) would keep tiny models whole
        assert config["zero_optimization"]["stage3_param_persistence_threshold"] == "auto"
    if "offload_optimizer" in config["zero_optimization"]:
        assert config["zero_force_ds_cpu_optimizer"] is False
    assert config["bf16"]["enabled"] == "auto" and config["fp16"]["enabled"] == "auto"


def test_accelerate_refuses_to_swap_muon_for_deepspeed_cpu_adam():
    import accelerate.accelerator

    from hf_muon import Muon

    with pytest.raises(ValueError, match="DeepSpeedCPUAdam"):
        accelerate.accelerator.map_pytorch_optim_to_deepspeed(Muon(tiny_llama(), lr=1e-3))


def test_without_deepspeed_accelerate_is_left_alone_and_nothing_warns(monkeypatch, recwarn):
    # Accelerate defines map_pytorch_optim_to_deepspeed only where DeepSpeed is installed: every Trainer run
    # without the optional DeepSpeed warned that Accelerate lacked it and should be reinstalled
    import importlib.util
    import types

    from hf_muon.integrations import deepspeed_config

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real_find_spec(name, *a))
    accelerator_module = types.ModuleType("accelerate.accelerator")
    deepspeed_config.patch_accelerate(accelerator_module)
    assert not hasattr(accelerator_module, "map_pytorch_optim_to_deepspeed")
    assert [str(w.message) for w in recwarn if "hf_muon" in str(w.message)] == []


@pytest.mark.parametrize("env, args, kind", [
    ({}, {}, None),                                                     # not launched on several ranks
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "1"}, {"deepspeed": "x.json"}, None),
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "2"}, {"deepspeed": "x.json"}, "deepspeed"),
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true"}, {}, "deepspeed"),
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "2", "ACCELERATE_USE_FSDP": "true"}, {}, "fsdp"),
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "2"}, {}, "ddp"),
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "2"}, {"use_cpu": True}, None),  # Trainer gets --use_cpu DDP right
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "2", "HF_MUON_CPU_DISTRIBUTED": "0"}, {"deepspeed": "x.json"}, None),
])
def test_cpu_state_is_set_up_only_where_accelerate_gets_the_world_wrong(monkeypatch, env, args, kind):
    from types import SimpleNamespace

    from accelerate.state import PartialState

    from hf_muon.integrations import accelerate_cpu

    for name in ("LOCAL_RANK", "WORLD_SIZE", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_CPU",
                 "HF_MUON_CPU_DISTRIBUTED"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(PartialState, "_shared_state", {})
    monkeypatch.setattr(accelerate_cpu, "accelerator_available", lambda: False)
    args = SimpleNamespace(**{"deepspeed": None, "fsdp": None, "use_cpu": False, **args})
    assert accelerate_cpu.needs_cpu_state(args) == kind
    monkeypatch.setattr(accelerate_cpu, "accelerator_available", lambda: True)  # with a GPU: never
    assert accelerate_cpu.needs_cpu_state(args) is None


def test_a_later_training_arguments_keeps_the_cpu_state(monkeypatch):
    """A second TrainingArguments in the process (dataclasses.replace, to_dict, a second parse) reset the
    state to one process per rank, while the gloo group stayed up: each rank trained alone, silently."""
    from types import SimpleNamespace

    from accelerate.state import PartialState

    from hf_muon.integrations import accelerate_cpu

    for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(accelerate_cpu, "_STATE_KIND", ["ddp"])
    monkeypatch.setattr(PartialState, "_shared_state", {"backend": "gloo"})
    later = SimpleNamespace(deepspeed=None, fsdp=None, use_cpu=False, accelerator_config=None)
    assert accelerate_cpu.prepare_training_args(later) == "ddp"
    assert later.accelerator_config == {"use_configured_state": True}
    with pytest.raises(ValueError, match="set up a ddp launch over gloo .* these ask for deepspeed"):
        accelerate_cpu.prepare_training_args(SimpleNamespace(deepspeed="x.json", fsdp=None, use_cpu=False,
                                                             accelerator_config=None))


def test_ddp_with_a_copy_of_the_training_arguments_trains_as_one(tmp_path):
    prefix = str(tmp_path / "run")
    run_ok(torchrun("--optim", "muon", "--copy_args", "--output_dir", str(tmp_path), "--max_steps", "4",
                    "--save_strategy", "no", "--dump_params", prefix, "--report", prefix, *TRAIN))
    check_run(prefix, 4, "ddp")
    rank0, rank1 = load(prefix)
    assert max_rel_diff(rank1, rank0) == 0.0  # the AdamW half drifted apart (0.22 vs 0.74 embedding sums)


def test_use_configured_state_keeps_the_users_accelerator_config(tmp_path):
    from transformers.trainer_pt_utils import AcceleratorConfig

    from hf_muon.integrations.accelerate_cpu import _use_configured_state

    path = tmp_path / "acc.json"
    path.write_text('{"split_batches": true}')
    assert _use_configured_state(None) == {"use_configured_state": True}
    assert _use_configured_state({"even_batches": False}) == {"even_batches": False, "use_configured_state": True}
    assert _use_configured_state('{"even_batches": false}') == {"even_batches": False, "use_configured_state": True}
    assert _use_configured_state(str(path)) == {"split_batches": True, "use_configured_state": True}
    assert _use_configured_state(AcceleratorConfig()).use_configured_state is True


def test_runner_hands_deepspeeds_local_rank_to_the_script():
    from hf_muon.run import _move_local_rank

    assert _move_local_rank(["--local_rank=1", "train.py", "--x"]) == ["train.py", "--local_rank=1", "--x"]
    assert _move_local_rank(["--local_rank", "1", "-m", "pkg.train"]) == ["-m", "pkg.train", "--local_rank", "1"]
    assert _move_local_rank(["train.py", "--local_rank=0"]) == ["train.py", "--local_rank=0"]


# ---------------------------------------------------------------------------------------------------------------
# Launches: 2 CPU ranks each (about 30 s apiece on two cores)


@pytest.mark.slow
def test_refusal_reaches_a_launched_trainer(tmp_path):
    rc, out = run(torchrun("--deepspeed", os.path.join(DS_CONFIGS, "zero2_optimizer_block.json"),
                           "--output_dir", str(tmp_path), "--optim", "muon", "--max_steps", "2", *TRAIN))
    assert rc != 0 and "so does --optim muon" in out, out[-3000:]


@pytest.mark.slow
def test_optimizer_block_selects_hfmuon_with_the_right_split(tmp_path):
    # no --optim: the DS config's "optimizer" block picks HfMuon; DeepSpeed hands it a flat tensor list
    report = str(tmp_path / "report")
    run_ok(torchrun("--deepspeed", os.path.join(DS_CONFIGS, "zero2_optimizer_block.json"), "--output_dir",
                    str(tmp_path), "--max_steps", "4", "--save_strategy", "no", "--report", report, *TRAIN))
    for r in check_run(report, 4, "deepspeed", optimizer="hf_muon.integrations.deepspeed_config.HfMuon"):
        names = {algorithm: set(n) for algorithm, n in r["groups"]}
        assert len(names["muon"]) == MUON_TENSORS and "lm_head.weight" in names["adamw"], r["groups"]
        assert train_loss_fell(r)


@pytest.mark.slow
def test_hfmuon_under_zero3_zero_init_with_gradient_accumulation(tmp_path):
    # "type": "HfMuon" at stage 3, model built under zero.Init (--deepspeed before from_config), GAS 2:
    # Newton–Schulz once per matrix per optimizer step, not per micro-batch.
    config = {**ds_file("zero3.json"), "optimizer": ds_file("zero2_optimizer_block.json")["optimizer"]}
    path, report = tmp_path / "zero3_hfmuon.json", str(tmp_path / "report")
    path.write_text(json.dumps(config))
    run_ok(torchrun("--deepspeed", str(path), "--from_config", "--gradient_accumulation_steps", "2",
                    "--output_dir", str(tmp_path), "--max_steps", "4", "--save_strategy", "no", "--report", report,
                    *TRAIN))
    for r in check_run(report, 4, "deepspeed", optimizer="hf_muon.integrations.deepspeed_config.HfMuon"):
        assert r["built_partitioned"] and train_loss_fell(r), r
        names = {algorithm: set(n) for algorithm, n in r["groups"]}
        assert len(names["muon"]) == MUON_TENSORS and "model.embed_tokens.weight" in names["adamw"], r["groups"]


def train_loss_fell(r: dict) -> bool:
    losses = r["train_losses"]
    return losses[-1] < losses[0] - 0.2  # lr 1e-2, 4 steps: about 5.55 -> 4.9 with Muon


@pytest.mark.slow
def test_zero3_offload_through_the_deepspeed_launcher_in_bf16(tmp_path):
    report = str(tmp_path / "report")
    run_ok(deepspeed("--deepspeed", os.path.join(DS_CONFIGS, "zero3_offload.json"), "--bf16", "--use_cpu",
                     "--output_dir", str(tmp_path), "--optim", "muon", "--max_steps", "4", "--save_strategy", "no",
                     "--report", report, *TRAIN))
    for r in check_run(report, 4, "deepspeed"):
        assert r["dtype"] == "torch.bfloat16" and train_loss_fell(r), r


@pytest.mark.slow
def test_zero3_with_zero_init_in_bf16(tmp_path):
    # deepspeed_zero3.yaml sets zero3_init_flag: from_config then builds the model under zero.Init,
    # where every parameter looks 1-D; Muon must still get (and orthogonalize) the 14 matrices.
    report = str(tmp_path / "report")
    run_ok(accelerate("deepspeed_zero3.yaml", "--from_config", "--bf16", "--use_cpu", "--output_dir", str(tmp_path),
                      "--optim", "muon", "--max_steps", "4", "--save_strategy", "no", "--report", report, *TRAIN))
    reports = check_run(report, 4, "deepspeed")
    for r in reports:
        assert r["built_partitioned"] and r["dtype"] == "torch.bfloat16" and train_loss_fell(r), r
        check_zero3_persistence(r)
    check_telemetry(reports, exchanged=True)


def check_telemetry(reports: list[dict], exchanged: bool | None) -> None:
    """Muon's figures are in every training log, reduced over ranks (so every rank logs the same).
    ``exchanged``: whether the owner exchange moves bytes (``None``: it may, ZeRO-1/2 straddlers)."""
    from hf_muon.optimizer.telemetry import TELEMETRY_KEYS

    logs = [r["telemetry"] for r in reports]
    assert logs[0] and all(set(TELEMETRY_KEYS) <= set(entry) for entry in logs[0]), logs[0]
    assert all(log == logs[0] for log in logs), logs
    for entry in logs[0]:
        assert 0 < entry["muon/update_rms"] < 1 and 0 < entry["muon/adamw_update_rms"] < 1, entry
        assert entry["muon/ns_ms"] > 0, entry
        assert exchanged is None or (entry["muon/exchange_bytes"] > 0) == exchanged, entry


def check_zero3_persistence(r: dict) -> None:
    """"auto" threshold = 10 * hidden_size = 320: every matrix is gathered per use and released, only the
    norms stay gathered (the optimizer sees partitions of both either way)."""
    assert sorted(r["persistent"]) == sorted(
        [f"model.layers.{i}.{n}.weight" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")]
        + ["model.norm.weight"]), r["persistent"]


@pytest.mark.slow
def test_two_machines_on_loopback_finish_with_identical_parameters(tmp_path):
    # one `accelerate launch` per simulated machine, 1 rank each, meeting at 127.0.0.1:port
    port, prefix = str(free_port()), str(tmp_path / "run")
    logs, procs, outs, finished = [], [], [], False
    try:
        for rank in (0, 1):
            cmd = [*ACCELERATE, "--config_file", os.path.join(ACC_CONFIGS, "deepspeed_zero2_two_machines.yaml"),
                   "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
                   "--main_process_ip", "127.0.0.1", "--main_process_port", port,
                   "-m", "hf_muon.run", TINY, "--output_dir", str(tmp_path / f"out{rank}"), "--optim", "muon",
                   "--max_steps", "4", "--save_strategy", "no", "--dump_params", prefix, "--report", prefix, *TRAIN]
            logs.append(tempfile.TemporaryFile("w+"))
            procs.append(start(cmd, logs[-1]))
        finished = wait_all(procs, LAUNCH_TIMEOUT)  # one machine failing stops the other at once
    finally:
        for proc in procs:
            stop(proc)
        for log in logs:
            log.seek(0)
            outs.append(log.read())
            log.close()
    assert finished, f"hung for {LAUNCH_TIMEOUT}s and was stopped:\n{outs[0][-3000:]}\n{outs[1][-3000:]}"
    for rank, (proc, out) in enumerate(zip(procs, outs)):
        assert proc.returncode == 0, f"machine {rank} failed ({proc.returncode}):\n{out[-4000:]}"
    for r in check_run(prefix, 4, "deepspeed"):
        assert train_loss_fell(r)
    rank0, rank1 = load(prefix)
    assert max_rel_diff(rank1, rank0) == 0.0
