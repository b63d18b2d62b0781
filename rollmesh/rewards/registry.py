"""Finding reward functions by name, and checking what they return.

A reward function is `fn(response: str, label: Any, metadata: dict) -> float | dict`; a dict holds
`"reward"` (a number) and may add other plain-data fields, which travel on as the reward's info.
Functions are registered under the entry-point group `rollmesh.rewards`, or named directly as
`"module:function"` (a module importable where the function runs). A function may carry a
`warmup()` attribute (slow imports, caches): RewardSandbox runs it when a child loads the
function, outside the time limit of a call. A function that declares a parameter named
`trajectory` is called `fn(response, label, metadata, trajectory=view)` with the trajectory's
view (`rollmesh.rewards.trajectory`); the others as above.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

import msgpack

__all__ = [
    "ENTRY_POINT_GROUP",
    "RewardFn",
    "RewardOutputError",
    "UnknownRewardError",
    "available_rewards",
    "check_reward_output",
    "get_reward_fn",
    "wants_trajectory",
]

ENTRY_POINT_GROUP = "rollmesh.rewards"
RewardFn = Callable[[str, Any, dict], "float | dict[str, Any]"]


class UnknownRewardError(LookupError):
    """No reward function by that name (the message lists the available ones)."""

    def __str__(self) -> str:  # LookupError's str() would quote the message
        return str(self.args[0])


class RewardOutputError(TypeError):
    """A reward function returned something that is not a reward."""


def available_rewards() -> list[str]:
    """Names registered under the `rollmesh.rewards` entry-point group, sorted."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def get_reward_fn(name: str) -> RewardFn:
    """The reward function registered as `name`, or at `"module:function"`."""
    found = entry_points(group=ENTRY_POINT_GROUP).select(name=name)
    if found:
        fn = next(iter(found)).load()
    elif ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise UnknownRewardError(
                f"cannot load reward function {name!r}: {type(e).__name__}: {e}"
            ) from None
    else:
        raise UnknownRewardError(
            f"unknown reward function {name!r}; available: "
            f"{', '.join(available_rewards()) or 'none'} (entry points in group "
            f"'{ENTRY_POINT_GROUP}'), or give 'module:function'"
        )
    if not callable(fn):
        raise UnknownRewardError(f"reward function {name!r} is a {type(fn).__name__}, not callable")
    return fn


def wants_trajectory(fn: RewardFn) -> bool:
    """Whether `fn` declares a parameter named `trajectory` (positional-or-keyword or
    keyword-only): it is then given the trajectory's view."""
    try:
        param = inspect.signature(fn).parameters.get("trajectory")
    except (TypeError, ValueError):  # a callable whose signature Python cannot read
        return False
    return param is not None and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                 inspect.Parameter.KEYWORD_ONLY)


def check_reward_output(value: Any, name: str) -> tuple[float, dict[str, Any]]:
    """`(reward, info)` from what reward function `name` returned, or RewardOutputError: the
    reward must be a finite number, the info plain data (it crosses process boundaries)."""
    if isinstance(value, dict):
        if "reward" not in value:
            raise RewardOutputError(
                f"reward function {name!r} returned a dict without 'reward' "
                f"(keys: {', '.join(map(str, value)) or 'none'})"
            )
        reward, info = value["reward"], {k: v for k, v in value.items() if k != "reward"}
    else:
        reward, info = value, {}
    if not isinstance(reward, numbers.Real):
        raise RewardOutputError(
            f"reward function {name!r} returned {type(reward).__name__} {reward!r:.80}, "
            "expected a number or a dict with a numeric 'reward'"
        )
    reward = float(reward)
    if not math.isfinite(reward):
        raise RewardOutputError(f"reward function {name!r} returned a non-finite reward {reward}")
    try:
        msgpack.unpackb(msgpack.packb(info))  # the round trip also rejects non-string keys
    except (TypeError, ValueError, OverflowError) as e:
        raise RewardOutputError(
            f"reward function {name!r} returned info that is not plain data: {e}"
        ) from None
    return reward, info
