"""Sockets: one factory and the few patterns every role uses, over ZeroMQ with asyncio.

- `Transport` owns a process's ZeroMQ context, its CURVE keys and authenticator, and makes
  every socket with bounded high-water marks, a maximum message size and a linger. CURVE is on
  by default for every socket of a process that holds the run's keys, loopback included (a
  local process without them is refused: model code, another user); a non-loopback socket
  without keys is refused.
- `RpcServer` (ROUTER) / `RpcClient` (DEALER): request-reply with correlation ids, timeouts
  and retries (the "lazy pirate": on a timeout the socket is rebuilt and pending requests are
  sent again), a dispatcher from record type to handler, protocol errors answered and counted.
- `RpcStream`: a stream of replies (the trainer's batches).

Channels, status publishing and heartbeats are `rollmesh.wire.channels`.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import itertools
import weakref
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import structlog
import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from rollmesh.wire import protocol
from rollmesh.wire.keys import (
    CLIENTS,
    SENDER,
    CurveKeys,
    RunAuthenticator,
    TransportError,
    role_of,
    sender_of,
)
from rollmesh.wire.protocol import ProtocolError
from rollmesh.wire.messages import ErrorReply

log = structlog.get_logger("rollmesh.wire.transport")  # rollmesh.runtime.log configures it; wire sits below runtime

# Malformed messages this process received, by socket (server name or receiver kind): every
# role publishes them with its status, so the monitor shows who is sent garbage.
PROTOCOL_ERRORS: collections.Counter[str] = collections.Counter()
# Requests refused because their sender may not send them there, by socket: published too.
FORBIDDEN: collections.Counter[str] = collections.Counter()

DEFAULT_HWM = 1000
ZAP_STOP_TIMEOUT_S = 5.0  # the longest close() waits for the CURVE authenticator's thread
# What a stuck authenticator thread still uses (its authenticator, its context), kept from the
# garbage collector, whose clean-up would close or wait on them under that thread.
_ABANDONED: list[Any] = []
DEFAULT_MAX_MSG_BYTES = 256 << 20
DEFAULT_LINGER_MS = 1000
# ZMTP heartbeats on every connection: a connection that stays silent (a partition that drops
# packets without a reset, a NAT or firewall that forgot the flow) is closed after the timeout
# and re-established, instead of swallowing messages until TCP gives up (~15 minutes).
DEFAULT_ZMTP_HEARTBEAT_MS = 2000
DEFAULT_ZMTP_TIMEOUT_MS = 10000


def note_forbidden(where: str, count: int, **fields: Any) -> None:
    """One more refused message at `where` (its own `count`, this one included): counted in
    FORBIDDEN, logged at the 1st, 2nd, 4th ... and every 1000th (a hostile peer must not
    flood the log)."""
    FORBIDDEN[where] += 1
    if count & (count - 1) == 0 or count % 1000 == 0:
        log.warning("forbidden", where=where, count=count, **fields)


class Forbidden(PermissionError):
    """A handler's refusal of its request's sender (a role speaking for another): answered
    ErrorReply(code="forbidden"), counted and logged like a refusal by `allow`."""


class PeerTimeout(TimeoutError):
    """A peer did not answer in time, after all retries."""


class RemoteError(RuntimeError):
    """The peer answered with an ErrorReply."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# --------------------------------------------------------------------------------------------
# Addresses and keys
# --------------------------------------------------------------------------------------------


def is_loopback(address: str) -> bool:
    """ipc://, inproc:// and tcp:// on 127.0.0.0/8, ::1 or localhost are loopback."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    if not address.startswith("tcp://"):
        raise TransportError(f"unsupported address {address!r} (expected tcp://, ipc:// or inproc://)")
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or interface: treat as reachable from outside


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------
# The socket factory
# --------------------------------------------------------------------------------------------


class Transport:
    """A process's sockets. One per process; `close()` (or the context manager) at exit."""

    def __init__(
        self,
        keys: CurveKeys | None = None,
        *,
        hwm: int = DEFAULT_HWM,
        max_msg_bytes: int = DEFAULT_MAX_MSG_BYTES,
        linger_ms: int = DEFAULT_LINGER_MS,
        heartbeat_ms: int = DEFAULT_ZMTP_HEARTBEAT_MS,
        heartbeat_timeout_ms: int = DEFAULT_ZMTP_TIMEOUT_MS,
    ):
        self.keys = keys
        self.heartbeat_ms, self.heartbeat_timeout_ms = heartbeat_ms, heartbeat_timeout_ms
        self.hwm = hwm
        self.max_msg_bytes = max_msg_bytes
        self.linger_ms = linger_ms
        self.sync_ctx = zmq.Context()
        # Async sockets share the sync context, so one ZAP authenticator serves both.
        self.ctx = zmq.asyncio.Context.shadow(self.sync_ctx.underlying)
        # Sockets of the shadow context are invisible to sync_ctx.destroy(): track them all, so
        # close() never blocks in term() on a socket somebody forgot.
        self._sockets: weakref.WeakSet[zmq.Socket] = weakref.WeakSet()
        self._auth: ThreadAuthenticator | None = None
        if keys is not None:
            self._auth = RunAuthenticator(self.sync_ctx, keys.directory / CLIENTS)
            self._auth.load()
            self._auth.start()
            self._auth.configure_curve_callback(domain="*", credentials_provider=self._auth)
            self._auth.allow_any = False

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._auth is not None:
            auth, self._auth = self._auth, None
            if not self._stop_auth(auth):
                # its thread still uses a socket of this context: destroying the context
                # under it is unsafe, and term() would wait for it. Leave both (a daemon
                # thread: it does not hold up the process's exit).
                for sock in list(self._sockets):
                    if not sock.closed:
                        sock.close(linger=0)
                _ABANDONED.append(self.sync_ctx)
                return
        for sock in list(self._sockets):
            if not sock.closed:
                sock.close(linger=0)
        self.sync_ctx.destroy(linger=0)

    @staticmethod
    def _stop_auth(auth: ThreadAuthenticator, timeout_s: float | None = None) -> bool:
        """pyzmq's `ThreadAuthenticator.stop`, but waiting at most `timeout_s` for its thread
        (pyzmq's joins it for good): False, logged, if the thread did not stop."""
        timeout_s = ZAP_STOP_TIMEOUT_S if timeout_s is None else timeout_s
        thread = auth.thread
        if auth.pipe is not None:
            try:
                auth.pipe.send(b"TERMINATE", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                log.error("zap_thread_stuck", waited_s=timeout_s)
                if auth.pipe is not None:  # ours; without it pyzmq's __del__ sends no stop
                    auth.pipe.close(linger=0)  # (a send nobody reads would block for good)
                    auth.pipe = None  # type: ignore[assignment]
                _ABANDONED.append(auth)  # never collected: its socket stays the thread's
                return False
        auth.thread = None  # type: ignore[assignment]
        if auth.pipe is not None:
            auth.pipe.close()
            auth.pipe = None  # type: ignore[assignment]
        zmq.auth.Authenticator.stop(auth)
        return True

    def socket(
        self,
        kind: int,
        *,
        bind: str | None = None,
        connect: str | None = None,
        secure: bool | None = None,
        hwm: int | None = None,
        sync: bool = False,
        linger_ms: int | None = None,
        identity: bytes | None = None,
    ) -> zmq.Socket:
        """Make a socket and bind or connect it. `secure=None`: CURVE where this transport has
        the run's keys (loopback too: on one host, a local process without the keys sent a
        StopRun, took batches and stalled a run) or the address is not loopback."""
        address = bind or connect
        if address is None or (bind and connect):
            raise TransportError("give exactly one of bind= or connect=")
        if secure is None:
            secure = self.keys is not None or not is_loopback(address)
        if secure and self.keys is None:
            raise TransportError(
                f"{address}: CURVE keys are required for a non-loopback address "
                "(pass the run's keys, or bind to 127.0.0.1 for a single-host run)"
            )
        sock = (self.sync_ctx if sync else self.ctx).socket(kind)
        self._sockets.add(sock)
        hwm = self.hwm if hwm is None else hwm
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_msg_bytes)
        sock.setsockopt(zmq.LINGER, self.linger_ms if linger_ms is None else linger_ms)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if self.heartbeat_ms > 0:
            sock.setsockopt(zmq.HEARTBEAT_IVL, self.heartbeat_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.heartbeat_timeout_ms)
            sock.setsockopt(zmq.HEARTBEAT_TTL, self.heartbeat_timeout_ms)  # the peer's side too
            # a connection whose handshake stalls (made into a partition) is retried as soon
            sock.setsockopt(zmq.HANDSHAKE_IVL, self.heartbeat_timeout_ms)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a gone peer errors, not vanishes
        if secure:
            assert self.keys is not None
            if bind:
                sock.curve_server = True
                sock.curve_secretkey = self.keys.server_secret
                sock.curve_publickey = self.keys.server_public
            else:
                sock.curve_serverkey = self.keys.server_public
                sock.curve_publickey = self.keys.client_public
                sock.curve_secretkey = self.keys.client_secret
        try:
            if bind:
                sock.bind(bind)
            else:
                sock.connect(connect)
        except zmq.ZMQError as e:
            sock.close(0)
            raise TransportError(f"cannot {'bind' if bind else 'connect'} {address}: {e}") from None
        return sock


# --------------------------------------------------------------------------------------------
# Request-reply
# --------------------------------------------------------------------------------------------

Handler = Callable[[Any, bytes], Awaitable[Any]]

# -- the hot path: fewer Python layers per message -------------------------------------------
#
# pyzmq's asyncio socket sends and receives through its blocking-API "sugar" layer, which pays
# for flag enums and type checks on every frame, and through a Future per call. A message of
# the data plane has 6 frames and more (a Batch has 4 per sample), so the two helpers
# below do what pyzmq's own fast paths do, frame by frame with plain int flags:
# - `_send_now`: pyzmq's "short-circuit" send, attempted when no send waits on the socket;
# - `_drain`: non-blocking reads of what is already queued, for the reader loops.
# They use the asyncio socket's bookkeeping (`_shadow_sock`, `_send_futures`, `_recv_futures`,
# `_schedule_remaining_events`: private, long-standing, checked here with pyzmq 27); a socket
# without it takes pyzmq's public path for every send and receive (same behaviour, slower).

_DRAIN = 64  # messages read from a socket per wake-up before the event loop has its turn
_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = _NOBLOCK | _SNDMORE


def _fast(sock: Any) -> bool:
    return (getattr(sock, "_shadow_sock", None) is not None
            and getattr(sock, "_send_futures", None) is not None
            and getattr(sock, "_recv_futures", None) is not None
            and hasattr(sock, "_schedule_remaining_events"))


def _send_now(sock: Any, frames: list[Any]) -> bool:
    """Send `frames` at once if the socket can take them (True); False: nothing was sent, the
    caller awaits `sock.send_multipart` (a full high-water mark, a send already waiting).

    Arrays go zero-copy above pyzmq's copy threshold. A multipart message is atomic in ZeroMQ:
    once its first frame is accepted the others are too, so EAGAIN can only come first.
    """
    if not _fast(sock) or sock.closed or sock._send_futures:
        return False
    send = sock._shadow_sock.send
    try:
        send(frames[0], _NOBLOCK_MORE if len(frames) > 1 else _NOBLOCK, copy=False)
    except zmq.Again:
        return False
    last = len(frames) - 1
    for i in range(1, last):
        send(frames[i], _NOBLOCK_MORE, copy=False)
    if last:
        send(frames[last], _NOBLOCK, copy=False)
    if sock._recv_futures:
        # The send may have consumed the socket's edge-triggered wake-up for a message that
        # arrived meanwhile: have pyzmq look again, as its own short-circuit send does.
        sock._schedule_remaining_events()
    return True


async def send_frames(sock: Any, frames: list[Any]) -> None:
    if not _send_now(sock, frames):
        await sock.send_multipart(frames, copy=False)


async def recv_frames(sock: Any) -> list[Any]:
    """`sock.recv_multipart(copy=False)`, awaiting only the first frame: the rest of a
    multipart message is there once its first frame is (ZeroMQ delivers it whole), read with
    plain int flags. pyzmq's own asks the socket RCVMORE through its enum-typed option layer
    for every frame, which a batch of 32 groups (about 200 frames) pays 200 times. For one
    reader per socket (every reader loop here); with another receive waiting, pyzmq's own."""
    if not _fast(sock) or sock._recv_futures:
        return await sock.recv_multipart(copy=False)
    frame = await sock.recv(copy=False)
    parts = [frame]
    if frame.more:
        recv = sock._shadow_sock.recv
        while frame.more:
            frame = recv(_NOBLOCK, copy=False)
            parts.append(frame)
    return parts


def _drain(sock: Any, limit: int = _DRAIN) -> list[list[Any]]:
    """The messages already queued on `sock` (at most `limit`), read without a Future, a
    callback and a loop iteration each.

    Only for a loop that reads continuously and awaits `sock.recv_multipart` again whenever
    this returns fewer than `limit`: that await re-checks the socket's (edge-triggered) events,
    so a send waiting on the same socket is not left asleep by these reads.
    """
    out: list[list[Any]] = []
    if not _fast(sock) or sock.closed:
        return out
    recv = sock._shadow_sock.recv
    try:
        while len(out) < limit:
            frame = recv(_NOBLOCK, copy=False)
            parts = [frame]
            while frame.more:  # the rest of a multipart message is there already
                frame = recv(_NOBLOCK, copy=False)
                parts.append(frame)
            out.append(parts)
    except zmq.Again:
        pass
    return out


@dataclass
class ServerStats:
    requests: int = 0
    replies: int = 0
    protocol_errors: int = 0
    handler_errors: int = 0
    forbidden: int = 0
    last_error: str = ""


class RpcServer:
    """ROUTER: [peer, corr id, type, body, *buffers] -> handler(record, peer) -> reply record.

    A malformed message is answered with ErrorReply(code="protocol") when its envelope is
    readable, and counted either way; the server keeps serving. Handlers run as tasks, so a
    slow one (a long poll) does not hold up the others.

    A handler may return an async iterator instead of a record: a stream, each record it yields
    sent under the request's correlation id (`RpcClient.stream` receives them) until it ends,
    or until a send fails (the peer is gone), which closes it.

    On a CURVE socket every request carries its sender's identity (`sender_of`); a handler
    reads it as `SENDER.get()`. `allow` says which roles (`role_of` the identity) may send
    each record type (None: any identity of the run); a request from any other is answered
    ErrorReply(code="forbidden"), counted and logged, and never reaches its handler. A
    record type missing from `allow` is refused to everybody.
    """

    def __init__(
        self,
        transport: Transport,
        address: str,
        handlers: dict[type, Handler],
        *,
        secure: bool | None = None,
        name: str = "rpc",
        max_concurrent: int = 1024,
        allow: dict[type, Any] | None = None,
    ):
        self.sock = transport.socket(zmq.ROUTER, bind=address, secure=secure)
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.secure = bool(self.sock.getsockopt(zmq.CURVE_SERVER))
        self.handlers = dict(handlers)
        self.allow = None if allow is None else {
            t: None if who is None else frozenset(who) for t, who in allow.items()}
        self.name = name
        self.stats = ServerStats()
        self._slots = asyncio.Semaphore(max_concurrent)
        self._tasks: set[asyncio.Task] = set()

    async def serve(self) -> None:
        try:
            while True:
                batch = [await recv_frames(self.sock)]
                batch += _drain(self.sock, _DRAIN - 1)
                for frames in batch:
                    await self._slots.acquire()
                    task = asyncio.create_task(self._handle(frames))
                    self._tasks.add(task)
                    task.add_done_callback(self._done)
                if len(batch) == _DRAIN:
                    await asyncio.sleep(0)  # a flood: let the handlers run before reading on
        finally:
            for task in list(self._tasks):
                task.cancel()

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._slots.release()

    async def _handle(self, frames: list[Any]) -> None:
        self.stats.requests += 1
        if len(frames) < 2:
            self._protocol_error(f"no envelope ({len(frames)} frames)")
            return
        peer, corr = frames[0].bytes, frames[1].bytes
        if len(corr) > 16:
            self._protocol_error(f"correlation id of {len(corr)} bytes")
            return
        try:
            request = protocol.decode(frames[2:])
            handler = self.handlers.get(type(request))
            if handler is None:
                raise ProtocolError(f"{self.name} does not handle {type(request).__name__}")
        except ProtocolError as e:
            self._protocol_error(str(e))
            await self._reply(peer, corr, ErrorReply(code="protocol", message=str(e)))
            return
        if self.secure:
            sender = sender_of(frames[2])
            refused = self._refuse(sender, type(request))
            if refused:
                await self._reply(peer, corr, ErrorReply(code="forbidden", message=refused))
                return
            SENDER.set(sender)  # this request's task's own context
        try:
            reply = await handler(request, peer)
            if hasattr(reply, "__anext__"):
                await self._stream(peer, corr, reply)
                return
        except asyncio.CancelledError:
            raise
        except Forbidden as e:
            self._forbid(SENDER.get(), type(request), str(e))
            reply = ErrorReply(code="forbidden", message=str(e))
        except Exception as e:
            self.stats.handler_errors += 1
            log.exception("handler_failed", server=self.name, request=type(request).__name__)
            reply = ErrorReply(code="handler", message=f"{type(e).__name__}: {e}")
        if reply is not None:
            await self._reply(peer, corr, reply)

    async def _stream(self, peer: bytes, corr: bytes, items: Any) -> None:
        try:
            async for item in items:
                if not await self._reply(peer, corr, item):
                    break  # the peer is gone: nobody reads the rest
        finally:
            close = getattr(items, "aclose", None)
            if close is not None:
                await close()

    def _refuse(self, sender: str | None, kind: type) -> str:
        """Why `sender` may not send `kind` here; "" if it may."""
        if sender is None:
            why = f"{self.name} refuses {kind.__name__} from a connection without an identity"
        elif self.allow is None:
            return ""
        else:
            who = self.allow.get(kind, frozenset())
            if who is None or role_of(sender) in who:
                return ""
            why = (f"{sender} may not send {kind.__name__} to the {self.name} (only "
                   f"{', '.join(sorted(who)) or 'nobody'})")
        return self._forbid(sender, kind, why)

    def _forbid(self, sender: str | None, kind: type, why: str) -> str:
        self.stats.forbidden += 1
        note_forbidden(self.name, self.stats.forbidden, sender=sender, request=kind.__name__,
                       reason=why)
        return why

    def _protocol_error(self, reason: str) -> None:
        self.stats.protocol_errors += 1
        self.stats.last_error = reason
        PROTOCOL_ERRORS[self.name] += 1
        # One line per bad message would let a hostile peer flood the log: log the 1st, 10th...
        n = self.stats.protocol_errors
        if n & (n - 1) == 0 or n % 1000 == 0:
            log.warning("protocol_error", server=self.name, reason=reason, count=n)

    async def _reply(self, peer: bytes, corr: bytes, reply: Any) -> bool:
        try:
            await send_frames(self.sock, [peer, corr, *protocol.encode(reply)])
            self.stats.replies += 1
            return True
        except zmq.ZMQError as e:  # peer gone (ROUTER_MANDATORY) or HWM: the client will retry
            log.warning("reply_dropped", server=self.name, error=str(e))
            return False

    def close(self) -> None:
        self.sock.close(0)


class RpcClient:
    """DEALER with correlation ids: many requests in flight, each with its own timeout.

    On a timeout the socket is rebuilt (dropping whatever ZeroMQ still queued for a dead peer)
    and every pending request is sent again, up to `retries` times; then `PeerTimeout`.
    """

    def __init__(
        self,
        transport: Transport,
        address: str,
        *,
        timeout_s: float = 5.0,
        retries: int = 2,
        secure: bool | None = None,
        name: str = "rpc",
    ):
        self.transport = transport
        self.address = address
        self.timeout_s = timeout_s
        self.retries = retries
        self.secure = secure
        self.name = name
        self._ids = itertools.count(1)
        self._pending: dict[bytes, tuple[asyncio.Future, list[Any]]] = {}
        self._streams: dict[bytes, RpcStream] = {}
        self._sock: zmq.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None  # resends pending requests on a disconnect
        # The last request got no reply at all: the next one starts on a fresh socket (a
        # caller with retries=0, such as a Heartbeater, would otherwise never rebuild one).
        self._stale = False

    def _connect(self) -> None:
        self._sock = self.transport.socket(
            zmq.DEALER, connect=self.address, secure=self.secure, linger_ms=0
        )
        self._reader = asyncio.create_task(self._read(self._sock))
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        # the transport closes it with its other sockets: an open monitor socket left by a
        # client nobody closed would block the context's term() forever
        self.transport._sockets.add(self._monitor)
        self._watcher = asyncio.create_task(self._resend_on_disconnect(self._sock, self._monitor))

    async def _resend_on_disconnect(self, sock: zmq.Socket, monitor: zmq.Socket) -> None:
        """A connection dropped (a ZMTP heartbeat timeout after a partition, a reset): what was
        written to it may be lost, so every pending request is sent again at once, to go out on
        the next connection, instead of waiting out its timeout (the same resend as a retry)."""
        while True:
            await monitor.recv_multipart()
            for stream in list(self._streams.values()):
                stream._break("the connection dropped")  # what it was sent may be lost
            for corr, (future, frames) in list(self._pending.items()):
                if not future.done():
                    try:
                        sent = sock.send_multipart([corr, *frames], copy=False, flags=zmq.NOBLOCK)
                    except zmq.ZMQError:
                        continue
                    if isinstance(sent, asyncio.Future):  # an asyncio socket: Again lands here
                        sent.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _disconnect(self) -> None:
        for stream in list(self._streams.values()):
            stream._break("the socket was rebuilt")  # the server streams to the old one
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
        self._reader = self._watcher = None
        if self._sock is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(0)
            self._sock.close(0)
            self._sock = None

    async def _read(self, sock: zmq.Socket) -> None:
        while True:
            batch = [await recv_frames(sock)]
            batch += _drain(sock, _DRAIN - 1)
            for frames in batch:
                self._deliver(frames)
            if len(batch) == _DRAIN:
                await asyncio.sleep(0)

    def _deliver(self, frames: list[Any]) -> None:
        if not frames:
            return
        corr = frames[0].bytes
        entry = self._pending.get(corr)
        if entry is None and self._streams:
            stream = self._streams.get(corr)
            if stream is not None:
                try:
                    stream._items.put_nowait(protocol.decode(frames[1:]))
                except ProtocolError as e:
                    stream._items.put_nowait(e)
                return
        if entry is None or entry[0].done():
            return  # a late reply to a request already answered or abandoned
        try:
            entry[0].set_result(protocol.decode(frames[1:]))
        except ProtocolError as e:
            entry[0].set_exception(e)

    async def request(self, rec: Any, *, timeout_s: float | None = None,
                      retries: int | None = None) -> Any:
        """Send a record, return the reply record. ErrorReply -> RemoteError."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        retries = self.retries if retries is None else retries
        if self._sock is None:
            self._connect()
        elif self._stale:
            self._rebuild()
        self._stale = False
        corr = next(self._ids).to_bytes(8, "big")
        frames = protocol.encode(rec)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending[corr] = (future, frames)
        try:
            for attempt in range(retries + 1):
                if attempt:
                    log.info("rpc_retry", peer=self.address, request=type(rec).__name__,
                             attempt=attempt)
                    self._rebuild()
                else:
                    await self.send_frames(corr, frames)
                # asyncio.wait leaves the future pending on a timeout (no shield, no extra task)
                await asyncio.wait((future,), timeout=timeout_s)
                if future.done():
                    reply = future.result()
                    break
            else:
                self._stale = True
                raise PeerTimeout(
                    f"no reply from {self.address} to {type(rec).__name__} after "
                    f"{retries + 1} attempt(s) of {timeout_s:g}s: is the {self.name} peer alive?"
                )
        finally:
            self._pending.pop(corr, None)
            if not future.done():
                future.cancel()
        if isinstance(reply, ErrorReply):
            raise RemoteError(reply.code, reply.message)
        return reply

    async def stream(self, rec: Any) -> RpcStream:
        """Send a request the server answers with a stream of records (see RpcServer); read
        them with the returned stream's `next`. Not sent again on a timeout or a reconnect:
        the stream then says it is broken, and the caller asks anew from where it stands."""
        if self._sock is None:
            self._connect()
        elif self._stale:
            self._rebuild()
        corr = next(self._ids).to_bytes(8, "big")
        stream = RpcStream(self, corr, type(rec).__name__)
        self._streams[corr] = stream
        await self.send_frames(corr, protocol.encode(rec))
        return stream

    async def send_frames(self, corr: bytes, frames: list[Any]) -> None:
        assert self._sock is not None
        await send_frames(self._sock, [corr, *frames])

    def _rebuild(self) -> None:
        self._disconnect()
        self._connect()
        assert self._sock is not None
        for corr, (future, frames) in self._pending.items():
            if not future.done():
                # The fresh socket has no peer yet: queue without blocking (HWM bounds it).
                try:
                    self._sock.send_multipart([corr, *frames], copy=False, flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass

    def close(self) -> None:
        self._disconnect()
        for future, _ in self._pending.values():
            if not future.done():
                future.cancel()
        self._pending.clear()
        self._streams.clear()


class StreamBroken(ConnectionError):
    """A stream's connection dropped or was rebuilt: what it carried since may be lost."""


class RpcStream:
    """The records a server streams in answer to one request (`RpcClient.stream`)."""

    def __init__(self, client: RpcClient, corr: bytes, request: str):
        self.client, self.corr, self.request = client, corr, request
        self._items: asyncio.Queue[Any] = asyncio.Queue()
        self.broken: str | None = None

    def _break(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
            self._items.put_nowait(StreamBroken(f"{self.request} stream from "
                                                f"{self.client.address}: {why}"))

    async def next(self, timeout_s: float | None = None) -> Any:
        """The next record; PeerTimeout if none came within `timeout_s`, StreamBroken if the
        connection dropped (nothing more will come), RemoteError for an ErrorReply."""
        try:
            item = await asyncio.wait_for(self._items.get(), timeout_s)
        except asyncio.TimeoutError:
            raise PeerTimeout(f"nothing from {self.client.address} on the {self.request} stream "
                              f"for {timeout_s:g}s") from None
        if isinstance(item, BaseException):
            if isinstance(item, StreamBroken):
                self._items.put_nowait(item)  # and again for every later call
            raise item
        if isinstance(item, ErrorReply):
            raise RemoteError(item.code, item.message)
        return item

    def close(self) -> None:
        """Stop listening: whatever the server still sends on it is dropped."""
        self.client._streams.pop(self.corr, None)
