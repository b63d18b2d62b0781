"""Training math as pure functions on torch tensors: reward shaping, advantages, KL, policy and
value losses, loss aggregation, log-probs and entropy from logits, the learning-rate schedule;
and the registries of policy losses, advantage estimators and reward shapings
(`rollmesh.algorithms.registry`, the built-ins in `rollmesh.algorithms.builtin`).

Conventions: B sequences padded to T tokens, [B, T] tensors, `mask` [B, T] = 1 on the tokens
that count in the loss (generated tokens); float32 math whatever the input dtype.

The names below are imported on first use (PEP 562), so that `rollmesh.algorithms.registry`,
which the config reads its allowed values from, can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "rollmesh.algorithms.advantages": (
        "KL_ESTIMATORS", "compute_advantages", "gae_advantages", "grpo_advantages",
        "kl_estimate", "kl_in_reward", "reinforce_pp_advantages", "rloo_advantages",
    ),
    "rollmesh.algorithms.logits": ("entropy_from_logits", "token_logprobs"),
    "rollmesh.algorithms.losses": (
        "AGG_MODES", "LossInputs", "aggregate", "cispo_loss", "decoupled_ppo_loss", "gspo_loss",
        "policy_loss", "ppo_loss", "tis_loss", "value_loss",
    ),
    "rollmesh.algorithms.registry": (
        "advantage_estimators", "policy_losses", "register_advantage_estimator",
        "register_policy_loss", "register_reward_shaping", "reward_shapings",
    ),
    "rollmesh.algorithms.schedule": ("LR_SCHEDULES", "lr_lambda"),
    "rollmesh.algorithms.shaping": ("overlong_penalty", "shape_rewards"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
