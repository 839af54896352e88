"""Check and time the fused serving op with a LoRA (`torch.ops.qerl.nvfp4_linear_lora`) on a GPU.

For vLLM's merged Qwen2.5-7B projections with their output slices (q/k/v, o, gate/up, down),
LoRA rank slots 32, one or two adapter slots and tokens without an adapter, it compares the op
with plain torch (the dequantized weight's matmul + `lora_expand_reference`) eagerly, replayed
from a CUDA graph and under torch.compile, and says which path served it (the decode kernel's
epilogue or GEMM + `lora_expand_`). Where the decode kernel serves a shape, the shrink in the
same launch too (`check_shrink`: T and y, split-K 1 / 2 / 4, no token with an adapter, launches
in a row and a graph replay, the counter buffer zero after each). Then, per shape and M,
CUDA-graph times in µs of: the GEMM alone (`nvfp4_linear`), GEMM + the separate expand kernel
(two launches, what vLLM's path costs for the expand), the op with T given (the epilogue where
it applies), vLLM's three launches (shrink, GEMM, expand) and GEMM + shrink + expand in one launch,
the in-launch shrink's checks and times last. Exits 1 on any mismatch. A hang (the
shrink's flags) is bounded by the caller's `timeout` (run.sh).

    python benchmarks/nvfp4_lora_check.py [--m 1 2 8 16 64] [--time-m 1 8 16] [--rank 32] [--no-compile] [--no-shrink]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.nvfp4_serving_check import replay_from_graph  # noqa: E402

SLICES = {"qkv": [3584, 512, 512], "o": [3584], "gate_up": [18944, 18944], "down": [3584]}
K = {"qkv": 3584, "o": 3584, "gate_up": 3584, "down": 18944}


def check_shrink(name, slots, m, cfg, weights, w_hat, bs, slices, k, args, gen) -> int:
    """The shrink in the GEMM's launch (LORA_SHRINK) against torch: T and y, for the table's config
    through the op (lora_t None) and for split-K 1 / 2 / 4 directly; mixed and all -1 token slots;
    three launches in a row on alternating inputs (a flag left up would let a launch read the last
    one's T) and a CUDA-graph replay; the shared counter buffer must be zero after every launch.
    Returns the number of failed cases."""
    import torch

    from kernels.nvfp4 import gemm
    from kernels.nvfp4.lora import lora_expand_reference, lora_shrink_reference

    packed, scale, g, bias = weights
    dev = packed.device
    lora_a = [(torch.randn(slots, 1, args.rank, k, device=dev, generator=gen) * 0.05).bfloat16() for _ in slices]
    xs = [torch.randn(m, k, device=dev).bfloat16() for _ in range(2)]
    failed = 0
    for slot_kind in ("mixed", "none"):
        idx = ((torch.arange(m, device=dev) + 1) % (slots + 1) - 1).int() if slot_kind == "mixed" else \
            torch.full((m,), -1, dtype=torch.int32, device=dev)

        def want(xx):
            t = lora_shrink_reference(xx, lora_a, idx)
            base = (xx.float() @ w_hat.t() + (0 if bias is None else bias.float())).bfloat16()
            return lora_expand_reference(base, t, bs, idx, slices).float(), t

        for how in ("op", "split 1", "split 2", "split 4"):
            t_out = torch.empty(len(slices), m, args.rank, device=dev)
            if how == "op":
                def run(xx):
                    return torch.ops.qerl.nvfp4_linear_lora(xx, packed, scale, g, bias, None, lora_a, bs, idx, slices)
            else:
                c = dict(cfg, SPLIT_K=int(how.split()[1]))

                def run(xx, c=c, t_out=t_out):
                    return gemm.linear_w4a16(xx, packed, scale, g, bias, _config=c,
                                             _lora=(t_out, bs, idx, slices, lora_a))
            errs, dirty = {}, 0
            for i, xx in enumerate((xs[0], xs[1], xs[0])):
                y = run(xx).float()
                torch.cuda.synchronize()
                dirty += int(gemm._counters(dev, 0).count_nonzero())
                y_want, t_want = want(xx)
                errs[f"y{i}"] = float((y - y_want).norm() / y_want.norm())
                if how != "op" and slot_kind == "mixed":
                    errs[f"T{i}"] = float((t_out - t_want).norm() / t_want.norm())
            graph = replay_from_graph(lambda xx, *_: run(xx), xs[0].clone(), xs[1], ())
            dirty += int(gemm._counters(dev, 0).count_nonzero())
            y_want, _ = want(xs[1])
            errs["graph"] = float((graph.float() - y_want).norm() / y_want.norm())
            ok = all(e < args.tol for e in errs.values()) and dirty == 0
            failed += not ok
            print(f"{'ok ' if ok else 'BAD'} {name} slots={slots} M={m} shrink in the launch ({how}, {slot_kind}): "
                  + " ".join(f"{a} {e:.2e}" for a, e in errs.items()) + f"  nonzero counters {dirty}", flush=True)
    return failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 8, 16, 64])
    ap.add_argument("--time-m", type=int, nargs="*", default=[1, 8, 16])
    ap.add_argument("--rank", type=int, default=32, help="LoRA rank slots (vLLM's max_lora_rank)")
    ap.add_argument("--tol", type=float, default=1e-2)
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="skip the torch.compile check (the slowest part)")
    ap.add_argument("--no-shrink", dest="shrink", action="store_false",
                    help="skip the shrink in the GEMM's launch (LORA_SHRINK)")
    args = ap.parse_args(argv)
    import torch
    from triton.testing import do_bench_cudagraph

    from kernels.nvfp4 import decode_gemm, dequantize, gemm, global_scale, quantize, serving
    from kernels.nvfp4.lora import lora_expand_, lora_expand_reference, lora_shrink

    dev = torch.device("cuda")
    serving.prepare(dev)
    # one compiled `run` per (shape, slots, M): more variants than dynamo's default limit of 8, after
    # which it would silently run the rest eagerly
    torch._dynamo.config.recompile_limit = 1024
    op, base_op = torch.ops.qerl.nvfp4_linear_lora, torch.ops.qerl.nvfp4_linear
    gen = torch.Generator(device=dev).manual_seed(0)
    failed, shrink_cases, shrink_timings = 0, [], []
    for name, slices in SLICES.items():
        n, k = sum(slices), K[name]
        w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).bfloat16()
        packed, scale, g = quantize(w, global_scale(w))
        g = g.reshape(1).repeat(n) * torch.linspace(0.5, 1.5, n, device=dev)
        bias = torch.randn(n, device=dev).bfloat16() if name == "qkv" else None
        w_hat = dequantize(packed, scale, torch.ones(1, device=dev), torch.float32) / g[:, None]
        for slots in (1, 2):
            bs = [(torch.randn(slots, 1, s, args.rank, device=dev, generator=gen) * 0.05).bfloat16() for s in slices]
            for m in args.m:
                t = torch.randn(len(slices), m, args.rank, device=dev, generator=gen)
                idx = ((torch.arange(m, device=dev) + 1) % (slots + 1) - 1).int()  # 0, (1,) -1, 0, …

                def reference(x):
                    base = (x.float() @ w_hat.t() + (0 if bias is None else bias.float())).bfloat16()
                    return lora_expand_reference(base, t, bs, idx, slices).float()

                def run(x):
                    return op(x, packed, scale, g, bias, t, [], bs, idx, slices)

                x = torch.randn(m, k, device=dev).bfloat16()
                x2 = torch.randn(m, k, device=dev).bfloat16()
                want, want2 = reference(x), reference(x2)
                eager = run(x)
                captured = replay_from_graph(lambda xx, *_: run(xx), x.clone(), x2, ())
                outs = [("eager", eager, want), ("graph", captured, want2)]
                if args.compile:
                    outs.append(("compiled", torch.compile(run, dynamic=False)(x2), want2))
                errs = {a: float((o.float() - ref).norm() / ref.norm()) for a, o, ref in outs}
                ok = all(e < args.tol for e in errs.values())
                failed += not ok
                cfg = serving.config_for(m, n, k, torch.cuda.get_device_properties(dev).multi_processor_count)
                path = ("epilogue" if cfg and cfg.get("DECODE") and decode_gemm.lora_fits(m, cfg, slices, args.rank)
                        else "gemm+expand")
                print(f"{'ok ' if ok else 'BAD'} {name} slots={slots} M={m}: "
                      + " ".join(f"{a} {e:.2e}" for a, e in errs.items()) + f"  {path}", flush=True)
                if path == "epilogue" and decode_gemm.lora_fits(m, cfg, slices, args.rank, shrink=True):
                    shrink_cases.append((name, slots, m, cfg, (packed, scale, g, bias), w_hat, bs, slices, k))
        bs = [(torch.randn(1, 1, s, args.rank, device=dev, generator=gen) * 0.05).bfloat16() for s in slices]
        for m in args.time_m:
            x = torch.randn(m, k, device=dev).bfloat16()
            t = torch.randn(len(slices), m, args.rank, device=dev)
            idx = torch.zeros(m, dtype=torch.int32, device=dev)
            us = {"gemm": do_bench_cudagraph(lambda: base_op(x, packed, scale, g, bias), rep=50) * 1e3,
                  "gemm+expand": do_bench_cudagraph(
                      lambda: lora_expand_(base_op(x, packed, scale, g, bias), t, bs, idx, slices), rep=50) * 1e3,
                  "op": do_bench_cudagraph(lambda: op(x, packed, scale, g, bias, t, [], bs, idx, slices), rep=50) * 1e3}
            lora_a = [(torch.randn(1, 1, args.rank, k, device=dev, generator=gen) * 0.05).bfloat16() for _ in slices]
            us["shrink+gemm+expand (approx. vLLM)"] = do_bench_cudagraph(lambda: lora_expand_(
                base_op(x, packed, scale, g, bias), lora_shrink(x, lora_a, idx), bs, idx, slices), rep=50) * 1e3
            print(f"time {name} M={m}: " + " ".join(f"{a} {v:.2f} us" for a, v in us.items()), flush=True)
            cfg = serving.config_for(m, n, k, torch.cuda.get_device_properties(dev).multi_processor_count)
            if cfg and cfg.get("DECODE") and decode_gemm.lora_fits(m, cfg, slices, args.rank, shrink=True):
                shrink_timings.append((name, m, x, (packed, scale, g, bias), cfg, t, bs, idx, slices, lora_a))
    # The shrink in the launch last: a flag that is never raised hangs the launch (bounded by run.sh's
    # timeout), and everything above has printed by then.
    if args.shrink:
        for case in shrink_cases:
            failed += check_shrink(*case, args, gen)
        for name, m, x, (packed, scale, g, bias), cfg, t, bs, idx, slices, lora_a in shrink_timings:
            t_out = torch.empty_like(t)
            us = do_bench_cudagraph(lambda: gemm.linear_w4a16(
                x, packed, scale, g, bias, _config=cfg, _lora=(t_out, bs, idx, slices, lora_a)), rep=50) * 1e3
            print(f"time {name} M={m}: op+shrink {us:.2f} us (one launch)", flush=True)
    print(f"{failed} case(s) failed" if failed else "all cases match the reference")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
