"""Weight syncs overlapped with training (`sync.overlap`), against the blocking ones.

The trainer's own code in this process (TrainState, `update_policy`, `WeightSender`,
`sync_weights`), the real synchronizer (`Synchronizer` served over RPC) and a real built-in
engine process; the rollouter and the MessageQueue, which the synchronizer only asks to pause,
resume and take a version, are recorders (`Peer`) that a test can hold up. After every sync the
engine's weights are read back (/get_weights_by_name) and compared bit for bit with what the
trainer sent: its parameters at the sync (blocking) or its snapshot (overlapped)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch

from rollmesh.engine.client import EngineError
from rollmesh.runtime.log import get_logger
from rollmesh.training.batching import from_groups
from rollmesh.wire.messages import Ok, Pause, Paused, SyncDone, SyncRequest, WeightVersion
from rollmesh.training.weight_sender import WeightSender, finish_sync, sync_weights
from rollmesh.training.ranks import full_tensor
from rollmesh.sync.role import Synchronizer
from rollmesh.training.state import build_state
from rollmesh.training.step import prepare, update_policy
from rollmesh.wire.transport import RpcServer, Transport, free_port
from rollmesh.weight_sync.buckets import Snapshot, WeightSpec
from tests.engine.engine_harness import Engine
from tests.test_trainer import experiment, make_groups


class Peer:
    """The rollouter's or the MessageQueue's RPC client as the synchronizer uses it: answers
    Pause with Paused and anything else with Ok, records each request with the loop's time, and
    answers a request of type `held` only once `release` is set."""

    def __init__(self, held: type | None = None):
        self.requests: list = []
        self.times: list[tuple[str, float]] = []
        self.held = held
        self.release = asyncio.Event()
        self.arrived = asyncio.Event()

    async def request(self, rec, **kw):
        self.requests.append(rec)
        self.times.append((type(rec).__name__, asyncio.get_running_loop().time()))
        if self.held is not None and isinstance(rec, self.held):
            self.arrived.set()
            await self.release.wait()
        return Paused(in_flight=0, cancel_queue=0) if isinstance(rec, Pause) else Ok()


class Rig:
    """A synchronizer (served over RPC), an engine, a trainer state and its publisher."""

    def __init__(self, tmp_path, transport, engine, *overrides, rollouter=None, mq=None):
        self.exp = experiment("sync.bucket_mb=0.05", "trainer.total_steps=100", *overrides)
        self.rollouter, self.mq = rollouter or Peer(), mq or Peer()
        self.sync = Synchronizer(SimpleNamespace(log=get_logger("test")), self.exp,
                                 self.rollouter, self.mq)
        self.server = RpcServer(transport, f"tcp://127.0.0.1:{free_port()}", {
            SyncRequest: lambda m, peer: self.sync.request(m),
            SyncDone: lambda m, peer: self.sync.done(m)}, name="synchronizer")
        self.serving = asyncio.create_task(self.server.serve())
        self.engine = engine
        self.state = build_state(self.exp)
        self.publisher = WeightSender(transport, {"engines": [engine.url],
                                               "synchronizer": self.server.address},
                                   self.exp.sync, torch.device("cpu"))
        # every step trains on it (the weights move); small, as steps are all it needs
        self.data = from_groups(make_groups(1, n_groups=1, size=2))

    async def __aenter__(self):
        await self.publisher.open()
        return self

    async def __aexit__(self, *exc):
        await self.publisher.close()
        self.publisher.reset_group()
        self.serving.cancel()
        self.server.close()

    async def step(self) -> None:
        """One trainer step (the trainer's own code, in a thread)."""
        await asyncio.to_thread(lambda: update_policy(self.state, prepare(self.state, self.data)))
        self.state.step += 1

    def switch(self, **sync: object) -> None:
        """The same run, its sync settings changed (the publisher reads them at each sync)."""
        self.state.exp = dataclasses.replace(
            self.state.exp, sync=dataclasses.replace(self.state.exp.sync, **sync))
        self.publisher.sync = self.state.exp.sync

    def weights(self) -> dict[str, torch.Tensor]:
        """The trainer's parameters now, as the engines receive them (the engines' dtype)."""
        return {n: full_tensor(p).detach().to(self.state.compute_dtype).clone()
                for n, p in self.state.model.named_parameters()}

    async def engine_weights(self, names) -> dict[str, torch.Tensor]:
        def read():
            out = {}
            for name in names:
                status, rows = self.engine.post("/get_weights_by_name",
                                                {"name": name, "truncate_size": 1 << 30})
                assert status == 200, rows
                out[name] = torch.tensor(rows, dtype=torch.float32)
            return out
        return await asyncio.to_thread(read)

    async def engine_version(self) -> str:
        return (await asyncio.to_thread(self.engine.get, "/get_model_info"))[1]["weight_version"]


def assert_same_bits(engine: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> None:
    assert engine.keys() == sent.keys()
    for name, tensor in sent.items():
        # the engine answers float32 numbers: exact for float32 and bfloat16 weights
        assert torch.equal(engine[name], tensor.float()), name


def test_a_snapshot_lays_the_tensors_out_as_the_flattened_buckets():
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.tensor([1.5, -2.25, 3.0])
    specs = [WeightSpec("a", torch.bfloat16, (2, 3)), WeightSpec("b", torch.float32, (3,))]
    snap = Snapshot(specs)
    snap.fill([a, b])
    a.add_(1)  # the snapshot is a copy: the parameters move on, it does not
    assert snap.nbytes == 6 * 2 + 3 * 4
    assert torch.equal(snap.tensor(0), (a - 1).to(torch.bfloat16)) and torch.equal(snap.tensor(1), b)
    assert torch.equal(snap.region(0, 2)[12:], b.view(torch.uint8))
    assert snap.fits(specs, "cpu") and not snap.fits(specs[:1], "cpu")
    with pytest.raises(ValueError, match="shape"):
        snap.put(1, torch.zeros(4))
    with pytest.raises(ValueError, match="1 tensors for a snapshot of 2"):
        snap.fill([a])


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One built-in engine in bfloat16 (trained in float32: every path casts). Each test's
    publisher builds its weight-update group anew, after dropping the one a test left."""
    e = Engine(tmp_path_factory.mktemp("engine") / "engine.log", "--weight-version", "0",
               "--dtype", "bfloat16")
    yield e
    assert e.stop() == 0, e.log()


BF16 = 'model.dtype="bfloat16"'


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
                           'sync.load_format="flattened_bucket"') as rig:
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
