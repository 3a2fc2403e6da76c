"""Muon vs AdamW on the same small Llama pretraining run ("make demo").

Runs ``examples/pretrain_clm.py`` (the packaged recipe
``hf_muon.recipes.pretrain_clm`` as a script) twice on its default corpus (the Python
standard library's source), with the same model, seed, data order, step count
and cosine schedule with a short warmup; only the optimizer and its learning
rate differ. The AdamW arm is a plain ``python examples/pretrain_clm.py ...``;
the Muon arm is the very same script started through the hf_muon runner,
``python -m hf_muon.run examples/pretrain_clm.py --optim muon ...``, which is
all it takes to give an unmodified Trainer script ``--optim muon``.

It then prints a table (optimizer, learning rate, final eval loss, wall time,
and the step at which Muon reached AdamW's final eval loss) and writes
``<output_dir>/loss_curves.png`` and ``<output_dir>/summary.json``. Each run's
log and Trainer output are in ``<output_dir>/adamw`` and ``<output_dir>/muon``.

Examples::

    python examples/demo.py                       # 250 steps per arm, a few minutes on 2 CPU cores
    python examples/demo.py --steps 500 --muon_lr 2e-2 --output_dir runs/demo_500
    python examples/demo.py --muon_optim adamw_torch   # dry run of the pipeline without Muon
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from transformers.training_args import OptimizerNames  # noqa: E402

from hf_muon.integrations.transformers import OPTIM_NAME  # noqa: E402
from hf_muon.recipes.curves import loss_curves, steps_to_reach  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = "examples/pretrain_clm.py"

Curve = list[tuple[int, float]]


@dataclass
class RunResult:
    name: str
    optim: str
    learning_rate: float
    wall_time_s: float
    final_eval_loss: float
    train_curve: Curve
    eval_curve: Curve


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=250, help="Optimizer steps per run.")
    parser.add_argument("--adamw_lr", type=float, default=5e-4, help="Peak learning rate of the AdamW run.")
    parser.add_argument("--muon_lr", type=float, default=1e-2, help="Peak learning rate of the Muon run.")
    parser.add_argument(
        "--muon_optim",
        default="muon",
        help="--optim of the second run. Any optimizer the Trainer already knows (e.g. adamw_torch) "
        "runs without the hf_muon runner, which lets you test the demo's pipeline without Muon.",
    )
    parser.add_argument("--warmup_steps", type=int, default=10, help="Linear warmup before the cosine decay.")
    parser.add_argument("--eval_steps", type=int, default=25, help="Evaluate every this many steps.")
    parser.add_argument("--seed", type=int, default=42, help="Seed of both runs (model init and data order).")
    parser.add_argument("--output_dir", type=Path, default=Path("runs/demo"), help="Where results go.")
    return parser.parse_args()


def command_for(optim: str) -> list[str]:
    """Built-in Trainer optimizers run the script directly; others need the hf_muon runner."""
    # this process imported hf_muon (the recipe's curves), which added "muon" to OptimizerNames
    if optim != OPTIM_NAME and optim in {name.value for name in OptimizerNames}:
        return [sys.executable, SCRIPT]
    return [sys.executable, "-m", "hf_muon.run", SCRIPT]


def read_curves(output_dir: Path) -> tuple[Curve, Curve]:
    """Train and eval loss curves from ``trainer_state.json``, one eval point per step."""
    return loss_curves(json.loads((output_dir / "trainer_state.json").read_text())["log_history"])


def run(name: str, optim: str, learning_rate: float, args: argparse.Namespace) -> RunResult:
    output_dir = (args.output_dir / name).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    command = command_for(optim) + [
        "--output_dir", str(output_dir),
        "--optim", optim,
        "--learning_rate", str(learning_rate),
        "--max_steps", str(args.steps),
        "--lr_scheduler_type", "cosine",
        "--warmup_steps", str(args.warmup_steps),
        "--eval_strategy", "steps",
        "--eval_steps", str(args.eval_steps),
        "--seed", str(args.seed),
        "--report_to", "none",
        "--disable_tqdm", "true",
    ]  # fmt: skip
    # Busy-waiting OpenMP threads slow training down many times over when
    # anything else shares the CPU; passive waiting costs nothing when it doesn't.
    env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}
    log_path = output_dir / "train.log"
    print(f"[{name}] {' '.join(command[1:])}\n[{name}] log: {log_path}", flush=True)

    start = time.perf_counter()
    with log_path.open("w") as log:
        completed = subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall_time = time.perf_counter() - start
    if completed.returncode != 0:
        sys.exit(f"[{name}] failed with exit code {completed.returncode}; last lines of {log_path}:\n"
                 + "\n".join(log_path.read_text().splitlines()[-30:]))

    train_curve, eval_curve = read_curves(output_dir)
    result = RunResult(
        name, optim, learning_rate, round(wall_time, 1), eval_curve[-1][1], train_curve, eval_curve
    )
    print(f"[{name}] done in {wall_time:.0f} s, final eval loss {result.final_eval_loss:.4f}", flush=True)
    return result


def plot(runs: list[RunResult], target: float, reached_at: float | None, path: Path) -> None:
    figure, (train_axes, eval_axes) = plt.subplots(1, 2, figsize=(11, 4.2))
    for result in runs:
        label = f"{result.optim} (lr {result.learning_rate:g})"
        train_axes.plot(*zip(*result.train_curve), label=label, linewidth=1.2)
        eval_axes.plot(*zip(*result.eval_curve), label=label, marker="o", markersize=3)
    eval_axes.axhline(target, color="gray", linestyle=":", linewidth=1, label="AdamW final eval loss")
    if reached_at is not None:
        eval_axes.axvline(reached_at, color="gray", linestyle="--", linewidth=1,
                          label=f"Muon reaches it at step {reached_at:.0f}")
    for axes, title in ((train_axes, "train loss"), (eval_axes, "eval loss")):
        axes.set_title(title)
        axes.set_xlabel("step")
        axes.set_ylabel("cross-entropy (nats per byte)")
        axes.grid(alpha=0.3)
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    args = parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    adamw = run("adamw", "adamw_torch", args.adamw_lr, args)
    muon = run("muon", args.muon_optim, args.muon_lr, args)

    reached_at = steps_to_reach(muon.eval_curve, adamw.final_eval_loss)
    reached_text = "not reached" if reached_at is None else f"step {reached_at:.0f} of {args.steps}"
    print()
    print(f"{'optimizer':<14}{'learning rate':>14}{'final eval loss':>17}{'wall time':>11}")
    for result in (adamw, muon):
        print(f"{result.optim:<14}{result.learning_rate:>14g}{result.final_eval_loss:>17.4f}"
              f"{result.wall_time_s:>10.0f}s")
    print(f"{muon.optim} reached AdamW's final eval loss ({adamw.final_eval_loss:.4f}): {reached_text}")

    plot_path = args.output_dir / "loss_curves.png"
    plot([adamw, muon], adamw.final_eval_loss, reached_at, plot_path)
    summary = {
        "steps": args.steps,
        "seed": args.seed,
        "warmup_steps": args.warmup_steps,
        "runs": [asdict(result) for result in (adamw, muon)],
        "adamw_final_eval_loss": adamw.final_eval_loss,
        "muon_steps_to_adamw_final_eval_loss": reached_at,
    }
    summary_path = args.output_dir / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {plot_path} and {summary_path}")


if __name__ == "__main__":
    main()
