"""Training math as pure functions on torch tensors: reward shaping, advantages, KL, policy and
value losses, loss aggregation, log-probs and entropy from logits, the learning-rate schedule.

Conventions: B sequences padded to T tokens, [B, T] tensors, `mask` [B, T] = 1 on the tokens
that count in the loss (generated tokens); float32 math whatever the input dtype.
"""

from rollmesh.algorithms.advantages import (
    ADVANTAGE_KINDS,
    KL_ESTIMATORS,
    compute_advantages,
    gae_advantages,
    grpo_advantages,
    kl_estimate,
    kl_in_reward,
    reinforce_pp_advantages,
    rloo_advantages,
)
from rollmesh.algorithms.logits import entropy_from_logits, token_logprobs
from rollmesh.algorithms.losses import (
    AGG_MODES,
    POLICY_LOSSES,
    aggregate,
    cispo_loss,
    decoupled_ppo_loss,
    gspo_loss,
    policy_loss,
    ppo_loss,
    tis_loss,
    value_loss,
)
from rollmesh.algorithms.schedule import LR_SCHEDULES, lr_lambda
from rollmesh.algorithms.shaping import overlong_penalty, shape_rewards

__all__ = [
    "ADVANTAGE_KINDS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "LR_SCHEDULES",
    "POLICY_LOSSES",
    "aggregate",
    "cispo_loss",
    "compute_advantages",
    "decoupled_ppo_loss",
    "entropy_from_logits",
    "gae_advantages",
    "grpo_advantages",
    "gspo_loss",
    "kl_estimate",
    "kl_in_reward",
    "lr_lambda",
    "overlong_penalty",
    "policy_loss",
    "ppo_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "shape_rewards",
    "token_logprobs",
    "tis_loss",
    "value_loss",
]
