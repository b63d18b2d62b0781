"""The trainer's state and how it is built: the policy, the reference, the critic, optimizers.

`build_state` loads the policy (float32 master weights), an optional frozen reference model and,
for GAE (`algorithm.advantage = "gae"`), the critic, each with its AdamW and the warm-up +
schedule in trainer steps; it seeds every RNG from `trainer.seed` (else `seed`) + the rank.

The critic (`Critic`) is the policy's architecture loaded the same way, without the LM head,
with a scalar value head on the last hidden states (drawn the same on every rank). It gives
per-token values aligned with the tokens as the log-probs are: the value of token t, V_t, is
read from position t - 1 (the state before token t was chosen; the first token has none).

Ranks: the models are sharded with FSDP2 over the trainer's K ranks (`shard`: `fully_shard`
per decoder layer, then the root), on CPU ranks over gloo as on GPUs over nccl. A checkpoint
directory is built on the meta device, sharded, and each rank reads only its own rows of every
parameter (`rollmesh.models.sharded`): K ranks hold one copy of each model between them, not K.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rollmesh.algorithms import head, lr_lambda
from rollmesh.config import ExperimentConfig, LoraConfig
from rollmesh.models.loading import is_tiny, load_model, load_tokenizer
from rollmesh.models.lora import has_adapters, inject, is_adapter
from rollmesh.runtime.log import get_logger
from rollmesh.training.lora import initial_values
from rollmesh.training.ranks import Ranks
from rollmesh.models.sharded import UnsupportedCheckpoint, load_causal_lm
from rollmesh.models.varlen import use_packed_attention
from rollmesh.weight_sync.tensors import dtype_from_name

log = get_logger("rollmesh.training")


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
    # Rank 0's word, shared with the step's batch: a checkpoint is due after this step
    # (trainer.checkpoint_every_s); every rank saves together.
    checkpoint_due: bool = False
    # The value model, with its own optimizer and schedule: advantage = "gae" only.
    critic: Critic | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    critic_scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
    # The checkpoint being written in the background (`checkpoint.PendingSave`), until it is
    # latest or abandoned (training/role.py: save_checkpoint, settle_checkpoint).
    pending_save: Any = None

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
                with_next: bool = False, value_index: Tensor | None = None,
                **packed: Any) -> Tensor:
        """[B, T] values; `with_next`: [B, T + 1], column n_b the value of the state after row
        b's last token (n_b its length; the bootstrap of a truncated response).

        A packed row (`input_ids` [1, N] with `position_ids` and the packed kwargs of
        `rollmesh.models.varlen.packed_kwargs`) gives one value per position; `value_index`
        [B, T + 1] says which position each token-aligned entry reads (-1: none, 0)."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask,
                            use_cache=False, **packed).last_hidden_state
        values = self.value_head(hidden).squeeze(-1).float()
        if value_index is not None:
            flat = values.reshape(-1)
            out = torch.where(value_index >= 0, flat[value_index.clamp(min=0)], 0.0)
            return out if with_next else out[:, :-1]
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
                critic_seed: int | None = None, whole: bool = False,
                lora_seed: int | None = None) -> tuple[Any, Any]:
    """(model, tokenizer): the policy's architecture and weights (`critic_seed` given: the critic
    around its decoder), `prepare`d, then sharded over the ranks, float32 master weights.

    A checkpoint directory is built on meta and each rank reads only its shards
    (`rollmesh.models.sharded`), so K ranks hold one model between them, not K; a checkpoint that
    loader cannot read (it says why in the log), `whole`, and tiny specs (seeded, built the same
    in every process) are built whole on every rank, then sharded. `lora_seed` given: the
    policy with `[model.lora]`'s adapters (`rollmesh.training.lora`), their first values drawn
    from that seed."""
    path, dtype = exp.model.path, torch.float32
    compute_dtype = dtype_from_name(exp.model.dtype)
    shard_fn = functools.partial(shard, ranks=ranks, device=device, compute_dtype=compute_dtype)
    if not is_tiny(path) and not whole:
        wrap = (None if critic_seed is None
                else functools.partial(_new_critic, seed=critic_seed))
        if lora_seed is not None:
            wrap = functools.partial(_with_adapters, cfg=exp.model.lora, seed=lora_seed)
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
    if lora_seed is not None:
        model, values = _with_adapters(lm, exp.model.lora, lora_seed)
        with torch.no_grad():
            for name, value in values.items():
                param = model.get_parameter(name)
                param.copy_(value.to(device=param.device, dtype=param.dtype))
    if critic_seed is not None:
        model, head = _new_critic(lm, critic_seed)
        with torch.no_grad():
            for name, value in head.items():
                model.get_parameter(name).copy_(value)
        model = model.to(device=device, dtype=dtype)
    prepare(model)
    return shard_fn(model), tokenizer


def _with_adapters(lm: Any, cfg: LoraConfig, seed: int) -> tuple[Any, dict[str, Tensor]]:
    """The LM with peft's adapters in it, and their first values (`load_causal_lm`'s `wrap`:
    on meta, the values fill them after sharding)."""
    inject(lm, cfg)
    return lm, initial_values(lm, seed)


def _tokenizer(exp: ExperimentConfig) -> Any:
    return load_tokenizer(exp.model.tokenizer_path or exp.model.path,
                          trust_remote_code=exp.model.trust_remote_code)


def shard(model: torch.nn.Module, ranks: Ranks, device: torch.device,
          compute_dtype: torch.dtype) -> torch.nn.Module:
    """FSDP2 over the trainer's ranks: each decoder layer, then the root (K = 1: as it is).
    Parameters still on meta stay there: `rollmesh.models.sharded` fills the shards."""
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
        adapters = has_adapters(model)
        for name, p in model.named_parameters():  # under LoRA the adapters alone
            p.requires_grad_(not adapters or is_adapter(name))
        if gradient_checkpointing:  # the critic: on its decoder
            (model.model if isinstance(model, Critic) else model).gradient_checkpointing_enable()
            if adapters:  # checkpointed layers whose inputs need no grad would give none
                model.enable_input_require_grads()
    return prepare


def _policy_prepare(gradient_checkpointing: bool) -> Callable[[torch.nn.Module], None]:
    trainable = _trainable(gradient_checkpointing)

    def prepare(model: torch.nn.Module) -> None:
        model.config.architectures = [type(model).__name__]  # before FSDP renames the class
        trainable(model)
    return prepare


def _frozen(model: torch.nn.Module) -> None:
    model.requires_grad_(False)


def adamw(params: Any, **kwargs: Any) -> torch.optim.AdamW:
    """torch's fused AdamW (one kernel per parameter, on CPU as on CUDA: 6.5x faster than the
    per-operation default for 0.45B float32 parameters on 2 CPU cores), or the default where
    fused is not supported for these parameters."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, ValueError) as e:
        log.info("adamw_not_fused", reason=str(e)[:200])
        return torch.optim.AdamW(params, **kwargs)


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
    lora = exp.model.lora.enabled
    model, tokenizer = load_models(exp, ranks, device, _policy_prepare(t.checkpoints_activations(device.type)),
                                   whole=whole, lora_seed=seed - ranks.rank if lora else None)
    compute_dtype = dtype_from_name(exp.model.dtype)
    ref_model = None
    if exp.algorithm.use_reference and not lora:  # LoRA: the base is the policy, adapters off
        ref_model, _ = load_models(exp, ranks, device, _frozen, whole=whole)
    head.set_compile(t.compile == "on" or (t.compile == "auto" and device.type == "cuda"))
    packed = [model, ref_model]
    optimizer = adamw([p for p in model.parameters() if p.requires_grad], lr=t.lr, betas=tuple(t.betas),
                      weight_decay=t.weight_decay)
    # The schedule is in trainer steps: every mini-batch update of one step has the same rate.
    schedule = functools.partial(_lr_multiplier, mini_batches=t.mini_batches,
                                 warmup_steps=t.warmup_steps, total_steps=t.total_steps,
                                 schedule=t.lr_schedule)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    autocast = device.type == "cuda" and compute_dtype != torch.float32 and ranks.world == 1
    state = TrainState(exp, model, optimizer, scheduler, tokenizer, ranks, device, ref_model,
                       autocast)
    if exp.algorithm.trains_critic():
        if exp.algorithm.critic_lr is None:  # parse_config refuses this; a hand-built config
            raise ValueError("algorithm.critic_lr: missing required value (expected float > 0, "
                             f"as advantage = '{exp.algorithm.advantage}' trains a critic)")
        # the value head is drawn the same on every rank
        state.critic, _ = load_models(exp, ranks, device, _trainable(t.checkpoints_activations(device.type)),
                                      critic_seed=seed - ranks.rank, whole=whole)
        state.critic_optimizer = adamw(
            state.critic.parameters(), lr=exp.algorithm.critic_lr, betas=tuple(t.betas),
            weight_decay=t.weight_decay)
        state.critic_scheduler = torch.optim.lr_scheduler.LambdaLR(state.critic_optimizer,
                                                                   schedule)
        packed.append(state.critic)
    if t.packing:
        for m in packed:
            if m is not None:
                kernel = use_packed_attention(m, device)
        log.info("packed_micro_batches", attention=kernel, device=str(device))
    return state


def _lr_multiplier(update: int, *, mini_batches: int, warmup_steps: int, total_steps: int,
                   schedule: str) -> float:
    return lr_lambda(update // mini_batches, warmup_steps, total_steps, schedule)
