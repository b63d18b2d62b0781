"""The launcher's progress watchdog: a run that cannot make progress must not look alive.

Every few seconds the launcher takes a `Snapshot` of the run (the trainer's step and version,
each engine's weight version, the samples dropped by reason, the samples generated, the
MessageQueue's depth) and hands the recent ones to `stalled`, a pure function: it answers
None (the run moves, or is slow but working) or the error that stops the run, naming the
cause, e.g.

    no trainer step for 600s (trainer at step 4, version 4; engine 0 at version 0):
    every sample stale (6096 dropped: stale 6096)

It fires only when all of these hold:
- the trainer's step has not changed for `timeout_s` (0: never fires);
- the MessageQueue holds less than one batch (the trainer is starved, not busy on a long step);
- over that same window samples were dropped, or none were generated while some were asked
  for (admitted, not generated yet).
A run whose generation is slow but succeeds (samples reach the queue, none dropped) is slow,
not stuck; one whose rollout holds back at its staleness bound while the trainer is on a long
step is busy: the watchdog leaves both alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Snapshot:
    t: float  # time.monotonic() when taken
    trainer_step: int | None  # None: the trainer did not answer
    trainer_version: int | None = None
    engine_versions: list[int | None] = field(default_factory=list)  # None: not answering
    dropped: dict[str, int] = field(default_factory=dict)  # cumulative, by reason
    generated: int | None = None  # cumulative samples generated and queued (None: unknown)
    queue_depth: int | None = None  # samples the MessageQueue holds ready
    batch_samples: int = 1  # samples in one trainer batch
    outstanding: int | None = None  # samples admitted and not generated yet (None: unknown)


def _version(v: object) -> int | None:
    try:
        return int(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def stalled(history: list[Snapshot], timeout_s: float) -> str | None:
    """The error that stops the run, or None. `history`: snapshots oldest first (the caller
    keeps at least `timeout_s` of them; older ones are ignored)."""
    if timeout_s <= 0 or not history:
        return None
    now = history[-1]
    if now.trainer_step is None:
        return None
    # the oldest snapshot since which the step has not changed
    since = now
    for snap in reversed(history):
        if snap.trainer_step is None:
            continue
        if snap.trainer_step != now.trainer_step:
            break
        since = snap
    if now.t - since.t < timeout_s:
        return None
    if now.queue_depth is not None and now.queue_depth >= now.batch_samples:
        return None  # a batch is waiting for the trainer: busy (a long step), not starved
    # the window: the newest snapshot at least timeout_s old (and at the current step)
    base = since
    for snap in history:
        if snap.t > now.t - timeout_s:
            break
        if snap.t >= since.t:
            base = snap
    dropped = {k: v - base.dropped.get(k, 0) for k, v in now.dropped.items()
               if v - base.dropped.get(k, 0) > 0}
    n_dropped = sum(dropped.values())
    generated = (now.generated - base.generated
                 if now.generated is not None and base.generated is not None else None)
    if n_dropped == 0 and (generated is None or generated > 0):
        return None
    if n_dropped == 0 and now.outstanding == 0:
        return None  # nothing asked for: rollout holds back (the bound), the trainer is busy
    where = [f"trainer at step {now.trainer_step}"
             + (f", version {now.trainer_version}" if now.trainer_version is not None else "")]
    for i, v in enumerate(now.engine_versions):
        where.append(f"engine {i} not answering" if v is None else f"engine {i} at version {v}")
    behind = [i for i, v in enumerate(now.engine_versions)
              if v is not None and now.trainer_version is not None and v != now.trainer_version]
    if n_dropped:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(dropped.items(), key=lambda kv: -kv[1]))
        if len(dropped) == 1:
            what = f"every sample {next(iter(dropped))} ({n_dropped} dropped)"
        else:
            what = f"{n_dropped} samples dropped ({reasons})"
        if generated is not None:
            what += f", {generated} generated and queued"
    else:
        what = "nothing generated"
    if behind and now.engine_versions:
        what += (f"; engine(s) {', '.join(map(str, behind))} not at the trainer's version "
                 f"{now.trainer_version}")
    if all(v is None for v in now.engine_versions) and now.engine_versions:
        what += "; no engine answering"
    return (f"no trainer step for {now.t - since.t:.0f}s ({'; '.join(where)}): {what} "
            f"(trainer.progress_timeout_s={timeout_s:g})")
