"""``hf-muon convert-checkpoint CKPT OUT``: give a checkpoint without ``hf_muon_state/`` one.

Checkpoints written by an hf_muon that predates portable state hold the optimizer only in the
writing backend's format, which no other layout reads. This reads that format offline, in one
process, and writes ``OUT`` = ``CKPT`` plus ``hf_muon_state/``, which every layout resumes from:

* one process / DDP: ``optimizer.pt`` (groups name their parameters) + ``model.safetensors``;
* FSDP: the ``optimizer_0/`` and ``pytorch_model_fsdp_0/`` distributed checkpoints (torch's
  ``dcp_to_torch_save``);
* DeepSpeed ZeRO-1/2/3: ``global_stepN/``; DeepSpeed's own ``zero_to_fp32`` reassembles the fp32
  weights, and the same reassembly is applied to each optimizer state tensor, which ZeRO keeps in
  the same flat layout as the weights.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import io
import os
import re
import shutil
import tempfile
from typing import Any

import torch
from torch import Tensor

from ..integrations.compat import internal
from ..optimizer.shards import STATE_KEYS
from .portable import CheckpointError, has_portable_state, make_meta, write_portable


def _group_names(group: dict, where: str) -> list[str]:
    if "algorithm" not in group or "param_names" not in group:
        raise CheckpointError(f"{where}: the optimizer's param groups do not say their algorithm and parameter names: "
                              "this is not a state written by hf_muon.Muon with named parameters")
    return list(group["param_names"])


def _collect(groups: list[dict], state_of, param_of, steps_of, where: str):
    """``(tensors, params meta, groups meta)`` from per-name accessors."""
    tensors: dict[str, Tensor] = {}
    params: dict[str, dict] = {}
    for group in groups:
        for name in _group_names(group, where):
            state = state_of(name)
            keys = [k for k in STATE_KEYS[group["algorithm"]] if state.get(k) is not None]
            weight = param_of(name)
            tensors[f"param/{name}"] = weight.detach().to(torch.float32).reshape(-1).contiguous()
            for key in keys:
                tensors[f"{key}/{name}"] = state[key].detach().to(torch.float32).reshape(-1).contiguous()
            params[name] = {"shape": list(weight.shape), "algorithm": group["algorithm"], "state": keys,
                            "step": steps_of(name, state)}
    saved_groups = [{"algorithm": g["algorithm"], "params": sorted(g["param_names"]),
                     **{k: g[k] for k in ("lr", "initial_lr") if k in g}} for g in groups]
    return tensors, params, saved_groups


def _adamw_step(_: str, state: dict) -> float | None:
    step = state.get("step")
    return None if step is None else float(step)


def _weights(checkpoint: str) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    single = os.path.join(checkpoint, "model.safetensors")
    if os.path.isfile(single):
        return load_file(single)
    shards = sorted(glob.glob(os.path.join(checkpoint, "model-*-of-*.safetensors")))
    if shards:
        return {k: v for f in shards for k, v in load_file(f).items()}
    binary = os.path.join(checkpoint, "pytorch_model.bin")
    if os.path.isfile(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise CheckpointError(f"{checkpoint} has optimizer.pt but no model weights (model.safetensors) to go with it")


def _model_weights(checkpoint: str) -> dict[str, Tensor]:
    """The parameters as the model's own ``named_parameters()`` names and shapes them, loaded through
    transformers: transformers 5 saves some in another form than it trains them (stacked MoE experts
    one tensor per expert, renamed routers) and converts them back when it loads."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    architecture = (getattr(config, "architectures", None) or [None])[0]
    model_class = getattr(transformers, architecture, None) if architecture else None
    if model_class is None:
        raise CheckpointError(f"{checkpoint}: its weights are not saved under the names the optimizer state uses, and "
                              f"its config.json names no transformers model class to load them with "
                              f"(architectures: {getattr(config, 'architectures', None)})")
    try:
        model, info = model_class.from_pretrained(checkpoint, local_files_only=True, output_loading_info=True)
    except RuntimeError as error:  # transformers refuses a weight of another shape ("ignore_mismatched_sizes")
        raise CheckpointError(f"{checkpoint}: its weights do not load into {architecture}: {error}") from None
    # a weight missing from the files would be initialized at random: refuse rather than write it
    missing = list(info.get("missing_keys", ())) + [str(k) for k in info.get("mismatched_keys", ())]
    if missing:
        raise CheckpointError(f"{checkpoint}: the model's weights are incomplete ({', '.join(missing[:3])}"
                              f"{' ...' if len(missing) > 3 else ''} missing or of another shape)")
    return {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False)}


def _weights_by_name(checkpoint: str, weights: dict[str, Tensor], names: list[str]) -> dict[str, Tensor]:
    """``weights`` (as saved), or the model's own where the saved names are not the optimizer's."""
    missing = [name for name in names if name not in weights]
    if not missing:
        return weights
    if os.path.isfile(os.path.join(checkpoint, "config.json")):
        loaded = _model_weights(checkpoint)
        if all(name in loaded for name in names):
            return loaded
    listed = ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
    raise CheckpointError(f"the checkpoint's weights have no {listed} (saved under other names, and no transformers "
                          "model in config.json maps them)")


def from_optimizer_pt(checkpoint: str):
    state_dict = torch.load(os.path.join(checkpoint, "optimizer.pt"), map_location="cpu", weights_only=True)
    by_name: dict[str, dict] = {}
    for group in state_dict["param_groups"]:
        for index, name in zip(group["params"], _group_names(group, "optimizer.pt")):
            by_name[name] = state_dict["state"].get(index, {})
    weights = _weights_by_name(checkpoint, _weights(checkpoint), list(by_name))
    return _collect(state_dict["param_groups"], lambda n: by_name[n], weights.__getitem__, _adamw_step,
                    "optimizer.pt"), "one process or DDP"


def from_fsdp(checkpoint: str):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(os.path.join(checkpoint, "optimizer_0"), os.path.join(tmp, "optimizer.pt"))
        optimizer = torch.load(os.path.join(tmp, "optimizer.pt"), map_location="cpu", weights_only=False)["optimizer"]
        model_dir = os.path.join(checkpoint, "pytorch_model_fsdp_0")
        if os.path.isdir(model_dir):
            dcp_to_torch_save(model_dir, os.path.join(tmp, "model.pt"))
            weights = torch.load(os.path.join(tmp, "model.pt"), map_location="cpu", weights_only=False)["model"]
        else:
            weights = _weights(checkpoint)
    names = [name for group in optimizer["param_groups"] for name in _group_names(group, "optimizer_0")]
    weights = _weights_by_name(checkpoint, weights, names)
    return _collect(optimizer["param_groups"], lambda n: optimizer["state"].get(n, {}), weights.__getitem__,
                    _adamw_step, "optimizer_0"), "FSDP"


def _zero_to_fp32() -> Any:
    return importlib.import_module("deepspeed.utils.zero_to_fp32")


def deepspeed_tag_dir(checkpoint: str) -> str | None:
    """The DeepSpeed tag folder a resume loads: the one ``latest`` names, else the highest
    ``global_stepN`` by N (a string sort puts ``global_step4`` after ``global_step10``); ``None`` if none."""
    tag_file = os.path.join(checkpoint, "latest")
    if os.path.isfile(tag_file):
        with open(tag_file) as f:
            return os.path.join(checkpoint, f.read().strip())
    steps = [(int(m.group(1)), path) for path in glob.glob(os.path.join(checkpoint, "global_step*"))
             if (m := re.fullmatch(r"global_step(\d+)", os.path.basename(path))) and os.path.isdir(path)]
    return max(steps)[1] if steps else None


def from_deepspeed(checkpoint: str):
    zero = _zero_to_fp32()
    step_dir = deepspeed_tag_dir(checkpoint)
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's helpers print progress
        model_states = internal(zero, "parse_model_states", "deepspeed")(
            internal(zero, "get_model_state_files", "deepspeed")(step_dir))
        files = internal(zero, "get_optim_files", "deepspeed")(step_dir)
    ranks = [torch.load(f, map_location="cpu", mmap=True, weights_only=False)["optimizer_state_dict"] for f in files]
    stage = int(ranks[0]["zero_stage"])
    world = max(ranks[0]["partition_count"]) if isinstance(ranks[0]["partition_count"], list) else \
        ranks[0]["partition_count"]
    if world != len(ranks):
        raise CheckpointError(f"{step_dir}: {len(ranks)} optimizer files for a world of {world}: the checkpoint is incomplete")
    flats_key, base_key = ("single_partition_of_fp32_groups", "base_optimizer_state") if stage <= 2 else \
        ("fp32_flat_groups", "optimizer_state_dict")
    base = ranks[0][base_key]
    groups = base["param_groups"]
    names_of = {n: g for g in groups for n in _group_names(g, f"{step_dir} (ZeRO-{stage})")}

    def merged(per_rank_flats: list[list[Tensor]]) -> dict[str, Tensor]:
        out: dict[str, Any] = {}
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            if stage <= 2:
                internal(zero, "_zero2_merge_trainable_params", "deepspeed")(
                    out, world, per_rank_flats, model_states, ranks[0].get("param_alignment_paddings"))
            else:
                internal(zero, "_zero3_merge_trainable_params", "deepspeed")(out, world, per_rank_flats, model_states)
        return {n: (t.contiguous() if not isinstance(t, Tensor) else t) for n, t in out.items()}

    weights = merged([list(r[flats_key]) for r in ranks])
    # optimizer state tensors are shaped like the flat fp32 partitions they belong to, in the same order
    per_key: dict[str, dict[str, Tensor]] = {}
    for key in sorted({k for keys in STATE_KEYS.values() for k in keys}):
        flats = []
        for r in ranks:
            state = r[base_key]["state"]
            flats.append([state.get(i, {}).get(key, torch.zeros_like(flat)) for i, flat in enumerate(r[flats_key])])
        per_key[key] = merged(flats)
    steps = [float(s["step"]) for s in base["state"].values() if "step" in s]
    adamw_step = max(steps) if steps else None  # every ZeRO partition steps together

    def state_of(name: str) -> dict:
        return {key: found[name] for key, found in per_key.items() if name in found}

    def step_of(name: str, _: dict) -> float | None:
        return adamw_step if names_of[name]["algorithm"] != "muon" else None

    return _collect(groups, state_of, lambda n: weights[n], step_of, f"{step_dir} (ZeRO-{stage})"), \
        f"DeepSpeed ZeRO-{stage}"


def detect(checkpoint: str):
    """The reader for the backend files in ``checkpoint``."""
    if glob.glob(os.path.join(checkpoint, "global_step*")):
        return from_deepspeed
    if os.path.isdir(os.path.join(checkpoint, "optimizer_0")):
        return from_fsdp
    if os.path.isfile(os.path.join(checkpoint, "optimizer.pt")):
        return from_optimizer_pt
    raise CheckpointError(f"{checkpoint} holds no optimizer state hf_muon can read (no global_step*/, optimizer_0/ or "
                          "optimizer.pt): it cannot be converted; resume with --optim_args allow_fresh_state=true")


def _scheduler_state(checkpoint: str) -> dict | None:
    path = os.path.join(checkpoint, "scheduler.pt")
    if os.path.isfile(path):
        return torch.load(path, map_location="cpu", weights_only=True)
    tag_dir = deepspeed_tag_dir(checkpoint)
    for f in glob.glob(os.path.join(tag_dir, "*model_states.pt"))[:1] if tag_dir else []:
        return torch.load(f, map_location="cpu", weights_only=False).get("lr_scheduler")
    return None


def convert_checkpoint(checkpoint: str, output: str) -> str:
    """Write ``output``: a copy of ``checkpoint`` with ``hf_muon_state/`` added (``output`` may be
    ``checkpoint`` itself). Returns a one-line summary."""
    checkpoint, output = os.path.abspath(checkpoint), os.path.abspath(output)
    if not os.path.isdir(checkpoint):
        raise CheckpointError(f"{checkpoint} is not a checkpoint folder")
    if has_portable_state(checkpoint):
        raise CheckpointError(f"{checkpoint} already has hf_muon_state/: every layout resumes from it as it is")
    (tensors, params, groups), backend = detect(checkpoint)(checkpoint)
    if output != checkpoint:
        if os.path.exists(output):
            raise CheckpointError(f"{output} exists; give a new folder")
        shutil.copytree(checkpoint, output)
    written_under = {"backend": backend, "converted_from": checkpoint}
    write_portable(output, tensors, make_meta(params, groups, 0, written_under), _scheduler_state(checkpoint))
    muon = sum(1 for p in params.values() if p["algorithm"] == "muon")
    return (f"{output}: hf_muon_state/ written from {backend} files ({muon} Muon and {len(params) - muon} AdamW "
            "tensors with their state); resume from it under any layout")


def to_deepspeed_universal(checkpoint: str, output: str) -> str:
    """Write ``output``: ``checkpoint`` with a DeepSpeed *universal* checkpoint (``global_stepN_universal/``
    and ``latest_universal``) built from hf_muon's portable state, for DeepSpeed's own loader
    (``"checkpoint": {"load_universal": true}``). DeepSpeed's ``ds_to_universal`` cannot do this: it
    reads only Adam's ``exp_avg``/``exp_avg_sq``, and hf_muon's Muon tensors carry ``momentum_buffer``.
    DeepSpeed's universal loader itself takes any state name, so it loads these. ZeRO-1/2 checkpoints."""
    from safetensors.torch import load_file

    from .portable import portable_dir, read_meta

    checkpoint, output = os.path.abspath(checkpoint), os.path.abspath(output)
    tag_dir = deepspeed_tag_dir(checkpoint)
    model_files = glob.glob(os.path.join(tag_dir, "mp_rank_*_model_states.pt")) if tag_dir else []
    if not model_files:
        raise CheckpointError(f"{checkpoint} is not a DeepSpeed ZeRO-1/2 checkpoint (no global_stepN/mp_rank_*_model_states.pt): "
                              "a universal checkpoint also needs DeepSpeed's engine state from it")
    if output != checkpoint:
        if os.path.exists(output):
            raise CheckpointError(f"{output} exists; give a new folder")
        shutil.copytree(checkpoint, output, ignore=shutil.ignore_patterns("hf_muon_state"))
    source = checkpoint if has_portable_state(checkpoint) else None
    if source is None:  # read DeepSpeed's own files first
        (tensors, params, groups), _ = from_deepspeed(checkpoint)
        meta = make_meta(params, groups, 0, {})
    else:
        meta, tensors = read_meta(source), load_file(os.path.join(portable_dir(source), "tensors.safetensors"))
    tag = os.path.basename(tag_dir) + "_universal"
    zero_dir = os.path.join(output, tag, "zero")
    for name, entry in meta["params"].items():
        folder = os.path.join(zero_dir, name)
        os.makedirs(folder, exist_ok=True)
        for key in ["param", *entry["state"]]:
            whole = tensors[f"{key}/{name}"].view(entry["shape"]).clone()
            torch.save({"param": whole}, os.path.join(folder, ("fp32" if key == "param" else key) + ".pt"))
        if entry.get("step") is not None:
            torch.save(torch.tensor(float(entry["step"])), os.path.join(folder, "step.pt"))
    for f in model_files:  # the engine's own state (module, scheduler, step counters), as ds_to_universal copies it
        shutil.copy2(f, os.path.join(output, tag))
        module = torch.load(f, map_location="cpu", weights_only=False).get("module") or {}
        for name, value in module.items():  # frozen weights and buffers: fp32 from the module state
            path = os.path.join(zero_dir, name, "fp32.pt")
            if not os.path.isfile(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save({"param": value.float()}, path)
    rank0 = torch.load(sorted(glob.glob(os.path.join(tag_dir, "*zero_pp_rank_0_*optim_states.pt")))[0],
                       map_location="cpu", weights_only=False)["optimizer_state_dict"]
    common = {k: v for k, v in rank0.items()
              if k not in ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")}
    common["param_groups"] = rank0["base_optimizer_state"]["param_groups"]
    torch.save(common, os.path.join(zero_dir, "optimizer_state.pt"))
    with open(os.path.join(output, "latest_universal"), "w") as f:
        f.write(tag)
    return f"{output}: DeepSpeed universal checkpoint {tag}/ with hf_muon's state ({len(meta['params'])} tensors)"
