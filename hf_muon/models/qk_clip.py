"""QK-clip (MuonClip, Kimi K2): keep every attention head's largest pre-softmax logit at most ``tau``.

During training forward passes the largest ``scaling * q·k`` of each head, over the positions the
attention mask allows and after RoPE, is tracked (on device, max over micro-batches). After each
optimizer step, a head whose maximum exceeded ``tau`` has its query and key weights rescaled so that
logit would be exactly ``tau``: ``gamma_h = tau / max_h``.

Split of ``gamma_h`` (every head's logit is scaled by exactly its own ``gamma_h``; 1 if under tau):

* MHA (one key head per query head): query and key rows of the head each by ``sqrt(gamma_h)``.
* GQA (a key head shared by a group of query heads): the key head by ``s = sqrt(min gamma in its
  group)``, each query head by ``gamma_h / s``. A group with no head over tau is untouched bit for
  bit; in a group with a clipped head, an unclipped head's query rows are multiplied by ``1 / s`` and
  its logits are unchanged up to rounding.
* Biases (Qwen2's q/k biases, GPT-2's ``c_attn`` bias) are output features like the weight rows and
  are scaled by the same factor, otherwise the logit would not scale by ``gamma_h``.

Which modules are attention, and how their heads are laid out, comes from module types and the model
config, never from parameter names: Llama (``LlamaAttention``: ``q_proj``/``k_proj`` ``Linear``, GQA
from ``num_key_value_heads``), Qwen2 (``Qwen2Attention``, same with biases) and GPT-2
(``GPT2Attention``: ``c_attn`` ``Conv1D`` with weight ``[d, 3d]``, q|k|v column blocks).

Logits are seen through transformers' ``AttentionInterface``: the model's config is pointed at
``hf_muon_qk_clip_eager`` or ``hf_muon_qk_clip_sdpa`` (registered with the same mask function as
``eager``/``sdpa``), which records and then calls the model's own ``eager`` or the ``sdpa`` function.
``QKClip.detach()`` restores the config. The config key is private and not saved by ``save_pretrained``.
"""

from __future__ import annotations

import math
import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..distributed.providers import shape_of
from ..optimizer.row_scaling import FeatureScaling, scale_output_features

ATTENTION_PREFIX = "hf_muon_qk_clip_"
TRACKED_IMPLEMENTATIONS = ("eager", "sdpa")
SUPPORTED_MODELS = "Llama (LlamaAttention), Qwen2 (Qwen2Attention) and GPT-2 (GPT2Attention, self-attention)"


@dataclass(frozen=True)
class AttentionLayer:
    """One attention module and its head layout.

    ``fused_qkv``: GPT-2's ``c_attn`` (``Conv1D``, q|k|v column blocks); otherwise separate
    ``q_proj``/``k_proj`` ``Linear`` layers."""

    name: str
    module: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    fused_qkv: bool

    def query_key_parameters(self) -> list[tuple[str, Tensor]]:
        """The parameters that make this layer's queries and keys (GPT-2: ``c_attn``, v included)."""
        holders = ("c_attn",) if self.fused_qkv else ("q_proj", "k_proj")
        found = [(f"{name}.{kind}", getattr(getattr(self.module, name), kind))
                 for name in holders for kind in ("weight", "bias")]
        return [(n, p) for n, p in found if p is not None]

    def trains(self) -> bool:
        """Whether the query/key parameters train (all of them) or are frozen (all); refused when mixed:
        the clip splits each head's factor between its query and its key."""
        flags = {n: p.requires_grad for n, p in self.query_key_parameters()}
        if len(set(flags.values())) > 1:
            frozen = [n for n, trains in flags.items() if not trains]
            raise ValueError(f"QKClip: {self.name} has frozen ({', '.join(frozen)}) and trained query/key "
                             "parameters; the clip rescales queries and keys together: train or freeze them all")
        return all(flags.values())

    def scalings(self, gamma: Tensor) -> tuple[list[FeatureScaling], list[str]]:
        """The output-feature scalings that multiply head ``h``'s logit by ``gamma[h]`` (see the module
        docstring for the split), and the parameter names they act on (for messages)."""
        group = self.num_heads // self.num_kv_heads
        key_scale = gamma.view(self.num_kv_heads, group).amin(dim=1).sqrt()
        query_scale = gamma / key_scale.repeat_interleave(group)
        q_features = query_scale.repeat_interleave(self.head_dim)
        k_features = key_scale.repeat_interleave(self.head_dim)
        if self.fused_qkv:
            c_attn = self.module.c_attn
            v_features = torch.ones(self.num_heads * self.head_dim, dtype=gamma.dtype, device=gamma.device)
            features = torch.cat([q_features, k_features, v_features])
            # Conv1D computes x @ W + b with W [in, out]: output features are columns
            targets = [(c_attn.weight, features, 1, "c_attn.weight"), (c_attn.bias, features, 0, "c_attn.bias")]
        else:
            q, k = self.module.q_proj, self.module.k_proj
            targets = [(q.weight, q_features, 0, "q_proj.weight"), (q.bias, q_features, 0, "q_proj.bias"),
                       (k.weight, k_features, 0, "k_proj.weight"), (k.bias, k_features, 0, "k_proj.bias")]
        present = [(p, f, axis, f"{self.name}.{n}") for p, f, axis, n in targets if p is not None]
        return [FeatureScaling(p, f, axis) for p, f, axis, _ in present], [n for *_, n in present]


def _attention_classes() -> dict[type, str]:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

    return {LlamaAttention: "llama", Qwen2Attention: "llama", GPT2Attention: "gpt2"}


def find_attention_layers(model: nn.Module) -> list[AttentionLayer]:
    """The attention layers of a Llama, Qwen2 or GPT-2 model, in module order; ``ValueError`` otherwise."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"QKClip needs the model (an nn.Module), got {type(model).__name__}")
    classes = _attention_classes()
    layers = []
    for name, module in model.named_modules():
        kind = classes.get(type(module))
        if kind is None:
            continue
        config = module.config
        heads = config.num_attention_heads
        if kind == "gpt2":
            if module.is_cross_attention:
                raise ValueError(f"QKClip: {name} is GPT-2 cross-attention; only GPT-2 self-attention is supported")
            if module.reorder_and_upcast_attn:
                raise ValueError("QKClip does not track GPT-2 with reorder_and_upcast_attn=True (its eager path "
                                 "bypasses the attention interface): set config.reorder_and_upcast_attn=False")
            d = module.embed_dim
            if shape_of(module.c_attn.weight) != (d, 3 * d):
                raise ValueError(f"QKClip: {name}.c_attn.weight has shape {shape_of(module.c_attn.weight)}, "
                                 f"expected GPT-2's Conv1D [d, 3d] = [{d}, {3 * d}]")
            layers.append(AttentionLayer(name, module, heads, heads, module.head_dim, fused_qkv=True))
        else:
            kv_heads = getattr(config, "num_key_value_heads", None) or heads
            hd = module.head_dim
            for proj, n in ((module.q_proj, heads), (module.k_proj, kv_heads)):
                if not isinstance(proj, nn.Linear) or shape_of(proj.weight)[0] != n * hd:
                    raise ValueError(f"QKClip: {name}'s q_proj/k_proj is not an nn.Linear with {n} x {hd} "
                                     f"output features as the config says (got {type(proj).__name__} "
                                     f"{shape_of(proj.weight)})")
            if heads % kv_heads:
                raise ValueError(f"QKClip: {heads} query heads are not a multiple of {kv_heads} key/value heads")
            layers.append(AttentionLayer(name, module, heads, kv_heads, hd, fused_qkv=False))
    if not layers:
        raise ValueError(f"QKClip supports {SUPPORTED_MODELS}; found none of these attention modules in "
                         f"{type(model).__name__}. Use QKClip only with one of those models.")
    others = sorted({type(m).__name__ for m in model.modules()
                     if type(m).__name__.endswith("Attention") and type(m) not in classes})
    if others:  # e.g. Llava: its Llama layers are tracked, its CLIP vision tower's attention is not
        warnings.warn(f"QKClip tracks and clips {len(layers)} attention layers of {SUPPORTED_MODELS}; the attention "
                      f"modules of types {', '.join(others)} in {type(model).__name__} are neither tracked nor clipped")
    return layers


# --- logit tracking --------------------------------------------------------------------------------

# attention module -> (its QKClip, layer index); weak so a dropped model is not kept alive
_TRACKED: "weakref.WeakKeyDictionary[nn.Module, tuple[QKClip, int]]" = weakref.WeakKeyDictionary()


def _base_attention(base: str, module: nn.Module) -> Callable:
    """The function the module would call without QKClip: its model's own eager function, or sdpa."""
    if base == "sdpa":  # whatever transformers' registry holds for it (a user may have overridden it)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(f"QKClip: {type(module).__module__} has no eager_attention_forward to call")
    return eager


def _tracking_attention(base: str) -> Callable:
    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                  **kwargs: Any):
        entry = _TRACKED.get(module)
        if entry is not None and module.training:
            clip, index = entry
            clip._record(index, head_max_logits(module, query, key, attention_mask, kwargs.get("scaling"),
                                                kwargs.get("is_causal")))
        return _base_attention(base, module)(module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = f"{ATTENTION_PREFIX}{base}"
    return attention


def _register_tracking_implementations() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    for base in TRACKED_IMPLEMENTATIONS:
        name = ATTENTION_PREFIX + base
        if name not in ALL_ATTENTION_FUNCTIONS:
            AttentionInterface.register(name, _tracking_attention(base))
            # the same masks as the implementation it wraps (transformers builds none for unknown names)
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])


@torch.no_grad()
def head_max_logits(module: nn.Module, query: Tensor, key: Tensor, attention_mask: Tensor | None,
                    scaling: float | None, is_causal: bool | None) -> Tensor:
    """Per query head, the largest ``scaling * q·k`` over the positions ``attention_mask`` allows, in
    fp32 (``-inf`` for a head that attends nowhere). ``query`` is ``[B, H, Sq, D]``, ``key``
    ``[B, Hkv, Sk, D]`` (query head ``h`` reads key head ``h // (H / Hkv)``, as ``repeat_kv``)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    key = key.repeat_interleave(heads // kv_heads, dim=1)
    logits = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scaling
    q_len, k_len = logits.shape[-2:]
    if attention_mask is not None:
        mask = attention_mask[..., :k_len]
        allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    else:  # sdpa's rule: causal from is_causal (else the module's), never for a single query
        causal = (is_causal if is_causal is not None else getattr(module, "is_causal", True)) and q_len > 1
        allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=logits.device)
        if causal:
            allowed = allowed.tril()
    logits = logits.masked_fill(~allowed, float("-inf"))
    return logits.transpose(0, 1).reshape(heads, -1).amax(dim=1)


# --- the clip ------------------------------------------------------------------------------------

def check_tau(tau: float) -> None:
    """Refuse a tau that is not a finite number > 0 (``--optim_args qk_clip_tau=`` is checked with this)."""
    if isinstance(tau, bool) or not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau > 0):
        raise ValueError(f"QKClip: tau must be a finite number > 0, got {tau!r}")


class QKClip:
    """QK-clip for a Llama, Qwen2 or GPT-2 model trained with :class:`hf_muon.Muon`::

        clip = QKClip(model, tau=100.0).attach(optimizer)
        ...  # train as usual
        clip.max_attention_logit  # largest logit seen in the last step, before clipping

    Works on one process, DDP, FSDP2 (``Shard(0)``) and DeepSpeed ZeRO-1/2/3 (fp32 partitions),
    for ``attn_implementation="eager"`` or ``"sdpa"``. Logits are tracked in training mode only.

    Args:
        model: the model (not a DDP/DeepSpeed wrapper is needed: wrappers are walked too).
        tau: the largest pre-softmax attention logit a head may keep after a step.
    """

    def __init__(self, model: nn.Module, tau: float = 100.0) -> None:
        check_tau(tau)
        self.tau = float(tau)
        found = find_attention_layers(model)
        # frozen query/key weights never change: the clip must not rescale them either
        self.layers = [layer for layer in found if layer.trains()]
        frozen = [layer.name for layer in found if layer not in self.layers]
        if not self.layers:
            raise ValueError(f"QKClip: the query/key weights of all {len(found)} attention layers are frozen: "
                             "there is nothing to clip; drop qk_clip_tau")
        if frozen:
            warnings.warn(f"QKClip: {len(frozen)} attention layers with frozen query/key weights are neither "
                          f"tracked nor clipped: {', '.join(frozen[:4])}{' ...' if len(frozen) > 4 else ''}")
        self._configs = self._tracked_configs()
        self._maxima: list[Tensor | None] = [None] * len(self.layers)
        self._optimizer: torch.optim.Optimizer | None = None
        self._hook = self._pre_hook = None
        self._pending: list[FeatureScaling] | None = None  # scalings of the step being applied
        self._pending_names: dict[int, str] = {}
        self._seen_since_step = False
        self._last_max: Tensor | None = None
        self._last_clipped: Tensor | None = None
        self._last_head_max: list[Tensor] = []
        _register_tracking_implementations()
        for config, base in self._configs:
            config._attn_implementation = ATTENTION_PREFIX + base
        for index, layer in enumerate(self.layers):
            _TRACKED[layer.module] = (self, index)

    def _tracked_configs(self) -> list[tuple[Any, str]]:
        configs: dict[int, tuple[Any, str]] = {}
        for layer in self.layers:
            config = layer.module.config
            impl = config._attn_implementation
            if impl is not None and impl.startswith(ATTENTION_PREFIX):
                raise ValueError(f"QKClip: {layer.name} is already tracked by another QKClip: detach() it first")
            if impl not in TRACKED_IMPLEMENTATIONS:
                raise ValueError(f"QKClip tracks attention logits with attn_implementation 'eager' or 'sdpa'; "
                                 f"{layer.name} uses {impl!r}: load or build the model with attn_implementation='sdpa'")
            configs[id(config)] = (config, impl)
        return list(configs.values())

    def attach(self, optimizer: torch.optim.Optimizer) -> QKClip:
        """Clip after every ``optimizer.step()`` (a step post-hook); returns ``self``."""
        from ..optimizer.muon import Muon

        if not isinstance(optimizer, Muon):
            raise TypeError(f"QKClip.attach needs the hf_muon.Muon that trains the model, got {type(optimizer).__name__}")
        if self._hook is not None:
            raise RuntimeError("QKClip is already attached to an optimizer")
        self._optimizer = optimizer
        self._hook = optimizer.register_step_post_hook(self._after_step)
        self._pre_hook = optimizer.register_step_pre_hook(self._before_step)
        return self

    def detach(self) -> None:
        """Stop clipping and tracking; the model's attention implementation is restored."""
        if self._hook is not None:
            self._hook.remove()
            self._pre_hook.remove()
            self._hook = self._pre_hook = None
        for config, base in self._configs:
            config._attn_implementation = base
        for layer in self.layers:
            _TRACKED.pop(layer.module, None)

    @property
    def max_attention_logit(self) -> float | None:
        """The largest pre-softmax logit of any head in the last step (all ranks), before clipping;
        ``None`` before the first step, ``-inf`` if that step saw no training forward pass."""
        return None if self._last_max is None else float(self._last_max)

    @property
    def clipped_heads(self) -> int:
        """How many heads (over all layers) were clipped after the last step."""
        return 0 if self._last_clipped is None else int(self._last_clipped)

    def last_head_max_logits(self) -> list[Tensor]:
        """Per layer, each query head's largest logit in the last step (all ranks), before clipping."""
        return list(self._last_head_max)

    def head_max_logits(self) -> list[Tensor]:
        """Per layer, each query head's largest logit since the last step on this rank (``-inf``: none seen)."""
        return [self._maxima_of(i) for i in range(len(self.layers))]

    def _maxima_of(self, index: int) -> Tensor:
        m = self._maxima[index]
        if m is None:
            layer = self.layers[index]
            device = next(layer.module.parameters()).device
            m = torch.full((layer.num_heads,), float("-inf"), device=device)
        return m

    def _record(self, index: int, maxima: Tensor) -> None:
        current = self._maxima[index]
        self._maxima[index] = maxima if current is None else torch.maximum(current, maxima)
        self._seen_since_step = True

    @torch.no_grad()
    def _open_step(self) -> None:
        """Agree on every head's maximum (all ranks), then decide the scalings of this step."""
        maxima = [self._maxima_of(i) for i in range(len(self.layers))]
        device = maxima[0].device
        flat = torch.cat([m.to(device) for m in maxima])
        # the ranks the optimizer treats as one data-parallel job see different data: agree on the max
        # (Muon(distributed=False) means each rank trains alone)
        group = self._optimizer.process_group
        if self._optimizer.distributed and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        self._last_max = flat.max()
        over = flat > self.tau
        self._last_clipped = over.sum()
        gamma = torch.where(over, self.tau / flat, torch.ones_like(flat))
        self._last_head_max = list(flat.split([layer.num_heads for layer in self.layers]))
        pending, names = [], {}
        for layer, layer_gamma in zip(self.layers, gamma.split([layer.num_heads for layer in self.layers])):
            scalings, param_names = layer.scalings(layer_gamma)
            pending += scalings
            names.update({id(s.param): n for s, n in zip(scalings, param_names)})
        self._pending, self._pending_names = pending, names
        self._maxima = [None] * len(self.layers)
        self._seen_since_step = False

    def _check_still_tracking(self) -> None:
        """Refuse a step after the model's attention implementation was switched away from the tracking
        one (``model.set_attn_implementation``): nothing would be tracked or clipped any more."""
        for config, base in self._configs:
            if config._attn_implementation != ATTENTION_PREFIX + base:
                raise RuntimeError(
                    f"QKClip: the model's attention implementation was changed to {config._attn_implementation!r} "
                    "after QK-clip was attached, so no attention logit is tracked or clipped any more. Change it "
                    "before building the optimizer (or call clip.detach() first and attach a new QKClip)")

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._pending is None:  # a new step (ZeRO steps each group in turn): refuse it before it runs
            self._check_still_tracking()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if getattr(optimizer, "last_step_skipped", False):  # non-finite gradients: the step changes nothing
            return
        # DeepSpeed ZeRO calls step() once per param group (ZeRO-1/2) or sub-group (ZeRO-3), each time
        # with only that group's tensors: a step is open until every q/k tensor has been reached.
        if self._pending is not None and self._seen_since_step:
            missing = sorted(self._pending_names[id(s.param)] for s in self._pending)
            raise RuntimeError(
                f"QKClip: the optimizer's last step did not hold {', '.join(missing[:4])}"
                f"{' ...' if len(missing) > 4 else ''}: they are frozen, not in this optimizer, or held "
                "by a wrapper hf_muon cannot read (supported: one process, DDP, FSDP2, DeepSpeed ZeRO-1/2/3 "
                "with hf_muon.Muon). Train the query/key weights with the optimizer QKClip is attached to."
            )
        if self._pending is None:
            self._open_step()
        reached = scale_output_features(optimizer, self._pending)
        self._pending = [s for s in self._pending if id(s.param) not in reached] or None
