"""DeepSpeed JSON configs and hf_muon: ``"optimizer": {"type": "HfMuon"}``, and configs that would drop it.

Two ways select hf_muon under DeepSpeed:

* no ``"optimizer"`` block in the DeepSpeed config and ``--optim muon`` (Trainer builds the optimizer);
* ``"optimizer": {"type": "HfMuon", "params": {...}}``: DeepSpeed looks up any type it does not know
  as ``getattr(torch.optim, type)``, so :func:`register_with_deepspeed` puts :class:`HfMuon` there and
  into ``ZERO_SUPPORTED_OPTIMIZERS``. (``"type": "Muon"``, in any case, is always DeepSpeed's own Muon.)

On the second path DeepSpeed hands the optimizer a flat list of tensors without names or model, so
:class:`HfMuon` takes the model from the DeepSpeed engine that is building it and splits the tensors
exactly as ``Muon(model)`` would, or refuses.

:func:`check_deepspeed_config` refuses, with what to change, the combinations in which Trainer or
Accelerate would silently not run hf_muon: an ``"optimizer"`` block together with ``--optim muon``
(Trainer ignores ``--optim``), and optimizer offload with ``zero_force_ds_cpu_optimizer`` left true
(Accelerate swaps the optimizer for DeepSpeedCPUAdam).

Nothing here runs at ``import hf_muon``: the import hook calls :func:`register_with_deepspeed` when
``deepspeed`` is imported and :func:`patch_accelerate` when ``accelerate.accelerator`` is, and the
Trainer patch (``integrations/transformers.py``) calls :func:`check_trainer` once the Accelerator exists.
"""

from __future__ import annotations

import importlib.util

import contextvars
import inspect
import os
from types import ModuleType
from typing import Any

from torch import Tensor, nn

from ..optimizer.groups import module_behind
from ..optimizer.muon import Muon
from ..optimizer.param_split import MUON
from .compat import internal, record, wrap_once

OPTIMIZER_TYPE = "HfMuon"
OPTIM_NAME = "muon"  # --optim muon (integrations/transformers.py)
# Keys the Trainer fills from TrainingArguments when the config says "auto".
TRAINER_AUTO_KEYS = ("lr", "betas", "eps", "weight_decay")
# Muon's constructor arguments a DeepSpeed config may set (not params and model: DeepSpeed passes those).
OPTIMIZER_PARAMS = tuple(name for name in inspect.signature(Muon.__init__).parameters
                         if name not in ("self", "params", "model"))

# The module of the DeepSpeed engine that is building its optimizer right now (see _patch_engine).
_ENGINE_MODULE: contextvars.ContextVar[nn.Module | None] = contextvars.ContextVar("hf_muon_engine_module",
                                                                                 default=None)


def check_optimizer_params(params: dict[str, Any]) -> None:
    """Refuse ``"optimizer": {"type": "HfMuon", "params": ...}`` keys that are not Muon settings."""
    unknown = sorted(set(params) - set(OPTIMIZER_PARAMS))
    if unknown:
        raise ValueError(
            f"DeepSpeed config \"optimizer\": {{\"type\": \"{OPTIMIZER_TYPE}\"}} has params {unknown} that "
            f"hf_muon.Muon does not take; it accepts: {', '.join(OPTIMIZER_PARAMS)}"
        )


def _name_tensors(tensors: list[Tensor], model: nn.Module) -> list[tuple[str, Tensor]]:
    names = {id(p): n for n, p in model.named_parameters()}
    foreign = [i for i, p in enumerate(tensors) if id(p) not in names]
    if foreign:
        raise ValueError(
            f"HfMuon was given {len(foreign)} tensors (positions {foreign[:5]}...) that are not parameters of the "
            f"model {type(model).__name__}, so it cannot tell hidden matrices (Muon) from embeddings, heads and "
            "norms (AdamW). Pass only the model's parameters to deepspeed.initialize(model_parameters=...)."
        )
    return [(names[id(p)], p) for p in tensors]


def _with_names(params: list[Any], model: nn.Module) -> list[Any]:
    """Flat tensors (and tensors inside group dicts) as ``(name, tensor)`` pairs of ``model``."""
    if all(isinstance(p, Tensor) for p in params):
        return _name_tensors(params, model)
    if all(isinstance(g, dict) for g in params):
        groups = []
        for group in params:
            plist = [group["params"]] if isinstance(group["params"], Tensor) else list(group["params"])
            if plist and all(isinstance(p, Tensor) for p in plist) and "algorithm" not in group:
                group = {**group, "params": _name_tensors(plist, model)}
            groups.append(group)
        return groups
    return params  # (name, tensor) pairs: Muon looks them up in the model itself


class HfMuon(Muon):
    """:class:`hf_muon.Muon` under the name a DeepSpeed config selects: ``"type": "HfMuon"``.

    DeepSpeed builds it as ``HfMuon(model_parameters, **params)`` where ``model_parameters`` is a
    flat list of tensors. The model those tensors belong to comes from ``model=`` or, when DeepSpeed
    builds it, from the engine (``engine.module``); without one it refuses rather than guess
    from tensor shapes. It also refuses when no tensor qualifies for Muon (for example when
    ``deepspeed.zero.Init`` has hidden every shape), instead of silently running AdamW alone.
    """

    def __init__(self, params: Any, *args: Any, model: nn.Module | None = None, **kwargs: Any) -> None:
        check_optimizer_params(kwargs)
        behind = module_behind(params)
        model = model if model is not None else (behind if behind is not None else _ENGINE_MODULE.get())
        if model is None:
            raise ValueError(
                "HfMuon needs the model its tensors come from, to give Muon to hidden matrices and AdamW to "
                "embeddings, heads and norms. Select it through a DeepSpeed config (\"optimizer\": {\"type\": "
                "\"HfMuon\"}) so the DeepSpeed engine supplies the model, or pass model=..."
            )
        if behind is None and not isinstance(params, nn.Module):
            params = _with_names(list(params), model)
        super().__init__(params, *args, model=model, **kwargs)
        if not any(g["algorithm"] == MUON and g["params"] for g in self.param_groups):
            count = sum(len(g["params"]) for g in self.param_groups)
            raise ValueError(
                f"HfMuon found no hidden weight matrix for Muon among the {count} tensors of {type(model).__name__}: "
                "all would get AdamW. If the model was created under deepspeed.zero.Init (ZeRO-3 with "
                "from_pretrained/from_config), its parameters' shapes are hidden from the split; otherwise choose "
                "params with force_muon, or use \"type\": \"AdamW\"."
            )


def _patch_engine(engine_cls: type) -> None:
    """Let :class:`HfMuon` see the module of the engine that constructs it (idempotent)."""

    def wrap(original):
        def _configure_basic_optimizer(self: Any, model_parameters: Any) -> Any:
            token = _ENGINE_MODULE.set(self.module)
            try:
                return original(self, model_parameters)
            finally:
                _ENGINE_MODULE.reset(token)

        return _configure_basic_optimizer

    wrap_once(engine_cls, "_configure_basic_optimizer", wrap, "deepspeed")


def register_with_deepspeed(deepspeed_module: ModuleType | None = None) -> None:
    """Make ``"optimizer": {"type": "HfMuon"}`` work in DeepSpeed configs (idempotent; imports deepspeed).

    Puts :class:`HfMuon` on ``torch.optim`` (DeepSpeed's lookup for types it does not know), adds it
    and :class:`hf_muon.Muon` to ``ZERO_SUPPORTED_OPTIMIZERS`` (so ZeRO needs no
    ``zero_allow_untested_optimizer``), and lets the engine hand :class:`HfMuon` its model.
    ``deepspeed_module`` is what the import hook passes (the package just imported); it is not needed.
    """
    import torch.optim
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero import utils as zero_utils

    existing = getattr(torch.optim, OPTIMIZER_TYPE, None)
    if existing is not None and existing is not HfMuon:
        raise RuntimeError(f"torch.optim.{OPTIMIZER_TYPE} is already {existing!r}; hf_muon cannot register its own")
    if existing is None:
        torch.optim.HfMuon = HfMuon  # type: ignore[attr-defined]
        record("deepspeed", f"torch.optim.{OPTIMIZER_TYPE}", lambda: delattr(torch.optim, OPTIMIZER_TYPE))
    supported = internal(zero_utils, "ZERO_SUPPORTED_OPTIMIZERS", "deepspeed")
    for cls in (HfMuon, Muon):
        if cls not in supported:
            supported.append(cls)
            record("deepspeed", f"deepspeed ZERO_SUPPORTED_OPTIMIZERS += {cls.__name__}",
                   lambda cls=cls: supported.remove(cls))
    _patch_engine(DeepSpeedEngine)


def _offload_device(config: dict[str, Any]) -> str | None:
    offload = (config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    device = offload.get("device") if isinstance(offload, dict) else None
    return None if device in (None, "none") else str(device)


def check_deepspeed_config(config: dict[str, Any], optim: str | None = None, source: str = "the DeepSpeed config") -> None:
    """Refuse a DeepSpeed config that, with ``--optim optim``, would not run what the user asked for.

    Args:
        config: the DeepSpeed config as a dict (after Accelerate read it).
        optim: ``TrainingArguments.optim`` (``"muon"`` means Trainer is to build hf_muon.Muon).
        source: where the config came from, for the messages.

    Raises:
        ValueError: saying what to change in the config or on the command line.
    """
    block = config.get("optimizer")
    muon_flag = str(getattr(optim, "value", optim)) == OPTIM_NAME
    if isinstance(block, dict):
        kind = block.get("type")
        kind_lower = kind.lower() if isinstance(kind, str) else None
        if kind_lower == OPTIMIZER_TYPE.lower() and kind != OPTIMIZER_TYPE:
            raise ValueError(f"{source}: write \"type\": \"{OPTIMIZER_TYPE}\" exactly (DeepSpeed looks the name up "
                             f"in torch.optim, case-sensitively); got {kind!r}")
        if muon_flag and kind_lower == "muon":
            raise ValueError(
                f"{source} has \"optimizer\": {{\"type\": {kind!r}}}, which is always DeepSpeed's own Muon, not hf_muon, "
                "and with an \"optimizer\" block Trainer ignores --optim muon. To train with hf_muon, remove the "
                f"\"optimizer\" block and keep --optim muon, or set \"type\": \"{OPTIMIZER_TYPE}\" and drop --optim muon."
            )
        if muon_flag and kind == OPTIMIZER_TYPE:
            raise ValueError(
                f"{source} selects hf_muon (\"type\": \"{OPTIMIZER_TYPE}\") and so does --optim muon; with an "
                "\"optimizer\" block Trainer ignores --optim and --optim_args. Use one: remove the \"optimizer\" "
                "block (settings from --optim_args), or drop --optim muon (settings from the block's \"params\")."
            )
        if muon_flag:
            raise ValueError(
                f"{source} has \"optimizer\": {{\"type\": {kind!r}}}: Trainer would silently ignore --optim muon and "
                "train with that optimizer. Remove the \"optimizer\" block to train with hf_muon "
                f"(or set \"type\": \"{OPTIMIZER_TYPE}\" and drop --optim muon)."
            )
        if kind == OPTIMIZER_TYPE:
            params = block.get("params") or {}
            check_optimizer_params(params)
            stuck = sorted(k for k, v in params.items() if v == "auto" and k not in TRAINER_AUTO_KEYS)
            if stuck:
                raise ValueError(f"{source}: \"auto\" is only filled for {TRAINER_AUTO_KEYS}; give {stuck} values")
    device = _offload_device(config)
    if muon_flag and not isinstance(block, dict) and device and config.get("zero_force_ds_cpu_optimizer", True):
        raise ValueError(OFFLOAD_MESSAGE.format(source=source, device=device))


OFFLOAD_MESSAGE = (
    "{source} offloads the optimizer to {device} while \"zero_force_ds_cpu_optimizer\" is true (DeepSpeed's "
    "default): Accelerate would silently replace hf_muon.Muon with DeepSpeedCPUAdam. Add "
    "\"zero_force_ds_cpu_optimizer\": false at the top level of the DeepSpeed config file "
    "(see ds_configs/zero3_offload.json)."
)


def config_source(args: Any) -> str:
    """Where the DeepSpeed config of this run came from, for messages."""
    if isinstance(getattr(args, "deepspeed", None), str):
        return f"DeepSpeed config {args.deepspeed}"
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    return f"DeepSpeed config {path}" if path and path != "none" else "the DeepSpeed config (from accelerate launch)"


def check_trainer(trainer: Any) -> None:
    """Run :func:`check_deepspeed_config` for a Trainer whose Accelerator exists (no-op without DeepSpeed)."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return
    plugin = internal(trainer.accelerator.state, "deepspeed_plugin", "accelerate")
    register_with_deepspeed()
    check_deepspeed_config(plugin.deepspeed_config, trainer.args.optim, config_source(trainer.args))


def patch_accelerate(accelerator_module: ModuleType) -> None:
    """Make Accelerate refuse, instead of silently swapping, hf_muon.Muon for DeepSpeedCPUAdam (idempotent).

    Accelerate calls ``map_pytorch_optim_to_deepspeed`` only for a client optimizer under
    optimizer offload with ``zero_force_ds_cpu_optimizer`` true; that is the swap.
    """

    def wrap(original):
        def map_pytorch_optim_to_deepspeed(optimizer: Any) -> Any:
            if isinstance(optimizer, Muon):
                raise ValueError(OFFLOAD_MESSAGE.format(source="The DeepSpeed config", device="cpu"))
            return original(optimizer)

        return map_pytorch_optim_to_deepspeed

    if not hasattr(accelerator_module, "map_pytorch_optim_to_deepspeed") and \
            importlib.util.find_spec("deepspeed") is None:
        return  # Accelerate defines it only where DeepSpeed is installed: nothing to swap, nothing to refuse
    wrap_once(accelerator_module, "map_pytorch_optim_to_deepspeed", wrap, "accelerate")
