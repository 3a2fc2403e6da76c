"""``TrainingArguments(optim="muon")``: the optimizer name, the Trainer lookup, ``--optim_args``.

Works with transformers 5.x (and 4.4x): ``muon`` becomes a real ``OptimizerNames`` member (so
``OptimizerNames("muon")``, ``HfArgumentParser`` choices and pickled ``training_args.bin`` accept
it), and ``Trainer.get_optimizer_cls_and_kwargs`` answers for it before falling back to the
original lookup.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

OPTIM_NAME = "muon"
_MEMBER = "MUON"

# --optim_args keys -> converter from the string Trainer hands over.
_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
OPTIM_ARGS = {
    "momentum": float,
    "nesterov": lambda v: _BOOL[v.lower()],
    "ns_steps": int,
    "ns_coefficients": str,
    "ns_dtype": str,
    "adjust_lr": str,
    "adamw_lr": float,
    "force_muon": str,
    "force_adamw": str,
}


def add_optimizer_name(training_args: ModuleType) -> None:
    """Add ``MUON = "muon"`` to ``training_args.OptimizerNames`` (idempotent).

    A class attribute is not a member: ``OptimizerNames("muon")`` and argparse choices read the
    enum's member tables, so the member goes into those.
    """
    enum_cls = training_args.OptimizerNames
    if OPTIM_NAME in enum_cls._value2member_map_:
        return
    member = str.__new__(enum_cls, OPTIM_NAME)
    member._name_, member._value_ = _MEMBER, OPTIM_NAME
    member.__objclass__ = enum_cls
    type.__setattr__(enum_cls, _MEMBER, member)
    enum_cls._member_map_[_MEMBER] = member
    enum_cls._member_names_.append(_MEMBER)
    enum_cls._value2member_map_[OPTIM_NAME] = member


def parse_optim_args(optim_args: str | None) -> dict[str, Any]:
    """Parse ``--optim_args "momentum=0.95,ns_steps=5,force_adamw=lm_head"`` for Muon.

    Values may contain ``=``; a regex that needs a comma is not expressible (use ``|``).
    Unknown keys and malformed values raise ``ValueError`` naming the accepted keys.
    """
    parsed: dict[str, Any] = {}
    for item in (optim_args or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ValueError(f"--optim_args entry {item!r} is not key=value; muon accepts: {', '.join(OPTIM_ARGS)}")
        if key not in OPTIM_ARGS:
            raise ValueError(f"--optim_args key {key!r} is not a Muon setting; muon accepts: {', '.join(OPTIM_ARGS)}")
        try:
            parsed[key] = OPTIM_ARGS[key](value)
        except (ValueError, KeyError):
            raise ValueError(f"--optim_args {key}={value!r} is not a valid value for {key}") from None
    return parsed


def muon_cls_and_kwargs(args: Any, model: Any) -> tuple[type, dict[str, Any]]:
    """The ``(optimizer class, kwargs)`` Trainer builds for ``--optim muon``.

    Trainer's ``learning_rate``, ``weight_decay`` (and its no-decay set of biases and norms),
    ``adam_beta1/2`` and ``adam_epsilon`` apply; ``--optim_args`` sets the rest.
    """
    from transformers import Trainer

    from ..optimizer.muon import Muon
    from ..optimizer.param_split import split_parameters

    if model is None:
        raise ValueError("--optim muon needs the model to split its parameters; call Trainer.create_optimizer()")
    options = parse_optim_args(args.optim_args)
    split = split_parameters(model, options.pop("force_muon", None), options.pop("force_adamw", None))
    split.muon = [(n, p) for n, p in split.muon if p.requires_grad]
    split.adamw = [(n, p) for n, p in split.adamw if p.requires_grad]
    decay = set(Trainer.get_decay_parameter_names(None, model))  # it reads only the model
    no_decay = [n for n, _ in split.muon + split.adamw if n not in decay]
    kwargs = dict(
        lr=args.learning_rate,
        weight_decay=args.weight_decay,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        params=split.param_groups(no_decay=no_decay, weight_decay=args.weight_decay),
        **options,
    )
    return Muon, kwargs


def patch_trainer(trainer_module: ModuleType) -> None:
    """Make ``Trainer.get_optimizer_cls_and_kwargs`` answer for ``muon`` (idempotent), and check DeepSpeed
    configs once the Trainer's Accelerator exists (``deepspeed_config.check_trainer``)."""
    from .deepspeed_config import patch_trainer_checks

    trainer_cls = trainer_module.Trainer
    patch_trainer_checks(trainer_cls)
    original = trainer_cls.get_optimizer_cls_and_kwargs
    if getattr(original, "_hf_muon", False):
        return

    def get_optimizer_cls_and_kwargs(args: Any, model: Any = None) -> tuple[Any, Any]:
        if args.optim == OPTIM_NAME:
            return muon_cls_and_kwargs(args, model)
        return original(args, model)

    get_optimizer_cls_and_kwargs._hf_muon = True  # type: ignore[attr-defined]
    get_optimizer_cls_and_kwargs.__doc__ = original.__doc__
    trainer_cls.get_optimizer_cls_and_kwargs = staticmethod(get_optimizer_cls_and_kwargs)


def register_with_transformers() -> None:
    """Register ``muon`` with transformers now (imports it). ``import hf_muon`` does this lazily."""
    import transformers.trainer
    import transformers.training_args

    add_optimizer_name(transformers.training_args)
    patch_trainer(transformers.trainer)
