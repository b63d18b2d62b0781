"""End-to-end tests of engine_client (they start processes); the unit tests and the
helpers they share are in tests/unit/test_engine_client.py."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from rollmesh.engine.client import EngineClient, EngineRequestError
from rollmesh.engine.launch import builtin_argv
from tests.engine.engine_harness import REPO, Engine, repo_env
from tests.unit.test_engine_client import LONG, PROMPT, run, until_running
from tests.unit.test_engine_client import engines  # noqa: F401 - pytest fixtures


@pytest.mark.slow
def test_generate_balances_over_servers_by_in_flight(engines):
    async def main():
        async with EngineClient([e.url for e in engines]) as client:
            await client.wait_healthy(60)
            outs = await asyncio.gather(*(client.generate(PROMPT, {"max_new_tokens": 24,
                                                                   "ignore_eos": True})
                                          for _ in range(8)))
            return outs

    outs = run(main())
    by_server = {e.url: sum(o.server == e.url for o in outs) for e in engines}
    assert by_server == {engines[0].url: 4, engines[1].url: 4}
    for o in outs:
        assert len(o.output_ids) == len(o.logprobs) == 24
        assert o.finish_reason == "length" and all(lp <= 0 for lp in o.logprobs)


@pytest.mark.slow
def test_abort_by_rid_returns_the_partial_output(engines):
    async def main():
        async with EngineClient([e.url for e in engines]) as client:
            rid = client.new_rid()
            task = asyncio.create_task(client.generate(PROMPT, LONG, rid=rid))
            await until_running(engines, 1)
            await asyncio.sleep(0.2)
            assert await client.abort(rid)
            return await task

    out = run(main())
    assert out.aborted and 0 < len(out.output_ids) < LONG["max_new_tokens"]
    assert len(out.logprobs) == len(out.output_ids)


@pytest.mark.slow
def test_pause_aborts_in_flight_and_resume_serves_again(engines):
    async def main():
        async with EngineClient([e.url for e in engines]) as client:
            tasks = [asyncio.create_task(client.generate(PROMPT, LONG)) for _ in range(4)]
            await until_running(engines, 4)
            await asyncio.sleep(0.2)
            await client.pause("abort")
            partials = await asyncio.gather(*tasks)
            await client.resume()
            after = await client.generate(PROMPT, {"max_new_tokens": 4, "ignore_eos": True})
            return partials, after

    partials, after = run(main())
    assert all(p.aborted and len(p.output_ids) < LONG["max_new_tokens"] for p in partials)
    assert after.finish_reason == "length" and len(after.output_ids) == 4


@pytest.mark.slow
def test_abort_while_cuts_what_runs_and_what_starts_until_the_pause_is_answered(engines):
    """The synchronizer's side of an abort-mode pause (the workers cannot abort: they hold the
    engines' API key only): every engine's requests are aborted, answering their partial
    output, and again every round until the pause is answered; a generation a worker sent
    after the first round (its Cancel had not reached it) is cut too."""
    async def main():
        async with EngineClient([e.url for e in engines]) as client:
            first = [asyncio.create_task(client.generate(PROMPT, LONG)) for _ in range(2)]
            await until_running(engines, 2)
            late: list = []

            async def rollouter_pause():  # answered once every generation has come back
                outs = await asyncio.gather(*first)
                await asyncio.sleep(0.5)  # a round has gone by: this one starts after it
                late.append(await client.generate(PROMPT, LONG))
                return outs

            start = time.monotonic()
            outs = await asyncio.wait_for(client.abort_while(rollouter_pause(), every_s=0.2), 60)
            took = time.monotonic() - start
            after = await client.generate(PROMPT, {"max_new_tokens": 4, "ignore_eos": True})
            return outs, late, took, after

    outs, late, took, after = run(main())
    for out in [*outs, *late]:
        assert out.aborted and 0 < len(out.output_ids) < LONG["max_new_tokens"], out.raw
        assert len(out.logprobs) == len(out.output_ids)
    assert took < 10, took  # cut by the rounds, not run to their 3,000 tokens
    assert after.finish_reason == "length" and len(after.output_ids) == 4  # no pause left


@pytest.mark.slow
def test_a_stopping_worker_drops_its_generations_without_the_abort_route(tmp_path):
    """A worker that stops hands its trajectories back at once, though it may not abort on the
    engines (its key is refused there): it stops waiting, the engine aborts the request whose
    client went away, and the trajectory keeps the tokens it held before."""
    from rollmesh.agents.loops import Interrupted, LoopContext
    from rollmesh.config import RolloutConfig
    from rollmesh.core.trajectory import new_trajectory
    from rollmesh.engine.auth import EngineKeys

    keys_dir = tmp_path / "keys"
    keys_dir.mkdir()
    EngineKeys("gen-key", "admin-key").write(keys_dir)
    engine = Engine(tmp_path / "e.log", "--api-key-file", str(keys_dir / "engine.token"),
                    "--admin-api-key-file", str(keys_dir / "engine-admin.token"))
    try:
        async def main():
            worker = EngineKeys.load(str(keys_dir))  # an agent worker's: no admin key
            assert worker == EngineKeys("gen-key", None)
            async with EngineClient([engine.url], api_key=worker.api) as client:
                ctx = LoopContext(client, None, RolloutConfig(), max_context=8192,
                                  cancelling=asyncio.Event(), tools={})
                ctx.per_token_versions = True  # (no version probe: not what this is about)
                traj = new_trajectory("s-1", "g-1", 0, PROMPT, agent_loop="single_turn")
                call = asyncio.create_task(ctx.generate(traj, 3000, {"ignore_eos": True}))
                await until_running([engine], 1, api_key=worker.api)
                rid = next(iter(ctx.active))
                with pytest.raises(EngineRequestError, match="401"):
                    await client._call(client.servers[0], "POST", "/abort_request",
                                       {"rid": rid, "abort_all": False})
                start = time.monotonic()
                ctx.stopping.set()
                ctx.drop_all()
                with pytest.raises(Interrupted):
                    await asyncio.wait_for(call, 10)
                dropped_in = time.monotonic() - start
                for _ in range(100):  # the engine notices the client went away
                    info = (await client.server_info())[0]
                    running = info["internal_states"][0]["running_requests"]
                    if running == 0:
                        break
                    await asyncio.sleep(0.1)
                return traj, dropped_in, running, ctx.active

        traj, dropped_in, running, active = run(main())
    finally:
        engine.stop()
    assert dropped_in < 2 and running == 0 and not active
    assert traj.token_ids.tolist() == PROMPT  # what it held before; the partial is lost


@pytest.mark.slow
def test_a_bad_request_is_not_retried(engines):
    async def main():
        async with EngineClient([engines[0].url], retries=3, backoff_s=2.0) as client:
            start = time.monotonic()
            with pytest.raises(EngineRequestError) as err:
                await client.generate(PROMPT, {"max_new_tokens": 4, "no_such_key": 1})
            return err.value, time.monotonic() - start

    err, took = run(main())
    assert err.status == 400 and "no_such_key" in str(err)
    assert took < 2.0  # no back-off happened


@pytest.mark.slow
def test_dead_server_is_taken_out_and_put_back(tmp_path):
    live = Engine(tmp_path / "live.log")
    dying = Engine(tmp_path / "dying.log")
    port = dying.port
    dying.stop()

    async def main():
        async with EngineClient([live.url, dying.url], retries=2, backoff_s=0.05,
                                health_interval_s=0.5) as client:
            outs = await asyncio.gather(*(client.generate(PROMPT, {"max_new_tokens": 2,
                                                                   "ignore_eos": True})
                                          for _ in range(4)))
            down = [s.healthy for s in client.servers]
            # the same server comes back on the same port: the prober puts it back
            proc = subprocess.Popen(builtin_argv("tiny", "127.0.0.1", port, seed=0),
                                    cwd=REPO, env=repo_env(), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 90
                while not client.servers[1].healthy and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                back = client.servers[1].healthy
                outs2 = await asyncio.gather(*(client.generate(PROMPT, {"max_new_tokens": 2,
                                                                        "ignore_eos": True})
                                               for _ in range(4)))
            finally:
                proc.terminate()
                proc.wait(30)
            return outs, down, back, outs2

    try:
        outs, down, back, outs2 = run(main())
    finally:
        live.stop()
    assert all(o.server == live.url for o in outs)  # every request landed on the live one
    assert down == [True, False] and back
    assert {o.server for o in outs2} == {live.url, f"http://127.0.0.1:{port}"}
