"""Weight sync between real processes: trainer role, synchronizer role, built-in engine, and the
rollout side (MessageQueue, rollouter, agent and reward workers); and the bucket wire forms."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from rollmesh.models.loading import build_tiny
from rollmesh.wire.messages import Ok, Pause, Paused, SyncDone, SyncRequest
from rollmesh.wire.transport import free_port
from rollmesh.weight_sync.buckets import BucketSender, WeightSpec, announce, plan_buckets
from rollmesh.weight_sync.group import destroy_weight_update_group, init_weight_update_group
from tests.helpers.rollout_stack import ENV
from tests.unit.test_trainer import spawn_trainers

ROWS = [{"prompt": f"What is {a} plus {b}?", "label": str(a + b)}
        for a in range(4) for b in range(4)]


async def start_training(stack, exp, tmp_path):
    """A synchronizer and the trainer rank(s) beside a running rollout stack; returns the
    synchronizer's RPC address and the trainer children."""
    sup, spec = stack.sup, stack.mq.spec.config["experiment"]
    rollouter_rpc, mq_rpc = stack.rollouter.endpoints["rpc"], stack.mq.endpoints["rpc"]
    syncer = sup.spawn("synchronizer", "rollmesh.sync.role:main", env=ENV, config={
        "experiment": spec, "rollouter": rollouter_rpc, "message_queue": mq_rpc,
        "bind": f"tcp://127.0.0.1:{free_port()}"})
    sync_rpc = (await sup.wait_ready(syncer, 120))["rpc"]
    trainers = spawn_trainers(sup, exp, {
        "message_queue": mq_rpc, "synchronizer": sync_rpc, "engines": [stack.engine.url],
        "export_dir": str(tmp_path / "export"),
        "metrics_path": str(tmp_path / "metrics.jsonl")})
    return sync_rpc, trainers


RECEIVER = textwrap.dedent("""
    import json, os, sys
    from safetensors.torch import save_file
    from rollmesh.weight_sync.buckets import receive_bucket
    from rollmesh.weight_sync.group import destroy_weight_update_group, init_weight_update_group
    port, load_format, out = int(sys.argv[1]), sys.argv[2], sys.argv[4]
    buckets = json.loads(sys.argv[3])
    group = init_weight_update_group("127.0.0.1", port, 1, 2, "weight_update_group", "gloo", 60)
    got = {}
    for names, dtypes, shapes in buckets:
        received = receive_bucket(group, names, dtypes, shapes, load_format)
        got.update((n, t.clone()) for n, t in received)
    save_file(got, out)
    destroy_weight_update_group(group)
    # gloo's threads sometimes abort in interpreter teardown ("terminate called without an
    # active exception") after the work is done: leave without running it
    os._exit(0)
""")


def send_bucket(group, bucket, tensors, load_format="tensor", device="cpu", buffer=None) -> int:
    """Rank 0: broadcast the bucket's tensors (given in bucket order, any dtype: each is cast
    to its spec's dtype) and wait. Returns the bytes sent. `buffer`: a uint8 tensor to build
    flattened buckets in."""
    sender = BucketSender(group, load_format, device, slots=1,
                          buffers=[buffer] if buffer is not None else ())
    sent = sender.start(sender.pack(bucket, tensors))
    sender.wait()
    return sent


@pytest.mark.parametrize("load_format", ["tensor", "flattened_bucket"])
def test_buckets_arrive_whole_in_either_wire_form(tmp_path, load_format):
    model, _ = build_tiny("tiny")
    named = dict(model.named_parameters())
    # mixed dtypes in one bucket: the flattened form is raw bytes back to back
    specs = [WeightSpec(n, torch.bfloat16 if i % 3 == 0 else torch.float32, tuple(p.shape))
             for i, (n, p) in enumerate(named.items())]
    buckets = plan_buckets(specs, 300_000)
    assert len(buckets) > 2 and all(sum(s.nbytes for s in b) <= 300_000 or len(b) == 1
                                    for b in buckets)
    port = free_port()
    receiver = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, str(port), load_format,
         json.dumps([announce(b) for b in buckets]), str(tmp_path / "got.safetensors")],
        env={**os.environ, **ENV})
    try:
        group = init_weight_update_group("127.0.0.1", port, 0, 2, "weight_update_group", "gloo",
                                         60)
        sent = sum(send_bucket(group, b, (named[s.name] for s in b), load_format)
                   for b in buckets)
        assert receiver.wait(60) == 0
        destroy_weight_update_group(group)
    finally:
        receiver.kill()
    got = load_file(tmp_path / "got.safetensors")
    assert sent == sum(s.nbytes for s in specs)
    for s in specs:
        assert got[s.name].dtype == s.dtype
        assert torch.equal(got[s.name], named[s.name].detach().to(s.dtype))


class FakePeer:
    """Stands in for the rollouter's and the MessageQueue's RPC clients: records requests."""

    def __init__(self):
        self.requests: list = []

    async def request(self, rec, **kw):
        self.requests.append(rec)
        return Paused(in_flight=0, cancel_queue=3) if isinstance(rec, Pause) else Ok()


def synchronizer(timeout_s: float = 600.0):
    from types import SimpleNamespace

    from rollmesh.runtime.log import get_logger
    from rollmesh.sync.role import Synchronizer
    from tests.unit.test_trainer import experiment as trainer_experiment

    exp = trainer_experiment(f"sync.timeout_s={timeout_s}")
    rollouter, mq = FakePeer(), FakePeer()
    ctx = SimpleNamespace(log=get_logger("test"))
    return Synchronizer(ctx, exp, rollouter, mq), rollouter, mq


def test_a_failed_broadcast_resumes_rollout_at_the_old_version():
    async def body():
        s, rollouter, mq = synchronizer()
        go = await s.request(SyncRequest(version=1))
        assert go.version == 1 and go.cancel_queue == 3
        await s.done(SyncDone(version=1, ok=False, error="engine said no"))
        return s, rollouter, mq

    s, rollouter, mq = asyncio.run(body())
    assert [type(r).__name__ for r in rollouter.requests] == ["Pause", "Resume"]
    assert rollouter.requests[1].version == 0 and mq.requests == []  # nothing published
    assert s.version == 0 and s.stats()["failures"] == 1 and s.current is None


def test_a_trainer_that_never_reports_back_does_not_leave_rollout_paused():
    async def body():
        s, rollouter, mq = synchronizer(timeout_s=0.2)
        await s.request(SyncRequest(version=1))
        for _ in range(200):  # the watchdog gives the sync up after 0.2 s
            await asyncio.sleep(0.05)
            if s.current is None:
                break
        with pytest.raises(ValueError, match="in progress is none"):
            await s.done(SyncDone(version=1))
        go = await s.request(SyncRequest(version=1))  # the next try starts a new sync
        await s.done(SyncDone(version=1, broadcast_s=0.1, bytes=10))
        with pytest.raises(ValueError, match="not newer"):
            await s.request(SyncRequest(version=1))
        return s, rollouter, mq, go

    s, rollouter, mq, go = asyncio.run(body())
    assert [type(r).__name__ for r in rollouter.requests] == ["Pause", "Resume", "Pause", "Resume"]
    assert [r.version for r in mq.requests] == [1] and s.version == 1
    assert s.stats()["syncs"] == 1 and s.stats()["failures"] == 1


def test_a_restarted_synchronizer_finishes_the_sync_its_predecessor_started():
    """The synchronizer died after SyncGo; the trainer broadcast and reports to the new one,
    which never saw the request: it publishes the version and resumes rollout all the same,
    and a repeated report is answered as the first."""
    async def body():
        s, rollouter, mq = synchronizer()
        first = await s.done(SyncDone(version=3, broadcast_s=0.1, bytes=10))
        again = await s.done(SyncDone(version=3, broadcast_s=0.1, bytes=10))
        go = await s.request(SyncRequest(version=4))  # and the next sync goes as usual
        await s.done(SyncDone(version=4))
        return s, rollouter, mq, first, again, go

    s, rollouter, mq, first, again, go = asyncio.run(body())
    assert first.message == again.message == "version 3" and go.version == 4
    assert [r.version for r in mq.requests] == [3, 4] and s.version == 4
    assert [(type(r).__name__, getattr(r, "version", None)) for r in rollouter.requests] == [
        ("Resume", 3), ("Pause", None), ("Resume", 4)]


class VersionServer:
    """A real HTTP server answering /get_server_info with a weight_version the test sets (an
    engine as the synchronizer's check sees it); `version = None`: it does not answer (down)."""

    def __init__(self, version: str | None = "0"):
        self.version = version
        self.url = ""

    async def __aenter__(self):
        from aiohttp import web

        async def info(request):
            if self.version is None:
                raise web.HTTPServiceUnavailable()
            return web.json_response({"weight_version": self.version})

        app = web.Application()
        app.router.add_get("/get_server_info", info)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


def test_a_sync_is_not_ok_while_an_engine_serves_an_older_version():
    """An engine that restarted during the broadcast answers with the initial weights: the
    synchronizer refuses SyncDone(ok), keeps rollout paused and publishes nothing; the trainer
    reports the attempt failed, asks again (the group rebuilt: the launcher said an engine
    restarted) and, once every serving engine holds the version, it is published. An engine
    that does not answer is not serving and does not hold a sync back."""
    from rollmesh.engine.client import EngineClient

    async def body():
        async with VersionServer("0") as a, VersionServer("0") as b:
            async with EngineClient([a.url, b.url]) as engines:
                s, rollouter, mq = synchronizer()
                s.engines = engines
                go = await s.request(SyncRequest(version=1))
                assert not go.rebuild_group
                a.version = "1"  # b restarted mid-broadcast: it still says 0
                with pytest.raises(ValueError, match=f"{b.url} at version 0"):
                    await s.done(SyncDone(version=1, broadcast_s=0.1, bytes=10))
                assert s.current is not None and mq.requests == []  # still in progress
                s.engines_changed()  # the launcher's EnginesChanged for b
                await s.done(SyncDone(version=1, ok=False, error="b behind", retrying=True))
                assert [type(r).__name__ for r in rollouter.requests] == ["Pause"]  # paused
                again = await s.request(SyncRequest(version=1))
                assert again.rebuild_group  # b is not in the old group
                b.version = None  # b died again: not serving, not judged
                await s.done(SyncDone(version=1, broadcast_s=0.1, bytes=10))
                after = s.rebuild
                # a republish of the published version is accepted and rebuilds the group
                b.version = "0"
                rego = await s.request(SyncRequest(version=1, republish=True))
                b.version = "1"
                await s.done(SyncDone(version=1, broadcast_s=0.1, bytes=10))
                return s, rollouter, mq, after, rego

    s, rollouter, mq, after, rego = asyncio.run(body())
    assert not after  # the rebuilt group covers the restart the launcher announced
    assert rego.rebuild_group and s.version == 1
    assert [r.version for r in mq.requests] == [1, 1]
    assert [type(r).__name__ for r in rollouter.requests] == ["Pause", "Pause", "Resume", "Pause",
                                                              "Resume"]
    assert s.stats()["failures"] == 1 and s.stats()["syncs"] == 2


def test_an_engine_restart_announced_during_a_sync_is_not_forgotten():
    """EnginesChanged that arrives while a sync that rebuilds the group is in progress (its
    SyncGo was sent before the restart): the next sync still rebuilds the group."""
    async def body():
        s, rollouter, mq = synchronizer()
        s.engines_changed()
        go = await s.request(SyncRequest(version=1))
        s.engines_changed()  # a second restart, after SyncGo
        await s.done(SyncDone(version=1))
        return go, s.rebuild

    go, rebuild = asyncio.run(body())
    assert go.rebuild_group and rebuild


def test_a_restarted_engine_holds_rollout_until_it_has_the_current_weights():
    """EnginesChanged with the engine at version 0 while version 1 is published: rollout is
    paused (what it would generate is stale) until the engine holds version 1, then resumed;
    an engine that already holds the version (a sync's retry sent it) pauses nothing."""
    from rollmesh.engine.client import EngineClient

    async def body():
        async with VersionServer("1") as engine, EngineClient([engine.url]) as engines:
            s, rollouter, mq = synchronizer()
            s.engines = engines
            await s.request(SyncRequest(version=1))
            await s.done(SyncDone(version=1))
            s.hold()  # the engine holds version 1 already
            await s.holding
            before = list(rollouter.requests)
            engine.version = "0"  # restarted
            s.hold()
            while not any(isinstance(r, Pause) for r in rollouter.requests[len(before):]):
                await asyncio.sleep(0.05)
            engine.version = "1"  # the trainer re-published
            await asyncio.wait_for(s.holding, 10)
            return before, rollouter.requests[len(before):]

    before, held = asyncio.run(body())
    assert [type(r).__name__ for r in before] == ["Pause", "Resume"]  # the sync's own
    assert [type(r).__name__ for r in held] == ["Pause", "Resume"] and held[1].version == 1


def test_an_abandoned_in_place_sync_continues_the_engines():
    """In-place mode: the trainer paused the engines in place and never reported back (it
    died): when the synchronizer gives the sync up it continues the engines, which would
    otherwise hold their requests until a restarted trainer syncs."""
    from types import SimpleNamespace

    from aiohttp import web

    from rollmesh.engine.client import EngineClient
    from rollmesh.runtime.log import get_logger
    from rollmesh.sync.role import Synchronizer
    from tests.unit.test_trainer import experiment as trainer_experiment

    async def body():
        calls: list[str] = []

        async def record(request):
            calls.append(request.path)
            return web.json_response({"message": "ok", "status": "ok"})

        app = web.Application()
        app.router.add_post("/continue_generation", record)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        exp = trainer_experiment("sync.timeout_s=0.2", "sync.pause_mode=in_place")
        try:
            async with EngineClient([f"http://127.0.0.1:{port}"]) as engines:
                s = Synchronizer(SimpleNamespace(log=get_logger("test")), exp, FakePeer(),
                                 FakePeer(), engines=engines)
                await s.request(SyncRequest(version=1))
                for _ in range(200):  # the watchdog gives the sync up after 0.2 s
                    await asyncio.sleep(0.05)
                    if s.current is None:
                        break
                return calls, s.version
        finally:
            await runner.cleanup()

    calls, version = asyncio.run(body())
    assert calls == ["/continue_generation"] and version == 0
