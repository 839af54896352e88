"""The rollout stage's NVFP4 backend choice (components/rollout/backends.py): pure logic, no GPU."""
from __future__ import annotations

import json
import re

import pytest

from components.common.cli import ConfigError
from components.rollout.backends import CHOICES, TABLE_PATH, choose_backend, engine_settings, load_table

TABLE = {"measured_on": "NVIDIA H200, vLLM 0.26.0, qwen2.5-7b shape",
         "tokens_per_second": {"bf16": {"1": 150, "16": 2400, "64": 8000, "256": 16000},
                               "marlin": {"1": 200, "16": 2900, "64": 7400, "256": 10900},
                               "humming": {"1": 190, "64": 8800, "256": 15000},
                               "dequant": {"1": 140, "16": 2300, "64": 8100, "256": 16100}}}


@pytest.mark.parametrize("concurrency, want", [(1, "marlin"), (2, "marlin"), (12, "marlin"), (16, "marlin"),
                                               (40, "humming"), (64, "humming"), (200, "dequant"),
                                               (256, "dequant"), (4096, "dequant")])
def test_auto_picks_the_fastest_measured_at_the_nearest_concurrency(concurrency, want):
    backend, why = choose_backend("auto", concurrency, True, TABLE, "NVIDIA H200")
    assert backend == want
    assert why.startswith(want) and "NVIDIA H200" in why and "other hardware" not in why


def test_reason_names_the_figures_and_other_hardware():
    backend, why = choose_backend("auto", 256, True, TABLE, "NVIDIA A100-SXM4-80GB")
    assert backend == "dequant"
    assert "16,100" in why and "humming 15,000" in why and "bf16 16,000" in why and "concurrency 256" in why
    assert "other hardware" in why


def test_expected_stage_time_decides_when_tokens_and_start_times_are_known():
    table = dict(TABLE, engine_start_s={"bf16": 80, "marlin": 90, "humming": 190, "dequant": 110})
    # 1M tokens at 64 sequences: marlin 90 + 135 = 225 s, dequant 110 + 123 = 233 s, humming 190 + 114 = 304 s
    backend, why = choose_backend("auto", 64, True, table, "NVIDIA H200", tokens=1_000_000)
    assert backend == "marlin"
    assert why.startswith("marlin: about 225 s for up to 1,000,000 tokens") and "dequant 233 s" in why \
        and "humming 304 s" in why and "concurrency 64" in why
    # 50M tokens: throughput wins (humming 190 + 5,682 s)
    assert choose_backend("auto", 64, True, table, tokens=50_000_000)[0] == "humming"
    # without a token count, or with a start time missing, the most tokens/s decides
    assert choose_backend("auto", 64, True, table)[0] == "humming"
    partial = dict(TABLE, engine_start_s={"marlin": 90, "dequant": 110})
    assert choose_backend("auto", 64, True, partial, tokens=1_000_000)[0] == "humming"


def test_explicit_choice_and_fallbacks():
    assert choose_backend("humming", 1, True, TABLE) == ("humming", "requested")
    assert choose_backend("auto", 8, True, None)[0] == "marlin"  # no measurements: vLLM's default
    assert choose_backend("auto", 8, True, {"tokens_per_second": {"bf16": {"8": 1}}})[0] == "marlin"
    assert choose_backend("auto", 8, False, TABLE) == ("dequant", choose_backend("dequant", 8, False, None)[1])
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        choose_backend("marlin", 8, False, TABLE)
    with pytest.raises(ConfigError, match="must be one of"):
        choose_backend("fp8", 8, True, TABLE)


def test_engine_settings_select_each_backend():
    assert engine_settings("humming") == ({"linear_backend": "humming"}, {"QERL_NVFP4_BACKEND": ""})
    assert engine_settings("dequant") == ({}, {"QERL_NVFP4_BACKEND": "dequant", "VLLM_DISABLE_COMPILE_CACHE": "1"})
    assert engine_settings("marlin") == ({}, {"QERL_NVFP4_BACKEND": ""})
    assert engine_settings("fused") == ({}, {"QERL_NVFP4_BACKEND": "fused", "VLLM_DISABLE_COMPILE_CACHE": "1"})
    # where the fused layers' LoRA runs: the plugin reads QERL_NVFP4_LORA_EPILOGUE at model load
    assert [engine_settings("fused", k)[1]["QERL_NVFP4_LORA_EPILOGUE"] for k in ("vllm", "expand", "fused")] == \
        ["0", "expand", "1"]
    assert "QERL_NVFP4_LORA_EPILOGUE" not in engine_settings("marlin", "fused")[1]
    with pytest.raises(ConfigError, match="LoRA kernels must be one of"):
        engine_settings("fused", "punica")
    with pytest.raises(ConfigError):
        engine_settings("auto")
    assert set(CHOICES) == {"auto", "marlin", "humming", "dequant", "fused"}


def test_fused_is_chosen_only_by_name_until_measured():
    assert choose_backend("fused", 1, True, TABLE) == ("fused", "requested")
    for c in (1, 16, 256):  # no 'fused' row in the table: auto never picks it
        assert choose_backend("auto", c, True, TABLE)[0] != "fused"
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        choose_backend("fused", 1, False, TABLE)
    faster = {**TABLE, "tokens_per_second": {**TABLE["tokens_per_second"], "fused": {"1": 400, "16": 100}}}
    assert choose_backend("auto", 1, True, faster)[0] == "fused"  # once measured, it competes
    assert choose_backend("auto", 16, True, faster)[0] == "marlin"


def test_table_file(tmp_path):
    assert load_table(tmp_path / "missing.json") is None
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable"):
        load_table(bad)
    bad.write_text(json.dumps({"measured_on": "x"}))
    with pytest.raises(ConfigError, match="tokens_per_second"):
        load_table(bad)
    shipped = load_table(TABLE_PATH, "NVIDIA H200")  # the measured table the stage ships with
    assert shipped is not None, f"{TABLE_PATH} is missing: run benchmarks/rollout.py --write-table"
    for c in ("1", "16", "64", "256"):
        assert all(c in shipped["tokens_per_second"][b] for b in ("bf16", "marlin")), c
    assert choose_backend("auto", 256, True, shipped)[0] in ("marlin", "humming", "dequant")
    assert set(shipped["engine_start_s"]) >= {"marlin", "humming", "dequant"}
    assert choose_backend("auto", 64, True, shipped, tokens=1_000_000)[1].startswith(
        choose_backend("auto", 64, True, shipped, tokens=1_000_000)[0] + ": about")
    h100 = "NVIDIA H100 80GB HBM3"  # its own table: up to 64 sequences a backend that reads the 4-bit weights
    for c in (1, 16, 64):
        backend, why = choose_backend("auto", c, True, load_table(TABLE_PATH, h100), h100, tokens=100_000)
        assert backend in ("marlin", "fused") and "other hardware" not in why, (c, backend)


def test_rollout_config_rejects_an_unknown_backend():
    from components.rollout.__main__ import RolloutConfig

    with pytest.raises(ConfigError, match="--nvfp4-backend must be one of"):
        RolloutConfig(model="/m", prompts="/p", output="/o", nvfp4_backend="fp8")
    with pytest.raises(ConfigError, match="--nvfp4-lora-kernels must be one of vllm, expand, fused, not 'punica'"):
        RolloutConfig(model="/m", prompts="/p", output="/o", nvfp4_lora_kernels="punica")
    with pytest.raises(ConfigError, match="--lora-dual-stream runs vLLM's own LoRA kernels"):
        RolloutConfig(model="/m", prompts="/p", output="/o", nvfp4_lora_kernels="fused", lora_dual_stream=True)


@pytest.mark.parametrize("field, value, msg", [
    ("aqn_sigma", float("inf"), "--aqn-sigma must be a finite number"),
    ("aqn_sigma", float("nan"), "--aqn-sigma must be a finite number"),
    ("temperature", float("inf"), "--temperature must be a finite number"),
    ("temperature", -1.0, "--temperature must be a finite number"),
    ("top_p", 0.0, "--top-p must be in (0, 1]"),
    ("kv_cache_gb", -3.0, "--kv-cache-gb must be a positive number"),
    ("kv_cache_gb", 0.0, "--kv-cache-gb must be a positive number"),
    ("gpu_memory_utilization", 7.0, "--gpu-memory-utilization must be in (0, 1]"),
])
def test_rollout_config_rejects_out_of_range_numbers(field, value, msg):
    from components.rollout.__main__ import RolloutConfig

    with pytest.raises(ConfigError, match=re.escape(msg)):
        RolloutConfig(model="/m", prompts="/p", output="/o", **{field: value})
    RolloutConfig(model="/m", prompts="/p", output="/o", kv_cache_gb=0.5, gpu_memory_utilization=1.0)


def test_lora_slot_is_the_smallest_vllm_rank_that_holds_the_adapter():
    from components.rollout.engine import VLLM_LORA_RANKS, lora_slot_rank

    assert [lora_slot_rank(r) for r in (1, 2, 8, 9, 16, 32, 33, 64, 300, 512)] == [1, 8, 8, 16, 16, 32, 64, 64, 320, 512]
    assert all(lora_slot_rank(r) == r for r in VLLM_LORA_RANKS)
    with pytest.raises(ConfigError, match="exceeds vLLM's largest LoRA rank 512"):
        lora_slot_rank(513)


def test_check_adapter_refuses_what_does_not_fit(tmp_path):
    import torch
    from safetensors.torch import save_file

    from components.rollout.engine import check_adapter

    model = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
             "num_hidden_layers": 2}
    prefix = "base_model.model.model.layers"

    def adapter(tensors: dict, rank: int = 4):
        d = tmp_path / f"a{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA"}))
        save_file({k: torch.zeros(s) for k, s in tensors.items()}, d / "adapter_model.safetensors")
        return d

    good = {f"{prefix}.1.self_attn.k_proj.lora_A.weight": (4, 32),
            f"{prefix}.1.self_attn.k_proj.lora_B.weight": (16, 4),
            f"{prefix}.0.mlp.down_proj.lora_A.weight": (4, 64), f"{prefix}.0.mlp.down_proj.lora_B.weight": (32, 4)}
    assert check_adapter(adapter(good), model, max_rank=8)["r"] == 4
    cases = [
        ({f"{prefix}.2.self_attn.k_proj.lora_A.weight": (4, 32)}, "names no decoder layer of this base (it has 2)"),
        ({f"{prefix}.0.self_attn.k_proj.lora_B.weight": (32, 4)}, "has shape (32, 4), the base model needs (16, 4)"),
        ({f"{prefix}.0.self_attn.k_proj.lora_magnitude_vector": (16,)}, "neither a lora_A nor a lora_B"),
        ({f"{prefix}.0.self_attn.rotary.lora_A.weight": (4, 32)}, "targets a module the rollout engine does not serve"),
    ]
    for tensors, msg in cases:
        with pytest.raises(ConfigError, match=re.escape(msg)):
            check_adapter(adapter(tensors), model, max_rank=8)
    with pytest.raises(ConfigError, match="exceeds the engine's max_lora_rank 2"):
        check_adapter(adapter(good), model, max_rank=2)


def test_aqn_touches_the_decoder_rmsnorms_only():
    import torch
    from torch import nn

    from components.rollout.aqn import apply_noise, noisy_norms

    class RMSNorm(nn.Module):  # vLLM's and transformers' classes are *RMSNorm too
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))

    def layer(norm):
        block = nn.Module()
        block.input_layernorm, block.post_attention_layernorm = norm(8), norm(8)
        block.self_attn = nn.Module()
        block.self_attn.q_norm = RMSNorm(8)  # Qwen3's per-head norms: not AQN's
        return block

    class Multimodal(nn.Module):
        def __init__(self):
            super().__init__()
            self.language_model = nn.Module()
            self.language_model.model = nn.Module()
            self.language_model.model.layers = nn.ModuleList([layer(RMSNorm) for _ in range(3)])
            self.language_model.model.norm = RMSNorm(8)
            self.vision_tower = nn.Module()
            self.vision_tower.layers = nn.ModuleList([layer(RMSNorm), layer(nn.LayerNorm)])

        def get_language_model(self):
            return self.language_model

    model = Multimodal()
    names = [n for n, _ in noisy_norms(model)]
    assert names == [f"model.layers.{i}.{k}" for i in range(3) for k in ("input_layernorm", "post_attention_layernorm")]
    assert apply_noise(model, 0.1, seed=0) == 6
    assert torch.equal(model.vision_tower.layers[0].input_layernorm.weight, torch.ones(8))
    assert torch.equal(model.language_model.model.norm.weight, torch.ones(8))
    assert not torch.equal(model.language_model.model.layers[2].post_attention_layernorm.weight, torch.ones(8))
    plain = Multimodal().language_model  # a text-only model: searched as it is
    assert len(noisy_norms(plain)) == 6


def test_one_table_per_gpu_model(tmp_path):
    from components.rollout.backends import load_tables, merge_table

    path = tmp_path / "t.json"
    path.write_text(json.dumps(TABLE))  # the older format: one table at the top level
    assert load_table(path, "NVIDIA H100 80GB HBM3") == TABLE and len(load_tables(path)) == 1
    h100 = {"gpu": "NVIDIA H100 80GB HBM3", "measured_on": "NVIDIA H100 80GB HBM3, vLLM 0.26.0",
            "tokens_per_second": {"bf16": {"1": 120}, "marlin": {"1": 170}, "fused": {"1": 180}}}
    h200 = dict(TABLE, gpu="NVIDIA H200")
    merge_table(path, h200)  # the untagged table was measured on this model: merged into, now tagged
    [only] = load_tables(path)
    assert only["gpu"] == "NVIDIA H200" and only["tokens_per_second"] == TABLE["tokens_per_second"]
    h200 = only
    merge_table(path, h100)
    assert load_tables(path) == [h200, h100]
    assert load_table(path, "NVIDIA H100 80GB HBM3") == h100 and load_table(path, "NVIDIA H200") == h200
    backend, why = choose_backend("auto", 1, True, load_table(path, "NVIDIA H100 80GB HBM3"), "NVIDIA H100 80GB HBM3")
    assert backend == "fused" and "other hardware" not in why
    # a GPU without a table of its own gets the first, and the reason says so
    backend, why = choose_backend("auto", 1, True, load_table(path, "NVIDIA A100-SXM4-80GB"), "NVIDIA A100-SXM4-80GB")
    assert backend == "marlin" and "other hardware than this NVIDIA A100-SXM4-80GB" in why
    # a rerun of some backends and concurrencies replaces those figures of its own model's table only
    merge_table(path, dict(h100, measured_on="NVIDIA H100 80GB HBM3, rerun", engine_start_s={"marlin": 60},
                           tokens_per_second={"marlin": {"1": 175, "64": 7000}}))
    merged = load_table(path, "NVIDIA H100 80GB HBM3")
    assert len(load_tables(path)) == 2 and merged["tokens_per_second"] == {
        "bf16": {"1": 120}, "marlin": {"1": 175, "64": 7000}, "fused": {"1": 180}}
    assert merged["engine_start_s"] == {"marlin": 60}
    assert merged["measured_on"].endswith("then marlin: NVIDIA H100 80GB HBM3, rerun")
    assert load_table(path, "NVIDIA H200") == h200
    path.write_text(json.dumps({"tables": [{"gpu": "x"}]}))
    with pytest.raises(ConfigError, match="tokens_per_second"):
        load_tables(path)
