"""The MessageQueue's clients: the rollouter's puts and the trainer's stream of batches.

The rollouter puts what it has ready in PutGroups (`put_ready`), two out at once, what is ready
shared between them so that they overlap: the queue writes one put's records to its log in one
write while it receives and checks the next, and acknowledges them together. Each reply says
how many samples the queue has dropped as stale so far (`PutGroupsReply.dropped_stale`), which
the rollouter's admission gives back; a put loop with nothing to put sends an empty put every
second, so that those counts (and a queue that stopped answering) are still heard.

The trainer takes its batches from a stream (`BatchFeed`): it opens one at its next step with
credit for the steps it may take at its version (OpenBatchStream), and the queue pushes each
step's batch as soon as it has the groups, while the trainer is still busy with the step before;
the trainer moves the credit on as it goes (BatchCredit). Each step's batch is kept by the queue
until a checkpoint covers it, so a trainer that restarts and opens a stream at its checkpoint's
next step gets the same batches again.

The roles that use these import this module only, never the queue's own (`rollmesh.mq.role`,
`rollmesh.mq.store`).
"""

from __future__ import annotations

import asyncio
import collections
import secrets
import time
from typing import Any, Callable

from rollmesh.runtime.log import get_logger
from rollmesh.wire import protocol
from rollmesh.wire.messages import (
    Batch,
    BatchCredit,
    Group,
    OpenBatchStream,
    PutGroups,
    PutGroupsReply,
    StreamState,
)
from rollmesh.wire.protocol import ProtocolError
from rollmesh.wire.transport import PeerTimeout, RemoteError, RpcClient, RpcStream, StreamBroken

# One PutGroups holds at most this many groups, bytes of arrays and frames (what is ready
# beyond goes in the next put): big enough to spread a put's costs over many groups, small
# enough that one put is a short write and a short pause of the queue's loop.
PUT_MAX_GROUPS = 64
PUT_MAX_BYTES = 32 << 20
PUT_MAX_FRAMES = protocol.MAX_FRAMES // 2
PUTS_IN_FLIGHT = 2  # the rollouter's puts out at once
# Batches the trainer's stream takes ahead of the step it trains (within one weight version):
# the next step's batch is on its way while the trainer computes this one.
STREAM_AHEAD = 1
# With nothing to put for this long, the put loop sends an empty put: its reply carries the
# queue's stale drops; a put unanswered this long says the queue is away.
IDLE_PUT_S = 1.0
QUEUE_LEASH_S = 3.0


def group_bytes(group: Group) -> int:
    """About what a group weighs on the wire: the bytes of its arrays."""
    return sum(t.token_ids.nbytes + t.logprobs.nbytes + t.versions.nbytes + t.loss_mask.nbytes
               for t in group.trajectories)


def next_put(ready: collections.deque[Group], *, max_groups: int = PUT_MAX_GROUPS,
             max_bytes: int = PUT_MAX_BYTES, max_frames: int = PUT_MAX_FRAMES) -> list[Group]:
    """The groups of the next PutGroups: the oldest ready, within the limits (one at least)."""
    out: list[Group] = []
    nbytes = frames = 0
    for group in ready:
        size = group_bytes(group)
        n = 2 + 4 * len(group.trajectories)
        if out and (len(out) >= max_groups or nbytes + size > max_bytes
                    or frames + n > max_frames):
            break
        out.append(group)
        nbytes += size
        frames += n
    return out


async def put_ready(mq: RpcClient, ready: collections.deque[Group], wake: asyncio.Event,
                    queued: Callable[[Group], None], *, log: Any,
                    full: Callable[[], None] | None = None,
                    heard: Callable[[PutGroupsReply], None] | None = None,
                    unheard: Callable[[], None] | None = None, timeout_s: float = 30.0,
                    idle_s: float = IDLE_PUT_S, leash_s: float = QUEUE_LEASH_S,
                    max_groups: int = PUT_MAX_GROUPS, max_bytes: int = PUT_MAX_BYTES,
                    in_flight: int = PUTS_IN_FLIGHT, sending: set[int] | None = None) -> None:
    """The rollouter's put loop, until cancelled: what is ready goes to the queue in PutGroups,
    oldest first, with up to `in_flight` puts out at once, shared evenly over the puts that may
    go out (the queue writes one while it receives and checks the next). A group stays in
    `ready` until the queue has it in its log (then `queued(group)` is called); what the queue
    refused because it is full stays and goes again (`full()` is called; no new put for 10 ms,
    doubling to 0.5 s). A failed put (timeout, error) goes again after a second: a group the
    queue took and whose reply was lost is counted once there (by its id). `wake` is set when
    `ready` grows.

    What the queue says back: `heard(reply)` is called with every reply (its `dropped_stale`
    is the queue's count of samples dropped as stale), `unheard()` when a put has had no answer
    for `leash_s`. With nothing to put for `idle_s`, an empty put goes out (answered at once,
    with the counts), so that they are heard while the rollouter has nothing to send.
    `sending`: the set this loop keeps the ids (`id(group)`) of the groups in a put not yet
    answered in, for the caller to read (a rewind leaves those to the queue)."""
    running = asyncio.get_running_loop()

    async def send(put: PutGroups, timeout: float) -> Any:
        extra = {} if put.groups else {"retries": 0}  # an empty put is not worth a retry
        request = asyncio.create_task(mq.request(put, timeout_s=timeout, **extra))
        try:
            await asyncio.wait({request}, timeout=leash_s)
            late = not request.done()
            if late and unheard is not None:
                unheard()  # no answer on a short leash: the queue is away (or cut off)
            try:
                return await request
            except PeerTimeout:
                if not late and unheard is not None:
                    unheard()  # timed out within the leash
                raise
        finally:
            request.cancel()

    delay = 0.01
    resume_at = 0.0  # no new put before this (the queue was full, or did not answer)
    flying: collections.deque[tuple[asyncio.Task, list[Group]]] = collections.deque()
    out: set[int] = set() if sending is None else sending  # groups in a put not yet answered
    try:
        while True:
            while len(flying) < in_flight and running.time() >= resume_at:
                waiting = collections.deque(g for g in ready if id(g) not in out)
                if not waiting:
                    break
                # what waits is shared over the puts that may go out now, so that they overlap
                # (the queue writes one while the next is sent and checked) instead of one
                # put carrying it all while the others have nothing to carry
                share = -(-len(waiting) // (in_flight - len(flying)))
                groups = next_put(waiting, max_groups=min(max_groups, share),
                                  max_bytes=max_bytes)
                flying.append((asyncio.create_task(
                    send(PutGroups(groups=groups), timeout_s)), groups))
                out.update(map(id, groups))
            wake.clear()
            pause = max(0.0, resume_at - running.time())
            if not flying:
                if pause and any(id(g) not in out for g in ready):
                    await asyncio.sleep(pause)
                else:
                    try:
                        await asyncio.wait_for(wake.wait(), idle_s)
                    except asyncio.TimeoutError:  # nothing to put: an empty put hears the queue
                        flying.append((asyncio.create_task(
                            send(PutGroups(groups=[]), min(timeout_s, leash_s))), []))
                continue
            task, groups = flying[0]
            if len(flying) < in_flight:  # another put may go out once more is ready
                woken = asyncio.create_task(wake.wait())
                await asyncio.wait({task, woken}, timeout=pause or None,
                                   return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
                if not task.done():
                    continue
            flying.popleft()
            out.difference_update(map(id, groups))
            try:
                reply = await task
                if not (isinstance(reply, PutGroupsReply) and 0 <= reply.accepted <= len(groups)):
                    raise ProtocolError(f"PutGroups of {len(groups)} answered with {reply!r:.200}")
            except (PeerTimeout, RemoteError, ProtocolError) as e:
                if groups or not isinstance(e, PeerTimeout):  # an empty put: `unheard` says so
                    log.warning("queue_put_failed", groups=len(groups), error=str(e))
                resume_at = running.time() + 1.0
                continue
            if heard is not None:
                heard(reply)
            if reply.accepted:
                taken = set(map(id, groups[:reply.accepted]))
                left = [g for g in ready if id(g) not in taken]
                ready.clear()
                ready.extend(left)
                for g in groups[:reply.accepted]:
                    queued(g)
            if reply.accepted < len(groups):
                if full is not None:
                    full()
                resume_at = running.time() + delay
                delay = min(delay * 2, 0.5)
            elif groups:
                delay = 0.01
    finally:
        for task, _ in flying:
            task.cancel()


class BatchFeed:
    """The trainer's end of the hand-out: its batches from the MessageQueue's stream.

    `get(step, ...)` returns the batch for `step`, the step after the trainer's last one. The
    feed keeps one stream open (OpenBatchStream) with credit through `through_step`, which the
    trainer sets to the last step it may train at its current weight version (never beyond:
    a batch is taken at the version it is trained at, so its staleness is exact), at most
    `STREAM_AHEAD` past `step`. So the next batch is already here, or on its way, when the
    trainer asks for it. Each get moves the credit on (BatchCredit) and says which step the
    latest checkpoint holds. After a dropped connection, a stream the queue no longer has (it
    restarted, or another replaced it), or a wait that came back empty although the queue had
    sent the step's batch, the next get opens a new stream at `step`: the queue hands out
    again, from its log, every batch it already took for the steps from there on, so nothing
    is lost or trained twice (a batch that arrives twice is dropped)."""

    def __init__(self, mq: RpcClient, groups: int, *, log: Any = None):
        self.mq, self.groups = mq, groups
        self.log = log if log is not None else get_logger("rollmesh.mq.client")
        self.stream: RpcStream | None = None
        self.stream_id = 0
        self.have: dict[int, Batch] = {}  # batches received for the steps ahead
        # (version, through, committed) last sent; None: send them again (a probe)
        self.credit: tuple[int, int, int] | None = None
        self.opened = 0  # streams opened (1 when nothing went wrong)

    async def get(self, step: int, version: int, through_step: int, committed_step: int,
                  timeout_s: float) -> Batch | None:
        """The batch for `step`, or None if none came within `timeout_s` (ask again)."""
        if step < 1 or through_step < step:
            raise ValueError(f"BatchFeed.get: step must be >= 1 and through_step >= step, got "
                             f"step={step}, through_step={through_step}")
        for s in [s for s in self.have if s < step]:
            del self.have[s]
        if self.stream is None or self.stream.broken:
            await self._open(step, version, through_step, committed_step)
        elif (version, through_step, committed_step) != self.credit:
            probe = self.credit is None  # the last wait came back empty: is the stream whole?
            try:
                state = await self.mq.request(BatchCredit(
                    stream=self.stream_id, version=version, through_step=through_step,
                    committed_step=committed_step), timeout_s=max(timeout_s, 5.0))
            except PeerTimeout as e:  # the queue is away (restarting): ask again later
                self.log.warning("batch_credit_failed", step=step, error=str(e))
                self._close()
                return None
            if not isinstance(state, StreamState):
                raise ProtocolError(f"BatchCredit answered with {type(state).__name__}")
            self.credit = (version, through_step, committed_step)
            if not state.open or (probe and state.next_step > step and step not in self.have):
                # the queue restarted, or a stream replaced ours, or it sent this step's batch
                # and, a whole wait later, nothing came: a new stream (it sends it again)
                await self._open(step, version, through_step, committed_step)
        if step in self.have:
            return self.have.pop(step)
        assert self.stream is not None
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                batch = await self.stream.next(max(0.0, deadline - time.monotonic()))
            except PeerTimeout:
                self.credit = None  # the next get asks the queue how the stream stands
                return None
            except StreamBroken as e:
                self.log.warning("batch_stream_broken", step=step, error=str(e))
                self._close()
                return None
            except RemoteError:  # the queue ended the stream with an error (its log, say)
                self._close()  # the next get opens another
                raise
            if not isinstance(batch, Batch):
                self._close()
                raise ProtocolError(f"the batch stream sent a {type(batch).__name__}")
            if batch.step == step:
                return batch
            if batch.step > step:
                self.have.setdefault(batch.step, batch)
            # else: a step already had (sent again by a stream opened meanwhile): dropped

    async def _open(self, step: int, version: int, through_step: int,
                    committed_step: int) -> None:
        self._close()
        self.have.clear()  # the new stream hands them out again
        self.stream_id = secrets.randbits(62)
        self.stream = await self.mq.stream(OpenBatchStream(
            stream=self.stream_id, groups=self.groups, version=version, next_step=step,
            through_step=through_step, committed_step=committed_step))
        self.credit = (version, through_step, committed_step)
        self.opened += 1

    def _close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None

    def close(self) -> None:
        self._close()
        self.have.clear()



def shares(groups: int, shards: int) -> list[int]:
    """Each queue shard's part of a batch of `groups` groups: as equal as can be, the first
    shards one more; they sum to `groups`."""
    return [groups // shards + (1 if j < groups % shards else 0) for j in range(shards)]


class ShardedFeed:
    """The trainer's batches from several queue shards: each step's batch is shard j's fixed
    share (`shares`) from each shard's own stream (a `BatchFeed` each), in shard order. Each
    shard keeps what it handed out for a step until a checkpoint covers it, so a restarted
    trainer gets the same groups from every shard again: the batch is the same set of groups.
    A share that came while another shard's did not is kept for the next `get` (the stream
    would not send it again), so nothing waits on the slowest shard twice."""

    def __init__(self, queues: list[RpcClient], groups: int, *, log: Any = None):
        if groups < len(queues):
            raise ValueError(f"ShardedFeed: a batch of {groups} groups cannot take a share from "
                             f"each of {len(queues)} queue shards (rollout.batch_groups must be "
                             f"at least the number of queue shards)")
        self.feeds = [BatchFeed(mq, n, log=log) for mq, n in zip(queues, shares(groups,
                                                                                  len(queues)))]

    async def get(self, step: int, version: int, through_step: int, committed_step: int,
                  timeout_s: float) -> Batch | None:
        """The batch for `step` (every shard's share), or None if one did not come within
        `timeout_s` (ask again)."""
        parts = await asyncio.gather(*(f.get(step, version, through_step, committed_step,
                                             timeout_s) for f in self.feeds))
        if any(p is None for p in parts):
            for feed, part in zip(self.feeds, parts):
                if part is not None:
                    feed.have[step] = part
            return None
        return Batch(groups=[g for p in parts for g in p.groups],
                     version=max(p.version for p in parts), step=step,
                     redelivered=any(p.redelivered for p in parts))

    def close(self) -> None:
        for f in self.feeds:
            f.close()
