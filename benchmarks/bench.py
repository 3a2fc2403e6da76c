"""The whole benchmark: same as ``hf-muon bench`` (see ``hf_muon/bench/run.py``).

    python benchmarks/bench.py --quick          # pipeline check, under 3 minutes
    python benchmarks/bench.py                  # full preset, under 30 minutes on 2 quiet CPU cores
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

from hf_muon.bench.run import main  # noqa: E402

if __name__ == "__main__":
    main()
