"""Figure 6: model-aware Muon.

(a) Telemetry's cost: optimizer steps of one model with ``telemetry=True`` and ``False``, interleaved,
median ratio; and the recording itself timed directly (``StepFigures.add_batch``), as a share of
the step. (b) Fused projections per block: GPT-2 (q | k | v in one ``c_attn``) trained by the
pretraining recipe with ``ns_split="block"`` and ``"none"``, the same learning-rate grid and seeds,
each compared at its best learning rate. (c) QK-clip: the recipe's Llama at a high learning rate,
the largest attention logit of each logged step with QK-clip at ``tau`` and without (tracked by a
QK-clip whose ``tau`` is never reached). (d) The adaptive learning rate: the recipe with and without
``adaptive_lr``, same seeds, final eval loss and the multiplier's curve.
All training runs go through the pretraining recipe's worker (:func:`hf_muon.bench.quality.train_runs`).
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path
from typing import Any

from .common import summarize
from .quality import median_curve, train_runs

SPLITS = ("block", "none")


def telemetry_cost(cfg: dict[str, Any]) -> dict[str, Any]:
    """Step time with and without telemetry on a GPT-2 of ``cfg["model"]`` (recipe flags), one process."""
    import torch

    from ..optimizer import telemetry as telemetry_module
    from ..optimizer.muon import Muon
    from ..recipes.pretrain_clm import ModelArguments, build_model

    torch.manual_seed(0)
    base = build_model(ModelArguments(**cfg["model"]), cfg.get("seq_len", 128))
    models = {on: copy.deepcopy(base) for on in (True, False)}
    optimizers = {on: Muon(models[on], lr=1e-3, telemetry=on) for on in (True, False)}
    grads = {n: torch.randn_like(p) * 1e-2 for n, p in base.named_parameters()}
    for on, model in models.items():
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
    recording = {"s": 0.0}
    original = telemetry_module.StepFigures.add_batch

    def timed_add_batch(self, *a, **k):
        started = time.perf_counter()
        original(self, *a, **k)
        recording["s"] += time.perf_counter() - started

    times: dict[bool, list[float]] = {True: [], False: []}
    reads: list[float] = []
    telemetry_module.StepFigures.add_batch = timed_add_batch
    try:
        for on in (True, False):  # warm-up
            optimizers[on].step()
        recording["s"] = 0.0
        for _ in range(cfg["repeats"]):
            for on in (True, False):
                started = time.perf_counter()
                optimizers[on].step()
                times[on].append(time.perf_counter() - started)
            started = time.perf_counter()
            optimizers[True].telemetry()
            reads.append(time.perf_counter() - started)
    finally:
        telemetry_module.StepFigures.add_batch = original
    ratios = [a / b for a, b in zip(times[True], times[False])]
    step_on = statistics.median(times[True])
    return {
        "model": cfg["model"], "repeats": cfg["repeats"],
        "step_s": {"telemetry on": summarize(times[True]), "telemetry off": summarize(times[False])},
        "ratio_on_off": summarize(ratios),
        "recording_share_of_step": recording["s"] / cfg["repeats"] / step_on,
        "read_s": summarize(reads),
    }


def _finished(records: list[dict[str, Any]], runs: list[dict[str, Any]],
              cfg: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The runs that finished, and a result that says how many did and why the others did not."""
    ok = [r for r in records if "final_eval_loss" in r]
    return ok, {"config": cfg, "completed": len(ok), "planned": len(runs),
                "failed_runs": [r.get("failed") or r.get("lane_failure") for r in records if "final_eval_loss" not in r]}


def fused_sweep(cfg: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """GPT-2 with ``ns_split`` block vs none: the recipe, same grid and seeds, eval curves."""
    runs = [{"optim": "muon", "lr": lr, "seed": seed, "optim_args": f"ns_split={split}", "split": split}
            for seed in cfg["seeds"] for lr in cfg["lrs"] for split in SPLITS]
    ok, result = _finished(train_runs(runs, cfg, out_dir, "fig 6: GPT-2, fused c_attn per block vs whole"), runs, cfg)
    grid: dict[str, dict[str, Any]] = {}
    for split in SPLITS:
        grid[split] = {}
        for lr in cfg["lrs"]:
            sel = [r for r in ok if r["split"] == split and r["lr"] == lr]
            if sel:
                grid[split][f"{lr:g}"] = {"lr": lr, "final_eval_loss": summarize([r["final_eval_loss"] for r in sel])}
    result["grid"] = grid
    if not all(grid.values()):
        result["failed"] = "not every ns_split finished a run"
        return result
    best = {split: min(rows.values(), key=lambda r: r["final_eval_loss"]["median"]) for split, rows in grid.items()}
    result["best"] = {split: {"lr": b["lr"], "final_eval_loss": b["final_eval_loss"]} for split, b in best.items()}
    result["curves"] = {split: median_curve([r["eval_curve"] for r in ok if r["split"] == split and r["lr"] == b["lr"]])
                        for split, b in best.items()}
    # per seed at each split's best lr: block minus none (negative: per-block training is better)
    by_seed = {split: {r["seed"]: r["final_eval_loss"] for r in ok if r["split"] == split and r["lr"] == b["lr"]}
               for split, b in best.items()}
    seeds = sorted(set(by_seed["block"]) & set(by_seed["none"]))
    result["block_minus_none_per_seed"] = {s: by_seed["block"][s] - by_seed["none"][s] for s in seeds}
    return result


NEVER = 1e30  # a tau no logit reaches: QK-clip then only tracks


def _telemetry_curve(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """Median over runs of ``key`` at each logged step."""
    by_step: dict[int, list[float]] = {}
    for r in records:
        for entry in r.get("telemetry", []):
            if key in entry:
                by_step.setdefault(entry["step"], []).append(entry[key])
    return [(step, statistics.median(values)) for step, values in sorted(by_step.items())]


def qk_clip_curves(cfg: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """The largest attention logit per logged step, with QK-clip at ``cfg["tau"]`` and without."""
    arms = {"QK-clip": cfg["tau"], "plain Muon (tracked only)": NEVER}
    runs = [{"optim": "muon", "lr": cfg["lr"], "seed": seed, "optim_args": f"qk_clip_tau={tau:g}", "arm": arm}
            for seed in cfg["seeds"] for arm, tau in arms.items()]
    ok, result = _finished(train_runs(runs, cfg, out_dir, "fig 6: QK-clip vs plain Muon at a high lr"), runs, cfg)
    for arm in arms:
        sel = [r for r in ok if r["arm"] == arm]
        curve = _telemetry_curve(sel, "muon/max_attention_logit")
        result[arm] = {"max_logit_curve": curve, "largest_logit": max((v for _, v in curve), default=None),
                       "final_eval_loss": summarize([r["final_eval_loss"] for r in sel])}
    return result


def adaptive_lr_runs(cfg: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """The recipe with and without ``adaptive_lr``, same lr and seeds."""
    arms = {"adaptive lr": "adaptive_lr=true", "fixed schedule": ""}
    runs = [{"optim": "muon", "lr": cfg["lr"], "seed": seed, "optim_args": args, "arm": arm}
            for seed in cfg["seeds"] for arm, args in arms.items()]
    ok, result = _finished(train_runs(runs, cfg, out_dir, "fig 6: adaptive lr vs the schedule alone"), runs, cfg)
    for arm in arms:
        sel = [r for r in ok if r["arm"] == arm]
        result[arm] = {"final_eval_loss": summarize([r["final_eval_loss"] for r in sel]),
                       "eval_curve": median_curve([r["eval_curve"] for r in sel]) if sel else []}
    adaptive = [r for r in ok if r["arm"] == "adaptive lr"]
    result["adaptive lr"]["multiplier_curve"] = _telemetry_curve(adaptive, "muon/lr_multiplier")
    result["adaptive lr"]["noise_scale_curve"] = _telemetry_curve(adaptive, "muon/noise_scale")
    by_seed = {arm: {r["seed"]: r["final_eval_loss"] for r in ok if r["arm"] == arm} for arm in arms}
    seeds = sorted(set(by_seed["adaptive lr"]) & set(by_seed["fixed schedule"]))
    result["adaptive_minus_fixed_per_seed"] = {s: by_seed["adaptive lr"][s] - by_seed["fixed schedule"][s] for s in seeds}
    return result


def run(cfg: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Every part of figure 6; a part that fails is reported, the others still run."""
    result: dict[str, Any] = {}
    for name, fn in (("telemetry", lambda: telemetry_cost(cfg["telemetry"])),
                     ("fused", lambda: fused_sweep(cfg["fused"], out_dir / "fused_runs")),
                     ("qk_clip", lambda: qk_clip_curves(cfg["qk_clip"], out_dir / "qk_clip_runs")),
                     ("adaptive_lr", lambda: adaptive_lr_runs(cfg["adaptive_lr"], out_dir / "adaptive_lr_runs"))):
        try:
            result[name] = fn()
        except Exception as exc:  # noqa: BLE001 - one broken part must not take the other down
            result[name] = {"failed": f"{type(exc).__name__}: {exc}"[:400]}
    return result
