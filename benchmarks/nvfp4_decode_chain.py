"""A decode step's NVFP4 GEMMs in one CUDA graph, as vLLM runs them: A/B of the serving op's switches.

Per layer of the Qwen2.5-7B shape (vLLM's merged projections): RMSNorm-like elementwise kernels,
qkv, o, a residual add, gate_up, SiLU·mul, down, all through `torch.ops.qerl.nvfp4_linear`, with
random packed weights per layer (so every GEMM reads its weight from HBM). The whole chain is
captured in one CUDA graph and replayed; it prints the median ms per replay for each setting of
QERL_NVFP4_PDL (programmatic dependent launch) and QERL_NVFP4_SCALE_PAIRS, and whether the
outputs of all settings are bit-identical (they must be: same arithmetic, same order).

    python benchmarks/nvfp4_decode_chain.py [--layers 28] [--m 1 16]

Needs a GPU (sm_90+ for PDL). It times only the GEMM chain and its glue, not attention or LoRA:
the gain it shows is an upper bound on what a switch buys inside vLLM (benchmarks/rollout.py).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H, INTER, QKV = 3584, 18944, 4608  # Qwen2.5-7B


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16], help="input rows (sequences in the batch)")
    ap.add_argument("--replays", type=int, default=20, help="graph replays per timing; 5 timings, median")
    args = ap.parse_args(argv)
    import torch

    from kernels.nvfp4 import gemm, serving

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    shapes = {"qkv": (QKV, H), "o": (H, H), "gate_up": (2 * INTER, H), "down": (H, INTER)}

    def weight(n, k):
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
        scale = (torch.rand(n, k // 16, device="cuda") * 2 + 0.1).to(torch.float8_e4m3fn)
        return packed, scale, torch.full((n,), 3.0, device="cuda")

    layers = [{name: weight(*shape) for name, shape in shapes.items()} for _ in range(args.layers)]
    norm_w = torch.randn(H, device="cuda").bfloat16()
    op = torch.ops.qerl.nvfp4_linear
    serving.prepare(torch.device("cuda"))

    def rms(h):
        return (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16() * norm_w

    def step(h):
        for w in layers:
            qkv = op(rms(h), *w["qkv"])
            h = h + op(qkv[:, :H] * 0.5, *w["o"])  # the slice and scale stand in for attention
            gu = op(rms(h), *w["gate_up"])
            h = h + op(torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:], *w["down"]) * 1e-3
        return h

    results = []
    for m in args.m:
        h0 = torch.randn(m, H, device="cuda").bfloat16() * 0.1
        outs = {}
        for pdl, pairs in itertools.product((False, True), (False, True)):
            os.environ[serving.PDL_ENV] = "1" if pdl else "0"
            gemm.SCALE_PAIRS_DEFAULT = pairs
            step(h0)  # compiles
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step(h0)
            graph.replay()
            torch.cuda.synchronize()
            outs[(pdl, pairs)] = out.clone()
            times = []
            for _ in range(5):
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
                for _ in range(args.replays):
                    graph.replay()
                t1.record()
                torch.cuda.synchronize()
                times.append(t0.elapsed_time(t1) / args.replays)
            del graph
            row = dict(m=m, layers=args.layers, pdl=pdl, scale_pairs=pairs, ms=round(sorted(times)[2], 4))
            results.append(row)
            print(json.dumps(row), flush=True)
        first = next(iter(outs.values()))
        same = all(torch.equal(o, first) for o in outs.values())
        print(json.dumps(dict(m=m, identical_outputs=same, finite=bool(torch.isfinite(first).all()))), flush=True)
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
