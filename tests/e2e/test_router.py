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
