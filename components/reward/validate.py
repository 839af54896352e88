"""The reward contract's checks, shared by the reward stage, the train stage and the pipeline.

A reward shard is acceptable when it follows the rewards schema (v1.x), holds every rollout
sample exactly once (keyed by prompt_id, sample_index), nothing else, and only finite values.
Every reward shard the pipeline consumes, built-in or from a user's container, goes through
`check_rewards` before training.
"""
from __future__ import annotations

import math

import pyarrow as pa

from components.common.schemas import SchemaError, validate


def _keys(table: pa.Table) -> list[tuple[str, int]]:
    return list(zip(table.column("prompt_id").to_pylist(), table.column("sample_index").to_pylist()))


def check_rewards(rollouts: pa.Table, rewards: pa.Table, where: str = "reward shard") -> None:
    """Raise SchemaError naming the first problem: schema, missing/duplicate/stray rows, NaN/inf."""
    validate(rewards, "rewards", where)
    want, got = _keys(rollouts), _keys(rewards)
    seen: set[tuple[str, int]] = set()
    for key in got:
        if key in seen:
            raise SchemaError(f"{where}: rollout sample {key[0]}#{key[1]} is scored more than once")
        seen.add(key)
    missing = [k for k in want if k not in seen]
    if missing:
        raise SchemaError(f"{where}: {len(missing)} rollout sample(s) have no reward, e.g. {missing[0][0]}#{missing[0][1]}")
    stray = seen - set(want)
    if stray:
        k = sorted(stray)[0]
        raise SchemaError(f"{where}: {len(stray)} reward row(s) match no rollout sample, e.g. {k[0]}#{k[1]}")
    for i, (key, value) in enumerate(zip(got, rewards.column("reward").to_pylist())):
        if not math.isfinite(value):
            raise SchemaError(f"{where}: reward of {key[0]}#{key[1]} is {value}; rewards must be finite")
    for key, comps in zip(got, rewards.column("components").to_pylist()):
        for name, value in comps:
            if value is None or not math.isfinite(value):
                raise SchemaError(f"{where}: component {name!r} of {key[0]}#{key[1]} is {value}; must be finite")
