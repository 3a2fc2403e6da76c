"""hf_muon: the Muon optimizer for the Hugging Face training stack.

``import hf_muon`` is cheap (it imports neither torch nor transformers nor deepspeed) and makes
``TrainingArguments(optim="muon")`` / ``--optim muon`` work as soon as transformers loads (unless
``HF_MUON_REGISTER=0``). ``--optim muon`` on any command line works without the import: see
``hf_muon/integrations/import_hook.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["GradientNoiseScale", "Muon", "ParameterSplit", "orthogonalize", "register_with_transformers", "split_parameters", "unregister"]

_LAZY = {
    "GradientNoiseScale": "hf_muon.optimizer.noise_scale",
    "Muon": "hf_muon.optimizer.muon",
    "split_parameters": "hf_muon.optimizer.param_split",
    "ParameterSplit": "hf_muon.optimizer.param_split",
    "orthogonalize": "hf_muon.kernels.newton_schulz",
    "register_with_transformers": "hf_muon.integrations.transformers",
    "unregister": "hf_muon.integrations.import_hook",
}

if TYPE_CHECKING:
    from .integrations.import_hook import unregister
    from .integrations.transformers import register_with_transformers
    from .kernels.newton_schulz import orthogonalize
    from .optimizer.noise_scale import GradientNoiseScale
    from .optimizer.muon import Muon
    from .optimizer.param_split import ParameterSplit, split_parameters


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_muon' has no attribute {name!r}")


from .integrations.import_hook import register_when_transformers_loads, registration_disabled  # noqa: E402

if not registration_disabled():
    register_when_transformers_loads()

# DeepSpeed ZeRO's layout provider, by module path: imported on first use (it never imports deepspeed),
# so the optimizer layer uses it without importing hf_muon.integrations.
from .distributed.providers import register_provider  # noqa: E402

register_provider("hf_muon.integrations.deepspeed_zero:PROVIDER")
