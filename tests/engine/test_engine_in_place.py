"""In-place syncs on a real engine: a request paused in place keeps its KV, a real gloo weight
broadcast (a trainer process) lands while it is paused, and /continue_generation continues it
under the new weights. Every output token reports the version that made it (meta_info
`output_token_weight_versions`, the built-in engine's extension; docs/sglang-api.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine_harness import REPO, Engine, chat_prompt, free_port, greedy_decode, repo_env

from rollmesh.models.loading import build_tiny, materialize

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent


def broadcast(engine: Engine, spec: str, version: str) -> dict:
    """A trainer process joins the engine's weight-update group over gloo and broadcasts
    `spec`'s weights as `version` (trainer_broadcast.py)."""
    cmd = [sys.executable, str(HERE / "trainer_broadcast.py"), engine.url, str(free_port()),
           spec, version]
    done = subprocess.run(cmd, cwd=REPO, env=repo_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def wait_decoding(engine: Engine, steps: int = 5, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while engine.stats()["running_requests"] < 1:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.02)
    start = engine.stats()["decode_steps"]
    while engine.stats()["decode_steps"] < start + steps:
        assert time.monotonic() < deadline, "the request never decoded"
        time.sleep(0.02)


def stream(engine: Engine, body: dict, on_chunk) -> list[dict]:
    import urllib.request

    req = urllib.request.Request(engine.url + "/generate", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks.append(json.loads(line[6:]))
                on_chunk(chunks[-1])
    return chunks


def test_in_place_sync_continues_requests_under_the_new_weights(tmp_path):
    e = Engine(tmp_path / "engine.log", "--weight-version", "0")
    try:
        old, tok = build_tiny("tiny")
        prompt = chat_prompt(tok, "A long answer across a weight sync")
        n = 300
        with ThreadPoolExecutor(1) as pool:
            f = pool.submit(e.generate, prompt, rid="across-sync", max_new_tokens=n,
                            temperature=0, ignore_eos=True)
            wait_decoding(e)
            assert e.post("/pause_generation", {"mode": "in_place"})[0] == 200
            before = e.stats()["generated_tokens"]  # tokens made at version 0
            replies = broadcast(e, "tiny:seed=1", "1")
            assert replies["update"]["success"] and replies["init"]["success"], replies
            s = e.stats()
            # the update landed while the request waited, paused, with its KV
            assert (s["weight_version"], s["running_requests"], s["generated_tokens"]) == \
                ("1", 1, before)
            assert not f.done()
            assert e.post("/continue_generation", {})[0] == 200
            out = f.result(timeout=120)
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": n}  # not aborted
        assert 0 < before < n
        assert meta["output_token_weight_versions"] == ["0"] * before + ["1"] * (n - before)
        assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": before},
                                           {"version": "1", "start": before, "end": n}]
        assert meta["weight_version"] == "1"
        # the tokens before the sync are the old model's greedy ones; after it, the new
        # weights decide (the old model alone would have gone on differently)
        reference = greedy_decode(old, prompt, n)
        assert out["output_ids"][:before] == reference[:before]
        assert out["output_ids"][before:] != reference[before:]
        assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
        # the broadcast asked flush_cache with a request kept: SGLang's scheduler would die
        assert "flush_cache_with_requests_kept" in e.log()
        # The prompt's KV cached under version 0 went with the update (the kept request keeps
        # its own): the same prompt now is prefilled anew, and decoded by the new weights only.
        new, _ = build_tiny("tiny:seed=1")
        fresh = e.generate(prompt, max_new_tokens=8, temperature=0, ignore_eos=True)
        assert fresh["meta_info"]["cached_tokens"] == 0
        assert fresh["output_ids"] == greedy_decode(new, prompt, 8)

        # Without a pause: an update from disk lands between two decode steps of a streamed
        # request; every chunk carries one version per output token.
        path = materialize("tiny:seed=2", tmp_path / "ckpt2")
        updated: list[dict] = []

        def on_chunk(chunk: dict) -> None:
            if not updated and len(chunk["output_ids"]) >= 5:
                updated.append(e.post("/update_weights_from_disk",
                                      {"model_path": str(path), "weight_version": "2"})[1])

        chunks = stream(e, {"input_ids": prompt, "stream": True, "sampling_params": {
            "max_new_tokens": 120, "temperature": 0, "ignore_eos": True}}, on_chunk)
        assert updated and updated[0]["success"], updated
        for c in chunks:
            versions = c["meta_info"]["output_token_weight_versions"]
            assert len(versions) == len(c["output_ids"])
            assert versions == sorted(versions)  # "1" then "2", never back
        final = chunks[-1]["meta_info"]
        assert final["finish_reason"]["type"] == "length"
        assert set(final["output_token_weight_versions"]) == {"1", "2"}
        assert final["output_token_weight_versions"][0] == "1"
    finally:
        assert e.stop() == 0, e.log()


def test_pause_abort_still_aborts_and_reports_the_versions_made(engine, tiny):
    """The default mode is unchanged: pause `abort` ends the request with its partial output,
    each of its tokens with its version."""
    _, tok = tiny
    prompt = chat_prompt(tok, "Aborted by a sync")
    with ThreadPoolExecutor(1) as pool:
        f = pool.submit(engine.generate, prompt, rid="abort-sync", max_new_tokens=3000,
                        temperature=1.0, ignore_eos=True)
        wait_decoding(engine)
        assert engine.post("/pause_generation", {"mode": "abort"})[0] == 200
        out = f.result(timeout=60)
        assert engine.post("/continue_generation", {})[0] == 200
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["output_token_weight_versions"] == ["default"] * len(out["output_ids"]) != []
