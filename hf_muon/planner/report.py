"""How plans are shown: aligned text tables, JSON, and one plot (matplotlib, imported only here)."""

from __future__ import annotations

import json
import os

from .cost import Plan


def flops_text(x: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} FLOP"


def bytes_text(x: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def params_text(x: float) -> str:
    return f"{x / 1e9:.2f} B" if x >= 1e8 else f"{x / 1e6:.2f} M"


def seconds_text(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 10 else f"{x:.1f} s"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned first column, right-aligned others, two spaces between."""
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return [fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows]


def plan_text(plan: Plan) -> str:
    """One plan as tables: per-rank figures (min/mean/max over ranks) and the projected step time."""
    p = plan
    lines = [
        f"{p.model}: {p.layout}, {p.world} rank{'s' if p.world > 1 else ''} of {p.accelerator} over {p.interconnect}",
        f"Muon: {p.muon_tensors} tensors ({p.matrices} matrices, {params_text(p.muon_params)} parameters); "
        f"AdamW: {params_text(p.adamw_params)} parameters",
        f"Newton–Schulz: {p.ns_dtype}, {p.ns_steps} steps at {p.matmul_efficiency:.0%} of the matmul rate; "
        f"{p.busy_ranks} of {p.world} ranks own matrices; " + (
            f"{p.exchanges} exchange{'s' if p.exchanges != 1 else ''} in {p.comm_dtype}: {p.buckets} "
            f"bucket{'s' if p.buckets != 1 else ''}, {p.exchange_collectives} all-to-all calls"
            if p.exchange_collectives else "nothing exchanged (each rank orthogonalizes what it holds)"),
    ]
    if p.exchange_flops_per_byte is not None:
        lines.append(f"owner plan: matrices held whole by one rank may move at {p.exchange_flops_per_byte:.3g} FLOP "
                     f"per byte on the wire ({p.hardware_flops_per_byte:.3g} for this accelerator and link)")
    lines.append("")
    spread = lambda s, text: [text(s.min), text(s.mean), text(s.max)]
    rows = [
        ["Newton–Schulz work"] + spread(p.ns_flops, flops_text),
        ["exchange sent"] + spread(p.exchange_sent, bytes_text),
        ["exchange received"] + spread(p.exchange_received, bytes_text),
        ["exchange buffers (peak)"] + spread(p.owner_buffer_bytes, bytes_text),
        ["optimizer state, hf_muon"] + spread(p.state_bytes, bytes_text),
        ["optimizer state, AdamW"] + spread(p.adamw_state_bytes, bytes_text),
    ]
    rows += [[f"backend: {name}"] + [bytes_text(value)] * 3 for name, value in p.backend_detail.items()]
    lines += _table(["per rank, per step", "min", "mean", "max"], rows)
    t = p.times
    lines += [""] + _table(
        ["projected optimizer step", "hf_muon (sum)", "hf_muon (overlapped)", "AdamW"],
        [["Newton–Schulz (busiest rank)", seconds_text(t.newton_schulz), seconds_text(t.newton_schulz), "-"],
         ["exchange", seconds_text(t.exchange), seconds_text(t.exchange), "-"],
         ["element-wise", seconds_text(t.elementwise), seconds_text(t.elementwise), seconds_text(t.adamw)],
         ["total", seconds_text(t.muon_sum), seconds_text(t.muon_overlapped), seconds_text(t.adamw)]],
    )
    if p.backend_detail:
        lines.append(f"(the backend's own collectives, the same under both optimizers: "
                     f"{bytes_text(p.backend_bytes.max)} per rank, {seconds_text(p.backend_seconds)} at the link's bandwidth)")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def summary_text(plans: list[Plan]) -> str:
    """One line per world size."""
    rows = [[str(p.world), f"{p.busy_ranks}", flops_text(p.ns_flops.max),
             bytes_text(max(p.exchange_sent.max, p.exchange_received.max)), bytes_text(p.backend_bytes.max),
             bytes_text(p.state_bytes.max), bytes_text(p.adamw_state_bytes.max),
             seconds_text(p.times.muon_sum), seconds_text(p.times.muon_overlapped), seconds_text(p.times.adamw)]
            for p in plans]
    header = ["ranks", "NS owners", "NS max/rank", "exchange max/rank", "backend/rank", "state hf_muon",
              "state AdamW", "step sum", "step overlapped", "step AdamW"]
    return "\n".join(_table(header, rows))


def plans_text(plans: list[Plan]) -> str:
    """Every plan's tables, then the summary across world sizes when there are several."""
    parts = [plan_text(p) for p in plans]
    if len(plans) > 1:
        parts.append("summary (max over ranks; state per rank)\n" + summary_text(plans))
    return "\n\n".join(parts)


# what the JSON's numbers count (``Plan``'s fields)
JSON_UNITS = "FLOP (ns_flops), bytes (exchange_*, backend_*, *_state_bytes, owner_buffer_bytes), seconds (times, " \
             "backend_seconds), FLOP per byte (*_flops_per_byte)"


def plans_json(plans: list[Plan]) -> str:
    """The plans as JSON, one object per world size, each with ``"units"`` (see ``JSON_UNITS``)."""
    return json.dumps([{**p.to_dict(), "units": JSON_UNITS} for p in plans], indent=2)


def check_plot_path(path: str) -> None:
    """``ValueError`` unless a plot can be saved at ``path`` (an existing folder, a format matplotlib writes)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.backend_bases import FigureCanvasBase

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--plot {path}: no folder {folder}")
    formats = FigureCanvasBase.get_supported_filetypes()
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    if extension not in formats:
        raise ValueError(f"--plot {path}: give a file name ending in one of {', '.join('.' + f for f in sorted(formats))}")


def plot_plans(plans: list[Plan], path: str) -> None:
    """Projected optimizer-step time and its parts against the world size, hf_muon and AdamW."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plans = sorted(plans, key=lambda p: p.world)
    worlds = [p.world for p in plans]
    series = {
        "hf_muon, sum": ([p.times.muon_sum for p in plans], "-", "C0"),
        "hf_muon, overlapped": ([p.times.muon_overlapped for p in plans], "--", "C0"),
        "Newton–Schulz (busiest rank)": ([p.times.newton_schulz for p in plans], ":", "C1"),
        "exchange": ([p.times.exchange for p in plans], ":", "C2"),
        "element-wise (Muon)": ([p.times.elementwise for p in plans], ":", "C4"),
        "AdamW": ([p.times.adamw for p in plans], "-", "C3"),
        "backend collectives (both; not in the step)": ([p.backend_seconds for p in plans], "-.", "0.5"),
    }
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (values, style, color) in series.items():
        if any(v > 0 for v in values):  # a log axis cannot show zeros (no backend traffic at W = 1)
            ax.plot(worlds, [v * 1e3 if v > 0 else float("nan") for v in values], style, color=color, marker="o",
                    label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks (GPUs)")
    ax.set_ylabel("projected optimizer step (ms)")
    first = plans[0]
    ax.set_title(f"{first.model}\n{first.layout} on {first.accelerator}, {first.interconnect}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
