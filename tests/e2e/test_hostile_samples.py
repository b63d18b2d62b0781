"""A whole run fed by a buggy agent loop (issue 35): one prompt in four goes to a loop that
appends a token id far past the vocabulary. Such a row crashed the trainer twice (IndexError)
and its restart erased metrics.jsonl. Now the rollouter drops each such group, reason
`invalid`, logged with the worker it came from; the trainer never sees one, never restarts; the
run finishes with one row per step and the identity exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_launcher import check_accounting, finish, launch, metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


def test_a_loop_that_spoils_its_rows_loses_its_groups_as_invalid_and_nothing_else(tmp_path):
    rows = [json.loads(line) for line in
            (ROOT / "configs/data/letters_train.jsonl").read_text().splitlines() if line.strip()]
    for i, row in enumerate(rows):
        if i % 4 == 0:
            row["agent_loop"] = "spoiled_tokens"
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    steps = 12
    proc = launch(run_dir, "--set", f"trainer.total_steps={steps}", "--set", "rollout.eval_every=0",
                  "--set", f"data.train_path={data}")
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, steps + 1))
    assert not any("invalid_samples" in r for r in metrics(run_dir))  # none reached the trainer
    summary = check_accounting(run_dir)
    assert summary["dropped"].get("invalid", 0) > 0, summary
    assert set(summary["dropped"]) <= {"invalid", "filtered", "stale"}, summary["dropped"]
    log = (run_dir / "logs" / "rollouter-0.log").read_text()
    events = [json.loads(line) for line in log.splitlines() if '"sample_invalid"' in line]
    assert events and all("outside the vocabulary" in e["why"] and e["worker"].startswith(
        "agent_worker") for e in events), events[:3]
    trainer_log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "IndexError" not in trainer_log and '"fatal"' not in trainer_log
    status = json.loads((run_dir / "status.json").read_text())
    assert all(p["restarts"] == 0 for p in status["processes"]), status["processes"]
