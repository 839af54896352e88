#!/bin/bash
# The second device call of 2026-12-07 (third session), from the repo root:
#   bash benchmarks/results/2026-12-07-swap/run.sh
# The swap kernel at two CTAs per SM (a 128-column tile with 8 warps, or 4 warps): ncu of the first
# call showed ptxas issuing each step's weight and scale loads after the wgmma wait, so the next
# step's scale decode waits for them before its wgmma can issue; a second CTA per SM can fill that.
# Cut to ~2 minutes: the session had ~5 minutes of device time left.
set -u
export PYTHONUNBUFFERED=1
B128='{"SWAP":true,"PREPACKED":true,"BN":128}'
W4='{"SWAP":true,"PREPACKED":true,"WARPS":4,"BN":128}'
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/gpu.txt 2>&1
timeout 130 python3 benchmarks/nvfp4_wgmma_check.py --configs "[$B128, $W4]" --m 4096 \
  --out $OUT/check.json > $OUT/check.log 2>&1
echo "# $SECONDS s"; grep -E "^time|checks ok" $OUT/check.log
