#!/bin/bash
# The device call for the swap kernel's PRODUCER variant (2026-12-08), from the repo root, one Hopper GPU:
# bash benchmarks/results/2026-12-08-producer/run.sh   (~3-5 minutes expected; call with timeout_s 480 or more)
# run2.sh of ../2026-12-07-pingpong (ncu source page, H100) put 28 % of swap PINGPONG's stall samples on the
# `ready` wait of both wgmma partitions: the ring runs dry, half 0 refilling each slot a step late. PRODUCER
# adds a third partition, one warp, that only issues the ring's TMA loads as soon as both halves released a
# slot. It has never run on a GPU: first a process of its own that checks it against the reference (a fault
# or a hang cannot take the baselines with it), then PINGPONG and PRODUCER timed in one process (same card,
# same cuBLAS), then, time permitting, ncu's source page of PRODUCER (did the `ready` wait shrink?).
set -u
# at most 8 files come back from $OUT: gpu.txt, check_pr.{log,json}, check_sk.log, time.log and ncu's three
export PYTHONUNBUFFERED=1
PP='{"SWAP":true,"PREPACKED":true,"TMA_W":true,"PINGPONG":true}'
PR='{"SWAP":true,"PREPACKED":true,"TMA_W":true,"PINGPONG":true,"PRODUCER":true}'
PR128='{"SWAP":true,"PREPACKED":true,"TMA_W":true,"PINGPONG":true,"PRODUCER":true,"BN":128,"STAGES":6}'
PR240='{"SWAP":true,"PREPACKED":true,"TMA_W":true,"PINGPONG":true,"PRODUCER":true,"PP_REGS":240}'
PRSK='{"SWAP":true,"PREPACKED":true,"TMA_W":true,"PINGPONG":true,"PRODUCER":true,"BN":16,"STAGES":8,"SPLIT_K":4}'
mkdir -p $OUT/x
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/gpu.txt 2>&1
# passed LOG: every check line ok and the summary printed (it prints "0/78 checks ok" too)
passed() { grep -q "^check " $1 && ! grep -q BAD $1 && grep -q "checks ok" $1; }
# 1. correctness (learner and vLLM shapes, M = 1, 16, 33, 64, 200, ... as nvfp4_wgmma_check.py picks); timed
#    only at 16 rows here so that the summary comes soon (step 2 times 256 and 4096)
timeout 200 python3 benchmarks/nvfp4_wgmma_check.py --configs "[$PR, $PR128]" --m 16 \
  --out $OUT/check_pr.json > $OUT/check_pr.log 2>&1
echo "check rc $?" >> $OUT/check_pr.log
# 1b. split-K (4 splits: the producer's ring per split, the split-K epilogue), decode-sized tiles, timed at M = 16
if passed $OUT/check_pr.log && [ $SECONDS -lt 220 ]; then
  timeout 90 python3 benchmarks/nvfp4_wgmma_check.py --configs "[$PRSK]" --m 16 > $OUT/check_sk.log 2>&1
  echo "check rc $?" >> $OUT/check_sk.log
fi
# 2. only if every check passed: PINGPONG (the baseline) and PRODUCER in one process, no checks
if passed $OUT/check_pr.log && [ $SECONDS -lt 300 ]; then
  timeout 150 python3 benchmarks/nvfp4_wgmma_check.py --skip-check --configs "[$PP, $PR, $PR240]" --m 256 4096 \
    > $OUT/time.log 2>&1
  echo "time rc $?" >> $OUT/time.log
fi
# 3. ncu source page of PRODUCER on gate/up at M = 4096 (as run2.sh did for PINGPONG)
if passed $OUT/check_pr.log && [ $SECONDS -lt 360 ]; then
  timeout 90 ncu --clock-control none --kernel-name regex:'_swap_kernel' --launch-skip 1 --launch-count 1 \
    --set full --import-source yes -f -o $OUT/x/pr python3 benchmarks/results/2026-12-07-dw/ncu_target.py "$PR" \
    > $OUT/x/pr.ncu.log 2>&1
  timeout 60 ncu -i $OUT/x/pr.ncu-rep --csv --page raw > $OUT/x/raw.csv 2>&1
  timeout 60 ncu -i $OUT/x/pr.ncu-rep --csv --page source --print-source sass > $OUT/x/sass.csv 2>&1
  python3 benchmarks/results/2026-12-07-pingpong/ncu_sass.py $OUT/x/raw.csv $OUT/x/sass.csv 60 > $OUT/ncu_pr_sass.txt 2>&1
  gzip -c $OUT/x/sass.csv > $OUT/ncu_pr_sass.csv.gz; gzip -c $OUT/x/raw.csv > $OUT/ncu_pr_raw.csv.gz
  tail -5 $OUT/x/pr.ncu.log >> $OUT/ncu_pr_sass.txt
fi
rm -rf $OUT/x
echo "# $SECONDS s"; cat $OUT/gpu.txt
for f in $OUT/*.log; do echo "== $f"; grep -E "BAD|Error|error|Timeout" $f | head -3; tail -n 3 $f; done
grep -h "^time fwd .*M= 4096" $OUT/time.log 2>/dev/null | sed 's/ TFLOP.*cuBLAS / | cuBLAS /' | head -30
head -40 $OUT/ncu_pr_sass.txt 2>/dev/null
