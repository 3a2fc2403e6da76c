"""A command-line tool that re-launches itself: the parent never parses --optim, a child Python does."""

import os
import subprocess
import sys

if __name__ == "__main__":
    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_tiny.py")
    raise SystemExit(subprocess.run([sys.executable, child, *sys.argv[1:]]).returncode)
