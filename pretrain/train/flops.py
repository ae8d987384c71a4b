"""FLOPs of a training step, TFLOP/s and MFU, and the devices they are measured on.

FLOPs are counted, not derived from a formula: torch's FlopCounterMode records the matmuls and attention of
one real forward + backward. That stays right for every mix of objectives (sparse MLM heads, ELECTRA's
generator, PLM's second stream) without a hand-kept formula per objective.
"""

from __future__ import annotations

import os
import platform
import re

import torch
from torch.utils.flop_counter import FlopCounterMode

# Dense peak TFLOP/s per device for 16-bit (bf16/fp16) and fp32 (TF32 where the tensor cores do it), from
# the vendors' data sheets; `train.peak_tflops` overrides.
PEAK_TFLOPS = {
    "H200": {"16": 989.0, "32": 494.5},
    "H100 SXM": {"16": 989.0, "32": 494.5},
    "H100 PCIe": {"16": 756.0, "32": 378.0},
    "H100": {"16": 989.0, "32": 494.5},
    "A100": {"16": 312.0, "32": 156.0},
    "A10G": {"16": 125.0, "32": 62.5},
    "L4": {"16": 121.0, "32": 60.0},
    "V100": {"16": 125.0, "32": 15.7},
}


def _cpu_attention_formulas() -> dict:
    """torch counts SDPA's CUDA kernels but not the CPU's flash kernel (whose work is the same): without these an MFU
    on the CPU leaves attention out. The formulas are torch's own for the flash kernel (same argument order)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    def forward(query, key, value, *args, out_shape=None, **kwargs) -> int:  # shapes: FlopCounterMode passes them
        return sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out, query, key, value)

    aten = torch.ops.aten
    return {
        aten._scaled_dot_product_flash_attention_for_cpu: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward,
    }


def count_step_flops(fn) -> int:
    """FLOPs of everything `fn()` runs (call it around a forward and backward)."""
    with FlopCounterMode(display=False, custom_mapping=_cpu_attention_formulas()) as counter:
        fn()
    return int(counter.get_total_flops())


def device_peak_tflops(precision: str, override: float = 0.0) -> float | None:
    """Peak TFLOP/s of one device of this machine, or None when unknown (e.g. a CPU; set train.peak_tflops)."""
    if override > 0:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    bits = "32" if precision == "fp32" else "16"
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # most specific name first ("H100 PCIe" before "H100")
        if re.search(re.escape(key).replace(r"\ ", r".*"), name, flags=re.IGNORECASE):
            return PEAK_TFLOPS[key][bits]
    return None


def device_description() -> str:
    """The devices this process trains on, in words: "1 x NVIDIA H100 80GB HBM3" or "CPU: AMD EPYC ... (2 cores)"."""
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"CPU: {model} ({cores} cores)"


def throughput_metrics(flops_per_s: float, world_size: int, peak_tflops: float | None) -> dict[str, float]:
    achieved = flops_per_s / 1e12  # TFLOP/s over all ranks
    out = {"tflops": float(f"{achieved / world_size:.4g}")}  # per device, as MFU is
    if peak_tflops:
        out["mfu"] = float(f"{achieved / (world_size * peak_tflops):.4g}")
    return out
