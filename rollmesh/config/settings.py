"""Each role's settings, one dataclass per role: what `rollmesh.launcher.plan.build_plan` writes
for a process and its `main` reads back with `parse_config(XSettings, ctx.config, "<role>
spec")`, so that a bad spec is an error naming the role and the key. The defaults are the
roles' own.

They travel as plain dicts (`rollmesh.config.to_dict`): Supervisor.spawn passes JSON. Tests and
benchmarks write them by hand, with only the keys they need.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollmesh.config.tuning import (
    COMPACT_FLOOR_BYTES, MAX_PENDING_BATCHES, AgentWorkerTuning, QueueTuning, RewardWorkerTuning,
)
from rollmesh.config.experiment import ExperimentConfig
from rollmesh.config.parse import _field

__all__ = ["COMPACT_FLOOR_BYTES", "MAX_PENDING_BATCHES"]  # re-exported: the queue's defaults

_EXPERIMENT = "the experiment (the resolved file, rollmesh.config.ExperimentConfig)"
_LOCAL = "tcp://127.0.0.1:0"  # bind any free port on loopback


@dataclass(kw_only=True)
class MessageQueueSettings(QueueTuning):
    """Its wiring, and its tuning (capacity, fsync, compaction: the cluster file's
    [settings.message_queue])."""

    experiment: ExperimentConfig = _field(_EXPERIMENT)
    bind: str = _field("address its RPC server binds (tcp://host:port)")
    state_dir: str | None = _field(
        "directory of its write-ahead log (a durable queue); none: in memory", None)
    shard: int = _field("this queue's index among the queue shards", 0, ge=0)
    shards: int = _field("queue shards in the run: each holds its share of the capacity", 1,
                         ge=1)


@dataclass(kw_only=True)
class RolloutSettings:
    experiment: ExperimentConfig = _field(_EXPERIMENT)
    bind: str = _field("address of the channel the agent and reward workers connect to")
    control: str = _field("address of its RPC server (pause, resume, stats)")
    message_queue: str = _field("the MessageQueue's RPC address")
    queue_shards: list[str] = _field(
        "every queue shard's RPC address, in shard order, with more than one; empty: "
        "message_queue alone", factory=list)
    engines: list[str] = _field(
        "engine URLs: admission stops while none is healthy; none: not watched", factory=list)
    state_dir: str | None = _field("directory of its journal; none: no journal", None)
    shard: int = _field("this rollouter's index among the rollout shards", 0, ge=0)
    shards: int = _field("rollout shards in the run (rollouters)", 1, ge=1)


@dataclass(kw_only=True)
class AgentWorkerSettings(AgentWorkerTuning):
    experiment: ExperimentConfig = _field(_EXPERIMENT)
    rollouter: str = _field("the rollouter's channel address")
    engines: list[str] = _field("engine URLs")
    router: str | None = _field(
        "the router's URL that generation goes through (engine.router); none: the engines "
        "directly", None)


@dataclass(kw_only=True)
class RewardWorkerSettings(RewardWorkerTuning):
    experiment: ExperimentConfig = _field(_EXPERIMENT)
    rollouter: str = _field("the rollouter's channel address")


@dataclass(kw_only=True)
class SynchronizerSettings:
    experiment: ExperimentConfig = _field(_EXPERIMENT)
    bind: str = _field("address its RPC server binds", _LOCAL)
    rollouter: str = _field("the rollouter's control (RPC) address")
    rollouters: list[str] = _field(
        "every rollouter's control address, in shard order, with more than one; empty: "
        "rollouter alone", factory=list)
    message_queue: str = _field("the MessageQueue's RPC address")
    queue_shards: list[str] = _field(
        "every queue shard's RPC address, in shard order, with more than one; empty: "
        "message_queue alone", factory=list)
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
    queue_shards: list[str] = _field(
        "every queue shard's RPC address, in shard order, with more than one; empty: "
        "message_queue alone", factory=list)
    synchronizer: str | None = _field(
        "the synchronizer's RPC address; none: no weight sync", None)
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
    lora_dir: str | None = _field(
        "model.lora.rank > 0: where rank 0 writes each synced version's adapter for the "
        "engines to load (this host's or a shared filesystem)", None)
    threads: int | None = _field("torch.set_num_threads; none: torch's default", None, ge=1)
    device_index: int = _field("the CUDA device of the rank", 0, ge=0)
    colocate: bool = _field(
        "colocated mode (the cluster file's `colocate`): the engines give the device back while "
        "this trainer steps (training/colocate.py)", False)


def queue_addresses(settings: RolloutSettings | SynchronizerSettings | TrainerSettings) -> list[str]:
    """Every queue shard's address, in shard order (one: the MessageQueue)."""
    return list(settings.queue_shards) or [settings.message_queue]
