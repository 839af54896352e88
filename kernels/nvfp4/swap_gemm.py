"""The NVFP4 W4A16 forward with the weight as wgmma's register operand (Hopper, Gluon): no decoded tile in smem.

    y [M, N] = x [M, K] @ Ŵᵀ   computed as   yᵀ [N, M] = Ŵ [N, K] · xᵀ

Ŵ the NVFP4 weight (packed E2M1 bytes [N, K/2], e4m3 block scales [N, K/16], fp32 global
scale, one or one per row). GPU only (sm_90: wgmma; Gluon does not run in Triton's
interpreter): a test compiles it offline, `benchmarks/nvfp4_wgmma_check.py` checks and times it.

Why. wgmma reads its B operand from shared memory but may take A from registers. The kernels of
`wgmma_gemm.py` multiply x (A) by the decoded weight (B), so the weight must be decoded into a
bf16 tile in shared memory, handed over (a CTA barrier, or mbarriers between a decoding warp
group and the multiplying ones) and read back by every warp group: at M = 4096 that reaches
72-79 % of cuBLAS (NOTES.md, 2026-12-07). Swapping the operands (as CUTLASS's mixed-input GEMMs
and vLLM's Machete do) lets each warp group decode its own 64 weight rows straight into its A
fragment, in registers, while its previous wgmma runs; only the input tile (B) goes through
shared memory, by TMA. A CTA is WARPS / 4 warp groups, 16·WARPS weight rows × BN input rows;
each weight is decoded once per BN input rows, and every warp group reads the same input tile.

The A fragment (per warp 16 rows, as mma.sync's m16n8k16): lane 4g + t holds rows g and g + 8
and, in each k16, the k-pairs (2t, 2t + 1) and (2t + 8, 2t + 9), i.e. byte t + 4j (j = 0..7) of
a row's 32 packed bytes per 64-deep step: one byte per 32-bit word, a byte's two codes one bf16x2
register. So each thread loads its 16 bytes per step one by one (`LDG.U8`, from L1: a quad's four
lanes read neighbouring bytes), and decodes each with `_DECODE_BYTE_ASM` (5 instructions per 2
weights); `convert_layout(..., assert_trivial=True)` makes the compiler prove that the decoded
tensor already is the fragment. With PREPACKED the weight comes reordered once by `prepack` (a
lane's 8 bytes of a row side by side): two 64-bit loads per thread and step instead of 16 byte
loads (8x fewer L1 requests), the bytes put back in order in registers. The four block scales of a row and
step come as one 32-bit word, decoded by `_SCALE_WORD_ASM` (the arithmetic of
`gemm._SCALE_PAIR_ASM`, twice). With TMA_W as well, the step's packed bytes [rows, 32] and its
block scales (reordered step-major once by `prepack_scales`, so a step's [rows, 4] is one TMA box)
arrive by TMA in the input's ring slot, STAGES steps ahead, and the decode reads them from shared
memory: no global load left in a step (see Status for why that matters).

Pipeline: the input tile [BN, 64] by TMA into a ring of STAGES slots (mbarrier per slot, rows ≥
M read as zeros); the packed bytes and scale words two steps ahead in registers; per step: issue
step i's wgmma asynchronously, load step i + 2 and decode step i + 1 while it runs, wait for it,
one CTA barrier, refill its slot; two steps per loop iteration, so that the bytes and A
fragments alternate between two register sets without copies. One wgmma in flight, not two: a
wgmma's A registers may not be written until it is retired, and with the next A decoded in a loop
the compiler may reuse them (the first draft kept two in flight and did;
`benchmarks/nvfp4_gemm_ptx.py` now counts such writes, `wgmma_a_overwrites`, and a test requires
none).
Epilogue: · 2^8 / g per weight row (+ bias), rounded to bf16, transposed through shared memory
(stmatrix) and stored by TMA; optional split-K as in `wgmma_gemm.py` (fp32 partials in a workspace
of whole tiles, the last program to arrive sums them in split order).

Status (H200, NOTES.md "2026-12-07, third session"): correct (112 / 112 cases of
`nvfp4_wgmma_check.py`); at M = 4096 68-71 % of cuBLAS on the learner's shapes (the WS kernel of
`wgmma_gemm.py` 77-82 %), 76-81 % on vLLM's fused qkv / gate_up with PREPACKED; at 16 rows 30-35 %
of the HBM bandwidth on the big shapes, slower than the serving table's kernels. ptxas issues the
loads after the wgmma wait, so the next step's scale decode waits for them (ncu). TMA_W (H100,
"fourth session"): correct, no global load left in the step, but no faster (66-71 % of cuBLAS):
ncu puts half the issue gaps in the CTA barrier that ends each step. PINGPONG removes that
barrier (two partitions, mbarrier hand-backs): correct on an H100 and 6-8 points faster, 75-81 %
of cuBLAS on the big shapes ("fifth session"), still below dequantize + cuBLAS at the learner's
sizes. The learner takes this kernel only with `QERL_NVFP4_GEMM=swap`; serving does not route to it.
"""
from __future__ import annotations

import torch

from .gemm import _SCALE_BIAS, _SCALE_PAIR_EXP, _counters
from .wgmma_gemm import AVAILABLE  # whether this triton has Gluon's Hopper API

__all__ = ["AVAILABLE", "DEFAULT_CONFIG", "byte_bits", "full_config", "linear_swap", "prepack", "prepack_scales",
           "supports"]

# WARPS: 4 or 8 (one or two warp groups, 64 weight rows each); BN input rows per CTA (8..256, the
# wgmma's N; the accumulator takes BN / 2 registers per thread); STAGES input tiles in flight;
# SPLIT_K programs per tile along the reduction; GROUP_M input-row tiles side by side (L2 reuse).
# PREPACKED: the packed weight comes reordered by `prepack` (two 64-bit loads per thread and step
# instead of 16 byte loads). TMA_W (needs PREPACKED): the packed weight and the block scales
# (reordered by `prepack_scales`) come through the TMA ring with the input: no global load in a step.
# PINGPONG (needs TMA_W, WARPS 8, STAGES >= 3): the two warp groups in partitions of their own
# (`gl.warp_specialize`; the worker capped at PP_REGS registers per thread, the default partition
# keeps 256), handing ring slots back by mbarrier instead of a CTA barrier per step, so that one
# multiplies while the other decodes and waits. Its refill comes a step later than without
# PINGPONG: STAGES 4 prefetches as deep as STAGES 3 does there. On an H100, 6-8 points of cuBLAS
# faster than TMA_W at M = 4096, slower at M = 16 (NOTES.md, 2026-12-07, fifth session).
# PRODUCER (needs PINGPONG): a third partition of one warp (PRODUCER_REGS registers per thread) issues
# every TMA load, STAGES steps ahead of the two wgmma warp groups (CUTLASS's producer warp): each slot
# is refilled as soon as both halves have released it, not a step later. The default partition gets
# what is left of the register file (triton: 504 - PP_REGS - PRODUCER_REGS at 12 warps). Compiled,
# not yet run on a GPU (NOTES.md, 2026-12-08).
DEFAULT_CONFIG = {"WARPS": 8, "BN": 256, "STAGES": 4, "SPLIT_K": 1, "GROUP_M": 8, "PREPACKED": False, "TMA_W": False,
                  "PINGPONG": False, "PP_REGS": 232, "PRODUCER": False, "PRODUCER_REGS": 24}
BK = 64  # reduction per step: 32 packed bytes and 4 block scales per weight row


def full_config(cfg: dict | None) -> dict:
    return {**DEFAULT_CONFIG, **(cfg or {})}


def supports(m: int, n: int, k: int, cfg: dict | None = None) -> bool:
    """Whether a config fits y [m, n] = x [m, k] @ Ŵᵀ: whole CTAs of weight rows, whole steps along K."""
    cfg = full_config(cfg)
    return m >= 1 and n % (16 * cfg["WARPS"]) == 0 and k % BK == 0


def prepack(packed: torch.Tensor) -> torch.Tensor:
    """The packed weight [N, K/2] reordered for configs with PREPACKED: in every row's 32 bytes of a
    step, position 8t + j holds byte t + 4j (j = 0..7), the 8 bytes lane t of a quad decodes, so a
    thread loads them at once. A copy (the checkpoint's order is unchanged)."""
    n, half = packed.shape
    if half % (BK // 2):
        raise ValueError(f"prepack needs whole steps of {BK // 2} bytes per row, got {half}")
    return packed.reshape(n, half // 32, 8, 4).transpose(-1, -2).reshape(n, half).contiguous()


def prepack_scales(scale: torch.Tensor) -> torch.Tensor:
    """The block scales [N, K/16] reordered for configs with TMA_W: step-major [K/64, N, 4] (the four
    scales of a row and 64-deep step together, one step's rows contiguous, as one TMA box). A copy."""
    n, blocks = scale.shape
    if blocks % (BK // 16):
        raise ValueError(f"prepack_scales needs whole steps of {BK // 16} block scales per row, got {blocks}")
    return scale.reshape(n, blocks // 4, 4).transpose(0, 1).contiguous()


# `_byte_ptx`'s constants: b · SPREAD puts a byte's high nibble on bits 16-19 next to its low one
# on bits 0-3 (no overlap: b < 2^8), NIBBLES keeps both; × PLACE moves each nibble's sign to bit 15
# of its half and its magnitude to bits 6-8 (`gemm._DECODE_WORD_ASM`'s low codes), KEEP keeps those.
_SPREAD, _NIBBLES, _PLACE, _KEEP = 2**12 + 1, 0x000F000F, 2**12 + 2**6, 0x81C081C0


def _byte_ptx() -> str:
    """One packed byte ($2, zero-extended) → its two weights E2M1 · s · 2^-8 in bf16 (exact), the low
    nibble's in $0, the high one's in $1 (one bf16x2 register); $3 s · 2^118 twice as bf16x2. Before
    the fma the halves are E2M1 · 2^-126 (`byte_bits`), then one fma applies the scale."""
    return "\n".join(["", "{", ".reg .b32 p, k;", "mov.b32 k, 0x80008000;", f"mul.lo.u32 p, $2, {_SPREAD};",
                      f"and.b32 p, p, {_NIBBLES:#010x};", f"mul.lo.u32 p, p, {_PLACE};",
                      f"and.b32 p, p, {_KEEP:#010x};", "fma.rn.bf16x2 p, p, $3, k;", "mov.b32 {$0, $1}, p;", "}", ""])


def byte_bits(b: torch.Tensor) -> torch.Tensor:
    """`_byte_ptx`'s integer arithmetic in torch (for tests: the PTX runs on GPUs only): packed bytes
    (int64) → the bf16x2 bit patterns of their (low, high) nibble's E2M1 · 2^-126."""
    return (((b * _SPREAD) & _NIBBLES) * _PLACE) & _KEEP


def _scale_word_ptx() -> str:
    """Four e4m3 block scales (the bytes of the 32-bit $4, first block lowest) → each as s · 2^118
    twice in a bf16x2 register, $0..$3: `gemm._SCALE_PAIR_ASM` on each half of the word."""
    lines = ["", "{", ".reg .b16 lo, hi;", ".reg .b32 f, t, n, one;", "mov.b32 one, 0x00010001;",
             "mov.b32 {lo, hi}, $4;"]
    for half, (o0, o1) in (("lo", (0, 1)), ("hi", (2, 3))):
        lines += [f"cvt.rn.f16x2.e4m3x2 f, {half};", "shr.b32 t, f, 3;", "and.b32 t, t, 0x0FFF0FFF;",
                  "min.u16x2 n, t, one;", f"mad.lo.u32 t, n, {_SCALE_PAIR_EXP}, t;",
                  "lop3.b32 t, t, f, 0x80008000, 0xF8;",  # t | (f & sign bits)
                  f"prmt.b32 ${o0}, t, t, 0x1010;", f"prmt.b32 ${o1}, t, t, 0x3232;"]
    return "\n".join(lines + ["}", ""])


if AVAILABLE:
    from .decode_gemm import _cta_barrier  # a shim over triton 3.6 / 3.9 names
    from .wgmma_gemm import (  # the Gluon API as wgmma_gemm imported it, and its tile order and TMA shim
        TensorDescriptor,
        _tile,
        _tma_load,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    _DECODE_BYTE_ASM = gl.constexpr(_byte_ptx())
    _SCALE_WORD_ASM = gl.constexpr(_scale_word_ptx())
    _SCALE_BIAS_C = gl.constexpr(_SCALE_BIAS)
    _X_SMEM_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    # TMA_W: the weight's bytes [rows, 32] and scales [1, rows/4, 16] unswizzled (read by plain loads)
    _BYTES_SMEM_LAYOUT_2D = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    _BYTES_SMEM_LAYOUT_3D = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3)

    @gluon.constexpr_function
    def _bytes_layout(warps):
        """[16·warps rows, 4 blocks, 8 bytes] of one step's packed weight: lane 4g + t holds rows g and
        g + 8 of its warp's 16 and byte t + 4j of the row (j = 0..7: bit 0 of j is the byte's bit 2 in
        its block, bits 1-2 the block), the bytes of the wgmma A fragment (module docstring)."""
        reg = [[8, 0, 0], [0, 0, 4], [0, 1, 0], [0, 2, 0]]
        lane = [[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
        warp = [[16 << b, 0, 0] for b in range(warps.bit_length() - 1)]
        return gl.DistributedLinearLayout(reg, lane, warp, [], [16 * warps, 4, 8])

    @gluon.constexpr_function
    def _rows_layout(warps):
        """[16·warps] weight rows as lane 4g + t holds rows g, g + 8 of its warp's 16 (t: copies)."""
        lane = [[0], [0], [1], [2], [4]]
        warp = [[16 << b] for b in range(warps.bit_length() - 1)]
        return gl.DistributedLinearLayout([[8]], lane, warp, [], [16 * warps])

    @gluon.constexpr_function
    def _prepacked_layout(warps):
        """[16·warps rows, 4 (t), 2 (words)] of one step's PREPACKED weight as 32-bit words (`prepack`):
        lane 4g + t holds rows g and g + 8, and its 2 words (8 bytes) of each row in consecutive
        registers (one 64-bit load per row)."""
        reg = [[0, 0, 1], [8, 0, 0]]
        lane = [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
        warp = [[16 << b, 0, 0] for b in range(warps.bit_length() - 1)]
        return gl.DistributedLinearLayout(reg, lane, warp, [], [16 * warps, 4, 2])

    @gluon.jit
    def _load_bytes(ptrs, PREPACKED: gl.constexpr):
        """One step's packed weight as loaded: bytes [ROWS, 4, 8] zero-extended to int32 (16 byte loads
        per thread, `_bytes_layout`), or with PREPACKED the raw words [ROWS, 4, 2] (two 64-bit loads).
        Kept raw until `_bytes` decodes them a step later: unpacking them here would wait for the load."""
        if PREPACKED:
            return gl.load(ptrs)
        else:
            return gl.load(ptrs).to(gl.int32)

    @gluon.jit
    def _bytes(v, ROWS: gl.constexpr, PREPACKED: gl.constexpr, b_lay: gl.constexpr):
        """`_load_bytes`'s result as bytes [ROWS, 4, 8] (int32) in `_bytes_layout`. PREPACKED: word w
        of lane t holds bytes 8t + 4w + i (i = 0..3), which hold Ŵ's byte t + 4j (j = 4w + i = 2·block +
        bit 2 of the byte): split the words, then reorder in registers."""
        if PREPACKED:
            b = gl.join(gl.join(v & 0xFF, (v >> 16) & 0xFF), gl.join((v >> 8) & 0xFF, (v >> 24) & 0xFF))
            b = gl.reshape(b, [ROWS, 4, 8])  # [rows, t, j], j = 4w + i
            b = gl.permute(gl.reshape(b, [ROWS, 4, 4, 2]), (0, 2, 3, 1))  # [rows, block, bit 2, t]
            return gl.convert_layout(gl.reshape(b, [ROWS, 4, 8]), b_lay)
        else:
            return v

    @gluon.jit
    def _decode_step(b, sw, ROWS: gl.constexpr, PREPACKED: gl.constexpr, b_lay: gl.constexpr, a_op: gl.constexpr):
        """Packed bytes b [ROWS, 4, 8] (int32, zero-extended) and scale words sw [ROWS] → the step's
        weights [ROWS, 64] bf16 (· 2^-8) in the wgmma A fragment's layout."""
        s0, s1, s2, s3 = gl.inline_asm_elementwise(_SCALE_WORD_ASM, "=r,=r,=r,=r,r", [sw],
                                                   dtype=(gl.int32,) * 4, is_pure=True, pack=1)
        # [ROWS] → [ROWS, 4 blocks] (join adds the minor dimension: (s0, s2), (s1, s3) → s0 s1 s2 s3), in
        # the bytes' layout without their byte dimension (the same threads: registers only), then
        # broadcast over a block's 8 bytes
        s = gl.reshape(gl.join(gl.join(s0, s2), gl.join(s1, s3)), [ROWS, 4])
        s = gl.convert_layout(s, gl.SliceLayout(2, b_lay), assert_trivial=True)
        s, b = gl.broadcast(gl.expand_dims(s, 2), _bytes(b, ROWS, PREPACKED, b_lay))
        lo, hi = gl.inline_asm_elementwise(_DECODE_BYTE_ASM, "=h,=h,r,r", [b, s],
                                           dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
        w = gl.reshape(gl.join(lo, hi), [ROWS, 64])  # code 2·byte + nibble: Ŵ's column order
        return gl.convert_layout(w, a_op, assert_trivial=True)

    if hasattr(gl.shared_memory_descriptor, "reinterpret"):  # triton 3.9
        @gluon.jit
        def _smem_as(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
            return smem.reinterpret(dtype, shape, layout)
    else:  # triton 3.6
        @gluon.jit
        def _smem_as(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
            return smem._reinterpret(dtype, shape, layout)

    if hasattr(tma, "async_store"):  # triton 3.9
        @gluon.jit
        def _tma_store(desc, coord, smem):
            tma.async_store(desc, coord, smem)
    else:  # triton 3.6
        @gluon.jit
        def _tma_store(desc, coord, smem):
            tma.async_copy_shared_to_global(desc, coord, smem)

    @gluon.jit
    def _epilogue_t(acc, g_ptr, bias_ptr, out_desc, o_smem, off_m, off_n, ROWS: gl.constexpr,
                    HAS_BIAS: gl.constexpr, G_PER_ROW: gl.constexpr, mma: gl.constexpr):
        """y = acc · 2^8 / g (+ bias) per weight row, rounded to bf16 once (one division per row), then
        transposed through shared memory and stored by TMA (input rows ≥ M are not written)."""
        rn = off_n + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
        if G_PER_ROW:
            y = acc * gl.div_rn(gl.full([ROWS], _SCALE_BIAS_C, gl.float32, gl.SliceLayout(1, mma)),
                                gl.load(g_ptr + rn))[:, None]
        else:
            y = acc * gl.div_rn(_SCALE_BIAS_C, gl.load(g_ptr))
        if HAS_BIAS:
            y += gl.load(bias_ptr + rn).to(gl.float32)[:, None]
        o_smem.store(gl.permute(y.to(gl.bfloat16), (1, 0)))
        fence_async_shared()  # every thread's part is visible to the TMA engine ...
        _cta_barrier()  # ... before one thread issues the store
        _tma_store(out_desc, [off_m, off_n], o_smem)
        tma.store_wait(0)

    @gluon.jit
    def _store_tile_t(acc, g_ptr, bias_ptr, out_desc, o_smem, ws_ptr, cnt_ptr, SPLIT_K, off_m, off_n, tile, tiles,
                      split, ROWS: gl.constexpr, BN: gl.constexpr, HAS_BIAS: gl.constexpr, G_PER_ROW: gl.constexpr,
                      mma: gl.constexpr):
        """The tile's output: the epilogue, or with split-K this split's fp32 partial (a workspace of
        whole tiles in the accumulator's order), and the last split to arrive sums them in split order
        (deterministic) and runs the epilogue. `tile` of `tiles`: the output tile (PINGPONG: each warp
        group's half of one)."""
        if SPLIT_K == 1:
            _epilogue_t(acc, g_ptr, bias_ptr, out_desc, o_smem, off_m, off_n, ROWS, HAS_BIAS, G_PER_ROW, mma)
        else:
            rn = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
            rm = gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
            offs = rn[:, None] * BN + rm[None, :]
            gl.store(ws_ptr + (split * tiles + tile).to(gl.int64) * (ROWS * BN) + offs, acc)
            _cta_barrier()  # every thread's partial is written before the release below
            arrived = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                total = gl.zeros([ROWS, BN], gl.float32, layout=mma)
                for sp in range(SPLIT_K):
                    total += gl.load(ws_ptr + (sp * tiles + tile).to(gl.int64) * (ROWS * BN) + offs,
                                     cache_modifier=".cg")
                _epilogue_t(total, g_ptr, bias_ptr, out_desc, o_smem, off_m, off_n, ROWS, HAS_BIAS, G_PER_ROW, mma)
                gl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch

    @gluon.jit
    def _swap_step(i, acc, a, b, sw, x_desc, x_ring, ready, b_ptrs, s_ptrs, n_k, k0, off_m, ROWS: gl.constexpr,
                   BN: gl.constexpr, STAGES: gl.constexpr, PREPACKED: gl.constexpr, b_lay: gl.constexpr,
                   a_op: gl.constexpr):
        """Step i: multiply its decoded weight `a` by its input tile (async); meanwhile load step i + 2's
        bytes and scales and decode step i + 1's (`b`, `sw`). Then wait for this wgmma: its A registers
        may not be written before it is done (a second wgmma in flight would need the next A in other
        registers than this one, which the loop cannot promise), and its input slot takes step i + STAGES."""
        BK_: gl.constexpr = 64
        STEP: gl.constexpr = 8 if PREPACKED else BK_ // 2  # a step's bytes per row, in b_ptrs' units
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        acc = warpgroup_mma(a, x_ring.index(slot).permute((1, 0)), acc, is_async=True)
        nxt = gl.minimum(i + 2, n_k - 1)
        b_next = _load_bytes(b_ptrs + nxt * STEP, PREPACKED)
        sw_next = gl.load(s_ptrs + nxt)
        a_next = _decode_step(b, sw, ROWS, PREPACKED, b_lay, a_op)
        acc, a, a_next = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a, a_next))
        _cta_barrier()  # every warp group's wgmma of step i is done: its input slot is free
        fill = i + STAGES
        if fill < n_k:
            _fill(slot, fill, x_desc, x_desc, x_desc, x_ring, x_ring, x_ring, ready, off_m, 0, k0, BN, ROWS, 1, False)
        return acc, a_next, b_next, sw_next

    @gluon.constexpr_function
    def _words_layout(warps):
        """[16·warps rows, 8 words] of one step's PREPACKED weight in shared memory: lane 4g + t holds
        words 2t, 2t + 1 of rows g and g + 8 (`_prepacked_layout` before the reshape)."""
        reg = [[0, 1], [8, 0]]
        lane = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]
        warp = [[16 << b, 0] for b in range(warps.bit_length() - 1)]
        return gl.DistributedLinearLayout(reg, lane, warp, [], [16 * warps, 8])

    @gluon.jit
    def _fill(slot, step, x_desc, w_desc, s_desc, x_ring, w_ring, s_ring, ready, off_m, off_n, k0,
              BN: gl.constexpr, ROWS: gl.constexpr, HALVES: gl.constexpr, TMA_W: gl.constexpr):
        """Start the TMA loads of `step` into ring slot `slot`: the input tile, and with TMA_W the
        weight's packed bytes [ROWS, 32] and block scales [ROWS, 4] (one mbarrier for all), as HALVES
        boxes of ROWS / HALVES rows (PINGPONG: one per warp group, w_ring / s_ring index slot·HALVES + h)."""
        BK_: gl.constexpr = 64
        RH: gl.constexpr = ROWS // HALVES
        if TMA_W:
            mbarrier.expect(ready.index(slot), BN * BK_ * 2 + ROWS * (BK_ // 2 + BK_ // 16))
            for h in gl.static_range(HALVES):
                _tma_load(w_desc, [off_n + h * RH, (k0 + step) * (BK_ // 2)], ready.index(slot),
                          w_ring.index(slot * HALVES + h))
                _tma_load(s_desc, [k0 + step, (off_n + h * RH) // 4, 0], ready.index(slot),
                          s_ring.index(slot * HALVES + h))
        else:
            mbarrier.expect(ready.index(slot), BN * BK_ * 2)
        _tma_load(x_desc, [off_m, (k0 + step) * BK_], ready.index(slot), x_ring.index(slot))

    @gluon.jit
    def _decode_slot(w_ring, s_ring, ready, step, STAGES: gl.constexpr, HALVES: gl.constexpr, half: gl.constexpr,
                     ROWS: gl.constexpr, b_lay: gl.constexpr, a_op: gl.constexpr):
        """TMA_W: wait for `step`'s slot, read its packed words and scale words from shared memory
        (two 64-bit and two 32-bit loads per thread) and decode them into the A fragment. ROWS: this
        partition's rows (the slot's `half` of HALVES)."""
        W: gl.constexpr = gl.num_warps()
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        words = _smem_as(w_ring.index(slot * HALVES + half), gl.int32, [ROWS, 8],
                         gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
        b = gl.convert_layout(gl.reshape(words.load(_words_layout(W)), [ROWS, 4, 2]), _prepacked_layout(W))
        sw = _smem_as(s_ring.index(slot * HALVES + half), gl.int32, [ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0])).load(
            _rows_layout(W))
        return _decode_step(b, sw, ROWS, True, b_lay, a_op)

    @gluon.jit
    def _swap_step_tma(i, acc, a, x_desc, w_desc, s_desc, x_ring, w_ring, s_ring, ready, empty, n_k, k0, off_m, off_n,
                       ROWS: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, HALVES: gl.constexpr,
                       half: gl.constexpr, b_lay: gl.constexpr, a_op: gl.constexpr, PRODUCER: gl.constexpr = False):
        """`_swap_step` with the weight and scales in the TMA ring: no global load in the step. Step i's
        wgmma runs while step i + 1's slot is decoded; then the wait, and slot i takes step i + STAGES.
        No wait for slot i here: `_decode_slot` waited for it (every thread) when it decoded step i.
        HALVES 2 (PINGPONG): this is one of two warp groups in partitions of their own (ROWS its rows);
        a CTA barrier would lock them in step, so each releases the slot on `empty` (an mbarrier both
        arrive on) and half 0 refills the slot of step i - 1 (the other half runs up to a step behind).
        PRODUCER: the producer warp (`_pingpong_producer`) refills; both halves only release the slot."""
        slot = i % STAGES
        acc = warpgroup_mma(a, x_ring.index(slot).permute((1, 0)), acc, is_async=True)
        a_next = _decode_slot(w_ring, s_ring, ready, gl.minimum(i + 1, n_k - 1), STAGES, HALVES, half, ROWS, b_lay,
                              a_op)
        acc, a, a_next = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a, a_next))
        _cta_barrier()  # every warp of this partition: the wgmma of step i is done, its slot read
        if HALVES == 1:
            fill = i + STAGES
            if fill < n_k:
                _fill(slot, fill, x_desc, w_desc, s_desc, x_ring, w_ring, s_ring, ready, off_m, off_n, k0, BN, ROWS,
                      1, True)
        else:
            mbarrier.arrive(empty.index(slot), count=1)  # one thread of this partition
            if not PRODUCER:
                if half == 0:
                    if i > 0:
                        prev = i - 1
                        fill = prev + STAGES
                        if fill < n_k:
                            mbarrier.wait(empty.index(prev % STAGES), (prev // STAGES) & 1)  # both halves are done
                            _fill(prev % STAGES, fill, x_desc, w_desc, s_desc, x_ring, w_ring, s_ring, ready, off_m,
                                  off_n, k0, BN, ROWS * HALVES, HALVES, True)
        return acc, a_next

    @gluon.jit
    def _tma_steps(acc, x_desc, w_desc, s_desc, x_ring, w_ring, s_ring, ready, empty, n_k, k0, off_m, off_n,
                   ROWS: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, HALVES: gl.constexpr,
                   half: gl.constexpr, b_lay: gl.constexpr, a_op: gl.constexpr, PRODUCER: gl.constexpr = False):
        """TMA_W's main loop over n_k steps (step 0 peeled, then two per iteration; see `_swap_kernel`)."""
        a = _decode_slot(w_ring, s_ring, ready, 0, STAGES, HALVES, half, ROWS, b_lay, a_op)
        acc, a = _swap_step_tma(0, acc, a, x_desc, w_desc, s_desc, x_ring, w_ring, s_ring, ready, empty, n_k, k0,
                                off_m, off_n, ROWS, BN, STAGES, HALVES, half, b_lay, a_op, PRODUCER)
        for i in range(1, n_k - 1, 2):
            acc, a = _swap_step_tma(i, acc, a, x_desc, w_desc, s_desc, x_ring, w_ring, s_ring, ready, empty, n_k, k0,
                                    off_m, off_n, ROWS, BN, STAGES, HALVES, half, b_lay, a_op, PRODUCER)
            acc, a = _swap_step_tma(i + 1, acc, a, x_desc, w_desc, s_desc, x_ring, w_ring, s_ring, ready, empty, n_k,
                                    k0, off_m, off_n, ROWS, BN, STAGES, HALVES, half, b_lay, a_op, PRODUCER)
        if n_k % 2 == 0:  # steps 1 .. n_k - 1 were odd in number: the last one
            acc, a = _swap_step_tma(n_k - 1, acc, a, x_desc, w_desc, s_desc, x_ring, w_ring, s_ring, ready, empty,
                                    n_k, k0, off_m, off_n, ROWS, BN, STAGES, HALVES, half, b_lay, a_op, PRODUCER)
        return acc

    @gluon.jit
    def _pingpong_half(x_desc, w_desc, s_desc, out_desc, x_ring, w_ring, s_ring, o_smem, ready, empty, g_ptr,
                       bias_ptr, ws_ptr, cnt_ptr, SPLIT_K, off_m, off_n, k0, n_k, tile, split,
                       half: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr,
                       G_PER_ROW: gl.constexpr, PRODUCER: gl.constexpr = False):
        """PINGPONG: one warp group's partition, weight rows off_n + 64·half .. + 63 of the CTA's 128.
        Half 0 (the default partition) also starts the ring and refills it, unless PRODUCER (a warp of
        its own does, `_pingpong_producer`)."""
        W: gl.constexpr = gl.num_warps()
        RH: gl.constexpr = 16 * W
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BN, 16])
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        if not PRODUCER:
            if half == 0:
                for j in gl.static_range(STAGES):  # steps 0 .. STAGES - 1
                    if j < n_k:
                        _fill(j, j, x_desc, w_desc, s_desc, x_ring, w_ring, s_ring, ready, off_m, off_n, k0, BN,
                              2 * RH, 2, True)
        acc = gl.zeros([RH, BN], gl.float32, layout=mma)
        acc = _tma_steps(acc, x_desc, w_desc, s_desc, x_ring, w_ring, s_ring, ready, empty, n_k, k0, off_m, off_n,
                         RH, BN, STAGES, 2, half, _bytes_layout(W), a_op, PRODUCER)
        _store_tile_t(acc, g_ptr, bias_ptr, out_desc, o_smem, ws_ptr, cnt_ptr, SPLIT_K, off_m, off_n + half * RH,
                      2 * tile + half, 2 * gl.num_programs(0), split, RH, BN, HAS_BIAS, G_PER_ROW, mma)

    @gluon.jit
    def _pingpong_producer(x_desc, w_desc, s_desc, x_ring, w_ring, s_ring, ready, empty, off_m, off_n, k0, n_k,
                           ROWS: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
        """PINGPONG with PRODUCER: one warp that only issues the ring's TMA loads (CUTLASS's producer
        warp), as far ahead as the ring allows. Step i goes into slot i % STAGES once both halves
        have released the step before it there, i - STAGES (`empty` completes a phase per use of
        the slot: wait for phase i // STAGES - 1; the parity ((i // STAGES) & 1) ^ 1 passes at
        once on a fresh barrier, so the first STAGES steps go out unhindered). ROWS: the CTA's
        weight rows (both halves; boxes of ROWS / 2)."""
        for i in range(n_k):
            slot = i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            _fill(slot, i, x_desc, w_desc, s_desc, x_ring, w_ring, s_ring, ready, off_m, off_n, k0, BN, ROWS, 2,
                  True)

    @gluon.jit
    def _swap_kernel(
        x_desc, w_desc, s_desc, out_desc, packed_ptr, scale_ptr, g_ptr, bias_ptr, ws_ptr, cnt_ptr,
        M, N, K, stride_w, stride_s, SPLIT_K,
        BN: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
        HAS_BIAS: gl.constexpr, G_PER_ROW: gl.constexpr, PREPACKED: gl.constexpr, TMA_W: gl.constexpr,
        PINGPONG: gl.constexpr = False, PP_REGS: gl.constexpr = 232, PRODUCER: gl.constexpr = False,
        PRODUCER_REGS: gl.constexpr = 24,
    ):
        W: gl.constexpr = gl.num_warps()
        ROWS: gl.constexpr = 32 * W if PINGPONG else 16 * W  # the CTA's weight rows
        BK_: gl.constexpr = 64
        tile = gl.program_id(0)
        split = gl.program_id(1)
        off_m, off_n, k0, n_k = _tile(tile, split, M, N, K, SPLIT_K, BN, ROWS, BK_, GROUP_M)

        x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK_], x_desc.layout)
        if PINGPONG:  # two warp groups in partitions of their own (num_warps each), a half of the rows each
            w_ring = gl.allocate_shared_memory(gl.uint8, [2 * STAGES, ROWS // 2, BK_ // 2], w_desc.layout)
            s_ring = gl.allocate_shared_memory(gl.uint8, [2 * STAGES, 1, ROWS // 8, 16], s_desc.layout)
            o_smem0 = gl.allocate_shared_memory(gl.bfloat16, [BN, ROWS // 2], out_desc.layout)
            o_smem1 = gl.allocate_shared_memory(gl.bfloat16, [BN, ROWS // 2], out_desc.layout)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for j in gl.static_range(STAGES):
                mbarrier.init(ready.index(j), count=1)
                mbarrier.init(empty.index(j), count=2)  # one arrive per warp group
            fence_async_shared()  # the initialized barriers are visible to TMA
            if PRODUCER:  # a third partition, one warp at PRODUCER_REGS registers, issues every TMA load
                gl.warp_specialize([
                    (_pingpong_half, (x_desc, w_desc, s_desc, out_desc, x_ring, w_ring, s_ring, o_smem0, ready,
                                      empty, g_ptr, bias_ptr, ws_ptr, cnt_ptr, SPLIT_K, off_m, off_n, k0, n_k, tile,
                                      split, 0, BN, STAGES, HAS_BIAS, G_PER_ROW, True)),
                    (_pingpong_half, (x_desc, w_desc, s_desc, out_desc, x_ring, w_ring, s_ring, o_smem1, ready,
                                      empty, g_ptr, bias_ptr, ws_ptr, cnt_ptr, SPLIT_K, off_m, off_n, k0, n_k, tile,
                                      split, 1, BN, STAGES, HAS_BIAS, G_PER_ROW, True)),
                    (_pingpong_producer, (x_desc, w_desc, s_desc, x_ring, w_ring, s_ring, ready, empty, off_m, off_n,
                                          k0, n_k, ROWS, BN, STAGES)),
                ], [W, 1], [PP_REGS, PRODUCER_REGS])
            else:
                gl.warp_specialize([
                    (_pingpong_half, (x_desc, w_desc, s_desc, out_desc, x_ring, w_ring, s_ring, o_smem0, ready,
                                      empty, g_ptr, bias_ptr, ws_ptr, cnt_ptr, SPLIT_K, off_m, off_n, k0, n_k, tile,
                                      split, 0, BN, STAGES, HAS_BIAS, G_PER_ROW)),
                    (_pingpong_half, (x_desc, w_desc, s_desc, out_desc, x_ring, w_ring, s_ring, o_smem1, ready,
                                      empty, g_ptr, bias_ptr, ws_ptr, cnt_ptr, SPLIT_K, off_m, off_n, k0, n_k, tile,
                                      split, 1, BN, STAGES, HAS_BIAS, G_PER_ROW)),
                ], [W], [PP_REGS])
        else:
            _swap_body(x_desc, w_desc, s_desc, out_desc, x_ring, packed_ptr, scale_ptr, g_ptr, bias_ptr, ws_ptr,
                       cnt_ptr, SPLIT_K, off_m, off_n, k0, n_k, tile, split, stride_w, stride_s, ROWS, BN, STAGES,
                       HAS_BIAS, G_PER_ROW, PREPACKED, TMA_W)

    @gluon.jit
    def _swap_body(x_desc, w_desc, s_desc, out_desc, x_ring, packed_ptr, scale_ptr, g_ptr, bias_ptr, ws_ptr, cnt_ptr,
                   SPLIT_K, off_m, off_n, k0, n_k, tile, split, stride_w, stride_s, ROWS: gl.constexpr,
                   BN: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr, G_PER_ROW: gl.constexpr,
                   PREPACKED: gl.constexpr, TMA_W: gl.constexpr):
        """The kernel without PINGPONG: one partition of WARPS / 4 warp groups, a CTA barrier per step."""
        W: gl.constexpr = gl.num_warps()
        BK_: gl.constexpr = 64
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BN, 16])
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_lay: gl.constexpr = _bytes_layout(W)
        r_lay: gl.constexpr = _rows_layout(W)
        if TMA_W:  # the weight's bytes and scales of each step in the ring too
            w_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, ROWS, BK_ // 2], w_desc.layout)
            s_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, 1, ROWS // 4, 16], s_desc.layout)
        else:
            w_ring = x_ring
            s_ring = x_ring
        o_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, ROWS], out_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):
            mbarrier.init(ready.index(j), count=1)
        fence_async_shared()  # the initialized barriers are visible to TMA
        for j in gl.static_range(STAGES):  # steps 0 .. STAGES - 1
            if j < n_k:
                _fill(j, j, x_desc, w_desc, s_desc, x_ring, w_ring, s_ring, ready, off_m, off_n, k0, BN, ROWS, 1,
                      TMA_W)

        # step 0 outside the loop: were the accumulator's zeros on a path that skips the loop, ptxas
        # would serialize the wgmma (C7515; see wgmma_gemm._wgmma_kernel). Two steps per iteration:
        # the decoded A (and the loaded bytes) alternate between two sets of registers, so the loop
        # carries them without copies (a copy of a loaded register at the end of an iteration would
        # wait for its load)
        acc = gl.zeros([ROWS, BN], gl.float32, layout=mma)
        if TMA_W:
            acc = _tma_steps(acc, x_desc, w_desc, s_desc, x_ring, w_ring, s_ring, ready, ready, n_k, k0, off_m, off_n,
                             ROWS, BN, STAGES, 1, 0, b_lay, a_op)
        else:
            # the step's packed bytes [ROWS, 4, 8] and scale words [ROWS] of step 0 (of this split); with
            # PREPACKED, its 32-bit words in the order they are stored ([ROWS, t, w], see `_bytes`)
            if PREPACKED:
                l_lay: gl.constexpr = _prepacked_layout(W)
                br = gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, l_lay)))
                bt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, l_lay)))
                bw = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, l_lay)))
                b_ptrs = (packed_ptr.to(gl.pointer_type(gl.int32))
                          + ((off_n + br).to(gl.int64) * (stride_w // 4) + k0 * 8)[:, None, None]
                          + (bt * 2)[None, :, None] + bw[None, None, :])
                STEP: gl.constexpr = 8
            else:
                br = gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, b_lay)))
                bb = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, b_lay)))
                bi = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, b_lay)))
                b_ptrs = (packed_ptr + ((off_n + br).to(gl.int64) * stride_w + k0 * (BK_ // 2))[:, None, None]
                          + (bb * 8)[None, :, None] + bi[None, None, :])
                STEP: gl.constexpr = BK_ // 2
            sr = gl.arange(0, ROWS, layout=r_lay)
            s_ptrs = scale_ptr.to(gl.pointer_type(gl.int32)) + (off_n + sr).to(gl.int64) * (stride_s // 4) + k0
            # step 0 decoded, step 1's bytes and scales loaded (the last step reloads itself: unused)
            a = _decode_step(_load_bytes(b_ptrs, PREPACKED), gl.load(s_ptrs), ROWS, PREPACKED, b_lay, a_op)
            nxt = gl.minimum(1, n_k - 1)
            b = _load_bytes(b_ptrs + nxt * STEP, PREPACKED)
            sw = gl.load(s_ptrs + nxt)
            acc, a, b, sw = _swap_step(0, acc, a, b, sw, x_desc, x_ring, ready, b_ptrs, s_ptrs, n_k, k0, off_m,
                                       ROWS, BN, STAGES, PREPACKED, b_lay, a_op)
            for i in range(1, n_k - 1, 2):
                acc, a, b, sw = _swap_step(i, acc, a, b, sw, x_desc, x_ring, ready, b_ptrs, s_ptrs, n_k, k0, off_m,
                                           ROWS, BN, STAGES, PREPACKED, b_lay, a_op)
                acc, a, b, sw = _swap_step(i + 1, acc, a, b, sw, x_desc, x_ring, ready, b_ptrs, s_ptrs, n_k, k0,
                                           off_m, ROWS, BN, STAGES, PREPACKED, b_lay, a_op)
            if n_k % 2 == 0:
                acc, a, b, sw = _swap_step(n_k - 1, acc, a, b, sw, x_desc, x_ring, ready, b_ptrs, s_ptrs, n_k, k0,
                                           off_m, ROWS, BN, STAGES, PREPACKED, b_lay, a_op)
        _store_tile_t(acc, g_ptr, bias_ptr, out_desc, o_smem, ws_ptr, cnt_ptr, SPLIT_K, off_m, off_n, tile,
                      gl.num_programs(0), split, ROWS, BN, HAS_BIAS, G_PER_ROW, mma)


def linear_swap(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                bias: torch.Tensor | None = None, cfg: dict | None = None) -> torch.Tensor:
    """y [M, N] bf16 = x [M, K] bf16 @ Ŵᵀ (+ bias), Ŵ [N, K]; one global scale or one per row of Ŵ.
    With cfg PREPACKED, `packed` is `prepack`'s reordering of the packed weight; with TMA_W also,
    `scale` is `prepack_scales`'s [K/64, N, 4]."""
    cfg = full_config(cfg)
    m, k = x.shape
    n = packed.shape[0]
    if not x.is_cuda:
        raise ValueError("the swap kernel (Gluon) runs on CUDA GPUs only; Triton's interpreter does not run Gluon")
    if not AVAILABLE or torch.cuda.get_device_capability(x.device)[0] != 9:
        raise ValueError("the swap kernel needs Gluon and a Hopper GPU (sm_90)")
    if cfg["WARPS"] not in (4, 8) or cfg["BN"] % 8 or not 8 <= cfg["BN"] <= 256 or cfg["STAGES"] < 2:
        raise ValueError(f"the swap kernel needs WARPS 4 or 8, BN a multiple of 8 in [8, 256] and STAGES >= 2, "
                         f"got {cfg}")
    if not supports(m, n, k, cfg):
        raise ValueError(f"the swap kernel needs N % {16 * cfg['WARPS']} == 0 and K % {BK} == 0 "
                         f"(got M={m}, N={n}, K={k})")
    if cfg["TMA_W"] and not cfg["PREPACKED"]:
        raise ValueError(f"the swap kernel's TMA_W reads the weight in `prepack`'s order: it needs PREPACKED, "
                         f"got {cfg}")
    pp = bool(cfg["PINGPONG"])
    if cfg["PRODUCER"] and not pp:
        raise ValueError(f"the swap kernel's PRODUCER is a third partition of PINGPONG: it needs PINGPONG, got {cfg}")
    if pp and (not cfg["TMA_W"] or cfg["WARPS"] != 8 or cfg["STAGES"] < 3):
        # STAGES 2 would hang: both halves wait for step i + 1 before half 0 issues it (at the end of step i)
        raise ValueError(f"the swap kernel's PINGPONG runs two warp groups on the TMA ring: it needs TMA_W, "
                         f"WARPS 8 and STAGES >= 3, got {cfg}")
    scale_shape = (k // BK, n, BK // 16) if cfg["TMA_W"] else (n, k // 16)
    if x.dtype != torch.bfloat16 or packed.dtype != torch.uint8 or packed.shape != (n, k // 2) \
            or tuple(scale.shape) != scale_shape or global_scale.numel() not in (1, n) \
            or (bias is not None and bias.numel() != n) or packed.stride(1) != 1 or scale.stride(-1) != 1:
        raise ValueError(f"the swap kernel needs x bf16 [M, K], packed uint8 [N, K/2], scale {list(scale_shape)} (unit "
                         f"stride along K), one global scale or N, a bias of N; got x {x.dtype} {tuple(x.shape)}, "
                         f"packed {packed.dtype} {tuple(packed.shape)}, scale {tuple(scale.shape)}, "
                         f"{global_scale.numel()} global scale(s), bias {None if bias is None else bias.numel()}")
    # the input ring, the output tile, the mbarriers (PINGPONG: `ready` and `empty`)
    smem = (cfg["STAGES"] * BK + 16 * cfg["WARPS"]) * cfg["BN"] * 2 + 8 * cfg["STAGES"] * (2 if pp else 1)
    if cfg["TMA_W"]:
        smem += cfg["STAGES"] * 16 * cfg["WARPS"] * (BK // 2 + BK // 16)  # the weight's bytes and scales
    if smem > 227 * 1024 or cfg["GROUP_M"] < 1:
        raise ValueError(f"the swap kernel's config needs {smem} bytes of shared memory (at most 227 KB: fewer "
                         f"STAGES or a smaller BN) and GROUP_M >= 1, got {cfg}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        raise ValueError("the swap kernel loads the input by TMA: its rows need 16-byte alignment")
    if scale.stride(0) % 4 or scale.data_ptr() % 4:
        raise ValueError("the swap kernel reads a row's 4 block scales of a step as one 32-bit word: scale rows "
                         "need a stride and an address that are multiples of 4")
    if cfg["TMA_W"] and (not scale.is_contiguous() or scale.data_ptr() % 16 or packed.stride(0) % 16
                         or packed.data_ptr() % 16):
        raise ValueError("the swap kernel's TMA_W loads the weight and scales by TMA: the scales contiguous "
                         "(`prepack_scales`), both 16-byte aligned")
    g = global_scale.reshape(-1)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    tiles = -(-m // cfg["BN"]) * (n // (16 * cfg["WARPS"]))
    steps = k // BK
    split = -(-steps // -(-steps // max(1, min(cfg["SPLIT_K"], steps))))  # no split without a step
    rows = 16 * cfg["WARPS"]
    ws = torch.empty(split * tiles * rows * cfg["BN"], dtype=torch.float32, device=x.device) if split > 1 else g
    # PINGPONG: each warp group (a partition of 4 warps) stores, and splits K over, its own half of the rows
    box = rows // 2 if pp else rows
    # the input tile [BN, 64] by TMA, rows ≥ M read as 0; the output tile [BN, rows] back by TMA, rows ≥ M not written
    x_desc = TensorDescriptor.from_tensor(x, [cfg["BN"], BK], _X_SMEM_LAYOUT)
    out_desc = TensorDescriptor.from_tensor(out, [cfg["BN"], box],
                                            gl.NVMMASharedLayout.get_default_for([cfg["BN"], box], gl.bfloat16))
    w_desc = s_desc = x_desc  # unused unless TMA_W
    if cfg["TMA_W"]:
        w_desc = TensorDescriptor.from_tensor(packed, [box, BK // 2], _BYTES_SMEM_LAYOUT_2D)
        s_desc = TensorDescriptor.from_tensor(scale.view(torch.uint8).view(k // BK, n // 4, 16), [1, box // 4, 16],
                                              _BYTES_SMEM_LAYOUT_3D)
    _swap_kernel[(tiles, split)](
        x_desc, w_desc, s_desc, out_desc, packed, scale.view(torch.uint8), g, bias if bias is not None else g, ws,
        _counters(x.device, 2 * tiles if pp else tiles), m, n, k, packed.stride(0), scale.stride(0), split,
        BN=cfg["BN"], STAGES=cfg["STAGES"], GROUP_M=cfg["GROUP_M"], HAS_BIAS=bias is not None,
        G_PER_ROW=g.numel() > 1, PREPACKED=bool(cfg["PREPACKED"]), TMA_W=bool(cfg["TMA_W"]),
        PINGPONG=pp, PP_REGS=cfg["PP_REGS"], PRODUCER=bool(cfg["PRODUCER"]), PRODUCER_REGS=cfg["PRODUCER_REGS"],
        num_warps=cfg["WARPS"] // 2 if pp else cfg["WARPS"],
    )
    return out
