"""The train stage: NVFP4Linear gradients, PEFT integration, end to end on SmolLM2-135M NVFP4,
resume equivalence and bad-input handling. CPU only; sequences kept short."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from components.common.schemas import REWARDS, ROLLOUTS, to_table, write_ipc
from components.common.storage import Artifact, Staging, exists
from kernels.nvfp4 import reference as R
from kernels.nvfp4.linear import NVFP4Linear
from tests.conftest import run_cli

torch.set_num_threads(1)

KEY = re.compile(r"^base_model\.model\.model\.layers\.\d+\."
                 r"(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.lora_[AB]\.weight$")
TRAIN_CFG = dict(lora_rank=8, lora_alpha=16, lr=2e-3, warmup_steps=1, total_steps=4, epochs=1,
                 micro_batch_tokens=256, tis_cap=2.0, seed=3)
QUESTIONS = ["What is 3+4?", "What is 10-6?", "Name a primary colour.", "What is 2*5?"]
ANSWERS = ["7", "4", "red", "10"]
COMPLETIONS = ["The answer is {a}.", "I think it is 12.", "{a}", "Let me see... it is {a}, surely."]


# ----------------------------------------------------------------------------- NVFP4Linear

def _quantized(out=48, inn=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inn, generator=g) * 0.05
    q = R.quantize(w, R.global_scale(w))
    return q


def test_the_base_dtype_follows_the_cpus_bf16_matmul(monkeypatch):
    """bf16 on GPUs and on CPUs whose bf16 matmul is native; float32 where torch would emulate it
    (a scalar loop, ~100x slower than float32 on AVX2-only CPUs). The rollout engine asks the same."""
    from components.common import compute
    from components.train.model import base_dtype

    monkeypatch.setattr(compute, "cpu_has_native_bf16_matmul", lambda: False)
    assert base_dtype("cpu") == torch.float32 and base_dtype("cuda:0") == torch.bfloat16
    monkeypatch.setattr(compute, "cpu_has_native_bf16_matmul", lambda: True)
    assert base_dtype("cpu") == torch.bfloat16 and compute.compute_dtype("cpu") == "bfloat16"
    monkeypatch.undo()
    assert isinstance(compute.cpu_has_native_bf16_matmul(), bool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_linear_forward_and_input_grad(dtype):
    q = _quantized()
    bias = torch.randn(48) * 0.1
    layer = NVFP4Linear.from_checkpoint_tensors(*q, bias=bias, dtype=dtype)
    assert not list(layer.parameters()) and not hasattr(layer, "weight")
    assert layer.nbytes() == 48 * 32 + 48 * 4 + 4 + 48 * bias.new_empty(0, dtype=dtype).element_size()
    w_hat = R.dequantize(*q, dtype)
    x = torch.randn(2, 5, 64, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y = layer(x)
    y_ref = x_ref @ w_hat.t() + bias.to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(y, y_ref, **tol)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    assert layer.weight_packed.grad is None


def test_nvfp4_linear_backward_matches_analytic_gradient():
    # d/dx sum((x W^T)^2) = 2 (x W^T) W
    q = _quantized(16, 32, seed=1)
    layer = NVFP4Linear.from_checkpoint_tensors(*q, dtype=torch.float32)
    x = torch.randn(3, 32, requires_grad=True)
    (layer(x) ** 2).sum().backward()
    w = R.dequantize(*q, torch.float32)
    torch.testing.assert_close(x.grad, 2 * (x.detach() @ w.t()) @ w, atol=1e-5, rtol=1e-5)


def test_fast_dequantize_is_bit_identical_to_reference():
    from kernels.nvfp4.linear import dequantize

    w = torch.randn(64, 128) * torch.logspace(-6, 2, 128)  # wide range: saturation, tiny blocks
    w[3, :16] = 0.0                                          # an all-zero block (scale 0.125)
    w[5, 16:32] = -1e-9                                      # rounds to -0.0 codes
    q = R.quantize(w, R.global_scale(w))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        a, b = R.dequantize(*q, dtype), dequantize(*q, dtype)
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(a.view(bits), b.view(bits)), dtype


def test_peft_wraps_nvfp4_linear():
    from components.train.model import attach_lora, lora_nvfp4_cls

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = NVFP4Linear.from_checkpoint_tensors(*_quantized(), dtype=torch.float32)
            self.scale = torch.nn.Parameter(torch.ones(()), requires_grad=False)  # PEFT wants >= 1 parameter

        def forward(self, x):
            return self.q_proj(x) * self.scale

    from peft import get_peft_model

    from components.train.model import lora_config
    m = get_peft_model(Tiny(), lora_config(4, 8, targets=["q_proj"], task_type=None))
    layer = m.base_model.model.q_proj
    assert isinstance(layer, lora_nvfp4_cls())
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
    x = torch.randn(3, 64)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expect = x @ R.dequantize(*_quantized(), torch.float32).t() + (x @ a.t() @ b.t()) * 2.0
    torch.testing.assert_close(m(x), expect, atol=1e-5, rtol=1e-5)
    with m.disable_adapter():
        torch.testing.assert_close(m(x), x @ R.dequantize(*_quantized(), torch.float32).t())
    with pytest.raises(NotImplementedError):
        layer.merge()
    assert attach_lora  # the model-level wrapper is exercised end to end below


def _smollm2_with_lora(ckpt):
    """SmolLM2-NVFP4 with a seeded r-4 LoRA whose B is non-zero (so the adapter matters)."""
    from components.train.model import attach_lora, load_base

    torch.manual_seed(0)
    m = attach_lora(load_base(ckpt), 4, 8)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01)
    return m


def test_gradient_checkpointing_gives_the_same_lora_gradients(smollm2_nvfp4):
    from components.train.model import logprobs

    m = _smollm2_with_lora(smollm2_nvfp4)
    ids = torch.randint(0, 49152, (2, 20))
    am = torch.ones_like(ids)
    am[1, 16:] = 0
    cm = torch.zeros_like(ids, dtype=torch.bool)
    cm[0, 10:], cm[1, 10:16] = True, True

    def grads():
        m.zero_grad()
        m.train()
        lp, _ = logprobs(m, ids, am, cm)
        lp.sum().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}

    plain = grads()
    m.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt = grads()
    nvfp4 = [mod for mod in m.modules() if isinstance(mod, NVFP4Linear)]
    for mod in nvfp4:  # what build_policy does with checkpointing on
        mod.keep_dequantized = True
    kept = grads()
    assert len(nvfp4) == 30 * 7
    assert len(plain) == 30 * 7 * 2 and all(float(g.abs().max()) > 0 for k, g in plain.items() if "lora_A" in k)
    for k in plain:
        torch.testing.assert_close(ckpt[k], plain[k], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(kept[k], ckpt[k], atol=0, rtol=0)


def test_dequant_prefetch_hands_each_layer_its_weights_ahead(smollm2_nvfp4):
    """The prefetcher's guesses under checkpointing (forward up, recomputation down, next
    micro-batch up again) and the same gradients, bit for bit, as dequantizing at use."""
    from components.train.model import logprobs
    from kernels.nvfp4.linear import DequantPrefetch

    m = _smollm2_with_lora(smollm2_nvfp4)
    m.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for mod in m.modules():
        if isinstance(mod, NVFP4Linear):
            mod.keep_dequantized = True
    ids = torch.randint(0, 49152, (2, 12))
    am, cm = torch.ones_like(ids), torch.zeros_like(ids, dtype=torch.bool)
    cm[:, 6:] = True

    def grads(micro_batches=2):
        m.zero_grad()
        m.train()
        for _ in range(micro_batches):
            logprobs(m, ids, am, cm)[0].sum().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}

    layers = m.base_model.model.model.layers
    assert DequantPrefetch.for_layers(layers) is None  # CPU: only when asked
    plain = grads()
    pf = DequantPrefetch.for_layers(layers, inline=True)
    used = []
    for i, layer in enumerate(layers):  # which layers found their Ŵ made ahead
        layer.register_forward_pre_hook(lambda mod, args, i=i: used.append(
            (i, all(q.prefetched is not None for q in mod.modules() if isinstance(q, NVFP4Linear)))))
    ahead = grads()
    n = len(layers)
    # 2 micro-batches x (forward 0..n-1, then recomputation n-1..0); only the very first misses
    assert [i for i, _ in used] == (list(range(n)) + list(range(n - 1, -1, -1))) * 2
    assert [hit for _, hit in used] == [False] + [True] * (4 * n - 1)
    assert (pf.hits, pf.issued) == (4 * n - 1, 4 * n)
    for k in plain:
        torch.testing.assert_close(ahead[k], plain[k], atol=0, rtol=0)
    # plain forwards after that: the first starts where the recomputation ended (layer 0);
    # the second jumps from the last layer to layer 0, a new sweep whose first layer misses
    m.eval()
    with torch.no_grad():
        used.clear()
        logprobs(m, ids, am, cm)
        logprobs(m, ids, am, cm)
    assert [hit for _, hit in used] == [True] * n + [False] + [True] * (n - 1)
    pf.remove()
    assert all(q.prefetched is None for q in m.modules() if isinstance(q, NVFP4Linear))


def test_garbage_collection_is_manual_inside_the_iteration_and_counted():
    import gc

    from components.train.trainer import _GarbageCollection

    assert gc.isenabled()
    with _GarbageCollection(manual=True) as c:
        assert not gc.isenabled()
    assert gc.isenabled() and c.full_passes == 0
    with _GarbageCollection(manual=False) as c:
        assert gc.isenabled()
        gc.collect()  # a full pass, as the allocation count would trigger one
    assert c.full_passes == 1 and c.seconds > 0 and gc.isenabled()


def test_keep_dequantized_saves_the_weight_only_when_asked():
    q = _quantized()
    layer = NVFP4Linear.from_checkpoint_tensors(*q, bias=torch.randn(48), dtype=torch.float32)
    x = torch.randn(3, 64, requires_grad=True)
    assert layer(x).grad_fn.saved_tensors[3] is None
    layer.keep_dequantized = True
    y = layer(x)
    torch.testing.assert_close(y.grad_fn.saved_tensors[3], R.dequantize(*q, torch.float32), atol=0, rtol=0)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(3, 48) @ R.dequantize(*q, torch.float32))


def test_build_policy_keeps_dequantized_weights_only_under_checkpointing(smollm2_nvfp4):
    from components.train import trainer as T
    from components.train.__main__ import TrainConfig

    for ckpt in (False, True):
        cfg = TrainConfig(model="m", rollouts=["r"], rewards="w", output="o", lora_rank=4, lora_alpha=8,
                          gradient_checkpointing=ckpt)
        policy = T.build_policy(smollm2_nvfp4, cfg, torch.device("cpu"))
        flags = {mod.keep_dequantized for mod in policy.modules() if isinstance(mod, NVFP4Linear)}
        assert flags == {ckpt}


# ----------------------------------------------------------------------------- data

def _publish_table(uri: Path, table) -> str:
    with Staging() as st:
        kind = table.schema.metadata[b"qerl.schema"].decode()  # rewards: the contract's one file name
        (st.path / ("rewards.arrow" if kind == "rewards" else "shard-000.arrow")).write_bytes(write_ipc(table))
        st.publish(str(uri), stage="test", progress=False)
    return str(uri)


@pytest.fixture(scope="module")
def tokenizer(smollm2_nvfp4):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(smollm2_nvfp4))


@pytest.fixture(scope="module")
def base_policy(smollm2_nvfp4):
    from components.train.model import load_base
    return load_base(smollm2_nvfp4)


def _rollout_rows(tokenizer, base_policy, iteration: int, digest: str = "") -> list[dict]:
    """4 prompts x 4 samples x <= 16 completion tokens; rollout logprobs = the base's, perturbed."""
    from components.train.model import logprobs

    seqs = []
    for p, (q, a) in enumerate(zip(QUESTIONS, ANSWERS)):
        prompt = tokenizer(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
        for s, c in enumerate(COMPLETIONS):
            comp = tokenizer(c.format(a=a))["input_ids"][:15] + [tokenizer.eos_token_id]
            truncated = s == 3 and iteration == 1
            seqs.append((p, s, a, c.format(a=a), prompt, comp[:-1] if truncated else comp, truncated))
    width = max(len(x[4]) + len(x[5]) for x in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    am, cm = torch.zeros_like(ids), torch.zeros_like(ids, dtype=torch.bool)
    for r, (_, _, _, _, prompt, comp, _) in enumerate(seqs):
        ids[r, :len(prompt) + len(comp)] = torch.tensor(prompt + comp)
        am[r, :len(prompt) + len(comp)] = 1
        cm[r, len(prompt):len(prompt) + len(comp)] = True
    with torch.no_grad():
        lp, _ = logprobs(base_policy, ids, am, cm)
    g = torch.Generator().manual_seed(100 + iteration)
    rows = []
    for r, (p, s, a, text, prompt, comp, truncated) in enumerate(seqs):
        noisy = (lp[r][cm[r]] + 0.05 * torch.randn(len(comp), generator=g)).clamp(max=0.0)
        rows.append({"prompt_id": f"p{p}", "sample_index": s, "prompt_token_ids": prompt,
                     "completion_token_ids": comp, "completion_logprobs": noisy.tolist(),
                     "completion_text": text, "finish_reason": "length" if truncated else "stop",
                     "answer": a, "iteration": iteration, "adapter_digest": digest, "aqn_sigma": 0.0,
                     "aqn_seed": 0, "sampling_seed": 0, "max_tokens": 16, "temperature": 1.0,
                     "top_p": 1.0})
    return rows


def _reward_rows(rollout_rows, iteration: int, tied: bool = False) -> list[dict]:
    out = []
    for r in rollout_rows:
        ok = float(r["answer"] in r["completion_text"])
        rew = 1.0 if tied else ok + 0.1 * ((r["sample_index"] + iteration) % 3)
        out.append({"prompt_id": r["prompt_id"], "sample_index": r["sample_index"], "reward": rew,
                    "components": {"correct": ok}})
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory, tokenizer, base_policy):
    root = tmp_path_factory.mktemp("train-data")
    out = {"root": root}
    for it in (0, 1):
        rows = _rollout_rows(tokenizer, base_policy, it)
        out[f"rollout_rows{it}"] = rows
        out[f"reward_rows{it}"] = _reward_rows(rows, it)
        out[f"rollouts{it}"] = _publish_table(root / f"rollouts{it}", to_table(rows, ROLLOUTS))
        out[f"rewards{it}"] = _publish_table(root / f"rewards{it}", to_table(out[f"reward_rows{it}"], REWARDS))
    cfg = root / "train.yaml"
    cfg.write_text(yaml.safe_dump(TRAIN_CFG))
    out["config"] = str(cfg)
    return out


def _args(model, data, out, *extra, rollouts=None, rewards=None, it=0) -> list[str]:
    return ["--model", str(model), "--rollouts", rollouts or data[f"rollouts{it}"],
            "--rewards", rewards or data[f"rewards{it}"], "--output", str(out), "--config", data["config"],
            "--iteration", str(it), *extra]


def _train(model, data, out, *extra, check=True, **kw):
    """The stage as a user runs it: a `python -m components.train` subprocess."""
    return run_cli("components.train", *_args(model, data, out, *extra, **kw), check=check)


def _train_in_process(model, data, out, *extra, **kw) -> int:
    """The same CLI entry (`run_stage`: parsing, exit status, one-line errors), without paying
    another interpreter start and torch/transformers import on the 2 shared cores."""
    from components.common.cli import run_stage
    from components.train.__main__ import TrainConfig, main

    return run_stage(main, TrainConfig, _args(model, data, out, *extra, **kw), prog="python -m components.train",
                     description="")


@pytest.fixture(scope="module")
def run1(smollm2_nvfp4, data):
    out = data["root"] / "iter0"
    proc = _train(smollm2_nvfp4, data, out)
    return out, proc


# ----------------------------------------------------------------------------- end to end

def test_end_to_end_publishes_standard_peft_adapter(run1, smollm2_artifact, tokenizer):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out, _ = run1
    names = set(Artifact(str(out)).names())
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.pt", "metrics.json"} <= names
    acfg = json.loads((out / "adapter_config.json").read_text())
    assert acfg["peft_type"] == "LORA" and acfg["r"] == 8 and acfg["lora_alpha"] == 16
    assert sorted(acfg["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"])
    assert not acfg.get("modules_to_save") and acfg["bias"] == "none" and not acfg["use_dora"]
    assert acfg["task_type"] == "CAUSAL_LM" and not acfg.get("use_rslora")
    sd = load_file(str(out / "adapter_model.safetensors"))
    assert len(sd) == 30 * 7 * 2 and all(KEY.match(k) for k in sd), sorted(sd)[:3]
    assert sd["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (8, 576)
    assert sd["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"].shape == (576, 8)
    assert any(float(v.abs().max()) > 0 for k, v in sd.items() if "lora_B" in k)

    m = json.loads((out / "metrics.json").read_text())
    for k in ("loss", "entropy", "clip_fraction", "approx_kl", "grad_norm", "reward_mean", "reward_std",
              "dropped_group_fraction", "rollout_logp_abs_diff", "rollout_kl", "tokens_per_s", "peak_memory_mb"):
        assert m[k] is not None and m[k] == m[k], k
    assert m["updated"] and m["step"] == 1 and m["micro_batches"] >= 2
    assert m["temperature"] == 1.0 and m["rollout_top_p"] == 1.0  # --temperature 0: the rollouts'
    assert 0.01 < m["rollout_logp_abs_diff"] < 0.1  # the 0.05-sigma perturbation
    assert 0 < m["mismatch_tokens"] <= m["completion_tokens"]  # the kept groups' completions, truncated included
    assert m["entropy"] > 0 and m["grad_norm"] > 0 and m["tokens_per_s"] > 0
    assert m["gc_full_passes"] == 0  # manual_gc: no full collection inside the iteration
    assert "dequant_prefetch_hits" not in m  # CPU: no side stream to overlap with, not attached
    # logp_old (no-grad pass) and the first epoch's logp_new are the same numbers: ratio 1
    assert m["epochs"][0]["approx_kl"] < 1e-7 and m["epochs"][0]["clip_fraction"] == 0
    print(f"\nCPU train step: {m['tokens_per_s']:.1f} tokens/s, update {m['seconds_update']:.1f}s, "
          f"peak RSS {m['peak_memory_mb']:.0f} MB")

    # plain PEFT on the bf16 base (float32 compute, so small LoRA deltas are not rounded away)
    base = AutoModelForCausalLM.from_pretrained(str(smollm2_artifact), dtype=torch.float32)
    ids = torch.tensor([tokenizer("<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n"
                                  "The answer is 7.")["input_ids"]])
    with torch.no_grad():
        before = torch.log_softmax(base(ids).logits, -1)
        peft_model = PeftModel.from_pretrained(base, str(out))
        after = torch.log_softmax(peft_model(ids).logits, -1)
        with peft_model.disable_adapter():
            again = torch.log_softmax(peft_model(ids).logits, -1)
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(again, before)


def test_rollouts_prefix_of_shards(run1, smollm2_nvfp4, data, tmp_path):
    """A prefix holding several shard artifacts reads as their concatenation (KFP passes one):
    the stage trains on it exactly as on the same rows in one shard."""
    from safetensors.torch import load_file

    from components.common.schemas import read_artifact_table
    from components.common.storage import expand_artifacts

    rows = data["rollout_rows0"]
    for k in range(2):
        _publish_table(tmp_path / "rollouts" / f"shard-00{k}-of-002",
                       to_table([r for r in rows if int(r["prompt_id"][1:]) % 2 == k], ROLLOUTS))
    shards = expand_artifacts([str(tmp_path / "rollouts")])
    assert [Path(s).name for s in shards] == ["shard-000-of-002", "shard-001-of-002"]
    assert sum(read_artifact_table(s, "rollouts").num_rows for s in shards) == len(rows)
    out = tmp_path / "adapter"
    assert _train_in_process(smollm2_nvfp4, data, out, rollouts=str(tmp_path / "rollouts")) == 0
    a, b = load_file(str(run1[0] / "adapter_model.safetensors")), load_file(str(out / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_equals_uninterrupted(run1, smollm2_nvfp4, data):
    from safetensors.torch import load_file

    from components.train import trainer as T
    from components.train.__main__ import TrainConfig
    from components.train.model import adapter_state
    from components.common.schemas import read_artifact_table

    out1, _ = run1
    out2 = data["root"] / "iter1"
    _train(smollm2_nvfp4, data, out2, "--adapter", str(out1), "--state", str(out1), it=1)
    resumed = load_file(str(out2 / "adapter_model.safetensors"))
    m2 = json.loads((out2 / "metrics.json").read_text())
    assert m2["step"] == 2 and m2["step_before"] == 1

    # uninterrupted: one process, the same model and optimizer across both iterations
    cfg = TrainConfig(model=str(smollm2_nvfp4), rollouts=[data["rollouts0"]], rewards=data["rewards0"],
                      output=str(data["root"] / "unused"), **TRAIN_CFG)
    dev = torch.device("cpu")
    policy = T.build_policy(smollm2_nvfp4, cfg, dev)
    opt, sched = T.make_optimizer(policy, cfg)
    lrs = []
    for it in (0, 1):
        cfg.iteration = it
        batch = T.load_batch(read_artifact_table(data[f"rollouts{it}"], "rollouts"),
                             read_artifact_table(data[f"rewards{it}"], "rewards"))
        lrs.append(T.train_iteration(policy, opt, sched, batch, cfg, dev)["lr"])
    straight = {k: v.float() for k, v in adapter_state(policy).items()}
    assert sorted(straight) == sorted(resumed)
    for k in straight:
        torch.testing.assert_close(resumed[k], straight[k], atol=1e-6, rtol=1e-5)
    assert lrs[1] == pytest.approx(m2["lr"]) and lrs[0] == pytest.approx(2e-3)  # warm-up step 0
    # and it moved: step 2 is not step 1
    first = load_file(str(out1 / "adapter_model.safetensors"))
    assert max(float((first[k] - resumed[k]).abs().max()) for k in first) > 1e-5


def test_dapo_with_kl_and_two_epochs(run1, smollm2_nvfp4, data, tmp_path):
    """The stage with the options the default run leaves off: DAPO (token aggregation, clip-higher,
    dynamic sampling, truncated completions masked; unit-tested in test_objective.py), a KL term
    to the adapter-free reference and mu = 2 optimizer steps over the batch."""
    from safetensors.torch import load_file

    out = tmp_path / "dapo"
    assert _train_in_process(smollm2_nvfp4, data, out, "--loss-type", "dapo", "--kl-beta", "0.1",
                             "--epochs", "2") == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["updated"] and m["optimizer_steps"] == 2 and len(m["epochs"]) == 2 and m["step"] == 2
    assert m["step_after"] - m["step_before"] == 2
    assert m["epochs"][0]["approx_kl"] < 1e-7 and m["epochs"][1]["approx_kl"] > 0  # the second step is off-policy
    # iteration 0 starts from a zero LoRA B: the policy is the reference, KL 0; after one step it is not
    assert m["epochs"][0]["ref_kl"] < 1e-7 < m["epochs"][1]["ref_kl"] and m["ref_kl"] == m["epochs"][1]["ref_kl"]
    assert 0 < m["loss_normalizer"] <= m["completion_tokens"]  # token-level: the kept, untruncated tokens
    a, b = load_file(str(run1[0] / "adapter_model.safetensors")), load_file(str(out / "adapter_model.safetensors"))
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_all_groups_tied_publishes_unchanged_adapter(run1, smollm2_nvfp4, data):
    from safetensors.torch import load_file

    out1, _ = run1
    tied = _publish_table(data["root"] / "rewards-tied", to_table(
        _reward_rows(data["rollout_rows1"], 1, tied=True), REWARDS))
    out = data["root"] / "tied"
    assert _train_in_process(smollm2_nvfp4, data, out, "--adapter", str(out1), "--state", str(out1),
                             "--loss-type", "dapo", rewards=tied, it=1) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["updated"] is False and m["dropped_group_fraction"] == 1.0 and "tie" in m["skipped_reason"]
    assert m["step"] == 1
    # no update, but the rollout/learner mismatch is still measured, over every completion token
    assert m["mismatch_tokens"] == m["completion_tokens"] and m["rollout_logp_abs_diff"] > 0
    assert m["rollout_kl"] >= 0 and m["entropy"] > 0
    a, b = load_file(str(out1 / "adapter_model.safetensors")), load_file(str(out / "adapter_model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- bad input

def _bad_case(case: str, data, run1, root: Path) -> tuple[list[str], dict, str]:
    rows, rew = data["rollout_rows0"], data["reward_rows0"]
    if case == "no_join":
        bad = [dict(r, prompt_id="other-" + r["prompt_id"]) for r in rew]
        return [], {"rewards": _publish_table(root / "r", to_table(bad, REWARDS))}, "no reward"
    if case == "incomplete_group":
        keep = lambda r: not (r["prompt_id"] == "p2" and r["sample_index"] == 3)  # noqa: E731
        return [], {"rollouts": _publish_table(root / "ro", to_table([r for r in rows if keep(r)], ROLLOUTS)),
                    "rewards": _publish_table(root / "r", to_table([r for r in rew if keep(r)], REWARDS))}, \
            "incomplete groups"
    if case == "nan_reward":
        bad = [dict(r, reward=float("nan")) if i == 5 else r for i, r in enumerate(rew)]
        return [], {"rewards": _publish_table(root / "r", to_table(bad, REWARDS))}, "finite"
    if case in ("temperature", "mixed_temperatures"):
        bad = [dict(r, temperature=0.7 if case == "temperature" or r["prompt_id"] == "p1" else 1.0) for r in rows]
        msg = "differs from the rollouts' log-prob temperature" if case == "temperature" else "one batch needs one"
        return ["--temperature", "1.0"], {"rollouts": _publish_table(root / "ro", to_table(bad, ROLLOUTS))}, msg
    if case in ("null_logprob", "inf_logprob", "abort", "shifted_indices"):
        def spoil(i, r):
            if case == "shifted_indices":  # every group 1..G instead of 0..G-1: sizes agree, keys do not
                return dict(r, sample_index=r["sample_index"] + 1)
            if i != 3:
                return r
            if case == "abort":
                return dict(r, finish_reason="abort")
            return dict(r, completion_logprobs=[None if case == "null_logprob" else float("-inf")]
                        + r["completion_logprobs"][1:])
        bad = [spoil(i, r) for i, r in enumerate(rows)]
        rewards = [dict(r, sample_index=r["sample_index"] + 1) for r in rew] if case == "shifted_indices" else rew
        msg = {"null_logprob": "missing, non-finite or positive completion logprob",
               "inf_logprob": "missing, non-finite or positive completion logprob",
               "abort": "finish_reason 'abort'", "shifted_indices": "expected 0..3"}[case]
        return [], {"rollouts": _publish_table(root / "ro", to_table(bad, ROLLOUTS)),
                    "rewards": _publish_table(root / "r", to_table(rewards, REWARDS))}, msg
    out1, _ = run1
    if case == "rank_mismatch":
        return ["--adapter", str(out1), "--lora-rank", "4"], {}, "rank mismatch"
    if case == "shape_mismatch":
        from safetensors.torch import load_file, save_file
        sd = load_file(str(out1 / "adapter_model.safetensors"))
        k = "base_model.model.model.layers.3.mlp.up_proj.lora_A.weight"
        sd[k] = torch.zeros(8, 100)
        with Staging() as st:
            shutil.copy(out1 / "adapter_config.json", st.path / "adapter_config.json")
            save_file(sd, str(st.path / "adapter_model.safetensors"))
            st.publish(str(root / "adapter"), stage="test", progress=False)
        return ["--adapter", str(root / "adapter")], {}, "does not fit the base model"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["no_join", "incomplete_group", "nan_reward", "null_logprob", "inf_logprob", "abort",
                                  "shifted_indices", "temperature", "mixed_temperatures", "rank_mismatch",
                                  "shape_mismatch"])
def test_bad_input_exit_2_and_nothing_published(case, smollm2_nvfp4, data, run1, tmp_path, capsys):
    extra, over, msg = _bad_case(case, data, run1, tmp_path)
    out = tmp_path / "out"
    capsys.readouterr()
    assert _train_in_process(smollm2_nvfp4, data, out, *extra, **over) == 2
    stderr = capsys.readouterr().err
    err = [line for line in stderr.splitlines() if "error:" in line]
    assert len(err) == 1 and msg in err[0], stderr[-2000:]
    assert not exists(str(out)) and not out.exists()


def test_bad_input_through_the_real_cli(smollm2_nvfp4, data, tmp_path):
    bad = [dict(r, prompt_id="other-" + r["prompt_id"]) for r in data["reward_rows0"]]
    out = tmp_path / "out"
    proc = _train(smollm2_nvfp4, data, out, check=False,
                  rewards=_publish_table(tmp_path / "r", to_table(bad, REWARDS)))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("python -m components.train: error: rewards ")
    assert not exists(str(out))
