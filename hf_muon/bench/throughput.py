"""Figure 2 (and the runs figures 3 and 4 read): end-to-end training through ``Trainer``.

Every run is a child process running :mod:`hf_muon.bench.train_worker`: one process for the
single-process runs, ``torchrun --nproc_per_node 2`` with ``DS_ACCELERATOR=cpu`` (gloo) for ZeRO-2 and
ZeRO-3 at W=2. Each launch has a hard timeout; a run that fails or times out becomes a
``failed: <reason>`` entry and the benchmark goes on. The same model, data, seed, learning rate and
tokens per optimizer step for every contender; the W=2 runs halve the gradient accumulation so the
tokens per step stay the same.

Launches are interleaved in ``rounds`` (AdamW, Muon, ..., AdamW, Muon, ...): a noisy neighbour that slows
one launch lands on one round, not on one contender. A contender's ratio to AdamW is taken within each
round (its launch against the AdamW launch next to it) and reported as the median over rounds with
its spread.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from ..launching import free_port
from .common import child_env, progress, run_child, summarize

SINGLE = "single process"
SETTINGS = {None: SINGLE, 2: "ZeRO-2, W=2", 3: "ZeRO-3, W=2"}


def _run_key(contender: str, stage: int | None) -> str:
    return f"{contender}@zero{stage}" if stage else contender


def plan(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The launches, in the order they run: ``{"world": 1 | W, "round": k, "runs": [{"contender",
    "zero_stage"}, ...]}``. Each of ``rounds`` (default 1) launches every run of a world size once,
    AdamW first, so the launches of the contenders alternate. With ``group_launches`` (the quick
    preset) all runs of a world size share one process (group) per round."""
    rounds = cfg.get("rounds", 1)
    if not (isinstance(rounds, int) and rounds >= 1):
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    single = [{"contender": c, "zero_stage": None} for c in cfg["single"]]
    zero = [{"contender": c, "zero_stage": stage} for stage in cfg["zero_stages"] for c in cfg["zero"]]
    launches = []
    for world, runs in ((1, single), (cfg["world"], zero)):
        if not runs:
            continue
        for k in range(rounds):
            if cfg.get("group_launches"):
                launches.append({"world": world, "round": k, "runs": runs})
            else:
                launches += [{"world": world, "round": k, "runs": [r]} for r in runs]
    return launches


def _spec(cfg: dict[str, Any], world: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    per_micro = cfg["micro_batch"] * cfg["seq_len"] * world
    if cfg["tokens_per_step"] % per_micro:
        raise ValueError(f"tokens_per_step {cfg['tokens_per_step']} is not a multiple of {per_micro}")
    cpus = os.cpu_count() or 1
    return {
        "model": cfg["model"], "seq_len": cfg["seq_len"], "micro_batch": cfg["micro_batch"],
        "grad_accum": cfg["tokens_per_step"] // per_micro, "warmup_steps": cfg["warmup_steps"],
        "measured_steps": cfg["measured_steps"], "lr": cfg["lr"], "weight_decay": cfg["weight_decay"],
        "corpus_mb": cfg["corpus_mb"], "seed": cfg["seed"], "threads": max(1, cpus // world), "runs": runs,
    }


def _launch(launch: dict[str, Any], cfg: dict[str, Any], out_dir: Path, index: int, bar) -> dict[str, Any]:
    world, runs = launch["world"], launch["runs"]
    work = out_dir / f"launch{index}"
    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(_spec(cfg, world, runs), indent=1))
    worker = ["-m", "hf_muon.bench.train_worker", "--spec", str(spec_path), "--out", str(work)]
    extra = {"DS_ACCELERATOR": "cpu"} if world > 1 else {}
    extra.update(cfg.get("env", {}))
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *worker]
    else:
        cmd = [sys.executable, *worker]
    env = child_env(threads=max(1, (os.cpu_count() or 1) // world), extra=extra)
    seen = [0]

    def poll() -> None:
        try:
            done = len(json.loads((work / "rank0.json").read_text())["runs"])
        except (OSError, ValueError, KeyError):
            return
        if done > seen[0]:
            bar.update(done - seen[0])
            seen[0] = done

    timeout = cfg["launch_timeout_s"] + cfg["run_timeout_s"] * len(runs)
    ok, reason = run_child(cmd, work / "log.txt", timeout, env=env, on_poll=poll)
    bar.update(len(runs) - seen[0])
    per_rank = []
    for rank in range(world):
        try:
            per_rank.append(json.loads((work / f"rank{rank}.json").read_text())["runs"])
        except (OSError, ValueError, KeyError):
            per_rank.append({})
    out = {}
    for run in runs:
        key = _run_key(run["contender"], run["zero_stage"])
        ranks = [r.get(key) for r in per_rank]
        if any(r is None for r in ranks):
            why = reason or "the worker wrote no result"
            if len(runs) > 1:
                why += f" (launch shared by {len(runs)} runs)"
            out[key] = {"contender": run["contender"], "zero_stage": run["zero_stage"], "failed": why,
                        "log": str(work / "log.txt")}
            continue
        out[key] = summarize_run(run, ranks, isolated=len(runs) == 1)
        out[key]["log"] = str(work / "log.txt")
    return out


def summarize_run(run: dict[str, Any], ranks: list[dict[str, Any]], isolated: bool) -> dict[str, Any]:
    """One run's figures from its ranks' records."""
    first = ranks[0]
    base = {"contender": run["contender"], "zero_stage": run["zero_stage"], "label": first.get("label"),
            "wall_s": first.get("wall_s")}
    failures = [r["failed"] for r in ranks if "failed" in r]
    if failures:
        return {**base, "failed": failures[0]}
    measured = first["measured_steps"]
    bytes_per_rank = []
    for r in ranks:
        ops = sorted({op for s in r["measured_steps"] for op in s["collective_bytes"]})
        bytes_per_rank.append({op: statistics.median(s["collective_bytes"].get(op, 0) for s in r["measured_steps"])
                               for op in ops})
    from .commcount import CommCounter

    ops = sorted({op for b in bytes_per_rank for op in b})
    mean_by_op = {op: statistics.mean(b.get(op, 0) for b in bytes_per_rank) for op in ops}
    return {
        **base,
        "optimizer_class": first["optimizer_class"], "world_size": first["world_size"],
        "tokens_per_step": first["tokens_per_step"], "parameters": first["parameters"],
        "tokens_per_s": summarize([s["tokens_per_s"] for s in measured]),
        "step_s": summarize([s["seconds"] for s in measured]),
        "optimizer_step_s": summarize(first["optimizer_step_s"]) if first["optimizer_step_s"] else None,
        "optimizer_state_bytes_per_rank": [r["optimizer_state_bytes"] for r in ranks],
        "peak_rss_bytes_per_rank": [r["peak_rss_process_bytes"] if isolated else r["peak_rss_sampled_bytes"]
                                    for r in ranks],
        "rss_before_train_bytes_per_rank": [r["rss_before_train_bytes"] for r in ranks],
        "peak_rss_training_bytes_per_rank": [r["peak_rss_sampled_bytes"] for r in ranks],
        "rss_isolated": isolated,
        "collective_bytes_per_rank_per_step": {"by_op": mean_by_op, "by_category": CommCounter.by_category(mean_by_op),
                                               "total": sum(mean_by_op.values()),
                                               "per_rank_total": [sum(b.values()) for b in bytes_per_rank]},
        "exchange_bytes_sent_per_rank": [r.get("exchange_bytes_sent") for r in ranks],
    }


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One contender's row from its runs in each round. Throughput and step time: median (min–max)
    of the rounds' medians, with every timed step kept; memory and traffic: the first round that
    succeeded (the same model and data every round); a failed round is listed, not averaged in."""
    ok = [r for r in rounds if "failed" not in r]
    failed = [{"round": k, "failed": r["failed"], "log": r.get("log")} for k, r in enumerate(rounds) if "failed" in r]
    if not ok:
        return {**rounds[0], "failed_rounds": failed}
    row = dict(ok[0])
    for key in ("tokens_per_s", "step_s"):
        row[key] = {**summarize([r[key]["median"] for r in ok]),
                    "steps": [x for r in ok for x in r[key]["samples"]]}
    steps = [x for r in ok if r.get("optimizer_step_s") for x in r["optimizer_step_s"]["samples"]]
    row["optimizer_step_s"] = summarize(steps) if steps else None
    row["wall_s"] = [r.get("wall_s") for r in rounds]
    row["rounds"] = len(rounds)
    row["logs"] = [r.get("log") for r in rounds]
    if failed:
        row["failed_rounds"] = failed
    return row


def ratios_to_adamw(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per contender, its tokens/s over AdamW's in the same round: median (min–max) over the rounds
    both ran in."""
    base = rounds.get("adamw", [])
    out = {}
    for contender, runs in rounds.items():
        ratios = [r["tokens_per_s"]["median"] / a["tokens_per_s"]["median"] for r, a in zip(runs, base)
                  if "failed" not in r and "failed" not in a and a["tokens_per_s"]["median"]]
        if ratios:
            out[contender] = summarize(ratios)
    return out


def run(cfg: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """All launches of ``cfg``; results keyed by setting, then contender."""
    launches = plan(cfg)
    bar = progress(sum(len(launch["runs"]) for launch in launches), "fig 2-4: training runs", "run")
    by_round: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for i, launch in enumerate(launches):
        bar.set_postfix_str(f"round {launch['round'] + 1}: "
                            + ", ".join(_run_key(r["contender"], r["zero_stage"]) for r in launch["runs"]))
        for row in _launch(launch, cfg, out_dir, i, bar).values():
            setting = SETTINGS[row["zero_stage"]]
            by_round.setdefault(setting, {}).setdefault(row["contender"], []).append(row)
    bar.close()
    results: dict[str, Any] = {}
    for setting, contenders in by_round.items():
        ratios = ratios_to_adamw(contenders)
        rows = results.setdefault(setting, {})
        for contender, runs in contenders.items():
            rows[contender] = merge_rounds(runs)
            if contender in ratios:
                rows[contender]["throughput_x_adamw"] = ratios[contender]["median"]
                rows[contender]["throughput_x_adamw_rounds"] = ratios[contender]
    return {"config": {k: v for k, v in cfg.items() if k != "env"}, "settings": results}
