"""Pretrain a small Llama-style causal language model with the Hugging Face Trainer.

A plain Trainer script: it knows nothing about Muon. The recipe itself ships in
the package as ``hf_muon.recipes.pretrain_clm`` (also runnable as ``python -m
hf_muon.recipes.pretrain_clm`` from any directory); this script runs it. The
model is built from a config (no weights are downloaded), text is tokenized
byte-level (UTF-8 bytes -> ids 0..255 plus an end-of-document id), and the
default corpus is the Python standard library's own ``.py`` files, so the script
runs offline on any machine.

Every ``TrainingArguments`` flag works (``--optim``, ``--optim_args``,
``--learning_rate``, ``--max_steps``, ``--deepspeed``, ``--local_rank`` ...),
next to the model and data flags of ``ModelArguments`` and ``DataArguments``.

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

To change the recipe, copy ``hf_muon/recipes/pretrain_clm.py`` here in place of
this import; ``hf-muon bench --pretrain_script PATH`` trains such a script in
figure 5 (it must define the names imported below).
"""

from hf_muon.recipes.pretrain_clm import (  # noqa: F401  (re-exported: hf-muon bench --pretrain_script)
    TRAINING_DEFAULTS,
    DataArguments,
    ModelArguments,
    build_datasets,
    build_model,
    main,
)

if __name__ == "__main__":
    main()
