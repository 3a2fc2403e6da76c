"""Fused projections: the logical matrices a model stores in one weight, read from its own code.

GPT-2 keeps q, k and v in one ``Conv1D`` (``c_attn``, column blocks), Phi-3 in ``qkv_proj`` (row
blocks of GQA sizes) and its MLP's gate and up in ``gate_up_proj``, GPT-NeoX, Bloom and Persimmon
interleave them per head, Falcon per head or per key/value group, CodeGen per model-parallel group,
MPT, ModernBERT and ViT-style vision towers (Qwen2-VL's, SAM's, ...) as ``[3, heads, head_dim]``;
transformers 5's stacked MoE experts keep each expert's gate and up in one ``gate_up_proj`` matrix. Newton–Schulz on the fused weight
is not Muon on q, k and v: each block of the update would follow the whole matrix's polar factor.
:func:`fused_blocks` says, for each such weight, which rows or columns make each logical block, from
the attention/MLP module's type and the model's config (as the module's own ``forward`` splits its
output), never from parameter names. ``ns_split="head"`` cuts attention projections (fused or not)
into one block per head.

Nothing here imports transformers: modules are matched by class name along their MRO, so a model
whose module subclasses a supported one (most ``Copied from`` variants do) is recognised too.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

NS_SPLITS = ("block", "head", "none")


@dataclass(frozen=True)
class Blocks:
    """How one weight matrix, or each matrix of a stack (MoE experts ``[experts, rows, cols]``), is cut
    into the matrices Newton–Schulz runs on.

    Along ``axis`` of the matrix as stored (0: rows, e.g. ``nn.Linear`` outputs; 1: columns, e.g.
    transformers' ``Conv1D`` outputs), block ``k`` is made of the runs ``segments[k]``, each
    ``(start, length)``, in order. Every index of the axis is in exactly one block.
    """

    axis: int
    segments: tuple[tuple[tuple[int, int], ...], ...]
    names: tuple[str, ...]

    def sizes(self) -> list[int]:
        return [sum(length for _, length in runs) for runs in self.segments]

    def shapes(self, shape: tuple[int, ...]) -> list[tuple[int, int]]:
        """Each block's ``(rows, cols)`` for a weight of ``shape`` (of each matrix, for a stack)."""
        rows, cols = shape[-2], shape[-1]
        return [(n, cols) if self.axis == 0 else (rows, n) for n in self.sizes()]

    def dim(self, weight: Tensor) -> int:
        """The dimension of ``weight`` (a matrix or a stack of them) the blocks are cut along."""
        return weight.ndim - 2 + self.axis

    def indices(self, device: torch.device | str = "cpu") -> list[Tensor]:
        """Each block's rows (or columns) of the weight, in order."""
        return [_indices(runs, torch.device(device)) for runs in self.segments]

    def split(self, weight: Tensor) -> list[Tensor]:
        """The blocks of ``weight`` (copies where a block is not one run)."""
        out, dim = [], self.dim(weight)
        for runs in self.segments:
            if len(runs) == 1:
                out.append(weight.narrow(dim, *runs[0]))
            else:
                out.append(weight.index_select(dim, _indices(runs, weight.device)))
        return out

    def join(self, blocks: list[Tensor], out: Tensor) -> Tensor:
        """Write ``blocks`` (as :meth:`split` returned them, any dtype) back into ``out``."""
        dim = self.dim(out)
        for runs, block in zip(self.segments, blocks):
            if len(runs) == 1:
                out.narrow(dim, *runs[0]).copy_(block)
            else:
                out.index_copy_(dim, _indices(runs, out.device), block.to(out.dtype))
        return out

    def to_json(self) -> list:
        """A JSON-able form (param groups carry it through ``state_dict()``)."""
        return [self.axis, [[list(run) for run in runs] for runs in self.segments], list(self.names)]

    @classmethod
    def from_json(cls, value: list) -> Blocks:
        axis, segments, names = value
        return cls(int(axis), tuple(tuple((int(s), int(n)) for s, n in runs) for runs in segments), tuple(names))


@functools.lru_cache(maxsize=1024)
def _indices(runs: tuple[tuple[int, int], ...], device: torch.device) -> Tensor:
    return torch.cat([torch.arange(start, start + length, device=device) for start, length in runs])


def _contiguous(axis: int, sizes: list[tuple[str, int]]) -> Blocks:
    """Blocks that follow each other along ``axis``: ``[(name, size), ...]``."""
    segments, start = [], 0
    for _, size in sizes:
        segments.append(((start, size),))
        start += size
    return Blocks(axis, tuple(segments), tuple(name for name, _ in sizes))


def _strided(axis: int, groups: int, group_size: int, parts: list[tuple[str, int, int]]) -> Blocks:
    """Blocks interleaved in ``groups`` equal groups along ``axis``: part ``(name, offset, size)`` of
    every group makes one block (GPT-NeoX: per head ``[q | k | v]``)."""
    segments = tuple(tuple((g * group_size + offset, size) for g in range(groups)) for _, offset, size in parts)
    return Blocks(axis, segments, tuple(name for name, _, _ in parts))


def _per_head(blocks: Blocks, head_dim: int | dict[str, int], attention: tuple[str, ...] = ("q", "k", "v")) -> Blocks:
    """``blocks`` with each attention block (q, k, v) cut into heads of ``head_dim`` (one size, or one per
    block name: a gated delta net's keys and values differ); other blocks kept."""
    segments, names = [], []
    for name, runs in zip(blocks.names, blocks.segments):
        if name not in attention:
            segments.append(runs)
            names.append(name)
            continue
        size = head_dim[name] if isinstance(head_dim, dict) else head_dim
        total = sum(length for _, length in runs)
        if size <= 0 or total % size:
            raise ValueError(f"hf_muon: block {name!r} of {total} rows does not hold whole heads of {size}; "
                             "pass ns_split='block' for this model and report it")
        heads = _cut_runs(runs, size)
        segments.extend(heads)
        names.extend(f"{name}.h{i}" for i in range(len(heads)))
    return Blocks(blocks.axis, tuple(segments), tuple(names))


def _cut_runs(runs: tuple[tuple[int, int], ...], size: int) -> list[tuple[tuple[int, int], ...]]:
    """``runs`` (in order) cut into consecutive pieces of ``size`` indices, each as its own runs: a
    head may span two runs (CodeGen's groups of queries need not hold whole heads)."""
    pieces: list[tuple[tuple[int, int], ...]] = []
    current: list[tuple[int, int]] = []
    need = size
    for start, length in runs:
        while length:
            take = min(need, length)
            if current and sum(current[-1]) == start:
                current[-1] = (current[-1][0], current[-1][1] + take)
            else:
                current.append((start, take))
            start, length, need = start + take, length - take, need - take
            if need == 0:
                pieces.append(tuple(current))
                current, need = [], size
    return pieces


def _heads(module: nn.Module, config: Any) -> tuple[int, int, int]:
    """``(heads, key/value heads, head_dim)`` of an attention module, from the module or its own config
    (a composite model's, e.g. Llava's, has no heads of its own: ``config`` is its text config then)."""
    config = getattr(module, "config", None) or config
    heads = (getattr(module, "num_heads", None) or getattr(module, "num_attention_heads", None)
             or getattr(config, "num_attention_heads", None))
    head_dim = getattr(module, "head_dim", None)
    kv = (getattr(module, "num_key_value_heads", None) or getattr(module, "num_kv_heads", None)
          or getattr(config, "num_key_value_heads", None) or heads)
    if head_dim is None:
        head_dim = config.hidden_size // heads
    return int(heads), int(kv), int(head_dim)


def _head_dim(module: nn.Module, config: Any, blocks: Blocks, config_fallback: bool = True) -> int | dict[str, int] | None:
    """The head size to cut ``blocks`` by: the module's own (a gated delta net's or MiMo's: one for
    queries and keys, one for values), else its query block over its own heads (SAM's, ViTDet's, ... vision
    attention keep no ``head_dim``; the config is the text model's), else what its config says
    (``None`` instead with ``config_fallback=False``)."""
    head_k, head_v = getattr(module, "head_k_dim", None), getattr(module, "head_v_dim", None)
    if isinstance(head_k, int) and isinstance(head_v, int):
        return {"q": head_k, "k": head_k, "v": head_v}
    if isinstance(getattr(module, "head_dim", None), int):
        v_head = getattr(module, "v_head_dim", None)  # MiMo-V2-Flash: values of another size
        return {"q": module.head_dim, "k": module.head_dim, "v": v_head} if isinstance(v_head, int) else module.head_dim
    heads = (getattr(module, "num_heads", None) or getattr(module, "num_attention_heads", None)
             or getattr(module, "n_head", None)
             or getattr(module, "groups", None))  # Florence-2's channel attention: per group
    if isinstance(heads, int) and "q" in blocks.names:
        return blocks.sizes()[blocks.names.index("q")] // heads
    if not config_fallback:
        return None
    try:  # the config's (Swin-like configs keep a tuple of heads per stage: not one module's)
        return _heads(module, config)[2]
    except (AttributeError, TypeError, ValueError, RuntimeError, ZeroDivisionError) as error:
        raise ValueError(f"hf_muon: ns_split='head' cannot read the head size of a {type(module).__name__} "
                         f"({error}); pass ns_split='block' for this model") from error


# module class name -> rule(module, config) yielding (submodule holding the fused weight, its blocks)
# (the submodule whose ``weight`` it is, or the tensor itself, its blocks)
Rule = Callable[[nn.Module, Any], Iterator[tuple[nn.Module | Tensor, Blocks]]]


def _gpt2_attention(module: nn.Module, config: Any) -> Iterator[tuple[nn.Module, Blocks]]:
    d = module.embed_dim
    if getattr(module, "is_cross_attention", False):  # q_attn is its own weight; c_attn holds k | v
        yield module.q_attn, _contiguous(1, [("q", d)])  # one block: cut only per head (ns_split="head")
        yield module.c_attn, _contiguous(1, [("k", d), ("v", d)])
    else:
        yield module.c_attn, _contiguous(1, [("q", d), ("k", d), ("v", d)])


def _gpt_bigcode_attention(module: nn.Module, config: Any) -> Iterator[tuple[nn.Module, Blocks]]:
    d, hd = module.embed_dim, module.head_dim
    if getattr(module, "is_cross_attention", False):
        return
    if module.multi_query:  # [q: d | k: hd | v: hd]
        yield module.c_attn, _contiguous(0, [("q", d), ("k", module.kv_dim), ("v", module.kv_dim)])
    else:  # viewed as [heads, 3 * hd]: per head [q | k | v]
        yield module.c_attn, _strided(0, module.num_heads, 3 * hd, [("q", 0, hd), ("k", hd, hd), ("v", 2 * hd, hd)])


def _phi3_attention(module: nn.Module, config: Any) -> Iterator[tuple[nn.Module, Blocks]]:
    heads, kv, hd = _heads(module, config)
    yield module.qkv_proj, _contiguous(0, [("q", heads * hd), ("k", kv * hd), ("v", kv * hd)])


def _phi3_mlp(module: nn.Module, config: Any) -> Iterator[tuple[nn.Module, Blocks]]:
    ff = module.gate_up_proj.out_features // 2
    yield module.gate_up_proj, _contiguous(0, [("gate", ff), ("up", ff)])


def _up_gate(attribute: str) -> Rule:
    """``up, gate = ....chunk(2, dim=-1)`` (Phi-4-multimodal's audio MLP, ModernBERT's ``Wi``)."""
    def rule(module: nn.Module, config: Any) -> Iterator[tuple[nn.Module, Blocks]]:
        linear = getattr(module, attribute)
        ff = linear.out_features // 2
        yield linear, _contiguous(0, [("up", ff), ("gate", ff)])
    return rule


def _dbrx_attention(module: nn.Module, config: Any) -> Iterator[tuple[nn.Module, Blocks]]:
    kv = module.num_key_value_heads * module.head_dim
    yield module.Wqkv, _contiguous(0, [("q", module.hidden_size), ("k", kv), ("v", kv)])


def _interleaved_per_head(attribute: str) -> Rule:
    """Output viewed as ``[heads, 3, head_dim]`` (GPT-NeoX, Bloom, Persimmon)."""
    def rule(module: nn.Module, config: Any) -> Iterator[tuple[nn.Module, Blocks]]:
        heads, _, hd = _heads(module, config)
        yield getattr(module, attribute), _strided(0, heads, 3 * hd, [("q", 0, hd), ("k", hd, hd), ("v", 2 * hd, hd)])
    return rule


def _falcon_attention(module: nn.Module, config: Any) -> Iterator[tuple[nn.Module, Blocks]]:
    heads, hd = module.num_heads, module.head_dim
    if module.new_decoder_architecture:  # [kv groups, queries of the group + 2, hd]: its queries, key, value
        kv = module.num_kv_heads
        per_group = heads // kv
        group = (per_group + 2) * hd
        yield module.query_key_value, _strided(
            0, kv, group, [("q", 0, per_group * hd), ("k", per_group * hd, hd), ("v", (per_group + 1) * hd, hd)])
    elif module.multi_query:  # [q: heads * hd | k: hd | v: hd]
        yield module.query_key_value, _contiguous(0, [("q", heads * hd), ("k", hd), ("v", hd)])
    else:
        yield from _interleaved_per_head("query_key_value")(module, config)


def _codegen_attention(module: nn.Module, config: Any) -> Iterator[tuple[nn.Module, Blocks]]:
    # output viewed as [mp_num, 3 * local]: per model-parallel group its queries | values | keys
    groups = getattr(module, "mp_num", 4)  # transformers 4 hard-codes 4 in ``forward``
    local = module.embed_dim // groups
    yield module.qkv_proj, _strided(0, groups, 3 * local, [("q", 0, local), ("v", local, local), ("k", 2 * local, local)])


def _qkv_thirds(attribute: str) -> Rule:
    """Output viewed as ``[..., 3, heads, head_dim]`` (or split in three equal parts): q | k | v rows
    (MPT, ModernBERT, the Qwen2-VL family's and other ViT-style vision towers' ``qkv``)."""
    def rule(module: nn.Module, config: Any) -> Iterator[tuple[nn.Module, Blocks]]:
        linear = getattr(module, attribute)
        d = linear.out_features // 3
        yield linear, _contiguous(0, [("q", d), ("k", d), ("v", d)])
    return rule


def _q_kv_sizes(module: nn.Module, config: Any) -> Iterator[tuple[nn.Module, Blocks]]:
    """``qkv`` split as ``[q_dim, kv_dim, kv_dim]`` (Exaone 4.5's vision tower)."""
    yield module.qkv, _contiguous(0, [("q", module.q_dim), ("k", module.kv_dim), ("v", module.kv_dim)])


def _openai_gpt_attention(module: nn.Module, config: Any) -> Iterator[tuple[nn.Module, Blocks]]:
    """openai-gpt: ``c_attn`` (Conv1D) output split in ``split_size`` columns: q | k | v."""
    d = module.split_size
    yield module.c_attn, _contiguous(1, [("q", d), ("k", d), ("v", d)])


def _zamba2_mlp(module: nn.Module, config: Any) -> Iterator[tuple[nn.Module, Blocks]]:
    """Zamba2's shared MLP: ``gate_up_proj`` and each layer's low-rank adapter added to its output
    (``Sequential(down to the rank, up to 2 * ff)``), both read as ``chunk(2)``: gate | up."""
    yield from _phi3_mlp(module, config)
    for adapter in module.gate_up_proj_adapter_list:
        if isinstance(adapter, nn.Sequential):
            ff = adapter[-1].out_features // 2
            yield adapter[-1], _contiguous(0, [("gate", ff), ("up", ff)])


def _gated_delta_net_qkv(module: nn.Module, config: Any) -> Iterator[tuple[nn.Module, Blocks]]:
    """Qwen3.5's gated delta net: ``in_proj_qkv`` split as ``[key_dim, key_dim, value_dim]`` after a
    depthwise convolution (each channel on its own, so the rows stay q | k | v)."""
    yield module.in_proj_qkv, _contiguous(0, [("q", module.key_dim), ("k", module.key_dim), ("v", module.value_dim)])


def _qwen3_next_delta_net(module: nn.Module, config: Any) -> Iterator[tuple[nn.Module, Blocks]]:
    """Qwen3-Next's gated delta net (``fix_query_key_value_ordering``): ``in_proj_qkvz`` viewed as
    ``[key heads, q | k | the group's v | its z]``, ``in_proj_ba`` as ``[key heads, b | a]``."""
    hk, per_group = module.head_k_dim, module.num_v_heads // module.num_k_heads
    v = per_group * module.head_v_dim
    yield module.in_proj_qkvz, _strided(0, module.num_k_heads, 2 * hk + 2 * v,
                                        [("q", 0, hk), ("k", hk, hk), ("v", 2 * hk, v), ("z", 2 * hk + v, v)])
    yield module.in_proj_ba, _strided(0, module.num_k_heads, 2 * per_group,
                                      [("b", 0, per_group), ("a", per_group, per_group)])


def _torch_multihead_attention(module: nn.Module, config: Any) -> Iterator[tuple[Tensor, Blocks]]:
    """``nn.MultiheadAttention``: ``in_proj_weight`` rows q | k | v, each ``embed_dim`` (where keys and
    values have other sizes it keeps ``q_proj_weight``, ... apart: nothing fused)."""
    if module.in_proj_weight is not None:
        d = module.embed_dim
        yield module.in_proj_weight, _contiguous(0, [("q", d), ("k", d), ("v", d)])
    elif module.q_proj_weight is not None:
        for name in ("q", "k", "v"):
            weight = getattr(module, f"{name}_proj_weight")
            yield weight, _contiguous(0, [(name, weight.shape[0])])  # one block: cut only per head


# Stacked experts whose gate and up columns alternate (``gate_up[..., ::2], gate_up[..., 1::2]``).
INTERLEAVED_GATE_UP = ("GptOssExperts",)


def experts_layout(module: nn.Module) -> str | None:
    """How a transformers 5 MoE experts module (a ``...Experts`` class holding 3-D ``gate_up_proj`` and
    ``down_proj``) stores its matrices, read from their shapes: ``"rows"`` (``gate_up_proj``
    ``[experts, 2 * I, H]``, used as ``F.linear(x, W[e]).chunk(2, dim=-1)``: Mixtral, Qwen-MoE,
    DeepSeek, ...), ``"columns"`` (``[experts, H, 2 * I]``, used as ``x @ W[e]``: Llama 4, GPT-OSS,
    Aria), or ``None`` (not such a module, or shapes that fit neither)."""
    from ..distributed.providers import shape_of

    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (type(module).__name__.endswith("Experts") and isinstance(gate_up, Tensor) and isinstance(down, Tensor)):
        return None
    gate_up, down = shape_of(gate_up), shape_of(down)
    if len(gate_up) != 3 or len(down) != 3:
        return None
    (_, a, b), (_, c, d) = gate_up, down
    if a == 2 * d and b == c:
        return "rows"
    if b == 2 * c and a == d:
        return "columns"
    return None


def _experts_gate_up(module: nn.Module, config: Any) -> Iterator[tuple[Tensor, Blocks]]:
    """Each expert's gate | up (see :func:`experts_layout`), interleaved columns for
    ``INTERLEAVED_GATE_UP``."""
    from ..distributed.providers import shape_of

    layout = experts_layout(module)
    if layout is None:
        return
    _, a, b = shape_of(module.gate_up_proj)
    if layout == "rows":
        yield module.gate_up_proj, _contiguous(0, [("gate", a // 2), ("up", a // 2)])
    elif any(cls.__name__ in INTERLEAVED_GATE_UP for cls in type(module).__mro__):
        yield module.gate_up_proj, _strided(1, b // 2, 2, [("gate", 0, 1), ("up", 1, 1)])
    else:
        yield module.gate_up_proj, _contiguous(1, [("gate", b // 2), ("up", b // 2)])


# attention modules whose ``qkv`` Linear is read as ``[3, heads, head_dim]`` (checked against their
# ``forward`` by tests/test_fused.py)
QKV_THIRDS = (
    "modeling_qwen2_vl.VisionAttention", "Qwen2_5_VLVisionAttention", "Qwen3VLVisionAttention",
    "Qwen3VLMoeVisionAttention", "Qwen3OmniMoeVisionAttention", "Qwen3_5VisionAttention", "Qwen3_5MoeVisionAttention",
    "Qwen4ExpVisionAttention", "Glm4vVisionAttention", "Glm4vMoeVisionAttention", "Glm5NextVisionAttention",
    "GlmImageVisionAttention", "GlmOcrVisionAttention", "LlavaOnevision15VisionAttention",
    "Ernie4_5_VLMoeVisionAttention", "CohereCompassVisionAttention", "Dots3NoteVisionAttention",
    "BlipAttention", "Blip2Attention", "InstructBlipAttention", "InstructBlipVideoAttention",
    "SamVisionAttention", "SamHQVisionAttention", "Sam2MultiScaleAttention", "GotOcr2VisionAttention",
    "DeepseekOcr2SamVisionAttention", "UnlimitedOcrSamVisionAttention", "PPFormulaNetVisionAttention",
    "SLANeXtVisionAttention", "SegGptAttention", "VitDetAttention", "HieraMaskUnitAttention", "MgpstrAttention",
    "TimesformerSelfAttention", "PPOCRV5MobileRecAttention", "PPOCRV5ServerRecAttention", "PPOCRV6SmallRecAttention",
    "Florence2VisionWindowAttention", "Florence2VisionChannelAttention",
)
# attribute names that usually hold several projections in one weight: one of them under a module
# with no rule above is warned about (orthogonalized whole), never cut by its name
FUSED_LOOKING = ("qkv", "qkv_proj", "query_key_value", "Wqkv", "W_pack", "wqkv", "c_attn", "to_qkv", "in_proj_qkv",
                 "in_proj_qkvz", "in_proj_ba", "gate_up_proj", "w13", "fc_gate_up", "Wi")
# gated delta nets whose ``in_proj_qkv`` is split as ``[key_dim, key_dim, value_dim]``
GATED_DELTA_NETS = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen4ExpTextGatedDeltaNet", "LaraMiniGatedDeltaNet")

FUSED_RULES: dict[str, Rule] = {
    "GPT2Attention": _gpt2_attention,
    # copies of GPT2Attention, not subclasses
    "DecisionTransformerGPT2Attention": _gpt2_attention,
    "ImageGPTAttention": _gpt2_attention,
    "GPTBigCodeAttention": _gpt_bigcode_attention,
    "Phi3Attention": _phi3_attention,
    # its copies: ``qkv_proj`` rows q | k | v at GQA sizes (Ergo views them per head, in that order)
    "Phi4MultimodalAttention": _phi3_attention,
    "ErgoAttention": _phi3_attention,
    "modeling_openai.Attention": _openai_gpt_attention,
    "Phi3MLP": _phi3_mlp,
    # Phi3MLP's copies (``gate, up = gate_up_proj(x).chunk(2, dim=-1)``), one with up first
    **{name: _phi3_mlp for name in ("GlmMLP", "Glm4MLP", "Glm4vTextMLP", "GlmImageTextMLP", "GlmOcrTextMLP", "DiaMLP",
                                    "Dots3NoteAudioMLP", "EsmFold2SwiGLU", "MiniMaxM3VLDenseMLP", "Phi4MultimodalMLP")},
    "Phi4MultimodalAudioMLP": _up_gate("gate_up_proj"),
    "ModernBertMLP": _up_gate("Wi"),  # ``input, gate = self.Wi(x).chunk(2, dim=-1)``
    "ModernBertDecoderMLP": _up_gate("Wi"),  # a copy of it
    "GPTNeoXAttention": _interleaved_per_head("query_key_value"),
    "GPTNeoXJapaneseAttention": _interleaved_per_head("query_key_value"),
    "BloomAttention": _interleaved_per_head("query_key_value"),
    "PersimmonAttention": _interleaved_per_head("query_key_value"),
    "MiniMaxLightningAttention": _interleaved_per_head("qkv_proj"),
    "Zamba2MLP": _zamba2_mlp,
    **{name: _gated_delta_net_qkv for name in GATED_DELTA_NETS},
    "Qwen3NextGatedDeltaNet": _qwen3_next_delta_net,
    "FalconAttention": _falcon_attention,
    "MptAttention": _qkv_thirds("Wqkv"),
    "ModernBertAttention": _qkv_thirds("Wqkv"),
    # ``self.qkv(x).reshape(..., 3, heads, -1)``; a bare class name that another library may reuse
    # ("VisionAttention") is keyed by its modeling file too
    **{name: _qkv_thirds("qkv") for name in QKV_THIRDS},
    "Exaone4_5_VisionAttention": _q_kv_sizes,
    "CodeGenAttention": _codegen_attention,
    "activation.MultiheadAttention": _torch_multihead_attention,  # torch.nn's
    "DbrxAttention": _dbrx_attention,
}
# Where each supported model keeps its fused weights (the README's table is checked against this).
MODEL_TABLE = (
    ("GPT-2, DistilGPT-2, DecisionTransformer, ImageGPT", "GPT2Attention, DecisionTransformerGPT2Attention, "
     "ImageGPTAttention", "c_attn (Conv1D): q | k | v column blocks; cross-attention: k | v"),
    ("GPT-BigCode (StarCoder 1)", "GPTBigCodeAttention", "c_attn: q | k | v rows (multi-query: d | hd | hd), else per head"),
    ("Phi-3, Phi-3.5, Phi-4, Phi-4-multimodal, Ergo", "Phi3Attention, Phi3MLP, Phi4MultimodalAttention, ErgoAttention",
     "qkv_proj: q | k | v rows (GQA sizes); gate_up_proj: gate | up"),
    ("GPT (openai-gpt)", "Attention (modeling_openai)", "c_attn (Conv1D): q | k | v column blocks"),
    ("GPT-NeoX, Pythia, GPT-NeoX-Japanese", "GPTNeoXAttention, GPTNeoXJapaneseAttention",
     "query_key_value: [q_h | k_h | v_h] per head"),
    ("Bloom", "BloomAttention", "query_key_value: [q_h | k_h | v_h] per head"),
    ("Persimmon", "PersimmonAttention", "query_key_value: [q_h | k_h | v_h] per head"),
    ("MiniMax (lightning attention)", "MiniMaxLightningAttention", "qkv_proj: [q_h | k_h | v_h] per head"),
    ("Qwen3.5 (and MoE), Qwen3-Next, LaraMini: gated delta nets", "Qwen3_5GatedDeltaNet, ... (GATED_DELTA_NETS), "
     "Qwen3NextGatedDeltaNet", "in_proj_qkv: q | k | v rows (key, key, value sizes); Qwen3-Next's in_proj_qkvz: per key "
     "head [q | k | its v | its z], in_proj_ba: per key head [b | a]"),
    ("Zamba2", "Zamba2MLP", "gate_up_proj and each layer's adapter output: gate | up"),
    ("Falcon", "FalconAttention", "query_key_value: per kv group [its queries | k | v] (new architecture), "
     "q | k | v (multi-query) or per head"),
    ("MPT, ModernBERT (and its decoder)", "MptAttention, ModernBertAttention, ModernBertMLP, ModernBertDecoderMLP",
     "Wqkv: q | k | v rows; ModernBERT's Wi: input | gate"),
    ("vision towers: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (and MoE, Omni), GLM-4V, BLIP, BLIP-2, InstructBLIP, SAM, "
     "SAM 2, ViTDet, Hiera, Florence-2, ... (39 modules)", "VisionAttention, Qwen2_5_VLVisionAttention, ... (QKV_THIRDS), Exaone4_5_VisionAttention",
     "qkv: q | k | v rows (Exaone 4.5's: GQA sizes)"),
    ("CodeGen", "CodeGenAttention", "qkv_proj: per model-parallel group (4) [its q | v | k] rows"),
    ("DBRX", "DbrxAttention", "Wqkv: q | k | v rows (GQA sizes)"),
    ("PyTorch's nn.Transformer layers", "nn.MultiheadAttention", "in_proj_weight: q | k | v rows"),
    ("GLM, GLM-4 (and GLM-4V, GLM-Image, GLM-OCR text), Dia, Phi-4-multimodal, MiniMax-M3-VL, ...",
     "GlmMLP, Glm4MLP, ... (Phi3MLP's copies)", "gate_up_proj: gate | up (Phi-4-multimodal's audio MLP: up | gate)"),
    ("MoEs with stacked experts on transformers 5 (Mixtral, Qwen-MoE, DeepSeek, OLMoE, Llama 4, GPT-OSS, ...)",
     "any ...Experts with 3-D gate_up_proj and down_proj",
     "gate_up_proj: each expert's gate | up (rows; columns where used as x @ W[e]; GPT-OSS: alternating columns)"),
)


def _rule_for(module: nn.Module) -> tuple[str, Rule] | None:
    for cls in type(module).__mro__:
        for key in (f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}", cls.__name__):
            if key in FUSED_RULES:
                return cls.__name__, FUSED_RULES[key]
    if experts_layout(module) is not None:
        return type(module).__name__, _experts_gate_up
    return None


def _separate_projections(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    """An attention module's own q/k/v ``nn.Linear`` projections (Llama, Qwen2, Mistral, ... keep
    them apart), for ``ns_split="head"``; none where an ``nn.MultiheadAttention`` inside projects
    them again (Aria's cross-attention: its heads are cut from that projection's output, not these)."""
    found = [(name, getattr(module, f"{name}_proj", None)) for name in ("q", "k", "v")]
    if (type(module).__name__.endswith("Attention") and all(isinstance(m, nn.Linear) for _, m in found)
            and not any(isinstance(child, nn.MultiheadAttention) for child in module.children())):
        return found  # type: ignore[return-value]
    return []


def _weight_axis_blocks(weight: Tensor, blocks: Blocks, where: str) -> Blocks:
    """Check ``blocks`` cover ``weight``'s axis exactly (a config that disagrees with the weight is a
    model hf_muon misreads: refuse rather than orthogonalize the wrong blocks)."""
    length = weight.shape[blocks.dim(weight)] if weight.ndim in (2, 3) else -1
    end = 0  # the runs, sorted, must follow each other from 0 to the axis' length
    for start, n in sorted(run for runs in blocks.segments for run in runs if run[1]):  # a block may be empty
        end = end + n if start == end and n > 0 else -1
    if end != length:
        raise ValueError(f"hf_muon: the fused blocks read for {where} do not cover its weight of shape "
                         f"{tuple(weight.shape)} exactly; pass ns_split='none' for this model and report it")
    return blocks


def block_shapes(shape: tuple[int, ...], blocks: Blocks | None) -> tuple[tuple[int, int], ...] | None:
    """``(rows, cols)`` of each block of a weight of ``shape`` cut by ``blocks`` (``None``: not cut):
    the matrices its owner orthogonalizes, which the owner plan costs."""
    return None if blocks is None else tuple(blocks.shapes(shape))


def fused_blocks(model: nn.Module, ns_split: str = "block") -> dict[int, tuple[str, Blocks]]:
    """``id(weight) -> (parameter name, Blocks)`` for each weight ``model`` stores fused, cut as
    ``ns_split`` says: ``"block"`` (each logical matrix: q, k, v, gate, up), ``"head"`` (attention
    projections per head, fused or not), ``"none"`` (nothing: whole matrices)."""
    if ns_split not in NS_SPLITS:
        raise ValueError(f"ns_split must be one of {NS_SPLITS}, got {ns_split!r}")
    if ns_split == "none":
        return {}
    from ..distributed.providers import shape_of

    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):  # a composite model's (Llava's) heads are its text model's
        config = config.get_text_config()
    names = {id(p): n for n, p in model.named_parameters()}
    found: dict[int, tuple[str, Blocks]] = {}
    headless: list[str] = []
    for module_name, module in model.named_modules():
        matched = _rule_for(module)
        targets: list[tuple[nn.Module, Blocks]] = []
        if matched is not None:
            for holder, blocks in matched[1](module, config):
                if ns_split == "head" and {"q", "k", "v"} & set(blocks.names):
                    blocks = _per_head(blocks, _head_dim(module, config, blocks))
                targets.append((holder, blocks))
        elif ns_split == "head":
            projections = _separate_projections(module)
            # the module's own head size only: one that keeps none (GroupViT's single-head assignment
            # attention) is not cut by its config's, which may be another tower's
            hd = _head_dim(module, None, _contiguous(0, [("q", projections[0][1].out_features)]),
                           config_fallback=False) if projections else None
            if projections and hd is None:
                headless.append(f"{module_name} ({type(module).__name__})")
            if hd is not None:
                for name, linear in projections:
                    targets.append((linear, _per_head(_contiguous(0, [(name, linear.out_features)]), hd)))
        for holder, blocks in targets:
            weight = holder.weight if isinstance(holder, nn.Module) else holder
            where = f"{module_name} ({type(module).__name__})"
            shape = shape_of(weight)
            _weight_axis_blocks(torch.empty(shape, device="meta"), blocks, where)
            if len(blocks.segments) > 1:
                found[id(weight)] = (names.get(id(weight), where), blocks)
    if headless:
        warnings.warn(f"hf_muon: ns_split='head': {len(headless)} attention module(s) keep no head size of their own, "
                      f"so their q, k and v projections are orthogonalized whole: {', '.join(headless[:3])}"
                      f"{', ...' if len(headless) > 3 else ''}", stacklevel=2)
    return found


def unknown_fused_looking(model: nn.Module) -> dict[int, str]:
    """``id(weight) -> "name (module class)"`` of each trained 2-D weight held under a name in
    ``FUSED_LOOKING`` by a module hf_muon has no layout for: orthogonalized whole, though it may
    hold several matrices (see :func:`unknown_layout_warning`)."""
    from ..distributed.providers import shape_of

    names = {id(p): n for n, p in model.named_parameters()}
    found = {}
    for module in model.modules():
        if _rule_for(module) is not None:
            continue
        for attribute in FUSED_LOOKING:
            weight = getattr(getattr(module, attribute, None), "weight", None)
            if (isinstance(weight, Tensor) and weight.requires_grad and len(shape_of(weight)) == 2
                    and id(weight) in names):
                found[id(weight)] = f"{names[id(weight)]} ({type(module).__name__})"
    return found


def unknown_layout_warning(found: list[str]) -> str:
    """What to tell a user about Muon weights :func:`unknown_fused_looking` found."""
    return (f"hf_muon: {len(found)} Muon weight(s) look fused by their name but their module has no known layout, "
            f"so each is orthogonalized whole: {', '.join(found[:3])}{', ...' if len(found) > 3 else ''}. If the "
            "module splits its output into q, k, v (or gate, up), Muon is not run per matrix there; please "
            "report the module (README: fused projections)")
