"""`rollmesh launch` for real: every role a process, on this machine and over SSH.

The first test is the embedded CPU default end to end (the README's main command): it must learn,
keep every step within the staleness bound, and account for every sample.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rollmesh.core.accounting import Identity
from rollmesh.runtime.durable_log import write_atomic
from tests.helpers.sshd import Sshd

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def free_ports_base(n: int = 64) -> int:
    """The first of `n` consecutive ports that nothing on this machine holds now, picked at
    random below the ephemeral range: fixed bases clashed with whatever else runs here."""
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(20000, 32000 - n)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", port))  # no SO_REUSEADDR: a port in TIME_WAIT counts as taken
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports in 20000-32000")


def launch(run_dir: Path, *args: str, cluster: str = "launch/local.toml") -> subprocess.Popen:
    """`rollmesh launch CLUSTER` in the background, on a free block of ports unless `args` set
    `ports.base`."""
    if not any(a.startswith("ports.base=") for a in args):
        args = (*args, "--set", f"ports.base={free_ports_base()}")
    return subprocess.Popen([sys.executable, "-m", "rollmesh", "launch", cluster, "--quiet",
                             "--run-dir", str(run_dir), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def rollmesh(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollmesh", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None):
    """Poll `predicate`; with the launcher's `proc`, stop as soon as it exits and say why."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the launcher exited with {proc.returncode} while waiting for "
                                 f"{what}:\n{proc.stdout.read()[-4000:] if proc.stdout else ''}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("\n")]  # not a row half-written


def status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def finish(proc: subprocess.Popen, timeout_s: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout_s)
    return out


def check_accounting(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert Identity.from_summary(summary).holds, summary
    return summary


def assert_staleness_rule(rows: list[dict], summary: dict) -> None:
    """What `staleness.measure` promises of every trained batch. `oldest_token`: its oldest
    token within max_staleness. `admission`: nothing was dropped as stale, and every batch's
    age since admission is at least its staleness (generation begins at admission or later),
    both reported."""
    bound = summary["max_staleness"]
    if summary["staleness_measure"] == "oldest_token":
        for row in rows:
            assert row["batch_staleness_max"] <= bound, row
        return
    assert summary["staleness_measure"] == "admission", summary
    assert not summary["dropped"].get("stale"), summary["dropped"]
    for row in rows:
        assert row["batch_admission_age_max"] >= row["batch_staleness_max"], row


def kill_and_await_restart(run_dir: Path, name: str, timeout_s: float = 120) -> None:
    """kill -9 the process of the run named `name` and wait until the launcher restarted it."""
    def proc() -> dict:
        return next(p for p in status(run_dir).get("processes", []) if p["name"] == name)

    before = proc()
    os.kill(before["pid"], signal.SIGKILL)
    wait_for(lambda: proc()["restarts"] == before["restarts"] + 1, timeout_s, f"{name}'s restart")


def trained_history(rows: list[dict]) -> list[dict]:
    """The steps of the surviving history: a step trained again after a resume replaces the
    lost one (its update died with the trainer before any checkpoint held it)."""
    by_step: dict[int, dict] = {}
    for row in rows:
        by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def assert_nothing_trained_twice(rows: list[dict]) -> None:
    seen: dict[str, int] = {}
    for row in trained_history(rows):
        for gid in row["group_ids"]:
            assert gid not in seen, f"group {gid} trained at step {seen[gid]} and {row['step']}"
            seen[gid] = row["step"]


def test_embedded_default_learns_within_the_bound_and_accounts_for_everything(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir)
    try:
        # While it runs: the monitor attaches read-only, and `rollmesh status` answers.
        wait_for(lambda: len(metrics(run_dir)) >= 3, 300, "the first trainer steps", proc)
        snap = rollmesh("monitor", str(run_dir), "--json", "--once", "--wait", "20")
        assert snap.returncode == 0, snap.stdout + snap.stderr
        snapshot = json.loads(snap.stdout)
        st = rollmesh("status", str(run_dir))
        assert st.returncode == 0 and "rollouter[0]" in st.stdout, st.stdout
    finally:
        out = finish(proc)
    assert proc.returncode == 0, out[-3000:]

    for key in ("roles", "trainer", "rollouter", "queue", "engines", "last_sync", "accounting"):
        assert snapshot[key] is not None, key
    roles = {r["role"] for r in snapshot["roles"]}
    assert {"engine", "rollouter", "message_queue", "trainer", "synchronizer", "agent_worker",
            "reward_worker"} <= roles
    assert all(r["liveness"] == "alive" for r in snapshot["roles"]), snapshot["roles"]
    assert snapshot["trainer"]["step"] is not None and snapshot["trainer"]["reward_history"]

    rows = metrics(run_dir)
    summary = check_accounting(run_dir)
    assert_nothing_trained_twice(rows)
    for row in rows:
        for key in ("step", "version", "reward_mean", "batch_staleness_max",
                    "batch_admission_age_max", "samples_consumed"):
            assert key in row, key
    assert_staleness_rule(rows, summary)
    rewards = [r["reward_mean"] for r in rows]
    fifth = len(rewards) // 5
    first, last = sum(rewards[:fifth]) / fifth, sum(rewards[-fifth:]) / fifth
    assert last >= first + 0.3, (first, last)
    assert (run_dir / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    policy = run_dir / "policy"
    assert (policy / "config.json").exists() and list(policy.glob("*.safetensors"))


def test_killed_agent_worker_is_restarted_and_the_run_completes(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--set", "trainer.total_steps=40")
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 5, 300, "training under way", proc)
        kill_and_await_restart(run_dir, "agent_worker[0]")
    finally:
        out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert len(metrics(run_dir)) == 40
    check_accounting(run_dir)
    assert_nothing_trained_twice(metrics(run_dir))
    final = status(run_dir)
    assert next(p for p in final["processes"] if p["name"] == "agent_worker[0]")["restarts"] == 1


@pytest.mark.long
def test_killed_engine_is_restarted_and_rejoins_at_the_current_weight_version(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--set", "trainer.total_steps=60")
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 5, 300, "training under way", proc)
        kill_and_await_restart(run_dir, "engine[0]")

        def caught_up():
            # the engine serves the weights the trainer published last (after the rebuild)
            load = status(run_dir).get("engines") or [{}]
            served = load[0].get("weight_version")
            latest = metrics(run_dir)[-1]["version"]
            return served not in (None, "0") and int(served) >= latest - 1 and latest > 10

        wait_for(caught_up, 120, "the restarted engine to hold the current weights")
    finally:
        out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert len(metrics(run_dir)) == 60
    check_accounting(run_dir)
    assert_nothing_trained_twice(metrics(run_dir))


def cpus_allowed(pid: int) -> str:
    """Where the kernel lets the process run (every thread it starts inherits it)."""
    return next(line.split(":", 1)[1].strip() for line in
                Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("Cpus_allowed_list"))


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)


def check_cpu_placement(run_dir: Path, launcher_pid: int, here: list[int]) -> None:
    """The placement PINNED asks for, read back from /proc (see its launch arguments)."""
    from rollmesh.runtime.cpus import format_cpulist

    first, last, every = str(here[0]), str(here[-1]), format_cpulist(here)
    procs = {p["name"]: p for p in status(run_dir)["processes"]}
    wanted = {"engine[0]": every, "trainer[0]": last, "agent_worker[0]": first,
              "agent_worker[1]": last}
    for name, p in procs.items():
        # the others have no cpus: the launcher's affinity from before launcher_cpus (this
        # test's), not the launcher's CPU
        assert cpus_allowed(p["pid"]) == wanted.get(name, every), name
        assert p["cpus"] == wanted.get(name), name
    assert cpus_allowed(launcher_pid) == first
    assert environ(procs["trainer[0]"]["pid"])["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in environ(procs["rollouter[0]"]["pid"])
    # the engine's torch threads follow its CPUs (a tiny model's own default is 1)
    engine_log = (run_dir / "logs" / "engine-0.log").read_text()
    assert f'"threads": {len(here)}, ' in engine_log, engine_log[-2000:]


def pinned_args(here: list[int]) -> list[str]:
    from rollmesh.runtime.cpus import format_cpulist

    first, last = here[0], here[-1]
    return ["--set", f"roles.engine.cpus={format_cpulist(here)}",
            "--set", f"roles.trainer.cpus={last}",
            "--set", f'roles.agent_worker.cpus=["{first}", "{last}"]',
            "--set", f"launcher_cpus={first}"]


@pytest.mark.long
@pytest.mark.parametrize("how", ["ctrl-c", "rollmesh stop"])
def test_stopping_a_run_leaves_no_process_behind(tmp_path, how):
    # with CPU placement (cpus per role and per process, launcher_cpus): each process runs
    # where the cluster file says, read back from /proc
    from rollmesh.runtime.cpus import available_cpus

    here = sorted(available_cpus())
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--set", "trainer.total_steps=100000", *pinned_args(here))
    try:
        wait_for(lambda: status(run_dir).get("state") == "running"
                 and all(p["pid"] for p in status(run_dir)["processes"]), 300, "the run")
        pids = [p["pid"] for p in status(run_dir)["processes"]]
        assert len(pids) == 8 and all(alive(p) for p in pids)
        check_cpu_placement(run_dir, proc.pid, here)
        if how == "ctrl-c":
            proc.send_signal(signal.SIGINT)
        else:  # as from another machine: no pid to signal, the control socket and the keys
            stopped = rollmesh("stop", str(run_dir), "--socket")
            assert stopped.returncode == 0, stopped.stdout + stopped.stderr
            assert "through tcp://" in stopped.stdout, stopped.stdout
        finish(proc, 120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    wait_for(lambda: not any(alive(p) for p in pids), 30, "every process to be gone")
    assert rollmesh("status", str(run_dir)).returncode == 1  # the launcher is not running
    if how == "rollmesh stop":  # a run that is over: nobody answers, and no pid fallback
        again = rollmesh("stop", str(run_dir), "--socket")
        assert again.returncode == 1 and "did not answer" in again.stderr, again.stderr


def test_ssh_mode_against_a_real_sshd(tmp_path):
    reason = Sshd.unavailable()
    if reason:
        pytest.skip(reason)
    try:
        sshd = Sshd(tmp_path / "sshd")
    except RuntimeError as e:
        pytest.skip(f"sshd cannot start here: {e}")
    run_dir = tmp_path / f"ssh-run-{os.getpid()}-{time.time_ns()}"
    remote_metrics = ROOT / "runs" / run_dir.name / "trainer" / "metrics.jsonl"
    try:
        out, proc = _run_over_ssh(tmp_path, sshd, run_dir)
        written_remotely = remote_metrics.read_text() if remote_metrics.exists() else ""
        exported_remotely = (ROOT / "runs" / run_dir.name / "policy" / "config.json").exists()
    finally:
        sshd.stop()  # whatever failed: no sshd left behind
        # the "remote" side kept its keys and specs under its work directory (this checkout)
        shutil.rmtree(ROOT / "runs" / run_dir.name, ignore_errors=True)
    assert proc.returncode == 0, out[-3000:]
    # the trainer ran "remotely": its rows were written there and mirrored here, each once
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 9))
    assert (run_dir / "metrics.jsonl").read_text() == written_remotely
    assert exported_remotely and (run_dir / "reward.png").exists()
    check_accounting(run_dir)
    remote = [p for p in status(run_dir)["processes"] if p["host"] == "remote"]
    assert len(remote) == 4 and all(p["exit_code"] == 0 for p in remote), remote
    worker_log = (run_dir / "logs" / "agent_worker-1.log").read_text()
    assert '"event": "ready"' in worker_log  # its output came back through ssh
    # the remote trainer ran on its CPU (its own affinity, logged at start) with one thread
    trainer_log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert f'"cpus": "{REMOTE_CPU}", "omp_threads": "1"' in trainer_log, trainer_log[:3000]


REMOTE_CPU = max(os.sched_getaffinity(0))


def _run_over_ssh(tmp_path: Path, sshd: Sshd, run_dir: Path) -> tuple[str, subprocess.Popen]:
    # the launcher's machine runs the engine, queue, rollouter and synchronizer; the trainer and
    # the workers run over SSH
    cluster = tmp_path / "cluster.toml"
    cluster.write_text("\n".join([
        'name = "ssh_test"', f'experiment = "{ROOT / "configs/tiny_cpu.toml"}"',
        "[hosts.local]", 'address = "127.0.0.1"', f'python = "{sys.executable}"',
        f'workdir = "{ROOT}"', sshd.host_toml("remote"),
        "[roles.engine]", 'host = "local"', "[roles.message_queue]", 'host = "local"',
        "[roles.synchronizer]", 'host = "local"', "[roles.trainer]", 'host = "remote"',
        f'cpus = "{REMOTE_CPU}"',  # checked and applied over there, at start
        "[roles.rollouter]", 'host = "local"',
        "[roles.agent_worker]", 'host = "remote"', "count = 2",
        "[roles.reward_worker]", 'host = "remote"',
        "[ports]", f"base = {free_ports_base()}", ""]))
    plan = rollmesh("launch", str(cluster), "--dry-run", "--run-dir", str(run_dir))
    assert plan.returncode == 0 and "over ssh" in plan.stdout, plan.stdout + plan.stderr
    assert "BatchMode=yes" in plan.stdout and "StrictHostKeyChecking" not in plan.stdout
    proc = launch(run_dir, "--set", "trainer.total_steps=8", cluster=str(cluster))
    return finish(proc), proc


def test_status_files_are_replaced_whole_so_a_reader_never_sees_half_of_one(tmp_path):
    # `rollmesh status`, the monitor and these tests read status.json while the launcher
    # rewrites it every second (a CI run once read half of one)
    path = tmp_path / "status.json"
    documents = [json.dumps({"processes": [{"name": f"p{i}", "pad": "x" * 20_000}] * 8})
                 for i in range(2)]
    write_atomic(path, documents[0])
    stop, torn = threading.Event(), []

    def reader() -> None:
        while not stop.is_set():
            text = path.read_text()
            if text not in documents:
                torn.append(len(text))

    t = threading.Thread(target=reader)
    t.start()
    for i in range(300):
        write_atomic(path, documents[i % 2], fsync=False)  # as the launcher writes it
    stop.set()
    t.join()
    assert not torn, f"{len(torn)} torn reads"
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]  # no temporary file left


def test_set_up_failures_are_one_clear_line_not_a_traceback(tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    out = rollmesh("launch", "launch/local.toml", "--quiet", "--run-dir", str(taken))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"rollmesh launch: run directory {taken} already exists" in out.stderr
    base = free_ports_base()
    with socket.socket() as holder:  # another program on the launcher's status port
        holder.bind(("127.0.0.1", base + 1))
        holder.listen()
        out = rollmesh("launch", "launch/local.toml", "--quiet", "--run-dir",
                       str(tmp_path / "run"), "--set", f"ports.base={base}")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert (f"cannot bind tcp://127.0.0.1:{base + 1}: Address already in use" in out.stderr
            and f"the launcher's ports {base}-{base + 2} are taken" in out.stderr), out.stderr
