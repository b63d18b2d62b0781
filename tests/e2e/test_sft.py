"""End-to-end tests of sft (they start processes); the unit tests and the
helpers they share are in tests/unit/test_sft.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.unit.test_sft import ROOT, _experiment


@pytest.mark.slow
def test_the_command_refuses_a_config_without_sft_and_the_launcher_waits_for_it(tmp_path):
    cfg = _experiment(tmp_path, 10)
    no_init = tmp_path / "no_init.toml"
    no_init.write_text(cfg.read_text().replace('init = "tiny"', ""))
    run = subprocess.run([sys.executable, "-m", "rollmesh", "sft", str(no_init)],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and "sft.init and sft.data_path" in run.stderr, run.stderr
    cluster = tmp_path / "cluster.toml"
    cluster.write_text((ROOT / "launch" / "agent_local.toml").read_text().replace(
        "../configs/agent_calc.toml", str(cfg)))
    run = subprocess.run([sys.executable, "-m", "rollmesh", "launch", str(cluster), "--run-dir",
                          str(tmp_path / "run")], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"run `rollmesh sft {cfg}` first" in run.stderr, run.stderr
    assert not (tmp_path / "run").exists()
