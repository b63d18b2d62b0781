"""Training math against values computed by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollmesh.algorithms import (
    AGG_MODES,
    aggregate,
    cispo_loss,
    compute_advantages,
    decoupled_ppo_loss,
    entropy_from_logits,
    gae_advantages,
    grpo_advantages,
    gspo_loss,
    kl_estimate,
    kl_in_reward,
    lr_lambda,
    overlong_penalty,
    policy_loss,
    ppo_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    shape_rewards,
    tis_loss,
    token_logprobs,
    value_loss,
)


def f32(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def close(actual, expected, atol=1e-5) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float32)
    torch.testing.assert_close(actual.float(), expected, atol=atol, rtol=1e-5)


def logp_for_ratio(old: torch.Tensor, ratios) -> torch.Tensor:
    """New log-probs whose ratio to `old` is `ratios`, as a leaf with gradient."""
    return (old + torch.log(torch.tensor(ratios))).detach().requires_grad_(True)


# ---------------------------------------------------------------- advantages


def test_grpo_group_stats_unbiased_std_and_degenerate_groups():
    rewards = f32(1.0, 0.0, 1.0, 1.0, 0.5, 0.5)
    group = torch.tensor([42, 42, 42, 7, 9, 9])  # arbitrary ids, not sorted
    mask = f32([1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 1], [0, 1, 1])
    adv = grpo_advantages(rewards, group, mask)
    # group 42: mean 2/3; unbiased var = ((1/3)^2 + (2/3)^2 + (1/3)^2) / 2 = 1/3, std = 0.57735
    # A = (1/3) / 0.57735 = 0.57735, (-2/3) / 0.57735 = -1.15470
    # group 7 has one sample, group 9 is all 0.5: both exactly 0
    close(adv, f32([0.57735, 0.57735, 0], [-1.15470, -1.15470, -1.15470], [0.57735, 0, 0],
                   [0, 0, 0], [0, 0, 0], [0, 0, 0]))
    mean_only = grpo_advantages(rewards, group, mask, std_normalize=False)
    close(mean_only[:3, 0], [1 / 3, -2 / 3, 1 / 3])


def test_grpo_equal_rewards_exactly_zero_without_eps():
    rewards = f32(0.1, 0.1, 0.1, 0.7)  # 0.1 * 3 / 3 != 0.1 in float32 arithmetic
    adv = grpo_advantages(rewards, torch.tensor([0, 0, 0, 1]), torch.ones(4, 3), eps=0.0)
    assert not adv.isnan().any()
    assert (adv == 0).all()


def test_rloo_leave_one_out():
    rewards = f32(1.0, 0.0, 0.5, 3.0)
    adv = rloo_advantages(rewards, torch.tensor([0, 0, 0, 1]), f32([1, 1], [1, 0], [1, 1], [1, 1]))
    # 1 - (0 + 0.5)/2 = 0.75; 0 - (1 + 0.5)/2 = -0.75; 0.5 - (1 + 0)/2 = 0; a lone sample: 0
    close(adv, f32([0.75, 0.75], [-0.75, 0], [0, 0], [0, 0]))


def test_reinforce_pp_discounted_return_then_batch_whitening():
    mask = f32([1, 1, 0], [1, 1, 1])
    adv = reinforce_pp_advantages(f32(1.0, 0.0), mask, gamma=0.5)
    # reward on each last masked token; returns: seq0 [0.5, 1], seq1 [0, 0, 0]
    # mean 1.5/5 = 0.3; unbiased var = (0.04 + 0.49 + 3 * 0.09) / 4 = 0.2, std 0.447214
    close(adv, f32([0.447214, 1.565248, 0], [-0.670820, -0.670820, -0.670820]))


def test_reinforce_pp_with_kl_penalty():
    mask = f32([1, 1, 0], [1, 1, 1])
    kl = f32([0.2, 0.4, 9.0], [0.1, 0.0, 0.0])
    adv = reinforce_pp_advantages(f32(1.0, 0.0), mask, kl, gamma=1.0, kl_coef=0.5)
    # token rewards: seq0 [-0.1, 1 - 0.2], seq1 [-0.05, 0, 0]
    # returns: seq0 [0.7, 0.8], seq1 [-0.05, 0, 0]; mean 0.29, unbiased var 0.178, std 0.421900
    close(adv, f32([0.971793, 1.208816, 0], [-0.805877, -0.687366, -0.687366]))


def test_gae_three_steps():
    adv, ret = gae_advantages(f32([0, 0, 1]), f32([0.5, 0.6, 0.7]), torch.ones(1, 3),
                              gamma=0.9, lam=0.8, whiten=False)
    # delta2 = 1 - 0.7 = 0.3                 A2 = 0.3
    # delta1 = 0.9*0.7 - 0.6 = 0.03          A1 = 0.03 + 0.72*0.3 = 0.246
    # delta0 = 0.9*0.6 - 0.5 = 0.04          A0 = 0.04 + 0.72*0.246 = 0.21712
    close(adv, f32([0.21712, 0.246, 0.3]))
    close(ret, f32([0.71712, 0.846, 1.0]))  # A + V


def test_gae_skips_unmasked_tokens_and_padding():
    rewards = f32([0, 0, 1], [0, 2, 0])
    values = f32([0.5, 9.0, 0.7], [1.0, 1.0, 5.0])
    mask = f32([1, 0, 1], [1, 1, 0])  # a tool token in the middle; padding at the end
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    # seq0: A2 = 0.3; t1 skipped; delta0 = 0.9*0.7 - 0.5 = 0.13, A0 = 0.13 + 0.72*0.3 = 0.346
    # seq1 (gamma 0.9, lam 0.8): A1 = 2 - 1 = 1; delta0 = 0.9*1 - 1 = -0.1, A0 = -0.1 + 0.72 = 0.62
    close(adv, f32([0.346, 0, 0.3], [0.62, 1.0, 0]))
    close(ret, f32([0.846, 0, 1.0], [1.62, 2.0, 0]))
    whitened, ret_w = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    picked = whitened[mask > 0]
    close(picked.mean(), 0.0)
    close(picked.std(), 1.0, atol=1e-4)
    close(ret_w, ret)  # returns are not whitened


@pytest.mark.parametrize("score", [0.1, 0.7, 0.3, 1 / 3])
def test_whitening_a_batch_without_signal_gives_zero_advantages(score):
    """Every masked return equal (all samples scored 0.1, gamma 1, no KL): no signal, so no
    update. float32, as the trainer runs it; the float32 mean of n copies of 0.1 is not 0.1, and
    dividing that residue by a std of ~0 used to give advantages of order 1 with random signs."""
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        mask = (torch.rand(16, 40, generator=gen) > 0.2).float()
        mask[3] = 0  # a fully masked row
        rewards = torch.full((16,), score, dtype=torch.float32)
        adv = reinforce_pp_advantages(rewards, mask)
        assert adv.dtype == torch.float32 and (adv == 0).all(), seed
        adv, _ = compute_advantages("reinforce_pp", rewards=rewards, mask=mask)
        assert (adv == 0).all(), seed
        # GAE with a constant critic and no reward, gamma = lam = 1: A_t = -V everywhere
        adv, ret = gae_advantages(torch.zeros(16, 40), torch.full((16, 40), score), mask)
        assert (adv == 0).all(), seed
        close(ret, torch.zeros(16, 40))


def test_whitening_a_nearly_constant_batch_stays_small():
    """Returns that differ by one rounding unit are scaled by at most 1/sqrt(eps), as verl's
    (x - mean) * rsqrt(var + eps): |A| <= spread / sqrt(eps), not spread / eps."""
    x = torch.full((4, 8), 0.7, dtype=torch.float32)
    x[0, 0] = torch.nextafter(torch.tensor(0.7), torch.tensor(1.0))
    spread = float(x.max() - x.min())
    adv, _ = gae_advantages(x, torch.zeros(4, 8), torch.ones(4, 8), whiten=True, lam=0.0)
    assert 0 < float(adv.abs().max()) <= spread / math.sqrt(1e-8)
    # and the peer's form on the same float32 input agrees
    mean, var = x.mean(), x.var()
    close(adv, (x - mean) * torch.rsqrt(var + 1e-8), atol=1e-7)


def test_compute_advantages_dispatch():
    rewards, group, mask = f32(1.0, 0.0, 2.0, 2.0), torch.tensor([0, 0, 1, 1]), torch.ones(4, 2)
    adv, ret = compute_advantages("grpo", rewards=rewards, group_index=group, mask=mask)
    close(adv, grpo_advantages(rewards, group, mask))
    assert ret is None
    adv, _ = compute_advantages("grpo_mean_only", rewards=rewards, group_index=group, mask=mask)
    close(adv[:, 0], [0.5, -0.5, 0, 0])
    adv, _ = compute_advantages("rloo", rewards=rewards, group_index=group, mask=mask)
    close(adv[:, 0], [1, -1, 0, 0])
    adv, _ = compute_advantages("reinforce_pp", rewards=rewards, mask=mask, gamma=0.5)
    close(adv, reinforce_pp_advantages(rewards, mask, gamma=0.5))
    # gae with sequence rewards: each goes on its last masked token
    adv, ret = compute_advantages("gae", rewards=f32(1.0), values=f32([0.5, 0.5, 0.0]),
                                  mask=f32([1, 1, 0]), whiten=False)
    close(adv, f32([0.5, 0.5, 0]))  # gamma = lam = 1: A = R - V
    close(ret, f32([1.0, 1.0, 0]))
    with pytest.raises(ValueError, match="expected one of"):
        compute_advantages("ppo", rewards=rewards, mask=mask)
    with pytest.raises(ValueError, match="group_index"):
        compute_advantages("grpo", rewards=rewards, mask=mask)


# ---------------------------------------------------------------- KL


def test_kl_estimators():
    logp, ref = f32(-1.0, -0.5, -2.0), f32(-1.5, -0.5, -1.5)  # log ratio 0.5, 0, -0.5
    close(kl_estimate(logp, ref, "k1"), [0.5, 0.0, -0.5])
    close(kl_estimate(logp, ref, "k2"), [0.125, 0.0, 0.125])
    # k3: e^-0.5 - 1 + 0.5 = 0.106531; e^0.5 - 1 - 0.5 = 0.148721
    close(kl_estimate(logp, ref, "k3"), [0.106531, 0.0, 0.148721])
    assert torch.isfinite(kl_estimate(f32(0.0), f32(-1e4), "k3")).all()
    with pytest.raises(ValueError, match="k1"):
        kl_estimate(logp, ref, "k4")


def verl_kl_penalty(logprob, ref_logprob, kind):
    """verl's kl_penalty / kl_penalty_forward (core_algos, v0.5+), re-implemented: k3 as
    exp(ref - logp) - (ref - logp) - 1 with the log ratio clamped to +-20 and the value to
    +-10; a name ending in "+" is k2 in gradient, the named estimator in value."""
    def forward(kind):
        if kind == "k2":
            return 0.5 * (logprob - ref_logprob).square()
        kl = (ref_logprob - logprob).clamp(-20, 20)
        return (kl.exp() - kl - 1).clamp(-10, 10)
    value = forward(kind.rstrip("+"))
    if not kind.endswith("+"):
        return value
    backward = 0.5 * (logprob - ref_logprob).square()
    return backward - backward.detach() + value.detach()


def test_kl_k3_plus_and_clamp_hand_values_and_verl():
    ref = torch.zeros(1, 4, dtype=torch.float64)
    x = [-1.0, -3.0, 0.5, 12.0]  # log ratio logp - ref
    # k3 = e^-x - 1 + x: e - 2 = 0.718282; e^3 - 4 = 16.085537; e^-0.5 - 0.5 = 0.106531;
    #      e^-12 + 11 = 11.000006.  d k3 / d logp = 1 - e^-x: -1.718282, -19.085537, 0.393469, 1
    k3_values = [0.718282, 16.085537, 0.106531, 11.000006]
    for estimator, clamp, value, grad in [
        ("k3", None, k3_values, [-1.718282, -19.085537, 0.393469, 1.0]),
        ("k3", 10.0, [0.718282, 10.0, 0.106531, 10.0], [-1.718282, 0, 0.393469, 0]),
        ("k3+", None, k3_values, x),  # k2's gradient: x
        ("k3+", 10.0, [0.718282, 10.0, 0.106531, 10.0], x),
    ]:
        logp = torch.tensor([x], dtype=torch.float64, requires_grad=True)
        got = kl_estimate(logp, ref, estimator, clamp=clamp)
        (g,) = torch.autograd.grad(got.sum(), logp)
        close(got.detach(), [value], atol=1e-5)
        close(g, [grad], atol=1e-5)
    # against verl's (clamp 10) on random log ratios up to e^+-6
    gen = torch.Generator().manual_seed(3)
    ref = torch.randn(6, 50, generator=gen, dtype=torch.float64)
    logp0 = ref + 4 * torch.randn(6, 50, generator=gen, dtype=torch.float64).clamp(-1.5, 1.5)
    for ours, theirs in [("k3", "k3"), ("k3+", "k3+")]:
        a = logp0.clone().requires_grad_(True)
        b = logp0.clone().requires_grad_(True)
        mine = kl_estimate(a, ref, ours, clamp=10.0)
        peer = verl_kl_penalty(b, ref, theirs)
        (ga,) = torch.autograd.grad(mine.sum(), a)
        (gb,) = torch.autograd.grad(peer.sum(), b)
        close(mine.detach(), peer.detach(), atol=1e-4)
        close(ga, gb, atol=1e-4)


def test_kl_in_reward():
    # the verl walkthrough's numbers: scores [0, 0, 1], kl [0.03, 0.02, 0.01], beta 0.1
    shaped = kl_in_reward(f32([0, 0, 1.0]), f32([0.03, 0.02, 0.01]), 0.1)
    close(shaped, f32([-0.003, -0.002, 0.999]))
    masked = kl_in_reward(f32([0, 1.0, 0]), f32([0.5, 0.5, 7.0]), 0.1, mask=f32([1, 1, 0]))
    close(masked, f32([-0.05, 0.95, 0]))


# ---------------------------------------------------------------- aggregation


VALUES = f32([1, 2, 3], [4, 5, 6], [7, 8, 9])
MASK = f32([1, 1, 0], [1, 0, 0], [0, 0, 0])  # the third sequence has no masked token


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2 non-empty sequences
        ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2
        ("seq-mean-token-sum-norm", 0.875),  # (3/4 + 4/4) / 2 with the constant 4
    ],
)
def test_aggregate_modes(mode, expected):
    close(aggregate(VALUES, MASK, mode, norm_tokens=4), expected)
    garbage = VALUES.clone()
    garbage[MASK == 0] = float("nan")
    close(aggregate(garbage, MASK, mode, norm_tokens=4), expected)  # masked positions never matter
    close(aggregate(VALUES, torch.zeros(3, 3), mode, norm_tokens=4), 0.0)  # empty batch: 0


def test_seq_mean_token_sum_norm_is_dr_grpo_and_needs_its_constant():
    """Dr. GRPO (Liu et al. 2025): mean over sequences of (token sum / L_max), in float64; the
    constant, not the padded width, so padding a batch wider does not change it."""
    gen = torch.Generator().manual_seed(7)
    values = torch.randn(5, 9, generator=gen, dtype=torch.float64)
    mask = (torch.rand(5, 9, generator=gen) > 0.3).double()
    mask[2] = 0
    per_seq = (values * mask).sum(1) / 16.0
    expected = per_seq[mask.sum(1) > 0].mean()
    close(aggregate(values, mask, "seq-mean-token-sum-norm", norm_tokens=16), float(expected))
    wider = torch.cat([values, torch.randn(5, 7, dtype=torch.float64)], 1)
    close(aggregate(wider, torch.cat([mask, torch.zeros(5, 7, dtype=torch.float64)], 1),
                    "seq-mean-token-sum-norm", norm_tokens=16), float(expected))
    with pytest.raises(ValueError, match="norm_tokens"):
        aggregate(values, mask, "seq-mean-token-sum-norm")


def test_aggregate_bool_mask_and_bad_mode():
    close(aggregate(VALUES, MASK.bool(), "token-mean"), 7 / 3)
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(VALUES, MASK, "sum")


@pytest.mark.parametrize("mode", AGG_MODES)
def test_global_normaliser_two_micro_batches_equal_one_batch(mode):
    values = f32([1, 2, 3], [4, 5, 6], [7, 8, 9], [-1, 0, 2]).requires_grad_(True)
    mask = f32([1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1])
    whole = aggregate(values, mask, mode, norm_tokens=5)
    (g_whole,) = torch.autograd.grad(whole, values)
    norm = {"global_tokens": mask.sum(), "global_seqs": (mask.sum(1) > 0).sum(), "norm_tokens": 5}
    parts = (aggregate(values[:2], mask[:2], mode, **norm)
             + aggregate(values[2:], mask[2:], mode, **norm))
    (g_parts,) = torch.autograd.grad(parts, values)
    close(parts, whole)
    close(g_parts, g_whole)
    # without the global normaliser the micro-batch means do not add up to the batch mean
    naive = (aggregate(values[:2], mask[:2], mode, norm_tokens=5)
             + aggregate(values[2:], mask[2:], mode, norm_tokens=5))
    assert not torch.allclose(naive, whole)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.lists(st.tuples(st.floats(-5, 5), st.booleans()), min_size=3, max_size=3),
             min_size=2, max_size=6),
    st.data(),
)
def test_global_normaliser_any_split(rows, data):
    values = torch.tensor([[v for v, _ in row] for row in rows])
    mask = torch.tensor([[float(m) for _, m in row] for row in rows])
    split = data.draw(st.integers(1, len(rows) - 1))
    norm = {
        "global_tokens": mask.sum().clamp(min=1),
        "global_seqs": (mask.sum(1) > 0).sum().clamp(min=1),
    }
    for mode in AGG_MODES:
        parts = (aggregate(values[:split], mask[:split], mode, norm_tokens=3, **norm)
                 + aggregate(values[split:], mask[split:], mode, norm_tokens=3, **norm))
        close(parts, aggregate(values, mask, mode, norm_tokens=3), atol=1e-4)


# ---------------------------------------------------------------- PPO


def test_ppo_clip_edges_asymmetric():
    old = torch.full((1, 7), -1.0)
    advantages = f32([1, 1, 1, -1, -1, -1, -2])
    ratios = [1.29, 1.31, 0.5, 0.79, 0.81, 1.5, 1.31]
    logp = logp_for_ratio(old, [ratios])
    loss, metrics = ppo_loss(logp, old, advantages, torch.ones(1, 7), clip_low=0.2, clip_high=0.3)
    # per token max(-A r, -A clip(r, 0.8, 1.3)):
    #   A=+1 r=1.29 inside:          -1.29
    #   A=+1 r=1.31 above 1.3:       max(-1.31, -1.3) = -1.3   clipped
    #   A=+1 r=0.5  below, A>0:      max(-0.5, -0.8)  = -0.5   (not clipped: pessimistic side)
    #   A=-1 r=0.79 below 0.8:       max(0.79, 0.8)   = 0.8    clipped
    #   A=-1 r=0.81 inside:          0.81
    #   A=-1 r=1.5  above, A<0:      max(1.5, 1.3)    = 1.5
    #   A=-2 r=1.31 above, A<0:      max(2.62, 2.6)   = 2.62
    # mean = (-1.29 - 1.3 - 0.5 + 0.8 + 0.81 + 1.5 + 2.62) / 7 = 2.64 / 7
    close(loss, 2.64 / 7)
    close(metrics["clip_frac"], 2 / 7)
    close(metrics["dual_clip_frac"], 0.0)
    close(metrics["ratio_max"], 1.5)
    close(metrics["ratio_mean"], sum(ratios) / 7)
    (grad,) = torch.autograd.grad(loss, logp)
    # d/dlogp of -A r = -A r; clipped tokens get exactly 0
    close(grad, f32([-1.29, 0, -0.5, 0, 0.81, 1.5, 2.62]) / 7)


def test_ppo_dual_clip_edge():
    old = torch.zeros(1, 4)
    advantages = f32([-1, -1, 1, -2])
    logp = logp_for_ratio(old, [[2.9, 3.1, 5.0, 3.5]])
    loss, metrics = ppo_loss(logp, old, advantages, torch.ones(1, 4), 0.2, 0.2, dual_clip=3.0)
    # A=-1 r=2.9: max(2.9, 1.2) = 2.9 < 3 -> 2.9
    # A=-1 r=3.1: 3.1 > 3*|A| = 3 -> 3.0 (dual clip)
    # A=+1 r=5:   max(-5, -1.2) = -1.2 (dual clip is for A < 0 only)
    # A=-2 r=3.5: min(7, 6) = 6 (dual clip)
    close(loss, (2.9 + 3.0 - 1.2 + 6.0) / 4)
    close(metrics["dual_clip_frac"], 0.5)
    close(metrics["clip_frac"], 0.25)
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad, f32([2.9, 0, 0, 0]) / 4)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_loss(logp, old, advantages, torch.ones(1, 4), dual_clip=0.9)


def test_ppo_masked_tokens_do_not_matter_and_approx_kl():
    old = f32([-1.0, -2.0, -1.0])
    logp = f32([-0.9, -2.0, 30.0])  # the masked token has a huge ratio
    advantages = f32([1.0, -1.0, 1e6])
    mask = f32([1, 1, 0])
    loss, metrics = ppo_loss(logp, old, advantages, mask)
    # r = e^0.1 = 1.105171 (inside 1.2): -1.105171; r = 1: +1; mean = -0.052585
    close(loss, (-1.105171 + 1.0) / 2)
    close(metrics["clip_frac"], 0.0)
    close(metrics["ratio_max"], 1.105171)
    # approx_kl = mean(r - 1 - log r) = (1.105171 - 1 - 0.1 + 0) / 2
    close(metrics["approx_kl"], 0.005171 / 2)
    # approx_kl_k1 = mean(-log r) = (-0.1 + 0) / 2, verl's ppo_kl
    close(metrics["approx_kl_k1"], -0.05)
    for value in metrics.values():
        assert value.dtype == torch.float32 and value.dim() == 0 and not value.requires_grad


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_ppo_aggregation_modes(mode):
    old = torch.zeros(2, 3)
    logp = torch.zeros(2, 3)  # ratio 1: per-token loss = -A
    advantages = f32([1, 2, 9], [3, 9, 9])
    mask = f32([1, 1, 0], [1, 0, 0])
    loss, _ = ppo_loss(logp, old, advantages, mask, agg=mode)
    # token-mean: -(1 + 2 + 3)/3; token-sum: -((1 + 2) + 3)/2; token-mean per seq: -(1.5 + 3)/2
    expected = {"token-mean": -2.0, "seq-mean-token-sum": -3.0, "seq-mean-token-mean": -2.25}
    close(loss, expected[mode])


def test_ppo_micro_batches_with_global_tokens_equal_one_batch():
    torch.manual_seed(0)
    old = torch.randn(4, 5)
    logp = (old + 0.3 * torch.randn(4, 5)).requires_grad_(True)
    advantages = torch.randn(4, 5)
    mask = (torch.rand(4, 5) > 0.3).float()
    whole, _ = ppo_loss(logp, old, advantages, mask)
    (g_whole,) = torch.autograd.grad(whole, logp)
    n = mask.sum()
    a, _ = ppo_loss(logp[:2], old[:2], advantages[:2], mask[:2], global_tokens=n)
    b, _ = ppo_loss(logp[2:], old[2:], advantages[2:], mask[2:], global_tokens=n)
    (g_parts,) = torch.autograd.grad(a + b, logp)
    close(a + b, whole)
    close(g_parts, g_whole)


def test_ppo_bf16_inputs_give_float32_loss():
    old = torch.zeros(1, 2, dtype=torch.bfloat16)
    logp = torch.zeros(1, 2, dtype=torch.bfloat16, requires_grad=True)
    loss, _ = ppo_loss(logp, old, f32([1.0, -0.5]), torch.ones(1, 2))
    assert loss.dtype == torch.float32
    close(loss, -0.25)
    loss.backward()
    assert logp.grad.dtype == torch.bfloat16


def test_ppo_step_lowers_loss_of_tiny_linear_policy():
    torch.manual_seed(0)
    batch, steps, features, vocab = 4, 3, 6, 5
    policy = torch.nn.Linear(features, vocab)
    x = torch.randn(batch, steps, features)
    tokens = torch.randint(0, vocab, (batch, steps))
    advantages = torch.randn(batch, 1).expand(batch, steps)
    mask = f32([1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0])
    with torch.no_grad():
        old = token_logprobs(policy(x), tokens)
    optimiser = torch.optim.SGD(policy.parameters(), lr=0.1)

    def loss_now():
        return ppo_loss(token_logprobs(policy(x), tokens), old, advantages, mask)[0]

    before = loss_now()
    optimiser.zero_grad()
    before.backward()
    optimiser.step()
    with torch.no_grad():
        after = loss_now()
    assert after < before - 1e-4


# ---------------------------------------------------------------- decoupled PPO and TIS


def test_decoupled_ppo_clips_around_proximal_weights_by_behaviour():
    prox = f32([-1.0, -1.0, -1.0, -1.0])
    behav = f32([-1.5, -0.8, -1.0, -1.1])  # w = e^0.5, e^-0.2, 1, e^0.1
    advantages = f32([1, 1, -1, -1])
    logp = logp_for_ratio(prox, [[1.1, 1.25, 0.75, 0.85]])  # ratio to prox, clip [0.8, 1.2]
    mask = torch.ones(1, 4)
    loss, metrics = decoupled_ppo_loss(logp, prox, behav, advantages, mask, 0.2, 0.2)
    # t0: r 1.1 inside (although r vs behaviour = 1.81):  e^0.5 * -1.1  = -1.813593
    # t1: r 1.25 above 1.2, A>0: clipped                  e^-0.2 * -1.2 = -0.982477
    # t2: r 0.75 below 0.8, A<0: clipped                  1 * 0.8       =  0.8
    # t3: r 0.85 inside                                   e^0.1 * 0.85  =  0.939395
    close(loss, (-1.813593 - 0.982477 + 0.8 + 0.939395) / 4)
    close(metrics["clip_frac"], 0.5)
    close(metrics["behaviour_weight_max"], math.exp(0.5))
    close(metrics["behaviour_capped_frac"], 0.0)
    (grad,) = torch.autograd.grad(loss, logp)
    # d/dlogp w * -A r = -w A r; clipped tokens 0; w carries no gradient
    close(grad, f32([-1.813593, 0, 0, 0.939395]) / 4)


def test_decoupled_ppo_behaviour_cap_truncates_or_masks():
    prox, behav = f32([-1.0, -1.0]), f32([-1.5, -1.1])  # w = 1.648721, 1.105171
    logp, advantages, mask = prox.clone(), f32([1.0, 1.0]), torch.ones(1, 2)  # ratio 1: l = -w
    loss, metrics = decoupled_ppo_loss(logp, prox, behav, advantages, mask, behaviour_cap=1.5)
    close(loss, (-1.5 - 1.105171) / 2)  # w = min(1.648721, 1.5)
    close(metrics["behaviour_capped_frac"], 0.5)
    close(metrics["behaviour_weight_max"], 1.648721)  # reported before the cap
    masked, _ = decoupled_ppo_loss(logp, prox, behav, advantages, mask, behaviour_cap=1.5,
                                   behaviour_cap_mode="mask")
    close(masked, (0.0 - 1.105171) / 2)  # the token leaves the sum, not the normaliser


def test_decoupled_ppo_equals_ppo_when_proximal_is_behaviour():
    torch.manual_seed(1)
    old = torch.randn(3, 4)
    logp, advantages, mask = old + 0.4 * torch.randn(3, 4), torch.randn(3, 4), torch.ones(3, 4)
    ppo, _ = ppo_loss(logp, old, advantages, mask, 0.2, 0.28, dual_clip=3.0)
    decoupled, _ = decoupled_ppo_loss(logp, old, old, advantages, mask, 0.2, 0.28, dual_clip=3.0)
    close(decoupled, ppo)


def test_tis_at_the_cap():
    old = f32([-1.0, -1.0, -1.0])
    behav = old - torch.log(f32([2.5, 1.5, 0.5]))  # exp(old - behav) = 2.5, 1.5, 0.5
    advantages = f32([1.0, -1.0, 2.0])
    mask = f32([1, 1, 1])
    logp = old.clone().requires_grad_(True)  # ratio 1
    loss, metrics = tis_loss(logp, old, behav, advantages, mask, tis_cap=2.0)
    # w = min(2.5, 2) = 2, 1.5, 0.5; PPO surrogate at r = 1: w * -A = -2, 1.5, -1
    close(loss, (-2.0 + 1.5 - 1.0) / 3)
    close(metrics["behaviour_capped_frac"], 1 / 3)
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad, f32([-2.0, 1.5, -1.0]) / 3)

    logp = f32([-0.5, -2.0, -1.0]).requires_grad_(True)
    loss, _ = tis_loss(logp, old, behav, advantages, mask, tis_cap=2.0, surrogate="pg")
    # -w A logp: -2*1*(-0.5) = 1; -1.5*(-1)*(-2) = -3; -0.5*2*(-1) = 1; mean -1/3
    close(loss, -1 / 3)
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad, f32([-2.0, 1.5, -1.0]) / 3)  # -w A / N


def test_policy_loss_dispatch():
    torch.manual_seed(2)
    old, behav = torch.randn(2, 3), torch.randn(2, 3)
    logp, advantages, mask = old + 0.1, torch.randn(2, 3), f32([1, 1, 0], [1, 1, 1])
    close(policy_loss("ppo", logp, old, advantages, mask, clip_high=0.28)[0],
          ppo_loss(logp, old, advantages, mask, 0.2, 0.28)[0])
    close(policy_loss("decoupled_ppo", logp, old, advantages, mask, behaviour_logprobs=behav,
                      behaviour_cap=2.0)[0],
          decoupled_ppo_loss(logp, old, behav, advantages, mask, behaviour_cap=2.0)[0])
    close(policy_loss("tis", logp, old, advantages, mask, behaviour_logprobs=behav, tis_cap=1.5,
                      agg="seq-mean-token-sum")[0],
          tis_loss(logp, old, behav, advantages, mask, 1.5, agg="seq-mean-token-sum")[0])
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        policy_loss("tis", logp, old, advantages, mask)
    with pytest.raises(ValueError, match="expected one of"):
        policy_loss("grpo", logp, old, advantages, mask)


# ---------------------------------------------------------------- GSPO and CISPO


def test_gspo_hand_values_sequence_clip_and_gradient():
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    lr = torch.tensor([[0.1, -0.3, 5.0], [0.3, 0.2, 0.1]], dtype=torch.float64)  # 5.0 masked
    logp = (old + lr).requires_grad_(True)
    mask = f32([1, 1, 0], [1, 1, 1])
    advantages = f32([1, 1, 1], [2, 2, 2])
    loss, metrics = gspo_loss(logp, old, advantages, mask, 0.2, 0.2, "seq-mean-token-mean")
    # s_0 = exp((0.1 - 0.3) / 2) = e^-0.1 = 0.904837, inside [0.8, 1.2]: l = -0.904837 per token
    # s_1 = exp(0.6 / 3) = e^0.2 = 1.221403 > 1.2 with A = 2: clipped, l = -2.4, no gradient
    # seq-mean-token-mean = (-0.904837 - 2.4) / 2
    close(loss, (-0.904837 - 2.4) / 2)
    close(metrics["clip_frac"], 3 / 5)  # the three tokens of sequence 1
    close(metrics["ratio_max"], 1.221403)
    (grad,) = torch.autograd.grad(loss, logp)
    # d/dlogp_t = -(1/2)(1/2) A s_0 for the two tokens of sequence 0; 0 for the clipped one
    close(grad, f32([-0.226209, -0.226209, 0], [0, 0, 0]))
    # which is the exact gradient of GSPO's sequence objective -(1/G) sum_i A_i s_i(theta)
    seq = logp.detach()[:1, :2].clone().requires_grad_(True)
    objective = -0.5 * 1.0 * torch.exp((seq - old[:1, :2]).mean())
    (exact,) = torch.autograd.grad(objective, seq)
    close(grad[:1, :2], exact)


def verl_gspo(old_log_prob, log_prob, advantages, response_mask, lo, hi, agg):
    """verl's compute_policy_loss_gspo (core_algos, v0.5), re-implemented in float64."""
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = response_mask.sum(-1).clamp(min=1)
    seq = (negative_approx_kl * response_mask).sum(-1) / seq_lengths
    log_ratio = log_prob - log_prob.detach() + seq.detach().unsqueeze(-1)
    ratio = log_ratio.clamp(max=10.0).exp()
    losses = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - lo, 1 + hi))
    if agg == "token-mean":
        return (losses * response_mask).sum() / response_mask.sum()
    return ((losses * response_mask).sum(-1) / response_mask.sum(-1)).mean()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gspo_matches_verl_formula(agg):
    gen = torch.Generator().manual_seed(11)
    for _ in range(5):
        old = -torch.rand(6, 12, generator=gen, dtype=torch.float64) * 3
        new = old + 1e-3 * torch.randn(6, 12, generator=gen, dtype=torch.float64)
        mask = (torch.rand(6, 12, generator=gen) > 0.25).double()
        mask[:, 0] = 1  # verl's seq-mean-token-mean has no guard for an empty row
        adv = torch.randn(6, 1, generator=gen, dtype=torch.float64).expand(6, 12) * mask
        a, b = new.clone().requires_grad_(True), new.clone().requires_grad_(True)
        mine, metrics = gspo_loss(a, old, adv, mask, 3e-4, 4e-4, agg)
        peer = verl_gspo(old, b, adv, mask, 3e-4, 4e-4, agg)
        (ga,) = torch.autograd.grad(mine, a)
        (gb,) = torch.autograd.grad(peer, b)
        close(mine.detach(), float(peer.detach()), atol=1e-6)
        close(ga, gb, atol=1e-6)
    assert 0 < float(metrics["clip_frac"]) < 1  # the 3e-4 / 4e-4 range binds for some


def test_cispo_hand_values_and_verl_formula():
    old = f32([-2.0, -2.0, -2.0])
    logp = f32([-1.5, -3.0, -1.0]).requires_grad_(True)
    advantages = f32([2.0, -3.0, 100.0])
    mask = f32([1, 1, 0])
    loss, metrics = cispo_loss(logp, old, advantages, mask, 0.2, 0.2)
    # r = e^0.5 = 1.648721 -> 1.2; e^-1 = 0.367879 -> 0.8; l = -sg(w) A logp:
    # -1.2 * 2 * -1.5 = 3.6; -0.8 * -3 * -3 = -7.2; token-mean -1.8
    close(loss, -1.8)
    close(metrics["clip_frac"], 1.0)
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad, f32([-1.2, 1.2, 0]))  # -w A / N: a clipped token keeps its gradient
    unbounded, _ = cispo_loss(logp, old, advantages, mask, clip_low=1.0, clip_high=0.2)
    close(unbounded, (3.6 - 0.367879 * 9) / 2)  # clip_low >= 1: no lower bound (MiniMax-M1)
    # verl's compute_policy_loss_cispo, re-implemented: -A * sg(clip(exp(clamp(lr, +-20)))) * logp
    gen = torch.Generator().manual_seed(5)
    old = -torch.rand(4, 9, generator=gen, dtype=torch.float64) * 4
    new = old + 0.5 * torch.randn(4, 9, generator=gen, dtype=torch.float64)
    adv = torch.randn(4, 9, generator=gen, dtype=torch.float64)
    mask = (torch.rand(4, 9, generator=gen) > 0.3).double()
    a, b = new.clone().requires_grad_(True), new.clone().requires_grad_(True)
    mine, _ = cispo_loss(a, old, adv, mask, 0.2, 0.28)
    ratio = (b - old).clamp(-20, 20).exp()
    peer_t = -adv * ratio.clamp(1 - 0.2, 1 + 0.28).detach() * b
    peer = (peer_t * mask).sum() / mask.sum()
    (ga,) = torch.autograd.grad(mine, a)
    (gb,) = torch.autograd.grad(peer, b)
    close(mine.detach(), float(peer.detach()), atol=1e-5)
    close(ga, gb, atol=1e-6)


def areal_decoupled_loss(logp, prox, behav, adv, mask, eps, cap):
    """AReaL's decoupled PPO actor loss with a behaviour weight cap, re-implemented: a token
    whose exp(prox - behav) is above the cap gets weight 0, the normaliser stays the mask."""
    ratio = (logp - prox).exp()
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps))
    weight = (prox - behav).exp()
    weight = torch.where(weight <= cap, weight, torch.zeros_like(weight))
    return (loss * weight * mask).sum() / mask.sum()


def test_behaviour_cap_mode_and_tis_surrogate_through_policy_loss():
    gen = torch.Generator().manual_seed(9)
    prox = -torch.rand(3, 7, generator=gen, dtype=torch.float64) * 3
    behav = prox + 0.6 * torch.randn(3, 7, generator=gen, dtype=torch.float64)
    logp = prox + 0.1 * torch.randn(3, 7, generator=gen, dtype=torch.float64)
    adv = torch.randn(3, 7, generator=gen, dtype=torch.float64)
    mask = (torch.rand(3, 7, generator=gen) > 0.2).double()
    masked, metrics = policy_loss("decoupled_ppo", logp, prox, adv, mask, behaviour_logprobs=behav,
                                  behaviour_cap=1.3, behaviour_cap_mode="mask")
    close(masked, float(areal_decoupled_loss(logp, prox, behav, adv, mask, 0.2, 1.3)))
    assert 0 < float(metrics["behaviour_capped_frac"]) < 1
    truncated, _ = policy_loss("decoupled_ppo", logp, prox, adv, mask, behaviour_logprobs=behav,
                               behaviour_cap=1.3)
    close(truncated, decoupled_ppo_loss(logp, prox, behav, adv, mask, behaviour_cap=1.3)[0])
    assert abs(float(masked) - float(truncated)) > 1e-3
    pg, _ = policy_loss("tis", logp, prox, adv, mask, behaviour_logprobs=behav, tis_cap=1.5,
                        tis_surrogate="pg")
    w = (prox - behav).exp().clamp(max=1.5)
    close(pg, float((-w * adv * logp * mask).sum() / mask.sum()))  # -w A log p, token-mean
    with pytest.raises(ValueError, match="'ppo' or 'pg'"):
        policy_loss("tis", logp, prox, adv, mask, behaviour_logprobs=behav, tis_surrogate="x")
    with pytest.raises(ValueError, match="'truncate' or 'mask'"):
        policy_loss("decoupled_ppo", logp, prox, adv, mask, behaviour_logprobs=behav,
                    behaviour_cap=1.3, behaviour_cap_mode="drop")


def test_policy_loss_dispatches_gspo_and_cispo():
    gen = torch.Generator().manual_seed(4)
    old = -torch.rand(2, 5, generator=gen) * 2
    logp, adv, mask = old + 1e-3, torch.randn(2, 5, generator=gen), f32([1, 1, 1, 0, 0], [1] * 5)
    close(policy_loss("gspo", logp, old, adv, mask, seq_clip_low=1e-4, seq_clip_high=2e-3,
                      agg="seq-mean-token-sum-norm", norm_tokens=8)[0],
          gspo_loss(logp, old, adv, mask, 1e-4, 2e-3, "seq-mean-token-sum-norm", norm_tokens=8)[0])
    close(policy_loss("cispo", logp, old, adv, mask, clip_low=0.1, clip_high=0.3)[0],
          cispo_loss(logp, old, adv, mask, 0.1, 0.3)[0])


# ---------------------------------------------------------------- reward shaping


def test_overlong_penalty_hand_values_and_dapo_formula():
    lengths = torch.tensor([10, 16, 17, 19, 20, 25])
    # max 20, buffer 4: no penalty up to 16, then -(L - 16)/4: -0.25, -0.75, -1; beyond: -1
    close(overlong_penalty(lengths, 20, 4), [0, 0, -0.25, -0.75, -1, -1])
    close(overlong_penalty(lengths, 20, 4, factor=0.5), [0, 0, -0.125, -0.375, -0.5, -0.5])
    # DAPO's reward manager: min(-(L - (max - buffer)) / buffer * factor, 0), for L <= max
    for n in range(0, 21):
        dapo = min(-(n - (20 - 4)) / 4 * 0.7, 0.0)
        close(overlong_penalty(torch.tensor([n]), 20, 4, 0.7), [dapo])
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, 20, 21)


def test_shape_rewards_scale_penalty_clip():
    rewards, lengths = f32(1.0, 0.5, -2.0, 1.0), torch.tensor([5, 18, 5, 20])
    assert torch.equal(shape_rewards(rewards, lengths), rewards)  # the defaults: unchanged
    # 2r + p(L) with max 20, buffer 4: [2, 1 - 0.5, -4, 2 - 1], then clipped to +-1.5
    close(shape_rewards(rewards, lengths, scale=2.0, overlong_buffer=4, overlong_max_tokens=20,
                        clip=1.5), [1.5, 0.5, -1.5, 1.0])
    with pytest.raises(ValueError, match="lengths"):
        shape_rewards(rewards, None, overlong_buffer=4, overlong_max_tokens=20)


def test_gae_bootstraps_a_truncated_response():
    rewards, values = f32([0, 0, 1], [0, 1, 0]), f32([0.5, 0.6, 0.7], [0.2, 0.3, 9.0])
    mask = f32([1, 1, 1], [1, 1, 0])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False,
                              bootstrap=f32(0.4, 0.0))
    # seq0 bootstraps V = 0.4 after its last token: delta2 = 1 + 0.9*0.4 - 0.7 = 0.66
    #   A1 = (0.9*0.7 - 0.6) + 0.72*0.66 = 0.5052;  A0 = (0.9*0.6 - 0.5) + 0.72*0.5052 = 0.403744
    # seq1 ended (bootstrap 0): A1 = 1 - 0.3 = 0.7; A0 = (0.9*0.3 - 0.2) + 0.72*0.7 = 0.574
    close(adv, f32([0.403744, 0.5052, 0.66], [0.574, 0.7, 0]))
    close(ret, f32([0.903744, 1.1052, 1.36], [0.774, 1.0, 0]))
    same, _ = gae_advantages(rewards, values, mask, 0.9, 0.8, whiten=False, bootstrap=f32(0, 0))
    close(same, gae_advantages(rewards, values, mask, 0.9, 0.8, whiten=False)[0])
    adv2, _ = compute_advantages("gae", token_rewards=rewards, values=values, mask=mask,
                                 gamma=0.9, lam=0.8, whiten=False, bootstrap=f32(0.4, 0.0))
    close(adv2, adv)


# ---------------------------------------------------------------- value loss


def test_value_loss_clipped():
    values = f32([1.5, 1.1, 0.5, 1.5]).requires_grad_(True)
    old = f32([1.0, 1.0, 1.0, 1.0])
    returns = f32([2.0, 2.0, 0.0, 1.0])
    loss, metrics = value_loss(values, old, returns, torch.ones(1, 4), clip=0.2)
    # V=1.5 R=2: (V-R)^2 = 0.25, V_clip = 1.2: 0.64 -> 0.5 * 0.64 = 0.32   clipped
    # V=1.1 R=2: 0.81 both                     -> 0.405
    # V=0.5 R=0: 0.25, V_clip = 0.8: 0.64      -> 0.32                      clipped
    # V=1.5 R=1: 0.25, V_clip = 1.2: 0.04      -> 0.125
    close(loss, (0.32 + 0.405 + 0.32 + 0.125) / 4)
    close(metrics["clip_frac"], 0.5)
    (grad,) = torch.autograd.grad(loss, values)
    close(grad, f32([0, -0.9, 0, 0.5]) / 4)  # d 0.5 (V-R)^2 = V - R; clipped: 0
    unclipped, _ = value_loss(values, old, returns, torch.ones(1, 4), clip=None)
    close(unclipped, 0.5 * (0.25 + 0.81 + 0.25 + 0.25) / 4)


def test_value_clip_fraction_counts_only_values_the_clip_moved():
    """|V - old V| < clip everywhere: nothing is clipped. old + (V - old) is not V in float32
    (here for 1.4% of the tokens), and comparing errors after that round trip counted tokens the
    clip never touched (0.3% here); V_clip = clamp(V, old - c, old + c) is V exactly inside."""
    gen = torch.Generator().manual_seed(0)
    old = torch.rand(64, 256, generator=gen) * 0.01
    values = (torch.rand(64, 256, generator=gen) * 0.4 + 0.05).requires_grad_(True)
    returns = torch.randn(64, 256, generator=gen)
    mask = torch.ones(64, 256)
    loss, metrics = value_loss(values, old, returns, mask, clip=0.5)
    assert float(metrics["clip_frac"]) == 0.0
    unclipped, _ = value_loss(values, old, returns, mask, clip=None)
    assert float(loss.detach()) == float(unclipped.detach())


# ---------------------------------------------------------------- logits


def naive_logprobs(logits, tokens, temperature=1.0):
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens[..., None]).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_matches_naive(dtype):
    torch.manual_seed(3)
    logits = (3 * torch.randn(3, 5, 11)).to(dtype).requires_grad_(True)
    tokens = torch.randint(0, 11, (3, 5))
    got = token_logprobs(logits, tokens, temperature=0.7, chunk_tokens=4)  # 15 rows: 4 chunks
    want = naive_logprobs(logits, tokens, 0.7)
    assert got.dtype == torch.float32
    close(got, want.detach())
    weights = torch.randn(3, 5)
    (g_got,) = torch.autograd.grad((got * weights).sum(), logits)
    (g_want,) = torch.autograd.grad((want * weights).sum(), logits)
    assert g_got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(g_got.float(), g_want.float(), atol=tol, rtol=tol)


def test_token_logprobs_shift_convention():
    torch.manual_seed(4)
    logits = torch.randn(2, 4, 6)
    tokens = torch.randint(0, 6, (2, 4))
    got = token_logprobs(logits, tokens, shift=True)
    # logits at t predict token t + 1; the result is aligned with tokens, first column 0
    close(got[:, 0], [0.0, 0.0])
    close(got[:, 1:], naive_logprobs(logits[:, :-1], tokens[:, 1:]))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, tokens, temperature=0.0)


def test_entropy_uniform_is_log_vocab():
    for dtype in (torch.float32, torch.bfloat16):
        uniform = torch.full((2, 3, 7), 4.0, dtype=dtype)
        close(entropy_from_logits(uniform), torch.full((2, 3), math.log(7)))
    # two equal logits and one banned (-inf): log 2, not NaN; a peaked distribution: ~0
    close(entropy_from_logits(f32([0.0, 0.0, -math.inf], [1000.0, 0.0, 0.0])), [math.log(2), 0.0])


@pytest.mark.parametrize("scale", [60.0, 245.0])
def test_entropy_at_large_logits_matches_float64(scale):
    """|logits / T| up to 60 and 245: entropy and its gradient within 1e-5 of float64 (the
    unshifted lse(z) - sum p z was off by 1e-4 and 1e-3 here)."""
    gen = torch.Generator().manual_seed(int(scale))
    z = (torch.randn(64, 1000, generator=gen, dtype=torch.float64) * scale / 3).clamp(-scale, scale)
    z[:, 0] = scale  # a row maximum at the bound
    z64 = z.clone().requires_grad_(True)
    want = -(torch.softmax(z64, -1) * torch.log_softmax(z64, -1)).sum(-1)
    weights = torch.randn(64, generator=gen, dtype=torch.float64)
    (g_want,) = torch.autograd.grad((want * weights).sum(), z64)
    z32 = (z * 0.5).float().requires_grad_(True)  # temperature 0.5: z = logits / 0.5
    got = entropy_from_logits(z32, temperature=0.5, chunk_tokens=24)
    (g_got,) = torch.autograd.grad((got * weights.float()).sum(), z32)
    torch.testing.assert_close(got.double(), want.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(g_got.double() * 0.5, g_want, atol=1e-5, rtol=0)


def test_entropy_gradient_matches_naive():
    torch.manual_seed(5)
    logits = torch.randn(3, 4, 9, requires_grad=True)
    got = entropy_from_logits(logits, temperature=1.3, chunk_tokens=5)
    z = logits / 1.3
    want = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    close(got, want.detach())
    weights = torch.randn(3, 4)
    (g_got,) = torch.autograd.grad((got * weights).sum(), logits)
    (g_want,) = torch.autograd.grad((want * weights).sum(), logits)
    close(g_got, g_want)


# ---------------------------------------------------------------- learning rate


def test_lr_lambda_warmup_and_cosine():
    lr = functools.partial(lr_lambda, warmup_steps=4, total_steps=12)
    assert [lr(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]  # (step + 1) / 4
    assert lr(4, schedule="constant") == lr(100, schedule="constant") == 1.0
    assert lr(4, schedule="cosine") == 1.0  # right after warm-up
    assert lr(8, schedule="cosine") == pytest.approx(0.5)  # half way through 8 decay steps
    assert lr(12, schedule="cosine") == pytest.approx(0.0)
    assert lr(20, schedule="cosine") == pytest.approx(0.0)
    assert lr(12, schedule="cosine", min_ratio=0.1) == pytest.approx(0.1)
    assert lr_lambda(0, 0, 10, "cosine") == 1.0  # no warm-up
    with pytest.raises(ValueError, match="cosine"):
        lr_lambda(0, 0, 10, "linear")


def test_lr_lambda_with_lambda_lr():
    optimiser = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, functools.partial(lr_lambda, warmup_steps=2, total_steps=4, schedule="cosine")
    )
    seen = []
    for _ in range(5):
        seen.append(optimiser.param_groups[0]["lr"])
        optimiser.step()
        schedule.step()
    # warm-up 1, 2; cosine over 2 steps: 2 * (1 + cos(pi/2))/2 = 1; then 0
    assert seen == pytest.approx([1.0, 2.0, 2.0, 1.0, 0.0])
