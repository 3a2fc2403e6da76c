"""One line that says what an :class:`hf_muon.Muon` will do: the split, the Newton–Schulz set-up, the rates.

:class:`hf_muon.Muon` logs it at INFO on the ``hf_muon`` logger when it is built; a Trainer run with
``--optim muon`` makes that logger print on rank 0.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Callable


from ..kernels.newton_schulz import resolve_method
from .param_split import MUON, shape_of


def _human(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _rates(values: list[float]) -> str:
    distinct = sorted(set(values))
    return ", ".join(f"{v:g}" for v in distinct) if distinct else "-"


def describe_optimizer(param_groups: list[dict[str, Any]], resolve_dtype: Any,
                       blocks_of: Callable[[dict], list[Any]] | None = None) -> str:
    """``Muon 14 tensors (0.05M params, 18 matrices), AdamW 7 tensors (0.02M); Newton–Schulz 5
    quintic steps (frobenius) in bfloat16 (standard 14, gram 4); lr 0.01 (Muon, match_rms_adamw),
    0.001 (AdamW); 2 frozen tensors (0.01M params) not trained``.

    ``resolve_dtype(ns_dtype, device)`` is the optimizer's dtype policy (``muon.resolve_ns_dtype``);
    ``blocks_of(group)`` gives each of a Muon group's tensors its fused blocks (``None``: whole), so
    the matrices and methods counted are the ones Newton–Schulz runs on (each block of each expert).
    """
    from ..distributed.layout import replicated, with_blocks
    from ..models.fused import block_shapes

    counts = {MUON: [0, 0], "adamw": [0, 0]}
    frozen = [0, 0]
    lrs: dict[str, list[float]] = {MUON: [], "adamw": []}
    methods: Counter[str] = Counter()
    ns: set[tuple] = set()
    adjust: set[str] = set()
    for group in param_groups:
        algorithm = MUON if group["algorithm"] == MUON else "adamw"
        lrs[algorithm].append(float(group["lr"]))
        cuts = blocks_of(group) if blocks_of is not None and algorithm == MUON else [None] * len(group["params"])
        for p, cut in zip(group["params"], cuts):
            shape = shape_of(p)
            if not p.requires_grad:
                frozen[0] += 1
                frozen[1] += math.prod(shape)
                continue
            counts[algorithm][0] += 1
            counts[algorithm][1] += math.prod(shape)
            if algorithm != MUON:
                continue
            dtype = resolve_dtype(group["ns_dtype"], p.device if p.device.type != "meta" else None)
            precondition = group.get("ns_precondition", "frobenius")
            # the matrices the owner plan costs: one, a stack's, or each of their blocks
            layout, = with_blocks([replicated(tuple(shape), bool(group.get("stacked")), 1)], [block_shapes(shape, cut)])
            for rows, cols in layout.ns_matrices:
                methods[resolve_method(rows, cols, group["ns_steps"], dtype, precondition=precondition)] += 1
            ns.add((group["ns_steps"], group["ns_coefficients"], precondition, str(dtype).replace("torch.", "")))
            adjust.add(group["adjust_lr"])
    (m_tensors, m_params), (a_tensors, a_params) = counts[MUON], counts["adamw"]
    matrices = sum(methods.values())
    parts = [f"Muon {m_tensors} tensors ({_human(m_params)} params"
             f"{f', {matrices} matrices' if matrices != m_tensors else ''}), "
             f"AdamW {a_tensors} tensors ({_human(a_params)} params)"]
    if ns:
        setups = "; ".join(f"{steps} {coefficients} steps ({precondition}) in {dtype}"
                           for steps, coefficients, precondition, dtype in sorted(ns))
        how = ", ".join(f"{method} {count}" for method, count in sorted(methods.items()))
        parts.append(f"Newton–Schulz {setups} ({how})")
    parts.append(f"lr {_rates(lrs[MUON])} (Muon, {'/'.join(sorted(adjust)) or '-'}), {_rates(lrs['adamw'])} (AdamW)")
    if frozen[0]:
        parts.append(f"{frozen[0]} frozen tensors ({_human(frozen[1])} params) not trained")
    return "; ".join(parts)

