"""Samples are checked where they enter: a trajectory back from an agent worker (the rollouter),
a group put to the MessageQueue, a batch the trainer is about to train on.

An agent loop is user code and its tokens come from a model: a token id past the vocabulary, rows
of different lengths, a weight version from the future or a reward that is not a number would
crash the trainer (an `IndexError` in the embedding) or poison a step. Such a sample is dropped
with the reason `invalid` (counted and logged with where it came from by the caller); it never
trains and never crashes a role. `invalid_reason` says what is wrong with one trajectory (None:
nothing), `invalid_group_reason` with a group; `vocabulary_size` is the bound on token ids a
model's rows may hold.

What is checked, each a cheap pass over the row's arrays:
- the four per-token arrays are 1-D, of one length, of the expected kinds (integer ids, versions
  and mask; floating log-probs);
- token ids in [0, vocab_size) (vocab_size None: only >= 0, where the vocabulary is not known);
- the loss mask 0 or 1, the prompt length within the row, no mask 1 on the prompt;
- versions -1 (not generated) or in [0, max_version] (None: no upper bound);
- log-probs of generated tokens not NaN and not above 0 (a probability is at most 1);
- the reward, when `scored`, a finite number.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from rollmesh.wire.messages import Group, Trajectory

__all__ = ["INVALID", "invalid_group_reason", "invalid_reason", "vocabulary_size"]

INVALID = "invalid"  # the drop reason
_ARRAYS = (("token_ids", "iu"), ("logprobs", "f"), ("versions", "iu"), ("loss_mask", "iub"))
_LOGPROB_SLACK = 1e-3  # float rounding of a log-prob that is 0 (probability 1)


def invalid_reason(traj: Trajectory, *, vocab_size: int | None = None,
                   max_version: int | None = None, scored: bool = False) -> str | None:
    """What is wrong with `traj` (one sentence naming the field), or None."""
    n = None
    for name, kinds in _ARRAYS:
        a = getattr(traj, name)
        if not isinstance(a, np.ndarray):
            return f"{name} is a {type(a).__name__}, not an array"
        if a.ndim != 1:
            return f"{name} has {a.ndim} dimensions, expected 1"
        if a.dtype.kind not in kinds:
            return f"{name} is of {a.dtype.name}"
        if n is None:
            n = a.size
        elif a.size != n:
            return f"{name} holds {a.size} values for {n} tokens"
    assert n is not None
    ids, logprobs, versions, mask = traj.token_ids, traj.logprobs, traj.versions, traj.loss_mask
    if n:
        low, high = int(ids.min()), int(ids.max())
        if low < 0:
            return f"token id {low} is negative"
        if vocab_size is not None and high >= vocab_size:
            return f"token id {high} is outside the vocabulary ({vocab_size} ids)"
        if int(mask.max()) > 1 or int(mask.min()) < 0:
            return "loss_mask holds values other than 0 and 1"
        vlow, vhigh = int(versions.min()), int(versions.max())
        if vlow < -1:
            return f"weight version {vlow} (expected -1 or a version)"
        if max_version is not None and vhigh > max_version:
            return f"weight version {vhigh} is in the future (latest {max_version})"
        generated = mask.astype(bool)
        if generated.any():
            lp = logprobs[generated]
            if np.isnan(lp).any():
                return "a generated token's log-prob is NaN"
            if float(lp.max()) > _LOGPROB_SLACK:
                return f"a generated token's log-prob is {float(lp.max())} > 0"
    if not isinstance(traj.prompt_len, int) or not 0 <= traj.prompt_len <= n:
        return f"prompt_len {traj.prompt_len!r} is not within the row's {n} tokens"
    if traj.prompt_len and int(mask[:traj.prompt_len].max()) != 0:
        return "the loss mask covers prompt tokens"
    if scored:
        r = traj.reward
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
            return f"reward {r!r} is not a finite number"
    return None


def invalid_group_reason(group: Group, *, vocab_size: int | None = None,
                         max_version: int | None = None) -> str | None:
    """What is wrong with a scored group (naming the sample), or None."""
    if not group.trajectories:
        return "the group holds no trajectory"
    if max_version is not None and group.version_admitted > max_version:
        return (f"admitted at version {group.version_admitted}, which is in the future "
                f"(latest {max_version})")
    for t in group.trajectories:
        why = invalid_reason(t, vocab_size=vocab_size, max_version=max_version, scored=True)
        if why is not None:
            return f"sample {t.sample_id!r}: {why}"
    return None


def vocabulary_size(model_path: str | None, tokenizer: Any) -> int:
    """The number of token ids a row of this model may hold: the checkpoint's `vocab_size`
    (its embedding's rows, often padded past the tokenizer's: the trainer indexes that), else
    the tokenizer's length (a tiny model's embedding has exactly that many rows)."""
    n = len(tokenizer)
    if model_path:
        try:
            config = json.loads((Path(model_path) / "config.json").read_text())
        except (OSError, ValueError):
            return n
        for c in (config, config.get("text_config") or {}):
            v = c.get("vocab_size") if isinstance(c, dict) else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return n
