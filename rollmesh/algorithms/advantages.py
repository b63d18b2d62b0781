"""Advantage estimators and the KL penalty that shapes rewards.

Shapes: B sequences padded to T tokens. `mask` [B, T] is 1 on the tokens that count in the loss
(generated tokens) and 0 on prompt, tool and padding tokens. Sequence rewards are [B], token
rewards [B, T], `group_index` [B] (equal values = the samples of one prompt). All math runs in
float32 whatever the input dtype; every advantage comes back [B, T], zero outside the mask.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollmesh.algorithms.registry import advantage_estimators

__all__ = [
    "KL_ESTIMATORS",
    "compute_advantages",
    "gae_advantages",
    "grpo_advantages",
    "kl_estimate",
    "kl_in_reward",
    "last_masked_token",
    "reinforce_pp_advantages",
    "rloo_advantages",
]

KL_ESTIMATORS = ("k1", "k2", "k3", "k3+")

# exp() of a log-ratio beyond this is a diverged policy, not information; keep it finite.
_MAX_LOG_RATIO = 20.0


def _group_stats(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-sample (group size n, group sum, group sum of squared deviations, group spread).

    spread = max - min of the group, exactly 0 when all rewards are equal (no rounding).
    """
    _, inverse = torch.unique(group_index, return_inverse=True)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    zeros = rewards.new_zeros(groups)
    n = zeros.index_add(0, inverse, torch.ones_like(rewards))
    total = zeros.index_add(0, inverse, rewards)
    mean = total / n
    sq_dev = zeros.index_add(0, inverse, (rewards - mean[inverse]) ** 2)
    hi = zeros.scatter_reduce(0, inverse, rewards, "amax", include_self=False)
    lo = zeros.scatter_reduce(0, inverse, rewards, "amin", include_self=False)
    return n[inverse], total[inverse], sq_dev[inverse], (hi - lo)[inverse]


def _per_token(per_sequence: Tensor, mask: Tensor) -> Tensor:
    return per_sequence[:, None] * mask.float()


def grpo_advantages(
    rewards: Tensor, group_index: Tensor, mask: Tensor, *, std_normalize: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO outcome advantage, broadcast over each sequence's masked tokens.

        A_i = (r_i - mean_g) / (std_g + eps)      (std_normalize=True)
        A_i =  r_i - mean_g                        (std_normalize=False, "grpo_mean_only", Dr. GRPO)

    mean_g, std_g over the n samples of i's group; std_g is the unbiased (Bessel, n - 1)
    standard deviation, as torch.std in verl. A group whose rewards are all equal, or a group of
    one sample, gets exactly 0 (no NaN): it carries no relative signal.
    """
    r = rewards.float()
    n, total, sq_dev, spread = _group_stats(r, group_index)
    adv = r - total / n
    if std_normalize:
        std = torch.sqrt(sq_dev / (n - 1).clamp(min=1))
        adv = adv / (std + eps)
    adv = torch.where((n > 1) & (spread > 0), adv, torch.zeros_like(adv))
    return _per_token(adv, mask)


def rloo_advantages(rewards: Tensor, group_index: Tensor, mask: Tensor) -> Tensor:
    """REINFORCE leave-one-out: A_i = r_i - (sum_g - r_i) / (n_g - 1), 0 for a group of one.

    Equal to n/(n-1) * (r_i - mean_g); broadcast over the sequence's masked tokens.
    """
    r = rewards.float()
    n, total, _, _ = _group_stats(r, group_index)
    adv = r - (total - r) / (n - 1).clamp(min=1)
    adv = torch.where(n > 1, adv, torch.zeros_like(adv))
    return _per_token(adv, mask)


def _masked_whiten(x: Tensor, mask: Tensor, eps: float) -> Tensor:
    """(x - mean) * rsqrt(var + eps) over the masked entries of the whole batch (unbiased var).

    A batch whose masked entries are all equal has no signal and gets exactly 0. Without that
    guard the float32 mean of n equal values that are not a power-of-two fraction (0.1, 0.7)
    is off by a rounding unit, and that residue, divided by a standard deviation of ~0, came back
    as advantages of order 1 with random signs. eps goes under the square root (verl's
    masked_whiten), so a nearly constant batch is scaled by at most 1/sqrt(eps), not 1/eps.
    """
    m = mask.float()
    count = m.sum()
    mean = (x * m).sum() / count.clamp(min=1)
    var = (((x - mean) * m) ** 2).sum() / (count - 1).clamp(min=1)
    hi = torch.where(m > 0, x, -torch.inf).max() if x.numel() else x.new_zeros(())
    lo = torch.where(m > 0, x, torch.inf).min() if x.numel() else x.new_zeros(())
    whitened = (x - mean) * torch.rsqrt(var + eps)
    return torch.where((m > 0) & (hi > lo), whitened, 0.0)


def last_masked_token(per_sequence: Tensor, mask: Tensor) -> Tensor:
    """[B] -> [B, T] with the value on each sequence's last masked token (0 if it has none)."""
    m = mask.float()
    positions = torch.arange(m.shape[1], device=m.device).expand_as(m)
    last = torch.where(m > 0, positions, -1).amax(dim=1)
    out = torch.zeros_like(m)
    has = last >= 0
    out[has, last[has]] = per_sequence.float()[has]
    return out


def _discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_next over masked tokens, right to left.

    Unmasked tokens (tool output between turns, padding) are transparent: they add no reward
    and no discount step, so a later turn's reward still reaches earlier turns.
    """
    m = mask.float()
    r = token_rewards.float() * m
    returns = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        running = torch.where(m[:, t] > 0, r[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * m


def reinforce_pp_advantages(
    rewards: Tensor, mask: Tensor, kl: Tensor | None = None, gamma: float = 1.0, *,
    kl_coef: float = 1.0, eps: float = 1e-8,
) -> Tensor:
    """REINFORCE++: discounted token return, then whitened over the batch's masked tokens.

        r_t = R * [t = last masked token] - kl_coef * kl_t      (rewards [B]), or
        r_t = rewards[t] - kl_coef * kl_t                         (rewards [B, T])
        G_t = r_t + gamma * G_{t+1}                               (over masked tokens only)
        A_t = (G_t - mean(G)) / (std(G) + eps)                    (batch statistics, unbiased std)

    `kl` is the per-token KL to the reference (e.g. kl_estimate(..., "k1")), or None.
    """
    token_rewards = last_masked_token(rewards, mask) if rewards.dim() == 1 else rewards.float()
    if kl is not None:
        token_rewards = kl_in_reward(token_rewards, kl, kl_coef)
    return _masked_whiten(_discounted_returns(token_rewards, mask, gamma), mask, eps)


def gae_advantages(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 1.0, *,
    whiten: bool = True, eps: float = 1e-8, bootstrap: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the masked tokens, right to left.

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next
        R_t     = A_t + V_t                   (the critic's target, computed before whitening)

    "next" is the next masked token (unmasked tool or padding tokens are skipped). After the
    last masked token A_next = 0 and V_next = bootstrap[b]: 0 when the episode ended (the
    default, every sequence), the critic's value of the state after the last token for a
    response cut off by the length limit (it did not end; Pardo et al. 2018, time limits).
    The advantages are whitened over the batch's masked tokens when `whiten` (verl's default
    for GAE); returns never are. Returns (advantages, returns), both [B, T] and 0 outside the mask.
    """
    m = mask.float()
    r = token_rewards.float() * m
    v = values.detach().float() * m
    adv = torch.zeros_like(r)
    next_value = (r.new_zeros(r.shape[0]) if bootstrap is None
                  else bootstrap.detach().float().reshape(r.shape[0]).clone())
    next_adv = r.new_zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        here = m[:, t] > 0
        next_adv = torch.where(here, delta + gamma * lam * next_adv, next_adv)
        next_value = torch.where(here, v[:, t], next_value)
        adv[:, t] = next_adv
    adv = adv * m
    returns = (adv + v) * m
    if whiten:
        adv = _masked_whiten(adv, m, eps)
    return adv, returns


def kl_estimate(
    logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3", *, clamp: float | None = None,
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi.

    With log_ratio = logprobs - ref_logprobs:
        k1  = log_ratio                          (unbiased, high variance, can be negative)
        k2  = 0.5 * log_ratio ** 2               (biased, low variance, >= 0)
        k3  = exp(-log_ratio) - 1 + log_ratio    (Schulman: unbiased, low variance, >= 0)
        k3+ = k3 in value, k2 in gradient        (straight-through, verl's "k3+"):
              k2 - sg[k2] + sg[k3]
    As a loss, k3's gradient, (1 - exp(-log_ratio)) d logp, is not an estimate of KL's gradient
    and grows exponentially where the policy fell below the reference; k2's, log_ratio d logp,
    is KL's gradient on-policy. As a reward (detached) only the value counts: k3+ is k3 there.
    k3's log_ratio is clamped to +-20 so a diverged token gives a large finite value, not inf.
    `clamp` bounds the k3 (and k3+) value to [-clamp, clamp] (verl and AReaL: 10), which also
    zeroes k3's gradient beyond it (log_ratio < -2.6 at 10); None: no bound.
    """
    log_ratio = logprobs.float() - ref_logprobs.float()
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator in ("k3", "k3+"):
        clamped = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        k3 = torch.exp(-clamped) - 1 + clamped
        if clamp is not None:
            k3 = k3.clamp(-clamp, clamp)
        if estimator == "k3":
            return k3
        k2 = 0.5 * log_ratio.square()
        return k2 - k2.detach() + k3.detach()
    raise ValueError(f"kl estimator: expected one of {KL_ESTIMATORS}, got {estimator!r}")


def kl_in_reward(
    rewards_token: Tensor, kl: Tensor, coef: float, mask: Tensor | None = None
) -> Tensor:
    """KL penalty folded into the reward: r'_t = r_t - coef * kl_t (times mask, when given).

    The KL is a constant of the reward here (detached): its gradient flows through the return.
    """
    shaped = rewards_token.float() - coef * kl.detach().float()
    return shaped if mask is None else shaped * mask.float()


def compute_advantages(
    kind: str, *, mask: Tensor, rewards: Tensor | None = None, group_index: Tensor | None = None,
    token_rewards: Tensor | None = None, values: Tensor | None = None, kl: Tensor | None = None,
    kl_coef: float = 0.0, gamma: float = 1.0, lam: float = 1.0, whiten: bool = True,
    bootstrap: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The estimator registered as `kind` (AlgorithmConfig.advantage, `advantage_estimators`);
    returns (advantages, returns).

    returns is the critic target for a critic estimator ("gae") and None for the critic-free
    ones. The built-ins (`rollmesh.algorithms.builtin`):
    grpo, grpo_mean_only, rloo: rewards [B] and group_index [B].
    reinforce_pp: rewards [B] (or token_rewards [B, T]); kl [B, T] optional, weighted by kl_coef.
    gae: token_rewards [B, T] (or rewards [B], put on each sequence's last masked token) and
         values [B, T]; kl, when given, is folded into the token rewards with kl_coef;
         bootstrap [B], when given, is V after each sequence's last token (0: it ended).
    """
    return advantage_estimators.get(kind).fn(
        mask=mask, rewards=rewards, group_index=group_index, token_rewards=token_rewards,
        values=values, kl=kl, kl_coef=kl_coef, gamma=gamma, lam=lam, whiten=whiten,
        bootstrap=bootstrap)
