# The two device scripts of 2026-12-06 evening (devrun/k1.sh, then devrun/roll.sh), from the project root
# decode kernel: correctness, then the sweep against the serving table's configs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv | tee $OUT/gpu.txt
BW=4.245e12; grep -q H100 $OUT/gpu.txt && BW=3.35e12
python3 -c "import triton; print(triton.__version__)"
timeout 200 python3 benchmarks/nvfp4_decode_check.py > $OUT/decode_check.log 2>&1; echo "check rc $?"
tail -5 $OUT/decode_check.log; grep -c BAD $OUT/decode_check.log; grep -m3 -A3 ERROR $OUT/decode_check.log | cut -c1-1500
timeout 330 python3 benchmarks/nvfp4_gemm_sweep.py --grid decode serving --jobs 14 --bandwidth $BW --rep 20 \
   --out $OUT/sweep_decode.json > $OUT/sweep.log 2>&1; echo "sweep rc $?"
sed -n '/Best correct/,$p' $OUT/sweep.log
# vLLM rollouts with the decode kernel in the serving table (needs the kit under /tmp/vk)
source /tmp/vk/c1/setup.sh > /tmp/setup.log 2>&1 || { tail -20 /tmp/setup.log; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
if [ -n "$CHECK" ]; then
  timeout 240 python3 benchmarks/nvfp4_serving_check.py --m 1 2 7 8 9 16 17 > $OUT/serving_check.log 2>&1; echo "check rc $?"
  grep -E "BAD|cases" $OUT/serving_check.log; grep -m4 "ok " $OUT/serving_check.log | cut -c1-250
fi
tag=${BACKENDS//,/-}
python3 benchmarks/rollout.py --backends $BACKENDS --concurrency ${CONC:-1,16} --budget-s 150 --out /tmp/rb \
  --write-table 2>&1 | grep -v -E "INFO|it/s\]" > $OUT/rollout_$tag.log
grep -E "tok/s|\||c=|rror" $OUT/rollout_$tag.log | tail -25
cp /tmp/rb/results-*.json components/rollout/backend_throughput.json $OUT/ 2>/dev/null
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv | tee $OUT/gpu.txt
BW=4.245e12; grep -q H100 $OUT/gpu.txt && BW=3.35e12
timeout 200 python3 benchmarks/nvfp4_decode_check.py > $OUT/decode_check2.log 2>&1; echo "check rc $?"
tail -2 $OUT/decode_check2.log; grep -m3 -A3 -E "ERROR|BAD" $OUT/decode_check2.log | cut -c1-1500
timeout 360 python3 benchmarks/nvfp4_gemm_sweep.py --grid decode-ring serving --jobs 14 --bandwidth $BW --rep 20 \
   --out $OUT/sweep_ring.json > $OUT/sweep_ring.log 2>&1; echo "sweep rc $?"
sed -n '/Best correct/,$p' $OUT/sweep_ring.log | cut -c1-220
