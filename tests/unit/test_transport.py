"""Sockets over real ZeroMQ: request-reply, CURVE, time-outs, streams, status hub, liveness."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import zmq

from rollmesh.wire.messages import Group, Heartbeat, Metrics, Ok, Trajectory
from rollmesh.wire.transport import (
    CurveKeys,
    PeerTimeout,
    RemoteError,
    RpcClient,
    RpcServer,
    Transport,
    TransportError,
    free_port,
    is_loopback,
)
from rollmesh.wire.channels import Heartbeater, Liveness, Publisher, StatusProxy, Subscriber
from tests.helpers.wire import Puller, Pusher, Shutdown


async def echo(msg, peer):
    return msg


def serve(server: RpcServer) -> asyncio.Task:
    return asyncio.create_task(server.serve())


def test_loopback_detection():
    assert is_loopback("tcp://127.0.0.1:5") and is_loopback("tcp://127.3.2.1:5")
    assert is_loopback("tcp://localhost:5") and is_loopback("tcp://[::1]:5")
    assert is_loopback("ipc:///tmp/x") and is_loopback("inproc://x")
    assert not is_loopback("tcp://10.0.0.2:5") and not is_loopback("tcp://0.0.0.0:5")
    assert not is_loopback("tcp://gpu-node-3:5")
    with pytest.raises(TransportError, match="unsupported address 'udp://x'"):
        is_loopback("udp://x")


def test_non_loopback_socket_without_keys_is_refused():
    with Transport() as t:
        with pytest.raises(TransportError) as err:
            t.socket(zmq.ROUTER, bind="tcp://0.0.0.0:0")
    assert str(err.value) == (
        "tcp://0.0.0.0:0: CURVE keys are required for a non-loopback address (pass the run's "
        "keys, or bind to 127.0.0.1 for a single-host run)")


def test_socket_options_are_bounded():
    with Transport(hwm=7, max_msg_bytes=1 << 20, linger_ms=5) as t:
        s = t.socket(zmq.PUSH, bind="tcp://127.0.0.1:0")
        assert s.getsockopt(zmq.SNDHWM) == 7 and s.getsockopt(zmq.RCVHWM) == 7
        assert s.getsockopt(zmq.MAXMSGSIZE) == 1 << 20 and s.getsockopt(zmq.LINGER) == 5
        s.close()


def test_request_reply_round_trip_and_errors():
    async def main():
        with Transport() as t:
            async def boom(msg, peer):
                raise ValueError("no such group")

            server = RpcServer(t, "tcp://127.0.0.1:0", {Ok: echo, Group: boom}, name="test")
            task = serve(server)
            client = RpcClient(t, server.address, timeout_s=2)
            replies = await asyncio.gather(*(client.request(Ok(message=str(i))) for i in range(50)))
            assert [r.message for r in replies] == [str(i) for i in range(50)]
            with pytest.raises(RemoteError) as err:
                await client.request(Group(group_id="g", trajectories=[]))
            assert err.value.code == "handler" and "ValueError: no such group" in err.value.message
            with pytest.raises(RemoteError) as err:
                await client.request(Shutdown())
            assert err.value.code == "protocol" and "test does not handle Shutdown" in err.value.message
            assert server.stats.handler_errors == 1 and server.stats.protocol_errors == 1
            client.close()
            task.cancel()
            server.close()

    asyncio.run(main())


def test_request_to_dead_peer_times_out_with_a_clear_error():
    port = free_port()

    async def main():
        with Transport() as t:
            client = RpcClient(t, f"tcp://127.0.0.1:{port}", timeout_s=0.3, retries=1, name="queue")
            start = time.monotonic()
            with pytest.raises(PeerTimeout) as err:
                await client.request(Ok())
            elapsed = time.monotonic() - start
            client.close()
        return err.value, elapsed

    err, elapsed = asyncio.run(main())
    assert str(err) == (f"no reply from tcp://127.0.0.1:{port} to Ok after 2 attempt(s) of 0.3s: "
                        "is the queue peer alive?")
    assert 0.55 < elapsed < 3


def test_retry_reaches_a_server_that_starts_late():
    port = free_port()

    async def main():
        with Transport() as t:
            client = RpcClient(t, f"tcp://127.0.0.1:{port}", timeout_s=0.4, retries=5)
            pending = asyncio.create_task(client.request(Ok(message="late")))
            await asyncio.sleep(0.6)
            server = RpcServer(t, f"tcp://127.0.0.1:{port}", {Ok: echo})
            task = serve(server)
            reply = await pending
            # the rebuilt socket dropped the first attempts: the server saw few duplicates
            assert server.stats.requests <= 2
            client.close()
            task.cancel()
            server.close()
            return reply

    assert asyncio.run(main()).message == "late"


def test_curve_accepts_the_run_key_and_refuses_an_unknown_key(tmp_path):
    run = CurveKeys.generate(tmp_path / "run")
    other = CurveKeys.generate(tmp_path / "other")
    # A stranger who even knows the server's public key, with a client key of its own.
    stranger = CurveKeys(run.server_public, other.server_secret, other.client_public,
                         other.client_secret, other.directory)
    for path in (tmp_path / "run").rglob("*"):
        assert path.stat().st_mode & 0o777 == (0o700 if path.is_dir() else 0o600)
    address = f"tcp://127.0.0.1:{free_port()}"

    async def main():
        with Transport(run) as server_t, Transport(run) as good_t, Transport(stranger) as bad_t, \
                Transport() as plain_t:
            server = RpcServer(server_t, address, {Ok: echo}, secure=True)
            task = serve(server)
            good = RpcClient(good_t, address, secure=True, timeout_s=3)
            assert (await good.request(Ok(message="hi"))).message == "hi"
            bad = RpcClient(bad_t, address, secure=True, timeout_s=0.5, retries=0)
            with pytest.raises(PeerTimeout):
                await bad.request(Ok(message="let me in"))
            plain = RpcClient(plain_t, address, secure=False, timeout_s=0.5, retries=0)
            with pytest.raises(PeerTimeout):
                await plain.request(Ok(message="no crypto"))
            assert server.stats.requests == 1  # only the authenticated client got through
            for c in (good, bad, plain):
                c.close()
            task.cancel()
            server.close()

    asyncio.run(main())


def test_close_stops_the_authenticator_and_does_not_wait_for_a_stuck_one(tmp_path, monkeypatch):
    import threading

    import rollmesh.wire.transport as transport

    keys = CurveKeys.generate(tmp_path / "run")
    t = Transport(keys)
    thread = t._auth.thread
    t.close()  # the real thread: told to stop, joined, the context destroyed
    assert not thread.is_alive() and t.sync_ctx.closed

    monkeypatch.setattr(transport, "ZAP_STOP_TIMEOUT_S", 0.2)
    t = Transport(keys)
    real = t._auth.thread
    stuck = threading.Event()
    t._auth.thread = threading.Thread(target=stuck.wait, daemon=True)  # never answers
    t._auth.thread.start()
    sock = t.socket(zmq.PULL, bind=f"tcp://127.0.0.1:{free_port()}", secure=True)
    began = time.monotonic()
    t.close()
    assert time.monotonic() - began < 3  # pyzmq's own stop would wait for good
    assert sock.closed and not t.sync_ctx.closed  # the context is left to the stuck thread
    stuck.set()
    real.join(5)  # (the real thread got TERMINATE and stopped)
    assert not real.is_alive()


def test_curve_keys_missing_is_a_clear_error(tmp_path):
    with pytest.raises(TransportError, match=f"cannot load CURVE keys from {tmp_path}"):
        CurveKeys.load(tmp_path)


def test_push_pull_stream_with_back_pressure():
    async def main():
        with Transport() as t:
            pull = Puller(t, bind="tcp://127.0.0.1:0", hwm=2)
            address = pull.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            push = Pusher(t, connect=address, hwm=2)
            await push.send(Ok(message="first"))
            assert (await pull.recv()).message == "first"
            # nobody reads now: the bounded queues fill and send waits (visible back-pressure)
            sent = 0
            with pytest.raises(asyncio.TimeoutError):
                for _ in range(10_000):
                    await push.send(Ok(message="x" * 100_000), timeout_s=0.5)
                    sent += 1
            assert sent < 10_000
            # garbage on the stream is counted and skipped
            raw = t.socket(zmq.PUSH, connect=address)
            pull2 = pull
            for _ in range(sent):
                await pull2.recv()
            push.close()
            await raw.send_multipart([b"Nope", b"\x80"])
            await raw.send_multipart(list(map(bytes, [b"Ok", b"\x81\xa7message\xa2ok"])))
            assert (await pull.recv()).message == "ok"
            assert pull.protocol_errors == 1
            raw.close(0)
            pull.close()

    asyncio.run(main())


def test_oversized_message_is_refused_by_the_receiver():
    async def main():
        with Transport(max_msg_bytes=1 << 20) as small, Transport() as big:
            pull = Puller(small, bind="tcp://127.0.0.1:0")
            address = pull.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            push = Pusher(big, connect=address)
            n = 1 << 19
            sample = Trajectory(sample_id="s", group_id="g", token_ids=np.zeros(n, np.int32),
                                logprobs=np.zeros(n, np.float32), versions=np.zeros(n, np.int32),
                                loss_mask=np.zeros(n, np.uint8), prompt_len=0)
            await push.send(sample)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(pull.recv(), 1.0)
            push.close()
            pull.close()

    asyncio.run(main())


def test_status_hub_proxies_publishers_to_subscribers():
    async def main():
        with Transport() as t:
            hub = StatusProxy(t, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
            sub = Subscriber(t, hub.backend, topics=["metrics."])
            pub = Publisher(t, hub.frontend)
            got = None
            for _ in range(50):  # PUB/SUB joins late: publish until the subscription is live
                await pub.publish("metrics.trainer", Metrics(role="trainer", host="h",
                                                             values={"loss": 0.5}))
                await pub.publish("other", Ok())
                try:
                    got = await asyncio.wait_for(sub.recv(), 0.1)
                    break
                except asyncio.TimeoutError:
                    continue
            assert got is not None
            topic, rec = got
            assert topic == "metrics.trainer" and rec.values == {"loss": 0.5}
            pub.close()
            sub.close()
            hub.close()
            assert not hub._thread.is_alive()

    asyncio.run(main())


def test_liveness_counts_missed_intervals():
    live = Liveness(interval_s=1.0, liveness=3)
    live.beat("a", now=100.0)
    assert live.is_alive("a", now=102.9) and not live.is_alive("a", now=103.1)
    assert live.dead(now=103.1) == ["a"] and not live.is_alive("never seen")


def test_heartbeater_declares_a_silent_peer_dead_within_liveness():
    async def main():
        with Transport() as t:
            async def answer(msg, peer):
                return Heartbeat(sender="server", seq=msg.seq)

            server = RpcServer(t, "tcp://127.0.0.1:0", {Heartbeat: answer})
            task = serve(server)
            client = RpcClient(t, server.address)
            dead_at = asyncio.get_running_loop().create_future()
            live = Liveness(interval_s=0.2, liveness=3)
            beater = asyncio.create_task(Heartbeater(
                client, "client", live, lambda: dead_at.set_result(time.monotonic())).run())
            await asyncio.sleep(1.0)
            assert not dead_at.done() and server.stats.requests >= 4
            task.cancel()  # the peer stops answering
            server.close()
            silent_from = time.monotonic()
            await asyncio.wait_for(dead_at, 5)
            await beater
            client.close()
            return dead_at.result() - silent_from

    took = asyncio.run(main())
    # dead after 3 missed 0.2 s intervals: not before ~0.4 s, and within one interval of 0.6 s
    assert 0.35 < took < 0.6 + 0.4, took


def _listeners(port: int) -> set[str]:
    """The local addresses listening on TCP `port` (from /proc/net/tcp{,6}: state 0A)."""
    found = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            for line in f.read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.split(":")
                if state == "0A" and int(p, 16) == port:
                    found.add(addr)
    return found


def test_the_rendezvous_store_listens_only_on_the_address_the_ranks_are_given():
    """torch's TCPStore alone listens on every interface, unauthenticated; rank 0's store of
    the trainer ranks and of the weight-update group binds the address it is reached at."""
    import socket
    import threading
    from datetime import timedelta

    from rollmesh.runtime.rendezvous import tcp_store

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    timeout = timedelta(seconds=20)
    joined = []
    client = threading.Thread(target=lambda: joined.append(
        tcp_store("127.0.0.1", port, 1, 2, timeout).set("rank1", "here")))
    client.start()
    server = tcp_store("127.0.0.1", port, 0, 2, timeout)  # waits for rank 1
    client.join(20)
    assert joined and server.get("rank1") == b"here"
    assert _listeners(port) == {"0100007F"}  # 127.0.0.1 only, not 0.0.0.0 nor [::]
    del server
    assert _listeners(port) == set()  # the store closed the socket it was given


def test_a_stream_delivers_in_order_ends_with_an_error_and_breaks_on_a_reconnect():
    """A handler that returns an async iterator streams its records under one correlation id;
    an exception in it reaches the client as RemoteError; when the server goes away and another
    binds its address, the open stream says it is broken (what it carried may be lost) and a new
    stream on the same client works."""
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"

    async def numbers(msg, peer):
        async def items():
            for i in range(int(msg.message)):
                yield Ok(message=str(i))
            if msg.message == "2":
                raise ValueError("no more")
            await asyncio.Event().wait()  # open until the client goes (or the server)

        return items()

    async def main():
        from rollmesh.wire.transport import StreamBroken

        with Transport() as t:
            server = RpcServer(t, address, {Ok: numbers})
            task = serve(server)
            client = RpcClient(t, address, timeout_s=2)
            stream = await client.stream(Ok(message="3"))
            got = [(await stream.next(5)).message for _ in range(3)]
            with pytest.raises(PeerTimeout):
                await stream.next(0.2)  # nothing more, still open
            failing = await client.stream(Ok(message="2"))
            assert [(await failing.next(5)).message for _ in range(2)] == ["0", "1"]
            with pytest.raises(RemoteError, match="ValueError: no more"):
                await failing.next(5)
            task.cancel()
            server.close()  # gone: the client's connection drops
            with pytest.raises(StreamBroken, match="Ok stream from .*: the connection dropped"):
                await stream.next(5)
            with pytest.raises(StreamBroken):  # and stays broken
                await stream.next(5)
            server = RpcServer(t, address, {Ok: numbers})
            task = serve(server)
            again = await client.stream(Ok(message="1"))
            assert (await again.next(5)).message == "0"
            client.close()
            task.cancel()
            server.close()
            return got

    assert asyncio.run(main()) == ["0", "1", "2"]
