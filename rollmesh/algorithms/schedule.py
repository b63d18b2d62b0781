"""Learning-rate multipliers for torch.optim.lr_scheduler.LambdaLR."""

from __future__ import annotations

import math

__all__ = ["LR_SCHEDULES", "lr_lambda"]

LR_SCHEDULES = ("constant", "cosine")


def lr_lambda(
    step: int, warmup_steps: int, total_steps: int, schedule: str = "constant", *,
    min_ratio: float = 0.0,
) -> float:
    """Multiplier of the peak learning rate at optimiser step `step` (0-based).

        warm-up:      (step + 1) / warmup_steps    while step < warmup_steps (step 0 moves)
        constant:     1
        cosine:       min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2,
                      p = clamp((step - warmup_steps) / (total_steps - warmup_steps), 0, 1)
    so cosine is 1 right after warm-up and min_ratio from total_steps on.
    Use: LambdaLR(opt, functools.partial(lr_lambda, warmup_steps=w, total_steps=n, schedule=s)).
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule: expected one of {LR_SCHEDULES}, got {schedule!r}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(max((step - warmup_steps) / max(1, total_steps - warmup_steps), 0.0), 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
