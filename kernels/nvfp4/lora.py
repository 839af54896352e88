"""LoRA's shrink and expand for the fused serving op, beside their plain-torch references.

vLLM applies a LoRA to a Linear layer in two kernel launches after the base GEMM (plus a fill
that zeroes T): a shrink T[s] = x · A_s[l]ᵀ (fp32 [slices, M, r], one slice per fused output:
q/k/v or gate/up) and an expand y[:, slice s] += T[s] · B_s[l]ᵀ, with l = the adapter slot of
each token (-1: none). The ``fused`` rollout backend does both inside its own GEMM's launch
where the Gluon decode kernel serves the layer (M ≤ 8 rows on the 7B shapes: `decode_gemm`,
shrink programs ahead of the tile programs, the expand in the epilogue), which saves three
launches per Linear (336 per decode step of a 7B model). Where another kernel serves the layer,
these Triton kernels do the same work around it as vLLM's would: `lora_shrink` into a zeroed
T, the GEMM, `lora_expand_` (as many launches as vLLM's path).

    T[s, m, r] = Σ_k x[m, k] · A_s[idx[m], 0, r, k]                    (0 where idx[m] < 0)
    y[m, n] += Σ_r bf16(T[s(n), m, r]) · B_s(n)[idx[m], 0, n − start_s(n), r]   (idx[m] ≥ 0)

T is fp32 and rounded to bf16 before the expand's product (as vLLM's expand does); the expand
sums in fp32, adds to y in fp32 and rounds once. A_s and B_s are vLLM's `lora_a_stacked[s]`
[max_loras, 1, r, K] and `lora_b_stacked[s]` [max_loras, 1, N_s, r], bf16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm import INTERPRET

__all__ = ["lora_expand_", "lora_expand_reference", "lora_shrink", "lora_shrink_reference", "block_n",
           "check_lora_a", "check_lora_args", "slice_args", "MAX_SLICES"]

MAX_SLICES = 3  # q/k/v


def lora_expand_reference(y: torch.Tensor, t: torch.Tensor, bs: list[torch.Tensor], idx: torch.Tensor,
                          slices: list[int]) -> torch.Tensor:
    """y + the LoRA delta, as a new tensor (y [M, ΣN_s] bf16, t [S, M, r] fp32, idx [M] int).
    No data-dependent branch, so it can be captured in a CUDA graph (`lora_expand_`'s fallback)."""
    out = y.float()
    start = 0
    for s, (b, n_s) in enumerate(zip(bs, slices)):
        for slot in range(b.shape[0]):
            delta = t[s].to(b.dtype).float() @ b[slot, 0, :n_s].float().T
            out[:, start:start + n_s] += delta * (idx.long() == slot).float()[:, None]
        start += n_s
    return out.to(y.dtype)


def lora_shrink_reference(x: torch.Tensor, a_s: list[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """T [S, M, r] fp32 for x [M, K] bf16 (fp32 products of the bf16 values)."""
    m, r = x.shape[0], a_s[0].shape[2]
    t = torch.zeros(len(a_s), m, r, dtype=torch.float32, device=x.device)
    for s, a in enumerate(a_s):
        for slot in range(a.shape[0]):
            t[s] += (x.float() @ a[slot, 0].float().T) * (idx.long() == slot).float()[:, None]
    return t


def block_n(slices: list[int]) -> int:
    """The widest output tile (≤ 128) that never straddles two slices; 0 if there is none."""
    return next((bn for bn in (128, 64, 32, 16) if all(n % bn == 0 for n in slices)), 0)


def check_lora_args(m: int, n: int, t: torch.Tensor, bs: list[torch.Tensor], idx: torch.Tensor,
                    slices: list[int]) -> None:
    """Raise ValueError unless the LoRA operands fit an [m, n] output and each other (what both
    kernels assume)."""
    if not 1 <= len(bs) == len(slices) <= MAX_SLICES or sum(slices) != n:
        raise ValueError(f"LoRA slices {list(slices)} ({len(bs)} B tensors) do not cover {n} output columns "
                         f"(1 to {MAX_SLICES} slices)")
    r = t.shape[-1]
    if t.dtype != torch.float32 or tuple(t.shape) != (len(bs), m, r) or not t.is_contiguous():
        raise ValueError(f"LoRA shrink output must be contiguous fp32 [{len(bs)}, {m}, r], got {t.dtype} "
                         f"{tuple(t.shape)}")
    if r < 16 or r & (r - 1):
        raise ValueError(f"LoRA rank slots must be a power of two >= 16 for the fused expand, got {r}")
    for b, n_s in zip(bs, slices):
        if (b.dtype != torch.bfloat16 or b.dim() != 4 or b.shape[1] != 1 or b.shape[2] < n_s or b.shape[3] != r
                or not b.is_contiguous() or b.shape[0] != bs[0].shape[0]):
            raise ValueError(f"LoRA B must be contiguous bf16 [max_loras, 1, >= {n_s}, {r}] (the same max_loras "
                             f"for every slice), got {b.dtype} {tuple(b.shape)}")
    if idx.shape != (m,) or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"LoRA token mapping must be int32/int64 [{m}], got {idx.dtype} {tuple(idx.shape)}")


def check_lora_a(a_s: list[torch.Tensor], r: int, k: int) -> None:
    """Raise ValueError unless every A_s is contiguous bf16 [max_loras, 1, r, k], one max_loras."""
    for a in a_s:
        if a.dtype != torch.bfloat16 or a.dim() != 4 or tuple(a.shape[1:]) != (1, r, k) or not a.is_contiguous() \
                or a.shape[0] != a_s[0].shape[0]:
            raise ValueError(f"LoRA A must be contiguous bf16 [max_loras, 1, {r}, {k}] (the same max_loras for every "
                             f"slice), got {a.dtype} {tuple(a.shape)}")


def slice_args(bs: list[torch.Tensor], slices: list[int]) -> tuple:
    """(B pointers ×3, slice ends N1 N2, per-slot strides ×3) for the kernels: missing slices
    repeat the last one and end at N."""
    n = sum(slices)
    ends = [sum(slices[:i + 1]) for i in range(len(slices))] + [n] * (MAX_SLICES - len(slices))
    b3 = list(bs) + [bs[-1]] * (MAX_SLICES - len(bs))
    strides = [b.stride(0) for b in b3]
    return (*b3, ends[0], ends[1], *strides)


@triton.jit
def _lora_expand_kernel(y_ptr, t_ptr, b0_ptr, b1_ptr, b2_ptr, idx_ptr, M, N1, N2, sb0, sb1, sb2, stride_y,
                        R: tl.constexpr, N_LORAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BF16_DOT: tl.constexpr):
    pid_m = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    # the slice of this tile (tiles never straddle two: block_n)
    if n0 < N1:
        b_ptr = b0_ptr
        s = 0
        start = 0
        sb = sb0
    elif n0 < N2:
        b_ptr = b1_ptr
        s = 1
        start = N1
        sb = sb1
    else:
        b_ptr = b2_ptr
        s = 2
        start = N2
        sb = sb2
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, R)
    m_ok = rm < M
    idx = tl.load(idx_ptr + rm, mask=m_ok, other=-1)
    t = tl.load(t_ptr + s * M * R + rm[:, None] * R + rr[None, :], mask=m_ok[:, None], other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for slot in tl.static_range(N_LORAS):
        b = tl.load(b_ptr + slot * sb + (rn - start)[None, :].to(tl.int64) * R + rr[:, None])  # [R, BLOCK_N]
        ts = tl.where((idx == slot)[:, None], t, 0.0).to(tl.bfloat16)
        if BF16_DOT:
            acc += tl.dot(ts, b)
        else:  # Triton's CPU interpreter gets bf16 tl.dot wrong: the same products in fp32 (exact)
            acc += tl.dot(ts.to(tl.float32), b.to(tl.float32))
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_y + rn[None, :]
    y = tl.load(y_ptrs, mask=m_ok[:, None], other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=m_ok[:, None])


@triton.jit
def _lora_shrink_kernel(x_ptr, a0_ptr, a1_ptr, a2_ptr, idx_ptr, t_ptr, M, K, stride_x, sa0, sa1, sa2, K_SPLIT,
                        R: tl.constexpr, N_LORAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                        BF16_DOT: tl.constexpr):
    pid_m = tl.program_id(0)
    s = tl.program_id(1)
    k0 = tl.program_id(2) * K_SPLIT
    if s == 0:
        a_ptr = a0_ptr
        sa = sa0
    elif s == 1:
        a_ptr = a1_ptr
        sa = sa1
    else:
        a_ptr = a2_ptr
        sa = sa2
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rr = tl.arange(0, R)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    idx = tl.load(idx_ptr + rm, mask=m_ok, other=-1)
    t = tl.zeros([BLOCK_M, R], tl.float32)
    for slot in tl.static_range(N_LORAS):
        acc = tl.zeros([BLOCK_M, R], tl.float32)
        for kk in range(k0, tl.minimum(k0 + K_SPLIT, K), BLOCK_K):
            k_ok = kk + rk < K
            x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + (kk + rk)[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_ptr + slot * sa + rr[None, :].to(tl.int64) * K + (kk + rk)[:, None],
                        mask=k_ok[:, None], other=0.0)  # [BLOCK_K, R]
            if BF16_DOT:
                acc += tl.dot(x, a)
            else:  # the CPU interpreter: the same products in fp32 (exact)
                acc += tl.dot(x.to(tl.float32), a.to(tl.float32))
        t += tl.where((idx == slot)[:, None], acc, 0.0)
    tl.atomic_add(t_ptr + s * M * R + rm[:, None] * R + rr[None, :], t, mask=m_ok[:, None])


def lora_shrink(x: torch.Tensor, a_s: list[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """T [S, M, r] fp32 (`lora_shrink_reference`): a zeroed T, then one launch of programs over
    (16-64 rows, slice, K split) adding their partial sums atomically. x [M, K] bf16 row-major."""
    m, k = x.shape
    r = a_s[0].shape[2]
    check_lora_a(a_s, r, k)
    if not 1 <= len(a_s) <= MAX_SLICES or r < 16 or r & (r - 1) or x.stride(1) != 1:
        raise ValueError(f"lora_shrink: 1-{MAX_SLICES} slices, rank slots a power of two >= 16 and a row-major "
                         f"input, got {len(a_s)} slices, rank slots {r}, input strides {x.stride()}")
    t = torch.zeros(len(a_s), m, r, dtype=torch.float32, device=x.device)
    if m == 0:
        return t
    bm, bk = (16 if m <= 16 else 32 if m <= 32 else 64), 64
    split = max(1, min(8, k // 512))
    k_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    a3 = list(a_s) + [a_s[-1]] * (MAX_SLICES - len(a_s))
    _lora_shrink_kernel[(triton.cdiv(m, bm), len(a_s), triton.cdiv(k, k_split))](
        x, *a3, idx, t, m, k, x.stride(0), *(a.stride(0) for a in a3), k_split,
        R=r, N_LORAS=a_s[0].shape[0], BLOCK_M=bm, BLOCK_K=bk, BF16_DOT=not INTERPRET, num_warps=4)
    return t


def lora_expand_(y: torch.Tensor, t: torch.Tensor, bs: list[torch.Tensor], idx: torch.Tensor,
                 slices: list[int]) -> torch.Tensor:
    """Add the LoRA delta to y in place (one launch) and return it. y [M, N] bf16, row-major."""
    m, n = y.shape
    check_lora_args(m, n, t, bs, idx, slices)
    bn = block_n(slices)
    if m == 0:
        return y
    if not bn or y.stride(1) != 1:
        y.copy_(lora_expand_reference(y, t, bs, idx, slices))
        return y
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    b0, b1, b2, n1, n2, sb0, sb1, sb2 = slice_args(bs, slices)
    _lora_expand_kernel[(triton.cdiv(m, bm), n // bn)](
        y, t, b0, b1, b2, idx, m, n1, n2, sb0, sb1, sb2, y.stride(0),
        R=t.shape[-1], N_LORAS=bs[0].shape[0], BLOCK_M=bm, BLOCK_N=bn, BF16_DOT=not INTERPRET, num_warps=4)
    return y
