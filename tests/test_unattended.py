"""A run that looks after itself: nobody types `--resume` after a trainer dies, a launcher that
dies takes every process with it, and a run that cannot progress stops with an error.

- kill -9 of the trainer: the launcher restarts it from its latest checkpoint (trainer.max_restarts),
  the lost steps are trained again on the same batches, the run finishes by itself (exit 0) and
  metrics.jsonl holds each step once;
- kill -9 of `rollmesh launch`: every role and engine exits within seconds, and
  `rollmesh launch --resume RUN` finishes the run with nothing lost or trained twice;
- the progress watchdog (rollmesh.launcher.watchdog): unit tests of its decision, and a run whose engines
  can never catch up (every sample stale) stopped with the cause named;
(`rollmesh stop RUN` through the launcher's control socket: tests/test_launcher.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollmesh.launcher.watchdog import Snapshot, stalled
from tests.helpers.sshd import Sshd
from tests.test_launcher import (
    ROOT, alive, assert_nothing_trained_twice, check_accounting, finish, launch, metrics,
    status, wait_for,
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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_trainer_is_restarted_by_the_launcher_and_the_run_finishes(tmp_path):
    run_dir = tmp_path / "run"
    steps = 16
    proc = launch(run_dir, "--set", f"trainer.total_steps={steps}",
                  "--set", "trainer.checkpoint_every=4", "--set", "rollout.eval_every=0")
    try:
        # past a checkpoint, and not on one: some steps are lost with the trainer
        wait_for(lambda: len(metrics(run_dir)) >= 6 and len(metrics(run_dir)) % 4 != 0, 300,
                 "training past a checkpoint", proc)
        before = metrics(run_dir)
        killed_at = time.monotonic()
        os.kill(proc_of(run_dir, "trainer[0]")["pid"], signal.SIGKILL)
        died_at = before[-1]["step"]
        resumed_from = (died_at // 4) * 4
        # the restarted trainer trims the lost rows, then writes the step after its checkpoint
        wait_for(lambda: proc_of(run_dir, "trainer[0]")["restarts"] == 1, 120,
                 "the trainer's restart", proc)
        old_row = next(r for r in before if r["step"] == resumed_from + 1)

        def retrained() -> bool:  # the row of the first lost step, written anew (its timings
            rows = metrics(run_dir)  # differ from the first one's)
            return any(r["step"] == resumed_from + 1 and r != old_row for r in rows)

        wait_for(retrained, 300, "a step trained by the restarted trainer", proc)
        recovered_s = time.monotonic() - killed_at
    finally:
        out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), "each step once, in order"
    # the steps trained again were trained on the very same batches (the queue kept them)
    for r in rows:
        lost = next((b for b in before if b["step"] == r["step"] and b["step"] > resumed_from),
                    None)
        if lost is not None:
            assert r["group_ids"] == lost["group_ids"], r["step"]
    assert_nothing_trained_twice(rows)
    summary = check_accounting(run_dir)
    assert summary["consumed"] == rows[-1]["samples_consumed"], summary
    assert proc_of(run_dir, "trainer[0]")["restarts"] == 1 and summary["trainer_restarts"] == 1
    # (the console's event line is hidden under --quiet; the launcher's log has the restart)
    restarts = [json.loads(line) for line in (run_dir / "logs/launcher.log").open()
                if '"trainer_restart"' in line]
    assert [(r["restart"], r["of"]) for r in restarts] == [(1, 3)], restarts
    assert f"{run_dir}/logs/trainer-0.log" in out  # the dead rank's log tail was shown
    print(f"\nrecovery: kill -9 of the trainer at step {died_at} -> step {resumed_from + 1} "
          f"trained again after {recovered_s:.1f}s")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_launcher_takes_every_process_with_it_and_resume_goes_on(tmp_path):
    run_dir = tmp_path / "run"
    steps = 14
    proc = launch(run_dir, "--set", f"trainer.total_steps={steps}",
                  "--set", "trainer.checkpoint_every=4", "--set", "rollout.eval_every=0")
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 6, 300, "training under way", proc)
        procs = status(run_dir)["processes"]
        pids = {p["name"]: p["pid"] for p in procs}
        assert "engine[0]" in pids and len(pids) == 8 and all(alive(p) for p in pids.values())
        assert len(processes_of(run_dir)) >= 8
        killed_at = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_for(lambda: not any(alive(p) for p in pids.values()) and not processes_of(run_dir),
                 30, "every role and engine to exit")
        gone_s = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    first = metrics(run_dir)
    resumed = subprocess.Popen([sys.executable, "-m", "rollmesh", "launch", "--resume",
                                str(run_dir), "--quiet"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    out = finish(resumed)
    assert resumed.returncode == 0, out[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), "each step once, in order"
    kept = (first[-1]["step"] // 4) * 4
    assert rows[:kept] == first[:kept]  # the checkpointed history is untouched
    for r in rows:  # the steps trained again: on the same batches
        lost = next((b for b in first if b["step"] == r["step"] and b["step"] > kept), None)
        if lost is not None:
            assert r["group_ids"] == lost["group_ids"], r["step"]
    assert_nothing_trained_twice(rows)
    summary = check_accounting(run_dir)
    assert summary["consumed"] == rows[-1]["samples_consumed"], summary
    print(f"\nkill -9 of the launcher: all {len(pids)} processes gone after {gone_s:.1f}s")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_that_cannot_progress_is_stopped_with_the_cause(tmp_path):
    # greedy sampling makes every answer of a group the same, so the DAPO filter drops every
    # group: samples are generated and dropped, and the trainer never gets a batch
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--set", "trainer.total_steps=1000",
                  "--set", "trainer.progress_timeout_s=10",
                  "--set", 'rollout.group_filter="dapo"',
                  "--set", "rollout.temperature=0", "--set", "rollout.eval_every=0")
    try:
        wait_for(lambda: status(run_dir).get("state") == "running", 300, "the run", proc)
        started = time.monotonic()
        out = finish(proc, 240)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    failure = status(run_dir)["failure"]
    assert failure.startswith("progress watchdog: no trainer step for "), failure
    assert "every sample filtered" in failure and "trainer at step 0" in failure, failure
    assert "engine 0 at version 0" in failure, failure
    assert "progress watchdog" in out, out[-2000:]
    assert check_accounting(run_dir)["failure"] == failure
    print(f"\nwatchdog: stopped {took:.0f}s into the run: {failure}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killed_launcher_takes_its_ssh_processes_with_it(tmp_path):
    """The engine and a worker run over SSH (tests/helpers/sshd.py: an sshd on this machine): a kill -9
    of the launcher ends their sessions, and the remote guard stops the engine, which has no
    heartbeat to its parent; the worker would also stop on its heartbeats."""
    reason = Sshd.unavailable()
    if reason:
        pytest.skip(reason)
    try:
        sshd = Sshd(tmp_path / "sshd")
    except RuntimeError as e:
        pytest.skip(f"sshd cannot start here: {e}")
    run_dir = tmp_path / f"ssh-kill-{os.getpid()}-{time.time_ns()}"
    cluster = tmp_path / "cluster.toml"
    cluster.write_text("\n".join([
        'name = "ssh_kill"', f'experiment = "{ROOT / "configs/tiny_cpu.toml"}"',
        "[hosts.local]", 'address = "127.0.0.1"', f'python = "{sys.executable}"',
        f'workdir = "{ROOT}"', sshd.host_toml("remote"),
        "[roles.engine]", 'host = "remote"', "[roles.message_queue]", 'host = "local"',
        "[roles.synchronizer]", 'host = "local"', "[roles.trainer]", 'host = "local"',
        "[roles.rollouter]", 'host = "local"', "[roles.agent_worker]", 'host = "remote"',
        "[roles.reward_worker]", 'host = "local"', ""]))
    proc = launch(run_dir, "--set", "trainer.total_steps=100000", cluster=str(cluster))
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 2, 300, "training under way", proc)
        # the engine as the sshd started it (the remote guard's child)
        engine = [p for p in processes_of(run_dir, run_dir.name) if " -m rollmesh engine " in p]
        assert engine, processes_of(run_dir, run_dir.name)
        killed_at = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_for(lambda: not processes_of(run_dir, run_dir.name), 30,
                 "every process of the run to exit")
        gone_s = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
        for line in processes_of(run_dir, run_dir.name):  # whatever failed: nothing left running
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
        sshd.stop()
        shutil.rmtree(ROOT / "runs" / run_dir.name, ignore_errors=True)
    print(f"\nkill -9 of the launcher, engine and worker over ssh: all gone after {gone_s:.1f}s")
