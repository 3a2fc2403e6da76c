"""Register ``--optim muon`` the moment transformers loads, in this process and in its children.

Registration must happen in the process that parses ``--optim``, which is often not the one the
user started (``accelerate launch`` and many CLIs re-launch Python). So the runner sets
``HF_MUON_REGISTER=1``; the ``hf_muon_autoregister.pth`` file installed with the package reads it
at every interpreter start and calls :func:`register_when_transformers_loads`, which hooks the
import of ``transformers.training_args`` / ``transformers.trainer`` without importing them itself.

The same hook registers ``"optimizer": {"type": "HfMuon"}`` when ``deepspeed`` is imported, makes
Accelerate refuse to swap hf_muon for DeepSpeedCPUAdam when ``accelerate.accelerator`` is, and sets
up Trainer + DeepSpeed on machines without a GPU (``integrations/accelerate_cpu.py``).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from types import ModuleType
from typing import Callable

ENV_VAR = "HF_MUON_REGISTER"


def _add_optimizer_name(module: ModuleType) -> None:
    from .accelerate_cpu import patch_training_args
    from .transformers import add_optimizer_name

    add_optimizer_name(module)
    patch_training_args(module)


def _patch_trainer(module: ModuleType) -> None:
    from .transformers import patch_trainer

    patch_trainer(module)


def _register_with_deepspeed(module: ModuleType) -> None:
    from .deepspeed_config import register_with_deepspeed

    register_with_deepspeed(module)


def _patch_accelerate(module: ModuleType) -> None:
    from .deepspeed_config import patch_accelerate

    patch_accelerate(module)


# Module -> what to do to it once it has run. The enum lives in training_args, the optimizer lookup
# in trainer; hooking each separately avoids importing trainer from inside training_args' import.
_ON_IMPORT: dict[str, Callable[[ModuleType], None]] = {
    "transformers.training_args": _add_optimizer_name,
    "transformers.trainer": _patch_trainer,
    "deepspeed": _register_with_deepspeed,
    "accelerate.accelerator": _patch_accelerate,
}

_DEFINES = {"transformers.training_args": "OptimizerNames", "transformers.trainer": "Trainer",
            "deepspeed": "initialize", "accelerate.accelerator": "Accelerator"}


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec):  # noqa: ANN001
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._callback(module)

    def __getattr__(self, name: str):  # get_source, get_code, ... for inspect and linecache
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._resolving = threading.local()

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001
        callback = _ON_IMPORT.get(fullname)
        if callback is None or getattr(self._resolving, "name", None) == fullname:
            return None
        self._resolving.name = fullname  # let the real finders answer for this name
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._resolving.name = None
        if spec is None or spec.loader is None:
            return None
        spec.loader = _CallbackLoader(spec.loader, callback)
        return spec


_FINDER = _PostImportFinder()


def register_when_transformers_loads() -> None:
    """Register ``muon`` with transformers (and ``HfMuon`` with DeepSpeed) now for what is loaded, and on
    import for the rest."""
    pending = False
    for name, callback in _ON_IMPORT.items():
        module = sys.modules.get(name)
        if module is not None and hasattr(module, _DEFINES[name]):
            callback(module)
        else:
            pending = True
    if pending and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
