"""Benchmark the quantize stage end to end on a random checkpoint of a real model's shape.

    python benchmarks/quantize_stage.py --shape qwen2.5-7b [--device cuda] [--workdir /tmp/qb]

Writes a random bf16 HF checkpoint (safetensors shards of 4 GB, Qwen2 layout with q/k/v
biases) once, then runs `python -m components.quantize` on it in a fresh process and prints
wall time, quantize throughput (GB/s of bf16 weights read), peak host RSS and peak GPU memory
(from the stage's metrics.json). Prints one table row per run; `--json FILE` saves them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "tiny": (256, 512, 2, 4, 2, 1024),  # a smoke test of the scripts
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064),
    "qwen2.5-32b": (5120, 27648, 64, 40, 8, 152064),
}


def qwen2_config(shape: str) -> dict:
    """The HF config.json of a Qwen2 model of `shape` (SHAPES)."""
    hidden, inter, layers, heads, kv, vocab = SHAPES[shape]
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645}


def tensor_specs(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of a Qwen2 checkpoint of `shape`, in file order."""
    hidden, inter, layers, heads, kv, vocab = SHAPES[shape]
    head_dim = hidden // heads
    specs = [("model.embed_tokens.weight", (vocab, hidden)), ("lm_head.weight", (vocab, hidden)),
             ("model.norm.weight", (hidden,))]
    for i in range(layers):
        p = f"model.layers.{i}"
        specs += [(f"{p}.input_layernorm.weight", (hidden,)), (f"{p}.post_attention_layernorm.weight", (hidden,)),
                  (f"{p}.self_attn.q_proj.weight", (heads * head_dim, hidden)), (f"{p}.self_attn.q_proj.bias", (heads * head_dim,)),
                  (f"{p}.self_attn.k_proj.weight", (kv * head_dim, hidden)), (f"{p}.self_attn.k_proj.bias", (kv * head_dim,)),
                  (f"{p}.self_attn.v_proj.weight", (kv * head_dim, hidden)), (f"{p}.self_attn.v_proj.bias", (kv * head_dim,)),
                  (f"{p}.self_attn.o_proj.weight", (hidden, heads * head_dim)),
                  (f"{p}.mlp.gate_proj.weight", (inter, hidden)), (f"{p}.mlp.up_proj.weight", (inter, hidden)),
                  (f"{p}.mlp.down_proj.weight", (hidden, inter))]
    return specs


def _random_bf16(seed: int = 0):
    """rnd(*shape): N(0, 0.02²) bf16 on the GPU when there is one (seeded)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(seed)
    return lambda *s: (torch.randn(*s, generator=gen, device=dev, dtype=torch.float32) * 0.02).to(torch.bfloat16)


def make_checkpoint(path: Path, shape: str, shard_bytes: int = 4 << 30) -> None:
    """A random bf16 HF checkpoint of `shape` at `path` (kept if it is already there)."""
    from safetensors.torch import save_file

    if (path / "config.json").exists():
        return
    path.mkdir(parents=True, exist_ok=True)
    rnd = _random_bf16()
    shards, cur, size = [], {}, 0
    for name, s in tensor_specs(shape):
        t = rnd(*s).cpu()
        if cur and size + t.numel() * 2 > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name], size = t, size + t.numel() * 2
    shards.append(cur)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        total += sum(t.numel() * 2 for t in shard.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(qwen2_config(shape), indent=1))


def make_nvfp4_checkpoint(path: Path, shape: str, shard_bytes: int = 4 << 30) -> None:
    """A random NVFP4 checkpoint of `shape` at `path`, made directly: each decoder layer's
    weights are drawn and quantized on the device (q/k/v and gate/up sharing a global scale,
    as the quantize stage does) and never written in bf16. A 32B model's bf16 checkpoint
    (~65 GB) does not fit a 64 GB disk; its NVFP4 one (~21 GB) does. Kept if already there."""
    import shutil

    from components.quantize.__main__ import (LAYER_WEIGHT, ShardWriter, fused_groups, quantization_config,
                                              write_quantized_group)

    if (path / "config.json").exists():
        return
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    rnd = _random_bf16()
    writer = ShardWriter(partial, shard_bytes)
    specs = tensor_specs(shape)
    layers: dict[str, list[str]] = {}
    for name, s in specs:
        m = LAYER_WEIGHT.match(name)
        if m and len(s) == 2:
            layers.setdefault(m["layer"], []).append(name)
        else:
            writer.add(name, rnd(*s))
    dims = dict(specs)
    for names in layers.values():
        for group in fused_groups(names):
            write_quantized_group(writer, {n: rnd(*dims[n]) for n in group})
    writer.close()
    config = qwen2_config(shape)
    config["quantization_config"] = quantization_config(["lm_head"])
    (partial / "config.json").write_text(json.dumps(config, indent=1))
    partial.rename(path)


def make_in_child(make, path: Path, shape: str) -> float:
    """Run `make(path, shape)` in a spawned process, so the generator's host and GPU memory
    (and its peak RSS) stay there; exit on failure; return the seconds it took."""
    import multiprocessing as mp

    t0 = time.time()
    gen = mp.get_context("spawn").Process(target=make, args=(path, shape))
    gen.start()
    gen.join()
    if gen.exitcode:
        sys.exit(f"making the random checkpoint {path} failed (exit code {gen.exitcode})")
    return time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--workdir", default="/tmp/qerl-bench")
    ap.add_argument("--json", help="save the figures here")
    args = ap.parse_args()
    work = Path(args.workdir)
    src, dst = work / f"{args.shape}-bf16", work / f"{args.shape}-nvfp4-{args.device}-{int(time.time())}"
    # In a child process: the stage is forked from this one, and Linux carries a parent's
    # peak RSS into the child's ru_maxrss, so this process must never hold the weights.
    seconds = make_in_child(make_checkpoint, src, args.shape)
    print(f"random {args.shape} checkpoint ready in {seconds:.1f}s at {src}", flush=True)
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "components.quantize", "--input", str(src), "--output", str(dst),
                           "--device", args.device], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.time() - t0
    if proc.returncode:
        sys.exit(proc.returncode)
    m = json.loads((dst / "metrics.json").read_text())
    row = {"shape": args.shape, "device": m["device"], "kernel": m["kernel"], "bf16_gb": round(m["bf16_gb_read"], 2),
           "quantize_s": round(m["seconds"], 1), "stage_wall_s": round(wall, 1), "gb_per_s": round(m["throughput_gb_s"], 2),
           "peak_host_rss_gb": round(m["peak_host_rss_mb"] / 1024, 2), "peak_gpu_gb": round(m["peak_gpu_mb"] / 1024, 2),
           "rel_error_mean": round(m["rel_error_mean"], 4)}
    print(" | ".join(f"{k}={v}" for k, v in row.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
