"""Small role entry points the tests start as real role processes (`rollmesh role`)."""

from __future__ import annotations

import asyncio
import dataclasses

from rollmesh.wire.messages import Group, Metrics, Ok, Trajectory
from rollmesh.runtime.process import RoleContext
from rollmesh.wire.transport import RpcServer
from tests.helpers.wire import Shutdown


async def echo(ctx: RoleContext) -> None:
    """Answers Trajectory/Group with the same record, Metrics with its server's error counts."""
    server: RpcServer

    async def same(msg, peer):
        return msg

    async def stats(msg, peer):
        return Metrics(role=ctx.spec.role, host=ctx.spec.host,
                       values=dataclasses.asdict(server.stats))

    async def shutdown(msg, peer):
        ctx.stopping.set()
        return Ok(message="bye")

    server = RpcServer(ctx.transport, ctx.config.get("bind", "tcp://127.0.0.1:0"),
                       {Trajectory: same, Group: same, Metrics: stats, Shutdown: shutdown},
                       name="echo")
    serving = asyncio.create_task(server.serve())
    await ctx.ready(rpc=server.address)
    await ctx.stopping.wait()
    serving.cancel()
    server.close()


async def crash(ctx: RoleContext) -> None:
    raise RuntimeError("boom: the role could not start")


async def stubborn(ctx: RoleContext) -> None:
    """Ignores SIGTERM's stop request: only SIGKILL (or the grace period) ends it."""
    await ctx.ready()
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(3600)  # refuse cancellation too
