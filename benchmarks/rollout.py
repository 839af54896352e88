"""Rollout throughput: NVFP4 (each backend) vs BF16, LoRA on, at several concurrencies.

    python benchmarks/rollout.py --shape qwen2.5-7b --backends bf16,marlin,humming,dequant \\
        --concurrency 1,16,64,256 --out /tmp/rollout-bench [--write-table]

Random weights of a real model's shape (`load_format="dummy"`, no tokenizer), a PEFT LoRA of
rank `--lora-rank` on q,k,v,o,gate,up,down (random, nonzero) served through `LoRARequest`,
`--prompt-len` random prompt tokens and `--max-tokens` new tokens per sequence (ignore_eos),
temperature 1.0, and, as the rollout stage asks, the log-prob of every sampled token under the
distribution sampled from (`--logprobs off` leaves them out, as every figure before 2026-12-05 did). For each concurrency c, c sequences are generated together and the output
tokens/s is c·max_tokens / wall time (one warm-up batch first). Each backend runs in its own
process (one vLLM engine per process). Prints a table and, per concurrency, the NVFP4 backend
the rollout stage's `auto` would choose from these figures; `--write-table` saves them as the
stage's measured table (components/rollout/backend_throughput.json).

Backends: bf16 (unquantized config), marlin / humming (vLLM's W4A16 kernels), dequant (the
project's dequantize-once kernel: bf16 GEMMs over the NVFP4 model's dequantized weights), fused
(the project's Triton W4A16 GEMMs on the packed weights, kernels/nvfp4/serving.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quantize_stage import SHAPES, qwen2_config  # noqa: E402

BACKENDS = ("bf16", "marlin", "humming", "dequant", "fused")


def model_dir(root: Path, shape: str, quantized: bool) -> Path:
    """A config-only checkpoint dir (weights come from load_format='dummy')."""
    d = root / f"{shape}-{'nvfp4' if quantized else 'bf16'}"
    d.mkdir(parents=True, exist_ok=True)
    config = qwen2_config(shape)
    if quantized:
        from components.quantize.__main__ import quantization_config

        config["quantization_config"] = quantization_config(["lm_head"])
    (d / "config.json").write_text(json.dumps(config, indent=1))
    return d


def lora_dir(root: Path, shape: str, rank: int) -> Path:
    """A PEFT adapter with random nonzero A and B (so the LoRA kernels really run)."""
    import torch
    from safetensors.torch import save_file

    hidden, inter, layers, heads, kv, _ = SHAPES[shape]
    hd = hidden // heads
    dims = {"self_attn.q_proj": (hidden, heads * hd), "self_attn.k_proj": (hidden, kv * hd),
            "self_attn.v_proj": (hidden, kv * hd), "self_attn.o_proj": (heads * hd, hidden),
            "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter), "mlp.down_proj": (inter, hidden)}
    d = root / f"{shape}-lora-r{rank}"
    if (d / "adapter_model.safetensors").exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(layers):
        for name, (fan_in, fan_out) in dims.items():
            p = f"base_model.model.model.layers.{i}.{name}"
            tensors[f"{p}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) * 0.01).to(torch.bfloat16)
            tensors[f"{p}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.01).to(torch.bfloat16)
    save_file(tensors, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "bias": "none", "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "base_model_name_or_path": "random"}))
    return d


def worker(args) -> dict:
    """One engine, every concurrency; returns the figures."""
    import torch

    from components.rollout.backends import engine_settings
    from components.rollout.engine import EngineConfig, _prepare_environment, set_lora_kernel_environment

    root = Path(args.out)
    backend = args.worker
    _prepare_environment(cpu=False)
    extra, env = ({}, {"QERL_NVFP4_BACKEND": ""}) if backend == "bf16" else engine_settings(backend)
    os.environ.update(env)
    stage = EngineConfig()
    configs = stage.lora_kernel_configs if args.lora_kernel_configs == "stage" else args.lora_kernel_configs
    dual = stage.lora_dual_stream if args.lora_dual_stream == "stage" else args.lora_dual_stream == "on"
    print(f"[{backend}] LoRA kernels: {set_lora_kernel_environment(configs, dual)}", flush=True)  # as the stage
    from kernels.vllm_nvfp4_dequant import register

    register()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    conc = [int(c) for c in args.concurrency.split(",")]
    mdir = model_dir(root, args.shape, quantized=backend != "bf16")
    use_lora = args.lora_rank > 0
    ldir = lora_dir(root, args.shape, args.lora_rank) if use_lora else None
    sizes = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, 512} & set(range(1, max(conc) + 1)) | set(conc))
    t0 = time.time()
    llm = LLM(model=str(mdir), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              enable_lora=use_lora, max_lora_rank=(args.lora_slot_rank or args.lora_rank) if use_lora else 16,
              max_loras=1,
              max_num_seqs=max(conc),
              max_model_len=args.prompt_len + args.max_tokens + 16, enable_prefix_caching=False,
              gpu_memory_utilization=args.gpu_memory_utilization,
              compilation_config={"cudagraph_capture_sizes": sizes},
              **({"logprobs_mode": "processed_logprobs"} if args.logprobs == "on" else {}), **extra)
    start_s = time.time() - t0

    def inspect(model):
        kernels = sorted({type(m.scheme.kernel).__name__ for m in model.modules()
                          if getattr(getattr(m, "scheme", None), "kernel", None) is not None})
        nbytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
        return kernels, nbytes

    kernels, weight_bytes = llm.apply_model(inspect)[0]
    lora = LoRARequest("bench", 1, str(ldir)) if use_lora else None
    gen = torch.Generator().manual_seed(1)
    vocab = SHAPES[args.shape][5]

    def batch(c, tokens):
        prompts = [{"prompt_token_ids": torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()}
                   for _ in range(c)]
        params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, detokenize=False, seed=0,
                                logprobs=0 if args.logprobs == "on" else None)
        t = time.time()
        outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs), time.time() - t

    result = {"backend": backend, "shape": args.shape, "lora_rank": args.lora_rank,
              "lora_slot_rank": (args.lora_slot_rank or args.lora_rank) if use_lora else 0,
              "engine_start_s": round(start_s, 1), "linear_kernels": kernels, "logprobs": args.logprobs == "on",
              "weight_gib": round(weight_bytes / 2**30, 2), "gpu": torch.cuda.get_device_name(), "vllm": vllm.__version__,
              "tokens_per_second": {}, "seconds": {}}
    deadline = time.time() + args.budget_s
    for c in conc:
        if time.time() > deadline:
            print(f"[{backend}] time budget spent: concurrency {c} skipped", flush=True)
            continue
        batch(c, 16)  # warm-up: this batch size's graphs and the LoRA slot
        n, s = batch(c, args.max_tokens)
        result["tokens_per_second"][str(c)] = round(n / s, 1)
        result["seconds"][str(c)] = round(s, 2)
        print(f"[{backend}] concurrency {c}: {n} tokens in {s:.2f}s = {n / s:,.1f} tok/s", flush=True)
    if args.greedy_check:
        result["greedy"] = greedy_tokens(llm, lora, vocab, args.greedy_check)
    result["lora_env"] = {k: os.environ.get(k) for k in ("VLLM_LORA_ENABLE_DUAL_STREAM", "VLLM_TUNED_CONFIG_FOLDER",
                                                         "QERL_NVFP4_LORA_EPILOGUE")}
    result["lora_kernels"] = {"configs": configs, "dual_stream": dual}
    for c in [int(c) for c in args.profile.split(",") if c]:
        result.setdefault("profile", {})[str(c)] = profile_decode(batch, c, backend)
    return result


def greedy_tokens(llm, lora, vocab: int, tokens: int) -> dict:
    """Greedy continuations of 4 fixed prompts (1, 3, 5 and 8 sequences' worth of rows go through
    the same kernels as decoding does), with the adapter and without it, and each chosen token's
    log-prob: two engines on the same dummy weights (vLLM seeds them) and adapter must agree,
    and the adapter must change them (`--greedy-check`; compare two runs' results files)."""
    import torch
    from vllm import SamplingParams

    gen = torch.Generator().manual_seed(7)
    prompts = [{"prompt_token_ids": torch.randint(0, vocab, (n,), generator=gen).tolist()} for n in (5, 17, 33, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, logprobs=0)
    out = {}
    for name, req in (("lora", lora), ("base", None)):
        res = llm.generate(prompts, params, lora_request=req, use_tqdm=False)
        out[name] = [list(o.outputs[0].token_ids) for o in res]
        out[name + "_logprobs"] = [[round(float(next(iter(d.values())).logprob), 4) for d in o.outputs[0].logprobs]
                                   for o in res]
    return out


# kernel-name fragments → what the time is spent on (first match wins)
KERNEL_KINDS = (("lora", ("_lora_shrink", "_lora_expand")),
                ("nvfp4 gemm", ("marlin", "humming", "w4a16", "dequant", "_decode_kernel", "_swap_kernel",
                                "_wgmma_kernel", "_ws_kernel")),  # the last four: fused's (kernels/nvfp4/)
                ("attention", ("flash", "fmha", "attn", "attention", "paged", "reshape_and_cache")),
                ("bf16 gemm", ("nvjet", "gemm", "gemv", "cutlass", "xmma", "cublas", "splitk")),
                ("memset/copy", ("memset", "memcpy", "copy", "fill")))


def _profiled(batch, c: int, tokens: int) -> dict:
    """One batch under the torch profiler (CUPTI; kernels inside CUDA graphs included): wall ns,
    GPU ns by kernel kind and by kernel, and the union of the kernel intervals (`busy`: kernels
    on two streams overlap)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _, wall = batch(c, tokens)
    out = {"wall": wall * 1e9, "kinds": {}, "kernels": {}, "busy": 0}
    spans = []
    for ev in prof.profiler.kineto_results.events():
        if ev.device_type().name != "CUDA":
            continue
        ns, name = ev.duration_ns(), ev.name()
        kind = next((k for k, frags in KERNEL_KINDS if any(f in name.lower() for f in frags)), "other")
        out["kinds"][kind] = out["kinds"].get(kind, 0) + ns
        out["kernels"][name] = out["kernels"].get(name, 0) + ns
        spans.append((ev.start_ns(), ev.end_ns()))
    end = None
    for s0, s1 in sorted(spans):
        if end is None or s0 > end:
            out["busy"], end = out["busy"] + (s1 - s0), s1
        elif s1 > end:
            out["busy"], end = out["busy"] + (s1 - end), s1
    return out


def profile_decode(batch, c: int, backend: str, steps: int = 64) -> dict:
    """Where one decode step's time goes at concurrency c, in ms: a batch of 1 + `steps` new
    tokens minus a batch of 1 (the prefill and the first token), divided by `steps`. GPU time
    by kernel kind and by kernel, the GPU busy time (union of kernel intervals), and the wall
    time; wall minus busy is time the GPU had nothing to run (host work, syncs)."""
    batch(c, 8)
    short, long = _profiled(batch, c, 1), _profiled(batch, c, 1 + steps)

    def per_step(key, sub=None):
        a, b = (long[key], short[key]) if sub is None else (long[key].get(sub, 0), short[key].get(sub, 0))
        return round((a - b) / 1e6 / steps, 3)

    kinds = {k: per_step("kinds", k) for k in long["kinds"]}
    top = sorted(long["kernels"], key=lambda k: -per_step("kernels", k))[:15]
    res = {"wall_ms_per_step": per_step("wall"), "gpu_busy_ms_per_step": per_step("busy"),
           "gpu_ms_per_step": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
           "top_kernels_ms_per_step": {k[:120]: per_step("kernels", k) for k in top},
           "prefill_wall_ms": round(short["wall"] / 1e6, 3)}
    print(f"[{backend}] decode profile c={c}: {res['wall_ms_per_step']:.2f} ms per step, GPU busy "
          f"{res['gpu_busy_ms_per_step']:.2f}: " + ", ".join(f"{k} {v:.2f}" for k, v in res["gpu_ms_per_step"].items()),
          flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma list of " + ", ".join(BACKENDS))
    ap.add_argument("--concurrency", default="1,16,64,256", help="comma list of sequences in flight")
    ap.add_argument("--lora-rank", type=int, default=32, help="0: no LoRA (to see what the adapter costs)")
    ap.add_argument("--lora-slot-rank", type=int, default=0,
                    help="the engine's max_lora_rank (default: --lora-rank, what the rollout stage uses)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--budget-s", type=float, default=400, help="per backend: skip concurrencies after this")
    ap.add_argument("--out", default="/tmp/qerl-rollout-bench", help="work dir; results go to results-*.json")
    ap.add_argument("--write-table", nargs="?", const="components/rollout/backend_throughput.json", default=None,
                    help="merge the figures (all results-*.json in --out) into the stage's measured table of this "
                         "GPU model: the backends and concurrencies measured replace theirs, the rest stays")
    ap.add_argument("--lora-dual-stream", choices=("stage", "on", "off"), default="stage",
                    help="VLLM_LORA_ENABLE_DUAL_STREAM (LoRA on a second CUDA stream beside the base GEMM); "
                         "stage: as the rollout stage sets it")
    ap.add_argument("--lora-kernel-configs", default="stage",
                    help="configs of vLLM's LoRA kernels: 'bundled', 'vllm' (its defaults), a folder "
                         "(see components/rollout/engine.py lora_kernel_environment) or 'stage' (what the "
                         "rollout stage uses)")
    ap.add_argument("--profile", default="", help="comma list of concurrencies at which to profile the decode "
                                                 "(GPU time per step by kernel kind vs wall time, prefill excluded)")
    ap.add_argument("--logprobs", choices=("on", "off"), default="on",
                    help="return each sampled token's log-prob, as the rollout stage does (on)")
    ap.add_argument("--greedy-check", type=int, default=0, metavar="N",
                    help="also record N greedy tokens of 4 fixed prompts with and without the adapter "
                         "(to compare two runs, e.g. QERL_NVFP4_LORA_EPILOGUE=0 and 1)")
    ap.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        res = worker(args)
        (out / f"results-{args.worker}.json").write_text(json.dumps(res, indent=1))
        return 0
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        ap.error(f"unknown backend(s) {bad}; choose from {', '.join(BACKENDS)}")
    here = Path(__file__).resolve().parents[1]
    for b in backends:
        (out / f"results-{b}.json").unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--worker", b] + [a for a in (argv or sys.argv[1:])]
        print(f"=== {b}", flush=True)
        rc = subprocess.run(cmd, cwd=here, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        if rc:
            print(f"[{b}] worker failed with exit code {rc}", flush=True)
    report(out, args.write_table)
    return 0


def _lora_kernels(result: dict) -> dict:
    """The LoRA kernel settings a result was measured with (older results: from its environment,
    or vLLM's defaults if it predates both)."""
    if "lora_kernels" in result:
        return result["lora_kernels"]
    env = result.get("lora_env") or {}
    return {"configs": env.get("VLLM_TUNED_CONFIG_FOLDER") or "vllm",
            "dual_stream": env.get("VLLM_LORA_ENABLE_DUAL_STREAM") == "1"}


def report(out: Path, table_path: str | None) -> None:
    from components.rollout.backends import NVFP4_BACKENDS, choose_backend, merge_table

    results = {}
    for f in sorted(out.glob("results-*.json")):
        r = json.loads(f.read_text())
        results[r["backend"]] = r
    if not results:
        print("no results")
        return
    conc = sorted({int(c) for r in results.values() for c in r["tokens_per_second"]})
    order = [b for b in BACKENDS if b in results]
    print("\n| backend | kernels | weights GiB | engine start s | " + " | ".join(f"c={c}" for c in conc) + " |")
    print("|---|---|---|---|" + "---|" * len(conc))
    for b in order:
        r = results[b]
        cells = [f"{r['tokens_per_second'][str(c)]:,.0f}" if str(c) in r["tokens_per_second"] else "–" for c in conc]
        print(f"| {b} | {', '.join(r['linear_kernels']) or 'none'} | {r['weight_gib']} | {r['engine_start_s']} | "
              + " | ".join(cells) + " |")
    any_r = next(iter(results.values()))
    gpus = {r["gpu"] for r in results.values()}
    if len(gpus) > 1 and table_path:
        raise SystemExit(f"{out} holds results of several GPUs ({', '.join(sorted(gpus))}): one table is one GPU "
                         "model; give --out a folder of one machine's results")
    rank = any_r.get("lora_rank", 32)  # results written before lora_rank was recorded ran r32
    lora = f"LoRA r{rank}" if rank else "no LoRA"
    lora += ", sampled-token logprobs" if any_r.get("logprobs") else ", no logprobs"
    table = {"gpu": any_r["gpu"],
             "measured_on": f"{any_r['gpu']}, vLLM {any_r.get('vllm', '?')}, {any_r['shape']} shape, {lora}, "
                            f"benchmarks/rollout.py, {time.strftime('%Y-%m-%d')}",
             "tokens_per_second": {b: r["tokens_per_second"] for b, r in results.items()},
             "engine_start_s": {b: r["engine_start_s"] for b, r in results.items()},
             "lora_kernels": {b: _lora_kernels(r) for b, r in results.items()}}
    bf16 = results.get("bf16", {}).get("tokens_per_second", {})
    print("\nfastest NVFP4 backend per concurrency (steady state; the rollout stage's auto also counts "
          "engine start against the task's tokens, see components/rollout/backends.py):")
    for c in conc:
        if not any(str(c) in results[b]["tokens_per_second"] for b in NVFP4_BACKENDS if b in results):
            continue
        best, why = choose_backend("auto", c, True, table, any_r["gpu"])
        ratio = (f" = {table['tokens_per_second'][best][str(c)] / bf16[str(c)]:.2f}× bf16"
                 if str(c) in bf16 and str(c) in table["tokens_per_second"][best] else "")
        print(f"  c={c}: {best}{ratio}  ({why})")
    if table_path:
        held = merge_table(Path(table_path), table)
        print(f"wrote the {any_r['gpu']} table into {table_path} "
              f"(it holds: {', '.join(t.get('gpu', '?') for t in held)})")


if __name__ == "__main__":
    sys.exit(main())
