"""Check the Gluon decode kernel (kernels/nvfp4/decode_gemm.py) against the reference on a GPU.

    python benchmarks/nvfp4_decode_check.py

Every config of RW 1/2 × KV 1/2 × 1/4 warps × split 1/3/8 (split 8 leaves a split empty on
K = 3584) × weight in registers or through a 4-stage shared-memory ring (STAGES 0/4), and RW 1
with the block scales through a ring of 3 or 4 stages as well (RING_S), on three shapes,
M = 1, 2, 5, 8, 9 and 16, with one global scale or one per row plus a bias, and block scales
of 0, e4m3 subnormals and 448 planted. Prints the failures and the
M = 1 / 16 cases at split 3; exits 1 on any relative error ≥ 1e-2 (bf16 output: ~2e-3).
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [("small", 256, 1024), ("qkv", 4608, 3584), ("down", 3584, 18944)]


def main() -> int:
    import torch

    from kernels.nvfp4 import dequantize, gemm, global_scale, quantize

    if not torch.cuda.is_available():
        print("nvfp4_decode_check: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bad = 0
    cfgs = [dict(DECODE=True, RW=rw, KV=kv, num_warps=w, SPLIT_K=sp, STAGES=st)
            for rw, kv, w, sp, st in itertools.product((1, 2), (1, 2), (1, 4), (1, 3, 8), (0, 4))]
    cfgs += [dict(DECODE=True, RW=1, KV=kv, num_warps=w, SPLIT_K=sp, STAGES=st, RING_S=True)
             for kv, w, sp, st in itertools.product((1, 2), (1, 4), (1, 3, 8), (3, 4))]
    for name, n, k in SHAPES:
        w = (torch.randn(n, k, device=dev) * 0.02).bfloat16()
        packed, scale, g = quantize(w, global_scale(w))
        sb = scale.view(torch.uint8)
        sb[::7, ::3] = 0  # zero scales: the codes stay, the weights must be zero
        sb[1::5, 1::4] = torch.randint(1, 8, sb[1::5, 1::4].shape, device=dev, dtype=torch.uint8)  # subnormals
        sb[2::9, 2::5] = 0x7E  # 448
        for per_row in (False, True):
            gg = g.reshape(1).repeat(n) * torch.linspace(0.5, 1.5, n, device=dev) if per_row else g.reshape(1)
            bias = torch.randn(n, device=dev).bfloat16() if per_row else None
            wf = dequantize(packed, scale, torch.ones(1, device=dev), torch.float32) / gg.reshape(-1, 1)
            for m in (1, 2, 5, 8, 9, 16):
                x = torch.randn(m, k, device=dev).bfloat16()
                want = x.float() @ wf.t() + (0 if bias is None else bias.float())
                for cfg in cfgs:
                    if n % (16 * cfg["RW"] * cfg["num_warps"]) or k % (128 * cfg["KV"]):
                        continue
                    try:
                        got = gemm.linear_w4a16(x, packed, scale, gg, bias, _config=dict(cfg)).float()
                        err = float((got - want).norm() / want.norm())
                    except Exception as e:  # noqa: BLE001 - reported as a failure with its config
                        err = float("nan")
                        print("ERROR", name, m, cfg, type(e).__name__, str(e)[:2000])
                    ok = err < 1e-2
                    bad += not ok
                    if not ok or (m in (1, 16) and cfg["SPLIT_K"] == 3):
                        print(f"{'ok ' if ok else 'BAD'} {name} M={m} per_row={per_row} {cfg}: {err:.2e}", flush=True)
    print(f"{bad} bad")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
