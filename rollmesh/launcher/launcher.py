"""The Launcher: start every role of the plan on every host, supervise them, host the hub
(`rollmesh launch CLUSTER_TOML` runs it: rollmesh.launcher.commands).

    plan      every process of the cluster file: host, ports, CPUs, its role config
              (rollmesh.launcher.plan)
    run dir   runs/<name>-<timestamp>: keys (CURVE, 0600), resolved configs, specs, logs,
              metrics.jsonl (mirrored from the trainer's host where it runs on another;
              its checkpoints and export stay there, under runs/<name>-<timestamp>)
    hub       the status proxy (always CURVE) that roles publish to and monitors attach to
    start     engines healthy -> message queue, synchronizer -> trainer -> rollouter -> workers
    supervise restart crashed workers, the message queue (durable, same address), the
              rollouter, the synchronizer and engines (bounded, with back-off), and the trainer
              ranks together from their latest checkpoint (trainer.max_restarts); any other
              role that dies ends the run with its first failure, exit code and log
    watchdog  no trainer step for trainer.progress_timeout_s while samples are dropped or none
              generated: the run stops with the cause named (rollmesh.launcher.watchdog)
    finish    when the trainer finishes: drain every rollouter shard, write summary.json (the
              accounting identity over every shard, rollmesh.launcher.summary), stop all
    stop      Ctrl-C / SIGTERM / `rollmesh stop RUN` (StopRun on the control socket, signed
              with the launcher's own key, RUN/keys/clients/launcher): every process on every host, one deadline
    death     a launcher killed outright takes its processes with it: local ones get SIGTERM
              from the kernel (PDEATHSIG, engines included), roles over SSH hear no heartbeat

Hosts whose address is this machine run their roles as local processes; others over OpenSSH
(rollmesh.launcher.hosts). `--dry-run` (rollmesh.launcher.commands) prints the plan (the command
per host) and starts nothing.

What the user sees is rollmesh.launcher.console's: a live progress bar and event lines on a terminal,
plain lines otherwise; every role's log and the launcher's own go to RUN/logs/ (JSON lines),
and to the terminal too, human-readable, with `--verbose`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollmesh.config import (
    ROLE, ROLE_TABLE, START_ORDER, ClusterConfig, ConfigError, ExperimentConfig, to_dict, to_toml,
)
from rollmesh.engine.auth import EngineKeys
from rollmesh.engine.client import EngineClient
from rollmesh.launcher.console import Console, LogStream
from rollmesh.launcher.hosts import Host, SshHost
from rollmesh.launcher.keys import files_for_host, make_keys
from rollmesh.launcher.plan import (
    Planned, PlannedRouter, _connect, _make_hosts, build_plan, launcher_affinity, plan_router,
)
from rollmesh.launcher.summary import collect_accounting, shards, summary_json
from rollmesh.launcher.summary import snapshot as take_snapshot
from rollmesh.launcher.supervisor import Child, EngineExited, RoleFailed, Supervisor, killed
from rollmesh.launcher.watchdog import Snapshot, stalled
from rollmesh.observe.plot import plot_metric, read_metrics
from rollmesh.runtime.cpus import format_cpulist
from rollmesh.runtime.durable_log import write_atomic
from rollmesh.runtime.log import configure_logging, get_logger
from rollmesh.wire.channels import Publisher, StatusProxy
from rollmesh.wire.messages import EnginesChanged, Metrics, Ok, StopRun
from rollmesh.wire.transport import CurveKeys, RpcClient, Transport, TransportError

log = get_logger("rollmesh.launcher.launcher")

# The roles, their entry points, start order and restart policy: rollmesh.config.ROLE_TABLE.
RESTARTABLE = {r.name for r in ROLE_TABLE if r.restartable}
# An engine is restarted `engine.max_restarts` times within any ENGINE_RESTART_WINDOW_S (a
# crash loop ends the run; engines killed now and then over a long run do not).
ENGINE_RESTART_WINDOW_S = 600.0
WATCH_EVERY_S = 5.0  # the progress watchdog's snapshots


@dataclass
class EngineProc:
    planned: Planned
    process: Any = None
    restarts: int = 0
    state: str = "starting"
    log_path: Path | None = None
    restart_times: list[float] = field(default_factory=list)  # monotonic, the recent ones


@dataclass
class RouterProc:
    """The running router: supervised as an engine is (restarted within engine.max_restarts
    per ENGINE_RESTART_WINDOW_S, else the run fails naming its log)."""

    process: Any = None
    restarts: int = 0
    log_path: Path | None = None
    restart_times: list[float] = field(default_factory=list)


class Launcher:
    def __init__(self, cluster: ClusterConfig, run_dir: Path, echo: bool = True,
                 resume: bool = False, console: Console | None = None):
        self.cluster = cluster
        self.resume = resume
        self.exp: ExperimentConfig = cluster.experiment_config  # type: ignore[assignment]
        self.run_dir = run_dir
        # what the user sees (`echo=False`: as --quiet); every role's lines reach it
        self.console = console or Console(self.exp.trainer.total_steps, quiet=not echo)
        self.echo = self.console.role_line
        self.failed_log: Path | None = None  # the log of the role whose failure ended the run
        self.metrics_seen: tuple[int, int] | None = None  # metrics.jsonl's (size, mtime) shown
        self.hosts = _make_hosts(cluster)
        # The engines' HTTP keys, generation and admin (rollmesh.engine.auth; the CURVE keys
        # guard the ZeroMQ sockets): one of each per run, kept in its keys directory.
        self.engine_keys = EngineKeys.for_run(run_dir / "keys", resume)
        # launcher_cpus: main() pins the launcher once the plan is made; the processes here
        # without CPUs of their own get its affinity from before (not the launcher's CPUs)
        self.launcher_before = launcher_affinity(cluster)
        self.plan = build_plan(cluster, self.hosts, str(run_dir.resolve()), self.engine_keys,
                               launcher_before=self.launcher_before)
        self.engines: list[EngineProc] = []
        # engine.router's router (rollmesh.engine.router), started once the engines are healthy
        self.router_plan: PlannedRouter | None = plan_router(
            cluster, self.plan, str(run_dir.resolve()), self.engine_keys)
        self.router = RouterProc() if self.router_plan is not None else None
        if self.router_plan is not None and self.router_plan.host.same_machine:
            from rollmesh.engine.router import RouterMissing, check_installed

            try:  # here: a clear error now rather than a line in the router's log
                check_installed()
            except RouterMissing as e:
                raise ConfigError("experiment", "engine.router", str(e)) from None
        self.children: dict[str, Child] = {}
        self.state = "starting"
        self.started = time.monotonic()
        self.stop_requested = asyncio.Event()
        self.stop_reason = ""
        self.failure: str | None = None
        self.trainer_restarts = 0
        self.deaths: dict[str, list[float]] = {}  # restartable role -> its recent deaths
        # a trainer (re)started from a checkpoint trims metrics.jsonl to it: a remote one's
        # file is then copied whole instead of appended to
        self.mirror_whole = resume
        self.mirror_lock = threading.Lock()  # the status loop's thread and the final mirror
        self.snapshots: list[Snapshot] = []

    # -- set-up --------------------------------------------------------------------------

    def launcher_address(self) -> str:
        remote = [h for h in self.hosts.values() if not h.same_machine]  # SSH, Slurm steps
        if not remote:
            return "127.0.0.1"
        return self.cluster.launcher_address or os.uname().nodename

    def prepare_run_dir(self) -> CurveKeys:
        if self.resume:  # the run's own keys, configs and state: the trainer's checkpoints,
            # the queue's log and the rollouter's journal are picked up by the roles themselves
            keys = make_keys(self.run_dir / "keys", self.plan, resume=True)
            log.info("resuming", run_dir=str(self.run_dir), checkpoints=sorted(
                p.name for p in (self.run_dir / "checkpoints").glob("step_*")))
            pointer = self.run_dir / "checkpoints" / "latest"  # rollmesh.training.checkpoint.LATEST
            self.console.info("rollmesh: resuming " + (
                f"from checkpoint {pointer.read_text().strip()}" if pointer.is_file()
                else "from the start (no checkpoint yet)"))
        else:
            # (a run submitted with --sbatch holds its batch script in RUN/slurm already)
            submitted = (self.run_dir / "slurm" / "job.sh").exists()
            if self.run_dir.exists() and (not submitted or any(
                    p.name != "slurm" for p in self.run_dir.iterdir())):
                raise RuntimeError(f"run directory {self.run_dir} already exists: pick another "
                                   "--run-dir, or go on with it: --resume "
                                   f"{self.run_dir} (a run never writes over another's files)")
            self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # hosts.*.env, logs
            keys = make_keys(self.run_dir / "keys", self.plan, resume=False)
        self.engine_keys.write(self.run_dir / "keys")
        # the resolved configs, the cluster file naming the experiment file beside it: what
        # `--resume` loads (overrides given then are applied on top and saved again)
        cluster = to_toml(self.cluster).replace(
            f"experiment = {json.dumps(self.cluster.experiment)}",
            'experiment = "experiment.toml"', 1)
        write_atomic(self.run_dir / "cluster.toml", cluster, mode=0o600)  # hosts.*.env values
        (self.run_dir / "experiment.toml").write_text(to_toml(self.exp))
        for host in self.hosts.values():
            if not host.local:  # the public keys, its own roles' secret ones (launcher/keys.py)
                assert isinstance(host, SshHost)
                host.check()
                for f in files_for_host(self.run_dir / "keys", self.plan, host.name):
                    host.put_file(f"{self.remote_run_dir}/keys/"
                                  f"{f.relative_to(self.run_dir / 'keys')}", f.read_bytes())
        return keys

    @property
    def remote_run_dir(self) -> str:
        return f"runs/{self.run_dir.name}"

    def keys_dir_for(self, host: Host) -> str:
        return str((self.run_dir / "keys").resolve()) if host.local else f"{self.remote_run_dir}/keys"

    # -- the run ---------------------------------------------------------------------------

    def log_to_run_dir(self) -> None:
        """The launcher's own lines: JSON in RUN/logs/launcher.log; on the terminal only with
        --verbose (through the console, human-readable like the roles')."""
        console = self.console
        terminal = (LogStream(console, f"{os.uname().nodename} launcher") if console.verbose
                    else False)
        configure_logging("launcher", stream=terminal, json=True,
                          file=self.run_dir / "logs" / "launcher.log")
        log.info("config", cluster=to_dict(self.cluster), experiment=to_dict(self.exp),
                 run_dir=str(self.run_dir))
        shared = self.cluster.shared_gpus()
        staleness = self.exp.staleness
        if shared and staleness.max_staleness > 0 and not staleness.sync_mode:
            log.warning("shared_gpu_staleness", gpus=shared,
                        max_staleness=staleness.max_staleness, colocate=self.cluster.colocate,
                        hint="engine and trainer share these GPUs: nothing overlaps on one "
                             "device, so max_staleness > 0 buys no throughput there, only older "
                             "samples (README, 'One GPU')")
        if self.cluster.launcher_cpus:
            log.info("launcher_cpus", cpus=format_cpulist(os.sched_getaffinity(0)),
                     before=format_cpulist(self.launcher_before))

    async def run(self) -> int:
        if self.resume:  # its directory is there: "resuming" goes to its launcher.log too
            self.log_to_run_dir()
        keys = self.prepare_run_dir()
        if not self.resume:
            self.log_to_run_dir()
        addr = self.launcher_address()
        base = self.cluster.launcher_port
        bind = "127.0.0.1" if addr == "127.0.0.1" else "*"
        with Transport(keys) as t:
            try:
                hub = StatusProxy(t, f"tcp://{bind}:{base + 1}", f"tcp://{bind}:{base + 2}",
                                  secure=True)
            except TransportError as e:
                raise TransportError(
                    f"{e}: the launcher's ports {base}-{base + 2} are taken (another run on "
                    "this machine?); stop it or pick another ports.base") from None
            frontend, backend = f"tcp://{addr}:{base + 1}", f"tcp://{addr}:{base + 2}"
            self.sup = Supervisor(t, control=f"tcp://{bind}:{base}", run_id=self.run_dir.name,
                                  keys_dir=str((self.run_dir / "keys").resolve()),
                                  log_dir=self.run_dir / "logs", status_hub=frontend,
                                  status_feed=backend)
            self.control = f"tcp://{addr}:{base}"
            self.sup.server.handlers[StopRun] = self.on_stop_run  # from the launcher's key only
            self.publisher = Publisher(t, frontend, secure=True)
            self.write_launcher_json(frontend, backend)
            status = asyncio.create_task(self.publish_status())
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.stop_requested.set)
            code = 1
            watch: asyncio.Task | None = None
            self.console.start()
            try:
                await self.start_all()
                self.state = self.console.state = "running"
                watch = asyncio.create_task(self.watch_progress())
                code = await self.supervise()
            except (RoleFailed, RuntimeError, OSError) as e:
                self.failure = self.failure or str(e)
                log.error("run_failed", error=self.failure)
                if self.failed_log is None:  # a role that died while starting
                    self.failed_log = next((c.log_path for c in self.children.values()
                                            if c.process.poll() is not None), None)
            finally:
                if watch is not None:
                    watch.cancel()
                    await asyncio.gather(watch, return_exceptions=True)
                self.state = self.console.state = "stopping"
                await self.shutdown()
                self.state = "finished" if code == 0 else "failed"
                await self.publish_once()
                status.cancel()
                self.publisher.close()
                hub.close()
                self.mirror_metrics()  # the trainer's last rows, where it ran on another host
                self.progress()
                self.console.stop()  # the bar's last state stays on the screen
            self.report(code)
            return code

    async def start_all(self) -> None:
        for p in self.plan:
            if p.engine is not None:
                self.engines.append(self.start_engine(EngineProc(p)))
        while True:
            try:
                await self.wait_engines()
                break
            except EngineExited as err:  # killed while starting: started again, counted
                if not killed(err.engine.process.returncode):
                    raise  # an error exit (a bad argument, no GPU): fail fast
                name = f"engine[{err.engine.planned.proc.index}]"
                self.count_restart(err.engine, name)
                log.warning("killed_while_starting", child=name,
                            exit_code=err.engine.process.returncode)
                self.start_engine(err.engine)
        if self.router is not None:
            self.start_router()
            await self.wait_router()
        for role in START_ORDER:
            started = [self.start_role(p) for p in self.plan if p.proc.role == role]
            await self.wait_started([p.name for p in self.plan if p.proc.role == role],
                                    self.exp.engine.startup_timeout_s)
            if started:
                log.info("started", started=role, count=len(started))
            if role == "trainer" and self.resume:
                self.mirror_whole = True  # it trimmed its metrics to its checkpoint

    def start_engine(self, e: EngineProc) -> EngineProc:
        p = e.planned
        assert p.engine is not None
        e.log_path = self.run_dir / "logs" / f"engine-{p.proc.index}.log"
        e.process = p.host.start(p.engine.argv, env=p.engine.env, log_path=e.log_path,
                                 echo=self.echo, label=f"{p.proc.host} engine/{p.proc.index}")
        e.state = "starting"
        return e

    def start_router(self) -> None:
        """The router beside engine[0], its log beside the engines' (RUN/logs/router.log)."""
        assert self.router is not None and self.router_plan is not None
        r, launch = self.router, self.router_plan.launch
        r.log_path = self.run_dir / "logs" / "router.log"
        r.process = self.router_plan.host.start(
            launch.argv, env=launch.env, log_path=r.log_path, echo=self.echo,
            label=f"{self.router_plan.host.name} router")
        log.info("router_started", url=self.router_plan.url, host=self.router_plan.host.name)

    async def wait_router(self) -> None:
        """Until the router's /readiness answers 200 (it has registered a healthy engine);
        RuntimeError naming its log (and its last line: a missing package says how to install
        it) if it exits first or the engines' startup time runs out."""
        assert self.router is not None and self.router_plan is not None
        r = self.router
        deadline = time.monotonic() + self.exp.engine.startup_timeout_s
        async with EngineClient([self.router_plan.url], api_key=self.engine_keys.api) as client:
            while True:
                if r.process.poll() is not None:
                    self.failed_log = r.log_path
                    tail = ""
                    if r.log_path is not None and r.log_path.exists():
                        lines = r.log_path.read_text(errors="replace").strip().splitlines()
                        tail = f": {lines[-1]}" if lines else ""
                    raise RuntimeError(f"the router exited with code {r.process.returncode} "
                                       f"while starting (log: {r.log_path}){tail}")
                try:
                    await client._call(client.servers[0], "GET", "/readiness", timeout_s=5)
                    break
                except Exception:  # noqa: BLE001 - not up yet
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the router was not ready after "
                                       f"{self.exp.engine.startup_timeout_s:g}s (log: {r.log_path})")
                await asyncio.sleep(0.3)
        log.info("router_ready", url=self.router_plan.url)

    async def restart_router(self) -> None:
        """The router exited: start it again (the same port; the agent workers' generations
        wait for it through rollout.engine_wait_s), within engine.max_restarts per window."""
        assert self.router is not None
        r = self.router
        while True:
            self.count_restart(r, "the router")
            log.warning("router_restart", restarts=r.restarts, code=r.process.returncode)
            self.start_router()
            try:
                await self.wait_router()
                return
            except RuntimeError as err:
                log.warning("router_restart_failed", error=str(err))
                await asyncio.sleep(min(2.0 ** len(r.restart_times), 30.0))

    async def wait_engines(self, engines: list[EngineProc] | None = None) -> None:
        engines = engines if engines is not None else self.engines
        urls = [f"http://{e.planned.host.address}:{e.planned.proc.port}" for e in engines]
        if not urls:
            return
        async with EngineClient(urls, api_key=self.engine_keys.api) as client:
            waiting = asyncio.create_task(client.wait_healthy(self.exp.engine.startup_timeout_s))
            while not waiting.done():
                dead = [e for e in engines if e.process.poll() is not None]
                if dead:
                    waiting.cancel()
                    e = dead[0]
                    raise EngineExited(e, f"engine[{e.planned.proc.index}] exited with code "
                                          f"{e.process.returncode} while starting (log: "
                                          f"{e.log_path})")
                await asyncio.sleep(0.2)
            waiting.result()
        for e in engines:
            e.state = "ready"

    def spec_path(self, p: Planned) -> str:
        base = str(self.run_dir.resolve()) if p.host.local else self.remote_run_dir
        return f"{base}/specs/{p.name}.json"

    def start_role(self, p: Planned) -> Child:
        child = self.sup.spawn(p.proc.role, ROLE[p.proc.role].entry, instance=p.proc.index,
                               config=p.config, host=p.host, echo=self.echo,
                               keys_dir=self.keys_dir_for(p.host), spec_path=self.spec_path(p),
                               env=p.env(), cpus=p.cpus, cpus_for=p.who)
        self.children[p.name] = child
        return child

    async def on_stop_run(self, msg: StopRun, peer: bytes) -> Ok:
        log.warning("stop_requested", via="control socket", reason=msg.reason)
        self.stop_reason = msg.reason
        self.stop_requested.set()
        return Ok(message="stopping")

    async def supervise(self) -> int:
        """Until the trainer finishes (0), a role fails for good or the progress watchdog gives
        up (1), or a stop is asked (130)."""
        while not self.stop_requested.is_set():
            for name, child in list(self.children.items()):
                code = child.process.poll()
                if code is None:
                    continue
                role = child.spec.role
                if role == "trainer" and code == 0:
                    # done when every rank is (rank 0 may still be writing the final
                    # checkpoint and export when another rank has exited)
                    if all(c.process.poll() == 0 for c in self.children.values()
                           if c.spec.role == "trainer"):
                        log.info("trainer_finished", child=name)
                        return 0
                    continue
                if role == "trainer" and self.trainer_restarts < self.exp.trainer.max_restarts:
                    await self.restart_trainer(name, child, code)
                    break  # the children were replaced: look at them afresh
                if role in RESTARTABLE and self.may_restart(name):
                    await self.restart(name, child, code)
                    continue
                self.failure = (child.failure() or f"{name} exited with code {code}")
                self.failed_log = child.log_path
                return 1
            for e in self.engines:
                if e.process.poll() is not None:
                    await self.restart_engine(e)
            if self.router is not None and self.router.process.poll() is not None:
                await self.restart_router()
            try:
                await asyncio.wait_for(self.stop_requested.wait(), 0.25)
            except asyncio.TimeoutError:
                pass
        return 1 if self.failure else 130

    async def restart_trainer(self, name: str, child: Child, code: int) -> None:
        """Every trainer rank again, from the latest checkpoint, as `--resume` starts them: they
        load it (trimming metrics.jsonl to it), publish its weights under its version, and the
        MessageQueue hands them the batches it handed out since (kept until a checkpoint covers
        them): the lost steps are trained again on the same groups. The rollout side runs on;
        the synchronizer is started afresh (a sync the dead trainer had under way would keep
        rollout paused until sync.timeout_s; it holds no other state)."""
        self.trainer_restarts += 1
        limit = self.exp.trainer.max_restarts
        delay = min(2.0 ** (self.trainer_restarts - 1), 30.0)
        ranks = sorted(n for n, c in self.children.items() if c.spec.role == "trainer")
        log.error("trainer_died", child=name, exit_code=code,
                  failure=child.failure(), log=str(child.log_path))
        log.warning("trainer_restart", restart=self.trainer_restarts, of=limit, delay_s=delay,
                    ranks=len(ranks))
        self.console.event(f"{child.failure()}; restarting the trainer from its latest "
                           f"checkpoint ({self.trainer_restarts} of {limit})")
        self.console.show_tail(f"{child.failure()}", child.log_path)
        began = time.monotonic()
        sync_name = next((n for n, c in self.children.items()
                          if c.spec.role == "synchronizer"), None)
        doomed = [self.children[n] for n in ranks]
        if sync_name is not None:
            doomed.append(self.children[sync_name])
        await self.sup.stop(doomed, grace_s=10)
        await asyncio.sleep(delay)
        if sync_name is not None:
            self.children[sync_name] = self.sup.respawn(self.children[sync_name])
            await self.sup.wait_ready(self.children[sync_name], 120)
        for n in ranks:
            self.children[n] = self.sup.respawn(self.children[n])
        try:
            for n in ranks:
                await self.sup.wait_ready(self.children[n],
                                          timeout_s=self.exp.engine.startup_timeout_s)
        except RoleFailed as e:  # died again while starting: the supervise loop sees it exit
            # and restarts it again, or ends the run past trainer.max_restarts
            log.error("trainer_restart_failed", restart=self.trainer_restarts, error=str(e))
            await self.sup.stop([self.children[n] for n in ranks], grace_s=5)
            return
        self.mirror_whole = True
        self.snapshots.clear()  # the watchdog's window starts again
        log.warning("trainer_restarted", restart=self.trainer_restarts,
                    restart_s=round(time.monotonic() - began, 2))
        self.console.event(f"trainer restarted from its latest checkpoint in "
                           f"{time.monotonic() - began:.1f}s ({self.trainer_restarts} of {limit})")

    async def restart(self, name: str, child: Child, code: int) -> None:
        delay = min(2.0 ** child.restarts, 30.0)
        log.warning("role_restart", child=name, exit_code=code, restarts=child.restarts + 1,
                    delay_s=delay, log=str(child.log_path))
        await asyncio.sleep(delay)  # also lets its pump write the last lines of its log
        self.console.event(f"{name} exited with code {code}; restarting it "
                           f"({child.restarts + 1} of {self.cluster.role_max_restarts})")
        self.console.show_tail(child.failure() or f"{name} exited with code {code}",
                               child.log_path)
        self.children[name] = self.sup.respawn(child)
        await self.wait_started([name], 120)

    async def wait_started(self, names: list[str], timeout_s: float) -> None:
        """Wait for Ready from each of `names`, just started. One killed by a signal before it
        was ready (kill -9 on a loaded machine, the OOM killer) is started again, as one that
        dies later is: a restartable role within the cluster file's role_max_restarts, the
        trainer's ranks all together within trainer.max_restarts. One that exits with an error
        or reports Fatal (a bad config) fails the run at once, as does one past its restarts
        (RoleFailed)."""
        for name in names:
            while True:
                child = self.children[name]
                try:
                    await self.sup.wait_ready(child, timeout_s=timeout_s)
                    break
                except RoleFailed:
                    code = child.process.poll()
                    if not killed(code) or child.fatal is not None:
                        raise
                    role = child.spec.role
                    if role == "trainer":
                        if self.trainer_restarts >= self.exp.trainer.max_restarts:
                            raise
                        self.trainer_restarts += 1
                        ranks = sorted(n for n, c in self.children.items()
                                       if c.spec.role == "trainer")
                        log.warning("killed_while_starting", child=name, exit_code=code,
                                    restart=self.trainer_restarts,
                                    of=self.exp.trainer.max_restarts, ranks=len(ranks))
                        await self.sup.stop([self.children[n] for n in ranks], grace_s=5)
                        for n in ranks:
                            self.children[n] = self.sup.respawn(self.children[n])
                        await self.wait_started(ranks, timeout_s)
                        break
                    if role not in RESTARTABLE or not self.may_restart(name):
                        raise
                    log.warning("killed_while_starting", child=name, exit_code=code,
                                restarts=child.restarts + 1, of=self.cluster.role_max_restarts)
                    self.console.event(f"{name} was killed while starting (exit code {code}); "
                                       f"starting it again ({child.restarts + 1} of "
                                       f"{self.cluster.role_max_restarts})")
                    await asyncio.sleep(min(2.0 ** child.restarts, 30.0))
                    self.children[name] = self.sup.respawn(child)

    def may_restart(self, name: str) -> bool:
        """A restartable role's process died: restart it unless it died role_max_restarts
        times in the last ENGINE_RESTART_WINDOW_S already (a crash loop, not a long run)."""
        now = time.monotonic()
        recent = [t for t in self.deaths.get(name, []) if now - t < ENGINE_RESTART_WINDOW_S]
        self.deaths[name] = recent + [now]
        return len(recent) < self.cluster.role_max_restarts

    def count_restart(self, p: Any, name: str) -> None:
        """One more restart of `p` (an engine or the router: `restarts`, `restart_times`,
        `process`, `log_path`), within engine.max_restarts per ENGINE_RESTART_WINDOW_S:
        counted and announced, or RuntimeError naming its log once the budget is spent."""
        limit, now = self.exp.engine.max_restarts, time.monotonic()
        p.restart_times = [t for t in p.restart_times if now - t < ENGINE_RESTART_WINDOW_S]
        if len(p.restart_times) >= limit:
            self.failed_log = p.log_path
            raise RuntimeError(
                f"{name} keeps exiting ({len(p.restart_times)} restarts within "
                f"{ENGINE_RESTART_WINDOW_S:g}s, engine.max_restarts={limit}; exit code "
                f"{p.process.returncode}, log: {p.log_path})")
        p.restarts += 1
        p.restart_times.append(now)
        self.console.event(f"{name} exited with code {p.process.returncode}; restarting it "
                           f"({len(p.restart_times)} within {ENGINE_RESTART_WINDOW_S:g}s, "
                           f"of {limit})")

    async def restart_engine(self, e: EngineProc) -> None:
        while True:
            self.count_restart(e, f"engine[{e.planned.proc.index}]")
            log.warning("engine_restart", engine=e.planned.proc.index, restarts=e.restarts,
                        recent=len(e.restart_times), limit=self.exp.engine.max_restarts,
                        window_s=ENGINE_RESTART_WINDOW_S)
            # It comes back with the initial weights, reported as version 0; the synchronizer
            # (EnginesChanged) and the trainer's check send it the current ones.
            self.start_engine(e)
            try:
                await self.wait_engines([e])
                break
            except RuntimeError as err:  # it died again while starting: counted, tried again
                log.warning("engine_restart_failed", engine=e.planned.proc.index,
                            error=str(err))
                await asyncio.sleep(min(2.0 ** len(e.restart_times), 30.0))
        sync = next(p for p in self.plan if p.proc.role == "synchronizer")
        client = RpcClient(self.sup.transport, _connect(sync.host, sync.proc.port), timeout_s=30)
        try:
            await client.request(EnginesChanged(reason=f"engine[{e.planned.proc.index}] restarted"))
        finally:
            client.close()

    async def watch_progress(self) -> None:
        """The progress watchdog (rollmesh.launcher.watchdog): a snapshot every WATCH_EVERY_S; a run
        that cannot make progress for trainer.progress_timeout_s is stopped with an error
        naming the cause (exit 1, in summary.json and status.json as its failure)."""
        timeout = self.exp.trainer.progress_timeout_s
        if not timeout:
            return
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            try:
                snap = await self.snapshot()
            except Exception as e:  # noqa: BLE001 - a missed snapshot is not a stall
                log.warning("watchdog_snapshot_failed", error=f"{type(e).__name__}: {e}")
                continue
            self.snapshots.append(snap)
            self.console.dropped(snap.dropped)
            self.snapshots = [s for s in self.snapshots
                              if snap.t - s.t <= timeout + 4 * WATCH_EVERY_S
                              or s.trainer_step == snap.trainer_step]
            error = stalled(self.snapshots, timeout)
            if error:
                log.error("run_stalled", error=error)
                self.console.event(f"progress watchdog: {error}; stopping the run")
                self.failure = f"progress watchdog: {error}"
                self.stop_requested.set()
                return

    async def snapshot(self) -> Snapshot:
        """Where the run stands (rollmesh.launcher.summary.snapshot: every rollouter and
        MessageQueue shard, the trainer, each engine's weight version)."""
        urls = [f"http://{e.planned.host.address}:{e.planned.proc.port}" for e in self.engines]
        return await take_snapshot(
            self.sup.transport, self.plan, engine_urls=urls, engine_key=self.engine_keys.api,
            batch_samples=self.exp.rollout.batch_groups * self.exp.data.group_size)

    async def shutdown(self) -> None:
        """Drain the rollouter for the summary, then stop roles (reverse order), then the
        router and the engines."""
        self.summary = await self.collect_summary()
        await self.sup.close(grace_s=10)
        # the router first (it proxies to the engines), then the engines, one deadline
        procs = [(e.planned.host, e.process) for e in self.engines]
        if self.router is not None and self.router_plan is not None:
            procs.insert(0, (self.router_plan.host, self.router.process))
        procs = [(host, proc) for host, proc in procs if proc is not None]
        for host, proc in procs:
            if proc.poll() is None:
                host.signal(proc, None, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while any(proc.poll() is None for _, proc in procs):
            if time.monotonic() > deadline:
                for host, proc in procs:
                    if proc.poll() is None:
                        host.signal(proc, None, signal.SIGKILL)  # a step: scancel
                        proc.kill()
                break
            await asyncio.sleep(0.1)

    async def collect_summary(self) -> dict[str, Any]:
        """The settings, then the accounting over every rollouter and MessageQueue shard
        (rollmesh.launcher.summary.collect_accounting); none if no rollouter ever started."""
        out: dict[str, Any] = {"max_staleness": self.exp.staleness.max_staleness,
                               "staleness_measure": self.exp.staleness.measure}
        if any(p.name in self.children for p in shards(self.plan, "rollouter")):
            urls = [f"http://{e.planned.host.address}:{e.planned.proc.port}" for e in self.engines]
            out.update(await collect_accounting(self.sup.transport, self.plan, urls,
                                                self.engine_keys))
        return out

    # -- status ----------------------------------------------------------------------------

    def write_launcher_json(self, frontend: str, backend: str) -> None:
        info = {"name": self.cluster.name, "run_dir": str(self.run_dir.resolve()),
                "pid": os.getpid(), "hub_frontend": frontend, "hub_backend": backend,
                "control": self.control, "started_at": time.time(),
                "cluster_file": str(self.run_dir / "cluster.toml"),
                "experiment_file": self.cluster.experiment,
                "max_staleness": self.exp.staleness.max_staleness}
        write_atomic(self.run_dir / "launcher.json", json.dumps(info, indent=2), fsync=False)

    def status(self) -> dict[str, Any]:
        procs = []
        for e in self.engines:
            p = e.planned
            alive = e.process is not None and e.process.poll() is None
            procs.append({"name": p.name, "role": "engine", "instance": p.proc.index,
                          "host": p.proc.host, "cpus": format_cpulist(p.proc.cpus) or None,
                          "pid": e.process.pid if e.process else None,
                          "state": e.state if alive else "exited", "restarts": e.restarts,
                          "exit_code": None if alive else e.process.returncode,
                          "log": str(e.log_path)})
        for name, c in self.children.items():
            code = c.process.poll()
            planned = next((p for p in self.plan if p.name == name), None)
            procs.append({"name": name, "role": c.spec.role, "instance": c.spec.instance,
                          "host": c.host.name if c.host else "local",
                          "cpus": format_cpulist(planned.proc.cpus) or None if planned else None,
                          "pid": c.pid,
                          "state": c.state if code is None else "exited",
                          "restarts": c.restarts, "exit_code": code, "log": str(c.log_path)})
        return {"run": self.cluster.name, "state": self.state, "processes": procs,
                "engines": getattr(self, "engine_load", []),
                "elapsed_s": round(time.monotonic() - self.started, 1),
                "failure": self.failure}

    async def poll_engines(self) -> None:
        urls = [f"http://{e.planned.host.address}:{e.planned.proc.port}" for e in self.engines]
        load = []
        async with EngineClient(urls, retries=0, api_key=self.engine_keys.api) as client:
            for url, info in zip(urls, await client.server_info_each(timeout_s=2)):
                state = ((info or {}).get("internal_states") or [{}])[0]
                load.append({"url": url, "healthy": info is not None,
                             "running_requests": state.get("running_requests"),
                             "waiting_requests": state.get("waiting_requests"),
                             "weight_version": state.get("weight_version")})
        self.engine_load = load

    async def publish_once(self) -> None:
        status = self.status()
        # read by `rollmesh status`, the monitor and scripts while rewritten every second
        write_atomic(self.run_dir / "status.json", json.dumps(status, indent=2), fsync=False)
        await self.publisher.publish("launcher", Metrics(role="launcher", host=os.uname().nodename,
                                                         values=status))

    async def publish_status(self) -> None:
        tick = 0
        while True:
            try:
                if self.state == "running":
                    await self.poll_engines()
                await self.publish_once()
                tick += 1
                if tick % 5 == 0:
                    await asyncio.to_thread(self.mirror_metrics)
                self.progress()
                self.console.tick()
            except Exception as e:
                log.warning("status_failed", error=f"{type(e).__name__}: {e}")
            await asyncio.sleep(1.0)

    def mirror_metrics(self) -> None:
        """A trainer on another host writes metrics.jsonl there: append what is new of it to
        the run directory's (whole lines only), so that progress, plots and `--resume` read the
        same file wherever the trainer ran."""
        trainer0 = next(p for p in self.plan if p.proc.role == "trainer")
        if trainer0.host.local:
            return
        with self.mirror_lock:  # a cancelled status loop's thread may still be in here
            local = self.run_dir / "metrics.jsonl"
            # after a trainer (re)start from a checkpoint its file was trimmed: copy it whole
            replace = self.mirror_whole
            offset = local.stat().st_size if local.exists() and not replace else 0
            try:
                new = trainer0.host.read_from(trainer0.config["metrics_path"], offset)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                log.warning("metrics_mirror_failed", host=trainer0.host.name, error=str(e))
                return
            whole = new[: new.rfind(b"\n") + 1]
            if replace:
                write_atomic(local, whole.decode(), fsync=False)
                self.mirror_whole = False
            elif whole:
                with open(local, "ab") as f:
                    f.write(whole)

    def progress(self) -> None:
        """Hand the console where training stands (metrics.jsonl, when it changed)."""
        metrics = self.run_dir / "metrics.jsonl"
        try:
            st = metrics.stat()
        except FileNotFoundError:
            return
        if (st.st_size, st.st_mtime_ns) == self.metrics_seen:
            return
        self.metrics_seen = (st.st_size, st.st_mtime_ns)
        # one row per step (a step trained again: its last)
        self.console.rows(read_metrics(metrics))

    def report(self, code: int) -> None:
        summary = summary_json(getattr(self, "summary", {}))
        if code != 0 and self.failure:
            summary["failure"] = self.failure  # why it ended (a role, the progress watchdog)
        if self.trainer_restarts:
            summary["trainer_restarts"] = self.trainer_restarts
        write_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2), fsync=False)
        metrics = self.run_dir / "metrics.jsonl"
        if metrics.exists():
            plot_metric(metrics, "reward_mean", self.run_dir / "reward.png")
        if code == 0:
            self.console.info(f"rollmesh: run finished; results in {self.run_dir}")
        elif code == 130:
            self.console.info(f"rollmesh: run stopped; results in {self.run_dir}")
        else:
            if self.failed_log is not None:
                self.console.show_tail("the run failed", self.failed_log)
            sys.stdout.flush()
            print(f"rollmesh: run failed: {self.failure}\n  run directory: {self.run_dir}",
                  file=sys.stderr)

