"""The engine client against real `rollmesh engine` servers: balancing, abort by rid, pause,
no retry on 4xx, and a dead server taken out and put back."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from rollmesh.config import EngineConfig, ModelConfig
from rollmesh.engine.client import RID_WIDTH, EngineClient, EngineError
from rollmesh.engine.launch import engine_launch
from tests.engine.engine_harness import Engine

PROMPT = [11, 12, 13, 14, 15]
LONG = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 1.0}


async def until_running(engines, n: int, timeout_s: float = 30, api_key: str | None = None,
                        ) -> None:
    """Wait until the engines report n requests running (no fixed sleeps: speed varies)."""
    async with EngineClient([e.url for e in engines], api_key=api_key) as probe:
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
    # the run's two keys (rollmesh.engine.auth): SGLang takes them, the built-in engine reads
    # them from their files
    keyed = engine_launch(EngineConfig(kind="sglang"), model, "h", 1, api_key="A",
                          admin_api_key="Z").argv
    assert keyed[keyed.index("--api-key") + 1] == "A"
    assert keyed[keyed.index("--admin-api-key") + 1] == "Z"
    keyed = engine_launch(EngineConfig(kind="builtin"), ModelConfig(path="tiny"), "h", 1,
                          api_key_file="k/engine.token",
                          admin_api_key_file="k/engine-admin.token").argv
    assert keyed[keyed.index("--api-key-file") + 1] == "k/engine.token"
    assert keyed[keyed.index("--admin-api-key-file") + 1] == "k/engine-admin.token"
    # nothing on a CPU host imports sglang
    out = subprocess.run([sys.executable, "-c",
                          "import sys, rollmesh.engine.launch, rollmesh.engine.client; "
                          "print('sglang' in sys.modules)"], capture_output=True, text=True)
    assert out.stdout.strip() == "False"
