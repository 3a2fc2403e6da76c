"""Every third-party internal hf_muon touches goes through here: one adapter per library and one patch registry.

Two kinds of contact with transformers, Accelerate and DeepSpeed need care, because a new release can
rename what they rely on:

* **Reading an internal** (a private attribute, or a public one that is not documented API, such as
  ``Trainer.get_optimizer_cls_and_kwargs`` or a ZeRO optimizer's ``fp32_partitioned_groups_flat``):
  :func:`internal` reads it and, when it is missing, raises :class:`IncompatibleVersionError` that
  names the attribute, the installed version and the versions hf_muon is tested with.
* **Changing** (replacing a function or method, adding an enum member): :func:`wrap_once` replaces
  ``owner.name`` with ``make_wrapper(original)`` exactly once and records it, :func:`record` notes any
  other change with its undo, and :func:`undo_all` takes every change back (tests use it instead of
  leaving patches in place for a whole run).

Nothing here imports a third-party package; the callers pass the objects in.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable

# The versions the test suite runs against (see README, "Supported versions").
TESTED_VERSIONS = {
    "torch": "2.13",
    "transformers": "4.57 and 5.25",
    "accelerate": "1.10 and 1.16",
    "deepspeed": "0.19.8",
}

_MARK = "_hf_muon_original"  # set on every wrapper; holds the function it replaced


class IncompatibleVersionError(RuntimeError):
    """A transformers, Accelerate or DeepSpeed internal hf_muon relies on is not there in this version."""


def installed_version(library: str) -> str:
    """The installed version of ``library`` (``"not installed"`` if absent, without importing it)."""
    module = sys.modules.get(library)
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        return dist_version(library)
    except PackageNotFoundError:
        return "not installed"


def describe(library: str) -> str:
    """``"deepspeed 0.20.1 (hf_muon is tested with 0.19.8)"``."""
    return f"{library} {installed_version(library)} (hf_muon is tested with {TESTED_VERSIONS.get(library, '?')})"


def internal(owner: Any, name: str, library: str) -> Any:
    """``getattr(owner, name)``, or a clear :class:`IncompatibleVersionError` naming the attribute and versions."""
    try:
        return getattr(owner, name)
    except AttributeError:
        where = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None) or type(owner).__qualname__
        raise IncompatibleVersionError(
            f"hf_muon needs {where}.{name} from {library}, which {describe(library)} does not have. "
            f"Install a {library} version hf_muon is tested with, or report this at the hf_muon issue tracker."
        ) from None


@dataclass
class Change:
    """One change hf_muon made to a third-party object, and how to take it back."""

    library: str
    what: str  # e.g. "transformers.Trainer.get_optimizer_cls_and_kwargs"
    undo: Callable[[], None]


_CHANGES: list[Change] = []


def record(library: str, what: str, undo: Callable[[], None]) -> None:
    """Note a change that is not a :func:`wrap_once` (an enum member added, a name put on a module) and its undo."""
    _CHANGES.append(Change(library, what, undo))


def _qualname(owner: Any) -> str:
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return getattr(owner, "__name__", type(owner).__qualname__)


def wrap_once(owner: Any, name: str, make_wrapper: Callable[[Callable], Callable], library: str) -> bool:
    """Replace ``owner.name`` by ``make_wrapper(original)`` unless hf_muon already did; return whether it did now.

    ``owner`` is a class or a module. The wrapper gets the original's name, docstring and
    ``__wrapped__``; a ``staticmethod`` stays one. A missing attribute raises
    :class:`IncompatibleVersionError`. :func:`undo_all` restores exactly what was there.
    """
    own = owner.__dict__ if isinstance(owner, type) else None
    current = own.get(name) if own is not None else None
    static = isinstance(current, staticmethod)
    original = current.__func__ if static else internal(owner, name, library)
    if getattr(original, _MARK, None) is not None:
        return False
    wrapper = make_wrapper(original)
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _MARK, original)
    setattr(owner, name, staticmethod(wrapper) if static else wrapper)

    def undo() -> None:
        if own is not None and current is None:  # it was inherited: uncover the base class's again
            delattr(owner, name)
        else:
            setattr(owner, name, current if current is not None else original)

    record(library, f"{_qualname(owner)}.{name}", undo)
    return True


def is_patched(owner: Any, name: str) -> bool:
    """Whether ``owner.name`` is an hf_muon wrapper."""
    return getattr(getattr(owner, name, None), _MARK, None) is not None


def changes() -> list[Change]:
    """The changes in force, oldest first."""
    return list(_CHANGES)


def undo_all() -> int:
    """Take back every change hf_muon made (newest first); return how many. Safe to call twice."""
    count = 0
    while _CHANGES:
        _CHANGES.pop().undo()
        count += 1
    return count
