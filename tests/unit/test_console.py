"""The console of `rollmesh launch` (rollmesh.launcher.console): what a user sees on a terminal, in a pipe,
with --verbose, and when a role fails. Unit tests of the rendering first (no processes), then
short runs of launch/local.toml (6 trainer steps, ~30 s each on CPU)."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path


from rollmesh.launcher.console import Console, DropSummary, Progress, eval_text, render_line, tail_lines
from tests.e2e.test_launcher import ROOT, free_ports_base

STEPS = 6


# --------------------------------------------------------------------------------------------
# Rendering, without processes
# --------------------------------------------------------------------------------------------


def test_render_line_is_human_readable():
    line = json.dumps({"event": "sync_done", "level": "info", "role": "synchronizer",
                       "host": "h", "timestamp": "2026-01-02T03:04:05.123Z", "version": 3,
                       "pause_s": 0.25})
    text = render_line(line)
    assert re.fullmatch(r"\d\d:\d\d:\d\d info    sync_done version=3 pause_s=0.25", text), text
    assert render_line("plain engine text") == "plain engine text"
    assert render_line('["not", "a record"]') == '["not", "a record"]'


def test_drops_are_summarised_once_per_reason_per_window():
    now = [100.0]
    drops = DropSummary(every_s=10, clock=lambda: now[0])
    drops.update({"stale": 4})
    assert drops.lines() == ["dropped 4 samples (stale); 4 in all"]
    for n in (9, 20, 31):  # three snapshots within the window: no line
        now[0] += 2
        drops.update({"stale": n, "filtered": 2})
        out = drops.lines()
        assert all("stale" not in line for line in out), out
    assert drops.lines() == []  # "filtered" was shown when it first came
    now[0] += 5  # 11 s after the first "stale" line
    assert drops.lines() == ["dropped 27 samples (stale) in the last 11s; 31 in all"]
    assert drops.lines() == []  # nothing new
    drops.update({"stale": 32})
    assert drops.lines(force=True) == ["dropped 1 samples (stale) in the last 0s; 32 in all"]


def test_progress_eta_rate_and_evals():
    p = Progress(total_steps=10)
    rows = [{"step": s, "time": 1000.0 + 2 * s, "samples_consumed": 16 * s, "version": s - 1,
             "reward_mean": 0.5, "batch_staleness_max": 1.0, "sync_idle_s": 0.3}
            for s in range(1, 5)]
    rows[1].update({"eval_reward_mean": 0.25, "eval_version": 1, "eval_pass@1": 0.2,
                    "eval/gsm8k/reward_mean": 0.3})
    evals = p.update(rows)
    assert [r["step"] for r in evals] == [2]
    assert p.update(rows) == []  # an eval is reported once
    assert p.step == 4 and p.eta_s() == 12.0 and p.rate("samples_consumed") == 8.0
    assert "samples/s" in " ".join(p.fields()) and "sync 0.30s" in p.fields()
    assert p.plain(12.3) == ("rollmesh: step 4/10 version 3 reward_mean 0.500 "
                             "staleness_max 1.0 elapsed 12s")
    assert eval_text(evals[0]) == ("eval (version 1): reward_mean 0.250, pass@1 0.200, "
                                   "gsm8k: reward_mean 0.300")


def test_plain_console_rate_limits_progress_and_quiet_shows_only_the_end():
    now = [0.0]
    out = io.StringIO()
    c = Console(10, stream=out, clock=lambda: now[0])
    for step in range(1, 11):
        now[0] += 1
        c.rows([{"step": s, "version": s, "reward_mean": 0.1} for s in range(1, step + 1)])
        c.tick()
    c.event("engine[0] exited with code -9; restarting it")
    c.stop()
    lines = out.getvalue().splitlines()
    steps = [line for line in lines if line.startswith("rollmesh: step")]
    assert len(steps) == 3 and steps[-1].startswith("rollmesh: step 10/10 "), lines  # 1, 6, 10
    assert "rollmesh: engine[0] exited with code -9; restarting it" in lines

    out = io.StringIO()
    c = Console(10, stream=out, quiet=True, clock=lambda: now[0])
    c.rows([{"step": 3, "version": 3, "reward_mean": 0.1, "eval_reward_mean": 0.2}])
    c.tick()
    c.event("not shown")
    c.stop()
    assert out.getvalue().splitlines() == [
        "rollmesh: step 3/10 version 3 reward_mean 0.100 staleness_max None elapsed 0s"]


def test_tail_lines_renders_the_last_lines(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("".join(json.dumps({"event": f"e{i}", "level": "info",
                                       "timestamp": "2026-01-02T03:04:05Z"}) + "\n"
                           for i in range(50)))
    lines = tail_lines(log, 20)
    assert len(lines) == 20 and lines[-1].endswith("info    e49") and "{" not in lines[0]
    assert tail_lines(tmp_path / "missing.log") == []


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------


def launch_args(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rollmesh", "launch", "launch/local.toml", "--run-dir",
            str(run_dir), "--set", f"trainer.total_steps={STEPS}",
            "--set", f"ports.base={free_ports_base()}", *extra]


def run_in_pty(argv: list[str], timeout_s: float = 120) -> tuple[int, str]:
    """Run `argv` with stdout and stderr a pseudo-terminal (120 columns); all it wrote."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave, env=env)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every writer closed
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        else:
            raise AssertionError("the launcher did not finish in time")
        return proc.wait(30), b"".join(chunks).decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


_CSI = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])|\x1b\][^\x07]*\x07|\x1b[()][0-9A-B]")


def screen_lines(raw: str) -> list[str]:
    """What a terminal shows after `raw` (its scrollback included): a small emulator of the
    codes rich's live display writes (CR, LF, cursor up, erase line; colours ignored)."""
    lines, row, col = [""], 0, 0
    pos = 0
    for m in list(_CSI.finditer(raw)) + [None]:
        text = raw[pos: m.start() if m else len(raw)]
        for ch in text:
            if ch == "\n":
                row, col = row + 1, 0
                if row == len(lines):
                    lines.append("")
            elif ch == "\r":
                col = 0
            elif ch >= " ":
                line = lines[row].ljust(col)
                lines[row] = line[:col] + ch + line[col + 1:]
                col += 1
        if m is None:
            break
        pos = m.end()
        arg, code = m.group(1), m.group(2)
        if code == "A":
            row = max(0, row - int(arg or 1))
        elif code == "K":
            lines[row] = "" if arg == "2" else lines[row][:col]
        elif code == "G":
            col = max(0, int(arg or 1) - 1)
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


