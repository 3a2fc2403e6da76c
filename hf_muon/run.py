"""Run an unmodified training script with ``--optim muon`` available.

    python -m hf_muon.run examples/pretrain_clm.py --optim muon ...
    python -m hf_muon.run -m my_package.train --optim muon ...
    accelerate launch -m hf_muon.run train.py --optim muon ...     (also torchrun -m, deepspeed --module)

It sets ``HF_MUON_REGISTER=1`` so registration reaches every child Python the script starts
(launchers and CLIs that re-launch themselves), then runs the script as ``__main__``.
"""

from __future__ import annotations

import os
import runpy
import sys

from .integrations.import_hook import ENV_VAR, register_when_transformers_loads

USAGE = "usage: python -m hf_muon.run SCRIPT.py [ARGS...]  |  python -m hf_muon.run -m MODULE [ARGS...]"


def main(argv: list[str] | None = None) -> None:
    """Run ``SCRIPT [ARGS]`` (or ``-m MODULE [ARGS]``) with Muon registered."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        raise SystemExit(0 if argv else 2)
    os.environ[ENV_VAR] = "1"
    register_when_transformers_loads()
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit(USAGE)
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        if not os.path.isfile(script):
            raise SystemExit(f"hf_muon.run: no such script: {script}\n{USAGE}")
        sys.argv = [script, *argv[1:]]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` does
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
