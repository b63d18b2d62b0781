"""`rollmesh stop` signals only the run's own launcher (issue 35, item 8): without keys or an
answer it used to send SIGTERM to whatever process held the pid in launcher.json."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from rollmesh.launcher.commands import stop_main


def run_dir(tmp_path, pid: int, started_at: float):
    run = tmp_path / "run"
    run.mkdir()
    (run / "launcher.json").write_text(json.dumps({
        "name": "r", "pid": pid, "started_at": started_at, "control": "tcp://127.0.0.1:1"}))
    return run


def test_stop_does_not_signal_a_process_that_is_not_the_runs_launcher(tmp_path, capsys):
    other = subprocess.Popen(["sleep", "60"])
    try:
        run = run_dir(tmp_path, other.pid, time.time() + 60)
        assert stop_main([str(run), "--pid"]) == 1
        assert "not a rollmesh process" in capsys.readouterr().err
        time.sleep(0.2)
        assert other.poll() is None  # still running: not signalled
    finally:
        other.kill()
        other.wait()


def test_a_rollmesh_process_that_started_after_the_launcher_is_not_it(tmp_path):
    from rollmesh.launcher.commands import not_the_launcher

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "rollmesh"])
    try:
        time.sleep(0.3)
        assert "started after" in not_the_launcher(proc.pid, {"started_at": time.time() - 3600})
        assert not_the_launcher(proc.pid, {"started_at": time.time()}) is None
    finally:
        proc.kill()
        proc.wait()
