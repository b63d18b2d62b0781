"""End-to-end tests of sync_overlap (they start processes); the unit tests and the
helpers they share are in tests/unit/test_sync_overlap.py."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
import torch

from rollmesh.engine.client import EngineError
from rollmesh.training.step import prepare, update_policy
from rollmesh.training.weight_sender import finish_sync, sync_weights
from rollmesh.wire.messages import Pause, WeightVersion
from rollmesh.wire.transport import Transport
from tests.engine.engine_harness import Engine
from tests.unit.test_sync_overlap import BF16, Peer, Rig, assert_same_bits
from tests.unit.test_sync_overlap import engine  # noqa: F401 - pytest fixtures


@pytest.mark.slow
def test_blocking_and_overlapped_syncs_land_bit_exact_in_the_engine(tmp_path, engine):
    """Blocking syncs, then overlapped ones, in either wire form, into one engine (bfloat16,
    from float32 master weights: every path casts): after each, every weight the engine holds
    equals, bit for bit, what the trainer sent under that version: its parameters (blocking),
    or the snapshot taken at the sync although the trainer has trained a step further since
    (overlapped); the engine never holds the trainer's newer weights."""

    async def body():
        with Transport() as t:
            async with Rig(tmp_path, t, engine, BF16) as rig:
                names = [n for n, _ in rig.state.model.named_parameters()]
                for version, load_format in ((1, "tensor"), (2, "flattened_bucket")):
                    rig.switch(load_format=load_format)  # blocking: sent when it returns
                    await rig.step()
                    sent = rig.weights()
                    timings = await sync_weights(rig.state, rig.publisher)
                    assert timings["published_version"] == version == rig.state.version
                    assert "sync_snapshot_s" not in timings
                    assert await rig.engine_version() == str(version)
                    assert_same_bits(await rig.engine_weights(names), sent)
                rows = []
                for version, load_format in ((3, "tensor"), (4, "flattened_bucket"),
                                             (5, "flattened_bucket")):
                    rig.switch(load_format=load_format, overlap=True)
                    if version == 3:  # later, the step after the last snapshot moved them
                        await rig.step()
                    sent = rig.weights()
                    rows.append(await sync_weights(rig.state, rig.publisher))
                    assert rig.state.version == version  # the trainer's: the snapshot's
                    assert_same_bits(rig.publisher.snapshot.tensors(), sent)
                    await rig.step()  # the trainer moves on, the snapshot does not
                    assert not all(torch.equal(a, b) for a, b in zip(sent.values(),
                                                                     rig.weights().values()))
                    await finish_sync(rig.state, rig.publisher)
                    assert await rig.engine_version() == str(version)
                    assert_same_bits(await rig.engine_weights(names), sent)
                rows.append(rig.publisher.take_finished())
                assert await rig.engine_sessions() == (False, 0)
                return rows, rig.sync.stats(), rig.mq.requests

    rows, stats, mq = asyncio.run(body())
    assert [r.get("published_version") for r in rows] == [3, 4, 5, None]
    assert [r.get("synced_version") for r in rows] == [None, 3, 4, 5]
    assert all(r["sync_idle_s"] == pytest.approx(r["sync_finish_s"] + r["sync_snapshot_s"])
               for r in rows[:3])
    assert all(r["sync_attempts"] == 1 and r["sync_bytes"] == rows[1]["sync_bytes"] > 0
               for r in rows[1:])
    assert stats["version"] == 5 and stats["syncs"] == 5 and stats["failures"] == 0
    assert [m.version for m in mq if isinstance(m, WeightVersion)] == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_the_trainer_computes_its_next_step_while_the_sync_is_in_flight(tmp_path, engine):
    """Overlapped: `sync_weights` returns with the sync of version 1 held before its broadcast
    (the rollouter answers Pause only once the trainer has begun its next step), the trainer
    computes that step while the sync pauses rollout, broadcasts and verifies, and the sync is
    still not done when the step ends (the queue takes the version only then). The engine then
    holds exactly the snapshot, not the parameters the step made meanwhile. (Blocking, the
    first `sync_weights` would wait for the held Pause: the test times out there.)"""

    async def body():
        loop = asyncio.get_running_loop()
        rollouter, mq = Peer(held=Pause), Peer(held=WeightVersion)
        with Transport() as t:
            async with Rig(tmp_path, t, engine, BF16, "sync.overlap=true",
                           'sync.load_format="flattened_bucket"', rollouter=rollouter,
                           mq=mq) as rig:
                before = await rig.engine_version()  # what an earlier test left
                await rig.step()
                sent = rig.weights()
                timings = await asyncio.wait_for(sync_weights(rig.state, rig.publisher), 60)
                events = [("sync_weights returned", loop.time())]
                await asyncio.wait_for(rollouter.arrived.wait(), 60)
                assert rig.publisher.pending() and rig.sync.current.version == 1
                assert rig.state.version == 1 and await rig.engine_version() == before

                started = threading.Event()

                def next_step() -> None:
                    started.set()
                    update_policy(rig.state, prepare(rig.state, rig.data))

                stepping = asyncio.create_task(asyncio.to_thread(next_step))
                await asyncio.to_thread(started.wait, 60)
                events.append(("step started", loop.time()))
                rollouter.release.set()  # the sync goes on: pause done, broadcast, verify
                await stepping
                events.append(("step done", loop.time()))
                in_flight = rig.publisher.pending() and rig.sync.version == 0
                mq.release.set()
                await asyncio.wait_for(finish_sync(rig.state, rig.publisher), 60)
                events.append(("sync done", loop.time()))
                return (timings, events, in_flight, sent, rig.weights(),
                        await rig.engine_weights(list(sent)), await rig.engine_version(),
                        rollouter.times, mq.times)

    timings, events, in_flight, sent, now, held, version, paused, published = asyncio.run(body())
    assert timings["published_version"] == 1 and "synced_version" not in timings
    assert in_flight  # the whole step ran with the sync in flight
    pause_answered = events[1][1]  # Pause was released right after the step had started
    assert [name for name, _ in paused] == ["Pause", "Resume"]
    assert [name for name, _ in published] == ["WeightVersion"]
    assert events[0][1] < paused[0][1] <= pause_answered < published[0][1]
    assert published[0][1] < paused[1][1]  # rollout resumed once the engine held version 1
    assert [n for n, _ in events] == ["sync_weights returned", "step started", "step done",
                                      "sync done"]
    assert version == "1"
    assert_same_bits(held, sent)
    assert not all(torch.equal(a, b) for a, b in zip(sent.values(), now.values()))


@pytest.mark.slow
def test_an_overlapped_sync_is_retried_and_its_failure_fails_the_next_sync(tmp_path):
    """Overlapped, the recovery paths of a blocking sync: the engine leaves the group after
    version 1 (as a restarted engine would), so the background broadcast of version 2 fails
    and is retried with the group rebuilt, from the same snapshot; then the engine dies, the
    background sync of version 3 fails (SyncDone not ok: nothing published), and the trainer's
    next sync raises that failure, as a blocking sync raises it."""
    engine = Engine(tmp_path / "engine.log", "--weight-version", "0", "--dtype", "float32")

    async def body():
        with Transport() as t:
            async with Rig(tmp_path, t, engine, "sync.overlap=true",
                           'sync.load_format="flattened_bucket"',
                           'sync.transport="broadcast"') as rig:  # the group's retry
                await rig.step()
                await sync_weights(rig.state, rig.publisher)
                await finish_sync(rig.state, rig.publisher)
                status, left = await asyncio.to_thread(
                    engine.post, "/destroy_weights_update_group",
                    {"group_name": "weight_update_group"})
                assert status == 200 and left["success"], left
                await rig.step()
                sent = rig.weights()
                await sync_weights(rig.state, rig.publisher)
                await rig.step()
                await finish_sync(rig.state, rig.publisher)
                retried = rig.publisher.take_finished()
                held = await rig.engine_weights(list(sent))

                engine.proc.kill()
                engine.proc.wait()
                # what is left to wait for: an engine to come back (none will)
                rig.publisher.sync = dataclasses.replace(rig.publisher.sync, timeout_s=2.0)
                await rig.step()
                await sync_weights(rig.state, rig.publisher)  # the snapshot of version 3
                await rig.step()
                with pytest.raises(EngineError, match="no engine answers /health"):
                    await sync_weights(rig.state, rig.publisher)
                return retried, sent, held, rig.sync.stats(), rig.rollouter.requests, \
                    rig.mq.requests, rig.state.version

    retried, sent, held, stats, rollouter, mq, version = asyncio.run(body())
    engine.stop()
    assert retried["synced_version"] == 2 and retried["sync_attempts"] == 2
    assert_same_bits(held, sent)
    assert [m.version for m in mq] == [1, 2]  # version 3 never published
    assert stats["version"] == 2 and stats["failures"] == 2
    # rollout stays paused (the failed attempt said a retry would follow) until the restarted
    # trainer re-publishes, as after a blocking sync that fails the same way
    assert [type(r).__name__ for r in rollouter][-2:] == ["Resume", "Pause"]
    assert version == 3
