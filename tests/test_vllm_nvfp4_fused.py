"""The ``fused`` vLLM backend (kernels/vllm_nvfp4_dequant.py + kernels/nvfp4/serving.py): a
vLLM-shaped fused q/k/v layer with three different shard global scales, served from its
packed 4-bit weights by the project's Triton kernels, against the plugin's own dequantized
reference. Runs the kernels under TRITON_INTERPRET=1 in a fresh process (the interpreter
is read when kernels are decorated); every path of the op's config table is taken: the GEMV
(M = 1), the tensor-core kernel (M ≤ 64) and dequantize + matmul (larger M), eagerly and
under torch.compile (the op is opaque there, through its fake implementation).
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

TOL = 1e-2  # ‖out − ref‖ / ‖ref‖: bf16 output, a different accumulation order


def test_config_table_covers_every_row_count(tmp_path, monkeypatch):
    from kernels.nvfp4 import serving

    (tmp_path / "none.json").write_text('{"configs": {}}')  # the generic table alone
    monkeypatch.setenv(serving.TABLE_ENV, str(tmp_path / "none.json"))

    assert serving.config_for(1, 4608, 3584, 132)["GEMV"] is True
    assert "GEMV" not in serving.config_for(1, 4608, 3000 + 16, 132)  # K % 128 != 0: tensor cores
    for m in (2, 16, 17, 32, 33, 64):
        cfg = serving.config_for(m, 4608, 3584, 132)
        assert cfg["BLOCK_M"] >= min(m, 32) and cfg["SPLIT_K"] >= 1
    assert serving.config_for(65, 4608, 3584, 132) is None  # dequantize + cuBLAS
    # more output tiles than SMs: no split; few tiles over a long K: split
    assert serving.config_for(16, 37888, 3584, 132)["SPLIT_K"] == 1
    assert serving.config_for(16, 3584, 18944, 132)["SPLIT_K"] > 1
    # on Hopper the wgmma kernel takes the rest where it has a CTA per SM: gate_up at 256 rows
    # (296 tiles of 256 x 128), not q/k/v (36), which stays with dequantize + cuBLAS
    assert serving.config_for(256, 37888, 3584, 132, wgmma=True) == {"WGMMA": True, "WARP_SPECIALIZE": True}
    assert serving.config_for(256, 4608, 3584, 132, wgmma=True) is None
    assert serving.config_for(64, 37888, 3584, 132, wgmma=True)["BLOCK_M"] == 32  # the tables first


def test_measured_table_wins_for_its_shapes(tmp_path, monkeypatch):
    from kernels.nvfp4 import serving

    gemv = dict(GEMV=True, BLOCK_N=128, BLOCK_K=256, SPLIT_K=2, num_warps=16, num_stages=1)
    tc = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=256, SWAP_AB=True, SPLIT_K=4, num_warps=4, num_stages=2,
              A_PREPERM=True, EVICT_W=False)
    (tmp_path / "t.json").write_text(json.dumps({"measured_on": "test", "configs": {
        "4608x3584": [[16, dict(tc, us=9.1, cublas_bf16_us=10.0)], [1, dict(gemv, us=5.0, cublas_bf16_us=9.0)]]}}))
    monkeypatch.setenv(serving.TABLE_ENV, str(tmp_path / "t.json"))
    assert serving.config_for(1, 4608, 3584, 132) == gemv  # measured figures are not kernel arguments
    for m in (2, 15, 16):
        assert serving.config_for(m, 4608, 3584, 132) == tc  # the M = 1 GEMV never takes 2 rows
    assert serving.config_for(17, 4608, 3584, 132)["BLOCK_M"] == 32  # beyond the measured: generic
    wide = dict(tc, BLOCK_M=64)
    (tmp_path / "t2.json").write_text(json.dumps({"configs": {"4608x3584": [[1, gemv], [16, tc], [128, wide]]}}))
    monkeypatch.setenv(serving.TABLE_ENV, str(tmp_path / "t2.json"))  # 17-128 rows: the config measured at 128
    assert serving.config_for(16, 4608, 3584, 132) == tc and serving.config_for(17, 4608, 3584, 132) == wide
    assert serving.config_for(128, 4608, 3584, 132) == wide and serving.config_for(129, 4608, 3584, 132) is None
    assert serving.config_for(16, 3584, 3584, 132)["BLOCK_K"] == 128  # another shape: generic
    (tmp_path / "bad.json").write_text('{"4608x3584": []}')
    monkeypatch.setenv(serving.TABLE_ENV, str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="bad.json.*expected"):
        serving.config_for(1, 4608, 3584, 132)


def test_decode_kernel_configs_only_where_they_can_run(tmp_path, monkeypatch):
    """The Gluon decode kernel (kernels/nvfp4/decode_gemm.py) runs on CUDA GPUs only and needs
    N a multiple of its rows and K of its K step: elsewhere the next entry serves."""
    from kernels.nvfp4 import serving

    dec = dict(DECODE=True, RW=2, KV=2, SPLIT_K=2, num_warps=4)  # 128 rows, K step 256
    tc = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SWAP_AB=True, SPLIT_K=4, num_warps=4, num_stages=4)
    (tmp_path / "t.json").write_text(json.dumps({"configs": {
        "4608x3584": [[1, dict(dec, us=5.0)], [16, dict(dec, us=9.0)], [32, tc]],
        "4608x3712": [[16, dec], [32, tc]],  # 3712 % 256 != 0
        "4624x3584": [[16, dec], [32, tc]]}}))  # 4624 % 128 != 0
    monkeypatch.setenv(serving.TABLE_ENV, str(tmp_path / "t.json"))
    assert serving.config_for(1, 4608, 3584, 132) == dec
    assert serving.config_for(16, 4608, 3584, 132) == dec
    assert serving.config_for(17, 4608, 3584, 132) == tc  # beyond 16 rows: never the decode kernel
    assert serving.config_for(1, 4608, 3584, 132, decode=False) == tc  # CPU / interpreter
    assert serving.config_for(8, 4608, 3712, 132) == tc
    assert serving.config_for(8, 4624, 3584, 132) == tc


def test_decode_kernel_refuses_cpu_tensors():
    from kernels.nvfp4 import gemm, global_scale, quantize

    w = torch.randn(128, 256) * 0.02
    q = quantize(w, global_scale(w))
    with pytest.raises(ValueError, match="CUDA GPUs only"):
        gemm.linear_w4a16(torch.randn(1, 256).bfloat16(), *q,
                          _config=dict(DECODE=True, RW=1, KV=1, SPLIT_K=1, num_warps=4))


def test_fused_backend_in_interpreter():
    from tests.conftest import interpreter_report

    report = interpreter_report(__file__, timeout=600)
    assert report["failures"] == [], report["failures"]
    assert report["checks"] >= 10, report
    assert report["selected"] == "QeRLFusedNvFp4LinearKernel", report
    print(f"{report['checks']} checks, worst rel. error {report['worst']:.2e}")


def _interpreter_check() -> dict:
    torch.set_num_threads(1)
    import os

    os.environ["QERL_NVFP4_BACKEND"] = "fused"
    from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig

    from kernels import vllm_nvfp4_dequant as plugin
    from kernels.nvfp4 import reference as ref

    failures, checks, worst = [], 0, 0.0
    cls = plugin.fused_kernel_class()
    selected = cls.__name__ if cls.is_supported()[0] else cls.is_supported()[1]

    # a fused q/k/v layer as vLLM hands it over: packed codes, block scales, vLLM's collapsed
    # global scale, and the per-shard checkpoint scales the plugin stashed
    gen = torch.Generator().manual_seed(0)
    K, widths = 256, [32, 16, 16]
    shards = []
    for i, n in enumerate(widths):
        w = (torch.randn(n, K, generator=gen) * (1 + 2 * i)).bfloat16()
        shards.append(ref.quantize(w, ref.global_scale(w)))
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.cat([s.weight_packed for s in shards]), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(torch.cat([s.weight_scale for s in shards]), requires_grad=False)
    shard_gs = torch.cat([s.weight_global_scale.reshape(1) for s in shards])
    layer.weight_global_scale = torch.nn.Parameter((1 / shard_gs.max()).reshape(1), requires_grad=False)
    layer.qerl_shard_global_scale = shard_gs.clone()
    layer.logical_widths = widths
    layer.input_size_per_partition = K
    if torch.unique(shard_gs).numel() != 3:
        failures.append(f"the shards should have different global scales: {shard_gs.tolist()}")

    kernel = cls(NvFp4LinearLayerConfig())
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # vLLM loads under the model dtype
    try:
        kernel.process_weights_after_loading(layer)
    finally:
        torch.set_default_dtype(default)
    row_gs = torch.repeat_interleave(shard_gs, torch.tensor(widths))
    w_ref = plugin.dequantize_nvfp4(layer.weight.data, layer.weight_scale.data, row_gs, torch.float32)
    if not torch.equal(layer.qerl_row_global_scale, row_gs):
        failures.append("qerl_row_global_scale is not the shards' scales, row by row")
    bias = torch.randn(sum(widths), generator=gen).bfloat16()

    compiled = torch.compile(lambda x, b: kernel.apply_weights(layer, x, b), backend="aot_eager", fullgraph=True)
    for m in (1, 5, 16, 32, 40, 70):
        x = torch.randn(2, m, K, generator=gen).bfloat16()[0]  # [m, K], strided like a slice
        for b in (None, bias):
            want = x.float() @ w_ref.t() + (0 if b is None else b.float())
            for how, fn in (("eager", lambda x, b: kernel.apply_weights(layer, x, b)), ("compiled", compiled)):
                checks += 1
                got = fn(x, b)
                if got.dtype != torch.bfloat16 or tuple(got.shape) != (m, sum(widths)):
                    failures.append(f"M{m} {how}: {got.dtype} {tuple(got.shape)}")
                    continue
                err = float((got.float() - want).norm() / want.norm())
                worst = max(worst, err)
                if err > TOL:
                    failures.append(f"M{m} bias={b is not None} {how}: rel. error {err:.3e}")
    # a leading batch dim goes through reshape
    x = torch.randn(2, 3, K, generator=gen).bfloat16()
    checks += 1
    got = kernel.apply_weights(layer, x)
    err = float((got.float() - x.float() @ w_ref.t()).norm() / (x.float() @ w_ref.t()).norm())
    if tuple(got.shape) != (2, 3, sum(widths)) or err > TOL:
        failures.append(f"batched: {tuple(got.shape)} rel. error {err:.3e}")
    # one global scale for all shards would be visibly wrong (the check above has teeth)
    single = plugin.dequantize_nvfp4(layer.weight.data, layer.weight_scale.data, shard_gs.max().reshape(1),
                                     torch.float32)
    if float((single - w_ref).norm() / w_ref.norm()) < 10 * TOL:
        failures.append("a single global scale is as close as the per-shard ones: the test has no teeth")
    return {"checks": checks, "failures": failures, "worst": worst, "selected": selected}


if __name__ == "__main__" and sys.argv[1:] == ["--interpreter-check"]:
    print(json.dumps(_interpreter_check()))
