#!/bin/bash
# The device calls of 2026-12-07, sixth session, from the project root on one warm machine.
# STEP=kernels: the serving sweep (decode kernels with RING_S, M = 1, 8, 16) on this card, its
#   winners merged into a copy of the serving table at /tmp/table.json (~6 min).
# STEP=ncu: the PINGPONG ncu source page and register/tile sweep (../2026-12-07-pingpong/run2.sh).
# STEP=rollout (after the vLLM kit's nine chunk calls): BACKENDS (default fused,bf16,dequant) at CONC (default
#   1,16,64,256) sequences with sampled-token logprobs, fused on /tmp/table.json, and where one
#   decode step's GPU time goes at 1 sequence (--profile 1).
set -u
export PYTHONUNBUFFERED=1
if [ "$STEP" = kernels ]; then
  export PYTHONPATH=$PWD
  nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
  BW=4.245e12; grep -q H100 $OUT/gpu.txt && BW=3.35e12
  cp kernels/nvfp4/serving_configs.json /tmp/table.json
  timeout 330 python3 benchmarks/nvfp4_gemm_sweep.py --grid decode-ring-s serving --jobs 14 --bandwidth $BW --rep 20 \
    --out $OUT/sweep_rs.json --serving-table /tmp/table.json > $OUT/sweep_rs.log 2>&1; echo "sweep rc $?"
  cp /tmp/table.json $OUT/serving_configs.json
  sed -n '/Best correct/,$p' $OUT/sweep_rs.log | cut -c1-160
fi
if [ "$STEP" = ncu ]; then
  bash benchmarks/results/2026-12-07-pingpong/run2.sh
fi
if [ "$STEP" = rollout ]; then
  source /tmp/vk/c1/setup.sh > /tmp/setup.log 2>&1 || { tail -20 /tmp/setup.log; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
  [ -f /tmp/table.json ] && export QERL_NVFP4_SERVING_CONFIGS=/tmp/table.json
  nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu_rollout.txt; cat $OUT/gpu_rollout.txt
  echo "serving table: ${QERL_NVFP4_SERVING_CONFIGS:-committed}"
  python3 benchmarks/rollout.py --backends ${BACKENDS:-fused,bf16,dequant} --concurrency ${CONC:-1,16,64,256} --budget-s 150 \
    --profile 1 --out /tmp/rb --write-table 2>&1 | grep -v -E "INFO|it/s\]" > $OUT/rollout.log
  grep -E "tok/s|\||c=|rror|profile" $OUT/rollout.log | tail -40
  cp /tmp/rb/results-*.json components/rollout/backend_throughput.json $OUT/ 2>/dev/null
fi
