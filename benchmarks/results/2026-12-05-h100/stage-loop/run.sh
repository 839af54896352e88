# One RL loop of the stages on the GPU: rollout(i0, marlin/auto, no adapter) -> reward -> train(i0)
# -> rollout(i1, adapter, AQN 0.01, T 0.8, dequant backend) -> reward -> train(i1, mismatch at T 0.8).
source /tmp/vk/c1/setup.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import vllm, math_verify; print('vllm', vllm.__version__)" || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
G=/tmp/g; mkdir -p $G
parts=$(for f in /tmp/vk/c*/smol.part*; do echo "$(basename $f) $f"; done | sort | cut -d' ' -f2)
[ -d $G/smollm2-nvfp4 ] || cat $parts | tar -x -C $G || exit 1
M=$G/smollm2-nvfp4; R=$G/run; P=devrun/prompts
C="--model $M --prompts $P --prompts-per-iteration 32 --samples 8 --max-tokens 256 --max-lora-rank 32"
RW="--reward gsm8k:1.0 format:0.1"
step() { name=$1; shift; t0=$(date +%s); "$@" > $OUT/$name.log 2>&1; rc=$?; echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"; grep -E "kernel|backend|Error|error|LoRA|AQN|tok/s" $OUT/$name.log | grep -v Warning | tail -8; return $rc; }
step rollout0 python3 -m components.rollout $C --iteration 0 --output $R/i0/rollouts/shard-000-of-001 || exit 1
step reward0 python3 -m components.reward --rollouts $R/i0/rollouts --output $R/i0/rewards $RW || exit 1
step train0 python3 -m components.train --model $M --rollouts $R/i0/rollouts --rewards $R/i0/rewards --output $R/i0/adapter --iteration 0 --lora-rank 32 --lr 2e-5 || exit 1
step rollout1 python3 -m components.rollout $C --iteration 1 --adapter $R/i0/adapter --aqn-sigma 0.01 --temperature 0.8 --nvfp4-backend dequant --output $R/i1/rollouts/shard-000-of-001 || exit 1
step reward1 python3 -m components.reward --rollouts $R/i1/rollouts --output $R/i1/rewards $RW
step train1 timeout 120 python3 -m components.train --model $M --rollouts $R/i1/rollouts --rewards $R/i1/rewards --output $R/i1/adapter --iteration 1 --adapter $R/i0/adapter --state $R/i0/adapter --lora-rank 32 --lr 2e-5
for a in i0/rollouts/shard-000-of-001 i0/adapter i1/rollouts/shard-000-of-001 i1/adapter; do
  [ -f $R/$a/metrics.json ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('epochs',None); print(sys.argv[2], json.dumps(d))" $R/$a/metrics.json $a
done | tee $OUT/metrics.txt
