"""Trajectories as token rows: how one is built from a prompt and grown, and the tokenizer.

A `messages.Trajectory` is one row of tokens (the prompt, then generated tokens with mask 1 and
observation tokens with mask 0) with, per token, the behaviour log-prob and the weight version
that produced it (-1: not generated). This module owns the helpers every role uses on that row,
so that the rollouter, the reward worker and the agent loops share them without importing one
another: `new_trajectory` (a prompt's row), `append_tokens` / `append_observation` (growing it)
and `load_tokenizer` (the experiment's tokenizer, which made the row's tokens). It also holds the
staleness rule, once, for the rollouter, the MessageQueue and the trainer: `oldest_version` (of
a trajectory or a group), `staleness` (how many versions old at a given version) and `is_stale`
(past `max_staleness`); and the other age every role reports beside it, `admission_age` (how
many versions ago its generation was admitted: what `staleness.measure = "admission"` bounds).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rollmesh.config import ModelConfig
from rollmesh.wire.messages import Group, Trajectory

__all__ = ["admission_age", "append_observation", "append_tokens", "is_stale", "load_tokenizer",
           "new_trajectory", "oldest_version", "staleness"]


def new_trajectory(sample_id: str, group_id: str, index: int, prompt_ids: list[int], *,
                   agent_loop: str, label: Any = None, metadata: dict[str, Any] | None = None,
                   loop_state: dict[str, Any] | None = None) -> Trajectory:
    n = len(prompt_ids)
    return Trajectory(
        sample_id=sample_id, group_id=group_id, index=index,
        token_ids=np.asarray(prompt_ids, dtype=np.int32), logprobs=np.zeros(n, np.float32),
        versions=np.full(n, -1, np.int32), loss_mask=np.zeros(n, np.uint8), prompt_len=n,
        agent_loop=agent_loop, label=label, metadata=metadata or {},
        loop_state=loop_state or {},
    )


def append_tokens(traj: Trajectory, ids: list[int], logprobs: list[float] | None,
                  version: int | Sequence[int]) -> None:
    """Append tokens; `version` is one version for all of them or one per token."""
    n = len(ids)
    generated = logprobs is not None
    traj.token_ids = np.concatenate([traj.token_ids, np.asarray(ids, np.int32)])
    traj.logprobs = np.concatenate(
        [traj.logprobs, np.asarray(logprobs if generated else np.zeros(n), np.float32)])
    if not generated:
        versions = np.full(n, -1, np.int32)
    elif isinstance(version, (int, np.integer)):
        versions = np.full(n, version, np.int32)
    else:
        versions = np.asarray(version, np.int32)
        if versions.shape != (n,):
            raise ValueError(f"{versions.size} weight versions for {n} tokens")
    traj.versions = np.concatenate([traj.versions, versions])
    traj.loss_mask = np.concatenate([traj.loss_mask, np.full(n, int(generated), np.uint8)])


def oldest_version(item: Trajectory | Group, *, strict: bool = False) -> int | None:
    """The oldest weight version among the generated tokens of a trajectory, or of every
    trajectory of a group (None: nothing generated yet). Versions that are not integers count
    as nothing generated, or with `strict` raise ValueError (the MessageQueue refuses such a
    group at the put). One pass over each row, without a copy."""
    oldest = None
    for t in item.trajectories if isinstance(item, Group) else (item,):
        v = t.versions
        kind = v.dtype.kind
        if kind not in "iu":
            if strict:
                raise ValueError(f"group {item.group_id!r}: trajectory {t.sample_id!r} has versions "
                                 f"of {v.dtype.name}, expected integers")
            continue
        if v.size:
            if kind == "i":
                # the smallest version >= 0 (-1: prompt tokens) in one pass, without a copy:
                # seen unsigned, a negative number is above every non-negative one
                low = int(v.view(v.dtype.byteorder + "u" + str(v.dtype.itemsize)).min())
                if low >= 1 << (8 * v.dtype.itemsize - 1):
                    continue  # every token negative: nothing generated
            else:
                low = int(v.min())
            oldest = low if oldest is None else min(oldest, low)
    return oldest


def staleness(oldest: Any, version: Any) -> Any:
    """The staleness rule, the one every role applies: a sample (or group) whose oldest
    generated token came from weight version `oldest` is `version - oldest` versions stale when
    trained at `version`; 0 when nothing was generated (`oldest` None). Works on ints and,
    elementwise, on tensors or arrays (where the caller marks "nothing generated" itself)."""
    return 0 if oldest is None else version - oldest


def admission_age(version_admitted: Any, version: Any) -> Any:
    """How many versions before `version` a group was admitted (its generation began at
    `version_admitted` or later): never less than its `staleness` but for tokens an engine
    behind the others made. Works on ints and, elementwise, on tensors or arrays."""
    return version - version_admitted


def is_stale(oldest: int | None, version: int, max_staleness: int) -> bool:
    """Past the bound: it may not be trained at `version` (`staleness` > max_staleness)."""
    return staleness(oldest, version) > max_staleness


def group_origin(group_id: str) -> int:
    """The rollout shard a group id comes from: `s<i>-...` is shard i's
    (rollout.data.PromptSource), any other id (one rollouter) shard 0's."""
    head, _, rest = group_id.partition("-")
    if rest and len(head) > 1 and head[0] == "s" and head[1:].isdigit():
        return int(head[1:])
    return 0


def append_observation(traj: Trajectory, ids: list[int]) -> None:
    """Tool, environment or template tokens: in the context, not in the loss."""
    append_tokens(traj, ids, None, -1)


def load_tokenizer(model: ModelConfig | str) -> Any:
    """The tokenizer of `[model]`: `model.tokenizer_path` when set, else tiny's built-in one or
    the checkpoint's own; `model.trust_remote_code` lets a checkpoint's tokenizer code run. A
    bare string is a model path with the defaults."""
    from rollmesh.models.loading import load_tokenizer as load

    if isinstance(model, str):
        return load(model)
    return load(model.tokenizer_path or model.path, trust_remote_code=model.trust_remote_code)
