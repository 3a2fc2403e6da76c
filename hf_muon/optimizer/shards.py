"""Where each parameter's optimizer state lives on this rank, whatever the layout.

A checkpoint that moves between layouts needs, per model parameter, this rank's piece of its master
weights and of each state tensor, and which elements of the whole that piece is. The optimizer sees
three kinds of tensors: whole ones (one process, DDP), FSDP2 ``DTensor`` row shards, and flat
partitions a backend hands over (DeepSpeed ZeRO), read through a layout provider. :func:`shards_of`
turns all three into the same :class:`Shard`; :class:`PendingState` goes the other way.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed.layout import TensorLayout
from ..distributed.sharding import is_dtensor, layouts_of, local, process_group_of
from .param_split import MUON

if TYPE_CHECKING:
    from ..distributed.providers import FlatPartition
    from .muon import Muon

STATE_KEYS = {MUON: ("momentum_buffer",), "adamw": ("exp_avg", "exp_avg_sq")}


@dataclass
class Shard:
    """One parameter as this rank holds it: flat pieces of its master weights and state tensors.

    ``layout.ranges[rank]`` says which elements of the whole (flattened) tensor the pieces are.
    """

    name: str
    algorithm: str
    layout: TensorLayout
    group: dist.ProcessGroup | None
    rank: int
    world: int
    param: Tensor
    state: dict[str, Tensor] = field(default_factory=dict)
    step: float | None = None


def _step_value(state: dict) -> float | None:
    step = state.get("step")
    return None if step is None else float(step)


def _flat_shards(optimizer: Muon, group: dict, names: dict[int, str]) -> list[Shard]:
    found = []
    for flat, part in [v for k, v in optimizer._partitions.items() if k[0] == group["matrices_index"]]:
        state = optimizer.state.get(flat, {})
        for p, (offset, length), layout in zip(part.params, part.spans, part.layouts):
            def piece(t: Tensor, offset=offset, length=length) -> Tensor:
                return t.narrow(0, offset, length)

            found.append(Shard(
                names[id(p)], group["algorithm"], layout, part.group, part.rank, part.world, piece(flat),
                {k: piece(state[k]) for k in STATE_KEYS[group["algorithm"]] if k in state}, _step_value(state)))
    return found


def shards_of(optimizer: Muon, names: dict[int, str]) -> list[Shard]:
    """Every parameter of ``optimizer`` as this rank holds it, sorted by name (the same order on every rank).

    ``names`` maps ``id(tensor)`` of the model's parameters to their names. Flat partitions are known
    once ``step()`` has run; before that a backend's groups cannot be enumerated (``RuntimeError``).
    """
    found: list[Shard] = []
    for group in optimizer.param_groups:
        params = list(group["params"])
        if optimizer._held_by_backend(group):  # ZeRO: flat partitions (ZeRO-3: none between steps)
            if not any(k[0] == group["matrices_index"] for k in optimizer._partitions):
                raise RuntimeError("hf_muon: a backend holds this optimizer's state in flat partitions that no "
                                   "step() has shown yet; save a checkpoint after the first optimizer step")
            found += _flat_shards(optimizer, group, names)
            continue
        where = process_group_of(params, optimizer.process_group if not is_dtensor(params[0]) else None)
        pg, rank, world = where if where is not None else (None, 0, 1)
        for p, layout in zip(params, layouts_of(params, group.get("stacked", False), world)):
            if id(p) not in names:
                raise KeyError(f"hf_muon: an optimizer tensor of shape {tuple(p.shape)} is not a parameter of the model")
            state = optimizer.state.get(p, {})
            found.append(Shard(
                names[id(p)], group["algorithm"], layout, pg, rank, world, local(p).reshape(-1),
                {k: local(state[k]).reshape(-1) for k in STATE_KEYS[group["algorithm"]] if k in state},
                _step_value(state)))
    return sorted(found, key=lambda s: s.name)


# (name, kind, start, end) -> that slice of the whole flattened tensor, in fp32
SliceReader = Callable[[str, str, int, int], Tensor]


@dataclass
class PendingState:
    """Optimizer state read from a portable checkpoint, waiting for the flat partitions it goes into.

    A backend's flat partitions appear only inside ``step()``; each is filled when its state is created.
    """

    read: SliceReader
    names: dict[int, str]
    steps: dict[str, float]
    stateful: set[str]  # the parameters the checkpoint holds state for (not those saved before their first update)

    def fill_partition(self, state: dict, part: FlatPartition) -> None:
        """Fill a flat partition's state; a parameter saved without state keeps zeros, as at its first update."""
        names = [self.names[id(p)] for p in part.params]
        for name, (offset, length), layout in zip(names, part.spans, part.layouts):
            if not length or name not in self.stateful:
                continue
            start = layout.ranges[part.rank][0]
            for key, buffer in state.items():
                if torch.is_tensor(buffer) and buffer.ndim == 1:
                    buffer.narrow(0, offset, length).copy_(self.read(name, key, start, start + length))
        steps = {name: self.steps[name] for name in names if name in self.steps}
        if steps and "step" in state:
            step = max(steps.values())
            state["step"].fill_(step)
            others = sorted(name for name, s in steps.items() if s != step)
            if others:  # the backend keeps one count per partition: say whose bias correction changes
                listed = ", ".join(others[:4]) + (" ..." if len(others) > 4 else "")
                warnings.warn(f"hf_muon: this ZeRO partition keeps one AdamW step count and continues at {step:g}, "
                              f"but {len(others)} of its parameters were saved with fewer steps ({listed}; they "
                              "started late): their bias correction from here differs from the run that did not stop")


def fill_whole_state(optimizer: Muon, read: SliceReader, names: dict[int, str], steps: dict[str, float],
                     stateful: set[str]) -> None:
    """Create and fill the state of every tensor that is not a backend's flat partition (one process,
    DDP, FSDP2): the same tensors ``step()`` would create, with this rank's slice of the checkpoint;
    none for a parameter the checkpoint holds no state for (``stateful``), as in the run that did not stop."""
    from torch.optim.optimizer import _get_scalar_dtype

    for group in optimizer.param_groups:
        params = list(group["params"])
        if not params or optimizer._held_by_backend(group):
            continue
        where = process_group_of(params, optimizer.process_group if not is_dtensor(params[0]) else None)
        rank, world = (where[1], where[2]) if where is not None else (0, 1)
        for p, layout in zip(params, layouts_of(params, group.get("stacked", False), world)):
            name = names[id(p)]
            if name not in stateful:  # saved before its first update: its state comes with its first gradient
                continue
            start, end = layout.ranges[rank]
            state = optimizer.state[p]
            for key in STATE_KEYS[group["algorithm"]]:
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                local(state[key]).view(-1).copy_(read(name, key, start, end))
            if group["algorithm"] != MUON:
                state["step"] = torch.tensor(steps[name], dtype=_get_scalar_dtype())
