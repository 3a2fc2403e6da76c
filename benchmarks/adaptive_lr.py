"""Does the gradient-noise-scale learning rate help? Pretraining recipe, seeds x {off, on}.

    PYTHONPATH=. python benchmarks/adaptive_lr.py --seeds 0 1 2 --max_steps 150 --threads 2 --out adaptive_lr.json

Each run is :mod:`hf_muon.recipes.pretrain_clm`'s byte-level Llama (made smaller by default, 2 layers,
d=96, 64-byte blocks, so that 3 seeds x 2 arms fit in about 10 minutes on 2 busy CPU cores) on its
default corpus (the Python standard library's source), ``--optim muon`` at ``--learning_rate``
with a cosine schedule, ``per_device_train_batch_size x gradient_accumulation_steps`` examples per
step (GAS >= 2 so that one process has two batch sizes). "on" attaches
:class:`hf_muon.optimizer.noise_scale.GradientNoiseScale`; "off" is the same run without it. Prints
the final eval loss per seed, the mean and spread (sample standard deviation) of each arm, and the
noise scale and multiplier the "on" runs ended with.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from transformers import TrainerCallback


class RecordNoise(TrainerCallback):
    """Noise scale and multiplier after every optimizer step (the Trainer-side logging, by hand)."""

    def __init__(self, noise) -> None:
        self.noise, self.history = noise, []

    def on_step_end(self, args, state, control, **kwargs):
        self.history.append((state.global_step, self.noise.noise_scale, self.noise.lr_multiplier))


def train_one(clm, train_dataset, eval_dataset, seed: int, adaptive: bool, a: argparse.Namespace, tmp: str) -> dict:
    from transformers import Trainer, TrainingArguments, default_data_collator, set_seed

    from hf_muon.optimizer.noise_scale import GradientNoiseScale

    set_seed(seed)
    model = clm.build_model(clm.ModelArguments(hidden_size=a.hidden_size, num_layers=a.num_layers,
                                               intermediate_size=a.intermediate_size), a.seq_len)
    args = TrainingArguments(**{**clm.TRAINING_DEFAULTS, "output_dir": tmp, "optim": "muon",
                                "learning_rate": a.learning_rate, "seed": seed, "max_steps": a.max_steps,
                                "per_device_train_batch_size": a.micro_batch,
                                "gradient_accumulation_steps": a.accumulation, "lr_scheduler_type": "cosine",
                                "warmup_steps": a.warmup_steps, "eval_steps": a.max_steps // 4,
                                "max_grad_norm": a.max_grad_norm, "use_cpu": True})
    trainer = Trainer(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                      data_collator=default_data_collator)
    record = None
    if adaptive:
        trainer.create_optimizer()
        noise = GradientNoiseScale(model, trainer.optimizer, micro_batch_size=a.micro_batch,
                                   accumulation_steps=a.accumulation, world_size=args.world_size, ema=a.ema,
                                   bounds=(a.min_multiplier, a.max_multiplier), warmup_steps=a.noise_warmup,
                                   max_grad_norm=a.max_grad_norm).attach()
        record = RecordNoise(noise)
        trainer.add_callback(record)
    start = time.perf_counter()
    trainer.train()
    result = {"seed": seed, "adaptive": adaptive, "final_eval_loss": trainer.evaluate()["eval_loss"],
              "wall_s": time.perf_counter() - start}
    if record is not None:
        multipliers = [m for _, _, m in record.history]
        result.update(final_noise_scale=noise.noise_scale, final_multiplier=noise.lr_multiplier,
                      mean_multiplier=statistics.fmean(multipliers), measured_steps=noise.measured_steps,
                      clipped_steps=noise.clipped_steps, skipped_steps=noise.skipped_steps,
                      history=record.history[:: max(1, len(record.history) // 20)])
    return result


def summarize(losses: list[float]) -> str:
    spread = statistics.stdev(losses) if len(losses) > 1 else 0.0
    return f"mean {statistics.fmean(losses):.4f}  sd {spread:.4f}  min {min(losses):.4f}  max {max(losses):.4f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max_steps", type=int, default=150)
    parser.add_argument("--learning_rate", type=float, default=1e-2)
    parser.add_argument("--micro_batch", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--warmup_steps", type=int, default=10)
    parser.add_argument("--max_grad_norm", type=float, default=0.0,
                        help="clipping (0: none); a clipped step's norm is not the gradient's and is not measured")
    parser.add_argument("--hidden_size", type=int, default=96)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--intermediate_size", type=int, default=256)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--corpus_mb", type=float, default=2.0)
    parser.add_argument("--ema", type=float, default=0.95)
    parser.add_argument("--noise_warmup", type=int, default=10)
    parser.add_argument("--min_multiplier", type=float, default=0.5)
    parser.add_argument("--max_multiplier", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default=None, help="write every run's figures as JSON here")
    a = parser.parse_args(argv)

    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    import hf_muon  # noqa: F401  (registers --optim muon)
    from hf_muon.recipes import pretrain_clm as clm
    from transformers import TrainingArguments

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        data_args = clm.DataArguments(seq_len=a.seq_len, corpus_mb=a.corpus_mb)
        train_dataset, eval_dataset = clm.build_datasets(data_args, TrainingArguments(output_dir=tmp, report_to="none"))
        for seed in a.seeds:
            for adaptive in (False, True):
                r = train_one(clm, train_dataset, eval_dataset, seed, adaptive, a, tmp)
                results.append(r)
                extra = (f"  noise_scale {r['final_noise_scale']:.1f}  multiplier {r['final_multiplier']:.3f} "
                         f"(mean {r['mean_multiplier']:.3f}, clipped steps {r['clipped_steps']})" if adaptive else "")
                print(f"seed {seed} adaptive={'on ' if adaptive else 'off'}: eval loss {r['final_eval_loss']:.4f} "
                      f"({r['wall_s']:.0f} s){extra}", flush=True)
                if a.out:
                    with open(a.out, "w") as f:
                        json.dump({"config": vars(a), "runs": results}, f, indent=1)
    for adaptive in (False, True):
        losses = [r["final_eval_loss"] for r in results if r["adaptive"] == adaptive]
        print(f"adaptive lr {'on ' if adaptive else 'off'}: {summarize(losses)}  (seeds {a.seeds})")
    off = {r["seed"]: r["final_eval_loss"] for r in results if not r["adaptive"]}
    deltas = [r["final_eval_loss"] - off[r["seed"]] for r in results if r["adaptive"]]
    print(f"on - off per seed: {', '.join(f'{d:+.4f}' for d in deltas)}  (negative: adaptive lr is better)")


if __name__ == "__main__":
    main()
