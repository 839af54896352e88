"""Sweep forced kernel configs of the NVFP4 forward GEMM at small M on a GPU (no autotuning).

For each shape, M and config of a grid it checks the output against the plain-torch
reference and times the call with CUDA graphs (`do_bench_cudagraph`, median), rotating among
weight sets larger than L2 so every call reads its weight from HBM. cuBLAS bf16 on the same
shape is the yardstick. The grid is compiled first by `--jobs` processes in parallel (a
config takes 2-15 s to compile, serially).

Grids (`--grid`, several allowed):
  gemv     the CUDA-core kernel for one input row (`_w4a16_gemv_kernel`) at M = 1: the
           tiles of GEMV_TILES (no spills, no shuffles in the loop) × split 1/2/4/8
  tc-m1    the tensor-core kernel at M = 1 (what M = 1 runs on without the GEMV)
  tc-m16   the tensor-core kernel at M = 16: BLOCK_N, BLOCK_K, split, stages, the input
           permuted outside the kernel (A_PREPERM; timed with and without that permute) and
           evict_first weight loads (EVICT_W)
  tc-split the tensor-core kernel at M = 1 and 16 with 6-16 K splits (BLOCK_N 64): the shapes
           with few output tiles (o, qkv, down) were fastest at the largest split of tc-m1
  tc-reg   the 16x64x128 tile at M = 1 and 16 with ptxas capped at 72 or 80 registers per thread
           (`maxnreg`: 7 or 6 CTAs of 4 warps per SM instead of 5 at 83)
  tc-deep  the tensor-core kernel at M = 1 and 16 with 3-8 pipeline stages and 4 or 8 warps
           (more loads in flight; on the H200 no better than 4 stages and 4 warps, NOTES.md)
  ab-pairs the serving table's tensor-core configs, each with and without SCALE_PAIRS (block
           scales loaded and decoded two at a time)
  tc-m64   the tensor-core kernel at M = 32, 64 and 128 (32- and 64-row tiles), against
           dequantize + cuBLAS (what `fused` ran above 32 rows until 2026-12-06: 0.46x bf16 in
           vLLM at 64 sequences on an H100)
  decode   the Gluon mma.sync kernel (`decode_gemm`, no shared memory in its loop) at M = 1, 8
           and 16: 16-row groups per warp (RW), 128-code chunks per step (KV), warps, split
  decode-ring  the decode kernel with its weight staged through shared memory by cp.async
           (STAGES 3/4/6 tiles in flight per warp; 0: in registers) and 1/2/4 warps per program
  decode-ring-s  the ring at M = 1 with the block scales staged through it as well (RING_S:
           STAGES - 1 tiles ahead instead of one in registers). At 8 and 16 rows and with the input
           through the ring too, an H100 sweep of 2026-12-06 found no gain (kernels/nvfp4/NOTES.md)
  serving  the serving table's configs at up to 16 rows, as they are: the yardstick for decode

Shapes (`--shapes`): vllm-7b (default: Qwen2.5-7B as vLLM runs it, merged qkv and gate_up),
learner-7b (the separate projections), or NxK entries.

    python benchmarks/nvfp4_gemm_sweep.py --grid gemv tc-m1 tc-m16 --out sweep.json \
        --serving-table kernels/nvfp4/serving_configs.json

`--serving-table` merges into that file, per shape and M, the fastest config that is correct
and beats what the serving op runs without it (cuBLAS bf16 as the yardstick up to 32 rows,
dequantize + cuBLAS above; kernel_only rows excluded: serving permutes its own input), in the
format `kernels/nvfp4/serving.py` reads: what vLLM's `fused` backend then runs.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHAPES = {
    "vllm-7b": [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944)],
    "learner-7b": [("q/o", 3584, 3584), ("k/v", 512, 3584), ("gate/up", 18944, 3584), ("down", 3584, 18944)],
}


# (BLOCK_N, BLOCK_K, warps) of the GEMV: on triton 3.6 for sm_90a these have 62-121 registers, no
# spills and 6.7-7.2 SASS instructions per weight in the K loop (benchmarks/nvfp4_gemm_ptx.py)
GEMV_TILES = ((32, 128, 4), (32, 256, 8), (64, 128, 4), (64, 128, 8), (64, 256, 16),
              (128, 128, 8), (128, 128, 16), (128, 256, 16), (256, 128, 16))


def grid(name: str) -> list[tuple[int, dict]]:
    """(M, forced config) pairs of one named grid."""
    out = []
    if name == "gemv":  # tiles that compile without spills or loop shuffles (nvfp4_gemm_ptx.py)
        for (bn, bk, warps), split in itertools.product(GEMV_TILES, (1, 2, 4, 8)):
            out.append((1, dict(GEMV=True, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=1)))
    elif name == "tc-m1":
        for bn, split in itertools.product((64, 128), (1, 2, 4)):
            out.append((1, dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=128, SWAP_AB=True, SPLIT_K=split, num_warps=4,
                                num_stages=4)))
    elif name == "tc-m16":
        for bn, bk, split, stages, pre, evict in itertools.product((64, 128), (128, 256), (1, 2, 4), (2, 4),
                                                                   (False, True), (False, True)):
            out.append((16, dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, SWAP_AB=True, SPLIT_K=split, num_warps=4,
                                 num_stages=stages, A_PREPERM=pre, EVICT_W=evict)))
    elif name == "tc-split":  # more K splits for the shapes with few output tiles (o, qkv, down)
        for m, bk, split, stages in itertools.product((1, 16), (128, 256), (6, 8, 12, 16), (3, 4)):
            out.append((m, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=bk, SWAP_AB=True, SPLIT_K=split, num_warps=4,
                                num_stages=stages)))
    elif name == "tc-reg":  # the 16x64x128 tile capped at 80 or 72 registers (6 or 7 CTAs per SM)
        for m, split, stages, regs in itertools.product((1, 16), (1, 2, 4, 8), (3, 4), (72, 80)):
            out.append((m, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SWAP_AB=True, SPLIT_K=split, num_warps=4,
                                num_stages=stages, maxnreg=regs)))
    elif name == "tc-deep":  # deeper pipelines and more warps, at the M of both decode regimes
        for m, bn, bk, stages, warps, split in itertools.product((1, 16), (64, 128), (128, 256), (3, 5, 6, 8), (4, 8),
                                                                  (1, 2, 4)):
            out.append((m, dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, SWAP_AB=True, SPLIT_K=split, num_warps=warps,
                                num_stages=stages)))
    elif name == "tc-m64":  # 32-128 rows, against dequantize + cuBLAS
        for m, bm, bn, split, stages in itertools.product((32, 64, 128), (32, 64), (64, 128), (1, 2, 4), (3, 4)):
            out.append((m, dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, SWAP_AB=True, SPLIT_K=split, num_warps=4,
                                num_stages=stages)))
    elif name == "ab-pairs":  # the serving table's tensor-core configs with and without SCALE_PAIRS
        from kernels.nvfp4 import serving
        seen = set()
        for entries in serving.measured_table().values():
            for m, c in entries:
                c = {k: v for k, v in c.items() if k not in serving.MEASURED_KEYS}
                key = json.dumps(c, sort_keys=True)
                if c.get("GEMV") or key in seen:
                    continue
                seen.add(key)
                for pairs in (True, False):
                    out.append((m, dict(c, SCALE_PAIRS=pairs)))
    elif name == "decode":  # the Gluon mma.sync kernel (kernels/nvfp4/decode_gemm.py) at decode sizes
        for m, rw, kv, warps, split in itertools.product((1, 8, 16), (1, 2), (1, 2), (4, 8), (1, 2, 4, 8)):
            out.append((m, dict(DECODE=True, RW=rw, KV=kv, SPLIT_K=split, num_warps=warps)))
    elif name == "decode-ring":  # the same with the weight through a cp.async ring in shared memory (STAGES)
        for m, rw, warps, stages, split in itertools.product((1, 8, 16), (1, 2), (1, 2, 4), (0, 3, 4, 6), (1, 2, 8)):
            out.append((m, dict(DECODE=True, RW=rw, KV=1, STAGES=stages, SPLIT_K=split, num_warps=warps)))
    elif name == "decode-ring-s":  # the ring with the block scales in it too (RING_S), at one row
        for warps, stages, split in itertools.product((1, 2, 4), (3, 4, 6), (1, 2, 8)):
            out.append((1, dict(DECODE=True, RW=1, KV=1, STAGES=stages, SPLIT_K=split, num_warps=warps, RING_S=True)))
    elif name == "serving":  # what the serving table runs now at up to 16 rows: the decode grid's yardstick
        from kernels.nvfp4 import serving
        seen = set()
        for entries in serving.measured_table().values():  # kernel arguments only (_load_table)
            for m, c in entries:
                if m <= 16 and (key := json.dumps([m, c], sort_keys=True)) not in seen:
                    seen.add(key)
                    out.append((m, c))
    else:
        raise SystemExit(f"unknown grid {name!r}: gemv, tc-m1, tc-m16, tc-split, tc-reg, tc-deep, tc-m64, ab-pairs, "
                         "decode, decode-ring, decode-ring-s, serving")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--grid", nargs="+", default=["gemv", "tc-m1"], help="named config grids (default: gemv tc-m1)")
    p.add_argument("--shapes", default="vllm-7b", help="vllm-7b, learner-7b, or comma-separated NxK")
    p.add_argument("--jobs", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)),
                   help="parallel compile processes (default: CPUs - 2, at most 14)")
    p.add_argument("--rep", type=int, default=25, help="do_bench_cudagraph rep ms per config")
    p.add_argument("--bandwidth", type=float, default=4.245e12,
                   help="copy bandwidth in B/s that %% of bandwidth refers to (H200: 4.245e12, measured)")
    p.add_argument("--out", type=Path, default=None, help="write every row as JSON here")
    p.add_argument("--serving-table", type=Path, default=None,
                   help="write the winners as kernels/nvfp4/serving.py's per-shape table here")
    p.add_argument("--merge-rows", type=Path, default=None,
                   help="an earlier run's --out (same GPU and shapes): its rows join this run's for "
                        "--serving-table and the summary, so a new grid adds to what was measured")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # i/n: compile a share, then exit
    return p.parse_args(argv)


def shapes_of(spec: str):
    if spec in SHAPES:
        return SHAPES[spec]
    return [(s, *map(int, s.split("x"))) for s in spec.split(",")]


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from triton.testing import do_bench_cudagraph

    from kernels.nvfp4 import gemm, global_scale, quantize, triton_kernels

    if not torch.cuda.is_available():
        print("nvfp4_gemm_sweep: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    cases = [c for g in args.grid for c in grid(g)]
    shapes = shapes_of(args.shapes)

    if args.worker is not None:  # compile this share of the grid (one call per distinct K)
        i, n = (int(v) for v in args.worker.split("/"))
        for _, N, K in {K: (s, N, K) for s, N, K in shapes}.values():
            w = (torch.randn(N, K, device=dev) * 0.02).bfloat16()
            q = quantize(w, global_scale(w))
            for M, cfg in cases[i::n]:
                try:
                    gemm.linear_w4a16(torch.randn(M, K, device=dev).bfloat16(), *q, _config=dict(cfg))
                except Exception as e:  # reported again, with the config, by the timing pass
                    print(f"compile failed {cfg}: {str(e)[:200]}", file=sys.stderr)
        torch.cuda.synchronize()
        return 0

    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                               "--worker", f"{i}/{args.jobs}"]) for i in range(args.jobs)]
    for p in procs:
        p.wait()
    print(f"compiled {len(cases)} configs with {args.jobs} processes in {time.time() - t0:.0f} s", flush=True)

    real_permute = gemm._permute_input
    rows = []
    for name, N, K in shapes:
        set_bytes = N * K * 9 // 16
        n_sets = max(2, -(-160 * 2**20 // set_bytes))  # > 3 × the H200's 50 MB L2
        base = (torch.randn(N, K, device=dev) * 0.02).bfloat16()
        qs = [quantize(base.roll(i, dims=1), global_scale(base)) for i in range(n_sets)]
        bf = [base.roll(i, dims=1) for i in range(max(2, -(-160 * 2**20 // (2 * N * K))))]
        for M in sorted({m for m, _ in cases}):
            xs = [torch.randn(M, K, device=dev).bfloat16() for _ in qs]
            t = do_bench_cudagraph(lambda: [torch.matmul(xs[0], w.t()) for w in bf], rep=args.rep,
                                   return_mode="median") / len(bf)
            moved = 2 * N * K + 2 * M * (N + K)
            rows.append(dict(shape=name, N=N, K=K, M=M, kernel="cublas_bf16", us=round(t * 1e3, 2),
                             pct_bw=round(100 * moved / (t * 1e-3) / args.bandwidth, 1)))
            print(json.dumps(rows[-1]), flush=True)
            moved = N * K * 9 // 16 + 2 * M * (N + K)
            if M > 32:  # what the serving op runs without a tensor-core config: dequantize, then cuBLAS
                t = do_bench_cudagraph(lambda: [torch.matmul(x, triton_kernels.dequantize(*q).t())
                                                for x, q in zip(xs, qs)], rep=args.rep, return_mode="median") / len(qs)
                rows.append(dict(shape=name, N=N, K=K, M=M, kernel="dequant_cublas", us=round(t * 1e3, 2),
                                 pct_bw=round(100 * moved / (t * 1e-3) / args.bandwidth, 1)))
                print(json.dumps(rows[-1]), flush=True)
            want = gemm.reference_linear(xs[0], *qs[0]).float()
            for m, cfg in cases:
                if m != M:
                    continue
                for kernel_only in ((False, True) if cfg.get("A_PREPERM") else (False,)):
                    row = dict(shape=name, N=N, K=K, M=M, kernel="nvfp4", kernel_only=kernel_only, **cfg)
                    try:
                        use = xs
                        if kernel_only:  # the input permuted beforehand: the kernel alone
                            use = [real_permute(x, cfg["BLOCK_K"]) for x in xs]
                            gemm._permute_input = lambda a2, bk: a2
                        got = gemm.linear_w4a16(use[0], *qs[0], _config=dict(cfg)).float()
                        err = float((got - want).norm() / want.norm())

                        def run_all(use=use, cfg=cfg):
                            for x, q in zip(use, qs):
                                gemm.linear_w4a16(x, *q, _config=dict(cfg))
                        t = do_bench_cudagraph(run_all, rep=args.rep, return_mode="median") / len(qs)
                        row.update(us=round(t * 1e3, 2), pct_bw=round(100 * moved / (t * 1e-3) / args.bandwidth, 1),
                                   rel_err=round(err, 5))
                    except Exception as e:
                        row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
                    finally:
                        gemm._permute_input = real_permute
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        qs = bf = base = xs = None  # free this shape's weights before the next one
        torch.cuda.empty_cache()
        if args.out:  # after each shape: a run cut short keeps what it measured
            args.out.write_text(json.dumps(rows, indent=1))

    ms = sorted({m for m, _ in cases})
    if args.merge_rows:
        earlier = json.loads(args.merge_rows.read_text())
        names = {name for name, _, _ in shapes}
        rows = rows + [r for r in earlier if r["shape"] in names and r["M"] in ms and r["kernel"] == "nvfp4"
                       and runnable(r)]
    if args.serving_table:
        write_serving_table(args.serving_table, rows, shapes, ms)
    print(f"\n{len(rows)} rows in {time.time() - t0:.0f} s. Best correct configs (rel. error < 1e-2):")
    for name, N, K in shapes:
        for M in ms:
            cb, dq = baseline(rows, name, M, "cublas_bf16"), baseline(rows, name, M, "dequant_cublas")
            ok = sorted((r for r in rows if r["shape"] == name and r["M"] == M and r["kernel"] == "nvfp4"
                         and r.get("rel_err", 1) < 1e-2), key=lambda r: r["us"])
            print(f"{name} {N}x{K} M={M}: cuBLAS bf16 {cb['us']} us ({cb['pct_bw']} % of BW)"
                  + (f", dequantize + cuBLAS {dq['us']} us" if dq else ""))
            for r in ok[:4]:
                cfg = {k: v for k, v in r.items()
                       if k not in ("shape", "N", "K", "M", "kernel", "us", "pct_bw", "rel_err")}
                print(f"   {r['us']:8.2f} us  {r['pct_bw']:5.1f} % of BW  {json.dumps(cfg)}")
    return 0


CONFIG_KEYS = ("GEMV", "BLOCK_M", "BLOCK_N", "BLOCK_K", "SWAP_AB", "SPLIT_K", "num_warps", "num_stages",
               "maxnreg", "A_PREPERM", "EVICT_W", "SCALE_PAIRS", "DECODE", "RW", "KV", "STAGES", "RING_S")
ROW_KEYS = ("shape", "N", "K", "M", "kernel", "kernel_only", "us", "pct_bw", "rel_err", "error")


def runnable(row: dict) -> bool:
    """Whether a (possibly older) row's config is one today's kernels take: no option set that
    has since been dropped (e.g. the GEMV's PREFETCH, measured on 2026-12-04 and removed)."""
    return not any(v for k, v in row.items() if k not in CONFIG_KEYS and k not in ROW_KEYS)


def baseline(rows: list, shape: str, m: int, kernel: str) -> dict | None:
    """The row of a yardstick kernel (cublas_bf16, dequant_cublas) at one shape and M, if timed."""
    return next((r for r in rows if (r["shape"], r["M"], r["kernel"]) == (shape, m, kernel)), None)


def write_serving_table(path: Path, rows: list, shapes, ms) -> None:
    """Per shape and M, the fastest correct config (the input permute counted) that beats what
    the serving op would run without it: cuBLAS on bf16 weights as the yardstick up to 32 rows,
    dequantize + cuBLAS above (what it really falls back to there). Merged into the file at
    `path`: these (shape, M) entries replace earlier ones, the others stay."""
    import torch
    import triton

    old = json.loads(path.read_text()) if path.exists() else {"configs": {}}
    configs = {shape: {int(m): cfg for m, cfg in entries} for shape, entries in old.get("configs", {}).items()}
    written = 0
    for name, N, K in shapes:
        for M in ms:
            cb, dq = baseline(rows, name, M, "cublas_bf16"), baseline(rows, name, M, "dequant_cublas")
            bar = dq["us"] if dq else cb["us"]
            ok = [r for r in rows if (r["shape"], r["M"], r["kernel"]) == (name, M, "nvfp4")
                  and not r.get("kernel_only") and r.get("rel_err", 1) < 1e-2 and r["us"] < bar]
            if ok:
                best = min(ok, key=lambda r: r["us"])
                cfg = dict({k: best[k] for k in CONFIG_KEYS if k in best}, us=best["us"], cublas_bf16_us=cb["us"])
                if dq:
                    cfg["dequant_cublas_us"] = dq["us"]
                configs.setdefault(f"{N}x{K}", {})[M] = cfg
                written += 1
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    here = (f"{gpu}, triton {triton.__version__}, benchmarks/nvfp4_gemm_sweep.py, "
            f"{time.strftime('%Y-%m-%d')} (M = {', '.join(map(str, ms))})")
    measured_on = f"{old['measured_on']}; {here}" if old.get("measured_on") else here
    path.write_text(json.dumps({"measured_on": measured_on, "configs": {
        shape: [[m, cfg] for m, cfg in sorted(by_m.items())] for shape, by_m in configs.items()}}, indent=1) + "\n")
    print(f"wrote {written} entries into {path}")


if __name__ == "__main__":
    sys.exit(main())
