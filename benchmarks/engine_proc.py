"""One built-in engine as its own process on a free local port, for the benchmarks that drive
it over HTTP (`engine.py`, `partial_rollout.py`)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def with_repo_on_path(repo: Path = REPO) -> dict[str, str]:
    """This environment with the repository first on PYTHONPATH, keeping what was there (a
    host whose packages come from PYTHONPATH, e.g. carried wheels, must still find them)."""
    rest = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), *([rest] if rest else [])]))


def start_engine(*args: str, python: str, cpus: set[int] | None = None,
                 timeout_s: float = 120.0) -> tuple[subprocess.Popen, str]:
    """`python -m rollmesh engine ARGS --port P`; returns (process, url) once /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [python, "-m", "rollmesh", "engine", *args, "--port", str(port)],
        cwd=REPO, env=with_repo_on_path(REPO), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"engine {' '.join(args)} did not start (exit code {proc.poll()})")
