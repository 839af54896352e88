"""The prompts and base_model stages, run through their CLIs."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from components.common.schemas import read_artifact_table
from components.common.storage import Artifact
from tests.conftest import run_cli

DATA = Path(__file__).parent / "data"


def test_base_model_loads_and_generates(smollm2_artifact):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    art = Artifact(str(smollm2_artifact))
    assert art.manifest["stage"] == "base_model"
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(art.names())
    config = json.loads(art.read_bytes("config.json"))
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    d = art.local_dir()
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    assert tok.chat_template and model.dtype == torch.bfloat16
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                   tokenize=False)
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "5" in answer, answer  # a real instruct model answers this one


def test_base_model_from_hf_dir_and_bad_sources(smollm2_artifact, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(smollm2_artifact, hf, ignore=shutil.ignore_patterns("MANIFEST.json", "metrics.json"))
    run_cli("components.base_model", "--source", str(hf), "--output", str(tmp_path / "copy"))
    assert Artifact(str(tmp_path / "copy")).read_bytes("model.safetensors") == (hf / "model.safetensors").read_bytes()

    (tmp_path / "empty").mkdir()
    p = run_cli("components.base_model", "--source", str(tmp_path / "empty"), "--output", str(tmp_path / "x"), check=False)
    assert p.returncode == 2 and "no config.json" in p.stderr
    cfg = json.loads((hf / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors"}
    (hf / "config.json").write_text(json.dumps(cfg))
    p = run_cli("components.base_model", "--source", str(hf), "--output", str(tmp_path / "y"), check=False)
    assert p.returncode == 2 and "already quantized" in p.stderr
    assert not (tmp_path / "x" / "MANIFEST.json").exists() and not (tmp_path / "y" / "MANIFEST.json").exists()


def test_prompts_from_gsm8k_jsonl(smollm2_artifact, tmp_path):
    out = tmp_path / "prompts"
    run_cli("components.prompts", "--model", str(smollm2_artifact), "--output", str(out),
            "--gsm8k-jsonl", str(DATA / "gsm8k_sample.jsonl"), "--eval-fraction", "0.25", "--seed", "3")
    train = read_artifact_table(str(out), "prompts", ["train.arrow"]).to_pylist()
    evals = read_artifact_table(str(out), "prompts", ["eval.arrow"]).to_pylist()
    assert len(train) + len(evals) == 20 and 0 < len(evals) < 20
    gold = [json.loads(line)["answer"].split("####")[-1].strip().replace(",", "")
            for line in (DATA / "gsm8k_sample.jsonl").read_text().splitlines()]
    assert sorted(r["answer"] for r in train + evals) == sorted(gold)
    row = train[0]
    assert row["prompt_text"].startswith("<|im_start|>system\nYou are a careful math tutor")
    assert row["prompt_text"].endswith("<|im_start|>assistant\n") and row["question"] in row["prompt_text"]
    assert row["solution"].endswith("#### " + row["answer"]) or "####" in row["solution"]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_artifact)
    assert tok.decode(row["prompt_token_ids"]) == row["prompt_text"]
    metrics = Artifact(str(out)).read_json("metrics.json")
    assert metrics["train"] == len(train) and metrics["source"] == "gsm8k"
    # deterministic: the same seed gives the same split, another seed another one
    again = tmp_path / "again"
    run_cli("components.prompts", "--model", str(smollm2_artifact), "--output", str(again),
            "--gsm8k-jsonl", str(DATA / "gsm8k_sample.jsonl"), "--eval-fraction", "0.25", "--seed", "3")
    assert read_artifact_table(str(again), "prompts", ["train.arrow"]).to_pylist() == train


def test_prompts_and_base_model_from_s3_sources(smollm2_artifact, s3_bucket, tmp_path):
    """A user's JSONL and HF checkpoint in a bucket: each object fetched alone, temp copies removed."""
    import boto3

    s3 = boto3.client("s3")
    bucket = s3_bucket[len("s3://"):]
    s3.upload_file(str(DATA / "gsm8k_sample.jsonl"), bucket, "data/gsm8k.jsonl")
    s3.put_object(Bucket=bucket, Key="data/unrelated.bin", Body=b"x" * 1000)  # must not be fetched
    for f in Path(smollm2_artifact).iterdir():
        if f.name not in ("MANIFEST.json", "metrics.json"):
            s3.upload_file(str(f), bucket, f"hf/{f.name}")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"TMPDIR": str(tmp), "QERL_TMPDIR": str(tmp)}
    run_cli("components.prompts", "--model", str(smollm2_artifact), "--output", str(tmp_path / "prompts"),
            "--gsm8k-jsonl", f"{s3_bucket}/data/gsm8k.jsonl", "--eval-fraction", "0", env=env)
    assert read_artifact_table(str(tmp_path / "prompts"), "prompts", ["train.arrow"]).num_rows == 20
    run_cli("components.base_model", "--source", f"{s3_bucket}/hf", "--output", str(tmp_path / "base"), env=env)
    assert Artifact(str(tmp_path / "base")).read_bytes("model.safetensors") == (
        Path(smollm2_artifact) / "model.safetensors").read_bytes()
    assert list(tmp.iterdir()) == []  # no download left behind
    p = run_cli("components.prompts", "--model", str(smollm2_artifact), "--output", str(tmp_path / "p2"),
                "--gsm8k-jsonl", f"{s3_bucket}/data/none.jsonl", env=env, check=False)
    assert p.returncode == 2 and "no object at" in p.stderr


def test_prompts_from_reasoning_gym_to_s3(smollm2_artifact, s3_bucket, tmp_path):
    cfg = tmp_path / "prompts.yaml"
    cfg.write_text("reasoning_gym: basic_arithmetic\nsize: 30\nseed: 5\neval_fraction: 0.2\n")
    out = f"{s3_bucket}/run/prompts"
    run_cli("components.prompts", "--config", str(cfg), "--size", "40", "--model", str(smollm2_artifact),
            "--output", out)
    table = read_artifact_table(out, "prompts")
    assert table.num_rows == 40  # the flag overrode the YAML's size
    assert set(table.column("source").to_pylist()) == {"reasoning_gym:basic_arithmetic"}
    assert all(r.lstrip("-").isdigit() for r in table.column("answer").to_pylist())


@pytest.mark.parametrize("args, msg", [
    (["--reasoning-gym", "basic_arithmetic"], "needs --size"),
    (["--reasoning-gym", "no_such_task", "--size", "3"], "reasoning-gym generator 'no_such_task'"),
    (["--gsm8k-jsonl", "missing.jsonl"], "file not found"),
    (["--gsm8k-jsonl", "x.jsonl", "--reasoning-gym", "basic_arithmetic", "--size", "2"], "exactly one source"),
    (["--reasoning-gym", "basic_arithmetic", "--size", "3", "--eval-fraction", "1.5"], "eval-fraction"),
    (["--reasoning-gym", "basic_arithmetic", "--size", "2", "--eval-fraction", "0.01"], "held out none of the 2"),
])
def test_prompts_bad_input(smollm2_artifact, tmp_path, args, msg):
    p = run_cli("components.prompts", "--model", str(smollm2_artifact), "--output", str(tmp_path / "o"), *args,
                check=False)
    assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "o" / "MANIFEST.json").exists()


def test_prompts_bad_jsonl_record(smollm2_artifact, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "no final marker"}\n')
    p = run_cli("components.prompts", "--model", str(smollm2_artifact), "--output", str(tmp_path / "o"),
                "--gsm8k-jsonl", str(bad), check=False)
    assert p.returncode == 2 and "does not end in '#### <final>'" in p.stderr


def test_stage_help_reads_well():
    for stage in ("prompts", "base_model"):
        p = run_cli(f"components.{stage}", "--help")
        assert p.stdout.startswith(f"usage: python -m components.{stage}") and "--config FILE" in p.stdout
