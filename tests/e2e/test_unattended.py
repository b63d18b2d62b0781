"""End-to-end tests of unattended (they start processes); the unit tests and the
helpers they share are in tests/unit/test_unattended.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.test_launcher import (
    ROOT,
    alive,
    assert_nothing_trained_twice,
    check_accounting,
    finish,
    launch,
    metrics,
    status,
    wait_for,
)
from tests.helpers.sshd import Sshd
from tests.unit.test_unattended import proc_of, processes_of


@pytest.mark.long
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


@pytest.mark.long
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


@pytest.mark.long
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


@pytest.mark.long
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
