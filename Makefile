# Two commands a new machine needs (nothing installed by hand):
#   make demo   train the demo model with Muon and with AdamW, print both eval losses, plot them
#   make test   run the whole test suite
#   make test-fast   the tests without multi-process launches (pytest -m "not slow", about 3 minutes)
# Both create/update the virtual environment in $(VENV). A torch already importable there (e.g.
# your own CUDA build, seen through --system-site-packages) is kept; otherwise torch==2.13.0 is installed.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEPS := $(VENV)/.hf_muon-deps
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1

.PHONY: demo test test-fast install clean

$(PY):
	$(PYTHON) -m venv --system-site-packages $(VENV)

$(DEPS): setup.cfg setup.py pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip "setuptools>=64" wheel
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q ".[deepspeed,examples,tests]"
	touch $@

# Reinstall our own package each time (3 s): child processes load it from site-packages.
install: $(DEPS)
	$(PY) -m pip install -q --no-deps --no-build-isolation --force-reinstall .

demo: install
	$(PY) examples/demo.py

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf build *.egg-info runs .pytest_cache
