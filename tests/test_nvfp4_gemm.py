"""W4A16 GEMMs on NVFP4 weights (kernels.nvfp4.gemm) against the plain-torch reference.

The Triton kernels run on CPU under TRITON_INTERPRET=1 in a fresh process (triton reads the
variable when a kernel is decorated, so it must be set before kernels.nvfp4.gemm is first
imported, which this process may already have done). Shapes are tiny: the interpreter is
slow. Input checks and the reference functions run in-process.
"""
from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kernels.nvfp4 import reference as ref  # noqa: E402

torch.set_num_threads(1)

TOL = 1e-2  # ‖out − ref‖ / ‖ref‖, bf16 output and a different accumulation order


def make_weight(n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * (1 + torch.rand(n, k // 16, 1, generator=gen) * 4) \
        .expand(n, k // 16, 16).reshape(n, k)
    w = w.bfloat16()
    return ref.quantize(w, ref.global_scale(w))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------- in-process

def test_reference_functions_match_float64():
    from kernels.nvfp4.gemm import reference_grad_input, reference_linear

    q = make_weight(48, 64, 1)
    w64 = ref.dequantize(*q, dtype=torch.float32).double()
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    dy = torch.randn(7, 48, generator=torch.Generator().manual_seed(3)).bfloat16()
    bias = torch.randn(48).bfloat16()
    y = reference_linear(x, *q, bias=bias)
    assert y.dtype == torch.bfloat16 and y.shape == (7, 48)
    assert rel(y, x.double() @ w64.t() + bias.double()) < TOL
    dx = reference_grad_input(dy, *q)
    assert dx.dtype == torch.bfloat16 and dx.shape == (7, 64)
    assert rel(dx, dy.double() @ w64) < TOL


def test_bad_inputs_raise():
    from kernels.nvfp4.gemm import grad_input_w4a16, linear_w4a16

    q = make_weight(16, 32, 0)
    x = torch.randn(3, 32).bfloat16()
    dy = torch.randn(3, 16).bfloat16()
    with pytest.raises(ValueError, match="bf16"):
        linear_w4a16(x.float(), *q)
    with pytest.raises(ValueError, match="bf16"):
        grad_input_w4a16(dy.half(), *q)
    with pytest.raises(ValueError, match="last dim"):
        linear_w4a16(x[:, :16], *q)
    with pytest.raises(ValueError, match="last dim"):
        grad_input_w4a16(x, *q)
    # in_features 24: not a multiple of 16
    packed24 = torch.zeros(16, 12, dtype=torch.uint8)
    with pytest.raises(ValueError, match="divisible by 16"):
        linear_w4a16(torch.zeros(3, 24).bfloat16(), packed24, q.weight_scale[:, :1],
                     q.weight_global_scale)
    with pytest.raises(ValueError, match="weight_packed"):
        linear_w4a16(x, q.weight_packed.to(torch.int16), *q[1:])
    with pytest.raises(ValueError, match="weight_scale"):
        linear_w4a16(x, q.weight_packed, q.weight_scale.float(), q.weight_global_scale)
    with pytest.raises(ValueError, match="weight_scale shape"):
        linear_w4a16(x, q.weight_packed, q.weight_scale[:, :1], q.weight_global_scale)
    with pytest.raises(ValueError, match="global_scale"):
        linear_w4a16(x, *q[:2], q.weight_global_scale.double())
    with pytest.raises(ValueError, match="global_scale"):
        linear_w4a16(x, *q[:2], 2.0)
    with pytest.raises(ValueError, match=r"one per output row \(16\)"):  # per-row: 16 rows, not 3
        linear_w4a16(x, *q[:2], torch.ones(3))
    with pytest.raises(ValueError, match="global_scale must be a float32 tensor of one number$"):
        grad_input_w4a16(dy, *q[:2], torch.ones(16))  # per-row scales: forward only
    with pytest.raises(ValueError, match="GEMV kernel is the forward for one input row"):
        linear_w4a16(x, *q, _config=dict(GEMV=True, BLOCK_N=16, BLOCK_K=32))  # 3 rows
    with pytest.raises(ValueError, match="bias"):
        linear_w4a16(x, *q, bias=torch.zeros(15).bfloat16())


def test_kernels_in_interpreter():
    from tests.conftest import interpreter_report

    report = interpreter_report(__file__, timeout=600)
    assert report["interpreted"] is True
    assert report["failures"] == [], report["failures"]
    assert report["checks"] >= 180, report
    print(f"{report['checks']} interpreter checks, worst rel. error {report['worst']:.2e}")


def _ptx_reports(*cfgs, dx: bool = False, out=None) -> list[dict]:
    """benchmarks/nvfp4_gemm_ptx.py's reports, one per config (a dict or its JSON), compiled for
    sm_90a without a GPU; `out` also keeps each config's TTGIR, PTX and cubin there."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [a for c in cfgs for a in ("--config", c if isinstance(c, str) else json.dumps(c))]
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/nvfp4_gemm_ptx.py"), *(["--dx"] if dx else []),
                           *(["--out", str(out)] if out is not None else []), *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_forward_reads_whole_vectors_of_its_tile_on_hopper():
    """Compiled for sm_90a without a GPU (benchmarks/nvfp4_gemm_ptx.py): the K-permuted
    forward feeds wgmma from 128-bit shared-memory loads, the unpermuted read takes its
    bytes one at a time (kernels/nvfp4/NOTES.md, fourth session), and the permuted loop
    decodes whole words without repacking registers."""
    cfg = '{"BLOCK_M":16,"BLOCK_N":64,"BLOCK_K":128,"SWAP_AB":true,"num_warps":4,"num_stages":4'
    permuted, plain = _ptx_reports(cfg + ',"SCALE_PAIRS":true}', cfg + ',"PERMUTE_K":false}')
    for r in (permuted, plain):
        assert r["wgmma"] > 0 and r["spill_store_bytes"] == 0, r
    assert "ld.shared.b8" not in permuted["memory_instructions"], permuted
    assert permuted["memory_instructions"]["ld.shared.v4.b32"] >= 4, permuted
    assert plain["memory_instructions"]["ld.shared.b8"] >= 32, plain
    # the word decode: 17 instructions per 8 weights and no register repacking ("the word decode" in
    # NOTES.md); 64 weights per thread and K step: ~140 for the decode, ~115 for the rest
    # (was 333 in all, 62 of them PRMT, before)
    assert permuted["sass_loop_instructions"] <= 275, permuted
    assert permuted["sass_loop_ops"].get("PRMT", 0) <= 16, permuted
    # SCALE_PAIRS: a thread's two block scales of a row come in as one 16-bit load, not two bytes
    assert permuted["memory_instructions"].get("ld.shared.b16", 0) >= 2, permuted
    assert "ld.shared.v2.b8" not in permuted["memory_instructions"], permuted


def test_gemv_compiles_to_a_lean_loop_on_hopper():
    """Compiled for sm_90a without a GPU (benchmarks/nvfp4_gemm_ptx.py): the GEMV's K loop has
    no spills and no shuffles (its block sums stay inside threads; the few shuffles are the
    epilogue's), and issues under 8 SASS instructions per weight (decode ~2.25, bf16x2 scale
    0.5, unpacking weight and input to float32 2, FFMA 1; NOTES.md, sixth session)."""
    cfgs = [{"GEMV": True, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w} for bn, bk, w in
            ((64, 128, 8), (128, 128, 16), (64, 128, 4))]
    for r in _ptx_reports(*cfgs):
        c = r["config"]
        per_thread = c["BLOCK_N"] * c["BLOCK_K"] / (32 * c["num_warps"])
        shuffles = sum(v for k, v in r["memory_instructions"].items() if k.startswith("shfl"))
        assert r["spill_store_bytes"] == 0 and r["wgmma"] == 0 and shuffles <= 16, r
        assert 0 < r["sass_loop_instructions"] / per_thread < 8, r
        assert r["sass_loop_ops"].get("FFMA", 0) >= per_thread, r  # one FFMA per weight, no tree adds


def test_decode_kernel_compiles_to_a_loop_without_shared_memory_on_hopper():
    """Compiled for sm_90a without a GPU (Gluon does not run in the interpreter; its results are
    checked on a GPU by benchmarks/nvfp4_decode_check.py, NOTES.md): the decode kernel's
    conversions into the mma.sync fragments are proven trivial by the compiler (`assert_trivial`),
    so its K loop has no shared memory, no barrier and no wgmma; weight and input arrive in
    16-byte loads; no spills. With STAGES the weight comes through shared memory by cp.async, and
    with RING_S the block scales too (4-byte copies instead of 2-byte loads into registers)."""
    ring = {"DECODE": True, "RW": 1, "KV": 1, "MT": 8, "num_warps": 1, "STAGES": 3}
    cfgs = [{"DECODE": True, "RW": 1, "KV": 1, "MT": mt, "num_warps": 4} for mt in (8, 16)] + [ring]
    cfgs += [dict(ring, RING_S=True)]
    *plain, ring_report, ring_s = _ptx_reports(*cfgs)
    for r in plain:
        mt = r["config"]["MT"]
        mem = r["memory_instructions"]
        # two K tiles per loop iteration, each 8 k-steps × MT/8 mma.sync
        assert r["spill_store_bytes"] == 0 and r["wgmma"] == 0 and r["mma_sync"] == 2 * mt, r
        assert r["shared_bytes"] <= 16 and not any(k.startswith("cp.async") for k in mem), r  # the split-K flag only
        assert r["sass_loop_ops"].get("HMMA") == 2 * mt and "BAR" not in r["sass_loop_ops"], r
        assert r["sass_loop_ops"].get("LDS", 0) == 0 and r["sass_loop_ops"].get("STS", 0) == 0, r
        assert mem["ld.global.v4.b32"] >= 2 * (2 + mt // 2), r  # 2 weight rows + the input, 16 bytes each
        # 2 × 2,048 weights per warp and iteration: 431 / 514 SASS instructions on triton 3.6 and 3.9
        assert r["sass_loop_instructions"] <= (450 if mt == 8 else 540), r
    # the shared-memory ring (STAGES): the weight arrives by cp.async, 16 bytes per thread and row
    r = ring_report
    assert r["spill_store_bytes"] == 0 and r["mma_sync"] == 8 and r["shared_bytes"] >= 3 * 16 * 64, r
    assert r["memory_instructions"].get("cp.async.cg.shared.global", 0) >= 2, r  # rows g and g + 8
    assert r["sass_loop_ops"].get("LDS", 0) >= 2 and r["sass_loop_instructions"] <= 245, r
    # ... and the block scales with it (RING_S): 4-byte cp.async, no 2-byte scale loads left
    r = ring_s
    mem = r["memory_instructions"]
    assert r["spill_store_bytes"] == 0 and r["mma_sync"] == 8, r
    assert mem.get("cp.async.cg.shared.global", 0) >= 2 and mem.get("cp.async.ca.shared.global", 0) >= 1, r
    assert "ld.global.b16" not in mem and mem.get("bar.sync", 0) >= 2, r
    assert r["sass_loop_ops"].get("LDGSTS", 0) >= 3 and r["sass_loop_instructions"] <= 245, r


def _wgmma_ptx_reports(cfg: dict) -> list[dict]:
    """benchmarks/nvfp4_gemm_ptx.py's reports on `cfg`, forward then dX (compiled for sm_90a, no GPU)."""
    reports = _ptx_reports(cfg) + _ptx_reports(cfg, dx=True)
    assert len(reports) == 2
    return reports


def test_wgmma_kernel_overlaps_decode_and_wgmma_without_spills_on_hopper():
    """Compiled for sm_90a without a GPU (checked and timed on one by benchmarks/nvfp4_wgmma_check.py):
    forward and dX of the many-rows kernel keep their wgmma asynchronous (one wait that leaves one
    group in flight, and ptxas did not serialize them: C7515), decode into shared memory with
    16-byte stores, get their operands by cp.async, and do not spill."""
    reports = _wgmma_ptx_reports({"WGMMA": True})
    for r in reports:
        mem = r["memory_instructions"]
        assert r["spill_store_bytes"] == 0 and not r["wgmma_serialized"], r
        assert r["wgmma"] == 8, r  # 4 × k16 per 64-deep step: step 0 peeled, then the loop
        assert mem.get("st.shared.v4.b32", 0) >= 8 and mem.get("cp.async.cg.shared.global", 0) >= 6, r
        # per 64-deep step and thread: the decode of 64 weights (~8 x 17 for the words, 36 PRMT that
        # pair codes in memory order) and the copies: 295 SASS on triton 3.6, 322 on 3.9
        assert r["sass_loop_instructions"] <= 340, r


@pytest.mark.parametrize("extra, regs, stores", [
    ({}, {"dec": [24, 184], "inc": [128, 240]}, 8),  # one decode warp group at 128 registers, wgmma warps 184
    ({"DECODE_WARPS": 8, "DECODE_REGS": 88, "MAXNREG": 128}, {"dec": [24, 168], "inc": [88, 232]}, 4),  # two at 88
    # PINGPONG: each wgmma warp group a partition of its own, the second at MMA_REGS 184
    ({"PINGPONG": True}, {"dec": [120, 192], "inc": [128, 184, 256]}, 8),
])
def test_warp_specialized_wgmma_kernel_splits_decode_and_wgmma_on_hopper(extra, regs, stores):
    """Compiled for sm_90a without a GPU (checked and timed on one by nvfp4_wgmma_check.py): the
    warp-specialized variant gives the decode one warp group (or two) with fewer registers
    (setmaxnreg) and the wgmma warps the rest, hands buffers over by mbarriers, loads the input by
    TMA, keeps its wgmma asynchronous and does not spill."""
    reports = _wgmma_ptx_reports({"WGMMA": True, "WARP_SPECIALIZE": True, **extra})
    for r in reports:
        mem = r["memory_instructions"]
        # 256 × 128 tile: each warp group 2 × (64 × 128 × 16) per k16, 4 k16 per step; step 0 peeled
        # (PINGPONG: the same code once per partition; triton 3.6, the GPU image's, compiles it without
        # spills, 3.9 spills ~1.2 KB per thread whatever the partitions' registers: not the version timed)
        spills_ok = 0 if not extra.get("PINGPONG") or importlib.metadata.version("triton").startswith("3.6") else 2048
        assert r["spill_store_bytes"] <= spills_ok and not r["wgmma_serialized"], r
        assert r["wgmma"] == (32 if extra.get("PINGPONG") else 16), r
        assert r["setmaxnreg"] == regs, r
        assert r["mbarrier_arrives"] >= 2 and r["tma_loads"] >= 2, r  # hand-overs; the input's first + next steps
        # a 128 × 64 weight tile per step: 8 (4) words per decoding thread, one 16-byte store each
        assert mem.get("st.shared.v4.b32", 0) >= stores and mem.get("cp.async.cg.shared.global", 0) >= 2, r


def test_swap_kernel_decodes_the_weight_into_registers_for_async_wgmma_on_hopper():
    """Compiled for sm_90a without a GPU (checked and timed on one by nvfp4_wgmma_check.py with
    "SWAP": true): the weight as wgmma's register operand. The compiler proves that the decoded
    bytes already sit in the A fragment (convert_layout(assert_trivial=True), else compiling fails),
    the wgmma stay asynchronous and no instruction writes the A registers of one in flight (the
    SASS, walked from each HGMMA to the wait that retires it), the weight never goes through shared
    memory (only the TMA'd input and the output tile do), and nothing spills, from decode-sized
    tiles to 128 × 256."""
    for cfg in ({"BN": 16, "WARPS": 4}, {"BN": 256, "WARPS": 8, "G_PER_ROW": True}):
        r = _ptx_reports({"SWAP": True, **cfg})[0]
        mem = r["memory_instructions"]
        # 4 k16 per step: step 0 peeled, two per iteration, the odd last one
        assert r["spill_store_bytes"] == 0 and not r["wgmma_serialized"] and r["wgmma"] == 16, r
        assert r["wgmma_a_overwrites"] == 0, r  # nothing writes an in-flight wgmma's A registers
        assert r["tma_loads"] >= 2 and mem.get("ld.global.b8", 0) >= 16, r  # input by TMA; 16 weight bytes per step
        # no decoded tile in shared memory: one or two stores in the epilogue (output tile, split-K flag)
        assert sum(v for op, v in mem.items() if op.startswith("st.shared")) <= 2, r
    # PREPACKED: a thread's 8 bytes of a row in one 64-bit load (2 per step, 4 steps in the SASS), put
    # back in Ŵ's order in registers (no shared memory); the rest as above
    r = _ptx_reports({"SWAP": True, "BN": 256, "WARPS": 8, "PREPACKED": True})[0]
    mem = r["memory_instructions"]
    assert r["spill_store_bytes"] == 0 and not r["wgmma_serialized"] and r["wgmma_a_overwrites"] == 0, r
    assert mem.get("ld.global.b8", 0) == 0 and mem.get("ld.global.v2.b32", 0) >= 10, r
    assert sum(v for op, v in mem.items() if op.startswith("st.shared")) <= 2, r
    # TMA_W: the weight's bytes and scales come with the input through the TMA ring (3 TMA loads per
    # fill); no global load of the weight at all, the decode reads shared memory (64-bit words)
    r = _ptx_reports({"SWAP": True, "BN": 256, "WARPS": 8, "PREPACKED": True, "TMA_W": True})[0]
    mem = r["memory_instructions"]
    assert r["spill_store_bytes"] == 0 and not r["wgmma_serialized"] and r["wgmma_a_overwrites"] == 0, r
    assert not any(op.startswith("ld.global") and "cg" not in op and op != "ld.global.b32" for op in mem), r
    assert mem.get("ld.global.b32", 0) <= 2 and mem.get("ld.shared.v2.b32", 0) >= 10 and r["tma_loads"] >= 12, r
    # PINGPONG: the two warp groups as partitions (one of them a worker at PP_REGS registers), each
    # with its own 16 wgmma and its slot hand-backs on an mbarrier (no CTA-wide barrier in the loop)
    r = _ptx_reports({"SWAP": True, "BN": 256, "WARPS": 8, "PREPACKED": True, "TMA_W": True, "PINGPONG": True})[0]
    assert r["spill_store_bytes"] == 0 and not r["wgmma_serialized"] and r["wgmma_a_overwrites"] == 0, r
    assert r["wgmma"] == 32 and r["setmaxnreg"]["dec"] == [232] and r["mbarrier_arrives"] >= 6, r


@pytest.mark.parametrize("bn, stages", [(256, 4), (128, 6)])
def test_swap_kernel_producer_warp_issues_every_tma_load_on_hopper(bn, stages):
    """PRODUCER (compiled for sm_90a, not yet run on a GPU): PINGPONG's two wgmma warp groups plus a
    third partition of one warp at PRODUCER_REGS (24) registers that issues every TMA load of the
    ring (one fill in its loop: 5 loads; the other 4 bulk copies are the output stores of the two
    halves, with and without split-K); the wgmma partitions only wait on `ready` and arrive on
    `empty`. Triton pads the partitions to 12 warps and gives the default one what is left:
    504 - PP_REGS - PRODUCER_REGS = 248. No spills with triton 3.6 (the GPU image's). The ring
    protocol itself: tests/test_nvfp4_swap_ring_protocol.py."""
    r = _ptx_reports({"SWAP": True, "BN": bn, "STAGES": stages, "WARPS": 8, "PREPACKED": True, "TMA_W": True,
                      "PINGPONG": True, "PRODUCER": True})[0]
    assert r["wgmma"] == 32 and not r["wgmma_serialized"] and r["wgmma_a_overwrites"] == 0, r
    if importlib.metadata.version("triton").startswith("3.6"):
        assert r["spill_store_bytes"] == 0, r
    # 24: the producer (and the padding warps), 232: the worker half, 248: the default half in the region
    assert 24 in r["setmaxnreg"]["dec"] and 248 in r["setmaxnreg"]["dec"], r
    assert 232 in r["setmaxnreg"]["inc"], r
    assert r["tma_loads"] == 9 and r["mbarrier_arrives"] >= 8, r


def test_swap_prepack_puts_a_lanes_bytes_together_and_the_kernel_restores_the_order():
    """`swap_gemm.prepack` stores byte t + 4j of every row's 32 bytes per step at 8t + j; the kernel
    loads [rows, t, j] and reorders it (`_bytes`: reshape [rows, t, block, bit 2], permute to
    [rows, block, bit 2, t]) back to Ŵ's [rows, block, byte]: the same index arithmetic in torch."""
    from kernels.nvfp4 import swap_gemm

    packed = torch.randint(0, 256, (48, 96), dtype=torch.uint8)  # 3 steps of 32 bytes
    pre = swap_gemm.prepack(packed)
    assert pre.shape == packed.shape and not torch.equal(pre, packed)
    for t in range(4):
        for j in range(8):
            assert torch.equal(pre[:, 8 * t + j::32], packed[:, t + 4 * j::32])
    loaded = pre.view(48, 3, 4, 8)  # [rows, step, t, j] as the kernel loads a step
    restored = loaded.reshape(48, 3, 4, 4, 2).permute(0, 1, 3, 4, 2).reshape(48, 3, 4, 8)
    assert torch.equal(restored.reshape(48, 96), packed)
    with pytest.raises(ValueError, match="whole steps"):
        swap_gemm.prepack(packed[:, :80])
    # TMA_W's scales: step-major [K/64, N, 4]; the kernel reads step s's box as one 32-bit word per row
    scale = torch.randint(0, 256, (48, 12), dtype=torch.uint8)  # 3 steps of 4 block scales
    pre_s = swap_gemm.prepack_scales(scale)
    assert pre_s.shape == (3, 48, 4) and pre_s.is_contiguous()
    for step in range(3):
        box = pre_s[step].reshape(-1)  # the TMA box [1, 48/4, 16] as the kernel's shared memory holds it
        for row in range(48):
            assert torch.equal(box[4 * row:4 * row + 4], scale[row, 4 * step:4 * step + 4])


def test_wgmma_kernel_refuses_what_it_cannot_run(monkeypatch):
    """The wgmma kernel runs on Hopper GPUs only; elsewhere it says so, and neither the autotuned
    path nor the learner's `QERL_NVFP4_GEMM=wgmma` routes to it (CPU tensors here)."""
    from kernels.nvfp4 import gemm, wgmma_gemm
    from kernels.nvfp4.linear import backend_name

    packed, scale, g = make_weight(256, 128, 0)
    x = torch.randn(64, 128).bfloat16()
    with pytest.raises(ValueError, match="CUDA GPUs only"):
        wgmma_gemm.linear_wgmma(x, packed, scale, g)
    assert not gemm._wgmma_fits(x, 64, 256, 128, False, g)
    assert wgmma_gemm.supports(64, 256, 128, wgmma_gemm.DEFAULT_CONFIG)
    assert not wgmma_gemm.supports(64, 576, 128, wgmma_gemm.DEFAULT_CONFIG)  # SmolLM2's 576 columns
    wide = {**wgmma_gemm.DEFAULT_CONFIG, "BM": 256, "BP": 128}  # 16 warps for 128 (64) weight rows: words twice
    assert not wgmma_gemm.supports(4096, 3584, 3584, wide) and not wgmma_gemm.supports(4096, 3584, 3584, wide, False)
    narrow = {**wgmma_gemm.DEFAULT_CONFIG, "BP": 128, "STAGES": 6}  # 8 warps: 128 (64) rows, one pass
    assert wgmma_gemm.supports(4096, 3584, 3584, narrow) and wgmma_gemm.supports(4096, 3584, 3584, narrow, False)
    # the warp-specialized 256 x 128 tile decodes with its own 4 warps: every 7B shape, not SmolLM2's 576
    for ws in ({"WARP_SPECIALIZE": True}, {"WARP_SPECIALIZE": True, "DECODE_WARPS": 8}):
        assert all(wgmma_gemm.supports(64, n, k, ws, fwd) for n, k in ((512, 3584), (18944, 3584), (3584, 18944))
                   for fwd in (True, False))
        assert not wgmma_gemm.supports(64, 576, 576, ws)
    # 16 decoding warps would give a 128 × 64 tile's words to more threads than it has (4 each)
    assert not wgmma_gemm.supports(4096, 3584, 3584, {"WARP_SPECIALIZE": True, "DECODE_WARPS": 16})
    for choice in ("wgmma", "swap"):
        monkeypatch.setenv("QERL_NVFP4_GEMM", choice)
        assert backend_name(x) == "reference"
    monkeypatch.setenv("QERL_NVFP4_GEMM", "wgmma2")
    with pytest.raises(ValueError, match="auto, wgmma, swap, dequant, fused or reference"):
        backend_name(x)


def test_pdl_kernels_wait_before_touching_the_input_or_output(tmp_path):
    """Compiled for sm_90a without a GPU: with PDL (programmatic dependent launch, the serving
    op's default) a kernel may run while the previous one in the stream still reads and writes
    memory, so the forward and the GEMV may only prefetch their own weight to L2 before
    `griddepcontrol.wait`: no global load, store, atomic or cp.async before it."""
    import re

    _ptx_reports('{"BLOCK_M":16,"BLOCK_N":64,"BLOCK_K":128,"SWAP_AB":true,"num_warps":4,"num_stages":4,"PDL":true}',
                 '{"GEMV":true,"BLOCK_N":64,"BLOCK_K":128,"num_warps":4,"PDL":true}', out=tmp_path)
    ptxs = sorted(tmp_path.glob("*.ptx"))
    assert len(ptxs) == 2, ptxs
    for ptx in ptxs:
        text = ptx.read_text()
        assert text.count("griddepcontrol.wait") == 1, ptx.name
        before = text[:text.index("griddepcontrol.wait")]
        assert "prefetch.global.L2" in before, ptx.name
        touched = re.findall(r"\b(?:ld\.global|st\.global|atom|red\.global|cp\.async)[.\w]*", before)
        assert touched == [], (ptx.name, touched)


def test_scale_pair_arithmetic_is_exact_for_every_e4m3_scale():
    """`_SCALE_PAIR_ASM` (the forward's block-scale decode on sm_89+) goes e4m3 → f16 (the
    hardware cvt) → bf16 bits of s · 2^118 with integer ops; `scale_pair_bits` is that
    arithmetic. For every e4m3 value but NaN (zero, subnormals, negatives, 448) it must equal
    the float route it replaced: float32 s · 2^118 rounded to bf16."""
    from kernels.nvfp4 import gemm

    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    f8 = codes.view(torch.float8_e4m3fn)
    f16_bits = f8.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    want = (f8.float() * 2.0 ** 118).bfloat16().view(torch.int16).to(torch.int32) & 0xFFFF
    got = gemm.scale_pair_bits(f16_bits)
    bad = [(hex(int(c)), hex(int(g)), hex(int(w))) for c, g, w in zip(codes, got, want) if g != w]
    assert bad == []
    ptx = gemm._SCALE_PAIR_ASM.value
    assert "cvt.rn.f16x2.e4m3x2" in ptx and str(gemm._SCALE_PAIR_EXP) in ptx


def test_swap_kernel_byte_decode_is_exact_for_every_byte():
    """`swap_gemm._byte_ptx` (the swap kernel's decode, GPU only) turns one packed byte into its two
    codes' E2M1 · 2^-126 as one bf16x2 (low nibble in the low half), before the fma by the scale ·
    2^118; `byte_bits` is that integer arithmetic. For all 256 bytes both halves must be exact."""
    from kernels.nvfp4 import swap_gemm

    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    b = torch.arange(256, dtype=torch.int64)
    bits = swap_gemm.byte_bits(b)

    def as_float(half):  # bf16 bit patterns → float32
        return (half.to(torch.int32) << 16).view(torch.float32) * 2.0 ** 126

    for half, codes in ((bits & 0xFFFF, b & 0xF), (bits >> 16, b >> 4)):
        want = e2m1[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0)
        assert torch.equal(as_float(half), want)
    ptx = swap_gemm._byte_ptx()
    assert f"mul.lo.u32 p, $2, {swap_gemm._SPREAD};" in ptx and "fma.rn.bf16x2" in ptx


# ---------------------------------------------------------------- interpreter half

def _interpreter_check() -> dict:
    torch.set_num_threads(1)
    from triton.runtime.interpreter import InterpretedFunction

    from kernels.nvfp4 import gemm

    failures: list[str] = []
    checks = 0
    worst = 0.0

    def expect(tag, out, want_ref, want64, shape):
        nonlocal checks, worst
        checks += 1
        if out.dtype != torch.bfloat16 or tuple(out.shape) != tuple(shape):
            failures.append(f"{tag}: got {out.dtype} {tuple(out.shape)}, want bf16 {shape}")
            return
        if not bool(torch.isfinite(out).all()):
            failures.append(f"{tag}: non-finite output")
            return
        e1, e2 = rel(out, want_ref), rel(out, want64)
        worst = max(worst, e1, e2)
        if e1 > TOL or e2 > TOL:
            failures.append(f"{tag}: rel err vs reference {e1:.3e}, vs float64 {e2:.3e}")

    base = dict(gemm.INTERPRET_CONFIG)
    configs = {
        "default": None,  # the fixed interpreter config (BM16 BN16 BK32)
        "bn32-bk64-split2": dict(base, BLOCK_N=32, BLOCK_K=64, SPLIT_K=2),
        "swap-bm32-split3": dict(base, BLOCK_M=32, BLOCK_K=64, SWAP_AB=True, SPLIT_K=3),
    }
    gen = torch.Generator().manual_seed(0)
    seed = 10
    for M in (1, 5, 33):
        for K in (32, 64, 96):
            for N in (16, 48):
                seed += 1
                q = make_weight(N, K, seed)
                w64 = ref.dequantize(*q, dtype=torch.float32).double()
                x = torch.randn(M, K, generator=gen).bfloat16()
                dy = torch.randn(M, N, generator=gen).bfloat16()
                y_ref = gemm.reference_linear(x, *q)
                dx_ref = gemm.reference_grad_input(dy, *q)
                # the full grid on the default config; the other configs on a subset
                names = ["default"] + (["bn32-bk64-split2", "swap-bm32-split3"]
                                       if (M, K) in ((5, 96), (33, 64), (1, 96)) else [])
                for name in names:
                    cfg = configs[name]
                    tag = f"M{M} K{K} N{N} {name}"
                    expect("linear " + tag, gemm.linear_w4a16(x, *q, _config=cfg),
                           y_ref, x.double() @ w64.t(), (M, N))
                    expect("grad_input " + tag, gemm.grad_input_w4a16(dy, *q, _config=cfg),
                           dx_ref, dy.double() @ w64, (M, K))

    # the forward's K-permuted tile (PERMUTE_K, what every GPU config with BLOCK_K ≥ 64 uses)
    # at the production BLOCK_K = 128 and 256 (G = 8, 16), against the unpermuted read
    for bk, split in ((128, 2), (256, 1)):
        q = make_weight(32, 512, 40 + bk)
        w64 = ref.dequantize(*q, dtype=torch.float32).double()
        x = torch.randn(5, 512, generator=gen).bfloat16()
        for perm in (True, False):
            cfg = dict(base, BLOCK_N=16, BLOCK_K=bk, SWAP_AB=True, SPLIT_K=split, PERMUTE_K=perm)
            expect(f"linear K512 BK{bk} permute={perm}", gemm.linear_w4a16(x, *q, _config=cfg),
                   gemm.reference_linear(x, *q), x.double() @ w64.t(), (5, 32))

    # bias (bf16 and fp32), leading batch dims, non-contiguous inputs
    q = make_weight(48, 64, 99)
    w64 = ref.dequantize(*q, dtype=torch.float32).double()
    x = torch.randn(2, 3, 64, generator=gen).bfloat16()
    for bias in (torch.randn(48, generator=gen).bfloat16(), torch.randn(48, generator=gen)):
        for name, cfg in (("default", None), ("split2", configs["bn32-bk64-split2"])):
            expect(f"linear bias {bias.dtype} batch {name}",
                   gemm.linear_w4a16(x, *q, bias=bias, _config=cfg),
                   gemm.reference_linear(x, *q, bias=bias),
                   x.double() @ w64.t() + bias.double(), (2, 3, 48))
    xt = torch.randn(64, 9, generator=gen).bfloat16().t()  # [9, 64], strides (1, 9)
    assert not xt.is_contiguous()
    expect("linear non-contiguous x", gemm.linear_w4a16(xt, *q), gemm.reference_linear(xt, *q),
           xt.double() @ w64.t(), (9, 48))
    xs = torch.randn(10, 128, generator=gen).bfloat16()[::2, ::2]  # [5, 64], strides (256, 2)
    expect("linear strided x", gemm.linear_w4a16(xs, *q), gemm.reference_linear(xs, *q),
           xs.double() @ w64.t(), (5, 48))
    dy = torch.randn(4, 2, 48, generator=gen).bfloat16().transpose(0, 1)  # [2, 4, 48]
    expect("grad_input batch non-contiguous dy", gemm.grad_input_w4a16(dy, *q),
           gemm.reference_grad_input(dy, *q), dy.double() @ w64, (2, 4, 64))
    # the CUDA-core GEMV (forward, one input row): splits, bias, a K-block of 128 and 256
    for n, k, bn, bk, split in ((48, 256, 16, 128, 1), (40, 512, 32, 128, 3), (16, 512, 16, 256, 2),
                                (64, 384, 64, 128, 2)):
        for with_bias in (False, True):
            seed += 1
            q = make_weight(n, k, seed)
            w64 = ref.dequantize(*q, dtype=torch.float32).double()
            x = torch.randn(1, k, generator=gen).bfloat16()
            bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
            cfg = dict(GEMV=True, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split)
            want64 = x.double() @ w64.t() + (0 if bias is None else bias.double())
            expect(f"gemv N{n} K{k} BN{bn} BK{bk} split{split} bias={with_bias}",
                   gemm.linear_w4a16(x, *q, bias=bias, _config=cfg),
                   gemm.reference_linear(x, *q, bias=bias), want64, (1, n))

    # one global scale per W row (vLLM's fused q/k/v, gate/up shards), forward only: three shards
    # quantized separately, concatenated, against the float64 product with each shard's weights
    shards = [make_weight(16, 256, 70 + i) for i in range(3)]
    packed = torch.cat([sh.weight_packed for sh in shards])
    scale = torch.cat([sh.weight_scale for sh in shards])
    g_rows = torch.cat([sh.weight_global_scale.expand(16) for sh in shards]).contiguous()
    w64 = torch.cat([ref.dequantize(*sh, dtype=torch.float32) for sh in shards]).double()
    x5 = torch.randn(5, 256, generator=gen).bfloat16()
    want_ref = torch.cat([gemm.reference_linear(x5, *sh) for sh in shards], dim=1)
    x1 = x5[:1]
    for tag, x_, cfg in (("tensor-core split2", x5, dict(base, BLOCK_N=16, BLOCK_K=128, SWAP_AB=True, SPLIT_K=2)),
                         ("tensor-core default", x5, None),
                         ("gemv", x1, dict(GEMV=True, BLOCK_N=16, BLOCK_K=128, SPLIT_K=2))):
        expect(f"per-row global scale {tag}", gemm.linear_w4a16(x_, packed, scale, g_rows, _config=cfg),
               want_ref[: x_.shape[0]], x_.double() @ w64.t(), (x_.shape[0], 48))

    # a packed weight at an odd address (a view into a byte buffer): the K-permuted forward reads
    # int32 words, so the launcher copies it to an aligned tensor first
    q = make_weight(32, 512, 97)
    buf = torch.zeros(q.weight_packed.numel() + 1, dtype=torch.uint8)
    odd = buf[1:].view(q.weight_packed.shape)
    odd.copy_(q.weight_packed)
    assert odd.data_ptr() % 4
    w64 = ref.dequantize(*q, dtype=torch.float32).double()
    x = torch.randn(5, 512, generator=gen).bfloat16()
    cfg = dict(base, BLOCK_N=16, BLOCK_K=128, SWAP_AB=True, SPLIT_K=1)
    expect("linear packed at an odd address", gemm.linear_w4a16(x, odd, *q[1:], _config=cfg),
           gemm.reference_linear(x, *q), x.double() @ w64.t(), (5, 32))

    # the input permuted outside the kernel (A_PREPERM) and evict_first weight loads: same result
    q = make_weight(32, 512, 98)
    w64 = ref.dequantize(*q, dtype=torch.float32).double()
    x = torch.randn(5, 512, generator=gen).bfloat16()
    for bk in (128, 256):
        cfg = dict(base, BLOCK_N=16, BLOCK_K=bk, SWAP_AB=True, SPLIT_K=2, A_PREPERM=True, EVICT_W=True)
        expect(f"linear A_PREPERM BK{bk}", gemm.linear_w4a16(x, *q, _config=cfg),
               gemm.reference_linear(x, *q), x.double() @ w64.t(), (5, 32))

    # every config benchmarks/nvfp4_gemm_sweep.py will time is accepted and correct (a bad one
    # would waste GPU time): on a small shape whose K takes every BLOCK_K and split
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import nvfp4_gemm_sweep as sweep

    q = make_weight(144, 1024, 123)
    w64 = ref.dequantize(*q, dtype=torch.float32).double()
    xs = {m: torch.randn(m, 1024, generator=gen).bfloat16() for m in (1, 16, 32, 64, 128)}
    want_ref = {m: gemm.reference_linear(x, *q) for m, x in xs.items()}
    seen = set()  # the interpreter ignores warps and stages: each distinct computation once
    for name in ("gemv", "tc-reg", "tc-m1", "tc-m16", "tc-split", "tc-deep", "tc-m64"):  # tc-reg first: maxnreg
        for m, cfg in sweep.grid(name):
            key = (m, *sorted((k, v) for k, v in cfg.items() if k not in ("num_warps", "num_stages", "maxnreg")))
            if key in seen:
                continue
            seen.add(key)
            x = xs[m]
            expect(f"sweep {name} {cfg}", gemm.linear_w4a16(x, *q, _config=dict(cfg)), want_ref[m],
                   x.double() @ w64.t(), (m, 144))

    # the learner's layer on the fused backend (QERL_NVFP4_GEMM=fused): NVFP4Linear's forward and
    # dX run through these kernels and equal autograd through the dequantized weight
    import os

    from kernels.nvfp4.linear import NVFP4Linear, backend_name
    os.environ["QERL_NVFP4_GEMM"] = "fused"
    try:
        q = make_weight(48, 256, 321)
        layer = NVFP4Linear.from_checkpoint_tensors(*q, bias=torch.randn(48, generator=gen), dtype=torch.bfloat16)
        for m in (1, 16, 40):
            x = torch.randn(m, 256, generator=gen).bfloat16().requires_grad_(True)
            checks += 1
            if backend_name(x) != "fused-triton":
                failures.append(f"NVFP4Linear with QERL_NVFP4_GEMM=fused runs {backend_name(x)}")
            y = layer(x)
            dy = torch.randn(m, 48, generator=gen).bfloat16()
            y.backward(dy)
            w = ref.dequantize(*q, dtype=torch.float32).double()
            want = gemm.reference_linear(x.detach(), *q, bias=layer.bias)
            expect(f"NVFP4Linear fused forward m{m}", y.detach(), want,
                   x.detach().double() @ w.t() + layer.bias.double(), (m, 48))
            expect(f"NVFP4Linear fused dX m{m}", x.grad, gemm.reference_grad_input(dy, *q), dy.double() @ w, (m, 256))
    finally:
        del os.environ["QERL_NVFP4_GEMM"]

    # the counter buffer is left zeroed by split-K launches
    checks += 1
    for buf in gemm._COUNTERS.values():
        if int(buf.abs().sum()) != 0:
            failures.append("split-K counters not reset to 0")
    return {"interpreted": isinstance(gemm._w4a16_kernel, InterpretedFunction),
            "checks": checks, "failures": failures, "worst": worst}


if __name__ == "__main__" and sys.argv[1:] == ["--interpreter-check"]:
    print(json.dumps(_interpreter_check()))


def test_sweep_merges_its_serving_table(tmp_path):
    """nvfp4_gemm_sweep.py --serving-table: a config enters where it beats what the serving op
    would run without it (cuBLAS bf16 up to 32 rows, dequantize + cuBLAS above), and earlier
    entries of other (shape, M) stay."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import nvfp4_gemm_sweep as sweep

    path = tmp_path / "t.json"
    h200 = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SWAP_AB": True, "SPLIT_K": 8, "us": 9.4}
    path.write_text(json.dumps({"measured_on": "NVIDIA H200, 2026-12-04", "configs": {"64x1024": [[16, h200]]}}))
    tc = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "SWAP_AB": True, "SPLIT_K": 4, "num_warps": 4, "num_stages": 3}
    rows = [dict(shape="s", M=m, kernel=k, us=us) for m in (64, 128)
            for k, us in (("cublas_bf16", 10.0), ("dequant_cublas", 30.0))]
    rows += [dict(shape="s", M=64, kernel="nvfp4", rel_err=1e-3, us=18.0, **tc),  # > cuBLAS, < dequant + cuBLAS
             dict(shape="s", M=64, kernel="nvfp4", rel_err=0.5, us=1.0, **dict(tc, SPLIT_K=1)),  # wrong: never taken
             dict(shape="s", M=128, kernel="nvfp4", rel_err=1e-3, us=31.0, **tc)]  # slower than its fallback
    sweep.write_serving_table(path, rows, [("s", 64, 1024)], [64, 128])
    data = json.loads(path.read_text())
    want = dict(tc, us=18.0, cublas_bf16_us=10.0, dequant_cublas_us=30.0)
    assert data["configs"]["64x1024"] == [[16, h200], [64, want]]
    assert data["measured_on"].startswith("NVIDIA H200, 2026-12-04; ") and "(M = 64, 128)" in data["measured_on"]
