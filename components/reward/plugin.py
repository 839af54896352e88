"""Custom reward plug-ins: the checks and the local runner behind docs/reward-contract.md.

A user brings a reward as a container plus a KFP component YAML. Before compiling, the
pipeline calls `check_component_spec` on that YAML: it must declare exactly the contract's
inputs (`rollouts`, `output`, optional `config`, all String), no outputs, an image and a
command, and pass `rollouts` and `output` to the command. Running locally (no Kubernetes, no
Docker), the pipeline calls `run_custom_reward` with the reward's own command line: it runs
it as a subprocess with the contract's arguments, maps its exit code, and validates the
published shard with `check_rewards` against the rollouts before anything trains on it.
"""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import yaml

from components.common.schemas import SchemaError, read_artifact_table
from components.common.storage import Artifact, StorageError, exists, expand_artifacts
from components.reward.validate import check_rewards

REQUIRED_INPUTS = ("rollouts", "output")
OPTIONAL_INPUTS = ("config",)
STRING_TYPES = {"string", "str"}
PLACEHOLDER = "REPLACE_ME"
SHARD = "rewards.arrow"
EXIT_MEANING = {1: "failed", 2: "rejected its input or config"}


class RewardPluginError(RuntimeError):
    """A custom reward that failed, or published a shard the pipeline cannot train on."""


@dataclass(frozen=True)
class RewardComponentInfo:
    """What the pipeline needs from a checked reward component."""
    name: str
    image: str
    command: list[Any]
    args: list[Any]
    inputs: dict[str, Any]   # name -> kfp InputSpec
    component: Any           # the kfp component, callable inside a @dsl.pipeline


# --------------------------------------------------------------------------- spec check

def _load_text(spec: str | os.PathLike | dict) -> tuple[str, str]:
    """(YAML text, where) from a path, a YAML string or a mapping."""
    if isinstance(spec, dict):
        return yaml.safe_dump(spec, sort_keys=False), "component spec"
    text = str(spec)
    if "\n" not in text and Path(text).is_file():
        return Path(text).read_text(), text
    if isinstance(spec, os.PathLike) or "\n" not in text:
        raise ValueError(f"reward component spec {text}: file not found")
    return text, "component spec"


def _names(element) -> set[str]:
    """Input names that a command-line element (possibly nested placeholders) passes."""
    from kfp.dsl import placeholders as ph

    if isinstance(element, (ph.InputValuePlaceholder, ph.InputPathPlaceholder)):
        return {element.input_name}
    if isinstance(element, ph.ConcatPlaceholder):
        return set().union(*(_names(e) for e in element.items))
    if isinstance(element, ph.IfPresentPlaceholder):
        parts = [element.then, element.else_]
        parts = [p for x in parts if x is not None for p in (x if isinstance(x, list) else [x])]
        return set().union(*(_names(p) for p in parts))
    return set()


def _check_input_names(names: list, where: str) -> None:
    for name in REQUIRED_INPUTS:
        if name not in names:
            raise ValueError(f"{where}: missing input {name!r} (a reward component declares "
                             f"inputs {', '.join(REQUIRED_INPUTS)} and optionally {', '.join(OPTIONAL_INPUTS)})")
    extra = sorted(map(str, set(names) - set(REQUIRED_INPUTS) - set(OPTIONAL_INPUTS)))
    if extra:
        raise ValueError(f"{where}: unexpected input(s) {extra}; the pipeline passes only "
                         f"{', '.join(REQUIRED_INPUTS + OPTIONAL_INPUTS)} (put settings in config)")


def check_component_spec(spec: str | os.PathLike | dict, *, allow_placeholders: bool = False) -> RewardComponentInfo:
    """Load a reward component YAML with kfp's own loader and check it against the contract.

    Raises ValueError naming the first problem. `allow_placeholders` accepts the unedited
    template (its image and command still say REPLACE_ME); the pipeline never sets it.
    """
    from kfp import components

    text, where = _load_text(spec)
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{where}: not valid YAML ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a KFP component mapping (name, inputs, implementation)")
    container = (raw.get("implementation") or {}).get("container") if isinstance(raw.get("implementation"), dict) else None
    if not isinstance(container, dict):
        raise ValueError(f"{where}: needs implementation.container (a reward is one container, not a graph)")
    if not str(container.get("image") or "").strip():
        raise ValueError(f"{where}: implementation.container.image is missing or empty")
    if not container.get("command"):
        raise ValueError(f"{where}: implementation.container.command is missing or empty "
                         "(KFP replaces the image's ENTRYPOINT with it; name the program explicitly)")
    declared = [i.get("name") if isinstance(i, dict) else i for i in (raw.get("inputs") or [])]
    _check_input_names(declared, where)  # before kfp: its error for a missing input is obscure
    try:
        comp = components.load_component_from_text(text)
    except Exception as e:  # noqa: BLE001 - kfp raises many types; one message for the user
        raise ValueError(f"{where}: kfp cannot load it as a component: {type(e).__name__}: {e}") from e
    cs = comp.component_spec
    impl = cs.implementation.container
    inputs = dict(cs.inputs or {})

    _check_input_names(list(inputs), where)
    for name, spec_ in inputs.items():
        if str(spec_.type or "").lower() not in STRING_TYPES:
            raise ValueError(f"{where}: input {name!r} has type {spec_.type}, expected String")
    if "config" in inputs and not (inputs["config"].optional or inputs["config"].default is not None):
        raise ValueError(f"{where}: input 'config' must be optional (give it default: \"\")")
    if cs.outputs:
        raise ValueError(f"{where}: declares output(s) {sorted(cs.outputs)}; a reward container declares "
                         "none and publishes only at the URI given as --output")
    passed = set().union(*(_names(e) for e in [*(impl.command or []), *(impl.args or [])]))
    for name in (*REQUIRED_INPUTS, *(n for n in OPTIONAL_INPUTS if n in inputs)):
        if name not in passed:
            raise ValueError(f"{where}: input {name!r} is never passed to the command "
                             f"(use {{inputValue: {name}}} in command or args)")
    if not allow_placeholders:
        strings = [raw.get("name", ""), impl.image, *[e for e in [*(impl.command or []), *(impl.args or [])] if isinstance(e, str)]]
        if any(PLACEHOLDER in str(s) for s in strings):
            raise ValueError(f"{where}: still contains the template placeholder {PLACEHOLDER} "
                             "(set your image and your program in the command)")
    return RewardComponentInfo(name=cs.name, image=impl.image, command=list(impl.command or []),
                               args=list(impl.args or []), inputs=inputs, component=comp)


# --------------------------------------------------------------------------- local runner

def _tail(text: str, lines: int = 15) -> str:
    kept = [ln for ln in (text or "").strip().splitlines() if ln.strip()][-lines:]
    return "\n".join("  | " + ln for ln in kept) or "  | (no output on stderr)"


def run_custom_reward(command: list[str], rollouts: list[str], output: str, config: str | None = None,
                      *, env: dict | None = None, timeout: float | None = None) -> pa.Table:
    """Run a reward container's command locally and return its validated reward table.

    The command gets `--rollouts URI... --output URI [--config FILE]` appended, the current
    environment (S3 endpoint and credentials included) plus `env`. Non-zero exit, no artifact
    at `output`, or a shard that breaks the contract raise RewardPluginError naming why.
    """
    if not command:
        raise ValueError("run_custom_reward needs the reward's command, e.g. ['python', 'my_reward.py']")
    if not rollouts:
        raise ValueError("run_custom_reward needs at least one rollouts URI")
    argv = [*map(str, command), "--rollouts", *rollouts, "--output", output]
    if config:
        argv += ["--config", str(config)]
    who = f"custom reward `{' '.join(map(str, command))}`"
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
    except FileNotFoundError as e:
        raise RewardPluginError(f"{who}: cannot start it: {e}") from e
    except subprocess.TimeoutExpired as e:
        raise RewardPluginError(f"{who}: still running after {timeout} s; stopped") from e
    if proc.returncode != 0:
        rc = proc.returncode
        meaning = f"was killed by signal {-rc}" if rc < 0 else EXIT_MEANING.get(rc, "failed")
        raise RewardPluginError(f"{who} {meaning} (exit {rc}); the iteration stops before training. "
                                f"Last stderr lines:\n{_tail(proc.stderr)}")
    if not exists(output):
        raise RewardPluginError(f"{who} exited 0 but published nothing at {output} (no MANIFEST.json)")
    try:
        art = Artifact(output)
        if SHARD not in art.objects:
            raise SchemaError(f"artifact {output} has no {SHARD} (it has: {', '.join(art.names()) or 'nothing'})")
        rewards = read_artifact_table(output, "rewards", [SHARD])
        if "metrics.json" in art.objects and not isinstance(art.read_json("metrics.json"), dict):
            raise SchemaError(f"{output}/metrics.json must hold a JSON object")
        try:
            shards = expand_artifacts(rollouts, "rollout shard")
        except StorageError as e:
            raise RewardPluginError(str(e)) from e
        rollout_table = pa.concat_tables([read_artifact_table(u, "rollouts") for u in shards])
        check_rewards(rollout_table, rewards, where=f"reward shard {output}/{SHARD}")
    except (SchemaError, StorageError, json.JSONDecodeError) as e:
        raise RewardPluginError(f"{who} published an invalid reward shard; the iteration stops "
                                f"before training: {e}") from e
    return rewards
