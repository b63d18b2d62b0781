"""The trainer against what must not lose a run (issue 35): a batch holding a sample the model
cannot take (a token id past the vocabulary crashed the step with an IndexError, twice, and the
restarted trainer erased metrics.jsonl), and a restart that would start again from fresh weights
over a run's history."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
import structlog

from rollmesh.config import TrainerSettings
from rollmesh.training.role import (
    TRAINED_AGAIN, HistoryWithoutCheckpoint, refuse_fresh_start, train_step, trim_metrics,
)
from rollmesh.training.state import build_state
from rollmesh.wire.messages import Batch
from tests.unit.test_trainer import experiment, make_groups

LOG = structlog.get_logger("test")


def test_a_batch_with_a_token_past_the_vocabulary_trains_on_the_rest():
    exp = experiment()
    state = build_state(exp)
    good, bad = make_groups(1)
    bad.trajectories[2].token_ids[-1] = 2**30
    before = {k: v.clone() for k, v in state.model.state_dict().items()}
    metrics = asyncio.run(train_step(state, Batch(step=1, version=0, groups=[good, bad]), 0.0))
    assert state.step == 1 and metrics["invalid_samples"] == 4 and metrics["samples"] == 4
    assert metrics["samples_consumed"] == 8  # as the queue counts what it handed out
    assert any((before[k] != v).any() for k, v in state.model.state_dict().items())
    # a batch of nothing but invalid samples: the step goes by, nothing trains, nothing crashes
    after = {k: v.clone() for k, v in state.model.state_dict().items()}
    metrics = asyncio.run(train_step(state, Batch(step=2, version=0, groups=[bad]), 0.0))
    assert state.step == 2 and metrics["invalid_samples"] == 4 and metrics["samples"] == 0
    assert metrics["samples_consumed"] == 12
    assert all((after[k] == v).all() for k, v in state.model.state_dict().items())


def rows(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_rows_of_steps_trained_again_are_moved_aside_never_erased(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)) + '{"step": 7')
    trim_metrics(path, 4, LOG)
    assert rows(path) == [1, 2, 3, 4] and rows(tmp_path / TRAINED_AGAIN) == [5, 6]
    path.write_text(path.read_text() + "".join(json.dumps({"step": s}) + "\n" for s in (5, 6)))
    trim_metrics(path, 0, LOG)  # killed before its first checkpoint: from step 1 again
    assert path.read_text() == "" and rows(tmp_path / TRAINED_AGAIN) == [5, 6, 1, 2, 3, 4, 5, 6]


def settings(tmp_path: Path, *overrides: str) -> TrainerSettings:
    return TrainerSettings(experiment=experiment(*overrides), message_queue="tcp://127.0.0.1:1",
                           metrics_path=str(tmp_path / "metrics.jsonl"),
                           checkpoint_dir=str(tmp_path / "checkpoints"))


def test_a_trainer_without_checkpoints_refuses_to_start_fresh_over_a_runs_history(tmp_path):
    off = settings(tmp_path, "trainer.checkpoint_every=0", "trainer.checkpoint_every_s=0")
    path = Path(off.metrics_path)
    refuse_fresh_start(path, off)  # a new run: nothing there
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 345)))
    with pytest.raises(HistoryWithoutCheckpoint, match=r"holds 344 trained steps.*no checkpoint"):
        refuse_fresh_start(path, off)
    assert len(rows(path)) == 344
    with pytest.raises(HistoryWithoutCheckpoint):  # no directory to checkpoint to at all
        refuse_fresh_start(path, dataclasses.replace(
            settings(tmp_path, "trainer.checkpoint_every=4"), checkpoint_dir=None))
    # checkpoints on, none written yet: the queue kept the batches; it starts again from step 1
    refuse_fresh_start(path, settings(tmp_path, "trainer.checkpoint_every_s=300"))
