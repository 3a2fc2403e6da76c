"""The report: targets judged from the measurements, ``report.md`` with tables, and PNG plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import CONTENDERS, HF_MUON, HF_MUON_AOL
from .throughput import SINGLE

ZERO2, ZERO3 = "ZeRO-2, W=2", "ZeRO-3, W=2"
MET, MISSED, NOT_MEASURED = "met", "MISSED", "not measured"
# "Equal or better orthogonality error": float noise (bf16 vs fp32 rounding of the same quintic)
# moves the error in the 5th digit; equal means within this relative tolerance.
ORTHO_TOLERANCE = 0.01


def _mib(n: float | None) -> str:
    return "–" if n is None else f"{n / 2**20:.1f} MiB"


def _fmt(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}g}"


def _ms(summary: dict[str, Any] | None) -> str:
    if not summary or summary.get("median") is None:
        return "–"
    return f"{1e3 * summary['median']:.1f} ({1e3 * summary['min']:.1f}–{1e3 * summary['max']:.1f})"


def _range(summary: dict[str, Any] | None, scale: float = 1.0, digits: int = 0) -> str:
    if not summary or summary.get("median") is None:
        return "–"
    f = f"{{:.{digits}f}}"
    return f"{f.format(summary['median'] * scale)} ({f.format(summary['min'] * scale)}–{f.format(summary['max'] * scale)})"


def _status(ok: bool) -> str:
    return MET if ok else MISSED


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _ortho_errors(ortho: dict[str, Any], prefix: str) -> dict[str, float] | None:
    """The variant named ``prefix...``'s relative error per input kind (gaussian, low_rank)."""
    row = next((v for k, v in ortho.items() if k.startswith(prefix)), None)
    return None if row is None else {kind: r["relative_error"] for kind, r in row.items()}


def _step_vs_torch_muon(fig1: dict[str, Any]) -> tuple[str, str, str | None, str, str]:
    """Target 3 over every set of figure 1: hf_muon.Muon as shipped, its step over torch.optim.Muon's
    (median of the per-round ratios, min–max) and its orthogonality error on Gaussian and gradient-like
    inputs against torch.optim.Muon's. The AOL contender's figures go in the detail."""
    name = "step time vs torch.optim.Muon"
    goal = "optimizer step <= 0.75 x torch.optim.Muon at equal or better orthogonality error, each set"
    sets = _get(fig1, "step_time") or {}
    measured, details, ok = [], [], bool(sets)
    for set_name, data in sets.items():
        rows = data["contenders"]
        ortho = _get(fig1, "orthogonality", set_name) or {}
        theirs = _ortho_errors(ortho, "torch.optim.Muon")
        ratios = {c: _get(rows, c, "x_torch_muon") for c in (HF_MUON, HF_MUON_AOL)}
        if not ratios[HF_MUON] or ratios[HF_MUON].get("median") is None or not theirs:
            return name, goal, None, NOT_MEASURED, f"fig 1 step times or errors incomplete ({set_name})"
        ours = _ortho_errors(ortho, "hf_muon shipped")
        aol = _ortho_errors(ortho, "hf_muon AOL (quintic, ") if HF_MUON_AOL in rows else None
        error_ok = all(ours[k] <= theirs[k] * (1 + ORTHO_TOLERANCE) for k in theirs)
        r = ratios[HF_MUON]
        ok = ok and r["median"] <= 0.75 and error_ok
        measured.append(f"{set_name} {r['median']:.2f} x")
        text = (f"{set_name}: {r['median']:.3f} x ({r['min']:.2f}–{r['max']:.2f}), error gaussian "
                f"{ours['gaussian']:.4f} / low-rank {ours['low_rank']:.4f} vs {theirs['gaussian']:.4f} / "
                f"{theirs['low_rank']:.4f}")
        a = ratios[HF_MUON_AOL]
        if a and a.get("median") is not None and aol:
            text += (f"; AOL 4 steps {a['median']:.3f} x, error {aol['gaussian']:.4f} / {aol['low_rank']:.4f} "
                     f"({'equal or better' if all(aol[k] <= theirs[k] * (1 + ORTHO_TOLERANCE) for k in theirs) else 'worse'})")
        details.append(text)
    if not sets:
        return name, goal, None, NOT_MEASURED, "fig 1 not run"
    details.append(f"ratio = median of per-round step ratios (min–max); equal error = within "
                   f"{100 * ORTHO_TOLERANCE:.0f}% relative on both inputs; torch.optim.Muon runs Newton–Schulz in "
                   f"bf16, one matrix at a time; hf_muon in {fig1.get('ns_dtype', 'float32')}, batched by shape")
    return name, goal, "; ".join(measured), _status(ok), ". ".join(details)


# ------------------------------------------------------------------------------------------- targets
def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the benchmark issue with the measured value and met / MISSED / not measured."""
    figs = results.get("figures", {})
    out = []

    def add(name: str, goal: str, measured: str | None, status: str, detail: str = "") -> None:
        out.append({"target": name, "goal": goal, "measured": measured or "–", "status": status, "detail": detail})

    # 1. throughput
    train = _get(figs, "fig2_4", "settings") or {}
    for setting in (SINGLE, ZERO2):
        rows = train.get(setting, {})
        muon, adamw = rows.get("hf_muon", {}), rows.get("adamw", {})
        name = f"throughput, {setting}"
        tokens = _get(results, "figures", "fig2_4", "config", "tokens_per_step")
        goal = f"hf_muon.Muon tokens/s >= 0.98 x AdamW's" + (f" at {tokens} tokens per step" if tokens else "")
        if "failed" in muon or "failed" in adamw or not muon or not adamw:
            why = muon.get("failed") or adamw.get("failed") or "not run"
            add(name, goal, None, NOT_MEASURED, f"failed: {why}")
        else:
            ratio = muon["throughput_x_adamw"]
            m, a = muon["tokens_per_s"], adamw["tokens_per_s"]
            detail = (f"{m['median']:.0f} ({m['min']:.0f}–{m['max']:.0f}) vs {a['median']:.0f} ({a['min']:.0f}–"
                      f"{a['max']:.0f}) tokens/s")
            spread = muon.get("throughput_x_adamw_rounds")
            if spread and spread["n"] > 1:
                detail += (f"; ratio median of {spread['n']} interleaved rounds, "
                           f"{spread['min']:.3f}–{spread['max']:.3f}")
            opt_step = (muon.get("optimizer_step_s") or {}).get("median")
            if opt_step and not muon.get("zero_stage"):
                detail += (f"; hf_muon's optimizer step is {1e3 * opt_step:.0f} ms of a "
                           f"{muon['step_s']['median']:.1f} s step ({100 * opt_step / muon['step_s']['median']:.1f}%)")
            if ratio < 0.98 and m["max"] >= a["min"]:
                detail += "; the ranges overlap: the gap is within this run's step-to-step noise"
            add(name, goal, f"{ratio:.3f} x", _status(ratio >= 0.98), detail)

    # 2. Newton–Schulz FLOP/s
    fig1 = figs.get("fig1", {})
    first_set = next(iter(_get(fig1, "step_time") or {}), None)
    eff = _get(fig1, "ns_efficiency", first_set, "total", "shipped") if first_set else None
    goal = "Newton–Schulz >= 85% of this machine's matmul FLOP/s for the same shapes and dtype"
    if eff:
        add(f"NS FLOP/s ({first_set})", goal, f"{100 * eff['fraction_of_machine']:.0f}%",
            _status(eff["fraction_of_machine"] >= 0.85),
            f"{eff['achieved_gflops']:.1f} GFLOP/s executed vs {eff['machine_gflops']:.1f} GFLOP/s bare matmuls "
            f"({fig1.get('ns_dtype', 'float32')}); {eff['standard_equivalent_gflops']:.1f} GFLOP/s counted as the "
            "standard iteration's FLOPs")
    else:
        add("NS FLOP/s", goal, None, NOT_MEASURED, _get(results, "sections", "fig1", "failed") or "fig 1 not run")

    # 3. step time vs torch.optim.Muon at equal or better orthogonality error, on every set
    add(*_step_vs_torch_muon(fig1))

    # 4. peak memory, 5. optimizer state
    single = train.get(SINGLE, {})
    muon, adamw = single.get("hf_muon", {}), single.get("adamw", {})
    goal = "peak resident memory of the training process <= 0.85 x AdamW's"
    if muon.get("peak_rss_bytes_per_rank") and adamw.get("peak_rss_bytes_per_rank"):
        m, a = muon["peak_rss_bytes_per_rank"][0], adamw["peak_rss_bytes_per_rank"][0]
        growth_m = m - muon["rss_before_train_bytes_per_rank"][0]
        growth_a = a - adamw["rss_before_train_bytes_per_rank"][0]
        note = "" if muon.get("rss_isolated") else " (runs shared one process: sampled, not isolated)"
        saved = adamw["optimizer_state_bytes_per_rank"][0] - muon["optimizer_state_bytes_per_rank"][0]
        add("peak training memory (single process)", goal, f"{m / a:.3f} x", _status(m / a <= 0.85),
            f"{_mib(m)} vs {_mib(a)}{note}; growth during training {_mib(growth_m)} vs {_mib(growth_a)}; "
            f"Muon's smaller state saves {_mib(saved)} = {100 * saved / a:.1f}% of AdamW's peak: the rest "
            "(libraries, model, activations) is the same for both")
    else:
        add("peak training memory", goal, None, NOT_MEASURED, muon.get("failed") or adamw.get("failed") or "not run")
    state = _get(figs, "fig3", "measured")
    goal = "optimizer state <= 0.55 x AdamW's on the Llama-like model"
    if state:
        add("optimizer state (Llama-like model)", goal, f"{state['muon_x_adamw']:.3f} x",
            _status(state["muon_x_adamw"] <= 0.55),
            f"{_mib(state['hf_muon.Muon'])} vs {_mib(state['AdamW'])}, vocabulary {state['vocab']}")
    else:
        add("optimizer state", goal, None, NOT_MEASURED, _get(results, "sections", "fig3", "failed") or "not run")

    # 6. traffic under ZeRO-3
    z3 = _get(figs, "fig4", ZERO3)
    goal = "extra traffic over AdamW <= 0.25 x the extra traffic of DeepSpeed's Muon (ZeRO-3, W=2)"
    if z3 and z3["muon_extra_x_ds_muon_extra"] is not None:
        ratio = z3["muon_extra_x_ds_muon_extra"]
        ours, theirs = z3["rows"]["hf_muon"]["extra_over_adamw"], z3["rows"]["ds_muon"]["extra_over_adamw"]
        add("extra traffic, ZeRO-3 W=2", goal, f"{ratio:.3f} x", _status(ratio <= 0.25),
            f"+{_mib(ours)} vs +{_mib(theirs)} per rank per step over AdamW's {_mib(z3['adamw_total'])}")
    else:
        rows3 = (z3 or {}).get("rows", {})
        why = "; ".join(f"{r['label']}: {r['failed']}" for r in rows3.values() if "failed" in r)
        if not why and rows3:
            why = "DeepSpeed's Muon moved no more than AdamW: ratio undefined"
        add("extra traffic, ZeRO-3 W=2", goal, None, NOT_MEASURED, why or "not run")

    # 7. quality
    q = figs.get("fig5", {})
    goal = "hf_muon.Muon at its best lr reaches AdamW's best final eval loss in <= 0.4 x the steps (median over seeds)"
    reach = _get(q, "reach", "muon_at_its_best_lr")
    if reach:
        frac = reach["fraction_of_run"]
        measured = "not reached" if frac is None else f"{frac:.2f} x ({reach['median_steps']:.0f} of {q['max_steps']} steps)"
        add("steps to AdamW's best loss", goal, measured, _status(frac is not None and frac <= 0.4),
            f"target loss {q['target_loss']:.4f} (AdamW at lr {q['best_lr']['AdamW']:g}); Muon at lr "
            f"{q['best_lr']['hf_muon.Muon']:g}")
    else:
        add("steps to AdamW's best loss", goal, None, NOT_MEASURED, q.get("failed") or "fig 5 not run")

    # 8. telemetry's cost
    tel = _get(figs, "fig6", "telemetry") or {}
    goal = "recording the telemetry costs < 1% of the optimizer step"
    if "recording_share_of_step" in tel:
        share = tel["recording_share_of_step"]
        add("telemetry cost", goal, f"{100 * share:.2f}% of the step", _status(share < 0.01),
            f"step time on/off {tel['ratio_on_off']['median']:.3f}x (median of {tel['repeats']} interleaved pairs); "
            f"reading the figures {1e3 * tel['read_s']['median']:.1f} ms per logging step; a Trainer records only "
            f"in the steps it logs, so it pays this once per logging_steps")
    elif "fig6" in figs:
        add("telemetry cost", goal, None, NOT_MEASURED, tel.get("failed") or "not run")
    return out


# ---------------------------------------------------------------------------------------------- plots
def plots(results: dict[str, Any], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = results.get("figures", {})
    written: list[str] = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append(name)

    def bars(ax, labels, values, lows=None, highs=None, colors=None):
        xs = range(len(labels))
        err = None
        if lows is not None:
            err = [[max(0.0, v - lo) for v, lo in zip(values, lows)], [max(0.0, hi - v) for v, hi in zip(values, highs)]]
        ax.bar(xs, values, yerr=err, capsize=3, color=colors)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)

    fig1 = figs.get("fig1", {})
    if fig1.get("step_time"):
        sets = fig1["step_time"]
        fig, axes = plt.subplots(1, len(sets), figsize=(5.5 * len(sets), 4.2), squeeze=False)
        for ax, (set_name, data) in zip(axes[0], sets.items()):
            names = [n for n in CONTENDERS if data["contenders"].get(n, {}).get("median")]
            rows = [data["contenders"][n] for n in names]
            bars(ax, names, [1e3 * r["median"] for r in rows], [1e3 * r["min"] for r in rows],
                 [1e3 * r["max"] for r in rows])
            ax.set_yscale("log")
            ax.set_ylabel("optimizer step (ms, median, min–max)")
            spec = data["spec"]
            ax.set_title(f"{set_name}: d={spec['d']}, {spec['layers']} layers, {data['matrices']} matrices", fontsize=9)
        save(fig, "fig1_step_time.png")
    if fig1.get("ns_efficiency"):
        effs = fig1["ns_efficiency"]
        fig, axes = plt.subplots(1, len(effs), figsize=(5.5 * len(effs), 4.0), squeeze=False)
        for ax, (set_name, eff) in zip(axes[0], effs.items()):
            labels, values = [], []
            for row in eff["per_shape"]:
                labels.append(f"{row['shape'][0]}x{row['shape'][1]} x{row['batch']} {row['kernel']} ({row['method']})")
                values.append(100 * row["fraction_of_machine"])
            for label in ("shipped", "before"):
                labels.append(f"all shapes, {label}")
                values.append(100 * eff["total"][label]["fraction_of_machine"])
            bars(ax, labels, values, colors=["tab:blue" if "shipped" in lb else "tab:gray" for lb in labels])
            ax.axhline(85, color="red", linestyle=":", label="target 85%")
            ax.set_ylabel(f"% of bare-matmul FLOP/s, same products ({eff['dtype']})")
            ax.set_title(f"{set_name}: Newton–Schulz vs machine matmul", fontsize=9)
            ax.legend(fontsize=7)
        save(fig, "fig1_ns_efficiency.png")
    if fig1.get("orthogonality"):
        set_name, ortho = next(iter(fig1["orthogonality"].items()))
        kinds = ("gaussian", "low_rank")
        fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 4.2), squeeze=False)
        for ax, kind in zip(axes[0], kinds):
            names = list(ortho)
            bars(ax, names, [ortho[n][kind]["relative_error"] for n in names])
            ax.set_yscale("log")
            ax.set_ylabel("|O - UV^T|_F / |UV^T|_F")
            ax.set_title(f"orthogonality error vs SVD polar factor ({set_name}, {kind.replace('_', ' ')})",
                         fontsize=9)
        save(fig, "fig1_orthogonality.png")

    train = _get(figs, "fig2_4", "settings") or {}
    if train:
        fig, ax = plt.subplots(figsize=(8, 4.2))
        labels, values, lows, highs = [], [], [], []
        for setting, rows in train.items():
            for contender, row in rows.items():
                labels.append(f"{setting}\n{row.get('label') or contender}")
                tps = row.get("tokens_per_s") or {}
                values.append(tps.get("median") or 0.0)
                lows.append(tps.get("min") or 0.0)
                highs.append(tps.get("max") or 0.0)
        bars(ax, labels, values, lows, highs)
        ax.set_ylabel("tokens/s (median, min–max over steps)")
        tokens = _get(figs, "fig2_4", "config", "tokens_per_step")
        ax.set_title(f"end-to-end Trainer throughput, {tokens} tokens per optimizer step (0 = failed)", fontsize=9)
        save(fig, "fig2_throughput.png")

    state = _get(figs, "fig3", "measured")
    single = train.get(SINGLE, {})
    if state or single:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        if state:
            bars(a1, ["AdamW", "hf_muon.Muon"], [state["AdamW"] / 2**20, state["hf_muon.Muon"] / 2**20])
            a1.set_ylabel("optimizer state (MiB)")
            a1.set_title(f"Llama-like model (vocab {state['vocab']})", fontsize=9)
        names = [c for c, r in single.items() if r.get("peak_rss_bytes_per_rank")]
        if names:
            peak = [single[c]["peak_rss_bytes_per_rank"][0] / 2**20 for c in names]
            before = [single[c]["rss_before_train_bytes_per_rank"][0] / 2**20 for c in names]
            xs = range(len(names))
            a2.bar(xs, before, label="before training", color="tab:gray")
            a2.bar(xs, [p - b for p, b in zip(peak, before)], bottom=before, label="growth to peak", color="tab:blue")
            a2.set_xticks(list(xs))
            a2.set_xticklabels([single[c].get("label") or c for c in names], rotation=20, ha="right", fontsize=7)
            a2.set_ylabel("resident memory (MiB)")
            a2.set_title("peak RSS of the training process (single process)", fontsize=9)
            a2.legend(fontsize=7)
        save(fig, "fig3_memory.png")

    net = figs.get("fig4") or {}
    zero_rows = [(s, c, r) for s, data in net.items() for c, r in data["rows"].items()]
    if zero_rows:
        from .commcount import CATEGORIES

        fig, ax = plt.subplots(figsize=(8, 4.2))
        xs = range(len(zero_rows))
        bottom = [0.0] * len(zero_rows)
        for cat in CATEGORIES:
            vals = [(_get(r, "by_category", cat) or 0) / 2**20 for _, _, r in zero_rows]
            ax.bar(xs, vals, bottom=bottom, label=cat)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for x, total in zip(xs, bottom):
            ax.annotate(f"{total:.1f}", (x, total), ha="center", va="bottom", fontsize=7)
        ax.set_ylim(0, 1.12 * max(bottom + [1.0]))
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{s}\n{r['label']}" + ("\n(failed)" if "failed" in r else "") for s, c, r in zero_rows],
                           rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("MiB per rank per optimizer step")
        ax.set_title("bytes passed to collectives", fontsize=9)
        ax.legend(fontsize=7)
        save(fig, "fig4_network.png")

    q = figs.get("fig5", {})
    if q.get("grid"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, rows in q["grid"].items():
            pts = sorted((r["lr"], r["final_eval_loss"]) for r in rows.values())
            if not pts:
                continue
            lrs = [p[0] for p in pts]
            med = [p[1]["median"] for p in pts]
            ax.errorbar(lrs, med, yerr=[[m - p[1]["min"] for m, p in zip(med, pts)], [p[1]["max"] - m for m, p in zip(med, pts)]],
                        marker="o", capsize=3, label=name)
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        if not ax.lines:
            ax.text(0.5, 0.5, "no finished runs", transform=ax.transAxes, ha="center")
        ax.set_ylabel("final eval loss (median, min–max over seeds)")
        ax.set_title("learning-rate sweep, same grid for both", fontsize=9)
        if ax.lines:
            ax.legend(fontsize=8)
        save(fig, "fig5_lr_sweep.png")
    if q.get("curves"):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for label, data in q["curves"].items():
            if data["median_curve"]:
                ax.plot(*zip(*data["median_curve"]), marker="o", markersize=3, label=f"{label} ({data['lr']:g})")
        ax.axhline(q["target_loss"], color="gray", linestyle=":", label="AdamW's best final eval loss")
        reach = _get(q, "reach", "muon_at_its_best_lr", "median_steps")
        if reach is not None:
            ax.axvline(reach, color="gray", linestyle="--", label=f"Muon reaches it at step {reach:.0f} (median)")
        ax.set_xlabel("step")
        ax.set_ylabel("eval loss (median over seeds)")
        ax.set_title("eval loss at the best learning rates", fontsize=9)
        ax.legend(fontsize=7)
        save(fig, "fig5_curves.png")
    fused = _get(figs, "fig6", "fused") or {}
    if fused.get("curves"):
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for split, curve in fused["curves"].items():
            if curve:
                ax.plot(*zip(*curve), marker="o", markersize=3,
                        label=f"ns_split={split} (lr {fused['best'][split]['lr']:g})")
        ax.set_xlabel("step")
        ax.set_ylabel("eval loss (median over seeds)")
        ax.set_title("GPT-2: fused c_attn orthogonalized per block vs whole, each at its best lr", fontsize=9)
        ax.legend(fontsize=8)
        save(fig, "fig6_fused_curves.png")
    qk = _get(figs, "fig6", "qk_clip") or {}
    if any(isinstance(v, dict) and v.get("max_logit_curve") for v in qk.values()):
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for arm, data in qk.items():
            if isinstance(data, dict) and data.get("max_logit_curve"):
                ax.plot(*zip(*data["max_logit_curve"]), marker="o", markersize=3, label=arm)
        ax.axhline(qk["config"]["tau"], color="gray", linestyle=":", label=f"tau = {qk['config']['tau']:g}")
        ax.set_xlabel("step")
        ax.set_ylabel("largest attention logit in the step")
        ax.set_title(f"QK-clip at lr {qk['config']['lr']:g}", fontsize=9)
        ax.legend(fontsize=8)
        save(fig, "fig6_qk_clip.png")
    ada = _get(figs, "fig6", "adaptive_lr") or {}
    if _get(ada, "adaptive lr", "eval_curve"):
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for arm in ("adaptive lr", "fixed schedule"):
            if ada[arm]["eval_curve"]:
                ax.plot(*zip(*ada[arm]["eval_curve"]), marker="o", markersize=3, label=f"{arm}: eval loss")
        ax.set_xlabel("step")
        ax.set_ylabel("eval loss (median over seeds)")
        if ada["adaptive lr"].get("multiplier_curve"):
            twin = ax.twinx()
            twin.plot(*zip(*ada["adaptive lr"]["multiplier_curve"]), color="gray", linestyle="--", label="lr multiplier")
            twin.set_ylabel("lr multiplier (median)")
            twin.legend(fontsize=7, loc="upper center")
        ax.set_title("adaptive learning rate vs the schedule alone", fontsize=9)
        ax.legend(fontsize=7)
        save(fig, "fig6_adaptive_lr.png")
    return written


# ------------------------------------------------------------------------------------------ markdown
def markdown(results: dict[str, Any], plot_files: list[str]) -> str:
    m = results.get("machine", {})
    lines = [
        f"# hf_muon benchmark ({results['preset']} preset)", "",
        f"Command: `{results['command']}`  ",
        f"Started {results['started']}, took {results['elapsed_s']:.0f} s.  ",
        f"Machine: {m.get('cpu')}, {m.get('cpu_count')} CPUs ({m.get('cpu_capability')}), torch {m.get('torch')}, "
        f"transformers {m.get('transformers')}, accelerate {m.get('accelerate')}, deepspeed {m.get('deepspeed')}.  ",
        f"Load average at start {m.get('loadavg_at_start')}, at end {results.get('loadavg_at_end')} "
        f"(anything above 0 besides this benchmark is contention: the timings are this run's, on this machine).",
        "",
    ]
    if results["preset"] == "quick":
        lines += ["> **Quick preset**: tiny models and few steps, to check that the pipeline works. Its numbers "
                  "say nothing about the targets; use the full preset for that.", ""]
    lines += ["## Targets", "", "| target | goal | measured | status | detail |", "|---|---|---|---|---|"]
    for t in results["targets"]:
        lines.append(f"| {t['target']} | {t['goal']} | {t['measured']} | **{t['status']}** | {t['detail']} |")
    missed = [t for t in results["targets"] if t["status"] != MET]
    lines += ["", (f"{len(missed)} of {len(results['targets'])} targets are not met or not measured: "
                   + "; ".join(f"{t['target']} ({t['status']})" for t in missed) + ".") if missed
              else "All targets met in this run.", ""]
    for name, sec in results.get("sections", {}).items():
        if "failed" in sec:
            lines += [f"**{name} failed:** {sec['failed']}", ""]
    figs = results.get("figures", {})
    lines += _fig1_md(figs.get("fig1"), plot_files)
    lines += _train_md(figs.get("fig2_4"), plot_files)
    lines += _fig3_md(figs.get("fig3"), figs.get("fig2_4"), plot_files)
    lines += _fig4_md(figs.get("fig4"), plot_files)
    lines += _fig5_md(figs.get("fig5"), plot_files)
    lines += _fig6_md(figs.get("fig6"), plot_files)
    timing = results.get("sections", {})
    lines += ["## Sections", "", "| section | seconds | load average before | after |", "|---|---|---|---|"]
    for name, sec in timing.items():
        lines.append(f"| {name} | {sec.get('elapsed_s', 0):.0f} | {sec.get('loadavg_before')} | {sec.get('loadavg_after')} |")
    lines.append("")
    return "\n".join(lines)


def _img(name: str, plot_files: list[str]) -> list[str]:
    return [f"![{name}]({name})", ""] if name in plot_files else []


def _fig1_md(fig1: dict[str, Any] | None, plot_files: list[str]) -> list[str]:
    if not fig1:
        return []
    out = ["## 1. Optimizer step on Llama-like matrices", "",
           f"Single process, {fig1.get('torch_threads')} torch threads. One warm-up step, then timed steps "
           "(median and min–max) on the same tensors and gradients for every contender.", ""]
    for set_name, data in fig1.get("step_time", {}).items():
        spec = data["spec"]
        ff = f"ff={spec['ff']}" if spec.get("ff") else "ff=8d/3 rounded up to 256"
        out += [f"**{set_name}**: d={spec['d']}, {spec['layers']} layers, {spec['heads']} heads, {spec['kv_heads']} "
                f"KV heads (GQA), SwiGLU ({ff}); {data['matrices']} matrices, {data['parameters'] / 1e6:.2f}M parameters, "
                f"{data['standard_ns_gflop']:.1f} GFLOP of Newton–Schulz per step (standard form).", "",
                "| contender | step ms, median (min–max) | n | x AdamW | x torch.optim.Muon, per round: median (min–max) |",
                "|---|---|---|---|---|"]
        for name in CONTENDERS:
            if name not in data["contenders"]:
                continue  # not a contender of this preset
            row = data["contenders"][name]
            if "skipped" in row:
                out.append(f"| {name} | skipped: {row['skipped']} | – | – | – |")
            else:
                out.append(f"| {name} | {_ms(row)} | {row.get('n')} | {_fmt(row.get('x_adamw'))} | "
                           f"{_range(row.get('x_torch_muon'), digits=3)} |")
        out.append("")
    out += _img("fig1_step_time.png", plot_files)
    effs = fig1.get("ns_efficiency", {})
    if effs:
        out += ["**Newton–Schulz FLOP/s against this machine's matmul FLOP/s** (quintic, 5 steps, "
                f"{fig1.get('ns_dtype', 'float32')} — the dtype hf_muon uses on this CPU). The limit is the time "
                "of the very matrix products the kernel executes, timed bare (`torch.bmm` into preallocated "
                "outputs, same batch, shapes and dtype, each product in the operand layout, row- or "
                "column-major, this machine multiplies fastest), in alternation with the kernel; the fraction is "
                "bare time / Newton–Schulz time. \"before\" is the standard iteration the kernel ran before the "
                "Gram change; \"shipped\" picks Gram iterations for wide matrices, which execute fewer FLOPs (in "
                "bf16 with one restart; the last column counts the standard form's FLOPs over the shipped time).",
                "",
                "| set | shape x batch | kernel | method | NS ms | bare matmuls ms | % of machine | executed GFLOP/s | standard-equivalent GFLOP/s |",
                "|---|---|---|---|---|---|---|---|---|"]
        for set_name, eff in effs.items():
            for row in eff["per_shape"]:
                out.append(f"| {set_name} | {row['shape'][0]}x{row['shape'][1]} x{row['batch']} | {row['kernel']} | "
                           f"{row['method']} | {1e3 * row['ns_s']:.1f} | {1e3 * row['bare_matmul_s']:.1f} | "
                           f"{100 * row['fraction_of_machine']:.0f}% | {row['achieved_gflops']:.1f} | "
                           f"{row['standard_equivalent_gflops']:.1f} |")
            for label, tot in eff["total"].items():
                out.append(f"| {set_name} | **all** | {label} | | {1e3 * tot['ns_s']:.1f} | {1e3 * tot['bare_matmul_s']:.1f} | "
                           f"**{100 * tot['fraction_of_machine']:.0f}%** | {tot['achieved_gflops']:.1f} | "
                           f"{tot['standard_equivalent_gflops']:.1f} |")
        out.append("")
        out += _img("fig1_ns_efficiency.png", plot_files)
    orthos = fig1.get("orthogonality", {})
    if orthos:
        out += ["**Orthogonality error** against the exact polar factor U V^T (SVD in float64) of one seeded matrix "
                "per distinct shape of each set, weighted by how often the shape occurs: Gaussian, and gradient-"
                "like (a rank-4 signal plus 1e-2 noise, whose tiny singular values the iteration must lift). The "
                "quintic is built to leave singular values in about [0.7, 1.2] (faster, not exact): its error is "
                "the polynomial's, not the dtype's. AOL (Turbo-Muon) rescales rows instead of dividing by the "
                "Frobenius norm and drops one iteration.", "",
                "| set | variant | error, Gaussian | singular values | error, low rank + noise | singular values |",
                "|---|---|---|---|---|---|"]
        for set_name, ortho in orthos.items():
            for name, row in ortho.items():
                g, lr = row["gaussian"], row["low_rank"]
                out.append(f"| {set_name} | {name} | {g['relative_error']:.4g} | {g['sigma_min']:.3f}–{g['sigma_max']:.3f} "
                           f"| {lr['relative_error']:.4g} | {lr['sigma_min']:.3g}–{lr['sigma_max']:.3f} |")
        out.append("")
    out += _img("fig1_orthogonality.png", plot_files)
    return out


def _train_md(train: dict[str, Any] | None, plot_files: list[str]) -> list[str]:
    if not train:
        return []
    c = train["config"]
    m = c["model"]
    out = ["## 2. End-to-end training throughput (Trainer)", "",
           f"Llama-style byte-level model (d={m['hidden_size']}, {m['num_layers']} layers, {m['num_heads']} heads, "
           f"{m['num_kv_heads']} KV heads, MLP {m['intermediate_size']}), sequences of {c['seq_len']}, micro-batch "
           f"{c['micro_batch']}, **{c['tokens_per_step']} tokens per optimizer step** (gradient accumulation; at "
           f"W=2 each rank accumulates half as many micro-batches). {c['warmup_steps']} warm-up step(s), then "
           f"{c['measured_steps']} timed steps per launch, wall time between optimizer-step ends; "
           f"{c.get('rounds', 1)} round(s) of launches interleaved (AdamW, Muon, ..., AdamW, Muon, ...): "
           "tokens/s is the median (min–max) of the rounds' medians (of the timed steps with one round), and "
           "x AdamW is the median (min–max) over rounds of the ratio to the AdamW launch of the same round. "
           "Same model, seed, data, learning rate and schedule for all. "
           "DeepSpeed runs: `torchrun --nproc_per_node 2`, `DS_ACCELERATOR=cpu`, gloo, fp32; ZeRO-3 with "
           "`stage3_param_persistence_threshold: 0` and `reduce_scatter: false` for every contender (DeepSpeed's "
           "Muon refuses reduce-scatter).", ""]
    if c.get("env"):
        out += [f"Environment for these runs: `{c['env']}`.", ""]
    out += ["| setting | contender | optimizer class | tokens/s, median (min–max) | x AdamW, median (min–max) "
            "| optimizer step ms |",
            "|---|---|---|---|---|---|"]
    for setting, rows in train["settings"].items():
        for contender, row in rows.items():
            label = row.get("label") or contender
            if "failed" in row:
                out.append(f"| {setting} | {label} | – | failed: {row['failed']} | – | – |")
                continue
            # under DeepSpeed the step runs inside the engine's backward: Trainer's optimizer.step() is a no-op
            step = "– (inside DeepSpeed)" if row.get("zero_stage") else _ms(row.get("optimizer_step_s"))
            ratio = row.get("throughput_x_adamw_rounds")
            ratio_cell = (f"{ratio['median']:.3f} ({ratio['min']:.3f}–{ratio['max']:.3f})" if ratio and ratio["n"] > 1
                          else _fmt(row.get("throughput_x_adamw")))
            out.append(f"| {setting} | {label} | `{row['optimizer_class']}` | {_range(row['tokens_per_s'])} | "
                       f"{ratio_cell} | {step} |")
    out.append("")
    return out + _img("fig2_throughput.png", plot_files)


def _fig3_md(fig3: dict[str, Any] | None, train: dict[str, Any] | None, plot_files: list[str]) -> list[str]:
    out = ["## 3. Memory", ""]
    if fig3:
        s, v = fig3["measured"], fig3["llama_vocab"]
        spec = fig3["spec"]
        out += [f"Optimizer state on the Llama-like model (d={spec['d']}, {spec['layers']} layers, GQA "
                f"{spec['heads']}/{spec['kv_heads']}, SwiGLU), measured after one step:", "",
                "| model | parameters | AdamW state | hf_muon.Muon state | ratio |", "|---|---|---|---|---|",
                f"| byte vocabulary ({s['vocab']}), measured | {s['parameters'] / 1e6:.2f}M | {_mib(s['AdamW'])} | "
                f"{_mib(s['hf_muon.Muon'])} | {s['muon_x_adamw']:.3f} |",
                f"| Llama vocabulary ({v['vocab']}), {v['how']} | {v['parameters'] / 1e6:.2f}M | {_mib(v['AdamW'])} | "
                f"{_mib(v['hf_muon.Muon'])} | {v['muon_x_adamw']:.3f} |", ""]
    single = (train or {}).get("settings", {}).get(SINGLE, {})
    if single:
        out += ["Peak resident memory (RSS) of the single-process training runs of figure 2 (the process's own "
                "high-water mark, which may be set before training starts, e.g. while libraries load), the RSS "
                "when training starts, the highest RSS sampled during training (every 20 ms), and the "
                "optimizer state the run held:", "",
                "| contender | peak RSS (process) | x AdamW | RSS before training | peak RSS during training | "
                "optimizer state |", "|---|---|---|---|---|---|"]
        base = single.get("adamw", {}).get("peak_rss_bytes_per_rank", [None])[0]
        for contender, row in single.items():
            if "failed" in row:
                out.append(f"| {row.get('label') or contender} | failed: {row['failed']} | | | | |")
                continue
            peak = row["peak_rss_bytes_per_rank"][0]
            during = (row.get("peak_rss_training_bytes_per_rank") or [None])[0]
            out.append(f"| {row['label']} | {_mib(peak)} | {_fmt(peak / base if base else None)} | "
                       f"{_mib(row['rss_before_train_bytes_per_rank'][0])} | {_mib(during)} | "
                       f"{_mib(row['optimizer_state_bytes_per_rank'][0])} |")
        if not next(iter(single.values())).get("rss_isolated", True):
            out.append("\nThese runs shared one process (quick preset): peaks are sampled per run, not isolated.")
        out.append("")
    return out + _img("fig3_memory.png", plot_files)


def _fig4_md(net: dict[str, Any] | None, plot_files: list[str]) -> list[str]:
    if not net:
        return []
    from .commcount import CATEGORIES

    out = ["## 4. Network: bytes per rank per optimizer step", "",
           "Every `torch.distributed` collective of the training process is wrapped (DeepSpeed's `deepspeed.comm` "
           "calls them); a call counts the larger of the buffers it sends or receives on the rank (all-reduce: "
           "the tensor; all-gather: the gathered output; reduce-scatter: the input; all-to-all: the larger side). "
           "Mean over the ranks of the median over timed steps, in the figure 2 runs. Where DeepSpeed reduces "
           "gradients (and ZeRO-3 gathers parameters) per micro-batch, that part scales with gradient "
           "accumulation; the extra over AdamW does not.", "",
           "| setting | contender | " + " | ".join(CATEGORIES) + " | total | x fp32 parameter bytes | extra over AdamW |",
           "|---|---|" + "---|" * (len(CATEGORIES) + 3)]
    for setting, data in net.items():
        for contender, row in data["rows"].items():
            if "failed" in row:
                out.append(f"| {setting} | {row['label']} | failed: {row['failed']} |" + " |" * (len(CATEGORIES) + 2))
                continue
            extra = "–" if row["extra_over_adamw"] is None else _mib(row["extra_over_adamw"])
            out.append(f"| {setting} | {row['label']} | " + " | ".join(_mib(row["by_category"][c]) for c in CATEGORIES)
                       + f" | {_mib(row['total'])} | {_fmt(row['x_parameter_bytes'])} | {extra} |")
    out.append("")
    for setting, data in net.items():
        ratio = data["muon_extra_x_ds_muon_extra"]
        if ratio is not None:
            out.append(f"{setting}: hf_muon.Muon's extra traffic is {ratio:.3f} x DeepSpeed's Muon's.  ")
    out.append("")
    return out + _img("fig4_network.png", plot_files)


def _lr_grid(lrs: list[float], grid: dict[str, dict[str, Any]], labels: dict[str, str]) -> list[str]:
    """A learning rate per row, each arm's median (min–max) final eval loss per column."""
    out = ["| learning rate | " + " | ".join(f"{labels[arm]} final eval loss, median (min–max)" for arm in grid) + " |",
           "|---|" + "---|" * len(grid)]
    for lr in lrs:
        cells = []
        for rows in grid.values():
            r = rows.get(f"{lr:g}")
            cells.append("–" if r is None else _range(r["final_eval_loss"], digits=4))
        out.append(f"| {lr:g} | " + " | ".join(cells) + " |")
    return out + [""]


def _fig5_md(q: dict[str, Any] | None, plot_files: list[str]) -> list[str]:
    if not q:
        return []
    out = ["## 5. Training quality: learning-rate sweep", ""]
    if "failed" in q and "grid" not in q:
        return out + [f"failed: {q['failed']}", ""]
    c = q["config"]
    t = c["training"]
    out += [f"`{c.get('recipe') or c.get('script')}` on its default corpus (the Python standard library's source), model flags "
            f"{c.get('model') or 'default'}, data flags {c.get('data') or 'default'}; {t['max_steps']} steps, "
            f"{t.get('lr_scheduler_type')} schedule, {t.get('warmup_steps')} warm-up steps, eval every "
            f"{t.get('eval_steps')} steps; the same grid {c['lrs']} and seeds {c['seeds']} for both. "
            f"{q['completed']} of {q['planned']} runs finished.", ""]
    if q.get("failed_runs") or q.get("lane_failure"):
        out += [f"Failed runs: {q.get('failed_runs')}; {q.get('lane_failure') or ''}", ""]
    out += _lr_grid(c["lrs"], q["grid"], {name: name for name in q["grid"]})
    if "best_lr" in q:
        out += [f"Best learning rate: AdamW {q['best_lr']['AdamW']:g}, hf_muon.Muon {q['best_lr']['hf_muon.Muon']:g}. "
                f"Target: AdamW's best median final eval loss, {q['target_loss']:.4f}.", "",
                "| run | lr | steps to the target, per seed | median | fraction of the run |", "|---|---|---|---|---|"]
        for label, r in q["reach"].items():
            per_seed = ", ".join(f"{s}: {'not reached' if v is None else f'{v:.0f}'}" for s, v in r["steps_per_seed"].items())
            med = "not reached" if r["median_steps"] is None else f"{r['median_steps']:.0f}"
            frac = "–" if r["fraction_of_run"] is None else f"{r['fraction_of_run']:.2f}"
            out.append(f"| {label.replace('_', ' ')} | {r['lr']:g} | {per_seed} | {med} | {frac} |")
        out.append("")
    return out + _img("fig5_lr_sweep.png", plot_files) + _img("fig5_curves.png", plot_files)


def _fig6_md(f: dict[str, Any] | None, plot_files: list[str]) -> list[str]:
    if not f:
        return []
    out = ["## 6. Model-aware Muon", "", "### Telemetry's cost", ""]
    tel = f.get("telemetry", {})
    if "failed" in tel:
        out += [f"failed: {tel['failed']}", ""]
    elif tel:
        out += [f"GPT-2 from the recipe ({tel['model']}), one process, {tel['repeats']} interleaved pairs of optimizer "
                f"steps: {_ms(tel['step_s']['telemetry on'])} ms with telemetry, {_ms(tel['step_s']['telemetry off'])} ms "
                f"without (ratio {tel['ratio_on_off']['median']:.3f}, {tel['ratio_on_off']['min']:.3f}–"
                f"{tel['ratio_on_off']['max']:.3f}). Recording itself (timed directly): "
                f"{100 * tel['recording_share_of_step']:.2f}% of the step. Reading the figures (once per logging "
                f"step): {_ms(tel['read_s'])} ms.", ""]
    fused = f.get("fused", {})
    out += ["### Fused projections: per block vs whole", ""]
    if "grid" not in fused:
        return out + [f"failed: {fused.get('failed')}", ""]
    c, t = fused["config"], fused["config"]["training"]
    out += [f"The pretraining recipe with model flags {c['model']} (GPT-2: q | k | v in one Conv1D `c_attn`), "
            f"{t['max_steps']} steps, the same grid {c['lrs']} and seeds {c['seeds']} for both; "
            f"{fused['completed']} of {fused['planned']} runs finished.", ""]
    out += _lr_grid(c["lrs"], fused["grid"], {s: f"ns_split={s}" for s in fused["grid"]})
    if "best" in fused:
        b = fused["best"]
        diffs = ", ".join(f"seed {s}: {d:+.4f}" for s, d in fused["block_minus_none_per_seed"].items())
        out += [f"At each one's best learning rate: block {b['block']['final_eval_loss']['median']:.4f} "
                f"(lr {b['block']['lr']:g}), none {b['none']['final_eval_loss']['median']:.4f} (lr {b['none']['lr']:g}); "
                f"block minus none per seed: {diffs}.", ""]
    out += _img("fig6_fused_curves.png", plot_files)
    qk = f.get("qk_clip", {})
    out += ["### QK-clip", ""]
    if "config" not in qk:
        out += [f"failed: {qk.get('failed')}", ""]
    else:
        c = qk["config"]
        out += [f"The recipe's model (flags {c['model'] or 'default'}) at lr {c['lr']:g}, {c['training']['max_steps']} "
                f"steps, seeds {c['seeds']}; {qk['completed']} of {qk['planned']} runs finished. Largest attention "
                f"logit of any logged step: with QK-clip at tau {c['tau']:g}: "
                f"{_fmt(qk['QK-clip']['largest_logit'], 4)}; without (tracked only): "
                f"{_fmt(qk['plain Muon (tracked only)']['largest_logit'], 4)}. Final eval loss: "
                f"{_fmt(qk['QK-clip']['final_eval_loss']['median'], 4)} with, "
                f"{_fmt(qk['plain Muon (tracked only)']['final_eval_loss']['median'], 4)} without.", ""]
        out += _img("fig6_qk_clip.png", plot_files)
    ada = f.get("adaptive_lr", {})
    out += ["### Adaptive learning rate", ""]
    if "config" not in ada:
        out += [f"failed: {ada.get('failed')}", ""]
    else:
        c = ada["config"]
        diffs = ", ".join(f"seed {s}: {d:+.4f}" for s, d in ada["adaptive_minus_fixed_per_seed"].items())
        out += [f"The recipe's model (flags {c['model'] or 'default'}) at lr {c['lr']:g}, {c['training']['max_steps']} "
                f"steps, gradient accumulation {c['training'].get('gradient_accumulation_steps', 1)}, no clipping, "
                f"seeds {c['seeds']}; {ada['completed']} of {ada['planned']} runs finished. Final eval loss, median "
                f"(min–max): adaptive {_range(ada['adaptive lr']['final_eval_loss'], digits=4)}, fixed schedule "
                f"{_range(ada['fixed schedule']['final_eval_loss'], digits=4)}; adaptive minus fixed per seed: {diffs}.", ""]
        out += _img("fig6_adaptive_lr.png", plot_files)
    return out
