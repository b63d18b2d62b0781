"""Interrupting generation on a real engine: abort, pause (abort / in_place), continue."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from engine_harness import chat_prompt

pytestmark = pytest.mark.slow

LONG = dict(max_new_tokens=3000, temperature=1.0, ignore_eos=True)


def _start(pool: ThreadPoolExecutor, engine, prompt, rid, **sampling) -> Future:
    return pool.submit(engine.generate, prompt, rid=rid, **sampling)


def _wait_running(engine, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while engine.stats()["running_requests"] < n:
        assert time.monotonic() < deadline, "requests never started running"
        time.sleep(0.02)
    # let them produce some tokens: each decode step gives every running request one more
    steps = engine.stats()["decode_steps"]
    while engine.stats()["decode_steps"] < steps + 3:
        assert time.monotonic() < deadline, "the running requests never decoded"
        time.sleep(0.02)


def _assert_partial(out: dict, limit: int) -> None:
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None,
                                     "err_type": None}
    assert 0 < meta["completion_tokens"] == len(out["output_ids"]) < limit
    assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]


def test_abort_returns_the_partial_output_within_a_step(engine, tiny):
    _, tok = tiny
    prompt = chat_prompt(tok, "A long story, please.")
    with ThreadPoolExecutor(2) as pool:
        target = _start(pool, engine, prompt, "abort-00001", **LONG)
        other = _start(pool, engine, prompt, "keep-000001", max_new_tokens=400, temperature=0,
                       ignore_eos=True)
        _wait_running(engine, 2)
        assert engine.get("/health_generate")[0] == 200  # busy, yet healthy
        t0 = time.perf_counter()
        assert engine.post("/abort_request", {"rid": "abort-00001"})[0] == 200
        out = target.result(timeout=30)
        latency = time.perf_counter() - t0
        kept = other.result(timeout=60)
    _assert_partial(out, 3000)
    assert latency < 1.0, f"abort took {latency:.3f}s"
    assert kept["meta_info"]["finish_reason"] == {"type": "length", "length": 400}


def test_abort_matches_rid_prefixes_like_sglang(engine, tiny):
    _, tok = tiny
    prompt = chat_prompt(tok, "Prefix test")
    with ThreadPoolExecutor(2) as pool:
        a = _start(pool, engine, prompt, "s-4", **LONG)
        b = _start(pool, engine, prompt, "s-42", **LONG)
        _wait_running(engine, 2)
        engine.post("/abort_request", {"rid": "s-4"})  # also aborts s-42: ids must not nest
        _assert_partial(a.result(timeout=30), 3000)
        _assert_partial(b.result(timeout=30), 3000)
    # An rid no request has exactly is a no-op, even though it prefixes a running one.
    with ThreadPoolExecutor(1) as pool:
        c = _start(pool, engine, prompt, "t-42", max_new_tokens=300, temperature=0,
                   ignore_eos=True)
        _wait_running(engine, 1)
        engine.post("/abort_request", {"rid": "t-4"})
        assert c.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_abort_returns_every_partial_and_new_requests_wait(engine, tiny):
    _, tok = tiny
    prompts = [chat_prompt(tok, f"Question number {i}") for i in range(4)]
    with ThreadPoolExecutor(5) as pool:
        inflight = [_start(pool, engine, p, f"p-{i:05d}", **LONG) for i, p in enumerate(prompts)]
        _wait_running(engine, 4)
        status, body = engine.post("/pause_generation", {"mode": "abort"})
        assert status == 200
        assert body == {"message": "Generation paused successfully.", "status": "ok"}
        for f in inflight:
            _assert_partial(f.result(timeout=30), 3000)

        late = _start(pool, engine, prompts[0], "late-00001", max_new_tokens=5, temperature=0)
        deadline = time.monotonic() + 30
        while engine.stats()["waiting_requests"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # were it not held, it would be running (and done) by now
        assert not late.done(), "a /generate sent while paused must wait for continue"
        assert engine.stats()["waiting_requests"] == 1
        assert engine.post("/continue_generation", {})[0] == 200
        out = late.result(timeout=30)
    assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop")


def test_pause_in_place_keeps_requests_and_their_results(engine, tiny):
    _, tok = tiny
    prompt = chat_prompt(tok, "Pause me in place")
    kw = dict(max_new_tokens=600, temperature=0, ignore_eos=True)
    reference = engine.generate(prompt, **kw)
    with ThreadPoolExecutor(1) as pool:
        f = _start(pool, engine, prompt, "inplace-0001", **kw)
        _wait_running(engine, 1, timeout=30)
        assert engine.post("/pause_generation", {"mode": "in_place"})[0] == 200
        steps = engine.stats()["decode_steps"]
        time.sleep(1.0)
        assert not f.done() and engine.stats()["decode_steps"] == steps
        assert engine.stats()["running_requests"] == 1
        assert engine.post("/continue_generation", {})[0] == 200
        out = f.result(timeout=60)
    assert out["output_ids"] == reference["output_ids"]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 600}


def test_flush_cache(engine):
    status, text = engine.get("/flush_cache")
    assert status == 200 and "flushed" in text
    assert engine.post("/flush_cache")[0] == 200


def test_a_prompt_seen_before_is_served_from_the_prefix_cache_until_flushed(engine):
    prompt = list(range(40, 100))
    sp = dict(max_new_tokens=4, temperature=0, ignore_eos=True)
    first = engine.generate(prompt, **sp)
    before = engine.stats()["prefill_tokens"]
    again = engine.generate(prompt, **sp)
    assert engine.stats()["prefill_tokens"] - before == 1  # its last token only
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert again["output_ids"] == first["output_ids"]
    assert engine.get("/v1/loads")[1]["loads"][0]["cache_hit_rate"] > 0
    assert engine.post("/flush_cache")[0] == 200
    assert engine.stats()["prefix_cache_tokens"] == 0
    assert engine.generate(prompt, **sp)["meta_info"]["cached_tokens"] == 0
