"""Figure 1: the optimizer step on Llama-like sets of matrices, in this process.

* step time of each contender (``torch.optim.AdamW`` foreach, ``hf_muon.Muon`` as shipped (Frobenius
  normalization, 5 steps), the same with ``ns_precondition="aol"`` (4 steps), with ``ns_dtype=fp32``
  where the dtype policy picks bf16 on this CPU, and ``torch.optim.Muon``) on the same tensors and
  gradients, and each one's ratio to ``torch.optim.Muon``'s step, round by round;
* Newton–Schulz FLOP/s as a fraction of this machine's matmul FLOP/s for the very products it
  executes (same shapes, same dtype, timed bare with preallocated outputs);
* orthogonality error of each Newton–Schulz variant against the exact polar factor ``U V^T`` of an
  SVD in float64, on Gaussian and on gradient-like (rank 4 plus 1e-2 noise) matrices of each set.

All of it runs on the CPU unless ``cfg["device"]`` names another device (``benchmarks/optimizer_step.py
--device cuda``, the check for a lent GPU): tensors are made there, Newton–Schulz runs in that device's
policy dtype, and each timed call waits for the device's queued kernels.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from typing import Any, Callable

import torch
from torch import nn

from ..distributed.rates import synchronize
from .common import (ADAMW, CONTENDERS, HF_MUON, HF_MUON_AOL, HF_MUON_FP32, TORCH_MUON, llama_matrices,
                     progress, summarize)

NS_STEPS = 5


def shape_set(spec: dict[str, int]) -> list[tuple[int, int]]:
    """The hidden matrices of a set spec: ``d``, ``layers``, ``heads``, ``kv_heads`` and optionally ``ff``."""
    return llama_matrices(spec["d"], spec["layers"], spec["heads"], spec["kv_heads"], spec.get("ff"))


def standard_ns_flops(shapes: list[tuple[int, int]], steps: int = NS_STEPS) -> int:
    from ..kernels.newton_schulz import ns_flops

    return sum(ns_flops(r, c, steps, "standard") for r, c in shapes)


def make_optimizer(name: str, params: list[nn.Parameter]) -> tuple[torch.optim.Optimizer, Callable[[], Any]]:
    """The contender ``name`` on ``params`` (all hidden matrices) and a factory of the context each of
    its steps runs in."""
    from ..optimizer.muon import Muon

    lr, wd = 1e-3, 0.01
    if name == ADAMW:
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd, foreach=True), contextlib.nullcontext
    if name == TORCH_MUON:
        return torch.optim.Muon(params, lr=lr, weight_decay=wd, adjust_lr_fn="match_rms_adamw"), contextlib.nullcontext
    group = [{"params": params, "algorithm": "muon"}]
    if name == HF_MUON:
        return Muon(group, lr=lr, weight_decay=wd), contextlib.nullcontext
    if name == HF_MUON_AOL:
        return Muon(group, lr=lr, weight_decay=wd, ns_precondition="aol"), contextlib.nullcontext
    if name == HF_MUON_FP32:
        return Muon(group, lr=lr, weight_decay=wd, ns_dtype=torch.float32), contextlib.nullcontext
    raise ValueError(name)


def time_steps(names: list[str], shapes: list[tuple[int, int]], repeats: int, min_repeats: int, budget_s: float,
               warmup_cutoff_s: float = 5.0, bar=None, device: torch.device | str = "cpu") -> dict[str, dict[str, Any]]:
    """Median/min–max of timed ``step()`` calls of each contender in ``names``, timed in rounds (one
    step of each contender per round) so that load from elsewhere on a shared machine hits them
    alike. Every contender gets its own copy of the same parameters and the same gradients.

    Per contender, the same rules: its first step is a warm-up (untimed) unless it took longer than
    ``warmup_cutoff_s`` (one-time costs, state allocation and first-call setup, are well under a
    second here, so they cannot move such a step, and it counts); it leaves the rounds after
    ``repeats`` timed steps, or after ``min_repeats`` once its timed steps have used ``budget_s``.
    The tensors live on ``device`` (drawn on the CPU, so every device gets the same numbers)."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    init = [(torch.randn(s, generator=gen) * 0.02).to(device) for s in shapes]
    grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
    state: dict[str, dict[str, Any]] = {}
    for name in names:
        params = [nn.Parameter(t.clone()) for t in init]
        opt, context = make_optimizer(name, params)
        state[name] = {"params": params, "opt": opt, "context": context, "times": [], "warm": [], "first": True}
    active = list(names)
    while active:
        for name in list(active):
            st = state[name]
            for p, g in zip(st["params"], grads):
                p.grad = g
            with st["context"]():
                synchronize(device)
                start = time.perf_counter()
                st["opt"].step()
                synchronize(device)
                elapsed = time.perf_counter() - start
            first, st["first"] = st["first"], False
            if first and elapsed <= warmup_cutoff_s:
                st["warm"].append(elapsed)
                continue
            st["times"].append(elapsed)
            n = len(st["times"])
            if n >= repeats or (n >= min_repeats and sum(st["times"]) > budget_s):
                active.remove(name)
                if bar is not None:
                    bar.update()
    out = {name: {**summarize(state[name]["times"]), "warmup_s": state[name]["warm"]} for name in names}
    if TORCH_MUON in names:  # each contender's step over torch.optim.Muon's of the same round
        reference = state[TORCH_MUON]["times"]
        for name in names:
            ratios = [t / r for t, r in zip(state[name]["times"], reference)]
            out[name]["x_torch_muon"] = summarize(ratios)
    return out


def step_times(sets: dict[str, dict[str, int]], cfg: dict[str, Any]) -> dict[str, Any]:
    """Step time of every contender on every set. A contender whose step on a set is estimated (from
    its time on the previous set, scaled by Newton–Schulz FLOPs) above ``max_step_s`` is skipped
    there, with the estimate as the reason."""
    out: dict[str, Any] = {}
    previous: dict[str, tuple[float, int]] = {}
    contenders = cfg.get("contenders", CONTENDERS)
    bar = progress(len(sets) * len(contenders), "fig 1: optimizer step", "contender")
    for set_name, spec in sets.items():
        bar.set_postfix_str(set_name)
        shapes = shape_set(spec)
        flops = standard_ns_flops(shapes)
        rows: dict[str, Any] = {}
        timed = []
        for name in contenders:
            if name == TORCH_MUON and not hasattr(torch.optim, "Muon"):
                rows[name] = {"skipped": f"torch {torch.__version__} has no torch.optim.Muon (torch >= 2.9 has)"}
                bar.update()
                continue
            if name != ADAMW and name in previous:
                seconds, prev_flops = previous[name]
                estimate = seconds * flops / prev_flops
                if estimate > cfg["max_step_s"]:
                    rows[name] = {"skipped": f"estimated {estimate:.3g} s per step from the previous set "
                                             f"(over the {cfg['max_step_s']:.3g} s per-step cap of this preset)"}
                    bar.update()
                    continue
            timed.append(name)
        measured = time_steps(timed, shapes, cfg["repeats"], cfg["min_repeats"], cfg["budget_s"], bar=bar,
                              device=cfg.get("device", "cpu"))
        for name in contenders:
            if name in measured:
                rows[name] = measured[name]
                previous[name] = (measured[name]["median"], flops)
        base = rows[ADAMW]["median"]
        for row in rows.values():
            if row.get("median") is not None:
                row["x_adamw"] = row["median"] / base
        out[set_name] = {"spec": spec, "matrices": len(shapes), "parameters": sum(r * c for r, c in shapes),
                         "standard_ns_gflop": flops / 1e9, "contenders": rows}
    bar.close()
    return out


def _interleaved_medians(fns: list[Callable[[], Any]], repeats: int, device: torch.device) -> list[float]:
    """Median time of each of ``fns`` (work on ``device``), timed in alternation (a, b, a, b, ...) after
    one untimed call each, so that a burst of load from elsewhere on a shared machine hits them alike."""
    for fn in fns:
        fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples):
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            out.append(time.perf_counter() - start)
    return [sorted(s)[len(s) // 2] for s in samples]


def _fastest_layout(b: int, m: int, k: int, n: int, dtype: torch.dtype, gen: torch.Generator,
                    repeats: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Operands of a bare ``[b, m, k] @ [b, k, n]`` in the memory layout (each operand row- or
    column-major) the machine multiplies fastest: the reference is the best this machine does."""
    def operand(rows: int, cols: int, transposed: bool) -> torch.Tensor:
        if transposed:
            return torch.randn(b, cols, rows, generator=gen, dtype=dtype).to(device).mT
        return torch.randn(b, rows, cols, generator=gen, dtype=dtype).to(device)

    out = torch.empty(b, m, n, dtype=dtype, device=device)
    variants = [(operand(m, k, tx), operand(k, n, ty)) for tx in (False, True) for ty in (False, True)]
    times = _interleaved_medians([lambda x=x, y=y: torch.bmm(x, y, out=out) for x, y in variants], repeats, device)
    x, y = variants[times.index(min(times))]
    return x, y, out


def policy_ns_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype ``hf_muon.Muon`` runs Newton–Schulz in on ``device`` by default."""
    from ..optimizer.muon import resolve_ns_dtype

    return resolve_ns_dtype(None, torch.device(device))


def ns_efficiency(shapes: list[tuple[int, int]], repeats: int, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> dict[str, Any]:
    """Newton–Schulz time per distinct shape (batched as hf_muon.Muon batches it) against the time of
    the bare matrix products it executes, in the same order (``torch.bmm`` into preallocated
    outputs, same batch, shapes and dtype, each product in its fastest operand layout), timed in
    alternation with it:
    ``fraction = bare time / NS time`` = achieved FLOP/s over the machine's matmul FLOP/s."""
    from ..kernels.newton_schulz import ns_flops, ns_matmuls, orthogonalize, resolve_method

    device = torch.device(device)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for (r, c), count in Counter(shapes).items():
        batch = torch.randn(count, r, c, generator=gen).to(device)
        for label, method in (("shipped", resolve_method(r, c, NS_STEPS, dtype)), ("before", "standard")):
            if label == "before" and method == rows[-1]["method"]:  # the same code path: measured once
                rows.append({**rows[-1], "kernel": label})
                continue
            products = ns_matmuls(r, c, NS_STEPS, method, dtype)
            buffers = {mkn: _fastest_layout(count, *mkn, dtype, gen, repeats, device) for mkn in set(products)}

            def bare() -> None:
                for mkn in products:
                    x, y, out = buffers[mkn]
                    torch.bmm(x, y, out=out)

            def ns() -> None:
                orthogonalize(batch, NS_STEPS, "quintic", dtype, method=method)

            ns_time, bare_time = _interleaved_medians([ns, bare], repeats, device)
            executed = count * ns_flops(r, c, NS_STEPS, method, dtype)
            standard = count * ns_flops(r, c, NS_STEPS, "standard")
            rows.append({
                "shape": [r, c], "batch": count, "kernel": label, "method": method, "ns_s": ns_time,
                "bare_matmul_s": bare_time, "executed_gflop": executed / 1e9,
                "achieved_gflops": executed / ns_time / 1e9, "machine_gflops": executed / bare_time / 1e9,
                "fraction_of_machine": bare_time / ns_time, "standard_equivalent_gflops": standard / ns_time / 1e9,
            })
    totals = {}
    for label in ("shipped", "before"):
        sel = [row for row in rows if row["kernel"] == label]
        ns_total = sum(row["ns_s"] for row in sel)
        bare_total = sum(row["bare_matmul_s"] for row in sel)
        executed = sum(row["executed_gflop"] for row in sel)
        totals[label] = {"ns_s": ns_total, "bare_matmul_s": bare_total, "fraction_of_machine": bare_total / ns_total,
                         "achieved_gflops": executed / ns_total,
                         "machine_gflops": executed / bare_total,
                         "standard_equivalent_gflops": standard_ns_flops(shapes) / 1e9 / ns_total}
    return {"dtype": str(dtype).replace("torch.", ""), "steps": NS_STEPS, "per_shape": rows, "total": totals}


def torch_muon_ns(g: torch.Tensor) -> torch.Tensor:
    """``torch.optim.Muon``'s orthogonalization of ``g``, measured through its public API.

    One step with momentum 0 (the buffer becomes ``g``), no Nesterov blend, no weight decay,
    ``adjust_lr_fn="original"`` and lr 1 on a zero parameter whose gradient is ``g`` leaves the
    parameter at ``-scale * NS(g)``, ``scale = sqrt(max(1, rows / cols))``: ``NS(g)`` is read back
    from it (exactly when ``scale`` is 1, to an fp32 rounding otherwise). Its Newton–Schulz runs in
    bf16 with the optimizer's defaults (quintic coefficients, ``NS_STEPS`` steps, its eps)."""
    if g.ndim != 2:
        raise ValueError(f"torch.optim.Muon orthogonalizes 2-D matrices, got shape {tuple(g.shape)}")
    param = nn.Parameter(torch.zeros_like(g, dtype=torch.float32))
    param.grad = g.detach().to(torch.float32).clone()
    opt = torch.optim.Muon([param], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False, ns_steps=NS_STEPS,
                           adjust_lr_fn="original")
    opt.step()
    rows, cols = g.shape
    scale = math.sqrt(max(1.0, rows / cols))
    return param.detach().neg() / scale


def ns_variants(shipped: torch.dtype,
                device: torch.device | str = "cpu") -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The Newton–Schulz variants of the orthogonality table; ``shipped`` is the policy's dtype on
    ``device`` (named in the shipped variant's label: "CPU", "CUDA", ...)."""
    from ..kernels.newton_schulz import orthogonalize

    f32, bf16 = torch.float32, torch.bfloat16
    other = f32 if shipped == bf16 else bf16
    name, other_name = (str(d).replace("torch.", "") for d in (shipped, other))
    variants = {
        "torch.optim.Muon (quintic, bf16, 5 steps)": torch_muon_ns,
        f"hf_muon shipped on this {torch.device(device).type.upper()} (quintic, {name}, Frobenius, 5 steps)":
            lambda g: orthogonalize(g, 5, "quintic", shipped, precondition="frobenius"),
        f"hf_muon AOL (quintic, {name}, 4 steps)": lambda g: orthogonalize(g, 4, "quintic", shipped, precondition="aol"),
        f"hf_muon AOL (quintic, {name}, 5 steps)": lambda g: orthogonalize(g, 5, "quintic", shipped, precondition="aol"),
        f"hf_muon quintic {other_name} (Frobenius, 5 steps)": lambda g: orthogonalize(g, 5, "quintic", other),
        "hf_muon Polar Express fp32 (5 steps)": lambda g: orthogonalize(g, 5, "polar_express", f32),
        "hf_muon Polar Express fp32 (8 steps)": lambda g: orthogonalize(g, 8, "polar_express", f32),
    }
    if not hasattr(torch.optim, "Muon"):  # torch < 2.9
        del variants["torch.optim.Muon (quintic, bf16, 5 steps)"]
    return variants


ORTHO_INPUTS = ("gaussian", "low_rank")


def ortho_input(kind: str, shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """A seeded test matrix: ``"gaussian"``, or ``"low_rank"`` (gradient-like: a rank-4 signal with
    entries about 1 plus Gaussian noise of 1e-2, whose tiny singular values Newton–Schulz must lift)."""
    rows, cols = shape
    if kind == "gaussian":
        return torch.randn(shape, generator=gen)
    if kind == "low_rank":
        signal = torch.randn(rows, 4, generator=gen) @ torch.randn(4, cols, generator=gen) / 2
        return signal + 1e-2 * torch.randn(shape, generator=gen)
    raise ValueError(f"kind must be one of {ORTHO_INPUTS}, got {kind!r}")


def orthogonality(shapes: list[tuple[int, int]], shipped: torch.dtype,
                  device: torch.device | str = "cpu") -> dict[str, Any]:
    """Per variant and input kind (:data:`ORTHO_INPUTS`): relative Frobenius error ``|O - U V^T| / |U V^T|``
    and the range of O's singular values, on one seeded matrix per distinct shape (the error averaged
    with the shapes' counts). The variants run on ``device``; the SVDs and errors on the CPU in float64."""
    gen = torch.Generator().manual_seed(2)
    counts = Counter(shapes)
    variants = ns_variants(shipped, device)
    out: dict[str, Any] = {name: {} for name in variants}
    for kind in ORTHO_INPUTS:
        inputs = {shape: ortho_input(kind, shape, gen) for shape in counts}
        polar = {}
        for shape, g in inputs.items():
            u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
            polar[shape] = u @ vh
        for name, fn in variants.items():
            errors, smin, smax = [], [], []
            for shape, g in inputs.items():
                o = fn(g.to(device)).double().cpu()
                errors += [((o - polar[shape]).norm() / polar[shape].norm()).item()] * counts[shape]
                s = torch.linalg.svdvals(o)
                smin.append(s.min().item())
                smax.append(s.max().item())
            out[name][kind] = {"relative_error": sum(errors) / len(errors), "sigma_min": min(smin),
                               "sigma_max": max(smax)}
    return out


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Figure 1 with the preset's ``cfg``: ``sets`` (name -> d, layers, heads, kv_heads, optional ff; the
    first is the set the NS FLOP/s target reads; the step-time target reads every set), ``contenders``, ``repeats``, ``min_repeats``, ``budget_s``,
    ``max_step_s``, ``ns_sets`` (sets whose Newton–Schulz FLOP/s is measured), ``ns_repeats``, and
    optionally ``device`` (default ``"cpu"``)."""
    sets = cfg["sets"]
    device = torch.device(cfg.get("device", "cpu"))
    dtype = policy_ns_dtype(device)
    result: dict[str, Any] = {"device": str(device), "torch_threads": torch.get_num_threads(),
                              "ns_dtype": str(dtype).replace("torch.", "")}
    contenders = cfg.get("contenders", CONTENDERS)
    if dtype == torch.float32:  # ns_dtype=fp32 is then what hf_muon.Muon runs anyway
        contenders = [c for c in contenders if c != HF_MUON_FP32]
    result["step_time"] = step_times(sets, {**cfg, "contenders": contenders})
    result["ns_efficiency"] = {}
    result["orthogonality"] = {}
    ns_sets = cfg.get("ns_sets", list(sets))
    bar = progress(len(ns_sets) + len(sets), "fig 1: NS FLOP/s and orthogonality", "part")
    for set_name in ns_sets:
        result["ns_efficiency"][set_name] = ns_efficiency(shape_set(sets[set_name]), cfg["ns_repeats"], dtype, device)
        bar.update()
    for set_name, spec in sets.items():
        result["orthogonality"][set_name] = orthogonality(shape_set(spec), dtype, device)
        bar.update()
    bar.close()
    return result
