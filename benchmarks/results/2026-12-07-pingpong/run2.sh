#!/bin/bash
# Second device call for PINGPONG (2026-12-07, fifth session), from the repo root:
# bash benchmarks/results/2026-12-07-pingpong/run2.sh   (~2-3 minutes; call with timeout_s 240 or more)
# run.sh (H100): swap PINGPONG 75-81 % of cuBLAS on the big shapes (+6-8 points over TMA_W), and ncu puts
# 35 % of the stall cycles on the L1TEX (long) scoreboard. This call: where in the SASS the stalls sit
# (ncu source page), and the register cap / tile order of PINGPONG at M = 4096.
set -u
export PYTHONUNBUFFERED=1
PP='{"SWAP":true,"PREPACKED":true,"TMA_W":true,"PINGPONG":true}'
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv > $OUT/gpu2.txt 2>&1
timeout 90 ncu --clock-control none --kernel-name regex:'_swap_kernel' --launch-skip 1 --launch-count 1 \
  --set full --import-source yes -f -o $OUT/x/pp python3 benchmarks/results/2026-12-07-dw/ncu_target.py "$PP" > $OUT/x/pp.ncu.log 2>&1
ncu -i $OUT/x/pp.ncu-rep --csv --page raw > $OUT/x/raw.csv 2>&1
ncu -i $OUT/x/pp.ncu-rep --csv --page source --print-source sass > $OUT/x/sass.csv 2>&1
python3 benchmarks/results/2026-12-07-pingpong/ncu_sass.py $OUT/x/raw.csv $OUT/x/sass.csv 60 > $OUT/ncu_pp_sass.txt 2>&1
gzip -c $OUT/x/sass.csv > $OUT/ncu_pp_sass.csv.gz; gzip -c $OUT/x/raw.csv > $OUT/ncu_pp_raw.csv.gz
tail -5 $OUT/x/pp.ncu.log >> $OUT/ncu_pp_sass.txt
if [ $SECONDS -lt 120 ]; then
  timeout 70 python3 benchmarks/nvfp4_wgmma_check.py --skip-check --m 4096 --configs \
    "[$PP, {\"SWAP\":true,\"PREPACKED\":true,\"TMA_W\":true,\"PINGPONG\":true,\"PP_REGS\":240}, {\"SWAP\":true,\"PREPACKED\":true,\"TMA_W\":true,\"PINGPONG\":true,\"GROUP_M\":16}]" \
    > $OUT/sweep.log 2>&1
fi
rm -rf $OUT/x
echo "# $SECONDS s"; head -80 $OUT/ncu_pp_sass.txt; grep "^time" $OUT/sweep.log | head -30; tail -2 $OUT/sweep.log
