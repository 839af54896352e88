"""Check and time the wgmma NVFP4 GEMMs (kernels/nvfp4/wgmma_gemm.py) on a Hopper GPU.

    python benchmarks/nvfp4_wgmma_check.py --out wgmma.json
    python benchmarks/nvfp4_wgmma_check.py --m 256 4096 --configs '[{}, {"BP": 128, "STAGES": 6}]'

Configs with "SWAP": true run kernels/nvfp4/swap_gemm.py (the weight as wgmma's register operand,
forward only: its dX cases are skipped, --layer-step takes dX from the warp-specialized kernel),
and add decode-sized cases (M = 1, 16, 33) to the check.

1. Correctness with every config of --configs against float32 math on the exact float32
   dequantized weight (E2M1 · s / g): the Qwen2.5-7B learner shapes (forward and dX) and vLLM's
   fused q/k/v and gate/up (forward, one global scale per weight row, a bias), at M that are and
   are not multiples of the tile, with zero, subnormal and 448 block scales in the weight.
   Outputs are poisoned first (NaN in the caching allocator). Relative error (Frobenius) must
   stay ≤ 1e-2; the kernel rounds only its output, so it is ~2e-3.
2. Time (CUDA-graph replay of all weight/input sets, median; the sets rotate so that weights do
   not stay in L2) per config against cuBLAS on the bf16 weight and against dequantize + cuBLAS
   (what the learner does by default), with TFLOP/s, one line each; --out writes all as JSON.
3. --layer-step: forward + dX through the 7 linears of one 7B decoder layer at 8 × 2,048 tokens,
   wgmma (each config) vs bf16 weights (the learner's GEMM work per layer and micro-batch).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (name, N, K): the learner's four Linear shapes, and the seven Linears of one decoder layer
from benchmarks.nvfp4_gemm import QWEN7B as LEARNER, QWEN7B_LAYER as LAYER  # noqa: E402

SERVING = [("qkv", 4608, 3584), ("gate_up", 37888, 3584)]  # vLLM's fused shards: per-row global scale


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--m", type=int, nargs="+", default=[256, 4096], help="rows to time (default 256 4096)")
    p.add_argument("--configs", type=json.loads, default=[{}],
                   help="JSON list of configs to check and time, each merged into wgmma_gemm.DEFAULT_CONFIG "
                        "(or WS_CONFIG with \"WARP_SPECIALIZE\": true)")
    p.add_argument("--rotate-mib", type=float, default=256.0, help="weights + inputs per timing, at least")
    p.add_argument("--rep", type=int, default=100, help="do_bench_cudagraph rep (ms)")
    p.add_argument("--layer-step", action="store_true")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def make_weight(torch, n: int, k: int, dev, per_row: bool = False, special: bool = False):
    """A random NVFP4 weight (Triton quantizer), optionally with one global scale per row and with
    zero, subnormal and 448 block scales planted."""
    from kernels.nvfp4 import global_scale, quantize

    w = (torch.randn(n, k, device=dev) * 0.02).bfloat16()
    packed, scale, g = quantize(w, global_scale(w))
    if per_row:  # fused shards keep one divisor each: rows divided by 0.5-2x the tensor's
        return packed, scale, (g * torch.logspace(-1, 1, n, base=2.0, device=dev)).float()
    if special:
        s = scale.view(torch.uint8)
        s[::97] = 0x00  # zero
        s[1::97, ::3] = 0x01  # the smallest subnormal, 2^-9
        s[2::97, 1::3] = 0x7E  # 448
    return packed, scale, g


class Kernels:
    """wgmma_gemm's entry points, or swap_gemm's forward for configs with "SWAP": true (dX: the
    warp-specialized wgmma kernel)."""

    def __init__(self):
        from kernels.nvfp4 import swap_gemm, wgmma_gemm
        self.wg, self.swap = wgmma_gemm, swap_gemm
        self.prepared = {}  # (id(tensor), how) -> (the tensor, its reordered copy), made once per tensor

    def _prepared(self, t, how):
        """`how(t)` (swap_gemm.prepack / prepack_scales), made once per tensor (as a model would at load)."""
        held = self.prepared.get((id(t), how))
        if held is None or held[0] is not t:
            self.prepared[(id(t), how)] = held = (t, how(t))
        return held[1]

    def supports(self, m, p, r, cfg, forward=True):
        if cfg.get("SWAP"):
            return forward and self.swap.supports(m, p, r, cfg)  # no dX of its own: not timed as one
        return self.wg.supports(m, p, r, cfg, forward)

    def linear_wgmma(self, x, packed, scale, g, bias=None, cfg=None):
        if (cfg or {}).get("SWAP"):
            if cfg.get("PREPACKED"):  # reordered once per weight, not timed
                packed = self._prepared(packed, self.swap.prepack)
            if cfg.get("TMA_W"):
                scale = self._prepared(scale, self.swap.prepack_scales)
            return self.swap.linear_swap(x, packed, scale, g, bias, cfg)
        return self.wg.linear_wgmma(x, packed, scale, g, bias, cfg)

    def grad_input_wgmma(self, dy, packed, scale, g, cfg=None):
        return self.wg.grad_input_wgmma(dy, packed, scale, g, {"WARP_SPECIALIZE": True} if (cfg or {}).get("SWAP")
                                        else cfg)


def check(torch, wg, dev, configs: list[dict]) -> list[dict]:
    """Every case against float32 math on the exact float32 Ŵ; output rounded to bf16 once."""
    from kernels.nvfp4 import reference

    rows = []
    cases = [(n, nn, k, m, "fwd") for n, nn, k in LEARNER for m in (64, 200, 4096)]
    cases += [(n, nn, k, m, "dX") for n, nn, k in LEARNER for m in (64, 200, 4096)]
    cases += [(n, nn, k, m, "fwd-fused") for n, nn, k in SERVING for m in (256, 300)]
    if any(c.get("SWAP") for c in configs):  # decode-sized inputs
        cases += [(n, nn, k, m, "fwd-fused") for n, nn, k in SERVING for m in (1, 16, 33)]
    for name, n, k, m, op in cases:
        q = make_weight(torch, n, k, dev, per_row=op == "fwd-fused", special=op != "fwd-fused")
        # the exact float32 Ŵ: E2M1 · s (reference dequantize with g = 1), divided by g per row
        w32 = reference.dequantize(q[0], q[1], torch.ones(1, device=dev), torch.float32) / q[2].reshape(-1, 1)
        for cfg in configs:
            if op == "dX" and cfg.get("SWAP"):
                continue  # the swap kernel is a forward
            torch.full((m * max(n, k) * 2,), float("nan"), dtype=torch.bfloat16, device=dev)  # poison
            if op == "dX":
                dy = torch.randn(m, n, device=dev).bfloat16()
                got, want = wg.grad_input_wgmma(dy, *q, cfg=cfg), (dy.float() @ w32).bfloat16()
            else:
                x = torch.randn(m, k, device=dev).bfloat16()
                bias = torch.randn(n, device=dev).bfloat16() if op == "fwd-fused" else None
                want = x.float() @ w32.t() + (0 if bias is None else bias.float())
                got, want = wg.linear_wgmma(x, *q, bias, cfg=cfg), want.bfloat16()
            err = float((got.float() - want.float()).norm() / want.float().norm())
            ok = bool(torch.isfinite(got).all()) and err <= 1e-2
            rows.append({"op": op, "shape": name, "M": m, "config": cfg, "rel_err": err, "ok": ok})
            print(f"check {op:9s} {name:8s} M={m:5d} {json.dumps(cfg):28s} rel err {err:.2e} {'ok' if ok else 'BAD'}",
                  flush=True)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import triton

    wg = Kernels()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("needs a Hopper GPU (sm_90)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    torch.manual_seed(0)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    print(f"# {info}", flush=True)
    checks = [] if args.skip_check else check(torch, wg, dev, args.configs)

    timings = []
    shapes = [(n, nn, k, "fwd") for n, nn, k in LEARNER] + [(n, nn, k, "dX") for n, nn, k in LEARNER]
    shapes += [(n, nn, k, "fwd") for n, nn, k in SERVING]
    for name, n, k, op in shapes:
        for m in args.m:
            timings += time_case(torch, wg, name, n, k, op, m, args)
            torch.cuda.empty_cache()

    layer = layer_step(torch, wg, dev, args) if args.layer_step else None
    bad = [c for c in checks if not c["ok"]]
    result = {"info": info, "checks": checks, "timings": timings, "layer_step": layer, "bad": bad}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    print(f"\n{len(checks) - len(bad)}/{len(checks)} checks ok; {len(timings)} timings")
    return 1 if bad else 0


def time_case(torch, wg, name: str, n: int, k: int, op: str, m: int, args) -> list[dict]:
    """Time every config on one (op, weight shape, M) against cuBLAS and dequantize + cuBLAS."""
    from triton.testing import do_bench_cudagraph

    from kernels.nvfp4 import triton_kernels

    dev = torch.device("cuda")
    red, p = (k, n) if op == "fwd" else (n, k)
    if not any(wg.supports(m, p, red, cfg, op == "fwd") for cfg in args.configs):
        return []  # no config runs here (the swap kernel has no dX): no baselines either
    n_sets = max(2, min(16, math.ceil(args.rotate_mib * 2**20 / (n * k * 2.56 + 2 * m * (k + n)))))
    sets = []
    for _ in range(n_sets):
        q = make_weight(torch, n, k, dev, per_row=name in ("qkv", "gate_up"))
        sets.append((torch.randn(m, red, device=dev).bfloat16(), q, triton_kernels.dequantize(*q, torch.bfloat16)))

    def graph_ms(fn) -> float:
        def all_sets():
            for a, q, w in sets:
                fn(a, q, w)
        return do_bench_cudagraph(all_sets, rep=args.rep, return_mode="median") / n_sets

    def oriented(w):
        return w.t() if op == "fwd" else w

    t_cub = graph_ms(lambda a, q, w: torch.matmul(a, oriented(w)))
    t_deq = graph_ms(lambda a, q, w: torch.matmul(a, oriented(triton_kernels.dequantize(*q, torch.bfloat16))))
    flops = 2.0 * m * n * k
    rows = []
    for cfg in args.configs:
        if not wg.supports(m, p, red, cfg, op == "fwd"):
            continue
        gemm = wg.linear_wgmma if op == "fwd" else wg.grad_input_wgmma
        try:
            t = graph_ms(lambda a, q, w, c=cfg, f=gemm: f(a, *q, cfg=c))
        except Exception as e:  # noqa: BLE001 - a config that does not compile/launch is reported, not fatal
            print(f"time {op} {name} M={m} {cfg}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        row = {"op": op, "shape": name, "N": n, "K": k, "M": m, "config": cfg, "us": t * 1e3,
               "us_cublas": t_cub * 1e3, "us_dequant_cublas": t_deq * 1e3,
               "tflops": flops / t / 1e9, "tflops_cublas": flops / t_cub / 1e9,
               "pct_cublas": 100 * t_cub / t, "pct_dequant_cublas": 100 * t_deq / t}
        rows.append(row)
        print(f"time {op:3s} {name:8s} M={m:5d} {json.dumps(cfg):28s} {t * 1e3:8.1f} us "
              f"{row['tflops']:6.1f} TFLOP/s | cuBLAS {t_cub * 1e3:8.1f} ({row['pct_cublas']:5.1f} %) | "
              f"dequant+cuBLAS {t_deq * 1e3:8.1f} ({row['pct_dequant_cublas']:5.1f} %)", flush=True)
    return rows


def layer_step(torch, wg, dev, args) -> dict:
    """fwd + dX over the 7 linears of one 7B decoder layer, 8 × 2,048 tokens: wgmma vs bf16."""
    from triton.testing import do_bench_cudagraph

    from kernels.nvfp4 import triton_kernels

    m = 8 * 2048
    layers = []
    for _, n, k in LAYER:
        q = make_weight(torch, n, k, dev)
        layers.append((q, triton_kernels.dequantize(*q, torch.bfloat16), torch.randn(m, k, device=dev).bfloat16(),
                       torch.randn(m, n, device=dev).bfloat16()))

    def nvfp4(cfg):
        for q, _, x, dy in layers:
            wg.linear_wgmma(x, *q, cfg=cfg)
            wg.grad_input_wgmma(dy, *q, cfg=cfg)

    def bf16():
        for _, w, x, dy in layers:
            torch.matmul(x, w.t())
            torch.matmul(dy, w)

    def deq():
        for q, _, x, dy in layers:
            w = triton_kernels.dequantize(*q, torch.bfloat16)
            torch.matmul(x, w.t())
            torch.matmul(dy, w)

    res = {"M": m}
    runs = [(f"wgmma {json.dumps(cfg)}", lambda c=cfg: nvfp4(c)) for cfg in args.configs]
    for name, fn in (*runs, ("bf16", bf16), ("dequant_cublas", deq)):
        fn()
        res[f"ms_{name}"] = do_bench_cudagraph(fn, rep=args.rep, return_mode="median")
        print(f"# layer step (7 linears, fwd + dX, M = {m}): {name} {res[f'ms_{name}']:.3f} ms", flush=True)
    return res


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"# total {time.time() - t0:.0f} s")
    sys.exit(rc)
