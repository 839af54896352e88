#!/bin/bash
# The device call of 2026-12-07 (second session), from the repo root: bash benchmarks/results/2026-12-07-dw/run.sh
# 1. correctness + timings: the WS kernel with one (WS) and two (DW8) decode warp groups, and the
#    swap kernel (kernels/nvfp4/swap_gemm.py, the weight as wgmma's register operand), its weight bytes
#    loaded one by one (SW) or PREPACKED (SWP: two 64-bit loads per thread and step);
# 2. the swap kernel at decode-sized M; 3. ncu of WS and swap on gate/up at M = 4096;
# 4. where the WS kernel's time goes (variants.py).
set -u
export PYTHONUNBUFFERED=1
D=benchmarks/results/2026-12-07-dw
WS='{"WARP_SPECIALIZE":true}'
DW8='{"WARP_SPECIALIZE":true,"DECODE_WARPS":8,"DECODE_REGS":88,"MAXNREG":128}'
SW='{"SWAP":true}'
SWP='{"SWAP":true,"PREPACKED":true}'
mkdir -p $OUT/x
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/gpu.txt 2>&1
timeout 320 python3 benchmarks/nvfp4_wgmma_check.py --configs "[$SWP, $SW, $WS, $DW8]" --m 4096 256 --layer-step \
  --out $OUT/check.json > $OUT/check.log 2>&1
# small M streams the weight: bytes in flight per SM decide, so split-K up to 16 (more CTAs per SM)
timeout 90 python3 benchmarks/nvfp4_wgmma_check.py --skip-check --m 16 64 --configs \
  '[{"SWAP":true,"BN":16,"WARPS":4,"SPLIT_K":4},{"SWAP":true,"BN":16,"WARPS":4,"SPLIT_K":4,"PREPACKED":true},{"SWAP":true,"BN":16,"WARPS":4,"SPLIT_K":8,"PREPACKED":true},{"SWAP":true,"BN":16,"WARPS":4,"SPLIT_K":16,"PREPACKED":true},{"SWAP":true,"BN":64,"WARPS":4,"SPLIT_K":4,"PREPACKED":true},{"SWAP":true,"BN":64,"WARPS":8,"SPLIT_K":8,"PREPACKED":true}]' \
  > $OUT/small.log 2>&1
# the rest only while the call has time left (a call ends at 600 s)
for name in ws swap; do
  [ $SECONDS -lt 400 ] || break
  cfg=$WS; [ $name = swap ] && cfg=$SWP
  timeout 60 ncu --clock-control none --kernel-name regex:'_ws_kernel|_swap_kernel' --launch-skip 1 --launch-count 1 \
    --set full --import-source yes -f -o $OUT/x/$name python3 $D/ncu_target.py "$cfg" > $OUT/x/$name.ncu.log 2>&1
  ncu -i $OUT/x/$name.ncu-rep --page details > $OUT/x/$name.details.txt 2>&1
  ncu -i $OUT/x/$name.ncu-rep --page source --print-source sass --csv > $OUT/x/$name.source.csv 2>&1
done
[ $SECONDS -lt 460 ] && timeout 60 python3 $D/variants.py "$WS" "$DW8" > $OUT/variants.log 2>&1
tar -C $OUT -czf $OUT/ncu.tar.gz x && rm -rf $OUT/x
echo "# $SECONDS s"; for f in $OUT/*.log; do echo "== $f"; tail -n 4 $f; done
