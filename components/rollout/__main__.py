"""python -m components.rollout --model URI --prompts URI --output URI [--adapter URI]
       [--samples G] [--max-tokens N] [--temperature T] [--top-p P] [--seed S]
       [--aqn-sigma σ] [--shard I --num-shards N]

Loads vLLM offline over the NVFP4 base, serves this iteration's adapter as a LoRA (never
merged into the 4-bit weights), applies AQN to the engine's RMSNorm weights, generates G
samples per prompt with the logprob of every sampled token, and publishes one rollout shard
(rollouts schema v1) plus metrics: tokens/s, mean and max completion length, truncation rate.

The iteration's prompts are `--prompts-per-iteration` train prompts taken in a seeded order
that moves on every iteration; `--shard I --num-shards N` keeps every N-th of them, so N
parallel tasks cover each prompt exactly once. Sampling is seeded per prompt (seed, prompt
id), so a prompt's samples do not depend on which shard or batch it landed in.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import statistics
import sys
import time
from dataclasses import dataclass

from components.common.cli import ConfigError, config_dict, field, require, run_stage
from components.common.schemas import ROLLOUTS, read_artifact_table, to_table, write_ipc
from components.common.storage import Artifact, Staging, parse_uri
from components.rollout.backends import CHOICES, LORA_KERNELS

log = logging.getLogger("qerl.rollout")


@dataclass
class RolloutConfig:
    model: str = field("", help="NVFP4 base checkpoint artifact URI (quantize stage output)", metavar="URI")
    prompts: str = field("", help="prompts artifact URI (prompts stage output)", metavar="URI")
    output: str = field("", help="URI to publish this task's rollout shard at", metavar="URI")
    adapter: str = field("", help="LoRA adapter artifact URI (train stage output); '' = the base policy", metavar="URI")
    iteration: int = field(0, help="RL iteration: selects the prompts and is recorded as the policy version")
    split: str = field("train", help="prompt split to sample from: train or eval")
    prompts_per_iteration: int = field(0, help="prompts per iteration, all shards together (0 = every prompt)")
    samples: int = field(4, help="completions per prompt (the GRPO group size G)")
    max_tokens: int = field(256, help="completion length limit; longer completions end with finish_reason=length")
    temperature: float = field(1.0, help="sampling temperature")
    top_p: float = field(1.0, help="nucleus sampling threshold")
    seed: int = field(0, help="sampling seed (per prompt: hash of seed, iteration and prompt id)")
    aqn_sigma: float = field(0.0, help="AQN noise std on the decoder RMSNorm weights (0 = off)")
    aqn_seed: int = field(-1, help="seed of the AQN noise (-1: derived from --seed and --iteration)")
    shard: int = field(0, help="this task's shard index, 0..num_shards-1")
    num_shards: int = field(1, help="number of parallel rollout tasks")
    max_lora_rank: int = field(64, help="largest adapter rank accepted. The engine's LoRA slot is sized to the "
                               "adapter's own rank (rounded up to vLLM's 8, 16, 32, 64, ...); without --adapter the "
                               "engine runs without LoRA")
    max_model_len: int = field(2048, help="engine context length (prompt + completion)")
    kv_cache_gb: float = field(1.0, help="CPU KV-cache size in GiB")
    gpu_memory_utilization: float = field(0.85, help="GPU memory fraction vLLM may take")
    nvfp4_backend: str = field("auto", help="GPU kernel for the NVFP4 layers: auto (the shortest expected stage time, "
                               "engine start + tokens / measured tokens/s at this task's concurrency, from "
                               "components/rollout/backend_throughput.json), marlin, humming, "
                               "dequant (bf16 copy of the dequantized weights: cuBLAS speed, bf16 memory), "
                               "or fused (the project's Triton GEMMs on the 4-bit weights); CPUs always use "
                               "dequant", metavar="NAME")
    nvfp4_lora_kernels: str = field("vllm", help="GPU, --nvfp4-backend fused: where the adapter's LoRA runs in the "
                                    "NVFP4 layers: vllm (vLLM's Punica fill, shrink and expand: three launches per "
                                    "layer), expand (vLLM's shrink, the expand in the fused GEMM's epilogue) or fused "
                                    "(shrink and expand inside the GEMM's launch where its decode kernel serves the "
                                    "batch; kernels/nvfp4/lora.py). Sets QERL_NVFP4_LORA_EPILOGUE, over any value in "
                                    "the environment; the metrics say how many LoRA layers it reached",
                                    metavar="NAME")
    max_num_seqs: int = field(256, help="most sequences the engine runs at once (the concurrency)")
    lora_kernel_configs: str = field("bundled", help="GPU: configs of vLLM's LoRA kernels: bundled "
                                     "(components/rollout/lora_configs, tuned per GPU by benchmarks/lora_kernels.py), "
                                     "vllm (its untuned defaults) or a folder of such files", metavar="NAME|DIR")
    lora_dual_stream: bool = field(False, help="GPU: run the LoRA kernels on a second CUDA stream beside the base "
                                   "layer's GEMM (VLLM_LORA_ENABLE_DUAL_STREAM). Measured on an H200: 2-3 %% more "
                                   "tokens/s, but 30-40 s more torch.compile at every engine start unless its cache "
                                   "persists (cluster.kernel_cache_pvc)")
    overwrite: bool = field(False, help="replace an artifact already published at --output")

    def __post_init__(self):
        for name in ("model", "prompts", "output"):
            require(bool(getattr(self, name)), f"--{name} is required")
            parse_uri(getattr(self, name))
        if self.adapter:
            parse_uri(self.adapter)
        require(self.split in ("train", "eval"), f"--split must be train or eval, not {self.split!r}")
        require(self.samples >= 1, "--samples must be at least 1")
        require(self.max_tokens >= 1, "--max-tokens must be at least 1")
        require(math.isfinite(self.temperature) and self.temperature >= 0,
                f"--temperature must be a finite number >= 0, not {self.temperature}")
        require(0 < self.top_p <= 1, f"--top-p must be in (0, 1], not {self.top_p}")
        require(math.isfinite(self.aqn_sigma) and self.aqn_sigma >= 0,
                f"--aqn-sigma must be a finite number >= 0, not {self.aqn_sigma}")
        require(math.isfinite(self.kv_cache_gb) and self.kv_cache_gb > 0,
                f"--kv-cache-gb must be a positive number, not {self.kv_cache_gb}")
        require(0 < self.gpu_memory_utilization <= 1,
                f"--gpu-memory-utilization must be in (0, 1], not {self.gpu_memory_utilization}")
        require(self.num_shards >= 1 and 0 <= self.shard < self.num_shards,
                f"--shard {self.shard} is not in 0..{self.num_shards - 1}")
        require(self.iteration >= 0 and self.prompts_per_iteration >= 0, "--iteration and --prompts-per-iteration must be >= 0")
        require(self.max_model_len > self.max_tokens, "--max-model-len must exceed --max-tokens")
        require(self.max_num_seqs >= 1, "--max-num-seqs must be at least 1")
        require(self.nvfp4_backend in CHOICES, f"--nvfp4-backend must be one of {', '.join(CHOICES)}, "
                f"not {self.nvfp4_backend!r}")
        require(self.nvfp4_lora_kernels in LORA_KERNELS, f"--nvfp4-lora-kernels must be one of "
                f"{', '.join(LORA_KERNELS)}, not {self.nvfp4_lora_kernels!r}")
        require(not (self.lora_dual_stream and self.nvfp4_lora_kernels != "vllm"),
                "--lora-dual-stream runs vLLM's own LoRA kernels on a second stream: it needs "
                "--nvfp4-lora-kernels vllm")


def _h(*parts) -> int:
    """A stable 63-bit hash of the parts (seeds for per-prompt sampling and AQN)."""
    return int.from_bytes(hashlib.sha256("\x00".join(map(str, parts)).encode()).digest()[:8], "big") >> 1


def select_prompts(rows: list[dict], cfg: RolloutConfig) -> list[dict]:
    """This iteration's prompts for this shard: a seeded order over the whole split, a window
    that moves by prompts_per_iteration each iteration (wrapping), every N-th for shard I."""
    order = sorted(rows, key=lambda r: _h(cfg.seed, r["prompt_id"]))
    n = cfg.prompts_per_iteration or len(order)
    start = cfg.iteration * n
    window = [order[(start + i) % len(order)] for i in range(min(n, len(order)))]
    return window[cfg.shard::cfg.num_shards]


def pick_backend(cfg: RolloutConfig, concurrency: int, tokens: int) -> tuple[str, str]:
    """The NVFP4 backend for this task and why (see components/rollout/backends.py)."""
    import torch

    from components.rollout.backends import choose_backend, load_table

    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name() if cuda else ""
    return choose_backend(cfg.nvfp4_backend, concurrency, cuda, load_table(gpu_name=gpu) if cuda else None,
                          gpu, tokens=tokens)


def main(cfg: RolloutConfig) -> None:
    from vllm import SamplingParams

    from components.rollout.engine import EngineConfig, RolloutEngine, check_adapter, lora_slot_rank

    prompts = read_artifact_table(cfg.prompts, "prompts", [f"{cfg.split}.arrow"]).to_pylist()
    if not prompts:
        raise ConfigError(f"{cfg.prompts} holds no {cfg.split} prompts"
                          + (" (the prompts stage ran with eval_fraction 0, or too few prompts to hold any out)"
                             if cfg.split == "eval" else ""))
    chosen = select_prompts(prompts, cfg)
    if not chosen:
        raise ConfigError(f"shard {cfg.shard} of {cfg.num_shards} gets no prompts "
                          f"({len(prompts)} {cfg.split} prompts): use fewer shards")
    too_long = [r["prompt_id"] for r in chosen if len(r["prompt_token_ids"]) + cfg.max_tokens > cfg.max_model_len]
    if too_long:
        raise ConfigError(f"{len(too_long)} prompt(s), e.g. {too_long[0]}, are longer than the context allows "
                          f"(prompt + --max-tokens {cfg.max_tokens} > --max-model-len {cfg.max_model_len})")
    model_dir = Artifact(cfg.model).local_dir()
    adapter, lora_cfg = None, None
    if cfg.adapter:
        adapter = Artifact(cfg.adapter)
        adapter_dir = adapter.local_dir()
        lora_cfg = check_adapter(adapter_dir, json.loads((model_dir / "config.json").read_text()), cfg.max_lora_rank)
    backend, why = pick_backend(cfg, concurrency=min(cfg.max_num_seqs, len(chosen) * cfg.samples),
                                tokens=len(chosen) * cfg.samples * cfg.max_tokens)
    log.info("NVFP4 backend %s", why if why.startswith(backend) else f"{backend} ({why})")
    # This run serves one adapter (or none: the iteration-0 policy is the base): size the LoRA
    # slot to it, and leave LoRA out entirely without one (vLLM's LoRA kernels cost ~0.9-1.6 ms
    # of GPU time per decode step at 7B on an H200, README "Rollouts on GPUs").
    slot = lora_slot_rank(int(lora_cfg["r"])) if lora_cfg else 0
    log.info("LoRA: %s", f"one slot of rank {slot} for the adapter's r={lora_cfg['r']}" if lora_cfg
             else "off (no --adapter)")
    engine = RolloutEngine(model_dir, EngineConfig(max_lora_rank=slot or cfg.max_lora_rank, max_loras=1,
                                                   max_model_len=cfg.max_model_len,
                                                   kv_cache_gb=cfg.kv_cache_gb, seed=cfg.seed,
                                                   gpu_memory_utilization=cfg.gpu_memory_utilization,
                                                   max_num_seqs=cfg.max_num_seqs, nvfp4_backend=backend,
                                                   nvfp4_lora_kernels=cfg.nvfp4_lora_kernels,
                                                   lora_kernel_configs=cfg.lora_kernel_configs,
                                                   lora_dual_stream=cfg.lora_dual_stream),
                           enable_lora=lora_cfg is not None)
    kernels = engine.linear_kernels()
    log.info("NVFP4 linear kernel(s): %s", ", ".join(kernels) or "none (an unquantized model)")
    lora = engine.lora_request(adapter_dir, adapter.digest) if adapter else None
    aqn_seed = cfg.aqn_seed if cfg.aqn_seed >= 0 else _h("aqn", cfg.seed, cfg.iteration) % 2**31
    norms = engine.set_aqn(cfg.aqn_sigma, aqn_seed)
    log.info("AQN sigma %.2e (seed %d) on %d RMSNorm modules", cfg.aqn_sigma, aqn_seed, norms)

    params = [SamplingParams(n=cfg.samples, temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                             seed=_h(cfg.seed, cfg.iteration, r["prompt_id"]) % 2**31, logprobs=0)
              for r in chosen]
    t0 = time.time()
    outputs = engine.generate([r["prompt_token_ids"] for r in chosen], params, lora)
    seconds = time.time() - t0

    rows = []
    for prompt, out in zip(chosen, outputs):
        for i, comp in enumerate(out.outputs):
            ids = list(comp.token_ids)
            logprobs = [step[tok].logprob for step, tok in zip(comp.logprobs, ids)]
            rows.append({"prompt_id": prompt["prompt_id"], "sample_index": i,
                         "prompt_token_ids": prompt["prompt_token_ids"], "completion_token_ids": ids,
                         "completion_logprobs": logprobs, "completion_text": comp.text,
                         "finish_reason": comp.finish_reason or "stop", "answer": prompt["answer"],
                         "iteration": cfg.iteration, "adapter_digest": adapter.digest if adapter else "",
                         "aqn_sigma": cfg.aqn_sigma, "aqn_seed": aqn_seed,
                         "sampling_seed": cfg.seed, "max_tokens": cfg.max_tokens,
                         "temperature": cfg.temperature, "top_p": cfg.top_p})
    lengths = [len(r["completion_token_ids"]) for r in rows]
    # fused backend with an adapter: the LoRA mode asked for and how many LoRA layers it reached
    lora_mode = cfg.nvfp4_lora_kernels if backend == "fused" and cfg.adapter else None
    in_launch = "{}/{}".format(*engine.lora_layers_in_launch()) if lora_mode else None
    if lora_mode:
        log.info("nvfp4 LoRA kernels %s: %s LoRA layers in the fused kernel's launch", lora_mode, in_launch)
    metrics = {"prompts": len(chosen), "samples": len(rows), "completion_tokens": sum(lengths),
               "tokens_per_second": sum(lengths) / max(seconds, 1e-9), "generate_seconds": seconds,
               "engine_start_seconds": engine.start_seconds, "completion_len_mean": statistics.fmean(lengths),
               "completion_len_max": max(lengths),
               "truncation_rate": sum(r["finish_reason"] == "length" for r in rows) / len(rows),
               "aqn_sigma": cfg.aqn_sigma, "aqn_seed": aqn_seed, "aqn_modules": norms,
               "adapter": cfg.adapter, "adapter_digest": adapter.digest if adapter else "",
               "lora_rank": lora_cfg.get("r") if lora_cfg else 0, "lora_slot_rank": slot,
               "lora_kernels": engine.lora_kernels, "device": "cpu" if engine.cpu else "cuda",
               "linear_kernels": kernels, "nvfp4_backend": backend, "nvfp4_backend_reason": why,
               "nvfp4_lora_kernels": lora_mode, "nvfp4_lora_layers_in_launch": in_launch,
               "concurrency": min(cfg.max_num_seqs, len(rows))}
    with Staging() as st:
        (st.path / "rollouts.arrow").write_bytes(write_ipc(to_table(rows, ROLLOUTS)))
        (st.path / "metrics.json").write_text(json.dumps(metrics, indent=1))
        st.publish(cfg.output, stage="rollout", config=config_dict(cfg), overwrite=cfg.overwrite)
    log.info("rollouts: %d prompts × %d samples, %.1f tok/s, mean length %.0f, truncated %.0f%% → %s",
             len(chosen), cfg.samples, metrics["tokens_per_second"], metrics["completion_len_mean"],
             100 * metrics["truncation_rate"], cfg.output)


if __name__ == "__main__":
    sys.exit(run_stage(main, RolloutConfig, prog="python -m components.rollout", description=__doc__))
