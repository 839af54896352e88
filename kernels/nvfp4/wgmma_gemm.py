"""The NVFP4 W4A16 GEMMs for many rows (M ≥ 64) on Hopper: decode into shared memory, then wgmma.

    out [M, P] = a [M, R] @ B,   B = Ŵᵀ (forward: a = x, Ŵ [P, R])  or  Ŵ (dX: a = dy, Ŵ [R, P])

Ŵ the NVFP4 weight (packed E2M1 bytes, e4m3 block scales along Ŵ's columns, fp32 global
scale). GPU only (sm_90: wgmma; Gluon does not run in Triton's interpreter): a test compiles
it offline, `benchmarks/nvfp4_wgmma_check.py` checks and times it on a GPU.

Why another kernel. The Triton tensor-core kernel of `gemm.py` decodes the weight into the
wgmma A fragment in registers and waits for every wgmma before decoding the next K tile, so
the tensor cores idle while the warps decode: 43-50 % of cuBLAS at M = 4096 on an H200, and
its dX, whose packing runs along the output dimension, 30-33 % (NOTES.md, 2026-12-03). At
many rows the decode is cheap (each weight is decoded once per BM rows of input); what
matters is that the tensor cores never wait for it. Here:

* every K step, all warps decode the step's weight tile [rows of Ŵ, columns of Ŵ] (always in
  Ŵ's own layout, so forward and dX share the decode) from shared memory into a bf16 tile in
  shared memory, in one of three buffers;
* then each warp group issues its wgmma on (the input tile, that bf16 tile) asynchronously and
  only waits for the *previous* step's wgmma (`warpgroup_mma_wait(1)`): the tensor cores
  multiply step i while the warps decode step i + 1. The forward reads the bf16 tile
  transposed (K-major B), dX as it is (N-major B); wgmma takes either for bf16;
* the input tile, the packed weight and the block scales arrive by cp.async through a ring of
  STAGES steps (STAGES - 2 ahead). One explicit CTA barrier per step (after the decode) covers
  the rings and the bf16 buffers: after it, every warp has finished the wgmma of step i - 2,
  whose slots are refilled (Triton's barrier analysis adds two more around the ring accesses).

The decode is `gemm._DECODE_WORD_ASM` (one 32-bit word → 8 weights E2M1 · s · 2^-8, exact in
bf16) with the scales of `gemm._SCALE_PAIR_ASM`; the epilogue multiplies by 2^8 and divides by
the global scale (per output column in the forward, as vLLM's fused q/k/v and gate/up need),
adds the bias and rounds to bf16 once. So the result is the float32-accumulated product with
the exact float32 dequantized weight, like every other kernel of this package.

Status (H100, NOTES.md 2026-12-06 late): correct; 56-62 % of cuBLAS at M = 4096, so the learner
keeps dequantize + cuBLAS by default. Without the decode the same pipeline reaches 85 %: the
decode, done by every warp between two wgmmas, is what is not hidden yet. At 256 rows it beats
dequantize + cuBLAS on the 7B gate_up and down shapes.

The warp-specialized variant (WS_CONFIG, NOTES.md 2026-12-07) takes the decode off the wgmma
warps: one extra warp group (fewer registers, `setmaxnreg`) loads the packed weight and scales by
cp.async and decodes into the bf16 buffers, the kernel's two warp groups only wait on mbarriers
and issue wgmma, the input tile comes by TMA; with a 256 × 128 tile it reaches 72-79 % of cuBLAS
at M = 4096 (H100), still below dequantize + cuBLAS (a 7B layer's fwd + dX: 28.3 vs 22.4 ms), and
1.8× dequantize + cuBLAS on vLLM's fused gate_up at 256 rows.
"""
from __future__ import annotations

import torch

try:  # Gluon ships with triton >= 3.5; its API is experimental and changes between releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    AVAILABLE = True
except ImportError:  # pragma: no cover
    AVAILABLE = False

from .gemm import _DECODE_WORD_ASM, _SCALE_BIAS, _SCALE_PAIR_ASM, _counters

__all__ = ["AVAILABLE", "DEFAULT_CONFIG", "WS_CONFIG", "full_config", "grad_input_wgmma", "linear_wgmma", "supports"]

# BM input rows × BP output columns per CTA (BM / 16 warps: 64 rows per warp group), BR of the
# reduction per step. 128 × 256 × 64 with 5 stages uses ~221 KB of the H100/H200's 227 KB.
# SPLIT_K > 1 splits the reduction over that many programs per tile (fp32 partials in a
# workspace, the last to arrive sums them in split order): for few tiles (serving-sized M).
DEFAULT_CONFIG = {"BM": 128, "BP": 256, "BR": 64, "STAGES": 5, "GROUP_M": 8, "SPLIT_K": 1}
# WARP_SPECIALIZE: the kernel `_ws_kernel` instead, where one extra warp group decodes into
# DECODED bf16 buffers and the kernel's WARPS warps (two warp groups, BM / 2 rows each) only load
# the input (TMA, a ring of STAGES) and issue wgmma; the decode warps get DECODE_REGS registers per
# thread, the kernel MAXNREG (the wgmma warps get what is left: 184). 256 × 128 halves the decode
# per multiply-add against 128 × 256 (each weight is decoded once per BM input rows): 72-79 % of
# cuBLAS at M = 4096 on an H100 where 128 × 256 gave 53-61 % (NOTES.md, 2026-12-07). ~194 KB.
# DECODE_WARPS 8 (two decode warp groups, each thread half the words; with DECODE_REGS 88 and
# MAXNREG 128, 16 warps in all): correct, 2-3 % slower than one on an H200 (NOTES.md, 2026-12-07).
# PINGPONG: the two wgmma warp groups in partitions of their own (the second at MMA_REGS registers),
# each with half the input rows and its own input ring, coupled only through the decoded buffers.
# Correct on an H100, no faster than without (NOTES.md, 2026-12-07, fifth session): off by default.
WS_CONFIG = {**DEFAULT_CONFIG, "WARP_SPECIALIZE": True, "BM": 256, "BP": 128, "STAGES": 4, "DECODED": 3,
             "DECODE_REGS": 128, "MAXNREG": 168, "WARPS": 8, "DECODE_WARPS": 4, "PINGPONG": False, "MMA_REGS": 184}


def full_config(cfg: dict | None) -> dict:
    """`cfg` over the defaults of its kernel (WS_CONFIG where it asks for WARP_SPECIALIZE)."""
    cfg = cfg or {}
    return {**(WS_CONFIG if cfg.get("WARP_SPECIALIZE") else DEFAULT_CONFIG), **cfg}


def supports(m: int, p: int, r: int, cfg: dict, forward: bool = True) -> bool:
    """Whether a config fits out [m, p] = a [m, r] @ B: whole tiles along P and R (M is masked), and
    a weight tile with at least a row per thread group (4 words per thread: more decoding warps than
    that would decode some words twice, e.g. BM 256 with BP 128 in the forward)."""
    cfg = full_config(cfg)
    wr, wc = (cfg["BP"], cfg["BR"]) if forward else (cfg["BR"], cfg["BP"])
    warps = cfg["DECODE_WARPS"] if cfg.get("WARP_SPECIALIZE") else cfg["BM"] // 16
    rows_per_pass = 32 // (wc // 32) * warps  # _rows_layout(wc / 8, 4, warps)
    return m >= 1 and p % cfg["BP"] == 0 and r % cfg["BR"] == 0 and wr % rows_per_pass == 0


if AVAILABLE:
    from .decode_gemm import _copy_to_shared, _cta_barrier  # shims over triton 3.6 / 3.9 names

    _SCALE_BIAS_C = gl.constexpr(_SCALE_BIAS)
    # the input tile [BM, 64] bf16 in shared memory: rows of 128 bytes, wgmma's 128-byte swizzle
    _A_SMEM_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    @gluon.constexpr_function
    def _rows_layout(cols, per_thread, warps):
        """[rows, cols] with `per_thread` contiguous columns per thread, a row's threads adjacent."""
        tc = cols // per_thread
        return gl.BlockedLayout([1, per_thread], [32 // tc, tc], [warps, 1], [1, 0])

    @gluon.jit
    def _decode_tile(w, pairs, WR: gl.constexpr, WC: gl.constexpr, w_lay: gl.constexpr):
        """int32 words w [WR, WC/8] (4 per thread) and int16 scale pairs [WR, WC/32] (1 per thread,
        the pair of those 4 words) → the weights [WR, WC] bf16 (· 2^-8) in Ŵ's column order."""
        s0, s1 = gl.inline_asm_elementwise(_SCALE_PAIR_ASM.value, "=r,=r,h", [pairs],
                                           dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
        # words 4p, 4p + 1 are block 2p (the pair's low byte), words 4p + 2, 4p + 3 block 2p + 1.
        # join adds a new minor dimension: [WR, WC/32, block, copy] → word 4p + 2·block + copy
        sw = gl.reshape(gl.join(gl.join(s0, s1), gl.join(s0, s1)), [WR, WC // 8])
        sw = gl.convert_layout(sw, w_lay, assert_trivial=True)
        o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
            _DECODE_WORD_ASM.value, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, sw],
            dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
        # output 4ν + 2j + h is nibble ν of byte j + 2h, i.e. code 4h + 2j + ν of the word; each join
        # adds the minor dimension, so this is [WR, WC/8, h, j, ν]: the codes in memory order
        v = gl.join(gl.join(gl.join(o0, o1), gl.join(o2, o3)), gl.join(gl.join(o4, o5), gl.join(o6, o7)))
        return gl.reshape(v, [WR, WC])

    @gluon.jit
    def _epilogue(acc, g_ptr, bias_ptr, out_ptr, out_offs, out_mask, rp, BP: gl.constexpr, HAS_BIAS: gl.constexpr,
                  G_PER_ROW: gl.constexpr, mma: gl.constexpr):
        """out = acc · 2^8 / g (+ bias), rounded to bf16 once; one division per column (or per kernel)."""
        if G_PER_ROW:
            y = acc * gl.div_rn(gl.full([BP], _SCALE_BIAS_C, gl.float32, gl.SliceLayout(0, mma)),
                                gl.load(g_ptr + rp))[None, :]
        else:
            y = acc * gl.div_rn(_SCALE_BIAS_C, gl.load(g_ptr))
        if HAS_BIAS:
            y += gl.load(bias_ptr + rp).to(gl.float32)[None, :]
        gl.store(out_ptr + out_offs, y.to(gl.bfloat16), mask=out_mask)

    @gluon.jit
    def _tile(tile, split, M, P, R, SPLIT_K, BM: gl.constexpr, BP: gl.constexpr, BR: gl.constexpr,
              GROUP_M: gl.constexpr):
        """Output tile `tile`'s offsets (grouped order: GROUP_M row tiles run next to each other on
        one column tile, for L2 reuse) and split `split`'s share of the reduction: steps
        [k0, k0 + n_k) (the launcher makes none empty)."""
        tiles_m = gl.cdiv(M, BM)
        tiles_p = P // BP
        per_group = GROUP_M * tiles_p
        first_m = (tile // per_group) * GROUP_M
        group_m = gl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % group_m
        pid_p = (tile % per_group) // group_m
        per_split = gl.cdiv(R // BR, SPLIT_K)
        k0 = split * per_split
        return pid_m * BM, pid_p * BP, k0, gl.minimum(per_split, R // BR - k0)

    @gluon.jit
    def _weight_pointers(packed_ptr, scale_ptr, k0, off_p, stride_w, stride_s, FORWARD: gl.constexpr,
                         BR: gl.constexpr, WR: gl.constexpr, WC: gl.constexpr, w_lay: gl.constexpr,
                         sc_lay: gl.constexpr):
        """Pointers to step 0's packed words [WR, WC/8] and scale pairs [WR, WC/32] of the weight
        tile, and how far a step moves them."""
        wr = gl.arange(0, WR, layout=gl.SliceLayout(1, w_lay))
        wc = gl.arange(0, WC // 8, layout=gl.SliceLayout(0, w_lay))
        sr = gl.arange(0, WR, layout=gl.SliceLayout(1, sc_lay))
        scc = gl.arange(0, WC // 32, layout=gl.SliceLayout(0, sc_lay))
        if FORWARD:  # rows off_p + r, columns (the reduction) from k0
            w_ptrs = (packed_ptr.to(gl.pointer_type(gl.int32)) + (off_p + wr).to(gl.int64)[:, None] * (stride_w // 4)
                      + (k0 * (BR // 8) + wc)[None, :])
            s_ptrs = (scale_ptr.to(gl.pointer_type(gl.int16)) + (off_p + sr).to(gl.int64)[:, None] * (stride_s // 2)
                      + (k0 * (BR // 32) + scc)[None, :])
            w_step = BR // 8
            s_step = BR // 32
        else:  # rows (the reduction) from k0, columns off_p + c
            w_ptrs = (packed_ptr.to(gl.pointer_type(gl.int32)) + (k0 * BR + wr).to(gl.int64)[:, None] * (stride_w // 4)
                      + (off_p // 8 + wc)[None, :])
            s_ptrs = (scale_ptr.to(gl.pointer_type(gl.int16)) + (k0 * BR + sr).to(gl.int64)[:, None] * (stride_s // 2)
                      + (off_p // 32 + scc)[None, :])
            w_step = BR * (stride_w // 4)
            s_step = BR * (stride_s // 2)
        return w_ptrs, s_ptrs, w_step, s_step

    @gluon.jit
    def _store_tile(acc, g_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, P, SPLIT_K, off_m, off_p, tile, split,
                    BM: gl.constexpr, BP: gl.constexpr, HAS_BIAS: gl.constexpr, G_PER_ROW: gl.constexpr,
                    mma: gl.constexpr):
        """The tile's output: the epilogue, or with split-K this split's fp32 partial, and the last
        split to arrive sums them in split order (deterministic) and runs the epilogue."""
        rm = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
        rp = off_p + gl.arange(0, BP, layout=gl.SliceLayout(0, mma))
        out_offs = rm.to(gl.int64)[:, None] * P + rp[None, :]
        out_mask = (rm < M)[:, None] & (rp >= 0)[None, :]
        if SPLIT_K == 1:
            _epilogue(acc, g_ptr, bias_ptr, out_ptr, out_offs, out_mask, rp, BP, HAS_BIAS, G_PER_ROW, mma)
        else:
            gl.store(ws_ptr + (split * M).to(gl.int64) * P + out_offs, acc, mask=out_mask)
            _cta_barrier()  # every thread's partial is written before the release below
            arrived = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                total = gl.zeros([BM, BP], gl.float32, layout=mma)
                for sp in range(SPLIT_K):
                    total += gl.load(ws_ptr + (sp * M).to(gl.int64) * P + out_offs, mask=out_mask, other=0.0,
                                     cache_modifier=".cg")
                _epilogue(total, g_ptr, bias_ptr, out_ptr, out_offs, out_mask, rp, BP, HAS_BIAS, G_PER_ROW, mma)
                gl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch

    @gluon.jit
    def _k_step(i, acc, a_ring, w_ring, s_ring, d_ring, a_ptrs, w_ptrs, s_ptrs, w_step, s_step, n_k,
                FORWARD: gl.constexpr, BR: gl.constexpr, WR: gl.constexpr, WC: gl.constexpr,
                STAGES: gl.constexpr, w_lay: gl.constexpr, p_lay: gl.constexpr):
        """One K step: decode step i, multiply it (async), refill the ring slot of step i - 2."""
        slot = i % STAGES
        # decode step i into bf16 buffer i % 3 (last read by the wgmma of step i - 3: finished,
        # every warp waited for it before the previous barrier)
        w = w_ring.index(slot).load(w_lay)
        pairs = s_ring.index(slot).load(p_lay)
        d = d_ring.index(i % 3)
        d.store(_decode_tile(w, pairs, WR, WC, w_lay))
        fence_async_shared()  # the decoded tile is visible to the wgmma (async proxy)
        async_copy.wait_group(STAGES - 4)  # step i + 1 has landed (this thread's copies)
        _cta_barrier()  # everyone's decode of step i and copies of step i + 1 are done
        if FORWARD:
            b = d.permute((1, 0))  # [BR, BP], K-major
        else:
            b = d  # [BR, BP], N-major
        acc = warpgroup_mma(a_ring.index(slot), b, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # this warp group's step i - 1 is done
        # every warp passed the barrier above after waiting for its step i - 2: refill that slot
        nxt = i + STAGES - 2
        if nxt < n_k:
            fill = nxt % STAGES
            _copy_to_shared(a_ring.index(fill), a_ptrs + nxt * BR)
            _copy_to_shared(w_ring.index(fill), w_ptrs + nxt * w_step)
            _copy_to_shared(s_ring.index(fill), s_ptrs + nxt * s_step)
        async_copy.commit_group()
        return acc

    @gluon.jit
    def _wgmma_kernel(
        a_ptr, packed_ptr, scale_ptr, g_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
        M, P, R, stride_am, stride_w, stride_s, SPLIT_K,
        FORWARD: gl.constexpr, BM: gl.constexpr, BP: gl.constexpr, BR: gl.constexpr,
        STAGES: gl.constexpr, GROUP_M: gl.constexpr, HAS_BIAS: gl.constexpr, G_PER_ROW: gl.constexpr,
    ):
        W: gl.constexpr = gl.num_warps()
        # the weight tile of a step in Ŵ's layout: [BP, BR] (forward) or [BR, BP] (dX)
        WR: gl.constexpr = BP if FORWARD else BR
        WC: gl.constexpr = BR if FORWARD else BP
        a_lay: gl.constexpr = _rows_layout(BR, 8, W)  # 16-byte copies
        w_lay: gl.constexpr = _rows_layout(WC // 8, 4, W)  # 4 words = 16 bytes per thread
        p_lay: gl.constexpr = _rows_layout(WC // 32, 1, W)  # the scale pair of those 4 words
        sc_lay: gl.constexpr = _rows_layout(WC // 32, 2, W)  # scales copied 4 bytes at a time
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BP, 16])
        a_smem_lay: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        d_smem_lay: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])

        pid = gl.program_id(0)
        off_m, off_p, k0, n_k = _tile(pid, gl.program_id(1), M, P, R, SPLIT_K, BM, BP, BR, GROUP_M)

        # pointers of step 0; a step advances them by BR along the reduction
        am = gl.minimum(off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, a_lay)), M - 1)  # rows ≥ M: never stored
        ak = gl.arange(0, BR, layout=gl.SliceLayout(0, a_lay))
        a_ptrs = a_ptr + am.to(gl.int64)[:, None] * stride_am + (k0 * BR + ak)[None, :]
        w_ptrs, s_ptrs, w_step, s_step = _weight_pointers(packed_ptr, scale_ptr, k0, off_p, stride_w, stride_s,
                                                          FORWARD, BR, WR, WC, w_lay, sc_lay)

        a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BR], a_smem_lay)
        w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, WR, WC // 8], flat)
        s_ring = gl.allocate_shared_memory(gl.int16, [STAGES, WR, WC // 32], flat)
        d_ring = gl.allocate_shared_memory(gl.bfloat16, [3, WR, WC], d_smem_lay)

        for j in gl.static_range(STAGES - 2):  # steps 0 .. STAGES - 3, one commit group each
            if j < n_k:
                _copy_to_shared(a_ring.index(j), a_ptrs + j * BR)
                _copy_to_shared(w_ring.index(j), w_ptrs + j * w_step)
                _copy_to_shared(s_ring.index(j), s_ptrs + j * s_step)
            async_copy.commit_group()
        async_copy.wait_group(STAGES - 3)  # step 0 has landed (this thread's copies) ...
        _cta_barrier()  # ... and everyone's

        # step 0 outside the loop: were the zeros on a path that skips the loop to the final wait,
        # ptxas would serialize every wgmma (C7515, "non wgmma instructions defining accumulator
        # registers ... between start and end of the pipeline stage")
        acc = gl.zeros([BM, BP], gl.float32, layout=mma)
        acc = _k_step(0, acc, a_ring, w_ring, s_ring, d_ring, a_ptrs, w_ptrs, s_ptrs, w_step, s_step, n_k,
                      FORWARD, BR, WR, WC, STAGES, w_lay, p_lay)
        for i in range(1, n_k):
            acc = _k_step(i, acc, a_ring, w_ring, s_ring, d_ring, a_ptrs, w_ptrs, s_ptrs, w_step, s_step, n_k,
                          FORWARD, BR, WR, WC, STAGES, w_lay, p_lay)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        async_copy.wait_group(0)

        _store_tile(acc, g_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, P, SPLIT_K, off_m, off_p, pid, gl.program_id(1),
                    BM, BP, HAS_BIAS, G_PER_ROW, mma)

    if hasattr(tma, "async_load"):  # triton 3.9
        @gluon.jit
        def _tma_load(desc, coord, bar, smem):
            tma.async_load(desc, coord, bar, smem)
    else:  # triton 3.6
        @gluon.jit
        def _tma_load(desc, coord, bar, smem):
            tma.async_copy_global_to_shared(desc, coord, bar, smem)

    @gluon.jit
    def _ws_load_a(a_desc, a_ring, a_ready, slot, off_m, kk, BR: gl.constexpr):
        """The input tile of reduction step kk into a_ring[slot] by TMA; a_ready[slot] counts its bytes."""
        mbarrier.expect(a_ready.index(slot), a_ring.shape[1] * a_ring.shape[2] * 2)
        _tma_load(a_desc, [off_m, kk * BR], a_ready.index(slot), a_ring.index(slot))

    @gluon.jit
    def _ws_mma_step(i, acc, a_desc, a_ring, a_ready, d_ring, d_ready, d_empty, n_k, k0, off_m,
                     FORWARD: gl.constexpr, BR: gl.constexpr):
        """Multiply step i (async) once its input and decoded weight are in; then step i - 1's
        wgmma has finished in both warp groups: hand its decoded buffer back, refill its input slot."""
        NA: gl.constexpr = a_ring.shape[0]
        ND: gl.constexpr = d_ring.shape[0]
        mbarrier.wait(a_ready.index(i % NA), (i // NA) & 1)
        mbarrier.wait(d_ready.index(i % ND), (i // ND) & 1)
        d = d_ring.index(i % ND)
        if FORWARD:
            b = d.permute((1, 0))  # [BR, BP], K-major
        else:
            b = d  # [BR, BP], N-major
        acc = warpgroup_mma(a_ring.index(i % NA), b, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # this warp group's step i - 1 is done
        if i > 0:
            _cta_barrier()  # ... and the other's (a barrier of this partition's warps only)
            prev = i - 1
            mbarrier.arrive(d_empty.index(prev % ND), count=1)
            nxt = prev + NA
            if nxt < n_k:
                _ws_load_a(a_desc, a_ring, a_ready, prev % NA, off_m, k0 + nxt, BR)
        return acc

    @gluon.jit
    def _ws_mma(a_desc, a_ring, a_ready, d_ring, d_ready, d_empty, n_k, k0, off_m, off_p, pid,
                g_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, P, SPLIT_K,
                FORWARD: gl.constexpr, BM: gl.constexpr, BP: gl.constexpr, BR: gl.constexpr,
                HAS_BIAS: gl.constexpr, G_PER_ROW: gl.constexpr):
        """The default partition (two warp groups): input tiles by TMA, wgmma, the epilogue."""
        W: gl.constexpr = gl.num_warps()
        NA: gl.constexpr = a_ring.shape[0]
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BP, 16])
        for j in gl.static_range(NA):
            if j < n_k:
                _ws_load_a(a_desc, a_ring, a_ready, j, off_m, k0 + j, BR)
        # step 0 outside the loop (see _wgmma_kernel: else ptxas serializes every wgmma, C7515)
        acc = gl.zeros([BM, BP], gl.float32, layout=mma)
        acc = _ws_mma_step(0, acc, a_desc, a_ring, a_ready, d_ring, d_ready, d_empty, n_k, k0, off_m, FORWARD, BR)
        for i in range(1, n_k):
            acc = _ws_mma_step(i, acc, a_desc, a_ring, a_ready, d_ring, d_ready, d_empty, n_k, k0, off_m,
                               FORWARD, BR)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _store_tile(acc, g_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, P, SPLIT_K, off_m, off_p, pid, gl.program_id(1),
                    BM, BP, HAS_BIAS, G_PER_ROW, mma)

    @gluon.jit
    def _ws_decode(packed_ptr, scale_ptr, w_ring, s_ring, d_ring, d_ready, d_empty, n_k, k0, off_p,
                   stride_w, stride_s, FORWARD: gl.constexpr, BP: gl.constexpr, BR: gl.constexpr):
        """The decode partition (one warp group): packed weight and scales by cp.async through their
        own ring, decoded into the bf16 buffers while the other warps multiply."""
        W: gl.constexpr = gl.num_warps()
        WR: gl.constexpr = BP if FORWARD else BR
        WC: gl.constexpr = BR if FORWARD else BP
        DS: gl.constexpr = w_ring.shape[0]
        ND: gl.constexpr = d_ring.shape[0]
        w_lay: gl.constexpr = _rows_layout(WC // 8, 4, W)
        p_lay: gl.constexpr = _rows_layout(WC // 32, 1, W)
        sc_lay: gl.constexpr = _rows_layout(WC // 32, 2, W)
        w_ptrs, s_ptrs, w_step, s_step = _weight_pointers(packed_ptr, scale_ptr, k0, off_p, stride_w, stride_s,
                                                          FORWARD, BR, WR, WC, w_lay, sc_lay)
        for j in gl.static_range(DS - 1):  # steps 0 .. DS - 2, one commit group each
            if j < n_k:
                _copy_to_shared(w_ring.index(j), w_ptrs + j * w_step)
                _copy_to_shared(s_ring.index(j), s_ptrs + j * s_step)
            async_copy.commit_group()
        for i in range(n_k):
            slot = i % DS
            async_copy.wait_group(DS - 2)  # step i has landed (this thread's copies) ...
            _cta_barrier()  # ... and everyone's; everyone has read step i - 1's slot: refill it
            nxt = i + DS - 1
            if nxt < n_k:
                _copy_to_shared(w_ring.index(nxt % DS), w_ptrs + nxt * w_step)
                _copy_to_shared(s_ring.index(nxt % DS), s_ptrs + nxt * s_step)
            async_copy.commit_group()
            v = _decode_tile(w_ring.index(slot).load(w_lay), s_ring.index(slot).load(p_lay), WR, WC, w_lay)
            mbarrier.wait(d_empty.index(i % ND), ((i // ND) & 1) ^ 1)  # step i - ND's wgmma is done
            d_ring.index(i % ND).store(v)
            fence_async_shared()  # visible to the wgmma (async proxy) ...
            _cta_barrier()  # ... from every thread of this partition, before the one arrive
            mbarrier.arrive(d_ready.index(i % ND), count=1)
        async_copy.wait_group(0)

    @gluon.jit
    def _ws_kernel(
        a_desc, packed_ptr, scale_ptr, g_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
        M, P, R, stride_w, stride_s, SPLIT_K,
        FORWARD: gl.constexpr, BM: gl.constexpr, BP: gl.constexpr, BR: gl.constexpr,
        STAGES: gl.constexpr, DECODED: gl.constexpr, GROUP_M: gl.constexpr, DECODE_REGS: gl.constexpr,
        HAS_BIAS: gl.constexpr, G_PER_ROW: gl.constexpr, DECODE_WARPS: gl.constexpr = 4,
        PINGPONG: gl.constexpr = False, MMA_REGS: gl.constexpr = 184,
    ):
        """Warp-specialized: one warp group decodes the weight into DECODED bf16 buffers (mbarriers
        `d_ready` / `d_empty`), the kernel's num_warps (two warp groups) load the input by TMA into
        a ring of STAGES (`a_ready`) and only issue wgmma. No step barrier couples the two: the
        decode runs up to DECODED - 1 steps ahead of the multiply. PINGPONG: the two wgmma warp groups
        in partitions of their own (num_warps = 4 each; the second a worker at MMA_REGS registers), each
        with its own BM / 2 input rows, input ring and `a_ready`, and each handing the decoded buffer
        back on `d_empty` (count 2): no barrier couples them, so one issues while the other waits."""
        WR: gl.constexpr = BP if FORWARD else BR
        WC: gl.constexpr = BR if FORWARD else BP
        flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        d_smem_lay: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        pid = gl.program_id(0)
        off_m, off_p, k0, n_k = _tile(pid, gl.program_id(1), M, P, R, SPLIT_K, BM, BP, BR, GROUP_M)

        if PINGPONG:
            BH: gl.constexpr = BM // 2
            a_ring0 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BH, BR], a_desc.layout)
            a_ring1 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BH, BR], a_desc.layout)
            a_ready0 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            a_ready1 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for j in gl.static_range(STAGES):
                mbarrier.init(a_ready0.index(j), count=1)
                mbarrier.init(a_ready1.index(j), count=1)
        else:
            a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BR], a_desc.layout)
            a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for j in gl.static_range(STAGES):
                mbarrier.init(a_ready.index(j), count=1)
        w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, WR, WC // 8], flat)
        s_ring = gl.allocate_shared_memory(gl.int16, [STAGES, WR, WC // 32], flat)
        d_ring = gl.allocate_shared_memory(gl.bfloat16, [DECODED, WR, WC], d_smem_lay)
        d_ready = gl.allocate_shared_memory(gl.int64, [DECODED, 1], mbarrier.MBarrierLayout())
        d_empty = gl.allocate_shared_memory(gl.int64, [DECODED, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(DECODED):
            mbarrier.init(d_ready.index(j), count=1)
            mbarrier.init(d_empty.index(j), count=2 if PINGPONG else 1)  # PINGPONG: each wgmma warp group
        fence_async_shared()  # the initialized barriers are visible to TMA

        if PINGPONG:  # `pid` of `_ws_mma` names the half tile (split-K counters), off_m its first row
            gl.warp_specialize([
                (_ws_mma, (a_desc, a_ring0, a_ready0, d_ring, d_ready, d_empty, n_k, k0, off_m, off_p, 2 * pid,
                           g_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, P, SPLIT_K,
                           FORWARD, BH, BP, BR, HAS_BIAS, G_PER_ROW)),
                (_ws_mma, (a_desc, a_ring1, a_ready1, d_ring, d_ready, d_empty, n_k, k0, off_m + BH, off_p,
                           2 * pid + 1, g_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, P, SPLIT_K,
                           FORWARD, BH, BP, BR, HAS_BIAS, G_PER_ROW)),
                (_ws_decode, (packed_ptr, scale_ptr, w_ring, s_ring, d_ring, d_ready, d_empty, n_k, k0, off_p,
                              stride_w, stride_s, FORWARD, BP, BR)),
            ], [gl.num_warps(), DECODE_WARPS], [MMA_REGS, DECODE_REGS])
        else:
            gl.warp_specialize([
                (_ws_mma, (a_desc, a_ring, a_ready, d_ring, d_ready, d_empty, n_k, k0, off_m, off_p, pid,
                           g_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, P, SPLIT_K,
                           FORWARD, BM, BP, BR, HAS_BIAS, G_PER_ROW)),
                (_ws_decode, (packed_ptr, scale_ptr, w_ring, s_ring, d_ring, d_ready, d_empty, n_k, k0, off_p,
                              stride_w, stride_s, FORWARD, BP, BR)),
            ], [DECODE_WARPS], [DECODE_REGS])


def _launch(a: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
            bias: torch.Tensor | None, forward: bool, cfg: dict | None) -> torch.Tensor:
    cfg = full_config(cfg)
    m, r = a.shape
    p = packed.shape[0] if forward else packed.shape[1] * 2
    if not a.is_cuda:
        raise ValueError("the wgmma kernel (Gluon) runs on CUDA GPUs only; Triton's interpreter does not run Gluon")
    if not AVAILABLE or torch.cuda.get_device_capability(a.device)[0] != 9:
        raise ValueError("the wgmma kernel needs Gluon and a Hopper GPU (sm_90)")
    if cfg["STAGES"] < 4:
        raise ValueError(f"the wgmma kernel needs STAGES >= 4 (its ring runs STAGES - 2 steps ahead and waits for "
                         f"the next step while one more is in flight), got {cfg['STAGES']}")
    if not supports(m, p, r, cfg, forward):
        raise ValueError(f"the wgmma kernel needs P % {cfg['BP']} == 0, R % {cfg['BR']} == 0 and a weight tile of "
                         f"whole thread groups (got M={m}, P={p}, R={r}, config {cfg})")
    if a.stride(1) != 1 or a.stride(0) % 8 or a.data_ptr() % 16 or packed.stride(0) % 16 or packed.data_ptr() % 16:
        raise ValueError("the wgmma kernel copies the input and the packed weight in 16-byte vectors: both need "
                         "16-byte aligned rows")
    if scale.stride(0) % 4 or scale.data_ptr() % 4:
        raise ValueError("the wgmma kernel copies the block scales in 4-byte vectors: their rows need a stride "
                         "and an address that are multiples of 4")
    g = global_scale.reshape(-1)
    if not forward and g.numel() != 1:
        raise ValueError("dX needs one global scale (a per-row scale of Ŵ does not factor out of the reduction)")
    out = torch.empty((m, p), dtype=torch.bfloat16, device=a.device)
    tiles = -(-m // cfg["BM"]) * (p // cfg["BP"])
    steps = r // cfg["BR"]
    split = -(-steps // -(-steps // max(1, min(cfg["SPLIT_K"], steps))))  # no split without a step
    ws = torch.empty(split * m * p, dtype=torch.float32, device=a.device) if split > 1 else out
    if cfg.get("WARP_SPECIALIZE"):
        pp = bool(cfg["PINGPONG"])
        if pp and cfg["WARPS"] != 8:
            raise ValueError(f"the wgmma kernel's PINGPONG runs two wgmma warp groups of 4 warps: it needs WARPS 8, "
                             f"got {cfg}")
        # the input tile [BM, BR] by TMA, rows ≥ M read as 0 (PINGPONG: each warp group its own half)
        a_desc = TensorDescriptor.from_tensor(a, [cfg["BM"] // (2 if pp else 1), cfg["BR"]], _A_SMEM_LAYOUT)
        _ws_kernel[(tiles, split)](
            a_desc, packed, scale.view(torch.uint8), g, bias if bias is not None else g, out, ws,
            _counters(a.device, 2 * tiles if pp else tiles), m, p, r, packed.stride(0), scale.stride(0), split,
            FORWARD=forward, BM=cfg["BM"], BP=cfg["BP"], BR=cfg["BR"], STAGES=cfg["STAGES"], DECODED=cfg["DECODED"],
            GROUP_M=cfg["GROUP_M"], DECODE_REGS=cfg["DECODE_REGS"], HAS_BIAS=bias is not None, G_PER_ROW=g.numel() > 1,
            DECODE_WARPS=cfg["DECODE_WARPS"], PINGPONG=pp, MMA_REGS=cfg["MMA_REGS"],
            num_warps=cfg["WARPS"] // 2 if pp else cfg["WARPS"], maxnreg=cfg["MAXNREG"],
        )
        return out
    _wgmma_kernel[(tiles, split)](
        a, packed, scale.view(torch.uint8), g, bias if bias is not None else g, out, ws, _counters(a.device, tiles),
        m, p, r, a.stride(0), packed.stride(0), scale.stride(0), split,
        FORWARD=forward, BM=cfg["BM"], BP=cfg["BP"], BR=cfg["BR"], STAGES=cfg["STAGES"], GROUP_M=cfg["GROUP_M"],
        HAS_BIAS=bias is not None, G_PER_ROW=g.numel() > 1, num_warps=cfg["BM"] // 16,
    )
    return out


def linear_wgmma(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, cfg: dict | None = None) -> torch.Tensor:
    """y [M, N] bf16 = x [M, K] bf16 @ Ŵᵀ (+ bias), Ŵ [N, K]; one global scale or one per row of Ŵ."""
    return _launch(x, packed, scale, global_scale, bias, True, cfg)


def grad_input_wgmma(dy: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     cfg: dict | None = None) -> torch.Tensor:
    """dx [M, K] bf16 = dy [M, N] bf16 @ Ŵ, Ŵ [N, K] with one global scale."""
    return _launch(dy, packed, scale, global_scale, None, False, cfg)
