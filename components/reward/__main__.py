"""python -m components.reward --rollouts URI [URI ...] --output URI [--reward NAME[:WEIGHT] ...]

Scores every rollout sample with the built-in rewards (see components/reward/rewards.py)
and publishes one reward shard (rewards schema v1: key, weighted total, unweighted named
components) plus metrics: mean/std reward, accuracy, format rate, and the fraction of prompt
groups whose rewards all tie (those give GRPO no signal). With no --reward the default is
GSM8K accuracy (weight 1) plus format (weight 0.1). Reward params go in the YAML config:

    reward: [gsm8k:1.0, format:0.1, overlong:0.5]
    params: {overlong: {buffer: 64}, gsm8k: {formats: [answer_tag, hash]}}

--rollouts takes rollout shard artifacts, or a prefix under which they were published.
"""
from __future__ import annotations

import json
import logging
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass

import pyarrow as pa

from components.common.cli import ConfigError, config_dict, field, require, run_stage
from components.common.schemas import REWARDS as REWARDS_SCHEMA, read_artifact_table, to_table, write_ipc
from components.common.storage import Staging, expand_artifacts, parse_uri
from components.reward.rewards import DEFAULT_REWARDS, Sample, combine, parse_reward_spec
from components.reward.validate import check_rewards

log = logging.getLogger("qerl.reward")
ACCURACY = ("gsm8k", "math")


@dataclass
class RewardConfig:
    rollouts: list[str] = field(default_factory=list, help="rollout shard artifact URIs, or a prefix holding them", metavar="URI")
    output: str = field("", help="URI to publish the reward shard at", metavar="URI")
    reward: list[str] = field(default_factory=lambda: [f"{n}:{w}" for n, w in DEFAULT_REWARDS],
                              help="rewards as NAME[:WEIGHT]: gsm8k, math, format, overlong, truncated", metavar="SPEC")
    params: dict = field(default_factory=dict, help="per-reward params, {name: {param: value}} (YAML only)")
    overwrite: bool = field(False, help="replace an artifact already published at --output")

    def __post_init__(self):
        require(bool(self.rollouts), "--rollouts is required")
        require(bool(self.output), "--output is required")
        for uri in [*self.rollouts, self.output]:
            parse_uri(uri)
        try:
            names = [parse_reward_spec(s)[0] for s in self.reward]
        except ValueError as e:
            raise ConfigError(str(e)) from e
        require(len(set(names)) == len(names), f"a reward is named twice in --reward {self.reward}")
        require(isinstance(self.params, dict), "params must be a mapping {reward: {param: value}}")
        stray = set(self.params) - set(names)
        require(not stray, f"params given for reward(s) not in --reward: {sorted(stray)}")


def score(rollouts: pa.Table, specs: list[str], params: dict) -> tuple[pa.Table, dict]:
    from tqdm import tqdm

    rows, by_group = [], defaultdict(list)
    cols = {c: rollouts.column(c).to_pylist() for c in
            ("prompt_id", "sample_index", "completion_text", "answer", "completion_token_ids", "max_tokens", "finish_reason")}
    for i in tqdm(range(rollouts.num_rows), desc="reward", unit="sample", disable=rollouts.num_rows < 2000):
        sample = Sample(completion=cols["completion_text"][i], gold=cols["answer"][i],
                        num_completion_tokens=len(cols["completion_token_ids"][i]),
                        max_tokens=cols["max_tokens"][i], finish_reason=cols["finish_reason"][i])
        try:
            total, parts = combine(sample, specs, params)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        rows.append({"prompt_id": cols["prompt_id"][i], "sample_index": cols["sample_index"][i],
                     "reward": total, "components": parts})
        by_group[cols["prompt_id"][i]].append(total)
    totals = [r["reward"] for r in rows]
    metrics = {"samples": len(rows), "groups": len(by_group),
               "reward_mean": statistics.fmean(totals), "reward_std": statistics.pstdev(totals),
               "tied_group_fraction": sum(len(set(v)) == 1 for v in by_group.values()) / len(by_group),
               "truncation_rate": sum(f == "length" for f in cols["finish_reason"]) / len(rows)}
    for name in {parse_reward_spec(s)[0] for s in specs}:
        metrics[f"{name}_mean"] = statistics.fmean(r["components"][name] for r in rows)
    acc = [n for n in ACCURACY if f"{n}_mean" in metrics]
    if acc:
        metrics["accuracy"] = metrics[f"{acc[0]}_mean"]
    if "format_mean" in metrics:
        metrics["format_rate"] = metrics["format_mean"]
    return to_table(rows, REWARDS_SCHEMA), metrics


def main(cfg: RewardConfig) -> None:
    shards = expand_artifacts(cfg.rollouts, "rollout shard")
    rollouts = pa.concat_tables([read_artifact_table(u, "rollouts") for u in shards])
    if rollouts.num_rows == 0:
        raise ConfigError(f"the rollout shards at {', '.join(cfg.rollouts)} hold no samples")
    table, metrics = score(rollouts, cfg.reward, cfg.params)
    check_rewards(rollouts, table)
    metrics["rollout_shards"] = shards
    with Staging() as st:
        (st.path / "rewards.arrow").write_bytes(write_ipc(table))
        (st.path / "metrics.json").write_text(json.dumps(metrics, indent=1))
        st.publish(cfg.output, stage="reward", config=config_dict(cfg), overwrite=cfg.overwrite)
    log.info("rewards: %d samples, mean %.3f, accuracy %s, tied groups %.0f%% → %s", metrics["samples"],
             metrics["reward_mean"], f"{metrics['accuracy']:.3f}" if "accuracy" in metrics else "n/a",
             100 * metrics["tied_group_fraction"], cfg.output)


if __name__ == "__main__":
    sys.exit(run_stage(main, RewardConfig, prog="python -m components.reward", description=__doc__))
