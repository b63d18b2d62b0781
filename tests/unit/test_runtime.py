"""Role processes for real: handshake, live sockets, garbage, crashes, signals, parent death."""

from __future__ import annotations

import asyncio
import os
import textwrap
import time
from pathlib import Path

import pytest
import zmq

from rollmesh.launcher.supervisor import Supervisor
from rollmesh.wire.transport import RpcClient, Transport

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(ROOT)}


def with_supervisor(body, heartbeat_s=0.5, **kwargs):
    async def main():
        with Transport() as t:
            sup = Supervisor(t, heartbeat_s=heartbeat_s, **kwargs)
            try:
                return await body(t, sup)
            finally:
                await sup.close(grace_s=5)

    return asyncio.run(main())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is not alive
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


PARENT = textwrap.dedent("""
    import asyncio, os, sys
    from pathlib import Path
    from rollmesh.launcher.supervisor import Supervisor
    from rollmesh.wire.transport import Transport

    async def main():
        t = Transport()
        sup = Supervisor(t, heartbeat_s=0.25, liveness=3, log_dir=Path(sys.argv[2]))
        child = sup.spawn("echo", "tests.helpers.roles:echo", env={"PYTHONPATH": sys.argv[1]})
        await sup.wait_ready(child, 60)
        print("CHILD", child.process.pid, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


def test_ready_gives_up_on_a_parent_that_stops_answering_only_when_asked_to_stop():
    """The parent can die between seeing Ready and answering it: the role must wind down on
    its stop signal then, not fail on a PeerTimeout; without a stop the timeout is an error."""
    from rollmesh.runtime.log import get_logger
    from rollmesh.runtime.process import RoleContext, RoleSpec
    from rollmesh.wire.transport import PeerTimeout

    async def main(stop_after: float | None):
        with Transport() as t:
            silent = t.sync_ctx.socket(zmq.ROUTER)  # a parent that reads and never answers
            port = silent.bind_to_random_port("tcp://127.0.0.1")
            spec = RoleSpec(role="echo", entry="tests.helpers.roles:echo",
                            control=f"tcp://127.0.0.1:{port}")
            control = RpcClient(t, spec.control, timeout_s=1.0, retries=0, name="parent")
            ctx = RoleContext(spec, t, control, get_logger("test"))
            if stop_after is not None:
                asyncio.get_running_loop().call_later(stop_after, ctx.stopping.set)
            started = time.monotonic()
            try:
                await ctx.ready(rpc="tcp://127.0.0.1:1")
                return ctx.is_ready, time.monotonic() - started
            finally:
                control.close()
                silent.close(0)

    is_ready, took = asyncio.run(main(stop_after=0.1))
    assert not is_ready and took < 0.9, took
    with pytest.raises(PeerTimeout):
        asyncio.run(main(stop_after=None))
