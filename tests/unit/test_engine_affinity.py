"""EngineClient's affinity routing against small real HTTP servers (aiohttp, the /generate
contract's shape): a key's requests go to one server by rendezvous hashing, the same in every
client; a load bound sends them elsewhere; a dead preferred server is skipped and a request whose
server dies is sent again, whole; no key is fewest-in-flight as before; and the client counts each
server's prompt and cached tokens from the answers."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from rollmesh.engine.client import EngineClient, rendezvous_weight


class Server:
    """A /generate server that records what it got, holds answers while `hold` is clear, and
    reports as cached the prompt tokens it saw before (a prefix cache of whole prompts minus the
    last token, as an engine's radix cache would find a sibling's prompt). `down`: 503."""

    def __init__(self) -> None:
        self.rids: list[str] = []
        self.hold = asyncio.Event()
        self.hold.set()
        self.arrived = asyncio.Event()  # set at each request (tests wait for in-flight counts)
        self.down = False
        self.aborted: list[str] = []
        self.seen: set[tuple[int, ...]] = set()
        self.url = ""

    async def start(self) -> str:
        async def generate(request: web.Request) -> web.Response:
            body = await request.json()
            if self.down:
                return web.json_response({"error": "not serving"}, status=503)
            self.rids.append(body["rid"])
            self.arrived.set()
            prompt = tuple(body["input_ids"])
            cached = len(prompt) - 1 if prompt in self.seen else 0
            self.seen.add(prompt)
            await self.hold.wait()
            if self.down:  # it died while the request ran
                return web.json_response({"error": "not serving"}, status=503)
            meta = {"id": body["rid"], "finish_reason": {"type": "length", "length": 1},
                    "prompt_tokens": len(prompt), "cached_tokens": cached,
                    "weight_version": "0", "output_token_logprobs": [[-1.0, 7, None]],
                    "output_token_weight_versions": [0]}
            return web.json_response({"text": "", "output_ids": [7], "meta_info": meta})

        async def health(_: web.Request) -> web.Response:
            return web.Response(status=503 if self.down else 200)

        async def abort(request: web.Request) -> web.Response:
            self.aborted.append((await request.json())["rid"])
            return web.json_response({})

        app = web.Application()
        app.router.add_post("/abort_request", abort)
        app.router.add_post("/generate", generate)
        app.router.add_get("/health", health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore
        return self.url

    async def stop(self) -> None:
        self.hold.set()
        await self.runner.cleanup()


async def servers(n: int) -> list[Server]:
    out = [Server() for _ in range(n)]
    for s in out:
        await s.start()
    return out


PARAMS = {"max_new_tokens": 1}
PROMPT = list(range(100, 300))


def by_server(pool: list[Server]) -> list[int]:
    return [len(s.rids) for s in pool]


def test_rendezvous_is_deterministic_across_clients_and_server_order():
    """Two clients (two agent-worker processes) with the server list in another order pick the
    same server for every key; keys spread over all servers; a server that goes away moves only
    its own keys."""
    urls = [f"http://10.0.0.{i}:30000" for i in range(1, 5)]
    a, b = EngineClient(urls), EngineClient(list(reversed(urls)))
    keys = [f"e0-r{i}-s0" for i in range(400)]
    assert [a.preferred(k) for k in keys] == [b.preferred(k) for k in keys]
    counts = {u: sum(a.preferred(k) == u for k in keys) for u in urls}
    assert all(60 < n < 140 for n in counts.values()), counts  # ~100 each
    assert rendezvous_weight("g", urls[0]) == rendezvous_weight("g", urls[0])
    before = {k: a.preferred(k) for k in keys}
    a.servers[0].healthy = False
    after = {k: a.preferred(k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == urls[0] for k in moved)


def test_a_groups_siblings_from_two_clients_go_to_one_server():
    async def main():
        pool = await servers(3)
        urls = [s.url for s in pool]
        async with EngineClient(urls) as c1, EngineClient(urls[::-1]) as c2:
            for g in range(6):
                key = f"group-{g}"
                before = by_server(pool)
                # 8 siblings at once, split between the two clients (two agent workers)
                await asyncio.gather(*[(c1 if k % 2 else c2).generate(
                    PROMPT + [g], PARAMS, affinity=key) for k in range(8)])
                gained = [s.url for s, n in zip(pool, before) if len(s.rids) > n]
                assert gained == [c1.preferred(key)] == [c2.preferred(key)]
            # every group entirely on its preferred server
            for s in pool:
                expected = sum(c1.preferred(f"group-{g}") == s.url for g in range(6)) * 8
                assert len(s.rids) == expected, (by_server(pool), expected)
            # a multi-turn trajectory: its later turns (longer prompts) go there too
            key = "group-0"
            before = {s.url: len(s.rids) for s in pool}
            for turn in range(3):
                await c2.generate(PROMPT + list(range(turn * 10)), PARAMS, affinity=key)
            gained = [s.url for s in pool if len(s.rids) > before[s.url]]
            assert gained == [c1.preferred(key)]
        for s in pool:
            await s.stop()

    asyncio.run(main())


def test_the_load_bound_sends_overflow_to_the_keys_next_server():
    """With requests held, a key's server takes up to the bound (here: the fewest + slack 3,
    the factor's mean being lower), then the key's next server in rendezvous order takes the
    rest, and the choice is again the same in a second client."""
    async def main():
        pool = await servers(3)
        urls = [s.url for s in pool]
        for s in pool:
            s.hold.clear()
        async with EngineClient(urls, affinity_slack=3) as client:
            key = "big-group"
            order = sorted(urls, key=lambda u: rendezvous_weight(key, u), reverse=True)
            tasks = [asyncio.create_task(client.generate(PROMPT, PARAMS, affinity=key))
                     for _ in range(5)]
            while sum(s.in_flight for s in client.servers) < 5:
                await asyncio.sleep(0.01)
            flight = {s.url: s.in_flight for s in client.servers}
            # first 3 on the key's server (in flight 0, 1, 2 < 0 + 3), then its next server
            assert [flight[u] for u in order] == [3, 2, 0], flight
            for s in pool:
                s.hold.set()
            await asyncio.gather(*tasks)
            # no key: unaffected by keys, the fewest in flight (here: all idle, round-robin)
            for s in pool:
                s.rids.clear()
            await asyncio.gather(*[client.generate(PROMPT, PARAMS) for _ in range(3)])
            assert by_server(pool) == [1, 1, 1]
        for s in pool:
            await s.stop()

    asyncio.run(main())


def test_the_load_factor_bounds_a_busy_server():
    """Under load, the factor rules: a key's server with far more than the mean in flight is
    passed over; least_loaded routing ignores keys."""
    client = EngineClient(["http://a:1", "http://b:1"], affinity_slack=0,
                          affinity_load_factor=1.25)
    key = "k"
    first = client.preferred(key)
    other = next(s for s in client.servers if s.url != first)
    pref = next(s for s in client.servers if s.url == first)
    pref.in_flight, other.in_flight = 10, 10
    assert client._pick(affinity=key) is pref  # 10 < 1.25 * 21 / 2
    pref.in_flight, other.in_flight = 15, 7
    assert client._pick(affinity=key) is other  # 15 >= 1.25 * 23 / 2
    plain = EngineClient(["http://a:1", "http://b:1"], routing="least_loaded")
    p_pref = next(s for s in plain.servers if s.url == first)
    p_other = next(s for s in plain.servers if s.url != first)
    p_pref.in_flight, p_other.in_flight = 1, 0
    assert plain._pick(affinity=key) is p_other


def test_bad_routing_options_are_named():
    with pytest.raises(ValueError, match="routing 'nearest'"):
        EngineClient(["http://a:1"], routing="nearest")
    with pytest.raises(ValueError, match="affinity_load_factor"):
        EngineClient(["http://a:1"], affinity_load_factor=0.5)
    with pytest.raises(ValueError, match="affinity_slack"):
        EngineClient(["http://a:1"], affinity_slack=-1)


def test_a_dead_preferred_server_is_skipped_and_a_request_on_it_fails_over():
    async def main():
        pool = await servers(2)
        urls = [s.url for s in pool]
        key = "g-failover"
        async with EngineClient(urls, wait_s=30, backoff_s=0.05,
                                health_interval_s=0.2) as client:
            pref = next(s for s in pool if s.url == client.preferred(key))
            other = next(s for s in pool if s is not pref)
            # a request running on the preferred server when it dies: sent again, whole
            pref.hold.clear()
            task = asyncio.create_task(client.generate(PROMPT, PARAMS, affinity=key,
                                                       rid="r-moved"))
            await asyncio.wait_for(pref.arrived.wait(), 10)
            pref.down = True
            pref.hold.set()
            out = await asyncio.wait_for(task, 20)
            assert out.server == other.url and other.rids == ["r-moved"]
            # while it is down its keys go to their next server
            out = await client.generate(PROMPT, PARAMS, affinity=key)
            assert out.server == other.url
            # back up: the key goes home again
            pref.down = False
            for _ in range(100):
                if client.healthy_count == 2:
                    break
                await asyncio.sleep(0.05)
            out = await client.generate(PROMPT, PARAMS, affinity=key)
            assert out.server == pref.url
        for s in pool:
            await s.stop()

    asyncio.run(main())


def test_abort_finds_a_keyed_request_on_its_server():
    async def main():
        pool = await servers(2)
        async with EngineClient([s.url for s in pool]) as client:
            key = "g-abort"
            pref = next(s for s in pool if s.url == client.preferred(key))
            pref.hold.clear()
            task = asyncio.create_task(client.generate(PROMPT, PARAMS, affinity=key,
                                                       rid="r-abort"))
            await asyncio.wait_for(pref.arrived.wait(), 10)
            assert await client.abort("r-abort") is True
            pref.hold.set()
            await task
        assert [s.aborted for s in pool if s is pref] == [["r-abort"]]
        assert all(s.aborted == [] for s in pool if s is not pref)
        for s in pool:
            await s.stop()

    asyncio.run(main())


def test_cache_stats_accumulate_per_server_from_the_answers():
    async def main():
        pool = await servers(2)
        async with EngineClient([s.url for s in pool]) as client:
            assert all(v == {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0,
                             "hit_rate": None} for v in client.cache_stats().values())
            for _ in range(4):  # one group of 4 on one server: 3 of them find the prompt
                await client.generate(PROMPT, PARAMS, affinity="g-cache")
            stats = client.cache_stats()
            home = stats[client.preferred("g-cache")]
            assert home == {"requests": 4, "prompt_tokens": 800, "cached_tokens": 3 * 199,
                            "hit_rate": round(597 / 800, 4)}
            other = next(v for u, v in stats.items() if u != client.preferred("g-cache"))
            assert other["requests"] == 0
        for s in pool:
            await s.stop()

    asyncio.run(main())


def test_agent_loops_key_by_group_across_workers_turns_and_resumes():
    """LoopContext.generate passes the trajectory's group id: two workers' contexts (their own
    clients) send a group's siblings, each one's later turns and a resumed trajectory (handed to
    the other worker) to the group's server."""
    from rollmesh.agents.loops import LoopContext
    from rollmesh.config import RolloutConfig
    from rollmesh.core.trajectory import new_trajectory

    async def main():
        pool = await servers(3)
        urls = [s.url for s in pool]
        async with EngineClient(urls) as c1, EngineClient(urls[::-1]) as c2:
            workers = [LoopContext(c, None, RolloutConfig(), max_context=4096,
                                   cancelling=asyncio.Event()) for c in (c1, c2)]
            for w in workers:
                w.per_token_versions = True  # no version probe: the fake engines report "0"
            for g in range(4):
                group = f"e0-r{g}-s0"
                trajs = [new_trajectory(f"{group}-{k:03d}", group, k, PROMPT,
                                        agent_loop="single_turn")
                         for k in range(4)]
                for turn in range(2):  # two turns each, siblings on both workers
                    await asyncio.gather(*[workers[k % 2].generate(t, 1)
                                           for k, t in enumerate(trajs)])
                await workers[1].generate(trajs[0], 1)  # resumed on the other worker
                assert c1.preferred(group) == c2.preferred(group)
            for s in pool:  # every request went to its group's server
                expected = 9 * sum(c1.preferred(f"e0-r{g}-s0") == s.url for g in range(4))
                assert len(s.rids) == expected, (by_server(pool), expected)
        for s in pool:
            await s.stop()

    asyncio.run(main())


def test_metrics_rows_get_the_hit_rate_of_the_prompt_tokens_sent_since_the_last_row():
    """The trainer's PrefixCacheFigures, fed the agent workers' status as the hub delivers it:
    per row, the share of the prompt tokens sent since the row before that the engines found
    cached, overall and per engine; a restarted worker's counters count from zero."""
    from rollmesh.training.role import PrefixCacheFigures
    from rollmesh.wire.messages import Metrics

    def status(worker: int, **engines: tuple[int, int]) -> tuple[str, Metrics]:
        figures = {f"http://{u}:1": {"requests": 1, "prompt_tokens": p, "cached_tokens": c,
                                     "hit_rate": None} for u, (p, c) in engines.items()}
        return f"metrics.agent_worker.{worker}", Metrics(
            role="agent_worker", host="h", values={"running": 1, "prefix_cache": figures})

    figures = PrefixCacheFigures(None)
    assert figures.step_metrics() == {}
    figures.take(*status(0, a=(800, 700), b=(200, 0)))
    figures.take(*status(1, a=(200, 100)))
    figures.take("metrics.agent_worker.2", Metrics(role="agent_worker", host="h", values={}))
    assert figures.step_metrics() == {"prefix_cache_hit_rate": 0.6667,
                                      "prefix_cache_hit_rate/a:1": 0.8,
                                      "prefix_cache_hit_rate/b:1": 0.0}
    assert figures.step_metrics() == {}  # nothing sent since
    figures.take(*status(0, a=(1800, 1600), b=(200, 0)))  # 1000 more to a, 900 cached
    figures.take(*status(1, a=(100, 50)))  # worker 1 restarted: 100 sent since
    assert figures.step_metrics() == {"prefix_cache_hit_rate": round(950 / 1100, 4),
                                      "prefix_cache_hit_rate/a:1": round(950 / 1100, 4)}
