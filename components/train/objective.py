"""The policy-gradient objective of the train stage, as pure torch functions (no model, no I/O).

Pieces, in the order the train loop uses them:

    group_advantages   rewards of one rollout batch -> per-completion advantages + keep mask
    micro_batches      sequence indices -> micro-batches under a padded-token budget
    loss_normalizer    the whole batch's token / sequence count, for gradient accumulation
    policy_loss        clipped surrogate x truncated importance weight (+ beta * k3 KL)
    token_entropy      masked mean entropy from logits, chunked (a metric)
    lr_lambda          linear warm-up then cosine decay, for LambdaLR

Conventions (shared by every function here):

* Log-probabilities are per sampled completion token, shape [B, T], right-padded; `mask` [B, T]
  marks real completion tokens (prompt and padding are 0). Values at masked positions are
  never read: they may be garbage, +-inf or NaN.
* Three policies meet in one token's log-probability:
    logp_rollout  the engine (vLLM, NVFP4 + quantization noise) that sampled the token;
    logp_old      the learner (torch, NVFP4 + LoRA) with the weights the batch was sampled
                  with, i.e. before this batch's updates; detached;
    logp_new      the learner now, with grad.
  With `epochs == 1` and one optimizer step per rollout batch, logp_old == logp_new.detach(),
  and policy_loss accepts `logp_old=None` for exactly that case.
* The reference policy for the KL term is the base model with the LoRA adapter disabled.
* The per-token objective (a loss, so minimized) is

      L_t = - w_t * min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A) + beta * k3_t
      r_t = exp(logp_new - logp_old)                          PPO ratio (grad flows here)
      w_t = min(exp(logp_old - logp_rollout), C), detached    truncated importance sampling
      k3_t = exp(ref - logp_new) - (ref - logp_new) - 1       KL(pi_theta || pi_ref), k3

  TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
  training"; verl's rollout correction) corrects for the engine/learner mismatch: the
  samples come from the engine, the surrogate is the learner's. The weight multiplies the
  surrogate only, not the KL term (the KL term is an on-learner regularizer, as in verl).
* Aggregation ("sequence" / "token") is defined in `ObjectiveConfig`; the denominator is the
  whole optimizer batch (see `loss_normalizer`), so micro-batch accumulation reproduces the
  full-batch loss and gradient exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch
from torch import Tensor

LOSS_TYPES = ("grpo", "dapo")
AGGREGATIONS = ("sequence", "token")

# Defaults that depend on loss_type; an explicit value in the constructor always wins.
_PRESETS: dict[str, dict] = {
    "grpo": dict(aggregation="sequence", clip_eps_high=0.2, dynamic_sampling=False,
                 mask_truncated=False),
    "dapo": dict(aggregation="token", clip_eps_high=0.28, dynamic_sampling=True,
                 mask_truncated=True),
}

# |log-ratio| is clamped to this before exp() (exp(20) ~ 4.9e8): a finite ratio for wildly
# off tokens, which are clipped anyway whenever the advantage sign makes clipping apply.
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class ObjectiveConfig:
    """How the train stage turns rewards and log-probabilities into a loss.

    Fields left at None take the `loss_type`'s default (the table below); `preset(name)` is
    the same as `ObjectiveConfig(loss_type=name)`.

                          grpo       dapo
        aggregation       sequence   token
        clip_eps_high     0.2        0.28   (DAPO "clip-higher")
        dynamic_sampling  False      True
        mask_truncated    False      True   (DAPO "overlong filtering")

    Attributes:
        loss_type: "grpo" | "dapo". Names the recipe; it only selects the defaults above,
            the computation is fully determined by the other fields.
        aggregation: "sequence": mean over each sequence's own tokens, then mean over
            sequences (GRPO / DeepSeekMath). "token": sum over all tokens of the batch divided
            by the batch's total token count (DAPO), so long completions weigh more.
        clip_eps_low: lower clip range, ratio is clipped below at 1 - clip_eps_low; in [0, 1).
        clip_eps_high: upper clip range, ratio is clipped above at 1 + clip_eps_high; >= 0.
        kl_beta: weight of the k3 KL to the reference policy (base, adapter disabled); 0 turns
            the term off and `logp_ref` is then not needed.
        adv_eps: epsilon in the advantage denominator (std_G + adv_eps); > 0.
        scale_rewards: divide the group-centred reward by the group std (GRPO). False keeps
            r - mean_G only (Dr. GRPO).
        dynamic_sampling: groups whose rewards all tie (zero advantage, no signal) are dropped:
            keep_mask is False for their rows and the caller removes them from the batch.
        mask_truncated: completions that hit max_tokens (finish_reason "length") contribute
            no loss and are not counted in the normalizer.
        tis_cap: cap C of the truncated importance weight min(exp(logp_old - logp_rollout), C);
            >= 1. None disables the rollout correction (weight 1 everywhere).
        epochs: mu, the number of passes (update epochs) over one rollout batch; >= 1.
        micro_batch_tokens: padded-token budget (max_len x rows) of one forward/backward
            micro-batch, see `micro_batches`; >= 1.
    """

    loss_type: str = "grpo"
    aggregation: str | None = None
    clip_eps_low: float = 0.2
    clip_eps_high: float | None = None
    kl_beta: float = 0.0
    adv_eps: float = 1e-6
    scale_rewards: bool = True
    dynamic_sampling: bool | None = None
    mask_truncated: bool | None = None
    tis_cap: float | None = 2.0
    epochs: int = 1
    micro_batch_tokens: int = 4096

    @classmethod
    def preset(cls, name: str, **overrides) -> "ObjectiveConfig":
        """The `name` recipe's defaults ("grpo" or "dapo"), with `overrides` on top."""
        return cls(loss_type=name, **overrides)

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        for key, value in _PRESETS[self.loss_type].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)

        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        for name in ("scale_rewards", "dynamic_sampling", "mask_truncated"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

        def number(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
            object.__setattr__(self, name, float(v))
            return float(v)

        if not 0.0 <= number("clip_eps_low") < 1.0:
            raise ValueError(f"clip_eps_low must be in [0, 1), got {self.clip_eps_low}")
        if number("clip_eps_high") < 0.0:
            raise ValueError(f"clip_eps_high must be >= 0, got {self.clip_eps_high}")
        if number("kl_beta") < 0.0:
            raise ValueError(f"kl_beta must be >= 0, got {self.kl_beta}")
        if number("adv_eps") <= 0.0:
            raise ValueError(f"adv_eps must be > 0, got {self.adv_eps}")
        if self.tis_cap is not None and number("tis_cap") < 1.0:
            raise ValueError(
                f"tis_cap must be >= 1 (a cap below 1 down-weights even on-policy tokens) "
                f"or None to disable the rollout correction, got {self.tis_cap}")
        for name in ("epochs", "micro_batch_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")


# ----------------------------------------------------------------------------- advantages

def group_advantages(rewards: Tensor, group_ids: Tensor | Sequence[Hashable],
                     cfg: ObjectiveConfig) -> tuple[Tensor, Tensor, dict]:
    """Group-relative advantages, one per completion.

    A_i = (r_i - mean_G) / (std_G + adv_eps), or r_i - mean_G when `scale_rewards` is False,
    where G is the set of completions sharing i's group id (the prompt). Groups may have any
    size and need not be contiguous; making them complete is the caller's business.

    std_G is the SAMPLE standard deviation (Bessel, divisor |G| - 1): the convention of TRL's
    GRPOTrainer (`rewards.view(-1, G).std(dim=1)`, torch's default unbiased=True) and of verl's
    GRPO advantage (`torch.std`), so advantages match those reference implementations. For
    0/1 rewards with G = 8 it is sqrt(8/7) ~ 1.07 times the population std.

    A group whose rewards all tie (exactly equal, including any group of size 1, whose sample
    std is undefined) carries no signal: its advantages are exactly 0, and with
    `dynamic_sampling` its rows get keep_mask False (DAPO drops such groups; this function
    does not resample, the batch just gets smaller).

    Args:
        rewards: [N] finite rewards.
        group_ids: [N] group key per completion: an integer tensor or a sequence of hashables
            (e.g. prompt_id strings).

    Returns:
        advantages [N] (rewards' dtype if floating, else float32), keep_mask [N] bool, and
        stats: num_groups, tied_groups, dropped_groups, dropped_group_fraction,
        kept_sequences, reward_mean, reward_std (population, over the whole batch).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    n = rewards.shape[0]
    keys = group_ids.tolist() if isinstance(group_ids, Tensor) else list(group_ids)
    if len(keys) != n:
        raise ValueError(f"group_ids has {len(keys)} entries for {n} rewards")
    r = rewards.detach().to(torch.float64)
    if not torch.isfinite(r).all():
        raise ValueError("rewards must be finite")

    index: dict[Hashable, int] = {}
    gid = torch.tensor([index.setdefault(k, len(index)) for k in keys], dtype=torch.long,
                       device=r.device)
    n_groups = len(index)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    if n == 0:
        stats = dict(num_groups=0, tied_groups=0, dropped_groups=0, dropped_group_fraction=0.0,
                     kept_sequences=0, reward_mean=0.0, reward_std=0.0)
        return (torch.zeros(0, dtype=out_dtype, device=rewards.device),
                torch.zeros(0, dtype=torch.bool, device=rewards.device), stats)

    count = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(
        0, gid, torch.ones_like(r))
    mean = torch.zeros_like(count).index_add_(0, gid, r) / count
    centred = r - mean[gid]
    ssd = torch.zeros_like(count).index_add_(0, gid, centred * centred)
    std = torch.sqrt(ssd / (count - 1).clamp(min=1))
    hi = torch.full_like(count, -math.inf).scatter_reduce_(0, gid, r, "amax")
    lo = torch.full_like(count, math.inf).scatter_reduce_(0, gid, r, "amin")
    tied = hi == lo                                   # includes every group of size 1

    adv = centred / (std[gid] + cfg.adv_eps) if cfg.scale_rewards else centred
    adv = torch.where(tied[gid], torch.zeros_like(adv), adv)
    if cfg.dynamic_sampling:
        keep = ~tied[gid]
        dropped = int(tied.sum())
    else:
        keep = torch.ones(n, dtype=torch.bool, device=r.device)
        dropped = 0
    stats = dict(
        num_groups=n_groups,
        tied_groups=int(tied.sum()),
        dropped_groups=dropped,
        dropped_group_fraction=dropped / n_groups,
        kept_sequences=int(keep.sum()),
        reward_mean=float(r.mean()),
        reward_std=float(r.std(unbiased=False)),
    )
    return adv.to(out_dtype).to(rewards.device), keep.to(rewards.device), stats


# ----------------------------------------------------------------------------- batching

def micro_batches(lengths: Sequence[int], token_budget: int, *,
                  sort_by_length: bool = False) -> list[list[int]]:
    """Pack sequence indices into micro-batches of padded size (max_len x rows) <= budget.

    Greedy and deterministic: indices are visited in the given order (or, with
    `sort_by_length`, by length descending, ties by index: less padding), and a new
    micro-batch starts whenever adding the next sequence would exceed the budget. A sequence
    longer than the budget on its own gets a micro-batch of its own.

    Gradient accumulation over the result must divide every micro-batch's loss by the WHOLE
    batch's normalizer, not the micro-batch's own: compute `loss_normalizer` once on the
    full batch and pass it as `policy_loss(..., normalizer=...)`; then the sum of the
    micro-batch losses (and of their gradients) equals the full-batch loss (and gradient)
    exactly, for both aggregations. A per-micro-batch mean would instead weight tokens by
    1 / (their micro-batch's size).
    """
    if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 1:
        raise ValueError(f"token_budget must be an int >= 1, got {token_budget!r}")
    lengths = list(lengths)
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"lengths[{i}] must be an int >= 0, got {n!r}")
    order = range(len(lengths))
    if sort_by_length:
        order = sorted(order, key=lambda i: (-lengths[i], i))

    batches: list[list[int]] = []
    current: list[int] = []
    current_max = 0
    for i in order:
        new_max = max(current_max, lengths[i])
        if current and new_max * (len(current) + 1) > token_budget:
            batches.append(current)
            current, new_max = [], lengths[i]
        current.append(i)
        current_max = new_max
    if current:
        batches.append(current)
    return batches


def _loss_mask(mask: Tensor, cfg: ObjectiveConfig, truncated: Tensor | None) -> Tensor:
    mask = mask.to(torch.bool)
    if cfg.mask_truncated and truncated is not None:
        truncated = torch.as_tensor(truncated, dtype=torch.bool, device=mask.device)
        if truncated.shape != mask.shape[:1]:
            raise ValueError(f"truncated must be [B]={tuple(mask.shape[:1])}, "
                             f"got {tuple(truncated.shape)}")
        mask = mask & ~truncated[:, None]
    return mask


def loss_normalizer(mask: Tensor | Sequence[int], cfg: ObjectiveConfig,
                    truncated: Tensor | Sequence[bool] | None = None) -> float:
    """The denominator of the loss over one optimizer batch (all its micro-batches).

    "token" aggregation: the number of loss tokens. "sequence" aggregation: the number of
    sequences with at least one loss token (a sequence masked out entirely, e.g. truncated
    under `mask_truncated`, neither contributes nor counts). Truncated completions count
    only when `cfg.mask_truncated` is False.

    Args:
        mask: the whole batch's [B, T] mask, or its [B] per-sequence token counts (handy when
            micro-batches are padded separately and no [B, T] tensor exists).
        truncated: [B] bool, True where the completion hit max_tokens.

    Returns 0.0 for an empty batch; policy_loss rejects an explicit normalizer of 0.
    """
    m = torch.as_tensor(mask)
    if m.dim() == 2:
        counts = m.to(torch.bool).sum(dim=1)
    elif m.dim() == 1:
        counts = m.to(torch.long)
        if (counts < 0).any():
            raise ValueError("per-sequence token counts must be >= 0")
    else:
        raise ValueError(f"mask must be [B, T] or [B] token counts, got shape {tuple(m.shape)}")
    if cfg.mask_truncated and truncated is not None:
        truncated = torch.as_tensor(truncated, dtype=torch.bool, device=counts.device)
        if truncated.shape != counts.shape:
            raise ValueError(f"truncated must be [B]={tuple(counts.shape)}, "
                             f"got {tuple(truncated.shape)}")
        counts = torch.where(truncated, torch.zeros_like(counts), counts)
    if cfg.aggregation == "token":
        return float(counts.sum())
    return float((counts > 0).sum())


# ----------------------------------------------------------------------------- the loss

def _k3(log_r: Tensor) -> Tensor:
    """k3 KL estimator exp(d) - d - 1 with d = log(p/q), samples from q: >= 0, unbiased."""
    return torch.expm1(log_r) - log_r


def policy_loss(logp_new: Tensor, logp_old: Tensor | None, logp_rollout: Tensor | None,
                advantages: Tensor, mask: Tensor, cfg: ObjectiveConfig,
                logp_ref: Tensor | None = None, *, truncated: Tensor | None = None,
                normalizer: float | Tensor | None = None) -> tuple[Tensor, dict]:
    """Clipped, TIS-weighted policy-gradient loss (with optional k3 KL) of one (micro-)batch.

    Per token (module docstring): L_t = -w_t * min(r_t A, clip(r_t) A) + beta * k3_t, then
    aggregated per `cfg.aggregation`:
        token:    sum_{b,t} m_bt L_bt / normalizer                  (normalizer = tokens)
        sequence: sum_b [sum_t m_bt L_bt / sum_t m_bt] / normalizer (normalizer = sequences)
    where m is `mask` with truncated rows removed when `cfg.mask_truncated`.

    Args:
        logp_new: [B, T] learner log-probs of the sampled tokens, with grad.
        logp_old: [B, T] learner log-probs before this batch's updates (detached here), or
            None for logp_new.detach() (the on-policy first pass).
        logp_rollout: [B, T] engine log-probs of the same tokens; required unless
            cfg.tis_cap is None (then ignored except for the mismatch metrics).
        advantages: [B] per-sequence advantage (broadcast over its tokens), detached here.
        mask: [B, T] bool/0-1, real completion tokens.
        logp_ref: [B, T] reference log-probs (adapter disabled); required if cfg.kl_beta > 0.
        truncated: [B] bool, completion hit max_tokens; used only with cfg.mask_truncated.
        normalizer: the whole optimizer batch's `loss_normalizer`, for micro-batch
            accumulation; None uses this batch's own (then this is the full-batch loss).

    Returns:
        loss: scalar float32 tensor with grad.
        metrics: detached 0-dim float32 tensors, means over this batch's loss tokens
            (num_tokens, num_sequences are counts; weight by num_tokens to combine
            micro-batches): clip_fraction (tokens whose clipped branch is the active one,
            i.e. zero gradient: A > 0 and r > 1 + eps_high, or A < 0 and r < 1 - eps_low),
            clip_fraction_low, clip_fraction_high, ratio_mean, approx_kl (k3 of KL(old||new),
            d = logp_new - logp_old), and when logp_rollout is given: rollout_logp_abs_diff
            (mean |logp_old - logp_rollout|), rollout_kl (k3 of KL(rollout||learner),
            d = logp_old - logp_rollout), and, when TIS is on, tis_weight_mean (after the cap)
            and tis_capped_fraction (raw weight > C); with logp_ref: ref_kl (k3 mean).
    """
    if logp_new.dim() != 2:
        raise ValueError(f"logp_new must be [B, T], got shape {tuple(logp_new.shape)}")
    shape = logp_new.shape
    for name, t in (("logp_old", logp_old), ("logp_rollout", logp_rollout),
                    ("logp_ref", logp_ref), ("mask", mask)):
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} must have logp_new's shape {tuple(shape)}, "
                             f"got {tuple(t.shape)}")
    if advantages.shape != shape[:1]:
        raise ValueError(f"advantages must be [B]={tuple(shape[:1])}, "
                         f"got {tuple(advantages.shape)}")
    if cfg.tis_cap is not None and logp_rollout is None:
        raise ValueError("logp_rollout is required when cfg.tis_cap is set "
                         "(set tis_cap=None to train without the rollout correction)")
    if cfg.kl_beta > 0 and logp_ref is None:
        raise ValueError("logp_ref is required when cfg.kl_beta > 0")

    m = _loss_mask(mask, cfg, truncated)
    mf = m.to(torch.float32)
    if normalizer is None:
        normalizer = loss_normalizer(m, cfg)
        denom = max(normalizer, 1.0)                 # an all-masked batch: loss 0, not NaN
    else:
        denom = torch.as_tensor(normalizer, dtype=torch.float32, device=logp_new.device)
        if not bool(denom > 0):
            raise ValueError(f"normalizer must be > 0, got {float(denom)}")

    zero = torch.zeros((), dtype=torch.float32, device=logp_new.device)
    new = logp_new.to(torch.float32)
    old = new.detach() if logp_old is None else logp_old.detach().to(torch.float32)
    adv = advantages.detach().to(torch.float32)[:, None]

    # Masked positions are replaced BEFORE any exp(), so garbage there reaches neither the
    # value nor the gradient.
    log_ratio = torch.where(m, new - old, zero).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    lo, hi = 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high
    surr_unclipped = ratio * adv
    surr_clipped = ratio.clamp(lo, hi) * adv
    surrogate = torch.minimum(surr_unclipped, surr_clipped)

    metrics: dict[str, Tensor] = {}
    if logp_rollout is not None:
        d_roll = torch.where(m, old - logp_rollout.detach().to(torch.float32), zero)
        if cfg.tis_cap is not None:
            raw_w = torch.exp(d_roll.clamp(max=_MAX_LOG_RATIO))
            weight = raw_w.clamp(max=cfg.tis_cap)
            surrogate = surrogate * weight
            metrics["tis_weight_mean"] = weight
            metrics["tis_capped_fraction"] = (raw_w > cfg.tis_cap).float()
        metrics["rollout_logp_abs_diff"] = d_roll.abs()
        metrics["rollout_kl"] = _k3(d_roll.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))

    per_token = -surrogate
    if logp_ref is not None:
        d_ref = torch.where(m, logp_ref.detach().to(torch.float32) - new, zero)
        k3_ref = _k3(d_ref.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        if cfg.kl_beta > 0:
            per_token = per_token + cfg.kl_beta * k3_ref
        metrics["ref_kl"] = k3_ref

    per_token = torch.where(m, per_token, zero)
    if cfg.aggregation == "token":
        loss = per_token.sum() / denom
    else:
        seq_len = mf.sum(dim=1)
        loss = (per_token.sum(dim=1) / seq_len.clamp(min=1.0)).sum() / denom

    # Metrics: token means over this batch's loss tokens, all detached.
    with torch.no_grad():
        n_tok = mf.sum()
        def tmean(x: Tensor) -> Tensor:
            return (x.detach() * mf).sum() / n_tok.clamp(min=1.0)
        clip_low = (adv < 0) & (ratio < lo)
        clip_high = (adv > 0) & (ratio > hi)
        out = {
            "num_tokens": n_tok,
            "num_sequences": (mf.sum(dim=1) > 0).float().sum(),
            "clip_fraction": tmean((clip_low | clip_high).float()),
            "clip_fraction_low": tmean(clip_low.float()),
            "clip_fraction_high": tmean(clip_high.float()),
            "ratio_mean": tmean(ratio),
            "approx_kl": tmean(_k3(log_ratio)),
        }
        out.update({k: tmean(v) for k, v in metrics.items()})
    return loss, out


# ----------------------------------------------------------------------------- entropy

@torch.no_grad()
def token_entropy(logits: Tensor, mask: Tensor, *, max_chunk_elements: int = 1 << 24) -> Tensor:
    """Mean entropy (nats) of the next-token distribution over the masked tokens (a metric).

    H_t = logsumexp(z_t) - sum_v softmax(z_t)_v z_tv, computed in float32 over chunks of the
    T axis sized so that one chunk's [B, chunk, V] float32 temporaries stay within
    `max_chunk_elements` elements (2^24 = 64 MiB each by default), never a full [B, T, V]
    float32 copy of bf16 logits. No gradient. Returns 0 when nothing is masked in.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    b, t, v = logits.shape
    if mask.shape != (b, t):
        raise ValueError(f"mask must be [B, T]={(b, t)}, got {tuple(mask.shape)}")
    if max_chunk_elements < 1:
        raise ValueError(f"max_chunk_elements must be >= 1, got {max_chunk_elements}")
    m = mask.to(torch.bool)
    chunk = max(1, max_chunk_elements // max(1, b * v))
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for s in range(0, t, chunk):
        z = logits[:, s:s + chunk].float()
        lse = torch.logsumexp(z, dim=-1)
        p = torch.exp(z - lse[..., None])
        h = lse - (p * z).sum(dim=-1)
        total += torch.where(m[:, s:s + chunk], h, torch.zeros_like(h)).sum()
    return total / m.sum().clamp(min=1).to(torch.float32)


# ----------------------------------------------------------------------------- schedule

def lr_lambda(step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> float:
    """LR multiplier: linear warm-up, then cosine decay to `min_ratio`.

        step < warmup_steps:  (step + 1) / warmup_steps     (the first step already learns)
        otherwise:            min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2,
                              p = min(1, (step - warmup_steps) / (total_steps - warmup_steps))

    `step` is LambdaLR's count of scheduler.step() calls (0 for the first optimizer step).
    Use as `LambdaLR(opt, functools.partial(lr_lambda, warmup_steps=W, total_steps=N))`.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if warmup_steps < 0 or total_steps < 1 or warmup_steps > total_steps:
        raise ValueError(f"need 0 <= warmup_steps <= total_steps and total_steps >= 1, got "
                         f"warmup_steps={warmup_steps}, total_steps={total_steps}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    p = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))
