"""A launched run in colocated mode (`launch/local_colocated.toml`: `colocate = true`): the
engine and the trainer take turns. It completes, nothing is lost (the accounting identity), the
versions advance one per step, and the turns really alternate: the engine gave its memory back
once per step and decoded nothing while it was released (its own decode-step counter, logged at
release and at resume), and every step's row carries its turn's timings."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_launcher import (
    assert_staleness_rule,
    check_accounting,
    finish,
    launch,
    metrics,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
STEPS = 6


def test_a_colocated_run_takes_turns_and_loses_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--set", f"trainer.total_steps={STEPS}",
                  cluster="launch/local_colocated.toml")
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    summary = check_accounting(run_dir)
    rows = metrics(run_dir)
    assert_staleness_rule(rows, summary)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["published_version"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["colocate_turn_s"] >= r["colocate_step_s"] > 0 for r in rows), rows[0]

    events = [json.loads(line) for line in (run_dir / "logs" / "engine-0.log").read_text()
              .splitlines() if line.startswith("{") and '"memory_' in line]
    turns = [e for e in events if e["event"] in ("memory_released", "memory_resumed")]
    kinds = [e["event"] for e in turns]
    assert kinds == ["memory_released", "memory_resumed"] * STEPS, kinds
    for released, resumed in zip(turns[::2], turns[1::2]):
        assert released["tags"] == resumed["tags"] == ["kv_cache", "cuda_graph"]
        assert released["decode_steps"] == resumed["decode_steps"]  # nothing decoded meanwhile
    # between two turns the engine generated (rollout resumed after each sync)
    assert turns[-1]["decode_steps"] > turns[0]["decode_steps"]
