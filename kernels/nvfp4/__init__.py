"""NVFP4 (compressed-tensors ``nvfp4-pack-quantized``) weight quantization.

`reference` is plain torch and defines the format; `triton_kernels` is its bit-identical
Triton twin. `quantize` / `dequantize` here pick Triton for CUDA tensors and the reference
otherwise (Triton is imported only when a CUDA tensor arrives).
"""
from __future__ import annotations

import torch

from .reference import BLOCK, NVFP4Tensor, global_scale

__all__ = ["BLOCK", "NVFP4Tensor", "global_scale", "quantize", "dequantize"]


def _impl(t: torch.Tensor):
    if t.is_cuda:
        from . import triton_kernels

        return triton_kernels
    from . import reference

    return reference


def quantize(weight: torch.Tensor, global_scale: torch.Tensor) -> NVFP4Tensor:
    """NVFP4-quantize `weight` [out, in] under `global_scale` (see `reference.quantize`)."""
    return _impl(weight).quantize(weight, global_scale)


def dequantize(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Ŵ [out, in] in `dtype` from the three NVFP4 tensors (see `reference.dequantize`)."""
    return _impl(weight_packed).dequantize(weight_packed, weight_scale, weight_global_scale, dtype)
