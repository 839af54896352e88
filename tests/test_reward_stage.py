"""The built-in reward stage end to end through its CLI, on local paths and on moto S3.

The synthetic rollouts: two prompts, two samples each, published as two shard artifacts under
one `rollouts` prefix. Expected rewards (defaults gsm8k:1.0 + format:0.1), decided by hand:

    p1#0  <think>..</think> <answer>42</answer>   gold 42   gsm8k 1  format 1  -> 1.1
    p1#1  <think>..</think> <answer>41</answer>   gold 42   gsm8k 0  format 1  -> 0.1
    p2#0  "... #### 7"                             gold 7    gsm8k 1  format 0  -> 1.0
    p2#1  "I am not sure" (finish "length")        gold 7    gsm8k 0  format 0  -> 0.0
"""
from __future__ import annotations

import math
import statistics
import subprocess

import pyarrow as pa
import pytest
import yaml

from components.common.schemas import REWARDS, ROLLOUTS, read_artifact_table, read_ipc, to_table, write_ipc
from components.common.storage import Artifact, Staging, exists
from tests.conftest import ROOT, kfp_argv, run_cli

COMPLETIONS = {  # (prompt_id, sample_index): (completion, gold, n_tokens, finish_reason)
    ("p1", 0): ("<think>6*7</think> <answer>42</answer>", "42", 6, "stop"),
    ("p1", 1): ("<think>6*7</think> <answer>41</answer>", "42", 6, "stop"),
    ("p2", 0): ("3 + 4 = 7\n#### 7", "7", 8, "stop"),
    ("p2", 1): ("I am not sure", "7", 12, "length"),
}
DEFAULT_EXPECTED = {("p1", 0): 1.1, ("p1", 1): 0.1, ("p2", 0): 1.0, ("p2", 1): 0.0}


def rollout_row(pid: str, idx: int, text: str, gold: str, n: int, finish: str) -> dict:
    return {"prompt_id": pid, "sample_index": idx, "prompt_token_ids": [1, 2, 3],
            "completion_token_ids": list(range(10, 10 + n)), "completion_logprobs": [-0.5] * n,
            "completion_text": text, "finish_reason": finish, "answer": gold, "iteration": 0,
            "adapter_digest": "", "aqn_sigma": 0.01, "aqn_seed": 7, "sampling_seed": 11, "max_tokens": 12,
            "temperature": 1.0, "top_p": 1.0}


def rollouts_table(keys=None) -> pa.Table:
    keys = keys or list(COMPLETIONS)
    return to_table([rollout_row(k[0], k[1], *COMPLETIONS[k]) for k in keys], ROLLOUTS)


def publish_rollouts(root: str) -> str:
    """Publish p1 and p2 as two shard artifacts under `<root>/iter-0000/rollouts`; return that prefix."""
    prefix = f"{root}/iter-0000/rollouts"
    for shard, pid in enumerate(("p1", "p2")):
        with Staging() as st:
            (st.path / "rollouts.arrow").write_bytes(write_ipc(rollouts_table([(pid, 0), (pid, 1)])))
            st.publish(f"{prefix}/shard-{shard:03d}-of-002", stage="rollout", config={}, progress=False)
    return prefix


def by_key(table: pa.Table) -> dict:
    return {(r["prompt_id"], r["sample_index"]): r for r in table.to_pylist()}


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store" / "run")
    return request.getfixturevalue("s3_bucket") + "/run"


def test_defaults_end_to_end(root):
    prefix = publish_rollouts(root)
    out = f"{root}/iter-0000/rewards"
    run_cli("components.reward", "--rollouts", prefix, "--output", out)
    art = Artifact(out)
    assert art.manifest["stage"] == "reward" and set(art.names()) == {"rewards.arrow", "metrics.json"}
    assert art.manifest["config"]["reward"] == ["gsm8k:1.0", "format:0.1"]
    rows = by_key(read_artifact_table(out, "rewards"))
    assert set(rows) == set(DEFAULT_EXPECTED)
    for key, want in DEFAULT_EXPECTED.items():
        assert rows[key]["reward"] == pytest.approx(want), key
    assert dict(rows[("p1", 0)]["components"]) == {"gsm8k": 1.0, "format": 1.0}
    assert dict(rows[("p2", 0)]["components"]) == {"gsm8k": 1.0, "format": 0.0}
    m = art.read_json("metrics.json")
    totals = [1.1, 0.1, 1.0, 0.0]
    assert m["samples"] == 4 and m["groups"] == 2
    assert m["reward_mean"] == pytest.approx(0.55)
    assert m["reward_std"] == pytest.approx(statistics.pstdev(totals))
    assert m["accuracy"] == pytest.approx(0.5) and m["gsm8k_mean"] == pytest.approx(0.5)
    assert m["format_rate"] == pytest.approx(0.5)
    assert m["tied_group_fraction"] == 0.0 and m["truncation_rate"] == pytest.approx(0.25)
    assert len(m["rollout_shards"]) == 2  # the prefix was expanded into both shard artifacts
    assert all(u.startswith(prefix + "/shard-") for u in m["rollout_shards"])


def test_reward_override_and_explicit_shards(tmp_path):
    root = str(tmp_path / "run")
    prefix = publish_rollouts(root)
    out = str(tmp_path / "rewards")
    shards = [f"{prefix}/shard-000-of-002", f"{prefix}/shard-001-of-002"]
    run_cli("components.reward", "--rollouts", *shards, "--output", out, "--reward", "gsm8k:2", "truncated:-1")
    rows = by_key(read_artifact_table(out, "rewards"))
    assert {k: r["reward"] for k, r in rows.items()} == {("p1", 0): 2.0, ("p1", 1): 0.0, ("p2", 0): 2.0, ("p2", 1): -1.0}
    assert dict(rows[("p2", 1)]["components"]) == {"gsm8k": 0.0, "truncated": 1.0}
    m = Artifact(out).read_json("metrics.json")
    assert m["reward_mean"] == pytest.approx(0.75) and "format_rate" not in m and m["accuracy"] == 0.5


def test_config_file_with_params(tmp_path):
    prefix = publish_rollouts(str(tmp_path / "run"))
    cfg = tmp_path / "reward.yaml"
    cfg.write_text(yaml.safe_dump({"reward": ["overlong:1.0"], "params": {"overlong": {"buffer": 4}}}))
    out = str(tmp_path / "rewards")
    run_cli("components.reward", "--rollouts", prefix, "--output", out, "--config", str(cfg))
    # max_tokens 12, buffer 4: no penalty up to 8 tokens, then (8 - n) / 4.
    rows = by_key(read_artifact_table(out, "rewards"))
    assert {k: r["reward"] for k, r in rows.items()} == {("p1", 0): 0.0, ("p1", 1): 0.0, ("p2", 0): 0.0, ("p2", 1): -1.0}


@pytest.mark.parametrize("spec, msg", [("bogus:1", "unknown reward 'bogus'"), ("gsm8k:abc", "bad weight 'abc'"),
                                       ("gsm8k:inf", "must be finite")])
def test_bad_reward_spec_is_exit_2_one_line(tmp_path, spec, msg):
    prefix = publish_rollouts(str(tmp_path / "run"))
    out = str(tmp_path / "rewards")
    proc = run_cli("components.reward", "--rollouts", prefix, "--output", out, "--reward", spec, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m components.reward: error:") and msg in lines[0]
    assert not exists(out)


def test_missing_rollouts_and_existing_output_are_exit_2(tmp_path):
    out = str(tmp_path / "rewards")
    proc = run_cli("components.reward", "--rollouts", str(tmp_path / "nothing"), "--output", out, check=False)
    assert proc.returncode == 2 and "no rollout shard published at or under" in proc.stderr and not exists(out)
    prefix = publish_rollouts(str(tmp_path / "run"))
    run_cli("components.reward", "--rollouts", prefix, "--output", out)
    before = Artifact(out).manifest
    # the same command again (a retried task): nothing to do, the artifact stays as it was
    proc = run_cli("components.reward", "--rollouts", prefix, "--output", out)
    assert "already published by this stage with this same config" in proc.stderr
    assert Artifact(out).manifest == before
    # another config at the same output: refused, nothing replaced
    proc = run_cli("components.reward", "--rollouts", prefix, "--output", out, "--reward", "gsm8k:2.0", check=False)
    assert proc.returncode == 2 and "already exists" in proc.stderr and Artifact(out).manifest == before


def test_shards_round_trip(root):
    prefix = publish_rollouts(root)
    rollouts = read_artifact_table(prefix + "/shard-000-of-002", "rollouts")
    assert rollouts.equals(rollouts_table([("p1", 0), ("p1", 1)]))
    assert rollouts.schema.metadata[b"qerl.schema_version"] == b"1.1"
    out = f"{root}/rewards"
    run_cli("components.reward", "--rollouts", prefix, "--output", out)
    rewards = read_artifact_table(out, "rewards")
    assert rewards.schema.equals(REWARDS, check_metadata=True)
    again = read_ipc(write_ipc(rewards), "rewards")
    assert again.equals(rewards)
    rebuilt = to_table(rewards.to_pylist(), REWARDS)
    assert rebuilt.equals(rewards)
    assert all(math.isfinite(v) for v in rewards.column("reward").to_pylist())


def test_component_yaml_runs_the_stage(tmp_path):
    """Run components/reward/component.yaml's command line as KFP would render it."""
    spec_path = ROOT / "components/reward/component.yaml"
    assert yaml.safe_load(spec_path.read_text())["implementation"]["container"]["image"] == "qerl/reward:0.1.0"
    prefix = publish_rollouts(str(tmp_path / "run"))
    for name, config, want in [("a", "", 0.55), ("b", "reward: [gsm8k:2]", 1.0)]:
        out = str(tmp_path / f"rewards-{name}")
        argv = kfp_argv(spec_path, rollouts=prefix, output=out, config=config)
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert Artifact(out).read_json("metrics.json")["reward_mean"] == pytest.approx(want)
    argv = kfp_argv(spec_path, rollouts=prefix, output=str(tmp_path / "bad"), config="reward: [nope]")
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown reward 'nope'" in proc.stderr
