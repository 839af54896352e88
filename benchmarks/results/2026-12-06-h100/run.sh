# Device calls of 2026-12-06 (H100), run from the project root as devrun/h100.sh: see README.md beside this file
# for the two commands. Needs the vLLM kit under /tmp/vk (../shared/tools/gpu-vllm).
source /tmp/vk/c1/setup.sh > /tmp/setup.log 2>&1 || { tail -20 /tmp/setup.log; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv > $OUT/gpu.txt
cat $OUT/gpu.txt
if [ "$1" = tune ]; then
  mkdir -p /tmp/lora-cfg
  python3 benchmarks/lora_kernels.py --shape qwen2.5-7b --rank 32 --out /tmp/lora-tune --jobs 14 \
      --install /tmp/lora-cfg 2>&1 | grep -v INFO > $OUT/lora_kernels.log
  tail -30 $OUT/lora_kernels.log
  cp /tmp/lora-tune/lora_kernels.json /tmp/lora-cfg/NVIDIA_H100* $OUT/
  ls -la /tmp/lora-cfg
else
  cp /tmp/lora-cfg/NVIDIA_H100* components/rollout/lora_configs/ || exit 1
  tag=${BACKENDS//,/-}
  python3 benchmarks/rollout.py --backends $BACKENDS --concurrency 1,16,64,256 --profile 1 --budget-s ${BUDGET:-200} \
      --out /tmp/rb 2>&1 | grep -v -E "INFO|it/s\]" > $OUT/rollout_$tag.log
  grep -E "tok/s|profile|\||c=" $OUT/rollout_$tag.log | tail -30
  cp /tmp/rb/results-*.json $OUT/
fi
