"""The trainer role: batches in, policy updates, weights out to the engines, checkpoints.

One step, as `train` runs it: get a batch from the MessageQueue -> old log-probs (recomputed
with the current parameters, or the engine's behaviour log-probs as they are: "bypass") and
reference log-probs (and, for GAE, the critic's old values) -> advantages -> `trainer.mini_batches`
optimizer updates, each accumulated over micro-batches -> metrics -> every `sync.sync_every` steps
a weight sync -> now and then a checkpoint.

GAE (`algorithm.advantage = "gae"`, PPO as verl runs it): a critic (`Critic`: the policy's
architecture loaded the same way, without the LM head, with a scalar value head on the last
hidden states) gives per-token values, aligned with the tokens as the log-probs are: the value of
token t, V_t, is read from position t - 1 (the state before token t was chosen; the first token
has none). The sequence reward goes on its last generated token (minus the per-token KL when
`kl_in_reward`); `gae_advantages` turns rewards and old values into advantages (whitened) and
returns (`bootstrap_truncated`: a response cut off by the length limit continues with the
critic's value of the state after its last token instead of 0). Each mini-batch then updates the policy and the critic (the clipped value loss against
the returns, token-mean, its own AdamW at `algorithm.critic_lr` with the trainer's schedule and
grad clip), both accumulated over the same micro-batches; the critic is sharded like the policy.

Versions: the trainer's version is the number of weight syncs it has published (the engines
start at version 0 = the initial weights). It asks for batches at its version; a sync publishes
version + 1 (protocol in `rollmesh.synchronizer`). A resumed trainer continues the sequence.
The queue streams the batches (`message_queue.BatchFeed`): the next step's batch is taken and
sent while this step trains, when both train at the same version.

Ranks: K processes (role instances 0..K-1), each its own role process, join the trainer's own
process group at `rendezvous` (rank 0 hosts the TCPStore): gloo on CPU, nccl on GPUs. The model
is sharded with FSDP2 (`fully_shard` per decoder layer, then the root) on both: FSDP2 trains on
CPU ranks over gloo (2 CPU ranks match 1 rank within ~1e-6 after two steps). A checkpoint
directory is built on the meta device, sharded, and each rank reads only its own rows of every
parameter (`rollmesh.sharded_load`): K ranks hold one copy of each model between them, not K.
Rank 0 alone talks to the other roles; it sends each batch and each decision (train, sync,
stop) to the other ranks as msgpack bytes (`rollmesh.ranks`). Every rank holds the whole batch
and computes what is cheap on it (advantages, normalisers, every rank's micro-batch plan);
forward and backward passes run only on its share of the sequences. Old and reference log-probs
(and the critic's old values) are computed on the shares and summed across ranks, so every rank
has them for the whole batch.
Weight syncs: `rollmesh.publish` (blocking, or with `sync.overlap` sent from a snapshot while
the next step computes); checkpoints: `rollmesh.checkpoint`.

Gradient accumulation: each micro-batch's loss is normalised by the token (or sequence) count
of its whole mini-batch over all ranks (`global_tokens`), so summing micro-batches gives the
loss and gradient of one big batch; FSDP averages gradients over the K ranks, so each rank's
loss is multiplied by K.

The role's config (every rank gets the same, `instance` is the rank): `experiment`,
`message_queue` (RPC), `synchronizer` (RPC; without it nothing is synced), `engines` (URLs) and
`engine_tp_sizes`, `weight_sync_address` (where engines reach rank 0, default 127.0.0.1),
`rendezvous` (tcp://host:port, K > 1), `bind` (rank 0's stats RPC), `metrics_path` (one JSON
line per step), `checkpoint_dir` (else trainer.checkpoint_dir; the latest checkpoint there is
resumed), `export_dir` (a Hugging Face export after every sync, `version_<v>`),
`final_export_dir` (one export when training ends), `rollouter` (RPC, for the data cursor saved
with checkpoints and the latest evaluation), `threads` (torch threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rollmesh import checkpoint, packing, protocol
from rollmesh.algorithms import (
    aggregate, compute_advantages, entropy_from_logits, kl_estimate, lr_lambda, policy_loss,
    shape_rewards, token_logprobs, value_loss,
)
from rollmesh.config import AlgorithmConfig, ExperimentConfig, parse_config
from rollmesh.durable_log import write_atomic
from rollmesh.engine.client import run_api_key
from rollmesh.engine.models import is_tiny, load_model, load_tokenizer, resolve_device
from rollmesh.evaluation import eval_metrics
from rollmesh.log import get_logger
from rollmesh.metrics_sink import MetricsSinks, require_extras
from rollmesh.metrics_sink import tensorboard_writer as _tensorboard  # noqa: F401 - tests
from rollmesh.packing import BatchData
from rollmesh.message_queue import STREAM_AHEAD, BatchFeed
from rollmesh.protocol import Batch, Metrics, StatsRequest
from rollmesh.publish import Publisher, finish_sync, sync_weights
from rollmesh.ranks import Ranks, close_ranks, full_tensor, init_ranks
from rollmesh.runtime import RoleContext
from rollmesh.sharded_load import UnsupportedCheckpoint, load_causal_lm
from rollmesh.transport import RpcClient, RpcServer
from rollmesh.weights import dtype_from_name

log = get_logger("rollmesh.trainer")
run = asyncio.to_thread  # torch work leaves the event loop free for heartbeats and stats


# -- state -----------------------------------------------------------------------------------------


@dataclass
class TrainState:
    exp: ExperimentConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    tokenizer: Any
    ranks: Ranks = field(default_factory=Ranks)
    device: torch.device = torch.device("cpu")
    ref_model: torch.nn.Module | None = None
    autocast: bool = False  # one rank on CUDA in bf16/fp16 (several ranks: FSDP's policy)
    step: int = 0
    version: int = 0
    samples_consumed: int = 0
    # The value model, with its own optimizer and schedule: advantage = "gae" only.
    critic: Critic | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    critic_scheduler: torch.optim.lr_scheduler.LambdaLR | None = None

    @property
    def temperature(self) -> float:
        # Log-probs must be those of the sampling distribution the engines used.
        return self.exp.rollout.temperature or 1.0

    @property
    def compute_dtype(self) -> torch.dtype:
        return dtype_from_name(self.exp.model.dtype)


class Critic(torch.nn.Module):
    """The value model: the policy's decoder without its LM head, and a scalar value head.

    `forward` returns values aligned with the tokens [B, T] (float32): out[:, t] is the value of
    the state before token t, read from the hidden state at position t - 1, as the log-prob of
    token t comes from the logits at t - 1; out[:, 0] = 0 (the first token has no state before
    it). The decoder is `self.model`, so `shard` finds its layers as it does the policy's.
    """

    def __init__(self, decoder: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.model = decoder
        self.value_head = torch.nn.Linear(hidden_size, 1)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                with_next: bool = False) -> Tensor:
        """[B, T] values; `with_next`: [B, T + 1], column n_b the value of the state after row
        b's last token (n_b its length; the bootstrap of a truncated response)."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask,
                            use_cache=False).last_hidden_state
        values = self.value_head(hidden).squeeze(-1).float()
        return torch.cat([values.new_zeros(values.shape[0], 1),
                          values if with_next else values[:, :-1]], dim=1)


def _value_head(config: Any, seed: int) -> dict[str, Tensor]:
    """The critic's value head: weight from N(0, initializer_range) with `seed` (the same on every
    rank), bias 0."""
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn((1, config.hidden_size), generator=generator)
              * getattr(config, "initializer_range", 0.02))
    return {"value_head.weight": weight, "value_head.bias": torch.zeros(1)}


def _new_critic(lm: Any, seed: int) -> tuple[Critic, dict[str, Tensor]]:
    with torch.random.fork_rng(devices=[]):  # leaves the global RNG stream as it was
        critic = Critic(lm.base_model, lm.config.hidden_size)
    return critic, _value_head(lm.config, seed)


def load_models(exp: ExperimentConfig, ranks: Ranks, device: torch.device,
                prepare: Callable[[torch.nn.Module], None], *,
                critic_seed: int | None = None, whole: bool = False) -> tuple[Any, Any]:
    """(model, tokenizer): the policy's architecture and weights (`critic_seed` given: the critic
    around its decoder), `prepare`d, then sharded over the ranks, float32 master weights.

    A checkpoint directory is built on meta and each rank reads only its shards
    (`rollmesh.sharded_load`), so K ranks hold one model between them, not K; a checkpoint that
    loader cannot read (it says why in the log), `whole`, and tiny specs (seeded, built the same
    in every process) are built whole on every rank, then sharded."""
    path, dtype = exp.model.path, torch.float32
    compute_dtype = dtype_from_name(exp.model.dtype)
    shard_fn = functools.partial(shard, ranks=ranks, device=device, compute_dtype=compute_dtype)
    if not is_tiny(path) and not whole:
        wrap = (None if critic_seed is None
                else functools.partial(_new_critic, seed=critic_seed))
        try:
            model = load_causal_lm(path, device, dtype, shard_fn, prepare=prepare, wrap=wrap,
                                   trust_remote_code=exp.model.trust_remote_code)
            return model, _tokenizer(exp)
        except UnsupportedCheckpoint as e:
            log.warning("sharded_load_unsupported", path=path, reason=str(e),
                        fallback="the whole model on every rank, then sharded")
    lm, tokenizer = load_model(path, device, dtype, tokenizer_path=exp.model.tokenizer_path,
                               trust_remote_code=exp.model.trust_remote_code)
    model = lm
    if critic_seed is not None:
        model, head = _new_critic(lm, critic_seed)
        with torch.no_grad():
            for name, value in head.items():
                model.get_parameter(name).copy_(value)
        model = model.to(device=device, dtype=dtype)
    prepare(model)
    return shard_fn(model), tokenizer


def _tokenizer(exp: ExperimentConfig) -> Any:
    return load_tokenizer(exp.model.tokenizer_path or exp.model.path,
                          trust_remote_code=exp.model.trust_remote_code)


def shard(model: torch.nn.Module, ranks: Ranks, device: torch.device,
          compute_dtype: torch.dtype) -> torch.nn.Module:
    """FSDP2 over the trainer's ranks: each decoder layer, then the root (K = 1: as it is).
    Parameters still on meta stay there: `rollmesh.sharded_load` fills the shards."""
    if ranks.world == 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"mesh": init_device_mesh(device.type, (ranks.world,))}
    if device.type == "cuda" and compute_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype,
                                                   reduce_dtype=torch.float32)
    for layer in getattr(getattr(model, "model", None), "layers", []):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _trainable(gradient_checkpointing: bool) -> Callable[[torch.nn.Module], None]:
    def prepare(model: torch.nn.Module) -> None:
        model.train()
        model.requires_grad_(True)
        if gradient_checkpointing:  # the critic: on its decoder
            (model.model if isinstance(model, Critic) else model).gradient_checkpointing_enable()
    return prepare


def _policy_prepare(gradient_checkpointing: bool) -> Callable[[torch.nn.Module], None]:
    trainable = _trainable(gradient_checkpointing)

    def prepare(model: torch.nn.Module) -> None:
        model.config.architectures = [type(model).__name__]  # before FSDP renames the class
        trainable(model)
    return prepare


def _frozen(model: torch.nn.Module) -> None:
    model.requires_grad_(False)


def build_state(exp: ExperimentConfig, ranks: Ranks = Ranks(),
                device: torch.device = torch.device("cpu"), *,
                whole: bool = False) -> TrainState:
    """Policy (float32 master weights), optional frozen reference, AdamW, warm-up + schedule;
    for GAE also the critic with its own AdamW and schedule. `whole`: every rank builds the
    whole models before sharding (the loader's reference path; see `load_models`)."""
    t = exp.trainer
    seed = (t.seed if t.seed is not None else exp.seed) + ranks.rank
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
    model, tokenizer = load_models(exp, ranks, device, _policy_prepare(t.gradient_checkpointing),
                                   whole=whole)
    compute_dtype = dtype_from_name(exp.model.dtype)
    ref_model = None
    if exp.algorithm.use_reference:
        ref_model, _ = load_models(exp, ranks, device, _frozen, whole=whole)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=tuple(t.betas),
                                  weight_decay=t.weight_decay)
    # The schedule is in trainer steps: every mini-batch update of one step has the same rate.
    schedule = functools.partial(_lr_multiplier, mini_batches=t.mini_batches,
                                 warmup_steps=t.warmup_steps, total_steps=t.total_steps,
                                 schedule=t.lr_schedule)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    autocast = device.type == "cuda" and compute_dtype != torch.float32 and ranks.world == 1
    state = TrainState(exp, model, optimizer, scheduler, tokenizer, ranks, device, ref_model,
                       autocast)
    if exp.algorithm.advantage == "gae":
        if exp.algorithm.critic_lr is None:  # parse_config refuses this; a hand-built config
            raise ValueError("algorithm.critic_lr: missing required value (expected float > 0, "
                             "as advantage = 'gae' trains a critic)")
        # the value head is drawn the same on every rank
        state.critic, _ = load_models(exp, ranks, device, _trainable(t.gradient_checkpointing),
                                      critic_seed=seed - ranks.rank, whole=whole)
        state.critic_optimizer = torch.optim.AdamW(
            state.critic.parameters(), lr=exp.algorithm.critic_lr, betas=tuple(t.betas),
            weight_decay=t.weight_decay)
        state.critic_scheduler = torch.optim.lr_scheduler.LambdaLR(state.critic_optimizer,
                                                                   schedule)
    return state


def _lr_multiplier(update: int, *, mini_batches: int, warmup_steps: int, total_steps: int,
                   schedule: str) -> float:
    return lr_lambda(update // mini_batches, warmup_steps, total_steps, schedule)


# -- forward passes --------------------------------------------------------------------------------


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


def _to(mb: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in mb.items()}


def _idle_micro_batch(data: BatchData) -> dict[str, Tensor]:
    """Two tokens that count for nothing: a rank with less work still joins every collective."""
    zeros = torch.zeros(1, 2)
    mb = {k: zeros.clone() for k in ("mask", "behaviour", "old", "ref", "advantages", "values",
                                     "returns")}
    mb.update(tokens=torch.zeros(1, 2, dtype=torch.long),
              versions=torch.full((1, 2), -1, dtype=torch.long),
              attention_mask=torch.ones(1, 2, dtype=torch.long))
    return mb


def _forward(state: TrainState, model: torch.nn.Module, mb: dict[str, Tensor]) -> Tensor:
    autocast = (torch.autocast(state.device.type, dtype=state.compute_dtype) if state.autocast
                else contextlib.nullcontext())
    with autocast:
        return model(input_ids=mb["tokens"], attention_mask=mb["attention_mask"]).logits


def _values(state: TrainState, critic: torch.nn.Module, mb: dict[str, Tensor], *,
            with_next: bool = False) -> Tensor:
    """The critic's token-aligned values [B, T] (`with_next`: [B, T + 1]), float32."""
    autocast = (torch.autocast(state.device.type, dtype=state.compute_dtype) if state.autocast
                else contextlib.nullcontext())
    with autocast:
        return critic(input_ids=mb["tokens"], attention_mask=mb["attention_mask"],
                      with_next=with_next).float()


def _my_micro_batches(state: TrainState, data: BatchData, index: list[int]) -> list[list[int]]:
    plan = packing.plan(data.lengths.tolist(), index, state.ranks.world,
                        state.exp.trainer.micro_batch_tokens)
    return plan[state.ranks.rank]


@torch.no_grad()
def batch_logprobs(state: TrainState, data: BatchData, model: torch.nn.Module) -> Tensor:
    """log p(token) under `model` for the whole batch [B, T]: each rank its share, then summed."""
    out = torch.zeros(data.tokens.shape, dtype=torch.float32)
    for rows in _my_micro_batches(state, data, list(range(data.size))):
        mb = _to(data.rows(rows) if rows else _idle_micro_batch(data), state.device)
        logits = _forward(state, model, mb)
        logp = token_logprobs(logits, mb["tokens"], state.temperature, shift=True)
        if rows:
            out[rows, :logp.shape[1]] = logp.float().cpu() * data.mask[rows, :logp.shape[1]]
    return state.ranks.sum_(out)


def old_logprobs(state: TrainState, data: BatchData) -> Tensor:
    if state.exp.algorithm.old_logprobs == "bypass":
        return data.behaviour.clone()
    return batch_logprobs(state, data, state.model)


def reference_logprobs(state: TrainState, data: BatchData) -> Tensor | None:
    if state.ref_model is None:
        return None
    return batch_logprobs(state, data, state.ref_model)


@torch.no_grad()
def old_values(state: TrainState, data: BatchData) -> Tensor | None:
    """The critic's values for the whole batch [B, T] (0 outside the mask) before this step's
    updates; None without a critic. Each rank its share, then summed."""
    both = critic_values(state, data)
    return None if both is None else both[0]


@torch.no_grad()
def critic_values(state: TrainState, data: BatchData) -> tuple[Tensor, Tensor] | None:
    """(old_values, V after each sequence's last token [B]); None without a critic."""
    if state.critic is None:
        return None
    width = data.tokens.shape[1]
    out = torch.zeros(data.size, width + 1, dtype=torch.float32)  # column `width`: V after
    for rows in _my_micro_batches(state, data, list(range(data.size))):
        mb = _to(data.rows(rows) if rows else _idle_micro_batch(data), state.device)
        values = _values(state, state.critic, mb, with_next=True).cpu()
        if rows:
            w = values.shape[1] - 1
            out[rows, :w] = values[:, :w] * data.mask[rows, :w]
            out[rows, width] = values[torch.arange(len(rows)), data.lengths[rows]]
    state.ranks.sum_(out)
    return out[:, :width].contiguous(), out[:, width].contiguous()


def batch_rewards(algo: AlgorithmConfig, data: BatchData) -> Tensor:
    """The rewards the advantages see [B]: `shape_rewards` (scale, DAPO overlong penalty over
    each response's generated tokens, clip); the scores as they are by default."""
    lengths = getattr(data, "response_tokens", None)
    return shape_rewards(
        data.rewards, data.mask.sum(dim=1) if lengths is None else lengths,
        scale=algo.reward_scale, clip=algo.reward_clip, overlong_buffer=algo.overlong_buffer,
        overlong_max_tokens=algo.overlong_max_tokens, overlong_factor=algo.overlong_penalty)


def batch_advantages(algo: AlgorithmConfig, data: BatchData, values: Tensor | None = None,
                     bootstrap: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """(advantages, returns) of the whole batch from its shaped rewards; a KL penalty in the
    reward is folded in first. returns (the critic's targets) only for "gae", which needs the
    old `values` (and takes `bootstrap` [B], V after each truncated response, 0 elsewhere)."""
    rewards, kl = batch_rewards(algo, data), None
    if algo.kl_in_reward and algo.kl_coef > 0:
        kl = kl_estimate(data.old, data.ref, algo.kl_estimator, clamp=algo.kl_clamp) * data.mask
        if algo.advantage in ("grpo", "grpo_mean_only", "rloo"):
            # Outcome estimators take one reward per sequence: the penalty summed over it.
            rewards, kl = rewards - algo.kl_coef * kl.sum(dim=1), None
    if algo.advantage == "gae" and values is None:
        raise ValueError("advantage 'gae': expected the critic's values")
    return compute_advantages(
        algo.advantage, mask=data.mask, rewards=rewards, group_index=data.group_index, kl=kl,
        kl_coef=algo.kl_coef, gamma=algo.gamma, lam=algo.lam, values=values, bootstrap=bootstrap)


# -- the update ------------------------------------------------------------------------------------

PARTS = ("loss", "pg_loss", "kl_loss", "tokens", "clip_frac", "approx_kl", "approx_kl_k1",
         "entropy", "behaviour_weight_mean")
CRITIC_PARTS = ("value_loss", "value_clip_frac", "value_error")


def micro_batch_loss(state: TrainState, mb: dict[str, Tensor], norm: dict[str, float],
                     ) -> tuple[Tensor, dict[str, float]]:
    """This micro-batch's share of its mini-batch's loss, and its metric partial sums."""
    algo = state.exp.algorithm
    logits = _forward(state, state.model, mb)
    logp = token_logprobs(logits, mb["tokens"], state.temperature, shift=True)
    mask = mb["mask"]
    norm = {**norm, "norm_tokens": algo.loss_norm_tokens}
    pg, stats = policy_loss(
        algo.loss, logp, mb["old"], mb["advantages"], mask, behaviour_logprobs=mb["behaviour"],
        clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
        behaviour_cap=algo.behaviour_cap, behaviour_cap_mode=algo.behaviour_cap_mode,
        tis_cap=algo.tis_cap, tis_surrogate=algo.tis_surrogate, seq_clip_low=algo.gspo_clip_low,
        seq_clip_high=algo.gspo_clip_high, agg=algo.loss_agg, **norm)
    # Position t predicts token t + 1: shift the entropy to align it with the tokens.
    entropy = entropy_from_logits(logits if algo.entropy_coef > 0 else logits.detach(),
                                  state.temperature)
    entropy = torch.cat([entropy.new_zeros(entropy.shape[0], 1), entropy[:, :-1]], dim=1)
    loss = pg
    if algo.entropy_coef > 0:
        loss = loss - algo.entropy_coef * aggregate(entropy, mask, algo.loss_agg, **norm)
    kl_loss = torch.zeros(())
    if algo.kl_coef > 0 and not algo.kl_in_reward:
        kl_loss = aggregate(kl_estimate(logp, mb["ref"], algo.kl_estimator, clamp=algo.kl_clamp),
                            mask, algo.loss_agg, **norm)
        loss = loss + algo.kl_coef * kl_loss
    n = float(mask.sum())
    parts = {"loss": float(loss.detach()), "pg_loss": float(pg.detach()),
             "kl_loss": float(kl_loss.detach()), "tokens": n,
             "clip_frac": float(stats["clip_frac"]) * n, "approx_kl": float(stats["approx_kl"]) * n,
             "approx_kl_k1": float(stats["approx_kl_k1"]) * n,
             "entropy": float((entropy.detach() * mask).sum()),
             "behaviour_weight_mean": float(stats.get("behaviour_weight_mean", 1.0)) * n}
    return loss, parts


def critic_micro_batch_loss(state: TrainState, mb: dict[str, Tensor], norm: dict[str, float],
                            ) -> tuple[Tensor, dict[str, float]]:
    """This micro-batch's share of its mini-batch's clipped value loss (token-mean over the
    mini-batch's tokens, as verl's critic), and its metric partial sums."""
    values = _values(state, state.critic, mb)
    mask = mb["mask"]
    loss, stats = value_loss(values, mb["values"], mb["returns"], mask,
                             clip=state.exp.algorithm.value_clip, agg="token-mean",
                             global_tokens=norm["global_tokens"])
    n = float(mask.sum())
    return loss, {"value_loss": float(loss.detach()),
                  "value_clip_frac": float(stats["clip_frac"]) * n,
                  "value_error": float(stats["value_error"]) * n}


def _optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    grad_clip: float) -> tuple[float, float]:
    """Clip, step, advance the schedule; returns (grad norm before clipping, lr used)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(full_tensor(grad_norm)), lr


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
    totals = torch.zeros(len(parts_of), dtype=torch.float64)
    grad_norms, lrs, critic_norms, critic_lrs = [], [], [], []
    minis = [m.tolist() for m in torch.tensor_split(order, min(t.mini_batches, data.size))]
    for mini in minis:
        mini = sorted(mini)
        norm = {"global_tokens": max(float(data.mask[mini].sum()), 1.0),
                "global_seqs": max(float((data.mask[mini].sum(dim=1) > 0).sum()), 1.0)}
        for rows in _my_micro_batches(state, data, mini):
            mb = _to(data.rows(rows) if rows else _idle_micro_batch(data), state.device)
            loss, parts = micro_batch_loss(state, mb, norm)
            (loss * ranks.world).backward()
            if critic is not None:
                loss, critic_parts = critic_micro_batch_loss(state, mb, norm)
                (loss * ranks.world).backward()
                parts.update(critic_parts)
            totals += torch.tensor([parts[k] for k in parts_of], dtype=torch.float64)
        grad_norm, lr = _optimizer_step(state.model, state.optimizer, state.scheduler,
                                        t.grad_clip)
        grad_norms.append(grad_norm)
        lrs.append(lr)
        if critic is not None:
            grad_norm, lr = _optimizer_step(critic, state.critic_optimizer, state.critic_scheduler,
                                            t.grad_clip)
            critic_norms.append(grad_norm)
            critic_lrs.append(lr)
    ranks.sum_(totals)
    tokens = max(float(totals[PARTS.index("tokens")]), 1.0)
    out = {k: float(totals[i]) / (len(minis) if k.endswith("loss") else tokens)
           for i, k in enumerate(parts_of) if k != "tokens"}
    out.update(grad_norm=float(np.mean(grad_norms)), lr=lrs[-1], loss_tokens=tokens)
    if critic is not None:
        out.update(critic_grad_norm=float(np.mean(critic_norms)), critic_lr=critic_lrs[-1],
                   **value_metrics(data))
    return out


@torch.no_grad()
def evaluate_loss(state: TrainState, data: BatchData) -> float:
    """The step's objective on `data` with the current parameters (no update): tests, probes."""
    norm = {"global_tokens": max(float(data.mask.sum()), 1.0),
            "global_seqs": max(float((data.mask.sum(dim=1) > 0).sum()), 1.0)}
    total = 0.0
    for rows in _my_micro_batches(state, data, list(range(data.size))):
        mb = _to(data.rows(rows) if rows else _idle_micro_batch(data), state.device)
        total += micro_batch_loss(state, mb, norm)[1]["loss"]
    return float(state.ranks.sum_(torch.tensor([total], dtype=torch.float64)))


@torch.no_grad()
def evaluate_value_loss(state: TrainState, data: StepBatch) -> float:
    """The critic's clipped value loss on a prepared `data` with its current parameters."""
    norm = {"global_tokens": max(float(data.mask.sum()), 1.0)}
    total = 0.0
    for rows in _my_micro_batches(state, data, list(range(data.size))):
        mb = _to(data.rows(rows) if rows else _idle_micro_batch(data), state.device)
        total += critic_micro_batch_loss(state, mb, norm)[1]["value_loss"]
    return float(state.ranks.sum_(torch.tensor([total], dtype=torch.float64)))


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
    stale = packing.staleness(data.versions, data.mask, state.version).float()
    tokens = int(data.lengths.sum())
    return {
        "step": state.step, "version": state.version, "time": time.time(), **stats,
        "batch_staleness_max": float(stale.max()), "batch_staleness_mean": float(stale.mean()),
        "tokens": tokens, "tokens_per_s": tokens / max(seconds, 1e-9), "step_s": seconds,
        "reward_mean": float(data.rewards.mean()), "samples": data.size,
        **_shaping_metrics(data),
        "response_tokens_mean": float(data.mask.sum(dim=1).mean()),
        "samples_consumed": state.samples_consumed, **data.counts,
    }


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


# -- rank 0's connections -----------------------------------------------------------------------


class Link:
    """Rank 0's connections to the other roles: queue, stats server, sync publisher, cursor."""

    def __init__(self, ctx: RoleContext, state: TrainState):
        self.ctx, self.state = ctx, state
        config, t = ctx.config, ctx.transport
        self.mq = RpcClient(t, config["message_queue"], timeout_s=60, name="message queue")
        self.feed = BatchFeed(self.mq, state.exp.rollout.batch_groups, log=ctx.log)
        self.rollouter = (RpcClient(t, config["rollouter"], timeout_s=30, name="rollouter")
                          if config.get("rollouter") else None)
        self.publisher = (Publisher(t, config, state.exp.sync, state.device,
                                    api_key=run_api_key(ctx.spec.keys_dir))
                          if config.get("synchronizer") else None)
        self.server = RpcServer(t, config.get("bind", "tcp://127.0.0.1:0"),
                                {StatsRequest: self._stats}, name="trainer")
        self._serving: asyncio.Task | None = None
        self.last_metrics: dict[str, Any] = {}
        self.eval: dict[str, Any] | None = None  # the newest evaluation, for the monitor
        metrics_path = config.get("metrics_path")
        self.metrics_path = Path(metrics_path) if metrics_path else None
        if self.metrics_path is not None:  # on another host, the run's directory is new there
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        self.sinks: MetricsSinks | None = None  # TensorBoard and W&B, opened by `open`

    async def open(self) -> dict[str, str]:
        self.sinks = await run(MetricsSinks.open, self.state.exp, self.metrics_path, self.ctx.log)
        if self.publisher is not None:
            await self.publisher.open()
        self._serving = asyncio.create_task(self.server.serve())
        return {"rpc": self.server.address}

    async def close(self) -> None:
        if self._serving is not None:
            self._serving.cancel()
        if self.publisher is not None:
            await self.publisher.close()
        self.feed.close()
        for client in (self.mq, self.rollouter):
            if client is not None:
                client.close()
        self.server.close()
        if self.sinks is not None:  # W&B finishes its run and stops its service process
            sinks, self.sinks = self.sinks, None
            await run(sinks.close)

    async def _stats(self, msg: StatsRequest, peer: bytes) -> Metrics:
        s = self.state
        return Metrics(role="trainer", host=self.ctx.spec.host, values={
            "step": s.step, "version": s.version, "samples_consumed": s.samples_consumed,
            "last": self.last_metrics})

    def report(self, metrics: dict[str, Any]) -> None:
        self.last_metrics = metrics
        self.ctx.log.info("step", **{k: (round(v, 6) if isinstance(v, float) else v)
                                     for k, v in metrics.items()})
        if self.metrics_path is not None:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(metrics) + "\n")
        if self.sinks is not None:
            self.sinks.log(metrics)

    async def engines_behind(self) -> list[str]:
        """The engines serving another version than the trainer's (logged; [] if none)."""
        assert self.publisher is not None
        behind = await self.publisher.engines_behind(self.state.version)
        if behind:
            self.ctx.log.warning("engines_behind", version=self.state.version, engines=behind)
        return behind

    async def republish(self) -> None:
        """Send the trainer's version again (every rank is in `sync_weights` with rank 0).
        A failure is logged, not fatal: the next check tries again."""
        try:
            timings = await sync_weights(self.state, self.publisher, republish=True)
        except Exception as e:  # noqa: BLE001 - the engines stay behind; checked again soon
            self.ctx.log.error("republish_failed", version=self.state.version, error=str(e)[:500])
            await asyncio.sleep(1.0)
            return
        self.ctx.log.info("weights_republished", version=self.state.version,
                          broadcast_s=round(timings.get("sync_broadcast_s", 0.0), 4),
                          attempts=timings.get("sync_attempts"))

    async def data_cursor(self) -> dict[str, Any] | None:
        if self.rollouter is None:
            return None
        return (await self.rollouter.request(StatsRequest())).values.get("cursor")

    async def latest_eval(self) -> dict[str, Any] | None:
        """The rollouter's newest finished evaluation of the held-out set, if any."""
        if self.rollouter is None or not self.state.exp.rollout.eval_every:
            return None
        return (await self.rollouter.request(StatsRequest())).values.get("eval")


# -- batches in ------------------------------------------------------------------------------------


async def next_batch(ctx: RoleContext, state: TrainState, link: Link | None) -> Batch | None:
    """Rank 0 pulls a batch at its version and shares it with every rank; None: stop.

    Before each request for a batch (so at every step, and again whenever a wait for one comes
    back empty), rank 0 checks that every engine serving holds the trainer's version: one that
    restarted has the initial weights, generates nothing the trainer can use, and would get the
    weights only at the next sync, which may never come if every sample is stale. An engine
    behind gets the current version again at once (every rank takes part in the gather)."""
    ranks = state.ranks
    if not ranks.is_main:
        while True:
            order = await run(ranks.share)
            if order["op"] == "stop":
                return None
            if order["op"] == "batch":
                return protocol.decode(order["frames"], Batch)
            if order["op"] == "republish":
                with contextlib.suppress(RuntimeError):  # rank 0 gave up; it tries again later
                    await sync_weights(state, None, republish=True)
    assert link is not None
    exp = state.exp
    while True:
        if ctx.stopping.is_set() or state.step >= exp.trainer.total_steps:
            await run(ranks.share, {"op": "stop"})
            return None
        # (not while an overlapped sync is in flight: the engines are behind on purpose, and
        # one that restarts is sent the weights by its retry or the next sync)
        if (link.publisher is not None and not link.publisher.pending()
                and await link.engines_behind()):
            await run(ranks.share, {"op": "republish"})
            await link.republish()
        # The queue keeps each batch it hands out until a checkpoint covers its step, and hands
        # a resumed trainer the same batch again: say which step this is for and which step the
        # latest checkpoint holds (no checkpoint directory: nothing to resume, all done with).
        ckpt_dir = ctx.config.get("checkpoint_dir") or exp.trainer.checkpoint_dir
        saved = checkpoint.latest(ckpt_dir) if ckpt_dir else None
        committed = (int(saved.name.rsplit("_", 1)[-1]) if saved is not None
                     else 0 if ckpt_dir else state.step)
        # The queue streams the batches: the next one comes while this step trains, if that
        # step trains at the same version (the queue checks staleness at the trainer's version)
        step = state.step + 1
        through = min(step + STREAM_AHEAD, last_step_at_version(state, link),
                      exp.trainer.total_steps)
        batch = await link.feed.get(step, state.version, through, committed, timeout_s=2.0)
        if batch is not None and batch.groups:
            frames = [memoryview(f).tobytes() for f in protocol.encode(batch)]
            await run(ranks.share, {"op": "batch", "frames": frames})
            return batch
        await run(ranks.share, {"op": "idle"})  # the other ranks wait in a collective: wake them


def last_step_at_version(state: TrainState, link: Link) -> int:
    """The last step the trainer trains at its current weight version: `train` syncs (version
    + 1) after every step that is a multiple of sync.sync_every, and only with a synchronizer."""
    if link.publisher is None:
        return state.exp.trainer.total_steps
    every = state.exp.sync.sync_every
    return -(-(state.step + 1) // every) * every


# -- the role --------------------------------------------------------------------------------------


async def save_checkpoint(ctx: RoleContext, state: TrainState, link: Link | None,
                          directory: str | Path) -> None:
    cursor = await link.data_cursor() if link is not None else None
    path = await run(checkpoint.save, directory, model=state.model, optimizer=state.optimizer,
                     scheduler=state.scheduler, step=state.step, version=state.version,
                     ranks=state.ranks, tokenizer=state.tokenizer,
                     samples_consumed=state.samples_consumed, data_cursor=cursor,
                     critic=state.critic, critic_optimizer=state.critic_optimizer,
                     critic_scheduler=state.critic_scheduler)
    if path is not None:
        ctx.log.info("checkpoint_saved", path=str(path), step=state.step, version=state.version)


async def train(ctx: RoleContext, state: TrainState, link: Link | None) -> None:
    """The loop: batch -> old/ref log-probs -> advantages -> updates -> metrics -> sync -> save."""
    exp, config = state.exp, ctx.config
    ckpt_dir = config.get("checkpoint_dir") or exp.trainer.checkpoint_dir
    export_dir = config.get("export_dir")
    every = exp.trainer.checkpoint_every
    saved_at = state.step
    reported_eval = None
    if state.step > 0 and state.version > 0:
        # Resumed: the engines (re)started with the initial weights. Send them this
        # checkpoint's weights under its own version before any batch, so that what they
        # generate is stamped right and the batches the queue hands again are as before.
        resync = await sync_weights(state, link.publisher if link else None, republish=True)
        ctx.log.info("resumed_weights_published", version=state.version,
                     broadcast_s=resync.get("sync_broadcast_s"))
    while True:
        waited = time.monotonic()
        batch = await next_batch(ctx, state, link)
        if batch is None:
            break
        started = time.monotonic()
        data = await run(prepare, state, packing.from_groups(batch.groups))
        stats = await run(update_policy, state, data)
        state.step += 1
        state.samples_consumed += data.size
        metrics = step_metrics(state, data, stats, time.monotonic() - started)
        metrics["wait_s"] = started - waited
        metrics["group_ids"] = [g.group_id for g in batch.groups]  # what this step trained on
        if state.step % exp.sync.sync_every == 0:
            metrics.update(await sync_weights(state, link.publisher if link else None))
            if export_dir:  # what the engines now serve, for evaluation and tests
                await run(checkpoint.export_hf, Path(export_dir) / f"version_{state.version}",
                          model=state.model, tokenizer=state.tokenizer,
                          dtype=state.compute_dtype, ranks=state.ranks)
        if link is not None:
            latest = await link.latest_eval()
            if latest and latest != reported_eval:  # each evaluation once, on the next step
                metrics.update(eval_metrics(latest))  # eval_pass@k, eval/{source}/...
                reported_eval = link.eval = latest
            link.report(metrics)
        # after the step's row: a checkpoint never holds a step whose row was not written
        # (killed in between, the step is trained again and its row written again)
        if ckpt_dir and every and state.step % every == 0:
            # (overlapped: the sync in flight first, so that a checkpoint's version was sent)
            await finish_sync(state, link.publisher if link else None)
            await save_checkpoint(ctx, state, link, ckpt_dir)
            saved_at = state.step
    await finish_sync(state, link.publisher if link else None)  # overlapped: the last one
    if ckpt_dir and state.step != saved_at:
        await save_checkpoint(ctx, state, link, ckpt_dir)
    if config.get("final_export_dir"):  # the policy the run ends with, in Hugging Face format
        await run(checkpoint.export_hf, Path(config["final_export_dir"]), model=state.model,
                  tokenizer=state.tokenizer, dtype=state.compute_dtype, ranks=state.ranks)


def trim_metrics(path: Path, step: int, log: Any) -> None:
    """A trainer (re)started from the checkpoint of `step` trains the steps after it again (on
    the same batches): drop their rows now, so metrics.jsonl holds each step once. Replaced
    whole (a reader sees the old file or the new one); a torn last line goes too."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    keep = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if line.endswith("\n") and isinstance(row, dict) and row.get("step", 0) <= step:
            keep.append(line)
    if len(keep) != len(lines):
        write_atomic(path, "".join(keep), fsync=True)
        log.info("metrics_trimmed", path=str(path), checkpoint_step=step,
                 rows_dropped=len(lines) - len(keep))


async def main(ctx: RoleContext) -> None:
    """Role entry (one process per rank; instance = rank)."""
    exp = parse_config(ExperimentConfig, ctx.config["experiment"], "trainer spec")
    if ctx.config.get("threads"):
        torch.set_num_threads(int(ctx.config["threads"]))
    device = resolve_device(exp.trainer.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(ctx.config.get("device_index", 0)))
    backend = exp.trainer.backend if exp.trainer.backend != "auto" else (
        "nccl" if device.type == "cuda" else "gloo")
    ranks = await run(init_ranks, ctx.config.get("rendezvous"), ctx.spec.instance,
                      exp.trainer.ranks, backend)
    link = None
    try:
        if ranks.is_main:  # a missing extra fails now, before the model loads
            await run(require_extras, exp)
        state = await run(build_state, exp, ranks, device)
        ckpt_dir = ctx.config.get("checkpoint_dir") or exp.trainer.checkpoint_dir
        resume = checkpoint.latest(ckpt_dir) if ckpt_dir else None
        if resume is not None:
            saved = await run(checkpoint.load, resume, model=state.model,
                              optimizer=state.optimizer, scheduler=state.scheduler, ranks=ranks,
                              critic=state.critic, critic_optimizer=state.critic_optimizer,
                              critic_scheduler=state.critic_scheduler)
            state.step, state.version = saved["step"], saved["version"]
            state.samples_consumed = saved["samples_consumed"]
            ctx.log.info("resumed", path=str(resume), step=state.step, version=state.version)
        if ranks.is_main and ctx.config.get("metrics_path"):
            trim_metrics(Path(ctx.config["metrics_path"]), state.step, ctx.log)
        endpoints: dict[str, str] = {}
        if ranks.is_main:
            link = Link(ctx, state)
            endpoints = await link.open()
            ctx.set_status(lambda: {
                "step": state.step, "version": state.version,
                "samples_consumed": state.samples_consumed, **link.last_metrics,
                **({"eval_reward_mean": link.eval["reward_mean"],
                    "eval_version": link.eval["version"]} if link.eval else {})})
        ctx.log.info("trainer_config", rank=ranks.rank, ranks=ranks.world, device=str(device),
                     backend=backend, sharding="fsdp2" if ranks.world > 1 else "none",
                     params=sum(math.prod(p.shape) for p in state.model.parameters()),
                     critic_params=(sum(math.prod(p.shape) for p in state.critic.parameters())
                                    if state.critic is not None else 0))
        await ctx.ready(**endpoints)
        await train(ctx, state, link)
    finally:
        if link is not None:
            await link.close()
        close_ranks(ranks)
