"""The default corpus of :mod:`hf_muon.recipes.pretrain_clm` and of the benchmark's training runs.

A deterministic slice of the Python standard library's ``.py`` files (every machine has them, so
nothing is downloaded), tokenized byte-level: one id per UTF-8 byte (0..255) plus an end-of-document
id. Standard library only: importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

BYTE_VOCAB = 256
EOS_ID = BYTE_VOCAB  # appended after every document
PAD_ID = BYTE_VOCAB + 1  # never produced by the data pipeline, reserved for padding
VOCAB_SIZE = BYTE_VOCAB + 2

SKIPPED_FOLDERS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})


def _hash(name: str) -> str:
    return hashlib.md5(name.encode()).hexdigest()


def bucket(name: str) -> int:
    """A stable pseudo-random number in [0, 100) for ``name`` (Python's hash() is salted)."""
    return int(_hash(name), 16) % 100


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(megabytes: float) -> list[Path]:
    """The stdlib's ``.py`` files (tests and installed packages left out) in a hash-based order, so
    the slice mixes many packages instead of taking them alphabetically, until ``megabytes`` are
    collected (the file that crosses the budget is included)."""
    root = stdlib_root()
    names = sorted(
        (
            path.relative_to(root).as_posix()
            for path in root.rglob("*.py")
            if not SKIPPED_FOLDERS & set(path.relative_to(root).parts)
        ),
        key=_hash,
    )
    budget = int(megabytes * 1e6)
    files: list[Path] = []
    for name in names:
        if budget <= 0:
            break
        files.append(root / name)
        budget -= (root / name).stat().st_size
    return files


def stdlib_corpus(megabytes: float, eval_percentage: int) -> tuple[list[str], list[str]]:
    """:func:`stdlib_files` split into train and eval: a file goes to eval when its hash bucket is
    below ``eval_percentage``."""
    root = stdlib_root()
    train_files: list[str] = []
    eval_files: list[str] = []
    for path in stdlib_files(megabytes):
        (eval_files if bucket(path.relative_to(root).as_posix()) < eval_percentage else train_files).append(str(path))
    return train_files, eval_files
