#!/bin/bash
# Device calls of 2026-12-07, seventh session (the LoRA expand in the fused kernel's epilogue), from
# the project root on one warm machine.
# STEP=check: the op with a LoRA against plain torch at the 7B shapes (eager, CUDA graph, compiled)
#   and its µs vs the GEMM alone and GEMM + a separate expand; the plain serving op re-checked (~2 min).
# STEP=rollout (after the vLLM kit's nine chunk calls): BACKENDS (default fused,bf16) at CONC (default
#   1,16) sequences with a decode profile at 1 and greedy tokens for the on/off comparison; EPI sets
#   QERL_NVFP4_LORA_EPILOGUE (default 1); results go to $OUT/epi$EPI/.
set -u
export PYTHONUNBUFFERED=1
if [ "$STEP" = check ]; then
  export PYTHONPATH=$PWD
  nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
  timeout 330 python3 benchmarks/nvfp4_lora_check.py > $OUT/lora_check.log 2>&1; echo "lora check rc $?"
  timeout 200 python3 benchmarks/nvfp4_serving_check.py --m 1 8 16 64 > $OUT/serving_check.log 2>&1
  echo "serving check rc $?"
  grep -v "^ok " $OUT/lora_check.log | tail -40; tail -3 $OUT/serving_check.log
fi
if [ "$STEP" = rollout ]; then
  source /tmp/vk/c1/setup.sh > /tmp/setup.log 2>&1 || { tail -20 /tmp/setup.log; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD QERL_NVFP4_LORA_EPILOGUE=${EPI:-1}
  nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu_rollout.txt; cat $OUT/gpu_rollout.txt
  mkdir -p $OUT/epi$QERL_NVFP4_LORA_EPILOGUE
  python3 benchmarks/rollout.py --backends ${BACKENDS:-fused,bf16} --concurrency ${CONC:-1,16} --budget-s 120 \
    --profile 1 --greedy-check 16 --out /tmp/rb$QERL_NVFP4_LORA_EPILOGUE 2>&1 | grep -v -E "INFO|it/s\]" \
    > $OUT/epi$QERL_NVFP4_LORA_EPILOGUE/rollout.log
  grep -E "tok/s|\||c=|rror|profile" $OUT/epi$QERL_NVFP4_LORA_EPILOGUE/rollout.log | tail -30
  cp /tmp/rb$QERL_NVFP4_LORA_EPILOGUE/results-*.json $OUT/epi$QERL_NVFP4_LORA_EPILOGUE/ 2>/dev/null
fi
