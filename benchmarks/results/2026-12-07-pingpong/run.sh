#!/bin/bash
# The device call for the swap kernel's PINGPONG variant (2026-12-07, fourth session), from the repo root:
# bash benchmarks/results/2026-12-07-pingpong/run.sh   (~3-6 minutes; call with timeout_s 600)
# ncu of TMA_W (../2026-12-07-swap) put half of the cycles between two issues in CTA-barrier stalls: the
# two warp groups wait for each other after every step, so the tensor cores idle while both sync and issue.
# PINGPONG runs each warp group in a partition of its own (gl.warp_specialize) and hands ring slots back by
# mbarrier: one multiplies while the other waits and issues its next wgmma. The same for the WS kernel of
# wgmma_gemm.py (WSPP: its two wgmma warp groups as partitions, each with its own input rows and ring).
set -u
export PYTHONUNBUFFERED=1
PP='{"SWAP":true,"PREPACKED":true,"TMA_W":true,"PINGPONG":true}'
PP128='{"SWAP":true,"PREPACKED":true,"TMA_W":true,"PINGPONG":true,"BN":128,"STAGES":6}'
WSPP='{"WARP_SPECIALIZE":true,"PINGPONG":true}'
TMA='{"SWAP":true,"PREPACKED":true,"TMA_W":true}'
WS='{"WARP_SPECIALIZE":true}'
mkdir -p $OUT/x
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/gpu.txt 2>&1
# PINGPONG has never run on a GPU: a process of its own (a fault or a hang cannot take the baselines with it)
timeout 160 python3 benchmarks/nvfp4_wgmma_check.py --configs "[$PP, $PP128, $WSPP]" --m 4096 \
  --layer-step --out $OUT/check_pp.json > $OUT/check_pp.log 2>&1
# the rest only while the call has time left (this session's device time is short)
if [ $SECONDS -lt 260 ]; then
  timeout 80 python3 benchmarks/nvfp4_wgmma_check.py --skip-check --configs "[$TMA, $WS]" --m 4096 \
    --layer-step --out $OUT/check.json > $OUT/check.log 2>&1
fi
# decode sizes: 128 weight rows per CTA in two partitions
if [ $SECONDS -lt 330 ]; then
  timeout 60 python3 benchmarks/nvfp4_wgmma_check.py --skip-check --m 16 --configs \
    '[{"SWAP":true,"BN":16,"WARPS":4,"SPLIT_K":4,"PREPACKED":true,"TMA_W":true},{"SWAP":true,"BN":16,"SPLIT_K":4,"STAGES":8,"PREPACKED":true,"TMA_W":true,"PINGPONG":true},{"SWAP":true,"BN":16,"SPLIT_K":8,"STAGES":8,"PREPACKED":true,"TMA_W":true,"PINGPONG":true}]' \
    > $OUT/small.log 2>&1
fi
if [ $SECONDS -lt 300 ]; then
  timeout 60 ncu --clock-control none --kernel-name regex:'_swap_kernel' --launch-skip 1 --launch-count 1 \
    --set full --import-source yes -f -o $OUT/x/pp python3 benchmarks/results/2026-12-07-dw/ncu_target.py "$PP" > $OUT/x/pp.ncu.log 2>&1
  ncu -i $OUT/x/pp.ncu-rep --page details > $OUT/ncu_pp.details.txt 2>&1
fi
rm -rf $OUT/x
echo "# $SECONDS s"; for f in $OUT/*.log; do echo "== $f"; grep -E "BAD|Error|error" $f | head -3; tail -n 3 $f; done
