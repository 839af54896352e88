#!/bin/bash
# Device calls of 2026-12-07, seventh session (the LoRA expand in the fused kernel's epilogue), from
# the project root on one warm machine.
# STEP=check: the op with a LoRA against plain torch at the 7B shapes (eager, CUDA graph, compiled)
#   and its µs vs the GEMM alone and GEMM + a separate expand; the plain serving op re-checked (~2 min).
# STEP=rollout (after the vLLM kit's nine chunk calls): the fused backend once per LoRA mode in EPIS
#   (QERL_NVFP4_LORA_EPILOGUE values, default "1 0"), then bf16 (BF16=0 skips it), at CONC (default
#   1,16) sequences with a decode profile at 1 and greedy tokens for the modes' comparison; results go
#   to $OUT/epi$E/ (bf16 under epi0/). ~7-9 min (bf16 last: the one cut if the call's 600 s run out).
set -u
export PYTHONUNBUFFERED=1
if [ "${STEP:-}" = check ]; then
  export PYTHONPATH=$PWD
  nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
  timeout ${CHECK_S:-330} python3 benchmarks/nvfp4_lora_check.py ${CHECK_ARGS:-} > $OUT/lora_check.log 2>&1
  echo "lora check rc $?"
  grep -v "^ok " $OUT/lora_check.log | tail -40
  if [ "${SERVING:-1}" = 1 ]; then
    timeout 200 python3 benchmarks/nvfp4_serving_check.py --m 1 8 16 64 > $OUT/serving_check.log 2>&1
    echo "serving check rc $?"; tail -3 $OUT/serving_check.log
  fi
fi
if [ "${STEP:-}" = rollout ]; then
  source /tmp/vk/c1/setup.sh > /tmp/setup.log 2>&1 || { tail -20 /tmp/setup.log; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
  nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu_rollout.txt; cat $OUT/gpu_rollout.txt
  bench() {  # $1: QERL_NVFP4_LORA_EPILOGUE, $2: backends; one engine per backend, each in its own process
    mkdir -p $OUT/epi$1
    QERL_NVFP4_LORA_EPILOGUE=$1 python3 benchmarks/rollout.py --backends $2 --concurrency ${CONC:-1,16} \
      --budget-s 120 --profile 1 --greedy-check 16 --out /tmp/rb$1 2>&1 | grep -v -E "INFO|it/s\]" >> $OUT/epi$1/rollout.log
    grep -E "tok/s|\||c=|rror|profile" $OUT/epi$1/rollout.log | tail -30
    cp /tmp/rb$1/results-*.json $OUT/epi$1/ 2>/dev/null
  }
  for e in ${EPIS:-1 0}; do bench $e fused; done  # the fused backend with each LoRA mode
  if [ "${BF16:-1}" = 1 ]; then bench 0 bf16; fi   # the baseline (the LoRA mode is the fused backend's only)
fi
