"""Fault injection on real runs: `kill -9` of a role in the middle of `rollmesh launch`.

Workers, engines, the MessageQueue (its log), the rollouter (its journal) and the synchronizer
are restarted by the launcher and the run completes by itself; so is the trainer (from its latest
checkpoint, tests/unit/test_unattended.py). With trainer.max_restarts = 0 a trainer that dies stops
the run cleanly and `rollmesh launch --resume RUN` goes on from its latest checkpoint. In every case
the accounting identity holds and no group is trained on twice in the run's surviving history.
(The agent worker, the engine and the MessageQueue have their own kill tests in test_launcher.py
and test_message_queue.py.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_launcher import (
    ROOT, assert_nothing_trained_twice, check_accounting, finish, kill_and_await_restart, launch,
    metrics, rollmesh, status, trained_history, wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def proc_of(run_dir: Path, name: str) -> dict:
    return next(p for p in status(run_dir).get("processes", []) if p["name"] == name)


@pytest.mark.parametrize("victim", ["rollouter[0]",
                                    pytest.param("synchronizer[0]", marks=pytest.mark.long),
                                    pytest.param("reward_worker[0]", marks=pytest.mark.long)])
def test_killed_role_is_restarted_and_the_run_completes(tmp_path, victim):
    run_dir = tmp_path / "run"
    steps = 30
    proc = launch(run_dir, "--set", f"trainer.total_steps={steps}", "--set", "rollout.eval_every=0")
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 6, 300, "training under way", proc)
        kill_and_await_restart(run_dir, victim)
    finally:
        out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    summary = check_accounting(run_dir)
    assert summary["consumed"] == rows[-1]["samples_consumed"], summary
    assert_nothing_trained_twice(rows)
    assert proc_of(run_dir, victim)["restarts"] == 1
    if victim == "rollouter[0]":
        log = (run_dir / "logs" / "rollouter-0.log").read_text()
        restored = [json.loads(line) for line in log.splitlines() if '"restored"' in line]
        assert restored and restored[-1]["admitted"] > 0, "the new rollouter used the journal"


@pytest.mark.long
def test_killed_trainer_without_restarts_stops_the_run_and_resume_goes_on(tmp_path):
    run_dir = tmp_path / "run"
    steps = 24
    proc = launch(run_dir, "--set", f"trainer.total_steps={steps}", "--set", "trainer.max_restarts=0",
                  "--set", "trainer.checkpoint_every=4", "--set", "rollout.eval_every=0")
    try:
        # past a checkpoint, and not on one: some steps are lost with the trainer
        wait_for(lambda: len(metrics(run_dir)) >= 10 and len(metrics(run_dir)) % 4 != 0, 300,
                 "training past a checkpoint", proc)
        os.kill(proc_of(run_dir, "trainer[0]")["pid"], signal.SIGKILL)
    finally:
        out = finish(proc)
    assert proc.returncode == 1, out[-3000:]
    assert "trainer/0 exited with code -9" in status(run_dir)["failure"], status(run_dir)
    first = metrics(run_dir)
    died_at = first[-1]["step"]
    assert died_at < steps

    resumed = subprocess.Popen([sys.executable, "-m", "rollmesh", "launch", "--resume",
                                str(run_dir), "--quiet"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    out = finish(resumed)
    assert resumed.returncode == 0, out[-3000:]
    rows = metrics(run_dir)
    history = trained_history(rows)
    # each step once: the resumed trainer dropped the rows past its checkpoint and wrote them
    # again (a reader never sees two rows for one step)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert history == rows
    # it went on from the last checkpoint before the kill, not from scratch: the rows up to it
    # are the first launch's, untouched
    kept = (died_at // 4) * 4
    assert rows[:kept] == first[:kept], (died_at, kept)
    resumed_log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert f'"checkpoint_step": {kept}' in resumed_log and '"metrics_trimmed"' in resumed_log
    # the steps trained again were trained on the very same batches (the queue kept them)
    lost = {r["step"]: r for r in first if r["step"] > kept}
    for r in rows[kept:]:
        if r["step"] in lost:
            assert r["group_ids"] == lost[r["step"]]["group_ids"], r["step"]
    assert_nothing_trained_twice(rows)
    summary = check_accounting(run_dir)
    assert summary["consumed"] == history[-1]["samples_consumed"], summary
    assert rollmesh("status", str(run_dir)).returncode == 1  # not running any more


@pytest.mark.long
def test_roles_killed_while_starting_are_started_again(tmp_path):
    """kill -9 of the engine, then of the trainer, then of an agent worker, each as soon as the
    launcher spawned it and before it was ready (issue 34: an agent worker killed 3 s after its
    spawn failed the whole run): each is started again like one killed later (the trainer's
    ranks together, within trainer.max_restarts; the engine within engine.max_restarts), and
    the run finishes with everything accounted for. (A role that exits with an error while
    starting still fails the run at once: test_launcher.py's set-up failures.)"""
    run_dir = tmp_path / "run"
    steps = 4
    proc = launch(run_dir, "--set", f"trainer.total_steps={steps}", "--set", "rollout.eval_every=0")
    victims = ["engine[0]", "trainer[0]", "agent_worker[0]"]
    try:
        for name in victims:
            def spawned() -> dict | None:
                return next((p for p in status(run_dir).get("processes", [])
                             if p["name"] == name and p.get("pid")), None)

            wait_for(spawned, 300, f"{name}'s spawn", proc)
            victim = spawned()
            assert victim["state"] not in ("ready", "running"), victim  # still starting
            os.kill(victim["pid"], signal.SIGKILL)
    finally:
        out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, steps + 1))
    check_accounting(run_dir)
    assert [proc_of(run_dir, n)["restarts"] for n in victims] == [1, 1, 1]
    events = [json.loads(line) for line in (run_dir / "logs/launcher.log").open()
              if '"killed_while_starting"' in line]
    assert [(e["child"], e["exit_code"]) for e in events] == [(n, -9) for n in victims], events


@pytest.mark.long
def test_checkpoints_by_time_so_a_dead_trainer_loses_seconds_not_the_run(tmp_path):
    """trainer.checkpoint_every_s (300 s by default; 3 s here) with no step-based checkpoints:
    a checkpoint comes by time alone, only the latest two stay on disk, and a trainer killed
    with kill -9 past it goes on from it (not from step 0), with one metrics row per step."""
    run_dir = tmp_path / "run"
    steps = 18
    proc = launch(run_dir, "--set", f"trainer.total_steps={steps}",
                  "--set", "trainer.checkpoint_every_s=3", "--set", "rollout.eval_every=0")
    latest = run_dir / "checkpoints" / "latest"

    def past_a_checkpoint() -> int | None:  # its step, once two steps were trained after it
        if not latest.is_file():
            return None
        step = int(latest.read_text().strip().removeprefix("step_"))
        return step if len(metrics(run_dir)) >= step + 2 and step < steps - 4 else None

    try:
        saved_at = wait_for(past_a_checkpoint, 300, "a checkpoint by time and steps after it",
                            proc)
        kill_and_await_restart(run_dir, "trainer[0]")
    finally:
        out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert_nothing_trained_twice(rows)
    check_accounting(run_dir)
    events = [json.loads(line) for line in (run_dir / "logs/trainer-0.log").open()
              if line.startswith("{")]
    resumed = [e["step"] for e in events if e["event"] == "resumed"]
    # from the checkpoint taken by time (or a later one, taken before the kill landed)
    assert resumed and resumed[-1] >= saved_at >= 1, (resumed, saved_at)
    saved = [e["step"] for e in events if e["event"] == "checkpoint_saved"]
    assert saved[-1] == steps and len(saved) >= 2, saved  # by time, then at the end
    assert len(list((run_dir / "checkpoints").glob("step_*"))) == 2  # trainer.keep_checkpoints
