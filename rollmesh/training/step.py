"""One training step's math: forward passes, advantages, the loss, the optimizer updates.

`prepare` turns a batch into what the updates need (every rank, the whole batch): old
log-probs (recomputed with the current parameters in a separate pass, or left to the training
forward when a batch gets one update: `old_from_training_forward`; or the engine's behaviour
log-probs as they are: "bypass"), reference log-probs, for GAE the critic's old values, then
the shaped rewards and the advantages (and the critic's returns). `update_policy` runs
`trainer.mini_batches` optimizer updates over it, each accumulated over micro-batches, its
metrics summed on the device and read back once; `step_metrics` is the step's metrics row.
Every forward goes through `rollmesh.training.forward` (packed rows, the chunked LM head).

Every pass over a batch runs on this rank's micro-batches (`micro_batches`, planned by
`rollmesh.training.batching.plan`): forward and backward passes run only on the rank's share of
the sequences; old and reference log-probs and the critic's old values are computed on the
shares and summed across ranks, so every rank has them for the whole batch.

GAE (`algorithm.advantage = "gae"`, the estimator registered with critic=True; PPO as verl
runs it): the sequence reward goes on its last
generated token (minus the per-token KL when `kl_in_reward`); `gae_advantages` turns rewards
and old values into advantages (whitened) and returns (`bootstrap_truncated`: a response cut off
by the length limit continues with the critic's value of the state after its last token instead
of 0). Each mini-batch then updates the policy and the critic (the clipped value loss against
the returns, token-mean, its own AdamW at `algorithm.critic_lr` with the trainer's schedule and
grad clip), both accumulated over the same micro-batches.

Gradient accumulation: each micro-batch's loss is normalised by the token (or sequence) count
of its whole mini-batch over all ranks (`global_tokens`), so summing micro-batches gives the
loss and gradient of one big batch; FSDP averages gradients over the K ranks, so each rank's
loss is multiplied by K.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rollmesh.algorithms import (
    aggregate, compute_advantages, kl_estimate, policy_loss, value_loss,
)
from rollmesh.algorithms.registry import policy_losses, reward_shapings
from rollmesh.config import AlgorithmConfig
from rollmesh.core import trajectory
from rollmesh.training.ranks import full_tensor
from rollmesh.training import batching
from rollmesh.training.batching import BatchData
from rollmesh.training.forward import token_logprobs_of
from rollmesh.training.lora import adapters_disabled
from rollmesh.training.state import TrainState


@dataclass
class StepBatch(BatchData):
    """A batch as one step uses it: BatchData and, for GAE, the critic's old values and the
    returns (its targets), [B, T], token-aligned like the rest, 0 outside the mask;
    `response_tokens` [B] (generated tokens, before `algorithm.mask_truncated`) and the
    `shaped_rewards` [B] the advantages were computed from."""

    values: Tensor | None = None
    returns: Tensor | None = None
    response_tokens: Tensor | None = None
    shaped_rewards: Tensor | None = None

    @classmethod
    def of(cls, data: BatchData) -> StepBatch:
        if isinstance(data, cls):
            return data
        return cls(**{f.name: getattr(data, f.name) for f in dataclasses.fields(data)})

    def rows(self, index: list[int]) -> dict[str, Tensor]:
        out = super().rows(index)
        width = out["tokens"].shape[1]
        for name in ("values", "returns"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)[index, :width]
        return out


def _to(mb: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, Tensor) else v
            for k, v in mb.items()}


def _idle_micro_batch(data: BatchData) -> dict[str, Tensor]:
    """Two tokens that count for nothing: a rank with less work still joins every collective."""
    zeros = torch.zeros(1, 2)
    mb = {k: zeros.clone() for k in ("mask", "behaviour", "old", "ref", "advantages", "values",
                                     "returns")}
    mb.update(tokens=torch.zeros(1, 2, dtype=torch.long),
              versions=torch.full((1, 2), -1, dtype=torch.long),
              attention_mask=torch.ones(1, 2, dtype=torch.long))
    return mb


def _values(state: TrainState, critic: torch.nn.Module, mb: dict[str, Any], *,
            with_next: bool = False) -> Tensor:
    """The critic's token-aligned values [B, T] (`with_next`: [B, T + 1]), float32."""
    autocast = (torch.autocast(state.device.type, dtype=state.compute_dtype) if state.autocast
                else contextlib.nullcontext())
    with autocast:
        if "input_ids" in mb:  # one packed row
            from rollmesh.models.varlen import packed_kwargs

            return critic(input_ids=mb["input_ids"], position_ids=mb["position_ids"],
                          value_index=mb["value_index"], with_next=with_next,
                          **packed_kwargs(mb["segments"], mb["input_ids"].device)).float()
        return critic(input_ids=mb["tokens"], attention_mask=mb["attention_mask"],
                      with_next=with_next).float()


def micro_batches(state: TrainState, data: BatchData, index: list[int] | None = None,
                  ) -> Iterator[tuple[list[int], dict[str, Tensor]]]:
    """This rank's micro-batches of the sequences `index` (default: the whole batch), each as
    (its rows, its tensors on the device), one at a time. Every rank yields as many: a rank
    with less work yields idle ones (rows [], `_idle_micro_batch`) so that it still joins every
    collective. The one loop of every pass over a batch (log-probs, values, updates)."""
    index = list(range(data.size)) if index is None else index
    packed = state.exp.trainer.packing
    plan = batching.plan(data.lengths.tolist(), index, state.ranks.world,
                         state.exp.trainer.micro_batch_tokens, packed)
    for rows in plan[state.ranks.rank]:
        mb = data.rows(rows) if rows else _idle_micro_batch(data)
        yield rows, _to(batching.model_inputs(mb, packed), state.device)


@torch.no_grad()
def batch_logprobs(state: TrainState, data: BatchData, model: torch.nn.Module) -> Tensor:
    """log p(token) under `model` for the whole batch [B, T]: each rank its share, then summed."""
    out = torch.zeros(data.tokens.shape, dtype=torch.float32)
    for rows, mb in micro_batches(state, data):
        logp, _ = token_logprobs_of(state, model, mb)
        if rows:
            out[rows, :logp.shape[1]] = logp.cpu()
    return state.ranks.sum_(out)


def old_from_training_forward(state: TrainState) -> bool:
    """Whether the proximal ("old") log-probs are the training forward's own, detached: with one
    optimizer update per batch they are the policy's log-probs before any update, which that
    forward computes anyway; a separate pass would compute the same numbers. Not when the
    advantages need them first (a KL penalty in the reward)."""
    algo = state.exp.algorithm
    return (algo.old_logprobs == "recompute" and state.exp.trainer.mini_batches == 1
            and not (algo.kl_in_reward and algo.kl_coef > 0))


def old_logprobs(state: TrainState, data: BatchData) -> Tensor | None:
    """The batch's proximal log-probs [B, T]; None where the training forward supplies them
    (`old_from_training_forward`)."""
    if state.exp.algorithm.old_logprobs == "bypass":
        return data.behaviour.clone()
    if old_from_training_forward(state):
        return None
    return batch_logprobs(state, data, state.model)


def reference_logprobs(state: TrainState, data: BatchData) -> Tensor | None:
    """The reference's log-probs [B, T]: the frozen reference model's, or under LoRA the base
    model's (the policy itself with its adapters off; no second copy of the weights)."""
    if state.exp.model.lora.enabled and state.exp.algorithm.use_reference:
        with adapters_disabled(state.model):
            return batch_logprobs(state, data, state.model)
    if state.ref_model is None:
        return None
    return batch_logprobs(state, data, state.ref_model)


@torch.no_grad()
def critic_values(state: TrainState, data: BatchData) -> tuple[Tensor, Tensor] | None:
    """(old_values, V after each sequence's last token [B]); None without a critic."""
    if state.critic is None:
        return None
    width = data.tokens.shape[1]
    out = torch.zeros(data.size, width + 1, dtype=torch.float32)  # column `width`: V after
    for rows, mb in micro_batches(state, data):
        values = _values(state, state.critic, mb, with_next=True).cpu()
        if rows:
            w = values.shape[1] - 1
            out[rows, :w] = values[:, :w] * data.mask[rows, :w]
            out[rows, width] = values[torch.arange(len(rows)), data.lengths[rows]]
    state.ranks.sum_(out)
    return out[:, :width].contiguous(), out[:, width].contiguous()


def batch_rewards(algo: AlgorithmConfig, data: BatchData) -> Tensor:
    """The rewards the advantages see [B]: the reward shaping registered as
    `algorithm.reward_shaping` over each response's generated tokens ("default": scale, DAPO
    overlong penalty, clip; the scores as they are with its defaults)."""
    lengths = getattr(data, "response_tokens", None)
    shaping = reward_shapings.get(algo.reward_shaping)
    return shaping.fn(data.rewards, data.mask.sum(dim=1) if lengths is None else lengths,
                      shaping.make_config(algo))


def batch_advantages(algo: AlgorithmConfig, data: BatchData, values: Tensor | None = None,
                     bootstrap: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """(advantages, returns) of the whole batch from its shaped rewards; a KL penalty in the
    reward is folded in first. returns (the critic's targets) only for a critic estimator
    ("gae"), which needs the old `values` (and takes `bootstrap` [B], V after each truncated
    response, 0 elsewhere)."""
    rewards, kl = batch_rewards(algo, data), None
    if algo.kl_in_reward and algo.kl_coef > 0:
        kl = kl_estimate(data.old, data.ref, algo.kl_estimator, clamp=algo.kl_clamp) * data.mask
        if algo.outcome_advantage():
            # Outcome estimators take one reward per sequence: the penalty summed over it.
            rewards, kl = rewards - algo.kl_coef * kl.sum(dim=1), None
    if algo.trains_critic() and values is None:
        raise ValueError(f"advantage {algo.advantage!r}: expected the critic's values")
    return compute_advantages(
        algo.advantage, mask=data.mask, rewards=rewards, group_index=data.group_index, kl=kl,
        kl_coef=algo.kl_coef, gamma=algo.gamma, lam=algo.lam, values=values, bootstrap=bootstrap)


# -- the update ------------------------------------------------------------------------------------

PARTS = ("loss", "pg_loss", "kl_loss", "tokens", "clip_frac", "approx_kl", "approx_kl_k1",
         "entropy", "behaviour_weight_mean")
CRITIC_PARTS = ("value_loss", "value_clip_frac", "value_error")


def micro_batch_loss(state: TrainState, mb: dict[str, Any], norm: dict[str, float],
                     ) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of its mini-batch's loss, and its metric partial sums (0-dim
    tensors on the device: nothing here waits for the device)."""
    algo = state.exp.algorithm
    logp, entropy = token_logprobs_of(state, state.model, mb,
                                      entropy="grad" if algo.entropy_coef > 0 else "metric")
    mask = mb["mask"]
    old = mb["old"] if "old" in mb else logp.detach()
    norm = {**norm, "norm_tokens": algo.loss_norm_tokens}
    pg, stats = policy_loss(
        algo.loss, logp, old, mb["advantages"], mask,
        policy_losses.get(algo.loss).make_config(algo), behaviour_logprobs=mb["behaviour"],
        agg=algo.loss_agg, **norm)
    loss = pg
    if algo.entropy_coef > 0:
        loss = loss - algo.entropy_coef * aggregate(entropy, mask, algo.loss_agg, **norm)
    kl_loss = torch.zeros((), device=logp.device)
    if algo.kl_coef > 0 and not algo.kl_in_reward:
        kl_loss = aggregate(kl_estimate(logp, mb["ref"], algo.kl_estimator, clamp=algo.kl_clamp),
                            mask, algo.loss_agg, **norm)
        loss = loss + algo.kl_coef * kl_loss
    n = mask.sum()
    weight = stats.get("behaviour_weight_mean")
    parts = {"loss": loss.detach(), "pg_loss": pg.detach(), "kl_loss": kl_loss.detach(),
             "tokens": n, "clip_frac": stats["clip_frac"] * n,
             "approx_kl": stats["approx_kl"] * n, "approx_kl_k1": stats["approx_kl_k1"] * n,
             "entropy": (entropy.detach() * mask).sum(),
             "behaviour_weight_mean": (n if weight is None else weight * n)}
    return loss, parts


def critic_micro_batch_loss(state: TrainState, mb: dict[str, Any], norm: dict[str, float],
                            ) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of its mini-batch's clipped value loss (token-mean over the
    mini-batch's tokens, as verl's critic), and its metric partial sums."""
    values = _values(state, state.critic, mb)
    mask = mb["mask"]
    loss, stats = value_loss(values, mb["values"], mb["returns"], mask,
                             clip=state.exp.algorithm.value_clip, agg="token-mean",
                             global_tokens=norm["global_tokens"])
    n = mask.sum()
    return loss, {"value_loss": loss.detach(), "value_clip_frac": stats["clip_frac"] * n,
                  "value_error": stats["value_error"] * n}


def _optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    grad_clip: float) -> tuple[Tensor, float]:
    """Clip, step, advance the schedule; returns (grad norm before clipping, a 0-dim tensor on
    the device; lr used)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return full_tensor(grad_norm).detach().float(), lr


def value_metrics(data: StepBatch) -> dict[str, float]:
    """The old values against the returns over the batch's masked tokens: their means and the
    explained variance 1 - Var(R - V) / Var(R) (1: the critic predicts the returns exactly)."""
    m = data.mask > 0
    values, returns = data.values[m].double(), data.returns[m].double()
    if values.numel() == 0:
        return {"value_mean": 0.0, "returns_mean": 0.0, "value_explained_var": 0.0}
    var = float(returns.var(unbiased=False))
    explained = 1.0 - float((returns - values).var(unbiased=False)) / var if var > 0 else 0.0
    return {"value_mean": float(values.mean()), "returns_mean": float(returns.mean()),
            "value_explained_var": explained}


def update_policy(state: TrainState, data: BatchData) -> dict[str, float]:
    """`trainer.mini_batches` optimizer updates over the batch (the policy's and, with GAE, the
    critic's, over the same mini- and micro-batches); returns the step's metrics."""
    t, ranks, critic = state.exp.trainer, state.ranks, state.critic
    if critic is not None and (not isinstance(data, StepBatch) or data.returns is None):
        raise ValueError("the critic's update needs the batch's old values and returns: "
                         "pass the batch through `prepare`")
    state.model.train()
    parts_of = PARTS + (CRITIC_PARTS if critic is not None else ())
    if critic is not None:
        critic.train()
    order = torch.randperm(data.size, generator=torch.Generator().manual_seed(
        (t.seed or 0) * 1_000_003 + state.step))  # the same on every rank and after a resume
    # Partial sums stay on the device until the end: one host synchronisation per step.
    totals = torch.zeros(len(parts_of), dtype=torch.float64, device=state.device)
    grad_norms, lrs, critic_norms, critic_lrs = [], [], [], []
    minis = [m.tolist() for m in torch.tensor_split(order, min(t.mini_batches, data.size))]
    for mini in minis:
        mini = sorted(mini)
        norm = {"global_tokens": max(float(data.mask[mini].sum()), 1.0),
                "global_seqs": max(float((data.mask[mini].sum(dim=1) > 0).sum()), 1.0)}
        for _, mb in micro_batches(state, data, mini):
            loss, parts = micro_batch_loss(state, mb, norm)
            (loss * ranks.world).backward()
            if critic is not None:
                loss, critic_parts = critic_micro_batch_loss(state, mb, norm)
                (loss * ranks.world).backward()
                parts.update(critic_parts)
            totals += torch.stack([parts[k].to(torch.float64) for k in parts_of])
        grad_norm, lr = _optimizer_step(state.model, state.optimizer, state.scheduler,
                                        t.grad_clip)
        grad_norms.append(grad_norm)
        lrs.append(lr)
        if critic is not None:
            grad_norm, lr = _optimizer_step(critic, state.critic_optimizer, state.critic_scheduler,
                                            t.grad_clip)
            critic_norms.append(grad_norm)
            critic_lrs.append(lr)
    norms = torch.stack(grad_norms + critic_norms).to(torch.float64)
    host = torch.cat([totals, norms]).cpu()  # the step's one wait for the device
    totals, norms = host[:len(parts_of)], host[len(parts_of):].numpy()
    ranks.sum_(totals)
    tokens = max(float(totals[PARTS.index("tokens")]), 1.0)
    out = {k: float(totals[i]) / (len(minis) if k.endswith("loss") else tokens)
           for i, k in enumerate(parts_of) if k != "tokens"}
    out.update(grad_norm=float(np.mean(norms[:len(grad_norms)])), lr=lrs[-1], loss_tokens=tokens)
    if critic is not None:
        out.update(critic_grad_norm=float(np.mean(norms[len(grad_norms):])),
                   critic_lr=critic_lrs[-1], **value_metrics(data))
    return out


def prepare(state: TrainState, data: BatchData) -> StepBatch:
    """Old and reference log-probs, the critic's old values (GAE), then advantages and returns
    (every rank, the whole batch). `algorithm.mask_truncated`: responses cut off by the length
    limit leave the loss mask first."""
    algo = state.exp.algorithm
    data = StepBatch.of(data)
    data.response_tokens = data.mask.sum(dim=1)
    truncated = data.truncated if data.truncated is not None else torch.zeros(data.size, dtype=bool)
    if algo.mask_truncated:
        data.mask = data.mask * (~truncated)[:, None].float()
    data.old = old_logprobs(state, data)
    data.ref = reference_logprobs(state, data)
    both = critic_values(state, data)
    bootstrap = None
    if both is not None:
        data.values, after = both
        if algo.bootstrap_truncated:
            bootstrap = torch.where(truncated, after, 0.0)
    data.shaped_rewards = batch_rewards(algo, data)
    data.advantages, data.returns = batch_advantages(algo, data, data.values, bootstrap)
    return data


def step_metrics(state: TrainState, data: BatchData, stats: dict[str, float],
                 seconds: float) -> dict[str, Any]:
    stale = batching.staleness(data.versions, data.mask, state.version).float()
    ages = ({} if data.admitted is None else _stats_of(
        "batch_admission_age", trajectory.admission_age(data.admitted, state.version).float()))
    tokens = int(data.lengths.sum())
    return {
        "step": state.step, "version": state.version, "time": time.time(), **stats,
        "batch_staleness_max": float(stale.max()), "batch_staleness_mean": float(stale.mean()),
        **ages,
        "tokens": tokens, "tokens_per_s": tokens / max(seconds, 1e-9), "step_s": seconds,
        "reward_mean": float(data.rewards.mean()), "samples": data.size,
        **_shaping_metrics(data),
        "response_tokens_mean": float(data.mask.sum(dim=1).mean()),
        "samples_consumed": state.samples_consumed, **data.counts,
    }


def _stats_of(name: str, values: Tensor) -> dict[str, float]:
    return {f"{name}_max": float(values.max()), f"{name}_mean": float(values.mean())}


def _shaping_metrics(data: BatchData) -> dict[str, float]:
    """truncated_frac (responses cut off by the length limit), and the mean of the rewards the
    advantages saw where shaping changed them."""
    out = {}
    if data.truncated is not None:
        out["truncated_frac"] = float(data.truncated.float().mean())
    shaped = getattr(data, "shaped_rewards", None)
    if shaped is not None and not torch.equal(shaped, data.rewards.float()):
        out["reward_shaped_mean"] = float(shaped.mean())
    return out
