"""Where the warp-specialized wgmma kernel's time goes (forward, M = 4096, 7B gate/up and down), from
the repo root: `python3 benchmarks/results/2026-12-07-dw/variants.py [CONFIG_JSON ...]`.

For each config it times, against cuBLAS on the bf16 weight, three copies of `wgmma_gemm.py`
made by text replacement (written next to it as `_ws_variant_*.py`, removed at the end):
* `as is`;
* `cheap decode`: the E2M1 decode's 17 instructions per word replaced by 1 (an `and` whose result
  is moved into the 8 outputs): the same loads, pairing and stores, without the decode arithmetic;
* `no decode`: the decode warps copy the packed weight and scales and hand the buffers over as
  before, but neither decode nor store them.
The variants compute garbage: timings of the pipeline, not results.
"""
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from kernels.nvfp4 import global_scale, quantize  # noqa: E402

SRC = (ROOT / "kernels/nvfp4/wgmma_gemm.py").read_text()
CHEAP = '"\\n{\\n.reg .b32 x;\\nand.b32 x, $8, $9;\\nmov.b32 {$0, $1}, x;\\nmov.b32 {$2, $3}, x;\\n' \
        'mov.b32 {$4, $5}, x;\\nmov.b32 {$6, $7}, x;\\n}\\n"'
VARIANTS = {
    "as_is": [],
    "cheap_decode": [("_DECODE_WORD_ASM.value, \"=h,=h,=h,=h,=h,=h,=h,=h,r,r\"",
                      CHEAP + ", \"=h,=h,=h,=h,=h,=h,=h,=h,r,r\"")],
    "no_decode": [("            v = _decode_tile(w_ring.index(slot).load(w_lay), s_ring.index(slot).load(p_lay), "
                   "WR, WC, w_lay)\n", ""),
                  ("            d_ring.index(i % ND).store(v)\n", "")],
}


def load_variant(name, edits):
    src = SRC
    for old, new in edits:
        assert src.count(old) == 1, (name, old)
        src = src.replace(old, new)
    path = ROOT / f"kernels/nvfp4/_ws_variant_{name}.py"
    path.write_text(src)
    import importlib
    return importlib.import_module(f"kernels.nvfp4._ws_variant_{name}"), path


def main():
    configs = [json.loads(c) for c in sys.argv[1:]] or [{"WARP_SPECIALIZE": True}]
    mods, paths = {}, []
    try:
        for name, edits in VARIANTS.items():
            mods[name], p = load_variant(name, edits)
            paths.append(p)
        for n, k in ((18944, 3584), (3584, 18944)):
            w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
            q = quantize(w, global_scale(w))
            x = torch.randn(4096, k, device="cuda").bfloat16()
            f = lambda: x @ w.t()  # noqa: E731
            f()
            print(f"{n}x{k} cuBLAS {do_bench_cudagraph(f, rep=50) * 1e3:.1f} us", flush=True)
            for cfg in configs:
                for name, mod in mods.items():
                    f = lambda m=mod, c=cfg: m.linear_wgmma(x, *q, cfg=c)  # noqa: E731
                    f()
                    print(f"{n}x{k} {json.dumps(cfg)} {name} {do_bench_cudagraph(f, rep=50) * 1e3:.1f} us", flush=True)
    finally:
        for p in paths:
            p.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
