"""Throughput of NVFP4 quantize / dequantize: torch reference vs Triton.

    python benchmarks/quantize_kernels.py                # Qwen2.5-7B layer shapes
    python benchmarks/quantize_kernels.py --shapes 4096x4096 --reps 50

On CUDA: times both implementations with triton.testing.do_bench (CUDA-event timing, L2
flushed between runs) and first checks that Triton's bytes equal the reference's at every
shape. Without CUDA: times the reference only (Triton needs a GPU). Throughput is GB/s of
the bf16 weight, in*out*2 bytes, for both directions (read by quantize, written by
dequantize).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.nvfp4 import reference  # noqa: E402

# Qwen2.5-7B: hidden 3584, intermediate 18944, 28 heads / 4 KV heads of 128
QWEN25_7B = ["3584x3584", "512x3584", "18944x3584", "3584x18944"]


def parse_shape(text: str) -> tuple[int, int]:
    out, inn = (int(v) for v in text.lower().split("x"))
    return out, inn


def bench_cpu(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def bench_cuda(fn, reps: int) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=max(5, reps // 4), rep=reps * 10,
                                   return_mode="median")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--shapes", nargs="+", default=QWEN25_7B, metavar="OUTxIN",
                    help="weight shapes out x in (default: Qwen2.5-7B q/o, k/v, gate/up, down)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=None,
                    help="timed repetitions (CPU) or do_bench time budget/10 ms (CUDA); "
                         "default 3 on CPU, 20 on CUDA")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU runs only)")
    args = ap.parse_args()

    dev = torch.device(args.device)
    on_cuda = dev.type == "cuda"
    reps = args.reps or (20 if on_cuda else 3)
    if not on_cuda:
        torch.set_num_threads(args.threads)
    impls = {"reference": reference}
    if on_cuda:
        from kernels.nvfp4 import triton_kernels

        impls["triton"] = triton_kernels
    timer = bench_cuda if on_cuda else bench_cpu
    name = torch.cuda.get_device_name(dev) if on_cuda else f"CPU ({torch.get_num_threads()} threads)"
    print(f"# NVFP4 kernels on {name}; GB/s of the bf16 weight (out*in*2 bytes), median time")
    if not on_cuda:
        print("# no CUDA device: reference only (Triton kernels need a GPU)")

    header = f"{'shape':>12} {'op':>10} {'impl':>10} {'ms':>9} {'GB/s':>8} {'bit-exact':>9}"
    print(header)
    print("-" * len(header))
    all_exact = True
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    for text in args.shapes:
        out, inn = parse_shape(text)
        w = (torch.randn(out, inn, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
        g = reference.global_scale(w)
        gb = out * inn * 2 / 1e9
        q_ref = reference.quantize(w, g)
        exact = {"reference": "-"}
        if "triton" in impls:
            q_tri = impls["triton"].quantize(w, g)
            d_ref = reference.dequantize(*q_ref)
            d_tri = impls["triton"].dequantize(*q_ref)
            ok = all(same_bits(a, b) for a, b in zip(q_ref, q_tri)) and same_bits(d_ref, d_tri)
            all_exact &= ok
            exact["triton"] = "yes" if ok else "NO"
            del q_tri, d_ref, d_tri
        for impl_name, impl in impls.items():
            for op, fn in (("quantize", lambda: impl.quantize(w, g)),
                           ("dequantize", lambda: impl.dequantize(*q_ref))):
                ms = timer(fn, reps)
                print(f"{text:>12} {op:>10} {impl_name:>10} {ms:9.3f} {gb / (ms / 1e3):8.2f} "
                      f"{exact[impl_name]:>9}", flush=True)
        del w, q_ref
        if on_cuda:
            torch.cuda.empty_cache()
    if on_cuda:
        print(f"# Triton == reference bit for bit at every shape: {'yes' if all_exact else 'NO'}")
    return 0 if all_exact else 1


if __name__ == "__main__":
    sys.exit(main())
