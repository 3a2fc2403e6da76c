"""Pretrain a small Llama-style causal language model with the Hugging Face Trainer.

A plain Trainer recipe: it knows nothing about Muon. The model is built from a
config (no weights are downloaded), text is tokenized byte-level (UTF-8 bytes ->
ids 0..255 plus an end-of-document id), and the default corpus is the Python
standard library's own ``.py`` files (:mod:`hf_muon.recipes.corpus`), so it runs
offline on any machine, from any directory.

Every ``TrainingArguments`` flag works (``--optim``, ``--optim_args``,
``--learning_rate``, ``--max_steps``, ``--deepspeed``, ``--local_rank`` ...),
next to the model and data flags defined below.

Examples::

    # AdamW baseline on the default stdlib corpus (about 1-2 minutes on 2 CPU cores)
    python -m hf_muon.recipes.pretrain_clm --optim adamw_torch --learning_rate 1e-3 \\
        --max_steps 250 --lr_scheduler_type cosine --warmup_steps 10 \\
        --output_dir runs/clm_adamw

    # The same run with Muon (the hf_muon runner registers ``--optim muon``)
    python -m hf_muon.run -m hf_muon.recipes.pretrain_clm --optim muon --learning_rate 1e-2 \\
        --max_steps 250 --lr_scheduler_type cosine --warmup_steps 10 \\
        --output_dir runs/clm_muon

``examples/pretrain_clm.py`` is the same recipe as a script (``python
examples/pretrain_clm.py ...``, ``python -m hf_muon.run examples/pretrain_clm.py ...``).
Figure 5 of ``hf-muon bench`` uses :data:`TRAINING_DEFAULTS`, :class:`ModelArguments`,
:class:`DataArguments`, :func:`build_datasets` and :func:`build_model` of this module
(or of a script passed with ``--pretrain_script`` that defines the same names).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import datasets
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

from .corpus import BYTE_VOCAB, EOS_ID, PAD_ID, VOCAB_SIZE, stdlib_corpus

__all__ = [
    "BYTE_VOCAB", "EOS_ID", "PAD_ID", "VOCAB_SIZE", "TRAINING_DEFAULTS", "ModelArguments", "DataArguments",
    "stdlib_corpus", "tokenize", "group_into_blocks", "build_datasets", "build_model", "main",
]

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
    model_type: str = field(
        default="llama",
        metadata={"help": "llama (separate q/k/v, SwiGLU) or gpt2 (fused q|k|v in one Conv1D: see ns_split)."},
    )
    hidden_size: int = field(default=192, metadata={"help": "Width of the residual stream."})
    num_layers: int = field(default=4, metadata={"help": "Number of transformer blocks."})
    num_heads: int = field(default=4, metadata={"help": "Number of attention (query) heads."})
    num_kv_heads: int | None = field(
        default=None, metadata={"help": "Number of key/value heads (grouped-query attention; llama only). "
                                        "Default: 2 for llama."}
    )
    intermediate_size: int = field(default=512, metadata={"help": "Width of the MLP."})
    max_position_embeddings: int = field(default=256, metadata={"help": "Longest supported sequence."})
    tie_word_embeddings: bool = field(
        default=False, metadata={"help": "Share the input embedding and the LM head weights."}
    )

    def __post_init__(self) -> None:
        # refused before any data work, each saying what to change
        if self.model_type not in ("llama", "gpt2"):
            raise ValueError(f"--model_type must be llama or gpt2, got {self.model_type!r}")
        if self.model_type == "gpt2" and self.num_kv_heads is not None:
            raise ValueError("--num_kv_heads is for llama: gpt2 has one key/value head per query head")
        if self.model_type == "llama" and self.num_kv_heads is None:
            self.num_kv_heads = 2
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "max_position_embeddings") + \
                (("num_kv_heads",) if self.model_type == "llama" else ()):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"--hidden_size {self.hidden_size} must be a multiple of --num_heads {self.num_heads}")
        if self.model_type == "llama" and self.num_heads % self.num_kv_heads:
            raise ValueError(f"--num_heads {self.num_heads} must be a multiple of --num_kv_heads {self.num_kv_heads}")


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
            "--train_files is given (or the stdlib slice is too small to hold a file out), the last "
            "--validation_split_percentage of the training blocks."
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

    def __post_init__(self) -> None:
        if self.seq_len < 1 or (self.max_eval_samples is not None and self.max_eval_samples < 1):
            raise ValueError(f"--seq_len and --max_eval_samples must be at least 1, got {self.seq_len} and "
                             f"{self.max_eval_samples}")
        if not self.corpus_mb > 0:
            raise ValueError(f"--corpus_mb must be > 0, got {self.corpus_mb}")
        if not 0 <= self.eval_file_percentage < 100 or not 0 < self.validation_split_percentage < 100:
            raise ValueError(f"--eval_file_percentage must be in [0, 100) and --validation_split_percentage in "
                             f"(0, 100), got {self.eval_file_percentage} and {self.validation_split_percentage}")


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
        data_files = {"train": train_files}
        if args.eval_files or eval_files:  # a tiny corpus may hold out no file: blocks are split off below
            data_files["eval"] = args.eval_files or eval_files

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

    for split, what in (("train", "training"), ("eval", "evaluation")):
        if len(blocks[split]) == 0:
            raise ValueError(f"the {what} text holds no block of --seq_len {args.seq_len} tokens: give more text "
                             "(--corpus_mb, --train_files/--eval_files) or a shorter --seq_len")
    eval_dataset = blocks["eval"]
    if args.max_eval_samples is not None and len(eval_dataset) > args.max_eval_samples:
        eval_dataset = eval_dataset.shuffle(seed=0).select(range(args.max_eval_samples))
    return blocks["train"], eval_dataset


def build_model(args: ModelArguments, seq_len: int) -> LlamaForCausalLM | GPT2LMHeadModel:
    if seq_len > args.max_position_embeddings:
        raise ValueError(
            f"--seq_len {seq_len} exceeds --max_position_embeddings {args.max_position_embeddings}"
        )
    if args.model_type == "gpt2":
        gpt2 = GPT2Config(
            vocab_size=VOCAB_SIZE, n_embd=args.hidden_size, n_layer=args.num_layers, n_head=args.num_heads,
            n_inner=args.intermediate_size, n_positions=args.max_position_embeddings,
            tie_word_embeddings=args.tie_word_embeddings, eos_token_id=EOS_ID, bos_token_id=EOS_ID,
            pad_token_id=PAD_ID, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        return GPT2LMHeadModel(gpt2)
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


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Parse ``argv`` (default: ``sys.argv[1:]``), train, evaluate and save; returns the eval metrics."""
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    parser.set_defaults(**TRAINING_DEFAULTS)
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)

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
    return metrics


if __name__ == "__main__":
    main()
