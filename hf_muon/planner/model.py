"""What the planner plans for: the tensors training would give Muon and AdamW, read from a config.

A model is built from its config on the meta device (no memory, seconds even for 47B parameters),
then split by the package's own ``split_parameters`` (the same param groups ``Muon`` gets) and cut
by ``fused_blocks`` (fused projections orthogonalized block by block), so the plan sees exactly
the tensors and blocks a training run would.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

PRESET_DIR = Path(__file__).with_name("configs")


@dataclass(frozen=True)
class PlanTensor:
    """One Muon tensor: its shape, whether its leading dims stack experts, and the ``(rows, cols)`` of
    the blocks it is orthogonalized in (of each expert's matrix, for a stack; ``None``: whole matrices)."""

    name: str
    shape: tuple[int, ...]
    stacked: bool = False
    blocks: tuple[tuple[int, int], ...] | None = None


@dataclass
class ModelTensors:
    """A model as the optimizer sees it: Muon param groups (ZeRO exchanges each on its own, DDP and
    FSDP2 all of them in one; see ``cost._exchanges``) and the AdamW parameters' sizes."""

    name: str
    muon_groups: list[list[PlanTensor]]
    adamw_numels: list[int] = field(default_factory=list)

    @property
    def muon_tensors(self) -> list[PlanTensor]:
        return [t for group in self.muon_groups for t in group]

    @property
    def muon_params(self) -> int:
        return sum(math.prod(t.shape) for t in self.muon_tensors)

    @property
    def adamw_params(self) -> int:
        return sum(self.adamw_numels)


def preset_names() -> list[str]:
    """The model configs shipped with the package (``hf-muon plan NAME``)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_config(model: str):
    """The ``transformers`` config ``model`` names: a shipped preset, a local folder or config.json,
    or a model id already in the local Hugging Face cache (never downloaded)."""
    import transformers

    if model in preset_names():
        return transformers.AutoConfig.from_pretrained(str(PRESET_DIR / f"{model}.json"))
    if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"{model}: a folder without config.json; give a model folder or a config.json file")
    if os.path.exists(model):
        try:
            return transformers.AutoConfig.from_pretrained(model)
        except Exception as error:  # noqa: BLE001 - not JSON, or values the config class refuses
            raise ValueError(f"{model} is not a config transformers can read ({type(error).__name__}: "
                             f"{str(error).strip()[:300]}): fix it") from None
    # a path, not a model id ("org/name" ids have one slash and go to the cache below)
    if model.endswith(".json") or model.startswith((".", os.sep, "~")) or model.count("/") > 1:
        raise ValueError(f"{model}: no such file or folder")
    try:
        return transformers.AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{model!r} is not a shipped preset ({', '.join(preset_names())}), an existing folder or config.json, "
            f"or a model id in the local Hugging Face cache (nothing is downloaded): {error}"
        ) from None


def meta_model(config, where: str = "the config"):
    """The model ``config`` describes, on the meta device: its ``architectures[0]`` class, else the
    causal-LM class of its model type (what training builds; ``AutoModel`` where there is none, which
    has no LM head). ``ValueError`` where transformers lacks the named class or cannot build it."""
    import torch
    import transformers

    architectures = getattr(config, "architectures", None) or []
    if architectures:
        model_cls = getattr(transformers, architectures[0], None)
        if model_cls is None:
            raise ValueError(f"{where} names the class {architectures[0]!r} in 'architectures', which transformers "
                             f"{transformers.__version__} does not have: fix 'architectures' or upgrade transformers")
        build = model_cls._from_config
    elif type(config) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        build = transformers.AutoModelForCausalLM.from_config
    else:
        build = transformers.AutoModel.from_config
    try:
        with torch.device("meta"):
            return build(config)
    except Exception as error:  # noqa: BLE001 - a config the model class refuses (its own asserts)
        raise ValueError(f"transformers cannot build a {type(config).__name__} model from {where}: "
                         f"{type(error).__name__}: {error}") from error


def model_tensors(model, name: str | None = None, ns_split: str = "block") -> ModelTensors:
    """The Muon groups (as ``ParameterSplit.param_groups`` makes them), their blocks and the AdamW
    sizes of an ``nn.Module`` (real or on the meta device)."""
    from ..models.fused import block_shapes, fused_blocks
    from ..optimizer.param_split import MUON, split_parameters

    split = split_parameters(model)
    blocks = {key: cut for key, (_, cut) in fused_blocks(model, ns_split).items()}
    groups, adamw = [], []
    for group in split.param_groups():
        if group["algorithm"] != MUON:
            adamw += [p.numel() for p in group["params"]]
            continue
        tensors = []
        for pname, p in zip(group["param_names"], group["params"]):
            shape = tuple(p.shape)
            tensors.append(PlanTensor(pname, shape, group["stacked"], block_shapes(shape, blocks.get(id(p)))))
        groups.append(tensors)
    return ModelTensors(name or type(model).__name__, groups, adamw)


def load_model_tensors(model: str, ns_split: str = "block") -> ModelTensors:
    """:func:`model_tensors` of the model ``model`` names (see :func:`load_config`), built on the meta device."""
    built = meta_model(load_config(model), model)
    return model_tensors(built, f"{model} ({type(built).__name__})", ns_split)
