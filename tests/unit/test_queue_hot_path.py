"""The MessageQueue's hot path (issue 16): several groups per put, the streamed hand-out.

In-process: PutGroups' accepted prefix, duplicates and one write for the lot; a group kept as
the frames it came in, written to the log and compacted without being encoded or checksummed
again. Real queue processes: the stream hands out each step's batch once, in step order, within
the consumer's credit and at its version; a consumer that drops mid-stream (or whose stream is
replaced) and the one that takes over from its checkpoint's next step get exactly the same
batches for the same steps, nothing counted twice; the rollouter's put loop and the trainer's
BatchFeed against a queue that is full, or killed and restarted."""

from __future__ import annotations

import asyncio
import collections

import numpy as np
import pytest

from rollmesh.runtime import durable_log
from rollmesh.wire import protocol
from rollmesh.runtime.durable_log import DurableLog
from rollmesh.mq.client import BatchFeed, next_put, put_ready
from rollmesh.mq.store import LOG_NAME, MessageQueue, decode_entry
from rollmesh.wire.messages import (
    Batch,
    Group,
    PutGroups,
    PutGroupsReply,
)
from rollmesh.wire.transport import PeerTimeout, RpcClient
from tests.unit.test_message_queue import (
    balance, group, ids, spawn_queue, stats,
)
from tests.unit.test_trainer import with_supervisor

# -- in-process ----------------------------------------------------------------------------------


def test_put_many_accepts_a_prefix_up_to_the_capacity_and_counts_duplicates_once(tmp_path):
    q = MessageQueue(5, 1, state_dir=tmp_path)
    assert q.put_many([group(0), group(1)]) == 2
    appended = q.journal.appended_records
    # g-00001 again (a retry) and twice in the same put: accepted, queued once
    assert q.put_many([group(1), group(2), group(2), group(3), group(4), group(5),
                       group(6)]) == 5
    assert q.journal.appended_records == appended + 3  # g2, g3, g4: one write for the lot
    s = q.stats()
    assert s["depth_groups"] == 5 and s["duplicate_puts"] == 2 and s["rejected_puts"] == 1
    assert balance(s) == 0
    assert q.put_many([group(5)]) == 0  # still full
    q.take(2, 0)
    assert q.put_many([group(5), group(6), group(7)]) == 2
    q.close()
    again = MessageQueue(5, 1, state_dir=tmp_path)
    assert ids(again.take(5, 0)) == ["g-00002", "g-00003", "g-00004", "g-00005", "g-00006"]
    again.close()


@pytest.mark.parametrize("spoil, why", [
    (lambda t: setattr(t, "versions", t.versions.astype(np.float32)), "versions is of float32"),
    (lambda t: setattr(t, "logprobs", t.logprobs[:-1]), "logprobs holds"),
    (lambda t: t.token_ids.__setitem__(0, -5), "token id -5 is negative"),
    (lambda t: setattr(t, "reward", float("nan")), "reward nan is not a finite number"),
    (lambda t: setattr(t, "prompt_len", 10**6), "prompt_len"),
])
def test_an_invalid_group_in_a_put_is_dropped_as_invalid_and_the_rest_queued(tmp_path, spoil, why):
    """A malformed group among good ones: counted as put and dropped, reason "invalid" (its
    place given back to its rollouter), never handed out; the good ones are queued; the queue
    balances, and all of it survives a reopen."""
    q = MessageQueue(10, 1, state_dir=tmp_path)
    bad = group(2)
    spoil(bad.trajectories[1])
    logs = []
    q.log = type("L", (), {"error": lambda self, ev, **kw: logs.append((ev, kw)),
                           "warning": lambda self, ev, **kw: logs.append((ev, kw))})()
    assert q.put_many([group(1), bad, group(3)]) == 3
    assert [(ev, kw["group"], kw["reason"]) for ev, kw in logs] == [
        ("group_refused", "g-00002", "invalid")]
    assert why in logs[0][1]["why"]
    for reopen in (False, True):
        if reopen:
            q.close()
            q = MessageQueue(10, 1, state_dir=tmp_path)
        s = q.stats()
        assert s["depth_groups"] == 2 and s["dropped"] == {"invalid": 2}
        assert s["put_samples"] == s["depth_samples"] + 2
        assert q.stale_by_origin == {"0": 2}
        assert q.put(bad)  # sent again: it counts once
        assert q.stats()["dropped"] == {"invalid": 2}
    assert [g.group_id for g in q.take(2, version=0)] == ["g-00001", "g-00003"]
    q.close()


def test_put_many_returns_once_its_groups_are_in_the_log_and_a_failed_write_queues_none(
        tmp_path, monkeypatch):
    import os

    from rollmesh.mq.store import QueueDiskError

    q = MessageQueue(10, 1, state_dir=tmp_path, fsync_interval_s=3600)
    assert q.put_many([group(0), group(1)]) == 2
    # acknowledged: in the file (the kernel) already, with no fsync and no close (a kill -9
    # of the queue now loses nothing): a replay of the file as it stands has both
    entries = [decode_entry(p) for p in DurableLog.open(tmp_path / LOG_NAME)[1]]
    assert [e[2].group_id for e in entries] == ["g-00000", "g-00001"]
    assert q.journal.fsyncs == 0
    size = (tmp_path / LOG_NAME).stat().st_size

    def full(fd, buffers):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "writev", full)
    with pytest.raises(QueueDiskError, match="cannot write its log .*No space left"):
        q.put_many([group(2), group(3)])
    s = q.stats()
    assert s["depth_groups"] == 2 and s["put_samples"] == 4 and s["log_error"] is not None
    assert (tmp_path / LOG_NAME).stat().st_size == size  # nothing of the failed put
    monkeypatch.undo()
    assert q.put_many([group(2), group(3)]) == 2  # the retry: queued once
    assert q.stats()["log_error"] is None and balance(q.stats()) == 0
    again = MessageQueue(10, 1, state_dir=tmp_path)  # as a restart would see the file
    assert ids(again.take(4, 0)) == [f"g-0000{i}" for i in range(4)]
    again.close()
    q.close()


def test_a_received_group_goes_to_the_log_and_out_again_as_the_frames_it_came_in(tmp_path):
    import zmq

    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://hot-path")
        b.connect("inproc://hot-path")
        a.send_multipart(protocol.encode(PutGroups(groups=[group(1), group(2)])), copy=False)
        received = b.recv_multipart(copy=False)
        put = protocol.decode(received)
        # the second group's frames: its type, its body, its 8 arrays, as received
        assert [id(f) for f in protocol.frames_of(put.groups[1])] == \
            [id(f) for f in received[12:22]]
        q = MessageQueue(10, 1, state_dir=tmp_path)
        assert q.put_many(put.groups) == 2
        out = protocol.encode(Batch(groups=q.take(2, 0), version=0))
        assert [id(f) for f in out[2:]] == [id(f) for f in received[2:]]
        q.close()
    finally:
        a.close(0)
        b.close(0)
        ctx.term()
    entries = [decode_entry(p) for p in DurableLog.open(tmp_path / LOG_NAME)[1]]
    assert [e[2].group_id for e in entries if e[0] == "put"] == ["g-00001", "g-00002"]
    assert entries[0][2].trajectories[1].token_ids.tolist() == \
        group(1).trajectories[1].token_ids.tolist()


def test_compaction_writes_the_kept_put_records_again_without_checksumming_them(
        tmp_path, monkeypatch):
    q = MessageQueue(100, 1, state_dir=tmp_path)
    assert q.put_many([group(i) for i in range(6)]) == 6
    q.take(2, 0, step=1)
    checksummed = []
    real_header = durable_log.header
    monkeypatch.setattr(durable_log, "header", lambda p: checksummed.append(p) or real_header(p))
    q.compact()
    # the take and the counters were encoded anew; the six puts were written as they were
    assert [decode_entry(p)[0] for p in checksummed] == ["take", "state"]
    monkeypatch.undo()
    q.put(group(6))
    before = q.stats()
    q.close()
    again = MessageQueue(100, 1, state_dir=tmp_path)  # every record whole (checksums right)
    assert again.journal.discarded_bytes == 0
    assert again.stats()["depth_groups"] == before["depth_groups"] == 5
    assert ids(again.redeliver(1).groups) == ["g-00000", "g-00001"]
    assert again.take(5, 0)[4].trajectories[0].token_ids.tolist() == \
        group(6).trajectories[0].token_ids.tolist()
    again.close()


def test_next_put_takes_the_oldest_ready_groups_within_its_limits():
    ready = collections.deque(group(i, tokens=100) for i in range(10))
    assert ids(next_put(ready, max_groups=4)) == ids(list(ready)[:4])
    one = 2 * 100 * 13  # two samples of 100 tokens, 13 bytes a token
    assert len(next_put(ready, max_bytes=3 * one)) == 3
    assert len(next_put(ready, max_frames=2 * 10)) == 2  # 2 + 4 x 2 frames a group
    assert len(next_put(ready, max_bytes=1)) == 1  # one at least


def test_put_ready_shares_what_is_ready_over_the_puts_it_may_have_out():
    """64 groups ready, two puts out at once: two puts of 32 (the queue writes one while the
    next comes in), not one of 64 and nothing for the other; one group: one put of one."""
    sent: list[list[str]] = []
    gate = asyncio.Event()

    class Queue:  # answers every put in full once the gate opens
        async def request(self, msg, timeout_s=None):
            sent.append(ids(msg.groups))
            await gate.wait()
            return PutGroupsReply(accepted=len(msg.groups), depth=0)

    async def body():
        ready = collections.deque(group(i, tokens=8) for i in range(64))
        wake, queued = asyncio.Event(), []
        putting = asyncio.create_task(put_ready(Queue(), ready, wake, queued.append,
                                                log=structlog_logger(), in_flight=2))
        for _ in range(50):
            await asyncio.sleep(0)
        first = list(sent)
        gate.set()
        for _ in range(100):
            if not ready:
                break
            await asyncio.sleep(0.01)
        ready.append(group(64, tokens=8))
        wake.set()
        for _ in range(100):
            if len(queued) == 65:
                break
            await asyncio.sleep(0.01)
        putting.cancel()
        return first, [g.group_id for g in queued]

    first, queued = asyncio.run(body())
    assert first == [[f"g-{i:05d}" for i in range(32)], [f"g-{i:05d}" for i in range(32, 64)]]
    assert sent[2:] == [["g-00064"]] and queued == [f"g-{i:05d}" for i in range(65)]


# -- the queue role: the stream ------------------------------------------------------------------


async def queue_and_clients(t, sup, tmp_path, n: int = 0, overrides: tuple[str, ...] = (),
                            **config):
    mq = spawn_queue(sup, tmp_path / "mq", overrides, **config)
    address = (await sup.wait_ready(mq, 60))["rpc"]
    producer = RpcClient(t, address, timeout_s=10, retries=3)
    if n:
        reply = await producer.request(PutGroups(groups=[group(i) for i in range(n)]))
        assert reply == PutGroupsReply(accepted=n, depth=n)
    return mq, address, producer


async def nothing_for(stream, seconds: float = 0.5) -> None:
    with pytest.raises(PeerTimeout):
        await stream.next(seconds)


# -- the rollouter's puts and the trainer's feed, against the real queue --------------------------


def test_put_ready_waits_while_the_queue_is_full_and_queues_every_group_once(tmp_path):
    async def body(t, sup):
        mq, address, producer = await queue_and_clients(t, sup, tmp_path, capacity_groups=4)
        ready = collections.deque(group(i) for i in range(10))
        wake, queued, fulls = asyncio.Event(), [], []
        putting = asyncio.create_task(put_ready(
            producer, ready, wake, queued.append, log=structlog_logger(),
            full=lambda: fulls.append(1), max_groups=3))
        consumer = RpcClient(t, address, timeout_s=10)
        feed = BatchFeed(consumer, groups=2)
        batches = [await feed.get(s, 0, s + 1, s - 1, timeout_s=10) for s in range(1, 6)]
        for _ in range(100):
            if not ready:
                break
            await asyncio.sleep(0.05)
        putting.cancel()
        end = await stats(producer)
        feed.close()
        consumer.close()
        producer.close()
        return batches, [g.group_id for g in queued], len(ready), len(fulls), end

    batches, queued, left, fulls, end = with_supervisor(tmp_path, body)
    assert sorted(queued) == [f"g-{i:05d}" for i in range(10)] and left == 0
    assert sorted(g for b in batches for g in ids(b.groups)) == sorted(queued)
    assert fulls >= 1 and end["rejected_puts"] >= 1 and end["duplicate_puts"] == 0
    assert (end["put_samples"], end["consumed_samples"]) == (20, 20) and balance(end) == 0


def structlog_logger():
    from rollmesh.runtime.log import get_logger

    return get_logger("test")


def test_a_nested_group_is_checked_as_strictly_as_any_record():
    frames = [bytes(memoryview(f).cast("B")) for f in protocol.encode(PutGroups(groups=[
        group(1)]))]
    assert isinstance(protocol.decode(frames).groups[0], Group)
    bad = list(frames)
    bad[5] = bad[5][:-4]  # the first array of the nested group, cut short
    with pytest.raises(protocol.ProtocolError,
                       match="nested record in frames 0..9: array frame 1 has 92 bytes"):
        protocol.decode(bad)


