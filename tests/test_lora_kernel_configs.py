"""Tuned configs for vLLM's LoRA kernels (components/rollout/lora_configs, written by
benchmarks/lora_kernels.py): the environment the engine sets, and that vLLM's own lookup
finds the bundled files and returns their tuned configs. No GPU: the GPU name is faked."""
from __future__ import annotations

import json

import pytest

from components.common.cli import ConfigError
from components.rollout.engine import LORA_KERNEL_CONFIGS, lora_kernel_environment

# the LoRA'd modules of the Qwen2.5-7B shape vLLM builds: (slices, in_features, largest slice)
QWEN7B = {"qkv": (3, 3584, 3584), "o": (1, 3584, 3584), "gate_up": (2, 3584, 18944), "down": (1, 18944, 3584)}


def test_environment(tmp_path):
    env = lora_kernel_environment("bundled", dual_stream=True)
    assert env == {"VLLM_LORA_ENABLE_DUAL_STREAM": "1", "VLLM_TUNED_CONFIG_FOLDER": str(LORA_KERNEL_CONFIGS.resolve())}
    assert lora_kernel_environment("vllm", dual_stream=False) == {"VLLM_LORA_ENABLE_DUAL_STREAM": "0"}
    assert lora_kernel_environment(str(tmp_path), False)["VLLM_TUNED_CONFIG_FOLDER"] == str(tmp_path.resolve())
    with pytest.raises(ConfigError, match="does not exist"):
        lora_kernel_environment(str(tmp_path / "missing"), False)


def _bundled_gpus() -> list[str]:
    return sorted({p.name.rsplit("_SHRINK.json", 1)[0] for p in LORA_KERNEL_CONFIGS.glob("*_SHRINK.json")})


def test_bundled_files_are_complete():
    gpus = _bundled_gpus()
    assert gpus, f"no tuned LoRA kernel configs in {LORA_KERNEL_CONFIGS}"
    for gpu in gpus:
        for kind in ("SHRINK", "EXPAND_TRUE", "EXPAND_FALSE"):
            data = json.loads((LORA_KERNEL_CONFIGS / f"{gpu}_{kind}.json").read_text())
            for slices in ("1", "2", "3"):
                by_m = data["2"][slices]  # vLLM keys by lora_ids.size(0) = max_loras + 1
                assert {"1", "16", "256", "8192"} <= set(by_m), (gpu, kind, slices)


def test_the_h100_and_h200_are_bundled():
    assert {"NVIDIA_H200", "NVIDIA_H100_80GB_HBM3"} <= set(_bundled_gpus())


@pytest.mark.parametrize("gpu", _bundled_gpus())
@pytest.mark.parametrize("module", sorted(QWEN7B))
@pytest.mark.parametrize("m", [1, 3, 16, 100, 8192])
def test_vllm_reads_the_bundled_configs(gpu, module, m, monkeypatch):
    """vLLM's get_lora_op_configs, pointed at the bundled folder, returns the tuned entry of
    this GPU model for the nearest token count (not its defaults)."""
    import torch
    from vllm.lora.ops.triton_ops import utils

    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(LORA_KERNEL_CONFIGS))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpu.replace("_", " "))
    utils.load_lora_op_config.cache_clear()
    utils.get_lora_op_configs.cache_clear()
    try:
        slices, fan_in, widest = QWEN7B[module]
        for op, (k, n), fname in (("shrink", (fan_in, 32), "SHRINK"), ("expand", (32, widest), "EXPAND_TRUE")):
            kw = {"add_inputs": True} if op == "expand" else {}
            got = utils.get_lora_op_configs(op, max_loras=2, batch=m, hidden_size=n if op == "expand" else k,
                                            rank=k if op == "expand" else n, num_slices=slices, **kw)
            table = json.loads((LORA_KERNEL_CONFIGS / f"{gpu}_{fname}.json").read_text())["2"][str(slices)]
            nearest = min(table, key=lambda key: (abs(int(key) - m), int(key)))
            assert got == table[nearest][str(k)][str(n)], (op, module, m)
    finally:
        utils.load_lora_op_config.cache_clear()
        utils.get_lora_op_configs.cache_clear()


def test_tuner_install_merges_shapes():
    """benchmarks/lora_kernels.py --install lays a new run over the folder's files: another
    shape's configs stay, the same keys take the new config."""
    from benchmarks.lora_kernels import merge_configs

    old = {"2": {"1": {"1": {"3584": {"32": {"num_warps": 4, "block_m": 16}}}}}}
    new = {"2": {"1": {"1": {"5120": {"32": {"num_warps": 8, "block_m": 16}}},
                       "16": {"3584": {"32": {"num_warps": 2, "block_m": 16}}}}}}
    merged = merge_configs(old, new)
    assert merged["2"]["1"]["1"] == {"3584": {"32": {"num_warps": 4, "block_m": 16}},
                                     "5120": {"32": {"num_warps": 8, "block_m": 16}}}
    assert merged["2"]["1"]["16"]["3584"]["32"]["num_warps"] == 2
    replaced = merge_configs(old, {"2": {"1": {"1": {"3584": {"32": {"num_warps": 8, "block_m": 64}}}}}})
    assert replaced["2"]["1"]["1"]["3584"]["32"] == {"num_warps": 8, "block_m": 64}
    assert old["2"]["1"]["1"]["3584"]["32"]["num_warps"] == 4  # inputs are not modified


def test_log_says_whether_this_gpu_has_tuned_configs():
    from components.rollout.engine import describe_lora_kernels

    env = lora_kernel_environment("bundled", dual_stream=False)
    gpu = _bundled_gpus()[0].replace("_", " ")
    assert describe_lora_kernels(env, gpu) == f"tuned configs from {LORA_KERNEL_CONFIGS.resolve()}, dual stream off"
    other = describe_lora_kernels(env, "NVIDIA A100-SXM4-80GB")
    assert other.startswith("vLLM's default configs (no NVIDIA_A100_SXM4_80GB_*.json")
    assert describe_lora_kernels(lora_kernel_environment("vllm", True), gpu) == "vLLM's default configs, dual stream on"
