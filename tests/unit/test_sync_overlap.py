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
from types import SimpleNamespace

import pytest
import torch

from rollmesh.runtime.log import get_logger
from rollmesh.training.batching import from_groups
from rollmesh.wire.messages import Ok, Pause, Paused, SyncDone, SyncRequest
from rollmesh.training.weight_sender import WeightSender
from rollmesh.training.ranks import full_tensor
from rollmesh.sync.role import Synchronizer
from rollmesh.training.state import build_state
from rollmesh.training.step import prepare, update_policy
from rollmesh.wire.transport import RpcServer, free_port
from rollmesh.weight_sync.buckets import Snapshot, WeightSpec
from tests.engine.engine_harness import Engine
from tests.unit.test_trainer import experiment, make_groups


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

    async def engine_sessions(self) -> tuple[bool, int]:
        """(a weight-update session is open, updates the engine took outside one): SGLang 0.5.23
        refuses an update outside /begin_weight_update ... /end_weight_update."""
        info = (await asyncio.to_thread(self.engine.get, "/get_server_info"))[1]
        return info["weight_update_session_open"], info["weight_updates_outside_session"]


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


