"""The NVFP4 W4A16 forward for decode-sized inputs (M ≤ 16 rows), in Gluon on mma.sync.

y [M, N] = x [M, K] @ Ŵᵀ, Ŵ the NVFP4 weight [N, K] (packed E2M1 bytes [N, K/2], e4m3 block
scales [N, K/16], fp32 global scale(s)). GPU only (sm_89+; Gluon does not run in Triton's
interpreter): the tests compile it offline and compare it against the reference on a GPU.

Why another kernel. The tensor-core kernel of `gemm.py` (Triton `tl.dot`, wgmma) is
latency-bound at decode sizes (kernels/nvfp4/NOTES.md, 2026-12-05: barrier and wgmma waits
every K step, 1.2 eligible warps per scheduler, 41-52 % of copy bandwidth). This one (with
the default STAGES = 0) has no shared memory and no barrier in its main loop: every warp
streams its own 16·RW weight rows into registers, decodes them into the mma.sync A fragment in
place, and multiplies them with the input's B fragment, loaded from global memory
(L1/L2-resident: x is at most 16 rows).
Warps never wait for each other, so occupancy hides the latency; the next K tile's weight,
scales and input are loaded one iteration ahead.

Layout (per 128 codes of K, one "chunk"; KV chunks per iteration). Lane l = 4g + t holds rows
g and g + 8 of its warp's 16-row group and, in each, the bytes 16t … 16t + 15 of every chunk:
one 16-byte load per row, words j = 0..3 (32-bit, 8 codes each). A word's 8 weights go to
the thread's own A-fragment slots, so nothing moves between threads: the reduction is over a
*virtual* order of K in which code 2j' + ν of byte j' + 2hh of word j (physical
k = 32t + 8j + 4hh + 2j' + ν) sits at virtual k = 32j + 16ν + 8j' + 2t + hh, which puts the
decoder's bf16x2 output pairs (`gemm._DECODE_WORD_ASM`) exactly on mma.sync's k-pairs of lane
t. The input is permuted the same way in registers (its fragment is x[g, 32t … 32t + 31] of
each chunk, loaded contiguously); both permutations are `convert_layout(assert_trivial=True)`,
so the compiler proves that no data moves.

With STAGES ≥ 2 the weight instead goes through a ring of that many K tiles in shared memory
(cp.async, 16 bytes per thread and row), which keeps more bytes in flight than registers allow.
Each thread reads back only what it copied itself, so its own `cp.async.wait_group` would be
enough, but Triton's barrier analysis cannot see that and puts two `bar.sync` in the loop; with
one or two warps per program they cost little. On an H200 this is 10 % faster on the 7B gate_up
shape at one row and 5 % on down (kernels/nvfp4/NOTES.md, 2026-12-06 evening).
RING_S puts the block scales through a ring of their own as well (STAGES - 1 tiles ahead instead
of one); as threads then read scales other threads copied, the loop gets a CTA barrier after the
wait and one before a slot is overwritten. 3 % faster on gate_up at one row on an H100, no gain
elsewhere (NOTES.md, 2026-12-06 night).

Split-K across programs as in `gemm._w4a16_kernel` (fp32 partials, the last arriving program
sums them in split order: deterministic), with the same per-device counter buffer.
"""
from __future__ import annotations

import torch
import triton

try:  # Gluon ships with triton >= 3.5; its API is experimental and changes between releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    AVAILABLE = True
except ImportError:  # pragma: no cover
    AVAILABLE = False

from .gemm import _DECODE_WORD_ASM, _SCALE_BIAS, _SCALE_PAIR_ASM, _counters

__all__ = ["AVAILABLE", "linear_decode", "lora_fits", "supports"]

CHUNK = 128  # codes of K per thread-group load: 4 lanes × 16 bytes of one row
SHRINK_TILES = 4  # K tiles per LoRA shrink program (LORA_SHRINK): more programs, each short


def supports(m: int, n: int, k: int, cfg: dict) -> bool:
    """Whether a config fits a shape: M ≤ 16, K a multiple of its K tile (128·KV) and N of its rows."""
    rows = 16 * cfg["RW"] * cfg["num_warps"]
    return 1 <= m <= 16 and k % (CHUNK * cfg["KV"]) == 0 and n % rows == 0


if AVAILABLE:
    _CHUNK = gl.constexpr(CHUNK)
    _SCALE_BIAS_C = gl.constexpr(_SCALE_BIAS)
    _RING_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))

    if hasattr(gl, "thread_barrier"):  # triton 3.6 (the GPU image)
        @gluon.jit
        def _cta_barrier():
            gl.thread_barrier()
    else:  # triton 3.9 renamed it
        @gluon.jit
        def _cta_barrier():
            gl.barrier()

    if hasattr(async_copy, "async_load"):  # triton 3.9
        @gluon.jit
        def _copy_to_shared(smem, ptrs):
            async_copy.async_load(smem, ptrs)
    else:  # triton 3.6
        @gluon.jit
        def _copy_to_shared(smem, ptrs):
            async_copy.async_copy_global_to_shared(smem, ptrs)

    @gluon.constexpr_function
    def _mma_layout(warps):
        return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])

    @gluon.constexpr_function
    def _words_layout(rw, warps, per_thread):
        """[16·RW·W rows, 4·per_thread cols] (32-bit words, or int16 scale pairs with per_thread
        = KV): lane 4g + t holds rows g, g + 8 of each 16-row group of its warp, columns
        per_thread·t …; the warp's groups repeat every 16·W rows (the mma layout's order)."""
        reg = [[0, 1 << b] for b in range(per_thread.bit_length() - 1)] + [[8, 0]]
        reg += [[16 * warps << b, 0] for b in range(rw.bit_length() - 1)]
        lane = [[0, per_thread], [0, 2 * per_thread], [1, 0], [2, 0], [4, 0]]
        warp = [[16 << b, 0] for b in range(warps.bit_length() - 1)]
        return gl.DistributedLinearLayout(reg, lane, warp, [], [16 * rw * warps, 4 * per_thread])

    @gluon.constexpr_function
    def _x_layout(mt, warps, kv):
        """[MT input rows, 128·KV]: lane 4g + t holds row g (and g + 8 when MT = 16) and the
        32·KV contiguous columns of lane t; every warp holds the same (the mma B operand)."""
        reg = [[0, 1 << b] for b in range((32 * kv).bit_length() - 1)] + ([[8, 0]] if mt == 16 else [])
        lane = [[0, 32 * kv], [0, 64 * kv], [1, 0], [2, 0], [4, 0]]
        warp = [[0, 0] for _ in range(warps.bit_length() - 1)]
        return gl.DistributedLinearLayout(reg, lane, warp, [], [mt, CHUNK * kv])

    @gluon.jit
    def _virtual_k(v, ROWS: gl.constexpr, KV: gl.constexpr):
        """[ROWS, 128·KV] in physical order k = 32·KV·t + 8j + 4hh + 2j' + ν → the virtual
        order 32j + 16ν + 8j' + 2t + hh (the module docstring)."""
        v = gl.reshape(v, [ROWS, 4, 4 * KV, 2, 2, 2])  # t, j, hh, j', ν
        v = gl.permute(v, [0, 2, 5, 4, 1, 3])  # j, ν, j', t, hh
        return gl.reshape(v, [ROWS, _CHUNK * KV])

    @gluon.jit
    def _decode(w, s, ROWS: gl.constexpr, KV: gl.constexpr):
        """int32 words w [ROWS, 16·KV] and their scales s (s · 2^118 as bf16x2, same shape) →
        the weights [ROWS, 128·KV] bf16 in physical K order (· 2^-8, see gemm._DECODE_ASM)."""
        o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
            _DECODE_WORD_ASM.value, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, s],
            dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
        # output 4ν + 2j' + hh is nibble ν of byte j' + 2hh
        v = gl.join(gl.join(gl.join(o0, o1), gl.join(o2, o3)), gl.join(gl.join(o4, o5), gl.join(o6, o7)))
        # [ROWS, 16·KV, hh, j', ν] → physical order within the word: 4hh + 2j' + ν
        return gl.reshape(v, [ROWS, _CHUNK * KV])

    @gluon.jit
    def _step(w, s, x, acc, ROWS: gl.constexpr, KV: gl.constexpr, MT: gl.constexpr,
              w_lay: gl.constexpr, a_op: gl.constexpr, b_op: gl.constexpr):
        """acc += one K tile: weight words w, scale pairs s, input x (their load layouts)."""
        # two block scales per int16 → each as s · 2^118 twice in a 32-bit word; then each word's own
        s0, s1 = gl.inline_asm_elementwise(_SCALE_PAIR_ASM.value, "=r,=r,h", [s],
                                           dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
        sw = gl.reshape(gl.join(gl.join(s0, s1), gl.join(s0, s1)), [ROWS, 16 * KV])  # word 4p + 2·block + copy
        sw = gl.convert_layout(sw, w_lay, assert_trivial=True)
        a = gl.convert_layout(_virtual_k(_decode(w, sw, ROWS, KV), ROWS, KV), a_op, assert_trivial=True)
        b = gl.convert_layout(gl.permute(_virtual_k(x, MT, KV), [1, 0]), b_op, assert_trivial=True)
        return mma_v2(a, b, acc)

    @gluon.constexpr_function
    def _lora_layouts(rows, mt, r, warps):
        """Load layouts of the LoRA epilogue's operands: B [rows, r] in 16-byte vectors along r,
        Tᵀ [r, mt] (contiguous along r) one value per thread; neither wider than its tensor."""
        b_lay = gl.BlockedLayout([1, 8], [32 // (r // 8), r // 8], [warps, 1], [1, 0])
        t_lay = gl.BlockedLayout([1, 1], [32 // mt, mt], [warps, 1], [0, 1])
        return b_lay, t_lay

    @gluon.jit
    def _lora_delta(n0, M, N, lt_ptr, lb0_ptr, lb1_ptr, lb2_ptr, lidx_ptr, LN1, LN2, lsb0, lsb1, lsb2, lsync_ptr,
                    ROWS: gl.constexpr, MT: gl.constexpr, LORA_R: gl.constexpr, N_LORAS: gl.constexpr,
                    mma: gl.constexpr, SHRINK: gl.constexpr):
        """The LoRA expand of output rows n0 … n0 + ROWS - 1 (kernels/nvfp4/lora.py, transposed:
        [ROWS, MT] in the accumulator's layout): Σ_r B_s[idx[m], n, r] · bf16(T[s, m, r]), one
        mma.sync per adapter slot, the tokens of other slots (and idx -1) masked out of Tᵀ.
        SHRINK: T comes from this launch's shrink programs (`_lora_shrink`): wait for slice s's
        flag (lsync[3 + s]) first; the slice's last reader resets it and its reader count
        (lsync[6 + s]) for the next launch."""
        W: gl.constexpr = gl.num_warps()
        if n0 < LN1:  # the slice of these rows (a program's rows never straddle two: the host checks)
            b_ptr = lb0_ptr
            s = 0
            start = 0
            sb = lsb0
        elif n0 < LN2:
            b_ptr = lb1_ptr
            s = 1
            start = LN1
            sb = lsb1
        else:
            b_ptr = lb2_ptr
            s = 2
            start = LN2
            sb = lsb2
        b_lay: gl.constexpr = _lora_layouts(ROWS, MT, LORA_R, W)[0]
        t_lay: gl.constexpr = _lora_layouts(ROWS, MT, LORA_R, W)[1]
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        rn = n0 - start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, b_lay))
        rr = gl.arange(0, LORA_R, layout=gl.SliceLayout(0, b_lay))
        tr = gl.arange(0, LORA_R, layout=gl.SliceLayout(1, t_lay))
        tm = gl.arange(0, MT, layout=gl.SliceLayout(0, t_lay))
        m_ok = tm < M
        idx = gl.load(lidx_ptr + tm, mask=m_ok, other=-1)
        if SHRINK:
            while gl.atomic_add(lsync_ptr + 3 + s, 0, sem="acquire", scope="gpu") == 0:
                pass
        t = gl.load(lt_ptr + s * M * LORA_R + tm[None, :] * LORA_R + tr[:, None], mask=m_ok[None, :], other=0.0,
                    cache_modifier=".cg")
        if SHRINK:
            _cta_barrier()  # every thread has T in registers before the flag may be reset
            if s == 0:
                width = LN1
            elif s == 1:
                width = LN2 - LN1
            else:
                width = N - LN2
            if gl.atomic_add(lsync_ptr + 6 + s, 1, sem="acq_rel", scope="gpu") == width // ROWS - 1:
                gl.atomic_xchg(lsync_ptr + 6 + s, 0, sem="relaxed", scope="gpu")
                gl.atomic_xchg(lsync_ptr + 3 + s, 0, sem="relaxed", scope="gpu")
        delta = gl.zeros([ROWS, MT], gl.float32, layout=mma)
        for slot in gl.static_range(N_LORAS):
            b = gl.load(b_ptr + slot * sb + rn.to(gl.int64)[:, None] * LORA_R + rr[None, :])
            ts = gl.where((idx == slot)[None, :], t, 0.0).to(gl.bfloat16)
            delta = mma_v2(gl.convert_layout(b, a_op), gl.convert_layout(ts, b_op), delta)
        return delta

    @gluon.constexpr_function
    def _shrink_layouts(bk, mt, warps):
        """Load layouts of the shrink's operands: A [16·warps rows, bk] in 16-byte vectors along K,
        xᵀ [bk, mt] in 16-byte vectors along K; neither wider than its tensor."""
        tpc = min(bk // 8, 32)
        a_lay = gl.BlockedLayout([1, 8], [32 // tpc, tpc], [warps, 1], [1, 0])
        x_lay = gl.BlockedLayout([8, 1], [tpc, 32 // tpc], [1, warps], [0, 1])
        return a_lay, x_lay

    @gluon.jit
    def _lora_shrink(s, part, kt0, kt1, x_ptr, stride_xm, M, K, la0_ptr, la1_ptr, la2_ptr, lsa0, lsa1, lsa2,
                     lidx_ptr, lt_ptr, lws_ptr, lsync_ptr, PARTS,
                     MT: gl.constexpr, BK: gl.constexpr, LORA_R: gl.constexpr, N_LORAS: gl.constexpr,
                     N_SLICES: gl.constexpr, mma: gl.constexpr):
        """A shrink program (LORA_SHRINK): T[s, m, r] = Σ_k x[m, k] · A_s[idx[m], r, k] over K tiles
        kt0 … kt1 - 1 (part `part` of PARTS for slice s), for every rank slot r, as mma.sync on
        [16·W rank rows, MT tokens] chunks (one per adapter slot, the tokens of other slots masked
        out). Partials go to lws[part, s, m, r]; the last part of slice s (counter lsync[s]) sums
        them in part order into T and raises slice s's flag lsync[3 + s], which the tile programs'
        epilogues wait for."""
        W: gl.constexpr = gl.num_warps()
        RA: gl.constexpr = 16 * W
        CHUNKS: gl.constexpr = (LORA_R + RA - 1) // RA
        if s == 0:
            a_ptr = la0_ptr
            sa = lsa0
        elif s == 1:
            a_ptr = la1_ptr
            sa = lsa1
        else:
            a_ptr = la2_ptr
            sa = lsa2
        a_lay: gl.constexpr = _shrink_layouts(BK, MT, W)[0]
        x_lay: gl.constexpr = _shrink_layouts(BK, MT, W)[1]
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        ra = gl.arange(0, RA, layout=gl.SliceLayout(1, a_lay))
        ka = gl.arange(0, BK, layout=gl.SliceLayout(0, a_lay))
        kx = gl.arange(0, BK, layout=gl.SliceLayout(1, x_lay))
        xm = gl.minimum(gl.arange(0, MT, layout=gl.SliceLayout(0, x_lay)), M - 1)
        ro = gl.arange(0, RA, layout=gl.SliceLayout(1, mma))
        mo = gl.arange(0, MT, layout=gl.SliceLayout(0, mma))
        idx = gl.load(lidx_ptr + mo, mask=mo < M, other=-1)
        for c in gl.static_range(CHUNKS):
            rows = c * RA + ra
            tsel = gl.zeros([RA, MT], gl.float32, layout=mma)
            for slot in gl.static_range(N_LORAS):
                acc = gl.zeros([RA, MT], gl.float32, layout=mma)
                for kt in range(kt0, kt1):
                    a = gl.load(a_ptr + slot * sa + rows.to(gl.int64)[:, None] * K + (kt * BK + ka)[None, :],
                                mask=(rows < LORA_R)[:, None], other=0.0)
                    xt = gl.load(x_ptr + xm.to(gl.int64)[None, :] * stride_xm + (kt * BK + kx)[:, None])
                    acc = mma_v2(gl.convert_layout(a, a_op), gl.convert_layout(xt, b_op), acc)
                tsel += gl.where((idx == slot)[None, :], acc, 0.0)
            r_o = c * RA + ro
            offs = (s * M + mo[None, :]) * LORA_R + r_o[:, None]
            gl.store(lws_ptr + part * (N_SLICES * M * LORA_R) + offs, tsel,
                     mask=(mo < M)[None, :] & (r_o < LORA_R)[:, None])
        _cta_barrier()  # every thread's partial is written before the release below
        if gl.atomic_add(lsync_ptr + s, 1, sem="acq_rel", scope="gpu") == PARTS - 1:
            for c in gl.static_range(CHUNKS):
                r_o = c * RA + ro
                offs = (s * M + mo[None, :]) * LORA_R + r_o[:, None]
                omask = (mo < M)[None, :] & (r_o < LORA_R)[:, None]
                total = gl.zeros([RA, MT], gl.float32, layout=mma)
                for sp in range(0, PARTS):
                    total += gl.load(lws_ptr + sp * (N_SLICES * M * LORA_R) + offs, mask=omask, other=0.0,
                                     cache_modifier=".cg")
                gl.store(lt_ptr + offs, total, mask=omask)
            gl.atomic_xchg(lsync_ptr + s, 0, sem="relaxed", scope="gpu")
            _cta_barrier()  # T is written by every thread before the flag goes up
            gl.atomic_xchg(lsync_ptr + 3 + s, 1, sem="release", scope="gpu")

    @gluon.jit
    def _decode_kernel(
        x_ptr, packed_ptr, scale_ptr, g_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
        M, N, K, stride_xm, stride_w, stride_s, SPLIT_K,
        lt_ptr, lb0_ptr, lb1_ptr, lb2_ptr, lidx_ptr, LN1, LN2, lsb0, lsb1, lsb2,
        la0_ptr, la1_ptr, la2_ptr, lsa0, lsa1, lsa2, lws_ptr, lsync_ptr, LQ,
        RW: gl.constexpr, KV: gl.constexpr, MT: gl.constexpr,
        HAS_BIAS: gl.constexpr, G_PER_ROW: gl.constexpr, STAGES: gl.constexpr = 0,
        RING_S: gl.constexpr = False, LORA: gl.constexpr = False, LORA_R: gl.constexpr = 16,
        N_LORAS: gl.constexpr = 1, LORA_SHRINK: gl.constexpr = 0,
    ):
        W: gl.constexpr = gl.num_warps()
        ROWS: gl.constexpr = 16 * RW * W
        BK: gl.constexpr = _CHUNK * KV
        mma: gl.constexpr = _mma_layout(W)
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        w_lay: gl.constexpr = _words_layout(RW, W, 4 * KV)
        s_lay: gl.constexpr = _words_layout(RW, W, KV)
        x_lay: gl.constexpr = _x_layout(MT, W, KV)

        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        if LORA_SHRINK > 0:
            # roles by ticket, in the order programs start: a tile program that waits for the shrink got
            # its ticket after every shrink program got theirs, so those are running or done whatever
            # order the hardware starts blocks in (the last ticket resets the counter for the next launch)
            programs = gl.num_programs(0) * gl.num_programs(1)
            ticket = gl.atomic_add(lsync_ptr + 9, 1, sem="relaxed", scope="gpu")
            if ticket == programs - 1:
                gl.atomic_xchg(lsync_ptr + 9, 0, sem="relaxed", scope="gpu")
            pid_n = ticket % gl.num_programs(0)
            pid_k = ticket // gl.num_programs(0)
        k_tiles = K // BK
        per_split = gl.cdiv(k_tiles, SPLIT_K)
        kt0 = pid_k * per_split
        kt1 = gl.minimum(kt0 + per_split, k_tiles)
        if LORA_SHRINK > 0:
            # the first LORA_SHRINK · LQ programs of each split compute the LoRA shrink: LQ per slice,
            # each over a 1 / LQ part of the split's K tiles (the tile programs are shifted past them)
            if pid_n < LORA_SHRINK * LQ:
                q = pid_n % LQ
                per_q = gl.cdiv(kt1 - kt0, LQ)
                _lora_shrink(pid_n // LQ, pid_k * LQ + q, gl.minimum(kt0 + q * per_q, kt1),
                             gl.minimum(kt0 + (q + 1) * per_q, kt1), x_ptr, stride_xm, M, K, la0_ptr, la1_ptr,
                             la2_ptr, lsa0, lsa1, lsa2, lidx_ptr, lt_ptr, lws_ptr, lsync_ptr, SPLIT_K * LQ, MT, BK,
                             LORA_R, N_LORAS, LORA_SHRINK, mma)
                return
            pid_n -= LORA_SHRINK * LQ
        first = gl.minimum(kt0, kt1 - 1)  # a split past the end (it adds zeros) still loads a real tile

        # weight words [ROWS, 16·KV] and scale pairs [ROWS, 4·KV] of the split's first K tile
        rows_w = pid_n * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, w_lay))
        cols_w = gl.arange(0, 16 * KV, layout=gl.SliceLayout(0, w_lay))
        w_ptrs = (packed_ptr.to(gl.pointer_type(gl.int32)) + rows_w.to(gl.int64)[:, None] * (stride_w // 4)
                  + (first * (BK // 8) + cols_w)[None, :])
        rows_s = pid_n * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_lay))
        cols_s = gl.arange(0, 4 * KV, layout=gl.SliceLayout(0, s_lay))
        s_ptrs = (scale_ptr.to(gl.pointer_type(gl.int16)) + rows_s.to(gl.int64)[:, None] * (stride_s // 2)
                  + (first * (BK // 32) + cols_s)[None, :])
        # input [MT, BK] of that tile; rows ≥ M repeat row M - 1 (same cache lines, no mask:
        # their products land in output columns that are never stored)
        xm = gl.minimum(gl.arange(0, MT, layout=gl.SliceLayout(1, x_lay)), M - 1)
        xk = gl.arange(0, BK, layout=gl.SliceLayout(0, x_lay))
        x_ptrs = x_ptr + xm.to(gl.int64)[:, None] * stride_xm + (first * BK + xk)[None, :]

        acc = gl.zeros([ROWS, MT], gl.float32, layout=mma)
        if STAGES == 0:
            # two K tiles per iteration in two register sets, each loaded one tile ahead of its use
            # (one set would need a copy of every prefetched register at the end of each iteration)
            w = gl.load(w_ptrs)
            s = gl.load(s_ptrs)
            x = gl.load(x_ptrs)
            for kt in range(kt0, kt1, 2):
                d1 = gl.minimum(kt + 1, kt1 - 1) - kt  # past the split's end: reload a tile, unused
                w2 = gl.load(w_ptrs + d1 * (BK // 8))
                s2 = gl.load(s_ptrs + d1 * (BK // 32))
                x2 = gl.load(x_ptrs + d1 * BK)
                acc = _step(w, s, x, acc, ROWS, KV, MT, w_lay, a_op, b_op)
                d2 = gl.minimum(kt + 2, kt1 - 1) - kt
                w = gl.load(w_ptrs + d2 * (BK // 8))
                s = gl.load(s_ptrs + d2 * (BK // 32))
                x = gl.load(x_ptrs + d2 * BK)
                if kt + 1 < kt1:
                    acc = _step(w2, s2, x2, acc, ROWS, KV, MT, w_lay, a_op, b_op)
                w_ptrs += d2 * (BK // 8)
                s_ptrs += d2 * (BK // 32)
                x_ptrs += d2 * BK
        else:
            # the weight through a ring of STAGES tiles in shared memory (cp.async): a thread copies
            # its own 16-byte vectors and reads back only those. The input (L1/L2-resident) is loaded
            # one tile ahead in registers. RING_S: the block scales go through a ring too, 4·KV bytes
            # per copy in a layout of their own, so threads read scales that other threads copied: a
            # CTA barrier after the wait and one before a slot is copied over. Otherwise they are
            # loaded one tile ahead in registers.
            ring = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS, 16 * KV], _RING_LAYOUT)
            if RING_S:
                sc_lay: gl.constexpr = gl.BlockedLayout([1, 2 * KV], [16, 2], [W, 1], [1, 0])
                s_ring = gl.allocate_shared_memory(gl.int16, [STAGES, ROWS, 4 * KV], _RING_LAYOUT)
                rows_c = pid_n * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, sc_lay))
                cols_c = gl.arange(0, 4 * KV, layout=gl.SliceLayout(0, sc_lay))
                sc_ptrs = (scale_ptr.to(gl.pointer_type(gl.int16)) + rows_c.to(gl.int64)[:, None] * (stride_s // 2)
                           + (first * (BK // 32) + cols_c)[None, :])
            n_kt = kt1 - kt0
            for i in gl.static_range(STAGES - 1):
                t = gl.maximum(gl.minimum(i, n_kt - 1), 0)
                _copy_to_shared(ring.index(i), w_ptrs + t * (BK // 8))
                if RING_S:
                    _copy_to_shared(s_ring.index(i), sc_ptrs + t * (BK // 32))
                async_copy.commit_group()
            if not RING_S:
                s = gl.load(s_ptrs)
            x = gl.load(x_ptrs)
            for i in range(0, n_kt):
                slot = (i + STAGES - 1) % STAGES
                ahead = gl.minimum(i + STAGES - 1, n_kt - 1)
                if RING_S:
                    _cta_barrier()  # every thread has read the scales of slot `slot` (tile i - 1)
                    _copy_to_shared(s_ring.index(slot), sc_ptrs + ahead * (BK // 32))
                _copy_to_shared(ring.index(slot), w_ptrs + ahead * (BK // 8))
                async_copy.commit_group()
                nxt = gl.minimum(i + 1, n_kt - 1)
                if not RING_S:
                    s_next = gl.load(s_ptrs + nxt * (BK // 32))
                x_next = gl.load(x_ptrs + nxt * BK)
                async_copy.wait_group(STAGES - 1)  # this thread's copies of tile i have landed
                if RING_S:
                    _cta_barrier()  # ... and every other thread's
                    s = s_ring.index(i % STAGES).load(s_lay)
                w = ring.index(i % STAGES).load(w_lay)
                acc = _step(w, s, x, acc, ROWS, KV, MT, w_lay, a_op, b_op)
                if not RING_S:
                    s = s_next
                x = x_next
            async_copy.wait_group(0)

        acc = acc * _SCALE_BIAS_C
        rn = pid_n * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
        rm = gl.arange(0, MT, layout=gl.SliceLayout(0, mma))
        out_offs = rm.to(gl.int64)[None, :] * N + rn[:, None]
        out_mask = (rm < M)[None, :] & (rn >= 0)[:, None]
        if G_PER_ROW:
            g = gl.load(g_ptr + rn)[:, None]
        else:
            g = gl.load(g_ptr)
        if SPLIT_K == 1:
            y = gl.div_rn(acc, g)
            if HAS_BIAS:
                y += gl.load(bias_ptr + rn).to(gl.float32)[:, None]
            if LORA:
                y += _lora_delta(pid_n * ROWS, M, N, lt_ptr, lb0_ptr, lb1_ptr, lb2_ptr, lidx_ptr, LN1, LN2,
                                 lsb0, lsb1, lsb2, lsync_ptr, ROWS, MT, LORA_R, N_LORAS, mma, LORA_SHRINK > 0)
            gl.store(out_ptr + out_offs, y.to(gl.bfloat16), mask=out_mask)
        else:
            gl.store(ws_ptr + pid_k * (M * N) + out_offs, acc, mask=out_mask)
            _cta_barrier()  # every thread's partial is written before the release below
            arrived = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:  # the last split of these rows sums the partials in split order
                total = gl.zeros([ROWS, MT], gl.float32, layout=mma)
                for sp in range(0, SPLIT_K):
                    total += gl.load(ws_ptr + sp * (M * N) + out_offs, mask=out_mask, other=0.0,
                                     cache_modifier=".cg")
                y = gl.div_rn(total, g)
                if HAS_BIAS:
                    y += gl.load(bias_ptr + rn).to(gl.float32)[:, None]
                if LORA:
                    y += _lora_delta(pid_n * ROWS, M, N, lt_ptr, lb0_ptr, lb1_ptr, lb2_ptr, lidx_ptr, LN1, LN2,
                                     lsb0, lsb1, lsb2, lsync_ptr, ROWS, MT, LORA_R, N_LORAS, mma, LORA_SHRINK > 0)
                gl.store(out_ptr + out_offs, y.to(gl.bfloat16), mask=out_mask)
                gl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # ready for the next launch


def lora_fits(m: int, cfg: dict, slices: list[int], rank_slots: int, shrink: bool = False) -> bool:
    """Whether the decode kernel can add a LoRA in its epilogue (kernels/nvfp4/lora.py): its
    rows per program never straddle two output slices, and the epilogue's load layouts fit the
    rank slots (a power of two, 16-256) and the rows; with `shrink` also the shrink programs'
    (`_lora_shrink`: 2·num_warps ≤ input rows rounded up to 8 or 16, with 128-code K tiles)."""
    rows, warps = 16 * cfg["RW"] * cfg["num_warps"], cfg["num_warps"]
    mt = 8 if m <= 8 else 16
    fits = (all(n % rows == 0 for n in slices) and 16 <= rank_slots <= 256
            and not rank_slots & (rank_slots - 1) and (32 // mt) * warps <= rank_slots)
    tpc = min(CHUNK * cfg["KV"] // 8, 32)
    return fits and (not shrink or (32 // tpc) * warps <= mt)


def linear_decode(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                  bias: torch.Tensor | None, cfg: dict, lora: tuple | None = None) -> torch.Tensor:
    """y [M, N] bf16 = x [M, K] bf16 @ Ŵᵀ (+ bias) with config keys RW (16-row groups per warp),
    KV (128-code chunks per K step), SPLIT_K, num_warps, STAGES (0: the weight prefetched one
    tile ahead in registers; ≥ 2: through a ring of that many tiles in shared memory) and RING_S
    (with STAGES ≥ 2: the block scales through a ring as well, 4-byte copies). The caller
    (`gemm.linear_w4a16`) has checked dtypes and shapes; x is 2-D with unit stride along K, packed
    rows 16-byte aligned. `lora` = (T, [B_s], token slots, slices, [A_s] or None) adds a LoRA's
    expand in the epilogue (kernels/nvfp4/lora.py; the caller checked them with
    `lora.check_lora_args` and `lora_fits`). With [A_s] (vLLM's `lora_a_stacked`,
    [max_loras, 1, r, K] bf16) the launch also computes T (written into the given tensor): per
    slice and split, ⌈K tiles of the split / SHRINK_TILES⌉ shrink programs ahead of the tile
    programs, whose epilogues wait for T. Programs take their roles from a ticket counter in the
    order they start, so every shrink program has started before any tile program can wait. The
    launch needs the shared counter buffer zeroed, as every kernel leaves it."""
    m, k = x.shape
    n = packed.shape[0]
    if not x.is_cuda:
        raise ValueError("the decode kernel (Gluon) runs on CUDA GPUs only; Triton's interpreter does not run Gluon")
    if not AVAILABLE or not supports(m, n, k, cfg):
        raise ValueError(f"the decode kernel needs Gluon, 1 <= M <= 16, K % {CHUNK * cfg['KV']} == 0 and "
                         f"N % {16 * cfg['RW'] * cfg['num_warps']} == 0 (got M={m}, N={n}, K={k})")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16 or packed.stride(0) % 16 or packed.data_ptr() % 16:
        raise ValueError("the decode kernel reads x and the packed weight in 16-byte vectors: both need "
                         "16-byte aligned rows")
    if scale.stride(0) % 2 or scale.data_ptr() % 2:
        raise ValueError("the decode kernel reads the block scales in pairs: their rows need an even stride")
    ring_s = bool(cfg.get("RING_S", False))
    if ring_s and (cfg.get("STAGES", 0) < 2 or scale.stride(0) % 4 or scale.data_ptr() % 4):
        raise ValueError("RING_S copies the block scales in 4-byte vectors through the shared-memory ring: it "
                         f"needs STAGES >= 2 and 4-byte aligned scale rows (got STAGES={cfg.get('STAGES', 0)}, "
                         f"row stride {scale.stride(0)} B, address % 4 = {scale.data_ptr() % 4})")
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    split = cfg.get("SPLIT_K", 1)
    tiles = n // (16 * cfg["RW"] * cfg["num_warps"])
    ws = torch.empty(split * m * n, dtype=torch.float32, device=x.device) if split > 1 else out
    g = global_scale.reshape(-1)
    counters = _counters(x.device, tiles + 16)
    shrink_programs = 0
    if lora is not None:
        from .lora import check_lora_a, slice_args
        t, bs, idx, slices, lora_a = lora
        r = t.shape[-1]
        if not lora_fits(m, cfg, slices, r, shrink=lora_a is not None):
            raise ValueError(f"the decode kernel's LoRA epilogue does not fit slices {list(slices)} with rank slots "
                             f"{r} and {16 * cfg['RW'] * cfg['num_warps']} rows per program")
        b0, b1, b2, n1, n2, sb0, sb1, sb2 = slice_args(bs, slices)
        lora_args = (t, b0, b1, b2, idx, n1, n2, sb0, sb1, sb2)
        lora_consts = dict(LORA=True, LORA_R=r, N_LORAS=bs[0].shape[0])
        if lora_a is not None:
            check_lora_a(lora_a, r, k)
            if lora_a[0].shape[0] != bs[0].shape[0]:
                raise ValueError(f"LoRA A has {lora_a[0].shape[0]} adapter slots, B {bs[0].shape[0]}")
            a3 = list(lora_a) + [lora_a[-1]] * (3 - len(lora_a))
            # parts per slice and split: at most SHRINK_TILES K tiles each (a part's loop has no prefetch)
            per_split = triton.cdiv(k // (CHUNK * cfg["KV"]), split)
            parts = triton.cdiv(per_split, SHRINK_TILES)
            shrink_programs = len(slices) * parts
            lws = torch.empty(split * shrink_programs * m * r, dtype=torch.float32, device=x.device)
            lora_args += (*a3, *(a.stride(0) for a in a3), lws, counters[tiles:], parts)
            lora_consts["LORA_SHRINK"] = len(slices)
        else:
            lora_args += (g, g, g, 0, 0, 0, g, counters[tiles:], 1)
    else:
        lora_args, lora_consts = (g, g, g, g, g, n, n, 0, 0, 0, g, g, g, 0, 0, 0, g, counters[tiles:], 1), {}
    _decode_kernel[(tiles + shrink_programs, split)](
        x, packed, scale.view(torch.uint8), g, bias if bias is not None else g, out, ws,
        counters, m, n, k, x.stride(0), packed.stride(0), scale.stride(0), split, *lora_args,
        RW=cfg["RW"], KV=cfg["KV"], MT=8 if m <= 8 else 16, HAS_BIAS=bias is not None, G_PER_ROW=g.numel() > 1,
        STAGES=cfg.get("STAGES", 0), RING_S=ring_s, **lora_consts,
        num_warps=cfg["num_warps"],
    )
    return out
