"""Power cuts (issue 34): every process of a run killed at once, then `rollmesh launch --resume`.

`launch/local.toml` with a checkpoint every 3 s is cut five times, at moments drawn at random
and at two chosen ones: while a checkpoint is being written (its temporary directory exists)
and while a weight sync is in progress (the synchronizer paused rollout and has not finished).
Each time the launcher and all its descendants are frozen (SIGSTOP) and then killed (SIGKILL),
so that no process outlives another by more than the kill loop, and the run is resumed. At the
end: the run finished by itself, one metrics row per step, no group trained twice, the
accounting identity exact, every trained batch within the staleness rule (the rewind: before
it, groups regenerated after a cut by engines at the initial weights were trained past the
bound), and nothing dropped as stale."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_launcher import (
    ROOT, assert_nothing_trained_twice, assert_staleness_rule, check_accounting, finish, launch,
    metrics, trained_history, wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

STEPS = 220


def descendants(root: int) -> list[int]:
    """`root` and every process below it (by parent pid, whatever their sessions)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def cut(proc: subprocess.Popen) -> int:
    """The power cut: freeze the launcher and everything below it, then kill them all."""
    frozen: set[int] = set()
    for _ in range(3):  # a process forked while the others froze is caught by the next pass
        for pid in descendants(proc.pid):
            if pid not in frozen:
                frozen.add(pid)
                with_pid(pid, signal.SIGSTOP)
    for pid in frozen:
        with_pid(pid, signal.SIGKILL)
    proc.wait(timeout=60)
    return len(frozen)


def with_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def last_event(log: Path) -> str | None:
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        if line.startswith("{") and line.endswith("}"):
            return json.loads(line).get("event")
    return None


def resume(run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rollmesh", "launch", "--resume",
                             str(run_dir), "--quiet"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.long
def test_five_power_cuts_at_random_moments_lose_nothing_and_train_nothing_twice(tmp_path):
    run_dir = tmp_path / "run"
    rng = random.Random(34)
    checkpoints = run_dir / "checkpoints"
    proc = launch(run_dir, "--set", f"trainer.total_steps={STEPS}",
                  "--set", "trainer.checkpoint_every_s=3", "--set", "rollout.eval_every=0")
    moments = ["random", "checkpoint", "random", "sync", "random"]
    cuts = []
    try:
        for moment in moments:
            start = len(metrics(run_dir))
            # some progress first (rows may have been cut back to the checkpoint)
            wait_for(lambda: len(metrics(run_dir)) >= min(start + 3, STEPS - 60), 300,
                     "training after the resume", proc)
            if moment == "random":
                time.sleep(rng.uniform(0.5, 6.0))
            else:
                def at_the_moment() -> bool:
                    if moment == "checkpoint":
                        return any(p.name.startswith(".tmp-step_") for p in
                                   checkpoints.glob(".tmp-*")) if checkpoints.is_dir() else False
                    return last_event(run_dir / "logs" / "synchronizer-0.log") == "sync_paused"

                deadline = time.monotonic() + 120
                while not at_the_moment():
                    assert time.monotonic() < deadline, f"never saw a {moment} in progress"
                    assert proc.poll() is None, finish(proc)[-3000:]
                    time.sleep(0.002)
            rows = len(metrics(run_dir))
            assert rows < STEPS, "the run ended before the cut: raise STEPS"
            killed = cut(proc)
            cuts.append({"moment": moment, "rows": rows, "processes": killed})
            proc = resume(run_dir)
    finally:
        out = finish(proc, timeout_s=900)
    assert proc.returncode == 0, out[-3000:]
    assert all(c["processes"] >= 9 for c in cuts), cuts  # the launcher and every role
    rows = metrics(run_dir)
    history = trained_history(rows)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), cuts
    assert history == rows
    assert_nothing_trained_twice(rows)
    summary = check_accounting(run_dir)
    assert summary["consumed"] == history[-1]["samples_consumed"], summary
    assert_staleness_rule(rows, summary)  # nothing dropped as stale, every batch in the rule
    trainer_log = [json.loads(line) for line in (run_dir / "logs/trainer-0.log").open()
                   if line.startswith("{")]
    resumed = [e for e in trainer_log if e["event"] == "resumed"]
    assert len(resumed) >= 3, resumed  # most cuts came after a checkpoint: not from step 0
    print(json.dumps({"cuts": cuts, "dropped": summary["dropped"],
                      "resumed_at": [e["step"] for e in resumed]}))
