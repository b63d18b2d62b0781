"""End-to-end tests of queue_hot_path (they start processes); the unit tests and the
helpers they share are in tests/unit/test_queue_hot_path.py."""

from __future__ import annotations

import asyncio
import collections

import pytest

from rollmesh.mq.client import BatchFeed, put_ready
from rollmesh.wire.messages import (
    BatchCredit,
    OpenBatchStream,
    PutGroups,
    PutGroupsReply,
    StatsRequest,
    StreamState,
    WeightVersion,
)
from rollmesh.wire.transport import PeerTimeout, RpcClient
from tests.unit.test_message_queue import (
    balance,
    group,
    ids,
    kill_and_respawn,
    stats,
)
from tests.unit.test_queue_hot_path import nothing_for, queue_and_clients, structlog_logger
from tests.unit.test_trainer import with_supervisor


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
        mq, address, producer = await queue_and_clients(  # max_staleness 1
            t, sup, tmp_path, overrides=("staleness.measure=oldest_token",))
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
