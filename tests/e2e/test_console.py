"""End-to-end tests of console (they start processes); the unit tests and the
helpers they share are in tests/unit/test_console.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest

from tests.e2e.test_launcher import ROOT, metrics, status, wait_for
from tests.unit.test_console import STEPS, launch_args, run_in_pty, screen_lines


@pytest.mark.slow
def test_terminal_shows_a_short_live_display_with_its_final_state(tmp_path):
    """Under a pseudo-terminal: what the terminal shows at the end (the lines of an emulated
    screen, scrollback included: the live bar is repainted in place, so counting the raw
    bytes' newlines would not be what a user sees) is under 60 lines, ends with the bar's
    final state (step N/N), and holds no role log line."""
    run_dir = tmp_path / "run"
    code, raw = run_in_pty(launch_args(run_dir))
    lines = screen_lines(raw)
    text = "\n".join(lines)
    assert code == 0, text[-3000:]
    assert len(lines) < 60, text
    bar = [line for line in lines if re.search(r"step \d+/\d+", line) and "ETA" in line]
    assert bar and f"step {STEPS}/{STEPS}" in bar[-1] and "100%" in bar[-1], text
    figures = lines[lines.index(bar[-1]) + 1]
    assert "reward" in figures and "samples/s" in figures and "elapsed" in bar[-1], text
    assert "rollmesh: run finished" in lines[-1], text
    assert not any(line.startswith("[") or '{"' in line for line in lines), text
    assert "eval (version 0)" in text  # an event line (tiny_cpu evaluates at the start)
    launcher_log = (run_dir / "logs" / "launcher.log").read_text().splitlines()
    assert launcher_log and all(json.loads(line)["role"] == "launcher" for line in launcher_log)


@pytest.mark.slow
def test_pipe_gets_plain_progress_lines_and_no_role_lines(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(launch_args(run_dir), cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == f"rollmesh: run directory {run_dir}"
    assert all(line.startswith("rollmesh: ") for line in lines), out.stdout
    steps = [line for line in lines if line.startswith("rollmesh: step ")]
    assert steps and re.fullmatch(
        rf"rollmesh: step {STEPS}/{STEPS} version \d+ reward_mean [0-9.]+ staleness_max \S+ "
        r"elapsed \d+s", steps[-1]), out.stdout
    assert len(lines) < 20 and out.stderr == "", out.stdout + out.stderr
    assert "\x1b[" not in out.stdout
    # the roles' logs are in files, as JSON lines
    trainer_log = (run_dir / "logs" / "trainer-0.log").read_text().splitlines()
    assert json.loads(trainer_log[-1])["role"] == "trainer"


@pytest.mark.slow
def test_verbose_streams_role_lines_human_readable(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(launch_args(run_dir, "--verbose"), cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    lines = out.stdout.splitlines()
    role = re.compile(r"\[(\S+) (\w+)(/\d+)?\] (\d\d:\d\d:\d\d )?(debug|info|warning|error)"
                      r"\s+\w+")
    shown = [line for line in lines if role.match(line)]
    roles = {role.match(line).group(2) for line in shown}
    assert {"trainer", "rollouter", "agent_worker", "launcher"} <= roles, roles
    assert any(re.match(r"\[\S+ trainer/0\] \d\d:\d\d:\d\d info\s+\w+", line) for line in shown)
    assert not any('{"event"' in line or '"level":' in line for line in lines), \
        [line for line in lines if '"level":' in line][:3]
    assert any(line.startswith(f"rollmesh: step {STEPS}/{STEPS} ") for line in lines)


@pytest.mark.slow
def test_a_failed_role_shows_its_log_tail(tmp_path):
    """The trainer killed with no restarts left ends the run: its log's last lines (rendered,
    not JSON) are on the console, with the failure."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(launch_args(run_dir, "--set", "trainer.max_restarts=0",
                                        "--set", "trainer.total_steps=60"),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 1, 120, "a first step", proc)
        trainer = next(p for p in status(run_dir)["processes"] if p["name"] == "trainer[0]")
        os.kill(trainer["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    log = run_dir / "logs" / "trainer-0.log"
    head = re.search(rf"rollmesh: the run failed; the last (\d+) lines of {re.escape(str(log))}:",
                     out)
    assert head and int(head.group(1)) >= 3, out[-3000:]  # trainer_config, ready, step...
    tail = [line[4:] for line in out[head.end():].splitlines() if line.startswith("  | ")]
    assert len(tail) == int(head.group(1)) and not any('{"' in line for line in tail), tail
    records = [json.loads(line) for line in log.read_text().splitlines()[-len(tail):]]
    for shown, rec in zip(tail, records):
        assert re.match(rf"\d\d:\d\d:\d\d {rec['level']}\s+{rec['event']}\b", shown), shown
    assert "rollmesh: run failed: trainer/0 exited with code -9" in out, out[-3000:]
