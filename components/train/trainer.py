"""The train stage's core, without I/O: the rollout batch, one iteration's update, the state.

    batch = load_batch(rollouts, rewards)                  joined, validated, sorted
    policy = build_policy(ckpt_dir, cfg, device)           NVFP4 base + LoRA (seeded)
    opt, sched = make_optimizer(policy, cfg)               AdamW + warm-up/cosine LambdaLR
    restore_state(state, opt, sched, cfg, adapter_sha, where)   resume: optimizer, schedule, RNG
    metrics = train_iteration(policy, opt, sched, batch, cfg, device)
    state = trainer_state(opt, sched, cfg, adapter_sha, step)

`train_iteration` is what one `python -m components.train` run does between reading and
publishing; calling it twice in one process is the "uninterrupted" reference that a resumed
run (adapter + trainer_state.pt) reproduces.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import os
import random
import resource
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import torch
from torch import Tensor

from components.common.cli import ConfigError
from components.common.schemas import SchemaError
from components.reward.validate import check_rewards
from components.train import objective as O
from components.train.model import attach_lora, load_base, logprobs, reference_logprobs
from kernels.nvfp4.linear import DequantPrefetch, NVFP4Linear

log = logging.getLogger("qerl.train")

STATE_FORMAT = "qerl-train-state/1"


# ----------------------------------------------------------------------------- the batch

@dataclass
class Batch:
    """One iteration's rollouts joined with their rewards, sorted by (prompt_id, sample_index)."""
    prompt_ids: list[str]
    sample_index: list[int]
    prompt_tokens: list[list[int]]
    completion_tokens: list[list[int]]
    rollout_logprobs: list[list[float]]
    truncated: list[bool]
    rewards: Tensor              # [N] float64
    group_size: int
    iterations: list[int]
    adapter_digests: list[str]
    logprob_temperature: float = 1.0   # the temperature the rollout logprobs were computed at
    top_p: float = 1.0                 # the smallest top-p the rollouts were sampled with

    def __len__(self) -> int:
        return len(self.prompt_ids)


def load_batch(rollouts: pa.Table, rewards: pa.Table, where: str = "rewards") -> Batch:
    """Join rollouts and rewards on (prompt_id, sample_index); SchemaError on bad input.

    Checks, in order: the reward contract (`check_rewards`: schema, every sample scored once,
    no stray rows, finite values), unique rollout keys, complete groups (every prompt has
    the same number of samples), token/logprob consistency. (`check_vocab` checks the ids.)
    """
    keys = list(zip(rollouts.column("prompt_id").to_pylist(), rollouts.column("sample_index").to_pylist()))
    dup = [k for k, c in Counter(keys).items() if c > 1]
    if dup:
        raise SchemaError(f"rollouts: sample {dup[0][0]}#{dup[0][1]} appears more than once")
    check_rewards(rollouts, rewards, where)
    if not keys:
        raise SchemaError("rollouts: the batch is empty")
    sizes = Counter(k[0] for k in keys)
    common = Counter(sizes.values()).most_common(1)[0][0]
    odd = sorted(p for p, n in sizes.items() if n != common)
    if odd:
        raise SchemaError(f"rollouts: incomplete groups: prompt {odd[0]} has {sizes[odd[0]]} sample(s), "
                          f"{len(sizes) - len(odd)} other prompt(s) have {common} "
                          f"({len(odd)} prompt(s) differ); every prompt needs the same number of samples")
    reward_of = dict(zip(zip(rewards.column("prompt_id").to_pylist(), rewards.column("sample_index").to_pylist()),
                         rewards.column("reward").to_pylist()))
    cols = {c: rollouts.column(c).to_pylist() for c in
            ("prompt_token_ids", "completion_token_ids", "completion_logprobs", "finish_reason",
             "iteration", "adapter_digest")}
    # 1.1 shards: log-probs of the sampling distribution (logits / T; greedy rows: plain logits).
    # 1.0 shards have no column and hold plain-logit log-probs: temperature 1.
    names = rollouts.schema.names
    temps = {(t if t > 0 else 1.0) for t in rollouts.column("temperature").to_pylist()} if "temperature" in names \
        else {1.0}
    if len(temps) != 1 or not all(math.isfinite(t) for t in temps):
        raise SchemaError(f"rollouts: sampled at temperatures {sorted(temps)}; one batch needs one temperature "
                          "(the learner's log-probs are computed at it)")
    top_p = min(rollouts.column("top_p").to_pylist()) if "top_p" in names and len(rollouts) else 1.0
    indices: dict[str, set[int]] = {}
    for pid, si in keys:
        indices.setdefault(pid, set()).add(si)
    bad = next((p for p, got in sorted(indices.items()) if got != set(range(common))), None)
    if bad is not None:
        raise SchemaError(f"rollouts: prompt {bad} has sample indices {sorted(indices[bad])}, expected "
                          f"0..{common - 1}: a group is incomplete or mixes samples of different rollouts")
    order = sorted(range(len(keys)), key=lambda i: keys[i])
    for i in order:
        pid, si = keys[i]
        p, c, lp = cols["prompt_token_ids"][i], cols["completion_token_ids"][i], cols["completion_logprobs"][i]
        if not p:
            raise SchemaError(f"rollouts: sample {pid}#{si} has an empty prompt")
        if len(lp) != len(c):
            raise SchemaError(f"rollouts: sample {pid}#{si} has {len(c)} completion tokens but {len(lp)} logprobs")
        if any(x is None or not math.isfinite(x) or x > 1e-3 for x in lp):
            raise SchemaError(f"rollouts: sample {pid}#{si} has a missing, non-finite or positive completion "
                              "logprob (the engine's log-probability of each sampled token is a finite number <= 0)")
        if any(t is None for t in p + c):
            raise SchemaError(f"rollouts: sample {pid}#{si} has a missing token id")
        if cols["finish_reason"][i] not in ("stop", "length"):
            raise SchemaError(f"rollouts: sample {pid}#{si} has finish_reason {cols['finish_reason'][i]!r}; "
                              "a completion the learner can use ended with 'stop' or 'length'")
    pick = lambda name: [cols[name][i] for i in order]  # noqa: E731
    return Batch(
        prompt_ids=[keys[i][0] for i in order], sample_index=[keys[i][1] for i in order],
        prompt_tokens=pick("prompt_token_ids"), completion_tokens=pick("completion_token_ids"),
        rollout_logprobs=pick("completion_logprobs"),
        truncated=[f == "length" for f in pick("finish_reason")],
        rewards=torch.tensor([reward_of[keys[i]] for i in order], dtype=torch.float64),
        group_size=common, iterations=pick("iteration"), adapter_digests=pick("adapter_digest"),
        logprob_temperature=temps.pop(), top_p=top_p,
    )


def policy_temperature(cfg, batch: Batch) -> float:
    """The temperature the learner computes log-probs at: the rollouts' (cfg.temperature 0), or
    cfg.temperature when it agrees with them; otherwise the ratios would compare two different
    distributions, so ConfigError."""
    if cfg.temperature == 0:
        return batch.logprob_temperature
    if not math.isclose(cfg.temperature, batch.logprob_temperature, rel_tol=1e-5):
        raise ConfigError(f"--temperature {cfg.temperature} differs from the rollouts' log-prob temperature "
                          f"{batch.logprob_temperature}: the ratios to the rollout log-probs would compare "
                          "different distributions (leave --temperature 0 to use the rollouts')")
    return cfg.temperature


def check_vocab(batch: Batch, vocab_size: int | None) -> None:
    """SchemaError if a token id falls outside the model's vocabulary (a rollout of another model)."""
    if vocab_size is None:
        return
    for pid, si, p, c in zip(batch.prompt_ids, batch.sample_index, batch.prompt_tokens, batch.completion_tokens):
        if any(t < 0 or t >= vocab_size for t in p + c):
            raise SchemaError(f"rollouts: sample {pid}#{si} has a token id outside the model's vocabulary "
                              f"[0, {vocab_size}): rollouts of another model?")


def _collate(batch: Batch, rows: list[int], device) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded input_ids, attention_mask, completion_mask [b, L] for `rows`."""
    seqs = [batch.prompt_tokens[i] + batch.completion_tokens[i] for i in rows]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    am = torch.zeros(len(rows), width, dtype=torch.long)
    cm = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, (i, s) in enumerate(zip(rows, seqs)):
        ids[r, :len(s)] = torch.tensor(s, dtype=torch.long)
        am[r, :len(s)] = 1
        cm[r, len(batch.prompt_tokens[i]):len(s)] = True
    return ids.to(device), am.to(device), cm.to(device)


def _scatter(values: list[Tensor], mask: Tensor) -> Tensor:
    """Per-row 1-D completion values -> [b, L] float32 at mask positions (0 elsewhere)."""
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if values:
        out[mask] = torch.cat([v.to(mask.device, torch.float32) for v in values])
    return out


# ----------------------------------------------------------------------------- policy + optimizer

def build_policy(ckpt_dir, cfg, device: torch.device, base_name: str | None = None):
    """NVFP4 base + fresh LoRA, seeded by cfg.seed (LoRA A init), gradient checkpointing opt."""
    base = load_base(ckpt_dir, device=device)
    torch.manual_seed(cfg.seed)
    policy = attach_lora(base, rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                         base_name=base_name)
    if cfg.gradient_checkpointing:
        policy.base_model.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
        # Every NVFP4 Linear sits in a checkpointed decoder layer: its recomputation's Ŵ can
        # serve the backward (NVFP4Linear.keep_dequantized), one dequantize fewer per call.
        for mod in policy.modules():
            if isinstance(mod, NVFP4Linear):
                mod.keep_dequantized = True
    if cfg.dequant_prefetch:
        layers = getattr(base.get_decoder(), "layers", None)
        policy.dequant_prefetch = DequantPrefetch.for_layers(layers) if layers is not None else None
    return policy


def trainable(policy) -> list[torch.nn.Parameter]:
    return [p for p in policy.parameters() if p.requires_grad]


def make_optimizer(policy, cfg):
    params = trainable(policy)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                            weight_decay=cfg.weight_decay, fused=bool(params) and params[0].is_cuda)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(
        O.lr_lambda, warmup_steps=cfg.warmup_steps, total_steps=cfg.total_steps, min_ratio=cfg.min_lr_ratio))
    return opt, sched


def rng_state() -> dict:
    out = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trainer_state(opt, sched, cfg, adapter_sha256: str, step: int) -> dict:
    """Everything a resumed run needs besides the adapter weights."""
    return {"format": STATE_FORMAT, "step": step, "iteration": cfg.iteration,
            "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": rng_state(),
            "lora": {"r": cfg.lora_rank, "alpha": cfg.lora_alpha}, "adapter_sha256": adapter_sha256}


def restore_state(state: dict, opt, sched, cfg, adapter_sha256: str | None, where: str) -> int:
    """Load optimizer, schedule position and RNG from a trainer_state dict; return the step.

    The scheduler's position is the run's optimizer step (LambdaLR.last_epoch)."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ConfigError(f"{where} is not a train state ({STATE_FORMAT})")
    if state["lora"] != {"r": cfg.lora_rank, "alpha": cfg.lora_alpha}:
        raise ConfigError(f"{where} was saved for LoRA {state['lora']}, the config has "
                          f"r={cfg.lora_rank}, alpha={cfg.lora_alpha}")
    if adapter_sha256 is not None and state.get("adapter_sha256") != adapter_sha256:
        raise ConfigError(f"{where} was saved together with a different adapter than --adapter "
                          "(pass the adapter published with that state)")
    try:
        opt.load_state_dict(state["optimizer"])
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{where}: the optimizer state does not fit this adapter: {e}") from e
    sched.load_state_dict(state["scheduler"])
    # The config's lr and schedule are authoritative; the state carries the position only.
    sched.base_lrs = [cfg.lr for _ in opt.param_groups]
    for g, lr in zip(opt.param_groups, sched.base_lrs):
        g["initial_lr"] = lr
        g["lr"] = lr * O.lr_lambda(sched.last_epoch, cfg.warmup_steps, cfg.total_steps, cfg.min_lr_ratio)
        g["weight_decay"], g["eps"] = cfg.weight_decay, cfg.adam_eps
        g["betas"] = (cfg.adam_beta1, cfg.adam_beta2)
    sched._last_lr = [g["lr"] for g in opt.param_groups]
    set_rng_state(state["rng"])
    return int(state["step"])


# ----------------------------------------------------------------------------- one iteration

def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _update_profiler(device: torch.device):
    """QERL_PROFILE_DIR=DIR: profile the update (torch.profiler) and write DIR/update_profile.txt.
    QERL_SYNC_DEBUG=1 (CUDA): warn, once per call site, at every GPU→host sync in the update."""
    if device.type == "cuda" and os.environ.get("QERL_SYNC_DEBUG", "0") not in ("", "0"):
        torch.cuda.set_sync_debug_mode("warn")
    if not os.environ.get("QERL_PROFILE_DIR"):
        return None
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=acts)
    prof.__enter__()
    return prof


def _write_profile(prof) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.__exit__(None, None, None)
    out = Path(os.environ["QERL_PROFILE_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    (out / "update_profile.txt").write_text(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70))
    log.info("update profile written to %s", out / "update_profile.txt")


@contextlib.contextmanager
def attention_kernels(cudnn: bool):
    """cudnn=False: PyTorch's SDPA may not pick cuDNN attention inside the block (process-wide
    flag, restored on exit; a context manager such as `sdpa_kernel` would not reach the
    recomputation that gradient checkpointing runs during backward)."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(before and cudnn)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


class _GarbageCollection:
    """Python's cyclic garbage collector inside the iteration: counts its full (oldest
    generation) passes and their seconds; with `manual`, automatic collection is off inside
    (one collection before, one after). A full pass walks every tracked object of the process
    (the model's modules, PEFT wrappers, ...) and lands wherever the allocation count says,
    i.e. in the middle of some epoch."""

    def __init__(self, manual: bool):
        self.manual, self.full_passes, self.seconds, self._t = manual, 0, 0.0, 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.full_passes += 1
            self.seconds += time.perf_counter() - self._t

    def __enter__(self):
        gc.collect()
        gc.callbacks.append(self._callback)
        self._was_enabled = gc.isenabled()
        if self.manual:
            gc.disable()
        return self

    def __exit__(self, *exc):
        if self._was_enabled:
            gc.enable()
        gc.callbacks.remove(self._callback)
        gc.collect()
        return False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _learner_logprobs(policy, batch: Batch, mbs: list[list[int]], temperature: float, device: torch.device,
                      metrics: dict, with_reference: bool) -> tuple[dict[int, Tensor], dict[int, Tensor], float]:
    """The learner's log-probs of every completion token of the rows in `mbs`, before any update
    ({row: [T_i]}), the reference's (adapter disabled) when asked, and the mean token entropy.

    Also puts the rollout/learner mismatch of those tokens into `metrics` (all completion tokens,
    truncated ones included): rollout_logp_abs_diff = mean |logp_learner − logp_rollout| and
    rollout_kl = mean k3 estimate of KL(rollout ‖ learner), with mismatch_tokens counted."""
    policy.eval()
    old: dict[int, Tensor] = {}
    ref: dict[int, Tensor] = {}
    ent_sum, ent_n, abs_sum, kl_sum = 0.0, 0, 0.0, 0.0
    with torch.no_grad():
        for mb in mbs:
            ids, am, cm = _collate(batch, mb, device)
            lp, ent = logprobs(policy, ids, am, cm, temperature=temperature, with_entropy=True)
            n = int(cm.sum())
            ent_sum, ent_n = ent_sum + float(ent) * n, ent_n + n
            for r, i in enumerate(mb):
                old[i] = lp[r][cm[r]].float().cpu()
                d = (old[i] - torch.tensor(batch.rollout_logprobs[i], dtype=torch.float32)).clamp(-20, 20)
                abs_sum += float(d.abs().sum())
                kl_sum += float((torch.expm1(d) - d).sum())
            if with_reference:
                lr_ = reference_logprobs(policy, ids, am, cm, temperature=temperature)
                for r, i in enumerate(mb):
                    ref[i] = lr_[r][cm[r]].cpu()
    metrics.update(rollout_logp_abs_diff=abs_sum / max(ent_n, 1), rollout_kl=kl_sum / max(ent_n, 1),
                   mismatch_tokens=ent_n)
    return old, ref, ent_sum / max(ent_n, 1)


def train_iteration(policy, opt, sched, batch: Batch, cfg, device: torch.device) -> dict:
    """Advantages, logp_old (+ ref), then `epochs` optimizer steps over the batch. Metrics."""
    with attention_kernels(cfg.cudnn_attention), _GarbageCollection(cfg.manual_gc) as collector:
        metrics = _train_iteration(policy, opt, sched, batch, cfg, device)
    metrics.update(gc_full_passes=collector.full_passes, gc_seconds=collector.seconds)
    return metrics


def _train_iteration(policy, opt, sched, batch: Batch, cfg, device: torch.device) -> dict:
    obj = cfg.objective()
    t0 = time.time()
    temperature = policy_temperature(cfg, batch)
    adv, keep, gstats = O.group_advantages(batch.rewards, batch.prompt_ids, obj)
    rows = [i for i in range(len(batch)) if keep[i]]
    counts = [len(batch.completion_tokens[i]) for i in rows]
    trunc = [batch.truncated[i] for i in rows]
    norm = O.loss_normalizer(counts, obj, trunc) if rows else 0.0
    metrics: dict = {
        "iteration": cfg.iteration, "sequences": len(batch), "group_size": batch.group_size,
        "num_groups": gstats["num_groups"], "tied_groups": gstats["tied_groups"],
        "dropped_groups": gstats["dropped_groups"],
        "dropped_group_fraction": gstats["dropped_group_fraction"],
        "kept_sequences": len(rows), "reward_mean": gstats["reward_mean"], "reward_std": gstats["reward_std"],
        "completion_tokens": int(sum(len(c) for c in batch.completion_tokens)),
        "truncated_fraction": sum(batch.truncated) / len(batch), "loss_normalizer": norm,
        "step_before": sched.last_epoch, "temperature": temperature, "rollout_top_p": batch.top_p,
    }
    def micro_batches_of(idx: list[int]) -> list[list[int]]:
        return [[idx[j] for j in mb] for mb in
                O.micro_batches([len(batch.prompt_tokens[i]) + len(batch.completion_tokens[i]) for i in idx],
                                obj.micro_batch_tokens, sort_by_length=True)]

    if not rows or norm <= 0:
        why = ("every group's rewards tie (dynamic sampling dropped all groups)" if not rows else
               "no loss token is left (all kept completions are empty or masked as truncated)")
        log.warning("no update this iteration: %s; publishing the adapter unchanged", why)
        # the rollout/learner mismatch is still measured, over every sample (a forward pass, no update)
        scored = rows or list(range(len(batch)))
        _, _, entropy = _learner_logprobs(policy, batch, micro_batches_of(scored), temperature, device, metrics, False)
        metrics.update(updated=False, skipped_reason=why, optimizer_steps=0, step_after=sched.last_epoch,
                       entropy=entropy, seconds=time.time() - t0, peak_memory_mb=_peak_memory_mb(device))
        return metrics

    mbs = micro_batches_of(rows)
    adv = adv.to(torch.float32)
    truncated = torch.tensor(batch.truncated, dtype=torch.bool)
    old, ref, entropy = _learner_logprobs(policy, batch, mbs, temperature, device, metrics, obj.kl_beta > 0)
    t_old = time.time()

    params = trainable(policy)
    policy.train()
    epochs, tokens_seen, t_upd = [], 0, time.time()
    profiler = _update_profiler(device)
    for epoch in range(obj.epochs):
        t_epoch = time.time()
        opt.zero_grad(set_to_none=True)
        acc: dict[str, float] = {}
        loss_sum, n_tok = 0.0, 0.0
        for mb in mbs:
            ids, am, cm = _collate(batch, mb, device)
            new, _ = logprobs(policy, ids, am, cm, temperature=temperature)
            roll = _scatter([torch.tensor(batch.rollout_logprobs[i]) for i in mb], cm)
            old_t = _scatter([old[i] for i in mb], cm)
            ref_t = _scatter([ref[i] for i in mb], cm) if obj.kl_beta > 0 else None
            loss, m = O.policy_loss(new, old_t, roll, adv[mb].to(device), cm, obj, ref_t,
                                    truncated=truncated[mb].to(device), normalizer=norm)
            loss.backward()
            loss_sum += float(loss.detach())
            w = float(m["num_tokens"])
            n_tok += w
            for k, v in m.items():
                if k not in ("num_tokens", "num_sequences"):
                    acc[k] = acc.get(k, 0.0) + float(v) * w
            tokens_seen += int(am.sum())
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
        if not torch.isfinite(grad_norm):
            raise FloatingPointError(f"non-finite gradient norm {float(grad_norm)} in epoch {epoch}: "
                                     "nothing is published")
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        _sync(device)
        e = {k: v / max(n_tok, 1.0) for k, v in acc.items()}
        e.update(loss=loss_sum, grad_norm=float(grad_norm), lr=lr, loss_tokens=n_tok, seconds=time.time() - t_epoch)
        epochs.append(e)
        log.info("epoch %d/%d: loss %.5f, grad norm %.4f, lr %.3g, clip %.3f, approx KL %.2e",
                 epoch + 1, obj.epochs, e["loss"], e["grad_norm"], lr, e["clip_fraction"], e["approx_kl"])
    t_end = time.time()  # before the profile is written: building its table takes tens of seconds
    if device.type == "cuda" and torch.cuda.get_sync_debug_mode() != 0:  # QERL_SYNC_DEBUG set it
        torch.cuda.set_sync_debug_mode("default")  # (any call warns that the mode is a prototype)
    if profiler is not None:
        _write_profile(profiler)
    first, last = epochs[0], epochs[-1]
    metrics.update(
        updated=True, optimizer_steps=obj.epochs, step_after=sched.last_epoch, micro_batches=len(mbs),
        loss=last["loss"], entropy=entropy, clip_fraction=last["clip_fraction"],
        approx_kl=last["approx_kl"], grad_norm=last["grad_norm"], lr=last["lr"],
        ratio_mean=last["ratio_mean"],
        tis_weight_mean=first.get("tis_weight_mean"), tis_capped_fraction=first.get("tis_capped_fraction"),
        ref_kl=last.get("ref_kl"), epochs=epochs,
        seconds_logp_old=t_old - t0, seconds_update=t_end - t_upd, seconds=t_end - t0,
        tokens_per_s=tokens_seen / max(t_end - t_upd, 1e-9),
        peak_memory_mb=_peak_memory_mb(device),
    )
    prefetch = getattr(policy, "dequant_prefetch", None)
    if prefetch is not None:  # layers whose Ŵ was made ahead / layer entries that tried
        metrics.update(dequant_prefetch_hits=prefetch.hits, dequant_prefetch_issued=prefetch.issued)
    return metrics
