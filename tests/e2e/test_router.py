"""Generation through SGLang's router (`engine.router = "sglang-router"`): two real built-in
engines, the real router started by rollmesh's command line, rollmesh's EngineClient. The
outage and in-place sync tests run through it too (tests/e2e/test_engine_outage.py,
test_in_place_sync.py, parametrized over ROUTERS)."""

from __future__ import annotations

import asyncio
import os

import pytest

from rollmesh.engine.client import EngineClient, EngineRequestError
from tests.engine.engine_harness import Engine
from tests.helpers.router import NEEDS_ROUTER, Router

pytestmark = NEEDS_ROUTER

PROMPT = [11, 12, 13, 14, 15]
SHORT = {"max_new_tokens": 6, "ignore_eos": True}
LONG = {"max_new_tokens": 3000, "ignore_eos": True}


def test_generation_goes_through_the_router_and_everything_else_to_each_engine(tmp_path):
    """/generate through the router with the run's API key: the body comes back as the engine
    wrote it (rid, per-token weight versions, log-probs); a group of siblings lands on one
    engine (cache-aware); a caller without the key is refused by the router; pause, weight
    version updates and an abort by rid still reach the engines themselves."""
    key = tmp_path / "engine.token"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"k3y\n")
    os.close(fd)
    engines = [Engine(tmp_path / f"e{i}.log", "--weight-version", "0", "--api-key-file",
                      str(key)) for i in range(2)]
    router = Router([e.url for e in engines], tmp_path / "router.log", api_key_file=str(key))

    async def main():
        urls = [e.url for e in engines]
        async with EngineClient(urls, api_key="k3y", router_url=router.url) as client:
            await client.update_weight_version("3")  # per engine, not through the router
            rids = [client.new_rid() for _ in range(4)]
            group = await asyncio.gather(*(client.generate(PROMPT, SHORT, rid=r)
                                           for r in rids))
            # a long one, aborted by rid: the client does not know its engine
            rid = client.new_rid()
            task = asyncio.create_task(client.generate(PROMPT + [1], LONG, rid=rid))
            while not any(s["running_requests"] for s in await stats(client)):
                await asyncio.sleep(0.05)
            assert await client.abort(rid)
            aborted = await asyncio.wait_for(task, 60)
            await client.pause("abort")
            await client.resume()
            served = [s["generated_tokens"] for s in await stats(client)]
        async with EngineClient(urls, router_url=router.url) as keyless:
            with pytest.raises(EngineRequestError) as refused:
                await keyless.generate(PROMPT, SHORT)
        return rids, group, aborted, refused.value, served

    try:
        rids, group, aborted, refused, served = asyncio.run(main())
    finally:
        router.stop()
        for e in engines:
            e.stop()
    for rid, out in zip(rids, group):
        assert out.server == router.url and out.rid == rid
        assert out.raw["meta_info"]["id"] == rid  # the rid reached the engine unchanged
        assert out.finish_reason == "length" and len(out.output_ids) == SHORT["max_new_tokens"]
        assert len(out.logprobs) == len(out.output_ids)
        assert out.weight_version == "3" and out.token_versions == [3] * len(out.output_ids)
    assert aborted.aborted and len(aborted.output_ids) < LONG["max_new_tokens"]
    assert refused.status == 401
    # cache-aware: the siblings (and the aborted one, same prefix) ran on one engine
    assert sorted(served)[0] == 0, served


async def stats(client: EngineClient) -> list[dict]:
    """Each engine's scheduler state, asked of the engine itself (with the key)."""
    return [info["internal_states"][0] for info in await client.server_info_each()]


@pytest.mark.slow
def test_a_killed_router_is_restarted_and_a_waiting_generation_goes_through_the_new_one(
        tmp_path):
    """The launcher's router supervision at the level of its helpers (no whole launch): the
    router of a real Launcher's plan, pointed at a test engine, killed -9; `restart_router`
    (what the supervision loop calls once the process has exited) starts it again on its port,
    and a generation that found no router meanwhile waits (engine_wait_s) and completes
    through the new one. Past engine.max_restarts within the window the run fails, naming the
    router's log."""
    from rollmesh.config import load_cluster
    from rollmesh.engine.router import RouterPorts, router_launch
    from rollmesh.launcher.launcher import Launcher
    from rollmesh.launcher.plan import PlannedRouter
    from tests.engine.engine_harness import REPO, free_port

    cluster = load_cluster(REPO / "launch/local.toml",
                           ['engine.router="sglang-router"', "engine.max_restarts=1"])
    launcher = Launcher(cluster, tmp_path / "run", echo=False)
    (tmp_path / "run" / "logs").mkdir(parents=True)
    key = tmp_path / "run" / "keys" / "engine.token"  # the run's key, as the launch writes it
    key.parent.mkdir()
    fd = os.open(key, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, launcher.engine_keys.api.encode())
    os.close(fd)
    engine = Engine(tmp_path / "e.log", "--api-key-file", str(key))
    # the planned router (its host, the launch's command line) in front of the test engine
    launcher.router_plan = PlannedRouter(launcher.router_plan.host, router_launch(
        [engine.url], "127.0.0.1", RouterPorts(free_port(), free_port()),
        api_key_file=str(key)))

    async def main():
        launcher.start_router()
        await launcher.wait_router()
        first = launcher.router.process
        first.kill()
        first.wait(10)
        async with EngineClient([engine.url], api_key=launcher.engine_keys.api, wait_s=60,
                                health_interval_s=0.3, backoff_s=0.05,
                                router_url=launcher.router_plan.url) as client:
            task = asyncio.create_task(client.generate(PROMPT, SHORT))
            await asyncio.sleep(0.5)
            assert not task.done() and not client.router.healthy  # no router: it waits
            await launcher.restart_router()
            out = await asyncio.wait_for(task, 60)
        second = launcher.router.process
        second.kill()
        second.wait(10)
        with pytest.raises(RuntimeError) as err:
            await launcher.restart_router()
        return first, second, out, str(err.value)

    try:
        first, second, out, message = asyncio.run(main())
    finally:
        if launcher.router.process is not None and launcher.router.process.poll() is None:
            launcher.router.process.kill()
            launcher.router.process.wait(10)
        engine.stop()
    assert second is not first and launcher.router.restarts == 1
    assert out.server == launcher.router_plan.url and out.finish_reason == "length"
    assert len(out.output_ids) == SHORT["max_new_tokens"]
    assert "keeps exiting" in message and "engine.max_restarts=1" in message, message
    assert "router.log" in message, message
