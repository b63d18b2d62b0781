"""End-to-end tests of data_verl (they start processes); the unit tests and the
helpers they share are in tests/unit/test_data_verl.py."""

from __future__ import annotations

import json

import pytest

from tests.unit.test_data_verl import gsm8k_rows, write_verl


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_verl_schema_gsm8k_parquet_file_trains(tmp_path):
    from tests.e2e.test_launcher import check_accounting, finish, launch, metrics

    train = write_verl(tmp_path / "train.parquet", gsm8k_rows("train", 32))
    test = write_verl(tmp_path / "test.parquet", gsm8k_rows("test", 4))
    run_dir, steps = tmp_path / "run", 3
    proc = launch(run_dir, "--set", f"data.train_path={train}", "--set", f"data.eval_path={test}",
                  "--set", "data.format=verl", "--set", "rollout.reward=gsm8k",
                  "--set", "data.max_prompt_tokens=224", "--set", "model.max_context=256",
                  "--set", "rollout.eval_every=1", "--set", "rollout.eval_n=2",
                  "--set", f"trainer.total_steps={steps}")
    out = finish(proc, timeout_s=240)
    assert proc.returncode == 0, out[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows
    for row in rows:
        assert "reward_mean" in row and row["samples_consumed"] > 0, row
    check_accounting(run_dir)
    logs = (run_dir / "logs" / "rollouter-0.log").read_text().splitlines()
    loaded = [json.loads(x) for x in logs if '"dataset_loaded"' in x]
    assert {(e["format"], e["rows"]) for e in loaded} == {("verl", 32), ("verl", 4)}, loaded
    # the rows' data_source reaches the trajectories: the eval figures per source
    assert any("eval/openai/gsm8k/reward_mean" in r for r in rows), rows
