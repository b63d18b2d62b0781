"""Hostile input against every kind of socket a role binds, on real role processes.

Started once for the module (real processes, through the role runtime): the built-in engine
(HTTP), the MessageQueue (RpcServer/ROUTER), the rollouter (its worker Channel/ROUTER and its
control RpcServer), the synchronizer (RpcServer), a reward worker and an agent worker (DEALERs
on a channel this test binds, so the test plays a hostile rollouter), and a status hub
(StatusProxy, the launcher's XSUB/XPUB) that the roles publish their Metrics to. A PULL socket
(Puller) is fuzzed in-process: no role binds one.

Hypothesis throws at each: random frames, truncated and extra array frames, huge declared
shapes and sizes, wrong field types, unknown record types, msgpack length bombs, and valid
records out of order (Resume before Pause, SyncDone without SyncRequest, OpenBatchStream and
BatchCredit with absurd sizes). After each barrage the role is alive, answers a valid request correctly, its protocol
error counter went up (its stats, the Metrics it publishes, or its log), and its resident
memory (VmRSS) stays under a bound. The engine's HTTP gets malformed JSON, wrong types, huge and
negative values, unknown routes and an oversized body: each a 4xx with a message, and the
engine still generates. A summary line gives the inputs tried.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollmesh.config import to_dict
from rollmesh.wire.protocol import RECORDS, ProtocolError, decode, encode
from rollmesh.wire.messages import (
    BatchCredit,
    Cancel,
    Heartbeat,
    Metrics,
    Ok,
    OpenBatchStream,
    Pause,
    Paused,
    Resume,
    Score,
    Scored,
    StatsRequest,
    StreamState,
    SyncDone,
    SyncRequest,
    Trajectory,
    WeightVersion,
    WorkerHello,
)
from rollmesh.launcher.supervisor import Supervisor
from rollmesh.wire.transport import Transport, free_port
from rollmesh.wire.channels import StatusProxy, Subscriber
from tests.engine.engine_harness import Engine
from tests.helpers.rollout_stack import ENV, experiment, write_dataset
from tests.helpers.wire import Puller, Pusher
from tests.helpers.wire_strategies import any_record

pytestmark = pytest.mark.slow

RSS_BOUND_MB = {"role": 600, "growth": 150, "engine": 2500}
TRIED: collections.Counter[str] = collections.Counter()
RSS: dict[str, tuple[float, float]] = {}

FUZZ = settings(max_examples=120, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


# -- hostile frames ------------------------------------------------------------------------------

NAMES = sorted(RECORDS)
_plain = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
                      | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
                      lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                          max_size=3),
                      max_leaves=8)


def _ext(index: Any, dtype: Any, shape: Any) -> msgpack.ExtType:
    return msgpack.ExtType(1, msgpack.packb([index, dtype, shape]))


@st.composite
def huge_array(draw: Any) -> list[bytes]:
    """A Trajectory whose arrays declare absurd shapes, dtypes or frames."""
    shape = draw(st.lists(st.integers(-(2**63), 2**64 - 1), max_size=40)
                 | st.just([2**31, 2**31]) | st.just([2**62]) | st.just([-1]) | st.just([0] * 33))
    dtype = draw(st.sampled_from(["float32", "int32", "object", "O", "V8", "<f8", "float128",
                                  "U10", 7, None]))
    index = draw(st.sampled_from([0, 1, -1, 2**40, "0", None]))
    body = {"sample_id": "s", "group_id": "g", "token_ids": _ext(index, dtype, shape),
            "logprobs": _ext(1, "float32", [1]), "versions": _ext(2, "int32", [1]),
            "loss_mask": _ext(3, "uint8", [1]), "prompt_len": 1}
    frames = [b"Trajectory", msgpack.packb(body)]
    frames += draw(st.lists(st.binary(max_size=16), max_size=5))
    return frames


@st.composite
def mutated_record(draw: Any) -> list[bytes]:
    """A valid record's frames, then broken: truncated/extra/missing array frames, a swapped
    type name, a cut body."""
    frames = [bytes(memoryview(f).cast("B")) for f in encode(draw(any_record))]
    how = draw(st.sampled_from(["truncate_array", "extra_frame", "drop_frame", "rename", "cut_body",
                                "flip_byte"]))
    if how == "truncate_array" and len(frames) > 2:
        i = draw(st.integers(2, len(frames) - 1))
        frames[i] = frames[i][: max(0, len(frames[i]) - draw(st.integers(1, 8)))] or b"\x00"
    elif how == "extra_frame":
        frames.append(draw(st.binary(max_size=32)))
    elif how == "drop_frame":
        frames.pop(draw(st.integers(1, len(frames) - 1)))
    elif how == "rename":  # another record's name (its own would leave the record valid)
        frames[0] = draw(st.sampled_from([n for n in NAMES if n.encode() != frames[0]])).encode()
    elif how == "cut_body":
        frames[1] = frames[1][: draw(st.integers(0, max(0, len(frames[1]) - 1)))]
    else:
        body = bytearray(frames[1])
        if body:
            i = draw(st.integers(0, len(body) - 1))
            body[i] ^= draw(st.integers(1, 255))
        frames[1] = bytes(body)
    return frames


@st.composite
def wrong_types(draw: Any) -> list[bytes]:
    name = draw(st.sampled_from(NAMES))
    fields = list(RECORDS[name].__dataclass_fields__)
    # a record without fields (StatsRequest): newer hypothesis refuses sampled_from([])
    chosen = draw(st.lists(st.sampled_from(fields), unique=True)) if fields else []
    body = {f: draw(_plain) for f in chosen}
    if draw(st.booleans()):
        body[draw(st.text(max_size=6))] = draw(_plain)  # an extra field, maybe
    return [name.encode(), msgpack.packb(body, use_bin_type=True)]


BOMBS = [b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",
         b"\xdb\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01", b"\x91" * 100_000,
         b"\x81\xa1a" * 10_000 + b"\xc0"]

hostile = st.one_of(
    st.lists(st.binary(max_size=64), min_size=1, max_size=6),  # random frames
    st.tuples(st.sampled_from(NAMES).map(str.encode), st.binary(max_size=64)).map(list),
    st.tuples(st.binary(min_size=1, max_size=80).filter(lambda b: b.decode("latin-1") not in RECORDS),
              st.just(msgpack.packb({}))).map(list),  # unknown types
    st.tuples(st.sampled_from(NAMES).map(str.encode), st.sampled_from(BOMBS)).map(list),
    wrong_types(), mutated_record(), huge_array(),
)
rpc_hostile = st.tuples(st.binary(max_size=20), hostile).map(lambda t: [t[0], *t[1]])

# Sent once to each socket as well: more frames than allowed, a body over the body limit.
BIG = [[b"Heartbeat", msgpack.packb({"sender": "x", "seq": 1})] + [b""] * 5000,
       [b"Trajectory", b"\xc6" + (17 << 20).to_bytes(4, "big") + b"\x00" * (17 << 20)]]


# -- the processes ----------------------------------------------------------------------------------


class Loop:
    """An event loop in a thread: the supervisor and the hub live there for the module."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 180) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Run:
    """The fuzzed run: its processes and their addresses (set by the fixture below)."""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    r = Run()
    r.tmp = tmp
    r.ctx = zmq.Context()
    loop = r.loop = Loop()
    rows = [{"prompt": f"q{i}", "label": "a"} for i in range(50)]
    exp = experiment(write_dataset(tmp / "data.jsonl", rows), "rollout.max_concurrent=2")
    spec = to_dict(exp)
    r.engine = Engine(tmp / "engine.log", "--weight-version", "0")

    async def start():
        r.t = Transport()
        r.hub = StatusProxy(r.t, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
        sup = r.sup = Supervisor(r.t, heartbeat_s=1.0, liveness=10, log_dir=tmp / "logs",
                                 status_hub=r.hub.frontend)
        r.mq = sup.spawn("message_queue", "rollmesh.mq.role:main", env=ENV,
                         config={"experiment": spec, "bind": f"tcp://127.0.0.1:{free_port()}"})
        r.channel = f"tcp://127.0.0.1:{free_port()}"  # the test's own (hostile) rollouter
        r.reward = sup.spawn("reward_worker", "rollmesh.rewards.role:main", env=ENV,
                             config={"experiment": spec, "rollouter": r.channel, "pool": 1})
        r.agent = sup.spawn("agent_worker", "rollmesh.agents.role:main", env=ENV,
                            config={"experiment": spec, "rollouter": r.channel,
                                    "engines": [r.engine.url], "credits": 4})
        r.mq_rpc = (await sup.wait_ready(r.mq, 120))["rpc"]
        r.rollouter = sup.spawn("rollouter", "rollmesh.rollout.role:main", env=ENV, config={
            "experiment": spec, "bind": f"tcp://127.0.0.1:{free_port()}",
            "control": f"tcp://127.0.0.1:{free_port()}", "message_queue": r.mq_rpc})
        eps = await sup.wait_ready(r.rollouter, 120)
        r.r_channel, r.r_rpc = eps["channel"], eps["rpc"]
        r.sync = sup.spawn("synchronizer", "rollmesh.sync.role:main", env=ENV, config={
            "experiment": spec, "bind": f"tcp://127.0.0.1:{free_port()}",
            "rollouter": r.r_rpc, "message_queue": r.mq_rpc})
        r.sync_rpc = (await sup.wait_ready(r.sync, 120))["rpc"]

    # The workers connect to a channel nobody serves yet: bind it before they need it.
    r.worker_channel = None
    try:
        loop.run(start())
        r.worker_channel = r.ctx.socket(zmq.ROUTER)
        r.worker_channel.setsockopt(zmq.ROUTER_HANDOVER, 1)
        r.worker_channel.bind(r.channel)
        r.workers = hello_from_workers(r)
        for c in (r.reward, r.agent):
            loop.run(r.sup.wait_ready(c, 120))
        yield r
    finally:
        if r.worker_channel is not None:
            r.worker_channel.close(0)
        if hasattr(r, "sup"):
            loop.run(r.sup.close(grace_s=5), timeout=60)
            r.hub.close()
            r.t.close()
        loop.stop()
        r.engine.stop()
        r.ctx.destroy(0)
        print(f"\nfuzz summary: inputs tried {sum(TRIED.values())} "
              + " ".join(f"{k}={v}" for k, v in sorted(TRIED.items())))
        print("fuzz memory (VmRSS MB before -> after): " + ", ".join(
            f"{k} {a:.0f}->{b:.0f}" for k, (a, b) in sorted(RSS.items())))


def hello_from_workers(r: Run) -> dict[str, bytes]:
    """Each worker's WorkerHello on the test's channel: kind -> the worker's peer id."""
    peers: dict[str, bytes] = {}
    deadline = time.monotonic() + 120
    while len(peers) < 2 and time.monotonic() < deadline:
        if r.worker_channel.poll(500):
            frames = r.worker_channel.recv_multipart()
            try:
                msg = decode(frames[1:])
            except ProtocolError:
                continue
            if isinstance(msg, WorkerHello):
                peers[msg.kind] = frames[0]
    assert set(peers) == {"agent", "reward"}, peers
    return peers


# -- helpers ------------------------------------------------------------------------------------


def rpc(r: Run, address: str, rec: Any, timeout_s: float = 30) -> Any:
    """One request over the wire, the way RpcClient frames it."""
    sock = r.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart([b"\x00" * 7 + b"\x01", *encode(rec)])
        assert sock.poll(int(timeout_s * 1000)), f"no reply from {address} to {rec}"
        frames = sock.recv_multipart()
        assert frames[0] == b"\x00" * 7 + b"\x01"
        return decode(frames[1:])
    finally:
        sock.close(0)


def barrage(name: str, sock: zmq.Socket, strategy: Any, *, examples: int = 120,
            prefix: list[bytes] | None = None, drain: zmq.Socket | None = None) -> None:
    """Send hypothesis' hostile messages (and BIG) on `sock`, draining replies as they come."""

    def send(frames: list[bytes]) -> None:
        sock.send_multipart([*(prefix or []), *frames], copy=False)
        TRIED[name] += 1
        while drain is not None and drain.poll(0):
            drain.recv_multipart()

    @settings(FUZZ, max_examples=examples)
    @given(frames=strategy)
    def throw(frames: list[bytes]) -> None:
        send(frames)

    throw()
    for frames in BIG:
        send(frames if prefix is not None or sock.socket_type != zmq.DEALER
             else [b"corr", *frames])
    time.sleep(0.3)
    while drain is not None and drain.poll(200):
        drain.recv_multipart()


def logged_protocol_errors(r: Run, child: Any) -> int:
    """The role's own count of protocol errors, from its log (logged at 1, 2, 4, 8, ...)."""
    best = 0
    for line in child.log_path.read_text().splitlines():
        if '"protocol_error"' in line:
            try:
                best = max(best, int(json.loads(line).get("count", 0)))
            except ValueError:
                pass
    return best


def published(r: Run, topic: str, timeout_s: float = 15) -> dict[str, Any]:
    """The next Metrics a role publishes to the hub (what the monitor sees)."""
    sub = r.ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sub.connect(r.hub.backend)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sub.poll(500):
                frames = sub.recv_multipart()
                return decode(frames[1:], Metrics).values
        raise AssertionError(f"no Metrics on {topic} within {timeout_s}s")
    finally:
        sub.close(0)


def check_alive_and_small(r: Run, label: str, child: Any, before: float) -> None:
    assert child.process.poll() is None, f"{label} died: {child.log_path.read_text()[-3000:]}"
    after = rss_mb(child.process.pid)
    RSS[label] = (before, after)
    assert after < RSS_BOUND_MB["role"], (label, after)
    assert after - before < RSS_BOUND_MB["growth"], (label, before, after)


def rpc_socket(r: Run, address: str) -> zmq.Socket:
    sock = r.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 5000)
    sock.connect(address)
    return sock


# -- the RpcServers ---------------------------------------------------------------------------------


def test_message_queue_rpc(run):
    r = run
    pid = r.mq.process.pid
    before_rss = rss_mb(pid)
    before = rpc(r, r.mq_rpc, StatsRequest()).values["protocol_errors"]
    sock = rpc_socket(r, r.mq_rpc)
    barrage("message_queue", sock, rpc_hostile, examples=150, prefix=[], drain=sock)
    # Valid records with absurd values: credit for a stream the queue does not have, a batch
    # bigger than any queue, negative sizes and steps.
    reply = rpc(r, r.mq_rpc, BatchCredit(stream=2**62, version=0, through_step=2**62))
    assert reply == StreamState(open=False, next_step=0), reply
    for rec in (OpenBatchStream(stream=1, groups=2**62, version=0, next_step=1, through_step=1),
                OpenBatchStream(stream=-1, groups=-5, version=-(2**63), next_step=-(2**63),
                                through_step=-1, committed_step=-1)):
        reply = rpc(r, r.mq_rpc, rec)
        # Refused by the handler with the reason (an ErrorReply), the queue untouched.
        assert getattr(reply, "code", "") == "handler", reply
        assert "groups must be in [1, " in reply.message, reply
    reply = rpc(r, r.mq_rpc, BatchCredit(stream=1, version=-(2**63), through_step=-5,
                                         committed_step=-(2**63)))
    assert getattr(reply, "code", "") == "handler", reply
    assert "steps must be >= 0" in reply.message, reply
    TRIED["message_queue"] += 4
    sock.close(0)
    stats = rpc(r, r.mq_rpc, StatsRequest()).values
    assert stats["protocol_errors"] > before + 100, stats["protocol_errors"]
    assert stats["version"] == 0 and stats["depth_groups"] == 0
    check_alive_and_small(r, "message_queue", r.mq, before_rss)


def test_synchronizer_rpc_and_out_of_order_records(run):
    r = run
    before_rss = rss_mb(r.sync.process.pid)
    sock = rpc_socket(r, r.sync_rpc)
    barrage("synchronizer", sock, rpc_hostile, examples=120, prefix=[], drain=sock)
    sock.close(0)
    # Out of order: SyncDone with no sync in progress, a SyncRequest for an old version.
    # (a SyncDone for a newer version with none in progress is adopted, not refused: a
    # restarted synchronizer finishes the sync its predecessor started; tests/unit/test_sync.py)
    for rec in (SyncDone(version=-1), SyncDone(version=0, ok=False), SyncRequest(version=0),
                SyncDone(version=-(2**63)), SyncRequest(version=-(2**63))):
        reply = rpc(r, r.sync_rpc, rec)
        assert reply.__class__.__name__ == "ErrorReply" and reply.code == "handler", reply
        TRIED["synchronizer"] += 1
    stats = rpc(r, r.sync_rpc, StatsRequest()).values
    assert stats["version"] == 0 and stats["in_progress"] is None and stats["syncs"] == 0
    assert logged_protocol_errors(r, r.sync) >= 64
    check_alive_and_small(r, "synchronizer", r.sync, before_rss)


def test_rollouter_control_rpc_and_out_of_order_records(run):
    r = run
    before_rss = rss_mb(r.rollouter.process.pid)
    before = rpc(r, r.r_rpc, StatsRequest()).values["protocol_errors"]
    sock = rpc_socket(r, r.r_rpc)
    barrage("rollouter_rpc", sock, rpc_hostile, examples=120, prefix=[], drain=sock)
    sock.close(0)
    # Resume before any Pause, twice, at the version it already has; then a real pause/resume.
    assert isinstance(rpc(r, r.r_rpc, Resume(version=0)), Ok)
    assert isinstance(rpc(r, r.r_rpc, Resume(version=-5)), Ok)
    paused = rpc(r, r.r_rpc, Pause(mode="no-such-mode"))
    assert isinstance(paused, Paused) and paused.in_flight == 0
    assert isinstance(rpc(r, r.r_rpc, Pause(mode="abort")), Paused)  # paused twice
    assert isinstance(rpc(r, r.r_rpc, Resume(version=0)), Ok)
    TRIED["rollouter_rpc"] += 5
    stats = rpc(r, r.r_rpc, StatsRequest()).values
    assert stats["protocol_errors"] > before + 100
    assert stats["version"] == 0 and stats["paused"] is False
    check_alive_and_small(r, "rollouter", r.rollouter, before_rss)


# -- the rollouter's worker channel (ROUTER) ---------------------------------------------------------


def test_rollouter_channel(run):
    r = run
    before_rss = rss_mb(r.rollouter.process.pid)
    before = rpc(r, r.r_rpc, StatsRequest()).values["channel_protocol_errors"]
    sock = r.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"fuzzer")
    sock.connect(r.r_channel)
    barrage("rollouter_channel", sock, hostile, examples=150, prefix=[], drain=sock)
    # Out of order: results from a peer that never said hello, for samples never dispatched.
    traj = Trajectory(sample_id="nope", group_id="nope", token_ids=np.zeros(2, np.int32),
                      logprobs=np.zeros(2, np.float32), versions=np.zeros(2, np.int32),
                      loss_mask=np.zeros(2, np.uint8), prompt_len=1)
    from rollmesh.wire.messages import Returned
    scored = Scored(sample_id=traj.sample_id, reward=1.0, reward_status="ok")
    for rec in (Returned(trajectory=traj), scored, Cancel(), Paused(in_flight=1, cancel_queue=2)):
        sock.send_multipart(encode(rec))
        TRIED["rollouter_channel"] += 1
    # A valid hello: the rollouter takes the fuzzer on as a (reward) worker and heartbeats it.
    sock.send_multipart(encode(WorkerHello(worker="fuzzer", kind="reward", credits=1)))
    deadline, beat = time.monotonic() + 20, None
    while beat is None and time.monotonic() < deadline:
        if sock.poll(500):
            try:
                msg = decode(sock.recv_multipart())
            except ProtocolError:
                continue
            if isinstance(msg, Heartbeat):
                beat = msg
    assert beat is not None and beat.sender == "rollouter"
    sock.send_multipart(encode(scored))  # from a known worker, not dispatched
    deadline = time.monotonic() + 20
    while True:
        stats = rpc(r, r.r_rpc, StatsRequest()).values
        if stats["unexpected_returns"] >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert stats["channel_protocol_errors"] > before + 100
    assert stats["unexpected_returns"] >= 1 and stats["messages_from_unknown_peers"] >= 2
    assert "fuzzer" in stats["workers"]
    sock.close(0)  # the rollouter declares it silent and drops it
    # What the monitor sees: the rollouter's published status counts the channel's errors.
    assert published(r, "metrics.rollouter.0")["channel_protocol_errors"] > before + 100
    check_alive_and_small(r, "rollouter", r.rollouter, before_rss)


# -- the workers (the test is their hostile rollouter) -----------------------------------------------


def _recv_from(r: Run, peer: bytes, want: type, timeout_s: float = 30) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if r.worker_channel.poll(500):
            frames = r.worker_channel.recv_multipart()
            if frames[0] != peer:
                continue
            msg = decode(frames[1:])
            if isinstance(msg, want):
                return msg
    raise AssertionError(f"no {want.__name__} from {peer!r}")


def _score_request(r: Run, answer: str) -> Trajectory:
    from rollmesh.core.trajectory import load_tokenizer

    tok = load_tokenizer("tiny")
    prompt = tok.encode("q", add_special_tokens=False)
    response = tok.encode(answer, add_special_tokens=False)
    ids = np.array(prompt + response, np.int32)
    n = len(ids)
    return Trajectory(sample_id="s-1", group_id="g-1", token_ids=ids,
                      logprobs=np.zeros(n, np.float32), versions=np.full(n, -1, np.int32),
                      loss_mask=np.zeros(n, np.uint8), prompt_len=len(prompt),
                      status="finished", label=tok.decode(response, skip_special_tokens=True))


@pytest.mark.parametrize("kind", ["reward", "agent"])
def test_worker_channel_client(run, kind):
    r = run
    child = r.reward if kind == "reward" else r.agent
    peer = r.workers[kind]
    before_rss = rss_mb(child.process.pid)
    barrage(f"{kind}_worker", r.worker_channel, hostile, examples=120, prefix=[peer])
    # Out of order for a worker: a Cancel with nothing running, records meant for others.
    for rec in (Cancel(reason="fuzz"), Paused(in_flight=0, cancel_queue=0), WeightVersion(version=9)):
        r.worker_channel.send_multipart([peer, *encode(rec)])
        TRIED[f"{kind}_worker"] += 1
    r.worker_channel.send_multipart([peer, *encode(Heartbeat(sender="rollouter", seq=77))])
    beat = _recv_from(r, peer, Heartbeat)
    assert beat.seq == 77
    if kind == "reward":
        traj = _score_request(r, "a")
        r.worker_channel.send_multipart([peer, *encode(Score(trajectory=traj))])
        scored = _recv_from(r, peer, Scored)
        assert scored.sample_id == "s-1" and scored.reward_status == "ok"
        assert scored.reward == 1.0  # exact_match of the response against its label
    else:
        r.worker_channel.send_multipart([peer, *encode(StatsRequest())])
        stats = _recv_from(r, peer, Metrics).values
        assert stats["running"] == 0 and stats["failed"] == 0
    assert logged_protocol_errors(r, child) >= 64
    check_alive_and_small(r, f"{kind}_worker", child, before_rss)


# -- the status hub and a PULL socket -----------------------------------------------------------------


def test_status_hub(run):
    """A hostile publisher on the hub: the hub forwards, the monitor's Subscriber counts and skips
    the garbage and still reads the roles' Metrics."""
    r = run

    async def main():
        with Transport() as t:
            sub = Subscriber(t, r.hub.backend, topics=("metrics.", "fuzz"))
            pub = r.ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.connect(r.hub.frontend)
            try:
                # The subscription must reach this publisher through the hub before anything
                # sent counts (PUB drops what no one subscribed to yet): probe until one arrives.
                probe = Metrics(role="probe", host="fuzz", values={})
                deadline = time.monotonic() + 30
                while True:
                    pub.send_multipart([b"fuzz", *encode(probe)])
                    try:
                        topic, rec = await asyncio.wait_for(sub.recv(), 0.2)
                        if topic == "fuzz":
                            break
                    except asyncio.TimeoutError:
                        assert time.monotonic() < deadline, "the hub never forwarded"

                @settings(FUZZ, max_examples=120)
                @given(frames=hostile)
                def throw(frames):
                    pub.send_multipart([b"fuzz", *frames])
                    TRIED["status_hub"] += 1

                throw()
                for frames in BIG:
                    pub.send_multipart([b"fuzz", *frames])
                pub.send_multipart([b"fuzz"])  # a topic and nothing else
                TRIED["status_hub"] += 3
                # then a valid record after the garbage: once it is read, all of it was
                sentinel = Metrics(role="sentinel", host="fuzz", values={})
                pub.send_multipart([b"fuzz", *encode(sentinel)])
                deadline = time.monotonic() + 30
                roles = set()
                wanted = {"message_queue", "rollouter", "synchronizer", "sentinel"}
                while time.monotonic() < deadline and not wanted <= roles:
                    topic, rec = await asyncio.wait_for(sub.recv(), 30)
                    if topic.startswith("metrics."):
                        assert isinstance(rec, Metrics)
                        roles.add(rec.role)
                    elif topic == "fuzz" and rec == sentinel:  # (garbage may decode as a record)
                        roles.add(rec.role)
                assert wanted <= roles, roles
                assert sub.protocol_errors >= 50, sub.protocol_errors
            finally:
                pub.close(0)
                sub.close()

    asyncio.run(main())
    assert r.hub._thread.is_alive()


def test_puller(run):
    r = run

    async def main():
        with Transport() as t:
            puller = Puller(t, bind="tcp://127.0.0.1:0")
            address = puller.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            push = r.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(address)
            good = Pusher(t, connect=address)
            received = []

            async def pull():
                while True:
                    received.append(await puller.recv())

            task = asyncio.create_task(pull())
            try:
                barrage("puller", push, hostile, examples=120, prefix=[])
                await good.send(Heartbeat(sender="ok", seq=5))

                def ours() -> list:
                    return [m for m in received if isinstance(m, Heartbeat) and m.sender == "ok"]

                # Two sockets: the puller fair-queues them, so ours may come before the last
                # of the barrage; and Hypothesis can produce a valid record by chance.
                deadline = time.monotonic() + 10
                while ((not ours() or puller.protocol_errors < 100)
                       and time.monotonic() < deadline):
                    await asyncio.sleep(0.05)
            finally:
                task.cancel()
                push.close(0)
                good.close()
                puller.close()
            mine = ours()
            assert len(mine) == 1 and mine[0] == Heartbeat(sender="ok", seq=5, time=mine[0].time)
            assert puller.protocol_errors >= 100

    asyncio.run(main())


# -- the engine's HTTP ---------------------------------------------------------------------------------

_json = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
                     | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                         max_size=3),
                     max_leaves=8)
ROUTES = ["/generate", "/abort_request", "/get_model_info", "/server_info", "/health",
          "/flush_cache", "/no_such_route", "/generate/../admin", "/%00", "/" + "x" * 3000]
SAFE_BODIES = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=50).map(str.encode),
    st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
                 | st.text(max_size=10),
                 lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                     max_size=4),
                 max_leaves=10).map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {"input_ids": st.one_of(st.lists(st.integers(-(2**40), 2**40), max_size=6), st.none(),
                                st.text(max_size=5), st.lists(st.lists(st.integers(0, 5)))),
         "sampling_params": st.one_of(st.none(), st.text(max_size=4), st.fixed_dictionaries({}, optional={
             "max_new_tokens": st.one_of(st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=3)),
             "temperature": st.one_of(st.floats(), st.integers(-5, 5), st.text(max_size=3)),
             "top_p": st.floats(), "top_k": st.integers(-(2**40), 2**40),
             "min_p": st.floats(), "n": st.integers(-3, 3), "stop": _json,
             "stop_token_ids": st.lists(st.integers(-(2**40), 2**40), max_size=3),
             "min_new_tokens": st.integers(-(2**40), 2**40),
             "sampling_seed": st.one_of(st.integers(-(2**70), 2**70), st.floats()),
             "bogus": _json}))},
        optional={"rid": _json, "return_logprob": _json, "stream": st.booleans() | _json,
                  "text": st.one_of(st.text(max_size=8), st.integers()),
                  "logprob_start_len": _json},
    ).map(lambda d: json.dumps(d).encode()),
)


def _valid_generate(r: Run) -> None:
    status, body = r.engine.post("/generate", {
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                    "ignore_eos": True}})
    assert status == 200 and len(body["output_ids"]) == 4, (status, body)


def test_engine_http(run):
    r = run
    engine = r.engine
    before_rss = rss_mb(engine.proc.pid)
    statuses: collections.Counter[int] = collections.Counter()

    def check(status: int, body: Any, what: Any) -> None:
        statuses[status] += 1
        assert status < 500, (status, body, what)
        if status >= 400 and status not in (404, 405):
            assert body, (status, what)  # a message saying what is wrong
        TRIED["engine_http"] += 1

    @settings(FUZZ, max_examples=200)
    @given(route=st.sampled_from(ROUTES), method=st.sampled_from(["POST", "GET", "PUT"]),
           body=SAFE_BODIES)
    def throw(route, method, body):
        if route == "/flush_cache" and method != "GET":
            method = "GET"
        status, payload = engine.request(method, route, raw=body if method != "GET" else None,
                                         timeout=120)
        check(status, payload, (method, route, body[:200]))

    throw()
    fuzzed = collections.Counter(statuses)  # what the random inputs got (how many hypothesis
    # generates in its budget varies with the machine's load; each was answered below 500)
    explicit = [
        ("/generate", b"{not json", "malformed JSON"),
        ("/generate", b"[1, 2]", "must be a JSON object"),
        ("/generate", b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1e30}}',
         "max_new_tokens must be an integer"),
        ("/generate", b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 10000000000000}}',
         "maximum context length"),
        ("/generate", b'{"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}',
         "max_new_tokens must be >= 0"),
        ("/generate", b'{"input_ids": [-1]}', "outside the vocabulary"),
        ("/generate", b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', "temperature"),
        ("/generate", b'{"input_ids": [1], "sampling_params": {"temperature": Infinity}}',
         "temperature"),
        ("/generate", b'{"input_ids": [1], "sampling_params": {"top_p": NaN}}', "top_p"),
        ("/generate", b'{"input_ids": [1], "sampling_params": {"min_p": NaN}}', "min_p"),
        ("/generate", json.dumps({"input_ids": [1] * 100_000}).encode(), "context length"),
        ("/generate", b'{"text": "hi", "input_ids": [1]}', "exactly one of text or input_ids"),
        ("/generate", b'{"input_ids": [1], "rid": 5}', "rid must be a string"),
        ("/pause_generation", b'{"mode": "nap"}', "mode must be one of"),
        ("/init_weights_update_group", b'{"master_port": "x"}', "bad or missing field"),
        ("/update_weights_from_distributed", b'{"names": 1}', "must be lists"),
        ("/update_weights_from_disk", b'{"model_path": 5}', "model_path"),
        ("/update_weight_version", b'{}', "new_version is required"),
        ("/destroy_weights_update_group", b'{"group_name": "nope"}', "no weight update group"),
    ]
    for route, raw, message in explicit:
        status, payload = engine.request("POST", route, raw=raw)
        check(status, payload, route)
        assert 400 <= status < 500 and message in json.dumps(payload), (route, raw[:80], status,
                                                                          payload)
    status, payload = engine.request("POST", "/generate", raw=b"x" * (65 * 1024 * 1024))
    check(status, payload, "oversized")
    assert status == 413, (status, payload)
    _valid_generate(r)
    status, _ = engine.get("/health")
    assert status == 200 and engine.proc.poll() is None
    after = rss_mb(engine.proc.pid)
    RSS["engine"] = (before_rss, after)
    assert after < RSS_BOUND_MB["engine"]
    assert fuzzed[400] >= 5 and fuzzed[200] >= 5, fuzzed  # refused with a reason, and served
