"""The engine client against real `rollmesh engine` servers: balancing, abort by rid, pause,
no retry on 4xx, and a dead server taken out and put back."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from rollmesh.config import EngineConfig, ModelConfig
from rollmesh.engine.client import RID_WIDTH, EngineClient, EngineError, EngineRequestError
from rollmesh.engine.launch import builtin_argv, engine_launch
from tests.engine.engine_harness import REPO, Engine, repo_env

PROMPT = [11, 12, 13, 14, 15]
LONG = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 1.0}


async def until_running(engines, n: int, timeout_s: float = 30) -> None:
    """Wait until the engines report n requests running (no fixed sleeps: speed varies)."""
    async with EngineClient([e.url for e in engines]) as probe:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            infos = await probe.server_info_each()
            running = sum((i or {}).get("internal_states", [{}])[0].get("running_requests", 0)
                          for i in infos)
            if running >= n:
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"{n} requests never ran")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    d = tmp_path_factory.mktemp("engines")
    pair = [Engine(d / "a.log"), Engine(d / "b.log")]
    yield pair
    for e in pair:
        e.stop()


def run(coro):
    return asyncio.run(coro)


def test_rids_are_fixed_width_and_never_prefixes():
    client = EngineClient(["http://127.0.0.1:1"])
    rids = [client.new_rid() for _ in range(5000)]
    assert {len(r) for r in rids} == {RID_WIDTH} and len(set(rids)) == len(rids)
    other = EngineClient(["http://127.0.0.1:1"])
    assert other.new_rid()[:15] != rids[0][:15]  # another client (process) has another prefix


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


def test_no_server_at_all_is_a_clear_error():
    async def main():
        async with EngineClient(["http://127.0.0.1:9"], retries=1, backoff_s=0.01) as client:
            with pytest.raises(EngineError) as err:
                await client.generate(PROMPT, {"max_new_tokens": 2})
            return str(err.value)

    message = run(main())
    assert "http://127.0.0.1:9" in message


def test_launch_commands_for_both_kinds():
    model = ModelConfig(path="/models/Qwen2.5-1.5B-Instruct", dtype="bfloat16")
    sglang = engine_launch(EngineConfig(kind="sglang", tp_size=2, mem_fraction_static=0.7),
                           model, "10.0.0.5", 30000, gpus=[2, 3], seed=7, python="python3")
    assert sglang.argv == [
        "python3", "-m", "sglang.launch_server", "--model-path", "/models/Qwen2.5-1.5B-Instruct",
        "--host", "10.0.0.5", "--port", "30000", "--tp-size", "2", "--mem-fraction-static", "0.7",
        "--skip-server-warmup", "--weight-version", "0", "--dtype", "bfloat16",
        "--max-running-requests", "256", "--random-seed", "7"]
    assert sglang.env == {"CUDA_VISIBLE_DEVICES": "2,3"} and sglang.url == "http://10.0.0.5:30000"
    assert sglang.shell().startswith("CUDA_VISIBLE_DEVICES=2,3 python3 -m sglang.launch_server")
    builtin = engine_launch(EngineConfig(kind="builtin"), ModelConfig(path="tiny"), "127.0.0.1",
                            8000, python="py")
    assert builtin.argv[:6] == ["py", "-m", "rollmesh", "engine", "--model", "tiny"]
    # nothing on a CPU host imports sglang
    out = subprocess.run([sys.executable, "-c",
                          "import sys, rollmesh.engine.launch, rollmesh.engine.client; "
                          "print('sglang' in sys.modules)"], capture_output=True, text=True)
    assert out.stdout.strip() == "False"
