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
    BatchCredit,
    Group,
    OpenBatchStream,
    PutGroups,
    PutGroupsReply,
    StatsRequest,
    StreamState,
    WeightVersion,
)
from rollmesh.wire.transport import PeerTimeout, RpcClient
from tests.test_message_queue import (
    balance, group, ids, kill_and_respawn, spawn_queue, stats,
)
from tests.test_trainer import with_supervisor

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


def test_a_malformed_group_in_a_put_changes_nothing(tmp_path):
    q = MessageQueue(10, 1, state_dir=tmp_path)
    bad = group(2)
    bad.trajectories[1].versions = bad.trajectories[1].versions.astype(np.float32)
    with pytest.raises(ValueError, match="g-00002.*versions of float32, expected integers"):
        q.put_many([group(1), bad])
    s = q.stats()
    assert s["depth_groups"] == 0 and s["put_samples"] == 0 and q.journal.appended_records == 0
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


async def queue_and_clients(t, sup, tmp_path, n: int = 0, **config):
    mq = spawn_queue(sup, tmp_path / "mq", **config)
    address = (await sup.wait_ready(mq, 60))["rpc"]
    producer = RpcClient(t, address, timeout_s=10, retries=3)
    if n:
        reply = await producer.request(PutGroups(groups=[group(i) for i in range(n)]))
        assert reply == PutGroupsReply(accepted=n, depth=n)
    return mq, address, producer


async def nothing_for(stream, seconds: float = 0.5) -> None:
    with pytest.raises(PeerTimeout):
        await stream.next(seconds)


@pytest.mark.slow
def test_a_stream_hands_out_each_step_once_in_order_within_its_credit(tmp_path):
    async def body(t, sup):
        mq, address, producer = await queue_and_clients(t, sup, tmp_path, n=6)
        trainer = RpcClient(t, address, timeout_s=10)
        stream = await trainer.stream(OpenBatchStream(
            stream=7, groups=2, version=0, next_step=1, through_step=2))
        got = [await stream.next(10), await stream.next(10)]
        await nothing_for(stream)  # no credit for step 3
        mid = await stats(producer)
        state = await trainer.request(BatchCredit(stream=7, version=0, through_step=4,
                                                  committed_step=1))
        assert state == StreamState(open=True, next_step=3)
        got.append(await stream.next(10))
        await nothing_for(stream)  # credit for step 4, but no group left: it waits for more
        await producer.request(PutGroups(groups=[group(6), group(7)]))
        got.append(await stream.next(10))
        # the credit is used up (through step 4, handed out): a checkpoint at step 3 is
        # committed all the same (the last step of a run has no hand-out to go with)
        await trainer.request(BatchCredit(stream=7, version=0, through_step=4,
                                          committed_step=3))
        for _ in range(100):
            end = await stats(producer)
            if end["committed_step"] == 3:
                break
            await asyncio.sleep(0.05)
        stream.close()
        trainer.close()
        producer.close()
        return got, mid, end

    got, mid, end = with_supervisor(tmp_path, body)
    assert [b.step for b in got] == [1, 2, 3, 4] and not any(b.redelivered for b in got)
    assert [ids(b.groups) for b in got] == [["g-00000", "g-00001"], ["g-00002", "g-00003"],
                                            ["g-00004", "g-00005"], ["g-00006", "g-00007"]]
    # step 3 was not taken before its credit came: the queue held its groups
    assert mid["consumed_samples"] == 8 and mid["depth_groups"] == 2
    assert mid["pending_batches"] == 2
    assert end["consumed_samples"] == 16 and end["committed_step"] == 3
    assert end["pending_batches"] == 1 and balance(end) == 0


@pytest.mark.slow
def test_a_consumer_that_drops_mid_stream_and_the_next_one_get_each_step_once(tmp_path):
    """The first trainer holds steps 1-3 (step 3 taken and on its way when it dies, with its
    checkpoint at step 1); the one that takes over opens at step 2: steps 2 and 3 again, the
    very same groups, then new ones; the queue counts each hand-out once."""
    async def body(t, sup):
        mq, address, producer = await queue_and_clients(t, sup, tmp_path, n=10)
        first = RpcClient(t, address, timeout_s=10)
        stream = await first.stream(OpenBatchStream(
            stream=1, groups=2, version=0, next_step=1, through_step=3))
        had = [await stream.next(10) for _ in range(2)]
        for _ in range(50):  # step 3 is taken too (its push may be lost with the consumer)
            if (await stats(producer))["pending_batches"] == 3:
                break
            await asyncio.sleep(0.05)
        first.close()  # gone mid-stream, without a word
        second = RpcClient(t, address, timeout_s=10)
        feed = BatchFeed(second, groups=2)
        again = [await feed.get(s, 0, min(s + 1, 5), committed_step=1, timeout_s=10)
                 for s in (2, 3, 4, 5)]
        end = await stats(producer)
        feed.close()
        second.close()
        producer.close()
        return had, again, end

    had, again, end = with_supervisor(tmp_path, body)
    assert [ids(b.groups) for b in had] == [["g-00000", "g-00001"], ["g-00002", "g-00003"]]
    assert [b.step for b in again] == [2, 3, 4, 5]
    assert ids(again[0].groups) == ids(had[1].groups) and again[0].redelivered
    assert ids(again[1].groups) == ["g-00004", "g-00005"] and again[1].redelivered
    assert [ids(b.groups) for b in again[2:]] == [["g-00006", "g-00007"],
                                                  ["g-00008", "g-00009"]]
    assert not again[2].redelivered and not again[3].redelivered
    # 10 groups of 2 put, 10 consumed once (steps 1-5), none twice, none left
    assert (end["put_samples"], end["consumed_samples"], end["depth_samples"]) == (20, 20, 0)
    assert end["redelivered_batches"] == 2 and balance(end) == 0


@pytest.mark.slow
def test_a_new_stream_replaces_the_open_one_and_credit_for_another_is_refused(tmp_path):
    async def body(t, sup):
        mq, address, producer = await queue_and_clients(t, sup, tmp_path, n=2)
        client = RpcClient(t, address, timeout_s=10)
        old = await client.stream(OpenBatchStream(stream=1, groups=2, version=0, next_step=1,
                                                  through_step=5))
        first = await old.next(10)
        new = await client.stream(OpenBatchStream(stream=2, groups=2, version=0, next_step=2,
                                                  through_step=5))
        await asyncio.sleep(0.3)
        refused = await client.request(BatchCredit(stream=1, version=0, through_step=9))
        await producer.request(PutGroups(groups=[group(2), group(3)]))
        second = await new.next(10)
        await nothing_for(old)  # the replaced stream hands out nothing more
        log = (tmp_path / "logs/message_queue-0.log").read_text()
        old.close()
        new.close()
        client.close()
        producer.close()
        return first, second, refused, log

    first, second, refused, log = with_supervisor(tmp_path, body)
    assert (first.step, second.step) == (1, 2)
    assert ids(second.groups) == ["g-00002", "g-00003"]
    assert refused == StreamState(open=False, next_step=0)
    assert '"event": "batch_stream_replaced"' in log


@pytest.mark.slow
def test_a_stream_checks_staleness_at_its_version_and_refuses_a_bad_request(tmp_path):
    async def body(t, sup):
        mq, address, producer = await queue_and_clients(t, sup, tmp_path)  # max_staleness 1
        await producer.request(PutGroups(groups=[group(0, version=0), group(1, version=1),
                                                 group(2, version=2)]))
        client = RpcClient(t, address, timeout_s=10)
        stream = await client.stream(OpenBatchStream(stream=1, groups=2, version=2,
                                                     next_step=1, through_step=1))
        batch = await stream.next(10)
        bad = await client.stream(OpenBatchStream(stream=2, groups=10**6, version=0,
                                                  next_step=1, through_step=1))
        with pytest.raises(Exception, match="groups must be in \\[1, 12\\]"):
            await bad.next(10)
        end = await stats(producer)
        stream.close()
        client.close()
        producer.close()
        return batch, end

    batch, end = with_supervisor(tmp_path, body)
    assert ids(batch.groups) == ["g-00001", "g-00002"] and batch.version == 2
    assert end["dropped"] == {"stale": 2} and end["staleness_hist"] == {"0": 2, "1": 2}


# -- the rollouter's puts and the trainer's feed, against the real queue --------------------------


@pytest.mark.slow
def test_put_ready_with_nothing_to_put_still_hears_the_queues_stale_drops_and_its_silence():
    """Idle, the put loop sends an empty put every `idle_s`: `heard` gets each reply (the
    queue's stale drops); a put unanswered for `leash_s` calls `unheard`."""
    puts: list[int] = []
    answer = asyncio.Event()
    answer.set()

    class Queue:
        async def request(self, msg, timeout_s=None, retries=None):
            puts.append(len(msg.groups))
            if not answer.is_set():
                await asyncio.sleep(timeout_s)
                raise PeerTimeout("no answer")
            return PutGroupsReply(accepted=len(msg.groups), depth=0, dropped_stale=4 * len(puts))

    async def body():
        heard, unheard = [], []
        putting = asyncio.create_task(put_ready(
            Queue(), collections.deque(), asyncio.Event(), lambda g: None,
            log=structlog_logger(), heard=lambda r: heard.append(r.dropped_stale),
            unheard=lambda: unheard.append(len(puts)), idle_s=0.05, leash_s=0.1))
        while len(heard) < 3:
            await asyncio.sleep(0.01)
        answer.clear()
        while not unheard:
            await asyncio.sleep(0.01)
        putting.cancel()
        return heard, unheard

    heard, unheard = asyncio.run(asyncio.wait_for(body(), 10))
    assert heard[:3] == [4, 8, 12] and set(puts) == {0}
    assert unheard and unheard[0] == len(heard) + 1


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


@pytest.mark.slow
def test_the_feed_gets_the_same_batches_across_a_killed_queue(tmp_path):
    async def body(t, sup):
        mq, address, producer = await queue_and_clients(t, sup, tmp_path, n=8)
        trainer = RpcClient(t, address, timeout_s=5)
        feed = BatchFeed(trainer, groups=2)
        first = [await feed.get(s, 0, s + 1, committed_step=0, timeout_s=10) for s in (1, 2)]
        # step 3 is taken too (credit through 3) and on its way or here: the queue dies
        mq = await kill_and_respawn(sup, mq)
        got = []
        for s in (3, 4):
            batch = None
            for _ in range(20):  # the feed asks again (a new stream) until the queue answers
                batch = await feed.get(s, 0, s + 1, committed_step=2, timeout_s=2)
                if batch is not None:
                    break
            got.append(batch)
        end = await stats(producer)
        feed.close()
        trainer.close()
        producer.close()
        return first, got, end

    first, got, end = with_supervisor(tmp_path, body)
    assert [ids(b.groups) for b in first + got] == [
        ["g-00000", "g-00001"], ["g-00002", "g-00003"], ["g-00004", "g-00005"],
        ["g-00006", "g-00007"]]
    assert (end["put_samples"], end["consumed_samples"]) == (16, 16) and balance(end) == 0
    assert end["committed_step"] == 2


def structlog_logger():
    from rollmesh.runtime.log import get_logger

    return get_logger("test")


@pytest.mark.slow
def test_the_status_and_stats_of_a_streaming_queue(tmp_path):
    async def body(t, sup):
        mq, address, producer = await queue_and_clients(t, sup, tmp_path, n=4)
        await producer.request(WeightVersion(version=1))
        s = (await producer.request(StatsRequest())).values
        producer.close()
        return s

    s = with_supervisor(tmp_path, body)
    assert s["depth_groups"] == 4 and s["version"] == 1 and s["durable"] is True


def test_a_nested_group_is_checked_as_strictly_as_any_record():
    frames = [bytes(memoryview(f).cast("B")) for f in protocol.encode(PutGroups(groups=[
        group(1)]))]
    assert isinstance(protocol.decode(frames).groups[0], Group)
    bad = list(frames)
    bad[5] = bad[5][:-4]  # the first array of the nested group, cut short
    with pytest.raises(protocol.ProtocolError,
                       match="nested record in frames 0..9: array frame 1 has 92 bytes"):
        protocol.decode(bad)


@pytest.mark.slow
def test_the_feed_opens_a_new_stream_when_a_pushed_batch_never_came(tmp_path):
    async def body(t, sup):
        mq, address, producer = await queue_and_clients(t, sup, tmp_path, n=4)
        client = RpcClient(t, address, timeout_s=10)
        feed = BatchFeed(client, groups=2)
        first = await feed.get(1, 0, 1, committed_step=0, timeout_s=10)
        feed.stream.close()  # what the queue sends on it from now on is lost on the way
        lost = await feed.get(2, 0, 2, committed_step=0, timeout_s=1)
        again = await feed.get(2, 0, 2, committed_step=0, timeout_s=10)  # asks, then anew
        end = await stats(producer)
        opened = feed.opened
        feed.close()
        client.close()
        producer.close()
        return first, lost, again, opened, end

    first, lost, again, opened, end = with_supervisor(tmp_path, body)
    assert ids(first.groups) == ["g-00000", "g-00001"] and lost is None
    assert ids(again.groups) == ["g-00002", "g-00003"] and again.redelivered and opened == 2
    assert end["consumed_samples"] == 8 and end["redelivered_batches"] == 1
