"""Plots of a run's metrics.jsonl with matplotlib (`rollmesh plot`, and reward.png at a run's end).

`plot_run(RUN)` draws one panel per family of the trainer's keys that the rows hold (reward,
staleness, KL and entropy, response length, throughput, sync times, eval pass@k) against the
trainer step; `plot_run(RUN, metrics=[...])` one panel per named key. matplotlib's object API
(Figure + the Agg canvas) is imported inside the functions: no pyplot, no global state, no
display, and importing this module stays cheap.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

SAMPLES_PER_S = "samples_per_s"  # derived: a row's samples over the time since the step before
_PASS_AT = re.compile(r"^eval_pass@(\d+)$")


@dataclass(frozen=True)
class Panel:
    """One axes: `left` keys on the y axis, `right` keys on a second y axis (other units)."""

    title: str
    left: tuple[str, ...]
    right: tuple[str, ...] = ()
    ylabel: str = ""
    right_ylabel: str = ""
    smooth: tuple[str, ...] = ()  # keys also drawn as a moving average (noisy per-step figures)


# The default panels, in order; a panel is drawn if the rows hold one of its keys.
PANELS = (
    Panel("reward", ("reward_mean", "eval_reward_mean"), ylabel="reward",
          smooth=("reward_mean",)),
    Panel("staleness", ("batch_staleness_mean", "batch_staleness_max",
                        "batch_admission_age_mean", "batch_admission_age_max"),
          ylabel="versions"),
    Panel("KL and entropy", ("kl_loss", "approx_kl"), ("entropy",), ylabel="KL",
          right_ylabel="entropy"),
    Panel("response length", ("response_tokens_mean",), ylabel="tokens"),
    Panel("throughput", (SAMPLES_PER_S,), ("wait_s",), ylabel="samples/s",
          right_ylabel="trainer wait for a batch (s)"),
    Panel("sync times", ("sync_idle_s", "sync_pause_s", "sync_wait_s", "sync_broadcast_s",
                         "sync_resume_s"), ylabel="seconds"),
)
PASS_AT_TITLE = "eval pass@k"


def read_metrics(metrics_path: Path) -> list[dict]:
    """The rows of a metrics.jsonl, one per step, in step order. A step trained again (the
    trainer restarted from a checkpoint before that step; the trainer trims the rows past its
    checkpoint when it starts, but a file copied mid-restart or an older run may hold both)
    counts once: its last row, which describes the update the run kept. A torn or non-JSON line
    is skipped."""
    by_step: dict[object, dict] = {}
    unnumbered: list[dict] = []
    for line in Path(metrics_path).read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict):
            continue
        if isinstance(row.get("step"), int):
            by_step.pop(row["step"], None)  # re-inserted: the dict keeps the newest last
            by_step[row["step"]] = row
        else:
            unnumbered.append(row)
    return [by_step[s] for s in sorted(by_step)] + unnumbered  # type: ignore[type-var]


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _with_derived(rows: Sequence[dict]) -> list[dict]:
    """The rows with a step number, plus samples_per_s: a row's samples over the wall time since
    the previous step's row (waiting and syncing included: what the run achieved)."""
    out: list[dict] = []
    prev: dict | None = None
    for row in rows:
        if not isinstance(row.get("step"), int):
            continue
        row = dict(row)
        samples, t = _number(row.get("samples")), _number(row.get("time"))
        if prev is not None and samples is not None and t is not None:
            pt = _number(prev.get("time"))
            if prev["step"] == row["step"] - 1 and pt is not None and t > pt:
                row[SAMPLES_PER_S] = samples / (t - pt)
        out.append(row)
        prev = row
    return out


def numeric_keys(rows: Sequence[dict]) -> list[str]:
    """The keys that hold a number in some row (what can be plotted), sorted."""
    return sorted({k for r in _with_derived(rows) for k, v in r.items()
                   if k != "step" and _number(v) is not None})


def _series(rows: Sequence[dict], key: str) -> tuple[list[float], list[float]]:
    pts = [(float(r["step"]), _number(r.get(key))) for r in rows]
    return [x for x, y in pts if y is not None], [y for _, y in pts if y is not None]


def _moving_average(ys: list[float], k: int) -> list[float]:
    return [sum(ys[i - k + 1:i + 1]) / k for i in range(k - 1, len(ys))]


def _draw(ax: Axes, rows: Sequence[dict], keys: Sequence[str], smooth: Sequence[str],
          colors: Any) -> list[Any]:
    lines = []
    for key in keys:
        xs, ys = _series(rows, key)
        if not ys:
            continue
        # few points, or not every step (eval rounds, syncs every n steps): show the points
        points = len(ys) <= 30 or len(ys) < 0.9 * len(rows)
        color = next(colors)
        k = max(1, len(ys) // 10)
        if key in smooth and k > 1:
            lines += ax.plot(xs, ys, color=color, alpha=0.35, linewidth=1, label=key)
            lines += ax.plot(xs[k - 1:], _moving_average(ys, k), color=color, linewidth=2,
                             label=f"{key} (mean of {k})")
        else:
            lines += ax.plot(xs, ys, color=color, marker="o" if points else None,
                             markersize=3, linewidth=1.5, label=key)
    return lines


def _draw_panel(ax: Axes, rows: Sequence[dict], panel: Panel) -> None:
    import itertools

    from matplotlib import rcParams
    from matplotlib.ticker import MaxNLocator

    colors = itertools.cycle(rcParams["axes.prop_cycle"].by_key()["color"])
    lines = _draw(ax, rows, panel.left, panel.smooth, colors)
    if panel.right and any(_series(rows, k)[1] for k in panel.right):
        twin = ax.twinx()
        lines += _draw(twin, rows, panel.right, panel.smooth, colors)
        twin.set_ylabel(panel.right_ylabel)
    ax.set_title(panel.title)
    ax.set_xlabel("trainer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    if lines:
        ax.legend(lines, [line.get_label() for line in lines], fontsize="small", loc="best")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def panels_for(rows: Sequence[dict], metrics: Sequence[str] | None = None) -> list[Panel]:
    """The panels to draw: the default ones whose keys the rows hold, or one per named metric.
    A named metric no row holds raises ValueError listing the keys there are."""
    available = numeric_keys(rows)
    if metrics is not None:
        if not metrics:
            raise ValueError("no metric named; available: " + ", ".join(available))
        unknown = [m for m in metrics if m not in available]
        if unknown:
            raise ValueError(f"unknown metric {', '.join(unknown)}; available: "
                             + ", ".join(available))
        return [Panel(m, (m,)) for m in metrics]
    have = set(available)
    panels = [p for p in PANELS if have & set(p.left + p.right)]
    pass_at = sorted((k for k in have if _PASS_AT.match(k)),
                     key=lambda k: int(_PASS_AT.match(k).group(1)))  # type: ignore[union-attr]
    if pass_at:
        panels.append(Panel(PASS_AT_TITLE, tuple(pass_at), ylabel="pass rate"))
    if not panels:
        raise ValueError("none of the default panels' keys is in the rows; name metrics "
                         "instead, from: " + ", ".join(available))
    return panels


def build_figure(rows: Sequence[dict], metrics: Sequence[str] | None = None) -> Figure:
    """A figure with one panel per default family the rows hold (or per named metric), in a
    grid of two columns, x = trainer step."""
    from matplotlib.figure import Figure

    rows = _with_derived(rows)
    if not rows:
        raise ValueError("no metrics rows with a step")
    panels = panels_for(rows, metrics)
    cols = 1 if len(panels) == 1 else 2
    nrows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(8 if cols == 1 else 13, 4.5 if nrows == 1 else 3.4 * nrows),
                 layout="constrained")
    axes = fig.subplots(nrows, cols, squeeze=False).ravel()
    for ax, panel in zip(axes, panels):
        _draw_panel(ax, rows, panel)
    for ax in axes[len(panels):]:
        fig.delaxes(ax)
    return fig


def _save(fig: Figure, out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)


def metrics_file(run_dir_or_metrics_path: Path | str) -> Path:
    """RUN/metrics.jsonl for a run directory, else the path itself; FileNotFoundError naming
    what is missing."""
    path = Path(run_dir_or_metrics_path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file: {path}")
    return path


def plot_run(run_dir_or_metrics_path: Path | str, out: Path | str | None = None,
             metrics: Sequence[str] | None = None) -> list[str]:
    """Draw a run's metrics to `out` (default: plot.png beside metrics.jsonl); returns the panel
    titles drawn. ValueError for a file without rows or an unknown metric."""
    path = metrics_file(run_dir_or_metrics_path)
    rows = read_metrics(path)
    if not rows:
        raise ValueError(f"no metrics rows in {path}")
    fig = build_figure(rows, metrics)
    _save(fig, Path(out) if out is not None else path.parent / "plot.png")
    return [ax.get_title() for ax in fig.axes if ax.get_title()]


def plot_metric(metrics_path: Path, key: str, out: Path) -> None:
    """One metric against the trainer step, with its moving average (reward.png at a run's end).
    A run that wrote no such value still gets its PNG, saying so."""
    from matplotlib.figure import Figure

    rows = _with_derived(read_metrics(metrics_path))
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    panel = Panel(f"{key} by step", (key,), ylabel=key, smooth=(key,))
    _draw_panel(fig.add_subplot(), rows, panel)
    _save(fig, out)
