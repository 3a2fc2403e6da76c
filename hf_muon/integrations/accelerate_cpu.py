"""Trainer + DeepSpeed on machines without a GPU: give Accelerate the world DeepSpeed has.

Without an accelerator, Accelerate's ``PartialState`` finds no distributed backend for DeepSpeed and
reports one process on every rank while DeepSpeed's own world has W ranks: every rank then sees
the whole dataset, believes it is the main process and writes checkpoints (``--ddp_backend gloo`` is
ignored on this path). That is silently wrong, so wherever hf_muon's registration is active (the
``hf_muon.run`` runner, ``HF_MUON_REGISTER=1``, or ``import hf_muon`` before ``TrainingArguments``
exist), :func:`patch_training_args` makes ``TrainingArguments`` do, in exactly that situation:

1. ``PartialState(backend="gloo")`` with ``ACCELERATE_USE_DEEPSPEED=true`` (DeepSpeed's
   ``init_distributed`` over gloo, so Accelerate's state has the real rank and world size);
2. ``accelerator_config.use_configured_state = True`` so the Trainer keeps that state;
3. ``torch.distributed.destroy_process_group()`` at exit (gloo aborts at shutdown otherwise).

"That situation" is: DeepSpeed requested (``--deepspeed`` or ``accelerate launch --use_deepspeed``),
launched with several ranks (``LOCAL_RANK`` set), Accelerate sees no accelerator, and no
``PartialState`` exists yet. With a GPU nothing changes. Set ``HF_MUON_CPU_DEEPSPEED=0`` to turn it off.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from datetime import timedelta
from types import ModuleType
from typing import Any

ENV_SWITCH = "HF_MUON_CPU_DEEPSPEED"
_TRUE = ("1", "true", "yes", "on")


def _flag(name: str, default: str = "false") -> bool:
    return os.environ.get(name, default).strip().lower() in _TRUE


def deepspeed_requested(args: Any) -> bool:
    """Whether these ``TrainingArguments`` (or the launcher's environment) ask for DeepSpeed."""
    return bool(getattr(args, "deepspeed", None)) or _flag("ACCELERATE_USE_DEEPSPEED")


def accelerator_available() -> bool:
    """Whether Accelerate would find a device with a distributed backend (the trap needs there be none)."""
    try:
        from accelerate.utils.imports import get_distributed_backend, get_torch_accelerator_backend
    except ImportError:  # older Accelerate: CUDA was the only backend it set up for DeepSpeed
        import torch

        return torch.cuda.is_available()
    device_type, _ = get_torch_accelerator_backend()
    return device_type is not None and get_distributed_backend(device_type) is not None


def needs_cpu_deepspeed_state(args: Any) -> bool:
    """True when Trainer + DeepSpeed would run each rank as if it were alone (see the module doc)."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() not in _TRUE:
        return False
    if not deepspeed_requested(args) or int(os.environ.get("LOCAL_RANK", "-1")) == -1:
        return False
    from accelerate.state import PartialState

    return PartialState._shared_state == {} and not accelerator_available()


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def init_cpu_deepspeed_state(timeout_s: float | None = None) -> Any:
    """Create Accelerate's ``PartialState`` for DeepSpeed over gloo and return it.

    ``ACCELERATE_USE_DEEPSPEED`` is set only while the state is created (Transformers does the same
    for ``--deepspeed``), then restored, so a later ``Accelerator`` is configured by its own
    arguments. The process group is destroyed at interpreter exit.
    """
    from accelerate.state import PartialState

    previous = os.environ.get("ACCELERATE_USE_DEEPSPEED")
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        state = PartialState(backend="gloo", **kwargs)
    finally:
        if previous is None:
            del os.environ["ACCELERATE_USE_DEEPSPEED"]
        else:
            os.environ["ACCELERATE_USE_DEEPSPEED"] = previous
    atexit.register(_destroy_process_group)
    if state.process_index == 0:
        print(f"hf_muon: DeepSpeed without a GPU: Accelerate uses a gloo process group of {state.num_processes} "
              f"ranks (on its own it would see 1 per rank). {ENV_SWITCH}=0 turns this off.", file=sys.stderr)
    return state


def _use_configured_state(accelerator_config: Any) -> Any:
    """``accelerator_config`` (None, dict, JSON text, JSON file or ``AcceleratorConfig``) with
    ``use_configured_state`` set, in a form ``TrainingArguments.__post_init__`` accepts."""
    if accelerator_config is None:
        return {"use_configured_state": True}
    if isinstance(accelerator_config, str):
        if accelerator_config.lstrip().startswith("{"):
            accelerator_config = json.loads(accelerator_config)
        else:
            with open(accelerator_config) as f:
                accelerator_config = json.load(f)
    if isinstance(accelerator_config, dict):
        return {**accelerator_config, "use_configured_state": True}
    accelerator_config.use_configured_state = True  # an AcceleratorConfig
    return accelerator_config


def prepare_training_args(args: Any) -> bool:
    """Before ``TrainingArguments.__post_init__``: set up the gloo DeepSpeed state if needed.

    Returns whether it did.
    """
    if not needs_cpu_deepspeed_state(args):
        return False
    init_cpu_deepspeed_state(getattr(args, "ddp_timeout", None))
    args.accelerator_config = _use_configured_state(args.accelerator_config)
    return True


def patch_training_args(training_args: ModuleType) -> None:
    """Run :func:`prepare_training_args` at the start of ``TrainingArguments.__post_init__`` (idempotent)."""
    cls = training_args.TrainingArguments
    original = cls.__post_init__
    if getattr(original, "_hf_muon", False):
        return

    def __post_init__(self: Any, *a: Any, **kw: Any) -> None:
        prepare_training_args(self)
        original(self, *a, **kw)

    __post_init__._hf_muon = True  # type: ignore[attr-defined]
    __post_init__.__doc__ = original.__doc__
    __post_init__.__wrapped__ = original  # type: ignore[attr-defined]
    cls.__post_init__ = __post_init__
