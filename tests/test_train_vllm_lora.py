"""vLLM (CPU) serves the train stage's LoRA adapter on the NVFP4 base through a LoRARequest,
and its log-probs match the learner's (torch NVFP4Linear + PEFT LoRA) within bf16 noise.

The adapter is written by `components.train.model.save_adapter` (the train stage's own code
path) with random non-zero lora_B, so the LoRA delta is large enough to see."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = pytest.mark.slow

PROMPT = "<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n"
COMPLETION = "The answer is 7, because three plus four is seven."
# bf16 noise between vLLM CPU (oneDNN GEMMs, its attention, punica LoRA) and torch (ATen, SDPA,
# PEFT) over 30 layers: observed max 0.22 / mean 0.05 per token. A wrong LoRA scaling (alpha/r
# ignored) or a missing module would be off by a sizeable fraction of the LoRA effect (> 1).
MAX_ATOL, MEAN_ATOL = 0.35, 0.1


@pytest.fixture(scope="module")
def adapter(smollm2_nvfp4, tmp_path_factory):
    from components.train.model import attach_lora, load_base, save_adapter

    torch.manual_seed(0)
    policy = attach_lora(load_base(smollm2_nvfp4), rank=8, alpha=16)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    out = tmp_path_factory.mktemp("adapter")
    save_adapter(policy, out)
    return policy, out


def _learner_logprobs(policy, ids: list[int], n_prompt: int, lora: bool) -> torch.Tensor:
    from components.train.model import logprobs

    t = torch.tensor([ids])
    cm = torch.zeros_like(t, dtype=torch.bool)
    cm[0, n_prompt:] = True
    with torch.no_grad():
        if lora:
            lp, _ = logprobs(policy, t, torch.ones_like(t), cm)
        else:
            with policy.disable_adapter():
                lp, _ = logprobs(policy, t, torch.ones_like(t), cm)
    return lp[0, n_prompt:]


def test_vllm_serves_the_adapter_and_matches_the_learner(adapter, smollm2_nvfp4):
    policy, lora_dir = adapter
    acfg = json.loads((lora_dir / "adapter_config.json").read_text())
    assert acfg["r"] == 8 and acfg["lora_alpha"] == 16

    from vllm.lora.peft_helper import PEFTHelper
    helper = PEFTHelper.from_local_dir(str(lora_dir), max_position_embeddings=None)
    assert helper.r == 8 and helper.vllm_lora_scaling_factor == 2.0

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if hasattr(torch.cpu, "_init_amx"):
        torch.cpu._init_amx()
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    tok = AutoTokenizer.from_pretrained(str(smollm2_nvfp4))
    prompt = tok(PROMPT)["input_ids"]
    comp = tok(COMPLETION)["input_ids"]
    ids = prompt + comp
    llm = LLM(model=str(smollm2_nvfp4), dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=256, max_num_seqs=2, seed=0, enable_lora=True, max_lora_rank=8, max_loras=1)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)

    def engine(lora):
        (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False,
                              lora_request=LoRARequest("qerl", 1, str(lora_dir)) if lora else None)
        return torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[len(prompt):], comp)])

    base_v, lora_v = engine(False), engine(True)
    base_l = _learner_logprobs(policy, ids, len(prompt), lora=False)
    lora_l = _learner_logprobs(policy, ids, len(prompt), lora=True)
    effect = (lora_l - base_l).abs()
    print(f"\n|vLLM - learner| max/mean: base {float((base_v - base_l).abs().max()):.4f}/"
          f"{float((base_v - base_l).abs().mean()):.4f}, LoRA {float((lora_v - lora_l).abs().max()):.4f}/"
          f"{float((lora_v - lora_l).abs().mean()):.4f}; LoRA effect max/mean {float(effect.max()):.3f}/"
          f"{float(effect.mean()):.3f}; LoRA delta mismatch max "
          f"{float(((lora_v - base_v) - (lora_l - base_l)).abs().max()):.4f}")
    assert effect.max() > 3 * MAX_ATOL                  # the adapter matters …
    for v, l in ((base_v, base_l), (lora_v, lora_l)):  # … and vLLM applies it as PEFT does
        assert (v - l).abs().max() < MAX_ATOL and (v - l).abs().mean() < MEAN_ATOL
    del llm
