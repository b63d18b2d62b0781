"""Role processes: the one way any role starts, and the parent's side of their lifecycle.

Child (`rollmesh role --spec FILE_OR_JSON`, entry `role_main`):
    logging with role and host -> control socket to the parent -> Hello (protocol version
    checked) -> the role's `async def main(ctx)`, which calls `await ctx.ready(...)` once it
    serves -> Ready. Heartbeats both ways. SIGTERM/SIGINT set `ctx.stopping` and the role
    returns (or is cancelled after `grace_s`). A parent that dies (PDEATHSIG, SIGHUP from the
    SSH guard, or silent for `liveness` heartbeats) stops the role, within PARENT_LOST_GRACE_S. An exception is logged and sent as Fatal, exit 1.

Parent (`Supervisor`): binds the control socket, spawns role processes, waits for Ready,
    hears Fatal, and stops every child on one shared deadline (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import importlib
import json
import os
import signal
import socket
import stat
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Awaitable, Callable

from rollmesh.runtime.cpus import ENV as CPUS_ENV, format_cpulist
from rollmesh.runtime.log import configure_logging, get_logger
from rollmesh.wire.messages import Fatal, Hello, Metrics, Ready
from rollmesh.wire.transport import (
    FORBIDDEN,
    PROTOCOL_ERRORS,
    CurveKeys,
    PeerTimeout,
    RemoteError,
    RpcClient,
    Transport,
)
from rollmesh.wire.keys import identity_for
from rollmesh.wire.channels import Heartbeater, Liveness, Publisher, Subscriber

EXIT_FATAL = 1
EXIT_PARENT_LOST = 3
# A role whose parent died stops within this (not grace_s): nobody waits for its clean drain,
# its peers are going too, and every role's state is kept for a kill -9 anyway (the queue's
# log, the rollouter's journal, the trainer's checkpoints).
PARENT_LOST_GRACE_S = 2.0
_orphaned = False  # this process's role lost its parent (set by run_role, read by role_main)

log = get_logger("rollmesh.runtime.process")


@dataclasses.dataclass
class RoleSpec:
    """Everything a role process is handed by its parent (JSON on the command line or a file)."""

    role: str
    entry: str  # "package.module:function": async def function(ctx: RoleContext) -> None
    control: str  # the parent's control endpoint
    instance: int = 0
    host: str = ""
    run_id: str = ""
    parent_pid: int = 0  # 0: the parent is remote (SSH), only heartbeats tell if it is alive
    keys_dir: str | None = None
    status_hub: str | None = None  # the launcher's XSUB: where this role publishes its status
    status_feed: str | None = None  # the launcher's XPUB: where it may subscribe to others'
    status_interval_s: float = 1.0
    heartbeat_s: float = 1.0
    liveness: int = 3
    grace_s: float = 10.0
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    restart: int = 0  # 0: the first process of this role in this launch; n: its n-th restart

    @property
    def name(self) -> str:
        return f"{self.role}/{self.instance}"

    @classmethod
    def from_json(cls, text: str) -> RoleSpec:
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"role spec: unknown key(s) {sorted(unknown)}")
        return cls(**data)


class RoleContext:
    """What a role's main function gets: its spec, logger, sockets and the stop signal."""

    def __init__(self, spec: RoleSpec, transport: Transport, control: RpcClient, log: Any):
        self.spec = spec
        self.transport = transport
        self.control = control
        self.log = log
        self.stopping = asyncio.Event()
        self.is_ready = False
        self.status: Callable[[], dict[str, Any]] | None = None
        # to the hub (status, announcements); opened by run_role when the spec names a hub
        self.publisher: Publisher | None = None

    def set_status(self, fn: Callable[[], dict[str, Any]]) -> None:
        """What this role shows the monitor: called every status interval, published to the
        hub as Metrics on topic `metrics.<role>.<instance>`."""
        self.status = fn

    async def announce(self, kind: str, rec: Any) -> bool:
        """Publish `rec` to the hub on topic `<kind>.<role>.<instance>` (an event other roles
        subscribe to, beside the status); False without a hub. Pub/sub may drop it: what
        matters is published again until superseded (as the rollouter's EvalResult is)."""
        if self.publisher is None:
            return False
        await self.publisher.publish(f"{kind}.{self.spec.role}.{self.spec.instance}", rec)
        return True

    def subscribe(self, *topics: str) -> Subscriber | None:
        """A subscriber to the hub's records under `topics` (prefixes); None without a hub."""
        if not self.spec.status_feed:
            return None
        return Subscriber(self.transport, self.spec.status_feed, topics,
                          secure=self.transport.keys is not None)

    @property
    def config(self) -> dict[str, Any]:
        return self.spec.config

    async def ready(self, **endpoints: str) -> None:
        """Tell the parent this role serves, and where.

        A stop that comes while the parent's answer is outstanding (the parent was killed just
        after it saw Ready, or went silent) ends the wait: the role then finds `stopping` set
        and winds down instead of failing on a parent that can no longer answer."""
        request = asyncio.ensure_future(self.control.request(
            Ready(role=self.spec.role, host=self.spec.host, pid=os.getpid(),
                  instance=self.spec.instance, endpoints=endpoints)))
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({request, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not request.done() or (self.stopping.is_set() and request.exception() is not None):
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)
            self.log.info("ready_abandoned", reason="stopping before the parent answered")
            return
        request.result()
        self.is_ready = True
        self.log.info("ready", **endpoints)


def _die_with_parent(parent_pid: int) -> None:
    """Linux: get SIGTERM when the parent exits, and stop now if it already has."""
    if not parent_pid or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        raise SystemExit(EXIT_PARENT_LOST)


async def rejoin_when_silent(hello: Callable[[], Awaitable[Any]], heard: Callable[[], float],
                             interval_s: float, liveness: int, log: Any,
                             peer: str = "rollouter") -> None:
    """A worker's side of a restarted peer: the peer heartbeats every `interval_s`; when nothing
    came from it for `liveness` intervals (it died and came back without knowing this worker,
    or is gone), introduce this worker again, and again every `liveness` intervals."""
    last_hello = time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        now = time.monotonic()
        limit = interval_s * liveness
        if now - heard() > limit and now - last_hello > limit:
            log.warning("peer_silent", peer=peer, silent_s=round(now - heard(), 2),
                        action="hello again")
            await hello()
            last_hello = now


def _orphan() -> None:
    """The parent is gone, and with it the reader of this process's output (the launcher's
    pump, or the ssh session): from now on a log line would fail with a broken pipe, or block
    on a full one, in the middle of stopping. Output goes nowhere instead."""
    global _orphaned
    if _orphaned:
        return
    _orphaned = True
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            mode = os.fstat(fd).st_mode
            if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):  # a log file is still written
                os.dup2(devnull, fd)
        os.close(devnull)
    except OSError:
        pass


def _load_entry(entry: str) -> Callable[[RoleContext], Awaitable[None]]:
    module, _, func = entry.partition(":")
    if not func:
        raise ValueError(f"role entry {entry!r}: expected 'module:function'")
    return getattr(importlib.import_module(module), func)


async def run_role(spec: RoleSpec) -> int:
    """Run one role to completion; returns the process exit code."""
    logger = get_logger("rollmesh.role", instance=spec.instance)
    keys = (CurveKeys.load(spec.keys_dir, identity_for(spec.role, spec.instance))
            if spec.keys_dir else None)
    transport = Transport(keys)
    control = RpcClient(transport, spec.control, timeout_s=spec.heartbeat_s * spec.liveness,
                        retries=1, name="parent")
    ctx = RoleContext(spec, transport, control, logger)
    loop = asyncio.get_running_loop()
    parent_lost = False  # silent (heartbeats): exit code EXIT_PARENT_LOST
    orphaned = False  # gone (PDEATHSIG's SIGTERM, or silent): the short grace

    def on_signal(sig: int) -> None:
        nonlocal orphaned
        if spec.parent_pid and os.getppid() != spec.parent_pid:
            orphaned = True  # the kernel's PDEATHSIG: the launcher died
        if sig == signal.SIGHUP:
            orphaned = True  # over SSH: the session ended (the remote guard)
        if orphaned:
            _orphan()
        ctx.stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal, sig)

    def on_parent_dead() -> None:
        nonlocal parent_lost, orphaned
        parent_lost = orphaned = True
        _orphan()
        ctx.stopping.set()

    tasks: list[asyncio.Task] = []
    try:
        await control.request(Hello(role=spec.role, host=spec.host, pid=os.getpid(),
                                    instance=spec.instance))
        main = _load_entry(spec.entry)
        heartbeater = Heartbeater(control, spec.name, Liveness(spec.heartbeat_s, spec.liveness),
                                  on_parent_dead)
        tasks.append(asyncio.create_task(heartbeater.run(), name="heartbeat"))
        if spec.status_hub:
            ctx.publisher = Publisher(transport, spec.status_hub,
                                      secure=transport.keys is not None)
            tasks.append(asyncio.create_task(_publish_status(ctx), name="status"))
        main_task = asyncio.create_task(main(ctx), name=spec.role)
        stop_task = asyncio.create_task(ctx.stopping.wait())
        tasks.append(stop_task)
        await asyncio.wait({main_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if not main_task.done():
            logger.info("stopping", parent_lost=parent_lost, orphaned=orphaned)
            # A multi-threaded parent's threads die one by one: the first PDEATHSIG can come
            # while getppid() still names it. Look again while waiting: orphaned, the grace
            # is PARENT_LOST_GRACE_S.
            began = time.monotonic()
            while not main_task.done():
                if spec.parent_pid and os.getppid() != spec.parent_pid and not orphaned:
                    orphaned = True
                    _orphan()
                grace = min(spec.grace_s, PARENT_LOST_GRACE_S) if orphaned else spec.grace_s
                if time.monotonic() - began >= grace:
                    break
                await asyncio.wait({main_task}, timeout=0.1)
            if not main_task.done():
                logger.warning("grace_expired", grace_s=grace)
                main_task.cancel()
                if orphaned:  # its clean-up may wait on peers that are gone: not for long
                    await asyncio.wait({main_task}, timeout=1.0)
                else:
                    await asyncio.gather(main_task, return_exceptions=True)
                return EXIT_PARENT_LOST if parent_lost else 0
        main_task.result()  # re-raises the role's exception, if any
        logger.info("exit", parent_lost=parent_lost)
        return EXIT_PARENT_LOST if parent_lost else 0
    except (asyncio.CancelledError, KeyboardInterrupt):
        return 0
    except Exception as e:
        logger.exception("fatal", error=f"{type(e).__name__}: {e}")
        if not parent_lost:
            try:
                await control.request(
                    Fatal(role=spec.role, host=spec.host, pid=os.getpid(), instance=spec.instance,
                          error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()),
                    timeout_s=2.0, retries=0)
            except (PeerTimeout, RemoteError):
                pass
        return EXIT_FATAL
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if ctx.publisher is not None:  # the role's main is done: nothing announces any more
            ctx.publisher.close()
            ctx.publisher = None
        if not orphaned:  # orphaned, role_main exits at once: no linger on dead peers
            control.close()
            transport.close()


async def _publish_status(ctx: RoleContext) -> None:
    """Publish the role's status to the hub; the hub is always CURVE (the monitor needs keys)."""
    spec, publisher = ctx.spec, ctx.publisher
    assert publisher is not None
    topic = f"metrics.{spec.role}.{spec.instance}"
    while True:
        values: dict[str, Any] = {"pid": os.getpid(), "ready": ctx.is_ready,
                                  "protocol_errors": sum(PROTOCOL_ERRORS.values()),
                                  "forbidden": sum(FORBIDDEN.values())}
        if ctx.status is not None:
            try:
                values.update(ctx.status())
            except Exception as e:  # a broken status must not take the role down
                values["status_error"] = f"{type(e).__name__}: {e}"
        await publisher.publish(topic, Metrics(role=spec.role, host=spec.host,
                                               values={"instance": spec.instance, **values}))
        await asyncio.sleep(spec.status_interval_s)


def role_main(argv: list[str]) -> int:
    """`rollmesh role --spec FILE_OR_JSON`: run one role process."""
    parser = argparse.ArgumentParser(prog="rollmesh role")
    parser.add_argument("--spec", required=True, help="the role spec: a JSON file or JSON text")
    args = parser.parse_args(argv)
    text = args.spec if args.spec.lstrip().startswith("{") else Path(args.spec).read_text()
    spec = RoleSpec.from_json(text)
    spec.host = spec.host or socket.gethostname()
    configure_logging(spec.role, spec.host, instance=spec.instance,
                      **({"run": spec.run_id} if spec.run_id else {}))
    _die_with_parent(spec.parent_pid)
    if os.environ.get(CPUS_ENV):  # started pinned (rollmesh.runtime.cpus): what it actually got
        log.info("cpus", cpus=format_cpulist(os.sched_getaffinity(0)),
                 omp_threads=os.environ.get("OMP_NUM_THREADS"))

    async def run() -> int:
        code = EXIT_FATAL
        try:
            code = await run_role(spec)
        finally:
            if _orphaned or (spec.parent_pid and os.getppid() != spec.parent_pid):
                _exit_now(code)
        return code

    return asyncio.run(run())


def _exit_now(code: int) -> None:
    """Exit without asyncio.run's wait for worker threads (one may sit in a collective or a
    request to a peer that went with the launcher): out now, as a kill -9 would."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
