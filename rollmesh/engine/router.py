"""SGLang's router in front of the engines (`engine.router = "sglang-router"`).

The router (the `sglang-router` package, pinned by the `router` extra: a Rust server that runs
on CPU) takes every /generate and picks the engine; its cache-aware policy sends a prompt
where its prefix is already cached, so the siblings of a GRPO group land on one engine.
Everything else stays per engine (rollmesh.engine.client): pause, abort, weight updates, health.

`router_launch` builds the command the launcher starts (locally, over SSH or as a Slurm step,
like an engine's); `python -m rollmesh.engine.router` is that command: it reads the run's
engine API key from its file (so the key is not on a command line `ps` shows) and runs the
router's own launcher in this process. With the key the router refuses callers without it
(401), control routes included (without one, anyone who reaches it could add a worker), and
presents it to the engines.

Flags set here, and why:
    --health-check-interval-secs 1, --health-failure-threshold 2, --health-success-threshold 1
        a dead engine leaves the rotation within ~2 s, a restarted one is back within ~1 s
        (defaults: 60 s, 3, 2 — minutes of requests sent to a dead engine)
    --disable-circuit-breaker  the health checks above decide; an open circuit (60 s by
        default) would keep a restarted engine idle
    --request-timeout-secs 86400  rollmesh's client owns generation timeouts; a generation
        held through an in-place pause for a weight sync must not be cut by the router
    --prometheus-port  its metrics listener binds a port of its own (default 29000 on every
        address, which a second run on the host would find taken and die): a planned one
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Sequence

from rollmesh.engine.launch import EngineLaunch

PACKAGE = "sglang_router"
INSTALL_HINT = "pip install 'rollmesh[router]' (sglang-router==0.3.2)"
REQUEST_TIMEOUT_S = 86400


class RouterMissing(RuntimeError):
    """engine.router is set and the router's package is not installed."""


def check_installed() -> None:
    """RouterMissing, naming the fix, when the sglang_router package cannot be imported here."""
    if importlib.util.find_spec(PACKAGE) is None:
        raise RouterMissing(f"engine.router = 'sglang-router' needs the {PACKAGE} package, "
                            f"not installed for {sys.executable}: {INSTALL_HINT}")


@dataclass
class RouterPorts:
    http: int
    metrics: int


def router_launch(worker_urls: Sequence[str], host: str, ports: RouterPorts, *,
                  policy: str = "cache_aware", api_key_file: str | None = None,
                  startup_timeout_s: float = 600.0, log_level: str = "info",
                  python: str = sys.executable) -> EngineLaunch:
    """The router on `host`, in front of `worker_urls` (the engines' URLs), with the run's
    API key read from `api_key_file`."""
    argv = [python, "-m", "rollmesh.engine.router"]
    if api_key_file:
        argv += ["--api-key-file", api_key_file]
    argv += ["--", "--worker-urls", *worker_urls, "--policy", policy,
             "--host", host, "--port", str(ports.http),
             "--prometheus-host", host, "--prometheus-port", str(ports.metrics),
             "--health-check-interval-secs", "1", "--health-failure-threshold", "2",
             "--health-success-threshold", "1", "--disable-circuit-breaker",
             "--request-timeout-secs", str(REQUEST_TIMEOUT_S),
             "--worker-startup-timeout-secs", str(max(1, int(startup_timeout_s))),
             "--log-level", log_level]
    return EngineLaunch("sglang-router", host, ports.http, argv)


def _read_key(path: str) -> str:
    """The run's engine API key (as the built-in engine reads it, without importing torch)."""
    if os.stat(path).st_mode & 0o077:
        raise PermissionError(f"{path}: the engine API key file must not be readable by group "
                              "or others (chmod 600)")
    key = open(path).read().strip()
    if not key:
        raise ValueError(f"{path}: the engine API key file is empty")
    return key


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m rollmesh.engine.router [--api-key-file F] -- ROUTER_ARGS`: the router's
    launcher with `--api-key` from the file."""
    from rollmesh.runtime.log import configure_logging

    parser = argparse.ArgumentParser(prog="python -m rollmesh.engine.router")
    parser.add_argument("--api-key-file", default=None)
    parser.add_argument("router_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    rest = [a for a in args.router_args if a != "--"] if args.router_args[:1] == ["--"] \
        else list(args.router_args)
    log = configure_logging("router")
    try:
        check_installed()
        api_key = _read_key(args.api_key_file) if args.api_key_file else None
    except (RouterMissing, OSError, ValueError) as e:
        log.error("router_cannot_start", error=str(e))
        print(f"rollmesh router: {e}", file=sys.stderr)
        return 2
    from sglang_router.launch_router import launch_router, parse_router_args

    log.info("router_starting", args=rest)
    launch_router(parse_router_args(rest + (["--api-key", api_key] if api_key else [])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
