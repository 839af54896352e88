"""The train stage's objective (components/train/objective.py) on hand-computed tiny cases.

Every expected number is written out, with the arithmetic that produces it in a comment;
nothing is checked against a second call of the code under test.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch

from components.train.objective import (
    ObjectiveConfig, group_advantages, loss_normalizer, lr_lambda, micro_batches, policy_loss,
    token_entropy,
)

torch.set_num_threads(1)

LN2, LN3 = math.log(2.0), math.log(3.0)


def approx(x, rel=1e-5, abs=1e-6):
    return pytest.approx(x, rel=rel, abs=abs)


def cfg(loss_type="grpo", **kw):
    """Most loss tests switch TIS and the KL off unless they are about them."""
    kw.setdefault("tis_cap", None)
    return ObjectiveConfig.preset(loss_type, **kw)


# ----------------------------------------------------------------------------- config

def test_presets_fill_defaults_and_explicit_values_win():
    g = ObjectiveConfig()
    assert (g.loss_type, g.aggregation, g.clip_eps_low, g.clip_eps_high) == ("grpo", "sequence", 0.2, 0.2)
    assert (g.dynamic_sampling, g.mask_truncated, g.scale_rewards) == (False, False, True)
    assert (g.kl_beta, g.adv_eps, g.tis_cap, g.epochs, g.micro_batch_tokens) == (0.0, 1e-6, 2.0, 1, 4096)
    d = ObjectiveConfig.preset("dapo")
    assert (d.aggregation, d.clip_eps_high, d.dynamic_sampling, d.mask_truncated) == ("token", 0.28, True, True)
    assert d == ObjectiveConfig(loss_type="dapo")
    mixed = ObjectiveConfig.preset("dapo", aggregation="sequence", clip_eps_high=0.3)
    assert (mixed.aggregation, mixed.clip_eps_high, mixed.dynamic_sampling) == ("sequence", 0.3, True)
    assert isinstance(ObjectiveConfig(kl_beta=1).kl_beta, float)


@pytest.mark.parametrize("kw, words", [
    (dict(loss_type="ppo"), "loss_type"),
    (dict(aggregation="mean"), "aggregation"),
    (dict(clip_eps_low=1.0), "clip_eps_low"),
    (dict(clip_eps_low=-0.1), "clip_eps_low"),
    (dict(clip_eps_high=-0.01), "clip_eps_high"),
    (dict(clip_eps_high=float("nan")), "clip_eps_high"),
    (dict(kl_beta=-1.0), "kl_beta"),
    (dict(kl_beta="0.1"), "kl_beta"),
    (dict(adv_eps=0.0), "adv_eps"),
    (dict(scale_rewards=1), "scale_rewards"),
    (dict(dynamic_sampling="yes"), "dynamic_sampling"),
    (dict(mask_truncated=0), "mask_truncated"),
    (dict(tis_cap=0.5), "tis_cap"),
    (dict(tis_cap=float("inf")), "tis_cap"),
    (dict(epochs=0), "epochs"),
    (dict(epochs=1.0), "epochs"),
    (dict(micro_batch_tokens=0), "micro_batch_tokens"),
    (dict(micro_batch_tokens=True), "micro_batch_tokens"),
])
def test_config_validation(kw, words):
    with pytest.raises(ValueError, match=words):
        ObjectiveConfig(**kw)


# ----------------------------------------------------------------------------- advantages

# Groups, interleaved on purpose:
#   a: [1, 0, 0, 0]  mean .25, deviations [.75, -.25, -.25, -.25], sum sq = .5625 + 3*.0625 = .75,
#                    sample var = .75/3 = .25, std = .5
#   b: [2, 0]        mean 1, deviations [1, -1], sample var = 2/1, std = sqrt(2)
#   c: [1, 1, 1]     tie
#   d: [5]           size 1 -> tie
IDS = ["a", "b", "a", "c", "a", "c", "b", "a", "c", "d"]
REWARDS = torch.tensor([1., 2., 0., 1., 0., 1., 0., 0., 1., 5.])


def test_group_advantages_sample_std():
    adv, keep, stats = group_advantages(REWARDS, IDS, ObjectiveConfig(adv_eps=1e-6))
    a_hi, a_lo = 0.75 / (0.5 + 1e-6), -0.25 / (0.5 + 1e-6)       # 1.499997, -0.499999
    b = 1.0 / (math.sqrt(2.0) + 1e-6)                             # 0.707106
    expected = [a_hi, b, a_lo, 0.0, a_lo, 0.0, -b, a_lo, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert adv.dtype == torch.float32
    assert keep.all()
    assert stats["num_groups"] == 4 and stats["tied_groups"] == 2
    assert stats["dropped_groups"] == 0 and stats["dropped_group_fraction"] == 0.0
    assert stats["reward_mean"] == approx(1.1)                    # 11 / 10


def test_group_advantages_tensor_ids_equal_list_ids():
    ids = torch.tensor([0, 1, 0, 2, 0, 2, 1, 0, 2, 3])
    adv_t, _, _ = group_advantages(REWARDS, ids, ObjectiveConfig())
    adv_l, _, _ = group_advantages(REWARDS, IDS, ObjectiveConfig())
    assert torch.equal(adv_t, adv_l)


def test_group_advantages_scale_rewards_off_is_dr_grpo():
    adv, _, _ = group_advantages(REWARDS, IDS, ObjectiveConfig(scale_rewards=False))
    assert adv.tolist() == approx([.75, 1., -.25, 0., -.25, 0., -1., -.25, 0., 0.])


def test_dynamic_sampling_drops_tied_groups():
    adv, keep, stats = group_advantages(REWARDS, IDS, ObjectiveConfig(dynamic_sampling=True))
    assert keep.tolist() == [True, True, True, False, True, False, True, True, False, False]
    assert stats["dropped_groups"] == 2                            # c and d
    assert stats["dropped_group_fraction"] == 0.5                  # 2 of 4
    assert stats["kept_sequences"] == 6
    assert adv[~keep].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_tie_with_float_noise_gives_exact_zero():
    # mean of three 0.1s is not exactly 0.1 in float, (r - mean) / (0 + eps) would be noise.
    adv, keep, stats = group_advantages(torch.tensor([0.1, 0.1, 0.1]), [7, 7, 7],
                                        ObjectiveConfig(dynamic_sampling=True))
    assert adv.tolist() == [0.0, 0.0, 0.0] and not keep.any() and stats["dropped_groups"] == 1


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="entries"):
        group_advantages(torch.zeros(3), [0, 0], ObjectiveConfig())
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([0.0, float("nan")]), [0, 0], ObjectiveConfig())
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), [0, 0], ObjectiveConfig())


# ----------------------------------------------------------------------------- policy loss

def clip_case():
    """B=2, T=3.  seq 0: A=+1, 3 tokens, ratios [1.0, 1.5, 0.5]
                   seq 1: A=-2, 2 tokens, ratios [0.5, 1.5], position 2 is padding (NaN)."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.2, float("nan")]])
    ratios = torch.tensor([[1.0, 1.5, 0.5], [0.5, 1.5, 1.0]])
    new = (old + torch.log(ratios)).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -2.0])
    return new, old, adv, mask


# Per-token loss -min(r A, clip(r) A) with clip range [0.8, 1.2] (grpo):
#   seq 0 (A=+1): r=1.0 -> -1;  r=1.5 -> -min(1.5, 1.2) = -1.2 (HIGH clip active);  r=0.5 -> -min(.5, .8) = -.5
#   seq 1 (A=-2): r=0.5 -> -min(-1, -1.6) = 1.6 (LOW clip active);  r=1.5 -> -min(-3, -2.4) = 3.0
#   sums: seq 0 = -2.7 (mean -0.9), seq 1 = 4.6 (mean 2.3)
#   sequence: (-0.9 + 2.3) / 2 = 0.7          token: (-2.7 + 4.6) / 5 = 0.38
# With dapo's upper bound 1.28, seq 0's r=1.5 token gives -1.28: seq 0 sum = -2.78 (mean -0.926667)
#   sequence: (-0.926667 + 2.3) / 2 = 0.686667   token: (-2.78 + 4.6) / 5 = 0.364
@pytest.mark.parametrize("loss_type, aggregation, expected", [
    ("grpo", "sequence", 0.7),
    ("grpo", "token", 0.38),
    ("dapo", "sequence", (-2.78 / 3 + 2.3) / 2),
    ("dapo", "token", 0.364),
])
def test_clipped_surrogate_all_variants(loss_type, aggregation, expected):
    new, old, adv, mask = clip_case()
    loss, m = policy_loss(new, old, None, adv, mask, cfg(loss_type, aggregation=aggregation))
    assert loss.item() == approx(expected)
    assert m["clip_fraction"].item() == approx(2 / 5)              # one high, one low of 5 tokens
    assert m["clip_fraction_high"].item() == approx(1 / 5)
    assert m["clip_fraction_low"].item() == approx(1 / 5)
    assert m["num_tokens"].item() == 5 and m["num_sequences"].item() == 2
    # approx_kl: k3 = r - 1 - ln r per token: 0; .5 - ln1.5 = .094535; -.5 + ln2 = .193147;
    #            (seq 1) .193147; .094535  -> sum .575364 / 5 = .115073
    assert m["approx_kl"].item() == approx((2 * (0.5 - math.log(1.5)) + 2 * (LN2 - 0.5)) / 5)
    assert m["ratio_mean"].item() == approx((1 + 1.5 + 0.5 + 0.5 + 1.5) / 5)


def test_clipped_tokens_get_no_gradient():
    # token aggregation, N = 5: dL/dlogp_new = -A * r / 5 on unclipped tokens, 0 on clipped ones
    #   seq 0: -1*1/5 = -.2;  clipped -> 0;  -1*.5/5 = -.1     seq 1: clipped -> 0;  2*1.5/5 = .6;  pad 0
    new, old, adv, mask = clip_case()
    loss, _ = policy_loss(new, old, None, adv, mask, cfg("grpo", aggregation="token"))
    loss.backward()
    assert new.grad[0].tolist() == approx([-0.2, 0.0, -0.1])
    assert new.grad[1].tolist() == approx([0.0, 0.6, 0.0])


def test_logp_old_none_is_on_policy_gradient():
    # ratio 1 everywhere, nothing clipped; sequence aggregation: L = -(1/B) sum_b A_b * mean_t r
    #   dL/dlogp_bt = -A_b / (B * len_b):  seq 0: -1 / (2*3) = -.166667   seq 1: 2 / (2*2) = .5
    #   value: -(1*1 + (-2)*1) / 2 = 0.5
    new, _, adv, mask = clip_case()
    new = new.detach().nan_to_num(0.0).requires_grad_(True)
    loss, m = policy_loss(new, None, None, adv, mask, cfg("grpo"))
    assert loss.item() == approx(0.5)
    loss.backward()
    assert new.grad[0].tolist() == approx([-1 / 6] * 3)
    assert new.grad[1].tolist() == approx([0.5, 0.5, 0.0])
    assert m["clip_fraction"].item() == 0.0 and m["approx_kl"].item() == 0.0


def tis_case():
    """One sequence, A=+1, ratio 1, exp(logp_old - logp_rollout) = [1, 3, 0.5]."""
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    rollout = old - torch.tensor([[0.0, LN3, -LN2]])
    new = old.clone().requires_grad_(True)
    return new, old, rollout, torch.tensor([1.0]), torch.ones(1, 3, dtype=torch.bool)


def test_tis_weight_capped():
    # w = min([1, 3, .5], 2) = [1, 2, .5];  L = -(1 + 2 + .5) / 3 = -1.166667 (one sequence: both aggregations)
    new, old, rollout, adv, mask = tis_case()
    for agg in ("sequence", "token"):
        loss, m = policy_loss(new, old, rollout, adv, mask, cfg("grpo", aggregation=agg, tis_cap=2.0))
        assert loss.item() == approx(-3.5 / 3)
    assert m["tis_weight_mean"].item() == approx(3.5 / 3)
    assert m["tis_capped_fraction"].item() == approx(1 / 3)
    # |old - rollout| = [0, ln3, ln2]: mean (1.098612 + .693147) / 3 = .597253
    assert m["rollout_logp_abs_diff"].item() == approx((LN3 + LN2) / 3)
    # k3 with d = old - rollout: 0;  3 - ln3 - 1 = .901388;  .5 + ln2 - 1 = .193147  -> mean .364845
    assert m["rollout_kl"].item() == approx((2 - LN3 + LN2 - 0.5) / 3)
    # gradient: dL/dlogp_new_t = -w_t * r_t / 3 = [-1/3, -2/3, -1/6]: the weight is detached
    loss.backward()
    assert new.grad[0].tolist() == approx([-1 / 3, -2 / 3, -1 / 6])


def test_tis_with_clipping():
    # token 1 of the TIS case now has ratio 1.5: w * min(1.5, 1.2) = 2 * 1.2 = 2.4
    #   L = -(1 + 2.4 + .5) / 3 = -1.3
    new, old, rollout, adv, mask = tis_case()
    new = (old + torch.log(torch.tensor([[1.0, 1.5, 1.0]]))).requires_grad_(True)
    loss, m = policy_loss(new, old, rollout, adv, mask, cfg("grpo", tis_cap=2.0))
    assert loss.item() == approx(-3.9 / 3)
    assert m["clip_fraction"].item() == approx(1 / 3)


def test_tis_disabled_ignores_rollout():
    # tis_cap None: w = 1, L = -(1 + 1 + 1) / 3 = -1; mismatch metrics still reported
    new, old, rollout, adv, mask = tis_case()
    loss, m = policy_loss(new, old, rollout, adv, mask, cfg("grpo", tis_cap=None))
    assert loss.item() == approx(-1.0)
    assert "tis_weight_mean" not in m
    assert m["rollout_logp_abs_diff"].item() == approx((LN3 + LN2) / 3)


def test_tis_requires_rollout_logprobs():
    new, old, _, adv, mask = tis_case()
    with pytest.raises(ValueError, match="logp_rollout"):
        policy_loss(new, old, None, adv, mask, cfg("grpo", tis_cap=2.0))


def test_kl_term():
    # ref - logp_new = [0, ln2, -ln2]: k3 = exp(d) - d - 1 = [0, 2 - ln2 - 1, .5 + ln2 - 1] = [0, .306853, .193147]
    #   sum = 0.5 exactly; beta = 0.1, A = 0:  L = 0.1 * 0.5 / 3 = 0.0166667
    #   with A = +1 (ratio 1): L = -1 + 0.0166667 = -0.983333
    #   gradient of beta*k3/3 wrt logp: beta * (1 - exp(d)) / 3 = [0, .1*(1-2)/3, .1*(1-.5)/3] = [0, -.033333, .016667]
    lp = torch.tensor([[-1.0, -2.0, -3.0]])
    ref = lp + torch.tensor([[0.0, LN2, -LN2]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    c = cfg("grpo", kl_beta=0.1)
    new = lp.clone().requires_grad_(True)
    loss, m = policy_loss(new, lp, None, torch.tensor([0.0]), mask, c, logp_ref=ref)
    assert loss.item() == approx(0.1 * 0.5 / 3)
    assert m["ref_kl"].item() == approx(0.5 / 3)
    loss.backward()
    assert new.grad[0].tolist() == approx([0.0, -0.1 / 3, 0.05 / 3])
    loss, _ = policy_loss(lp.clone(), lp, None, torch.tensor([1.0]), mask, c, logp_ref=ref)
    assert loss.item() == approx(-1.0 + 0.1 * 0.5 / 3)
    with pytest.raises(ValueError, match="logp_ref"):
        policy_loss(lp, lp, None, torch.tensor([1.0]), mask, c)


def test_kl_not_weighted_by_tis():
    # A = 0 so only the KL term remains; TIS weights [1, 2, .5] must not touch it: L = .1 * .5 / 3
    lp = torch.tensor([[-1.0, -1.0, -1.0]])
    ref = lp + torch.tensor([[0.0, LN2, -LN2]])
    rollout = lp - torch.tensor([[0.0, LN3, -LN2]])
    loss, _ = policy_loss(lp.clone(), lp, rollout, torch.tensor([0.0]),
                          torch.ones(1, 3, dtype=torch.bool), cfg("grpo", kl_beta=0.1, tis_cap=2.0),
                          logp_ref=ref)
    assert loss.item() == approx(0.1 * 0.5 / 3)


def truncation_case():
    """seq 0: A=+1, 2 tokens; seq 1 (truncated): A=-1, 3 tokens; all ratios 1.
    Per-token loss: seq 0 -> -1 each, seq 1 -> +1 each."""
    lp = torch.full((2, 3), -1.0)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    return lp, torch.tensor([1.0, -1.0]), mask, torch.tensor([False, True])


@pytest.mark.parametrize("aggregation, mask_truncated, expected", [
    ("sequence", False, 0.0),     # (-1 + 1) / 2
    ("token", False, 0.2),        # (-2 + 3) / 5
    ("sequence", True, -1.0),     # seq 1 gone: -1 / 1
    ("token", True, -1.0),        # seq 1 gone: -2 / 2
])
def test_mask_truncated(aggregation, mask_truncated, expected):
    lp, adv, mask, trunc = truncation_case()
    c = cfg("grpo", aggregation=aggregation, mask_truncated=mask_truncated)
    loss, m = policy_loss(lp, lp, None, adv, mask, c, truncated=trunc)
    assert loss.item() == approx(expected)
    assert m["num_tokens"].item() == (2 if mask_truncated else 5)
    assert loss_normalizer(mask, c, trunc) == {("sequence", False): 2.0, ("token", False): 5.0,
                                                ("sequence", True): 1.0, ("token", True): 2.0}[
        (aggregation, mask_truncated)]
    assert loss_normalizer([2, 3], c, [False, True]) == loss_normalizer(mask, c, trunc)


def test_dynamic_sampling_end_to_end():
    # rewards: group a [1, 0] (sample std sqrt(.5/1) = .707107 -> A = +-.5/.707107 = +-.707106),
    #          group b [1, 1] (tie, dropped). Kept rows only, one token each, ratio 1:
    #   token loss = -(.707106 - .707106) / 2 = 0;  with ratios [1.1, 1.0]: -(1.1*.707106 - .707106) / 2 = -.0353553
    adv, keep, stats = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), ["a", "a", "b", "b"],
                                        ObjectiveConfig.preset("dapo"))
    assert keep.tolist() == [True, True, False, False] and stats["dropped_groups"] == 1
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert adv.tolist() == approx([a, -a, 0.0, 0.0])
    old = torch.tensor([[-1.0], [-1.0]])
    new = old + torch.log(torch.tensor([[1.1], [1.0]]))
    loss, _ = policy_loss(new, old, None, adv[keep], torch.ones(2, 1, dtype=torch.bool),
                          cfg("dapo"))
    assert loss.item() == approx(-(1.1 * a - a) / 2)


def test_garbage_in_padding_never_leaks():
    # NaN / -inf at masked positions (engine logprobs of padding) must not reach value or grad
    lp = torch.tensor([[-1.0, float("nan")], [-1.0, -1.0]])
    rollout = torch.tensor([[-1.0, float("-inf")], [-1.0, -1.0]])
    ref = torch.tensor([[-1.0, float("inf")], [-1.0, -1.0]])
    new = lp.clone().requires_grad_(True)
    mask = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    c = cfg("grpo", tis_cap=2.0, kl_beta=0.1)
    loss, m = policy_loss(new, lp, rollout, torch.tensor([1.0, -1.0]), mask, c, logp_ref=ref)
    # seq 0: -1 (one token), seq 1: +1 per token -> (-1 + 1) / 2 = 0
    assert loss.item() == approx(0.0)
    loss.backward()
    assert torch.isfinite(new.grad).all() and new.grad[0, 1].item() == 0.0
    assert all(torch.isfinite(v) for v in m.values())


def test_all_masked_batch_is_zero_not_nan():
    lp = torch.zeros(2, 2, requires_grad=True)
    loss, m = policy_loss(lp, None, None, torch.ones(2), torch.zeros(2, 2, dtype=torch.bool), cfg())
    assert loss.item() == 0.0 and m["clip_fraction"].item() == 0.0
    loss.backward()
    assert lp.grad.abs().sum().item() == 0.0


def test_policy_loss_shape_and_normalizer_errors():
    lp = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, lp, None, torch.zeros(3), mask, cfg())
    with pytest.raises(ValueError, match="logp_old"):
        policy_loss(lp, torch.zeros(2, 4), None, torch.zeros(2), mask, cfg())
    with pytest.raises(ValueError, match="normalizer"):
        policy_loss(lp, lp, None, torch.zeros(2), mask, cfg(), normalizer=0)


# ----------------------------------------------------------------------------- accumulation

@pytest.mark.parametrize("aggregation", ["sequence", "token"])
def test_micro_batch_accumulation_equals_full_batch(aggregation):
    """Sum over micro-batches (each trimmed to its own padded length, loss divided by the full
    batch's normalizer) reproduces the full-batch loss and the gradient of a tiny parameter."""
    torch.manual_seed(0)
    lengths = [3, 5, 2, 6, 1, 4]
    b, t = len(lengths), max(lengths)
    mask = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    x = torch.randn(b, t)
    old = (-torch.nn.functional.softplus(x * 0.7 + 0.1)).detach()
    rollout = old + 0.3 * torch.randn(b, t)
    ref = old + 0.2 * torch.randn(b, t)
    adv = torch.randn(b)
    trunc = torch.tensor([False, False, False, True, False, False])
    c = cfg("dapo", aggregation=aggregation, tis_cap=2.0, kl_beta=0.05, mask_truncated=True,
            clip_eps_low=0.1, clip_eps_high=0.1)

    def logp(w, rows, width):
        return -torch.nn.functional.softplus(x[rows, :width] * w[0] + w[1])

    w = torch.tensor([0.9, -0.2], requires_grad=True)          # off old=(0.7, 0.1): some clipping
    full, fm = policy_loss(logp(w, slice(None), t), old, rollout, adv, mask, c, logp_ref=ref,
                           truncated=trunc)
    (g_full,) = torch.autograd.grad(full, w)
    assert fm["clip_fraction"].item() > 0

    batches = micro_batches(lengths, 10)
    assert len(batches) > 2
    norm = loss_normalizer(mask, c, trunc)
    assert norm == ({"sequence": 5.0, "token": 15.0}[aggregation])   # 6 rows / 21 tokens minus row 3 (6)
    total = torch.zeros(())
    g_sum = torch.zeros(2)
    for rows in batches:
        width = max(lengths[i] for i in rows)
        r = torch.tensor(rows)
        loss, _ = policy_loss(logp(w, r, width), old[r, :width], rollout[r, :width], adv[r],
                              mask[r, :width], c, logp_ref=ref[r, :width], truncated=trunc[r],
                              normalizer=norm)
        (g,) = torch.autograd.grad(loss, w)
        total, g_sum = total + loss.detach(), g_sum + g
    assert total.item() == pytest.approx(full.item(), rel=1e-6, abs=1e-7)
    assert torch.allclose(g_sum, g_full, rtol=1e-5, atol=1e-7)
    assert g_full.abs().sum() > 0


def test_micro_batches_hand_packed():
    # budget 10: [0,1] -> 5*2 = 10 ok, +2 -> 5*3 = 15 no;  [2] +3 -> 8*2 = 16 no;  [3] (8 <= 10)
    #            +4 -> 8*2 = 16 no;  [4, 5] -> 1*2 = 2
    assert micro_batches([3, 5, 2, 8, 1, 1], 10) == [[0, 1], [2], [3], [4, 5]]
    # by length desc: 3(8) 1(5) 0(3) 2(2) 4(1) 5(1): [3] | [1, 0] 5*2 = 10 | [2, 4, 5] 2*3 = 6
    assert micro_batches([3, 5, 2, 8, 1, 1], 10, sort_by_length=True) == [[3], [1, 0], [2, 4, 5]]
    assert micro_batches([12, 2], 10) == [[0], [1]]                 # too long alone: own batch
    assert micro_batches([2, 12, 2], 10) == [[0], [1], [2]]
    assert micro_batches([], 10) == []
    assert micro_batches([4, 4, 4], 4096) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="token_budget"):
        micro_batches([1], 0)
    with pytest.raises(ValueError, match="lengths"):
        micro_batches([1, -1], 8)


# ----------------------------------------------------------------------------- entropy

def test_token_entropy_hand_values():
    # row 0: uniform over 4 -> ln 4 = 1.386294
    # row 1: logits [0, ln3, -inf, -inf] -> p = [.25, .75]: H = .25 ln4 + .75 ln(4/3) = .346574 + .215762 = .562335
    # row 2: masked out (would be ln 4)
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0],
                            [0.0, LN3, -1e9, -1e9],
                            [1.0, 1.0, 1.0, 1.0]]])
    mask = torch.tensor([[1, 1, 0]])
    h = token_entropy(logits, mask)
    assert h.item() == approx((math.log(4) + 0.25 * math.log(4) + 0.75 * math.log(4 / 3)) / 2)


def test_token_entropy_chunked_matches_direct():
    torch.manual_seed(1)
    logits = (3 * torch.randn(3, 7, 11)).to(torch.bfloat16)
    mask = torch.rand(3, 7) > 0.3
    z = logits.float()
    direct = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    expected = direct[mask].mean().item()
    for chunk_elems in (1, 33, 3 * 11 * 2, 1 << 24):                 # chunk = 1, 1, 2, all of T
        assert token_entropy(logits, mask, max_chunk_elements=chunk_elems).item() == approx(expected)
    assert token_entropy(logits, torch.zeros(3, 7, dtype=torch.bool)).item() == 0.0


# ----------------------------------------------------------------------------- schedule

def test_lr_lambda_key_steps():
    f = functools.partial(lr_lambda, warmup_steps=2, total_steps=10)
    assert f(0) == 0.5 and f(1) == 1.0 and f(2) == 1.0                # warm-up (step+1)/2, then peak
    assert f(4) == approx(0.5 * (1 + math.cos(math.pi / 4)))         # p = 2/8: .853553
    assert f(6) == approx(0.5)                                       # p = 4/8
    assert f(10) == approx(0.0, abs=1e-12) and f(12) == approx(0.0, abs=1e-12)
    assert lr_lambda(6, 2, 10, min_ratio=0.1) == approx(0.1 + 0.9 * 0.5)   # .55
    assert lr_lambda(50, 2, 10, min_ratio=0.1) == approx(0.1)
    assert lr_lambda(0, 0, 4) == 1.0 and lr_lambda(2, 0, 4) == approx(0.5)
    for bad in [dict(step=-1, warmup_steps=0, total_steps=1), dict(step=0, warmup_steps=5, total_steps=4),
                dict(step=0, warmup_steps=0, total_steps=0),
                dict(step=0, warmup_steps=0, total_steps=4, min_ratio=1.5)]:
        with pytest.raises(ValueError):
            lr_lambda(**bad)


def test_lr_lambda_drives_lambdalr():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1e-5)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, functools.partial(lr_lambda, warmup_steps=2, total_steps=10))
    seen = []
    for _ in range(7):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.5e-5, 1e-5, 1e-5, 1e-5 * 0.5 * (1 + math.cos(math.pi / 8)),
                                  1e-5 * 0.5 * (1 + math.cos(math.pi / 4)),
                                  1e-5 * 0.5 * (1 + math.cos(3 * math.pi / 8)), 0.5e-5], rel=1e-9)
