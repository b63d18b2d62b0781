"""End-to-end tests of wandb (they start processes); the unit tests and the
helpers they share are in tests/unit/test_wandb.py."""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.e2e.test_launcher import finish, launch, metrics, status, wait_for
from tests.unit.test_wandb import (
    WANDB_OFFLINE,
    config_items,
    history_rows,
    wandb_core_pids,
    wandb_records,
)
from tests.unit.test_wandb import wandb_env  # noqa: F401 - pytest fixtures


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_offline_wandb_run_holds_every_step_and_the_resolved_config(tmp_path, wandb_env):
    services_before = wandb_core_pids()
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--set", "trainer.total_steps=6", *WANDB_OFFLINE)
    out = finish(proc, timeout_s=100)
    assert proc.returncode == 0, out[-4000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]

    run_id = (run_dir / "wandb_run_id").read_text().strip()
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and runs[0].name.endswith(f"-{run_id}"), runs
    records = wandb_records(runs[0] / f"run-{run_id}.wandb")

    logged = history_rows(records)
    by_step = {r["trainer/step"]: r for r in logged if "trainer/step" in r}
    assert sorted(by_step) == [1, 2, 3, 4, 5, 6], logged
    for row in rows:  # every numeric value of every row, as metrics.jsonl has it
        wb = by_step[row["step"]]
        assert wb["reward_mean"] == pytest.approx(row["reward_mean"], rel=1e-12, abs=0)
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                assert wb[key] == pytest.approx(value, rel=1e-12), key
        assert "group_ids" not in wb  # lists are not metrics

    config = config_items(records)
    spec = json.loads(next((run_dir / "specs").glob("trainer*.json")).read_text())
    experiment = spec.get("config", spec)["experiment"]
    assert config["data"]["group_size"] == experiment["data"]["group_size"]
    assert config["trainer"]["total_steps"] == 6
    assert config["metrics"]["wandb_project"] == "rollmesh-test"
    run_record = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run_record.project == "rollmesh-test" and run_record.display_name == run_dir.name

    # the trainer said where the run is, once; W&B's service process ended with the trainer
    trainer_log = "".join(p.read_text() for p in (run_dir / "logs").glob("trainer*"))
    said = [json.loads(line) for line in trainer_log.splitlines()
            if line.startswith("{") and '"event": "wandb"' in line]
    assert len(said) == 1 and said[0]["mode"] == "offline" and said[0]["run_id"] == run_id, said
    assert not (wandb_core_pids() - services_before)


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_restarted_trainer_goes_on_with_the_same_wandb_run(tmp_path, wandb_env):
    """kill -9 the trainer past a checkpoint: the launcher restarts it, it trains the steps after
    the checkpoint again, and logs them to the same W&B run (resumed by id; offline, a second
    offline-run directory with that id), none of them dropped for going back in step. W&B may
    not have written the dead trainer's last rows: the new one logs the last kept ones again."""
    run_dir = tmp_path / "run"
    steps, every = 8, 3
    proc = launch(run_dir, "--set", f"trainer.total_steps={steps}", "--set",
                  f"trainer.checkpoint_every={every}", "--set", "rollout.eval_every=0",
                  *WANDB_OFFLINE)
    try:
        # past a checkpoint and not on one: the steps after it are lost with the trainer
        wait_for(lambda: len(metrics(run_dir)) > every and len(metrics(run_dir)) % every != 0,
                 100, "training past a checkpoint", proc)
        trainer = next(p for p in status(run_dir)["processes"] if p["name"] == "trainer[0]")
        os.kill(trainer["pid"], signal.SIGKILL)
    finally:
        out = finish(proc, timeout_s=130)
    assert proc.returncode == 0, out[-4000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))

    run_id = (run_dir / "wandb_run_id").read_text().strip()
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))  # named by start time
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs), runs
    first, second = (history_rows(wandb_records(r / f"run-{run_id}.wandb")) for r in runs)
    log = [json.loads(line) for line in (run_dir / "logs" / "trainer-0.log").read_text()
           .splitlines() if line.startswith("{")]
    kept = [e["step"] for e in log if e["event"] == "resumed"][-1]  # the checkpoint's step
    replayed = [e for e in log if e["event"] == "wandb_replayed"][-1]
    assert kept % every == 0 and replayed["last_step"] == kept, (kept, replayed)
    assert [r["trainer/step"] for r in first] == list(range(1, len(first) + 1))
    assert [r["trainer/step"] for r in second] == [*range(replayed["first_step"], kept + 1),
                                                   *range(kept + 1, steps + 1)]
    assert len(first) + 1 >= replayed["first_step"]  # no step missing between the two
    logged = {r["trainer/step"]: r for r in first + second}  # the latest row of each step
    for row in rows:
        assert logged[row["step"]]["reward_mean"] == row["reward_mean"], row["step"]
        assert logged[row["step"]]["samples_consumed"] == row["samples_consumed"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_launch_without_the_wandb_package_fails_at_the_trainers_start(tmp_path, wandb_env,
                                                                      monkeypatch):
    """Every process of the run finds a `wandb` that is not installed (a module on PYTHONPATH
    that raises as an absent one does): the trainer exits at its start, before loading the
    model, and the launcher's output and the trainer's log say what to install."""
    shim = tmp_path / "no_wandb"
    shim.mkdir()
    (shim / "wandb.py").write_text(
        'raise ModuleNotFoundError("No module named \'wandb\'", name="wandb")\n')
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(shim), os.environ.get("PYTHONPATH")])))
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--set", "trainer.total_steps=4", *WANDB_OFFLINE)
    out = finish(proc, timeout_s=100)
    message = ("metrics.wandb_project is set but the `wandb` package is not installed: "
               "pip install 'rollmesh[wandb]'")
    assert proc.returncode != 0
    assert message in out, out[-3000:]
    assert message in (run_dir / "logs" / "trainer-0.log").read_text()
    assert not metrics(run_dir) and not (run_dir / "wandb").exists()
