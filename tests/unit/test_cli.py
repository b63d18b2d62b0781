"""The `rollmesh` command as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def rollmesh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollmesh", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_version():
    out = rollmesh("--version")
    assert out.returncode == 0 and out.stdout.strip() == "0.1.0"


def test_config_prints_the_resolved_config_with_overrides():
    out = rollmesh("config", "configs/tiny_cpu.toml", "--set", "staleness.max_staleness=0")
    assert out.returncode == 0, out.stderr
    assert "[staleness]\nmax_staleness = 0" in out.stdout


def test_config_error_names_file_key_and_expectation(tmp_path):
    bad = tmp_path / "x.toml"
    bad.write_text((ROOT / "configs/tiny_cpu.toml").read_text()
                   .replace("max_staleness = 1", "max_staleness = -1"))
    out = rollmesh("config", str(bad))
    assert out.returncode == 2
    assert out.stderr.strip() == f"rollmesh: {bad}: staleness.max_staleness: expected int >= 0, got -1"


def test_launch_dry_run_prints_the_command_per_host_and_starts_nothing(tmp_path):
    out = rollmesh("launch", "launch/local.toml", "--dry-run", "--run-dir", str(tmp_path / "r"))
    assert out.returncode == 0, out.stderr
    for role in ("engine[0]", "rollouter[0]", "agent_worker[1]", "message_queue[0]", "trainer[0]"):
        assert role in out.stdout
    assert "-m rollmesh engine --model tiny" in out.stdout
    assert f"-m rollmesh role --spec '{tmp_path / 'r'}/specs/rollouter[0].json'" in out.stdout
    assert not (tmp_path / "r").exists()  # nothing was started or written


def test_role_command_rejects_a_bad_spec():
    out = rollmesh("role", "--spec", '{"role": "x", "entry": "a:b", "control": "tcp://127.0.0.1:1", "bogus": 1}')
    assert out.returncode != 0 and "unknown key(s) ['bogus']" in out.stderr


def test_gpu_example_dry_run_plans_sglang_engines_and_fsdp_ranks_over_ssh(tmp_path):
    out = rollmesh("launch", "launch/gsm8k_gpu.example.toml", "--dry-run",
                   "--run-dir", str(tmp_path / "r"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("-m sglang.launch_server --model-path /models/Qwen2.5-1.5B-Instruct") == 4
    assert "CUDA_VISIBLE_DEVICES=3" in out.stdout and "--tp-size 1" in out.stdout
    assert out.stdout.count("over ssh") == 2 and "BatchMode=yes" in out.stdout
    assert out.stdout.count("specs/trainer[") == 4
    assert not (tmp_path / "r").exists()


def test_8gpu_example_dry_run_warns_of_the_missing_model_where_a_launch_refuses(tmp_path):
    """The command the example's header suggests, on a machine without its model: the dry run
    prints the plan and warns; a launch refuses with the same message, starting nothing."""
    model = "/models/Qwen2.5-1.5B-Instruct"  # configs/gsm8k_grpo.toml's model.path
    if Path(model).exists():
        pytest.skip(f"{model} exists on this machine")
    out = rollmesh("launch", "launch/gsm8k_8gpu.example.toml", "--dry-run",
                   "--run-dir", str(tmp_path / "r"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("-m sglang.launch_server --model-path " + model) == 4
    assert out.stdout.count("specs/trainer[") == 4
    warnings = [l for l in out.stderr.splitlines() if l.startswith("rollmesh launch: warning: ")]
    assert len(warnings) == 1 and "model.path" in warnings[0] and repr(model) in warnings[0]
    assert not (tmp_path / "r").exists()

    launch = rollmesh("launch", "launch/gsm8k_8gpu.example.toml", "--run-dir", str(tmp_path / "r"))
    assert launch.returncode == 2
    refusal = launch.stderr.strip()
    problem = warnings[0].removeprefix("rollmesh launch: warning: ").removesuffix(
        " (a launch on this machine would stop here)")
    assert refusal == f"rollmesh launch: {problem}"
    assert not (tmp_path / "r").exists()


def test_dry_run_warns_of_a_host_python_this_machine_lacks(tmp_path):
    """Before launch/bootstrap.sh (no .venv): the plan names the python as configured."""
    out = rollmesh("launch", "launch/local.toml", "--dry-run", "--run-dir", str(tmp_path / "r"),
                   "--set", "hosts.local.python=.not-made-yet/bin/python")
    assert out.returncode == 0, out.stderr
    assert f"{ROOT}/.not-made-yet/bin/python -m rollmesh engine --model tiny" in out.stdout
    assert out.stderr.strip() == (
        f"rollmesh launch: warning: hosts.local.python: {ROOT}/.not-made-yet/bin/python does not "
        "exist (run launch/bootstrap.sh, or set python) (a launch on this machine would stop "
        "here)")

def test_a_launch_with_a_host_python_this_machine_lacks_refuses_in_one_line(tmp_path):
    """The real launch of the case above: one line naming the key, no traceback, no run."""
    out = rollmesh("launch", "launch/local.toml", "--run-dir", str(tmp_path / "r"),
                   "--set", "hosts.local.python=.not-made-yet/bin/python")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"rollmesh launch: hosts.local.python: {ROOT}/.not-made-yet/bin/python does not exist "
        "(run launch/bootstrap.sh, or set python)")
    assert "Traceback" not in out.stderr and not (tmp_path / "r").exists()


def test_readme_configuration_reference_is_in_step_with_the_dataclasses():
    readme = (ROOT / "README.md").read_text()
    start, end = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"
    documented = readme[readme.index(start) + len(start): readme.index(end)].strip()
    generated = rollmesh("config", "--reference").stdout.strip()
    assert documented == generated, "README's reference is stale: regenerate it with " \
        "`rollmesh config --reference`"
