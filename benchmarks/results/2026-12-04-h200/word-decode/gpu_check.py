"""GPU correctness of forced configs: forward (K-permuted and not) and dX against the reference."""
import sys, json, torch
sys.path.insert(0, ".")
from kernels.nvfp4 import gemm, reference as ref
from tests.test_nvfp4_gemm import make_weight

torch.manual_seed(0)
cfgs = {
    "s16x64x128": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SWAP_AB=True, SPLIT_K=4, num_warps=4, num_stages=4),
    "s16x128x256": dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=256, SWAP_AB=True, SPLIT_K=2, num_warps=4, num_stages=3),
    "l128x128x64": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, SWAP_AB=True, SPLIT_K=1, num_warps=8, num_stages=3),
}
worst, bad = 0.0, []
for (n, k) in ((144, 1024), (3584, 3584), (512, 3584)):
    q = [t.cuda() for t in make_weight(n, k, n + k)]
    for m in (1, 5, 33, 300):
        x = torch.randn(m, k, device="cuda").bfloat16()
        dy = torch.randn(m, n, device="cuda").bfloat16()
        y_ref = gemm.reference_linear(x, *q).float()
        dx_ref = gemm.reference_grad_input(dy, *q).float()
        for name, c in cfgs.items():
            for perm in (True, False):
                y = gemm.linear_w4a16(x, *q, _config=dict(c, PERMUTE_K=perm)).float()
                e = float((y - y_ref).norm() / y_ref.norm())
                worst = max(worst, e)
                if e > 1e-2: bad.append(("fwd", n, k, m, name, perm, e))
            dx = gemm.grad_input_w4a16(dy, *q, _config=dict(c)).float()
            e = float((dx - dx_ref).norm() / dx_ref.norm())
            worst = max(worst, e)
            if e > 1e-2: bad.append(("dx", n, k, m, name, e))
        y = gemm.linear_w4a16(x, *q, _config=dict(GEMV=True, BLOCK_N=64, BLOCK_K=128, SPLIT_K=2)).float() if m == 1 else y_ref
        e = float((y - y_ref).norm() / y_ref.norm()); worst = max(worst, e)
        if e > 1e-2: bad.append(("gemv", n, k, m, e))
print(json.dumps({"worst": worst, "bad": bad[:20], "n_bad": len(bad)}))
