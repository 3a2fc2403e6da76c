"""Layout-neutral optimizer checkpoints: written under any layout, loaded under any other.

A checkpoint folder gets ``hf_muon_state/`` beside whatever the backend wrote::

    meta.json            format, version, the layout it was written under, every parameter's name,
                         shape and algorithm, the param groups' learning rates, skipped steps
    tensors.safetensors  per parameter, flat fp32 and whole: ``param/NAME`` (the master weights
                         the optimizer updates), ``momentum_buffer/NAME`` (Muon),
                         ``exp_avg/NAME`` and ``exp_avg_sq/NAME`` (AdamW); ``buffer/NAME``, whole in
                         its own dtype, for each persistent buffer of the model (a resume under FSDP
                         or DeepSpeed does not read the backend's weight files)
    scheduler.pt         the learning-rate scheduler's state, when one was given

Saving gathers each tensor's pieces on rank 0 through the same code the exchange uses
(``distributed.exchange.gather_on_owners``), bucket by bucket. Loading reads, on each rank, only the
slice of each tensor that rank holds (safetensors slices), whatever the layout: whole tensors (one
process, DDP), FSDP2 row shards, or DeepSpeed ZeRO partitions (filled when ``step()`` first shows
them). AdamW's step counts are per parameter; ZeRO's per-partition counts map onto them.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..distributed import providers
from ..distributed.exchange import gather_on_owners
from ..distributed.sharding import is_dtensor, local
from ..optimizer.param_split import split_change_hint
from ..optimizer.shards import PendingState, Shard, fill_whole_state, shards_of

DIRNAME = "hf_muon_state"
FORMAT = "hf_muon portable optimizer state"
VERSION = 1
_META, _TENSORS, _SCHEDULER = "meta.json", "tensors.safetensors", "scheduler.pt"
_BUFFER = "buffer"  # the model's persistent buffers: KIND/NAME entries beside "param" and the state keys
_GROUP_KEYS = ("lr", "initial_lr")  # what the schedule moved; other settings come from the resuming run


logger = logging.getLogger("hf_muon")


class CheckpointError(ValueError):
    """A checkpoint cannot give this run its optimizer state; the message says what to do."""


def portable_dir(checkpoint: str) -> str:
    return os.path.join(checkpoint, DIRNAME)


def has_portable_state(checkpoint: str) -> bool:
    return os.path.isfile(os.path.join(portable_dir(checkpoint), _META))


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` (a tied parameter keeps its first name, as ``named_parameters`` gives)."""
    return {id(p): n for n, p in model.named_parameters()}


def persistent_buffers(model: nn.Module) -> list[tuple[str, Tensor]]:
    """The model's buffers its ``state_dict`` carries (running statistics, counters), by name, sorted.
    A resume under FSDP or DeepSpeed does not read the checkpoint's weight files, so these travel here."""
    found: dict[str, Tensor] = {}
    for prefix, module in model.named_modules():
        for key, buffer in module._buffers.items():
            if buffer is not None and key not in module._non_persistent_buffers_set:
                found.setdefault(f"{prefix}.{key}" if prefix else key, buffer)
    return sorted(found.items())


def _whole(t: Tensor) -> Tensor:
    """``t`` whole on this rank, in its dtype (a ``DTensor`` is gathered: every rank calls, in the same order)."""
    return (t.full_tensor() if is_dtensor(t) else t).detach().to("cpu").clone()


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ------------------------------------------------------------------------------------------------ save


def _entries(shards: list[Shard]) -> list[tuple[str, str, Tensor, Shard]]:
    """``(kind, name, piece, shard)`` for every tensor to write, in the same order on every rank."""
    entries = []
    for s in shards:
        entries.append(("param", s.name, s.param, s))
        entries += [(kind, s.name, s.state[kind], s) for kind in sorted(s.state)]
    return entries


def _gather(entries: list[tuple[str, str, Tensor, Shard]], bucket_bytes: int) -> dict[str, Tensor]:
    """Whole flat fp32 CPU tensors on global rank 0 (empty elsewhere), one gather per process group."""
    out: dict[str, Tensor] = {}
    by_group: dict[int, list] = {}
    for entry in entries:
        by_group.setdefault(id(entry[3].group), []).append(entry)
    for group_entries in by_group.values():
        first = group_entries[0][3]
        if first.world > 1 and dist.get_global_rank(first.group or dist.group.WORLD, 0) != 0:
            raise NotImplementedError("hf_muon: saving optimizer state whose process group does not contain rank 0")
        pieces = [piece.float() for _, _, piece, _ in group_entries]
        layouts = [s.layout for _, _, _, s in group_entries]
        if first.world == 1:
            found = ((i, piece) for i, piece in enumerate(pieces))
        else:
            found = gather_on_owners(pieces, layouts, [0] * len(pieces), group=first.group, rank=first.rank,
                                     world=first.world, bucket_bytes=bucket_bytes)
        for i, whole in found:
            kind, name, _, _ = group_entries[i]
            out[f"{kind}/{name}"] = whole.reshape(-1).detach().to("cpu", torch.float32).clone()
    return out


def _steps(shards: list[Shard]) -> dict[str, float]:
    """AdamW step counts by parameter. A rank may hold no piece of a parameter (ZeRO-1/2), so the
    ranks' counts are combined (max; -1 stands for "none here")."""
    values = torch.tensor([-1.0 if s.step is None else s.step for s in shards], dtype=torch.float64)
    groups = {id(s.group): s for s in shards if s.world > 1}
    for s in groups.values():
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=s.group)
    return {s.name: float(v) for s, v in zip(shards, values.tolist()) if v >= 0}


def _group_names(optimizer, group: dict, names: dict[int, str]) -> list[str]:
    return sorted(names[id(p)] for p in optimizer.model_tensors(group) if id(p) in names)


def save_portable(optimizer, model: nn.Module, checkpoint: str, *, scheduler: Any = None,
                  written_under: dict | None = None, bucket_bytes: int = 64 * 2**20, noise_scale: Any = None) -> None:
    """Write ``checkpoint/hf_muon_state/``. Called on every rank (it gathers); rank 0 writes.

    Args:
        optimizer: the :class:`hf_muon.Muon` (unwrapped).
        model: the model its parameters belong to (for names).
        scheduler: a learning-rate scheduler whose ``state_dict()`` is saved too.
        written_under: what to record about the layout (shown when a resume refuses).
        noise_scale: a :class:`hf_muon.optimizer.noise_scale.GradientNoiseScale` whose state (plain
            numbers, the same on every rank) goes into ``meta.json`` as ``gradient_noise_scale``.
    """
    names = parameter_names(model)
    shards = shards_of(optimizer, names)
    tensors = _gather(_entries(shards), bucket_bytes)
    buffers = {name: _whole(b) for name, b in persistent_buffers(model)}
    steps = _steps(shards)
    rank, world = _world()
    if rank != 0:
        return
    tensors.update({f"{_BUFFER}/{name}": b for name, b in buffers.items()})
    meta = make_meta(
        {s.name: {"shape": list(s.layout.shape), "algorithm": s.algorithm, "state": sorted(s.state),
                  "step": steps.get(s.name)} for s in shards},
        [{"algorithm": g["algorithm"], "params": _group_names(optimizer, g, names),
          **{k: g[k] for k in _GROUP_KEYS if k in g}} for g in optimizer.param_groups],
        optimizer.skipped_steps, {"world_size": world, **(written_under or {})})
    meta["buffers"] = {name: list(b.shape) for name, b in buffers.items()}
    if noise_scale is not None:
        meta["gradient_noise_scale"] = noise_scale.state_dict()
    write_portable(checkpoint, tensors, meta, None if scheduler is None else scheduler.state_dict())


def write_portable(checkpoint: str, tensors: dict[str, Tensor], meta: dict, scheduler_state: dict | None) -> None:
    """Write ``checkpoint/hf_muon_state/`` from whole flat fp32 tensors (``KIND/NAME``) and their meta."""
    from safetensors.torch import save_file

    folder = portable_dir(checkpoint)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, _TENSORS))
    if scheduler_state is not None:
        torch.save(scheduler_state, os.path.join(folder, _SCHEDULER))
    with open(os.path.join(folder, _META + ".tmp"), "w") as f:  # meta last: its presence means complete
        json.dump(meta, f, indent=1)
    os.replace(os.path.join(folder, _META + ".tmp"), os.path.join(folder, _META))


def make_meta(params: dict[str, dict], groups: list[dict], skipped_steps: int, written_under: dict) -> dict:
    """The ``meta.json`` of a portable state: ``params`` maps each name to its ``shape``, ``algorithm``,
    ``state`` (keys saved) and ``step`` (AdamW's count, or ``None``)."""
    return {"format": FORMAT, "version": VERSION, "written_under": written_under, "params": params,
            "groups": groups, "skipped_steps": skipped_steps}


# ------------------------------------------------------------------------------------------------ load


def read_meta(checkpoint: str) -> dict:
    path = os.path.join(portable_dir(checkpoint), _META)
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{checkpoint} has no hf_muon optimizer state ({DIRNAME}/{_META} is missing)") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path} is damaged ({error}); resume from an earlier checkpoint") from None
    if meta.get("format") != FORMAT or not isinstance(meta.get("version"), int):
        raise CheckpointError(f"{path} is not an hf_muon optimizer state file")
    if meta["version"] > VERSION:
        raise CheckpointError(f"{path} was written by a newer hf_muon (format {meta['version']}, this one reads "
                              f"{VERSION}): upgrade hf_muon")
    return meta


def expected_params(optimizer, names: dict[int, str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``name -> (algorithm, shape)`` of every parameter this optimizer updates."""
    from ..distributed.providers import shape_of

    found = {}
    for group in optimizer.param_groups:
        for p in optimizer.model_tensors(group):
            if id(p) not in names:
                raise CheckpointError(f"hf_muon: an optimizer tensor of shape {tuple(shape_of(p))} is not a parameter "
                                      "of the model being trained")
            found[names[id(p)]] = (group["algorithm"], tuple(shape_of(p)))
    return found


def compare(meta: dict, expected: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[list[str], list[str]]:
    """``(model problems, split problems)``: parameters missing, extra or reshaped (the weights cannot
    be restored), and parameters whose Muon/AdamW assignment changed (only the state cannot)."""
    saved = {n: (e["algorithm"], tuple(e["shape"])) for n, e in meta["params"].items()}
    model, split = [], []
    missing, extra = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if missing:
        model.append(f"not in the checkpoint: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if extra:
        model.append(f"in the checkpoint but not trained now: {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
    for name in sorted(set(saved) & set(expected)):
        (alg_s, shape_s), (alg_e, shape_e) = saved[name], expected[name]
        if shape_s != shape_e:
            model.append(f"{name}: shape {list(shape_s)} in the checkpoint, {list(shape_e)} now")
        elif alg_s != alg_e:
            split.append(f"{name}: {alg_s} in the checkpoint, {alg_e} now (force_muon/force_adamw or the model changed"
                         f"{split_change_hint([name])})")
    return model, split


def _mismatch(checkpoint: str, problems: list[str], fresh_possible: bool) -> CheckpointError:
    return CheckpointError(
        f"{checkpoint} holds optimizer state of a different model or parameter split:\n  " + "\n  ".join(problems[:12])
        + "\nResume with the model and --optim_args it was written with, or start a new run"
        + (" (--optim_args allow_fresh_state=true resumes the weights with fresh optimizer state)." if fresh_possible
           else "; these weights cannot be loaded into this model."))


def _reader(checkpoint: str, meta: dict):
    from safetensors import safe_open

    path = os.path.join(portable_dir(checkpoint), _TENSORS)
    try:
        handle = safe_open(path, "pt", device="cpu")
    except Exception as error:  # noqa: BLE001 (safetensors raises its own types)
        raise CheckpointError(f"{path} cannot be read ({error}); resume from an earlier checkpoint") from None
    keys = set(handle.keys())
    absent = [f"{kind}/{n}" for n, e in meta["params"].items() for kind in ["param", *e["state"]]
              if f"{kind}/{n}" not in keys] + [f"{_BUFFER}/{n}" for n in meta.get("buffers", {})
                                               if f"{_BUFFER}/{n}" not in keys]
    if absent:
        raise CheckpointError(f"{path} is partial: {len(absent)} tensors missing ({', '.join(absent[:4])} ...); "
                              "resume from an earlier checkpoint")

    def read(name: str, kind: str, start: int, end: int) -> Tensor:
        if kind == _BUFFER:  # whole, in the dtype it was saved in
            return handle.get_tensor(f"{kind}/{name}")
        if kind != "param" and kind not in meta["params"][name]["state"]:
            raise CheckpointError(f"{path} has no {kind} for {name} (saved before its first update?)")
        return handle.get_slice(f"{kind}/{name}")[start:end]

    return read


def _load_parameters(optimizer, read, names: dict[int, str], meta: dict) -> None:
    """Set the weights the optimizer updates (and, under ZeRO, the model's copy) from the checkpoint."""
    from ..distributed.sharding import is_dtensor, layouts_of, process_group_of

    for group in optimizer.param_groups:
        params = list(group["params"])
        if optimizer._held_by_backend(group):
            for p in sorted(optimizer.model_tensors(group), key=lambda t: names[id(t)]):  # same order: collectives
                name = names[id(p)]
                whole = read(name, "param", 0, int(torch.Size(meta["params"][name]["shape"]).numel()))
                if not providers.load_parameter(p, whole):
                    raise CheckpointError(f"hf_muon: no layout provider can load parameter {name}")
            continue
        where = process_group_of(params, optimizer.process_group if not is_dtensor(params[0]) else None)
        rank, world = (where[1], where[2]) if where is not None else (0, 1)
        for p, layout in zip(params, layouts_of(params, group.get("stacked", False), world)):
            start, end = layout.ranges[rank]
            target = local(p).data
            target.view(-1).copy_(read(names[id(p)], "param", start, end).to(target.dtype))


def _load_buffers(model: nn.Module, read, meta: dict, checkpoint: str) -> None:
    """Set the model's persistent buffers from the checkpoint (written before they travelled: say so)."""
    from ..distributed.sharding import layouts_of, process_group_of

    saved = meta.get("buffers")
    buffers = persistent_buffers(model)
    if saved is None:
        if buffers:
            logger.warning(f"{checkpoint} was written without the model's buffers ({buffers[0][0]} ...): they keep the "
                           "values this run built unless the checkpoint's own weight files were loaded")
        return
    missing = sorted(set(saved) - {name for name, _ in buffers})
    if missing:
        raise CheckpointError(f"{checkpoint} holds buffers this model does not have ({', '.join(missing[:4])}): "
                              "it was written by another model")
    for name, buffer in buffers:
        if name not in saved:
            continue
        whole = read(name, _BUFFER, 0, 0).to(buffer.dtype)
        if is_dtensor(buffer):
            _, rank, world = process_group_of([buffer])
            start, end = layouts_of([buffer], False, world)[0].ranges[rank]
            local(buffer).view(-1).copy_(whole.view(-1)[start:end])
        else:
            buffer.copy_(whole.view(buffer.shape))


def load_portable(optimizer, model: nn.Module, checkpoint: str, *, scheduler: Any = None,
                  allow_fresh_state: bool = False, noise_scale: Any = None) -> dict:
    """Load ``checkpoint/hf_muon_state/`` into ``optimizer`` (and the weights it updates) under the
    current layout, whatever layout wrote it. Called on every rank. Returns the checkpoint's meta.

    Raises :class:`CheckpointError` for a checkpoint of another model or parameter split, a damaged
    or partial one, or one from a newer hf_muon. With ``allow_fresh_state``, a checkpoint whose
    only difference is the Muon/AdamW split gives its weights and scheduler, the optimizer starts
    fresh, and a warning says so. ``noise_scale`` (a ``GradientNoiseScale``) gets the saved estimate;
    from a checkpoint without one it starts measuring afresh, and a warning says so.
    """
    meta = read_meta(checkpoint)
    names = parameter_names(model)
    model_problems, split_problems = compare(meta, expected_params(optimizer, names))
    if model_problems or (split_problems and not allow_fresh_state):
        raise _mismatch(checkpoint, model_problems + split_problems, not model_problems)
    fresh = bool(split_problems)
    saved_groups = {(g["algorithm"], tuple(g["params"])): g for g in meta["groups"]}
    group_keys = [(g["algorithm"], tuple(_group_names(optimizer, g, names))) for g in optimizer.param_groups]
    unmatched = [k for k in group_keys if k not in saved_groups]
    if unmatched and not fresh:
        raise CheckpointError(f"{checkpoint}: no saved param group matches the current {unmatched[0][0]} group of "
                              f"{len(unmatched[0][1])} parameters (the weight-decay split changed)")
    read = _reader(checkpoint, meta)
    with torch.no_grad():
        _load_parameters(optimizer, read, names, meta)
        _load_buffers(model, read, meta, checkpoint)
    if fresh:
        logger.warning(f"allow_fresh_state=true: CONTINUING WITH FRESH OPTIMIZER STATE: {checkpoint} was written with "
                       f"another parameter split ({split_problems[0]}{' ...' if len(split_problems) > 1 else ''}); "
                       "its weights and schedule were loaded, Muon's momentum and AdamW's moments start from zero")
    else:
        steps = {n: e["step"] for n, e in meta["params"].items() if e.get("step") is not None}
        stateful = {n for n, e in meta["params"].items() if e["state"]}
        with torch.no_grad():
            fill_whole_state(optimizer, read, names, steps, stateful)
        optimizer._pending_state = PendingState(read, names, steps, stateful)
        optimizer.skipped_steps = int(meta.get("skipped_steps", 0))
        for group, key in zip(optimizer.param_groups, group_keys):
            group.update({k: v for k, v in saved_groups[key].items() if k in _GROUP_KEYS})
    if noise_scale is not None:
        if "gradient_noise_scale" in meta:
            noise_scale.load_state_dict(meta["gradient_noise_scale"])
        else:
            logger.warning(f"{checkpoint} has no gradient noise scale state (written without adaptive_lr): the "
                           "estimate starts afresh, with the lr multiplier at 1 for its warm-up steps")
    scheduler_path = os.path.join(portable_dir(checkpoint), _SCHEDULER)
    if scheduler is not None and os.path.isfile(scheduler_path):
        scheduler.load_state_dict(torch.load(scheduler_path, weights_only=True))
        if fresh and len(scheduler.get_last_lr()) == len(optimizer.param_groups):
            for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr
    return meta


def has_state(optimizer) -> bool:
    """Whether the optimizer holds any state (or state waiting for a backend's partitions)."""
    return bool(optimizer.state) or optimizer._pending_state is not None
