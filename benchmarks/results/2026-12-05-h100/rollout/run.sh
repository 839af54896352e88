# usage: TAGS="pdl1 pdl0" bash devrun/rollout.sh   (fused backend, PDL on / off)
source /tmp/vk/c1/setup.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
for tag in $TAGS; do
  pdl=${tag#pdl}
  QERL_NVFP4_SCALE_PAIRS=${SP:-1} QERL_NVFP4_PDL=$pdl timeout 280 python3 benchmarks/rollout.py --backends ${BACKENDS:-fused} --concurrency ${CONC:-1,16} \
     --profile ${PROFILE:-1} --out /tmp/rb_$tag > $OUT/rollout_$tag.log 2>&1
  cp /tmp/rb_$tag/results-*.json $OUT/ 2>/dev/null; for f in $OUT/results-*.json; do mv -n $f ${f%.json}-$tag.json 2>/dev/null; done
  grep -E 'tok/s|fused|step|GEMM|busy' $OUT/rollout_$tag.log | tail -20
done
