"""Where the trainer's metrics rows go besides metrics.jsonl: TensorBoard and Weights & Biases.

Opened by the trainer's rank 0 with the experiment config and the directory of metrics.jsonl
(the run directory, or the trainer's directory there on another host). Both sinks are optional:

- TensorBoard, where the `tensorboard` extra is installed: every numeric value of a row as a
  scalar at the row's step, under DIR/tensorboard.
- W&B, where `metrics.wandb_project` is set (the `wandb` extra; without the project wandb is
  never imported): one W&B run per rollmesh run, its directory DIR/wandb (an offline run lands
  in DIR/wandb/offline-run-*, for `wandb sync`), its config the resolved experiment config. The
  run's id is kept in DIR/wandb_run_id, so a trainer restarted from a checkpoint (it trains the
  steps after the checkpoint again) goes on with the same W&B run. W&B drops a row whose `step`
  is not above the last one, so rows carry their step as the `trainer/step` metric instead:
  a step trained again is logged again. The restarted trainer also logs again the rows of the
  last REPLAY_S that metrics.jsonl keeps: W&B may not have written them before the old trainer
  died (a few rows may be there twice, never missing). Mode: WANDB_MODE, else
  `metrics.wandb_mode`. W&B's service process is stopped at `close`.

A sink failing mid-run (W&B's network, a full disk under TensorBoard) is logged once and that
sink is dropped: training goes on and metrics.jsonl keeps every row.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from rollmesh.config import ConfigError, ExperimentConfig, to_dict
from rollmesh.runtime.durable_log import write_atomic

STEP_METRIC = "trainer/step"
TRANSACTION_LOG_FLUSH_S = 1.0
REPLAY_S = 30.0  # covers W&B's 1 s offline flush and its 15 s online send interval


class MissingExtra(ConfigError):
    """A config key asks for an optional package that is not installed."""

    def __init__(self, key: str, package: str, extra: str, detail: str = "") -> None:
        problem = (f"is set but the `{package}` package is "
                   f"{f'not importable ({detail})' if detail else 'not installed'}: "
                   f"pip install 'rollmesh[{extra}]'")
        ValueError.__init__(self, f"{key} {problem}")  # the key leads: no file to name
        self.source, self.key, self.problem = "experiment", key, problem


def import_wandb() -> Any:
    """The `wandb` module, imported quietly; MissingExtra naming the extra if it is absent."""
    os.environ.setdefault("WANDB_SILENT", "true")  # no banners on the role's stdout
    try:
        import wandb
    except ImportError as e:  # absent, or installed but broken (a dependency's version)
        absent = isinstance(e, ModuleNotFoundError) and e.name in ("wandb", None)
        raise MissingExtra("metrics.wandb_project", "wandb", "wandb",
                           "" if absent else f"{type(e).__name__}: {e}") from e
    return wandb


def require_extras(exp: ExperimentConfig) -> None:
    """Fail at the trainer's start, before the model loads, if a configured sink's package is
    missing."""
    if exp.metrics.wandb_project:
        import_wandb()


def tensorboard_writer(directory: Path | None, log: Any) -> Any:
    """A TensorBoard writer in `directory` where the optional extra is installed, else None."""
    if directory is None:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # the `tensorboard` extra is not installed: JSONL only
        return None
    log.info("tensorboard", logdir=str(directory))
    return SummaryWriter(str(directory))


def _numeric(row: dict[str, Any]) -> dict[str, int | float]:
    return {k: v for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


class MetricsSinks:
    """TensorBoard and W&B for rank 0's metrics rows. `open` and `close` block (W&B starts and
    stops its service process): run them off the event loop. `log` is quick."""

    def __init__(self, log: Any, tensorboard: Any = None, wandb_run: Any = None,
                 wandb_module: Any = None) -> None:
        self.log_ = log
        self.tensorboard = tensorboard
        self.wandb_run = wandb_run
        self._wandb = wandb_module

    @classmethod
    def open(cls, exp: ExperimentConfig, metrics_path: Path | None, log: Any) -> MetricsSinks:
        """The sinks the config and the installed extras ask for, in the directory of
        `metrics_path` (None: no files, so no TensorBoard)."""
        directory = metrics_path.parent if metrics_path is not None else None
        tensorboard = tensorboard_writer(directory / "tensorboard" if directory else None, log)
        if not exp.metrics.wandb_project:
            return cls(log, tensorboard)
        wandb = import_wandb()
        try:
            run, resumed = _wandb_init(wandb, exp, directory, log)
        except BaseException:
            if tensorboard is not None:
                tensorboard.close()
            raise
        sinks = cls(log, tensorboard, run, wandb)
        if resumed and metrics_path is not None:
            sinks.replay_to_wandb(metrics_path)
        return sinks

    def replay_to_wandb(self, metrics_path: Path) -> None:
        """A trainer restarted goes on with the W&B run of the one before it, which may have died
        with its last rows unwritten by W&B (flushed every second offline, sent every 15 s
        online). Log again the rows metrics.jsonl keeps from the last REPLAY_S before its newest
        (the rows past the checkpoint are gone from it: they are trained again): W&B may hold
        some of them twice, with the same values at the same trainer/step, but none is lost."""
        rows = _read_rows(metrics_path)
        if not rows or self.wandb_run is None:
            return
        since = rows[-1].get("time", 0.0) - REPLAY_S
        again = [r for r in rows if r.get("time", 0.0) >= since]
        wandb_run, tensorboard, self.tensorboard = self.wandb_run, self.tensorboard, None
        try:
            for row in again:
                self.log(row)
        finally:
            self.tensorboard = tensorboard
        if self.wandb_run is wandb_run:
            self.log_.info("wandb_replayed", rows=len(again), first_step=again[0]["step"],
                           last_step=again[-1]["step"])

    def log(self, row: dict[str, Any]) -> None:
        """One metrics row (a trainer step, eval keys included): its numeric values."""
        values = _numeric(row)
        if self.tensorboard is not None:
            try:
                for key, value in values.items():
                    self.tensorboard.add_scalar(key, value, row["step"])
                self.tensorboard.flush()
            except Exception as e:  # noqa: BLE001 - metrics.jsonl still has the row
                self.log_.warning("tensorboard_failed", error=f"{type(e).__name__}: {e}"[:500])
                self.tensorboard = None
        if self.wandb_run is not None:
            try:
                self.wandb_run.log({STEP_METRIC: row["step"], **values})
            except Exception as e:  # noqa: BLE001 - W&B down: training goes on without it
                self.log_.warning("wandb_failed", step=row.get("step"),
                                  error=f"{type(e).__name__}: {e}"[:500],
                                  note="W&B logging stops for this trainer; metrics.jsonl "
                                       "keeps every row")
                self.wandb_run = None

    def close(self) -> None:
        """Flush TensorBoard, finish the W&B run and stop W&B's service process."""
        if self.tensorboard is not None:
            try:
                self.tensorboard.close()
            except Exception as e:  # noqa: BLE001
                self.log_.warning("tensorboard_failed", error=f"{type(e).__name__}: {e}"[:500])
            self.tensorboard = None
        if self._wandb is None:
            return
        try:
            if self.wandb_run is not None:
                self.wandb_run.finish()
        except Exception as e:  # noqa: BLE001 - the run's rows are in metrics.jsonl anyway
            self.log_.warning("wandb_finish_failed", error=f"{type(e).__name__}: {e}"[:500])
        finally:
            self.wandb_run = None
            try:
                self._wandb.teardown()  # the wandb-core service must not outlive the trainer
            except Exception as e:  # noqa: BLE001
                self.log_.warning("wandb_teardown_failed", error=f"{type(e).__name__}: {e}"[:500])
            self._wandb = None


def _wandb_init(wandb: Any, exp: ExperimentConfig, directory: Path | None,
                log: Any) -> tuple[Any, bool]:
    """The W&B run (resumed: its id was in `directory` already) and whether it was resumed."""
    cfg = exp.metrics
    mode = os.environ.get("WANDB_MODE") or cfg.wandb_mode
    run_id = None
    resumed = False
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        id_path = directory / "wandb_run_id"
        run_id = id_path.read_text().strip() if id_path.exists() else ""
        resumed = bool(run_id)
        if not run_id:
            run_id = uuid.uuid4().hex[:12]  # W&B run ids take [a-z0-9]
            write_atomic(id_path, run_id + "\n")
    name = cfg.wandb_run_name or (_run_name(directory) if directory is not None else None)
    run = wandb.init(
        project=cfg.wandb_project, entity=cfg.wandb_entity, name=name, mode=mode,
        dir=str(directory) if directory is not None else None, config=to_dict(exp),
        tags=list(cfg.wandb_tags) or None, id=run_id, resume="allow" if run_id else None,
        settings=wandb.Settings(**_settings(wandb)))
    run.define_metric(STEP_METRIC)
    run.define_metric("*", step_metric=STEP_METRIC)
    log.info("wandb", project=cfg.wandb_project, entity=cfg.wandb_entity, name=name, mode=mode,
             run_id=run.id, url=getattr(run, "url", None),
             dir=str(Path(run.dir).parent) if mode != "disabled" else None,
             resumed=resumed,
             **({"sync": f"wandb sync {Path(run.dir).parent}"} if mode == "offline" else {}))
    return run, resumed


def _read_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines(keepends=True):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if line.endswith("\n") and isinstance(row, dict) and "step" in row:
                rows.append(row)
    return rows


def _settings(wandb: Any) -> dict[str, Any]:
    """The role's output stays the role's (no console capture); the offline run file is flushed
    every second, not every 15 s (W&B's default): a trainer killed -9 loses W&B's unwritten
    rows with it, and its replacement only logs the steps after the checkpoint again."""
    settings: dict[str, Any] = {"console": "off", "silent": True}
    if "x_transaction_log_flush_interval" in getattr(wandb.Settings, "model_fields", {}):
        settings["x_transaction_log_flush_interval"] = TRANSACTION_LOG_FLUSH_S
    return settings


def _run_name(directory: Path) -> str:
    """The run directory's name: metrics.jsonl is in it, or in its `trainer` directory on a
    trainer host other than the launcher's."""
    directory = directory.resolve()
    return directory.parent.name if directory.name == "trainer" else directory.name
