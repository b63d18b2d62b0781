"""The cluster file's schema (`launch/*.toml` -> `ClusterConfig`): hosts, where each role runs
(placements), the port plan and Slurm, with the rules within one cluster file (GPUs given once,
ports that do not collide), the launch plan (`ClusterConfig.processes`), and whether an address is
this machine (`is_local_address`, for `launch = "auto"`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from rollmesh.config.experiment import ExperimentConfig
from rollmesh.config.parse import _field, _Invalid, _plural, _show
from rollmesh.config.tuning import SettingsConfig
from rollmesh.runtime.cpus import CpuListError, parse_cpulist
from rollmesh.config.roles import ROLES, SINGLETON_ROLES

def is_local_address(address: str) -> bool:
    """Loopback, this machine's name, or one of its addresses."""
    if address in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        import ipaddress

        if ipaddress.ip_address(address).is_loopback:
            return True
    except ValueError:
        pass
    try:
        mine = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        mine = set()
    return address in mine



@dataclass(kw_only=True)
class HostConfig:
    address: str = _field("host name or IP address to reach it (127.0.0.1/localhost: no SSH)")
    user: str | None = _field("SSH user (default: ssh's own default)", None)
    port: int = _field("SSH port", 22, ge=1, le=65535)
    identity_file: str | None = _field(
        "SSH private key on the launching machine (must exist)", None
    )
    python: str = _field(
        "Python interpreter on the host (e.g. a virtualenv's bin/python)", "python3"
    )
    workdir: str | None = _field(
        "directory the processes start in (default: the launcher's current directory on a local "
        "host, the login directory over SSH)",
        None,
    )
    env: dict[str, str] = _field(
        "extra environment variables for every process on the host", factory=dict
    )
    gpus: int = _field("GPUs on the host (ids 0 .. gpus-1)", 0, ge=0)
    launch: Literal["auto", "local", "ssh", "slurm"] = _field(
        "how processes start there: `auto` (local processes when the address is this machine, "
        "else SSH), `local`, `ssh` (always through sshd, e.g. another user on this machine), or "
        "`slurm` (job steps through srun; set by [slurm], which fills the hosts)",
        "auto",
    )
    ssh_options: list[str] = _field(
        "extra `ssh -o` options, e.g. \"UserKnownHostsFile=/path/known_hosts\" (host-key "
        "checking stays on)",
        factory=list,
    )

    def validate(self) -> None:
        for i, opt in enumerate(self.ssh_options):
            # ssh reads `-o` like a config line: "Key=value", "Key value" and "Key = value".
            if re.split(r"[\s=]", opt.strip(), maxsplit=1)[0].lower() == "stricthostkeychecking":
                raise _Invalid(f"ssh_options[{i}]", "host-key checking stays on: "
                               "add the host's key to a known_hosts file instead")
        if self.identity_file is not None and not os.path.isfile(
            os.path.expanduser(self.identity_file)
        ):
            raise _Invalid(
                "identity_file", f"expected an existing file, got {_show(self.identity_file)}"
            )


@dataclass(kw_only=True)
class Placement:
    host: str = _field("name of the host (a [hosts.<name>] table) the processes run on")
    count: int = _field("processes of this role on the host", 1, ge=1)
    gpus: list[int] = _field(
        "GPU ids on the host, split evenly among the processes in order (empty: CPU only)",
        factory=list,
        ge=0,
    )
    cpus: str | list[str] | None = _field(
        "CPUs the processes may use: a Linux cpulist of the host's CPU ids (\"0-3,8\") for "
        "every process of this placement, or a list of one per process; OMP_NUM_THREADS, "
        "MKL_NUM_THREADS and a trainer's torch threads follow (the number of CPUs) unless the "
        "host's `env` sets OMP_NUM_THREADS. Unset: not pinned (README: CPU placement)",
        None,
    )

    def validate(self) -> None:
        if isinstance(self.cpus, list):
            if len(self.cpus) != self.count:
                raise _Invalid("cpus", f"expected one cpulist per process ({self.count}, as "
                               f"count), or one string for all, got {_show(self.cpus)}")
            for i, text in enumerate(self.cpus):
                _check_cpulist(f"cpus[{i}]", text)
        elif self.cpus is not None:
            _check_cpulist("cpus", self.cpus)

    def cpus_of(self, j: int) -> tuple[int, ...]:
        """The CPUs of this placement's `j`-th process (empty: not pinned)."""
        if self.cpus is None:
            return ()
        return parse_cpulist(self.cpus[j] if isinstance(self.cpus, list) else self.cpus)


def _check_cpulist(key: str, text: str) -> None:
    try:
        parse_cpulist(text)
    except CpuListError as e:
        raise _Invalid(key, str(e)) from None


@dataclass(kw_only=True)
class RolesConfig:
    """Where each role runs: one `[roles.<role>]` table, or `[[roles.<role>]]` per host."""

    engine: list[Placement] = _field("inference servers")
    rollouter: list[Placement] = _field(
        "rollouters: one, or several rollout shards (each with a shard of the prompts and "
        "its own agent and reward workers)")
    agent_worker: list[Placement] = _field("agent-loop workers")
    reward_worker: list[Placement] = _field("reward workers")
    message_queue: list[Placement] = _field(
        "the MessageQueue: one, or several queue shards (groups routed by the rollouters, "
        "each batch taken from all)")
    trainer: list[Placement] = _field("trainer ranks")
    synchronizer: list[Placement] = _field("the parameter synchronizer (one process)")

    def validate(self) -> None:
        for role in ROLES:
            placements: list[Placement] = getattr(self, role)
            if not placements:
                raise _Invalid(role, "expected at least one placement, got []")
            if role in SINGLETON_ROLES:
                if len(placements) > 1:
                    raise _Invalid(
                        role,
                        f"expected one placement ({role} is a single process), "
                        f"got {len(placements)}",
                    )
                if placements[0].count != 1:
                    raise _Invalid(
                        f"{role}.count",
                        f"expected 1 ({role} is a single process), got {placements[0].count}",
                    )
            for i, p in enumerate(placements):
                if len(p.gpus) % p.count:
                    raise _Invalid(
                        f"{_placement_key(role, i, len(placements))}.gpus",
                        "expected a list whose length is a multiple of count "
                        f"({p.count}), got {_show(p.gpus)}",
                    )


# One field per role of rollmesh.config.ROLE_TABLE, in its (the port plan's) order.
assert tuple(f.name for f in dataclasses.fields(RolesConfig)) == ROLES


@dataclass(kw_only=True)
class PortsConfig:
    """Each process gets `per_process` consecutive ports; the launcher's block comes first at
    `base`, then every role without an explicit port, in role order."""

    base: int = _field(
        "first port of the automatic plan (the launcher's own block)", 28000, ge=1024, le=65535
    )
    per_process: int = _field("consecutive ports reserved for each process", 4, ge=1, le=64)
    engine: int | None = _field("first port of the engine servers (HTTP)", None, ge=1024, le=65535)
    rollouter: int | None = _field("first port of the rollouter", None, ge=1024, le=65535)
    agent_worker: int | None = _field(
        "first port of the agent-loop workers", None, ge=1024, le=65535
    )
    reward_worker: int | None = _field("first port of the reward workers", None, ge=1024, le=65535)
    message_queue: int | None = _field("first port of the MessageQueue", None, ge=1024, le=65535)
    trainer: int | None = _field(
        "first port of the trainer ranks (rank 0: rendezvous)", None, ge=1024, le=65535
    )
    synchronizer: int | None = _field(
        "first port of the parameter synchronizer", None, ge=1024, le=65535
    )


class Process(NamedTuple):
    """One process of the launch plan."""

    role: str
    index: int  # 0.. within its role, across placements
    host: str  # a key of ClusterConfig.hosts
    gpus: tuple[int, ...]
    port: int  # the first of ports.per_process consecutive ports it may bind
    cpus: tuple[int, ...] = ()  # the CPUs it may use (empty: not pinned)

    @property
    def name(self) -> str:
        return f"{self.role}[{self.index}]"


@dataclass(kw_only=True)
class SlurmConfig:
    """`[slurm]` (or `hosts = "slurm"`): hosts node0..nodeN-1 from the Slurm allocation
    (rollmesh.launcher.slurm); each process a job step (srun). Needs a filesystem shared by the nodes."""

    nodes: int = _field("nodes to ask for with `--sbatch` (inside an allocation: its nodes)", 1,
                        ge=1)
    gpus_per_node: int | None = _field(
        "GPUs per node (default: from the allocation, SLURM_GPUS_PER_NODE / "
        "SLURM_GPUS_ON_NODE; 0 without)", None, ge=0)
    engine_nodes: int = _field(
        "roles left out of [roles] are placed by rule: engines on the first engine_nodes nodes, "
        "trainer ranks on the rest, the other roles on node0; 0: every role on node0", 0, ge=0)
    agent_workers: int = _field("agent workers on node0 when [roles.agent_worker] is left out",
                                2, ge=1)
    reward_workers: int = _field(
        "reward workers on node0 when [roles.reward_worker] is left out", 1, ge=1)
    python: str = _field("Python interpreter on the nodes (relative: to workdir)", "python3")
    workdir: str | None = _field(
        "directory the steps start in, on the shared filesystem (default: the launcher's)", None)
    env: dict[str, str] = _field("extra environment variables for every step", factory=dict)
    srun_options: list[str] = _field(
        "extra srun options for every step, e.g. \"--cpus-per-task=4\"", factory=list)
    partition: str | None = _field("`--sbatch`: the partition (default: the cluster's)", None)
    account: str | None = _field("`--sbatch`: the account to charge", None)
    time: str | None = _field("`--sbatch`: the time limit, e.g. \"24:00:00\"", None)
    sbatch_options: list[str] = _field(
        "`--sbatch`: extra sbatch options, e.g. \"--qos=high\"", factory=list)


@dataclass(kw_only=True)
class ClusterConfig:
    name: str = _field("run name (the run directory is <run_dir>/<name>)")
    experiment: str = _field(
        "experiment file, relative to this file's folder (stored resolved, as an absolute path)"
    )
    run_dir: str = _field(
        "directory for logs, checkpoints and state (relative to the working directory)", "runs"
    )
    launcher_address: str | None = _field(
        "address other hosts reach the launching machine at (status hub, control); default: "
        "this machine's host name. Unused when every host is this machine",
        None,
    )
    hosts: dict[str, HostConfig] = _field("machines, by name", factory=dict)
    roles: RolesConfig = _field("where each role runs")
    ports: PortsConfig = _field("port plan", factory=PortsConfig)
    share_gpus: bool = _field(
        "let an engine and trainer ranks use the same GPUs (one GPU for both; the experiment's "
        "sync.backend must then be gloo: NCCL refuses two ranks on one device)", False
    )
    colocate: bool = _field(
        "colocated mode: the engines and the trainer take turns on the same devices (verl's "
        "hybrid engine, slime's --colocate): while the trainer steps, rollout is paused and the "
        "engines give back the memory of engine.release_while_training; the weights are synced "
        "after every step, then rollout resumes (implies share_gpus; the experiment needs "
        "sync.pause_mode = 'abort', sync.sync_every = 1, sync.overlap = false)", False
    )
    slurm: SlurmConfig | None = _field(
        "run inside a Slurm allocation: hosts from it, processes as job steps (see below)", None
    )
    launcher_cpus: str | None = _field(
        "CPUs of the launching machine the launcher itself may use (a cpulist, \"0-1\"); the "
        "processes it starts there without `cpus` of their own keep the launcher's affinity from "
        "before. Unset: not pinned",
        None,
    )
    role_max_restarts: int = _field(
        "times the launcher restarts each process of the rollouter, MessageQueue, "
        "synchronizer, agent and reward workers after it died (killed while starting "
        "included) within any 10 minutes, with back-off (1, 2, 4 ... 30 s); one that dies "
        "more often (a crash loop) ends the run. The trainer's ranks: trainer.max_restarts; engines: "
        "engine.max_restarts", 5, ge=0)
    settings: SettingsConfig = _field(
        "each role's own knobs: [settings.message_queue], [settings.agent_worker], "
        "[settings.reward_worker]", factory=SettingsConfig)
    # Derived: filled by load_cluster, never read from the file, not compared or written out.
    experiment_config: ExperimentConfig | None = field(
        default=None,
        init=False,
        compare=False,
        repr=False,
        metadata={"help": "the loaded experiment (set by load_cluster)"},
    )

    def processes(self) -> list[Process]:
        """Every process to start, in role order, with its GPUs and ports."""
        per = self.ports.per_process
        cursor = self.ports.base + per  # block 0 is the launcher's
        plan = []
        for role in ROLES:
            explicit = getattr(self.ports, role)
            index = 0
            for p in getattr(self.roles, role):
                k = len(p.gpus) // p.count
                for j in range(p.count):
                    if explicit is not None:
                        port = explicit + index * per
                    else:
                        port, cursor = cursor, cursor + per
                    plan.append(
                        Process(role, index, p.host, tuple(p.gpus[j * k : (j + 1) * k]), port,
                                p.cpus_of(j))
                    )
                    index += 1
        return plan

    @property
    def launcher_port(self) -> int:
        """First of the launcher's own ports (status hub)."""
        return self.ports.base

    def validate(self) -> None:
        for role in ROLES:
            placements = getattr(self.roles, role)
            for i, p in enumerate(placements):
                key = f"roles.{_placement_key(role, i, len(placements))}"
                if p.host not in self.hosts:
                    names = ", ".join(repr(h) for h in self.hosts) or "none defined"
                    raise _Invalid(
                        f"{key}.host",
                        f"expected a name from [hosts] ({names}), got {_show(p.host)}",
                    )
                n = self.hosts[p.host].gpus
                if p.gpus and n == 0:
                    raise _Invalid(
                        f"{key}.gpus",
                        f"expected [] (host {p.host!r} has no GPUs), got {_show(p.gpus)}",
                    )
                for g, gpu in enumerate(p.gpus):
                    if gpu >= n:
                        raise _Invalid(
                            f"{key}.gpus[{g}]",
                            f"expected int in [0, {n}) "
                            f"(host {p.host!r} has {_plural(n, 'GPU')}), got {gpu}",
                        )
                if role == "trainer" and len(p.gpus) > p.count:
                    raise _Invalid(
                        f"{key}.gpus",
                        f"expected at most {_plural(p.count, 'GPU id')} (one per rank), "
                        f"got {_show(p.gpus)}",
                    )
        shards = sum(p.count for p in self.roles.rollouter)
        for role in ("agent_worker", "reward_worker"):
            n = sum(p.count for p in getattr(self.roles, role))
            if n < shards:
                raise _Invalid(f"roles.{role}", f"expected at least {shards} in all (one per "
                               f"rollouter: each rollout shard has its own), got {n}")
        if self.launcher_cpus is not None:
            _check_cpulist("launcher_cpus", self.launcher_cpus)
        self._check_gpus_given_once()
        self._check_ports()

    def shared_gpus(self) -> list[str]:
        """The GPUs an engine and a trainer rank both have ("host:gpu"; share_gpus, colocate)."""
        roles: dict[tuple[str, int], set[str]] = {}
        for proc in self.processes():
            if proc.role in ("engine", "trainer"):
                for gpu in proc.gpus:
                    roles.setdefault((proc.host, gpu), set()).add(proc.role)
        return [f"{h}:{g}" for (h, g), r in sorted(roles.items()) if len(r) == 2]

    def _check_gpus_given_once(self) -> None:
        # Keyed by address: two host entries for one machine share its GPUs.
        owner: dict[tuple[str, int], str] = {}
        for proc in self.processes():
            placements = getattr(self.roles, proc.role)
            i, first = _placement_of(placements, proc.index)
            for g, gpu in enumerate(proc.gpus):
                slot = (self.hosts[proc.host].address, gpu)
                if (self.share_gpus or self.colocate) and proc.role in ("engine", "trainer"):
                    # colocated: one engine and one trainer rank per GPU, never two of a role
                    slot = (*slot, proc.role)
                if slot in owner:
                    # Its position in the placement's `gpus` list, for the key path.
                    k = len(proc.gpus) * (proc.index - first) + g
                    raise _Invalid(
                        f"roles.{_placement_key(proc.role, i, len(placements))}.gpus[{k}]",
                        f"GPU {gpu} on host {proc.host!r} is given to both {owner[slot]} "
                        f"and {proc.name}",
                    )
                owner[slot] = proc.name

    def _check_ports(self) -> None:
        per = self.ports.per_process

        def key_of(role: str | None) -> str | None:
            return f"ports.{role}" if role and getattr(self.ports, role) is not None else None

        # The launcher's block is reserved on every address: it may run on any of the hosts.
        launcher = range(self.ports.base, self.ports.base + per)
        if launcher[-1] > 65535:
            raise _Invalid(
                "ports.base",
                f"the launcher would get ports {launcher[0]}-{launcher[-1]}, past 65535",
            )
        taken: dict[tuple[str, int], Process] = {}
        for proc in self.processes():
            last = proc.port + per - 1
            if last > 65535:
                raise _Invalid(
                    key_of(proc.role) or "ports.base",
                    f"{proc.name} would get ports {proc.port}-{last}, past 65535",
                )
            address = self.hosts[proc.host].address
            for port in range(proc.port, last + 1):
                other = taken.get((address, port))
                if port in launcher or other is not None:
                    # Automatic blocks never overlap each other: blame the explicit port.
                    key = key_of(proc.role) or key_of(other and other.role) or "ports.base"
                    who = other.name if other else "the launcher"
                    raise _Invalid(
                        key, f"port {port} on {address} is taken by both {who} and {proc.name}"
                    )
                taken[(address, port)] = proc



def _placement_key(role: str, i: int, n: int) -> str:
    # A lone placement is usually written as a plain [roles.<role>] table: name it that way.
    return role if n == 1 else f"{role}[{i}]"


def _placement_of(placements: list[Placement], index: int) -> tuple[int, int]:
    """(placement number, index of its first process) for the process numbered `index`."""
    first = 0
    for i, p in enumerate(placements):
        if index < first + p.count:
            return i, first
        first += p.count
    raise IndexError(index)
