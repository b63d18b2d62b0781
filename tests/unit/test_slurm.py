"""`rollmesh launch` on Slurm: hosts from the allocation, processes as job steps, `--sbatch`.

The first tests read cluster files against a faked allocation (no Slurm needed). The last ones
run a private one-node Slurm cluster (tests/helpers/slurm_cluster.py; they skip with the reason where
slurm-wlm and munge are missing or this is not root): the embedded default submitted with
`--sbatch` runs to the end with an agent worker's step killed and restarted, and
`rollmesh stop` ends a job; nothing is left running.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollmesh.config import slurm as slurm_allocation
from rollmesh.launcher import slurm
from rollmesh.config import ConfigError, load_cluster
from rollmesh.launcher.host_kinds import make_host
from tests.helpers.slurm_cluster import Slurm
from tests.e2e.test_launcher import (
    free_ports_base,
)

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENT = ROOT / "configs" / "tiny_cpu.toml"  # launch/local.toml's experiment


def cluster_file(tmp_path: Path, body: str = "", base: int = 28000) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text("\n".join([
        'name = "slurm_test"', f'experiment = "{EXPERIMENT}"', body,
        "[ports]", f"base = {base}", ""]))
    return path


@pytest.fixture
def allocation(monkeypatch):
    """A faked allocation of three nodes with 4 GPUs each."""
    for key in list(os.environ):
        if key.startswith("SLURM_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-03]")
    monkeypatch.setenv("SLURM_GPUS_PER_NODE", "a100:4")
    monkeypatch.setattr(slurm_allocation, "expand_nodelist",
                        lambda nodelist: ["gpu01", "gpu02", "gpu03"] if nodelist == "gpu[01-03]"
                        else pytest.fail(nodelist))


def test_hosts_come_from_the_allocation_and_roles_are_placed_by_rule(tmp_path, allocation):
    cluster = load_cluster(cluster_file(tmp_path, "[slurm]\nengine_nodes = 1\n"),
                           ["engine.count=2", "trainer.ranks=3"])
    assert {n: (h.address, h.gpus, h.launch) for n, h in cluster.hosts.items()} == {
        "node0": ("gpu01", 4, "slurm"), "node1": ("gpu02", 4, "slurm"),
        "node2": ("gpu03", 4, "slurm")}
    where = {(p.role, p.index): (p.host, p.gpus) for p in cluster.processes()}
    assert where[("engine", 0)] == ("node0", (0,)) and where[("engine", 1)] == ("node0", (1,))
    # three trainer ranks over the two other nodes, one GPU each
    assert [where[("trainer", i)] for i in range(3)] == [
        ("node1", (0,)), ("node1", (1,)), ("node2", (0,))]
    assert {where[(r, 0)][0] for r in ("rollouter", "message_queue", "synchronizer",
                                       "agent_worker", "reward_worker")} == {"node0"}


def test_a_large_allocation_gets_rollout_and_queue_shards_by_rule(tmp_path, monkeypatch):
    """2,000 GPUs (250 nodes of 8): 4 rollouters and 1 queue shard
    (config.roles.default_shards), each rollouter with its own agent and reward workers; the
    three-node allocation above keeps one of each."""  # (agent_workers: 2 by default)
    for key in list(os.environ):
        if key.startswith("SLURM_"):
            monkeypatch.delenv(key)
    nodes = [f"gpu{i:03d}" for i in range(250)]
    monkeypatch.setenv("SLURM_JOB_ID", "43")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[000-249]")
    monkeypatch.setenv("SLURM_GPUS_PER_NODE", "8")
    monkeypatch.setattr(slurm_allocation, "expand_nodelist", lambda nodelist: nodes)
    cluster = load_cluster(cluster_file(tmp_path, "[slurm]\nengine_nodes = 200\n"
                                        "reward_workers = 1\n"), ["engine.count=2"])
    count = {r: sum(1 for p in cluster.processes() if p.role == r)
             for r in ("rollouter", "message_queue", "agent_worker", "reward_worker")}
    assert count == {"rollouter": 4, "message_queue": 1, "agent_worker": 4,
                     "reward_worker": 4}


def test_a_role_written_out_names_its_node_and_hosts_slurm_is_the_short_form(tmp_path,
                                                                               allocation):
    body = 'hosts = "slurm"\n[roles.trainer]\nhost = "node2"\ngpus = [3]\n'
    cluster = load_cluster(cluster_file(tmp_path, body))
    trainer = next(p for p in cluster.processes() if p.role == "trainer")
    assert (trainer.host, trainer.gpus) == ("node2", (3,))
    assert cluster.slurm is not None and len(cluster.hosts) == 3


@pytest.mark.parametrize("body, key, words", [
    ("[slurm]\nengine_nodes = 3\n", "slurm.engine_nodes", "expected at most 2"),
    ("[slurm]\n[hosts.big]\naddress = \"x\"\n", "hosts.big", "come from the allocation"),
    ("[slurm]\nnodes = 0\n", "slurm.nodes", "expected int >= 1"),
    ("[slurm]\n[roles.trainer]\nhost = \"node7\"\n", "roles.trainer.host", "node0, node1"),
])
def test_bad_slurm_tables_are_named(tmp_path, allocation, body, key, words):
    with pytest.raises(ConfigError) as e:
        load_cluster(cluster_file(tmp_path, body))
    assert key in str(e.value) and words.replace("node0, node1", "'node0', 'node1'") in str(
        e.value), str(e.value)


def test_a_model_directory_is_checked_on_the_shared_filesystem(tmp_path, allocation):
    with pytest.raises(ConfigError) as e:
        load_cluster(cluster_file(tmp_path, "[slurm]\n"), [f"model.path={tmp_path / 'nope'}"])
    assert "model.path" in str(e.value) and "a Slurm node" in str(e.value), str(e.value)


def test_the_batch_script_asks_for_what_slurm_says_and_runs_the_launcher(tmp_path):
    from rollmesh.config import SlurmConfig

    cfg = SlurmConfig(nodes=2, gpus_per_node=8, time="1:00:00", partition="gpu",
                      python=".venv/bin/python", workdir="/shared/rollmesh",
                      sbatch_options=["--qos=high"])
    script = slurm.batch_script(tmp_path / "run", cfg, ["/c.toml", "--run-dir", "/r"])
    lines = script.splitlines()
    for opt in ("--nodes=2", "--gpus-per-node=8", "--time=1:00:00", "--partition=gpu",
                "--qos=high", "--exclusive", f"--output={tmp_path / 'run'}/slurm/job.out"):
        assert f"#SBATCH {opt}" in lines, (opt, script)
    assert lines[-2:] == ["cd /shared/rollmesh", "exec /shared/rollmesh/.venv/bin/python -m "
                          "rollmesh launch /c.toml --run-dir /r"]


def test_gpus_in_allocation_reads_what_slurm_sets():
    assert slurm.gpus_in_allocation({"SLURM_GPUS_PER_NODE": "h100:8"}) == 8
    assert slurm.gpus_in_allocation({"SLURM_GPUS_ON_NODE": "2"}) == 2
    assert slurm.gpus_in_allocation({"SLURM_JOB_GPUS": "0,1,5"}) == 3
    assert slurm.gpus_in_allocation({}) == 0


def test_a_step_asks_slurm_for_its_gpus_and_the_others_for_none(tmp_path, allocation):
    cluster = load_cluster(cluster_file(tmp_path, "[slurm]\nsrun_options = [\"-c4\"]\n"))
    host = make_host("node0", cluster.hosts["node0"], cluster.slurm.srun_options)
    gpu = host.argv(["-m", "x"], {"CUDA_VISIBLE_DEVICES": "2,3"}, "trainer-0")
    cpu = host.argv(["-m", "x"], {}, "rollouter-0")
    assert gpu[:7] == ["srun", "--overlap", "-N1", "-n1", "-w", "gpu01", "--export=ALL"]
    assert "--gres=gpu:2" in gpu and "--gres=none" in cpu and gpu[-4] == "-c4"
    assert "CUDA_VISIBLE_DEVICES" not in host.local_env({"CUDA_VISIBLE_DEVICES": "2,3"})


def test_outside_an_allocation_a_launch_is_refused_and_a_dry_run_shows_placeholders(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_JOB")}
    path = cluster_file(tmp_path, "[slurm]\nnodes = 2\nengine_nodes = 1\n"
                        f'python = "{sys.executable}"\n')
    run = [sys.executable, "-m", "rollmesh", "launch", str(path)]
    plan = subprocess.run([*run, "--dry-run"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert plan.returncode == 0, plan.stderr
    assert "host node1 (<node1>, Slurm job steps (srun))" in plan.stdout
    assert "srun --overlap -N1 -n1 -w '<node1>'" in plan.stdout and "trainer[0]" in plan.stdout
    refused = subprocess.run(run, capture_output=True, text=True, env=env, cwd=ROOT)
    assert refused.returncode == 2 and "--sbatch" in refused.stderr, refused.stderr


# --------------------------------------------------------------------------------------------
# A real Slurm
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    reason = Slurm.unavailable()
    if reason:
        pytest.skip(reason)
    try:
        s = Slurm()
    except RuntimeError as e:
        pytest.skip(f"Slurm cannot start here: {e}")
    try:
        yield s
    finally:
        s.stop()


def client_env(cluster: Slurm) -> dict[str, str]:
    """This test's environment, not inside any allocation, reaching the private cluster; the
    checkout's rollmesh first (it reaches the batch job and its steps: sbatch exports all)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return {**env, **cluster.env}


def rollmesh(cluster: Slurm, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollmesh", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env=client_env(cluster))


def submit(cluster: Slurm, tmp_path: Path, run_dir: Path, steps: int,
           extra: list[str] = ()) -> str:
    path = cluster_file(tmp_path, "\n".join([
        "[slurm]", f'python = "{sys.executable}"', f'workdir = "{ROOT}"']),
        base=free_ports_base())
    out = rollmesh(cluster, "launch", str(path), "--sbatch", "--nodes", "1", "--time", "10",
                   "--run-dir", str(run_dir), "--quiet", "--set", f"trainer.total_steps={steps}",
                   *extra)
    assert out.returncode == 0 and "submitted batch job" in out.stdout, out.stdout + out.stderr
    job = slurm.job_of(run_dir)
    assert job and job in cluster.jobs()
    return job


def leftovers(run_dir: Path) -> list[str]:
    """Processes whose command line names the run directory (every role's does)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(run_dir) in cmd:
                found.append(f"{proc.name}: {cmd[:200]}")
    return found


def job_log(run_dir: Path) -> str:
    return Slurm.tail(run_dir / "slurm" / "job.out", 4000)


