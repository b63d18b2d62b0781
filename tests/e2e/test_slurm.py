"""End-to-end tests of slurm (they start processes); the unit tests and the
helpers they share are in tests/unit/test_slurm.py."""

from __future__ import annotations

import json
import os

import pytest

from rollmesh.launcher import slurm
from tests.e2e.test_launcher import (
    check_accounting,
    cpus_allowed,
    metrics,
    status,
    wait_for,
)
from tests.unit.test_slurm import ROOT, job_log, leftovers, rollmesh, submit
from tests.unit.test_slurm import cluster  # noqa: F401 - pytest fixtures


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sbatch_runs_the_default_to_the_end_and_restarts_a_killed_step(cluster, tmp_path):
    run_dir = tmp_path / "run"
    # the agent workers written out, each pinned to a CPU of the node (inside its step)
    last = max(os.sched_getaffinity(0))
    job = submit(cluster, tmp_path, run_dir, steps=20, extra=[
        "--set", "roles.agent_worker.host=node0", "--set", "roles.agent_worker.count=2",
        "--set", f'roles.agent_worker.cpus=["{last}", "0"]'])
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 1 or not cluster.jobs(), 150,
                 "training under way")
        assert len(metrics(run_dir)) >= 1, job_log(run_dir)
        st = rollmesh(cluster, "status", str(run_dir))
        assert st.returncode == 0 and "agent_worker[0]" in st.stdout, st.stdout + st.stderr
        # the steps run this checkout's rollmesh (--chdir to slurm.workdir, PYTHONPATH exported)
        worker = next(p for p in status(run_dir)["processes"] if p["name"] == "agent_worker[0]")
        assert os.readlink(f"/proc/{worker['pid']}/cwd") == str(ROOT)
        assert cpus_allowed(worker["pid"]) == str(last)
        steps = dict((name, step) for step, name in cluster.steps())
        assert {"engine-0", "trainer-0", "agent_worker-0", "reward_worker-0"} <= set(steps)
        cluster.run("scancel", "--signal=KILL", steps["agent_worker-0"])  # its step, not the job

        def restarts() -> int:
            return next((p["restarts"] for p in status(run_dir).get("processes", [])
                         if p["name"] == "agent_worker[0]"), 0)

        wait_for(lambda: restarts() == 1, 60, "the agent worker's restart")

        def new_pid() -> int | None:
            p = next(p for p in status(run_dir)["processes"] if p["name"] == "agent_worker[0]")
            return p["pid"] if p["pid"] not in (None, worker["pid"]) else None

        assert cpus_allowed(wait_for(new_pid, 60, "the restarted worker's hello")) == str(last)
        wait_for(lambda: job not in cluster.jobs(), 150, "the job to end")
    finally:
        if job in cluster.jobs():
            cluster.run("scancel", job, check=False)
    out = job_log(run_dir)
    assert "rollmesh: run finished" in out, out
    assert len(metrics(run_dir)) == 20
    check_accounting(run_dir)
    final = status(run_dir)
    assert final["state"] == "finished"
    assert next(p for p in final["processes"] if p["name"] == "agent_worker[0]")["restarts"] == 1
    assert all(p["host"] == "node0" for p in final["processes"])
    assert not cluster.steps() and not leftovers(run_dir), leftovers(run_dir)


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rollmesh_stop_ends_the_job_and_leaves_nothing_running(cluster, tmp_path):
    run_dir = tmp_path / "run"
    job = submit(cluster, tmp_path, run_dir, steps=100000)
    try:
        wait_for(lambda: status(run_dir).get("state") == "running" or not cluster.jobs(), 150,
                 "the run")
        assert status(run_dir).get("state") == "running", job_log(run_dir)
        # the monitor attaches from outside the job (launcher.json names the node's hub)
        snap = rollmesh(cluster, "monitor", str(run_dir), "--json", "--once", "--wait", "20")
        assert snap.returncode == 0 and json.loads(snap.stdout)["roles"], snap.stdout + snap.stderr
        stopped = rollmesh(cluster, "stop", str(run_dir))
        assert stopped.returncode == 0 and "through tcp://" in stopped.stdout, (
            stopped.stdout + stopped.stderr)
        assert job not in cluster.jobs()  # stop waits until the job has left the queue
    finally:
        if job in cluster.jobs():
            cluster.run("scancel", job, check=False)
    assert "rollmesh: run stopped" in job_log(run_dir)
    wait_for(lambda: not leftovers(run_dir), 20, "every process of the run to be gone")
    assert not cluster.steps()
    assert rollmesh(cluster, "status", str(run_dir)).returncode == 1


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_scancel_of_the_job_ends_everything_and_resume_goes_on_under_sbatch(cluster, tmp_path):
    run_dir = tmp_path / "run"
    job = submit(cluster, tmp_path, run_dir, steps=100000, extra=["--set",
                                                                  "trainer.checkpoint_every=2"])
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "step_00000004").exists()
                 or not cluster.jobs(), 150, "two checkpoints")
        assert cluster.jobs(), job_log(run_dir)
        cluster.run("scancel", job)  # as a user or an administrator ends a job
        wait_for(lambda: job not in cluster.jobs(), 60, "the cancelled job to leave the queue")
    finally:
        if job in cluster.jobs():
            cluster.run("scancel", job, check=False)
    wait_for(lambda: not leftovers(run_dir), 20, "every process of the run to be gone")
    assert not cluster.steps()
    done = len(metrics(run_dir))
    resumed = rollmesh(cluster, "launch", "--resume", str(run_dir), "--sbatch", "--quiet",
                       "--set", f"trainer.total_steps={done + 3}")
    assert resumed.returncode == 0 and "submitted" in resumed.stdout, resumed.stdout + resumed.stderr
    again = slurm.job_of(run_dir)
    assert again != job
    try:
        wait_for(lambda: again not in cluster.jobs(), 150, "the resumed job to end")
    finally:
        if again in cluster.jobs():
            cluster.run("scancel", again, check=False)
    out = job_log(run_dir)
    assert "rollmesh: run finished" in out and "resuming" in out, out
    assert [r["step"] for r in metrics(run_dir)][-1] == done + 3
    check_accounting(run_dir)
    assert not leftovers(run_dir) and not cluster.steps()
