"""The MessageQueue role: the bounded buffer between rollout and training.

It owns the queued groups, the staleness bound at hand-out, back-pressure to the rollouter, and
its share of the accounting: every sample put is eventually consumed or dropped with a reason,
and until then it is counted in `depth`.

Staleness of a group handed to a trainer at version v: v minus the oldest weight version among
the group's generated tokens. A group past `max_staleness` is dropped at hand-out and counted
(reason "stale"): the bound holds even for trajectories resumed across many syncs. Groups are
kept whole (GRPO needs the n samples of a prompt together), so one stale sample drops its group.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

from rollmesh.config import ExperimentConfig, parse_config
from rollmesh.protocol import (
    Batch, GetBatch, Group, Metrics, Ok, PutGroup, PutReply, StatsRequest, WeightVersion,
)
from rollmesh.runtime import RoleContext
from rollmesh.transport import RpcServer


def oldest_version(group: Group) -> int | None:
    """The oldest weight version that produced a token of this group (None: nothing generated)."""
    oldest = None
    for t in group.trajectories:
        generated = t.versions[t.versions >= 0]
        if generated.size:
            v = int(generated.min())
            oldest = v if oldest is None else min(oldest, v)
    return oldest


class MessageQueue:
    """The queue's state and rules, without sockets (the role below serves it)."""

    def __init__(self, capacity_groups: int, max_staleness: int):
        self.capacity = capacity_groups
        self.max_staleness = max_staleness
        # (oldest generated version, group): computed once at put, not at every hand-out
        self.groups: collections.deque[tuple[int | None, Group]] = collections.deque()
        self.depth_samples = 0
        self.version = 0
        self.put_samples = 0
        self.consumed_samples = 0
        self.rejected_puts = 0  # back-pressure events: a put refused because the queue was full
        self.dropped: collections.Counter[str] = collections.Counter()
        self.staleness_hist: collections.Counter[int] = collections.Counter()
        self._consumed_times: collections.deque[tuple[float, int]] = collections.deque()

    def put(self, group: Group) -> bool:
        if len(self.groups) >= self.capacity:
            self.rejected_puts += 1
            return False
        self.groups.append((oldest_version(group), group))
        self.put_samples += len(group.trajectories)
        self.depth_samples += len(group.trajectories)
        return True

    @staticmethod
    def staleness(oldest: int | None, version: int) -> int:
        return 0 if oldest is None else version - oldest

    def set_version(self, version: int) -> None:
        self.version = max(self.version, version)

    def drop_stale(self, version: int) -> int:
        """Drop every group past the bound for a consumer at `version`; returns samples dropped."""
        if all(self.staleness(o, version) <= self.max_staleness for o, _ in self.groups):
            return 0
        kept: collections.deque[tuple[int | None, Group]] = collections.deque()
        dropped = 0
        for oldest, g in self.groups:
            if self.staleness(oldest, version) > self.max_staleness:
                dropped += len(g.trajectories)
            else:
                kept.append((oldest, g))
        self.groups = kept
        self.depth_samples -= dropped
        self.dropped["stale"] += dropped
        return dropped

    def take(self, n: int, version: int) -> list[Group] | None:
        """Exactly n groups for a trainer at `version`, oldest first, or None if fewer remain
        after dropping the stale ones."""
        version = max(version, self.version)
        self.drop_stale(version)
        if len(self.groups) < n:
            return None
        out = [self.groups.popleft() for _ in range(n)]
        now = time.monotonic()
        for oldest, g in out:
            k = len(g.trajectories)
            self.consumed_samples += k
            self.depth_samples -= k
            self.staleness_hist[self.staleness(oldest, version)] += k
            self._consumed_times.append((now, k))
        return [g for _, g in out]

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        while self._consumed_times and now - self._consumed_times[0][0] > 60:
            self._consumed_times.popleft()
        recent = sum(k for _, k in self._consumed_times)
        span = now - self._consumed_times[0][0] if self._consumed_times else 0.0
        return {
            "depth_groups": len(self.groups), "depth_samples": self.depth_samples,
            "capacity_groups": self.capacity, "version": self.version,
            "put_samples": self.put_samples, "consumed_samples": self.consumed_samples,
            "dropped": dict(self.dropped), "rejected_puts": self.rejected_puts,
            "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
            "consumed_per_s": recent / span if span > 0 else 0.0,
            "max_staleness": self.max_staleness,
        }


def default_capacity(exp: ExperimentConfig) -> int:
    """Enough for every group the staleness bound lets exist at once, and one batch more."""
    per_version = exp.rollout.batch_groups * exp.sync.sync_every
    return (exp.staleness.max_staleness + 2) * per_version


async def main(ctx: RoleContext) -> None:
    """Role entry: serve PutGroup / GetBatch / WeightVersion / StatsRequest."""
    exp = parse_config(ExperimentConfig, ctx.config["experiment"], "MessageQueue spec")
    queue = MessageQueue(ctx.config.get("capacity_groups") or default_capacity(exp),
                         exp.staleness.max_staleness)
    changed = asyncio.Condition()

    async def put(msg: PutGroup, peer: bytes) -> PutReply:
        accepted = queue.put(msg.group)
        if accepted:
            async with changed:
                changed.notify_all()
        return PutReply(accepted=accepted, depth=len(queue.groups))

    async def get(msg: GetBatch, peer: bytes) -> Batch:
        deadline = time.monotonic() + msg.timeout_s
        async with changed:
            while True:
                groups = queue.take(msg.groups, msg.version)
                remaining = deadline - time.monotonic()
                if groups is not None or remaining <= 0:
                    return Batch(groups=groups or [], version=max(msg.version, queue.version))
                try:
                    await asyncio.wait_for(changed.wait(), remaining)
                except asyncio.TimeoutError:
                    pass

    async def version(msg: WeightVersion, peer: bytes) -> Ok:
        queue.set_version(msg.version)
        async with changed:
            queue.drop_stale(queue.version)
            changed.notify_all()
        ctx.log.info("version", version=queue.version, depth=len(queue.groups))
        return Ok()

    async def stats(msg: StatsRequest, peer: bytes) -> Metrics:
        return Metrics(role="message_queue", host=ctx.spec.host,
                       values={**queue.stats(), "protocol_errors": server.stats.protocol_errors})

    server = RpcServer(ctx.transport, ctx.config["bind"], {
        PutGroup: put, GetBatch: get, WeightVersion: version, StatsRequest: stats,
    }, name="message_queue")
    ctx.log.info("config", capacity_groups=queue.capacity, max_staleness=queue.max_staleness)
    serving = asyncio.create_task(server.serve())
    ctx.set_status(queue.stats)
    await ctx.ready(rpc=server.address)
    await ctx.stopping.wait()
    serving.cancel()
    ctx.log.info("stats", **queue.stats())
    server.close()

