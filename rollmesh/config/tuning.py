"""The cluster file's `[settings.<role>]` tables: a role's own knobs (capacity, fsync, credits),
the same for every process of the role. Each role's settings (rollmesh.config.settings) are its
table's fields and its wiring, so a knob has one default and one help text.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rollmesh.config.parse import _field

# The MessageQueue's log and hand-out defaults (its class and its role's settings take them).
COMPACT_FLOOR_BYTES = 64 << 20
MAX_PENDING_BATCHES = 256


@dataclass(kw_only=True)
class QueueTuning:
    """`[settings.message_queue]`: how the MessageQueue holds and logs its groups (the role's
    settings, rollmesh.config.MessageQueueSettings, are these and its wiring)."""

    capacity_groups: int | None = _field(
        "groups the MessageQueue holds before the rollouter's puts wait (at least the "
        "experiment's rollout.batch_groups); unset: (staleness.max_staleness + 2) x "
        "rollout.batch_groups x sync.sync_every, enough for every group the staleness bound "
        "lets exist", None, ge=1)
    fsync_interval_s: float = _field(
        "seconds between fsyncs of the MessageQueue's log: what a machine crash may lose of "
        "the acknowledged puts (a killed process loses nothing); 0: every put is fsynced "
        "before it is acknowledged", 1.0, ge=0)
    compact_floor_bytes: int = _field(
        "size below which the MessageQueue's log is never compacted (bytes)",
        COMPACT_FLOOR_BYTES, ge=1)
    max_pending_batches: int = _field(
        "batches handed out to the trainer and not yet committed by a checkpoint that the "
        "MessageQueue keeps to hand out again", MAX_PENDING_BATCHES, ge=1)


@dataclass(kw_only=True)
class AgentWorkerTuning:
    """`[settings.agent_worker]`."""

    credits: int = _field("trajectories each agent worker runs at once", 64, ge=1)


@dataclass(kw_only=True)
class RewardWorkerTuning:
    """`[settings.reward_worker]`."""

    pool: int = _field(
        "sandbox children each reward worker scores in (it takes 4 trajectories per child)",
        2, ge=1)


@dataclass(kw_only=True)
class SettingsConfig:
    """`[settings.<role>]`: a role's own knobs, the same for every process of the role."""

    message_queue: QueueTuning = _field("the MessageQueue", factory=QueueTuning)
    agent_worker: AgentWorkerTuning = _field("each agent worker", factory=AgentWorkerTuning)
    reward_worker: RewardWorkerTuning = _field("each reward worker", factory=RewardWorkerTuning)

    def changed(self, role: str) -> dict[str, object]:
        """The settings of `role` that differ from their defaults (what the plan shows)."""
        table = getattr(self, role, None)
        if table is None:
            return {}
        default = type(table)()
        return {f.name: getattr(table, f.name) for f in dataclasses.fields(table)
                if getattr(table, f.name) != getattr(default, f.name)}
