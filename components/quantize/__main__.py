"""python -m components.quantize --input SRC --output DST

Turns a bf16 HF checkpoint into the NVFP4A16 checkpoint that vLLM (rollouts) and the learner
load: compressed-tensors format `nvfp4-pack-quantized`, as llm-compressor writes it
data-free. Every decoder Linear weight (2-D `*.weight` inside `layers.N.`) becomes
`weight_packed` + `weight_scale` + `weight_global_scale`; embeddings, norms, biases and
lm_head stay as they are. q/k/v and gate/up share one global scale (vLLM fuses them). A
Linear whose input size is not a multiple of 16 stays bf16 and is added to `ignore`.

It streams: tensors are read lazily from the source shards one decoder layer at a time and
written to output shards of at most `--max-shard-mb`, so peak host memory is about one layer
group plus two output shards (safetensors serializes a shard in memory), not the model.
Kernels: Triton on a GPU, the plain-torch reference on the CPU (bit-identical). Metrics: each
layer's relative error ‖Ŵ−W‖/‖W‖, throughput and peak memory.
"""
from __future__ import annotations

import json
import logging
import re
import resource
import shutil
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from components.common.cli import ConfigError, config_dict, field, require, run_stage, set_cpu_threads
from components.common.storage import Artifact, Staging, exists, fetch_external_dir, parse_uri

log = logging.getLogger("qerl.quantize")

# Decoder Linear weights: `…layers.<n>.<module path>.weight`, 2-D.
LAYER_WEIGHT = re.compile(r"^(?P<layer>(?:.*\.)?layers\.\d+)\.(?P<module>.+)\.weight$")
# Modules that vLLM fuses, so they must share one global scale: (group name, members).
FUSED = (("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
         ("gate_up", ("mlp.gate_proj", "mlp.up_proj")))
COPIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
                "added_tokens.json")


@dataclass
class QuantizeConfig:
    input: str = field("", help="bf16 HF checkpoint: a published artifact, an HF checkpoint dir or s3 prefix", metavar="SRC")
    output: str = field("", help="URI to publish the NVFP4 checkpoint at", metavar="DST")
    device: str = field("auto", help="'auto' (cuda if present, else cpu), 'cuda' or 'cpu'")
    max_shard_mb: int = field(1024, help="largest output safetensors shard, in MB (peak memory holds about two)")
    overwrite: bool = field(False, help="replace an artifact already published at --output")

    def __post_init__(self):
        require(bool(self.input), "--input is required")
        require(bool(self.output), "--output is required")
        parse_uri(self.input), parse_uri(self.output)
        require(self.device in ("auto", "cuda", "cpu"), f"--device must be auto, cuda or cpu, not {self.device!r}")
        require(self.max_shard_mb > 0, "--max-shard-mb must be positive")


def open_source(uri: str) -> Path:
    """A local directory with the source checkpoint (verified if it is a published artifact)."""
    src = Artifact(uri).local_dir() if exists(uri) else fetch_external_dir(uri)
    if not (src / "config.json").is_file():
        raise ConfigError(f"{uri} is not an HF checkpoint: no config.json")
    if not list(src.glob("*.safetensors")):
        raise ConfigError(f"{uri} is not a safetensors checkpoint: no *.safetensors files")
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise ConfigError(f"{uri} is already quantized ({method}); quantize a bf16/fp16/fp32 checkpoint")
    moe = [k for k in ("num_experts", "num_local_experts", "n_routed_experts") if config.get(k)]
    if moe:
        raise ConfigError(f"{uri} is a mixture-of-experts model ({moe[0]}={config[moe[0]]}): not supported yet "
                          "(its routers must stay bf16 and its experts need vLLM's NVFP4 MoE path); "
                          "dense Llama / Qwen-style decoders are")
    return src


def tensor_index(src: Path) -> dict[str, Path]:
    """tensor name → shard file, from the index if there is one."""
    index = sorted(src.glob("*.safetensors.index.json"))
    if index:
        weight_map = json.loads(index[0].read_text())["weight_map"]
        return {name: src / shard for name, shard in weight_map.items()}
    from safetensors import safe_open
    out = {}
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            out.update({k: shard for k in f.keys()})
    return out


def plan(names: list[str], shapes: dict[str, tuple]) -> tuple[dict[str, list[str]], list[str], list[str]]:
    """Group the quantizable weights by layer; return ({layer: [weight names]}, kept names, ignored modules)."""
    layers, kept, ignored = defaultdict(list), [], []
    for name in names:
        m = LAYER_WEIGHT.match(name)
        if m and len(shapes[name]) == 2:
            if shapes[name][1] % 16:
                ignored.append(name[: -len(".weight")])
                kept.append(name)
            else:
                layers[m["layer"]].append(name)
        else:
            kept.append(name)
            # a 2-D Linear outside the decoder layers (a projector, an MTP head) stays bf16, so the
            # checkpoint must say so, or vLLM builds an NVFP4 layer for it; embeddings and lm_head
            # are not Linear layers of compressed-tensors' scheme (lm_head is always listed)
            if len(shapes[name]) == 2 and name.endswith(".weight") and "embed" not in name \
                    and not name.endswith("lm_head.weight"):
                ignored.append(name[: -len(".weight")])
    return dict(layers), kept, ignored


def fused_groups(weights: list[str]) -> list[list[str]]:
    """Split one layer's weights into groups that share a global scale."""
    groups, rest = [], set(weights)
    for _, members in FUSED:
        g = [w for w in weights if any(w.endswith(f".{m}.weight") for m in members)]
        if g:
            groups.append(g)
            rest -= set(g)
    return groups + [[w] for w in sorted(rest)]


class ShardWriter:
    """Accumulate tensors and write safetensors shards of bounded size, plus the index."""

    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max_bytes = out, max_bytes
        self.pending, self.pending_bytes, self.shards, self.weight_map = {}, 0, [], {}

    def add(self, name: str, tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous().cpu()
        self.pending_bytes += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        from safetensors.torch import save_file
        path = self.out / f"model-{len(self.shards) + 1:05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.shards.append(path)
        self.weight_map.update({k: path.name for k in self.pending})
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> int:
        self.flush()
        n = len(self.shards)
        for i, path in enumerate(self.shards, 1):  # HF naming: model-0000i-of-0000n.safetensors
            final = path.with_name(f"model-{i:05d}-of-{n:05d}.safetensors")
            path.rename(final)
            self.weight_map = {k: (final.name if v == path.name else v) for k, v in self.weight_map.items()}
        total = sum((self.out / f).stat().st_size for f in set(self.weight_map.values()))
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return total


def write_quantized_group(writer: ShardWriter, weights: dict) -> list:
    """Quantize one fused group `{name.weight: tensor}` under a shared global scale and add
    each `name.weight_packed / weight_scale / weight_global_scale` to `writer`; returns
    (name, weight, NVFP4Tensor) per member."""
    import kernels.nvfp4 as nvfp4

    g = nvfp4.global_scale(*weights.values())
    out = []
    for n, w in weights.items():
        q = nvfp4.quantize(w, g)
        base = n[: -len(".weight")]
        writer.add(f"{base}.weight_packed", q.weight_packed)
        writer.add(f"{base}.weight_scale", q.weight_scale)
        writer.add(f"{base}.weight_global_scale", q.weight_global_scale)
        out.append((n, w, q))
    return out


def quantization_config(ignore: list[str]) -> dict:
    """The `quantization_config` block, built by compressed-tensors itself (what vLLM parses)."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme

    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("NVFP4A16", ["Linear"])},
                            ignore=ignore, format="nvfp4-pack-quantized",
                            quantization_status=QuantizationStatus.COMPRESSED)
    # Mirrors compressed-tensors' ModelCompressor.update_config.
    return {"version": compressed_tensors.__version__, "quant_method": "compressed-tensors",
            "sparsity_config": {}, "transform_config": {},
            **qc.model_dump(mode="json", exclude={"quant_method"})}


def quantize_checkpoint(src: Path, dst: Path, device: str, max_shard_mb: int) -> dict:
    import torch
    from safetensors import safe_open
    from tqdm import tqdm

    import kernels.nvfp4 as nvfp4

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    index = tensor_index(src)

    # Each read opens its shard and closes it again: a mapping kept open would keep every
    # page already read resident, and peak memory would grow to the whole model.
    def load(name: str):
        with safe_open(index[name], "pt", device="cpu") as f:
            return f.get_tensor(name)

    shapes = {}
    for shard in sorted(set(index.values())):
        with safe_open(shard, "pt", device="cpu") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})

    names = sorted(index)
    layers, kept, ignored = plan(names, shapes)
    if not layers:
        raise ConfigError(f"{src} has no decoder Linear weights (nothing matches 'layers.N.*.weight')")
    if ignored:
        log.warning("%d Linear layer(s) have in_features not divisible by 16 and stay bf16: %s",
                    len(ignored), ", ".join(ignored[:5]))
    writer = ShardWriter(dst, max_shard_mb << 20)
    errors, bytes_in, t0 = {}, 0, time.time()
    for name in kept:
        writer.add(name, load(name))
    for layer in tqdm(sorted(layers, key=lambda s: int(s.rsplit(".", 1)[1])), desc="quantize", unit="layer"):
        for group in fused_groups(layers[layer]):
            weights = {n: load(n).to(dev) for n in group}
            for n, w in weights.items():
                if not torch.isfinite(w).all():
                    raise ConfigError(f"{n} has NaN/Inf values; refusing to quantize it")
            for n, w, q in write_quantized_group(writer, weights):
                w_hat = nvfp4.dequantize(q.weight_packed, q.weight_scale, q.weight_global_scale, torch.float32)
                wf = w.float()
                errors[n[: -len(".weight")]] = float((w_hat - wf).norm() / wf.norm().clamp_min(1e-30))
                bytes_in += w.numel() * w.element_size()
            del weights
    seconds = time.time() - t0
    total = writer.close()
    config = json.loads((src / "config.json").read_text())
    lm_head = ["lm_head"]
    config["quantization_config"] = quantization_config(lm_head + ignored)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    peak_gpu = torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0
    return {
        "device": dev.type, "kernel": "triton" if dev.type == "cuda" else "reference",
        "layers": len(layers), "quantized_linears": len(errors), "ignored_linears": ignored,
        "seconds": round(seconds, 3), "bf16_gb_read": bytes_in / 1e9,
        "throughput_gb_s": bytes_in / 1e9 / max(seconds, 1e-9), "output_bytes": total,
        "peak_host_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_gpu_mb": peak_gpu / 2**20,
        "rel_error_mean": sum(errors.values()) / len(errors), "rel_error_max": max(errors.values()),
        "rel_error": errors,
    }


def main(cfg: QuantizeConfig) -> None:
    set_cpu_threads()
    src = open_source(cfg.input)
    with Staging() as st:
        metrics = quantize_checkpoint(src, st.path, cfg.device, cfg.max_shard_mb)
        (st.path / "metrics.json").write_text(json.dumps(metrics, indent=1))
        st.publish(cfg.output, stage="quantize", config=config_dict(cfg), overwrite=cfg.overwrite)
    log.info("quantized %d Linear layers in %.1fs (%.2f GB/s, mean rel. error %.4f) → %s",
             metrics["quantized_linears"], metrics["seconds"], metrics["throughput_gb_s"],
             metrics["rel_error_mean"], cfg.output)


if __name__ == "__main__":
    sys.exit(run_stage(main, QuantizeConfig, prog="python -m components.quantize", description=__doc__))
