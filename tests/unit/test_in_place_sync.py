"""In-place weight syncs (`sync.pause_mode = "in_place"`) and the version stamping they need.

A request that runs across an in-place sync is not aborted: the engines keep it (and its KV)
while the weights land and continue it under the new ones, so its tokens come from two
versions. The staleness bound counts on each token carrying the version that made it:
- with the built-in engine each token gets its own (meta_info `output_token_weight_versions`),
  with SGLang 0.5.23 too (its `weight_versions` spans, expanded);
- with an engine that reports one version per answer and no spans the worker stamps the whole
  request with the oldest version it can have been made with when a sync happened during it.
Tests here: real engine processes, a real gloo broadcast from a trainer-like process, the real
MessageQueue rules and the trainer's staleness computation; a stub server for SGLang-shaped
answers (with and without spans).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rollmesh.agents.loops import LoopContext, token_stamps
from rollmesh.config import RolloutConfig
from rollmesh.engine.client import EngineClient, GenerateOutput
from rollmesh.models.loading import build_tiny
from rollmesh.wire.messages import Group
from rollmesh.core.trajectory import new_trajectory
from tests.engine.engine_harness import REPO, Engine, free_port, repo_env

HERE = Path(__file__).resolve().parents[1]  # tests/


def broadcast(url: str, spec: str, version: str) -> dict:
    """A trainer process: joins the engine's weight-update group over gloo and broadcasts
    `spec`'s weights as `version` (tests/engine/trainer_broadcast.py)."""
    cmd = [sys.executable, str(HERE / "engine" / "trainer_broadcast.py"), url, str(free_port()),
           spec, version]
    done = subprocess.run(cmd, cwd=REPO, env=repo_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


async def wait_decoding(engine: Engine, running: int, steps: int = 5,
                        timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (await asyncio.to_thread(engine.stats))["running_requests"] < running:
        assert time.monotonic() < deadline, "the requests never started running"
        await asyncio.sleep(0.02)
    start = (await asyncio.to_thread(engine.stats))["decode_steps"]
    while (await asyncio.to_thread(engine.stats))["decode_steps"] < start + steps:
        assert time.monotonic() < deadline, "the requests never decoded"
        await asyncio.sleep(0.02)


def context(client: EngineClient, tokenizer: Any) -> LoopContext:
    return LoopContext(client, tokenizer, RolloutConfig(), max_context=4096,
                       cancelling=asyncio.Event())


def group_of(name: str, trajs: list) -> Group:
    return Group(group_id=name, trajectories=trajs)


    # (stamped with the answer's one version, 1, as before, the group would have looked fresh
    # at version 1 and been trained at version 2 with tokens of version 0: staleness 2 > 1)


# -- SGLang-shaped answers ------------------------------------------------------------------------


class SGLangStub:
    """An HTTP server answering /generate in SGLang's shape: one `weight_version` per answer
    (the last token's), no per-token key; with `spans`, SGLang 0.5.23's `weight_versions` (a
    span per version, `utils/weight_versions.py`), without, an engine that reports only the one
    version. `sync_during_next` makes the next /generate see a sync after half its tokens (the
    answer reports the new version); `/get_model_info` reports the version as it is now."""

    def __init__(self, version: int, spans: bool) -> None:
        self.version = version
        self.spans = spans
        self.sync_during_next = False
        self.generated = 0

    async def __aenter__(self) -> str:
        from aiohttp import web

        async def generate(request: web.Request) -> web.Response:
            body = await request.json()
            n = body["sampling_params"]["max_new_tokens"]
            spans = [{"version": str(self.version), "start": 0, "end": n}]
            if self.sync_during_next:
                self.version += 1
                self.sync_during_next = False
                spans = [{"version": str(self.version - 1), "start": 0, "end": n // 2},
                         {"version": str(self.version), "start": n // 2, "end": n}]
            ids = [10 + (self.generated + i) % 50 for i in range(n)]
            self.generated += n
            meta = {"id": body["rid"], "finish_reason": {"type": "length", "length": n},
                    "prompt_tokens": len(body["input_ids"]), "weight_version": str(self.version),
                    "completion_tokens": n, "cached_tokens": 0,
                    "output_token_logprobs": [[-1.0, t, None] for t in ids]}
            if self.spans:
                meta["weight_versions"] = spans
            return web.json_response({"text": "", "output_ids": ids, "meta_info": meta})

        async def model_info(_: web.Request) -> web.Response:
            return web.json_response({"weight_version": str(self.version)})

        async def health(_: web.Request) -> web.Response:
            return web.Response(status=200)

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_get("/get_model_info", model_info)
        app.router.add_get("/health", health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore

    async def __aexit__(self, *exc: Any) -> None:
        await self.runner.cleanup()


def stamped_across_syncs(spans: bool) -> list[list[int]]:
    """Three requests of 4 tokens through LoopContext.generate, a sync during the second; the
    versions each was stamped with."""
    _, tok = build_tiny("tiny")

    async def run() -> list[list[int]]:
        stub = SGLangStub(version=3, spans=spans)
        async with stub as url, EngineClient([url], retries=0) as client:
            ctx = context(client, tok)
            traj = new_trajectory("s", "g", 0, [1, 2, 3], agent_loop="single_turn")
            seen = []
            for sync in (False, True, False):  # before any answer the engine is asked: 3
                stub.sync_during_next = sync
                start = len(traj.versions)
                out = await ctx.generate(traj, 4)
                assert (out.token_versions is None) == (not spans)
                seen.append(traj.versions[start:].tolist())
            return seen

    return asyncio.run(run())


def test_answers_with_one_version_are_stamped_with_the_oldest_they_can_have():
    """Without per-token versions or spans, a request during which a sync happened (it reports
    another version than the one known when it started) is stamped with the known start
    version for all its tokens; one with no sync during it gets the version it reports."""
    assert stamped_across_syncs(spans=False) == [[3] * 4,  # no sync during it
                                                 [3] * 4,  # reported 4, started at 3: all 3
                                                 [4] * 4]  # started at 4, reported 4


def test_sglang_spans_stamp_each_token():
    """SGLang 0.5.23's `weight_versions` spans say which tokens each version made: a request
    across a sync gets 3 for its first half and 4 for the rest, as from the built-in engine."""
    assert stamped_across_syncs(spans=True) == [[3] * 4, [3, 3, 4, 4], [4] * 4]


def test_the_client_reads_per_token_versions():
    from rollmesh.engine.client import EngineError

    def body(**meta: Any) -> dict:
        return {"output_ids": [7, 8, 9], "meta_info": {
            "finish_reason": {"type": "length", "length": 3}, "weight_version": "2",
            "prompt_tokens": 1, **meta}}

    parse = GenerateOutput.from_response
    assert parse("r", "s", body(output_token_weight_versions=["1", "1", "2"])).token_versions \
        == [1, 1, 2]
    assert parse("r", "s", body()).token_versions is None  # not reported
    # SGLang 0.5.23's spans, expanded; spans that do not cover the tokens exactly: unknown
    spans = [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 3}]
    assert parse("r", "s", body(weight_versions=spans)).token_versions == [1, 1, 2]
    for bad in ([{"version": "1", "start": 0, "end": 2}],
                [{"version": "1", "start": 1, "end": 3}],
                [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 1, "end": 3}],
                "1"):
        assert parse("r", "s", body(weight_versions=bad)).token_versions is None, bad
    # the per-token key wins over the spans
    assert parse("r", "s", body(weight_versions=spans,
                                output_token_weight_versions=["2"] * 3)).token_versions == [2] * 3
    # an engine started with --weight-version default: no integer versions to stamp with
    assert parse("r", "s", body(output_token_weight_versions=["default"] * 3)).token_versions \
        is None
    with pytest.raises(EngineError, match="expected a list of 3 versions, got 2"):
        parse("r", "s", body(output_token_weight_versions=["1", "2"]))


def test_the_stamping_rule():
    def out(version: str, n: int, per_token: list[int] | None = None) -> GenerateOutput:
        return GenerateOutput(rid="r", server="s", output_ids=[5] * n, logprobs=[-1.0] * n,
                              finish_reason="length", weight_version=version, prompt_tokens=1,
                              token_versions=per_token)

    assert token_stamps(out("5", 3, [4, 4, 5]), start=4) == [4, 4, 5]  # the engine's own
    assert token_stamps(out("5", 3), start=5) == 5  # no sync during the request
    assert token_stamps(out("7", 3), start=5) == 5  # syncs during it: the oldest possible
    assert token_stamps(out("4", 3), start=5) == 4  # an engine behind the others
    assert token_stamps(out("5", 3), start=None) == 5  # nothing known: what it reports


# -- end to end ---------------------------------------------------------------------------------


