"""Turn whatever a user passes as ``params`` into param groups that each name their algorithm."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

from torch import Tensor, nn

from ..distributed import providers
from .param_split import ADAMW, MUON, shape_of, split_parameters, unwrap

ALGORITHMS = (MUON, ADAMW)


class ModelParamGroups(list):
    """Param group dicts that remember the model they split (``.model``): the Trainer hands the groups
    over but replaces them with the model if it finds a ``model`` keyword, so the model travels here."""

    def __init__(self, groups: list[dict], model: nn.Module) -> None:
        super().__init__(groups)
        self.model = model


def module_behind(params: Any) -> nn.Module | None:
    """The module behind ``params`` if it is a module, a live ``model.(named_)parameters()`` generator
    or :class:`ModelParamGroups`.

    ``Muon(model.parameters())`` must behave like ``Muon(model)``: AdamW users pass the generator,
    and without the module embeddings and heads cannot be told from hidden matrices.
    """
    if isinstance(params, nn.Module):
        return unwrap(params)
    if isinstance(params, ModelParamGroups):
        return unwrap(params.model)
    if inspect.isgenerator(params) and params.gi_frame is not None:
        if params.gi_code in (nn.Module.parameters.__code__, nn.Module.named_parameters.__code__):
            owner = params.gi_frame.f_locals.get("self")
            return unwrap(owner) if isinstance(owner, nn.Module) else None
    return None


def _as_group_dicts(params: Any) -> list[dict]:
    """Normalise tensors, (name, tensor) pairs or group dicts into a list of group dicts."""
    if isinstance(params, Tensor):
        raise TypeError("params must be an iterable of tensors, (name, tensor) pairs or dicts, not a single Tensor")
    items = list(params)
    if not items:
        raise ValueError("Muon got an empty parameter list")
    if all(isinstance(item, dict) for item in items):
        groups = []
        for group in items:
            group = dict(group)
            plist = list(group["params"]) if not isinstance(group["params"], Tensor) else [group["params"]]
            if plist and all(isinstance(x, tuple) for x in plist):
                group["param_names"] = [n for n, _ in plist]
                plist = [p for _, p in plist]
            group["params"] = plist
            groups.append(group)
        return groups
    if all(isinstance(item, tuple) and len(item) == 2 for item in items):
        return [{"params": [p for _, p in items], "param_names": [n for n, _ in items]}]
    if all(isinstance(item, Tensor) for item in items):
        return [{"params": items}]
    raise TypeError("params must be a module, or an iterable of tensors, (name, tensor) pairs or dicts")


def build_param_groups(
    params: Any, model: nn.Module | None = None, force_muon: str | None = None, force_adamw: str | None = None
) -> list[dict]:
    """Param groups for :class:`hf_muon.Muon`, each with ``"algorithm"`` set to ``"muon"`` or ``"adamw"``.

    A group that pins ``"algorithm"`` is kept as it is. Any other group is split by
    :func:`split_parameters` on ``model`` (or the module behind ``params``); without a model,
    every tensor of 2 or more dimensions goes to Muon and a warning says how to do better.
    """
    model = model if model is not None else module_behind(params)  # split_parameters unwraps
    if isinstance(params, nn.Module):
        split = split_parameters(params, force_muon, force_adamw)  # it looks through wrappers
        return split.param_groups()
    groups = _as_group_dicts(params)
    table = split_parameters(model, force_muon, force_adamw).algorithm_of() if model is not None else None
    if (force_muon or force_adamw) and model is None:
        raise ValueError("force_muon / force_adamw need the model: pass Muon(model, ...) or Muon(params, model=model)")

    result: list[dict] = []
    guessed = False
    for group in groups:
        providers.check_group(group)  # before splitting: a refused key is reported once, as given
        if "algorithm" in group:
            if group["algorithm"] == MUON and "stacked" not in group:
                read_stacked(group, table, stacklevel=4)  # user -> Muon.__init__ -> here -> read_stacked
            result.append(group)
            continue
        names = group.get("param_names")
        parts: dict[tuple[str, bool], dict] = {}
        for i, p in enumerate(group["params"]):
            if table is not None and id(p) in table:
                algorithm, stacked = table[id(p)]
            else:
                is_matrix = len(shape_of(p)) >= 2
                algorithm, stacked = (MUON if is_matrix else ADAMW), False
                guessed = guessed or is_matrix
            part = parts.setdefault(
                (algorithm, stacked),
                {**group, "params": [], "algorithm": algorithm, "stacked": stacked, **({"param_names": []} if names else {})},
            )
            part["params"].append(p)
            if names:
                part["param_names"].append(names[i])
        for part in parts.values():
            if part["algorithm"] == MUON and not part["stacked"]:  # guessed 3-D tensors: said how they are read
                read_stacked(part, table, stacklevel=4)
        result.extend(parts.values())
    if guessed:
        warnings.warn(
            "hf_muon.Muon got tensors without their model, so every tensor of 2 or more dimensions goes to Muon, "
            "including any embedding or output head among them. Pass the model (Muon(model, ...), "
            "Muon(model.parameters(), ...) or Muon(params, model=model)) to give those AdamW.",
            stacklevel=3,
        )
    return result


def read_stacked(group: dict, table: dict[int, tuple[str, bool]] | None, stacklevel: int = 3) -> None:
    """Set a Muon group's ``"stacked"`` from the model's split (``table``: ``ParameterSplit.algorithm_of()``,
    ``None`` without a model): whether its tensors of 3 or more dimensions are stacks of matrices (MoE
    experts ``[experts, out, in]``, each orthogonalized on its own) or one matrix each (a convolution's
    ``[out, in, kernel...]``). Tensors the model does not know are read as convolutions, with a warning
    saying how to say otherwise; experts beside other such tensors are refused."""
    tensors = [p for p in group["params"] if len(shape_of(p)) >= 3]
    kinds = [table[id(p)][1] if table is not None and table.get(id(p), (None,))[0] == MUON else None for p in tensors]
    if True in kinds and set(kinds) != {True}:
        raise ValueError("a param group pinned to 'muon' holds stacked MoE experts and other tensors of 3 or more "
                         "dimensions: put the experts in a group of their own (it reads them as a stack)")
    group["stacked"] = True in kinds
    unknown = [tuple(shape_of(p)) for p, kind in zip(tensors, kinds) if kind is None]
    if unknown:
        whose = "without their model" if table is None else "that the model does not read as stacked experts"
        warnings.warn(f"hf_muon: {len(unknown)} Muon tensor(s) of 3 or more dimensions {whose} "
                      f"({', '.join(map(str, unknown[:3]))}{', ...' if len(unknown) > 3 else ''}): each is read as one "
                      "matrix, out x (in * the rest), as a convolution's weight. For a stack of matrices (MoE experts "
                      "[experts, out, in]) give their group 'algorithm': 'muon' and 'stacked': True; or pass the model",
                      stacklevel=stacklevel)


def validate_group(group: dict) -> None:
    """Check one group's algorithm and settings; raise ``ValueError`` saying what to change.

    Backend-specific keys and tensor flags are checked by the registered layout providers."""
    algorithm = group.get("algorithm")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"param group 'algorithm' must be one of {ALGORITHMS}, got {algorithm!r}")
    providers.check_group(group)
    for i, p in enumerate(group["params"]):
        ndim = len(shape_of(p))
        if algorithm == MUON and ndim < 2:
            name = group["param_names"][i] if "param_names" in group else f"#{i} of shape {shape_of(p)}"
            raise ValueError(f"Muon needs matrices (>= 2-D); parameter {name} is {ndim}-D: give it 'algorithm': 'adamw'")
        if algorithm == MUON and group.get("stacked") and ndim < 3:
            raise ValueError("a group with 'stacked': True needs tensors of 3 or more dimensions (a stack of matrices)")
