"""Figure 4: bytes moved per rank per optimizer step by all collectives, from the ZeRO runs of figure 2.

The training workers count every ``torch.distributed`` collective (:mod:`hf_muon.bench.commcount`);
this module turns those counts into the figure: per stage and contender, bytes by category
(gradient reduction, parameter gathering, all-to-all, other), the total, the extra over AdamW at
the same stage, and the ratio of hf_muon's extra to DeepSpeed's Muon's.
"""

from __future__ import annotations

from typing import Any

from .commcount import CATEGORIES
from .throughput import SINGLE

KEY = "collective_bytes_per_rank_per_step"


def summary(train: dict[str, Any] | None) -> dict[str, Any]:
    """``{setting: {"rows": {contender: {...}}, "muon_extra_x_ds_muon_extra": ratio | None}}`` for
    distributed setting of ``train`` (figure 2's results)."""
    out: dict[str, Any] = {}
    settings = (train or {}).get("settings") or {}
    # the same model everywhere; a ZeRO-3 rank may see only its (empty) placeholders
    parameters = max((row.get("parameters") or 0 for rows in settings.values() for row in rows.values()), default=0)
    for setting, rows in settings.items():
        if setting == SINGLE:
            continue
        base = (rows.get("adamw") or {}).get(KEY, {}).get("total")
        table: dict[str, Any] = {}
        for contender, row in rows.items():
            counts = row.get(KEY)
            if not counts:
                table[contender] = {"label": row.get("label") or contender, "failed": row.get("failed", "no counts")}
                continue
            table[contender] = {
                "label": row.get("label") or contender,
                "by_category": {c: counts["by_category"].get(c, 0) for c in CATEGORIES},
                "by_op": counts["by_op"], "total": counts["total"], "per_rank_total": counts["per_rank_total"],
                "extra_over_adamw": None if base is None else counts["total"] - base,
                "x_parameter_bytes": counts["total"] / (4 * parameters) if parameters else None,
            }
        ours = (table.get("hf_muon") or {}).get("extra_over_adamw")
        theirs = (table.get("ds_muon") or {}).get("extra_over_adamw")
        ratio = ours / theirs if ours is not None and theirs else None
        out[setting] = {"rows": table, "adamw_total": base, "muon_extra_x_ds_muon_extra": ratio}
    return out
