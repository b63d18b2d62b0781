"""The console of `rollmesh launch`: what the user sees while a run goes on.

    terminal   a live display (rich): one progress line (the trainer's step of total, a bar,
               ETA, reward mean, staleness max, samples/s, the last sync's time, elapsed), and
               above it one line per notable event: a role restarted or failed (with the last
               lines of its log), a sync failed, samples dropped (per reason, at most one line
               per DROP_EVERY_S), eval results, the trainer restarted from its checkpoint, the
               progress watchdog. The bar's last state stays on the screen at exit.
    not a tty  plain lines: `rollmesh: step S/T version V reward_mean R staleness_max X
               elapsed Ns` (at most one per PLAIN_EVERY_S, when the step moved) and the event
               lines, each starting with `rollmesh: `.
    --verbose  also every role's log lines (and the launcher's own), human-readable:
               `HH:MM:SS [host role/i] level event key=value ...`.
    --quiet    nothing while it runs but failures' log tails; the final progress line and the
               summary at the end.

Logs go to files whatever the console shows: RUN/logs/<role>-<i>.log and RUN/logs/launcher.log,
JSON lines (one format per sink: JSON in files, human-readable on a terminal).
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, TextIO

PLAIN_EVERY_S = 5.0  # a plain progress line at most this often
PLAIN_IDLE_S = 30.0  # ... and one this often while the step does not move
DROP_EVERY_S = 10.0  # one "dropped" line per reason at most this often
TAIL_LINES = 20  # a failed role's log lines shown
_SKIP = {"event", "level", "timestamp", "role", "host", "instance", "run", "logger"}
# role log events shown as event lines (besides --verbose)
SYNC_FAILURES = {"sync_failed", "sync_timed_out"}


def _clock_time(stamp: Any) -> str:
    """An ISO timestamp (UTC, as structlog writes it) as local HH:MM:SS."""
    try:
        t = _dt.datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
        return t.astimezone().strftime("%H:%M:%S")
    except ValueError:
        return ""


def render_line(line: str) -> str:
    """A JSON log line as `HH:MM:SS level   event key=value ...`; anything else as it is."""
    try:
        rec = json.loads(line)
    except ValueError:
        return line
    if not isinstance(rec, dict) or "event" not in rec:
        return line
    rest = " ".join(f"{k}={v}" for k, v in rec.items() if k not in _SKIP)
    when = _clock_time(rec["timestamp"]) + " " if "timestamp" in rec else ""
    return f"{when}{rec.get('level', ''):7s} {rec['event']} {rest}".rstrip()


def tail_lines(path: Path | str | None, n: int = TAIL_LINES, width: int = 240) -> list[str]:
    """The last `n` lines of a log file, human-readable, each cut to `width` characters
    (nothing if it cannot be read)."""
    if path is None:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            data = f.read()
    except OSError:
        return []
    lines = [render_line(line) for line in data.decode(errors="replace").splitlines()[-n:]
             if line.strip()]
    return [line if len(line) <= width else line[: width - 1] + "…" for line in lines]


def _hms(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _num(value: Any, fmt: str = ".3f") -> str:
    return "-" if value is None else (f"{value:{fmt}}" if isinstance(value, (int, float)) else str(value))


class Progress:
    """Where training stands, from the trainer's metrics rows (one per step)."""

    def __init__(self, total_steps: int):
        self.total = total_steps
        self.rows: deque[dict[str, Any]] = deque(maxlen=20)
        self.last: dict[str, Any] = {}
        self.eval_step = 0

    def update(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Take every row so far (metrics.jsonl, one row per step); returns the rows with an
        eval round not seen before."""
        if not rows:
            return []
        self.rows = deque(rows[-20:], maxlen=20)
        self.last = rows[-1]
        evals = [r for r in rows if "eval_reward_mean" in r and r.get("step", 0) > self.eval_step]
        if evals:
            self.eval_step = evals[-1].get("step", 0)
        return evals

    @property
    def step(self) -> int:
        return int(self.last.get("step") or 0)

    def rate(self, key: str) -> float | None:
        """`key` per second over the recent rows (their `time`)."""
        rows = [r for r in self.rows if isinstance(r.get("time"), (int, float)) and key in r]
        if len(rows) < 2 or rows[-1]["time"] <= rows[0]["time"]:
            return None
        return (rows[-1][key] - rows[0][key]) / (rows[-1]["time"] - rows[0]["time"])

    def eta_s(self) -> float | None:
        steps_per_s = self.rate("step")
        if not steps_per_s or steps_per_s <= 0:
            return None
        return max(0, self.total - self.step) / steps_per_s

    def plain(self, elapsed_s: float) -> str:
        last = self.last
        return (f"rollmesh: step {last.get('step')}/{self.total} "
                f"version {last.get('version')} reward_mean {last.get('reward_mean', 0):.3f} "
                f"staleness_max {last.get('batch_staleness_max')} "
                f"elapsed {elapsed_s:.0f}s")

    def fields(self) -> list[str]:
        last = self.last
        out = [f"reward {_num(last.get('reward_mean'))}",
               f"staleness {_num(last.get('batch_staleness_max'), 'g')}"]
        sps = self.rate("samples_consumed")
        out.append(f"{_num(sps, '.1f')} samples/s")
        if last.get("sync_idle_s") is not None:
            out.append(f"sync {last['sync_idle_s']:.2f}s")
        return out


def eval_text(row: dict[str, Any]) -> str:
    """An eval round of a metrics row (rollmesh.core.evaluation.eval_metrics' keys) as one line."""
    parts = [f"eval (version {row.get('eval_version')}): reward_mean "
             f"{_num(row.get('eval_reward_mean'))}"]
    parts += [f"{k.removeprefix('eval_')} {_num(v)}" for k, v in sorted(row.items())
              if k.startswith("eval_pass@")]
    sources = sorted({k.split("/")[1] for k in row if k.startswith("eval/")})
    for s in sources:
        parts.append(f"{s}: reward_mean {_num(row.get(f'eval/{s}/reward_mean'))}")
    if row.get("eval_failed"):
        parts.append(f"failed {row['eval_failed']}")
    return ", ".join(parts)


class DropSummary:
    """Samples dropped, from cumulative counts per reason: at most one line per reason per
    `every_s`, with the count since the last line and the total."""

    def __init__(self, every_s: float = DROP_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.every_s, self.clock = every_s, clock
        self.totals: dict[str, int] = {}
        self.shown: dict[str, int] = {}  # the total at the last line
        self.last_line: dict[str, float] = {}

    def update(self, totals: dict[str, int]) -> None:
        for reason, n in totals.items():
            self.totals[reason] = max(int(n), self.totals.get(reason, 0))

    def lines(self, force: bool = False) -> list[str]:
        now, out = self.clock(), []
        for reason, total in sorted(self.totals.items()):
            new = total - self.shown.get(reason, 0)
            if new <= 0:
                continue
            if not force and now - self.last_line.get(reason, -1e18) < self.every_s:
                continue
            since = now - self.last_line[reason] if reason in self.last_line else None
            window = f" in the last {since:.0f}s" if since is not None else ""
            out.append(f"dropped {new} samples ({reason}){window}; {total} in all")
            self.shown[reason], self.last_line[reason] = total, now
        return out


class Console:
    """The launcher's console (see the module's docstring). Thread-safe: role lines come from
    the pumps' threads."""

    def __init__(self, total_steps: int, *, verbose: bool = False, quiet: bool = False,
                 stream: TextIO | None = None, live: bool | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.stream = stream if stream is not None else sys.stdout
        self.verbose, self.quiet = verbose, quiet and not verbose
        isatty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.live_mode = (isatty if live is None else live) and not self.quiet
        self.clock = clock
        self.started = clock()
        self.progress = Progress(total_steps)
        self.drops = DropSummary(clock=clock)
        self.state = "starting"
        self.lock = threading.RLock()
        self.last_plain = -1e18
        self.last_plain_step: int | None = None
        self._live: Any = None
        self._rich: Any = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if not self.live_mode or self._live is not None:
            return
        from rich.console import Console as RichConsole
        from rich.live import Live

        self._rich = RichConsole(file=self.stream, highlight=False, soft_wrap=False)
        self._live = Live(self, console=self._rich, refresh_per_second=4, transient=False,
                          redirect_stdout=False, redirect_stderr=False)
        self._live.start()

    def stop(self) -> None:
        """End the live display (its last state stays on the screen); plain: the last
        progress line."""
        with self.lock:
            for line in self.drops.lines(force=True):
                self.event(line)
            if self._live is not None:
                self._live.refresh()
                self._live.stop()
                self._live = None
            elif self.progress.last and (self.quiet
                                         or self.progress.step != self.last_plain_step):
                self._write(self.progress.plain(self.elapsed()))
                self.last_plain_step = self.progress.step

    def __rich__(self) -> Any:
        """The progress display (rich calls this on every refresh): the bar's line, and the
        figures' line under it."""
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        p = self.progress
        total = max(p.total, 1)
        eta = p.eta_s()
        head = f"step {p.step}/{p.total}" if p.last else f"{self.state}..."
        grid = Table.grid(padding=(0, 1))
        grid.add_column(no_wrap=True, min_width=len(head))
        grid.add_column(width=30, no_wrap=True)
        grid.add_column(no_wrap=True)
        grid.add_row(head, ProgressBar(total=total, completed=min(p.step, total), width=30),
                     f"{100 * p.step / total:3.0f}%  ETA {_hms(eta) if eta is not None else '-'}"
                     f"  elapsed {_hms(self.elapsed())}")
        if not p.last:
            return grid
        return Group(grid, Text("  " + "  ".join(p.fields()), no_wrap=True, overflow="ellipsis"))

    def elapsed(self) -> float:
        return self.clock() - self.started

    # -- output ----------------------------------------------------------------------------

    def _write(self, text: str) -> None:
        with self.lock:
            if self._live is not None:
                from rich.text import Text

                self._rich.print(Text(text), soft_wrap=True)
            else:
                self.stream.write(text + "\n")
                self.stream.flush()

    def info(self, text: str) -> None:
        """A line the user always sees (the run directory, the final summary)."""
        self._write(text)

    def event(self, text: str) -> None:
        """A notable event: a line above the progress bar (plain: `rollmesh: TEXT`)."""
        if self.quiet:
            return
        self._write(text if self._live is not None else f"rollmesh: {text}")

    def show_tail(self, title: str, log_path: Path | str | None, n: int = TAIL_LINES) -> None:
        """The last lines of a role's log, human-readable (shown even with --quiet)."""
        lines = tail_lines(log_path, n)
        title = re.sub(r" \(log: [^)]*\)$", "", title)  # the path follows
        with self.lock:
            self._write(f"rollmesh: {title}; the last {len(lines)} lines of {log_path}:")
            for line in lines:
                self._write(f"  | {line}")

    # -- inputs ----------------------------------------------------------------------------

    def role_line(self, label: str, line: str) -> None:
        """A role's (or engine's) log line, as the pump reads it: shown with --verbose; a
        sync failure becomes an event line."""
        if self.verbose:
            self._write(f"[{label}] {render_line(line)}")
        if '"sync_' in line:
            try:
                rec = json.loads(line)
            except ValueError:
                return
            if isinstance(rec, dict) and rec.get("event") in SYNC_FAILURES and not self.verbose:
                why = rec.get("error") or (f"timed out after {rec['timeout_s']}s"
                                           if "timeout_s" in rec else "")
                self.event(f"sync of version {rec.get('version')} failed ({label}): {why}")

    def rows(self, rows: list[dict[str, Any]]) -> None:
        """The trainer's metrics rows (all of metrics.jsonl so far)."""
        with self.lock:
            for row in self.progress.update(rows):
                self.event(eval_text(row))

    def dropped(self, totals: dict[str, int]) -> None:
        """Samples dropped so far, per reason (cumulative counts)."""
        with self.lock:
            self.drops.update(totals)

    def tick(self) -> None:
        """Called every second or so: dropped-sample lines due; plain progress lines."""
        with self.lock:
            for line in self.drops.lines():
                self.event(line)
            if self._live is not None or self.quiet or not self.progress.last:
                return
            now = self.clock()
            moved = self.progress.step != self.last_plain_step
            if now - self.last_plain >= (PLAIN_EVERY_S if moved else PLAIN_IDLE_S):
                self._write(self.progress.plain(self.elapsed()))
                self.last_plain, self.last_plain_step = now, self.progress.step


class LogStream:
    """A file-like sink for the launcher's structlog lines (JSON) under --verbose: each line
    shown through the console like a role's."""

    def __init__(self, console: Console, label: str):
        self.console, self.label, self.buf = console, label, ""

    def write(self, text: str) -> int:
        self.buf += text
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            self.console.role_line(self.label, line)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False
