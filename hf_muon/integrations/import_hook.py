"""Register ``--optim muon`` the moment transformers loads, in this process and in its children.

Registration must happen in the process that parses ``--optim``, which is often not the one the
user started (``accelerate launch`` and many CLIs re-launch Python). Three things turn it on:

* ``--optim muon`` / ``--optim=muon`` in ``sys.argv`` or ``HF_MUON_REGISTER=1`` in the environment:
  ``hf_muon_autoregister.pth``, installed beside the package, checks both at every interpreter start
  and only then imports ``hf_muon._autoregister``, which calls :func:`register_when_transformers_loads`;
* ``python -m hf_muon.run`` sets ``HF_MUON_REGISTER=1`` for itself and every child it starts;
* ``import hf_muon``.

``HF_MUON_REGISTER=0`` turns all three automatic routes off (:func:`hf_muon.register_with_transformers`
still works). :func:`register_when_transformers_loads` hooks the import of the modules in
:data:`HOOKS` without importing them; each hook runs right after its module has run. A hook that
fails never breaks the user's import: it warns once, naming the library's version and what is
disabled. :func:`unregister` takes every hook and patch back.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from types import ModuleType

ENV_VAR = "HF_MUON_REGISTER"
_OFF = ("0", "false", "no", "off")


class IntegrationWarning(UserWarning):
    """hf_muon could not hook a third-party module; the feature it names is disabled in this process."""


@dataclass(frozen=True)
class Hook:
    """What to do to ``module`` once it has been imported (``defines`` shows it ran to the end)."""

    module: str
    defines: str
    library: str
    callback: str  # "hf_muon.integrations.x:function", imported only when the hook fires
    disables: str  # what does not work if the hook fails


# The enum lives in training_args, the optimizer lookup in trainer; hooking each separately avoids
# importing trainer from inside training_args' import.
HOOKS = (
    Hook("transformers.training_args", "OptimizerNames", "transformers",
         "hf_muon.integrations.transformers:on_training_args",
         "--optim muon (TrainingArguments), early --optim_args checks and the CPU multi-rank set-up"),
    Hook("transformers.trainer", "Trainer", "transformers", "hf_muon.integrations.transformers:on_trainer",
         "Trainer's lookup of --optim muon and its DeepSpeed config checks"),
    Hook("deepspeed", "initialize", "deepspeed", "hf_muon.integrations.deepspeed_config:register_with_deepspeed",
         '"optimizer": {"type": "HfMuon"} in DeepSpeed configs'),
    Hook("accelerate.accelerator", "Accelerator", "accelerate",
         "hf_muon.integrations.deepspeed_config:patch_accelerate",
         "the refusal of Accelerate's swap of hf_muon for DeepSpeedCPUAdam under optimizer offload"),
)
_BY_MODULE = {hook.module: hook for hook in HOOKS}
_WARNED: set[str] = set()


def registration_disabled() -> bool:
    """Whether ``HF_MUON_REGISTER`` turns automatic registration off (``0``, ``false``, ``no``, ``off``)."""
    return os.environ.get(ENV_VAR, "").strip().lower() in _OFF


def run_hook(hook: Hook, module: ModuleType) -> bool:
    """Run ``hook`` on its freshly imported ``module``; on any error warn once and return False."""
    from .compat import describe

    try:
        path, _, name = hook.callback.partition(":")
        getattr(importlib.import_module(path), name)(module)
        return True
    except Exception as error:  # noqa: BLE001 - the user's import must succeed whatever happens here
        if hook.module not in _WARNED:
            _WARNED.add(hook.module)
            warnings.warn(
                f"hf_muon could not hook {hook.module} ({type(error).__name__}: {error}); with "
                f"{describe(hook.library)} this is disabled: {hook.disables}. The import itself is unaffected.",
                IntegrationWarning, stacklevel=2)
        return False


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, hook: Hook) -> None:
        self._loader = loader
        self._hook = hook

    def create_module(self, spec):  # noqa: ANN001
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        run_hook(self._hook, module)

    def __getattr__(self, name: str):  # get_source, get_code, ... for inspect and linecache
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._resolving = threading.local()

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001
        hook = _BY_MODULE.get(fullname)
        if hook is None or getattr(self._resolving, "name", None) == fullname:
            return None
        self._resolving.name = fullname  # let the real finders answer for this name
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._resolving.name = None
        if spec is None or spec.loader is None:
            return None
        spec.loader = _CallbackLoader(spec.loader, hook)
        return spec


_FINDER = _PostImportFinder()


def register_when_transformers_loads() -> None:
    """Register ``muon`` with transformers (and ``HfMuon`` with DeepSpeed, Accelerate's checks) now for
    the modules already loaded, and on import for the rest. Idempotent; never raises for a hook."""
    for hook in HOOKS:
        module = sys.modules.get(hook.module)
        if module is not None and hasattr(module, hook.defines):
            run_hook(hook, module)
    # kept even when every hooked module is loaded: importlib.reload of one finds its spec here again
    # (transformers' OptimizerNames would lose muon otherwise); a miss costs a dict lookup per import
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def unregister() -> int:
    """Stop registering on import and take back every change hf_muon made to third-party modules
    (enum member, wrapped methods, ``torch.optim.HfMuon``...). Returns how many changes were undone."""
    from .compat import undo_all

    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    _WARNED.clear()
    return undo_all()
