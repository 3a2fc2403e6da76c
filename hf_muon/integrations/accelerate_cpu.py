"""Trainer launched on several ranks of a machine without a GPU: give Accelerate the real world.

Without an accelerator, Accelerate (1.16, checked) and Trainer get a multi-rank launch silently wrong:

* DeepSpeed (``--deepspeed`` or ``accelerate launch --use_deepspeed``): ``PartialState`` finds no
  backend and reports one process on every rank, while DeepSpeed's own world has W ranks: every
  rank sees the whole dataset, believes it is the main process and writes checkpoints
  (``--ddp_backend gloo`` is ignored on this path).
* DDP (``torchrun`` / ``accelerate launch --multi_gpu``) without ``--use_cpu``: the same, one process
  per rank, and gradients are never all-reduced.
* FSDP (``accelerate launch --use_fsdp`` or ``--fsdp``): Accelerate turns FSDP on only for accelerator
  worlds (``MULTI_GPU``, ``MULTI_XPU``...), so on CPU the model is not sharded at all.

So wherever hf_muon's registration is active (``--optim muon``, the ``hf_muon.run`` runner,
``HF_MUON_REGISTER=1``, or ``import hf_muon`` before ``TrainingArguments`` exist),
:func:`prepare_training_args`, run at the start of ``TrainingArguments.__post_init__`` (see
``integrations/transformers.py``), first creates the ``PartialState`` those launches need, over gloo:

* DeepSpeed: ``PartialState(backend="gloo")`` while ``ACCELERATE_USE_DEEPSPEED=true``, so DeepSpeed's
  ``init_distributed`` runs and the state has DeepSpeed's rank and world size;
* DDP: ``PartialState(cpu=True, backend="gloo")`` (what ``--use_cpu`` does; skipped when it is set);
* FSDP: the same, then the state is labelled ``MULTI_GPU`` so that ``AcceleratorState`` enables FSDP;
  the device stays the CPU and FSDP2's ``fully_shard`` runs over gloo;

then sets ``accelerator_config.use_configured_state = True`` so the Trainer keeps that state, and
destroys the process group at exit (gloo aborts at shutdown otherwise). It acts only when the run
was launched with several ranks (``LOCAL_RANK`` set, ``WORLD_SIZE`` > 1), Accelerate sees no
accelerator and no ``PartialState`` exists yet; with a GPU nothing changes. It says what it did
on rank 0. ``HF_MUON_CPU_DISTRIBUTED=0`` turns it off.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from datetime import timedelta
from typing import Any

from .compat import internal

ENV_SWITCH = "HF_MUON_CPU_DISTRIBUTED"
DEEPSPEED, FSDP, DDP = "deepspeed", "fsdp", "ddp"
_TRUE = ("1", "true", "yes", "on")


def _flag(name: str, default: str = "false") -> bool:
    return os.environ.get(name, default).strip().lower() in _TRUE


def accelerator_available() -> bool:
    """Whether Accelerate finds a device with a distributed backend (the fixes apply when it does not)."""
    try:
        from accelerate.utils.imports import get_distributed_backend, get_torch_accelerator_backend
    except ImportError:  # older Accelerate: CUDA was the accelerator it set up distributed runs for
        import torch

        return torch.cuda.is_available()
    device_type, _ = get_torch_accelerator_backend()
    return device_type is not None and get_distributed_backend(device_type) is not None


def requested_kind(args: Any) -> str | None:
    """``"deepspeed"``, ``"fsdp"`` or ``"ddp"``: the engine these ``TrainingArguments`` and the launcher's
    environment ask for; ``None`` for DDP with ``--use_cpu`` (Trainer sets that up right itself)."""
    if getattr(args, "deepspeed", None) or _flag("ACCELERATE_USE_DEEPSPEED"):
        return DEEPSPEED
    if getattr(args, "fsdp", None) or _flag("ACCELERATE_USE_FSDP"):
        return FSDP
    if getattr(args, "use_cpu", False) or _flag("ACCELERATE_USE_CPU"):
        return None
    return DDP


def needs_cpu_state(args: Any) -> str | None:
    """The kind of launch (see :func:`requested_kind`) whose state must be set up here, or ``None``."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() not in _TRUE:
        return None
    if int(os.environ.get("LOCAL_RANK", "-1")) == -1 or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    kind = requested_kind(args)
    if kind is None:
        return None
    from accelerate.state import PartialState

    if internal(PartialState, "_shared_state", "accelerate") != {} or accelerator_available():
        return None
    return kind


_STATE_KIND: list[str] = []  # the kind of state init_cpu_state set up in this process, if any


def shutdown() -> None:
    """Destroy the process group :func:`init_cpu_state` created (no-op otherwise; safe to call twice).

    Registered with ``atexit`` for scripts that ``import hf_muon`` themselves; ``hf_muon.run`` ends
    every launch through :func:`hf_muon.launching.shutdown_process_group` itself (which may also end
    the process, see there). Here it only destroys the group: an ``atexit`` handler does not own
    the process.
    """
    if not _STATE_KIND:
        return
    from ..launching import shutdown_process_group

    shutdown_process_group()


def init_cpu_state(kind: str, timeout_s: float | None = None) -> Any:
    """Create Accelerate's ``PartialState`` for a ``kind`` launch over gloo and return it.

    For DeepSpeed, ``ACCELERATE_USE_DEEPSPEED`` is set only while the state is created (Transformers
    does the same for ``--deepspeed``) and then restored. The process group is destroyed at exit.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if kind not in (DEEPSPEED, FSDP, DDP):
        raise ValueError(f"kind must be one of {(DEEPSPEED, FSDP, DDP)}, got {kind!r}")
    kwargs: dict[str, Any] = {"backend": "gloo"}
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    if kind == DEEPSPEED:
        previous = os.environ.get("ACCELERATE_USE_DEEPSPEED")
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        try:
            state = PartialState(**kwargs)
        finally:
            if previous is None:
                del os.environ["ACCELERATE_USE_DEEPSPEED"]
            else:
                os.environ["ACCELERATE_USE_DEEPSPEED"] = previous
    else:
        state = PartialState(cpu=True, **kwargs)
        if kind == FSDP:
            # AcceleratorState enables FSDP only for accelerator worlds; the label is all it reads.
            state.distributed_type = DistributedType.MULTI_GPU
    if state.device is not None and state.device.type == "cpu" and state.device.index is not None:
        # Accelerate names the CPU "cpu:0" here; transformers < 5.18 resumes multi-rank checkpoints with
        # torch.load(map_location=args.device), and torch cannot restore a storage to "cpu:0"
        import torch

        state.device = torch.device("cpu")
    _STATE_KIND.append(kind)
    atexit.register(shutdown)
    if state.process_index == 0:
        alone = "would not shard the model" if kind == FSDP else "would see 1 process per rank"
        print(f"hf_muon: no GPU: Accelerate runs {kind} over a gloo process group of {state.num_processes} ranks "
              f"(on its own it {alone}). {ENV_SWITCH}=0 turns this off.", file=sys.stderr)
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


def prepare_training_args(args: Any) -> str | None:
    """Before ``TrainingArguments.__post_init__``: set up the gloo state a CPU launch needs.

    Returns the kind of launch it set up (``"deepspeed"``, ``"fsdp"``, ``"ddp"``) or ``None``.
    """
    if _STATE_KIND and _state_is_up():
        # A later TrainingArguments in the same process (a copy, dataclasses.replace, a second parse) must
        # keep the state too: without use_configured_state transformers resets it to one process per rank
        # while the gloo group stays up (each rank trained alone, and Muon still exchanged: wrong silently).
        kind, wanted = _STATE_KIND[0], requested_kind(args)
        if wanted is not None and wanted != kind:
            raise ValueError(f"hf_muon: this process set up a {kind} launch over gloo for its first TrainingArguments; "
                             f"these ask for {wanted}. Use one kind of launch per process.")
        args.accelerator_config = _use_configured_state(args.accelerator_config)
        return kind
    kind = needs_cpu_state(args)
    if kind is None:
        return None
    init_cpu_state(kind, getattr(args, "ddp_timeout", None))
    args.accelerator_config = _use_configured_state(args.accelerator_config)
    return kind


def _state_is_up() -> bool:
    from accelerate.state import PartialState

    return internal(PartialState, "_shared_state", "accelerate") != {}
