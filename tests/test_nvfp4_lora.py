"""The LoRA shrink and expand of the fused serving op (kernels/nvfp4/lora.py, the decode kernel's
epilogue, ``torch.ops.qerl.nvfp4_linear_lora``) against plain torch.

The Triton kernels run on CPU under TRITON_INTERPRET=1 in a fresh process (see
tests/test_nvfp4_gemm.py); the Gluon decode kernel's epilogue is compiled for sm_90a without a
GPU here and checked on a GPU by benchmarks/nvfp4_lora_check.py.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

torch.set_num_threads(1)

TOL = 1e-2  # ‖out − ref‖ / ‖ref‖: bf16 outputs


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def lora_operands(slices: list[int], slots: int, m: int, r: int, seed: int, pad: int = 0):
    """T [S, m, r] fp32, B_s [slots, 1, N_s (+ pad rows, as vLLM's max-size buffers), r] bf16 and
    token slots in -1 … slots - 1 (every value present when m allows)."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(len(slices), m, r, generator=gen)
    bs = [torch.randn(slots, 1, n + pad, r, generator=gen).bfloat16() for n in slices]
    idx = (torch.arange(m) % (slots + 1) - 1).int()[torch.randperm(m, generator=gen)]
    return t, bs, idx


def test_reference_is_the_per_token_definition():
    from kernels.nvfp4.lora import lora_expand_reference

    slices = [32, 16, 16]
    t, bs, idx = lora_operands(slices, 2, 7, 16, seed=1, pad=8)
    y = torch.randn(7, 64).bfloat16()
    want = y.double().clone()
    for m in range(7):
        if idx[m] < 0:
            continue
        col = 0
        for s, n in enumerate(slices):
            b = bs[s][int(idx[m]), 0, :n].double()
            want[m, col:col + n] += b @ t[s, m].bfloat16().double()
            col += n
    out = lora_expand_reference(y, t, bs, idx, slices)
    assert rel(out, want) < 4e-3
    assert torch.equal(out[idx < 0], y[idx < 0])  # tokens without an adapter are left as they are

    from kernels.nvfp4.lora import lora_shrink_reference

    a_s = [torch.randn(2, 1, 16, 48).bfloat16() for _ in slices]
    x = torch.randn(7, 48).bfloat16()
    t = lora_shrink_reference(x, a_s, idx.long())  # int64 slots, as vLLM's _token_lora_indices
    for s, a in enumerate(a_s):
        for m in range(7):
            row = (a[int(idx[m]), 0].double() @ x[m].double()) if idx[m] >= 0 else torch.zeros(16, dtype=torch.double)
            assert torch.allclose(t[s, m].double(), row, rtol=1e-5, atol=1e-5), (s, m)


def test_decode_lora_epilogue_fits_only_what_its_layouts_cover():
    from kernels.nvfp4.decode_gemm import lora_fits

    cfg = {"RW": 1, "KV": 1, "num_warps": 4}  # 64 rows per program
    assert lora_fits(1, cfg, [3584, 512, 512], 32, shrink=True)
    assert not lora_fits(1, cfg, [96, 32], 32)  # a program's rows would straddle two slices
    assert not lora_fits(1, cfg, [3584], 24) and not lora_fits(1, cfg, [3584], 512)  # rank slots
    wide = {"RW": 1, "KV": 1, "num_warps": 8}  # Tᵀ's load layout needs (32 / 8 tokens) · 8 warps <= r
    assert not lora_fits(1, wide, [3584], 16) and lora_fits(1, wide, [3584], 32)
    assert not lora_fits(1, wide, [3584], 32, shrink=True)  # the shrink's xᵀ layout: 2 · 8 warps > 8 tokens
    assert lora_fits(9, wide, [3584], 32, shrink=True)  # 16 tokens


def test_bad_lora_operands_raise():
    from kernels.nvfp4.lora import check_lora_args

    t, bs, idx = lora_operands([32, 32], 1, 4, 16, seed=2)
    check_lora_args(4, 64, t, bs, idx, [32, 32])
    with pytest.raises(ValueError, match="do not cover 48"):
        check_lora_args(4, 48, t, bs, idx, [32, 32])
    with pytest.raises(ValueError, match="contiguous fp32"):
        check_lora_args(4, 64, t.bfloat16(), bs, idx, [32, 32])
    with pytest.raises(ValueError, match="power of two"):
        check_lora_args(4, 64, t[..., :12].contiguous(), [b[..., :12].contiguous() for b in bs], idx, [32, 32])
    with pytest.raises(ValueError, match="LoRA B"):
        check_lora_args(4, 64, t, [bs[0], bs[1][:, :, :16]], idx, [32, 32])
    with pytest.raises(ValueError, match="token mapping"):
        check_lora_args(4, 64, t, bs, idx[:3], [32, 32])


def test_lora_kernels_in_interpreter():
    from tests.conftest import interpreter_report

    report = interpreter_report(__file__, timeout=600)
    assert report["interpreted"] is True
    assert report["failures"] == [], report["failures"]
    assert report["checks"] >= 20, report
    print(f"{report['checks']} interpreter checks, worst rel. error {report['worst']:.2e}")


def test_decode_kernel_lora_epilogue_compiles_on_hopper():
    """Compiled for sm_90a without a GPU: the LoRA epilogue leaves the decode kernel's K loop as
    it was (same SASS count, no spills) and adds one mma.sync chain per adapter slot at each of
    its two stores (split-K and not); the shrink programs compile beside it without spills."""
    from tests.test_nvfp4_gemm import _ptx_reports

    plain = {"DECODE": True, "RW": 1, "KV": 1, "num_warps": 4}
    ring = {"DECODE": True, "RW": 1, "KV": 1, "num_warps": 1, "STAGES": 3, "RING_S": True}
    cfgs = [plain, dict(plain, LORA=True, LORA_R=32), dict(plain, MT=16, LORA=True, LORA_R=16, N_LORAS=2),
            ring, dict(ring, LORA=True, LORA_R=64), dict(plain, LORA=True, LORA_R=32, LORA_SHRINK=3),
            dict(ring, LORA=True, LORA_R=32, LORA_SHRINK=2)]
    base, lora, lora16, ring_base, ring_lora, *shrinks = _ptx_reports(*cfgs)
    # the shrink programs (LORA_SHRINK) share the kernel but not its K loop. Their registers count for
    # every program: the 1-warp ring config (gate_up at one row) goes from ~79 to ~120 (NOTES.md)
    for r, b in zip(shrinks, (base, ring_base)):
        mem = r["memory_instructions"]
        assert r["spill_store_bytes"] == 0 and r["mma_sync"] > b["mma_sync"], r
        assert r["sass_loop_instructions"] <= b["sass_loop_instructions"] + 8, (r, b)
        assert r["registers"] <= 128, r
        # the flag protocol: T read through L2 after an acquire load of the slice's flag
        assert mem.get("ld.global.gpu.acquire.b32", 0) >= 1 and mem.get("ld.global.cg.b32", 0) >= 1, r
    for r, b in ((lora, base), (ring_lora, ring_base)):
        assert r["spill_store_bytes"] == 0, r
        assert r["sass_loop_instructions"] == b["sass_loop_instructions"], (r, b)
        # [16 rows, r] × [r, 8 tokens] per warp: r / 16 mma.sync, at both stores
        assert r["mma_sync"] == b["mma_sync"] + 2 * r["config"]["LORA_R"] // 16, (r, b)
    assert lora16["spill_store_bytes"] == 0 and lora16["mma_sync"] > lora["mma_sync"], lora16


def _interpreter_check() -> dict:
    from triton.runtime.interpreter import InterpretedFunction

    from kernels.nvfp4 import reference, serving
    from kernels.nvfp4.lora import (_lora_expand_kernel, lora_expand_, lora_expand_reference, lora_shrink,
                                    lora_shrink_reference)

    failures: list[str] = []
    checks, worst = 0, 0.0

    def expect(tag, out, want):
        nonlocal checks, worst
        checks += 1
        if out.dtype != want.dtype or out.shape != want.shape or not bool(torch.isfinite(out).all()):
            failures.append(f"{tag}: got {out.dtype} {tuple(out.shape)}, want {want.dtype} {tuple(want.shape)}")
            return
        e = rel(out, want)
        worst = max(worst, e)
        if e > TOL:
            failures.append(f"{tag}: rel err {e:.3e}")

    # the expand alone: one to three slices, one or two adapter slots, rank slots 16 / 32, tokens
    # without an adapter, more tokens than one program's rows
    seed = 0
    for slices in ([48], [32, 32], [64, 16, 16]):
        for slots in (1, 2):
            for m, r in ((1, 16), (5, 32), (37, 16)):
                seed += 1
                t, bs, idx = lora_operands(slices, slots, m, r, seed, pad=16)
                y = torch.randn(m, sum(slices), generator=torch.Generator().manual_seed(seed)).bfloat16()
                want = lora_expand_reference(y, t, bs, idx, slices)
                expect(f"expand {slices} slots={slots} m={m} r={r}", lora_expand_(y.clone(), t, bs, idx, slices),
                       want)
    # int64 slots (vLLM's _token_lora_indices), none of them with an adapter
    t, bs, idx = lora_operands([32, 32], 2, 5, 16, seed=77)
    y = torch.randn(5, 64).bfloat16()
    none = torch.full((5,), -1, dtype=torch.int64)
    expect("expand, int64, no adapter", lora_expand_(y.clone(), t, bs, none, [32, 32]), y)
    expect("expand, int64", lora_expand_(y.clone(), t, bs, idx.long(), [32, 32]),
           lora_expand_reference(y, t, bs, idx, [32, 32]))
    # a slice width no tile divides: the reference path, same result
    t, bs, idx = lora_operands([24, 8], 1, 3, 16, seed=99)
    y = torch.randn(3, 32).bfloat16()
    expect("expand, no common tile", lora_expand_(y.clone(), t, bs, idx, [24, 8]),
           lora_expand_reference(y, t, bs, idx, [24, 8]))

    # the serving op: GEMV (M = 1), tensor-core kernel (M ≤ 64), dequantize + matmul (M > 64),
    # each followed by the expand (the decode kernel's epilogue is GPU only)
    gen = torch.Generator().manual_seed(5)
    slices, k = [64, 32, 32], 128
    w = (torch.randn(sum(slices), k, generator=gen) * 0.5).bfloat16()
    q = reference.quantize(w, reference.global_scale(w))
    w_hat = reference.dequantize(*q, torch.float32)
    for m in (1, 9, 70):
        t, bs, idx = lora_operands(slices, 2, m, 32, seed=m)
        x = torch.randn(m, k, generator=gen).bfloat16()
        bias = torch.randn(sum(slices), generator=gen).bfloat16()
        base = (x.float() @ w_hat.T + bias.float()).bfloat16()
        want = lora_expand_reference(base, t, bs, idx, slices)
        g = q[2].reshape(1).expand(sum(slices)).contiguous()
        out = torch.ops.qerl.nvfp4_linear_lora(x, q[0], q[1], g, bias, t, [], bs, idx, slices)
        expect(f"serving op m={m}, T given", out, want)
        # without T: the op runs the shrink too
        a_s = [torch.randn(2, 1, 32, k, generator=gen).bfloat16() for _ in slices]
        t_want = lora_shrink_reference(x, a_s, idx)
        expect(f"shrink m={m}", lora_shrink(x, a_s, idx), t_want)
        out = torch.ops.qerl.nvfp4_linear_lora(x, q[0], q[1], g, bias, None, a_s, bs, idx, slices)
        expect(f"serving op m={m}, shrink", out, lora_expand_reference(base, t_want, bs, idx, slices))
    return {"interpreted": isinstance(_lora_expand_kernel, InterpretedFunction) and serving is not None,
            "checks": checks, "failures": failures, "worst": worst}


if __name__ == "__main__" and sys.argv[1:] == ["--interpreter-check"]:
    print(json.dumps(_interpreter_check()))
