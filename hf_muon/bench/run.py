"""``hf-muon bench``: run every figure of the benchmark and write ``results.json``, ``report.md`` and PNGs.

    hf-muon bench --quick                 # under 3 minutes on 2 CPU cores: checks the pipeline, judges nothing
    hf-muon bench                         # the full preset (about 50 minutes on 2 quiet CPU cores)
    hf-muon bench --only fig1,fig3        # some figures only (fig1, fig2_4, fig3, fig5, fig6)
    hf-muon bench --from_results runs/bench/results.json   # rebuild report.md and PNGs, measure nothing

It runs from any directory: figure 5 trains the packaged pretraining recipe
(``hf_muon.recipes.pretrain_clm``; ``--pretrain_script my_pretrain_clm.py`` trains a script of your own
that defines the same names, as ``examples/pretrain_clm.py`` does). Figures 2 and 4 start ``torchrun``
with DeepSpeed on the CPU (``DS_ACCELERATOR=cpu``).
A part that fails is reported as ``failed: <reason>``; the others still run.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any


FIGURES = ("fig1", "fig3", "fig2_4", "fig5", "fig6")
GPT2_SMALL = {"model_type": "gpt2", "hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128}
GPT2 = {"model_type": "gpt2", "hidden_size": 192, "num_layers": 4, "num_heads": 4, "intermediate_size": 768}
LLAMA_SMALL = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128}

QUICK: dict[str, Any] = {
    "fig1": {"sets": {"llama-ratio": {"d": 128, "layers": 1, "heads": 4, "kv_heads": 2, "ff": 344},
                      "llama-like": {"d": 128, "layers": 2, "heads": 4, "kv_heads": 2},
                      "larger": {"d": 192, "layers": 1, "heads": 4, "kv_heads": 2}},
             "repeats": 3, "min_repeats": 2, "budget_s": 1.0, "max_step_s": 5.0, "ns_repeats": 3},
    "fig3": {"llama_like": {"d": 128, "layers": 2, "heads": 4, "kv_heads": 2}, "vocab": 258},
    "fig2_4": {"model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128},
               "seq_len": 64, "micro_batch": 4, "tokens_per_step": 1024, "warmup_steps": 1, "measured_steps": 2,
               "lr": 1e-3, "weight_decay": 0.01, "corpus_mb": 0.3, "seed": 0,
               "single": ["adamw", "hf_muon", "torch_muon"], "zero": ["adamw", "hf_muon", "ds_muon"],
               "zero_stages": [2, 3], "world": 2, "group_launches": True,
               "launch_timeout_s": 60, "run_timeout_s": 40,
               # DeepSpeed's Muon compiles its kernels (minutes on a cold cache): eager in the quick preset
               "env": {"TORCHDYNAMO_DISABLE": "1"}},
    "fig5": {"lrs": [1e-3, 1e-2], "seeds": [0], "lanes": 2, "timeout_s": 90,
             "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128},
             "data": {"seq_len": 64, "corpus_mb": 1.0, "max_eval_samples": 16},
             "training": {"max_steps": 6, "warmup_steps": 1, "lr_scheduler_type": "cosine", "eval_strategy": "steps",
                          "eval_steps": 3, "logging_steps": 3, "per_device_train_batch_size": 8,
                          "per_device_eval_batch_size": 16, "disable_tqdm": True, "report_to": "none",
                          "save_strategy": "no"}},
    "fig6": {"telemetry": {"model": GPT2_SMALL, "repeats": 5},
             "fused": {"lrs": [1e-2, 3e-2], "seeds": [0], "lanes": 2, "timeout_s": 180, "model": GPT2_SMALL,
                       "data": {"seq_len": 64, "corpus_mb": 1.0, "max_eval_samples": 16},
                       "training": {"max_steps": 6, "warmup_steps": 1, "lr_scheduler_type": "cosine",
                                    "eval_strategy": "steps", "eval_steps": 3, "logging_steps": 3,
                                    "per_device_train_batch_size": 8, "per_device_eval_batch_size": 16,
                                    "disable_tqdm": True, "report_to": "none", "save_strategy": "no"}},
             "qk_clip": {"lr": 0.1, "tau": 0.3, "seeds": [0], "lanes": 2, "timeout_s": 180, "model": LLAMA_SMALL,
                         "data": {"seq_len": 64, "corpus_mb": 1.0, "max_eval_samples": 16},
                         "training": {"max_steps": 6, "warmup_steps": 1, "lr_scheduler_type": "cosine",
                                      "eval_strategy": "steps", "eval_steps": 6, "logging_steps": 2,
                                      "per_device_train_batch_size": 8, "per_device_eval_batch_size": 16,
                                      "disable_tqdm": True, "report_to": "none", "save_strategy": "no"}},
             "adaptive_lr": {"lr": 1e-2, "seeds": [0], "lanes": 2, "timeout_s": 180, "model": LLAMA_SMALL,
                             "data": {"seq_len": 64, "corpus_mb": 1.0, "max_eval_samples": 16},
                             "training": {"max_steps": 6, "warmup_steps": 1, "lr_scheduler_type": "cosine",
                                          "eval_strategy": "steps", "eval_steps": 6, "logging_steps": 2,
                                          "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                                          "max_grad_norm": 0.0, "per_device_eval_batch_size": 16,
                                          "disable_tqdm": True, "report_to": "none", "save_strategy": "no"}}},
}

FULL: dict[str, Any] = {
    # ff=1376 is Llama's own MLP ratio (2.6875d); "llama-like" rounds 8d/3 up to 256 (1536)
    "fig1": {"sets": {"llama-ratio": {"d": 512, "layers": 4, "heads": 8, "kv_heads": 2, "ff": 1376},
                      "llama-like": {"d": 512, "layers": 4, "heads": 8, "kv_heads": 2},
                      "larger": {"d": 1024, "layers": 2, "heads": 16, "kv_heads": 4}},
             "repeats": 4, "min_repeats": 2, "budget_s": 30.0, "max_step_s": 120.0,
             "ns_sets": ["llama-ratio"], "ns_repeats": 5},
    "fig3": {"llama_like": {"d": 512, "layers": 4, "heads": 8, "kv_heads": 2}, "vocab": 258},
    "fig2_4": {"model": {"hidden_size": 192, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512},
               "seq_len": 128, "micro_batch": 16, "tokens_per_step": 65536, "warmup_steps": 1, "measured_steps": 2,
               "lr": 1e-3, "weight_decay": 0.01, "corpus_mb": 2.0, "seed": 0,
               "single": ["adamw", "hf_muon", "torch_muon"], "zero": ["adamw", "hf_muon", "ds_muon"],
               "zero_stages": [2, 3], "world": 2, "group_launches": False, "rounds": 3,
               "launch_timeout_s": 240, "run_timeout_s": 420, "env": {}},
    "fig5": {"lrs": [3e-4, 1e-3, 3e-3, 1e-2, 3e-2], "seeds": [0, 1, 2], "lanes": 2, "timeout_s": 1500,
             "model": {}, "data": {},
             "training": {"max_steps": 64, "warmup_steps": 6, "lr_scheduler_type": "cosine", "eval_strategy": "steps",
                          "eval_steps": 8, "logging_steps": 8, "disable_tqdm": True, "report_to": "none",
                          "save_strategy": "no"}},
    "fig6": {"telemetry": {"model": GPT2, "repeats": 20},
             "fused": {"lrs": [3e-3, 1e-2, 3e-2, 1e-1], "seeds": [0, 1, 2], "lanes": 2, "timeout_s": 1800, "model": GPT2,
                       "data": {},
                       "training": {"max_steps": 64, "warmup_steps": 6, "lr_scheduler_type": "cosine",
                                    "eval_strategy": "steps", "eval_steps": 8, "logging_steps": 8,
                                    "disable_tqdm": True, "report_to": "none", "save_strategy": "no"}},
             # the recipe's Llama at a learning rate high enough for its attention logits to grow
             "qk_clip": {"lr": 0.1, "tau": 30.0, "seeds": [0], "lanes": 2, "timeout_s": 900, "model": {}, "data": {},
                         "training": {"max_steps": 64, "warmup_steps": 6, "lr_scheduler_type": "cosine",
                                      "eval_strategy": "steps", "eval_steps": 32, "logging_steps": 4,
                                      "disable_tqdm": True, "report_to": "none", "save_strategy": "no"}},
             # gradient accumulation 2: two batch sizes in one process; no clipping (a clipped step is not measured)
             "adaptive_lr": {"lr": 1e-2, "seeds": [0, 1, 2], "lanes": 2, "timeout_s": 1500, "model": {}, "data": {},
                             "training": {"max_steps": 128, "warmup_steps": 6, "lr_scheduler_type": "cosine",
                                          "eval_strategy": "steps", "eval_steps": 16, "logging_steps": 8,
                                          "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2,
                                          "max_grad_norm": 0.0, "disable_tqdm": True, "report_to": "none",
                                          "save_strategy": "no"}}},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hf-muon bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser.parse_args(argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="the quick preset (pipeline check, < 3 minutes)")
    parser.add_argument("--output_dir", type=Path, default=None,
                        help="where results.json, report.md and the PNGs go (default runs/bench or runs/bench_quick)")
    parser.add_argument("--only", default=",".join(FIGURES), help=f"comma-separated subset of {','.join(FIGURES)}")
    parser.add_argument("--pretrain_script", type=Path, default=None,
                        help="figure 5: train this script instead of the packaged recipe hf_muon.recipes.pretrain_clm "
                             "(it must define TRAINING_DEFAULTS, ModelArguments, DataArguments, build_datasets and "
                             "build_model as that module does)")
    # before the recipe was packaged: figure 5 trained EXAMPLES_DIR/pretrain_clm.py
    parser.add_argument("--examples_dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--from_results", type=Path, default=None,
                        help="measure nothing: rebuild report.md and the PNGs from this results.json (into its folder)")


def _section(name: str, fn, results: dict[str, Any]) -> None:
    from .common import loadavg

    start, before = time.perf_counter(), loadavg()
    info: dict[str, Any] = {"loadavg_before": before}
    try:
        results["figures"][name] = fn()
    except Exception as exc:  # noqa: BLE001 - one broken figure must not take the others down
        traceback.print_exc()
        info["failed"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:400]
    info.update(elapsed_s=time.perf_counter() - start, loadavg_after=loadavg())
    results["sections"][name] = info


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # Busy-waiting OpenMP threads slow everything down many times over on a shared CPU; this must be
    # set before torch is imported (children get it through their environment).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(var, "1")
    only = [f.strip() for f in args.only.split(",") if f.strip()]
    unknown = sorted(set(only) - set(FIGURES))
    if unknown or not only:
        named = f"unknown figure(s) {unknown}" if unknown else "no figure"
        raise SystemExit(f"hf-muon bench: --only {args.only!r} names {named}; choose from {','.join(FIGURES)}")
    if args.from_results is not None:
        try:
            results = json.loads(args.from_results.read_text())
        except (OSError, ValueError) as error:
            raise SystemExit(f"hf-muon bench: --from_results {args.from_results}: cannot read a results.json there "
                             f"({type(error).__name__}: {error})") from None
        return write_report(results, args.from_results.parent)
    preset_name = "quick" if args.quick else "full"
    preset = copy.deepcopy(QUICK if args.quick else FULL)
    out_dir = args.output_dir or Path("runs/bench_quick" if args.quick else "runs/bench")
    out_dir.mkdir(parents=True, exist_ok=True)
    script = args.pretrain_script or (args.examples_dir / "pretrain_clm.py" if args.examples_dir else None)
    if script is not None and "fig5" in only and not script.is_file():
        raise SystemExit(f"hf-muon bench: --pretrain_script {script}: no such file")
    preset["fig5"]["script"] = str(script.resolve()) if script is not None else None

    from .common import loadavg, machine_info

    started = time.perf_counter()
    results: dict[str, Any] = {
        "preset": preset_name, "command": " ".join(["hf-muon", "bench", *argv]),
        "started": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine_info(),
        "presets": {preset_name: preset}, "sections": {}, "figures": {},
    }

    def save() -> None:
        results["elapsed_s"] = time.perf_counter() - started
        (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))

    print(f"hf-muon bench ({preset_name}): writing to {out_dir}", file=sys.stderr, flush=True)
    if "fig1" in only:
        from . import optimizer_step

        _section("fig1", lambda: optimizer_step.run(preset["fig1"]), results)
        save()
    if "fig3" in only:
        from . import memory

        _section("fig3", lambda: memory.run(preset["fig3"]), results)
        save()
    if "fig2_4" in only:
        from . import throughput

        _section("fig2_4", lambda: throughput.run(preset["fig2_4"], out_dir / "train_runs"), results)
        save()
    if "fig5" in only:
        from . import quality

        _section("fig5", lambda: quality.run(preset["fig5"], out_dir / "quality_runs"), results)
        save()
    if "fig6" in only:
        from . import model_aware

        _section("fig6", lambda: model_aware.run(preset["fig6"], out_dir / "model_aware_runs"), results)
        save()

    results["loadavg_at_end"] = loadavg()
    results["elapsed_s"] = time.perf_counter() - started
    return write_report(results, out_dir)


def write_report(results: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Targets, PNGs, ``report.md`` and the final ``results.json`` from the measurements in ``results``."""
    from . import network, report

    if "fig2_4" in results.get("figures", {}):
        results["figures"]["fig4"] = network.summary(results["figures"]["fig2_4"])
    results["targets"] = report.targets(results)
    plot_files = report.plots(results, out_dir)
    results["files"] = {"results": "results.json", "report": "report.md", "plots": plot_files}
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out_dir / "report.md").write_text(report.markdown(results, plot_files))
    print(f"\nhf-muon bench ({results['preset']}) took {results['elapsed_s']:.0f} s; report: {out_dir / 'report.md'}")
    for t in results["targets"]:
        print(f"  [{t['status']:>12}] {t['target']}: {t['measured']}")
    return results


if __name__ == "__main__":
    main()
