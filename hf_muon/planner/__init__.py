"""``hf-muon plan``: what Muon will cost on a cluster, before renting it.

    plan_model("llama-3-8b", "zero3", [64, 1024], "h100-sxm", "ib-400g")   # list of Plan
    plan_for_shapes([(4096, 4096), ...], "ddp", 1, "cpu")                 # one Plan

Modules: ``model`` (the tensors training would see, from a config), ``cost`` (the cost model),
``presets`` (hardware figures), ``measure`` (the ``cpu`` preset's rates), ``report`` (tables, plot).
"""

from __future__ import annotations

import torch

from .cost import DEFAULT_NS_STEPS, LAYOUTS, Plan, plan, shapes_tensors
from .model import ModelTensors, load_model_tensors, preset_names
from .presets import CPU, Accelerator, accelerator, interconnect, with_peak

__all__ = ["LAYOUTS", "Plan", "plan_for_shapes", "plan_model", "plan_tensors", "preset_names"]


def _ns_dtypes(ns_dtype: torch.dtype | str | None, on_cpu: bool) -> tuple[torch.dtype, torch.dtype]:
    """(dtype NS runs in, dtype the owner plan costs) as ``Muon`` resolves them on that device."""
    from ..optimizer.muon import plan_ns_dtype, resolve_ns_dtype

    run = resolve_ns_dtype(ns_dtype, torch.device("cpu") if on_cpu else None)
    return run, plan_ns_dtype(ns_dtype)


def _matrix_shapes(tensors: ModelTensors) -> list[tuple[int, int]]:
    """Every matrix Newton–Schulz runs on (blocks, experts one by one), for the ``cpu`` measurement."""
    from dataclasses import replace

    from ..distributed.layout import replicated

    return [shape for t in tensors.muon_tensors
            for shape in replace(replicated(t.shape, t.stacked, 1), blocks=t.blocks).ns_matrices]


def plan_tensors(tensors: ModelTensors, layout: str, worlds: list[int], accelerator_name: str = "h100-sxm",
                 interconnect_name: str = "ib-400g", *, peak_tflops: float | None = None,
                 link_gbs: float | None = None, latency_us: float | None = None,
                 ns_dtype: torch.dtype | str | None = None, **options) -> list[Plan]:
    """One :class:`Plan` per world size in ``worlds`` for ``tensors`` (see ``cost.plan`` for ``options``:
    ns_steps, comm_dtype, bucket_bytes, param_bytes, grad_bytes, matmul_efficiency, overlap, sub_group_size).

    ``accelerator_name="cpu"`` measures this machine's matmul rate on the plan's own products and its
    memory bandwidth first (a few seconds): with all of torch's threads for one rank, with one thread
    per rank for several (as ``torchrun --nproc_per_node N`` runs them on one machine)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    for world in worlds:
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"world sizes must be integers >= 1, got {world!r}")
    steps = options.get("ns_steps", DEFAULT_NS_STEPS)
    if not (isinstance(steps, int) and 1 <= steps < 100):  # as hf_muon.Muon takes them
        raise ValueError(f"ns_steps must be an integer in [1, 100), got {steps!r}")
    device = accelerator(accelerator_name)
    link = interconnect(interconnect_name, link_gbs, latency_us)
    run_dtype, plan_dtype = _ns_dtypes(ns_dtype, device == CPU)
    measured: dict[int, Accelerator] = {}
    plans = []
    for world in worlds:
        if device == CPU:
            # CPU ranks share this machine: torchrun gives each of several local ranks one thread
            # (OMP_NUM_THREADS=1), a single process keeps torch's default.
            threads = 1 if world > 1 else torch.get_num_threads()
            if threads not in measured:
                from .measure import measure_cpu

                measured[threads] = measure_cpu(_matrix_shapes(tensors), steps, run_dtype, threads)
            rank_device = measured[threads]
        else:
            rank_device = device
        plans.append(plan(tensors, layout, world, with_peak(rank_device, peak_tflops), link, ns_dtype=run_dtype,
                          plan_dtype=plan_dtype, **options))
    return plans


def plan_model(model: str, layout: str, worlds: list[int], accelerator_name: str = "h100-sxm",
               interconnect_name: str = "ib-400g", *, ns_split: str = "block", **options) -> list[Plan]:
    """:func:`plan_tensors` for a model named by a shipped preset, a local folder or config.json, or a
    model id in the local Hugging Face cache; built from its config on the meta device."""
    return plan_tensors(load_model_tensors(model, ns_split), layout, worlds, accelerator_name, interconnect_name,
                        **options)


def plan_for_shapes(shapes: list[tuple[int, ...]], layout: str, world: int, accelerator_name: str = "cpu",
                    interconnect_name: str = "ib-400g", **options) -> Plan:
    """The plan of a list of matrix shapes (one Muon group, whole matrices, no AdamW parameters): the
    prediction to check against ``hf-muon bench``'s one-process figure 1 or a 2-rank ZeRO-3 run."""
    return plan_tensors(shapes_tensors(shapes), layout, [world], accelerator_name, interconnect_name, **options)[0]
