"""``hf-muon bench``: the quick preset produces a well-formed report; its small pieces do what they say.

The quick preset's numbers are not checked (tiny models on a shared CI machine): only that every
run of it finished, and that results.json, report.md and the PNGs are written and hold what the
report promises. It runs from a folder other than the repository (the pretraining recipe of
figure 5 ships in the package), as ``pip install hf-muon`` users run it.
"""

import contextlib
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STATUSES = {"met", "MISSED", "not measured"}


def test_importing_hf_muon_and_its_cli_stays_cheap():
    code = ("import sys, hf_muon, hf_muon.cli, hf_muon.bench, hf_muon.bench.run; "
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'matplotlib', 'transformers')]; "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_bench_help_lists_the_presets():
    out = subprocess.run([sys.executable, "-m", "hf_muon.cli", "bench", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "--quick" in out and "--only" in out
    top = subprocess.run([sys.executable, "-m", "hf_muon.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "bench" in top


def test_collective_counter_sizes_calls(tmp_path):
    import torch
    import torch.distributed as dist

    from hf_muon.bench import commcount

    counter = commcount.install()
    assert commcount.install() is counter  # idempotent
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        counter.reset()
        dist.all_reduce(torch.ones(10))
        out = torch.empty(8)
        dist.all_gather_into_tensor(out, torch.ones(8))
        dist._all_gather_base(out, torch.ones(8))  # calls all_gather_into_tensor inside: counted once
        dist.all_to_all_single(torch.empty(6), torch.ones(6))
        assert counter.bytes == {"all_reduce": 40, "all_gather_into_tensor": 32, "_all_gather_base": 32,
                                 "all_to_all_single": 24}
        by = commcount.CommCounter.by_category(counter.bytes)
        assert by == {"gradient reduction": 40, "parameter gathering": 64, "all-to-all": 24, "other": 0}
    finally:
        dist.destroy_process_group()


def test_steps_to_reach_and_medians():
    from hf_muon.bench.common import summarize
    from hf_muon.bench.quality import median_or_none, steps_to_reach
    from hf_muon.recipes import curves

    assert steps_to_reach is curves.steps_to_reach  # one definition, shared with examples/demo.py

    curve = [(10, 3.0), (20, 2.0), (30, 1.5)]
    assert steps_to_reach(curve, 2.5) == pytest.approx(15.0)
    assert steps_to_reach(curve, 3.5) == 10.0
    assert steps_to_reach(curve, 1.0) is None
    assert median_or_none([10.0, None, 30.0]) == 30.0
    assert median_or_none([10.0, None, None]) is None
    s = summarize([3.0, 1.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 3.0, 3)


def test_loss_curves_from_log_history():
    from hf_muon.recipes.curves import loss_curves

    history = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}, {"step": 2, "eval_loss": 4.5},
               {"step": 4, "eval_loss": 3.5}, {"step": 4, "eval_loss": 3.4}, {"step": 4, "train_runtime": 1.0}]
    assert loss_curves(history) == ([(1, 5.0), (2, 4.0)], [(2, 4.5), (4, 3.4)])


def test_stdlib_corpus_is_one_slice_split_into_train_and_eval():
    from hf_muon.recipes.corpus import stdlib_corpus, stdlib_files

    files = stdlib_files(0.5)
    assert files and sum(f.stat().st_size for f in files[:-1]) < 0.5e6 <= sum(f.stat().st_size for f in files)
    train, evals = stdlib_corpus(0.5, 20)
    assert train and evals and not set(train) & set(evals)
    assert sorted(train + evals) == sorted(map(str, files))
    assert stdlib_corpus(0.5, 20) == (train, evals)  # deterministic


@pytest.mark.skipif(not hasattr(__import__("torch").optim, "Muon"), reason="this torch has no torch.optim.Muon")
@pytest.mark.parametrize("shape", [(48, 48), (32, 96), (96, 32)])
def test_torch_muon_orthogonalization_is_read_through_its_public_api(shape):
    import torch

    from hf_muon.bench.optimizer_step import torch_muon_ns

    def reference(g):  # torch.optim.Muon's documented iteration, in float64
        a, b, c = 3.4445, -4.7750, 2.0315
        x = g.double().T if g.shape[0] > g.shape[1] else g.double()
        x = x / x.norm()
        for _ in range(5):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.T if g.shape[0] > g.shape[1] else x

    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    out = torch_muon_ns(g)
    assert out.shape == g.shape and out.dtype == torch.float32
    ref = reference(g)
    # torch runs it in bf16; a wrong scale (sqrt(rows / cols) = 1.73 for the tall one) would be far off
    assert ((out.double() - ref).norm() / ref.norm()).item() < 0.03


@pytest.mark.slow
def test_pretrain_clm_example_runs_with_muon_from_another_folder(tmp_path):
    """examples/pretrain_clm.py is a thin script around hf_muon.recipes.pretrain_clm, started through
    the runner from outside the repository."""
    tiny = ["--hidden_size", "32", "--num_layers", "1", "--num_heads", "2", "--num_kv_heads", "1",
            "--intermediate_size", "64", "--seq_len", "32", "--corpus_mb", "0.1", "--max_eval_samples", "4",
            "--max_steps", "2", "--eval_strategy", "no", "--per_device_train_batch_size", "4",
            "--report_to", "none", "--disable_tqdm", "true"]
    script = os.path.join(ROOT, "examples", "pretrain_clm.py")
    proc = subprocess.run([sys.executable, "-m", "hf_muon.run", script, "--optim", "muon", "--output_dir", "out",
                           *tiny], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "eval_loss=" in proc.stdout
    assert (tmp_path / "out" / "eval_results.json").is_file()


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_ns_efficiency_counts_the_executed_products(dtype_name):
    import torch

    from hf_muon.bench.optimizer_step import ns_efficiency
    from hf_muon.kernels.newton_schulz import ns_flops

    dtype = getattr(torch, dtype_name)
    result = ns_efficiency([(32, 96), (32, 96), (48, 48)], repeats=1, dtype=dtype)
    shipped = {tuple(r["shape"]): r for r in result["per_shape"] if r["kernel"] == "shipped"}
    assert shipped[(32, 96)]["method"] == "gram" and shipped[(32, 96)]["batch"] == 2
    assert shipped[(48, 48)]["method"] == "standard"
    # bf16 Gram iterations restart once: two more wide products than in fp32
    assert shipped[(32, 96)]["executed_gflop"] == pytest.approx(2 * ns_flops(32, 96, 5, "gram", dtype) / 1e9)
    assert result["dtype"] == dtype_name
    for row in result["per_shape"]:
        assert row["ns_s"] > 0 and row["bare_matmul_s"] > 0 and row["fraction_of_machine"] > 0


def test_optimizer_step_script_runs_figure_1_on_the_device_named(tmp_path):
    """benchmarks/optimizer_step.py --device (the command a lent GPU runs, here on the CPU): every
    contender timed with its ratio to torch.optim.Muon, Newton–Schulz FLOP/s and the orthogonality
    table, in the device's policy dtype, written to --json."""
    import torch

    from hf_muon.bench.common import CONTENDERS, HF_MUON_FP32, TORCH_MUON
    from hf_muon.bench.optimizer_step import policy_ns_dtype

    out = tmp_path / "fig1.json"
    tiny = ["--d", "64", "--ff", "160", "--layers", "1", "--heads", "2", "--kv_heads", "1", "--repeats", "2"]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "optimizer_step.py"), *tiny,
                           "--device", "cpu", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    dtype = policy_ns_dtype("cpu")
    assert result["device"] == "cpu" and result["ns_dtype"] == str(dtype).replace("torch.", "")
    assert f"on cpu, {result['torch_threads']} CPU threads, Newton–Schulz in {result['ns_dtype']}" in proc.stdout
    expected = [c for c in CONTENDERS if not (c == HF_MUON_FP32 and dtype == torch.float32)]
    if not hasattr(torch.optim, "Muon"):
        expected.remove(TORCH_MUON)
    rows = result["step_time"]["set"]["contenders"]
    assert list(rows) == expected
    for name in expected:
        assert rows[name]["median"] > 0 and len(rows[name]["samples"]) == 2, rows[name]
        if TORCH_MUON in expected:
            assert rows[name]["x_torch_muon"]["median"] > 0
    assert result["ns_efficiency"]["set"]["total"]["shipped"]["ns_s"] > 0
    table = result["orthogonality"]["set"]
    shipped = f"hf_muon shipped on this CPU (quintic, {result['ns_dtype']}, Frobenius, 5 steps)"
    assert shipped in table and 0 < table[shipped]["gaussian"]["relative_error"] < 1


def _failures(node, path=""):
    """Every ``failed`` (and ``lane_failure``, ``missing_runs``) entry under ``node``, with where it is."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}/{key}"
            if key in ("failed", "lane_failure", "missing_runs"):
                found.append(f"{where}: {value}")
            elif key == "failed_runs" and value:
                found.append(f"{where}: {value}")
            else:
                found += _failures(value, where)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _failures(value, f"{path}[{i}]")
    return found


@pytest.mark.slow
def test_quick_preset_writes_a_well_formed_report(tmp_path):
    # From a folder that is not the repository, with a relative --output_dir: the bench needs nothing
    # from the source tree (figure 5 trains the packaged recipe).
    out = tmp_path / "bench"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "hf_muon.cli", "bench", "--quick", "--output_dir", "bench"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    results = json.loads((out / "results.json").read_text())
    assert results["preset"] == "quick"
    for key in ("command", "started", "elapsed_s", "machine", "sections", "figures", "targets", "files"):
        assert key in results, key
    assert set(results["sections"]) == {"fig1", "fig3", "fig2_4", "fig5", "fig6"}
    # every part and every training run finished; the reasons of those that did not
    failures = _failures({"sections": results["sections"], "figures": results["figures"]})
    assert not failures, "\n".join(failures)
    figures = results["figures"]
    assert set(figures["fig1"]) >= {"step_time", "ns_efficiency", "orthogonality"}
    assert "hf_muon.Muon" in figures["fig3"]["measured"]
    settings = figures["fig2_4"]["settings"]
    assert set(settings) == {"single process", "ZeRO-2, W=2", "ZeRO-3, W=2"}
    for rows in settings.values():
        for row in rows.values():
            assert "tokens_per_s" in row, row
    fig5 = figures["fig5"]
    assert fig5["config"]["recipe"] == "hf_muon.recipes.pretrain_clm"
    assert fig5["completed"] == fig5["planned"] > 0, fig5.get("runs")
    assert "grid" in figures["fig5"]
    assert set(figures["fig4"]) == {"ZeRO-2, W=2", "ZeRO-3, W=2"}
    fig6 = figures["fig6"]
    assert fig6["telemetry"]["repeats"] > 0 and 0 < fig6["telemetry"]["recording_share_of_step"] < 1
    assert fig6["fused"]["completed"] == fig6["fused"]["planned"] > 0, fig6["fused"].get("failed_runs")
    assert set(fig6["fused"]["best"]) == {"block", "none"}
    assert fig6["qk_clip"]["completed"] == fig6["qk_clip"]["planned"] > 0
    assert fig6["qk_clip"]["QK-clip"]["max_logit_curve"] and fig6["qk_clip"]["plain Muon (tracked only)"]["max_logit_curve"]
    assert fig6["adaptive_lr"]["completed"] == fig6["adaptive_lr"]["planned"] > 0
    assert fig6["adaptive_lr"]["adaptive lr"]["multiplier_curve"]

    targets = results["targets"]
    assert len(targets) == 9
    for t in targets:
        assert t["status"] in STATUSES, t
        assert t["target"] and t["goal"]

    report = (out / "report.md").read_text()
    assert report.startswith("# hf_muon benchmark (quick preset)")
    lines = report.splitlines()
    header = lines.index("| target | goal | measured | status | detail |")
    assert lines[header + 1] == "|---|---|---|---|---|"
    rows = lines[header + 2: header + 2 + len(targets)]
    assert all(r.startswith("| ") and r.count(" | ") >= 4 for r in rows)
    for heading in ("## 1.", "## 2.", "## 3.", "## 4.", "## 5.", "## 6."):
        assert any(line.startswith(heading) for line in lines), heading

    plots = results["files"]["plots"]
    assert {"fig1_step_time.png", "fig1_ns_efficiency.png", "fig1_orthogonality.png", "fig2_throughput.png",
            "fig3_memory.png", "fig4_network.png", "fig5_lr_sweep.png", "fig5_curves.png",
            "fig6_fused_curves.png", "fig6_qk_clip.png", "fig6_adaptive_lr.png"} <= set(plots)
    for name in plots:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
        assert f"]({name})" in report


def test_throughput_launches_alternate_contenders_in_rounds():
    from hf_muon.bench.throughput import plan

    cfg = {"single": ["adamw", "hf_muon"], "zero": ["adamw", "hf_muon"], "zero_stages": [2], "world": 2,
           "rounds": 3}
    order = [(launch["world"], launch["round"], launch["runs"][0]["contender"]) for launch in plan(cfg)]
    assert order == [(1, k, c) for k in range(3) for c in ("adamw", "hf_muon")] + \
        [(2, k, c) for k in range(3) for c in ("adamw", "hf_muon")]
    grouped = plan({**cfg, "group_launches": True})
    assert [(launch["world"], launch["round"], len(launch["runs"])) for launch in grouped] == \
        [(1, 0, 2), (1, 1, 2), (1, 2, 2), (2, 0, 2), (2, 1, 2), (2, 2, 2)]
    with pytest.raises(ValueError, match="rounds must be a positive integer"):
        plan({**cfg, "rounds": 0})


def test_throughput_ratio_is_taken_within_each_round():
    """A slow round (a noisy neighbour) moves both contenders of that round, not their ratio."""
    from hf_muon.bench.common import summarize
    from hf_muon.bench.throughput import merge_rounds, ratios_to_adamw

    def row(tokens_per_s: list[float]) -> dict:
        return {"contender": "x", "zero_stage": None, "tokens_per_s": summarize(tokens_per_s),
                "step_s": summarize([1 / t for t in tokens_per_s]), "optimizer_step_s": summarize([0.1]),
                "wall_s": 1.0, "log": "log.txt"}

    rounds = {"adamw": [row([100, 102]), row([50, 50]), row([98, 100])],
              "hf_muon": [row([97, 99]), row([48.5, 48.5]), row([95, 97])],
              "torch_muon": [row([80]), {"contender": "torch_muon", "zero_stage": None, "failed": "timeout"},
                             row([78.4])]}
    ratios = ratios_to_adamw(rounds)
    assert ratios["adamw"]["median"] == 1.0
    assert ratios["hf_muon"]["n"] == 3 and ratios["hf_muon"]["min"] == pytest.approx(0.97, abs=1e-3)
    assert ratios["hf_muon"]["median"] == pytest.approx(0.97, abs=1e-3)
    assert ratios["torch_muon"]["n"] == 2  # the failed round is left out, not counted as zero
    merged = merge_rounds(rounds["torch_muon"])
    assert merged["failed_rounds"] == [{"round": 1, "failed": "timeout", "log": None}]
    assert merged["tokens_per_s"]["median"] == pytest.approx(79.2) and merged["rounds"] == 3
    assert merge_rounds(rounds["hf_muon"])["tokens_per_s"]["steps"] == [97, 99, 48.5, 48.5, 95, 97]


def test_llama_sets_take_an_mlp_width():
    from hf_muon.bench.common import llama_matrices

    assert llama_matrices(512, 1, 8, 2) == [(512, 512), (128, 512), (128, 512), (512, 512), (1536, 512),
                                            (1536, 512), (512, 1536)]
    assert llama_matrices(512, 2, 8, 2, ff=1376)[4:7] == [(1376, 512), (1376, 512), (512, 1376)]


def test_step_time_target_reads_every_set():
    from hf_muon.bench.common import HF_MUON, HF_MUON_AOL, TORCH_MUON
    from hf_muon.bench.report import MET, MISSED, _step_vs_torch_muon

    def fig1(ratio_by_set, our_low_rank_error):
        errors = lambda g, lr: {"gaussian": {"relative_error": g}, "low_rank": {"relative_error": lr}}
        ratio = lambda r: {"median": r, "min": r - 0.01, "max": r + 0.01}
        return {"step_time": {s: {"contenders": {HF_MUON: {"x_torch_muon": ratio(r)},
                                                 HF_MUON_AOL: {"x_torch_muon": ratio(r - 0.1)},
                                                 TORCH_MUON: {"x_torch_muon": ratio(1.0)}}}
                              for s, r in ratio_by_set.items()},
                "orthogonality": {s: {"torch.optim.Muon (quintic)": errors(0.2, 0.6),
                                      "hf_muon shipped (quintic)": errors(0.2, our_low_rank_error),
                                      "hf_muon AOL (quintic, bf16, 4 steps)": errors(0.2, 0.8)}
                                  for s in ratio_by_set}}

    name, _, measured, status, detail = _step_vs_torch_muon(fig1({"a": 0.7, "b": 0.72}, 0.6))
    assert status == MET and measured == "a 0.70 x; b 0.72 x" and "AOL 4 steps" in detail and "(worse)" in detail
    assert _step_vs_torch_muon(fig1({"a": 0.7, "b": 0.8}, 0.6))[3] == MISSED  # one set too slow
    assert _step_vs_torch_muon(fig1({"a": 0.7, "b": 0.72}, 0.7))[3] == MISSED  # less orthogonal


@contextlib.contextmanager
def example_module(name: str):
    """``examples/<name>.py`` loaded as a module (not run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]


def test_the_demo_starts_its_muon_run_through_the_runner():
    # the demo imports hf_muon, which adds "muon" to OptimizerNames: it took muon for a built-in
    # optimizer and ran the script without the runner its docstring shows
    with example_module("demo") as demo:
        assert demo.command_for("muon")[1:] == ["-m", "hf_muon.run", demo.SCRIPT]
        assert demo.command_for("adamw_torch")[1:] == [demo.SCRIPT]


@pytest.mark.parametrize("argv, message", [
    (["--model_type", "gpt2", "--num_kv_heads", "1"], "--num_kv_heads is for llama"),  # was ignored
    (["--num_kv_heads", "3"], "must be a multiple of --num_kv_heads 3"),  # failed in the first forward
    (["--hidden_size", "30"], "must be a multiple of --num_heads"),
    (["--model_type", "bert"], "--model_type must be llama or gpt2"),
    (["--seq_len", "0"], "--seq_len and --max_eval_samples must be at least 1"),
    (["--max_eval_samples", "0"], "--seq_len and --max_eval_samples must be at least 1"),  # failed after training
    (["--corpus_mb", "0"], "--corpus_mb must be > 0"),
    (["--eval_file_percentage", "150"], "--eval_file_percentage must be in"),
])
def test_the_recipes_flags_are_checked_before_any_work(argv, message):
    from transformers import HfArgumentParser

    from hf_muon.recipes.pretrain_clm import DataArguments, ModelArguments

    with pytest.raises(ValueError, match=message):
        HfArgumentParser((ModelArguments, DataArguments)).parse_args_into_dataclasses(args=argv)
    model, _ = HfArgumentParser((ModelArguments, DataArguments)).parse_args_into_dataclasses(args=[])
    assert model.num_kv_heads == 2  # llama's default


@pytest.mark.parametrize("argv, message", [
    (["--stdlib_packages", "asyncio"], "give at least two different packages"),  # a regression head, accuracy 1.0
    (["--validation_percentage", "0"], "--validation_percentage must be in"),  # failed after training
    (["--max_eval_samples", "0"], "--max_eval_samples must be at least 1"),
])
def test_the_finetuning_examples_flags_are_checked_before_any_work(argv, message):
    from transformers import HfArgumentParser

    with example_module("finetune_classification") as module:
        with pytest.raises(ValueError, match=message):
            HfArgumentParser(module.DataArguments).parse_args_into_dataclasses(args=argv)


def test_the_finetuning_example_refuses_labels_it_cannot_learn(tmp_path):
    with example_module("finetune_classification") as module:
        (tmp_path / "train.csv").write_text("text,label\nhello,pos\nbad,neg\ngood,pos\n")
        (tmp_path / "dev.csv").write_text("text,label\nsuper,pos\nso so,neutral\n")
        (tmp_path / "one.csv").write_text("text,label\nhello,pos\ngood,pos\n")
        args = module.DataArguments(train_file=str(tmp_path / "train.csv"), validation_file=str(tmp_path / "dev.csv"))
        with pytest.raises(ValueError, match=r"dev.csv has labels the training file lacks: \['neutral'\]"):
            module.load_user_files(args, 0)  # a bare KeyError: 'neutral'
        with pytest.raises(ValueError, match="a classifier needs at least two"):
            module.load_user_files(module.DataArguments(train_file=str(tmp_path / "one.csv")), 0)


@pytest.mark.parametrize("argv, message", [
    (["--from_results", "/nonexistent/results.json"], "--from_results /nonexistent/results.json: cannot read"),
    (["--quick", "--only", "fig5", "--pretrain_script", "/nonexistent.py"], "--pretrain_script /nonexistent.py: no such"),
    (["--quick", "--only", ""], "names no figure"),  # ran nothing and exited 0
    (["--only", "fig9"], "names unknown figure(s) ['fig9']"),
])
def test_bench_mistakes_stop_before_measuring(argv, message, tmp_path):
    from hf_muon.bench.run import main

    with pytest.raises(SystemExit) as stop:
        main([*argv, "--output_dir", str(tmp_path)])
    assert message in str(stop.value)
    assert not (tmp_path / "results.json").exists()
