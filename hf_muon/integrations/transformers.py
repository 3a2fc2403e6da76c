"""``TrainingArguments(optim="muon")``: the optimizer name, the Trainer lookup, ``--optim_args``.

Works with transformers 5.x and 4.57 (both tested): ``muon`` becomes a real ``OptimizerNames`` member (so
``OptimizerNames("muon")``, ``HfArgumentParser`` choices and pickled ``training_args.bin`` accept
it), ``TrainingArguments`` checks ``--optim_args`` as it is created (before any data work), and
``Trainer.get_optimizer_cls_and_kwargs`` answers for it before falling back to the original lookup.
Every change goes through :mod:`hf_muon.integrations.compat` (one place to undo them all).
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import sys
from types import ModuleType
from typing import Any

from .compat import internal, record, wrap_once

LIBRARY = "transformers"
logger = logging.getLogger("hf_muon")

OPTIM_NAME = "muon"
_MEMBER = "MUON"

# --optim_args keys -> converter from the string Trainer hands over.
_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
OPTIM_ARGS = {
    "momentum": float,
    "nesterov": lambda v: _BOOL[v.lower()],
    "ns_steps": int,
    "ns_coefficients": str,
    "ns_precondition": str,
    "ns_dtype": str,
    "adjust_lr": str,
    "adamw_lr": float,
    "force_muon": str,
    "force_adamw": str,
    "ns_split": str,
    "telemetry": lambda v: _BOOL[v.lower()],
    "overlap_exchange": lambda v: _BOOL[v.lower()],
    "exchange_flops_per_byte": lambda v: v if v == "auto" else float(v),
    "qk_clip_tau": float,
    # not Muon settings: the Trainer attaches these features when training begins
    "adaptive_lr": lambda v: _BOOL[v.lower()],
    # not a Muon setting: a resume whose checkpoint has no usable optimizer state continues fresh (loudly)
    "allow_fresh_state": lambda v: _BOOL[v.lower()],
}
_TRAINER_ONLY = ("allow_fresh_state", "adaptive_lr")


def add_optimizer_name(training_args: ModuleType) -> None:
    """Add ``MUON = "muon"`` to ``training_args.OptimizerNames`` (idempotent).

    A class attribute is not a member: ``OptimizerNames("muon")`` and argparse choices read the
    enum's member tables, so the member goes into those.
    """
    enum_cls = internal(training_args, "OptimizerNames", LIBRARY)
    if OPTIM_NAME in enum_cls._value2member_map_:
        return
    member = str.__new__(enum_cls, OPTIM_NAME)
    member._name_, member._value_ = _MEMBER, OPTIM_NAME
    member.__objclass__ = enum_cls
    type.__setattr__(enum_cls, _MEMBER, member)
    enum_cls._member_map_[_MEMBER] = member
    enum_cls._member_names_.append(_MEMBER)
    enum_cls._value2member_map_[OPTIM_NAME] = member

    def undo() -> None:
        type.__delattr__(enum_cls, _MEMBER)
        del enum_cls._member_map_[_MEMBER], enum_cls._value2member_map_[OPTIM_NAME]
        enum_cls._member_names_.remove(_MEMBER)

    record(LIBRARY, f"{enum_cls.__module__}.OptimizerNames.{_MEMBER}", undo)


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
        if key in parsed:
            raise ValueError(f"--optim_args sets {key} twice; give each setting once")
        try:
            parsed[key] = OPTIM_ARGS[key](value)
        except (ValueError, KeyError):
            raise ValueError(f"--optim_args {key}={value!r} is not a valid value for {key}") from None
    return parsed


def check_optim_args(optim_args: str | None) -> dict[str, Any]:
    """Parse ``--optim_args`` and check every value as :class:`hf_muon.Muon` will (ranges, names,
    regexes), so that a mistake stops the run when ``TrainingArguments`` is created, not after the
    data and the model were prepared. Returns the parsed settings; raises ``ValueError``."""
    from ..optimizer.muon import Muon

    options = parse_optim_args(optim_args)
    defaults = {name: p.default for name, p in inspect.signature(Muon.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    try:
        Muon._check_hyperparameters({**defaults, **options})
        Muon._check_adamw_lr(options.get("adamw_lr"))
        if "qk_clip_tau" in options:
            from ..models.qk_clip import check_tau

            check_tau(options["qk_clip_tau"])
        Muon._check_exchange_flops_per_byte(options.get("exchange_flops_per_byte"))
        for key in ("force_muon", "force_adamw"):
            if key in options:
                try:
                    re.compile(options[key])
                except re.error as error:
                    raise ValueError(f"{key}={options[key]!r} is not a valid regular expression ({error})") from None
    except ValueError as error:
        raise ValueError(f"--optim_args: {error}") from None
    return options


def _is_muon(optim: Any) -> bool:
    return str(getattr(optim, "value", optim)) == OPTIM_NAME


def show_info_lines(rank: int) -> None:
    """Make the ``hf_muon`` logger print its INFO lines (on rank 0; warnings on every rank) unless the
    user configured it. Called when a Trainer run asks for ``--optim muon``."""
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[hf_muon] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False


def before_training_args(args: Any) -> None:
    """Run at the start of ``TrainingArguments.__post_init__``: check ``--optim muon``'s settings, then
    set up the gloo state a multi-rank CPU launch needs (``accelerate_cpu.prepare_training_args``)."""
    from .accelerate_cpu import prepare_training_args

    if _is_muon(args.optim):
        check_optim_args(args.optim_args)
        show_info_lines(int(os.environ.get("RANK", "0")))
    prepare_training_args(args)


def on_training_args(training_args: ModuleType) -> None:
    """Import hook of ``transformers.training_args``: add the ``muon`` name and the early checks (idempotent)."""
    add_optimizer_name(training_args)
    cls = internal(training_args, "TrainingArguments", LIBRARY)

    def wrap(original):
        def __post_init__(self: Any, *a: Any, **kw: Any) -> None:
            before_training_args(self)
            original(self, *a, **kw)

        return __post_init__

    wrap_once(cls, "__post_init__", wrap, LIBRARY)


def muon_cls_and_kwargs(args: Any, model: Any) -> tuple[type, dict[str, Any]]:
    """The ``(optimizer class, kwargs)`` Trainer builds for ``--optim muon``.

    Trainer's ``learning_rate``, ``weight_decay`` (and its no-decay set of biases and norms),
    ``adam_beta1/2`` and ``adam_epsilon`` apply; ``--optim_args`` sets the rest.
    """
    from transformers import Trainer

    from ..optimizer.groups import ModelParamGroups
    from ..optimizer.muon import Muon
    from ..optimizer.param_split import split_parameters

    if model is None:
        raise ValueError("--optim muon needs the model to split its parameters; call Trainer.create_optimizer()")
    options = {k: v for k, v in check_optim_args(args.optim_args).items() if k not in _TRAINER_ONLY}
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
        # the groups carry the model (fused projections, QK-clip): a "model" keyword would make the
        # Trainer pass the model instead of these groups
        params=ModelParamGroups(split.param_groups(no_decay=no_decay, weight_decay=args.weight_decay), model),
        **options,
    )
    return Muon, kwargs


def on_trainer(trainer_module: ModuleType) -> None:
    """Import hook of ``transformers.trainer``: make ``Trainer.get_optimizer_cls_and_kwargs`` answer for
    ``muon``, check DeepSpeed configs once the Trainer's Accelerator exists, and make checkpoints
    resume under any layout (:mod:`hf_muon.integrations.trainer_checkpoints`), and log Muon's figures
    (:mod:`hf_muon.integrations.trainer_telemetry`) (idempotent)."""
    from . import trainer_adaptive_lr, trainer_checkpoints, trainer_telemetry
    from .deepspeed_config import check_trainer

    trainer_checkpoints.on_trainer(trainer_module)
    trainer_telemetry.on_trainer(trainer_module)
    trainer_cls = internal(trainer_module, "Trainer", LIBRARY)

    def wrap_lookup(original):
        def get_optimizer_cls_and_kwargs(args: Any, model: Any = None) -> tuple[Any, Any]:
            if _is_muon(args.optim):
                return muon_cls_and_kwargs(args, model)
            return original(args, model)

        return get_optimizer_cls_and_kwargs

    def wrap_accelerator(original):
        def create_accelerator_and_postprocess(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            check_trainer(self)
            return result

        return create_accelerator_and_postprocess

    def wrap_init(original):
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            # callbacks that act once training begins (the optimizer and the prepared model exist then)
            trainer_telemetry.install(self)
            trainer_adaptive_lr.install(self)

        return __init__

    wrap_once(trainer_cls, "__init__", wrap_init, LIBRARY)
    wrap_once(trainer_cls, "get_optimizer_cls_and_kwargs", wrap_lookup, LIBRARY)
    wrap_once(trainer_cls, "create_accelerator_and_postprocess", wrap_accelerator, LIBRARY)


def register_with_transformers() -> None:
    """Register ``muon`` with transformers now (imports it). ``import hf_muon`` does this lazily."""
    import transformers.trainer
    import transformers.training_args

    on_training_args(transformers.training_args)
    on_trainer(transformers.trainer)
