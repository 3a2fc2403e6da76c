"""``hf-muon plan``'s projections against what this machine measured: predicted vs measured step time.

    hf-muon bench --only fig1 --output_dir runs/bench              # the one-process sets
    python benchmarks/exchange_overlap.py --out runs/exchange_overlap.json   # ZeRO-3, 2 ranks
    python benchmarks/plan_check.py --fig1 runs/bench/results.json --zero3 runs/exchange_overlap.json

The planner's ``cpu`` accelerator measures this machine's matmul rate and memory bandwidth now (run it
on the same quiet machine as the measurements), ``loopback`` its gloo link between two processes.
One process: figure 1's ``hf_muon.Muon`` step per set (every matrix is Muon's) against the plan's
``muon_sum`` under ``ddp`` at W=1. ZeRO-3 at 2 ranks: the benchmark's overlapped and synchronous
``Muon.step`` (slowest rank) against the plan's ``muon_overlapped`` and ``muon_sum``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TOLERANCE = 0.25


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fig1", type=Path, required=True, help="hf-muon bench results.json with figure 1")
    parser.add_argument("--zero3", type=Path, default=None, help="benchmarks/exchange_overlap.py's JSON")
    parser.add_argument("--out", type=Path, default=Path("runs/plan_check.json"))
    args = parser.parse_args()

    from hf_muon.bench.common import HF_MUON, llama_matrices
    from hf_muon.bench.optimizer_step import shape_set
    from hf_muon.planner import plan_for_shapes

    rows = []
    fig1 = json.loads(args.fig1.read_text())["figures"]["fig1"]
    for name, data in fig1["step_time"].items():
        measured = data["contenders"][HF_MUON]["median"]
        plan = plan_for_shapes(shape_set(data["spec"]), "ddp", 1, "cpu")
        rows.append({"case": f"one process, {name} {data['spec']}", "predicted_s": plan.times.muon_sum,
                     "measured_s": measured})
    if args.zero3 is not None:
        bench = json.loads(args.zero3.read_text())
        # the benchmark's model: d=512, 4 layers, GQA 8/2, ff=1376 (benchmarks/exchange_overlap.py)
        shapes = llama_matrices(512, 4, 8, 2, 1376)
        for mode, overlap, field in (("overlap", True, "muon_overlapped"), ("sync", False, "muon_sum")):
            plan = plan_for_shapes(shapes, "zero3", 2, "cpu", "loopback", overlap=overlap)
            measured = max(r[f"{mode}/step_s"] for r in bench["per_rank"])
            rows.append({"case": f"ZeRO-3, 2 ranks, {mode} exchange", "predicted_s": getattr(plan.times, field),
                         "measured_s": measured, "plan": {"ns_s": plan.times.newton_schulz,
                                                          "exchange_s": plan.times.exchange,
                                                          "elementwise_s": plan.times.elementwise}})
    print(f"{'case':<70} {'predicted':>10} {'measured':>10} {'pred/meas':>10}")
    for row in rows:
        row["ratio"] = row["predicted_s"] / row["measured_s"]
        row["within_25pct"] = abs(row["ratio"] - 1) <= TOLERANCE
        print(f"{row['case']:<70} {1e3 * row['predicted_s']:>8.0f}ms {1e3 * row['measured_s']:>8.0f}ms "
              f"{row['ratio']:>10.2f}{'' if row['within_25pct'] else '  (off by more than 25%)'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
