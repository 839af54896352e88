# The device scripts of this run, from the project root, on one warm machine.
# 1. (kernels) the decode kernel with the block scales through the ring (RING_S) against the serving
#    table's configs; the winners merged into a copy of the table at /tmp/table.json
if [ "$STEP" = kernels ]; then
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv | tee $OUT/gpu.txt
BW=4.245e12; grep -q H100 $OUT/gpu.txt && BW=3.35e12
python3 -c "import triton; print(triton.__version__)"
cp kernels/nvfp4/serving_configs.json /tmp/table.json
timeout 330 python3 benchmarks/nvfp4_gemm_sweep.py --grid decode-ring-s serving --jobs 14 --bandwidth $BW --rep 20 \
   --out $OUT/sweep_rs.json --serving-table /tmp/table.json > $OUT/sweep_rs.log 2>&1; echo "sweep rc $?"
cp /tmp/table.json $OUT/serving_configs.json
sed -n '/Best correct/,$p' $OUT/sweep_rs.log | cut -c1-200
fi
# 2. (rollout, after the vLLM kit's nine chunk calls) the backends in BACKENDS (run here:
#    fused,bf16,marlin), fused with that table, at 1, 16, 64 and 256 sequences, logprobs on
if [ "$STEP" = rollout ]; then
source /tmp/vk/c1/setup.sh > /tmp/setup.log 2>&1 || { tail -20 /tmp/setup.log; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 QERL_NVFP4_SERVING_CONFIGS=/tmp/table.json
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
python3 benchmarks/rollout.py --backends ${BACKENDS:-fused,bf16,dequant} --concurrency 1,16,64,256 --budget-s 150 \
  --out /tmp/rb --write-table 2>&1 | grep -v -E "INFO|it/s\]" > $OUT/rollout.log
grep -E "tok/s|\||c=|rror" $OUT/rollout.log | tail -30
cp /tmp/rb/results-*.json components/rollout/backend_throughput.json /tmp/table.json $OUT/ 2>/dev/null
fi
