"""The launch plan's two tables: the roles and how the launcher starts each (`ROLE_TABLE`), and
each role's settings (one dataclass per role).

`ROLE_TABLE` is the one source for a role's entry point, whether it is a single process,
whether it is restarted by itself after a crash, its place in the start order and its named
ports. Its row order is the port plan's (rollmesh.config.ClusterConfig.processes) and the
cluster file's `[roles]`. A process owns the block `[port, port + ports.per_process)`; a role's
named ports are the first ports of its block, in the order they are named (`RoleSpec.port`).

The settings are what `launcher.build_plan` writes for a process and its `main` reads back with
`parse_config(XSettings, ctx.config, "<role> spec")`: a bad spec is an error naming the role and
the key. They travel as plain dicts (`rollmesh.config.to_dict`): Supervisor.spawn passes JSON.
Tests and benchmarks write them by hand, with only the keys they need.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollmesh.config.experiment import ExperimentConfig
from rollmesh.config.parse import _field

# --------------------------------------------------------------------------------------------
# The roles
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoleSpec:
    name: str
    # "module:function" the Supervisor starts; None: the engine, an HTTP server the launcher
    # starts itself (rollmesh.engine.sglang.engine_launch), before every other role
    entry: str | None
    singleton: bool  # one process in any cluster
    # Restarted by itself after a crash (up to launcher.MAX_RESTARTS, with back-off). The
    # others: trainer ranks are restarted together from their latest checkpoint
    # (trainer.max_restarts), engines within engine.max_restarts per window.
    restartable: bool
    start: int  # start order, ascending; the launcher waits for each role to be ready
    ports: tuple[str, ...] = ()  # the ports it binds, at offsets 0, 1, ... of its block

    def port(self, first: int, name: str) -> int:
        """The port named `name` of a process whose block begins at `first`."""
        return first + self.ports.index(name)


# The MessageQueue comes back at the same address with its state (its log in the run
# directory); its clients' requests are retried (RpcClient), and re-sent puts are deduplicated.
# The rollouter comes back from its journal (cursor, counters, the groups it had in flight, which
# it generates again); the synchronizer holds no state beyond the sync in progress, which the
# trainer retries. A trainer rank that dies takes every rank down with it: they are restarted
# together from the latest checkpoint, the synchronizer with them (a sync the dead trainer had
# under way would keep rollout paused); beyond that the run ends and `rollmesh launch --resume
# RUN` goes on.
ROLE_TABLE = (
    RoleSpec("engine", None, singleton=False, restartable=False, start=0, ports=("http",)),
    # bind: the agent and reward workers' channel; control: Pause/Resume/stats (RPC)
    RoleSpec("rollouter", "rollmesh.rollouter:main", singleton=True, restartable=True,
             start=4, ports=("bind", "control")),
    RoleSpec("agent_worker", "rollmesh.agent_worker:main", singleton=False, restartable=True,
             start=5),
    RoleSpec("reward_worker", "rollmesh.reward_worker:main", singleton=False, restartable=True,
             start=6),
    RoleSpec("message_queue", "rollmesh.message_queue:main", singleton=True, restartable=True,
             start=1, ports=("bind",)),
    # rendezvous: rank 0's, the ranks' store (rollmesh.ranks)
    RoleSpec("trainer", "rollmesh.trainer:main", singleton=False, restartable=False, start=3,
             ports=("bind", "rendezvous")),
    RoleSpec("synchronizer", "rollmesh.synchronizer:main", singleton=True, restartable=True,
             start=2, ports=("bind",)),
)
ROLE = {r.name: r for r in ROLE_TABLE}
ROLES = tuple(ROLE)  # in port-plan order
SINGLETON_ROLES = frozenset(r.name for r in ROLE_TABLE if r.singleton)
# The roles the Supervisor starts, in start order (the engines are started and healthy first).
START_ORDER = tuple(r.name for r in sorted(ROLE_TABLE, key=lambda r: r.start) if r.entry)


# --------------------------------------------------------------------------------------------
# Each role's settings
# --------------------------------------------------------------------------------------------

_EXPERIMENT = "the experiment (the resolved file, rollmesh.config.ExperimentConfig)"
_LOCAL = "tcp://127.0.0.1:0"  # bind any free port on loopback


@dataclass(kw_only=True)
class MessageQueueSettings:
    experiment: ExperimentConfig = _field(_EXPERIMENT)
    bind: str = _field("address its RPC server binds (tcp://host:port)")
    state_dir: str | None = _field(
        "directory of its write-ahead log (a durable queue); none: in memory", None)
    capacity_groups: int | None = _field(
        "groups it holds before puts wait; none: message_queue.default_capacity", None, ge=1)
    fsync_interval_s: float = _field("seconds between fsyncs of its log; 0: every record",
                                     1.0, ge=0)
    compact_floor_bytes: int = _field(
        "log size below which it is never compacted (message_queue.COMPACT_FLOOR_BYTES)",
        64 << 20, ge=1)
    max_pending_batches: int = _field(
        "handed-out batches not yet committed it keeps (message_queue.MAX_PENDING_BATCHES)",
        256, ge=1)


@dataclass(kw_only=True)
class RolloutSettings:
    experiment: ExperimentConfig = _field(_EXPERIMENT)
    bind: str = _field("address of the channel the agent and reward workers connect to")
    control: str = _field("address of its RPC server (pause, resume, stats)")
    message_queue: str = _field("the MessageQueue's RPC address")
    engines: list[str] = _field(
        "engine URLs: admission stops while none is healthy; none: not watched", factory=list)
    state_dir: str | None = _field("directory of its journal; none: no journal", None)


@dataclass(kw_only=True)
class AgentWorkerSettings:
    experiment: ExperimentConfig = _field(_EXPERIMENT)
    rollouter: str = _field("the rollouter's channel address")
    engines: list[str] = _field("engine URLs")
    credits: int = _field("trajectories it asks the rollouter for at once", 64, ge=1)


@dataclass(kw_only=True)
class RewardWorkerSettings:
    experiment: ExperimentConfig = _field(_EXPERIMENT)
    rollouter: str = _field("the rollouter's channel address")
    pool: int = _field("sandbox children that score (it asks for 4 per child)", 2, ge=1)


@dataclass(kw_only=True)
class SynchronizerSettings:
    experiment: ExperimentConfig = _field(_EXPERIMENT)
    bind: str = _field("address its RPC server binds", _LOCAL)
    rollouter: str = _field("the rollouter's control (RPC) address")
    message_queue: str = _field("the MessageQueue's RPC address")
    engines: list[str] = _field(
        "engine URLs: their versions are checked before a version is published; none: not "
        "checked", factory=list)
    version: int = _field("the engines' weight version at start", 0, ge=0)


@dataclass(kw_only=True)
class TrainerSettings:
    experiment: ExperimentConfig = _field(_EXPERIMENT)
    bind: str = _field("address of rank 0's stats server", _LOCAL)
    rendezvous: str | None = _field("rank 0's store (tcp://host:port); none: one rank", None)
    message_queue: str = _field("the MessageQueue's RPC address")
    synchronizer: str | None = _field(
        "the synchronizer's RPC address; none: no weight sync", None)
    rollouter: str | None = _field(
        "the rollouter's control address (the latest evaluation); none: not asked", None)
    engines: list[str] = _field("engine URLs (the weight-update group)", factory=list)
    engine_tp_sizes: list[int] | None = _field(
        "each engine's TP size (its ranks in the weight-update group); none: 1 each", None,
        ge=1)
    weight_sync_address: str = _field(
        "address of rank 0 the engines reach for the weight-update group", "127.0.0.1")
    metrics_path: str | None = _field("metrics.jsonl it appends a row per step to", None)
    checkpoint_dir: str | None = _field(
        "where its checkpoints go; none: trainer.checkpoint_dir", None)
    final_export_dir: str | None = _field(
        "where the final policy is exported (Hugging Face format); none: not exported", None)
    export_dir: str | None = _field(
        "where each published version is exported (evaluation, tests); none: not exported",
        None)
    threads: int | None = _field("torch.set_num_threads; none: torch's default", None, ge=1)
    device_index: int = _field("the CUDA device of the rank", 0, ge=0)
