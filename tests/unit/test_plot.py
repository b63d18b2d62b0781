"""`rollmesh plot` and reward.png: matplotlib panels from a run's metrics.jsonl (their titles
and legends, not pixels)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollmesh.observe.plot import build_figure, plot_metric, plot_run, read_metrics

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
DEFAULT = ["reward", "staleness", "KL and entropy", "response length", "throughput",
           "sync times", "eval pass@k"]


def trainer_row(step: int, *, sync: bool, eval_: bool) -> dict:
    """A row with the keys the trainer writes (step_metrics, wait_s, sync_weights, eval_metrics)."""
    row = {"step": step, "version": step - 1, "time": 1000.0 + 2.0 * step, "loss": 0.01,
           "pg_loss": 0.01, "kl_loss": 0.002 * step, "clip_frac": 0.0, "approx_kl": 0.001,
           "entropy": 7.6 - 0.01 * step, "behaviour_weight_mean": 1.0, "grad_norm": 0.5,
           "lr": 1e-3, "loss_tokens": 512.0, "batch_staleness_max": 1.0,
           "batch_staleness_mean": 0.5, "tokens": 1536, "tokens_per_s": 2800.0, "step_s": 0.5,
           "reward_mean": 0.4 + 0.02 * step, "samples": 32, "response_tokens_mean": 16.0 + step,
           "samples_consumed": 32 * step, "wait_s": 1.5, "group_ids": ["e0-r1-g0"]}
    if sync:
        row.update({"published_version": step, "sync_pause_s": 0.004, "sync_wait_s": 0.008,
                    "sync_broadcast_s": 0.03, "sync_resume_s": 0.01, "sync_idle_s": 0.05,
                    "sync_bytes": 1542400, "sync_attempts": 1})
    if eval_:
        row.update({"eval_reward_mean": 0.5, "eval_version": step - 1, "eval_samples": 16,
                    "eval_failed": 0, "eval_prompts": 4, "eval_pass@1": 0.5, "eval_pass@2": 0.8,
                    "eval_pass@4": 0.9, "eval_pass@16": 1.0, "eval/sea/reward_mean": 0.6,
                    "eval/sea/pass@1": 0.5})
    return row


def write_run(run: Path, steps: int = 12, *, sync_every: int = 2,
              eval_every: int | None = 4) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    rows = [trainer_row(s, sync=s % sync_every == 0,
                        eval_=eval_every is not None and s % eval_every == 1)
            for s in range(1, steps + 1)]
    path = run / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def titled(fig) -> dict:
    """Panel title -> its axes (the twin y axes carry no title)."""
    return {ax.get_title(): ax for ax in fig.axes if ax.get_title()}


def legend(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def rollmesh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollmesh", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_plot_run_draws_the_default_panels_to_run_plot_png(tmp_path):
    write_run(tmp_path / "run")
    assert plot_run(tmp_path / "run") == DEFAULT
    assert (tmp_path / "run" / "plot.png").read_bytes()[:8] == PNG
    axes = titled(build_figure(read_metrics(tmp_path / "run" / "metrics.jsonl")))
    assert list(axes) == DEFAULT
    assert legend(axes["reward"])[-1] == "eval_reward_mean"
    assert legend(axes["KL and entropy"]) == ["kl_loss", "approx_kl", "entropy"]
    assert legend(axes["throughput"]) == ["samples_per_s", "wait_s"]
    # pass@k in the order of k (16 after 4, not after 1)
    assert legend(axes["eval pass@k"]) == ["eval_pass@1", "eval_pass@2", "eval_pass@4",
                                           "eval_pass@16"]
    for ax in axes.values():
        assert ax.get_xlabel() == "trainer step"


def test_panels_whose_keys_no_row_holds_are_left_out(tmp_path):
    # no sync (sync_every past the last step), no evaluation
    path = write_run(tmp_path / "run", steps=5, sync_every=100, eval_every=None)
    axes = titled(build_figure(read_metrics(path)))
    assert list(axes) == ["reward", "staleness", "KL and entropy", "response length",
                          "throughput"]
    assert legend(axes["reward"]) == ["reward_mean"]


def test_samples_per_s_is_samples_over_the_time_since_the_previous_step(tmp_path):
    path = write_run(tmp_path / "run", steps=4)
    fig = build_figure(read_metrics(path), metrics=["samples_per_s"])
    (line,) = titled(fig)["samples_per_s"].get_lines()
    assert list(line.get_xdata()) == [2.0, 3.0, 4.0]  # the first step has no step before it
    assert list(line.get_ydata()) == [16.0, 16.0, 16.0]  # 32 samples, 2 s apart


def test_named_metrics_one_panel_each_and_unknown_names_listed(tmp_path):
    path = write_run(tmp_path / "run")
    out = tmp_path / "sel.png"
    assert plot_run(path, out, metrics=["reward_mean", "entropy"]) == ["reward_mean", "entropy"]
    assert out.read_bytes()[:8] == PNG
    with pytest.raises(ValueError, match=r"unknown metric nope, kl; available: .*reward_mean"):
        plot_run(path, out, metrics=["reward_mean", "nope", "kl"])


def test_no_metrics_file_or_no_rows_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics file: .*metrics.jsonl"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no metrics rows in"):
        plot_run(tmp_path)


def test_cli_plot_default_and_selected_panels(tmp_path):
    run = tmp_path / "run"
    write_run(run)
    out = rollmesh("plot", str(run))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [str(run / "plot.png"), "panels: " + ", ".join(DEFAULT)]
    assert (run / "plot.png").read_bytes()[:8] == PNG
    png = tmp_path / "o" / "two.png"
    out = rollmesh("plot", str(run / "metrics.jsonl"), "--metrics", "reward_mean,eval_pass@2",
                   "-o", str(png))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [str(png), "panels: reward_mean, eval_pass@2"]
    assert png.read_bytes()[:8] == PNG


def test_cli_plot_bad_input_exits_2_with_the_reason(tmp_path):
    run = tmp_path / "run"
    write_run(run)
    out = rollmesh("plot", str(run), "--metrics", "reward_mean,nope")
    assert out.returncode == 2
    assert out.stderr.startswith("rollmesh plot: unknown metric nope; available: ")
    assert "reward_mean" in out.stderr and not (run / "plot.png").exists()
    out = rollmesh("plot", str(tmp_path / "missing"))
    assert out.returncode == 2
    assert out.stderr.strip() == f"rollmesh plot: no metrics file: {tmp_path / 'missing'}"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    out = rollmesh("plot", str(tmp_path / "empty"))
    assert out.returncode == 2
    assert "no metrics rows in" in out.stderr


def test_plot_metric_writes_reward_png_even_without_values(tmp_path):
    path = write_run(tmp_path / "run", steps=3)
    plot_metric(path, "reward_mean", tmp_path / "run" / "reward.png")
    assert (tmp_path / "run" / "reward.png").read_bytes()[:8] == PNG
    empty = tmp_path / "empty.jsonl"  # a run that failed before its first step
    empty.write_text("")
    plot_metric(empty, "reward_mean", tmp_path / "none.png")
    assert (tmp_path / "none.png").read_bytes()[:8] == PNG


def test_importing_the_module_leaves_matplotlib_unloaded():
    code = "import sys, rollmesh.observe.plot; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
