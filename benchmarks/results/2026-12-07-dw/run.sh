#!/bin/bash
# The device call of 2026-12-07 (second session): two decode warp groups (DECODE_WARPS 8), the
# split-K question at 256 rows, where the WS kernel's time goes (variants.py) and an ncu run.
# From the repo root: bash benchmarks/results/2026-12-07-dw/run.sh  (writes $OUT)
set -u
export PYTHONUNBUFFERED=1
D=benchmarks/results/2026-12-07-dw
WS='{"WARP_SPECIALIZE":true}'
DW8='{"WARP_SPECIALIZE":true,"DECODE_WARPS":8,"DECODE_REGS":88,"MAXNREG":128}'
mkdir -p $OUT/x
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/gpu.txt 2>&1
timeout 330 python3 benchmarks/nvfp4_wgmma_check.py --configs "[$WS, $DW8]" --m 4096 256 --layer-step \
  --out $OUT/dw8.json > $OUT/dw8.log 2>&1
timeout 100 python3 $D/variants.py "$WS" "$DW8" > $OUT/variants.log 2>&1
timeout 90 python3 benchmarks/nvfp4_wgmma_check.py --skip-check --m 256 --configs \
  "[{}, {\"SPLIT_K\": 4}, {\"WARP_SPECIALIZE\": true, \"SPLIT_K\": 4}, ${DW8%\}}, \"SPLIT_K\": 4}]" \
  > $OUT/split.log 2>&1
for name in ws dw8; do
  cfg=$WS; [ $name = dw8 ] && cfg=$DW8
  timeout 75 ncu --clock-control none --kernel-name regex:_ws_kernel --launch-skip 1 --launch-count 1 \
    --set full --import-source yes -f -o $OUT/x/$name python3 $D/ncu_target.py "$cfg" > $OUT/x/$name.ncu.log 2>&1
  ncu -i $OUT/x/$name.ncu-rep --page details > $OUT/x/$name.details.txt 2>&1
  ncu -i $OUT/x/$name.ncu-rep --page source --print-source sass --csv > $OUT/x/$name.source.csv 2>&1
done
tar -C $OUT -czf $OUT/ncu.tar.gz x && rm -rf $OUT/x
tail -5 $OUT/dw8.log $OUT/variants.log $OUT/split.log
