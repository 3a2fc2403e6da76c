"""The owner plan: which rank runs Newton–Schulz on each tensor, balancing FLOPs, not counts."""

from __future__ import annotations

from .layout import TensorLayout


def assign_owners(layouts: list[TensorLayout], world: int, ns_steps: int) -> list[int]:
    """One owner rank per tensor.

    A tensor held whole by exactly one rank stays there (moving it would only add traffic).
    The rest go, largest first, to the least-loaded rank (longest-processing-time greedy),
    preferring on a tie a rank that already holds the whole tensor, then the lowest rank. The
    result depends only on the layouts, so every rank computes the same plan without talking.
    """
    load = [0.0] * world
    owners = [-1] * len(layouts)
    free = []
    for i, layout in enumerate(layouts):
        holders = [r for r in range(world) if layout.holds(r)]
        if len(holders) == 1 and layout.holds_all(holders[0]):
            owners[i] = holders[0]
            load[holders[0]] += layout.ns_flops(ns_steps)
        else:
            free.append(i)
    for i in sorted(free, key=lambda i: (-layouts[i].ns_flops(ns_steps), i)):
        layout = layouts[i]
        owner = min(range(world), key=lambda r: (load[r], not layout.holds_all(r), r))
        owners[i] = owner
        load[owner] += layout.ns_flops(ns_steps)
    return owners


def ns_load(layouts: list[TensorLayout], owners: list[int], world: int, ns_steps: int) -> list[float]:
    """Newton–Schulz FLOPs each rank runs under ``owners``."""
    load = [0.0] * world
    for layout, owner in zip(layouts, owners):
        load[owner] += layout.ns_flops(ns_steps)
    return load
