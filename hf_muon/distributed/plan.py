"""The owner plan: which rank runs Newton–Schulz on each tensor, balancing FLOPs, not counts.

The cost of a tensor is what the kernel really executes (``TensorLayout.ns_flops``: Gram-aware, in
the Newton–Schulz dtype), so the balance holds for the work each owner actually does.
"""

from __future__ import annotations

import torch

from .layout import TensorLayout


def assign_owners(layouts: list[TensorLayout], world: int, ns_steps: int,
                  ns_dtype: torch.dtype = torch.float32) -> list[int]:
    """One owner rank per tensor.

    A tensor held whole by exactly one rank stays there (moving it would only add traffic).
    The rest go, largest cost first, to the least-loaded rank (longest-processing-time greedy),
    preferring on a tie a rank that already holds the whole tensor, then the lowest rank. The
    result depends only on the layouts, ``ns_steps`` and ``ns_dtype``, so every rank that passes
    the same ones computes the same plan without talking.
    """
    costs = [layout.ns_flops(ns_steps, ns_dtype) for layout in layouts]
    load = [0.0] * world
    owners = [-1] * len(layouts)
    free = []
    for i, layout in enumerate(layouts):
        holders = [r for r in range(world) if layout.holds(r)]
        if len(holders) == 1 and layout.holds_all(holders[0]):
            owners[i] = holders[0]
            load[holders[0]] += costs[i]
        else:
            free.append(i)
    for i in sorted(free, key=lambda i: (-costs[i], i)):
        layout = layouts[i]
        owner = min(range(world), key=lambda r: (load[r], not layout.holds_all(r), r))
        owners[i] = owner
        load[owner] += costs[i]
    return owners


def ns_load(layouts: list[TensorLayout], owners: list[int], world: int, ns_steps: int,
            ns_dtype: torch.dtype = torch.float32) -> list[float]:
    """Newton–Schulz FLOPs each rank runs under ``owners``."""
    load = [0.0] * world
    for layout, owner in zip(layouts, owners):
        load[owner] += layout.ns_flops(ns_steps, ns_dtype)
    return load
