"""Reward shaping before the advantage: scale, DAPO's overlong penalty, clip.

Shapes: `rewards` [B] (one score per sequence), `lengths` [B] (the response's generated tokens).
float32 in and out. Responses cut off by the length limit can also leave the loss altogether
(`algorithm.mask_truncated`, DAPO's overlong filtering); that is a mask, applied by the trainer.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["overlong_penalty", "shape_rewards"]


def overlong_penalty(lengths: Tensor, max_tokens: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO"; verl's DAPO reward
    manager): 0 up to max_tokens - buffer, then falling linearly to -factor at max_tokens.

        p(L) = clip(((max_tokens - buffer) - L) / buffer * factor, -factor, 0)

    A response longer than max_tokens (several turns) gets -factor, not less.
    """
    if buffer <= 0 or buffer > max_tokens:
        raise ValueError(f"overlong buffer: expected 0 < buffer <= max_tokens ({max_tokens}), "
                         f"got {buffer}")
    excess = lengths.float() - (max_tokens - buffer)
    return (-excess / buffer * factor).clamp(min=-factor, max=0.0)


def shape_rewards(
    rewards: Tensor, lengths: Tensor | None = None, *, scale: float = 1.0,
    clip: float | None = None, overlong_buffer: int = 0, overlong_max_tokens: int | None = None,
    overlong_factor: float = 1.0,
) -> Tensor:
    """The reward the advantage sees, per sequence:

        r' = clip(scale * r + p(L), -clip, clip)

    p = overlong_penalty (only with overlong_buffer > 0, which needs `lengths` and
    `overlong_max_tokens`); clip=None: no clip. The defaults return the rewards unchanged.
    """
    shaped = rewards.float()
    if scale != 1.0:
        shaped = shaped * scale
    if overlong_buffer > 0:
        if lengths is None or overlong_max_tokens is None:
            raise ValueError("overlong penalty: expected the response lengths and max tokens")
        shaped = shaped + overlong_penalty(lengths, overlong_max_tokens, overlong_buffer,
                                           overlong_factor)
    if clip is not None:
        shaped = shaped.clamp(-clip, clip)
    return shaped
