"""Figure 5: training quality. A learning-rate sweep on the pretraining recipe
(:mod:`hf_muon.recipes.pretrain_clm`, or a script passed with ``--pretrain_script``) and its default
corpus, with the same grid, seeds, steps and schedule for AdamW (``adamw_torch``) and
``hf_muon.Muon`` (``muon``).

The runs are split over ``lanes`` worker processes (:mod:`hf_muon.bench.quality_worker`) that run
at the same time with ``cpu_count // lanes`` threads each. The best learning rate of each optimizer
is the one with the lowest median (over seeds) final eval loss. The target loss is AdamW's median
final eval loss at its best learning rate; for each seed, the step at which Muon (at its best
learning rate) first reaches it is read from its eval curve (linear interpolation between evals),
and the median over seeds is compared with the run length.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from ..recipes.curves import Curve, steps_to_reach  # noqa: F401  (steps_to_reach: re-exported)
from ..launching import start, stop
from .common import child_env, progress, summarize

OPTIMS = {"adamw_torch": "AdamW", "muon": "hf_muon.Muon"}

RECIPE = "hf_muon.recipes.pretrain_clm"  # the packaged recipe, trained unless cfg["script"] names a script


def median_or_none(values: list[float | None]) -> float | None:
    """Median where ``None`` (never reached) counts as larger than everything; ``None`` if the median is."""
    if not values:
        return None
    median = statistics.median(math.inf if v is None else v for v in values)
    return None if math.isinf(median) else median


def median_curve(curves: list[Curve]) -> Curve:
    steps = sorted(set.intersection(*(set(s for s, _ in c) for c in curves))) if curves else []
    tables = [dict(c) for c in curves]
    return [(s, statistics.median(t[s] for t in tables)) for s in steps]


def run(cfg: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """The sweep of ``cfg`` (``lrs``, ``seeds``, ``lanes``, ``timeout_s``, ``model``, ``data``,
    ``training``; ``script``: a training script defining the recipe's names, ``None`` for the
    packaged recipe), its logs and job files in ``out_dir``."""
    script = Path(cfg["script"]).resolve() if cfg.get("script") else None
    if script is not None and not script.is_file():
        return {"failed": f"--pretrain_script {cfg['script']}: no such file"}
    cfg["recipe"] = str(script) if script is not None else RECIPE
    runs = [{"optim": o, "lr": lr, "seed": seed} for seed in cfg["seeds"] for lr in cfg["lrs"] for o in OPTIMS]
    records = train_runs(runs, cfg, out_dir, "fig 5: learning-rate sweep", script)
    return analyse(records, runs, cfg)


def train_runs(runs: list[dict[str, Any]], cfg: dict[str, Any], out_dir: Path, title: str,
               script: Path | None = None) -> list[dict[str, Any]]:
    """Train ``runs`` (each ``optim``, ``lr``, ``seed``, maybe ``optim_args``) with the recipe, split over
    ``cfg["lanes"]`` worker processes; their records (see :mod:`hf_muon.bench.quality_worker`)."""
    lanes = max(1, min(cfg["lanes"], len(runs)))
    threads = max(1, (os.cpu_count() or 1) // lanes)
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for lane in range(lanes):
        job = {"runs": runs[lane::lanes], "training": cfg["training"], "model": cfg.get("model", {}),
               "data": cfg.get("data", {}), "threads": threads}
        (out_dir / f"lane{lane}.json").write_text(json.dumps(job, indent=1))
        out = out_dir / f"lane{lane}.jsonl"
        out.unlink(missing_ok=True)
        log = (out_dir / f"lane{lane}.log").open("w")
        cmd = [sys.executable, "-m", "hf_muon.bench.quality_worker", "--runs", str(out_dir / f"lane{lane}.json"),
               "--out", str(out)] + (["--script", str(script)] if script is not None else [])
        procs.append((start(cmd, log, env=child_env(threads)), log, out))
    bar = progress(len(runs), title, "run")
    records = _wait(procs, bar, cfg["timeout_s"])
    bar.close()
    return records


def _read(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def _wait(procs, bar, timeout_s: float) -> list[dict[str, Any]]:
    import time

    from .common import last_line

    deadline = time.monotonic() + timeout_s
    done = 0
    reasons = []
    while True:
        finished = all(p.poll() is not None for p, _, _ in procs)
        count = sum(len(_read(out)) for _, _, out in procs)
        if count > done:
            bar.update(count - done)
            done = count
        if finished:
            break
        if time.monotonic() > deadline:
            for p, _, _ in procs:
                if p.poll() is None:
                    stop(p, grace_s=10.0)
            reasons.append(f"timed out after {timeout_s:.0f} s")
            break
        time.sleep(1.0)
    records = []
    for p, log, out in procs:
        log.close()
        lane = _read(out)
        records += lane
        if p.returncode not in (0, None) and not reasons:
            reasons.append(f"a lane exited with {p.returncode}: {last_line(Path(log.name))}")
    if reasons:
        for r in records:
            r.setdefault("lane_note", reasons[0])
    return records + ([{"lane_failure": reasons[0]}] if reasons else [])


def analyse(records: list[dict[str, Any]], runs: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    lane_failure = next((r["lane_failure"] for r in records if "lane_failure" in r), None)
    records = [r for r in records if "optim" in r]
    ok = [r for r in records if "final_eval_loss" in r]
    failed = [r for r in records if "failed" in r]
    missing = len(runs) - len(records)
    grid: dict[str, dict[str, Any]] = {}
    for optim, name in OPTIMS.items():
        rows = {}
        for lr in cfg["lrs"]:
            sel = [r for r in ok if r["optim"] == optim and r["lr"] == lr]
            if sel:
                rows[f"{lr:g}"] = {"lr": lr, "final_eval_loss": summarize([r["final_eval_loss"] for r in sel]),
                                   "seeds": [r["seed"] for r in sel]}
        grid[name] = rows
    result: dict[str, Any] = {
        "config": cfg, "runs": records, "grid": grid, "completed": len(ok), "planned": len(runs),
        "failed_runs": [{k: r[k] for k in ("optim", "lr", "seed", "failed")} for r in failed],
    }
    if lane_failure:
        result["lane_failure"] = lane_failure
    if missing:
        result["missing_runs"] = missing
    adamw, muon = grid["AdamW"], grid["hf_muon.Muon"]
    if not adamw or not muon:
        result["failed"] = lane_failure or (failed[0]["failed"] if failed else "no run finished")
        return result
    best = {name: min(rows.values(), key=lambda r: r["final_eval_loss"]["median"])["lr"] for name, rows in grid.items()}
    target = adamw[f"{best['AdamW']:g}"]["final_eval_loss"]["median"]
    max_steps = cfg["training"]["max_steps"]

    def curves(optim: str, lr: float) -> list[dict[str, Any]]:
        return [r for r in ok if r["optim"] == optim and r["lr"] == lr]

    reach = {}
    for label, optim, lr in (("muon_at_its_best_lr", "muon", best["hf_muon.Muon"]),
                             ("muon_at_adamw_best_lr", "muon", best["AdamW"]),
                             ("adamw_at_its_best_lr", "adamw_torch", best["AdamW"])):
        per_seed = {r["seed"]: steps_to_reach(r["eval_curve"], target) for r in curves(optim, lr)}
        med = median_or_none(list(per_seed.values()))
        reach[label] = {"lr": lr, "steps_per_seed": per_seed, "median_steps": med,
                        "fraction_of_run": None if med is None else med / max_steps}
    plotted = {}
    for label, optim, lr in (("AdamW at its best lr", "adamw_torch", best["AdamW"]),
                             ("hf_muon.Muon at its best lr", "muon", best["hf_muon.Muon"]),
                             ("hf_muon.Muon at AdamW's best lr", "muon", best["AdamW"])):
        sel = curves(optim, lr)
        plotted[label] = {"lr": lr, "median_curve": median_curve([r["eval_curve"] for r in sel]),
                          "per_seed": {r["seed"]: r["eval_curve"] for r in sel}}
    result.update(best_lr=best, target_loss=target, max_steps=max_steps, reach=reach, curves=plotted)
    return result
