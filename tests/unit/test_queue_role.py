"""The MessageQueue role's handlers, one at a time, without sockets (`rollmesh.mq.role.QueueRole`).

Each test builds a `QueueRole` around an in-memory `MessageQueue` and calls one handler as the
role's RPC server would (a request record and the peer's identity), then checks what it answered
and what it did to the queue."""

from __future__ import annotations

import asyncio

import pytest

from rollmesh.mq.role import QueueRole
from rollmesh.mq.store import MessageQueue
from rollmesh.runtime.log import get_logger
from rollmesh.wire.messages import (
    Batch,
    BatchCredit,
    Metrics,
    OpenBatchStream,
    PutGroups,
    PutGroupsReply,
    StatsRequest,
    StreamState,
    WeightVersion,
)
from tests.unit.test_message_queue import group, ids

PEER = b"peer-1"


def role(capacity: int = 4, max_staleness: int = 1, measure: str = "admission") -> QueueRole:
    return QueueRole(MessageQueue(capacity, max_staleness, measure=measure),
                     log=get_logger("test"), host="h")


def run(coro_fn, **kw):
    """Run `coro_fn(role)` on a fresh role in its own event loop; close the role after."""
    async def main():
        r = role(**kw)
        try:
            return r, await coro_fn(r)
        finally:
            r.close()
    return asyncio.run(main())


def test_put_groups_queues_what_fits_and_answers_how_many_and_the_depth():
    async def body(r: QueueRole):
        first = await r.put_groups(PutGroups(groups=[group(i) for i in range(3)]), PEER)
        second = await r.put_groups(PutGroups(groups=[group(i) for i in range(2, 6)]), PEER)
        return first, second

    r, (first, second) = run(body)
    assert isinstance(first, PutGroupsReply) and (first.accepted, first.depth) == (3, 3)
    # group 2 again (a retry: counted as accepted, not queued twice), 3 fits, 4 and 5 do not
    assert (second.accepted, second.depth) == (2, 4)
    assert [g.group_id for _, g in r.queue.queued.values()] == ids([group(i) for i in range(4)])
    assert r.queue.duplicate_puts == 1 and r.queue.rejected_puts == 1


def test_stats_answers_the_queues_counters_as_metrics():
    async def body(r: QueueRole):
        await r.put_groups(PutGroups(groups=[group(0), group(1)]), PEER)
        return await r.stats(StatsRequest(), PEER)

    r, reply = run(body)
    assert isinstance(reply, Metrics) and reply.role == "message_queue" and reply.host == "h"
    v = reply.values
    assert (v["depth_groups"], v["depth_samples"], v["put_samples"]) == (2, 4, 4)
    assert v["capacity_groups"] == 4 and v["protocol_errors"] == 0 and not v["durable"]


def test_weight_version_drops_the_groups_past_the_bound_and_put_replies_say_so():
    async def body(r: QueueRole):
        before = await r.put_groups(
            PutGroups(groups=[group(0, version=0), group(1, version=2)]), PEER)
        await r.version(WeightVersion(version=2), PEER)
        after = await r.put_groups(PutGroups(groups=[]), PEER)  # what the rollouter sends idle
        return before, after

    r, (before, after) = run(body, measure="oldest_token")
    assert r.queue.version == 2
    assert [g.group_id for _, g in r.queue.queued.values()] == ["g-00001"]
    assert r.queue.dropped["stale"] == 2  # the 2 samples of group 0 (2 - 0 > 1)
    assert before.dropped_stale == 0
    assert (after.accepted, after.depth, after.dropped_stale) == (0, 1, 2)
    assert r.queue.rejected_puts == 0  # an empty put is no back-pressure event


def test_under_the_admission_measure_a_new_version_drops_nothing():
    """The bound was applied at admission: a group whose tokens span more versions than
    max_staleness is kept (and counted in both ages when it is handed out)."""
    async def body(r: QueueRole):
        await r.put_groups(PutGroups(groups=[group(0, version=0), group(1, version=2)]), PEER)
        await r.version(WeightVersion(version=2), PEER)
        return await r.put_groups(PutGroups(groups=[]), PEER)

    r, after = run(body, measure="admission")
    assert [g.group_id for _, g in r.queue.queued.values()] == ["g-00000", "g-00001"]
    assert r.queue.dropped["stale"] == 0 and after.dropped_stale == 0


def test_the_stream_hands_out_a_step_once_it_has_the_groups_and_credit_moves_it_on():
    async def body(r: QueueRole):
        stream = await r.open_stream(OpenBatchStream(
            stream=7, groups=2, version=0, next_step=1, through_step=1), PEER)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        assert not first.done()  # nothing queued yet: it waits
        await r.put_groups(PutGroups(groups=[group(i) for i in range(4)]), PEER)
        one = await asyncio.wait_for(first, 5)
        state = await r.credit(BatchCredit(stream=7, version=0, through_step=2,
                                           committed_step=1), PEER)
        two = await asyncio.wait_for(stream.__anext__(), 5)
        other = await r.credit(BatchCredit(stream=8, version=0, through_step=3), PEER)
        await stream.aclose()
        return one, state, two, other

    r, (one, state, two, other) = run(body)
    assert isinstance(one, Batch) and (one.step, ids(one.groups)) == (1, ["g-00000", "g-00001"])
    assert state == StreamState(open=True, next_step=2)
    assert (two.step, ids(two.groups)) == (2, ["g-00002", "g-00003"])
    assert other == StreamState(open=False, next_step=0)  # not the open stream
    assert r.queue.committed_step == 1 and sorted(r.queue.pending) == [2]
    assert r.consumer is None  # the stream closed


def test_open_stream_refuses_a_batch_larger_than_the_capacity():
    async def body(r: QueueRole):
        with pytest.raises(ValueError, match="capacity"):
            await r.open_stream(OpenBatchStream(
                stream=1, groups=5, version=0, next_step=1, through_step=1), PEER)
        return None

    run(body)
