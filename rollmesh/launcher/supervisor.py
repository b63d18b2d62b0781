"""The parent of role processes on one host (`Supervisor`): the control socket every role
reports to (Hello, Ready, heartbeats, Fatal), spawning (pinned to CPUs where asked), waiting for
Ready, stopping. The role's own side is `rollmesh.runtime.process`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from rollmesh.runtime.cpus import pinned
from rollmesh.runtime.log import get_logger
from rollmesh.runtime.process import RoleSpec
from rollmesh.wire.protocol import PROTOCOL_VERSION
from rollmesh.wire.messages import Fatal, Heartbeat, Hello, Ok, Ready, StopRun
from rollmesh.wire.keys import SENDER, CurveKeys, identity_for
from rollmesh.wire.transport import Forbidden, RpcServer, Transport
from rollmesh.wire.channels import Liveness

log = get_logger("rollmesh.launcher.supervisor")


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


def killed(code: int | None) -> bool:
    """An exit code that says a signal ended the process (kill -9, the OOM killer): negative
    from a local child, 128 + the signal through a shell, ssh or srun; not an error exit."""
    return code is not None and (code < 0 or code > 128)


class EngineExited(RuntimeError):
    """An engine exited while starting (`engine`: its EngineProc)."""

    def __init__(self, engine: Any, message: str):
        super().__init__(message)
        self.engine = engine


class RoleFailed(RuntimeError):
    """A role process exited or reported a fatal error when it should be serving."""


@dataclasses.dataclass
class Child:
    spec: RoleSpec
    process: subprocess.Popen
    log_path: Path | None
    host: Any = None  # rollmesh.launcher.hosts.Host it runs on; None: a plain local child
    pid: int | None = None  # its process id on its host (from Hello)
    restarts: int = 0
    launch: tuple[Any, ...] = ({}, None, None, None)  # env, cwd, echo, spec path: to respawn
    cpus: tuple[int, ...] = ()  # the CPUs it is started on (rollmesh.runtime.cpus), also on a respawn
    cpus_for: str = ""  # how the CPU prelude names it
    state: str = "spawned"  # spawned | hello | ready | silent | fatal | exited
    endpoints: dict[str, str] = dataclasses.field(default_factory=dict)
    fatal: Fatal | None = None
    ready_event: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @property
    def name(self) -> str:
        return self.spec.name

    def failure(self) -> str | None:
        code = self.process.poll()
        where = f" (log: {self.log_path})" if self.log_path else ""
        if self.fatal is not None:
            return f"{self.name} failed: {self.fatal.error}{where}"
        if code is not None:
            return f"{self.name} exited with code {code}{where}"
        return None


class Supervisor:
    """The parent of role processes on this host: control socket, spawn, ready, stop."""

    def __init__(self, transport: Transport, *, control: str = "tcp://127.0.0.1:0",
                 heartbeat_s: float = 1.0, liveness: int = 3, run_id: str = "",
                 keys_dir: str | None = None, log_dir: Path | None = None,
                 status_hub: str | None = None, status_feed: str | None = None):
        self.transport = transport
        self.heartbeat_s = heartbeat_s
        self.liveness = Liveness(heartbeat_s, liveness)
        self.run_id = run_id
        self.keys_dir = keys_dir
        self.log_dir = log_dir
        self.status_hub = status_hub
        self.status_feed = status_feed
        self.children: dict[str, Child] = {}
        # Every key of the run may report; each role process only as itself (`_as`), and
        # StopRun only from the launcher's own key (its handler is the launcher's).
        self.server = RpcServer(transport, control, {
            Hello: self._on_hello, Ready: self._on_ready, Heartbeat: self._on_heartbeat,
            Fatal: self._on_fatal,
        }, name="supervisor", allow={Hello: None, Ready: None, Heartbeat: None, Fatal: None,
                                     StopRun: {"launcher"}})
        self._serve = asyncio.create_task(self.server.serve(), name="supervisor")
        self._watch = asyncio.create_task(self.liveness.watch(self._on_silent), name="liveness")
        self.on_silent: Callable[[Child], Awaitable[None] | None] | None = None

    @property
    def control(self) -> str:
        return self.server.address

    @staticmethod
    def _as(role: str, instance: int, what: str) -> None:
        """Forbidden unless the request's key is this role process's own (or there are no
        keys): a role may not say Hello, Ready or Fatal for another."""
        sender = SENDER.get()
        if sender is not None and sender != identity_for(role, instance):
            raise Forbidden(f"{sender} may not send {what} for {role}/{instance}")

    async def _on_hello(self, msg: Hello, peer: bytes) -> Any:
        self._as(msg.role, msg.instance, "Hello")
        child = self.children.get(f"{msg.role}/{msg.instance}")
        if msg.protocol_version != PROTOCOL_VERSION:
            raise ValueError(f"protocol version {msg.protocol_version}, parent speaks "
                             f"{PROTOCOL_VERSION}")
        if child is not None:
            child.state, child.pid = "hello", msg.pid
        self.liveness.beat(f"{msg.role}/{msg.instance}")
        return Ok()

    async def _on_ready(self, msg: Ready, peer: bytes) -> Any:
        self._as(msg.role, msg.instance, "Ready")
        child = self.children.get(f"{msg.role}/{msg.instance}")
        if child is not None:
            child.state, child.endpoints = "ready", dict(msg.endpoints)
            child.ready_event.set()
        return Ok()

    async def _on_heartbeat(self, msg: Heartbeat, peer: bytes) -> Any:
        sender = SENDER.get()
        if sender is not None and msg.sender in self.children and (
                sender != msg.sender.replace("/", "-")):  # no keeping another role "alive"
            raise Forbidden(f"{sender} may not send Heartbeat for {msg.sender}")
        self.liveness.beat(msg.sender)
        child = self.children.get(msg.sender)
        if child is not None and child.state == "silent":
            child.state = "ready" if child.ready_event.is_set() else "hello"
        return Heartbeat(sender="supervisor", seq=msg.seq)

    async def _on_silent(self, name: str) -> None:
        child = self.children.get(name)
        if child is None or child.state in ("fatal", "exited"):
            return
        if child.process.poll() is not None:
            child.state = "exited"
            log.error("role_exited", child=name, code=child.process.returncode)
            return
        log.error("role_silent", child=name, silent_s=self.liveness.deadline_s)
        child.state = "silent"
        if self.on_silent is not None:
            result = self.on_silent(child)
            if asyncio.iscoroutine(result):
                await result

    async def _on_fatal(self, msg: Fatal, peer: bytes) -> Any:
        self._as(msg.role, msg.instance, "Fatal")
        child = self.children.get(f"{msg.role}/{msg.instance}")
        log.error("role_fatal", child=child.name if child else msg.role, error=msg.error)
        self.liveness.forget(f"{msg.role}/{msg.instance}")
        if child is not None:
            child.state, child.fatal = "fatal", msg
            child.ready_event.set()
        return Ok()

    def spawn(self, role: str, entry: str, *, instance: int = 0,
              config: dict[str, Any] | None = None, env: dict[str, str] | None = None,
              grace_s: float = 10.0, cwd: str | None = None, host: Any = None,
              echo: Any = None, keys_dir: str | None = None,
              control: str | None = None, status_hub: str | None = None,
              spec_path: str | None = None, cpus: tuple[int, ...] = (),
              cpus_for: str = "") -> Child:
        """Start `rollmesh role` for one role instance: here, or on `host` (a hosts.Host);
        with `cpus`, pinned to them from its start (rollmesh.runtime.cpus: the thread counts to match
        are the caller's `env`; `cpus_for` names it in the prelude's error)."""
        local = host is None or host.local
        spec = RoleSpec(role=role, entry=entry, control=control or self.control,
                        instance=instance, run_id=self.run_id,
                        parent_pid=os.getpid() if local and getattr(host, "same_machine", True)
                        else 0,  # remote, or a Slurm step (slurmstepd is its parent)
                        keys_dir=keys_dir or self.keys_dir,
                        status_hub=status_hub or self.status_hub,
                        status_feed=self.status_feed,
                        heartbeat_s=self.heartbeat_s, liveness=self.liveness.liveness,
                        grace_s=grace_s, config=config or {})
        if spec.keys_dir and local and getattr(host, "same_machine", True):
            # its own key pair (the launcher makes every planned one up front, and copies
            # them to other hosts); the run's sockets admit it once they read it
            CurveKeys.add_identities(spec.keys_dir, [identity_for(role, instance)])
        return self._start(spec, host, env or {}, cwd, echo, spec_path=spec_path, cpus=cpus,
                           cpus_for=cpus_for or f"{role}[{instance}]"
                           + (f" on host {host.name}" if host is not None else ""))

    def _start(self, spec: RoleSpec, host: Any, env: dict[str, str], cwd: str | None,
               echo: Any, restarts: int = 0, spec_path: str | None = None,
               cpus: tuple[int, ...] = (), cpus_for: str = "") -> Child:
        role, instance, entry = spec.role, spec.instance, spec.entry

        def command(args: list[str]) -> list[str]:
            return pinned(args, cpus, cpus_for) if cpus else args

        if host is not None:
            assert self.log_dir is not None, "a host-placed role needs a log directory"
            log_path = self.log_dir / f"{role}-{instance}.log"
            text = json.dumps(dataclasses.asdict(spec))
            if spec_path is not None:  # a file on the host (mode 0600) instead of a long argv
                host.put_file(spec_path, text.encode())
            process = host.start(command(["-m", "rollmesh", "role", "--spec",
                                          spec_path or text]),
                                 env=env, log_path=log_path, echo=echo,
                                 label=f"{host.name} {role}/{instance}")
            child = Child(spec, process, log_path, host=host, restarts=restarts,
                          launch=(env, cwd, echo, spec_path), cpus=cpus, cpus_for=cpus_for)
            self.children[spec.name] = child
            log.info("spawned", child=spec.name, host=host.name, entry=entry)
            return child
        log_path = None
        out: Any = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / f"{role}-{instance}.log"
            out = open(log_path, "ab")
        cmd = [sys.executable, *command(["-m", "rollmesh", "role", "--spec",
                                         json.dumps(dataclasses.asdict(spec))])]
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                                   env={**os.environ, **(env or {})}, cwd=cwd,
                                   start_new_session=True)  # a Ctrl-C reaches us, we stop them
        if out is not None:
            out.close()
        child = Child(spec, process, log_path, restarts=restarts, launch=(env, cwd, echo, None),
                      cpus=cpus, cpus_for=cpus_for)
        self.children[spec.name] = child
        log.info("spawned", child=spec.name, pid=process.pid, entry=entry)
        return child

    async def wait_ready(self, child: Child, timeout_s: float = 60.0) -> dict[str, str]:
        """Wait for Ready; RoleFailed if it exits, reports Fatal, or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while not child.ready_event.is_set():
            failure = child.failure()
            if failure:
                raise RoleFailed(failure)
            if time.monotonic() > deadline:
                raise RoleFailed(f"{child.name} not ready after {timeout_s:g}s")
            try:
                await asyncio.wait_for(child.ready_event.wait(), 0.1)
            except asyncio.TimeoutError:
                pass
        if child.fatal is not None:
            raise RoleFailed(child.failure() or child.name)
        return child.endpoints

    def respawn(self, child: Child) -> Child:
        """Start a fresh process for a child that exited: same spec, same host."""
        env, cwd, echo, spec_path = child.launch
        self.liveness.forget(child.name)
        spec = dataclasses.replace(child.spec, restart=child.restarts + 1)
        return self._start(spec, child.host, env, cwd, echo, restarts=child.restarts + 1,
                           spec_path=spec_path, cpus=child.cpus, cpus_for=child.cpus_for)

    @staticmethod
    def signal(child: Child, sig: int) -> None:
        if child.host is not None:
            child.host.signal(child.process, child.pid, sig)
        elif child.process.poll() is None:
            child.process.send_signal(sig)

    async def stop(self, children: list[Child], grace_s: float = 10.0) -> None:
        """SIGTERM these children, SIGKILL whatever is left at one shared deadline."""
        alive = [c for c in children if c.process.poll() is None]
        for child in alive:
            await asyncio.to_thread(self.signal, child, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(c.process.poll() is None for c in alive) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for child in alive:
            if child.process.poll() is None:
                log.warning("killed", child=child.name, grace_s=grace_s)
                await asyncio.to_thread(self.signal, child, signal.SIGKILL)
                if child.process.poll() is None:
                    child.process.kill()

    async def stop_all(self, grace_s: float = 10.0) -> dict[str, int]:
        """SIGTERM every child, SIGKILL whatever is left at one shared deadline."""
        await self.stop(list(self.children.values()), grace_s)
        codes = {}
        for child in self.children.values():
            codes[child.name] = child.process.wait()
            self.liveness.forget(child.name)
            if child.state != "fatal":
                child.state = "exited"
        return codes

    async def close(self, grace_s: float = 10.0) -> dict[str, int]:
        codes = await self.stop_all(grace_s)
        for task in (self._serve, self._watch):
            task.cancel()
        await asyncio.gather(self._serve, self._watch, return_exceptions=True)
        self.server.close()
        return codes
