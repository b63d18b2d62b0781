"""CPU placement per role (`cpus = "0-3"` in a cluster file): the cpulist, its checks, the plan,
the prelude that pins a process at start, and a role process that really runs on its CPUs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from rollmesh.engine.auth import EngineKeys
from rollmesh.config import ConfigError, HostConfig, load_cluster
from rollmesh.runtime.cpus import (
    CpuListError, available_cpus, format_cpulist, parse_cpulist, pinned, thread_env,
)
from rollmesh.launcher.host_kinds import make_host
from rollmesh.launcher.plan import _make_hosts, build_plan, print_plan
from rollmesh.launcher.slurm import SlurmHost

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENT = ROOT / "configs" / "tiny_cpu.toml"
HERE = available_cpus()
ABSENT = max(HERE) + 1  # a CPU id this machine does not have
ROLES = ("engine", "rollouter", "agent_worker", "reward_worker", "message_queue", "trainer",
         "synchronizer")


def cluster_file(tmp_path: Path, roles: dict[str, str] | None = None, top: str = "",
                 hosts: str = "") -> Path:
    """Every role on host "local" (this machine); `roles` adds lines to a role's table."""
    roles = roles or {}
    lines = ['name = "cpus"', f'experiment = "{EXPERIMENT}"', top,
             "[hosts.local]", 'address = "127.0.0.1"', f'python = "{sys.executable}"', hosts]
    for role in ROLES:
        lines += [f"[roles.{role}]", f'host = "{roles.get(role + ".host", "local")}"',
                  roles.get(role, "")]
    path = tmp_path / "cluster.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def cpus_of(cluster) -> dict[str, str]:
    return {p.name: format_cpulist(p.cpus) for p in cluster.processes()}


# --------------------------------------------------------------------------------------------
# The cpulist
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,cpus", [
    ("0", (0,)), ("0-3", (0, 1, 2, 3)), ("0-3,8,10-11", (0, 1, 2, 3, 8, 10, 11)),
    (" 1 , 3-4 ", (1, 3, 4)), ("2,0-1,1", (0, 1, 2)), ("5-5", (5,)),
])
def test_a_cpulist_parses_as_linux_writes_it(text, cpus):
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("text,words", [
    ("", "at least one CPU"), ("  ", "at least one CPU"), ("a", "'a' is neither"),
    ("0,,1", "'' is neither"), ("-1", "'-1' is neither"), ("0-", "'0-' is neither"),
    ("3-1", "'3-1' runs backwards"), ("0-3:2", "'0-3:2' is neither"), ("0 1", "'0 1'"),
    ("99999", "below 16384"),
])
def test_a_bad_cpulist_says_what_is_wrong(text, words):
    with pytest.raises(CpuListError) as err:
        parse_cpulist(text)
    assert words in str(err.value) and repr(text) in str(err.value)


@given(st.sets(st.integers(0, 300), min_size=1))
def test_format_writes_the_shortest_list_that_parses_back(cpus):
    text = format_cpulist(cpus)
    assert parse_cpulist(text) == tuple(sorted(cpus))
    # one item per run of consecutive ids
    assert len(text.split(",")) == sum(1 for c in cpus if c - 1 not in cpus)


def test_thread_counts_follow_the_cpus_unless_the_host_env_sets_them():
    assert thread_env((0, 1, 2), {}) == {"ROLLMESH_CPUS": "0-2", "OMP_NUM_THREADS": "3",
                                         "MKL_NUM_THREADS": "3"}
    # an explicit OMP_NUM_THREADS is kept (not in the result: the host's env has it) and MKL
    # follows it
    assert thread_env((0, 1, 2), {"OMP_NUM_THREADS": "1"}) == {"ROLLMESH_CPUS": "0-2",
                                                               "MKL_NUM_THREADS": "1"}


# --------------------------------------------------------------------------------------------
# The cluster file
# --------------------------------------------------------------------------------------------


def test_cpus_per_role_and_per_process(tmp_path):
    cluster = load_cluster(cluster_file(tmp_path, {
        "engine": 'cpus = "0"', "trainer": 'cpus = "0-1"',
        "agent_worker": 'count = 2\ncpus = ["1", "0,1"]', "reward_worker": "count = 2"}))
    assert cpus_of(cluster) == {
        "engine[0]": "0", "rollouter[0]": "", "agent_worker[0]": "1", "agent_worker[1]": "0-1",
        "reward_worker[0]": "", "reward_worker[1]": "", "message_queue[0]": "",
        "trainer[0]": "0-1", "synchronizer[0]": ""}


def test_cpus_per_placement_of_a_role_on_two_tables(tmp_path):
    path = cluster_file(tmp_path, {"agent_worker.host": "local", "agent_worker": ""})
    text = path.read_text().replace('[roles.agent_worker]\nhost = "local"',
                                    '[[roles.agent_worker]]\nhost = "local"\ncpus = "0"\n'
                                    '[[roles.agent_worker]]\nhost = "local"\ncount = 2\n'
                                    'cpus = ["1", "0"]')
    path.write_text(text)
    cluster = load_cluster(path)
    assert [c for n, c in cpus_of(cluster).items() if n.startswith("agent")] == ["0", "1", "0"]


def test_an_override_takes_a_cpulist_as_typed(tmp_path):
    path = cluster_file(tmp_path)
    cluster = load_cluster(path, ["roles.trainer.cpus=1", "roles.engine.cpus=0,1",
                                  "launcher_cpus=0"])
    assert cpus_of(cluster)["trainer[0]"] == "1" and cpus_of(cluster)["engine[0]"] == "0-1"
    assert cluster.launcher_cpus == "0"


@pytest.mark.parametrize("lines,key,words", [
    ({"trainer": 'cpus = "1-0"'}, "roles.trainer.cpus", "'1-0' runs backwards"),
    ({"trainer": "cpus = 1"}, "roles.trainer.cpus", "expected str or a list of str, got 1"),
    ({"agent_worker": 'count = 2\ncpus = ["0"]'}, "roles.agent_worker.cpus",
     "expected one cpulist per process (2, as count), or one string for all, got ['0']"),
    ({"agent_worker": 'count = 2\ncpus = ["0", "x"]'}, "roles.agent_worker.cpus[1]",
     "'x' is neither"),
    ({"agent_worker": "count = 2\ncpus = [0, 1]"}, "roles.agent_worker.cpus[0]",
     "expected str, got 0"),
])
def test_a_bad_cpus_value_is_named(tmp_path, lines, key, words):
    with pytest.raises(ConfigError) as err:
        load_cluster(cluster_file(tmp_path, lines))
    assert err.value.key == key and words in err.value.problem, str(err.value)


def test_cpus_this_machine_lacks_fail_at_load_naming_role_host_and_what_it_has(tmp_path):
    path = cluster_file(tmp_path, {"trainer": f'cpus = "0,{ABSENT}"'})
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    assert str(err.value) == (
        f"{path}: roles.trainer.cpus: CPU {ABSENT} is not on host 'local' (127.0.0.1, this "
        f"machine), which has CPUs {format_cpulist(HERE)}, got '0,{ABSENT}'")
    per_process = cluster_file(tmp_path, {"reward_worker": f'count = 2\ncpus = ["0", "{ABSENT}"]'})
    with pytest.raises(ConfigError) as err:
        load_cluster(per_process)
    assert err.value.key == "roles.reward_worker.cpus[1]"
    with pytest.raises(ConfigError) as err:
        load_cluster(cluster_file(tmp_path, top=f'launcher_cpus = "{ABSENT}-{ABSENT + 1}"'))
    assert err.value.key == "launcher_cpus" and "which has CPUs" in err.value.problem


def test_a_remote_host_is_not_checked_at_load(tmp_path):
    # over SSH (even to this machine): the CPUs are the other host's, checked when it starts
    path = cluster_file(tmp_path, {"trainer": f'cpus = "{ABSENT}"', "trainer.host": "remote"},
                        hosts='[hosts.remote]\naddress = "127.0.0.1"\nlaunch = "ssh"\n')
    assert cpus_of(load_cluster(path))["trainer[0]"] == str(ABSENT)


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


def plan_of(cluster, run_dir: Path):
    from rollmesh.launcher.plan import launcher_affinity

    return build_plan(cluster, _make_hosts(cluster), str(run_dir), engine_keys=EngineKeys("k", "a"),
                      launcher_before=launcher_affinity(cluster))


def test_the_plan_shows_each_process_cpus_threads_and_the_prelude(tmp_path, capsys):
    cluster = load_cluster(cluster_file(
        tmp_path, {"engine": 'cpus = "0"', "trainer": 'cpus = "0-1"',
                   "agent_worker": 'count = 2\ncpus = ["1", "0"]'}, top='launcher_cpus = "0"'))
    plan = plan_of(cluster, tmp_path / "run")
    print_plan(cluster, plan, str(tmp_path / "run"))
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "launcher: cpus=0" in lines

    def entry(name: str) -> tuple[str, str]:
        i = next(i for i, line in enumerate(lines) if line.strip().startswith(name + " "))
        return lines[i], lines[i + 1]

    head, cmd = entry("trainer[0]")
    assert head.split()[1:] == ["cpus=0-1", "threads=2"]
    assert "OMP_NUM_THREADS=2" in cmd and "MKL_NUM_THREADS=2" in cmd
    assert "-m rollmesh.runtime.cpus 0-1 'trainer[0] on host local' -- -m rollmesh role" in cmd
    head, cmd = entry("agent_worker[0]")
    assert head.split()[1:] == ["cpus=1", "threads=1"] and "-m rollmesh.runtime.cpus 1 " in cmd
    assert entry("agent_worker[1]")[0].split()[1:] == ["cpus=0", "threads=1"]
    head, cmd = entry("engine[0]")
    assert head.split()[1:] == ["cpus=0", "threads=1"]
    assert (f"{sys.executable} -m rollmesh.runtime.cpus 0 'engine[0] on host local' -- "
            f"{sys.executable} -m rollmesh engine") in cmd
    # no cpus of its own, the launcher pinned: it keeps the launcher's affinity from before
    head, cmd = entry("rollouter[0]")
    before = format_cpulist(os.sched_getaffinity(0))
    assert f"cpus={before} (the launcher's own, before launcher_cpus)" in head
    assert "OMP_NUM_THREADS" not in cmd
    by_name = {p.name: p for p in plan}
    assert by_name["trainer[0]"].config["threads"] == 2  # torch.set_num_threads in the rank
    assert "threads" not in by_name["message_queue[0]"].config


def test_the_host_env_and_the_engine_threads_flag_win_over_the_cpu_count(tmp_path, capsys):
    cluster = load_cluster(cluster_file(
        tmp_path, {"engine": 'cpus = "0-1"', "trainer": 'cpus = "0-1"'},
        hosts='env = { OMP_NUM_THREADS = "1" }'),
        ['engine.extra_args=["--threads", "1"]'])
    plan = {p.name: p for p in plan_of(cluster, tmp_path / "run")}
    assert plan["trainer[0]"].config["threads"] == 1
    assert "OMP_NUM_THREADS" not in plan["trainer[0]"].env()  # the host's own is kept
    assert plan["trainer[0]"].env()["MKL_NUM_THREADS"] == "1"
    print_plan(cluster, list(plan.values()), str(tmp_path / "run"))
    out = capsys.readouterr().out
    assert "engine[0]          cpus=0-1 threads: --threads" in out


def test_without_cpus_nothing_is_wrapped(tmp_path, capsys):
    cluster = load_cluster(cluster_file(tmp_path))
    plan = plan_of(cluster, tmp_path / "run")
    assert all(not p.cpus and not p.env() for p in plan)
    print_plan(cluster, plan, str(tmp_path / "run"))
    out = capsys.readouterr().out
    assert "rollmesh.runtime.cpus" not in out and "cpus=" not in out


def test_a_slurm_step_with_cpus_leaves_binding_to_the_prelude():
    host = SlurmHost("node0", HostConfig(address="gpu01", launch="slurm"))
    pinned_argv = host.argv(pinned(["-m", "x"], (2, 3), "w"), thread_env((2, 3), {}), "w-0")
    plain = host.argv(["-m", "x"], {}, "r-0")
    assert "--cpu-bind=none" in pinned_argv and "--cpu-bind=none" not in plain
    assert pinned_argv[pinned_argv.index("python3"):][:5] == [
        "python3", "-m", "rollmesh.runtime.cpus", "2-3", "w"]


def test_an_ssh_command_carries_the_prelude_and_thread_env():
    host = make_host("far", HostConfig(address="far.example", launch="ssh", python="py"))
    line = host.argv(pinned(["-m", "rollmesh", "role"], (4, 5), "trainer[0] on host far"),
                     thread_env((4, 5), {}))[-1]
    assert ("exec env MKL_NUM_THREADS=2 OMP_NUM_THREADS=2 ROLLMESH_CPUS=4-5 py -m rollmesh.runtime.cpus "
            "4-5 'trainer[0] on host far' -- -m rollmesh role") in line


# --------------------------------------------------------------------------------------------
# At start
# --------------------------------------------------------------------------------------------


def prelude(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollmesh.runtime.cpus", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def allowed(status: str) -> str:
    return next(line.split(":", 1)[1].strip() for line in status.splitlines()
                if line.startswith("Cpus_allowed_list"))


def test_the_prelude_pins_python_args_and_full_commands():
    last = format_cpulist([max(HERE)])
    out = prelude(last, "x", "--", "-c", "import os; print(open('/proc/self/status').read()); "
                  "print('env', os.environ['ROLLMESH_CPUS'])")
    assert out.returncode == 0, out.stderr
    assert allowed(out.stdout) == last and f"env {last}" in out.stdout
    out = prelude(format_cpulist(HERE), "x", "--", "cat", "/proc/self/status")
    assert out.returncode == 0 and allowed(out.stdout) == format_cpulist(HERE), out.stderr


def test_the_prelude_refuses_cpus_the_host_lacks_naming_process_host_and_what_it_has():
    out = prelude(f"0,{ABSENT}", "trainer[0] on host node1", "--", "-c", "print('ran')")
    assert out.returncode == 2 and "ran" not in out.stdout
    assert out.stderr.strip() == (
        f"rollmesh: trainer[0] on host node1: cpus '0,{ABSENT}': CPU {ABSENT} is not on this "
        f"host ({os.uname().nodename}), which has CPUs {format_cpulist(HERE)}")
    out = prelude("0-", "w", "--", "-c", "pass")
    assert out.returncode == 2 and "'0-' is neither" in out.stderr


