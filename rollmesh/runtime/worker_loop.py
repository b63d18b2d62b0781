"""The serve loop the agent and reward workers share: their side of the rollouter's channel.

A worker joins with its credits (`WorkerHello`), says hello again when the rollouter falls
silent (a restarted rollouter does not know it: `runtime.rejoin_when_silent`), answers the
rollouter's heartbeats and stats requests, and hands every other message to its own `handle`
(Assign, Cancel and Resume for an agent worker; Score for a reward worker).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from rollmesh.wire.messages import Heartbeat, Metrics, StatsRequest, WorkerHello
from rollmesh.runtime.process import RoleContext, rejoin_when_silent
from rollmesh.wire.channels import ChannelClient


async def serve_worker(ctx: RoleContext, channel: ChannelClient, *, name: str,
                       kind: Literal["agent", "reward"], credits: int,
                       handle: Callable[[Any], Awaitable[None]],
                       stats: Callable[[], dict[str, Any]]) -> None:
    """Serve the rollouter on `channel` until cancelled; `stats()` answers a StatsRequest (as
    role `<kind>_worker`)."""

    async def hello() -> None:
        await channel.send(WorkerHello(worker=name, kind=kind, credits=credits))

    await hello()
    heard = time.monotonic()
    spec = ctx.spec
    rejoin = asyncio.create_task(rejoin_when_silent(hello, lambda: heard, spec.heartbeat_s,
                                                    spec.liveness, ctx.log))
    try:
        while True:
            msg = await channel.recv()
            heard = time.monotonic()
            if isinstance(msg, Heartbeat):
                await channel.send(Heartbeat(sender=name, seq=msg.seq))
            elif isinstance(msg, StatsRequest):
                await channel.send(Metrics(role=f"{kind}_worker", host=spec.host, values=stats()))
            else:
                await handle(msg)
    finally:
        rejoin.cancel()
