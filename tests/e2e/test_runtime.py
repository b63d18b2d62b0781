"""End-to-end tests of runtime (they start processes); the unit tests and the
helpers they share are in tests/unit/test_runtime.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import zmq

from rollmesh.launcher.supervisor import RoleFailed
from rollmesh.runtime.process import EXIT_FATAL
from rollmesh.wire.messages import Group, Hello, Metrics, Ok, Trajectory
from rollmesh.wire.protocol import PROTOCOL_VERSION, to_torch
from rollmesh.wire.transport import RemoteError, RpcClient
from tests.helpers.wire import Shutdown
from tests.helpers.wire_strategies import assert_same
from tests.unit.test_runtime import ENV, PARENT, ROOT, alive, with_supervisor


@pytest.mark.slow
def test_role_process_round_trips_large_and_bf16_records(tmp_path):
    async def body(t, sup):
        child = sup.spawn("echo", "tests.helpers.roles:echo", env=ENV)
        endpoints = await sup.wait_ready(child, 60)
        client = RpcClient(t, endpoints["rpc"], timeout_s=30)
        n = 4 << 20  # 16 MiB of int32 token ids in one array
        rng = np.random.default_rng(0)
        big = Trajectory(sample_id="s-000001", group_id="g-000001",
                         token_ids=rng.integers(0, 1 << 30, n, dtype=np.int32),
                         logprobs=rng.random(n, dtype=np.float32), versions=np.zeros(n, np.int32),
                         loss_mask=np.ones(n, np.uint8), prompt_len=0)
        assert big.token_ids.nbytes >= 16 << 20
        assert_same(big, await client.request(big))
        bf16 = torch.randn(64, 64).to(torch.bfloat16)
        small = Trajectory(sample_id="s-000002", group_id="g", token_ids=np.zeros(0, np.int32),
                           logprobs=bf16, versions=np.zeros(0, np.int32),
                           loss_mask=np.zeros(0, np.uint8), prompt_len=0)
        echoed = await client.request(Group(group_id="g", trajectories=[small]))
        assert echoed.trajectories[0].token_ids.shape == (0,)
        assert torch.equal(to_torch(echoed.trajectories[0].logprobs), bf16)
        client.close()

    with_supervisor(body, log_dir=tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "echo-0.log").read_text().splitlines()]
    assert lines and all(line["role"] == "echo" and line["host"] for line in lines)
    assert any(line["event"] == "ready" for line in lines)


@pytest.mark.slow
def test_live_role_survives_10000_garbage_messages():
    async def body(t, sup):
        child = sup.spawn("echo", "tests.helpers.roles:echo", env=ENV)
        endpoints = await sup.wait_ready(child, 60)
        raw = t.socket(zmq.DEALER, connect=endpoints["rpc"])
        rng = np.random.default_rng(1)
        kinds = [
            lambda: [rng.bytes(rng.integers(0, 40)) for _ in range(rng.integers(1, 6))],
            lambda: [b"c", b"Trajectory", rng.bytes(rng.integers(0, 60))],
            lambda: [b"c", b"Group", b"\xdd\xff\xff\xff\xff"],
            lambda: [b"c", b"Ok", b"\x81\xa3bad\xc0", b"extra"],
            lambda: [b"c" * 40, b"Ok", b"\x80"],
        ]
        replies = 0
        for batch in range(20):
            for _ in range(500):
                await raw.send_multipart(kinds[rng.integers(len(kinds))]())
            while await raw.poll(100):
                await raw.recv_multipart()
                replies += 1
        raw.close(0)
        client = RpcClient(t, endpoints["rpc"], timeout_s=10)
        stats = await client.request(Metrics(role="test", host="h", values={}))
        assert child.process.poll() is None
        client.close()
        return stats.values, replies

    stats, replies = with_supervisor(body)
    assert stats["protocol_errors"] == 10_000
    assert stats["requests"] == 10_001
    assert replies > 5_000  # every garbage message with a readable envelope was answered


@pytest.mark.slow
def test_fatal_error_is_reported_before_exit(tmp_path):
    async def body(t, sup):
        child = sup.spawn("crash", "tests.helpers.roles:crash", env=ENV)
        with pytest.raises(RoleFailed) as err:
            await sup.wait_ready(child, 60)
        assert child.process.wait(10) == EXIT_FATAL
        return str(err.value), child

    message, child = with_supervisor(body, log_dir=tmp_path)
    assert message == (f"crash/0 failed: RuntimeError: boom: the role could not start "
                       f"(log: {tmp_path / 'crash-0.log'})")
    assert child.state == "fatal" and "Traceback" in child.fatal.traceback


@pytest.mark.slow
def test_missing_entry_point_is_fatal_with_its_name():
    async def body(t, sup):
        child = sup.spawn("nope", "tests.helpers.roles:no_such_role", env=ENV)
        with pytest.raises(RoleFailed, match="no_such_role"):
            await sup.wait_ready(child, 60)

    with_supervisor(body)


@pytest.mark.slow
def test_sigterm_stops_gracefully_and_stubborn_roles_are_killed_at_the_deadline():
    async def body(t, sup):
        good = sup.spawn("echo", "tests.helpers.roles:echo", env=ENV)
        bad = sup.spawn("stubborn", "tests.helpers.roles:stubborn", env=ENV, grace_s=60)
        await sup.wait_ready(good, 60)
        await sup.wait_ready(bad, 60)
        start = time.monotonic()
        codes = await sup.stop_all(grace_s=1.5)
        return codes, time.monotonic() - start

    codes, took = with_supervisor(body)
    assert codes == {"echo/0": 0, "stubborn/0": -signal.SIGKILL}
    assert 1.4 < took < 5


@pytest.mark.slow
def test_shutdown_request_over_the_wire():
    async def body(t, sup):
        child = sup.spawn("echo", "tests.helpers.roles:echo", env=ENV)
        endpoints = await sup.wait_ready(child, 60)
        client = RpcClient(t, endpoints["rpc"])
        assert (await client.request(Shutdown(reason="test"))).message == "bye"
        client.close()
        for _ in range(100):
            if child.process.poll() is not None:
                break
            await asyncio.sleep(0.1)
        return child.process.poll()

    assert with_supervisor(body) == 0


@pytest.mark.slow
def test_silent_child_is_declared_dead_within_liveness_and_recovers():
    async def body(t, sup):
        child = sup.spawn("echo", "tests.helpers.roles:echo", env=ENV)
        await sup.wait_ready(child, 60)
        await asyncio.sleep(0.5)
        os.kill(child.process.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        while child.state != "silent" and time.monotonic() - stopped < 10:
            await asyncio.sleep(0.02)
        took = time.monotonic() - stopped
        os.kill(child.process.pid, signal.SIGCONT)
        for _ in range(100):
            if child.state == "ready":
                break
            await asyncio.sleep(0.05)
        return took, child.state

    took, state = with_supervisor(body, heartbeat_s=0.25, liveness=3)
    assert 0.4 < took < 0.75 + 0.5, took  # 3 x 0.25 s, plus the watcher's and a beat's slack
    assert state == "ready"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_role_exits_when_its_parent_dies_or_goes_silent(how, tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(ROOT), str(tmp_path)],
                              stdout=subprocess.PIPE,
                              text=True, env={**os.environ, **ENV})
    try:
        line = ""
        while not line.startswith("CHILD"):
            line = parent.stdout.readline()
            assert line, "the parent script ended before starting its role"
        child_pid = int(line.split()[1])
        assert alive(child_pid)
        os.kill(parent.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child_pid), f"role survived its parent ({how})"
        events = [json.loads(line) for line in (tmp_path / "echo-0.log").read_text().splitlines()]
        last = events[-1]
        assert last["event"] == "exit" and last["role"] == "echo", events[-4:]
        # killed: PDEATHSIG delivers SIGTERM at once; frozen: the unanswered heartbeats tell
        assert last["parent_lost"] is (how == "freeze")
        if how == "freeze":
            assert any(e["event"] == "peer_dead" for e in events)
    finally:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        try:
            os.kill(child_pid, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass


@pytest.mark.slow
def test_hello_with_another_protocol_version_is_refused():
    async def body(t, sup):
        client = RpcClient(t, sup.control, timeout_s=5)
        with pytest.raises(RemoteError) as err:
            await client.request(Hello(role="old", host="h", pid=1, protocol_version=PROTOCOL_VERSION + 1))
        ok = await client.request(Hello(role="new", host="h", pid=1))
        client.close()
        return err.value, ok

    err, ok = with_supervisor(body)
    assert err.code == "handler"
    assert f"protocol version {PROTOCOL_VERSION + 1}, parent speaks {PROTOCOL_VERSION}" in err.message
    assert isinstance(ok, Ok)
