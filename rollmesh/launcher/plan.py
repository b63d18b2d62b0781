"""The plan of a run: every process of the cluster file, where it runs and what it is handed.

    Planned        one process: its host, its CPUs (rollmesh.runtime.cpus), its role's settings
                   (rollmesh.config) or, for an engine, its command line (rollmesh.engine.launch)
    build_plan     every process of the cluster file, wired to the others' addresses (_Wiring)
    print_plan     what `rollmesh launch --dry-run` prints: the command per host
    launcher_cpus  launcher_affinity, pin_launcher: the launcher's own CPUs

Used by rollmesh.launcher.launcher (the Launcher starts what the plan says) and
rollmesh.launcher.commands (`--dry-run`).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollmesh.config import (
    ROLE, AgentWorkerSettings, ClusterConfig, ConfigError, ExperimentConfig, MessageQueueSettings,
    Process, RewardWorkerSettings, RolloutSettings, SynchronizerSettings, TrainerSettings, to_dict,
)
from rollmesh.engine.auth import ADMIN_KEY_FILE, API_KEY_FILE, EngineKeys
from rollmesh.engine.launch import EngineLaunch, engine_launch
from rollmesh.engine.router import RouterPorts, router_launch
from rollmesh.launcher.host_kinds import make_host
from rollmesh.launcher.hosts import Host, SshHost
from rollmesh.runtime.cpus import (
    available_cpus, format_cpulist, missing_problem, parse_cpulist, pin_self, pinned, thread_env,
    threads_for,
)


@dataclass
class Planned:
    proc: Process
    host: Host
    config: dict[str, Any] = field(default_factory=dict)
    engine: EngineLaunch | None = None
    # The CPUs it is started on: its own (`cpus` in the cluster file), or, for a process on this
    # machine without them while the launcher pins itself (launcher_cpus), the launcher's
    # affinity from before (it would inherit the launcher's CPUs otherwise); empty: as it comes.
    cpus: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        return self.proc.name

    def port(self, name: str) -> int:
        """Its port named `name` (rollmesh.config.ROLE_TABLE)."""
        return ROLE[self.proc.role].port(self.proc.port, name)

    @property
    def who(self) -> str:
        """How the CPU prelude names it in an error."""
        return f"{self.name} on host {self.proc.host}"

    def env(self) -> dict[str, str]:
        """A role's environment beyond its host's: its GPUs, its CPUs' thread counts."""
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.proc.gpus))} if self.proc.gpus else {}
        if self.proc.cpus:
            env.update(thread_env(self.proc.cpus, self.host.cfg.env))
        return env


def _bind(host: Host, port: int) -> str:
    addr = host.address
    literal = addr.replace(".", "").isdigit() or ":" in addr
    return f"tcp://{addr if literal else '*'}:{port}"


def _connect(host: Host, port: int) -> str:
    return f"tcp://{host.address}:{port}"


def _make_hosts(cluster: ClusterConfig) -> dict[str, Host]:
    srun = cluster.slurm.srun_options if cluster.slurm is not None else None
    return {name: make_host(name, cfg, srun) for name, cfg in cluster.hosts.items()}


def build_plan(cluster: ClusterConfig, hosts: dict[str, Host], run_dir: str,
               engine_keys: EngineKeys | None = None,
               launcher_before: tuple[int, ...] = ()) -> list[Planned]:
    """Every process with the configuration it is handed: an engine's command line, each other
    role's settings (rollmesh.config). Ports: each process owns the block
    `[port, port + ports.per_process)` (see config.ClusterConfig.processes). CPUs: its own, or
    `launcher_before` (the launcher's affinity before launcher_cpus) for a process on this
    machine without any."""
    plan = [Planned(p, hosts[p.host], cpus=p.cpus or (
        launcher_before if cluster.launcher_cpus and hosts[p.host].same_machine else ()))
        for p in cluster.processes()]
    wiring = _Wiring(cluster, plan, run_dir)
    wiring.router = plan_router(cluster, plan, run_dir, engine_keys)
    for p in plan:
        if p.proc.role == "engine":
            _plan_engine(p, wiring.exp, run_dir, engine_keys)
        else:
            p.config = to_dict(_SETTINGS[p.proc.role](wiring, p))
    return plan


class _Wiring:
    """What a process's settings are made of: the experiment, where the run's outputs go on a
    host, and the addresses of the other roles' first process (by their named ports)."""

    def __init__(self, cluster: ClusterConfig, plan: list[Planned], run_dir: str):
        assert cluster.experiment_config is not None
        self.exp = cluster.experiment_config
        self.settings = cluster.settings
        self.colocate = cluster.colocate
        self.run_dir = run_dir
        self.first: dict[str, Planned] = {}
        self.every: dict[str, list[Planned]] = {}  # each role's processes, by index
        for p in plan:
            self.first.setdefault(p.proc.role, p)
            self.every.setdefault(p.proc.role, []).append(p)
        self.engines = [f"http://{p.host.address}:{p.port('http')}" for p in plan
                        if p.proc.role == "engine"]
        self.router: PlannedRouter | None = None  # engine.router's (plan_router)

    def connect(self, role: str, port: str) -> str:
        """The address of `role`'s first process's port named `port`."""
        p = self.first[role]
        return _connect(p.host, p.port(port))

    def shards(self, role: str, port: str) -> list[str]:
        """The addresses of `role`'s processes' port `port`, in index order, when it has more
        than one (rollout or queue shards); empty with one."""
        every = self.every.get(role, [])
        return [_connect(p.host, p.port(port)) for p in every] if len(every) > 1 else []

    def rollouter_of(self, p: Planned) -> str:
        """A worker's rollouter: workers are dealt to the rollout shards in turn."""
        every = self.every["rollouter"]
        r = every[p.proc.index % len(every)]
        return _connect(r.host, r.port("bind"))

    def tuning(self, role: str) -> dict[str, Any]:
        """`role`'s [settings.<role>] table, as its settings' keyword arguments."""
        table = getattr(self.settings, role)
        return {f.name: getattr(table, f.name) for f in dataclasses.fields(table)}

    def run_here(self, host: Host) -> str:
        """The run's directory on `host` (on another host: under its remote run directory)."""
        return self.run_dir if host.local else f"runs/{Path(self.run_dir).name}"


@dataclass
class PlannedRouter:
    """The router of `engine.router` (rollmesh.engine.router): where it runs, its command."""

    host: Host
    launch: EngineLaunch

    @property
    def url(self) -> str:
        return f"http://{self.host.address}:{self.launch.port}"


def plan_router(cluster: ClusterConfig, plan: list[Planned], run_dir: str,
                engine_keys: EngineKeys | None) -> PlannedRouter | None:
    """`engine.router = "sglang-router"`: the router on engine[0]'s host, in engine[0]'s port
    block (its 2nd port for HTTP, its 3rd for the router's metrics listener): ports the plan
    already reserves and checks, on any host kind (a port picked free here would say nothing of
    an SSH host's). Beside the engines because it talks to them most (every token comes back
    through it) and, like them, lives for the whole run; none without engine.router."""
    exp = cluster.experiment_config
    assert exp is not None
    if exp.engine.router == "none":
        return None
    engines = [p for p in plan if p.proc.role == "engine"]
    if not engines:
        return None
    if cluster.ports.per_process < 3:
        raise ConfigError("cluster file", "ports.per_process", "expected int >= 3 with "
                          "engine.router set (the router takes engine[0]'s 2nd and 3rd ports), "
                          f"got {cluster.ports.per_process}")
    first = engines[0]
    bind_host = first.host.address if first.host.local else "0.0.0.0"
    keys = f"{run_dir}/keys" if first.host.local else f"runs/{Path(run_dir).name}/keys"
    urls = [f"http://{p.host.address}:{p.port('http')}" for p in engines]
    launch = router_launch(urls, bind_host, RouterPorts(first.proc.port + 1, first.proc.port + 2),
                           policy=exp.engine.router_policy,
                           api_key_file=f"{keys}/{API_KEY_FILE}"  # it proxies /generate only
                           if engine_keys and engine_keys.api else None,
                           startup_timeout_s=exp.engine.startup_timeout_s,
                           log_level="warn", python=first.host.python())
    return PlannedRouter(first.host, launch)


def _bind_named(p: Planned, port: str) -> str:
    return _bind(p.host, p.port(port))


def _plan_engine(p: Planned, exp: ExperimentConfig, run_dir: str,
                 engine_keys: EngineKeys | None) -> None:
    bind_host = p.host.address if p.host.local else "0.0.0.0"
    key_dir = f"{run_dir}/keys" if p.host.local else f"runs/{Path(run_dir).name}/keys"
    keys = engine_keys or EngineKeys()
    p.engine = engine_launch(exp.engine, exp.model, bind_host, p.port("http"), gpus=p.proc.gpus,
                             seed=exp.seed, weight_version="0", python=p.host.python(),
                             api_key=keys.api, admin_api_key=keys.admin,
                             api_key_file=f"{key_dir}/{API_KEY_FILE}" if keys.api else None,
                             admin_api_key_file=f"{key_dir}/{ADMIN_KEY_FILE}" if keys.admin
                             else None,
                             lora_dir=f"{run_dir if p.host.local else f'runs/{Path(run_dir).name}'}"
                                      f"/lora/initial-{p.port('http')}")
    if p.cpus:  # the prelude sets its affinity, then execs the server
        p.engine.argv = pinned(p.engine.argv, p.cpus, p.who, python=p.host.python())
    if p.proc.cpus:  # the built-in engine's --threads (engine.extra_args) still wins
        p.engine.env.update(thread_env(p.proc.cpus, p.host.cfg.env))


def _state_dir(w: _Wiring, p: Planned) -> str:
    """A role's state directory: `RUN/<role>` (the first shard's, as with one), `RUN/<role>-<i>`
    for the other shards."""
    suffix = f"-{p.proc.index}" if p.proc.index else ""
    return f"{w.run_here(p.host)}/{p.proc.role}{suffix}"


def _message_queue(w: _Wiring, p: Planned) -> MessageQueueSettings:
    # durable: its groups, uncommitted hand-outs and counters outlive a restart
    return MessageQueueSettings(experiment=w.exp, bind=_bind_named(p, "bind"),
                                state_dir=_state_dir(w, p), shard=p.proc.index,
                                shards=len(w.every["message_queue"]),
                                **w.tuning("message_queue"))


def _rollouter(w: _Wiring, p: Planned) -> RolloutSettings:
    return RolloutSettings(experiment=w.exp, bind=_bind_named(p, "bind"),
                           state_dir=_state_dir(w, p),
                           control=_bind_named(p, "control"),
                           message_queue=w.connect("message_queue", "bind"),
                           queue_shards=w.shards("message_queue", "bind"),
                           engines=w.engines, shard=p.proc.index,
                           shards=len(w.every["rollouter"]))


def _agent_worker(w: _Wiring, p: Planned) -> AgentWorkerSettings:
    return AgentWorkerSettings(experiment=w.exp, rollouter=w.rollouter_of(p),
                               engines=w.engines, router=w.router.url if w.router else None,
                               **w.tuning("agent_worker"))


def _reward_worker(w: _Wiring, p: Planned) -> RewardWorkerSettings:
    return RewardWorkerSettings(experiment=w.exp, rollouter=w.rollouter_of(p),
                                **w.tuning("reward_worker"))


def _synchronizer(w: _Wiring, p: Planned) -> SynchronizerSettings:
    return SynchronizerSettings(experiment=w.exp, bind=_bind_named(p, "bind"),
                                rollouter=w.connect("rollouter", "control"),
                                rollouters=w.shards("rollouter", "control"),
                                message_queue=w.connect("message_queue", "bind"),
                                queue_shards=w.shards("message_queue", "bind"),
                                engines=w.engines)


def _trainer(w: _Wiring, p: Planned) -> TrainerSettings:
    # rank 0 hosts the ranks' rendezvous and joins the engines' weight-update group. A trainer
    # on another host writes its outputs there, under the run's remote directory; the launcher
    # mirrors its metrics into the run directory here.
    run_here = w.run_here(p.host)
    return TrainerSettings(
        experiment=w.exp, bind=_bind_named(p, "bind"),
        rendezvous=w.connect("trainer", "rendezvous"),
        weight_sync_address=w.first["trainer"].host.address,
        message_queue=w.connect("message_queue", "bind"),
        queue_shards=w.shards("message_queue", "bind"),
        synchronizer=w.connect("synchronizer", "bind"),
        engines=w.engines,
        # The weight-update group has 1 + sum(TP sizes) ranks: each engine's TP ranks join it
        # (rank_offset = 1 + the TP sizes before it).
        engine_tp_sizes=[w.exp.engine.tp_size] * len(w.engines),
        colocate=w.colocate,
        metrics_path=(f"{w.run_dir}/metrics.jsonl" if p.host.local
                      else f"{run_here}/trainer/metrics.jsonl"),
        final_export_dir=f"{run_here}/policy", checkpoint_dir=f"{run_here}/checkpoints",
        lora_dir=f"{run_here}/lora" if w.exp.model.lora.enabled else None,
        # torch.set_num_threads in the rank
        threads=threads_for(p.proc.cpus, p.host.cfg.env) if p.proc.cpus else None)


# Each role's settings, from the wiring and its process (the engine's: its command line).
_SETTINGS: dict[str, Callable[[_Wiring, Planned], Any]] = {
    "message_queue": _message_queue, "rollouter": _rollouter, "agent_worker": _agent_worker,
    "reward_worker": _reward_worker, "synchronizer": _synchronizer, "trainer": _trainer,
}


def launcher_affinity(cluster: ClusterConfig) -> tuple[int, ...]:
    """With launcher_cpus: the launcher's affinity now (before it pins itself), for the
    processes here that have no CPUs of their own; else ()."""
    return tuple(sorted(os.sched_getaffinity(0))) if cluster.launcher_cpus else ()


def pin_launcher(cluster: ClusterConfig, source: str) -> None:
    """launcher_cpus: every thread of the launcher on those CPUs (the ones it starts later
    inherit them), checked first (a Slurm allocation's launcher is checked only here)."""
    if not cluster.launcher_cpus:
        return
    cpus = parse_cpulist(cluster.launcher_cpus)
    problem = missing_problem(cpus, available_cpus(), f"this machine ({os.uname().nodename})")
    if problem:
        raise ConfigError(source, "launcher_cpus", f"{problem}, got {cluster.launcher_cpus!r}")
    pin_self(cpus)


def _cpus_note(p: Planned) -> str:
    """What the plan says of a process's CPUs."""
    if p.proc.cpus:
        threads = threads_for(p.proc.cpus, p.host.cfg.env)
        if p.engine is not None and any(a == "--threads" or a.startswith("--threads=")
                                        for a in p.engine.argv):
            threads_note = "threads: --threads"
        else:
            threads_note = f"threads={threads}"
        return f" cpus={format_cpulist(p.proc.cpus)} {threads_note}"
    if p.cpus:
        return f" cpus={format_cpulist(p.cpus)} (the launcher's own, before launcher_cpus)"
    return ""


def print_plan(cluster: ClusterConfig, plan: list[Planned], run_dir: str) -> None:
    print(f"run {cluster.name}: experiment {cluster.experiment}; run directory {run_dir}")
    if cluster.launcher_cpus:
        print(f"launcher: cpus={format_cpulist(parse_cpulist(cluster.launcher_cpus))}")
    for host_name in dict.fromkeys(p.proc.host for p in plan):
        host = next(p.host for p in plan if p.proc.host == host_name)
        how = ("Slurm job steps (srun)" if not host.same_machine and host.local
               else "local processes" if host.local else "over ssh")
        print(f"\nhost {host_name} ({host.address}, {how}):")
        if isinstance(host, SshHost):
            print(f"  each command below runs through: {shlex.join(host.ssh())}")
        specs = run_dir if host.local else f"runs/{Path(run_dir).name}"
        for p in (p for p in plan if p.proc.host == host_name):
            if p.engine is not None:
                args, env = p.engine.argv, p.engine.env
            else:
                args = ["-m", "rollmesh", "role", "--spec", f"{specs}/specs/{p.name}.json"]
                args, env = pinned(args, p.cpus, p.who) if p.cpus else args, p.env()
            argv = host.argv(args, env)
            if not host.same_machine and host.local:  # srun: the environment it hands on
                from rollmesh.launcher.slurm import step_name

                argv = host.argv(args, env, step_name(f"{host_name} {p.proc.role}/{p.proc.index}"))
                argv = ["env", *(f"{k}={v}" for k, v in sorted(env.items())), *argv] if env else argv
            gpus = f" gpus={list(p.proc.gpus)}" if p.proc.gpus else ""
            if env and host.same_machine:  # (ssh and srun show theirs in the command)
                argv = ["env", *(f"{k}={v}" for k, v in sorted(env.items())), *argv]
            changed = cluster.settings.changed(p.proc.role)
            tuned = "".join(f" {k}={v}" for k, v in changed.items())
            print(f"  {p.name:18s}{gpus}{_cpus_note(p)}{tuned}\n"
                  f"    {shlex.join(argv) if host.local else argv[-1]}")
    router = plan_router(cluster, plan, run_dir, None)
    if router is not None:
        argv = router.host.argv(router.launch.argv, {})
        print(f"\nrouter (engine.router, on host {router.host.name}, after the engines are "
              f"healthy): {router.url}\n    {shlex.join(argv) if router.host.local else argv[-1]}")
