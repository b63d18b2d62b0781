"""A launched run (`rollmesh launch launch/local.toml`) whose weights go to the engine by handle
(`sync.transport = "handles"`: shared memory, /update_weights_from_tensor): it completes,
its accounting holds, the versions advance, and the engine loaded every version from the
trainer's segment (no weight-update group was built)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_launcher import check_accounting, finish, launch, metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_launched_run_syncs_by_handle(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--set", "trainer.total_steps=6", "--set",
                  'sync.transport="handles"')
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    check_accounting(run_dir)
    rows = metrics(run_dir)
    versions = [r["version"] for r in rows]
    assert versions == sorted(versions) and versions[-1] >= 5, versions
    logs = "\n".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    loads = [json.loads(line) for line in logs.splitlines()
             if '"weights_updated"' in line and line.startswith("{")]
    assert loads and all(e["source"] == "tensor" and e["kind"] == "shm" for e in loads), loads[:3]
    assert {int(e["weight_version"]) for e in loads} >= set(range(1, versions[-1] + 1))
    assert "weight_group" not in logs  # no weight-update group joined, none built
