"""Worker of figure 5: pretraining-recipe training runs, several in one process.

    python -m hf_muon.bench.quality_worker --runs runs.json --out lane0.jsonl [--script my_pretrain_clm.py]

Each run is what ``python -m hf_muon.run -m hf_muon.recipes.pretrain_clm --optim OPTIM --learning_rate LR
--seed SEED ...`` does: the recipe's own model (``ModelArguments``), its default corpus
(``build_datasets``: the Python standard library's source), its ``TRAINING_DEFAULTS`` and a
``Trainer``; only the run's flags differ. ``--script`` trains a script that defines those names
instead of the packaged recipe (``examples/pretrain_clm.py`` does). Running them in one process
saves the import and tokenization of every run. One JSON line per finished run: final eval loss
and the eval curve.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any


RECIPE = "hf_muon.recipes.pretrain_clm"


def load_recipe(path: Path | None):
    """The packaged recipe, or the script at ``path`` loaded as a module."""
    if path is None:
        return importlib.import_module(RECIPE)
    spec = importlib.util.spec_from_file_location("pretrain_clm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["pretrain_clm"] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", type=Path, default=None,
                        help=f"a training script defining the names the worker uses (default: {RECIPE})")
    parser.add_argument("--runs", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    job = json.loads(args.runs.read_text())
    import torch

    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    import hf_muon  # noqa: F401  (registers --optim muon, as the hf_muon.run runner does)

    clm = load_recipe(args.script)
    from transformers import Trainer, TrainingArguments, default_data_collator, set_seed

    from ..recipes.curves import loss_curves

    common = {**clm.TRAINING_DEFAULTS, **job["training"]}
    with tempfile.TemporaryDirectory() as tmp:
        data_args = clm.DataArguments(**job.get("data", {}))
        train_dataset, eval_dataset = clm.build_datasets(data_args, TrainingArguments(output_dir=tmp, report_to="none"))
        model_args = clm.ModelArguments(**job.get("model", {}))
        for run in job["runs"]:
            start = time.perf_counter()
            record: dict[str, Any] = dict(run)
            try:
                set_seed(run["seed"])
                model = clm.build_model(model_args, data_args.seq_len)
                training_args = TrainingArguments(**{**common, "output_dir": tmp, "optim": run["optim"],
                                                     "learning_rate": run["lr"], "seed": run["seed"],
                                                     **({"optim_args": run["optim_args"]} if run.get("optim_args") else {})})
                trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset,
                                  eval_dataset=eval_dataset, data_collator=default_data_collator)
                trainer.train()
                final = trainer.evaluate()["eval_loss"]
                train_curve, curve = loss_curves(trainer.state.log_history)
                record.update(final_eval_loss=final, eval_curve=curve, train_curve=train_curve,
                              parameters=model.num_parameters(),
                              telemetry=[{"step": e["step"], **{k: v for k, v in e.items() if k.startswith("muon/")}}
                                         for e in trainer.state.log_history if "loss" in e])
                del trainer, model
            except Exception as exc:  # noqa: BLE001 - one failed run is reported, the sweep goes on
                traceback.print_exc()
                record["failed"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            record["wall_s"] = time.perf_counter() - start
            with args.out.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"{run['optim']} lr={run['lr']:g} seed={run['seed']}: "
                  f"{record.get('final_eval_loss', record.get('failed'))} in {record['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
