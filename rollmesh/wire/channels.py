"""The sockets beyond request-reply (`rollmesh.wire.transport` has the factory and RPC):

- `Channel` (ROUTER) and `ChannelClient` (DEALER): messages either way at any time, between the
  rollouter and its workers;
- `StatusProxy` (XSUB/XPUB in a thread), `Publisher`, `Subscriber`: status and metrics;
- `Liveness`, `Heartbeater`: heartbeats both ways; a peer silent for `liveness` intervals is dead.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Collection, Iterable

import structlog
import zmq
import zmq.asyncio

from rollmesh.wire import protocol
from rollmesh.wire.messages import Heartbeat
from rollmesh.wire.protocol import ProtocolError
from rollmesh.wire.keys import identity_for
from rollmesh.wire.transport import (
    PROTOCOL_ERRORS,
    PeerTimeout,
    RemoteError,
    RpcClient,
    Transport,
    note_forbidden,
    recv_frames,
    role_of,
    send_frames,
    sender_of,
)

log = structlog.get_logger("rollmesh.wire.channels")  # rollmesh.runtime.log configures it
_DRAIN_HUB = 256  # messages the hub forwards from one socket before it looks at the others


# --------------------------------------------------------------------------------------------
# Channels: ROUTER <-> many DEALERs, messages either way at any time
# --------------------------------------------------------------------------------------------


class _Receiver:
    """Records from `self.sock`; a malformed message is counted, logged sparsely, and skipped
    (a peer flooding garbage must not flood the log either)."""

    sock: zmq.Socket
    where = "stream"
    protocol_errors = 0

    def _protocol_error(self, reason: str) -> None:
        self.protocol_errors += 1
        PROTOCOL_ERRORS[self.where] += 1
        n = self.protocol_errors
        if n & (n - 1) == 0 or n % 1000 == 0:
            log.warning("protocol_error", where=self.where, reason=reason, count=n)

    async def recv(self) -> Any:
        while True:
            frames = await recv_frames(self.sock)
            try:
                return protocol.decode(frames)
            except ProtocolError as e:
                self._protocol_error(str(e))


class Channel(_Receiver):
    """The bound end of a work channel (ROUTER): receive from any peer, send to one peer.

    Used where the binder pushes work as well as receiving it (the rollouter dispatching
    trajectories to the workers that hold credit). Malformed messages are counted and skipped.
    On a CURVE socket, `allow` names the roles that may send on it (`role_of` their key's
    identity); a message from any other is counted, logged and skipped.
    """

    def __init__(self, transport: Transport, bind: str, *, secure: bool | None = None,
                 name: str = "channel", hwm: int | None = None,
                 allow: Collection[str] | None = None):
        self.sock = transport.socket(zmq.ROUTER, bind=bind, secure=secure, hwm=hwm)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting peer takes its id back
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.name = self.where = name
        self.secure = bool(self.sock.getsockopt(zmq.CURVE_SERVER))
        self.allow = None if allow is None else frozenset(allow)
        self.forbidden = 0

    async def recv(self) -> tuple[bytes, Any]:  # type: ignore[override]
        while True:
            frames = await recv_frames(self.sock)
            if self.secure and not self._allowed(frames[0]):
                continue
            try:
                return frames[0].bytes, protocol.decode(frames[1:])
            except ProtocolError as e:
                self._protocol_error(str(e))

    def _allowed(self, frame: Any) -> bool:
        sender = sender_of(frame)
        if sender is not None and (self.allow is None or role_of(sender) in self.allow):
            return True
        self.forbidden += 1
        note_forbidden(self.name, self.forbidden, sender=sender,
                       allowed=sorted(self.allow or ()))
        return False

    async def send(self, peer: bytes, rec: Any) -> bool:
        """False if the peer is gone (its work must be re-queued by the caller)."""
        try:
            await send_frames(self.sock, [peer, *protocol.encode(rec)])
            return True
        except zmq.ZMQError as e:
            log.warning("send_failed", channel=self.name, peer=peer.hex(), error=str(e))
            return False

    def close(self) -> None:
        self.sock.close(0)


class ChannelClient(_Receiver):
    """The connecting end of a work channel (DEALER)."""

    where = "channel client"

    def __init__(self, transport: Transport, connect: str, *, identity: bytes | None = None,
                 secure: bool | None = None, hwm: int | None = None):
        self.sock = transport.socket(zmq.DEALER, connect=connect, secure=secure, hwm=hwm,
                                     identity=identity)

    async def send(self, rec: Any) -> None:
        await send_frames(self.sock, protocol.encode(rec))

    def close(self) -> None:
        self.sock.close(0)


# --------------------------------------------------------------------------------------------
# Status: XSUB/XPUB proxy, publishers, subscribers
# --------------------------------------------------------------------------------------------


class StatusProxy:
    """The status hub: publishers connect to `frontend` (XSUB), subscribers to `backend` (XPUB).

    Forwards in a thread; `close()` stops it through its control socket, so no thread or socket
    is left behind. On CURVE sockets a publication goes on only if its sender may publish its
    topic: `<kind>.<role>.<instance>` from that role process's own key, anything from the
    launcher's; others are counted (`FORBIDDEN["status hub"]`) and dropped (a reward worker's
    key would otherwise forge the trainer's metrics or the rollouter's evaluations).
    """

    name = "status hub"

    def __init__(self, transport: Transport, frontend: str, backend: str,
                 secure: bool | None = None):
        self._xsub = transport.socket(zmq.XSUB, bind=frontend, secure=secure, sync=True)
        self._xpub = transport.socket(zmq.XPUB, bind=backend, secure=secure, sync=True)
        self.frontend = self._xsub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.backend = self._xpub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.secure = bool(self._xsub.getsockopt(zmq.CURVE_SERVER))
        self.forbidden = 0
        control = f"inproc://status-proxy-{id(self)}"
        self._control_server = transport.sync_ctx.socket(zmq.PAIR)
        self._control_server.bind(control)
        self._control = transport.sync_ctx.socket(zmq.PAIR)
        self._control.connect(control)
        self._thread = threading.Thread(target=self._run, name="status-proxy", daemon=True)
        self._thread.start()

    def may_publish(self, frames: list[Any]) -> bool:
        if not self.secure:
            return True
        sender = sender_of(frames[0])
        parts = frames[0].bytes.decode("utf-8", "replace").split(".")
        if sender == "launcher" or (sender is not None and len(parts) == 3
                                    and identity_for(parts[1], parts[2]) == sender):
            return True
        self.forbidden += 1
        note_forbidden(self.name, self.forbidden, sender=sender, topic=".".join(parts)[:80])
        return False

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in (self._xsub, self._xpub, self._control_server):
            poller.register(sock, zmq.POLLIN)
        try:
            while True:
                for sock, _ in poller.poll():
                    if sock is self._control_server:
                        if sock.recv() == b"TERMINATE":
                            return
                        continue
                    for _ in range(_DRAIN_HUB):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        if sock is self._xpub:  # (un)subscriptions go up to the publishers
                            self._xsub.send_multipart(frames, copy=False)
                        elif self.may_publish(frames):
                            self._xpub.send_multipart(frames, copy=False)
        except zmq.ZMQError:
            pass
        finally:
            for s in (self._xsub, self._xpub, self._control_server):
                s.close(0)

    def close(self) -> None:
        if self._thread.is_alive():
            self._control.send(b"TERMINATE")
            self._thread.join(5)
        self._control.close(0)


class Publisher:
    """Publishes records under a topic to the status hub."""

    def __init__(self, transport: Transport, hub: str, secure: bool | None = None):
        # A small HWM: status is droppable, a slow hub must never stall a role.
        self.sock = transport.socket(zmq.PUB, connect=hub, secure=secure, hwm=100)

    async def publish(self, topic: str, rec: Any) -> None:
        await send_frames(self.sock, [topic.encode(), *protocol.encode(rec)])

    def close(self) -> None:
        self.sock.close(0)


class Subscriber(_Receiver):
    """Receives (topic, record) from the status hub for the given topic prefixes."""

    where = "sub"

    def __init__(self, transport: Transport, hub: str, topics: Iterable[str] = ("",),
                 secure: bool | None = None):
        self.sock = transport.socket(zmq.SUB, connect=hub, secure=secure)
        for topic in topics:
            self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())

    async def recv(self) -> tuple[str, Any]:  # type: ignore[override]
        while True:
            frames = await recv_frames(self.sock)
            try:
                topic = frames[0].bytes.decode("utf-8", "replace")
                return topic, protocol.decode(frames[1:])
            except (ProtocolError, IndexError) as e:
                self._protocol_error(str(e))

    def close(self) -> None:
        self.sock.close(0)


# --------------------------------------------------------------------------------------------
# Heartbeats
# --------------------------------------------------------------------------------------------


@dataclass
class Liveness:
    """Last-seen times of peers; a peer silent for `liveness` intervals is dead."""

    interval_s: float = 1.0
    liveness: int = 3
    last_seen: dict[str, float] = field(default_factory=dict)

    @property
    def deadline_s(self) -> float:
        return self.interval_s * self.liveness

    def beat(self, peer: str, now: float | None = None) -> None:
        self.last_seen[peer] = time.monotonic() if now is None else now

    def forget(self, peer: str) -> None:
        self.last_seen.pop(peer, None)

    def is_alive(self, peer: str, now: float | None = None) -> bool:
        seen = self.last_seen.get(peer)
        now = time.monotonic() if now is None else now
        return seen is not None and now - seen <= self.deadline_s

    def dead(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return [p for p, seen in self.last_seen.items() if now - seen > self.deadline_s]

    async def watch(self, on_dead: Callable[[str], Awaitable[None] | None]) -> None:
        """Call `on_dead(peer)` once for each peer that falls silent; runs until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s / 4)
            for peer in self.dead():
                self.forget(peer)
                result = on_dead(peer)
                if asyncio.iscoroutine(result):
                    await result


class Heartbeater:
    """Sends a Heartbeat to a peer every interval and counts the peer's answers.

    The peer answers each heartbeat with one of its own, so each side knows the other is
    alive. After `liveness` consecutive unanswered heartbeats, `on_dead` is called once.
    Misses are counted rather than clock time measured, so a process that was itself stalled
    (swapped out, stopped) does not mistake its own silence for its peer's.
    """

    def __init__(self, client: RpcClient, sender: str, liveness: Liveness,
                 on_dead: Callable[[], Awaitable[None] | None]):
        self.client = client
        self.sender = sender
        self.liveness = liveness
        self.on_dead = on_dead

    async def run(self) -> None:
        seq = misses = 0
        interval = self.liveness.interval_s
        while misses < self.liveness.liveness:
            seq += 1
            started = time.monotonic()
            try:
                await self.client.request(Heartbeat(sender=self.sender, seq=seq),
                                          timeout_s=interval, retries=0)
                misses = 0
                self.liveness.beat(self.client.address)
            except PeerTimeout:
                misses += 1
            except RemoteError as e:
                log.warning("heartbeat_refused", peer=self.client.address, error=str(e))
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))
        log.error("peer_dead", peer=self.client.address, missed=misses,
                  silent_s=round(self.liveness.deadline_s, 2))
        result = self.on_dead()
        if asyncio.iscoroutine(result):
            await result
