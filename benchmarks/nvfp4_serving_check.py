"""Check the serving op (`torch.ops.qerl.nvfp4_linear`) on a GPU the way vLLM runs it.

For each shape (vLLM's merged Qwen2.5-7B projections) and input rows M it compares the op with
the plain-torch reference, eagerly, replayed from a captured CUDA graph, and under
torch.compile; weights carry one global scale per output row (as vLLM's fused shards do).
Prints one line per case and the config `serving.config_for` picked; exits 1 on any mismatch.
`--edge-scales` plants block scales of 0, e4m3 subnormals and 448 (the extremes of the scale
decode). The op's switches come from the environment (QERL_NVFP4_PDL, QERL_NVFP4_SCALE_PAIRS).

    python benchmarks/nvfp4_serving_check.py [--m 1 2 7 16 17 32 33 64 300] [--edge-scales]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.nvfp4_gemm_sweep import shapes_of  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 7, 16, 17, 32, 33, 64, 300])
    ap.add_argument("--shapes", default="vllm-7b", help="vllm-7b, learner-7b, or comma-separated NxK")
    ap.add_argument("--tol", type=float, default=1e-2, help="max relative error (bf16 output: ~3e-3)")
    ap.add_argument("--edge-scales", action="store_true",
                    help="set some block scales to 0, to e4m3 subnormals (2^-9 .. 7 · 2^-9) and to 448")
    args = ap.parse_args(argv)
    import torch

    from kernels.nvfp4 import dequantize, global_scale, quantize, serving

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: TRITON_INTERPRET=1
    serving.prepare(dev)
    op = torch.ops.qerl.nvfp4_linear
    failed = 0
    for name, n, k in shapes_of(args.shapes):
        w = (torch.randn(n, k, device=dev) * 0.02).bfloat16()
        packed, scale, g = quantize(w, global_scale(w))
        if args.edge_scales:
            sb = scale.view(torch.uint8)
            sb[::7, ::3] = 0  # the codes stay: a zero scale must still give zero weights
            sb[1::5, 1::4] = torch.randint(1, 8, sb[1::5, 1::4].shape, device=dev, dtype=torch.uint8)
            sb[2::9, 2::5] = 0x7E  # 448
        g = g.reshape(1).repeat(n) * torch.linspace(0.5, 1.5, n, device=dev)  # one divisor per row
        bias = torch.randn(n, device=dev).bfloat16() if name == "qkv" else None
        w = dequantize(packed, scale, torch.ones(1, device=dev), torch.float32) / g[:, None]

        def reference(x):  # float32 x @ Ŵᵀ (+ bias), Ŵ with one divisor per row
            return x.float() @ w.t() + (0 if bias is None else bias.float())

        compiled = torch.compile(lambda x: op(x, packed, scale, g, bias), dynamic=True)
        for m in args.m:
            x = torch.randn(m, k, device=dev).bfloat16()
            want = reference(x)
            eager = op(x, packed, scale, g, bias)
            x2 = torch.randn(m, k, device=dev).bfloat16()
            want2 = reference(x2)
            if dev.type == "cpu":  # no CUDA graph
                captured = op(x2, packed, scale, g, bias)
            else:
                captured = replay_from_graph(op, x, x2, (packed, scale, g, bias))
            errs = {"eager": (eager.float() - want).norm() / want.norm(),
                    "graph": (captured.float() - want2).norm() / want2.norm(),
                    "compiled": (compiled(x2).float() - want2).norm() / want2.norm()}
            ok = all(float(e) < args.tol for e in errs.values())
            failed += not ok
            sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
            cfg = serving.config_for(m, n, k, sms)
            errors = " ".join(f"{a} {float(e):.2e}" for a, e in errs.items())
            print(f"{'ok ' if ok else 'BAD'} {name} {n}x{k} M={m}: {errors}  config {cfg or 'dequantize+cuBLAS'}",
                  flush=True)
    print(f"{failed} case(s) failed" if failed else "all cases match the reference")
    return 1 if failed else 0


def replay_from_graph(op, x, x2, weights):
    """The op captured in a CUDA graph on input x, replayed after x is overwritten with x2."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        op(x, *weights)  # warm (compiles) outside the capture
        with torch.cuda.graph(graph, stream=stream):
            captured = op(x, *weights)
    torch.cuda.current_stream().wait_stream(stream)
    x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    return captured


if __name__ == "__main__":
    sys.exit(main())
