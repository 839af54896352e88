"""W4A16 GEMMs on a frozen NVFP4 weight: the packed 4-bit codes are dequantized in registers
inside the K loop, so the bf16 weight never exists in HBM.

For W [N, K] in the format of `reference` (packed uint8 [N, K/2], e4m3 block scales [N, K/16],
float32 divisor g):

* `linear_w4a16(x, ...)`     = x @ Wᵀ (+ bias)   [.., K] → [.., N]   (forward)
* `grad_input_w4a16(dy, ...)` = dy @ W            [.., N] → [.., K]   (backward, dX)

`reference_linear` / `reference_grad_input` are the plain-torch twins (reference dequantize
to bf16 Ŵ, float32 matmul, bf16 out).

Arithmetic. Inside the loop a weight element is decoded to the bf16 value E2M1(code) · s
(s the e4m3 block scale). That product is *exact* in bf16 (2 significant bits times 4, all
within bf16's exponent range), so no rounding happens before the tensor-core dot; the
divisor g is applied once to the float32 accumulator in the epilogue (`div_rn`), and the
result is rounded to bf16 (nearest even). This is the exact product with the float32
dequantized weight, i.e. slightly *more* accurate than multiplying by the bf16-rounded Ŵ that
`reference.dequantize` returns (they differ by ≤ 2⁻⁹ relative per weight element).

Decoding. On the GPU, inline PTX (`_DECODE_WORD_ASM` in the forward, 17 instructions per 8
weights; `_DECODE_ASM` in dX, 20) produces E2M1 · s · 2^-8 in bf16 (exact) and the epilogue
multiplies by 2^8; the CPU interpreter, which cannot run PTX, uses an integer decode in
float32: an E2M1 code c becomes the bf16 bit pattern
(c&7 >= 2 ? ((c&7) << 6) + 0x3F00 : (c&7) · 0x3F00) | (c&8) << 12. Both give the same products.
The e4m3 scale bytes are loaded as uint8 and decoded with `triton_kernels._e4m3_decode` (no fp8
dtype). Measured speeds and what limits them: NOTES.md.

One kernel serves both directions. The weight tile is always read as [rows of W, columns of
W], with the two codes of a byte adjacent along W's columns (K): in the forward the columns
are the reduction dim (tile [BLOCK_N, BLOCK_K]), in dX the reduction runs over W's rows and
the columns are the output dim (tile [BLOCK_K, BLOCK_N]); either way a tile is loaded as
bytes [rows, groups, 8] (so the block scale [rows, groups] broadcasts over a group's 8 bytes),
decoded into the low- and high-nibble weights, joined and reshaped to [rows, groups·16] (the
pair of a join sits in one thread).

One input row (M = 1, decoding one sequence) can also run on CUDA cores,
`_w4a16_gemv_kernel`, selected only by a forced config (`_config={"GEMV": True, ...}`) until
it is measured on a GPU (NOTES.md, sixth session). The forward takes either one global
scale or one per W row (vLLM fuses q/k/v and gate/up, whose shards keep their own).

Small M (decode-like) uses split-K: each split stores its float32 partial tile into a
workspace, bumps a per-tile counter, and the last split to arrive sums the partials in split
order (deterministic), applies g/bias, writes bf16 and resets the counter to 0 (so the
counter buffer, cached per device, stays zeroed). One launch, no atomics on data.
Caveat: two of these kernels running concurrently on different streams would share the
counter buffer; the trainer uses one stream.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .reference import BLOCK
from .reference import dequantize as _reference_dequantize
from .triton_kernels import _e4m3_decode, _round_bf16

__all__ = [
    "linear_w4a16",
    "grad_input_w4a16",
    "reference_linear",
    "reference_grad_input",
    "INTERPRET",
]


# ------------------------------------------------------------------ the kernel

# Inline PTX (GPU only): 4 packed bytes → their 4 low-nibble and 4 high-nibble weights as bf16,
# times the block scale. Operands: $0,$1 low codes of bytes (0,1),(2,3); $2,$3 high codes;
# $4 the 4 bytes; $5,$6 the scale of elements (0,1),(2,3) as bf16x2.
# A code's 3 magnitude bits go to bf16 bits 6-8 (mantissa msb + 2 low exponent bits) and its
# sign to bit 15: that is E2M1(code) · 2^-126 exactly (code 1 lands on the subnormal 2^-127),
# so the scale operand carries s · 2^118 and the epilogue multiplies by 2^8 (`_SCALE_BIAS`).
# One prmt spreads bytes (0,1) to bits 0-7 and 16-23 of a word with zero bytes between; then
# a low code needs << 12 (sign to bit 15) and << 6 (magnitude to bits 6-8), and the zero bytes
# keep both shifted words clean where the other one's bits land, so one lop3 ((x | y) & mask)
# finishes the pair; a high code needs << 8 and << 2 after an and that drops the low codes
# (whose lowest bit << 8 would land on bit 8). 2 prmt + 2 × 3 + 2 × 4 + 4 bf16x2 fma = 20
# instructions for 8 weights.
def _decode_ptx(scales=(5, 6)) -> str:
    """The PTX of `_DECODE_ASM`: one shift/shift/lop3 (+ and) group per output register.
    `scales`: the operands holding the scale of bytes (0,1) and (2,3) as bf16x2."""
    lines = ["{", ".reg .b32 t01, t23, x, y, u, z, o;", "mov.b32 z, 0x80008000;", "mov.b32 o, 0;",
             "prmt.b32 t01, $4, o, 0x4140;", "prmt.b32 t23, $4, o, 0x4342;"]
    for out, src, scale in ((0, "t01", scales[0]), (1, "t23", scales[1])):  # low codes: bits 0-3 of a half
        lines += [f"shl.b32 x, {src}, 12;", f"shl.b32 y, {src}, 6;",
                  "lop3.b32 x, x, y, 0x81C081C0, 0xA8;", f"fma.rn.bf16x2 ${out}, x, ${scale}, z;"]
    for out, src, scale in ((2, "t01", scales[0]), (3, "t23", scales[1])):  # high codes: bits 4-7
        lines += [f"and.b32 u, {src}, 0x00F000F0;", "shl.b32 x, u, 8;", "shl.b32 y, u, 2;",
                  "lop3.b32 x, x, y, 0x81C081C0, 0xA8;", f"fma.rn.bf16x2 ${out}, x, ${scale}, z;"]
    return "\n" + "\n".join(lines + ["}"]) + "\n"


_DECODE_ASM = tl.constexpr(_decode_ptx())
# The forward's decode (`_decode_tile_kperm`): one 32-bit word of packed bytes c0..c3 → 8 bf16
# outputs, times the block scale. $8 the word, $9 s · 2^118 twice as bf16x2; outputs $0..$7 are
# 16-bit, index 4ν + 2j + h = the code of nibble ν (0 low, 1 high) of byte c = j + 2h, so each
# output pair ($2i, $2i+1) is one bf16x2 register: the same nibble of bytes (0, 2) or (1, 3),
# which sit 16 bits apart. A pair's two codes, masked out (and), go to their places with one
# multiply that is two shifts and an or, since the shifted copies do not overlap: low codes
# (bits 0-3 of a half) · (2^12 + 2^6) put the sign on bit 15 and the magnitude on bits 6-8,
# high codes (bits 4-7) · (2^8 + 2^2) the same; an and keeps those bits. Bytes 1, 3 take one
# shift first. 1 + 4 × (and, mul, and, fma) = 17 instructions for 8 weights, no prmt.
def _decode_word_ptx() -> str:
    lines = ["{", ".reg .b32 v, x, z;", "mov.b32 z, 0x80008000;", "shr.b32 v, $8, 8;"]
    for outs, src, keep, mul in (((0, 1), "$8", "0x000F000F", 4160), ((2, 3), "v", "0x000F000F", 4160),
                                 ((4, 5), "$8", "0x00F000F0", 260), ((6, 7), "v", "0x00F000F0", 260)):
        lines += [f"and.b32 x, {src}, {keep};", f"mul.lo.u32 x, x, {mul};", "and.b32 x, x, 0x81C081C0;",
                  "fma.rn.bf16x2 x, x, $9, z;", f"mov.b32 {{${outs[0]}, ${outs[1]}}}, x;"]
    return "\n" + "\n".join(lines + ["}"]) + "\n"


_DECODE_WORD_ASM = tl.constexpr(_decode_word_ptx())
# Two e4m3 block scales (the bytes of the 16-bit $2, sm_89+) → each as s · 2^118 in bf16,
# twice per 32-bit word ($0 the low byte's, $1 the high byte's): the scale operand of
# `_DECODE_WORD_ASM`. The hardware turns the pair into f16x2 (exact: every e4m3 value is a
# normal f16, or zero). A nonzero f16 of exponent field E and mantissa m is the bf16 of
# exponent field E + 112 and mantissa m >> 3 (exact: e4m3 has 3 mantissa bits), so per half
# ((f >> 3) & 0x0FFF) + (112 + 118) << 7 is |s| · 2^118; a zero must stay zero, so that addend
# is taken min(half, 1) times (min.u16x2, then one mad); the sign sits on bit 15 in both
# formats. 8 instructions for 2 scales where the float32 route (cvt, × 2^118, cvt.bf16,
# × 0x10001, and byte shuffles to pair the inputs) took ~24. `scale_pair_bits` is the same
# arithmetic in torch (tests).
_SCALE_PAIR_EXP = (112 + 118) << 7  # f16 → bf16 exponent bias, and the decode's 2^118


def _scale_pair_ptx() -> str:
    return "\n".join(["", "{", ".reg .b32 f, t, n, one;", "mov.b32 one, 0x00010001;",
                      "cvt.rn.f16x2.e4m3x2 f, $2;", "shr.b32 t, f, 3;", "and.b32 t, t, 0x0FFF0FFF;",
                      "min.u16x2 n, t, one;", f"mad.lo.u32 t, n, {_SCALE_PAIR_EXP}, t;",
                      "lop3.b32 t, t, f, 0x80008000, 0xF8;",  # t | (f & sign bits)
                      "prmt.b32 $0, t, t, 0x1010;", "prmt.b32 $1, t, t, 0x3232;", "}", ""])


_SCALE_PAIR_ASM = tl.constexpr(_scale_pair_ptx())


def scale_pair_bits(f16_bits: torch.Tensor) -> torch.Tensor:
    """`_SCALE_PAIR_ASM`'s arithmetic on one f16 half (int32 tensor of f16 bit patterns) →
    the bf16 bit patterns of s · 2^118 (for tests: the PTX runs on GPUs only)."""
    t = (f16_bits >> 3) & 0x0FFF
    return (t + torch.clamp(t, max=1) * _SCALE_PAIR_EXP) | (f16_bits & 0x8000)


def _decode_f32_ptx() -> str:
    """`_DECODE_ASM` with float32 outputs (for the CUDA-core GEMV, which multiplies in float32):
    $0-$3 the low-nibble weights of bytes 0-3, $4-$7 the high-nibble ones; inputs $8 the 4
    bytes, $9/$10 the scales as bf16x2. Each bf16x2 result is split with one shift (low half)
    and one and (high half): a bf16 is the top half of the float32 with the same value."""
    lines = ["{", ".reg .b32 t01, t23, x, y, z, v;", "mov.b32 z, 0x80008000;",
             "prmt.b32 t01, $8, $8, 0x1100;", "prmt.b32 t23, $8, $8, 0x3322;"]
    # (outputs for the two bytes of the pair, byte pair, magnitude shift, sign shift, scale)
    for outs, src, mag, sign, scale in (((0, 1), "t01", 6, 12, 9), ((2, 3), "t23", 6, 12, 10),
                                        ((4, 5), "t01", 2, 8, 9), ((6, 7), "t23", 2, 8, 10)):
        lines += [f"shl.b32 x, {src}, {mag};", f"shl.b32 y, {src}, {sign};",
                  "lop3.b32 x, x, y, 0x01C001C0, 0xE4;", "and.b32 x, x, 0x81C081C0;",
                  f"fma.rn.bf16x2 v, x, ${scale}, z;",
                  f"shl.b32 ${outs[0]}, v, 16;", f"and.b32 ${outs[1]}, v, 0xFFFF0000;"]
    return "\n" + "\n".join(lines + ["}"]) + "\n"


_DECODE_F32_ASM = tl.constexpr(_decode_f32_ptx())
_SCALE_BIAS = 256.0  # the GPU decode's weights are E2M1 · s · 2^-8 (see _DECODE_ASM)
_SCALE_BIAS_C = tl.constexpr(_SCALE_BIAS)
_TWO_POW_118 = tl.constexpr(2.0 ** 118)


@triton.jit
def _e2m1_fp32(code):
    """int32 codes 0..15 → float32 E2M1 values (portable integer decode)."""
    idx = code & 7
    mag = tl.where(idx >= 2, (idx << 6) + 0x3F00, idx * 0x3F00)  # bf16 bit pattern of |value|
    bits = (mag | ((code & 8) << 12)) << 16
    return bits.to(tl.float32, bitcast=True)


def _hw_e4m3() -> bool:
    """Whether this process's GPU converts e4m3 in hardware (sm_89 and newer)."""
    try:
        return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    except Exception:  # noqa: BLE001 - no usable CUDA: the portable decode
        return False


_HW_E4M3 = tl.constexpr(_hw_e4m3())


@triton.jit
def _scale_f32(sc, GPU_MATH: tl.constexpr):
    """e4m3 block-scale bytes (uint8) → float32 values (exact either way). On sm_89+ the
    hardware conversion (cvt from e4m3x2): 0-14 % fewer SASS instructions in the K loops
    than the integer decode (NOTES.md, sixth session); the interpreter has no fp8 type and
    older GPUs no fp8 conversion, so they decode the bits."""
    if GPU_MATH and _HW_E4M3:
        return sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return _e4m3_decode(sc.to(tl.int32))


@triton.jit
def _decode_nibbles(b, s, BR: tl.constexpr, G: tl.constexpr, GPU_MATH: tl.constexpr, F32: tl.constexpr):
    """bytes b uint8 [BR, G, 8] + their block scales s float32 [BR, G] → (low-nibble,
    high-nibble) weights [BR, G, 8], times the block scale.

    GPU_MATH: inline PTX, values E2M1 · s · 2^-8 (exact), as bf16 (`_DECODE_ASM`) or, with F32,
    float32 (`_DECODE_F32_ASM`); otherwise (the CPU interpreter, whose bf16 arithmetic and bf16
    tl.dot are wrong) float32 values E2M1 · s (exact)."""
    if GPU_MATH:
        s2 = tl.broadcast_to((s * _TWO_POW_118).to(tl.bfloat16)[:, :, None], (BR, G, 8))  # s · 2^118
        if F32:
            lo, hi = tl.inline_asm_elementwise(
                _DECODE_F32_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [b, s2],
                dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
        else:
            lo, hi = tl.inline_asm_elementwise(
                _DECODE_ASM, "=r,=r,=r,=r,r,r,r", [b, s2],
                dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        bi = b.to(tl.int32)
        lo = _e2m1_fp32(bi & 15) * s[:, :, None]
        hi = _e2m1_fp32(bi >> 4) * s[:, :, None]
    return lo, hi


@triton.jit
def _decode_tile(b, sc, BR: tl.constexpr, G: tl.constexpr, GPU_MATH: tl.constexpr):
    """bytes b uint8 [BR, G, 8] + e4m3 bytes sc uint8 [BR, G] → the weights [BR, G*16]
    (element 2i from the low nibble of byte i), times the block scale (`_decode_nibbles`:
    bf16 on the GPU, float32 in the interpreter)."""
    lo, hi = _decode_nibbles(b, _scale_f32(sc, GPU_MATH), BR, G, GPU_MATH, False)
    return tl.reshape(tl.join(lo, hi), (BR, G * 16))  # the join's pair sits in one thread


@triton.jit
def _decode_tile_kperm(w, sc, BR: tl.constexpr, G: tl.constexpr, GPU_MATH: tl.constexpr,
                       SCALE_PAIRS: tl.constexpr = False):
    """`_decode_tile` for a K-permuted tile: its packed bytes as int32 words w [BR, G*2] in
    memory order + e4m3 bytes sc uint8 [BR, G] → the weights [BR, G*16] in the reduction order
    p of `_kperm`.

    Word 4G·l/8 + q of a row holds bytes i = 2G·l + 4q + c (c = 0..3), and byte i elements
    k = 2i + ν (ν = 0: low nibble, 1: high). With c = j + 2h that is k = 4G·l + 8q + 4h + 2j + ν,
    block scale k // 16 = (G/4)·l + q // 2, and the tile goes to position
    p = 16(2q + ν) + 8j + 2l + h. In wgmma's A fragment a thread holds positions
    16g + 2l + {0, 1, 8, 9} of a row for every g: its 2G contiguous bytes 2G·l … 2G·l + 2G - 1,
    i.e. G/2 whole words. Each of its 32-bit fragment registers (positions p, p + 1, h = 0, 1)
    is then one bf16x2 output of `_DECODE_WORD_ASM`, so nothing is repacked."""
    if SCALE_PAIRS:  # sc: int16 [BR, G/2], two scales each (see the kernel's SCALE_PAIRS)
        s0, s1 = tl.inline_asm_elementwise(_SCALE_PAIR_ASM, "=r,=r,h", [sc], dtype=(tl.int32, tl.int32),
                                           is_pure=True, pack=1)
        s = tl.reshape(tl.join(s0, s1), (BR, G))  # s · 2^118 as bf16, twice in one 32-bit word
    elif GPU_MATH:
        s = (_scale_f32(sc, GPU_MATH) * _TWO_POW_118).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
        s = (s & 0xFFFF) | (s << 16)
    else:
        s = _scale_f32(sc, GPU_MATH)  # [BR, G]: (l, q // 2) in memory order
    s = tl.reshape(tl.broadcast_to(tl.reshape(s, (BR, 4, G // 4, 1)), (BR, 4, G // 4, 2)), (BR, 4, G // 2))
    w = tl.reshape(w, (BR, 4, G // 2))
    if GPU_MATH:
        l00, l01, l10, l11, h00, h01, h10, h11 = tl.inline_asm_elementwise(
            _DECODE_WORD_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, s],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:  # code of nibble ν of byte c = j + 2h: bits 8c + 4ν
        l00 = _e2m1_fp32((w >> 0) & 15) * s
        l01 = _e2m1_fp32((w >> 16) & 15) * s
        l10 = _e2m1_fp32((w >> 8) & 15) * s
        l11 = _e2m1_fp32((w >> 24) & 15) * s
        h00 = _e2m1_fp32((w >> 4) & 15) * s
        h01 = _e2m1_fp32((w >> 20) & 15) * s
        h10 = _e2m1_fp32((w >> 12) & 15) * s
        h11 = _e2m1_fp32((w >> 28) & 15) * s
    # names: (l|h) = ν, then j, then h
    lo = tl.join(tl.join(l00, l01), tl.join(l10, l11))  # [BR, l, q, h, j]
    hi = tl.join(tl.join(h00, h01), tl.join(h10, h11))
    x = tl.permute(tl.join(lo, hi), (0, 2, 5, 4, 1, 3))  # [BR, l, q, h, j, ν] → [BR, q, ν, j, l, h]
    return tl.reshape(x, (BR, G * 16))


@triton.jit
def _kperm(a, BR: tl.constexpr, G: tl.constexpr):
    """Columns of a [BR, G*16] in the reduction order p of `_decode_tile_kperm`:
    column k = 4G·l + 8q + 4h + 2j + ν moves to p = 16(2q + ν) + 8j + 2l + h."""
    a = tl.permute(tl.reshape(a, (BR, 4, G // 2, 2, 2, 2)), (0, 2, 5, 4, 1, 3))
    return tl.reshape(a, (BR, G * 16))


@triton.jit
def _pdl_start(packed_ptr, rows, stride_w, first_byte, row_bytes, PF_LINES: tl.constexpr):
    """Programmatic dependent launch (PDL=True; the launch sets `launch_pdl`): this grid may
    start while the kernel before it in the stream is finishing, so it asks L2 for the first
    PF_LINES 128-byte lines of each of its weight rows (the weight is not written by anyone),
    then waits for the previous kernel (`griddepcontrol.wait`) before anything reads the input
    or writes: after the wait, the previous kernel's writes are visible and its reads done."""
    line = tl.arange(0, PF_LINES) * 128
    off = first_byte + tl.where(line < row_bytes, line, 0)
    ptrs = packed_ptr + rows[:, None] * stride_w + off[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
    tl.extra.cuda.gdc_wait()


@triton.jit
def _w4a16_kernel(
    a_ptr, packed_ptr, scale_ptr, g_ptr, bias_ptr, c_ptr, ws_ptr, cnt_ptr,
    M, N_OUT, RED, R, C, MN, stride_am, stride_ak, stride_w, stride_s, SPLIT_K, M_BUCKET,
    TRANS_W: tl.constexpr,  # False: c = a @ Wᵀ (reduce over W's columns); True: c = a @ W
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
    GPU_MATH: tl.constexpr,
    PERMUTE_K: tl.constexpr,  # forward only, EVEN_K, BLOCK_K % 64 == 0: see _decode_tile_kperm
    A_PREPERM: tl.constexpr = False,  # PERMUTE_K: the input arrives in order p (`_permute_input`)
    EVICT_W: tl.constexpr = False,  # weight loads marked evict_first (read once)
    G_PER_ROW: tl.constexpr = False,  # forward: one global scale per W row (vLLM's fused shards)
    EVEN_N: tl.constexpr = False,  # K-permuted forward: N_OUT % BLOCK_N == 0, the weight loads need no mask
    SCALE_PAIRS: tl.constexpr = False,  # K-permuted forward on sm_89+, BLOCK_K >= 128, even scale stride:
    # the block scales load as int16 pairs (a thread's G/4 scales of a row are contiguous) and
    # decode two at a time (`_SCALE_PAIR_ASM`)
    PDL: tl.constexpr = False,  # forward, sm_90+, launched with launch_pdl: see `_pdl_start`
):
    # ---- tile of the output (grouped order: GROUP_M row-tiles share a column-tile in L2)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N_OUT, BLOCK_N)
    width = GROUP_M * grid_n
    group_id = pid // width
    first_m = group_id * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size

    # ---- this split's range of K tiles
    k_tiles = tl.cdiv(RED, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt0 = pid_k * per_split
    kt1 = tl.minimum(kt0 + per_split, k_tiles)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = kt0 * BLOCK_K + tl.arange(0, BLOCK_K)
    m_ok = rm < M
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + rk.to(tl.int64)[None, :] * stride_ak
    a_step = BLOCK_K * stride_ak

    CG = C // 16
    j8 = tl.arange(0, 8)
    if TRANS_W:
        # W tile [BLOCK_K rows (reduction), BLOCK_N cols (output)]
        GW: tl.constexpr = BLOCK_N // 16
        rows = rk.to(tl.int64)
        grp = pid_n * GW + tl.arange(0, GW)
        p_ptrs = packed_ptr + rows[:, None, None] * stride_w + (grp[None, :, None] * 8 + j8[None, None, :])
        s_ptrs = scale_ptr + rows[:, None] * stride_s + grp[None, :]
        p_step = BLOCK_K * stride_w
        s_step = BLOCK_K * stride_s
        col_ok = grp < CG
    else:
        # W tile [BLOCK_N rows (output), BLOCK_K cols (reduction)]
        GW: tl.constexpr = BLOCK_K // 16
        rows = rn.to(tl.int64)
        grp = kt0 * GW + tl.arange(0, GW)
        if PERMUTE_K:  # the tile's bytes in memory order as int32 words, [BLOCK_N, BLOCK_K / 8]
            p_ptrs = (packed_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (stride_w // 4)
                      + (kt0 * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8))[None, :])
            p_step = BLOCK_K // 8
        else:
            p_ptrs = packed_ptr + rows[:, None, None] * stride_w + (grp[None, :, None] * 8 + j8[None, None, :])
            p_step = BLOCK_K // 2
        if PERMUTE_K and SCALE_PAIRS:
            s_ptrs = (scale_ptr.to(tl.pointer_type(tl.int16)) + rows[:, None] * (stride_s // 2)
                      + (kt0 * (GW // 2) + tl.arange(0, GW // 2))[None, :])
            s_step = GW // 2
        else:
            s_ptrs = scale_ptr + rows[:, None] * stride_s + grp[None, :]
            s_step = GW
        row_ok = rn < R

    if PDL:  # forward only: the first 4 K tiles of this program's weight rows
        _pdl_start(packed_ptr, rn.to(tl.int64) % R, stride_w, kt0 * (BLOCK_K // 2), (kt1 - kt0) * (BLOCK_K // 2),
                   (4 * BLOCK_K // 2 + 127) // 128)

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    for kt in range(kt0, kt1):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            k_ok = (kt * BLOCK_K + tl.arange(0, BLOCK_K)) < RED
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if not GPU_MATH:
            a = a.to(tl.float32)  # interpreter: float32 dot of the exact bf16 values
        if TRANS_W:
            wmask = col_ok[None, :]
            if not EVEN_K:
                wmask = wmask & k_ok[:, None]
            b = tl.load(p_ptrs, mask=wmask[:, :, None], other=0)
            sc = tl.load(s_ptrs, mask=wmask, other=0)
            w = _decode_tile(b, sc, BLOCK_K, GW, GPU_MATH)  # [BK, BN]
            if SWAP_AB:
                acc = tl.dot(tl.trans(w), tl.trans(a), acc)
            else:
                acc = tl.dot(a, w, acc)
        else:
            wmask = row_ok[:, None]
            if PERMUTE_K:  # EVEN_K
                if EVICT_W:
                    b = tl.load(p_ptrs, mask=wmask, other=0, eviction_policy="evict_first")
                    sc = tl.load(s_ptrs, mask=wmask, other=0, eviction_policy="evict_first")
                elif EVEN_N:  # no mask: 17 fewer instructions per K step (16x64x128)
                    b = tl.load(p_ptrs)
                    sc = tl.load(s_ptrs)
                else:
                    b = tl.load(p_ptrs, mask=wmask, other=0)
                    sc = tl.load(s_ptrs, mask=wmask, other=0)
                w = _decode_tile_kperm(b, sc, BLOCK_N, GW, GPU_MATH, SCALE_PAIRS)  # [BN, BK], order p
                if not A_PREPERM:
                    a = _kperm(a, BLOCK_M, GW)
            else:
                if not EVEN_K:
                    g_ok = (kt * GW + tl.arange(0, GW)) < CG
                    wmask = wmask & g_ok[None, :]
                b = tl.load(p_ptrs, mask=wmask[:, :, None], other=0)
                sc = tl.load(s_ptrs, mask=wmask, other=0)
                w = _decode_tile(b, sc, BLOCK_N, GW, GPU_MATH)  # [BN, BK]
            if SWAP_AB:
                acc = tl.dot(w, tl.trans(a), acc)
            else:
                acc = tl.dot(a, tl.trans(w), acc)
        a_ptrs += a_step
        p_ptrs += p_step
        s_ptrs += s_step

    if SWAP_AB:
        acc = tl.trans(acc)
    if GPU_MATH:
        acc = acc * _SCALE_BIAS_C  # the decoded weights carry 2^-8 (see _DECODE_ASM)
    n_ok = rn < N_OUT
    out_mask = m_ok[:, None] & n_ok[None, :]
    out_offs = rm.to(tl.int64)[:, None] * N_OUT + rn[None, :]
    if G_PER_ROW:  # forward only: output column = W row
        g = tl.load(g_ptr + rn, mask=n_ok, other=1.0)[None, :]
    else:
        g = tl.load(g_ptr)
    if SPLIT_K == 1:
        out = tl.div_rn(acc, g)
        if HAS_BIAS:
            out += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + out_offs, _round_bf16(out).to(tl.bfloat16), mask=out_mask)
    else:
        tl.store(ws_ptr + pid_k * MN + out_offs, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # last split of this tile: reduce in split order
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, SPLIT_K):
                total += tl.load(ws_ptr + s * MN + out_offs, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            out = tl.div_rn(total, g)
            if HAS_BIAS:
                out += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(c_ptr + out_offs, _round_bf16(out).to(tl.bfloat16), mask=out_mask)
            tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")  # ready for next launch


@triton.jit
def _w4a16_gemv_kernel(
    a_ptr, packed_ptr, scale_ptr, g_ptr, bias_ptr, c_ptr, ws_ptr, cnt_ptr,
    N_OUT, RED, stride_w, stride_s, SPLIT_K,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GPU_MATH: tl.constexpr,
    G_PER_ROW: tl.constexpr = False,
    PDL: tl.constexpr = False,  # sm_90+, launched with launch_pdl: see `_pdl_start`
):
    """The forward for one input row (M = 1: decoding one sequence) on CUDA cores.

    No tensor cores and no shared memory for the weight: each program streams a
    [BLOCK_N, BLOCK_K] weight tile per step straight into registers as bytes [BN, G, 8]
    (G = BLOCK_K/16 blocks of 8 bytes). Byte i of a row holds weights 2i (low nibble) and
    2i+1 (high nibble), and the input, read as 32-bit words, holds x[2i] in the low and
    x[2i+1] in the high half of word i; so the low nibbles multiply the words' low halves and
    the high nibbles the high halves, and no interleaving is needed. Weights are decoded
    straight to float32 (`_DECODE_F32_ASM`) and accumulated by FFMA into a float32
    [BLOCK_N, G, 8] accumulator (a byte's two products per slot), summed once after the loop.
    Bandwidth comes from occupancy (small programs, few registers) rather than a deep
    pipeline. a_ptr: the input as int32 words (K/2 of them, contiguous); RED % BLOCK_K == 0
    (the launcher checks). Split-K as in `_w4a16_kernel` (deterministic last-arriver
    reduction). Tiles that compile without spills: `GEMV_TILES` in
    benchmarks/nvfp4_gemm_sweep.py (about 7 SASS instructions per weight; NOTES.md)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_tiles = RED // BLOCK_K
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt0 = pid_k * per_split
    kt1 = tl.minimum(kt0 + per_split, k_tiles)
    G: tl.constexpr = BLOCK_K // 16

    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N_OUT
    rows = rn.to(tl.int64)
    grp = kt0 * G + tl.arange(0, G)
    j8 = tl.arange(0, 8)
    byte_in_row = grp[:, None] * 8 + j8[None, :]  # [G, 8]: also the input word index
    p_ptrs = packed_ptr + rows[:, None, None] * stride_w + byte_in_row[None, :, :]
    s_ptrs = scale_ptr + rows[:, None] * stride_s + grp[None, :]
    x_ptrs = a_ptr + byte_in_row
    if PDL:  # the first 4 K tiles of this program's weight rows
        _pdl_start(packed_ptr, rows % N_OUT, stride_w, kt0 * (BLOCK_K // 2), (kt1 - kt0) * (BLOCK_K // 2),
                   (4 * BLOCK_K // 2 + 127) // 128)

    acc = tl.zeros((BLOCK_N, G, 8), dtype=tl.float32)
    for _ in range(kt0, kt1):
        b = tl.load(p_ptrs, mask=n_ok[:, None, None], other=0, eviction_policy="evict_first")
        sc = tl.load(s_ptrs, mask=n_ok[:, None], other=0, eviction_policy="evict_first")
        xw = tl.load(x_ptrs)  # int32 [G, 8]
        x_lo = (xw << 16).to(tl.float32, bitcast=True)[None, :, :]  # x[2i]
        x_hi = (xw & -65536).to(tl.float32, bitcast=True)[None, :, :]  # x[2i+1]
        w_lo, w_hi = _decode_nibbles(b, _scale_f32(sc, GPU_MATH), BLOCK_N, G, GPU_MATH, True)
        acc += w_lo * x_lo  # two FFMA chains per byte; reduced once, after the loop
        acc += w_hi * x_hi
        p_ptrs += BLOCK_K // 2
        s_ptrs += G
        x_ptrs += BLOCK_K // 2
    acc = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BLOCK_N]

    if GPU_MATH:
        acc = acc * _SCALE_BIAS_C
    if G_PER_ROW:
        g = tl.load(g_ptr + rn, mask=n_ok, other=1.0)
    else:
        g = tl.load(g_ptr)
    if SPLIT_K == 1:
        out = tl.div_rn(acc, g)
        if HAS_BIAS:
            out += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(c_ptr + rn, _round_bf16(out).to(tl.bfloat16), mask=n_ok)
    else:
        tl.store(ws_ptr + pid_k * N_OUT + rn, acc, mask=n_ok)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s in range(0, SPLIT_K):
                total += tl.load(ws_ptr + s * N_OUT + rn, mask=n_ok, other=0.0, cache_modifier=".cg")
            out = tl.div_rn(total, g)
            if HAS_BIAS:
                out += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(c_ptr + rn, _round_bf16(out).to(tl.bfloat16), mask=n_ok)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")


try:
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction

    INTERPRET = isinstance(_w4a16_kernel, _InterpretedFunction)
except ImportError:  # pragma: no cover
    INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ------------------------------------------------------------------ configs

def _cfg(bm, bn, bk, warps, stages, swap, split=1):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SWAP_AB": swap, "SPLIT_K": split},
        num_warps=warps, num_stages=stages,
    )


# Compile cost matters (each variant takes ~3-15 s to compile for sm_90, serially), so the
# lists are short. All are swapped (out^T = W·a^T): the decoded tile is wgmma's A operand,
# straight from registers. Unswapped tiles put it in shared memory for the B operand; with the
# inline-PTX decode triton 3.6 fails to compile those (TritonGPUOptimizeDotOperands: "Illegal
# shared layout"), and on the H200 they were slower anyway (NOTES.md).
# small M (≤ 32): memory bound on the weight; split-K for parallelism.
_SMALL = [_cfg(bm, bn, bk, 4, 4, True, split)
          for bm in (16, 32)
          for bn, bk in ((64, 128), (64, 256), (128, 128))
          for split in (1, 2, 4, 8, 16)]
# medium M (≤ 512)
_MEDIUM = [_cfg(bm, bn, bk, w, st, True, split)
           for bm, bn, bk, w, st in ((64, 128, 128, 4, 3), (128, 128, 64, 8, 4), (128, 64, 128, 4, 4))
           for split in (1, 2, 4, 8)]
# large M: compute bound; the decode work per MAC is 1/BLOCK_M.
_LARGE = [_cfg(bm, bn, bk, w, st, True, 1)
          for bm, bn, bk, w, st in ((128, 128, 64, 8, 4), (256, 128, 64, 8, 3), (256, 128, 128, 8, 2),
                                    (128, 128, 64, 4, 4))]
_CONFIGS = _SMALL + _MEDIUM + _LARGE
_SMALL_IDS = {id(c) for c in _SMALL}
_MEDIUM_IDS = {id(c) for c in _MEDIUM}
_LARGE_IDS = {id(c) for c in _LARGE}

_NUM_SMS: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def _prune(configs, named_args, **kwargs):
    """The configs of M's bucket; split-K only while there are fewer than ~2 waves of output
    tiles, at most ~4 waves of programs, and every split gets ≥ 2 K tiles."""
    # Triton 3.6 passes keyword launch arguments in kwargs, not named_args (3.9 merges them).
    args = {**kwargs, **named_args}
    keep = _bucket_configs(args["M"], args["N_OUT"], args["RED"], args["M_BUCKET"],
                           _num_sms(args["a_ptr"].device))
    return [c for c in configs if id(c) in keep]


@functools.lru_cache(maxsize=4096)
def _bucket_configs(m: int, n_out: int, red: int, m_bucket: int, sms: int) -> frozenset:
    """ids of the configs `_prune` keeps (cached: the launcher asks on every call)."""
    if m_bucket <= 32:
        ids, bms = _SMALL_IDS, ((16,) if m_bucket <= 16 else (32,))
    elif m_bucket <= 512:
        ids, bms = _MEDIUM_IDS, (64, 128)
    else:
        ids, bms = _LARGE_IDS, (128, 256)
    out = []
    for c in _CONFIGS:
        kw = c.kwargs
        if id(c) not in ids or kw["BLOCK_M"] not in bms:
            continue
        split = kw["SPLIT_K"]
        if split > 1:
            tiles = triton.cdiv(m, kw["BLOCK_M"]) * triton.cdiv(n_out, kw["BLOCK_N"])
            if tiles >= 2 * sms or tiles * split > 4 * sms \
                    or triton.cdiv(red, kw["BLOCK_K"]) < 2 * split:
                continue
        out.append(id(c))
    return frozenset(out)


@functools.lru_cache(maxsize=4096)
def _workspace_plan(m: int, n_out: int, red: int, m_bucket: int, sms: int) -> tuple[int, int]:
    """(largest split, most output tiles) over the configs autotuning may pick for this call."""
    cands = [c for c in _CONFIGS if id(c) in _bucket_configs(m, n_out, red, m_bucket, sms)]
    return (max(c.kwargs["SPLIT_K"] for c in cands),
            max(triton.cdiv(m, c.kwargs["BLOCK_M"]) * triton.cdiv(n_out, c.kwargs["BLOCK_N"]) for c in cands))


# One fixed config under the interpreter (autotuning there would run every config on CPU).
INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "SWAP_AB": False, "SPLIT_K": 1,
                    "num_warps": 4, "num_stages": 1}

_autotuned = None


def _permute_k(trans_w: bool, red: int, block_k: int) -> bool:
    """Whether the forward reads its tile in the K-permuted order (`_decode_tile_kperm`)."""
    return not trans_w and red % block_k == 0 and block_k % 64 == 0


# Whether forward configs that do not say use SCALE_PAIRS (QERL_NVFP4_SCALE_PAIRS=1 turns it on).
# Off: correct on an H100 (zero / subnormal / 448 scales, odd addresses) but no measurable gain
# inside vLLM (kernels/nvfp4/NOTES.md, 2026-12-05 afternoon).
SCALE_PAIRS_DEFAULT = os.environ.get("QERL_NVFP4_SCALE_PAIRS", "0") == "1"


def _scale_pairs(trans_w: bool, red: int, block_k: int, stride_s: int) -> bool:
    """Whether the K-permuted forward can read its block scales as int16 pairs (SCALE_PAIRS):
    on sm_89+ (hardware e4m3 → f16x2), with ≥ 2 scales of a row per thread and an even row
    stride (`_run` makes the base address even)."""
    return (not INTERPRET and bool(_HW_E4M3) and _permute_k(trans_w, red, block_k) and block_k >= 128
            and stride_s % 2 == 0)


def _tuned_kernel():
    global _autotuned
    if _autotuned is None:
        _autotuned = triton.autotune(
            configs=_CONFIGS,
            key=["M_BUCKET", "N_OUT", "RED", "TRANS_W", "HAS_BIAS"],
            prune_configs_by={"early_config_prune": _prune},
        )(triton.heuristics({"EVEN_K": lambda a: a["RED"] % a["BLOCK_K"] == 0,
                             "EVEN_N": lambda a: a["N_OUT"] % a["BLOCK_N"] == 0,
                             "PERMUTE_K": lambda a: _permute_k(a["TRANS_W"], a["RED"], a["BLOCK_K"]),
                             "SCALE_PAIRS": lambda a: SCALE_PAIRS_DEFAULT and _scale_pairs(
                                 a["TRANS_W"], a["RED"], a["BLOCK_K"], a["stride_s"])})
          (_w4a16_kernel))
    return _autotuned


# ------------------------------------------------------------------ launcher

_COUNTERS: dict = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer ≥ n per device; the kernel leaves it zeroed after each launch."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def _check(name, a, weight_packed, weight_scale, weight_global_scale, a_dim_is_k: bool):
    if not isinstance(a, torch.Tensor) or a.dtype != torch.bfloat16:
        raise ValueError(f"{name}: input must be a bf16 tensor, got "
                         f"{getattr(a, 'dtype', type(a).__name__)}")
    if a.ndim < 1:
        raise ValueError(f"{name}: input must have at least 1 dim")
    if weight_packed.dtype != torch.uint8 or weight_packed.ndim != 2:
        raise ValueError(f"{name}: weight_packed must be uint8 [out, in/2], got "
                         f"{weight_packed.dtype} {tuple(weight_packed.shape)}")
    n, half = weight_packed.shape
    k = half * 2
    if k % BLOCK != 0:
        raise ValueError(f"{name}: in_features {k} is not divisible by {BLOCK}")
    if weight_scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"{name}: weight_scale must be float8_e4m3fn, got {weight_scale.dtype}")
    if tuple(weight_scale.shape) != (n, k // BLOCK):
        raise ValueError(f"{name}: weight_scale shape {tuple(weight_scale.shape)} does not fit "
                         f"weight_packed {tuple(weight_packed.shape)} (expected {(n, k // BLOCK)})")
    is_f32 = isinstance(weight_global_scale, torch.Tensor) and weight_global_scale.dtype == torch.float32
    if not is_f32 or not (weight_global_scale.numel() == 1  # or, in the forward, one per W row
                          or (a_dim_is_k and weight_global_scale.numel() == n)):
        raise ValueError(f"{name}: weight_global_scale must be a float32 tensor of one number"
                         + (f" or of one per output row ({n})" if a_dim_is_k else ""))
    want = k if a_dim_is_k else n
    if a.shape[-1] != want:
        raise ValueError(f"{name}: input last dim {a.shape[-1]} != {want} for a weight of "
                         f"shape [{n}, {k}]")
    dev = a.device
    for t in (weight_packed, weight_scale, weight_global_scale):
        if t.device != dev:
            raise ValueError(f"{name}: tensors on different devices ({dev} vs {t.device})")
    return n, k


def _permute_input(a2: torch.Tensor, block_k: int) -> torch.Tensor:
    """x [M, K] with each BLOCK_K chunk's columns in the forward's reduction order p
    (`_kperm`: column k = 4G·l + 8q + 4h + 2j + ν goes to p = 16(2q + ν) + 8j + 2l + h), contiguous."""
    m, k = a2.shape
    g = block_k // 16
    return a2.reshape(m, k // block_k, 4, g // 2, 2, 2, 2).permute(0, 1, 3, 6, 5, 2, 4).reshape(m, k).contiguous()


def _pdl(cfg: dict, device: torch.device) -> bool:
    """Whether a forced config's forward launches with programmatic dependent launch (its key
    PDL; Hopper and newer only, never in the interpreter): see `_pdl_start`."""
    return bool(cfg.pop("PDL", False)) and not INTERPRET and device.type == "cuda" \
        and torch.cuda.get_device_capability(device) >= (9, 0)


def _run_gemv(a2, packed, scale, g, bias_arg, out, has_bias: bool, trans_w: bool, cfg: dict) -> None:
    """Launch `_w4a16_gemv_kernel` (keys GEMV, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)."""
    M, red = a2.shape
    n_out = out.shape[1]
    bn, bk, split = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg.get("SPLIT_K", 1)
    if trans_w or red % bk or M != 1:
        raise ValueError(f"the GEMV kernel is the forward for one input row with K % BLOCK_K == 0 "
                         f"(got dX={trans_w}, M={M}, K={red}, BLOCK_K={bk})")
    tiles = triton.cdiv(n_out, bn)
    ws = torch.empty(split * n_out, dtype=torch.float32, device=a2.device) if split > 1 else out
    words = a2.reshape(red).contiguous().view(torch.int32)  # x[2i], x[2i+1] in word i
    pdl = _pdl(cfg, a2.device)
    _w4a16_gemv_kernel[(tiles, split)](
        words, packed, scale, g, bias_arg, out, ws, _counters(a2.device, tiles),
        n_out, red, packed.stride(0), scale.stride(0), split,
        HAS_BIAS=has_bias, BLOCK_N=bn, BLOCK_K=bk, GPU_MATH=not INTERPRET, G_PER_ROW=g.numel() > 1, PDL=pdl,
        num_warps=cfg.get("num_warps", 8), num_stages=cfg.get("num_stages", 1), launch_pdl=pdl,
    )


# From this many input rows on, the autotuned path (config None) hands Hopper GPUs to the
# warp-specialized wgmma kernel of `wgmma_gemm` (WS_CONFIG: decode into shared memory by one warp
# group, wgmma by two) where the shape fits it. 0 (the default: at 72-79 % of cuBLAS on an H100 it
# still loses to dequantize + cuBLAS at learner sizes, NOTES.md 2026-12-07): never.
WGMMA_MIN_M = int(os.environ.get("QERL_NVFP4_WGMMA_MIN_M", "0"))


def _wgmma_fits(a2: torch.Tensor, m: int, n_out: int, red: int, trans_w: bool, g: torch.Tensor,
                min_m: int | None = None) -> bool:
    """Whether the wgmma kernel runs this GEMM: Hopper, ≥ min_m rows (WGMMA_MIN_M; 0 = never),
    whole tiles, and one global scale in dX."""
    min_m = WGMMA_MIN_M if min_m is None else min_m
    if INTERPRET or min_m <= 0 or m < min_m or a2.device.type != "cuda" or (trans_w and g.numel() != 1):
        return False
    from . import wgmma_gemm
    return (wgmma_gemm.AVAILABLE and torch.cuda.get_device_capability(a2.device)[0] == 9
            and wgmma_gemm.supports(m, n_out, red, wgmma_gemm.WS_CONFIG, not trans_w))


def _run(a: torch.Tensor, weight_packed, weight_scale, weight_global_scale, bias, trans_w: bool,
         config: Optional[dict] = None, lora: Optional[tuple] = None) -> torch.Tensor:
    R, C = weight_packed.shape[0], weight_packed.shape[1] * 2
    n_out, red = (C, R) if trans_w else (R, C)
    lead = a.shape[:-1]
    a2 = a.reshape(-1, a.shape[-1])  # a view when possible: strides go to the kernel
    M = a2.shape[0]
    out = torch.empty((M, n_out), dtype=torch.bfloat16, device=a.device)
    if M == 0 or n_out == 0:
        return out.reshape(*lead, n_out)
    if red == 0:
        out.zero_()
        if bias is not None:
            out += bias.to(out.dtype)
        return out.reshape(*lead, n_out)
    packed = weight_packed.contiguous()
    if packed.data_ptr() % 4:  # the K-permuted forward reads the bytes as int32 words
        packed = packed.clone()
    scale = weight_scale.contiguous().view(torch.uint8)
    if scale.data_ptr() % 2:  # SCALE_PAIRS reads the scales as int16 pairs
        scale = scale.clone()
    g = weight_global_scale.reshape(-1).contiguous()  # [1], or [N] in the forward (G_PER_ROW)
    has_bias = bias is not None
    bias_arg = bias.contiguous() if has_bias else g
    m_bucket = max(16, triton.next_power_of_2(M))
    common = dict(TRANS_W=trans_w, HAS_BIAS=has_bias, GROUP_M=8, GPU_MATH=not INTERPRET,
                  G_PER_ROW=g.numel() > 1)

    if config is not None and config.get("WGMMA") or config is None and _wgmma_fits(a2, M, n_out, red, trans_w, g):
        from . import wgmma_gemm
        if a2.stride(1) != 1 or a2.stride(0) % 8 or a2.data_ptr() % 16:  # it copies 16-byte vectors
            a2 = torch.empty_like(a2, memory_format=torch.contiguous_format).copy_(a2)
        if packed.data_ptr() % 16:
            packed = packed.clone()
        if scale.data_ptr() % 4:  # 4-byte copies of the block scales
            scale = scale.clone()
        cfg = {k: v for k, v in (config or wgmma_gemm.WS_CONFIG).items() if k != "WGMMA"}
        out = (wgmma_gemm.grad_input_wgmma(a2, packed, scale, g, cfg=cfg) if trans_w
               else wgmma_gemm.linear_wgmma(a2, packed, scale, g, bias_arg if has_bias else None, cfg=cfg))
    elif config is not None and config.get("DECODE"):
        from . import decode_gemm
        if trans_w:
            raise ValueError("the decode kernel (DECODE) is a forward kernel")
        if a2.stride(1) != 1 or a2.stride(0) % 8 or a2.data_ptr() % 16:  # it reads 16-byte vectors
            a2 = torch.empty_like(a2, memory_format=torch.contiguous_format).copy_(a2)
        if packed.data_ptr() % 16:
            packed = packed.clone()
        out = decode_gemm.linear_decode(a2, packed, scale, g, bias_arg if has_bias else None, config, lora)
    elif config is not None and config.get("GEMV"):
        _run_gemv(a2, packed, scale, g, bias_arg, out, has_bias, trans_w, dict(config))
    elif config is not None or INTERPRET:
        cfg = dict(INTERPRET_CONFIG if config is None else config)
        split = cfg.pop("SPLIT_K")
        if cfg.get("A_PREPERM"):
            if not _permute_k(trans_w, red, cfg["BLOCK_K"]):
                raise ValueError("A_PREPERM needs the K-permuted forward (BLOCK_K % 64 == 0, K % BLOCK_K == 0)")
            a2 = _permute_input(a2, cfg["BLOCK_K"])
        bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
        tiles = triton.cdiv(M, bm) * triton.cdiv(n_out, bn)
        ws = (torch.empty(split * M * n_out, dtype=torch.float32, device=a.device)
              if split > 1 else out)
        cnt = _counters(a.device, tiles)
        pdl = _pdl(cfg, a.device) and not trans_w
        _w4a16_kernel[(tiles, split)](
            a2, packed, scale, g, bias_arg, out, ws, cnt,
            M, n_out, red, R, C, M * n_out, a2.stride(0), a2.stride(1), packed.stride(0),
            scale.stride(0), split, m_bucket, EVEN_K=(red % bk == 0), EVEN_N=(n_out % bn == 0),
            PERMUTE_K=cfg.pop("PERMUTE_K", True) and _permute_k(trans_w, red, bk),
            SCALE_PAIRS=cfg.pop("SCALE_PAIRS", SCALE_PAIRS_DEFAULT) and _scale_pairs(trans_w, red, bk, scale.stride(0)),
            PDL=pdl, launch_pdl=pdl, **common, **cfg,
        )
    else:
        kernel = _tuned_kernel()
        max_split, max_tiles = _workspace_plan(M, n_out, red, m_bucket, _num_sms(a.device))
        ws = (torch.empty(max_split * M * n_out, dtype=torch.float32, device=a.device)
              if max_split > 1 else out)
        cnt = _counters(a.device, max_tiles)

        def grid(meta):
            return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(n_out, meta["BLOCK_N"]),
                    meta["SPLIT_K"])

        kernel[grid](
            a2, packed, scale, g, bias_arg, out, ws, cnt,
            M, n_out, red, R, C, M * n_out, a2.stride(0), a2.stride(1), packed.stride(0),
            scale.stride(0), M_BUCKET=m_bucket, **common,
        )
    return out.reshape(*lead, n_out)


def linear_w4a16(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    _config: Optional[dict] = None,
    _lora: Optional[tuple] = None,
) -> torch.Tensor:
    """y [.., N] bf16 = x [.., K] bf16 @ Wᵀ (+ bias), W the NVFP4 weight [N, K].

    `weight_global_scale`: float32 [1], or [N] for one divisor per W row (fused shards).
    `_config` (tests/benchmarks) forces one kernel config instead of autotuning:
    keys BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, SPLIT_K, num_warps, num_stages, and optionally
    A_PREPERM (the input permuted by a separate torch op before the kernel), EVICT_W
    (evict_first weight loads), SCALE_PAIRS (where `_scale_pairs` allows; default SCALE_PAIRS_DEFAULT),
    PDL (programmatic dependent launch, `_pdl_start`); or GEMV=True with BLOCK_N, BLOCK_K, SPLIT_K, num_warps for
    the CUDA-core kernel (M = 1, K % BLOCK_K == 0); or DECODE=True with RW, KV, SPLIT_K, num_warps for the
    Gluon mma.sync kernel of `decode_gemm` (GPU only, M <= 16); or WGMMA=True with any of BM, BP, BR,
    STAGES, GROUP_M, SPLIT_K for the Gluon wgmma kernel of `wgmma_gemm` (Hopper only). Without `_config`,
    Hopper GPUs run that kernel from WGMMA_MIN_M rows on (0, the default: never) where the shape fits it.
    `_lora` (with a DECODE config only; x 2-D): a LoRA in the decode kernel's launch, (T, [B_s],
    token slots, slices, [A_s] or None) as `decode_gemm.linear_decode` takes it (the serving op)."""
    n, _ = _check("linear_w4a16", x, weight_packed, weight_scale, weight_global_scale, True)
    if _lora is not None and not (_config and _config.get("DECODE") and x.dim() == 2):
        raise ValueError("linear_w4a16: a LoRA epilogue (_lora) needs a DECODE config and a 2-D input")
    if bias is not None:
        if bias.shape != (n,) or bias.dtype not in (torch.bfloat16, torch.float32) \
                or bias.device != x.device:
            raise ValueError(f"linear_w4a16: bias must be bf16/fp32 [{n}] on {x.device}, got "
                             f"{bias.dtype} {tuple(bias.shape)}")
    return _run(x, weight_packed, weight_scale, weight_global_scale, bias, False, _config, _lora)


def grad_input_w4a16(
    dy: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    *,
    _config: Optional[dict] = None,
) -> torch.Tensor:
    """dX [.., K] bf16 = dy [.., N] bf16 @ W, W the NVFP4 weight [N, K] (reduction over N)."""
    _check("grad_input_w4a16", dy, weight_packed, weight_scale, weight_global_scale, False)
    return _run(dy, weight_packed, weight_scale, weight_global_scale, None, True, _config)


# ------------------------------------------------------------------ plain-torch reference

def reference_linear(x, weight_packed, weight_scale, weight_global_scale, bias=None):
    """x @ Ŵᵀ (+ bias): reference bf16 dequantize, float32 matmul, bf16 out."""
    w = _reference_dequantize(weight_packed, weight_scale, weight_global_scale, torch.bfloat16)
    y = x.to(torch.float32) @ w.to(torch.float32).t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(torch.bfloat16)


def reference_grad_input(dy, weight_packed, weight_scale, weight_global_scale):
    """dy @ Ŵ: reference bf16 dequantize, float32 matmul, bf16 out."""
    w = _reference_dequantize(weight_packed, weight_scale, weight_global_scale, torch.bfloat16)
    return (dy.to(torch.float32) @ w.to(torch.float32)).to(torch.bfloat16)
