"""End-to-end tests of cpus (they start processes); the unit tests and the
helpers they share are in tests/unit/test_cpus.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollmesh.launcher.supervisor import Supervisor
from rollmesh.runtime.cpus import (
    format_cpulist,
    thread_env,
)
from rollmesh.wire.transport import Transport
from tests.unit.test_cpus import HERE, ROOT, allowed


@pytest.mark.slow
def test_a_spawned_role_runs_on_its_cpus_with_its_thread_count_also_after_a_respawn(tmp_path):
    """A real role process (tests.helpers.roles:echo) started by the Supervisor as the launcher starts
    every role: /proc says where it may run, its environment its thread count."""
    cpus = (max(HERE),)

    def pinned_state(pid: int) -> tuple[str, str]:
        environ = dict(kv.split("=", 1) for kv in
                       Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in kv)
        return allowed(Path(f"/proc/{pid}/status").read_text()), environ.get("OMP_NUM_THREADS")

    async def main():
        with Transport() as t:
            sup = Supervisor(t, heartbeat_s=0.5, log_dir=tmp_path / "logs")
            try:
                env = {"PYTHONPATH": str(ROOT), **thread_env(cpus, {})}
                child = sup.spawn("echo", "tests.helpers.roles:echo", env=env, cwd=str(ROOT), cpus=cpus)
                await sup.wait_ready(child, 60)
                first = pinned_state(child.pid)
                child.process.kill()
                child.process.wait()
                again = sup.respawn(child)
                await sup.wait_ready(again, 60)
                return first, pinned_state(again.pid), again.pid != child.pid
            finally:
                await sup.close(grace_s=5)

    first, second, fresh = asyncio.run(main())
    assert first == second == (format_cpulist(cpus), "1") and fresh
    log = (tmp_path / "logs" / "echo-0.log").read_text()
    assert f'"cpus": "{format_cpulist(cpus)}"' in log  # the role says what it got
