"""Hardware presets for ``hf-muon plan``: accelerators (matmul rate, memory bandwidth) and links.

Figures are vendors' datasheet peaks (dense, no sparsity); the planner applies an efficiency to
the matmul peak (see ``cost.MATMUL_EFFICIENCY``). The ``cpu`` accelerator has no fixed figures: its
rates are measured on this machine when a plan asks for it (``measure.measure_cpu``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Accelerator:
    """One device: peak dense matmul FLOP/s in bf16 and fp32, memory bandwidth (bytes/s), memory (bytes).

    ``measured``: the rates are this machine's, timed on the plan's shapes (no efficiency applied)."""

    name: str
    bf16_flops: float
    fp32_flops: float
    memory_bandwidth: float
    memory_bytes: float
    measured: bool = False


@dataclass(frozen=True)
class Interconnect:
    """The link each rank's collectives cross: bandwidth per GPU per direction (bytes/s) and a
    latency per collective call (seconds)."""

    name: str
    bandwidth: float
    latency: float


T, G = 1e12, 1e9
ACCELERATORS: dict[str, Accelerator] = {
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16 tensor core (1979 with sparsity), 67 TFLOP/s
    # FP32 (non-tensor), 494 TFLOP/s TF32 dense; 3.35 TB/s HBM3, 80 GB.
    # https://www.nvidia.com/en-us/data-center/h100/
    # fp32 matmuls run on TF32 tensor cores only with allow_tf32; hf_muon's fp32 NS does not enable it.
    "h100-sxm": Accelerator("h100-sxm", 989 * T, 67 * T, 3.35e12, 80 * G),
    # NVIDIA H200 SXM datasheet: same Hopper compute as H100 SXM (989 TFLOP/s dense BF16), 4.8 TB/s HBM3e,
    # 141 GB. https://www.nvidia.com/en-us/data-center/h200/
    "h200": Accelerator("h200", 989 * T, 67 * T, 4.8e12, 141 * G),
    # NVIDIA A100 SXM 80GB datasheet: 312 TFLOP/s dense BF16, 19.5 TFLOP/s FP32, 2.039 TB/s HBM2e.
    # https://www.nvidia.com/en-us/data-center/a100/
    "a100": Accelerator("a100", 312 * T, 19.5 * T, 2.039e12, 80 * G),
}
CPU = "cpu"  # measured at plan time
LOOPBACK = "loopback"  # 2-process gloo on this machine, measured at plan time (CPU validation runs)

INTERCONNECTS: dict[str, Interconnect] = {
    # InfiniBand NDR 400 Gb/s, one HCA per GPU (DGX H100: 8x ConnectX-7 400G): 50 GB/s per GPU per
    # direction. Latency: a few microseconds per message on NDR; 20 us per NCCL collective call is
    # the order of NCCL's small-message latency across nodes (nccl-tests), used as a floor.
    "ib-400g": Interconnect("ib-400g", 50 * G, 20e-6),
    # InfiniBand HDR 200 Gb/s per GPU (DGX A100): 25 GB/s per direction.
    "ib-200g": Interconnect("ib-200g", 25 * G, 20e-6),
    # NVLink 4 (H100 SXM): 900 GB/s bidirectional per GPU, 450 GB/s per direction; within one node.
    # https://www.nvidia.com/en-us/data-center/nvlink/
    "nvlink4": Interconnect("nvlink4", 450 * G, 8e-6),
    # NVLink 3 (A100 SXM): 600 GB/s bidirectional, 300 GB/s per direction.
    "nvlink3": Interconnect("nvlink3", 300 * G, 8e-6),
    # RoCE / Ethernet 100 Gb/s per node: 12.5 GB/s.
    "eth-100g": Interconnect("eth-100g", 12.5 * G, 30e-6),
}


def accelerator(name: str) -> Accelerator | str:
    """The preset ``name``; ``"cpu"`` is returned as is (its rates are measured per plan)."""
    if name == CPU:
        return CPU
    if name not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {name!r}; choose one of {sorted(ACCELERATORS) + [CPU]}")
    return ACCELERATORS[name]


def with_peak(device: Accelerator, peak_tflops: float | None) -> Accelerator:
    """``device`` with its matmul rate (any dtype) set to ``peak_tflops`` (``--peak_tflops``), if given."""
    if peak_tflops is None:
        return device
    if not 0 < peak_tflops < float("inf"):
        raise ValueError(f"--peak_tflops must be a finite number > 0, got {peak_tflops}")
    return replace(device, name=f"{device.name} at {peak_tflops:g} TFLOP/s", bf16_flops=peak_tflops * T,
                   fp32_flops=peak_tflops * T)


def interconnect(name: str, link_gbs: float | None = None, latency_us: float | None = None) -> Interconnect:
    """The preset ``name``, its bandwidth overridden by ``link_gbs`` (GB/s per direction) if given.
    ``"loopback"`` is measured now (2 gloo processes on this machine, a few seconds)."""
    if name == LOOPBACK:
        from .measure import measure_loopback

        bandwidth, latency = measure_loopback()
        preset = Interconnect(f"loopback (measured: {bandwidth / G:.2f} GB/s, {latency * 1e6:.0f} us)", bandwidth,
                              latency)
    elif name not in INTERCONNECTS:
        raise ValueError(f"unknown interconnect {name!r}; choose one of {sorted(INTERCONNECTS) + [LOOPBACK]} "
                         "(or give --link_gbs with any of them)")
    else:
        preset = INTERCONNECTS[name]
    if link_gbs is not None:
        if not 0 < link_gbs < float("inf"):
            raise ValueError(f"--link_gbs must be a finite number > 0, got {link_gbs}")
        preset = replace(preset, name=f"{name} at {link_gbs:g} GB/s", bandwidth=link_gbs * G)
    if latency_us is not None:
        if not 0 <= latency_us < float("inf"):
            raise ValueError(f"--latency_us must be a number >= 0, got {latency_us}")
        preset = replace(preset, latency=latency_us * 1e-6)
    return preset
