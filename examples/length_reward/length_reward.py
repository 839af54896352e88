"""An example custom reward for QeRL Pipeline: brevity plus a keyword bonus.

    python length_reward.py --rollouts URI [URI ...] --output URI [--config FILE]

Follows docs/reward-contract.md using only `components.common` (no torch). Per sample:

    length  = -min(1, max(0, n - target_tokens) / target_tokens)   n = completion tokens
    keyword = 1 if any of `keywords` occurs in the completion text, else 0
    reward  = length_weight * length + keyword_weight * keyword

Config (YAML, every key optional):

    target_tokens: 256        # no penalty up to here; -1 at twice this length and beyond
    length_weight: 1.0
    keywords: ["<answer>"]
    keyword_weight: 0.5

Exit status: 0 published; 2 bad arguments, config or input (nothing published); 1 any other
failure (nothing published).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import pyarrow as pa
import yaml

from components.common.schemas import REWARDS, SchemaError, read_artifact_table, to_table, write_ipc
from components.common.storage import Staging, StorageError, expand_artifacts

DEFAULTS = {"target_tokens": 256, "length_weight": 1.0, "keywords": ["<answer>"], "keyword_weight": 0.5}
PROG = "length_reward"


class BadInput(ValueError):
    """Anything the user must fix: exit 2."""


def load_config(path: str | None) -> dict:
    cfg = dict(DEFAULTS)
    if path:
        try:
            with open(path) as fh:
                data = yaml.safe_load(fh) or {}
        except OSError as e:
            raise BadInput(f"cannot read --config {path}: {e.strerror}") from e
        except yaml.YAMLError as e:
            raise BadInput(f"--config {path} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise BadInput(f"--config {path} must hold a mapping")
        unknown = sorted(set(data) - set(DEFAULTS))
        if unknown:
            raise BadInput(f"--config {path}: unknown key(s) {unknown}; known: {sorted(DEFAULTS)}")
        cfg.update(data)
    if not isinstance(cfg["target_tokens"], int) or cfg["target_tokens"] <= 0:
        raise BadInput(f"target_tokens must be a positive integer, got {cfg['target_tokens']!r}")
    for k in ("length_weight", "keyword_weight"):
        if not isinstance(cfg[k], (int, float)) or not math.isfinite(cfg[k]):
            raise BadInput(f"{k} must be a finite number, got {cfg[k]!r}")
    if not isinstance(cfg["keywords"], list) or not all(isinstance(k, str) and k for k in cfg["keywords"]):
        raise BadInput(f"keywords must be a list of non-empty strings, got {cfg['keywords']!r}")
    return cfg


def score(rollouts: pa.Table, cfg: dict) -> tuple[pa.Table, dict]:
    target = cfg["target_tokens"]
    rows = []
    for r in rollouts.select(["prompt_id", "sample_index", "completion_text", "completion_token_ids"]).to_pylist():
        length = -min(1.0, max(0, len(r["completion_token_ids"]) - target) / target)
        keyword = 1.0 if any(k in r["completion_text"] for k in cfg["keywords"]) else 0.0
        rows.append({"prompt_id": r["prompt_id"], "sample_index": r["sample_index"],
                     "reward": cfg["length_weight"] * length + cfg["keyword_weight"] * keyword,
                     "components": {"length": length, "keyword": keyword}})
    totals = [r["reward"] for r in rows]
    metrics = {"samples": len(rows), "reward_mean": statistics.fmean(totals),
               "reward_std": statistics.pstdev(totals),
               "length_mean": statistics.fmean(r["components"]["length"] for r in rows),
               "keyword_rate": statistics.fmean(r["components"]["keyword"] for r in rows)}
    return to_table(rows, REWARDS), metrics


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", nargs="+", required=True, metavar="URI", help="rollout shard artifacts or prefixes")
    p.add_argument("--output", required=True, metavar="URI", help="where to publish the reward shard")
    p.add_argument("--config", metavar="FILE", help="YAML config (see above)")
    args = p.parse_args(argv)  # a bad command line exits 2 here
    try:
        cfg = load_config(args.config)
        shards = expand_artifacts(args.rollouts, "rollout shard")  # a prefix → its shard artifacts
        rollouts = pa.concat_tables([read_artifact_table(u, "rollouts") for u in shards])
        if rollouts.num_rows == 0:
            raise BadInput("the rollout shards hold no samples")
        table, metrics = score(rollouts, cfg)
        with Staging() as st:  # MANIFEST.json is written last, by publish()
            (st.path / "rewards.arrow").write_bytes(write_ipc(table))
            (st.path / "metrics.json").write_text(json.dumps(metrics, indent=1))
            st.publish(args.output, stage="reward:length_reward", config=cfg)
    except (BadInput, StorageError, SchemaError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - the contract: any other failure is exit 1
        print(f"{PROG}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"{PROG}: {metrics['samples']} samples, mean reward {metrics['reward_mean']:.3f} -> {args.output}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
