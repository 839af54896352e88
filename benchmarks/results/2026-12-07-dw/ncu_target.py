"""One warm-up and one profiled call of a wgmma-family kernel (forward, 7B gate/up, M = 4096) for ncu:
`ncu --kernel-name regex:'_ws_kernel|_swap_kernel' --launch-skip 1 --launch-count 1 ... \
    python3 ncu_target.py CONFIG_JSON`."""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks.nvfp4_wgmma_check import Kernels  # noqa: E402
from kernels.nvfp4 import global_scale, quantize  # noqa: E402

cfg = json.loads(sys.argv[1])
w = (torch.randn(18944, 3584, device="cuda") * 0.02).bfloat16()
q = quantize(w, global_scale(w))
x = torch.randn(4096, 3584, device="cuda").bfloat16()
kernels = Kernels()
for _ in range(2):
    kernels.linear_wgmma(x, *q, cfg=cfg)
torch.cuda.synchronize()
