"""GPU correctness of forced configs: forward (K-permuted and not), dX and the GEMV against the
reference. Run from the repository root: python3 benchmarks/results/2026-12-04-h200/word-decode/gpu_check.py"""
import json
import sys

import torch

sys.path.insert(0, ".")
from kernels.nvfp4 import gemm  # noqa: E402
from tests.test_nvfp4_gemm import make_weight  # noqa: E402

torch.manual_seed(0)
CONFIGS = {
    "s16x64x128": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SWAP_AB=True, SPLIT_K=4, num_warps=4, num_stages=4),
    "s16x128x256": dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=256, SWAP_AB=True, SPLIT_K=2, num_warps=4, num_stages=3),
    "l128x128x64": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, SWAP_AB=True, SPLIT_K=1, num_warps=8, num_stages=3),
}
GEMV = dict(GEMV=True, BLOCK_N=64, BLOCK_K=128, SPLIT_K=2)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


worst, bad = 0.0, []
for n, k in ((144, 1024), (3584, 3584), (512, 3584)):
    q = [t.cuda() for t in make_weight(n, k, n + k)]
    for m in (1, 5, 33, 300):
        x = torch.randn(m, k, device="cuda").bfloat16()
        dy = torch.randn(m, n, device="cuda").bfloat16()
        y_ref = gemm.reference_linear(x, *q).float()
        dx_ref = gemm.reference_grad_input(dy, *q).float()
        cases = [(("fwd", name, perm), lambda c=c, perm=perm: gemm.linear_w4a16(x, *q, _config=dict(c, PERMUTE_K=perm)),
                  y_ref) for name, c in CONFIGS.items() for perm in (True, False)]
        cases += [(("dx", name), lambda c=c: gemm.grad_input_w4a16(dy, *q, _config=dict(c)), dx_ref)
                  for name, c in CONFIGS.items()]
        if m == 1:
            cases.append((("gemv",), lambda: gemm.linear_w4a16(x, *q, _config=dict(GEMV)), y_ref))
        for tag, run, want in cases:
            e = rel(run(), want)
            worst = max(worst, e)
            if e > 1e-2:
                bad.append((*tag, n, k, m, e))
print(json.dumps({"worst": worst, "bad": bad[:20], "n_bad": len(bad)}))
