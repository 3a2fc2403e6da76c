"""``hf_muon.Muon``: Muon for hidden matrices and AdamW for the rest, in one ``torch.optim.Optimizer``.

The class is thin: argument checks, state creation and dispatch. The arithmetic lives in the pure
functions :func:`muon_update` (momentum -> Nesterov blend -> batched Newton–Schulz -> scaled
update) and torch's own functional AdamW, so the AdamW half is bit-for-bit ``torch.optim.AdamW``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import warnings
import weakref
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim.adam import adam as functional_adam
from torch.optim.optimizer import Optimizer, _get_scalar_dtype

from ..distributed.exchange import DEFAULT_BUCKET_BYTES, ExchangeStats
from ..distributed.providers import FlatPartition, bind_partition, describe_providers, owned_by_a_backend
from ..distributed.layout import TensorLayout, with_blocks
from ..distributed.rates import LinkRates, measure_link_rates
from ..distributed.sharding import (MeasuredFlopsPerByte, all_ranks_agree, exchange_over, group_ranks, is_dtensor,
                                   local, make_exchange)
from ..kernels.newton_schulz import (DEFAULT_NS_PRECONDITION, NS_COEFFICIENT_SETS, check_precondition,
                                     default_ns_steps, orthogonalize)
from ..models.fused import (NS_SPLITS, Blocks, block_shapes, fused_blocks, unknown_fused_looking,
                            unknown_layout_warning)
from .groups import build_param_groups, module_behind, read_stacked, validate_group
from .param_split import MUON, shape_of, split_change_hint, split_parameters, stored_in_by_out, unwrap
from .shards import PendingState
from .summary import describe_optimizer
from .telemetry import Stopwatch, StepFigures, Telemetry

logger = logging.getLogger("hf_muon")

# (blended local pieces, Newton–Schulz on whole tensors given with their indices) -> orthogonalized local pieces
Exchange = Callable[[list[Tensor], Callable[[list[Tensor], list[int]], list[Tensor]]], list[Tensor]]
# orthogonalize's signature: (G [..., rows, cols], steps, coefficients, dtype) -> orthogonalized G in dtype;
# a function that also takes the keyword ``precondition`` is given the group's ns_precondition
OrthogonalizeFn = Callable[[Tensor, int, str, torch.dtype], Tensor]


def _inspect_precondition(fn: Callable) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C extension without a signature: the old contract
        return False
    return any(p.name == "precondition" or p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters)


_cached_precondition = functools.lru_cache(maxsize=64)(_inspect_precondition)


def takes_precondition(fn: Callable) -> bool:
    """Whether ``fn`` (an ``orthogonalize_fn``) accepts the keyword ``precondition``; functions written
    for the 4-argument signature ``(G, steps, coefficients, dtype)`` do not and are called without it.
    Asked at every Newton–Schulz batch, so each (hashable) function is inspected once."""
    try:
        return _cached_precondition(fn)
    except TypeError:  # an unhashable callable
        return _inspect_precondition(fn)


def with_precondition(fn: OrthogonalizeFn | None, precondition: str) -> OrthogonalizeFn:
    """``fn`` (``None``: :func:`hf_muon.kernels.orthogonalize`) with ``precondition`` bound when it takes
    that keyword; a 4-argument function is returned as it is for the default preconditioner and refused
    for another (it could not honour it)."""
    fn = fn if fn is not None else orthogonalize
    if fn is orthogonalize or takes_precondition(fn):
        return functools.partial(fn, precondition=precondition)
    if precondition != DEFAULT_NS_PRECONDITION:
        raise ValueError(f"ns_precondition={precondition!r} needs an orthogonalize_fn that takes the keyword "
                         f"'precondition'; {fn!r} has the 4-argument signature: add the keyword or leave "
                         f"ns_precondition at {DEFAULT_NS_PRECONDITION!r}")
    return fn

ADJUST_LR_RULES = ("match_rms_adamw", "original")
_NS_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
              "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float64": torch.float64,
              "fp64": torch.float64}
_FLOATING = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # what ns_dtype and comm_dtype take


def ns_dtype_name(ns_dtype: torch.dtype | str | None) -> str | None:
    """``ns_dtype`` as param groups keep it: a name (``torch.float32`` -> ``"float32"``), since a
    ``torch.dtype`` in a group breaks ``torch.distributed.checkpoint``'s full optimizer state dict."""
    return str(ns_dtype).removeprefix("torch.") if isinstance(ns_dtype, torch.dtype) else ns_dtype


def lr_scale(rows: int, cols: int, rule: str) -> float:
    """Factor on the learning rate for a ``rows x cols`` orthogonalized update, ``rows`` its outputs.

    ``match_rms_adamw`` (Moonshot): ``0.2 * sqrt(max(rows, cols))`` gives the update the RMS an
    AdamW update has, so AdamW's lr and weight decay carry over. ``original`` (Keller Jordan):
    ``sqrt(max(1, rows / cols))``, fan-out over fan-in.
    """
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"adjust_lr must be one of {ADJUST_LR_RULES}, got {rule!r}")


def as_matrices(t: Tensor, stacked: bool) -> Tensor:
    """View ``t`` as ``[n, rows, cols]``: a stack of experts keeps its leading dims as the batch,
    anything else (a matrix, a convolution kernel) is one ``out x (in * kernel)`` matrix."""
    if stacked:  # sizes spelled out (no -1): a tensor with a zero dimension has no inferable one
        return t.reshape(math.prod(t.shape[:-2]), t.shape[-2], t.shape[-1])
    return t.reshape(1, t.shape[0], math.prod(t.shape[1:]))


@functools.cache
def cpu_multiplies_bf16_natively() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX), which make oneDNN's
    bf16 matmul faster than fp32 (2.5x on a 2-core AVX512-BF16 EPYC). Without them torch emulates
    bf16 matmuls, several times slower than fp32."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_ns_dtype(ns_dtype: torch.dtype | str | None, device: torch.device | None = None) -> torch.dtype:
    """The dtype Newton–Schulz runs in. ``None`` is the dtype policy: bfloat16 on accelerators (as
    ``torch.optim.Muon``) and on CPUs with native bf16 matmul (see
    :func:`cpu_multiplies_bf16_natively`), float32 on other CPUs. Strings come from ``--optim_args``."""
    if ns_dtype is None:
        if device is not None and device.type == "cpu" and not cpu_multiplies_bf16_natively():
            return torch.float32
        return torch.bfloat16
    if isinstance(ns_dtype, str):
        if ns_dtype not in _NS_DTYPES:
            raise ValueError(f"ns_dtype must be one of {sorted(_NS_DTYPES)} or a torch dtype, got {ns_dtype!r}")
        return _NS_DTYPES[ns_dtype]
    if ns_dtype not in _FLOATING:
        raise ValueError(f"ns_dtype must be a floating dtype, got {ns_dtype}")
    return ns_dtype


def plan_ns_dtype(ns_dtype: torch.dtype | str | None) -> torch.dtype:
    """The Newton–Schulz dtype the owner plan costs. Every rank must plan alike, so the policy
    (``None``) is costed as on an accelerator (bfloat16), never from this host's CPU features: two
    machines with different CPUs would otherwise plan different owners and mismatch collectives."""
    return resolve_ns_dtype(ns_dtype)


def orthogonalize_all(
    updates: list[Tensor], stacked: bool, steps: int, coefficients: str, ns_dtype: torch.dtype | str | None,
    orthogonalize_fn: OrthogonalizeFn | None = None, blocks: list[Blocks | None] | None = None,
    block_scales: list[list[float] | None] | None = None, weights: list[float] | None = None,
    record: Callable[[Tensor, list[float]], None] | None = None,
    precondition: str = DEFAULT_NS_PRECONDITION,
) -> list[Tensor]:
    """Newton–Schulz of every update, one batched call per (shape, device), in the NS dtype.

    ``orthogonalize_fn`` (default :func:`hf_muon.kernels.orthogonalize`) runs on each batch, given
    ``precondition`` if it takes that keyword (see :func:`takes_precondition`). An update
    with ``blocks[i]`` (a fused projection) is orthogonalized block by block and reassembled, each
    block times ``block_scales[i][k]`` (its learning-rate scale relative to the tensor's; float32 then).
    ``record(batch, row_weights)`` sees each batch Newton–Schulz returned, with a weight per matrix:
    ``weights[i]`` of its update times its block's relative scale squared (telemetry)."""
    fn = with_precondition(orthogonalize_fn, precondition)
    mats: list[Tensor] = []  # each update's matrices in order: one (or a stack), or one (a stack) per block
    block_shapes_: list[torch.Size] = []  # each block's shape, to put it back (a stack's block is a stack)
    mat_weights: list[float] = []
    for i, u in enumerate(updates):
        cut = blocks[i] if blocks is not None else None
        parts = cut.split(u) if cut is not None else [u]
        mats.extend(as_matrices(part, stacked) for part in parts)
        block_shapes_.extend(part.shape for part in parts)
        if record is not None:
            relative = (block_scales[i] if block_scales is not None else None) or [1.0] * len(parts)
            mat_weights.extend(weights[i] * r * r for r in relative)
    buckets: dict[tuple, list[int]] = {}
    for j, m in enumerate(mats):
        buckets.setdefault((tuple(m.shape[1:]), m.device), []).append(j)
    ortho_mats: list[Tensor] = [None] * len(mats)  # type: ignore[list-item]
    for (shape, device), indices in buckets.items():
        dtype = resolve_ns_dtype(ns_dtype, device)
        # stacked straight into the Newton–Schulz dtype (updates of any dtype share a batch): one
        # copy, not a cat and then a cast
        batch = torch.empty(sum(mats[j].shape[0] for j in indices), *shape, dtype=dtype, device=device)
        torch.cat([mats[j] for j in indices], out=batch)
        ortho = fn(batch, steps, coefficients, dtype)
        if record is not None:
            record(ortho, [mat_weights[j] for j in indices for _ in range(mats[j].shape[0])])
        for j, piece in zip(indices, ortho.split([mats[j].shape[0] for j in indices])):
            ortho_mats[j] = piece
    out: list[Tensor] = []
    j = 0
    for i, u in enumerate(updates):
        cut = blocks[i] if blocks is not None else None
        if cut is None:
            out.append(ortho_mats[j].reshape(u.shape))
            j += 1
            continue
        n = len(cut.segments)
        parts = [m.reshape(shape) for m, shape in zip(ortho_mats[j: j + n], block_shapes_[j: j + n])]
        scales = block_scales[i] if block_scales is not None else None
        if scales is not None and any(s != 1.0 for s in scales):
            parts = [part.float() * s for part, s in zip(parts, scales)]
        out.append(cut.join(parts, torch.empty(u.shape, dtype=parts[0].dtype, device=u.device)))
        j += n
    return out


def block_lr_scales(shape: tuple[int, ...], blocks: Blocks, rule: str,
                    in_by_out: bool = False) -> tuple[float, list[float] | None]:
    """A fused tensor's learning-rate scale (its first block's) and each block's relative to it
    (``None`` when all blocks share it): each block is a matrix of its own shape (``in_by_out``: the
    tensor is stored ``[in, out]``, as transformers' ``Conv1D``)."""
    shapes = [(cols, rows) if in_by_out else (rows, cols) for rows, cols in blocks.shapes(shape)]
    scales = [lr_scale(rows, cols, rule) for rows, cols in shapes]
    relative = [s / scales[0] for s in scales]
    return scales[0], (relative if any(r != 1.0 for r in relative) else None)


class MuonUpdate:
    """One Muon step on a list of tensors, cut where an exchange may come in: :meth:`prepare` moves the
    momentum and blends it (element-wise), :func:`orthogonalize_updates` runs the Newton–Schulz of one
    or more updates (locally or through one exchange), and :meth:`apply` adds the result to the
    parameters. :func:`muon_update` runs the three for one update."""

    def __init__(self, params: list[Tensor], blended: list[Tensor], scales: list[float],
                 relative: list[list[float] | None], settings: dict[str, Any], blocks: list[Blocks | None],
                 figures: StepFigures | None) -> None:
        self.params, self.blended, self.scales, self.relative = params, blended, scales, relative
        self.settings, self.blocks, self.figures = settings, blocks, figures
        # updates with equal keys run their Newton–Schulz in shared batches
        names = ("stacked", "ns_steps", "ns_coefficients", "ns_dtype", "ns_precondition")
        self.ns_key = (*(settings[k] for k in names), id(settings["orthogonalize_fn"]))

    @classmethod
    def prepare(
        cls, params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor], *, lr: float,
        weight_decay: float, momentum: float, nesterov: bool, ns_steps: int, ns_coefficients: str,
        ns_dtype: torch.dtype | str | None, adjust_lr: str, stacked: bool,
        ns_precondition: str = DEFAULT_NS_PRECONDITION, shapes: list[tuple[int, ...]] | None = None,
        orthogonalize_fn: OrthogonalizeFn | None = None, blocks: list[Blocks | None] | None = None,
        figures: StepFigures | None = None, in_by_out: list[bool] | None = None,
    ) -> "MuonUpdate":
        """Update the momentum buffers and blend them (see :func:`muon_update` for the arguments)."""
        shapes = shapes or [tuple(p.shape) for p in params]
        blocks = blocks if blocks is not None else [None] * len(params)
        in_by_out = in_by_out if in_by_out is not None else [False] * len(params)
        scales, relative = [], []
        for shape, cut, transposed in zip(shapes, blocks, in_by_out):
            if cut is None:
                _, rows, cols = as_matrices(torch.empty(shape, device="meta"), stacked).shape
                scales.append(lr_scale(*((cols, rows) if transposed else (rows, cols)), adjust_lr))
                relative.append(None)
            else:
                scale, rel = block_lr_scales(shape, cut, adjust_lr, transposed)
                scales.append(scale)
                relative.append(rel)
        if params:
            torch._foreach_lerp_(momentum_buffers, grads, 1 - momentum)
        blended = torch._foreach_lerp(grads, momentum_buffers, momentum) if nesterov and params else momentum_buffers
        settings = dict(lr=lr, weight_decay=weight_decay, ns_steps=ns_steps, ns_coefficients=ns_coefficients,
                        ns_dtype=ns_dtype, stacked=stacked, ns_precondition=ns_precondition,
                        orthogonalize_fn=orthogonalize_fn)
        return cls(params, list(blended), scales, relative, settings, blocks, figures)

    def apply(self, ortho: list[Tensor]) -> None:
        """Decay the parameters and add ``-lr * scale`` times their orthogonalized updates."""
        lr, weight_decay = self.settings["lr"], self.settings["weight_decay"]
        if not self.params:
            return
        if weight_decay != 0:
            torch._foreach_mul_(self.params, 1 - lr * weight_decay)
        # Same-scale tensors share one foreach call.
        by_scale: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
        for p, o, scale in zip(self.params, ortho, self.scales):
            ps, os_ = by_scale.setdefault(scale, ([], []))
            ps.append(p)
            os_.append(o.view(p.shape))
        # An update in another dtype (bf16 Newton–Schulz) is added as it is: add_ upcasts it inside the
        # kernel (for fp32 parameters bit-for-bit the cast-then-add result) without a full-size copy.
        for scale, (ps, os_) in by_scale.items():
            torch._foreach_add_(ps, os_, alpha=-lr * scale)


def _newton_schulz(which: list[tuple[MuonUpdate, int]], whole: list[Tensor]) -> list[Tensor]:
    """``whole[j]``, the whole tensor of update ``which[j][0]``'s tensor ``which[j][1]``, orthogonalized;
    all the updates share one ``ns_key``, so same-shape matrices of all of them share a batch. The
    first update's telemetry figures record them all (the figures are summed over updates)."""
    first = which[0][0]
    s, figures = first.settings, first.figures
    watch = Stopwatch(whole[0].device) if figures is not None else None
    out = orthogonalize_all(whole, s["stacked"], s["ns_steps"], s["ns_coefficients"], s["ns_dtype"],
                            s["orthogonalize_fn"], [u.blocks[i] for u, i in which], [u.relative[i] for u, i in which],
                            [(u.settings["lr"] * u.scales[i]) ** 2 for u, i in which],
                            figures.add_batch if figures else None, s["ns_precondition"])
    if watch is not None:
        figures.watches.append(watch.stop())
    return out


def orthogonalize_updates(updates: list[MuonUpdate], exchange: Exchange | None = None) -> list[list[Tensor]]:
    """Each update's blended tensors orthogonalized, each with its own update's settings: locally, or
    all of them through one ``exchange`` (one owner plan, one pipeline of collectives). Updates with
    the same Newton–Schulz settings share batches."""
    source = [(u, i) for u in updates for i in range(len(u.blended))]  # (update, its tensor) of each

    def newton_schulz(whole: list[Tensor], which: list[int]) -> list[Tensor]:
        out: list[Tensor] = [None] * len(which)  # type: ignore[list-item]
        by_settings: dict[tuple, list[int]] = {}
        for j, i in enumerate(which):
            by_settings.setdefault(source[i][0].ns_key, []).append(j)
        for positions in by_settings.values():
            done = _newton_schulz([source[which[j]] for j in positions], [whole[j] for j in positions])
            for j, o in zip(positions, done):
                out[j] = o
        return out

    blended = [b for u in updates for b in u.blended]
    ortho = exchange(blended, newton_schulz) if exchange is not None else (
        newton_schulz(blended, list(range(len(blended)))) if blended else [])
    out, start = [], 0
    for u in updates:
        out.append(ortho[start:start + len(u.blended)])
        start += len(u.blended)
    return out


def muon_update(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_steps: int,
    ns_coefficients: str,
    ns_dtype: torch.dtype | str | None,
    adjust_lr: str,
    stacked: bool,
    ns_precondition: str = DEFAULT_NS_PRECONDITION,
    shapes: list[tuple[int, ...]] | None = None,
    exchange: Exchange | None = None,
    orthogonalize_fn: OrthogonalizeFn | None = None,
    blocks: list[Blocks | None] | None = None,
    figures: StepFigures | None = None,
    in_by_out: list[bool] | None = None,
) -> None:
    """One Muon step on ``params`` in place (the functional form of :class:`Muon`'s Muon half).

    ``params``, ``grads`` and ``momentum_buffers`` may be this rank's pieces of larger tensors:
    then ``shapes`` gives the whole tensors' shapes and ``exchange`` orthogonalizes the blended
    pieces as whole tensors (see ``hf_muon.distributed``). Everything else is element-wise.
    ``orthogonalize_fn`` replaces :func:`hf_muon.kernels.orthogonalize` (same signature).
    ``blocks[i]`` cuts tensor ``i`` (a fused projection) into the matrices orthogonalized, each with
    the learning-rate scale of its own shape (see :mod:`hf_muon.models.fused`). ``in_by_out[i]``:
    tensor ``i`` is stored ``[in, out]`` (transformers' ``Conv1D``), so ``adjust_lr="original"``
    reads its fan-out from its columns. ``figures`` records what this rank orthogonalized (see
    :mod:`hf_muon.optimizer.telemetry`).
    """
    if not params:
        return
    update = MuonUpdate.prepare(
        params, grads, momentum_buffers, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
        ns_steps=ns_steps, ns_coefficients=ns_coefficients, ns_dtype=ns_dtype, adjust_lr=adjust_lr, stacked=stacked,
        ns_precondition=ns_precondition, shapes=shapes, orthogonalize_fn=orthogonalize_fn, blocks=blocks,
        figures=figures, in_by_out=in_by_out)
    update.apply(orthogonalize_updates([update], exchange)[0])


def _check_grad(p: Tensor) -> None:
    if torch.is_complex(p):
        raise ValueError("hf_muon.Muon does not support complex parameters")
    if p.grad.is_sparse:
        raise ValueError("hf_muon.Muon does not support sparse gradients (e.g. nn.Embedding(sparse=True)); use dense")


# the key under which state_dict() keeps each group's tensors' names in the model (see Muon.state_dict)
MODEL_NAMES = "hf_muon_param_names"


def _same_names(then: list[str], now: list[str]) -> bool:
    """The same tensors by name, one list maybe under a prefix the other lacks (a state saved through
    a wrapper, ``module.`` or ``_orig_mod.``, or from the optimizer of a submodule)."""
    return len(then) == len(now) and all(a == b or a.endswith("." + b) or b.endswith("." + a)
                                         for a, b in zip(then, now))


class Muon(Optimizer):
    """Muon for hidden weight matrices and AdamW for everything else, as one optimizer.

    A drop-in replacement for ``torch.optim.AdamW``::

        optimizer = Muon(model.parameters(), lr=1e-3, weight_decay=0.01)

    Hidden matrices (``nn.Linear``, transformers' ``Conv1D``, convolutions, stacked MoE experts
    inside the model body) get Muon: ``buf.lerp_(g, 1 - momentum)``, Nesterov blend
    ``g.lerp(buf, momentum)``, Newton–Schulz orthogonalization ``O``, then
    ``p *= 1 - lr * weight_decay`` and ``p -= lr * scale * O``. With ``adjust_lr="match_rms_adamw"``
    ``scale = 0.2 * sqrt(max(rows, cols))`` gives the update AdamW's RMS so AdamW's learning rate
    and weight decay carry over (see the README: the best value is often higher, about 10x on
    small models). Embeddings, output heads, norms, biases and scalars get ``torch.optim.AdamW``'s
    exact update, with ``adamw_lr`` (default ``lr``).

    Args:
        params: a module, ``model.parameters()``, ``model.named_parameters()``, tensors, or group
            dicts (a group may pin ``"algorithm": "muon" | "adamw"``; ``"stacked": True`` reads its tensors
            of 3 or more dimensions as stacks of matrices, MoE experts, where the model does not say so).
        lr: learning rate of both halves (AdamW's unless ``adamw_lr`` is set).
        weight_decay: decoupled weight decay, as in AdamW.
        momentum: Muon's momentum, in ``[0, 1)``.
        nesterov: use the Nesterov blend of gradient and momentum.
        ns_steps: Newton–Schulz iterations; ``None``: the preconditioner's default (5 for
            ``"frobenius"``, 4 for ``"aol"``), resolved when the group is added so groups hold ints.
            An explicit value is always used.
        ns_coefficients: ``"quintic"`` (Keller Jordan) or ``"polar_express"`` (Amsel et al.).
        ns_precondition: how each matrix is scaled before the iterations: ``"frobenius"`` (its
            Frobenius norm; the default) or ``"aol"`` (Turbo-Muon's row rescaling, one iteration
            fewer: 0.8x the products, but 1.06-1.28x the polar error of 5 Frobenius quintic steps on
            gradient-like matrices; see :func:`hf_muon.kernels.orthogonalize`).
        ns_dtype: dtype Newton–Schulz runs in (a torch dtype or its name; groups keep the name);
            ``None``: bfloat16 on accelerators and on CPUs with native bf16 matmul, float32 on other CPUs.
        adjust_lr: ``"match_rms_adamw"`` or ``"original"`` (``sqrt(max(1, fan_out / fan_in))``; a
            transformers ``Conv1D`` weight, stored ``[in, out]``, is read so where the model is known).
        betas, eps: AdamW's.
        adamw_lr: learning rate of the AdamW half; ``None`` means ``lr``.
        model: the model ``params`` come from, when it cannot be found from ``params`` itself.
        force_muon, force_adamw: regexes on parameter names that override the automatic split.
        foreach: passed to the AdamW half (``None``: torch's default).
        distributed: when ``torch.distributed`` runs with several ranks (DDP) or parameters are
            FSDP2 ``DTensor``s, orthogonalize each matrix once on an owner rank and share the result.
        bucket_bytes: cap on the whole-matrix bytes one exchange round gathers on owners.
        comm_dtype: dtype of updates on the wire (``torch.bfloat16`` or ``"bf16"`` halves the exchange
            traffic); ``None``: the widest of the updates' dtypes. Every rank, the owner too, applies
            the result as it came over the wire, so replicas stay equal bit for bit.
        overlap_exchange: pipeline the exchange with asynchronous collectives: its buckets (at least
            four, balanced in Newton–Schulz work per owner) travel to their owners while the previous
            bucket is orthogonalized and the one before returns, so traffic hides behind Newton–Schulz.
            ``False``: one bucket at a time (as few as ``bucket_bytes`` allows), the traffic and the
            work one after the other. Same results; the attribute may be changed between steps.
        exchange_flops_per_byte: Newton–Schulz FLOPs that take as long as one byte of exchange
            traffic on a rank's link (the NS FLOP rate over the link bandwidth; ``hf-muon plan``
            prints it for an accelerator and an interconnect). ``None`` (the default): a matrix that
            one rank holds whole is orthogonalized there, never moved. Given: such a matrix moves to a
            less-loaded rank when that shortens the step by this cost model (FSDP2 shards a stack of
            8 experts over its first 8 ranks only, which then run every expert's Newton–Schulz while
            the others idle), and under DDP, when the exchange does not pay, every rank
            orthogonalizes every matrix itself and nothing is exchanged (as with
            ``distributed=False``). ``"auto"``: measured at the first step that plans an exchange
            (the plan's Newton–Schulz products timed on this device, one bucket's all-to-all over the
            exchange's group, the slowest rank's times on every rank, so all ranks plan alike), once
            per process group, Newton–Schulz dtype and wire dtype; :attr:`link_rates` holds the
            figures and the log says the number to pass to plan the same without measuring. Same
            results either way; the attribute may be changed between steps.
        process_group: the ranks replicated (DDP) parameters are exchanged over; ``None``: the
            default world. FSDP2 ``DTensor``s use their mesh's group, and flat partitions a backend
            hands over (DeepSpeed ZeRO) that backend's group.
        orthogonalize_fn: Newton–Schulz with :func:`hf_muon.kernels.orthogonalize`'s signature
            ``(G, steps, coefficients, dtype) -> Tensor``; ``None``: that function. It is also given
            ``precondition=`` if it takes that keyword (needed for ``ns_precondition="aol"``). The
            owner plan still balances the default kernel's cost.
        ns_split: how fused projections (GPT-2's ``c_attn``, Phi-3's ``qkv_proj`` and ``gate_up_proj``,
            GPT-NeoX's ``query_key_value``, ...) are orthogonalized: ``"block"`` each logical matrix
            (q, k, v, gate, up) on its own, ``"head"`` attention projections per head (fused or not),
            ``"none"`` whole matrices. Read from the model (``Muon(model)``, ``model.parameters()``
            or ``model=``); see ``fused_blocks()`` and ``hf-muon inspect``.
        telemetry: record each step's figures for :meth:`telemetry` (the Trainer logs them): a few
            reductions per step, no host sync.
        qk_clip_tau: QK-clip (MuonClip): after each step, rescale the query and key weights of every
            attention head whose largest logit in the step's forward passes exceeded this
            (:class:`hf_muon.models.qk_clip.QKClip`; needs the model). ``None``: off.

    Attributes:
        skipped_steps: steps skipped because some gradient was not finite.
        exchange_stats: bytes this rank sent/received in the exchange and tensors it orthogonalized.
        link_rates: what ``exchange_flops_per_byte="auto"`` measured, one :class:`LinkRates` per
            process group, Newton–Schulz dtype and wire dtype (empty until then).
    """

    def __init__(
        self,
        params: nn.Module | Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int | None = None,
        ns_coefficients: str = "quintic",
        ns_dtype: torch.dtype | str | None = None,
        adjust_lr: str = "match_rms_adamw",
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adamw_lr: float | None = None,
        *,
        model: nn.Module | None = None,
        force_muon: str | None = None,
        force_adamw: str | None = None,
        foreach: bool | None = None,
        distributed: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        comm_dtype: torch.dtype | str | None = None,
        overlap_exchange: bool = True,
        exchange_flops_per_byte: float | str | None = None,
        process_group: dist.ProcessGroup | None = None,
        orthogonalize_fn: OrthogonalizeFn | None = None,
        ns_split: str = "block",
        telemetry: bool = True,
        qk_clip_tau: float | None = None,
        ns_precondition: str = DEFAULT_NS_PRECONDITION,
    ) -> None:
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
            ns_coefficients=ns_coefficients, ns_dtype=ns_dtype, adjust_lr=adjust_lr, betas=betas, eps=eps,
            foreach=foreach, stacked=False, ns_split=ns_split, ns_precondition=ns_precondition,
        )
        self._check_hyperparameters(defaults)
        defaults["ns_dtype"] = ns_dtype_name(ns_dtype)
        self._check_adamw_lr(adamw_lr)
        source_model = unwrap(model) if model is not None else module_behind(params)
        groups = build_param_groups(params, model, force_muon, force_adamw)
        self.adamw_lr = adamw_lr  # AdamW groups without an "lr" get it, those added later too
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self._check_exchange_flops_per_byte(exchange_flops_per_byte)
        comm_dtype = self._checked_comm_dtype(comm_dtype)
        self._check_process_group(process_group, distributed)
        if orthogonalize_fn is not None and not callable(orthogonalize_fn):
            raise TypeError(f"orthogonalize_fn must be callable like hf_muon.kernels.orthogonalize, got {orthogonalize_fn!r}")
        # Each group's own parameters, by the group's "matrices_index": a backend (DeepSpeed ZeRO)
        # may later swap a group's "params" for one flat partition, and these say which matrices it
        # stands for. Partitions are read by a registered layout provider (hf_muon.distributed.providers).
        self._group_tensors: list[list[Tensor]] = []
        self._group_tensor_ids: list[set[int]] = []
        self._backend_groups: set[int] = set()  # matrices_index of groups a backend holds as flat partitions
        # (matrices_index, data_ptr, numel) of each flat tensor seen -> (the flat, its partition)
        self._partitions: dict[tuple[int, int, int], tuple[Tensor, FlatPartition]] = {}
        # per flat partition and plan: (its exchange, its tensors' shapes, their blocks, their orientations)
        self._partition_exchanges: dict[tuple, tuple[Exchange, list, list, list]] = {}
        # per family of Muon groups of whole or FSDP2 tensors that share an exchange (see
        # _whole_tensors_step): (what its plan depends on, its exchange or None)
        self._group_exchanges: dict[tuple, tuple[tuple, Exchange | None]] = {}
        # state read from a portable checkpoint, put into flat partitions' state as step() creates it
        self._pending_state: PendingState | None = None
        # Fused projections' blocks, by the model tensor (see hf_muon.models.fused), and whether each
        # tensor is stored [in, out] (Conv1D); each group's lists follow _group_tensors. Without the
        # model nothing can be read: whole matrices stored [out, in]. The model is not kept alive.
        self._fused: dict[str, dict[int, tuple[str, Blocks]]] = {}
        self._source_model = weakref.ref(source_model) if source_model is not None else None
        self._group_blocks: list[list[Blocks | None]] = []
        self._group_in_by_out: list[list[bool]] = []
        self._model_tensors: set[int] = set()  # id of each model tensor when the tables were read
        self._in_by_out_ids: set[int] = set()
        self._unknown_layouts: dict[int, str] = {}  # fused-looking weights of modules with no known layout
        super().__init__(groups, defaults)
        self.distributed = distributed
        self.bucket_bytes = bucket_bytes
        self.comm_dtype = comm_dtype
        self.overlap_exchange = bool(overlap_exchange)
        self.exchange_flops_per_byte = exchange_flops_per_byte
        # Attributes, not group keys: a process group or a function would not survive state_dict().
        self.process_group = process_group
        self.orthogonalize_fn = orthogonalize_fn
        for group in self.param_groups:  # refused now, not at the first step
            with_precondition(orthogonalize_fn, group["ns_precondition"])
        self.skipped_steps = 0
        self.last_step_skipped = False  # step post-hooks (QK-clip) must leave a skipped step alone
        self.exchange_stats = ExchangeStats()
        # (group's ranks, device type, NS dtype, wire bytes per element) -> its measured rates
        self._link_rates: dict[tuple, LinkRates] = {}
        self.telemetry_enabled = telemetry
        self._telemetry = Telemetry()
        self.qk_clip = self._attach_qk_clip(source_model, qk_clip_tau) if qk_clip_tau is not None else None
        if logger.isEnabledFor(logging.INFO):
            line = describe_optimizer(self.param_groups, resolve_ns_dtype,
                                      lambda group: self._group_blocks[group["matrices_index"]])
            fused = self.fused_blocks()
            if fused:  # the fused projections cut into blocks (hf-muon inspect lists them)
                splits = sorted({g["ns_split"] for g in self.param_groups if g["algorithm"] == MUON})
                line += (f"; {len(fused)} fused tensors in {sum(len(b.segments) for b in fused.values())} blocks "
                         f"(ns_split={'/'.join(splits)})")
            logger.info(line)

    @staticmethod
    def _check_process_group(process_group: dist.ProcessGroup | None, distributed: bool) -> None:
        if process_group is None:
            return
        if not distributed:
            raise ValueError("process_group needs distributed=True (with distributed=False nothing is exchanged)")
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("process_group was given but torch.distributed is not initialized: "
                             "call torch.distributed.init_process_group first")
        if dist.get_rank(process_group) < 0:
            raise ValueError(f"this rank ({dist.get_rank()}) is not a member of process_group: create the optimizer "
                             "only on the ranks of its group, or pass a group that contains this rank")

    @staticmethod
    def _check_adamw_lr(adamw_lr: float | None) -> None:
        if adamw_lr is not None and not (isinstance(adamw_lr, (int, float)) and 0 <= adamw_lr < math.inf):
            raise ValueError(f"adamw_lr must be a finite number >= 0, got {adamw_lr!r}")

    @staticmethod
    def _check_hyperparameters(h: dict) -> None:
        if not (isinstance(h["lr"], (int, float)) and not isinstance(h["lr"], bool) and 0 <= h["lr"] < math.inf):
            raise ValueError(f"lr must be a finite number >= 0, got {h['lr']!r}")
        if not 0 <= h["weight_decay"] < math.inf:
            raise ValueError(f"weight_decay must be a finite number >= 0, got {h['weight_decay']}")
        if not 0 <= h["momentum"] < 1:
            raise ValueError(f"momentum must be in [0, 1), got {h['momentum']}")
        if h["ns_steps"] is not None and not (isinstance(h["ns_steps"], int) and not isinstance(h["ns_steps"], bool)
                                              and 1 <= h["ns_steps"] < 100):
            raise ValueError(f"ns_steps must be an integer in [1, 100) or None (the preconditioner's default), "
                             f"got {h['ns_steps']!r}")
        check_precondition(h.get("ns_precondition", DEFAULT_NS_PRECONDITION))
        if h["ns_coefficients"] not in NS_COEFFICIENT_SETS:
            raise ValueError(f"ns_coefficients must be one of {NS_COEFFICIENT_SETS}, got {h['ns_coefficients']!r}")
        if h.get("ns_split", "block") not in NS_SPLITS:
            raise ValueError(f"ns_split must be one of {NS_SPLITS}, got {h['ns_split']!r}")
        if h["adjust_lr"] not in ADJUST_LR_RULES:
            raise ValueError(f"adjust_lr must be one of {ADJUST_LR_RULES}, got {h['adjust_lr']!r}")
        resolve_ns_dtype(h["ns_dtype"])
        if not (isinstance(h["betas"], (tuple, list)) and len(h["betas"]) == 2):
            raise ValueError(f"betas must be a pair (beta1, beta2), each in [0, 1), got {h['betas']!r}")
        beta1, beta2 = h["betas"]
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise ValueError(f"betas must each be in [0, 1), got {h['betas']}")
        if not 0 <= h["eps"] < math.inf:
            raise ValueError(f"eps must be a finite number >= 0, got {h['eps']}")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; it must say ``"algorithm"`` unless all its tensors are below 2-D (AdamW). An AdamW
        group without ``"lr"`` gets ``adamw_lr`` when one was given. Where the groups carry parameter names
        (``Muon(model)``), the new one must too (``"param_names"``)."""
        if "algorithm" not in param_group:
            params = param_group["params"]
            params = [params] if isinstance(params, Tensor) else list(params)
            if any(p.ndim >= 2 for p in params):
                raise ValueError("a param group added after construction must set 'algorithm': 'muon' or 'adamw'")
            param_group = {**param_group, "params": params, "algorithm": "adamw"}
        if param_group["algorithm"] != MUON and "lr" not in param_group and getattr(self, "adamw_lr", None) is not None:
            param_group = {**param_group, "lr": self.adamw_lr}
        stacked_given = "stacked" in param_group
        if self.param_groups and ("param_names" in self.param_groups[0]) != ("param_names" in param_group):
            named = "param_names" in self.param_groups[0]
            raise ValueError("this optimizer's groups " + ("carry parameter names (Muon(model) names them): give the "
                             "new group 'param_names', one per tensor, as model.named_parameters() spells them"
                             if named else "have no parameter names: add the group without 'param_names'"))
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["algorithm"] == MUON and not stacked_given:  # a group added after construction
            model = self._read_model(group["params"])
            read_stacked(group, split_parameters(model).algorithm_of() if model is not None else None)
        validate_group(group)
        self._check_hyperparameters(group)
        group["ns_dtype"] = ns_dtype_name(group["ns_dtype"])
        if group["ns_steps"] is None:  # resolved once: the owner plan and checkpoints see an int
            group["ns_steps"] = default_ns_steps(group["ns_precondition"])
        group["matrices_index"] = len(self._group_tensors)
        self._group_tensors.append(list(group["params"]))
        self._group_tensor_ids.append({id(t) for t in group["params"]})
        self._group_blocks.append(self._blocks_of(group))
        self._group_in_by_out.append(self._in_by_out_of(group))

    def _attach_qk_clip(self, model: nn.Module | None, tau: float) -> Any:
        from ..models.qk_clip import QKClip

        if model is None:
            raise ValueError("qk_clip_tau needs the model (its attention layers are tracked): pass Muon(model, ...), "
                             "Muon(model.parameters(), ...) or Muon(params, model=model)")
        clip = QKClip(model, tau).attach(self)

        def figures() -> dict[str, float]:
            largest = clip.max_attention_logit
            return {"muon/max_attention_logit": math.nan if largest is None else largest,
                    "muon/clipped_heads": float(clip.clipped_heads)}

        self.add_telemetry_source(figures)
        return clip

    def _read_model(self, params: list[Tensor]) -> nn.Module | None:
        """The model (``None`` when not known or gone), its tables read again when ``params`` holds a
        tensor they have not seen (a group of tensors added to the model later)."""
        model = self._source_model() if self._source_model is not None else None
        if model is not None and not self._model_tensors.issuperset(map(id, params)):
            self._model_tensors = {id(p) for p in model.parameters()}
            self._in_by_out_ids = stored_in_by_out(model)
            self._fused = {split: {**table, **fused_blocks(model, split)} for split, table in self._fused.items()}
            self._unknown_layouts = unknown_fused_looking(model)
        return model

    def _blocks_of(self, group: dict, warn: bool = True) -> list[Blocks | None]:
        """The blocks of each of a new group's tensors (``None``: orthogonalized whole); ``warn``: name
        fused-looking weights hf_muon has no layout for."""
        model = self._read_model(group["params"])
        if group["algorithm"] != MUON or model is None:
            return [None] * len(group["params"])
        split = group["ns_split"]
        if split not in self._fused:
            self._fused[split] = fused_blocks(model, split)
        table = self._fused[split]
        unknown = [self._unknown_layouts[id(p)] for p in group["params"] if id(p) in self._unknown_layouts]
        if unknown and split != "none" and warn:
            warnings.warn(unknown_layout_warning(unknown), stacklevel=5)  # Muon(...) -> Optimizer.__init__ -> here
        return [table[id(p)][1] if id(p) in table else None for p in group["params"]]

    def _in_by_out_of(self, group: dict) -> list[bool]:
        """Whether each of a new group's tensors is stored ``[in, out]`` (transformers' ``Conv1D``,
        stacked experts used as ``x @ W[e]``)."""
        if group["algorithm"] != MUON or self._read_model(group["params"]) is None:
            return [False] * len(group["params"])
        return [id(p) in self._in_by_out_ids for p in group["params"]]

    def fused_blocks(self) -> dict[str, Blocks]:
        """``parameter name -> Blocks`` of every Muon tensor orthogonalized block by block."""
        names = {key: name for table in self._fused.values() for key, (name, _) in table.items()}
        found = {}
        for tensors, blocks in zip(self._group_tensors, self._group_blocks):
            for t, cut in zip(tensors, blocks):
                if cut is not None:
                    found[names.get(id(t), f"tensor of shape {tuple(t.shape)}")] = cut
        return found

    def _is_backend_flat(self, group: dict, t: Tensor) -> bool:
        """Whether ``t``, a tensor ``step()`` got for ``group``, is a flat buffer a backend put in place of
        the group's tensors (DeepSpeed ZeRO), rather than one of them, an FSDP2 shard of one, or a
        whole-tensor copy (DeepSpeed stage 0 in bf16/fp16 keeps fp32 copies of each tensor)."""
        index = group["matrices_index"]
        if t.ndim != 1 or id(t) in self._group_tensor_ids[index] or is_dtensor(t):
            return False
        if index not in self._backend_groups:  # ask the providers once the backend has shown up
            if not owned_by_a_backend(t, self._group_tensors[index]):
                return False
            self._backend_groups.add(index)
        return True

    def _held_by_backend(self, group: dict) -> bool:
        """Whether a backend holds ``group``'s tensors as flat partitions (ZeRO-3 even leaves ``params``
        empty between steps)."""
        params = group["params"]
        own = self._group_tensors[group["matrices_index"]]
        return bool(own) and (not params or any(self._is_backend_flat(group, p) for p in params))

    def model_tensors(self, group: dict) -> list[Tensor]:
        """The model's parameters ``group`` stands for (a backend may have swapped ``params`` for flat partitions)."""
        return self._group_tensors[group["matrices_index"]] if self._held_by_backend(group) else list(group["params"])

    def stepped_tensors(self, group: dict) -> list[Tensor]:
        """The tensors ``step()`` updates for ``group`` and keys its state by: the backend's flat partitions
        where one holds the group (ZeRO-3 leaves ``params`` empty between steps), else ``params``."""
        if self._held_by_backend(group):
            return [flat for key, (flat, _) in self._partitions.items() if key[0] == group["matrices_index"]]
        return list(group["params"])

    # torch.amp.GradScaler then calls step() even on an overflow (setting grad_scale/found_inf), so a
    # skipped step is seen here: counted in skipped_steps, and agreed on by all ranks of a sharded run.
    _step_supports_amp_scaling = True

    def _unscale_for_grad_scaler(self) -> None:
        """Divide gradients by the scale a ``GradScaler`` left on them (``self.grad_scale``, set only while
        it calls ``step()``; ``None`` once ``scaler.unscale_`` ran), with the scaler's own reciprocal."""
        scale = getattr(self, "grad_scale", None)
        if scale is None:
            return
        grads = [local(p.grad) for group in self.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, scale.double().reciprocal().float().to(grads[0].device))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.load_state_dict``, after checking the saved groups are this optimizer's
        split: the same algorithm per group and, where saved, the same parameter names (torch checks
        only group sizes, so another split of equal sizes would load momentum into the wrong tensors)."""
        saved = state_dict.get("param_groups", [])
        if len(saved) != len(self.param_groups):
            muon_names = [n for g, names in zip(self.param_groups, self._model_names()) if g["algorithm"] == MUON
                          for n in names or ()]
            raise ValueError(f"hf_muon.Muon.load_state_dict: the state has {len(saved)} param groups, this optimizer "
                             f"{len(self.param_groups)}: it was saved from another model or parameter split"
                             + split_change_hint(muon_names))

        def kinds(groups: list[dict]) -> list[tuple]:
            return [(g.get("algorithm"), len(g["params"])) for g in groups]

        was, now = kinds(saved), kinds(self.param_groups)
        if was != now and sorted(was, key=str) == sorted(now, key=str):
            # not matched up by names: a learning-rate scheduler's state keeps the groups' saved order
            raise ValueError("hf_muon.Muon.load_state_dict: the state holds the same param groups in another order "
                             f"({[k[0] for k in was]} when saved, {[k[0] for k in now]} now): Muon(model) puts the "
                             "Muon group first, Muon(model.parameters()) keeps the parameters' order. Build the "
                             "optimizer the way it was built when the state was saved")
        model_names = self._model_names()
        for i, (old, new) in enumerate(zip(saved, self.param_groups)):
            if old.get("algorithm", new["algorithm"]) != new["algorithm"]:
                raise ValueError(f"hf_muon.Muon.load_state_dict: group {i} was {old['algorithm']} when saved and is "
                                 f"{new['algorithm']} now: the parameter split changed (force_muon/force_adamw?)")
            # Muon(model.parameters()) has no "param_names": state_dict() writes the model's own names
            # beside every group; names given by the user are compared with names given by the user
            if "param_names" in old and "param_names" in new:
                names_then, names_now = old["param_names"], new["param_names"]
            else:
                names_then, names_now = old.get(MODEL_NAMES), model_names[i]
            if names_then is not None and names_now is not None and not _same_names(names_then, names_now):
                changed = sorted(set(names_then) ^ set(names_now))[:4]
                raise ValueError(f"hf_muon.Muon.load_state_dict: group {i} ({new['algorithm']}) holds other parameters "
                                 f"than when saved (e.g. {', '.join(changed) or 'another order'}): another model or split"
                                 + split_change_hint(set(names_then) ^ set(names_now)))
            for saved_id, p in zip(old["params"], new["params"]):
                for key, value in state_dict.get("state", {}).get(saved_id, {}).items():
                    if isinstance(value, Tensor) and value.ndim and tuple(value.shape) != tuple(p.shape):
                        raise ValueError(f"hf_muon.Muon.load_state_dict: group {i} ({new['algorithm']}) would put saved "
                                         f"{key!r} of shape {tuple(value.shape)} on a tensor of shape {tuple(p.shape)}: "
                                         "the state was saved from another model or parameter split")
        named = [("param_names" in g) for g in self.param_groups]
        indices = [g["matrices_index"] for g in self.param_groups]
        stacked = [g.get("stacked", False) for g in self.param_groups]
        super().load_state_dict(state_dict)
        changed_blocks = False
        for i, (group, had_names, index) in enumerate(zip(self.param_groups, named, indices)):
            # a group pinned to Muon without 'stacked' read a MoE's experts as one matrix before hf_muon read
            # the key from the model: its saved False is not a setting, the model's stacks stay stacks
            if group["algorithm"] == MUON and stacked[i] and not group.get("stacked", False):
                warnings.warn(f"hf_muon.Muon.load_state_dict: group {i} was saved orthogonalizing its stacked experts "
                              "as one matrix each ('stacked': False, as hf_muon did for a group pinned to 'muon' "
                              "without the key); each expert is orthogonalized on its own from now on", stacklevel=2)
            group["stacked"] = stacked[i] or group.get("stacked", False)
            # torch copies every saved key in: the index of this optimizer's own tensors stays, and groups
            # without names keep none
            group["matrices_index"] = index
            group.pop(MODEL_NAMES, None)
            if not had_names:
                group.pop("param_names", None)
            group.setdefault("ns_split", "none")  # written before ns_split existed: whole matrices
            # written before ns_precondition existed: those runs divided by the Frobenius norm
            group.setdefault("ns_precondition", "frobenius")
            group["ns_dtype"] = ns_dtype_name(group.get("ns_dtype"))  # saved as a torch.dtype before
            # the saved settings apply (as torch does for lr, betas, ...), ns_split too: cut again
            blocks = self._blocks_of({**group, "params": self._group_tensors[index]}, warn=False)
            changed_blocks |= blocks != self._group_blocks[index]
            self._group_blocks[index] = blocks
        if changed_blocks:  # plans were made for the old blocks
            self._group_exchanges.clear()
            self._partition_exchanges.clear()

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer.state_dict``; each group carries the model's names of its tensors where
        the model is known (``hf_muon_param_names``; ``Muon(model.parameters())`` has no
        ``"param_names"``), so that :meth:`load_state_dict` can refuse a state of another split."""
        state = super().state_dict()
        for saved, names in zip(state["param_groups"], self._model_names()):
            if names is not None:
                saved[MODEL_NAMES] = names
        return state

    def _model_names(self) -> list[list[str] | None]:
        """Per group, the model's names of its tensors (``None``: the model is unknown or gone, or a
        tensor is not the model's). Written for groups the user named too: a state of ``Muon(model)``
        is then checked against ``Muon(model.parameters())``, with no wrapper's prefix in either."""
        model = self._source_model() if self._source_model is not None else None
        if model is None:
            return [None] * len(self.param_groups)
        table = {id(p): n for n, p in model.named_parameters()}
        found = [[table.get(id(t)) for t in self._group_tensors[g["matrices_index"]]] for g in self.param_groups]
        return [None if None in names else names for names in found]  # type: ignore[misc]

    def _grads_finite(self) -> bool:
        """Refuse unsupported gradients up front, then check all are finite with one host sync."""
        flags, params = [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    _check_grad(p)
                    grad = local(p.grad)
                    if grad.numel() and not grad.is_meta:  # a ZeRO-3 rank may hold none of a tensor
                        # one pass, no temporaries (isfinite().all() takes four): NaN propagates
                        # through min and max, and an infinity is one of them
                        flags += torch.aminmax(grad)
                    params.append(p)
        finite = bool(torch.stack(flags).isfinite().all()) if flags else True
        # sharded gradients: every rank must skip the same steps, or collectives would not match. Over
        # the DTensors' mesh where there are any: a plain tensor beside them (a learned scalar in an
        # AdamW group) is on every rank of it
        sharded = [p for p in params if is_dtensor(p)]
        return all_ranks_agree(finite, sharded or params, self.process_group) if self.distributed and params else finite

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One optimization step. A step whose gradients are not all finite changes nothing
        (parameters, momentum, AdamW moments, step counts) and is counted in ``skipped_steps``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._unscale_for_grad_scaler()
        if len(self.param_groups) == len(self._group_tensors) and not any(map(self._held_by_backend, self.param_groups)):
            self._telemetry.new_step()  # one call is the whole step (ZeRO calls step() per group or part)
        self.last_step_skipped = not self._grads_finite()
        if self.last_step_skipped:
            self.skipped_steps += 1
            warnings.warn(f"hf_muon.Muon skipped a step with non-finite gradients ({self.skipped_steps} so far)")
            return loss
        whole: list[tuple[dict, list[Tensor], list[Blocks | None], list[bool]]] = []
        for group in self.param_groups:
            self._telemetry.lrs[group["matrices_index"]] = group["lr"]
            if group["algorithm"] != MUON:
                self._adamw_group_step(group)
                continue
            with_grad = [p for p in group["params"] if p.grad is not None]
            if with_grad and with_grad[0].ndim == 1:
                self._flat_partition_step(group, with_grad)
            else:
                index = group["matrices_index"]
                has_grad = [p.grad is not None for p in group["params"]]
                whole.append((group, with_grad,
                              [cut for cut, kept in zip(self._group_blocks[index], has_grad) if kept],
                              [t for t, kept in zip(self._group_in_by_out[index], has_grad) if kept]))
        self._whole_tensors_step(whole)
        return loss

    def _whole_tensors_step(self, groups: list[tuple[dict, list[Tensor], list[Blocks | None], list[bool]]]) -> None:
        """The Muon groups of whole or FSDP2 tensors (with the tensors that have gradients, their
        blocks and orientations). Groups whose owner plans cost alike (same process group,
        Newton–Schulz steps and dtype; stacked experts or not) share one exchange: one plan and one
        pipeline of collectives for all of them. Groups one after another would each wait for their
        busiest owner, so one group per layer (per-layer learning rates) of Llama-3-8B at 64 ranks
        would put 123 TFLOP of Newton–Schulz on the step's critical path instead of 8. In one process
        they share Newton–Schulz batches the same way."""
        families: dict[tuple, list[tuple[dict, list[Tensor], list[Blocks | None], list[bool]]]] = {}
        for group, with_grad, blocks, in_by_out in groups:
            for p in with_grad:
                if p.ndim < 2:
                    raise RuntimeError(
                        f"hf_muon.Muon's Muon group received a {p.ndim}-D tensor of {p.numel()} elements where it "
                        "expects matrices: something flattened the parameters that is neither DeepSpeed ZeRO "
                        "(stages 1-3) nor FSDP2. Wrap the model with one of those, or with DDP."
                    )
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            # the mesh by value: each fully_shard call without mesh= makes a new mesh object, so units
            # sharded that way hold equal meshes that are different objects: one family
            mesh = next((p.device_mesh for p in with_grad if is_dtensor(p)), None)
            if mesh is not None and not self.distributed and mesh.size() > 1:
                raise ValueError("hf_muon.Muon(distributed=False) cannot run under FSDP2 with several ranks: each rank "
                                 "holds only pieces of the matrices, and Newton–Schulz of a piece is not a piece of "
                                 "the whole's. Leave distributed=True.")
            family = (group["ns_steps"], plan_ns_dtype(group["ns_dtype"]), mesh)
            families.setdefault(family, []).append((group, with_grad, blocks, in_by_out))
        for family, members in families.items():
            tensors = [p for _, with_grad, *_ in members for p in with_grad]
            exchange = self._exchange_for(family, members, tensors) if self.distributed and tensors else None
            replicated = (exchange is None and dist.is_available() and dist.is_initialized()
                          and dist.get_world_size() > 1)
            self._apply_muon(
                [(group, [local(p) for p in with_grad], [local(p.grad) for p in with_grad],
                  [local(self.state[p]["momentum_buffer"]) for p in with_grad], [tuple(p.shape) for p in with_grad],
                  blocks, in_by_out, (group["matrices_index"], None)) for group, with_grad, blocks, in_by_out in members],
                exchange, replicated,
            )

    @staticmethod
    def _checked_comm_dtype(comm_dtype: torch.dtype | str | None) -> torch.dtype | None:
        """``comm_dtype`` as a floating torch dtype (names as for ``ns_dtype``), or ``None``."""
        if comm_dtype is None:
            return None
        dtype = _NS_DTYPES.get(comm_dtype) if isinstance(comm_dtype, str) else comm_dtype
        if dtype not in _FLOATING:
            raise ValueError(f"comm_dtype must be None (the widest of the updates' dtypes), a floating torch dtype "
                             f"or one of {sorted(_NS_DTYPES)}, got {comm_dtype!r}")
        return dtype

    @staticmethod
    def _check_exchange_flops_per_byte(value: float | str | None) -> None:
        if value is None or value == "auto":
            return
        if isinstance(value, str) or not 0 < value < math.inf:
            raise ValueError(f"exchange_flops_per_byte must be a positive number (your accelerator's Newton–Schulz "
                             f"FLOP/s over your link's bytes/s; hf-muon plan prints it), \"auto\" (measured at the "
                             f"first step) or None, got {value!r}")

    @property
    def link_rates(self) -> list[LinkRates]:
        """What ``exchange_flops_per_byte="auto"`` measured so far, in the order it was measured."""
        return list(self._link_rates.values())

    def _flops_per_byte(self, group: dict, device: torch.device) -> float | MeasuredFlopsPerByte | None:
        """``exchange_flops_per_byte`` for an exchange of ``group``'s tensors on ``device``: the
        setting, or for ``"auto"`` what measures it when the exchange is planned (a collective over
        the exchange's group, which every rank plans at the same step). Measured once per group and
        dtypes, logged and kept in :attr:`link_rates`. What is timed is Newton–Schulz in the dtype it
        runs in on ``device``, not the plan's."""
        if self.exchange_flops_per_byte != "auto":
            return self.exchange_flops_per_byte
        ns_steps, ns_dtype = group["ns_steps"], resolve_ns_dtype(group["ns_dtype"], device)

        def measured(layouts: list[TensorLayout], over: dist.ProcessGroup | None, world: int,
                     wire_itemsize: int) -> float | None:
            if world < 2:
                return None  # nothing to exchange, nothing to measure
            key = (tuple(group_ranks(over)), device.type, ns_dtype, wire_itemsize)
            if key not in self._link_rates:
                rates = measure_link_rates(layouts, over, world, ns_steps, ns_dtype, wire_itemsize, self.bucket_bytes,
                                           device)
                self._link_rates[key] = rates
                if dist.get_rank() == rates.ranks[0]:
                    logger.info("exchange rates measured over %d ranks: Newton–Schulz %.3g TFLOP/s in %s, all-to-all "
                                "%.3g GB/s per rank: exchange_flops_per_byte=%.4g (pass it to skip the measurement)",
                                len(rates.ranks), rates.ns_flops_per_s / 1e12, str(ns_dtype).replace("torch.", ""),
                                rates.link_bytes_per_s / 1e9, rates.flops_per_byte)
            return self._link_rates[key].flops_per_byte

        return measured

    def _exchange_for(self, family: tuple, members: list[tuple[dict, list[Tensor], list[Blocks | None], list[bool]]],
                      tensors: list[Tensor]) -> Exchange | None:
        """The exchange for a family of groups' tensors that have gradients (``members`` as
        :meth:`_whole_tensors_step` has them; ``tensors``: theirs in order), planned again only when
        what the plan depends on changes (the tensors, the settings): planning every step cost
        tenths of a second at scale."""
        group = members[0][0]
        stacked = [g["stacked"] for g, with_grad, *_ in members for _ in with_grad]
        blocks = [block_shapes(tuple(p.shape), cut)
                  for _, with_grad, cuts, _ in members for p, cut in zip(with_grad, cuts)]
        plan_dtype = plan_ns_dtype(group["ns_dtype"])
        depends_on = (tuple((id(p), tuple(p.shape), is_dtensor(p), s, b) for p, s, b in zip(tensors, stacked, blocks)),
                      group["ns_steps"], plan_dtype, self.bucket_bytes, self.comm_dtype, self.overlap_exchange,
                      self.exchange_flops_per_byte, self.process_group, id(self.exchange_stats))
        planned = self._group_exchanges.get(family)
        if planned is None or planned[0] != depends_on:
            exchange = make_exchange(tensors, stacked, group["ns_steps"], self.exchange_stats, self.bucket_bytes,
                                     self.comm_dtype, plan_dtype, self.process_group, overlap=self.overlap_exchange,
                                     flops_per_byte=self._flops_per_byte(group, local(tensors[0]).device),
                                     blocks=blocks)
            planned = self._group_exchanges[family] = (depends_on, exchange)
        return planned[1]

    def _flat_partition_step(self, group: dict, flats: list[Tensor]) -> None:
        """A backend (DeepSpeed ZeRO) handed over flat partitions: update each matrix's piece in place.

        Where the pieces sit is read once per partition by a registered layout provider."""
        for flat in flats:
            part = self._partition_of(group, flat)
            key = (group["matrices_index"], flat.data_ptr(), flat.numel())
            state = self.state[flat]  # state shaped like the tensor step() got, as backends expect
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(flat)
                self._fill_pending(flat, part)

            def pieces(t: Tensor) -> list[Tensor]:
                return [t.narrow(0, offset, length) for offset, length in part.spans]

            # The layout never changes, so neither do the owner plan, the shapes and the blocks: read them once.
            plan_dtype = plan_ns_dtype(group["ns_dtype"])
            plan_key = (*key, group["ns_steps"], plan_dtype, self.overlap_exchange, self.bucket_bytes,
                        self.comm_dtype, self.exchange_flops_per_byte, id(self.exchange_stats))
            if plan_key not in self._partition_exchanges:
                blocks, in_by_out = self._partition_forms(group, part)
                layouts = with_blocks(list(part.layouts), [block_shapes(layout.shape, cut)
                                                           for layout, cut in zip(part.layouts, blocks)])
                self._partition_exchanges[plan_key] = (
                    exchange_over(layouts, part.group, part.rank, part.world, group["ns_steps"],
                                  self.exchange_stats, self.bucket_bytes, self.comm_dtype, plan_dtype,
                                  self.overlap_exchange, self._flops_per_byte(group, flat.device)),
                    [layout.shape for layout in part.layouts], blocks, in_by_out)
            exchange, shapes, blocks, in_by_out = self._partition_exchanges[plan_key]
            self._apply_muon([(group, pieces(flat), pieces(flat.grad), pieces(state["momentum_buffer"]), shapes,
                               blocks, in_by_out, key)], exchange)

    def _partition_of(self, group: dict, flat: Tensor) -> FlatPartition:
        """The partition ``flat`` (a backend's flat tensor standing in for the group's tensors) is,
        read once by a registered layout provider and remembered (checkpoints enumerate them)."""
        key = (group["matrices_index"], flat.data_ptr(), flat.numel())
        if key not in self._partitions:  # every rank binds at the same step: a provider may all-gather
            matrices = self._group_tensors[group["matrices_index"]]
            self._partitions[key] = (flat, self._bind(flat, matrices, group.get("stacked", False)))
        return self._partitions[key][1]

    def _fill_pending(self, flat: Tensor, part: FlatPartition) -> None:
        """State just created for ``flat``: copy in what a portable checkpoint holds for its tensors."""
        if self._pending_state is not None:
            self._pending_state.fill_partition(self.state[flat], part)

    def _bind(self, flat: Tensor, matrices: list[Tensor], stacked: bool) -> FlatPartition:
        part = bind_partition(flat, matrices, stacked)
        if part is None:
            names, supported = describe_providers()
            raise RuntimeError(
                f"hf_muon.Muon's Muon group received a flat tensor of {flat.numel()} elements that no {names} "
                "bookkeeping describes (a wrapper that flattens parameters and that hf_muon does not support)"
                + (f"; supported: {supported}" if supported else "")
            )
        if part.world > 1 and not self.distributed:
            raise ValueError(f"hf_muon.Muon(distributed=False) cannot run under {part.backend} with several "
                             "ranks: each rank holds only pieces of the matrices. Leave distributed=True.")
        if self.process_group is not None and group_ranks(self.process_group) != group_ranks(part.group):
            raise ValueError(f"process_group (ranks {group_ranks(self.process_group)}) differs from the group "
                             f"{part.backend} partitions over (ranks {group_ranks(part.group)}); under "
                             f"{part.backend} leave process_group unset: its own group is used")
        return part

    def _partition_forms(self, group: dict, part: FlatPartition) -> tuple[list[Blocks | None], list[bool]]:
        """The blocks and the orientation (stored ``[in, out]``) of each tensor of a flat partition, found
        by the model parameter it is."""
        index = group["matrices_index"]
        tensors = self._group_tensors[index]
        blocks = {id(t): cut for t, cut in zip(tensors, self._group_blocks[index])}
        in_by_out = {id(t): transposed for t, transposed in zip(tensors, self._group_in_by_out[index])}
        if not part.params:
            unreadable = "fused projections cannot be cut in blocks; pass ns_split='none'" if any(blocks.values()) \
                else "Conv1D weights cannot be read [in, out]; pass adjust_lr='match_rms_adamw'" \
                if group["adjust_lr"] == "original" and any(in_by_out.values()) else None
            if unreadable:
                raise RuntimeError(f"hf_muon.Muon: {part.backend}'s partition does not say which parameters it holds, "
                                   f"so {unreadable}")
            return [None] * len(part.layouts), [False] * len(part.layouts)
        return [blocks.get(id(p)) for p in part.params], [in_by_out.get(id(p), False) for p in part.params]

    def _apply_muon(self, members: list[tuple[dict, list, list, list, list, list[Blocks | None], list[bool], tuple]],
                    exchange: Exchange | None, replicated: bool = False) -> None:
        """Muon steps of one or more groups, each ``(group, params, grads, buffers, shapes, blocks,
        in_by_out, figures key)``, their Newton–Schulz through ``exchange`` together (or locally)."""
        updates = []
        for group, params, grads, buffers, shapes, blocks, in_by_out, key in members:
            figures = self._telemetry.begin(key) if self.telemetry_enabled else None
            if figures is not None:
                figures.replicated = replicated
            updates.append(MuonUpdate.prepare(
                params, grads, buffers, lr=group["lr"], weight_decay=group["weight_decay"],
                momentum=group["momentum"], nesterov=group["nesterov"], ns_steps=group["ns_steps"],
                ns_coefficients=group["ns_coefficients"], ns_dtype=group["ns_dtype"], adjust_lr=group["adjust_lr"],
                stacked=group["stacked"], ns_precondition=group["ns_precondition"], shapes=shapes,
                orthogonalize_fn=self.orthogonalize_fn, blocks=blocks, figures=figures, in_by_out=in_by_out))
        stats = self.exchange_stats
        sent = stats.bytes_sent + stats.bytes_received
        for update, ortho in zip(updates, orthogonalize_updates(updates, exchange)):
            update.apply(ortho)
        if updates and updates[0].figures is not None:  # the shared exchange's bytes, counted once
            updates[0].figures.exchange_bytes = stats.bytes_sent + stats.bytes_received - sent

    def telemetry(self) -> dict[str, float]:
        """The last step's figures: ``muon/update_rms`` and ``muon/adamw_update_rms`` (RMS of each half's
        update over the tensors it updated, weight decay aside; 0 after a skipped step), ``muon/lr`` and
        ``muon/adamw_lr`` (first group of each), ``muon/ns_ms`` (the slowest rank's Newton–Schulz time),
        ``muon/exchange_bytes`` (sent + received per rank), ``muon/skipped_steps``, and what attached
        features add (e.g. ``muon/max_attention_logit``).

        In a multi-rank run this reduces over the ranks: call it on every rank (the Trainer does, at
        each logging step). Raises if the optimizer was built with ``telemetry=False``."""
        if not self.telemetry_enabled:
            raise RuntimeError("hf_muon.Muon(telemetry=False) records nothing; build it with telemetry=True")
        return self._telemetry.read(self, self.process_group)

    def add_telemetry_source(self, source: Callable[[], dict[str, float]]) -> None:
        """Add ``source()``'s figures to every :meth:`telemetry` reading (called there, on every rank)."""
        self._telemetry.sources.append(source)

    def _adamw_group_step(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            # a backend's flat partition is bound once (checkpoints enumerate it), even if the backend
            # created its state itself (DeepSpeed's universal checkpoint loader)
            part = self._partition_of(group, p) if self._is_backend_flat(group, p) else None
            state = self.state[p]
            if not state:  # the same initial state torch.optim.AdamW creates
                state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if part is not None:
                    self._fill_pending(p, part)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        self._telemetry.adamw_stepped[group["matrices_index"]] = set(map(id, params))
        beta1, beta2 = group["betas"]
        functional_adam(
            params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=group["foreach"], decoupled_weight_decay=True,
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=False,
        )
