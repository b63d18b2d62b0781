"""rollmesh's own policy losses, advantage estimators and reward shaping, registered by name,
each loss with the dataclass of its own parameters (one small config per loss).

A config's fields are filled from the flat `[algorithm]` keys of the same name (the field
metadata `key` names the key where it differs: GSPO's `seq_clip_low` is `algorithm.gspo_clip_low`),
so experiment files keep their flat keys. The registrations import no torch: each function
imports its math (`losses`, `advantages`, `shaping`) when it is called.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollmesh.algorithms.registry import (
    register_advantage_estimator, register_policy_loss, register_reward_shaping,
)

if TYPE_CHECKING:
    from torch import Tensor

    from rollmesh.algorithms.losses import LossInputs

__all__ = [
    "CISPOConfig",
    "DecoupledPPOConfig",
    "GSPOConfig",
    "PPOConfig",
    "RewardShapingConfig",
    "TISConfig",
]

# -- policy losses -----------------------------------------------------------------------------

@dataclass
class PPOConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None


@dataclass
class DecoupledPPOConfig(PPOConfig):
    behaviour_cap: float | None = None
    behaviour_cap_mode: str = "truncate"


@dataclass
class TISConfig(PPOConfig):
    tis_cap: float = 2.0
    tis_surrogate: str = "ppo"


@dataclass
class GSPOConfig:
    seq_clip_low: float = field(default=3e-4, metadata={"key": "gspo_clip_low"})
    seq_clip_high: float = field(default=4e-4, metadata={"key": "gspo_clip_high"})


@dataclass
class CISPOConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2


@register_policy_loss("ppo", config=PPOConfig)
def ppo_policy_loss(x: LossInputs, cfg: PPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    from rollmesh.algorithms.losses import ppo_loss

    return ppo_loss(x.logprobs, x.old_logprobs, x.advantages, x.mask, cfg.clip_low,
                    cfg.clip_high, cfg.dual_clip, x.agg, **x.normalisers())


@register_policy_loss("decoupled_ppo", config=DecoupledPPOConfig, needs_behaviour=True)
def decoupled_ppo_policy_loss(x: LossInputs, cfg: DecoupledPPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    from rollmesh.algorithms.losses import decoupled_ppo_loss

    return decoupled_ppo_loss(
        x.logprobs, x.old_logprobs, x.behaviour_logprobs, x.advantages, x.mask, cfg.clip_low,
        cfg.clip_high, cfg.behaviour_cap, x.agg, behaviour_cap_mode=cfg.behaviour_cap_mode,
        dual_clip=cfg.dual_clip, **x.normalisers())


@register_policy_loss("tis", config=TISConfig, needs_behaviour=True)
def tis_policy_loss(x: LossInputs, cfg: TISConfig) -> tuple[Tensor, dict[str, Tensor]]:
    from rollmesh.algorithms.losses import tis_loss

    return tis_loss(x.logprobs, x.old_logprobs, x.behaviour_logprobs, x.advantages, x.mask,
                    cfg.tis_cap, cfg.clip_low, cfg.clip_high, cfg.dual_clip, x.agg,
                    surrogate=cfg.tis_surrogate, **x.normalisers())


@register_policy_loss("gspo", config=GSPOConfig)
def gspo_policy_loss(x: LossInputs, cfg: GSPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    from rollmesh.algorithms.losses import gspo_loss

    return gspo_loss(x.logprobs, x.old_logprobs, x.advantages, x.mask, cfg.seq_clip_low,
                     cfg.seq_clip_high, x.agg, **x.normalisers())


@register_policy_loss("cispo", config=CISPOConfig)
def cispo_policy_loss(x: LossInputs, cfg: CISPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    from rollmesh.algorithms.losses import cispo_loss

    return cispo_loss(x.logprobs, x.old_logprobs, x.advantages, x.mask, cfg.clip_low,
                      cfg.clip_high, x.agg, **x.normalisers())


# -- advantage estimators ----------------------------------------------------------------------
# Each takes every input `compute_advantages` passes (keyword-only) and uses those it needs.


def _group_inputs(kind: str, rewards: Tensor | None, group_index: Tensor | None) -> None:
    if rewards is None or group_index is None:
        raise ValueError(f"advantage {kind!r}: expected rewards and group_index")


@register_advantage_estimator("grpo", outcome=True)
def grpo(*, mask: Tensor, rewards: Tensor | None = None, group_index: Tensor | None = None,
         **_: Any) -> tuple[Tensor, None]:
    from rollmesh.algorithms.advantages import grpo_advantages

    _group_inputs("grpo", rewards, group_index)
    return grpo_advantages(rewards, group_index, mask, std_normalize=True), None


@register_advantage_estimator("grpo_mean_only", outcome=True)
def grpo_mean_only(*, mask: Tensor, rewards: Tensor | None = None,
                   group_index: Tensor | None = None, **_: Any) -> tuple[Tensor, None]:
    from rollmesh.algorithms.advantages import grpo_advantages

    _group_inputs("grpo_mean_only", rewards, group_index)
    return grpo_advantages(rewards, group_index, mask, std_normalize=False), None


@register_advantage_estimator("rloo", outcome=True)
def rloo(*, mask: Tensor, rewards: Tensor | None = None, group_index: Tensor | None = None,
         **_: Any) -> tuple[Tensor, None]:
    from rollmesh.algorithms.advantages import rloo_advantages

    _group_inputs("rloo", rewards, group_index)
    return rloo_advantages(rewards, group_index, mask), None


@register_advantage_estimator("reinforce_pp")
def reinforce_pp(*, mask: Tensor, rewards: Tensor | None = None,
                 token_rewards: Tensor | None = None, kl: Tensor | None = None,
                 kl_coef: float = 0.0, gamma: float = 1.0, **_: Any) -> tuple[Tensor, None]:
    from rollmesh.algorithms.advantages import reinforce_pp_advantages

    source = token_rewards if token_rewards is not None else rewards
    if source is None:
        raise ValueError("advantage 'reinforce_pp': expected rewards or token_rewards")
    return reinforce_pp_advantages(source, mask, kl, gamma, kl_coef=kl_coef), None


@register_advantage_estimator("gae", critic=True)
def gae(*, mask: Tensor, rewards: Tensor | None = None, token_rewards: Tensor | None = None,
        values: Tensor | None = None, kl: Tensor | None = None, kl_coef: float = 0.0,
        gamma: float = 1.0, lam: float = 1.0, whiten: bool = True,
        bootstrap: Tensor | None = None, **_: Any) -> tuple[Tensor, Tensor]:
    from rollmesh.algorithms.advantages import gae_advantages, kl_in_reward, last_masked_token

    if values is None or (token_rewards is None and rewards is None):
        raise ValueError("advantage 'gae': expected values and token_rewards (or rewards)")
    if token_rewards is None:
        token_rewards = last_masked_token(rewards, mask)
    if kl is not None:
        token_rewards = kl_in_reward(token_rewards, kl, kl_coef)
    return gae_advantages(token_rewards, values, mask, gamma, lam, whiten=whiten,
                          bootstrap=bootstrap)


# -- reward shaping ----------------------------------------------------------------------------

@dataclass
class RewardShapingConfig:
    scale: float = field(default=1.0, metadata={"key": "reward_scale"})
    clip: float | None = field(default=None, metadata={"key": "reward_clip"})
    overlong_buffer: int = 0
    overlong_max_tokens: int | None = None
    overlong_factor: float = field(default=1.0, metadata={"key": "overlong_penalty"})


@register_reward_shaping("default", config=RewardShapingConfig)
def default_shaping(rewards: Tensor, lengths: Tensor | None,
                    cfg: RewardShapingConfig) -> Tensor:
    """Scale, DAPO's overlong penalty, clip (`shape_rewards`); the rewards as they are with the
    defaults."""
    from rollmesh.algorithms.shaping import shape_rewards

    return shape_rewards(rewards, lengths, scale=cfg.scale, clip=cfg.clip,
                         overlong_buffer=cfg.overlong_buffer,
                         overlong_max_tokens=cfg.overlong_max_tokens,
                         overlong_factor=cfg.overlong_factor)
