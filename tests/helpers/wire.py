"""Wire pieces only the tests use: a `Shutdown` request (an arbitrary request type for RPC
tests, answered by `tests.roles`) and PUSH/PULL streams (`Pusher`, `Puller`) over the
package's `Transport`, for the transport and fuzz tests. No role sends either."""

from __future__ import annotations

import asyncio
from typing import Any

import zmq

from rollmesh.wire import protocol
from rollmesh.wire.protocol import record
from rollmesh.wire.transport import Transport, _send_now
from rollmesh.wire.channels import _Receiver


@record
class Shutdown:
    """Ask a process to stop gracefully."""

    reason: str = ""


class Pusher:
    """PUSH end of a stream. `send` waits while the high-water mark is reached (back-pressure
    is visible, never an unbounded queue)."""

    def __init__(self, transport: Transport, *, bind: str | None = None,
                 connect: str | None = None, secure: bool | None = None, hwm: int | None = None):
        self.sock = transport.socket(zmq.PUSH, bind=bind, connect=connect, secure=secure, hwm=hwm)

    async def send(self, rec: Any, timeout_s: float | None = None) -> None:
        frames = protocol.encode(rec)
        if _send_now(self.sock, frames):
            return
        coro = self.sock.send_multipart(frames, copy=False)
        if timeout_s is None:
            await coro
        else:
            await asyncio.wait_for(coro, timeout_s)

    def close(self) -> None:
        self.sock.close()


class Puller(_Receiver):
    """PULL end of a stream. Malformed messages are counted and skipped."""

    where = "pull"

    def __init__(self, transport: Transport, *, bind: str | None = None,
                 connect: str | None = None, secure: bool | None = None, hwm: int | None = None):
        self.sock = transport.socket(zmq.PULL, bind=bind, connect=connect, secure=secure, hwm=hwm)

    def close(self) -> None:
        self.sock.close()
