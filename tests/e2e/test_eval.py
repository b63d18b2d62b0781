"""End-to-end tests of eval (they start processes); the unit tests and the
helpers they share are in tests/unit/test_eval.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.unit.test_eval import ROOT, SOURCES, write_eval_set


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_run_reports_pass_at_k_per_source_in_metrics_logs_and_the_monitor(tmp_path):
    from tests.e2e.test_launcher import finish, launch, metrics, wait_for

    prompts, eval_n = 4, 4
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--set", "trainer.total_steps=6", "--set", "rollout.eval_every=2",
                  "--set", f"rollout.eval_n={eval_n}", "--set", "rollout.eval_temperature=1.0",
                  "--set", "rollout.eval_pass_threshold=0.5",
                  "--set", f"data.eval_path={write_eval_set(tmp_path / 'eval.jsonl', prompts)}")
    monitor = None
    snapshots: list[dict] = []
    try:
        # The monitor, attached for the whole run, prints a --json snapshot every second.
        wait_for(lambda: (run_dir / "launcher.json").exists(), 60, "launcher.json", proc)
        monitor = subprocess.Popen(
            [sys.executable, "-m", "rollmesh", "monitor", str(run_dir), "--json", "--wait", "60"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        reader = threading.Thread(
            target=lambda: snapshots.extend(json.loads(line) for line in monitor.stdout),
            daemon=True)
        reader.start()
        out = finish(proc, timeout_s=150)
        deadline = time.monotonic() + 10  # the last published status may still be on its way
        while time.monotonic() < deadline and not any(
                (s.get("eval") or {}).get("by_source") for s in snapshots):
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        if monitor is not None:
            monitor.send_signal(signal.SIGTERM)
            try:
                monitor.wait(10)
            except subprocess.TimeoutExpired:
                monitor.kill()
    assert proc.returncode == 0, out[-3000:]

    rows = [r for r in metrics(run_dir) if "eval_version" in r]
    assert rows, "no metrics row reported an evaluation"
    assert [r["eval_version"] for r in rows] == sorted({r["eval_version"] for r in rows})
    for r in rows:
        assert r["eval_version"] % 2 == 0
        assert r["eval_prompts"] == prompts
        assert r["eval_samples"] + r["eval_failed"] == prompts * eval_n and r["eval_failed"] == 0
        assert 0.0 <= r["eval_pass@1"] <= r["eval_pass@2"] <= r["eval_pass@4"] <= 1.0, r
        assert 0.0 <= r["eval_reward_mean"] <= 1.0
        for s in SOURCES:
            assert 0.0 <= r[f"eval/{s}/reward_mean"] <= 1.0
            assert {f"eval/{s}/pass@{k}" for k in (1, 2, 4)} <= r.keys()
        means = [r[f"eval/{s}/reward_mean"] for s in SOURCES]  # two prompts x 4 answers each
        assert r["eval_reward_mean"] == pytest.approx(sum(means) / 2)

    # The rollouter's `eval` log line: one per round, with the same figures.
    lines = [json.loads(line) for line in (run_dir / "logs/rollouter-0.log").read_text()
             .splitlines() if '"eval"' in line]
    evals = {e["version"]: e for e in lines if e.get("event") == "eval"}
    assert set(evals) >= {r["eval_version"] for r in rows}
    first = evals[rows[0]["eval_version"]]
    assert first["n"] == prompts * eval_n and set(first["by_source"]) == set(SOURCES)
    assert first["pass_at"]["4"] == pytest.approx(rows[0]["eval_pass@4"])

    seen = [s["eval"] for s in snapshots if (s.get("eval") or {}).get("by_source")]
    assert seen, f"no monitor snapshot held an evaluation ({len(snapshots)} snapshots)"
    ev = seen[-1]
    assert ev["version"] in evals and set(ev["by_source"]) == set(SOURCES)
    assert list(ev["pass_at"]) == ["1", "2", "4"] and ev["n"] == prompts * eval_n
