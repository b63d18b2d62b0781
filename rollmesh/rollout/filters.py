"""Group filters: which scored groups go to the trainer (`rollout.group_filter`).

A filter is a function of a whole scored `Group` that returns whether to keep it; a group it
rejects is dropped as `filtered` and frees its place under the staleness bound. rollmesh's own
are `none` (`keep_all`) and `dapo` (`dapo_filter`); others are registered under the entry-point
group `rollmesh.group_filters`.
"""

from __future__ import annotations

import importlib.metadata
from typing import Callable

from rollmesh.wire.messages import Group

__all__ = ["dapo_filter", "get_group_filter", "keep_all"]


def keep_all(group: Group) -> bool:
    return True


def dapo_filter(group: Group) -> bool:
    """DAPO's dynamic sampling: a group whose rewards are all equal carries no signal."""
    rewards = {t.reward for t in group.trajectories}
    return len(rewards) > 1


def get_group_filter(name: str) -> Callable[[Group], bool]:
    filters: dict[str, Callable[[Group], bool]] = {"none": keep_all, "dapo": dapo_filter}
    for ep in importlib.metadata.entry_points(group="rollmesh.group_filters"):
        filters[ep.name] = ep.load()
    if name not in filters:
        raise KeyError(f"unknown group filter {name!r} (known: {', '.join(sorted(filters))})")
    return filters[name]
