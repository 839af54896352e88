export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 benchmarks/nvfp4_gemm_sweep.py --grid tc-m1 --out $OUT/base.json > $OUT/base.log 2>&1; echo "base rc $?"
python3 - <<'PY'
from pathlib import Path
p = Path("kernels/nvfp4/gemm.py")
s = p.read_text()
old = "w = _decode_tile_kperm(b, sc, BLOCK_N, GW, GPU_MATH)  # [BN, BK], order p"
assert old in s
p.write_text(s.replace(old, "w = _decode_tile_kperm(b, sc, BLOCK_N, GW, GPU_MATH) + _decode_tile_kperm(b ^ 17, sc, BLOCK_N, GW, GPU_MATH)"))
PY
python3 benchmarks/nvfp4_gemm_sweep.py --grid tc-m1 --out $OUT/double.json > $OUT/double.log 2>&1; echo "double rc $?"
python3 - <<'PY'
import json, os
o = os.environ["OUT"]
a = json.load(open(f"{o}/base.json")); b = json.load(open(f"{o}/double.json"))
for x, y in zip(a, b):
    if x["kernel"] == "nvfp4":
        print(x["shape"], x["BLOCK_N"], x["SPLIT_K"], x.get("us"), "->", y.get("us"), y.get("rel_err"))
PY
