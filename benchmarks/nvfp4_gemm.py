"""Benchmark the NVFP4 W4A16 GEMMs (kernels/nvfp4/gemm.py) against cuBLAS bf16 on a GPU.

For each Qwen2.5-7B linear shape and each M it checks correctness against the plain-torch
reference (outputs poisoned with NaN first), then times with triton.testing.do_bench
(median), rotating among several input/weight sets so neither the weight nor the activation
sits in L2 between calls:

  fwd:  linear_w4a16(x, W)      vs  x @ Ŵᵀ   (cuBLAS, bf16 Ŵ)
  dX:   grad_input_w4a16(dy, W) vs  dy @ Ŵ

Reported per row: time, TFLOP/s (2·M·N·K), GB/s of the bytes the kernel must move
(packed weight + e4m3 scales + input + output; bf16 weight + input + output for cuBLAS),
that bandwidth as % of a measured device-to-device copy (read + write bytes counted), and
speed as % of cuBLAS. The table is printed last; --out writes every figure as JSON.

--layer-step also times forward + backward (dX only, frozen weight) through the 7 linears of
one Qwen2.5-7B decoder layer at M = 8×2048 tokens, NVFP4 vs bf16 weights.

Example:  python benchmarks/nvfp4_gemm.py --layer-step --out nvfp4_gemm.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

QWEN7B = [  # name, out_features N, in_features K
    ("q_proj/o_proj", 3584, 3584),
    ("k_proj/v_proj", 512, 3584),
    ("gate_proj/up_proj", 18944, 3584),
    ("down_proj", 3584, 18944),
]
QWEN7B_LAYER = [("q", 3584, 3584), ("k", 512, 3584), ("v", 512, 3584), ("o", 3584, 3584),
                ("gate", 18944, 3584), ("up", 18944, 3584), ("down", 3584, 18944)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--m", type=int, nargs="+", default=[16, 256, 4096],
                   help="token counts M (default: 16 256 4096)")
    p.add_argument("--shapes", nargs="+", default=None,
                   help="subset of shape names to run (default: all four Qwen2.5-7B shapes); "
                        "or NxK entries, e.g. 4096x4096")
    p.add_argument("--ops", nargs="+", choices=["fwd", "dX"], default=["fwd", "dX"])
    p.add_argument("--rotate-mib", type=float, default=512.0,
                   help="rotate among input sets until their total exceeds this (default 512 MiB)")
    p.add_argument("--max-sets", type=int, default=64)
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup ms")
    p.add_argument("--rep", type=int, default=200, help="do_bench rep ms")
    p.add_argument("--layer-step", action="store_true",
                   help="also time fwd+bwd(dX) over the 7 linears of one decoder layer, M=16384")
    p.add_argument("--layer-tokens", type=int, default=8 * 2048)
    p.add_argument("--out", type=Path, default=None, help="write all figures as JSON here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", type=json.loads, default=None,
                   help='force one kernel config instead of autotuning (JSON: BLOCK_M, BLOCK_N, BLOCK_K, '
                        'SWAP_AB, SPLIT_K, num_warps, num_stages); skips minutes of autotune compiles')
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import triton
    from triton.testing import do_bench, do_bench_cudagraph

    from kernels.nvfp4 import global_scale, quantize
    from kernels.nvfp4 import gemm, triton_kernels

    if not torch.cuda.is_available():
        print("nvfp4_gemm benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    if gemm.INTERPRET:
        print("unset TRITON_INTERPRET to benchmark", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    torch.manual_seed(args.seed)
    props = torch.cuda.get_device_properties(dev)
    info = {"device": props.name, "sms": props.multi_processor_count,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}
    print(f"# {info}", flush=True)

    def bench(fn):
        return do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")

    # ---- copy-bandwidth ceiling: 1 GiB device-to-device copy, read + write bytes
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    t_copy = bench(lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() / (t_copy * 1e-3) / 1e9
    del src, dst
    print(f"# copy bandwidth ceiling: {copy_gbs:.0f} GB/s (1 GiB d2d copy, read+write)", flush=True)

    shapes = QWEN7B
    if args.shapes:
        named = {n: (n, N, K) for n, N, K in QWEN7B}
        shapes = []
        for s in args.shapes:
            if s in named:
                shapes.append(named[s])
            else:
                N, K = (int(v) for v in s.lower().split("x"))
                shapes.append((s, N, K))

    rows, failures = [], []
    for name, N, K in shapes:
        # one weight per set: quantize a random bf16 weight on the GPU (Triton quantizer)
        w_bytes = N * K // 2 + N * K // 16
        for M in args.m:
            set_bytes = w_bytes + 2 * N * K + 2 * (M * K + M * N) * 2
            n_sets = max(2, min(args.max_sets, math.ceil(args.rotate_mib * 2**20 / set_bytes)))
            sets = []
            base = (torch.randn(N, K, device=dev) * 0.02).bfloat16()
            for i in range(n_sets):
                w = base if i == 0 else base.roll(i, dims=1)
                q = quantize(w, global_scale(w))
                w_deq = gemm._reference_dequantize(*q, dtype=torch.bfloat16)
                x = torch.randn(M, K, device=dev).bfloat16()
                dy = torch.randn(M, N, device=dev).bfloat16()
                sets.append((x, dy, q, w_deq))
            del base
            for op in args.ops:
                # ---- correctness first (poisoned output buffer via the caching allocator)
                x, dy, q, w_deq = sets[0]
                out_numel = M * (N if op == "fwd" else K)
                poison = torch.full((out_numel,), float("nan"), dtype=torch.bfloat16, device=dev)
                del poison
                if op == "fwd":
                    got = gemm.linear_w4a16(x, *q, _config=args.config)
                    want = gemm.reference_linear(x, *q)
                else:
                    got = gemm.grad_input_w4a16(dy, *q, _config=args.config)
                    want = gemm.reference_grad_input(dy, *q)
                torch.cuda.synchronize()
                finite = bool(torch.isfinite(got).all())
                err = float((got.float() - want.float()).norm() / want.float().norm())
                ok = finite and err <= 1e-2
                if not ok:
                    failures.append(f"{op} {name} M={M}: finite={finite} rel_err={err:.3e}")
                # second set as well, after autotuning (split-K counters, other config)
                x1, dy1, q1, _ = sets[1]
                got1 = (gemm.linear_w4a16(x1, *q1, _config=args.config) if op == "fwd"
                        else gemm.grad_input_w4a16(dy1, *q1, _config=args.config))
                want1 = (gemm.reference_linear(x1, *q1) if op == "fwd"
                         else gemm.reference_grad_input(dy1, *q1))
                err1 = float((got1.float() - want1.float()).norm() / want1.float().norm())
                if not (bool(torch.isfinite(got1).all()) and err1 <= 1e-2):
                    ok = False
                    failures.append(f"{op} {name} M={M} (set 1): rel_err={err1:.3e}")
                best = args.config or getattr(gemm._tuned_kernel(), "best_config", None)

                # ---- timing, rotating over the sets
                cyc_q = itertools.cycle(range(n_sets))
                if op == "fwd":
                    def ours():
                        s = sets[next(cyc_q)]
                        return gemm.linear_w4a16(s[0], *s[2], _config=args.config)

                    cyc_c = itertools.cycle(range(n_sets))

                    def cublas():
                        s = sets[next(cyc_c)]
                        return s[0] @ s[3].t()
                else:
                    def ours():
                        s = sets[next(cyc_q)]
                        return gemm.grad_input_w4a16(s[1], *s[2], _config=args.config)

                    cyc_c = itertools.cycle(range(n_sets))

                    def cublas():
                        s = sets[next(cyc_c)]
                        return s[1] @ s[3]
                t_ours = bench(ours)
                t_cub = bench(cublas)
                # GPU time without host gaps: all sets in one CUDA graph, per call
                if op == "fwd":
                    def all_sets():
                        for s in sets:
                            gemm.linear_w4a16(s[0], *s[2], _config=args.config)
                else:
                    def all_sets():
                        for s in sets:
                            gemm.grad_input_w4a16(s[1], *s[2], _config=args.config)
                t_graph = do_bench_cudagraph(all_sets, rep=args.rep, return_mode="median") / n_sets
                # host cost per call: launches only, no sync inside
                torch.cuda.synchronize()
                h0 = time.perf_counter()
                for _ in range(100):
                    ours()
                host_us = (time.perf_counter() - h0) * 1e4
                torch.cuda.synchronize()
                # what NVFP4Linear does on CUDA by default: Triton dequantize + cuBLAS
                cyc_d = itertools.cycle(range(n_sets))

                def deq_cublas():
                    s = sets[next(cyc_d)]
                    w = triton_kernels.dequantize(*s[2], torch.bfloat16)
                    return s[0] @ w.t() if op == "fwd" else s[1] @ w
                t_deq = bench(deq_cublas)
                flops = 2.0 * M * N * K
                act = 2 * (M * K + M * N)
                b_ours = w_bytes + act
                b_cub = 2 * N * K + act
                row = {
                    "op": op, "shape": name, "N": N, "K": K, "M": M, "ok": ok, "rel_err": err,
                    "sets": n_sets, "flops": flops, "bytes": b_ours, "bytes_cublas": b_cub,
                    "ms": t_ours, "ms_cublas": t_cub,
                    "tflops": flops / (t_ours * 1e-3) / 1e12,
                    "tflops_cublas": flops / (t_cub * 1e-3) / 1e12,
                    "gbs": b_ours / (t_ours * 1e-3) / 1e9,
                    "gbs_cublas": b_cub / (t_cub * 1e-3) / 1e9,
                    "pct_copy_bw": 100 * b_ours / (t_ours * 1e-3) / 1e9 / copy_gbs,
                    "pct_cublas": 100 * t_cub / t_ours,
                    "config": str(best) if best is not None else None,
                    "ms_graph": t_graph, "host_us_per_call": host_us, "ms_dequant_cublas": t_deq,
                    "pct_cublas_graph": 100 * t_cub / t_graph,
                    "pct_copy_bw_graph": 100 * b_ours / (t_graph * 1e-3) / 1e9 / copy_gbs,
                }
                rows.append(row)
                print(f"{op:4s} {name:18s} M={M:5d} {t_ours * 1e3:9.1f} us (graph {t_graph * 1e3:.1f}, host "
                      f"{host_us:.0f}/call)  cuBLAS {t_cub * 1e3:9.1f} us  dequant+cuBLAS {t_deq * 1e3:.1f} us  "
                      f"err {err:.1e}  [{row['config']}]", flush=True)
            del sets
            torch.cuda.empty_cache()

    layer = None
    if args.layer_step:
        layer = layer_step(args, torch, gemm, quantize, global_scale, bench, dev)

    result = {"info": info, "copy_gbs": copy_gbs, "rows": rows, "layer_step": layer,
              "failures": failures,
              "goals": {"pct_copy_bw_at_M16_min": 70.0, "pct_cublas_at_M4096_min": 85.0}}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))

    # ---- the table, last
    print()
    print(f"device {info['device']}  triton {info['triton']}  copy ceiling {copy_gbs:.0f} GB/s")
    hdr = (f"{'op':4s} {'shape':18s} {'M':>5s} {'us':>9s} {'graph us':>9s} {'host us':>8s} {'TFLOP/s':>8s} "
           f"{'%copy':>6s} {'cuBLAS us':>9s} {'%cuBLAS':>7s} {'%cuB gr':>7s} {'deq+cuB':>8s} {'ok':>3s}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['op']:4s} {r['shape']:18s} {r['M']:5d} {r['ms'] * 1e3:9.1f} {r['ms_graph'] * 1e3:9.1f} "
              f"{r['host_us_per_call']:8.0f} {r['tflops']:8.1f} {r['pct_copy_bw_graph']:6.1f} "
              f"{r['ms_cublas'] * 1e3:9.1f} {r['pct_cublas']:7.1f} {r['pct_cublas_graph']:7.1f} "
              f"{r['ms_dequant_cublas'] * 1e3:8.1f} {'y' if r['ok'] else 'N':>3s}")
    if layer:
        print(f"layer step (7 linears, M={layer['M']}, fwd+dX): NVFP4 {layer['ms']:.2f} ms, "
              f"bf16 {layer['ms_bf16']:.2f} ms, ratio {layer['pct_bf16']:.1f} % of bf16 speed, "
              f"rel err dX {layer['rel_err']:.1e}")
    if failures:
        print("FAILURES:\n  " + "\n  ".join(failures))
    return 1 if failures else 0


def layer_step(args, torch, gemm, quantize, global_scale, bench, dev):
    """fwd + backward(dX) through the 7 linears of a decoder layer, frozen weights."""

    class NVFP4LinearFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, packed, scale, g):
            ctx.save_for_backward(packed, scale, g)
            return gemm.linear_w4a16(x, packed, scale, g)

        @staticmethod
        def backward(ctx, dy):
            packed, scale, g = ctx.saved_tensors
            return gemm.grad_input_w4a16(dy.contiguous(), packed, scale, g), None, None, None

    M = args.layer_tokens
    layers = []
    for name, N, K in QWEN7B_LAYER:
        w = (torch.randn(N, K, device=dev) * 0.02).bfloat16()
        q = quantize(w, global_scale(w))
        w_deq = gemm._reference_dequantize(*q, dtype=torch.bfloat16)
        x = torch.randn(M, K, device=dev).bfloat16().requires_grad_(True)
        dy = torch.randn(M, N, device=dev).bfloat16()
        layers.append((q, w_deq, x, dy))
        del w

    def step_nvfp4():
        for q, _, x, dy in layers:
            y = NVFP4LinearFn.apply(x, *q)
            y.backward(dy)

    def step_bf16():
        for _, w, x, dy in layers:
            y = torch.nn.functional.linear(x, w)
            y.backward(dy)

    # correctness of dX on one layer (q_proj) against the bf16 path
    q, w, x, dy = layers[0]
    x.grad = None
    NVFP4LinearFn.apply(x, *q).backward(dy)
    g1 = x.grad.clone()
    x.grad = None
    torch.nn.functional.linear(x, w).backward(dy)
    err = float((g1.float() - x.grad.float()).norm() / x.grad.float().norm())
    for _, _, xx, _ in layers:
        xx.grad = None
    step_nvfp4()  # autotune outside the timing
    t = bench(step_nvfp4)
    t_bf16 = bench(step_bf16)
    flops = sum(2 * 2.0 * M * N * K for _, N, K in QWEN7B_LAYER)
    res = {"M": M, "ms": t, "ms_bf16": t_bf16, "pct_bf16": 100 * t_bf16 / t,
           "tflops": flops / (t * 1e-3) / 1e12, "tflops_bf16": flops / (t_bf16 * 1e-3) / 1e12,
           "rel_err": err}
    print(f"# layer step: {res}", flush=True)
    return res


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"# total {time.time() - t0:.0f} s")
    sys.exit(rc)
