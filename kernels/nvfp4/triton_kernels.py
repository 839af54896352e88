"""NVFP4 quantize / dequantize in Triton, bit-identical to `reference` (the format is
described there once).

Every rounding is spelled out in integer/float32 arithmetic that is exact or IEEE
round-to-nearest on both a GPU and the CPU interpreter (TRITON_INTERPRET=1):

* divisions use `tl.div_rn` (plain `/` on fp32 may lower to an approximate division);
* fp32 → bf16 and fp32 → e4m3 roundings are done on the bit pattern, not with `.to()`:
  the interpreter's bf16/fp8 casts truncate or round half-up without carrying, so they
  are not round-to-nearest-even (fp32 → fp16 `.to()` is correct on both: numpy astype);
* the e4m3 scale is written as its bit pattern into a uint8 view of the fp8 tensor.

Quantize (and dequantize to fp32/fp16): one program handles BLOCK_M rows × BLOCK_G blocks of
16 inputs. Dequantize to bf16, the learner's hot path, runs over the flat packed bytes instead
(contiguous loads and stores; see `_nvfp4_dequantize_bf16_kernel`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .reference import (
    BLOCK,
    FP4_MAX,
    FP8_MAX,
    ZERO_BLOCK_SCALE,
    NVFP4Tensor,
    check_global_scale,
    check_weight,
)

_DTYPE_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# Format constants as Triton globals (module-level tl.constexpr).
FP4_MAX_C = tl.constexpr(FP4_MAX)
FP8_MAX_C = tl.constexpr(FP8_MAX)
ZERO_SCALE_C = tl.constexpr(ZERO_BLOCK_SCALE)
ZERO_CODE_C = tl.constexpr(0x20)  # e4m3 bit pattern of 0.125


@triton.jit
def _round_bf16(v):
    """fp32 → nearest-even bf16, returned as fp32 (finite inputs)."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_to_weight_dtype(v, KIND: tl.constexpr):
    if KIND == 1:
        v = _round_bf16(v)
    elif KIND == 2:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def _e4m3_round(s):
    """0 <= s <= 448 → (nearest-even e4m3 value as fp32, its bit pattern as int32)."""
    # normal range (s >= 2^-6): keep 3 mantissa bits of the fp32 pattern, ties to even
    bits = s.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 == 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    # subnormal range: a multiple of 2^-9, ties to even (n, its integer part, exact)
    n = s * 512.0
    n_int = n.to(tl.int32)  # truncation; n >= 0
    frac = n - n_int.to(tl.float32)
    n_int = n_int + ((frac > 0.5) | ((frac == 0.5) & ((n_int & 1) == 1))).to(tl.int32)
    is_sub = s < 0.015625
    value = tl.where(is_sub, n_int.to(tl.float32) * 0.001953125, normal)
    # e4m3 bits: exponent field = fp32 exponent - 120, 3 mantissa bits
    nbits = ((value.to(tl.int32, bitcast=True) >> 20) - 960) & 0x7F
    code = tl.where(value < 0.015625, n_int, nbits)
    return value, code


@triton.jit
def _e4m3_decode(code):
    """int32 e4m3 bit patterns (no NaN) → fp32 values."""
    exp = (code >> 3) & 15
    man = code & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    val = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)
    return tl.where((code & 0x80) != 0, -val, val)


@triton.jit
def _e2m1_decode(code):
    """int32 E2M1 codes 0..15 → fp32 values (code 8 is -0.0)."""
    exp = (code >> 1) & 3
    man = code & 1
    bits = tl.where(exp == 0, man * 0x3F000000, ((exp + 126) << 23) | (man << 22))
    bits = bits | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _nvfp4_quantize_kernel(
    x_ptr, g_ptr, packed_ptr, scale_ptr, M, K,
    KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
):
    G = K // 16
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    grps = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    lanes = tl.arange(0, 16)
    mask2 = (rows < M)[:, None] & (grps < G)[None, :]
    mask3 = mask2[:, :, None]
    rows64 = rows.to(tl.int64)[:, None, None]
    cols = grps[None, :, None] * 16 + lanes[None, None, :]
    x = tl.load(x_ptr + rows64 * K + cols, mask=mask3, other=0.0).to(tl.float32)

    g = tl.load(g_ptr)
    amax = tl.max(tl.abs(x), axis=2)
    s = g * _round_to_weight_dtype(tl.div_rn(amax, FP4_MAX_C), KIND)
    s, s_code = _e4m3_round(tl.minimum(s, FP8_MAX_C))
    s_code = tl.where(s == 0.0, ZERO_CODE_C, s_code)
    s = tl.where(s == 0.0, ZERO_SCALE_C, s)
    s_eff = tl.div_rn(s, g)

    q = tl.div_rn(x, s_eff[:, :, None])
    a = tl.abs(q)
    mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
           + (a > 5.0).to(tl.int32))
    code = mag | ((q < 0.0).to(tl.int32) << 3)
    lo, hi = tl.split(tl.reshape(code, (BLOCK_M, BLOCK_G, 8, 2)))
    byte = (lo | (hi << 4)).to(tl.uint8)

    pcols = grps[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    tl.store(packed_ptr + rows64 * (K // 2) + pcols, byte, mask=mask3)
    tl.store(scale_ptr + rows.to(tl.int64)[:, None] * G + grps[None, :],
             s_code.to(tl.uint8), mask=mask2)


@triton.jit
def _nvfp4_dequantize_kernel(
    packed_ptr, scale_ptr, g_ptr, out_ptr, M, K,
    KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
):
    G = K // 16
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    grps = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    mask2 = (rows < M)[:, None] & (grps < G)[None, :]
    mask3 = mask2[:, :, None]
    rows64 = rows.to(tl.int64)
    pcols = grps[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    byte = tl.load(packed_ptr + rows64[:, None, None] * (K // 2) + pcols, mask=mask3, other=0)
    byte = byte.to(tl.int32)
    s_code = tl.load(scale_ptr + rows64[:, None] * G + grps[None, :], mask=mask2, other=0)
    g = tl.load(g_ptr)
    s_eff = tl.div_rn(_e4m3_decode(s_code.to(tl.int32)), g)
    code = tl.reshape(tl.join(byte & 15, byte >> 4), (BLOCK_M, BLOCK_G, 16))
    w = _e2m1_decode(code) * s_eff[:, :, None]
    cols = grps[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    offs = rows64[:, None, None] * K + cols
    if KIND == 2:
        tl.store(out_ptr + offs, w.to(tl.float16), mask=mask3)
    else:
        tl.store(out_ptr + offs, w, mask=mask3)


@triton.jit
def _nvfp4_dequantize_bf16_kernel(packed_ptr, scale_ptr, g_ptr, out_ptr, n_bytes, row_bytes,
                                  BLOCK: tl.constexpr, G_PER_ROW: tl.constexpr = False):
    """bf16 Ŵ over the flat packed bytes: byte i holds inputs 2i, 2i+1 and its block scale is
    scale[i // 8] (a row of K/2 bytes is K/16 whole blocks), so every load and store is
    contiguous. Each byte becomes one 32-bit word, the low nibble's bf16 in the low half.
    G_PER_ROW: one global scale per row (row i // row_bytes), for vLLM's fused shards."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_bytes
    byte = tl.load(packed_ptr + offs, mask=mask, other=0).to(tl.int32)
    s_code = tl.load(scale_ptr + offs // 8, mask=mask, other=0).to(tl.int32)
    if G_PER_ROW:
        g = tl.load(g_ptr + offs // row_bytes, mask=mask, other=1.0)
    else:
        g = tl.load(g_ptr)
    s_eff = tl.div_rn(_e4m3_decode(s_code), g)
    lo = _round_bf16(_e2m1_decode(byte & 15) * s_eff).to(tl.int32, bitcast=True)
    hi = _round_bf16(_e2m1_decode(byte >> 4) * s_eff).to(tl.int32, bitcast=True)
    tl.store(out_ptr + offs, ((lo >> 16) & 0xFFFF) | (hi & -65536), mask=mask)


_BLOCK_M = 16
_BLOCK_G = 16  # 256 inputs per program row
_BF16_BLOCK = 8192  # packed bytes per program of the bf16 dequantize (swept on an H200: NOTES.md)
_BF16_WARPS = 8


def _grid(m: int, k: int):
    return (triton.cdiv(m, _BLOCK_M), triton.cdiv(k // BLOCK, _BLOCK_G))


def _check_device(t: torch.Tensor) -> None:
    if not t.is_cuda and not isinstance(_nvfp4_quantize_kernel, InterpretedFunction):
        raise ValueError(
            f"Triton NVFP4 kernels need CUDA tensors (got {t.device}); on CPU use "
            "kernels.nvfp4.reference, or set TRITON_INTERPRET=1 before importing this module"
        )


def quantize(weight: torch.Tensor, global_scale: torch.Tensor) -> NVFP4Tensor:
    """Triton twin of `reference.quantize` (same checks, same bytes)."""
    check_weight(weight)
    g = check_global_scale(global_scale).to(weight.device).contiguous()
    _check_device(weight)
    x = weight.detach().contiguous()
    m, k = x.shape
    packed = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    scale = torch.empty((m, k // BLOCK), dtype=torch.uint8, device=x.device)
    if m and k:
        _nvfp4_quantize_kernel[_grid(m, k)](
            x, g, packed, scale, m, k,
            KIND=_DTYPE_KIND[x.dtype], BLOCK_M=_BLOCK_M, BLOCK_G=_BLOCK_G,
        )
    return NVFP4Tensor(packed, scale.view(torch.float8_e4m3fn), g.clone())


def dequantize(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Triton twin of `reference.dequantize`. For a bf16 result `weight_global_scale` may also
    hold one divisor per row (vLLM's fused q/k/v, gate/up shards keep their own)."""
    if dtype not in _DTYPE_KIND:
        raise ValueError(f"dequantize: dtype must be bf16/fp16/fp32, got {dtype}")
    if weight_packed.dtype != torch.uint8 or weight_packed.ndim != 2:
        raise ValueError(
            f"weight_packed must be uint8 [out, in/2], got {weight_packed.dtype} "
            f"{tuple(weight_packed.shape)}"
        )
    m, half = weight_packed.shape
    k = half * 2
    if k % BLOCK != 0 or tuple(weight_scale.shape) != (m, k // BLOCK):
        raise ValueError(
            f"weight_scale shape {tuple(weight_scale.shape)} does not fit weight_packed "
            f"{tuple(weight_packed.shape)} (expected {(m, k // BLOCK)})"
        )
    dev = weight_packed.device
    per_row = (dtype == torch.bfloat16 and m > 1 and isinstance(weight_global_scale, torch.Tensor)
               and weight_global_scale.numel() == m)
    if per_row:  # not read back here (a sync per call); the caller checked the values at load
        g = weight_global_scale.detach().to(device=dev, dtype=torch.float32).reshape(m).contiguous()
    elif isinstance(weight_global_scale, torch.Tensor) and weight_global_scale.is_cuda:
        # Hot path (the learner dequantizes every layer on every call): checking the value
        # here would read it back to the host, a GPU sync per call that was measured to make
        # a 3584x3584 dequantize take 0.21 ms instead of tens of us. The value is checked
        # where the tensor is made (NVFP4Linear.from_checkpoint_tensors, the quantizer).
        if weight_global_scale.numel() != 1:
            raise ValueError("NVFP4 global_scale must be a tensor holding one number")
        g = weight_global_scale.detach().to(device=dev, dtype=torch.float32).reshape(1).contiguous()
    else:
        g = check_global_scale(weight_global_scale).to(dev).contiguous()
    _check_device(weight_packed)
    packed = weight_packed.contiguous()
    scale = weight_scale.to(dev).contiguous().view(torch.uint8)
    out = torch.empty((m, k), dtype=dtype, device=dev)
    if m and k and dtype == torch.bfloat16:
        n = packed.numel()
        _nvfp4_dequantize_bf16_kernel[(triton.cdiv(n, _BF16_BLOCK),)](
            packed, scale, g, out.view(torch.int32), n, half, BLOCK=_BF16_BLOCK, G_PER_ROW=per_row,
            num_warps=_BF16_WARPS)
    elif m and k:
        _nvfp4_dequantize_kernel[_grid(m, k)](
            packed, scale, g, out, m, k, KIND=_DTYPE_KIND[dtype], BLOCK_M=_BLOCK_M, BLOCK_G=_BLOCK_G,
        )
    return out
