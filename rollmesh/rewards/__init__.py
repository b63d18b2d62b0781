"""Reward functions: the registry (entry-point group `rollmesh.rewards`), the built-in
functions, and `RewardSandbox`, which runs any of them in child processes under a time limit.

A reward function is `fn(response: str, label: Any, metadata: dict) -> float | dict`; a dict
holds `"reward"` and may add other plain-data fields (the reward's info). One that declares a
`trajectory` parameter also gets the trajectory's view (turns, tool calls:
`rollmesh.rewards.trajectory`).
"""

from rollmesh.rewards.builtin import (
    letter_share_reward,
    exact_match_reward,
    gsm8k_reward,
    make_remote_reward,
    remote_reward,
    tool_answer_reward,
)
from rollmesh.rewards.registry import (
    ENTRY_POINT_GROUP,
    RewardFn,
    RewardOutputError,
    UnknownRewardError,
    available_rewards,
    check_reward_output,
    get_reward_fn,
    wants_trajectory,
)
from rollmesh.rewards.sandbox import RewardResult, RewardSandbox

__all__ = [
    "ENTRY_POINT_GROUP",
    "RewardFn",
    "RewardOutputError",
    "RewardResult",
    "RewardSandbox",
    "UnknownRewardError",
    "available_rewards",
    "check_reward_output",
    "letter_share_reward",
    "exact_match_reward",
    "get_reward_fn",
    "gsm8k_reward",
    "make_remote_reward",
    "remote_reward",
    "tool_answer_reward",
    "wants_trajectory",
]
