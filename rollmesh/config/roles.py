"""The roles the launcher starts and how (`ROLE_TABLE`): each role's entry point, whether it is
a single process, whether it is restarted by itself after a crash, its place in the start order
and its named ports. The one source for rollmesh.config.cluster (the `[roles]` of a cluster
file, the port plan), rollmesh.launcher.plan (named ports) and rollmesh.launcher.launcher
(start, supervise).

Row order is the port plan's (rollmesh.config.ClusterConfig.processes) and the cluster file's
`[roles]`. A process owns the block `[port, port + ports.per_process)`; a role's named ports are
the first ports of its block, in the order they are named (`RoleDef.port`). This module
imports nothing of the package: the config schema reads it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoleDef:
    name: str
    # "module:function" the Supervisor starts; None: the engine, an HTTP server the launcher
    # starts itself (rollmesh.engine.launch.engine_launch), before every other role
    entry: str | None
    singleton: bool  # one process in any cluster
    # Restarted by itself after a crash (up to the cluster file's role_max_restarts, with
    # back-off). The others: trainer ranks are restarted together from their latest checkpoint
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
    RoleDef("engine", None, singleton=False, restartable=False, start=0, ports=("http",)),
    # bind: the agent and reward workers' channel; control: Pause/Resume/stats (RPC)
    # Several rollouters (`count`) are rollout shards: each owns a disjoint shard of the prompts,
    # its own workers and its share of the admission bound (rollmesh.rollout.core).
    RoleDef("rollouter", "rollmesh.rollout.role:main", singleton=False, restartable=True,
             start=4, ports=("bind", "control")),
    RoleDef("agent_worker", "rollmesh.agents.role:main", singleton=False, restartable=True,
             start=5),
    RoleDef("reward_worker", "rollmesh.rewards.role:main", singleton=False, restartable=True,
             start=6),
    # Several queues (`count`) are queue shards: each holds the groups its rollouters route to
    # it, with its own log; the trainer takes a fixed share of every batch from each.
    RoleDef("message_queue", "rollmesh.mq.role:main", singleton=False, restartable=True,
             start=1, ports=("bind",)),
    # rendezvous: rank 0's, the ranks' store (rollmesh.training.ranks)
    RoleDef("trainer", "rollmesh.training.role:main", singleton=False, restartable=False, start=3,
             ports=("bind", "rendezvous")),
    RoleDef("synchronizer", "rollmesh.sync.role:main", singleton=True, restartable=True,
             start=2, ports=("bind",)),
)
ROLE = {r.name: r for r in ROLE_TABLE}
ROLES = tuple(ROLE)  # in port-plan order
SINGLETON_ROLES = frozenset(r.name for r in ROLE_TABLE if r.singleton)
# The roles the Supervisor starts, in start order (the engines are started and healthy first).
START_ORDER = tuple(r.name for r in sorted(ROLE_TABLE, key=lambda r: r.start) if r.entry)


# -- shard counts by default (the Slurm placement by rule; benchmarks/simulate.py --scale) -------
# One rollouter thread stays under half a core at this many GPUs of a 7B-class async run even
# with the per-shard costs benchmarks/shards.py measured in a contended 2 x 2 stack (at 1,000 it
# was at 72%); one queue shard at about five times as many (benchmarks/README.md, "Scaling on
# paper"; RESULTS.md, "Rollout and queue shards"). Larger models make fewer samples per GPU, so
# the same counts leave them more room.
GPUS_PER_ROLLOUTER = 600
GPUS_PER_QUEUE_SHARD = 3000


def default_shards(gpus: int) -> tuple[int, int]:
    """(rollouters, queue shards) for a cluster of `gpus` GPUs in all: one rollouter per
    started 600 GPUs and one queue shard per started 3,000."""
    gpus = max(int(gpus), 1)
    return -(-gpus // GPUS_PER_ROLLOUTER), -(-gpus // GPUS_PER_QUEUE_SHARD)
