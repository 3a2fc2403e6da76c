"""Pretrain a small Llama-style causal language model with the Hugging Face Trainer.

A plain Trainer script: it knows nothing about Muon. The model is built from a
config (no weights are downloaded), text is tokenized byte-level (UTF-8 bytes ->
ids 0..255 plus an end-of-document id), and the default corpus is the Python
standard library's own ``.py`` files, so the script runs offline on any machine.

Every ``TrainingArguments`` flag works (``--optim``, ``--optim_args``,
``--learning_rate``, ``--max_steps``, ``--deepspeed``, ``--local_rank`` ...),
next to the model and data flags defined below.

Examples::

    # AdamW baseline on the default stdlib corpus (about 1-2 minutes on 2 CPU cores)
    python examples/pretrain_clm.py --optim adamw_torch --learning_rate 1e-3 \\
        --max_steps 250 --lr_scheduler_type cosine --warmup_steps 10 \\
        --output_dir runs/clm_adamw

    # The same run with Muon (the hf_muon runner registers ``--optim muon``)
    python -m hf_muon.run examples/pretrain_clm.py --optim muon --learning_rate 1e-2 \\
        --max_steps 250 --lr_scheduler_type cosine --warmup_steps 10 \\
        --output_dir runs/clm_muon

    # Your own text files, a bigger model
    python examples/pretrain_clm.py --train_files a.txt b.txt --eval_files c.txt \\
        --hidden_size 384 --num_layers 6 --seq_len 256 --output_dir runs/clm_big
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
from transformers import (
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

BYTE_VOCAB = 256
EOS_ID = BYTE_VOCAB  # appended after every document
PAD_ID = BYTE_VOCAB + 1  # never produced by the data pipeline, reserved for padding
VOCAB_SIZE = BYTE_VOCAB + 2

# Defaults for TrainingArguments fields, chosen so that ``--max_steps 250``
# takes about a minute or two on 2 CPU cores. Any of them can be overridden on
# the command line.
TRAINING_DEFAULTS: dict[str, Any] = {
    "output_dir": "runs/pretrain_clm",
    "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 32,
    "learning_rate": 1e-3,
    "max_steps": 250,
    "eval_strategy": "steps",
    "eval_steps": 25,
    "logging_steps": 5,
    "save_strategy": "no",
    "report_to": "none",
}


@dataclass
class ModelArguments:
    hidden_size: int = field(default=192, metadata={"help": "Width of the residual stream."})
    num_layers: int = field(default=4, metadata={"help": "Number of transformer blocks."})
    num_heads: int = field(default=4, metadata={"help": "Number of attention (query) heads."})
    num_kv_heads: int = field(
        default=2, metadata={"help": "Number of key/value heads (grouped-query attention)."}
    )
    intermediate_size: int = field(default=512, metadata={"help": "Width of the SwiGLU MLP."})
    max_position_embeddings: int = field(default=256, metadata={"help": "Longest supported sequence."})
    tie_word_embeddings: bool = field(
        default=False, metadata={"help": "Share the input embedding and the LM head weights."}
    )


@dataclass
class DataArguments:
    train_files: list[str] | None = field(
        default=None,
        metadata={"help": "Text files to train on. Default: a slice of the Python standard library."},
    )
    eval_files: list[str] | None = field(
        default=None,
        metadata={
            "help": "Text files to evaluate on. Default: held-out stdlib files, or, when only "
            "--train_files is given, the last --validation_split_percentage of its blocks."
        },
    )
    seq_len: int = field(default=128, metadata={"help": "Tokens (bytes) per training block."})
    corpus_mb: float = field(
        default=4.0, metadata={"help": "Size of the default stdlib corpus, in megabytes."}
    )
    eval_file_percentage: int = field(
        default=5, metadata={"help": "Percent of the default corpus files held out for evaluation."}
    )
    validation_split_percentage: int = field(
        default=5,
        metadata={"help": "Percent of blocks held out when --train_files is given without --eval_files."},
    )
    max_eval_samples: int | None = field(
        default=64, metadata={"help": "Evaluate on at most this many blocks (a fixed random subset)."}
    )


def _bucket(name: str) -> int:
    """A stable pseudo-random number in [0, 100) for ``name`` (Python's hash() is salted)."""
    return int(hashlib.md5(name.encode()).hexdigest(), 16) % 100


def stdlib_corpus(megabytes: float, eval_percentage: int) -> tuple[list[str], list[str]]:
    """Pick a deterministic slice of the stdlib's ``.py`` files and split it into train/eval.

    Files are visited in a hash-based order (so the slice mixes many packages
    instead of taking them alphabetically) until ``megabytes`` are collected; a
    file goes to eval when its hash bucket is below ``eval_percentage``.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped_folders = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    candidates = sorted(
        (
            path.relative_to(root).as_posix()
            for path in root.rglob("*.py")
            if not skipped_folders & set(path.relative_to(root).parts)
        ),
        key=lambda name: hashlib.md5(name.encode()).hexdigest(),
    )
    budget = int(megabytes * 1e6)
    train_files: list[str] = []
    eval_files: list[str] = []
    for name in candidates:
        if budget <= 0:
            break
        (eval_files if _bucket(name) < eval_percentage else train_files).append(str(root / name))
        budget -= (root / name).stat().st_size
    return train_files, eval_files


def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
    """Byte-level tokenization: one id per UTF-8 byte, plus an end-of-document id."""
    return {"input_ids": [list(text.encode("utf-8")) + [EOS_ID] for text in batch["text"]]}


def group_into_blocks(batch: dict[str, list[list[int]]], seq_len: int) -> dict[str, list[list[int]]]:
    """Concatenate the documents and cut them into ``seq_len`` blocks (dropping the remainder)."""
    ids = [token for document in batch["input_ids"] for token in document]
    blocks = [ids[start : start + seq_len] for start in range(0, len(ids) - seq_len + 1, seq_len)]
    return {"input_ids": blocks, "labels": [list(block) for block in blocks]}


def build_datasets(
    args: DataArguments, training_args: TrainingArguments
) -> tuple[datasets.Dataset, datasets.Dataset]:
    if args.train_files:
        data_files = {"train": args.train_files}
        if args.eval_files:
            data_files["eval"] = args.eval_files
    else:
        train_files, eval_files = stdlib_corpus(args.corpus_mb, args.eval_file_percentage)
        data_files = {"train": train_files, "eval": args.eval_files or eval_files}

    with training_args.main_process_first(desc="dataset preprocessing"):
        raw = datasets.load_dataset("text", data_files=data_files, sample_by="document")
        tokenized = raw.map(tokenize, batched=True, remove_columns=["text"], desc="Tokenizing")
        blocks = tokenized.map(
            group_into_blocks,
            batched=True,
            fn_kwargs={"seq_len": args.seq_len},
            desc=f"Grouping into blocks of {args.seq_len}",
        )
    if "eval" not in blocks:
        blocks = blocks["train"].train_test_split(
            test_size=args.validation_split_percentage / 100, shuffle=False
        )
        blocks["eval"] = blocks.pop("test")

    eval_dataset = blocks["eval"]
    if args.max_eval_samples is not None and len(eval_dataset) > args.max_eval_samples:
        eval_dataset = eval_dataset.shuffle(seed=0).select(range(args.max_eval_samples))
    return blocks["train"], eval_dataset


def build_model(args: ModelArguments, seq_len: int) -> LlamaForCausalLM:
    if seq_len > args.max_position_embeddings:
        raise ValueError(
            f"--seq_len {seq_len} exceeds --max_position_embeddings {args.max_position_embeddings}"
        )
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=args.tie_word_embeddings,
        eos_token_id=EOS_ID,
        bos_token_id=None,
        pad_token_id=PAD_ID,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    parser.set_defaults(**TRAINING_DEFAULTS)
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    set_seed(training_args.seed)
    train_dataset, eval_dataset = build_datasets(data_args, training_args)
    model = build_model(model_args, data_args.seq_len)
    print(
        f"model: {model.num_parameters() / 1e6:.2f}M parameters | "
        f"train blocks: {len(train_dataset)} | eval blocks: {len(eval_dataset)} | "
        f"tokens per block: {data_args.seq_len}"
    )

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=default_data_collator,
    )
    train_result = trainer.train()
    trainer.log_metrics("train", train_result.metrics)
    trainer.save_metrics("train", train_result.metrics)

    metrics = trainer.evaluate()
    metrics["perplexity"] = math.exp(min(metrics["eval_loss"], 50.0))
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)
    trainer.save_state()
    trainer.save_model()

    if trainer.is_world_process_zero():
        print(f"eval_loss={metrics['eval_loss']:.4f}")


if __name__ == "__main__":
    main()
