"""A run that looks after itself: nobody types `--resume` after a trainer dies, a launcher that
dies takes every process with it, and a run that cannot progress stops with an error.

- kill -9 of the trainer: the launcher restarts it from its latest checkpoint (trainer.max_restarts),
  the lost steps are trained again on the same batches, the run finishes by itself (exit 0) and
  metrics.jsonl holds each step once;
- kill -9 of `rollmesh launch`: every role and engine exits within seconds, and
  `rollmesh launch --resume RUN` finishes the run with nothing lost or trained twice;
- the progress watchdog (rollmesh.launcher.watchdog): unit tests of its decision, and a run whose engines
  can never catch up (every sample stale) stopped with the cause named;
(`rollmesh stop RUN` through the launcher's control socket: tests/e2e/test_launcher.py.)
"""

from __future__ import annotations

import os
from pathlib import Path


from rollmesh.launcher.watchdog import Snapshot, stalled
from tests.e2e.test_launcher import (
    status,
)


def proc_of(run_dir: Path, name: str) -> dict:
    return next(p for p in status(run_dir).get("processes", []) if p["name"] == name)


def processes_of(run_dir: Path, needle: str | None = None) -> list[str]:
    """Every process on this machine whose command line names the run (its roles' spec
    files, its engines' key file, the ssh clients and the remote commands they started):
    its full path, or `needle` (a remote host's copy is under runs/<run name>)."""
    needle = needle or str(run_dir.resolve())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split()[2]
        except OSError:
            continue
        if needle in cmd and state != "Z":
            found.append(f"{entry.name}: {cmd[:200]}")
    return found


# -- the watchdog's decision ------------------------------------------------------------------


def snap(t: float, step: int, *, dropped: dict | None = None, generated: int = 0,
         engines: list | None = None, version: int | None = None, depth: int = 0) -> Snapshot:
    return Snapshot(t=t, trainer_step=step, trainer_version=step if version is None else version,
                    engine_versions=[0] if engines is None else engines,
                    dropped=dropped or {}, generated=generated, queue_depth=depth,
                    batch_samples=8)


def test_watchdog_names_engines_behind_and_every_sample_stale():
    history = [snap(t, 4, dropped={"stale": 10 * t}, generated=10 * t) for t in range(0, 65, 5)]
    error = stalled(history, 60)
    assert error is not None
    assert "trainer at step 4, version 4" in error and "engine 0 at version 0" in error, error
    assert "every sample stale (600 dropped)" in error, error
    assert "not at the trainer's version 4" in error, error
    assert stalled(history, 0) is None  # 0 disables it
    assert stalled(history[:-1], 60) is None  # 55 s without a step: not yet


def test_watchdog_says_nothing_generated_and_which_engine_is_down():
    history = [snap(t, 3, generated=40, engines=[None, 3]) for t in range(0, 100, 10)]
    for s in history:
        s.outstanding = 64  # asked for, never coming back
    error = stalled(history, 60)
    assert error is not None and "nothing generated" in error, error
    assert "engine 0 not answering" in error and "engine 1 at version 3" in error, error
    # nothing generated because nothing is asked for: rollout holds back at its staleness
    # bound while the trainer is on a long step (no batch waits: it took the only one)
    for s in history:
        s.outstanding = 0
    assert stalled(history, 60) is None


def test_watchdog_leaves_slow_but_working_runs_alone():
    # generating and queueing, nothing dropped, no step for long: slow generation, not a stall
    slow = [snap(t, 2, generated=t, engines=[2]) for t in range(0, 200, 10)]
    assert stalled(slow, 60) is None
    # dropping, but a batch waits in the queue: the trainer is busy on a long step
    busy = [snap(t, 2, dropped={"filtered": t}, generated=t, depth=16) for t in range(0, 200, 10)]
    assert stalled(busy, 60) is None
    # steps keep coming while samples are dropped: progress
    moving = [snap(t, t // 20, dropped={"stale": t}) for t in range(0, 200, 10)]
    assert stalled(moving, 60) is None
    # a trainer that does not answer is no evidence
    assert stalled([Snapshot(t=t, trainer_step=None) for t in range(0, 200, 10)], 60) is None


def test_watchdog_counts_only_the_window_since_the_last_step():
    # drops long ago (before the last step), none since, and samples still generated: no stall
    history = [snap(t, 1, dropped={"stale": 50}, generated=t) for t in range(0, 50, 10)]
    history += [snap(t, 2, dropped={"stale": 50}, generated=t) for t in range(50, 200, 10)]
    assert stalled(history, 60) is None
    history.append(snap(200, 2, dropped={"stale": 51, "generation_failed": 3}, generated=200))
    error = stalled(history, 60)
    assert error and "4 samples dropped (generation_failed 3, stale 1)" in error, error
    assert "no trainer step for 150s" in error, error


# -- end to end --------------------------------------------------------------------------------


