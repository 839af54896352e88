"""Where a run's artifacts live. The one place that knows the run layout:

    <root>/<run>/base/                         bf16 HF checkpoint (base_model stage)
    <root>/<run>/base-nvfp4/                   NVFP4 compressed-tensors checkpoint (quantize)
    <root>/<run>/prompts/                      prompt shards: train.arrow, eval.arrow (prompts)
    <root>/<run>/iter-0003/rollouts/shard-000-of-004/   one rollout task's shard (rollout)
    <root>/<run>/iter-0003/rewards/            reward shard (reward)
    <root>/<run>/iter-0003/adapter/            PEFT LoRA adapter (train)
    <root>/<run>/iter-0003/train/              optimizer + scheduler state, train metrics (train)
    <root>/<run>/eval/iter-0003/rollouts/      greedy samples on the eval split from the policy that
    <root>/<run>/eval/iter-0003/rewards/       rolls out iteration 3 (adapter of 2), and their rewards
    <root>/<run>/report/                       metrics table and plots

A rerun of one stage publishes a new version beside the old one (`rewards.v2/`, …) and
never touches it. Stages receive full URIs from the pipeline; they never guess paths.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .storage import StorageError, list_artifacts, parse_uri

_RUN_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")


def _versioned(name: str, version: int) -> str:
    if version < 1:
        raise ValueError(f"artifact versions start at 1, got {version}")
    return name if version == 1 else f"{name}.v{version}"


@dataclass(frozen=True)
class RunLayout:
    """The artifact URIs of one run: `RunLayout("s3://bucket/qerl", "gsm8k-0412")`."""
    root: str
    run: str

    def __post_init__(self):
        if not _RUN_NAME.match(self.run):
            raise ValueError(f"bad run name {self.run!r}: use 1-63 of a-z 0-9 . _ -, starting with a letter or digit")
        parse_uri(self.root)  # validates the root URI

    @property
    def prefix(self) -> str:
        return parse_uri(self.root).join(self.run).uri

    def _at(self, *parts: str) -> str:
        return parse_uri(self.root).join(self.run, *parts).uri

    def base(self) -> str:
        return self._at("base")

    def base_nvfp4(self) -> str:
        return self._at("base-nvfp4")

    def prompts(self) -> str:
        return self._at("prompts")

    def iteration(self, i: int) -> str:
        if i < 0:
            raise ValueError(f"iterations count from 0, got {i}")
        return self._at(f"iter-{i:04d}")

    def rollouts(self, i: int, shard: int = 0, num_shards: int = 1, version: int = 1) -> str:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is not in 0..{num_shards - 1}")
        return self._at(f"iter-{i:04d}", _versioned("rollouts", version), f"shard-{shard:03d}-of-{num_shards:03d}")

    def rewards(self, i: int, version: int = 1) -> str:
        return self._at(f"iter-{i:04d}", _versioned("rewards", version))

    def adapter(self, i: int, version: int = 1) -> str:
        return self._at(f"iter-{i:04d}", _versioned("adapter", version))

    def train_state(self, i: int, version: int = 1) -> str:
        return self._at(f"iter-{i:04d}", _versioned("train", version))

    def eval_rollouts(self, i: int, version: int = 1) -> str:
        """Evaluation samples of the policy that rolls out iteration i (the base at 0)."""
        return self._at("eval", f"iter-{i:04d}", _versioned("rollouts", version))

    def eval_rewards(self, i: int, version: int = 1) -> str:
        return self._at("eval", f"iter-{i:04d}", _versioned("rewards", version))

    def report(self) -> str:
        return self._at("report")

    def rollouts_prefix(self, i: int, version: int = 1) -> str:
        """The prefix under which all rollout shards of iteration i (of one version) live."""
        return self._at(f"iter-{i:04d}", _versioned("rollouts", version))

    def versions(self, uri_v1: str) -> list[int]:
        """Published versions of the artifact (or artifact prefix) whose first version is `uri_v1`."""
        parent, name = parse_uri(uri_v1).uri.rsplit("/", 1)
        found = set()
        for uri in list_artifacts(parent):
            first = uri[len(parent) + 1:].split("/", 1)[0]
            if first == name:
                found.add(1)
            elif first.startswith(name + ".v") and first[len(name) + 2:].isdigit():
                found.add(int(first[len(name) + 2:]))
        return sorted(found)

    def latest(self, uri_v1: str) -> str:
        """The newest published version's URI (what a rerun reads)."""
        versions = self.versions(uri_v1)
        if not versions:
            raise StorageError(f"nothing published at {uri_v1} (or any newer version of it)")
        parent, name = parse_uri(uri_v1).uri.rsplit("/", 1)
        return f"{parent}/{_versioned(name, versions[-1])}"

    def next_version(self, uri_v1: str) -> int:
        """The version a rerun publishes: one past the newest."""
        return (self.versions(uri_v1) or [0])[-1] + 1
