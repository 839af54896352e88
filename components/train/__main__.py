"""python -m components.train --model URI --rollouts URI [URI ...] --rewards URI --output URI
                              [--adapter URI] [--state URI] [--config FILE]

One QeRL training iteration: the frozen NVFP4 base (compressed-tensors
`nvfp4-pack-quantized`) with a trainable LoRA adapter, updated on one batch of rollouts.

1. Read the rollout shards and the reward shard, check the reward contract
   (`check_rewards`), join them on (prompt_id, sample_index); incomplete groups, NaN
   rewards, rollouts and rewards that do not join: one-line error, exit 2.
2. Group-relative advantages (`objective.group_advantages`); with dynamic sampling, groups
   whose rewards all tie are dropped and counted.
3. Build the learner (NVFP4 base + LoRA, or the --adapter of the previous iteration, whose
   rank/alpha/targets/shapes must fit), restore optimizer, LR-schedule position and RNG from
   --state.
4. logp_old: the learner's log-probs before the update (no grad), with the mean token
   entropy; the reference (adapter disabled) when kl_beta > 0.
5. `epochs` passes over the batch, each one AdamW step with gradient accumulation over
   micro-batches (loss normalized by the whole batch, `objective.loss_normalizer`), clipped
   surrogate x truncated importance weight against the rollout engine's log-probs, grad
   norm clipping, warm-up + cosine LR over `total_steps` of the whole run.
6. Publish to --output: `adapter_config.json` + `adapter_model.safetensors` (a standard PEFT
   LoRA adapter, loadable by PEFT on the bf16 base and by vLLM's LoRARequest),
   `trainer_state.pt` (optimizer, scheduler, RNG, step: pass this artifact as --state and
   --adapter next iteration) and `metrics.json`.

If every group is dropped, the adapter is published unchanged and metrics say so
(`updated: false`), so the pipeline continues. A failed run publishes nothing.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from components.common.cli import ConfigError, config_dict, field, require, run_stage, set_cpu_threads
from components.common.storage import (Artifact, Staging, exists, expand_artifacts, fetch_external_dir,
                                       parse_uri)

log = logging.getLogger("qerl.train")

STATE_FILE = "trainer_state.pt"
METRICS_FILE = "metrics.json"


@dataclass
class TrainConfig:
    model: str = field("", help="NVFP4 base checkpoint (quantize stage artifact, or an HF checkpoint dir / s3 prefix)", metavar="URI")
    rollouts: list[str] = field(default_factory=list, help="rollout shard artifact(s) of this iteration, or a prefix "
                                "holding them (every artifact below it is taken); concatenated", metavar="URI")
    rewards: str = field("", help="reward shard artifact scoring exactly those rollouts", metavar="URI")
    output: str = field("", help="URI to publish the adapter, trainer_state.pt and metrics.json at", metavar="URI")
    adapter: str = field("", help="adapter to continue from (the previous iteration's --output); empty: a fresh LoRA", metavar="URI")
    state: str = field("", help="artifact holding trainer_state.pt to resume optimizer, LR schedule and RNG from "
                                "(usually the same URI as --adapter); needs --adapter", metavar="URI")
    overwrite: bool = field(False, help="replace an artifact already published at --output")
    iteration: int = field(0, help="RL iteration number, recorded in the state and metrics; rollouts of another iteration give a warning")
    # objective
    loss_type: str = field("grpo", help="'grpo' or 'dapo': selects the defaults of aggregation, clip_eps_high, dynamic_sampling, mask_truncated")
    aggregation: str | None = field(None, help="'sequence' (GRPO) or 'token' (DAPO) loss aggregation; empty: the loss_type's default")
    clip_eps_low: float = field(0.2, help="PPO ratio clipped below at 1 - clip_eps_low")
    clip_eps_high: float | None = field(None, help="PPO ratio clipped above at 1 + clip_eps_high; empty: 0.2 (grpo) / 0.28 (dapo)")
    dynamic_sampling: bool | None = field(None, help="drop groups whose rewards all tie; empty: the loss_type's default (dapo: on)")
    mask_truncated: bool | None = field(None, help="no loss on completions that hit max_tokens; empty: the loss_type's default (dapo: on)")
    scale_rewards: bool = field(True, help="divide group-centred rewards by the group std (False: Dr. GRPO)")
    kl_beta: float = field(0.0, help="weight of the k3 KL to the reference policy (base, adapter disabled); 0: off, no reference pass")
    tis_cap: float = field(2.0, help="truncated importance sampling cap C of min(exp(logp_old - logp_rollout), C); 0 disables the correction")
    temperature: float = field(0.0, help="the policy's sampling temperature: logits are divided by it before log-probs. "
                               "0: the rollouts' (their temperature column); another value must agree with it")
    epochs: int = field(1, help="passes over the batch, one optimizer step each (mu)")
    micro_batch_tokens: int = field(4096, help="padded tokens (rows x longest sequence) per forward/backward micro-batch")
    # optimizer and schedule
    lr: float = field(1e-5, help="peak AdamW learning rate")
    warmup_steps: int = field(0, help="linear warm-up optimizer steps, counted over the whole run")
    total_steps: int = field(1000, help="optimizer steps of the whole run (iterations x epochs): the cosine decay's length")
    min_lr_ratio: float = field(0.0, help="the cosine decays to lr x min_lr_ratio")
    weight_decay: float = field(0.0, help="AdamW weight decay on the LoRA weights")
    adam_beta1: float = field(0.9, help="AdamW beta1")
    adam_beta2: float = field(0.999, help="AdamW beta2")
    adam_eps: float = field(1e-8, help="AdamW epsilon")
    grad_clip: float = field(1.0, help="clip the global gradient norm to this; 0: no clipping (the norm is still reported)")
    # LoRA and runtime
    lora_rank: int = field(32, help="LoRA rank r (must equal the --adapter's)")
    lora_alpha: float = field(64.0, help="LoRA alpha; the update is scaled by alpha / r (must equal the --adapter's)")
    lora_dropout: float = field(0.0, help="LoRA dropout on the adapter input")
    gradient_checkpointing: bool = field(False, help="recompute decoder activations in backward (less memory, ~1.3x time)")
    dequant_prefetch: bool = field(True, help="dequantize the next decoder layer's NVFP4 weights on a side CUDA stream while the "
                                   "current one computes (kernels.nvfp4.linear.DequantPrefetch), for one more layer of bf16 "
                                   "weights in memory (0.47 GB at 7B); ~1 %% of a 7B step on an H200, where cuBLAS leaves "
                                   "little room to overlap")
    manual_gc: bool = field(True, help="no automatic Python garbage collection during the iteration (one collection before "
                            "and after): a full pass walks every object of the process and otherwise lands inside some epoch")
    cudnn_attention: bool = field(False, help="allow cuDNN attention (PyTorch's first SDPA choice on Hopper). Off: "
                                  "FlashAttention / memory-efficient kernels built into PyTorch. cuDNN's kernels are "
                                  "JIT-compiled by the CUDA driver whenever its cache (CUDA_CACHE_PATH) is empty, as in "
                                  "a fresh stage container: +1.4 s on a 7B update and +0.6-1 s on its logp_old pass (H200); "
                                  "warm, cuDNN is ~3%% faster. Turn on when that cache persists between runs")
    seed: int = field(0, help="seed of the fresh LoRA initialization and the RNG (a resumed run continues the saved RNG)")
    device: str = field("auto", help="'auto' (cuda if present, else cpu), 'cuda' or 'cpu'")

    def __post_init__(self):
        if isinstance(self.rollouts, str):
            self.rollouts = [self.rollouts]
        for name in ("model", "rewards", "output"):
            require(bool(getattr(self, name)), f"--{name} is required")
        require(bool(self.rollouts), "--rollouts is required (one or more URIs)")
        for uri in [self.model, self.rewards, self.output, *self.rollouts] + [u for u in (self.adapter, self.state) if u]:
            parse_uri(uri)
        require(not self.state or bool(self.adapter), "--state needs --adapter (the adapter published with that state)")
        require(self.device in ("auto", "cuda", "cpu"), f"--device must be auto, cuda or cpu, not {self.device!r}")
        require(self.lora_rank >= 1, f"--lora-rank must be >= 1, got {self.lora_rank}")
        require(self.lora_alpha > 0, f"--lora-alpha must be > 0, got {self.lora_alpha}")
        require(0.0 <= self.lora_dropout < 1.0, f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        require(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        require(self.total_steps >= 1 and 0 <= self.warmup_steps <= self.total_steps,
                f"need 0 <= --warmup-steps <= --total-steps and --total-steps >= 1, got {self.warmup_steps}, {self.total_steps}")
        require(0.0 <= self.min_lr_ratio <= 1.0, f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        require(self.grad_clip >= 0, f"--grad-clip must be >= 0, got {self.grad_clip}")
        require(math.isfinite(self.temperature) and self.temperature >= 0,
                f"--temperature must be >= 0 (0: the rollouts'), got {self.temperature}")
        require(self.tis_cap == 0 or self.tis_cap >= 1, f"--tis-cap must be 0 (off) or >= 1, got {self.tis_cap}")
        require(self.iteration >= 0, f"--iteration must be >= 0, got {self.iteration}")
        self.objective()

    def objective(self):
        """The ObjectiveConfig these fields describe."""
        from components.train.objective import ObjectiveConfig

        try:
            return ObjectiveConfig(
                loss_type=self.loss_type, aggregation=self.aggregation or None, clip_eps_low=self.clip_eps_low,
                clip_eps_high=self.clip_eps_high, kl_beta=self.kl_beta, scale_rewards=self.scale_rewards,
                dynamic_sampling=self.dynamic_sampling, mask_truncated=self.mask_truncated,
                tis_cap=self.tis_cap or None, epochs=self.epochs, micro_batch_tokens=self.micro_batch_tokens)
        except ValueError as e:
            raise ConfigError(str(e)) from e


def _local(uri: str) -> Path:
    return Artifact(uri).local_dir() if exists(uri) else fetch_external_dir(uri)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _device(name: str):
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    return torch.device("cuda" if name == "auto" and torch.cuda.is_available() else ("cpu" if name == "auto" else name))


def main(cfg: TrainConfig) -> None:
    set_cpu_threads()
    t_start = time.time()
    if exists(cfg.output) and not cfg.overwrite:
        raise ConfigError(f"artifact {cfg.output} already exists (pass --overwrite to replace it)")

    import torch

    from components.common.schemas import read_artifact_table
    from components.train import model as M
    from components.train import trainer as T

    # 1. inputs: everything cheap is checked before transformers is imported or the model loaded
    import pyarrow as pa
    shards = list(dict.fromkeys(expand_artifacts(cfg.rollouts, "rollout shard")))
    tables = [read_artifact_table(u, "rollouts") for u in shards]
    rollouts = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    rewards = read_artifact_table(cfg.rewards, "rewards", ["rewards.arrow"])  # the contract's one shard; extras ignored
    batch = T.load_batch(rollouts, rewards, where=f"rewards {cfg.rewards}")
    T.policy_temperature(cfg, batch)  # a temperature that disagrees with the rollouts' fails here
    if batch.top_p < 1:
        log.warning("rollouts were sampled with top-p %g: their log-probs are over the nucleus, the learner's over "
                    "the whole vocabulary, so the TIS weights and mismatch metrics include that truncation",
                    batch.top_p)
    iters = sorted(set(batch.iterations))
    if iters != [cfg.iteration]:
        log.warning("rollouts carry iteration(s) %s, training as iteration %d", iters, cfg.iteration)
    adapter_dir, adapter_sha, adapter_digest = None, None, ""
    if cfg.adapter:
        adapter_dir = _local(cfg.adapter)
        acfg = M.read_adapter_config(adapter_dir)
        M.check_adapter_config(acfg, cfg.lora_rank, cfg.lora_alpha, M.TARGET_MODULES, f"--adapter {cfg.adapter}")
        adapter_sha = _sha256(adapter_dir / M.ADAPTER_WEIGHTS)
        if exists(cfg.adapter):
            adapter_digest = Artifact(cfg.adapter).digest
    rollout_digests = sorted(set(batch.adapter_digests))
    if rollout_digests != [adapter_digest]:
        log.warning("rollouts were sampled with adapter digest(s) %s, the learner starts from %r: "
                    "logp_old is not the sampling policy (TIS corrects only engine mismatch)",
                    [d[:12] for d in rollout_digests], adapter_digest[:12])
    state = None
    if cfg.state:
        state_dir = _local(cfg.state)
        if not (state_dir / STATE_FILE).is_file():
            raise ConfigError(f"--state {cfg.state} holds no {STATE_FILE}")
        try:
            state = torch.load(state_dir / STATE_FILE, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - a corrupt state is bad input
            raise ConfigError(f"--state {cfg.state}: cannot read {STATE_FILE}: {e}") from e
    ckpt = _local(cfg.model)
    T.check_vocab(batch, getattr(M.checkpoint_config(ckpt), "vocab_size", None))

    # 2. the learner
    device = _device(cfg.device)
    policy = T.build_policy(ckpt, cfg, device, base_name=cfg.model)
    if adapter_dir is not None:
        M.load_adapter_weights(policy, adapter_dir, f"--adapter {cfg.adapter}")
    opt, sched = T.make_optimizer(policy, cfg)
    if state is not None:
        T.restore_state(state, opt, sched, cfg, adapter_sha, f"--state {cfg.state}")
    elif cfg.adapter:
        log.warning("--adapter without --state: fresh optimizer moments, LR schedule from step 0")
    if sched.last_epoch >= cfg.total_steps:
        log.warning("schedule step %d is past --total-steps %d: lr is lr x min_lr_ratio = %g",
                    sched.last_epoch, cfg.total_steps, cfg.lr * cfg.min_lr_ratio)

    # 3. train
    metrics = T.train_iteration(policy, opt, sched, batch, cfg, device)
    step = sched.last_epoch
    metrics.update(step=step, wall_seconds=time.time() - t_start, device=device.type,
                   lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                   trainable_params=sum(p.numel() for p in T.trainable(policy)),
                   resumed_from=cfg.state or None, adapter_in=cfg.adapter or None)

    # 4. publish
    with Staging() as st:
        M.save_adapter(policy, st.path)
        sha = _sha256(st.path / M.ADAPTER_WEIGHTS)
        torch.save(T.trainer_state(opt, sched, cfg, sha, step), st.path / STATE_FILE)
        (st.path / METRICS_FILE).write_text(json.dumps(metrics, indent=1, default=float))
        st.publish(cfg.output, stage="train", config=config_dict(cfg), overwrite=cfg.overwrite)
    if metrics["updated"]:
        log.info("iteration %d: loss %.5f, reward %.3f±%.3f, dropped groups %.0f%%, %.0f tokens/s → %s",
                 cfg.iteration, metrics["loss"], metrics["reward_mean"], metrics["reward_std"],
                 100 * metrics["dropped_group_fraction"], metrics["tokens_per_s"], cfg.output)
    else:
        log.info("iteration %d: no update (%s); adapter published unchanged → %s",
                 cfg.iteration, metrics["skipped_reason"], cfg.output)


if __name__ == "__main__":
    sys.exit(run_stage(main, TrainConfig, prog="python -m components.train", description=__doc__))
