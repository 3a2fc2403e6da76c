"""The cost model: per-rank Newton–Schulz FLOPs, exchange bytes, backend traffic, memory and time.

Everything distributed is derived from the package's own pieces: layouts (``distributed.layout``),
the exchange plan (``plan_exchange``: owners, buckets and sizes, by the same rules as
``orthogonalize_distributed``) and the kernel's FLOP model (``orthogonalize_flops``).

Time model (one optimizer step; forward/backward are not modelled):

* Newton–Schulz: per exchange, the busiest owner's FLOPs / (matmul peak in the NS dtype x
  ``MATMUL_EFFICIENCY``; a measured rate (``cpu``) is used as is), summed over the step's exchanges.
  Exchanges run one after another: under DDP and FSDP2 all Muon param groups share one (``Muon``
  plans them together); under ZeRO each param group's flat partition has its own, and ZeRO-3 has one
  per sub-group (see :func:`zero3_sub_groups`).
* exchange: per ``all_to_all``, the most bytes one rank sends or receives / link bandwidth, plus the
  link's per-call latency, summed over calls.
* element-wise: bytes the update formulas move (``MUON_BYTES_PER_ELEMENT``...) / memory bandwidth.
* "sum" runs them one after the other (the synchronous exchange); "overlapped" hides the shorter of
  NS and exchange behind the longer (the best a pipelined exchange can do).

Backend collectives (the same under Muon and AdamW) assume NCCL's ring algorithm: an all-reduce of
``n`` bytes sends and receives ``2 (W-1)/W n`` per rank, an all-gather or reduce-scatter ``(W-1)/W n``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from ..distributed.exchange import DEFAULT_BUCKET_BYTES
from ..distributed.layout import TensorLayout, flat_sharded, group_flat_sharded, replicated, row_sharded, with_blocks
from ..distributed.plan import plan_exchange
from ..kernels.newton_schulz import DEFAULT_NS_PRECONDITION, default_ns_steps
from .model import ModelTensors, PlanTensor
from .presets import Accelerator, Interconnect

LAYOUTS = ("ddp", "fsdp2", "zero1", "zero2", "zero3")
# Large bf16 GEMMs on H100 reach about 60-70% of the 989 TFLOP/s datasheet peak (cuBLAS, square
# sizes >= 4096); Newton–Schulz's 1024..4096-wide products sit at the low end: 0.6.
MATMUL_EFFICIENCY = 0.6
# On a measured rate (``cpu``: bare bmm of the very products NS runs) the kernel's own overhead
# remains: figure 1 of ``hf-muon bench`` measures NS at 94% of those bare products (README, targets).
MEASURED_MATMUL_EFFICIENCY = 0.94
# Minimum fp32 bytes each update moves per element, counting every tensor read or written once:
# Muon: gradient read (4), momentum read + write (8), Nesterov blend written (4) and read into the
# NS dtype (4 + 2), the result read back (2) and as fp32 update (4 + 4), parameter read + write (8).
MUON_BYTES_PER_ELEMENT = 40
# AdamW: gradient read (4), both moments read + written (16), parameter read + written (8).
ADAMW_BYTES_PER_ELEMENT = 28
STATE_ITEMSIZE = 4  # optimizer states are fp32
DEFAULT_NS_STEPS = default_ns_steps(DEFAULT_NS_PRECONDITION)  # what Muon runs unless told
# DeepSpeed's default ``"zero_optimization": {"sub_group_size"}``: elements of each rank's partition.
ZERO3_SUB_GROUP_SIZE = 1_000_000_000


@dataclass
class Spread:
    """A per-rank quantity over the ranks: smallest, mean, largest."""

    min: float
    mean: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> "Spread":
        return cls(float(min(values)), float(sum(values) / len(values)), float(max(values)))


@dataclass
class StepTimes:
    """Projected optimizer-step time (seconds) and its parts."""

    newton_schulz: float
    exchange: float
    elementwise: float
    muon_sum: float
    muon_overlapped: float
    adamw: float


@dataclass
class Plan:
    """One plan: a model (or shapes) under one layout at one world size on one machine."""

    model: str
    layout: str
    world: int
    accelerator: str
    interconnect: str
    ns_dtype: str
    ns_steps: int
    comm_dtype: str
    matmul_efficiency: float
    muon_tensors: int
    matrices: int
    muon_params: int
    adamw_params: int
    ns_flops: Spread
    busy_ranks: int
    exchange_sent: Spread
    exchange_received: Spread
    exchange_collectives: int
    buckets: int
    exchanges: int
    backend_bytes: Spread
    backend_detail: dict[str, float]
    state_bytes: Spread
    adamw_state_bytes: Spread
    owner_buffer_bytes: Spread
    times: StepTimes
    backend_seconds: float
    notes: list[str] = field(default_factory=list)
    # the owner plan's link cost (``Muon(exchange_flops_per_byte=...)``; None: Muon's default) and
    # the value for this accelerator and interconnect
    exchange_flops_per_byte: float | None = None
    hardware_flops_per_byte: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def _layouts(layout: str, tensors: list[PlanTensor], world: int) -> list[TensorLayout]:
    """The layouts ``tensors`` have under ``layout``, with fused projections' blocks (costed block by
    block, as their owners run them)."""
    if layout == "ddp":
        layouts = [replicated(t.shape, t.stacked, world) for t in tensors]
    elif layout == "fsdp2":
        layouts = [row_sharded(t.shape, t.stacked, world) for t in tensors]
    elif layout == "zero3":
        layouts = [flat_sharded(t.shape, t.stacked, world) for t in tensors]
    elif layout in ("zero1", "zero2"):  # one DeepSpeed param group per Muon group, flattened and split
        stacked = {t.stacked for t in tensors}
        layouts = group_flat_sharded([t.shape for t in tensors], stacked.pop() if stacked else False, world)
    else:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    return with_blocks(layouts, [t.blocks for t in tensors])


def _backend_bytes(layout: str, world: int, params: int, param_bytes: int, grad_bytes: int) -> dict[str, float]:
    """Bytes each rank sends (= receives) per step in the backend's own collectives (ring algorithm)."""
    share = (world - 1) / world
    if layout == "ddp":
        return {"gradient all-reduce": 2 * share * params * grad_bytes}
    if layout in ("fsdp2", "zero3"):  # parameters gathered for forward and again for backward
        return {"parameter all-gather (fwd + bwd)": 2 * share * params * param_bytes,
                "gradient reduce-scatter": share * params * grad_bytes}
    return {"gradient reduce-scatter": share * params * grad_bytes,  # zero1/zero2
            "parameter all-gather (after step)": share * params * param_bytes}


def _held(layout: str, numel: int, world: int) -> float:
    """Elements of an AdamW tensor of ``numel`` one rank holds (the largest share)."""
    return float(numel) if layout == "ddp" else float(math.ceil(numel / world))


def zero3_sub_groups(group: list[PlanTensor], world: int, sub_group_size: int | None) -> list[list[PlanTensor]]:
    """The sub-groups DeepSpeed ZeRO-3 cuts a param group into, each stepped by its own optimizer call.

    As ``DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups`` (DeepSpeed 0.19): tensors in order,
    each counted by its partition on one rank (``ceil(numel / W)`` elements), a sub-group closed once
    it reaches ``sub_group_size``; ``None``, or a group that fits, is one sub-group. So the size is per
    rank: at W ranks a group of P elements is cut about ``P / (W * sub_group_size)`` times."""
    numels = [math.ceil(math.prod(t.shape) / world) for t in group]
    if sub_group_size is None or sub_group_size >= sum(numels):
        return [group]
    sub_groups, current, size = [], [], 0
    for tensor, numel in zip(group, numels):
        current.append(tensor)
        size += numel
        if size >= sub_group_size:
            sub_groups.append(current)
            current, size = [], 0
    return sub_groups + ([current] if current else [])


def _exchanges(layout: str, tensors: ModelTensors, world: int,
               sub_group_size: int | None) -> list[list[list[PlanTensor]]]:
    """The Muon tensors each of the step's exchanges carries (as lists of groups): all groups in one
    under DDP and FSDP2 (one owner plan, as ``Muon`` makes for groups with the same Newton–Schulz
    settings); one per group under ZeRO-1/2 (DeepSpeed hands each group over as its own flat
    partition); one per sub-group under ZeRO-3 (one ``step()`` call each)."""
    if layout in ("ddp", "fsdp2"):
        return [tensors.muon_groups]
    if layout == "zero3":
        return [[sub] for group in tensors.muon_groups for sub in zero3_sub_groups(group, world, sub_group_size)]
    return [[group] for group in tensors.muon_groups]


def plan(tensors: ModelTensors, layout: str, world: int, device: Accelerator, link: Interconnect, *,
         ns_steps: int = DEFAULT_NS_STEPS, ns_dtype: torch.dtype = torch.bfloat16,
         comm_dtype: torch.dtype = torch.float32,
         bucket_bytes: int = DEFAULT_BUCKET_BYTES, param_bytes: int = 2, grad_bytes: int | None = None,
         matmul_efficiency: float | None = None, plan_dtype: torch.dtype | None = None,
         overlap: bool = True, sub_group_size: int | None = ZERO3_SUB_GROUP_SIZE,
         exchange_flops_per_byte: float | None = None) -> Plan:
    """The plan of ``tensors`` under ``layout`` over ``world`` ranks of ``device`` joined by ``link``.

    Args:
        ns_dtype: the dtype Newton–Schulz runs in (the owner plan is costed in it too, as
            ``plan_ns_dtype`` does for an explicit dtype).
        comm_dtype: the exchange's dtype on the wire (``Muon``'s default: the fp32 updates').
        param_bytes, grad_bytes: bytes per element of the backend's parameter and gradient
            collectives (bf16 mixed precision: 2; gradients ``None``: 4 under DDP, whose parameters
            and so gradients stay fp32 under autocast, 2 under FSDP2's and ZeRO's bf16 reduce).
        matmul_efficiency: fraction of the matmul peak Newton–Schulz reaches (default
            ``MATMUL_EFFICIENCY``; ``MEASURED_MATMUL_EFFICIENCY`` for a measured rate).
        plan_dtype: the dtype the owner plan is costed in (``plan_ns_dtype``; default ``ns_dtype``).
        overlap: the exchange's bucketing (``Muon(overlap_exchange=...)``): pipelined buckets, at least
            ``PIPELINE_BUCKETS``, or as few as ``bucket_bytes`` allows.
        sub_group_size: ZeRO-3 only: DeepSpeed's ``"sub_group_size"`` (elements of each rank's
            partition; default DeepSpeed's, ``None``: never cut), see :func:`zero3_sub_groups`.
        exchange_flops_per_byte: as ``Muon(exchange_flops_per_byte=...)``: the owner plan may move a
            matrix held whole by one rank (``None``: never, Muon's default). The plan's
            ``hardware_flops_per_byte`` is the value for ``device`` and ``link``; when Muon's default
            leaves matrices pinned and that value would shorten the step, a note says by how much.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world size must be an integer >= 1, got {world!r}")
    if ns_steps < 1:
        raise ValueError(f"ns_steps must be >= 1, got {ns_steps}")
    if not tensors.muon_tensors:
        raise ValueError(f"{tensors.name}: no tensor gets Muon, nothing to plan")
    if sub_group_size is not None and (isinstance(sub_group_size, bool) or not isinstance(sub_group_size, int)
                                       or sub_group_size < 1):
        raise ValueError(f"sub_group_size must be an integer >= 1 (or None), got {sub_group_size!r}")
    if layout != "zero3" and sub_group_size != ZERO3_SUB_GROUP_SIZE:
        raise ValueError(f"sub_group_size is a DeepSpeed ZeRO-3 setting; layout {layout!r} does not cut param "
                         "groups into sub-groups: use layout 'zero3' or leave sub_group_size out")
    efficiency = matmul_efficiency
    if efficiency is None:
        efficiency = MEASURED_MATMUL_EFFICIENCY if device.measured else MATMUL_EFFICIENCY
    if not 0 < efficiency <= 1:
        raise ValueError(f"matmul efficiency must be in (0, 1], got {efficiency}")
    if exchange_flops_per_byte is not None and not 0 < exchange_flops_per_byte < math.inf:
        raise ValueError(f"exchange_flops_per_byte must be a positive number or None, got {exchange_flops_per_byte}")
    comm_itemsize = comm_dtype.itemsize
    rate = (device.fp32_flops if ns_dtype in (torch.float32, torch.float64) else device.bf16_flops) * efficiency

    flops = [0.0] * world
    sent, received, buffers = [0] * world, [0] * world, [0] * world
    muon_held = [0] * world
    collectives: list[int] = []
    buckets = matrices = 0
    busiest_owners = 0.0  # summed over the exchanges, which run one after another
    pinned = 0  # matrices held whole by one rank alone
    skipped = 0  # exchanges not made: each rank orthogonalizes their tensors itself (DDP, when that is faster)
    exchanges = _exchanges(layout, tensors, world, sub_group_size)
    for groups in exchanges:
        layouts = [lay for group in groups for lay in _layouts(layout, group, world)]
        for lay in layouts:
            for r, (start, end) in enumerate(lay.ranges):
                muon_held[r] += end - start
        planned = plan_exchange(layouts, world, ns_steps, plan_dtype or ns_dtype, comm_itemsize, bucket_bytes, overlap,
                                exchange_flops_per_byte, STATE_ITEMSIZE)
        volume = planned.volume
        if world > 1:
            pinned += sum(lay.sole_holder is not None for lay in planned.item_layouts)
        exchange_flops = [0.0] * world
        for item, owner in zip(planned.items, planned.owners):
            exchange_flops[owner] += item.layout.ns_flops(ns_steps, ns_dtype)
            matrices += len(item.layout.ns_matrices)
        if not planned.pays:
            # as Muon decides it (exchange_over): every rank runs all the Newton–Schulz, nothing moves
            flops = [a + sum(exchange_flops) for a in flops]
            busiest_owners += sum(exchange_flops)
            skipped += 1
            continue
        flops = [a + b for a, b in zip(flops, exchange_flops)]
        busiest_owners += max(exchange_flops)
        sent = [a + b for a, b in zip(sent, volume.bytes_sent)]
        received = [a + b for a, b in zip(received, volume.bytes_received)]
        buffers = [max(a, b) for a, b in zip(buffers, volume.peak_buffer_bytes)]
        collectives += volume.collective_bytes
        buckets += volume.buckets

    adamw_held = sum(_held(layout, n, world) for n in tensors.adamw_numels)
    all_params = tensors.muon_params + tensors.adamw_params
    adamw_everything = [m + adamw_held for m in muon_held]
    state = [STATE_ITEMSIZE * (m + 2 * adamw_held) for m in muon_held]
    adamw_state = [STATE_ITEMSIZE * 2 * a for a in adamw_everything]

    ns_s = busiest_owners / rate
    exchange_s = sum(b / link.bandwidth + link.latency for b in collectives)
    elementwise_s = max(MUON_BYTES_PER_ELEMENT * m + ADAMW_BYTES_PER_ELEMENT * adamw_held
                        for m in muon_held) / device.memory_bandwidth
    adamw_s = max(ADAMW_BYTES_PER_ELEMENT * a for a in adamw_everything) / device.memory_bandwidth
    times = StepTimes(ns_s, exchange_s, elementwise_s, elementwise_s + ns_s + exchange_s,
                      elementwise_s + max(ns_s, exchange_s), adamw_s)
    if grad_bytes is None:
        grad_bytes = 4 if layout == "ddp" else 2
    backend = _backend_bytes(layout, world, all_params, param_bytes, grad_bytes) if world > 1 else {}
    backend_total = sum(backend.values())

    busy = sum(1 for f in flops if f > 0)
    notes = []
    if busy < world:
        notes.append(f"{world - busy} of {world} ranks run no Newton–Schulz: {len(tensors.muon_tensors)} Muon tensors "
                     f"({matrices} matrices) cannot keep more than {busy} owners busy; NS time is the busiest "
                     "owner's (of each exchange)")
    if len(exchanges) > len(_exchanges(layout, tensors, world, None)):
        notes.append(f"ZeRO-3 steps the {len(tensors.muon_groups)} Muon group{'s' if len(tensors.muon_groups) > 1 else ''} "
                     f"as {len(exchanges)} sub-groups (sub_group_size {sub_group_size:,} elements of each "
                     "rank's partition), each with its own exchange and owner plan, one after another; a "
                     "larger \"sub_group_size\" in \"zero_optimization\" gives fewer")
    if max(buffers) > 0.25 * device.memory_bytes > 0:
        notes.append(f"the exchange's temporary buffers reach {max(buffers) / 2**30:.1f} GiB on one rank "
                     f"({100 * max(buffers) / device.memory_bytes:.0f}% of a {device.name}'s memory); "
                     "lower Muon's bucket_bytes (they scale with it) or use a sharded layout")
    if skipped:
        notes.append(f"every rank orthogonalizes every matrix itself and nothing is exchanged: at "
                     f"exchange_flops_per_byte={exchange_flops_per_byte:.3g} the exchange does not pay (Muon decides "
                     "the same when it makes the exchange)")
    elif layout == "ddp" and world > 2:
        notes.append(f"under DDP each owner sends its whole result to each of the {world - 1} other ranks in the "
                     "all-to-all (not a ring all-gather): its link carries (W-1) times the tensors it owns")
    hardware_flops_per_byte = rate / link.bandwidth
    step_s = times.muon_overlapped if overlap else times.muon_sum
    from .report import seconds_text  # report imports this module

    if layout == "ddp" and world > 1:
        # every rank holds every gradient: it could orthogonalize all of them itself, with no exchange
        alone_s = sum(flops) / rate + elementwise_s
        if alone_s < 0.9 * step_s:
            notes.append(f"Muon(distributed=False) would be faster here: each rank orthogonalizes every matrix "
                         f"itself ({seconds_text(sum(flops) / rate)} of Newton–Schulz) and nothing is exchanged, "
                         f"step {seconds_text(alone_s)} instead of {seconds_text(step_s)}; "
                         f"Muon(exchange_flops_per_byte={hardware_flops_per_byte:.3g}) makes that choice itself")
    if pinned and exchange_flops_per_byte is None:
        moved = plan(tensors, layout, world, device, link, ns_steps=ns_steps, ns_dtype=ns_dtype, comm_dtype=comm_dtype,
                     bucket_bytes=bucket_bytes, param_bytes=param_bytes, grad_bytes=grad_bytes,
                     matmul_efficiency=matmul_efficiency, plan_dtype=plan_dtype, overlap=overlap,
                     sub_group_size=sub_group_size, exchange_flops_per_byte=hardware_flops_per_byte)
        moved_s = moved.times.muon_overlapped if overlap else moved.times.muon_sum
        if moved_s < 0.9 * step_s:  # worth a note: a tenth of the step or more
            notes.append(
                f"{pinned} matrices are held whole by one rank each and orthogonalized there (Muon's default); "
                f"Muon(exchange_flops_per_byte={hardware_flops_per_byte:.3g}) (the Newton–Schulz rate over the "
                f"link's bandwidth here) lets the owner plan move some to idle ranks: step "
                f"{seconds_text(moved_s)} instead of {seconds_text(step_s)} (Newton–Schulz "
                f"{seconds_text(moved.times.newton_schulz)}, exchange {seconds_text(moved.times.exchange)}); "
                "plan it with --exchange_flops_per_byte")
    dtype_name = str(ns_dtype).replace("torch.", "")
    return Plan(
        model=tensors.name, layout=layout, world=world, accelerator=device.name, interconnect=link.name,
        ns_dtype=dtype_name, ns_steps=ns_steps, comm_dtype=str(comm_dtype).replace("torch.", ""),
        matmul_efficiency=efficiency, muon_tensors=len(tensors.muon_tensors), matrices=matrices,
        muon_params=tensors.muon_params, adamw_params=tensors.adamw_params,
        ns_flops=Spread.of(flops), busy_ranks=busy, exchange_sent=Spread.of(sent),
        exchange_received=Spread.of(received), exchange_collectives=len(collectives), buckets=buckets,
        exchanges=len(exchanges) - skipped,
        backend_bytes=Spread(backend_total, backend_total, backend_total), backend_detail=backend,
        state_bytes=Spread.of(state), adamw_state_bytes=Spread.of(adamw_state),
        owner_buffer_bytes=Spread.of(buffers), times=times,
        backend_seconds=backend_total / link.bandwidth, notes=notes,
        exchange_flops_per_byte=exchange_flops_per_byte, hardware_flops_per_byte=hardware_flops_per_byte,
    )


def shapes_tensors(shapes: list[tuple[int, ...]], name: str = "shapes") -> ModelTensors:
    """A list of matrix shapes as one Muon group of whole matrices and no AdamW parameters."""
    if not shapes:
        raise ValueError("no shapes given")
    for shape in shapes:
        if len(shape) < 2 or min(shape) < 1:
            raise ValueError(f"every shape must be a matrix with positive sizes, got {shape}")
    return ModelTensors(name, [[PlanTensor(f"matrix{i}", tuple(s)) for i, s in enumerate(shapes)]])
