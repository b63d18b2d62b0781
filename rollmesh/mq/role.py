"""The MessageQueue role: the bounded buffer between rollout and training, served over RPC.

The queue's state and rules (`MessageQueue`: its groups, the staleness bound, its durable log)
live in `rollmesh.mq.store`, its clients (the rollouter's `put_ready`, the trainer's `BatchFeed`)
in `rollmesh.mq.client`. This module is the process around them: `QueueRole` holds one handler
per request (a method each, built from a `MessageQueue` without sockets, so that a test can call
one alone), `main` binds them to the role's RPC server. Groups come in one way (PutGroups, what
the rollouter's `put_ready` sends) and batches go out one way (the stream a trainer's
`BatchFeed` opens: OpenBatchStream, BatchCredit).

The queue's state lives in one thread of its own (every MessageQueue call goes there, in order):
its log writes, checksums and compactions never hold up the event loop, which meanwhile
receives, checks (decodes) and sends; the periodic fsync runs in a third thread, beside the
appends. Back-pressure: a put the queue has no room for is refused in part (`accepted` says how
many of its groups are in), and the rollouter sends the rest again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from rollmesh.config import parse_config
from rollmesh.config.settings import MessageQueueSettings
from rollmesh.mq.store import GIVE_BACK, MessageQueue, default_capacity
from rollmesh.runtime.process import RoleContext
from rollmesh.wire.messages import (
    Batch,
    BatchCredit,
    Group,
    Metrics,
    Ok,
    OpenBatchStream,
    PutGroups,
    PutGroupsReply,
    StatsRequest,
    StreamState,
    WeightVersion,
)
from rollmesh.wire.transport import RpcServer


@dataclass
class _Stream:
    """The consumer's open stream (OpenBatchStream): what the queue may hand it, and where."""

    id: int
    peer: bytes
    groups: int
    version: int
    cursor: int  # the step it hands out next
    through: int  # the last step it may hand out (the consumer's credit)
    committed: int = 0  # the consumer's latest checkpoint, committed with the next hand-out


# Who may send the queue what (the run's keys name the sender): groups come from rollouters,
# batches go to trainers, and only the synchronizer, after a broadcast the trainer asked
# for, moves the version (a WeightVersion from anyone else stalled or emptied a run).
ALLOW: dict[type, Any] = {PutGroups: {"rollouter"}, OpenBatchStream: {"trainer"},
                          BatchCredit: {"trainer"}, WeightVersion: {"synchronizer"},
                          StatsRequest: None}


class QueueRole:
    """The role's request handlers, one method each, around one `MessageQueue`.

    Every call to the queue goes to its own thread (`call`); `changed` wakes the stream
    waiting for groups (or for credit); `consumer` is the open stream, if any. Built without sockets
    (`main` binds `handlers()` to an `RpcServer` and sets `server`, whose protocol error count
    the stats report), so a test can build one and call a handler alone."""

    def __init__(self, queue: MessageQueue, *, log: Any, host: str = "", shard: int = 0):
        self.queue, self.log, self.host, self.shard = queue, log, host, shard
        self.state = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="queue-state")
        self.changed = asyncio.Condition()
        self.consumer: _Stream | None = None  # the open stream, if any
        self.status: dict[str, Any] = {**queue.stats(), "shard": shard}  # for the monitor
        self.server: RpcServer | None = None

    def handlers(self) -> dict[type, Callable[..., Any]]:
        return {PutGroups: self.put_groups, OpenBatchStream: self.open_stream,
                BatchCredit: self.credit, WeightVersion: self.version, StatsRequest: self.stats}

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call `fn` (a MessageQueue method) in the queue's thread."""
        return await asyncio.get_running_loop().run_in_executor(self.state, fn, *args)

    def close(self) -> None:
        """Wait for what the queue's thread is doing: the state is the caller's thread's."""
        self.state.shutdown(wait=True)

    # -- puts --------------------------------------------------------------------------------

    async def put_groups(self, msg: PutGroups, peer: bytes) -> PutGroupsReply:
        queue = self.queue
        accepted, depth, stale, by_origin = await self.call(
            lambda: (queue.put_many(msg.groups), queue.depth_groups,
                     sum(queue.dropped[r] for r in GIVE_BACK), dict(queue.stale_by_origin)))
        if accepted:
            async with self.changed:
                self.changed.notify_all()
        return PutGroupsReply(accepted=accepted, depth=depth, dropped_stale=stale,
                              stale_by_origin=by_origin)

    # -- hand-outs ---------------------------------------------------------------------------

    def _commit_and_hand_out(self, committed: int, step: int, n: int,
                             version: int) -> tuple[list[Group], int, bool] | None:
        self.queue.commit(committed)
        return self.queue.hand_out(step, n, version)

    async def hand_out(self, step: int, n: int, version: int, committed: int = 0) -> Batch | None:
        """The batch for `step` (the one handed out before, if any), or None: too few groups.
        `committed`: a checkpoint to commit first (in the same call to the queue's thread).
        Called holding `changed`."""
        queue = self.queue
        if committed <= queue.committed_step and step not in queue.pending \
                and len(queue.queued) < n:
            return None  # nothing to do there (reads of the thread's state: never too low)
        out = await self.call(self._commit_and_hand_out, committed, step, n, version)
        if out is None:
            return None
        groups, version, redelivered = out
        if redelivered:  # a restarted trainer, or a retry: the very same batch
            self.log.info("batch_redelivered", step=step, groups=len(groups))
        elif step > 0:
            self.changed.notify_all()  # whatever else waits on `changed` sees it handed out
        return Batch(groups=groups, version=version, step=step, redelivered=redelivered)

    # -- the stream ---------------------------------------------------------------------------

    async def open_stream(self, msg: OpenBatchStream, peer: bytes) -> AsyncIterator[Batch]:
        capacity = self.queue.capacity
        if not 1 <= msg.groups <= capacity or msg.next_step < 1 or msg.through_step < 0 \
                or msg.committed_step < 0:
            raise ValueError(f"OpenBatchStream: groups must be in [1, {capacity}] (the "
                             f"capacity), next_step >= 1 and steps >= 0, got groups={msg.groups}, "
                             f"next_step={msg.next_step}, through_step={msg.through_step}, "
                             f"committed_step={msg.committed_step}")
        if msg.committed_step > self.queue.committed_step:
            await self.call(self.queue.commit, msg.committed_step)
        stream = _Stream(msg.stream, peer, msg.groups, msg.version, msg.next_step,
                         msg.through_step, msg.committed_step)
        before, self.consumer = self.consumer, stream
        if before is not None:
            self.log.info("batch_stream_replaced", next_step=before.cursor,
                          new_next_step=stream.cursor)
        async with self.changed:
            self.changed.notify_all()  # the stream it replaces ends
        return self.batches(stream)

    async def batches(self, stream: _Stream) -> AsyncIterator[Batch]:
        try:
            while True:
                async with self.changed:
                    while True:
                        if self.consumer is not stream:
                            return  # replaced
                        if stream.cursor <= stream.through:
                            batch = await self.hand_out(stream.cursor, stream.groups,
                                                        stream.version, stream.committed)
                            if batch is not None:
                                break
                        elif stream.committed > self.queue.committed_step:
                            # no hand-out to commit it with (the credit is used up: the last
                            # step of a run, or of a weight version): committed on its own
                            await self.call(self.queue.commit, stream.committed)
                        await self.changed.wait()
                stream.cursor += 1  # handed out (and kept): a stream opened later gets it again
                yield batch
        finally:
            if self.consumer is stream:
                self.consumer = None

    async def credit(self, msg: BatchCredit, peer: bytes) -> StreamState:
        if msg.through_step < 0 or msg.committed_step < 0:
            raise ValueError(f"BatchCredit: steps must be >= 0, got through_step="
                             f"{msg.through_step}, committed_step={msg.committed_step}")
        stream = self.consumer
        if stream is None or stream.id != msg.stream or stream.peer != peer:
            if msg.committed_step > self.queue.committed_step:
                await self.call(self.queue.commit, msg.committed_step)
            return StreamState(open=False, next_step=0)
        # committed with the stream's next hand-out (one call to the queue's thread for both;
        # a commit lost with a crash is sent again by the trainer's next credit)
        stream.committed = max(stream.committed, msg.committed_step)
        stream.version = max(stream.version, msg.version)
        stream.through = max(stream.through, msg.through_step)
        async with self.changed:
            self.changed.notify_all()
        return StreamState(open=True, next_step=stream.cursor)

    # -- the rest -----------------------------------------------------------------------------

    async def version(self, msg: WeightVersion, peer: bytes) -> Ok:
        def apply() -> tuple[int, int]:
            if msg.rewind:
                self.queue.rewind(msg.version)
            else:
                self.queue.set_version(msg.version)
            self.queue.drop_stale(self.queue.version)
            return self.queue.version, self.queue.depth_groups

        async with self.changed:
            now, depth = await self.call(apply)
            self.changed.notify_all()
        self.log.info("version", version=now, depth=depth, rewind=msg.rewind)
        return Ok()

    def protocol_errors(self) -> int:
        """Requests the server could not decode (none without a server: nothing came in)."""
        return self.server.stats.protocol_errors if self.server is not None else 0

    async def stats(self, msg: StatsRequest, peer: bytes) -> Metrics:
        return Metrics(role="message_queue", host=self.host,
                       values={**await self.call(self.queue.stats), "shard": self.shard,
                               "protocol_errors": self.protocol_errors()})

    async def status_loop(self) -> None:  # the monitor's copy, taken in the queue's thread
        while True:
            await asyncio.sleep(0.5)
            self.status.update(await self.call(self.queue.stats), shard=self.shard)

    async def fsync_loop(self, interval_s: float) -> None:
        """The batched fsync: nothing written stays unsynced longer than `interval_s`."""
        assert self.queue.journal is not None
        journal = self.queue.journal
        while True:
            await asyncio.sleep(max(interval_s, 0.05))
            began = await self.call(journal.begin_sync)
            if began is None:
                continue
            error = None
            try:
                await asyncio.to_thread(os.fsync, began[0])
            except OSError as e:
                error = e
            try:
                await self.call(journal.end_sync, began, error)
            except OSError as e:
                # what the kernel held may never reach the disk (and Linux forgets the error
                # after reporting it once): stop, so that a restart replays what is on disk
                self.log.error("log_fsync_failed", path=e.filename, error=str(e))
                raise


async def main(ctx: RoleContext) -> None:
    """Role entry: serve PutGroups / OpenBatchStream / BatchCredit / WeightVersion /
    StatsRequest (`QueueRole`).

    settings: rollmesh.config.MessageQueueSettings (a durable queue with a state_dir)."""
    settings = parse_config(MessageQueueSettings, ctx.config, "MessageQueue spec")
    exp = settings.experiment
    fsync_interval_s = settings.fsync_interval_s
    started = time.monotonic()
    queue = MessageQueue(
        settings.capacity_groups or default_capacity(exp, settings.shards),
        exp.staleness.max_staleness,
        measure=exp.staleness.measure, state_dir=settings.state_dir, fsync_interval_s=fsync_interval_s,
        compact_floor_bytes=settings.compact_floor_bytes,
        max_pending_batches=settings.max_pending_batches, log=ctx.log)
    if queue.journal is not None:
        ctx.log.info("replayed", path=str(queue.journal.path), records=queue.replayed_records,
                     depth_groups=queue.depth_groups, pending_batches=len(queue.pending),
                     put_samples=queue.put_samples, consumed_samples=queue.consumed_samples,
                     dropped=dict(queue.dropped), version=queue.version,
                     seconds=round(time.monotonic() - started, 3))
        queue.journal.background_sync = True  # QueueRole.fsync_loop
    role = QueueRole(queue, log=ctx.log, host=ctx.spec.host, shard=settings.shard)
    server = role.server = RpcServer(ctx.transport, settings.bind, role.handlers(), allow=ALLOW,
                                     name="message_queue")
    ctx.log.info("config", capacity_groups=queue.capacity, max_staleness=queue.max_staleness,
                 staleness_measure=queue.measure, state_dir=settings.state_dir,
                 fsync_interval_s=fsync_interval_s)
    serving = asyncio.create_task(server.serve())
    syncing = (asyncio.create_task(role.fsync_loop(fsync_interval_s))
               if queue.journal is not None else None)
    watching = asyncio.create_task(role.status_loop())
    ctx.set_status(lambda: dict(role.status))
    await ctx.ready(rpc=server.address)
    try:
        stop = asyncio.create_task(ctx.stopping.wait())
        await asyncio.wait([stop, *([syncing] if syncing is not None else [])],
                           return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if syncing is not None and syncing.done():
            syncing.result()  # a failed fsync: exit with its error (the launcher restarts us)
    finally:
        serving.cancel()
        watching.cancel()
        if syncing is not None:
            syncing.cancel()
        server.close()
        role.close()  # what it was doing is done: the state is the main thread's
        ctx.log.info("stats", **queue.stats())
        queue.close()
