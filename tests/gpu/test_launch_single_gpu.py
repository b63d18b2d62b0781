"""`rollmesh launch launch/single_gpu.toml` for a few steps: the built-in engine and the trainer
share the GPU, the weights go over gloo, and the accounting identity holds at the end."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_launcher import check_accounting, finish, free_ports_base, launch, metrics

pytestmark = pytest.mark.slow


def test_single_gpu_launch_runs_and_accounts_for_everything(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--set", "trainer.total_steps=6", "--set", "rollout.eval_every=0",
                  "--set", f"ports.base={free_ports_base()}", cluster="launch/single_gpu.toml")
    out = finish(proc, timeout_s=600)
    assert proc.returncode == 0, out
    rows = metrics(run_dir)
    assert [r["step"] for r in rows][-1] == 6
    summary = check_accounting(run_dir)
    assert summary["consumed"] > 0
    assert max(r["batch_staleness_max"] for r in rows) <= summary["max_staleness"]
    loaded = [line for p in (run_dir / "logs").glob("engine*")
              for line in p.read_text().splitlines() if "model_loaded" in line]
    assert loaded and all("cuda" in line for line in loaded), loaded
    print(json.dumps(summary))
