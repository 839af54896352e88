"""The wgmma kernel with and without its decode, against cuBLAS (forward, M = 4096), from the repo root:

    sed 's/        d.store(_decode_tile(w, pairs, WR, WC, w_lay))/        pass  # no decode/' \
        kernels/nvfp4/wgmma_gemm.py > kernels/nvfp4/_wgmma_nodecode.py
    python3 benchmarks/results/2026-12-06-wgmma/nodecode.py; rm kernels/nvfp4/_wgmma_nodecode.py

Without the decode the wgmma reads whatever the bf16 buffers hold: a timing of the pipeline alone
(copies, barriers, async wgmma), not a result.
"""
import sys

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, ".")
from kernels.nvfp4 import _wgmma_nodecode as nd  # noqa: E402
from kernels.nvfp4 import global_scale, quantize  # noqa: E402
from kernels.nvfp4 import wgmma_gemm as wg  # noqa: E402

dev = "cuda"
for n, k in ((18944, 3584), (3584, 18944)):
    w = (torch.randn(n, k, device=dev) * 0.02).bfloat16()
    q = quantize(w, global_scale(w))
    x = torch.randn(4096, k, device=dev).bfloat16()
    for name, f in (("wgmma", lambda: wg.linear_wgmma(x, *q)), ("no-decode", lambda: nd.linear_wgmma(x, *q)),
                    ("cublas", lambda: x @ w.t())):
        f()
        print(n, k, name, round(do_bench_cudagraph(f, rep=50) * 1e3, 1), "us", flush=True)
