"""NVFP4 weight quantization in plain torch: the bit-exact reference.

Format (compressed-tensors ``nvfp4-pack-quantized``, scheme preset ``NVFP4A16``, as
llm-compressor writes it data-free and vLLM loads it). For a Linear weight W [out, in]:

* ``weight_global_scale`` g, float32 [1]: g = 448·6 / amax(W), shared by a fused group
  (q/k/v, gate/up) as the group's smallest g. It is a *divisor*: vLLM inverts it on load.
* ``weight_scale`` s, float8_e4m3fn [out, in/16]: one scale per block of 16 consecutive
  inputs, s = e4m3(min(g · (amax_block / 6), 448)), and s = 0.125 where that rounds to 0.
* ``weight_packed`` uint8 [out, in/2]: E2M1 codes of W / (s / g), two per byte, element 2i
  in the low nibble. Code = sign << 3 | magnitude index into {0, .5, 1, 1.5, 2, 3, 4, 6};
  rounding is to nearest, ties to the even code (OCP MX spec), saturating at 6.

Dequantization: Ŵ = E2M1(code) · (s / g), computed in float32, rounded once to ``dtype``.

Every float operation below mirrors compressed-tensors 0.17 operation for operation (the
dtype each step rounds in matters on ties); the comments name the library code mirrored.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

BLOCK = 16
FP4_MAX = 6.0
FP8_MAX = 448.0
# compressed-tensors `_get_dtype_eps(float8_e4m3fn)`: the scale given to blocks whose e4m3
# scale is 0 (an all-zero block, or one g·amax/6 rounds to zero), to avoid dividing by 0.
ZERO_BLOCK_SCALE = 0.125
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class NVFP4Tensor(NamedTuple):
    """One quantized weight, under the parameter names a compressed-tensors checkpoint uses."""

    weight_packed: torch.Tensor  # uint8 [out, in/2]
    weight_scale: torch.Tensor  # float8_e4m3fn [out, in/16]
    weight_global_scale: torch.Tensor  # float32 [1]


def check_weight(weight: torch.Tensor) -> None:
    """Raise ValueError unless `weight` is a finite floating [out, in] tensor, in % 16 == 0."""
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"NVFP4 expects a 2-D weight [out, in], got {shape}")
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"NVFP4 expects a bf16/fp16/fp32 weight, got {weight.dtype}")
    if weight.shape[1] % BLOCK != 0:
        raise ValueError(
            f"NVFP4 needs in_features divisible by {BLOCK}, got weight shape {tuple(weight.shape)}"
        )
    if not bool(torch.isfinite(weight).all()):
        bad = int((~torch.isfinite(weight)).sum())
        raise ValueError(
            f"NVFP4 weight of shape {tuple(weight.shape)} has {bad} NaN/Inf value(s)"
        )


def check_global_scale(global_scale: torch.Tensor) -> torch.Tensor:
    """The global scale as float32 [1]; ValueError unless it is one finite positive number."""
    if not isinstance(global_scale, torch.Tensor) or global_scale.numel() != 1:
        raise ValueError("NVFP4 global_scale must be a tensor holding one number")
    g = global_scale.detach().to(torch.float32).reshape(1)
    if not bool(torch.isfinite(g).all()) or not bool((g > 0).all()):
        raise ValueError(f"NVFP4 global_scale must be finite and > 0, got {g.item()}")
    return g


def global_scale(*weights: torch.Tensor) -> torch.Tensor:
    """float32 [1]: 448·6 / amax for weights that share one global scale (the group's min).

    Mirrors compressed-tensors `generate_gparam` as llm-compressor's weight observer calls it
    (min/max of the whole tensor in the weight's dtype), then llm-compressor's
    `update_fused_layer_weight_global_scales` (min over the fused group). Two library details
    the plain formula leaves out: the division runs in the *weight's* dtype (a python float
    divided by a bf16 tensor is bf16, so for bf16 weights g carries bf16 rounding before it is
    stored as float32), and amax is clamped to finfo.tiny with NaN/Inf results replaced by 1.0
    (so an all-zero weight gets g = 1).
    """
    if not weights:
        raise ValueError("global_scale needs at least one weight")
    scales = []
    for w in weights:
        if w.numel() == 0:
            raise ValueError(f"global_scale got an empty weight of shape {tuple(w.shape)}")
        if not bool(torch.isfinite(w).all()):
            raise ValueError(f"global_scale: weight of shape {tuple(w.shape)} has NaN/Inf")
        amax = w.detach().abs().amax()
        amax = torch.clamp(amax, min=torch.finfo(amax.dtype).tiny)
        g = FP8_MAX * FP4_MAX / amax  # in w.dtype, as generate_gparam
        g = torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0)
        scales.append(g.to(torch.float32).reshape(1))
    return torch.min(torch.cat(scales)).reshape(1)


def block_scales(weight: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [out, in/16] block scales of a checked weight under global scale g."""
    out, inn = weight.shape
    amax = weight.detach().reshape(out, inn // BLOCK, BLOCK).abs().amax(dim=-1)
    # calculate_qparams: `max_val_pos / 6` (rounds in the weight dtype), then
    # `global_scale * scales` (float32), then round_to_quantized_type_dtype: clamp to ±448
    # and cast to e4m3 (round to nearest even). The issue text's g·amax/6 is the same formula
    # but the library rounds amax/6 to the weight dtype first; the library wins.
    s = g * (amax / FP4_MAX)
    s = torch.clamp(s, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    s = torch.where(s == 0, torch.full_like(s, ZERO_BLOCK_SCALE), s)
    return s.to(torch.float8_e4m3fn)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (0..15) of float32 `x`, round to nearest, ties to even, saturating.

    Same thresholds as compressed-tensors `FP4_E2M1_DATA.cast_to_fp4`: |x| <= .25 → 0,
    < .75 → .5, <= 1.25 → 1, < 1.75 → 1.5, <= 2.5 → 2, < 3.5 → 3, <= 5 → 4, else 6; the
    closed/open ends are exactly ties-to-even. A negative x that rounds to zero keeps its
    sign bit (code 8), as the library's `sign(x) * 0 = -0.0` does; -0.0 itself gives code 0.
    """
    a = x.abs()
    mag = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    )
    return mag | ((x < 0).to(torch.uint8) << 3)


def quantize(weight: torch.Tensor, global_scale: torch.Tensor) -> NVFP4Tensor:
    """Quantize a bf16/fp32 weight [out, in] to NVFP4 under `global_scale` (float32 [1])."""
    check_weight(weight)
    g = check_global_scale(global_scale).to(weight.device)
    out, inn = weight.shape
    scale = block_scales(weight, g)
    # _quantize: `scale = scale / global_scale` (float32), then `x / scale` (float32):
    # the library divides by s/g; multiplying by g/s instead rounds differently on ties.
    s_eff = scale.to(torch.float32) / g
    x = weight.detach().reshape(out, inn // BLOCK, BLOCK).to(torch.float32)
    codes = e2m1_codes(x / s_eff.unsqueeze(-1)).reshape(out, inn)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return NVFP4Tensor(packed.contiguous(), scale, g.clone())


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 E2M1 codes (sign bit 3 gives -0.0 for code 8)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def dequantize(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Ŵ [out, in] in `dtype` = E2M1 · (weight_scale / weight_global_scale), float32 math.

    Equals compressed-tensors `NVFP4PackedCompressor.decompress` bit for bit when dtype is
    bf16 (the dtype the library decompresses to).
    """
    if weight_packed.dtype != torch.uint8 or weight_packed.ndim != 2:
        raise ValueError(
            f"weight_packed must be uint8 [out, in/2], got {weight_packed.dtype} "
            f"{tuple(weight_packed.shape)}"
        )
    out, half = weight_packed.shape
    if half * 2 % BLOCK != 0 or tuple(weight_scale.shape) != (out, half * 2 // BLOCK):
        raise ValueError(
            f"weight_scale shape {tuple(weight_scale.shape)} does not fit weight_packed "
            f"{tuple(weight_packed.shape)} (expected {(out, half * 2 // BLOCK)})"
        )
    g = check_global_scale(weight_global_scale).to(weight_packed.device)
    codes = torch.stack((weight_packed & 0xF, weight_packed >> 4), dim=-1).reshape(out, half * 2)
    vals = e2m1_values(codes).reshape(out, half * 2 // BLOCK, BLOCK)
    s_eff = weight_scale.to(torch.float32) / g  # _dequantize: scale / global_scale
    return (vals * s_eff.unsqueeze(-1)).reshape(out, half * 2).to(dtype)
