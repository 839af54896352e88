#!/bin/bash
# A device call for the swap kernel (written 2026-12-07, third session; run in the fourth on an H100,
# results in README.md), from the repo root: bash benchmarks/results/2026-12-07-swap/run.sh
# (~5 minutes; call with timeout_s 600; a call brings back at most 8 files). ncu of the first call (../2026-12-07-dw) showed ptxas issuing
# each step's weight and scale loads after the wgmma wait, so the next step's scale decode waited
# for them before its wgmma could issue. Two remedies, timed against the PREPACKED kernel and WS:
# * TMA_W: the weight's bytes and scales come through the TMA ring with the input (no global load
#   in a step; compiled offline: 174 registers, no spills);
# * two CTAs per SM (a 128-column tile with 3 stages, or 4 warps), so one fills the other's gaps.
set -u
export PYTHONUNBUFFERED=1
TMA='{"SWAP":true,"PREPACKED":true,"TMA_W":true}'
TMA128='{"SWAP":true,"PREPACKED":true,"TMA_W":true,"BN":128,"STAGES":3}'
TMAW4='{"SWAP":true,"PREPACKED":true,"TMA_W":true,"WARPS":4,"BN":128}'
B128='{"SWAP":true,"PREPACKED":true,"BN":128}'
SWP='{"SWAP":true,"PREPACKED":true}'
WS='{"WARP_SPECIALIZE":true}'
mkdir -p $OUT/x
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/gpu.txt 2>&1
# TMA_W has never run on a GPU: in a process of its own, so that a fault cannot take the baselines with it
timeout 200 python3 benchmarks/nvfp4_wgmma_check.py --configs "[$TMA, $TMA128, $TMAW4]" --m 4096 256 \
  --layer-step --out $OUT/check_tma.json > $OUT/check_tma.log 2>&1
timeout 150 python3 benchmarks/nvfp4_wgmma_check.py --skip-check --configs "[$B128, $SWP, $WS]" --m 4096 \
  --layer-step --out $OUT/check.json > $OUT/check.log 2>&1
# issue 4 (vLLM at 256 sequences): the WS kernel with split-K where 256 rows give too few tiles (q/o, qkv,
# down: 28-36 tiles of 256 x 128); the serving switch QERL_NVFP4_SERVING_WGMMA takes WS only at >= 1 tile per SM
timeout 90 python3 benchmarks/nvfp4_wgmma_check.py --skip-check --m 128 256 --configs \
  '[{"WARP_SPECIALIZE":true},{"WARP_SPECIALIZE":true,"SPLIT_K":2},{"WARP_SPECIALIZE":true,"SPLIT_K":4},{"WARP_SPECIALIZE":true,"SPLIT_K":8}]' \
  > $OUT/ws_split.log 2>&1
# decode sizes: with TMA_W the weight is STAGES steps ahead, so deeper rings
timeout 100 python3 benchmarks/nvfp4_wgmma_check.py --skip-check --m 16 64 --configs \
  '[{"SWAP":true,"BN":16,"WARPS":4,"SPLIT_K":4,"PREPACKED":true},{"SWAP":true,"BN":16,"WARPS":4,"SPLIT_K":4,"PREPACKED":true,"TMA_W":true},{"SWAP":true,"BN":16,"WARPS":4,"SPLIT_K":4,"STAGES":8,"PREPACKED":true,"TMA_W":true},{"SWAP":true,"BN":16,"WARPS":4,"SPLIT_K":2,"STAGES":8,"PREPACKED":true,"TMA_W":true},{"SWAP":true,"BN":32,"WARPS":4,"SPLIT_K":4,"STAGES":6,"PREPACKED":true,"TMA_W":true},{"SWAP":true,"BN":64,"WARPS":4,"SPLIT_K":4,"STAGES":6,"PREPACKED":true,"TMA_W":true}]' \
  > $OUT/small.log 2>&1
if [ $SECONDS -lt 470 ]; then
  timeout 60 ncu --clock-control none --kernel-name regex:'_swap_kernel' --launch-skip 1 --launch-count 1 \
    --set full --import-source yes -f -o $OUT/x/tma python3 benchmarks/results/2026-12-07-dw/ncu_target.py "$TMA" > $OUT/x/tma.ncu.log 2>&1
  ncu -i $OUT/x/tma.ncu-rep --page details > $OUT/ncu_tma.details.txt 2>&1
  ncu -i $OUT/x/tma.ncu-rep --page source --print-source sass --csv > $OUT/x/tma.source.csv 2>&1
  tar -C $OUT -czf $OUT/ncu.tar.gz x
fi
rm -rf $OUT/x
echo "# $SECONDS s"; for f in $OUT/*.log; do echo "== $f"; tail -n 4 $f; done
