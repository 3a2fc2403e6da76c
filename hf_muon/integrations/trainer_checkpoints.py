"""Trainer checkpoints with ``--optim muon`` that resume under any layout, and never silently fresh.

Each checkpoint the Trainer writes gets ``hf_muon_state/`` (see :mod:`hf_muon.checkpoint.portable`)
beside the backend's own files. On ``resume_from_checkpoint``:

* with ``hf_muon_state/``: the backend's own loaders, which only read their own layout
  (``deepspeed_load_checkpoint``; FSDP's loader; ``model.safetensors`` when it is absent), stand aside,
  and hf_muon loads the weights it trains, Muon momentum, AdamW moments and step counts, the param
  groups' learning rates and the scheduler under the current layout. The Trainer restores the step
  and data position from ``trainer_state.json`` as always.
* without it (a checkpoint from an older hf_muon): the backend loads what it can; if that leaves
  the optimizer without state the run stops, naming ``hf-muon convert-checkpoint``, unless
  ``--optim_args allow_fresh_state=true`` asks to start the optimizer fresh (said loudly).
"""

from __future__ import annotations

import glob
import logging
import os
from typing import Any

from ..checkpoint.convert import deepspeed_tag_dir
from ..checkpoint.portable import CheckpointError, has_portable_state, has_state, load_portable, save_portable
from .compat import internal, wrap_once
from .trainer_adaptive_lr import estimator_for_checkpoint

LIBRARY = "transformers"
logger = logging.getLogger("hf_muon")
_WEIGHTS_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                  "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")


def innermost_optimizer(optimizer: Any) -> Any:
    """The optimizer under Accelerate's and DeepSpeed's wrappers (sometimes two deep)."""
    while getattr(optimizer, "optimizer", None) is not None and optimizer.optimizer is not optimizer:
        optimizer = optimizer.optimizer
    return optimizer


def muon_of(optimizer: Any) -> Any:
    from ..optimizer.muon import Muon

    inner = innermost_optimizer(optimizer) if optimizer is not None else None
    return inner if isinstance(inner, Muon) else None


def describe_layout(trainer: Any) -> dict:
    """The layout a Trainer runs under, as recorded in checkpoints and named in messages."""
    args = trainer.args
    if trainer.is_deepspeed_enabled:
        stage = trainer.accelerator.state.deepspeed_plugin.zero_stage
        backend = f"DeepSpeed ZeRO-{stage}"
    elif trainer.is_fsdp_enabled:
        backend = "FSDP"
    else:
        backend = "DDP" if args.world_size > 1 else "one process"
    return {"backend": backend, "world_size": args.world_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps}


def native_layout(checkpoint: str) -> str:
    """What the backend files in ``checkpoint`` say wrote it (for messages)."""
    tag_dir = deepspeed_tag_dir(checkpoint)
    if tag_dir:
        ranks = len(glob.glob(os.path.join(tag_dir, "*optim_states.pt")))
        stage3 = bool(glob.glob(os.path.join(tag_dir, "zero_pp_rank_*_model_states.pt")))
        return f"DeepSpeed ZeRO-{'3' if stage3 else '1/2'} at {ranks} ranks"
    if glob.glob(os.path.join(checkpoint, "optimizer_0*")) or glob.glob(os.path.join(checkpoint, "pytorch_model_fsdp*")):
        return "FSDP"
    if os.path.isfile(os.path.join(checkpoint, "optimizer.pt")):
        return "one process or DDP (optimizer.pt)"
    return "no optimizer state"


def _muon_requested(trainer: Any) -> bool:
    from .transformers import _is_muon

    return _is_muon(trainer.args.optim) or muon_of(trainer.optimizer) is not None


def _allow_fresh(trainer: Any) -> bool:
    from .transformers import _is_muon, parse_optim_args

    return _is_muon(trainer.args.optim) and parse_optim_args(trainer.args.optim_args).get("allow_fresh_state", False)


def refuse_without_state(trainer: Any, checkpoint: str) -> None:
    """The resume left Muon without state: stop (or, opted in, go on fresh and say so loudly)."""
    current = describe_layout(trainer)
    message = (
        f"Resuming from {checkpoint} under {current['backend']} at {current['world_size']} ranks loaded no "
        f"optimizer state: the checkpoint has no hf_muon_state/ and its own files ({native_layout(checkpoint)}) "
        "cannot be read by this layout, so Muon's momentum and AdamW's moments would restart from zero. "
        f"Convert it once, then resume from the result: hf-muon convert-checkpoint {checkpoint} "
        f"{checkpoint.rstrip(os.sep)}-portable  (or resume under the layout that wrote it; or pass "
        "--optim_args allow_fresh_state=true to continue with fresh optimizer state)"
    )
    if _allow_fresh(trainer):
        logger.warning("allow_fresh_state=true: CONTINUING WITH FRESH OPTIMIZER STATE. " + message)
        return
    raise CheckpointError(message)


def save_with_trainer(trainer: Any, output_dir: str) -> None:
    """Write ``hf_muon_state/`` into a checkpoint the Trainer is saving (every rank calls)."""
    muon = muon_of(trainer.optimizer)
    if muon is None or trainer.args.save_only_model:
        return
    try:
        save_portable(muon, trainer.model, output_dir, scheduler=trainer.lr_scheduler,
                      written_under=describe_layout(trainer), noise_scale=estimator_for_checkpoint(trainer))
    except (KeyError, RuntimeError, NotImplementedError) as error:  # the same on every rank: no collective started
        logger.warning(f"hf_muon_state/ NOT written to {output_dir} ({error}): this checkpoint resumes only under "
                       "the layout that wrote it")


def load_with_trainer(trainer: Any, checkpoint: str) -> bool:
    """Load ``hf_muon_state/`` for a resuming Trainer; ``False`` if the checkpoint has none."""
    muon = muon_of(trainer.optimizer)
    if muon is None or not has_portable_state(checkpoint):
        return False
    meta = load_portable(muon, trainer.model, checkpoint, scheduler=trainer.lr_scheduler,
                         allow_fresh_state=_allow_fresh(trainer), noise_scale=estimator_for_checkpoint(trainer))
    was, now = meta.get("written_under", {}), describe_layout(trainer)
    logger.info(f"resumed optimizer state from {checkpoint}: written under {was.get('backend', '?')} at "
                f"{was.get('world_size', '?')} ranks, loaded under {now['backend']} at {now['world_size']}")
    return True


def warn_frozen_not_loaded(model: Any, checkpoint: str) -> None:
    """The backend's weight files are not read on this resume; hf_muon_state/ holds the trained weights
    and the buffers, not frozen parameters (a frozen base would make every checkpoint its size): say so."""
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        more = " ..." if len(frozen) > 1 else ""
        logger.warning(f"resuming from {checkpoint}: {len(frozen)} frozen parameters ({frozen[0]}{more}) are not "
                       "loaded from it (hf_muon_state/ holds the trained ones, and under this layout the checkpoint's "
                       "own weight files are not read): they keep the values this run built, e.g. the pretrained "
                       "weights the script loads")


def on_trainer(trainer_module: Any) -> None:
    """Wrap the Trainer's checkpoint save and resume (idempotent)."""
    trainer_cls = internal(trainer_module, "Trainer", LIBRARY)

    def wrap_save(original):
        def _save_optimizer_and_scheduler(self: Any, output_dir: str) -> None:
            original(self, output_dir)
            save_with_trainer(self, output_dir)

        return _save_optimizer_and_scheduler

    def wrap_load_weights(original):
        def _load_from_checkpoint(self: Any, resume_from_checkpoint: str, model: Any = None) -> None:
            if _muon_requested(self) and has_portable_state(resume_from_checkpoint) and (
                    self.is_fsdp_enabled or not any(os.path.exists(os.path.join(resume_from_checkpoint, f))
                                                    for f in _WEIGHTS_FILES)):
                warn_frozen_not_loaded(model if model is not None else self.model, resume_from_checkpoint)
                return  # the trained weights come from hf_muon_state/ once the optimizer exists
            original(self, resume_from_checkpoint, model)

        return _load_from_checkpoint

    def wrap_load_optimizer(original):
        def _load_optimizer_and_scheduler(self: Any, checkpoint: str | None) -> None:
            if checkpoint is None or muon_of(self.optimizer) is None:
                return original(self, checkpoint)
            if load_with_trainer(self, checkpoint):
                return None
            original(self, checkpoint)
            if not has_state(muon_of(self.optimizer)) and self.state.global_step > 0:
                refuse_without_state(self, checkpoint)
            return None

        return _load_optimizer_and_scheduler

    def wrap_deepspeed_load(original):
        def deepspeed_load_checkpoint(engine: Any, checkpoint_path: str, *args: Any, **kwargs: Any) -> Any:
            if muon_of(getattr(engine, "optimizer", None)) is not None and has_portable_state(checkpoint_path):
                warn_frozen_not_loaded(engine.module, checkpoint_path)
                return None  # loaded by hf_muon under this layout (see _load_optimizer_and_scheduler)
            try:
                return original(engine, checkpoint_path, *args, **kwargs)
            except (ValueError, AssertionError, RuntimeError, KeyError) as error:
                if muon_of(getattr(engine, "optimizer", None)) is None:
                    raise
                raise CheckpointError(
                    f"DeepSpeed cannot resume {checkpoint_path} (written under {native_layout(checkpoint_path)}) "
                    f"under this layout: {type(error).__name__}: {error}. It has no hf_muon_state/; convert it once: "
                    f"hf-muon convert-checkpoint {checkpoint_path} {checkpoint_path.rstrip(os.sep)}-portable") from error

        return deepspeed_load_checkpoint

    wrap_once(trainer_cls, "_save_optimizer_and_scheduler", wrap_save, LIBRARY)
    wrap_once(trainer_cls, "_load_from_checkpoint", wrap_load_weights, LIBRARY)
    wrap_once(trainer_cls, "_load_optimizer_and_scheduler", wrap_load_optimizer, LIBRARY)
    wrap_once(trainer_module, "deepspeed_load_checkpoint", wrap_deepspeed_load, LIBRARY)
