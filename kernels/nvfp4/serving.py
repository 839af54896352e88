"""The NVFP4 forward as one torch custom op for serving (vLLM's ``fused`` backend).

``torch.ops.qerl.nvfp4_linear(x, packed, scale, row_global_scale, bias)`` = x @ Ŵᵀ (+ bias)
with Ŵ never materialized, for x bf16 [M, K]. It is a registered custom op with a fake
(meta) implementation, so torch.compile (vLLM compiles its models) treats it as one opaque
node and CUDA graphs capture its kernel launches.

No autotuning: configs come from `SERVING_CONFIGS`, a fixed table by input rows, because an
autotuner benchmarks on first use, which must not happen while vLLM captures CUDA graphs.
Its entries are provisional: the tensor-core tile is the one the earlier M = 16 sweeps
favoured, the GEMV tile one that compiles lean (NOTES.md, sixth session); the forced-config
sweep (`benchmarks/nvfp4_gemm_sweep.py`) is what should fill it. The split-K count is
derived per call from the shape so that the grid fills the SMs.

* M = 1: the CUDA-core GEMV (`gemm._w4a16_gemv_kernel`), when K % its BLOCK_K == 0;
* M ≤ 16 (and M ≤ 32): the tensor-core kernel, swapped, split-K;
* larger M: Triton dequantize to a transient bf16 Ŵ (one layer at a time), then cuBLAS.
  At these sizes the GEMM is compute bound and cuBLAS beats the fused kernel
  (kernels/nvfp4/NOTES.md: 43-50 % of cuBLAS at M = 4096).

Status: checked on the CPU (interpreter) against the dequantized reference, including under
torch.compile; not yet measured on a GPU.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton

# rows bound -> forced config of kernels/nvfp4/gemm.py (SPLIT_K filled in per call)
SERVING_CONFIGS: list[tuple[int, dict]] = [
    (1, dict(GEMV=True, BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=1)),
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SWAP_AB=True, num_warps=4, num_stages=4)),
    (32, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, SWAP_AB=True, num_warps=4, num_stages=4)),
]
MAX_SPLIT = 8


def _split_k(tiles: int, k_tiles: int, sms: int) -> int:
    """Split-K count: doubled while the programs stay within two per SM and every split keeps
    at least 2 K tiles."""
    split = 1
    while split < MAX_SPLIT and tiles * split <= sms and k_tiles >= 4 * split:
        split *= 2
    return split


def config_for(m: int, n: int, k: int, sms: int) -> Optional[dict]:
    """The forced config for an [m, k] x [n, k]ᵀ forward, or None for dequantize + cuBLAS."""
    for rows, cfg in SERVING_CONFIGS:
        if m <= rows:
            if cfg.get("GEMV") and k % cfg["BLOCK_K"]:
                continue
            bm = 1 if cfg.get("GEMV") else cfg["BLOCK_M"]
            tiles = triton.cdiv(m, bm) * triton.cdiv(n, cfg["BLOCK_N"])
            return dict(cfg, SPLIT_K=_split_k(tiles, k // cfg["BLOCK_K"], sms))
    return None


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def prepare(device: torch.device) -> None:
    """Allocate the split-K counter buffer now (at model load), not during CUDA-graph capture."""
    from . import gemm

    gemm._counters(device, 1 << 16)


@torch.library.custom_op("qerl::nvfp4_linear", mutates_args=())
def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, row_global_scale: torch.Tensor,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] bf16 @ Ŵᵀ (+ bias) -> [M, N] bf16; Ŵ = E2M1(packed) · scale / row_global_scale[row]."""
    from . import gemm, triton_kernels

    m, k = x.shape
    n = packed.shape[0]
    cfg = config_for(m, n, k, _num_sms(x.device))
    if cfg is None:  # per-row divisors are handled by the bf16 dequantize too
        w = triton_kernels.dequantize(packed, scale, row_global_scale, torch.bfloat16)
        return torch.nn.functional.linear(x, w, bias)
    return gemm.linear_w4a16(x, packed, scale, row_global_scale, bias, _config=cfg)


@nvfp4_linear.register_fake
def _(x, packed, scale, row_global_scale, bias=None):
    return x.new_empty((x.shape[0], packed.shape[0]))
