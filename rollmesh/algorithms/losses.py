"""Loss aggregation, the policy losses (PPO, decoupled PPO, TIS, GSPO, CISPO), the dispatch to
the registered losses (`policy_loss`) and the clipped value loss.

Per-token tensors are [B, T] with `mask` [B, T] (1 = generated token that counts). Each loss
returns (loss, metrics): loss a float32 scalar with gradient, metrics a dict of detached 0-dim
float32 tensors (no host sync here; the caller calls .item() when it logs), averaged over the
masked tokens of the tensors passed in.

Log-probs: `logprobs` are the current policy's (with gradient), `old_logprobs` /
`proximal_logprobs` the trainer's recomputation before this step's updates, and
`behaviour_logprobs` the engine's, per token, from the (possibly stale) weights that sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rollmesh.algorithms.advantages import kl_estimate
from rollmesh.algorithms.registry import policy_losses

__all__ = [
    "AGG_MODES",
    "LossInputs",
    "aggregate",
    "cispo_loss",
    "decoupled_ppo_loss",
    "gspo_loss",
    "policy_loss",
    "ppo_loss",
    "tis_loss",
    "value_loss",
]

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# Bounds exp(log-ratio) so one diverged token cannot make the loss inf (e^20 ~ 5e8).
_MAX_LOG_RATIO = 20.0

Normaliser = float | int | Tensor | None


def aggregate(
    values: Tensor, mask: Tensor, mode: str = "token-mean", *,
    global_tokens: Normaliser = None, global_seqs: Normaliser = None,
    norm_tokens: float | None = None,
) -> Tensor:
    """Reduce per-token `values` [B, T] to a scalar over the masked tokens (float32).

        token-mean:              sum_{b,t} m*v / N_tokens
        seq-mean-token-sum:      sum_b (sum_t m*v) / N_seqs
        seq-mean-token-mean:     sum_b (sum_t m*v / n_b) / N_seqs,   n_b = sum_t m[b]
        seq-mean-token-sum-norm: sum_b (sum_t m*v / C) / N_seqs,     C = norm_tokens

    seq-mean-token-sum-norm is Dr. GRPO's (Liu et al. 2025, "Understanding R1-Zero-like
    training"): each sequence's token sum over a constant C (the generation budget, e.g.
    rollout.max_new_tokens), so neither a sequence's own length nor the batch's token count
    scales its tokens' gradients; verl's mode of that name divides by the padded width instead,
    which changes from batch to batch. `norm_tokens` is required for it.

    By default N_tokens = sum(m) and N_seqs = the number of sequences with at least one masked
    token (a sequence with none adds 0 and is not counted; an empty batch gives 0, not NaN).

    Gradient accumulation: pass the counts of the whole optimiser batch as `global_tokens` /
    `global_seqs` (summed over every micro-batch and every rank). Each micro-batch's loss is
    then its share of one big-batch loss, and summing the micro-batch losses (accumulating their
    gradients) gives exactly the big batch's loss and gradient. DDP averages gradients over W
    ranks, so multiply the loss by W (or pass global_tokens / W) to keep the sum.
    Values at unmasked positions are ignored, even NaN or inf.
    """
    m = mask.float()
    v = torch.where(m > 0, values.float(), 0.0)
    if mode == "token-mean":
        denom = m.sum().clamp(min=1) if global_tokens is None else global_tokens
        return v.sum() / denom
    if mode == "seq-mean-token-sum":
        per_seq = v.sum(dim=1)
    elif mode == "seq-mean-token-mean":
        per_seq = v.sum(dim=1) / m.sum(dim=1).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        if norm_tokens is None or not norm_tokens > 0:
            raise ValueError("loss aggregation 'seq-mean-token-sum-norm': expected norm_tokens "
                             f"> 0 (the constant each sequence's token sum is divided by), got "
                             f"{norm_tokens!r}")
        per_seq = v.sum(dim=1) / norm_tokens
    else:
        raise ValueError(f"loss aggregation: expected one of {AGG_MODES}, got {mode!r}")
    denom = (m.sum(dim=1) > 0).sum().clamp(min=1) if global_seqs is None else global_seqs
    return per_seq.sum() / denom


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.float()
    return (torch.where(m > 0, x.float(), 0.0).sum() / m.sum().clamp(min=1)).detach()


def _masked_means(values: dict[str, Tensor], mask: Tensor) -> dict[str, Tensor]:
    """`_masked_mean` of several same-shaped tensors at once (a handful of ops, not a handful
    per metric)."""
    m = mask.float()
    stacked = torch.stack([v.detach().float() for v in values.values()])
    sums = torch.where(m > 0, stacked, 0.0).flatten(1).sum(dim=1) / m.sum().clamp(min=1)
    return dict(zip(values, sums.unbind()))


def _masked_max(x: Tensor, mask: Tensor) -> Tensor:
    m = mask > 0  # no boolean indexing: it would sync with the device
    top = torch.where(m, x.detach().float(), -torch.inf).max()
    return torch.where(m.any(), top, 0.0)


def _clipped_surrogate(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
    clip_low: float, clip_high: float, dual_clip: float | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-token PPO-clip loss; returns (loss, ratio, clip_active, dual_clip_active)."""
    log_ratio = (logprobs.float() - old_logprobs.float()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().float()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    clip_active = clipped > unclipped  # strict: at a tie the gradient goes through the ratio
    loss = torch.where(clip_active, clipped, unclipped)
    dual_active = torch.zeros_like(clip_active)
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip: expected > 1, got {dual_clip}")
        bound = -adv * dual_clip
        dual_active = (adv < 0) & (loss > bound)
        loss = torch.where(dual_active, bound, loss)
    return loss, ratio, clip_active, dual_active


def _ratio_metrics(
    logprobs: Tensor, old_logprobs: Tensor, ratio: Tensor, clip_active: Tensor,
    dual_active: Tensor, mask: Tensor,
) -> dict[str, Tensor]:
    # KL(old || new) from tokens drawn from old, log r = new - old:
    # approx_kl    = k3 = r - 1 - log r  (>= 0, low variance)
    # approx_kl_k1 = k1 = -log r         (verl's ppo_kl; unbiased, can be negative)
    approx_kl = kl_estimate(old_logprobs.detach(), logprobs.detach(), "k3")
    approx_kl_k1 = old_logprobs.detach().float() - logprobs.detach().float()
    return _masked_means({"clip_frac": clip_active, "dual_clip_frac": dual_active,
                          "approx_kl": approx_kl, "approx_kl_k1": approx_kl_k1,
                          "ratio_mean": ratio}, mask) | {"ratio_max": _masked_max(ratio, mask)}


def ppo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
    clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
    agg: str = "token-mean", *, global_tokens: Normaliser = None, global_seqs: Normaliser = None,
    norm_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip with an asymmetric range (DAPO clip-higher) and optional dual clip.

        ratio_t = exp(logp_t - old_t)
        l_t     = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - clip_low, 1 + clip_high))
        dual clip (Ye et al. 2020, verl clip_ratio_c), for A_t < 0 only:
        l_t     = min(l_t, -A_t * dual_clip)        i.e. the loss is at most dual_clip * |A_t|
        loss    = aggregate(l, mask, agg)

    Metrics: clip_frac = share of masked tokens where the clipped term is strictly the larger
    (its gradient is 0); dual_clip_frac = share where the dual bound is active; approx_kl = mean
    k3 estimate of KL(old || new) = mean(ratio - 1 - log ratio); approx_kl_k1 = the k1 estimate
    mean(-log ratio) (verl's ppo_kl); ratio_mean, ratio_max.
    """
    loss_t, ratio, clip_active, dual_active = _clipped_surrogate(
        logprobs, old_logprobs, advantages, clip_low, clip_high, dual_clip
    )
    loss = aggregate(loss_t, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs,
                     norm_tokens=norm_tokens)
    return loss, _ratio_metrics(logprobs, old_logprobs, ratio, clip_active, dual_active, mask)


def _behaviour_weight(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, cap: float | None, cap_mode: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(w, raw w, capped): raw w = exp(old - behaviour), detached; w is raw w capped by
    truncation (min(w, cap)) or masking (0 above the cap)."""
    log_w = old_logprobs.detach().float() - behaviour_logprobs.detach().float()
    raw = torch.exp(log_w.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    if cap is None:
        return raw, raw, torch.zeros_like(raw, dtype=torch.bool)
    capped = raw > cap
    if cap_mode == "truncate":
        return raw.clamp(max=cap), raw, capped
    if cap_mode == "mask":
        return torch.where(capped, 0.0, raw), raw, capped
    raise ValueError(f"behaviour cap mode: expected 'truncate' or 'mask', got {cap_mode!r}")


def _weight_metrics(raw_w: Tensor, capped: Tensor, mask: Tensor) -> dict[str, Tensor]:
    return _masked_means({"behaviour_weight_mean": raw_w, "behaviour_capped_frac": capped},
                         mask) | {"behaviour_weight_max": _masked_max(raw_w, mask)}


def decoupled_ppo_loss(
    logprobs: Tensor, proximal_logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor,
    mask: Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
    behaviour_cap: float | None = None, agg: str = "token-mean", *,
    behaviour_cap_mode: str = "truncate", dual_clip: float | None = None,
    global_tokens: Normaliser = None, global_seqs: Normaliser = None,
    norm_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """AReaL's decoupled PPO: the trust region is around the proximal policy, the off-policy
    gap between proximal and behaviour policy is corrected by a detached importance weight.

        ratio_t = exp(logp_t - prox_t)
        w_t     = exp(prox_t - behav_t)                   (detached)
        w_t     = min(w_t, behaviour_cap)                 (cap_mode "truncate", the default)
                  0 if w_t > behaviour_cap else w_t       (cap_mode "mask", as AReaL)
        l_t     = w_t * max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - clip_low, 1 + clip_high))
        loss    = aggregate(l, mask, agg)

    A masked token stays in the aggregation's normaliser (the normaliser must not depend on
    weights, or micro-batches would disagree with global_tokens). With prox == behav this is
    ppo_loss. Metrics: ppo_loss's (clip_frac etc. of ratio_t) plus behaviour_weight_mean/max
    (before the cap) and behaviour_capped_frac.
    """
    loss_t, ratio, clip_active, dual_active = _clipped_surrogate(
        logprobs, proximal_logprobs, advantages, clip_low, clip_high, dual_clip
    )
    w, raw_w, capped = _behaviour_weight(
        proximal_logprobs, behaviour_logprobs, behaviour_cap, behaviour_cap_mode
    )
    loss = aggregate(w * loss_t, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs,
                     norm_tokens=norm_tokens)
    metrics = _ratio_metrics(logprobs, proximal_logprobs, ratio, clip_active, dual_active, mask)
    return loss, metrics | _weight_metrics(raw_w, capped, mask)


def tis_loss(
    logprobs: Tensor, old_logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor,
    mask: Tensor, tis_cap: float = 2.0, clip_low: float = 0.2, clip_high: float = 0.2,
    dual_clip: float | None = None, agg: str = "token-mean", *, surrogate: str = "ppo",
    global_tokens: Normaliser = None, global_seqs: Normaliser = None,
    norm_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance sampling for the trainer/engine mismatch (Yao et al. 2025,
    "Your efficient RL framework secretly brings you off-policy RL training"; verl's TIS).

        w_t = min(exp(old_t - behav_t), tis_cap)           (detached; old = trainer's recompute)
        surrogate "ppo": l_t = w_t * max(-A_t * r_t, -A_t * clip(r_t, 1 - lo, 1 + hi)),
                         r_t = exp(logp_t - old_t), lo/hi = clip_low/clip_high
        surrogate "pg":  l_t = -w_t * A_t * logp_t          (vanilla policy gradient)
        loss = aggregate(l, mask, agg)

    The "ppo" form is decoupled_ppo_loss with behaviour_cap = tis_cap, truncated. Metrics as
    decoupled_ppo_loss (clip metrics are 0 for "pg").
    """
    if surrogate == "ppo":
        return decoupled_ppo_loss(
            logprobs, old_logprobs, behaviour_logprobs, advantages, mask, clip_low, clip_high,
            tis_cap, agg, dual_clip=dual_clip, global_tokens=global_tokens, global_seqs=global_seqs,
            norm_tokens=norm_tokens,
        )
    if surrogate != "pg":
        raise ValueError(f"tis surrogate: expected 'ppo' or 'pg', got {surrogate!r}")
    w, raw_w, capped = _behaviour_weight(old_logprobs, behaviour_logprobs, tis_cap, "truncate")
    loss_t = -w * advantages.detach().float() * logprobs.float()
    loss = aggregate(loss_t, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs,
                     norm_tokens=norm_tokens)
    log_ratio = logprobs.detach().float() - old_logprobs.float()
    ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    no_clip = torch.zeros_like(capped)
    metrics = _ratio_metrics(logprobs, old_logprobs, ratio, no_clip, no_clip, mask)
    return loss, metrics | _weight_metrics(raw_w, capped, mask)


def gspo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
    clip_low: float = 3e-4, clip_high: float = 4e-4, agg: str = "seq-mean-token-mean", *,
    global_tokens: Normaliser = None, global_seqs: Normaliser = None,
    norm_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"; verl's "gspo"): one
    importance ratio per sequence, the geometric mean of its tokens' ratios, clipped per sequence.

        s_b     = exp( sum_t m_bt * (logp_bt - old_bt) / n_b )     n_b = masked tokens of b
        s_bt    = sg[s_b] * pi_bt / sg[pi_bt]     (value s_b; gradient s_b * d logp_bt, GSPO-token)
        l_bt    = max(-A_bt * s_bt, -A_bt * clip(s_bt, 1 - clip_low, 1 + clip_high))
        loss    = aggregate(l, mask, agg)

    Every token of a sequence has the same ratio, so the clip keeps or drops a sequence whole.
    With "seq-mean-token-mean" (the paper's objective) the gradient is GSPO's,
    mean_b s_b A_b mean_t grad logp_bt. The clip range is of a sequence-mean log-ratio, orders
    of magnitude narrower than PPO's (the paper: 3e-4 / 4e-4). No dual clip.
    Metrics as ppo_loss, of s_bt (clip_frac counts tokens, so long clipped sequences weigh more).
    """
    m = mask.float()
    logp = logprobs.float()
    log_ratio = torch.where(m > 0, logp - old_logprobs.float(), 0.0)
    seq_log_ratio = (log_ratio.sum(dim=1) / m.sum(dim=1).clamp(min=1)).detach()
    seq_log_ratio = seq_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    # the detached sequence term added last: logp - sg[logp] is exactly 0 in value
    ratio = torch.exp(logp - logp.detach() + seq_log_ratio[:, None])
    adv = advantages.detach().float()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    clip_active = clipped > unclipped
    loss_t = torch.where(clip_active, clipped, unclipped)
    loss = aggregate(loss_t, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs,
                     norm_tokens=norm_tokens)
    no_dual = torch.zeros_like(clip_active)
    return loss, _ratio_metrics(logprobs, old_logprobs, ratio.detach(), clip_active, no_dual, mask)


def cispo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
    clip_low: float = 0.2, clip_high: float = 0.2, agg: str = "token-mean", *,
    global_tokens: Normaliser = None, global_seqs: Normaliser = None,
    norm_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025; verl's "cispo"): the clipped importance weight is a
    stop-gradient coefficient of the REINFORCE term, so no token loses its gradient to the clip.

        r_t  = exp(logp_t - old_t)
        l_t  = -sg[clip(r_t, 1 - clip_low, 1 + clip_high)] * A_t * logp_t
        loss = aggregate(l, mask, agg)

    clip_low >= 1 leaves the weight unbounded below (MiniMax-M1 bounds only the top).
    Metrics as ppo_loss; clip_frac = share of masked tokens whose weight the clip changed.
    """
    log_ratio = (logprobs.detach().float() - old_logprobs.float()).clamp(
        -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(max(1 - clip_low, 0.0), 1 + clip_high)
    loss_t = -weight * advantages.detach().float() * logprobs.float()
    loss = aggregate(loss_t, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs,
                     norm_tokens=norm_tokens)
    clip_active = weight != ratio
    no_dual = torch.zeros_like(clip_active)
    return loss, _ratio_metrics(logprobs, old_logprobs, ratio, clip_active, no_dual, mask)


@dataclass
class LossInputs:
    """What a registered policy loss is given besides its config: the micro-batch's [B, T]
    log-probs (current with gradient, `old_logprobs` the trainer's recomputation, the proximal
    policy; `behaviour_logprobs` the engine's, None unless the loss declares
    needs_behaviour), advantages and mask, and how its per-token losses are reduced
    (`aggregate`: algorithm.loss_agg over the whole mini-batch's counts)."""

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    behaviour_logprobs: Tensor | None = None
    agg: str = "token-mean"
    global_tokens: Normaliser = None
    global_seqs: Normaliser = None
    norm_tokens: float | None = None

    def normalisers(self) -> dict[str, Any]:
        return {"global_tokens": self.global_tokens, "global_seqs": self.global_seqs,
                "norm_tokens": self.norm_tokens}

    def aggregate(self, values: Tensor) -> Tensor:
        """Per-token `values` [B, T] reduced as the step reduces every loss term."""
        return aggregate(values, self.mask, self.agg, **self.normalisers())


# Metrics the trainer logs of every loss; a loss that does not return one gets it here.
_TRAINER_METRICS = ("clip_frac", "approx_kl", "approx_kl_k1")


def policy_loss(
    kind: str, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
    config: Any = None, *, behaviour_logprobs: Tensor | None = None, agg: str = "token-mean",
    global_tokens: Normaliser = None, global_seqs: Normaliser = None,
    norm_tokens: float | None = None, **params: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss registered as `kind` (AlgorithmConfig.loss, `policy_losses`: "ppo",
    "decoupled_ppo", "tis", "gspo", "cispo" built in, `rollmesh.algorithms.builtin`).

    `config` is the loss's own config (its registered dataclass; default: its defaults);
    `params` override its fields by name (e.g. clip_high=0.28 for "ppo", seq_clip_low for
    "gspo", tis_cap and tis_surrogate for "tis", behaviour_cap and behaviour_cap_mode for
    "decoupled_ppo"); a name the loss does not take is a TypeError.
    old_logprobs is the trainer's recomputation (the proximal policy for decoupled_ppo);
    behaviour_logprobs (the engine's) is required by the losses that declare needs_behaviour
    (decoupled_ppo, tis). Metrics: the loss's, with clip_frac (0), approx_kl and approx_kl_k1
    (of logprobs against old_logprobs) added where it returns none.
    """
    entry = policy_losses.get(kind)
    if config is None:
        config = entry.make_config(**params)
    elif params:
        config = entry.make_config(**{**vars(config), **params})
    if entry.info.get("needs_behaviour") and behaviour_logprobs is None:
        raise ValueError(f"policy loss {kind!r}: expected behaviour_logprobs")
    inputs = LossInputs(logprobs, old_logprobs, advantages, mask,
                        behaviour_logprobs if entry.info.get("needs_behaviour") else None,
                        agg, global_tokens, global_seqs, norm_tokens)
    loss, metrics = entry.fn(inputs, config)
    if any(k not in metrics for k in _TRAINER_METRICS):
        zero = torch.zeros_like(mask, dtype=torch.bool)
        defaults = _ratio_metrics(logprobs, old_logprobs, torch.ones_like(logprobs.detach()),
                                  zero, zero, mask)
        metrics = {**{k: defaults[k] for k in _TRAINER_METRICS}, **metrics}
    return loss, metrics


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None = 0.2,
    agg: str = "token-mean", *, global_tokens: Normaliser = None, global_seqs: Normaliser = None,
    norm_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss for the GAE critic (PPO2 / verl form).

        V_clip = clip(V, old_V - clip, old_V + clip)
        l_t    = 0.5 * max((V_t - R_t)^2, (V_clip_t - R_t)^2)      (clip=None: 0.5 * (V_t - R_t)^2)
        loss   = aggregate(l, mask, agg)

    V_clip is V itself, bit for bit, wherever |V - old_V| <= clip (verl's clip_by_value), so
    clip_frac counts only tokens the clip moved; old_V + clip(V - old_V) would round-trip V
    through a float32 difference and count some of the others.
    Metrics: clip_frac (share of masked tokens where the clipped error is strictly larger),
    value_mean, value_error (mean |V - R|).
    """
    v = values.float()
    target = returns.detach().float()
    loss_t = (v - target).square()
    clip_active = torch.zeros_like(loss_t, dtype=torch.bool)
    if clip is not None:
        old = old_values.detach().float()
        clipped_t = (torch.clamp(v, old - clip, old + clip) - target).square()
        clip_active = clipped_t > loss_t
        loss_t = torch.where(clip_active, clipped_t, loss_t)
    loss = aggregate(0.5 * loss_t, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs,
                     norm_tokens=norm_tokens)
    return loss, {
        "clip_frac": _masked_mean(clip_active, mask),
        "value_mean": _masked_mean(v.detach(), mask),
        "value_error": _masked_mean((v.detach() - target).abs(), mask),
    }
