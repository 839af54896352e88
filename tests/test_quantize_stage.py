"""The quantize stage: a bf16 HF checkpoint → NVFP4A16 compressed-tensors checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from components.common.storage import Artifact
from kernels.nvfp4 import reference
from tests.conftest import run_cli


def tiny_llama(path: Path, intermediate: int = 96, shards: bool = False, poison: str | None = None) -> Path:
    """A random 2-layer Llama saved as an HF safetensors checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=intermediate, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    if poison:
        with torch.no_grad():
            model.get_submodule(poison).weight[0, 0] = float("nan")
    model.save_pretrained(path, max_shard_size="60KB" if shards else "5GB")
    return path


def tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_smollm2_checkpoint_layout(smollm2_artifact, smollm2_nvfp4):
    art = Artifact(str(smollm2_nvfp4))
    assert art.manifest["stage"] == "quantize"
    config = json.loads(art.read_bytes("config.json"))
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["strategy"], w["group_size"], w["symmetric"]) == (4, "float", "tensor_group", 16, True)
    assert qc["config_groups"]["group_0"]["input_activations"] is None and qc["ignore"] == ["lm_head"]
    assert {"tokenizer.json", "chat_template.jinja", "generation_config.json", "model.safetensors.index.json"} <= set(art.names())

    q, src = tensors(smollm2_nvfp4), tensors(smollm2_artifact)
    layers = config["num_hidden_layers"]
    packed = [k for k in q if k.endswith(".weight_packed")]
    assert len(packed) == 7 * layers  # every decoder Linear
    for k in packed:
        base = k[: -len(".weight_packed")]
        out, inp = src[base + ".weight"].shape
        assert q[k].dtype == torch.uint8 and q[k].shape == (out, inp // 2)
        assert q[base + ".weight_scale"].dtype == torch.float8_e4m3fn and q[base + ".weight_scale"].shape == (out, inp // 16)
        assert q[base + ".weight_global_scale"].dtype == torch.float32 and q[base + ".weight_global_scale"].shape == (1,)
        assert base + ".weight" not in q
    for k in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert q[k].dtype == torch.bfloat16 and torch.equal(q[k], src[k])
    # fused groups share one global scale: the smallest of the group
    p = "model.layers.3"
    gs = [q[f"{p}.self_attn.{m}_proj.weight_global_scale"] for m in "qkv"]
    assert gs[0] == gs[1] == gs[2]
    assert gs[0] == reference.global_scale(*[src[f"{p}.self_attn.{m}_proj.weight"] for m in "qkv"])
    assert q[f"{p}.mlp.gate_proj.weight_global_scale"] == q[f"{p}.mlp.up_proj.weight_global_scale"]
    # the stage writes exactly what the reference kernel computes
    for name in ("self_attn.k_proj", "mlp.down_proj"):
        base = f"{p}.{name}"
        ref = reference.quantize(src[base + ".weight"], q[base + ".weight_global_scale"])
        assert torch.equal(q[base + ".weight_packed"], ref.weight_packed)
        assert torch.equal(q[base + ".weight_scale"].view(torch.uint8), ref.weight_scale.view(torch.uint8))
    metrics = art.read_json("metrics.json")
    assert len(metrics["rel_error"]) == 7 * layers and 0.05 < metrics["rel_error_mean"] < 0.15
    assert metrics["kernel"] == "reference" and metrics["peak_host_rss_mb"] > 0


def test_streams_sharded_source_and_keeps_odd_linears_bf16(tmp_path):
    src = tiny_llama(tmp_path / "src", intermediate=72, shards=True)  # down_proj in=72: not a multiple of 16
    assert len(list(src.glob("*.safetensors"))) >= 3
    run_cli("components.quantize", "--input", str(src), "--output", str(tmp_path / "q"), "--max-shard-mb", "1")
    q = tensors(tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["ignore"] == ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert q["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.0.mlp.up_proj.weight_packed" in q and q["lm_head.weight"].dtype == torch.bfloat16
    metrics = json.loads((tmp_path / "q" / "metrics.json").read_text())
    assert metrics["ignored_linears"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(q)
    for name, shard in index["weight_map"].items():
        with safe_open(tmp_path / "q" / shard, "pt") as f:
            assert name in f.keys()


def test_linears_outside_the_decoder_layers_stay_bf16_and_are_listed():
    from components.quantize.__main__ import plan

    shapes = {"model.embed_tokens.weight": (64, 32), "model.layers.0.self_attn.q_proj.weight": (32, 32),
              "model.layers.0.input_layernorm.weight": (32,), "model.mm_projector.weight": (32, 48),
              "lm_head.weight": (64, 32)}
    layers, kept, ignored = plan(list(shapes), shapes)
    assert layers == {"model.layers.0": ["model.layers.0.self_attn.q_proj.weight"]}
    assert ignored == ["model.mm_projector"]  # lm_head is always listed by the stage; embeddings are no Linear
    assert set(kept) == set(shapes) - {"model.layers.0.self_attn.q_proj.weight"}


def test_transformers_loads_the_checkpoint_dequantized(tmp_path):
    """compressed-tensors' own decompression (through transformers) of our checkpoint gives
    exactly our dequantized weights."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    src = tiny_llama(tmp_path / "src")
    run_cli("components.quantize", "--input", str(src), "--output", str(tmp_path / "q"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.bfloat16,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    q = tensors(tmp_path / "q")
    for base in ("model.layers.1.self_attn.o_proj", "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        ours = reference.dequantize(q[base + ".weight_packed"], q[base + ".weight_scale"], q[base + ".weight_global_scale"])
        assert torch.equal(model.get_submodule(base).weight, ours), base


@pytest.mark.parametrize("case, msg", [
    ("no_config", "no config.json"),
    ("not_safetensors", "not a safetensors checkpoint"),
    ("already_quantized", "already quantized"),
    ("nan", "model.layers.1.mlp.gate_proj.weight has NaN/Inf"),
    ("moe", "is a mixture-of-experts model (num_experts=4): not supported yet"),
])
def test_bad_input_publishes_nothing(tmp_path, case, msg):
    src = tmp_path / "src"
    if case == "nan":
        tiny_llama(src, poison="model.layers.1.mlp.gate_proj")
    else:
        tiny_llama(src)
    if case == "no_config":
        (src / "config.json").unlink()
    if case == "not_safetensors":
        for f in src.glob("*.safetensors"):
            torch.save(load_file(f), f.with_suffix(".bin"))
            f.unlink()
    if case == "moe":
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**cfg, "num_experts": 4}))
    if case == "already_quantized":
        run_cli("components.quantize", "--input", str(src), "--output", str(tmp_path / "q1"))
        src = tmp_path / "q1"
    p = run_cli("components.quantize", "--input", str(src), "--output", str(tmp_path / "out"), check=False)
    assert p.returncode == 2, p.stderr
    assert msg in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "out" / "MANIFEST.json").exists()


def test_benchmark_random_nvfp4_checkpoint_is_what_the_quantize_stage_writes(tmp_path):
    """benchmarks/quantize_stage.make_nvfp4_checkpoint (the 32B learner benchmark's base) has the
    quantize stage's layout: same config block, same tensor names, loadable by the learner."""
    from benchmarks.quantize_stage import make_checkpoint, make_nvfp4_checkpoint
    from components.train.model import load_base
    from kernels.nvfp4.linear import NVFP4Linear

    direct = tmp_path / "direct"
    make_nvfp4_checkpoint(direct, "tiny")
    assert not (tmp_path / "direct.partial").exists()
    make_checkpoint(tmp_path / "bf16", "tiny")
    run_cli("components.quantize", "--input", str(tmp_path / "bf16"), "--output", str(tmp_path / "staged"))
    staged = Artifact(str(tmp_path / "staged")).local_dir()

    def names(ckpt):
        out = {}
        for shard in ckpt.glob("*.safetensors"):
            with safe_open(str(shard), "pt") as f:
                out.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
        return out

    assert names(direct) == names(staged)
    config = [json.loads((p / "config.json").read_text()) for p in (direct, staged)]
    assert config[0]["quantization_config"] == config[1]["quantization_config"]
    model = load_base(direct)
    assert sum(isinstance(m, NVFP4Linear) for m in model.modules()) == 2 * 7
    out = model(torch.randint(0, 1024, (1, 8))).logits
    assert torch.isfinite(out).all()
