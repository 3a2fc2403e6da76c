"""Which parameters get Muon and which get AdamW, decided from the model's structure.

Muon is for the weights of hidden matrix layers. Embeddings, output heads and everything tied to
them, position embeddings, heads outside the model body, norms, biases and scalars get AdamW. The
decision uses module types and the model's own accessors (``get_input_embeddings``,
``get_output_embeddings``, ``base_model_prefix``, parameter identity for tied weights), never name
patterns; ``force_muon`` / ``force_adamw`` regexes let a user override it.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn

# A parameter's real shape, also where a backend hides it (zero.Init makes ``p.shape`` [0]): the
# registered layout providers know, this layer does not.
from ..distributed.providers import shape_of

MUON, ADAMW = "muon", "adamw"
_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass
class ParameterSplit:
    """The result of :func:`split_parameters`.

    Attributes:
        muon: ``(name, parameter)`` pairs optimized by Muon.
        adamw: ``(name, parameter)`` pairs optimized by AdamW.
        reasons: why each parameter (by name) went where it did.
        stacked: names of Muon parameters whose leading dimension stacks independent matrices
            (MoE expert weights): one Newton–Schulz per expert.
    """

    muon: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    adamw: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    stacked: set[str] = field(default_factory=set)

    def algorithm_of(self) -> dict[int, tuple[str, bool]]:
        """``id(parameter) -> (algorithm, stacked)`` for every parameter in the split."""
        table = {id(p): (MUON, n in self.stacked) for n, p in self.muon}
        table.update({id(p): (ADAMW, False) for _, p in self.adamw})
        return table

    def param_groups(self, no_decay: Iterable[str] = (), weight_decay: float | None = None) -> list[dict]:
        """Named param groups for :class:`hf_muon.Muon`, one per (algorithm, stacked, decays).

        Parameters named in ``no_decay`` get ``weight_decay=0`` (Trainer's biases-and-norms rule);
        the others get ``weight_decay`` when given, else the optimizer's default.
        """
        no_decay = set(no_decay)
        buckets: dict[tuple[str, bool, bool], list[tuple[str, nn.Parameter]]] = {}
        for algorithm, pairs in ((MUON, self.muon), (ADAMW, self.adamw)):
            for name, p in pairs:
                key = (algorithm, name in self.stacked, name not in no_decay)
                buckets.setdefault(key, []).append((name, p))
        groups = []
        for (algorithm, stacked, decays), pairs in buckets.items():
            group = {
                "params": [p for _, p in pairs],
                "param_names": [n for n, _ in pairs],
                "algorithm": algorithm,
                "stacked": stacked,
            }
            if not decays:
                group["weight_decay"] = 0.0
            elif weight_decay is not None:
                group["weight_decay"] = weight_decay
            groups.append(group)
        return groups


def _params_of(module: nn.Module | None) -> set[int]:
    return {id(p) for p in module.parameters()} if isinstance(module, nn.Module) else set()


def _accessor(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return getattr(model, name)() if hasattr(model, name) else None
    except (NotImplementedError, AttributeError):  # base classes raise when a model has none
        return None


def model_body(model: nn.Module) -> tuple[str, nn.Module]:
    """The model body (``model.<base_model_prefix>``) and its name prefix; the model itself if none."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    body = getattr(model, prefix, None) if prefix else None
    if isinstance(body, nn.Module) and body is not model:
        return prefix + ".", body
    return "", model


def _is_hf_conv1d(module: nn.Module) -> bool:
    # transformers' Conv1D (GPT-2) is a Linear with a transposed weight; only look it up if
    # transformers is already loaded, so this module never imports it.
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    return pytorch_utils is not None and isinstance(module, pytorch_utils.Conv1D)


def stored_in_by_out(model: nn.Module) -> set[int]:
    """``id`` of each weight ``model`` stores ``[in, out]`` (transformers' ``Conv1D``; stacked experts
    used as ``x @ W[e]``), not ``[out, in]`` as ``nn.Linear`` does: a rule on its shape
    (``adjust_lr="original"``'s fan-out over fan-in) must read it transposed."""
    from ..models.fused import experts_layout  # not at import: the models layer imports this one's users

    conv1d = {id(module.weight) for module in model.modules() if _is_hf_conv1d(module)}
    experts = {id(t) for module in model.modules() if experts_layout(module) == "columns"
               for t in (module.gate_up_proj, module.down_proj)}  # Llama 4, GPT-OSS: x @ W[e]
    return conv1d | experts


# torch's own attention keeps its input projections as parameters, not Linear layers: q | k | v in
# ``in_proj_weight``, or one each where keys and values have other sizes (see models/fused.py)
MULTIHEAD_ATTENTION_MATRICES = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")


def split_change_hint(names: Iterable[str]) -> str:
    """What to add to a refused checkpoint's message where ``names`` (parameters whose optimizer
    changed, or the Muon parameters now) show a split that an hf_muon upgrade changed."""
    if any(str(n).rsplit(".", 1)[-1] in MULTIHEAD_ATTENTION_MATRICES for n in names):
        return ("; if it was written before hf_muon gave nn.MultiheadAttention's input projections Muon (they "
                "were AdamW), resume it with force_adamw=r'(in|q|k|v)_proj_weight$'")
    return ""


def _classify_in_body(module: nn.Module, local_name: str, p: nn.Parameter) -> tuple[str, str, bool]:
    """(algorithm, reason, stacked) for a parameter that lives in the model body."""
    kind = type(module).__name__
    shape = shape_of(p)
    if len(shape) < 2:
        what = "bias" if local_name == "bias" else ("norm weight" if "Norm" in kind else "vector or scalar")
        return ADAMW, f"{what} ({kind}.{local_name}, {len(shape)}-D)", False
    if isinstance(module, nn.Embedding):
        return ADAMW, f"embedding table ({kind})", False
    if local_name == "weight" and isinstance(module, nn.Linear):
        return MUON, f"hidden matrix ({kind})", False
    if local_name == "weight" and _is_hf_conv1d(module):
        return MUON, "hidden matrix (transformers Conv1D)", False
    if local_name == "weight" and isinstance(module, _CONV_TYPES):
        return MUON, f"hidden convolution ({kind}, viewed as out x in*kernel)", False
    if isinstance(module, nn.MultiheadAttention) and local_name in MULTIHEAD_ATTENTION_MATRICES:
        return MUON, f"hidden matrix ({kind}.{local_name})", False
    num_experts = getattr(module, "num_experts", None)
    if isinstance(num_experts, int) and shape[0] == num_experts:
        if len(shape) == 3:
            return MUON, f"stacked expert matrices ({num_experts} x {shape[1]} x {shape[2]})", True
        if len(shape) == 2 and local_name.endswith("bias"):  # GPT-OSS: gate_up_proj_bias [experts, 2 * I]
            return ADAMW, f"bias of each expert ({kind}.{local_name}, {shape[0]} x {shape[1]})", False
        if len(shape) == 2:
            return MUON, f"MoE router matrix ({kind})", False
    return ADAMW, f"parameter of {kind} that is not a matrix layer's weight", False


def unwrap(model: nn.Module | None) -> nn.Module | None:
    """The model inside a DDP/DataParallel wrapper, a DeepSpeed engine or ``torch.compile`` (nested too):
    a wrapper forwards none of the model's attributes (its config, embeddings, head), so the split would
    take the LM head for a hidden matrix."""
    while model is not None:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) or \
                type(model).__name__ == "DeepSpeedEngine":
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model
    return None


def split_parameters(
    model: nn.Module, force_muon: str | None = None, force_adamw: str | None = None
) -> ParameterSplit:
    """Split ``model``'s parameters between Muon and AdamW, with the reason for each.

    Args:
        model: any ``nn.Module`` (a DDP, DeepSpeed or ``torch.compile`` wrapper is looked through: names are
            the inner model's); Hugging Face models are recognised by their accessors.
        force_muon: regex (``re.search`` on the parameter name) of parameters to give Muon anyway.
            They must be at least 2-D.
        force_adamw: regex of parameters to give AdamW anyway.

    Returns:
        A :class:`ParameterSplit`. Tied parameters appear once, under their first name.
    """
    muon_re = re.compile(force_muon) if force_muon else None
    adamw_re = re.compile(force_adamw) if force_adamw else None
    model = unwrap(model)
    input_embeddings = _params_of(_accessor(model, "get_input_embeddings"))
    output_embeddings = _params_of(_accessor(model, "get_output_embeddings"))
    body_prefix, body = model_body(model)
    in_body = _params_of(body)

    split = ParameterSplit()
    seen: set[int] = set()
    matched = {"force_muon": False, "force_adamw": False}
    for module_name, module in model.named_modules():
        for local_name, p in module.named_parameters(recurse=False):
            name = f"{module_name}.{local_name}" if module_name else local_name
            if id(p) in seen:
                continue  # a tied parameter, already placed under its first name
            seen.add(id(p))
            stacked = False
            if id(p) in input_embeddings:
                algorithm, reason = ADAMW, "input embedding" + (" (tied to the output)" if id(p) in output_embeddings else "")
            elif id(p) in output_embeddings:
                algorithm, reason = ADAMW, "output embedding / LM head"
            elif id(p) not in in_body:
                algorithm, reason = ADAMW, f"head outside the model body ({body_prefix.rstrip('.')})"
            else:
                algorithm, reason, stacked = _classify_in_body(module, local_name, p)
            matched_muon = bool(muon_re and muon_re.search(name))
            matched_adamw = bool(adamw_re and adamw_re.search(name))
            matched["force_muon"] |= matched_muon
            matched["force_adamw"] |= matched_adamw
            if matched_muon and matched_adamw:
                raise ValueError(f"parameter {name!r} matches both force_muon and force_adamw; make the regexes disjoint")
            if matched_muon:
                if len(shape_of(p)) < 2:
                    raise ValueError(
                        f"force_muon matched {name!r} of shape {shape_of(p)}; Muon needs a matrix (>= 2-D): "
                        "narrow the force_muon regex"
                    )
                algorithm, reason = MUON, f"force_muon override (was: {reason})"
            elif matched_adamw:
                algorithm, reason, stacked = ADAMW, f"force_adamw override (was: {reason})", False
            (split.muon if algorithm == MUON else split.adamw).append((name, p))
            split.reasons[name] = reason
            if stacked:
                split.stacked.add(name)
    for key, regex in (("force_muon", force_muon), ("force_adamw", force_adamw)):
        if regex and not matched[key]:  # a typo would otherwise leave the split as it was, silently
            some = ", ".join(list(split.reasons)[:3])
            raise ValueError(f"{key}={regex!r} matches no parameter of {type(model).__name__} (names look like {some}; "
                             "a tied parameter goes by its first name): fix the regex")
    return split


def optimizer_state_bytes(split: ParameterSplit, dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Optimizer-state bytes: Muon keeps one buffer per element, AdamW two."""
    size = torch.empty(0, dtype=dtype).element_size()
    muon = sum(math.prod(shape_of(p)) for _, p in split.muon)
    adamw = sum(math.prod(shape_of(p)) for _, p in split.adamw)
    return {
        "hf_muon": size * (muon + 2 * adamw),
        "all_adamw": size * 2 * (muon + adamw),
        "muon_params": muon,
        "adamw_params": adamw,
    }
