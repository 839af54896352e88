"""Does vLLM serve our NVFP4 checkpoint correctly? A check that prints figures (GPU or CPU).

    python benchmarks/vllm_nvfp4_check.py --model DIR [--backend marlin|humming|dequant] [--json OUT]

DIR is a quantize-stage output (compressed-tensors nvfp4-pack-quantized). Three checks:

1. Kernels: the class behind every quantized Linear in vLLM's model (Marlin on a Hopper GPU by
   default, QeRLDequantNvFp4LinearKernel for `--backend dequant` and on CPU).
2. Layers: every quantized Linear of vLLM's model (fused qkv_proj / gate_up_proj included) is
   run on random bf16 input and compared with x·Ŵᵀ (+ bias) in float64, Ŵ our dequantization
   of the checkpoint's tensors: ‖y − ref‖ / ‖ref‖ per layer (bf16 output rounding is ~2e-3).
3. Generation: greedy tokens from vLLM, and the logprob of each under the project's
   transformers model on the same checkpoint (`components.train.model.load_base`: NVFP4Linear,
   i.e. the dequantized weights): mean and max |Δ logprob|, and how many greedy tokens agree.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def layer_errors(model, ckpt: Path, device) -> dict:
    """{vLLM module name: relative error} for every quantized Linear (runs inside vLLM)."""
    import torch
    from safetensors import safe_open

    from components.train.model import _tensor_index
    from kernels.nvfp4 import dequantize

    index = _tensor_index(ckpt)
    handles = {}

    def get(name):
        if index[name] not in handles:
            handles[index[name]] = safe_open(str(index[name]), "pt", device=str(device))
        return handles[index[name]].get_tensor(name)

    gen = torch.Generator(device=device).manual_seed(0)
    errors = {}
    for name, mod in model.named_modules():
        if getattr(mod, "scheme", None) is None or hasattr(mod, "base_layer"):
            continue
        prefix, leaf = name.rsplit(".", 1)
        parts = [f"{prefix}.{p}" for p in FUSED.get(leaf, (leaf,))]
        w = torch.cat([dequantize(get(f"{p}.weight_packed"), get(f"{p}.weight_scale"),
                                  get(f"{p}.weight_global_scale"), torch.float32) for p in parts]).double()
        bias = [get(f"{p}.bias") for p in parts if f"{p}.bias" in index]
        x = torch.randn(8, w.shape[1], generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
        y = mod(x)
        y = (y[0] if isinstance(y, tuple) else y).double()
        ref = x.double() @ w.T
        if bias:
            ref = ref + torch.cat(bias).double()
        errors[name] = ((y - ref).norm() / ref.norm()).item()
    return errors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="NVFP4 checkpoint dir (quantize stage output)")
    ap.add_argument("--backend", default="marlin", choices=("marlin", "humming", "dequant"))
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens to generate per prompt")
    ap.add_argument("--cuda-graphs", action="store_true", help="default: eager (faster start)")
    ap.add_argument("--json", help="save the figures here")
    args = ap.parse_args(argv)
    import torch

    from components.rollout.backends import engine_settings
    from components.rollout.engine import _prepare_environment

    ckpt = Path(args.model).resolve()
    cuda = torch.cuda.is_available()
    _prepare_environment(cpu=not cuda)
    extra = {}
    if cuda:
        extra, env = engine_settings(args.backend)
        os.environ.update(env)
        extra.update(gpu_memory_utilization=0.5)
    elif not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        extra.update(kv_cache_memory_bytes=2**30)
    from kernels.vllm_nvfp4_dequant import register

    register()
    from vllm import LLM, SamplingParams

    has_tok = (ckpt / "tokenizer.json").exists()
    t0 = time.time()
    llm = LLM(model=str(ckpt), dtype="bfloat16", seed=0, max_model_len=1024, enforce_eager=not args.cuda_graphs,
              skip_tokenizer_init=not has_tok, enable_prefix_caching=False, **extra)
    start_s = time.time() - t0
    device = torch.device("cuda" if cuda else "cpu")
    kernels = llm.apply_model(lambda m: sorted({type(x.scheme.kernel).__name__ for x in m.modules()
                                                if getattr(getattr(x, "scheme", None), "kernel", None)}))[0]
    errors = llm.apply_model(lambda m: layer_errors(m, ckpt, device))[0]

    if has_tok:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        texts = ["Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                 "clips in May. How many clips did Natalia sell altogether in April and May?\nAnswer:",
                 "The capital of France is", "def fibonacci(n):"]
        prompts = [tok.encode(t).ids for t in texts]
    else:
        g = torch.Generator().manual_seed(0)
        vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
        prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (40, 7, 100)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, logprobs=0, detokenize=False)
    t0 = time.time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    gen_s = time.time() - t0
    del llm
    import gc
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

    from components.train.model import load_base
    ref = load_base(ckpt, device=device)
    deltas, agree, total = [], 0, 0
    for p, o in zip(prompts, outs):
        ids = list(o.outputs[0].token_ids)
        lp = [step[t].logprob for step, t in zip(o.outputs[0].logprobs, ids)]
        inp = torch.tensor([p + ids], device=device)
        with torch.no_grad():
            logits = ref(input_ids=inp).logits[0, len(p) - 1:-1].float()
        logp = torch.log_softmax(logits, -1)
        hf = logp.gather(1, torch.tensor(ids, device=device)[:, None])[:, 0].tolist()
        deltas += [abs(a - b) for a, b in zip(lp, hf)]
        first_diff = next((i for i, (a, t) in enumerate(zip(logp.argmax(-1).tolist(), ids)) if a != t), len(ids))
        agree += first_diff
        total += len(ids)
    worst = max(errors, key=errors.get)
    res = {"model": str(ckpt), "backend": args.backend, "device": torch.cuda.get_device_name() if cuda else "cpu",
           "linear_kernels": kernels, "engine_start_s": round(start_s, 1), "layers_checked": len(errors),
           "layer_rel_err_max": max(errors.values()), "layer_rel_err_mean": sum(errors.values()) / len(errors),
           "worst_layer": worst, "generated_tokens": total, "generate_s": round(gen_s, 2),
           "greedy_tokens_agreeing_before_first_divergence": agree,
           "logprob_abs_diff_mean": sum(deltas) / len(deltas), "logprob_abs_diff_max": max(deltas)}
    ok = res["layer_rel_err_max"] < 1e-2 and res["logprob_abs_diff_mean"] < 0.05
    res["verdict"] = "PASS" if ok else "FAIL"
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
