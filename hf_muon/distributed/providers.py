"""Layout providers: what a training backend that rewrites the optimizer's tensors tells hf_muon.

DDP and FSDP2 need none: their tensors say how they are laid out (plain replicated tensors,
``DTensor``s; see ``sharding``). A backend that hands ``step()`` flat buffers of its own instead of
the model's matrices (DeepSpeed ZeRO), hides real shapes (``zero.Init``) or reacts to flags on
tensors is described by a :class:`LayoutProvider`. Providers live in ``hf_muon.integrations`` and
are registered here; the optimizer asks this registry, never a backend, so neither it nor this
layer imports an integration. A provider registered by module path is imported on first use.

This module imports neither torch nor any integration: ``import hf_muon`` registers through it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch import Tensor

    from .layout import TensorLayout


@dataclass(frozen=True)
class FlatPartition:
    """The tensors (a param group's) with a piece in one flat tensor ``step()`` received.

    ``spans[i]`` is ``(offset, length)`` of matrix ``i``'s piece in the flat tensor (length 0 if this
    rank holds none of it); ``layouts[i]`` says which elements of it each rank of ``group`` holds;
    ``params[i]`` is the model parameter it is (checkpoints name it); ``backend`` names the
    provider's backend in messages.
    """

    spans: tuple[tuple[int, int], ...]
    layouts: tuple[TensorLayout, ...]
    group: dist.ProcessGroup | None
    rank: int
    world: int
    backend: str = "a sharding backend"
    params: tuple[Tensor, ...] = ()


class LayoutProvider:
    """One backend's facts about the tensors hf_muon sees. Every hook defaults to "not mine".

    Attributes:
        name: the backend, in messages (``"DeepSpeed ZeRO"``).
        supported: what a user should run instead when :meth:`bind` meets a variant it cannot read.
    """

    name: str = "a sharding backend"
    supported: str = ""

    def shape_of(self, p: Tensor) -> tuple[int, ...] | None:
        """``p``'s real shape when the backend hides it (``p.shape`` is a placeholder), else ``None``."""
        return None

    def check_group(self, group: dict[str, Any]) -> None:
        """Refuse group keys, or clear tensor flags, that would make the backend act on its own."""

    def owns(self, flat: Tensor, matrices: list[Tensor]) -> bool:
        """Whether ``flat`` is one of this backend's flat tensors standing in for ``matrices`` (cheap, local)."""
        return False

    def bind(self, flat: Tensor, matrices: list[Tensor], stacked: bool) -> FlatPartition | None:
        """Where each of ``matrices`` (a Muon group's model parameters) sits in ``flat``, the tensor
        ``step()`` got in their place; ``None`` if this backend did not make ``flat``. Called once
        per flat tensor, on every rank at the same step: it may run collectives over its group."""
        return None

    def load_parameter(self, p: Tensor, whole: Tensor) -> bool:
        """Set model parameter ``p`` (and any master copy the backend keeps of it) to ``whole``, its
        full value in fp32; ``False`` if ``p`` is not this backend's. Called on every rank, for the
        same parameters in the same order: it may run collectives."""
        return False


@dataclass
class _Entry:
    spec: LayoutProvider | str
    provider: LayoutProvider | None


_REGISTRY: list[_Entry] = []


def register_provider(provider: LayoutProvider | str) -> None:
    """Add a provider, or ``"package.module:attribute"`` naming one (imported on first use, so
    registering costs nothing). Registering the same one twice does nothing."""
    if not isinstance(provider, (LayoutProvider, str)):
        raise TypeError(f"register_provider needs a LayoutProvider or 'module:attribute', got {provider!r}")
    if isinstance(provider, str) and ":" not in provider:
        raise ValueError(f"a provider path must be 'package.module:attribute', got {provider!r}")
    if not any(e.spec is provider or e.spec == provider for e in _REGISTRY):
        _REGISTRY.append(_Entry(provider, provider if isinstance(provider, LayoutProvider) else None))


def unregister_provider(provider: LayoutProvider | str) -> None:
    """Remove a provider, given as it was registered (or as the object a path resolved to)."""
    _REGISTRY[:] = [e for e in _REGISTRY if not (e.spec is provider or e.spec == provider or e.provider is provider)]


def _resolve(entry: _Entry) -> LayoutProvider:
    if entry.provider is None:
        module, _, attribute = entry.spec.partition(":")
        found = getattr(importlib.import_module(module), attribute, None)
        found = found() if isinstance(found, type) else found
        if not isinstance(found, LayoutProvider):
            raise TypeError(f"registered layout provider {entry.spec!r} is not a LayoutProvider (got {found!r})")
        entry.provider = found
    return entry.provider


def providers() -> list[LayoutProvider]:
    """The registered providers, in registration order (path-registered ones imported now)."""
    return [_resolve(e) for e in list(_REGISTRY)]


def shape_of(p: Tensor) -> tuple[int, ...]:
    """``p``'s real shape: the first provider's answer, else ``p.shape``."""
    for provider in providers():
        shape = provider.shape_of(p)
        if shape is not None:
            return tuple(shape)
    return tuple(p.shape)


def check_group(group: dict[str, Any]) -> None:
    """Let every provider refuse or clean a param group (see :meth:`LayoutProvider.check_group`)."""
    for provider in providers():
        provider.check_group(group)


def owned_by_a_backend(flat: Tensor, matrices: list[Tensor]) -> bool:
    """Whether a registered provider's backend made ``flat`` in place of ``matrices`` (no collectives)."""
    return any(provider.owns(flat, matrices) for provider in providers())


def bind_partition(flat: Tensor, matrices: list[Tensor], stacked: bool) -> FlatPartition | None:
    """The first provider's :meth:`LayoutProvider.bind` that recognises ``flat``; ``None`` if none does."""
    for provider in providers():
        part = provider.bind(flat, matrices, stacked)
        if part is not None:
            return part
    return None


def load_parameter(p: Tensor, whole: Tensor) -> bool:
    """The first provider's :meth:`LayoutProvider.load_parameter` that takes ``p``; ``False`` if none does."""
    return any(provider.load_parameter(p, whole) for provider in providers())


def describe_providers() -> tuple[str, str]:
    """``(names, supported)`` of the registered providers, for "nothing recognised this" messages."""
    found = providers()
    names = " or ".join(p.name for p in found) or "registered layout provider"
    supported = "; ".join(f"{p.name}: {p.supported}" for p in found if p.supported)
    return names, supported
