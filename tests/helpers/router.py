"""A real SGLang router (`sglang-router`, the `router` extra) in front of test engines, started
by rollmesh's own command line (rollmesh.engine.router), for the tests that generate through
it. `ROUTERS` parametrizes a test over no router and the router; the router case is skipped,
saying why, where the package is not installed."""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Sequence

import pytest

from rollmesh.engine.launch import start
from rollmesh.engine.router import RouterPorts, router_launch
from tests.engine.engine_harness import free_port

HAVE_ROUTER = importlib.util.find_spec("sglang_router") is not None
NEEDS_ROUTER = pytest.mark.skipif(
    not HAVE_ROUTER, reason="sglang-router not installed: pip install 'rollmesh[router]'")
# parametrize(..., ROUTERS): "none" (the client balances) and "sglang-router"
ROUTERS = ["none", pytest.param("sglang-router", marks=NEEDS_ROUTER)]


class Router:
    """One router process in front of `engines`; `url` once it has a healthy engine."""

    def __init__(self, engines: Sequence[str], log_path: Path, *, policy: str = "cache_aware",
                 api_key_file: str | None = None, timeout_s: float = 60.0) -> None:
        launch = router_launch(list(engines), "127.0.0.1",
                               RouterPorts(http=free_port(), metrics=free_port()),
                               policy=policy, api_key_file=api_key_file)
        self.url, self.log_path = launch.url, log_path
        self.proc = start(launch, log_path=str(log_path))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n"
                                   f"{log_path.read_text()[-3000:]}")
            if self.ready():
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"router not ready after {timeout_s:g}s:\n"
                           f"{log_path.read_text()[-3000:]}")

    def ready(self) -> bool:
        """/readiness: 200 while it has a healthy engine."""
        with contextlib.suppress(OSError, urllib.error.HTTPError):
            with urllib.request.urlopen(self.url + "/readiness", timeout=2) as resp:
                return resp.status == 200
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def maybe_router(kind: str, engines: Sequence[str], log_path: Path,
                 **kw) -> Iterator[str | None]:
    """The router's URL for `kind == "sglang-router"` (stopped on exit), else None."""
    if kind == "none":
        yield None
        return
    router = Router(engines, log_path, **kw)
    try:
        yield router.url
    finally:
        router.stop()
