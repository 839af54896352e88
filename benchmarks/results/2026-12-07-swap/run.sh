#!/bin/bash
# The second device call of 2026-12-07 (third session), from the repo root:
#   bash benchmarks/results/2026-12-07-swap/run.sh
# The swap kernel at two CTAs per SM (a 128-column tile, or one warp group): ncu of the first call
# showed ptxas issuing each step's weight and scale loads after the wgmma wait, so the next step's
# scale decode waits for them before its wgmma can issue; a second CTA per SM can fill that gap.
set -u
export PYTHONUNBUFFERED=1
SWP='{"SWAP":true,"PREPACKED":true}'
B128='{"SWAP":true,"PREPACKED":true,"BN":128}'
W4='{"SWAP":true,"PREPACKED":true,"WARPS":4,"BN":128}'
W4S3='{"SWAP":true,"PREPACKED":true,"WARPS":4,"BN":128,"STAGES":3}'
WS='{"WARP_SPECIALIZE":true}'
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/gpu.txt 2>&1
timeout 300 python3 benchmarks/nvfp4_wgmma_check.py --configs "[$B128, $W4, $W4S3, $SWP, $WS]" --m 4096 256 --layer-step \
  --out $OUT/check.json > $OUT/check.log 2>&1
timeout 120 python3 benchmarks/nvfp4_wgmma_check.py --skip-check --m 16 64 --configs \
  '[{"SWAP":true,"BN":16,"WARPS":4,"SPLIT_K":4,"PREPACKED":true},{"SWAP":true,"BN":16,"WARPS":4,"SPLIT_K":2,"PREPACKED":true},{"SWAP":true,"BN":16,"WARPS":4,"SPLIT_K":4,"STAGES":2,"PREPACKED":true},{"SWAP":true,"BN":32,"WARPS":4,"SPLIT_K":4,"PREPACKED":true},{"SWAP":true,"BN":64,"WARPS":4,"SPLIT_K":2,"PREPACKED":true}]' \
  > $OUT/small.log 2>&1
echo "# $SECONDS s"; for f in $OUT/*.log; do echo "== $f"; tail -n 3 $f; done
