"""/generate forms SGLang serves beyond one prompt: batches, n > 1 (the GRPO group in one
request, prefilled once), input log-probs from logprob_start_len, top log-probs, log-probs with
text, repetition_penalty and logit_bias, a streamed batch."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_harness import chat_prompt, greedy_decode

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17], [5, 6, 7, 8]]


def _post(engine, body: dict[str, Any]) -> Any:
    status, out = engine.post("/generate", body)
    assert status == 200, out
    return out


def _stream(engine, body: dict[str, Any]) -> list[Any]:
    req = urllib.request.Request(engine.url + "/generate", data=json.dumps(body).encode(),
                                 method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        events = [line[len(b"data: "):] for line in resp.read().split(b"\n\n") if line]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.slow
def test_batched_input_ids_answer_a_list_in_order_equal_to_one_by_one(engine):
    sp = {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True}
    out = _post(engine, {"input_ids": PROMPTS, "sampling_params": sp, "rid": "batch"})
    assert isinstance(out, list) and len(out) == len(PROMPTS)
    for i, (prompt, got) in enumerate(zip(PROMPTS, out)):
        alone = _post(engine, {"input_ids": prompt, "sampling_params": sp})
        assert got["output_ids"] == alone["output_ids"]
        assert got["meta_info"]["prompt_tokens"] == len(prompt)
        assert got["meta_info"]["id"] == f"batch_{i}"  # SGLang: a string rid becomes rid_i
    listed = _post(engine, {"input_ids": PROMPTS[:2], "sampling_params": sp,
                            "rid": ["x-1", "x-2"]})
    assert [o["meta_info"]["id"] for o in listed] == ["x-1", "x-2"]


@pytest.mark.slow
def test_batched_text(engine, tiny):
    model, tok = tiny
    texts = ["Hello there", "What is 2+3?"]
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    out = _post(engine, {"text": texts, "sampling_params": sp})
    assert [o["output_ids"] for o in out] == [
        greedy_decode(model, tok.encode(t, add_special_tokens=False), 6) for t in texts]
    one = _post(engine, {"text": ["Hello there"], "sampling_params": sp})
    assert isinstance(one, list) and len(one) == 1  # a list of one is still a batch


@pytest.mark.slow
def test_n_samples_share_one_prefill(engine, tiny):
    _, tok = tiny
    prompt = chat_prompt(tok, "Count the clips Natalia sold in April and May.")
    assert engine.post("/flush_cache")[0] == 200  # nothing of the prompt cached before
    before = engine.stats()
    out = _post(engine, {"input_ids": prompt, "rid": "grp", "return_logprob": True,
                         "sampling_params": {"n": 6, "max_new_tokens": 12, "temperature": 1.0,
                                             "top_p": 0.9, "ignore_eos": True,
                                             "custom_params": {"slime": True}}})
    after = engine.stats()
    assert isinstance(out, list) and len(out) == 6
    assert after["prefill_forwards"] - before["prefill_forwards"] == 1
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(prompt)
    outputs = [tuple(o["output_ids"]) for o in out]
    assert len(set(outputs)) == 6, "the n samples are not distinct"
    assert [o["meta_info"]["id"] for o in out] == [f"grp_{k}" for k in range(6)]
    for o in out:
        assert len(o["output_ids"]) == 12 and o["meta_info"]["prompt_tokens"] == len(prompt)
        assert [t[1] for t in o["meta_info"]["output_token_logprobs"]] == o["output_ids"]
        assert o["meta_info"]["input_token_logprobs"] == [[None, prompt[-1], None]]


@pytest.mark.slow
def test_n_with_a_batch_is_prompt_major(engine):
    sp = {"n": 2, "max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    assert engine.post("/flush_cache")[0] == 200  # one prompt cached, not the other: 2 forwards
    before = engine.stats()["prefill_forwards"]
    out = _post(engine, {"input_ids": [[5, 6, 7], [9, 10, 11]], "rid": ["a", "b"],
                         "sampling_params": sp})
    assert [o["meta_info"]["id"] for o in out] == ["a_0", "a_1", "b_0", "b_1"]
    assert out[0]["output_ids"] == out[1]["output_ids"] != out[2]["output_ids"]
    assert out[2]["output_ids"] == out[3]["output_ids"]
    assert engine.stats()["prefill_forwards"] - before == 1  # two prompts of one length


@pytest.mark.slow
def test_input_token_logprobs_equal_a_teacher_forced_forward(engine, tiny):
    model, tok = tiny
    prompt = chat_prompt(tok, "Weng earns $12 an hour for babysitting.")
    logprobs = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), -1)
    want = logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    for start in (0, 5, len(prompt) - 1):
        out = _post(engine, {"input_ids": prompt, "return_logprob": True,
                             "logprob_start_len": start,
                             "sampling_params": {"max_new_tokens": 2, "temperature": 0.6}})
        entries = out["meta_info"]["input_token_logprobs"]
        # SGLang's layout: one entry per prompt token from logprob_start_len on, the first None.
        assert [e[1] for e in entries] == prompt[start:]
        assert entries[0][0] is None and all(e[2] is None for e in entries)
        got = torch.tensor([e[0] for e in entries[1:]])
        assert torch.allclose(got, want[start:], atol=1e-4, rtol=0)
    # max_new_tokens 0 scores the prompt (SGLang's prefill-only request); a one-token prompt
    # has nothing to score but its first-token None.
    out = _post(engine, {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                         "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 0}})
    entries = out["meta_info"]["input_token_logprobs"]
    assert out["output_ids"] == [] and out["meta_info"]["output_token_logprobs"] == []
    assert torch.allclose(torch.tensor([e[0] for e in entries[1:]]), want, atol=1e-4, rtol=0)
    assert len(out["meta_info"]["input_top_logprobs"]) == len(prompt)
    out = _post(engine, {"input_ids": prompt, "return_logprob": True,
                         "sampling_params": {"max_new_tokens": 0}})
    assert out["meta_info"]["input_token_logprobs"] == []  # prefill-only, start -1: none
    out = _post(engine, {"input_ids": [7], "return_logprob": True, "logprob_start_len": 0,
                         "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 2}})
    assert out["meta_info"]["input_token_logprobs"] == [[None, 7, None]]
    assert out["meta_info"]["input_top_logprobs"] == [None]
    # Without return_logprob, logprob_start_len is ignored (SGLang), not refused.
    out = _post(engine, {"input_ids": prompt, "logprob_start_len": 0,
                         "sampling_params": {"max_new_tokens": 2}})
    assert "input_token_logprobs" not in out["meta_info"]


@pytest.mark.slow
def test_top_logprobs_and_text_in_logprobs(engine, tiny):
    model, tok = tiny
    prompt = chat_prompt(tok, "Betty is saving money for a new wallet.")
    out = _post(engine, {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 2,
                         "top_logprobs_num": 4, "return_text_in_logprobs": True,
                         "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                             "ignore_eos": True}})
    meta = out["meta_info"]
    assert len(meta["output_top_logprobs"]) == 8
    for (lp, token, text), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert text == tok.decode([token])
        assert len(top) == 4
        values = [e[0] for e in top]
        assert values == sorted(values, reverse=True)
        assert top[0][1] == token and abs(top[0][0] - lp) < 1e-6  # greedy: the sampled leads
        assert all(e[2] == tok.decode([e[1]]) for e in top)
    inputs = meta["input_top_logprobs"]
    assert len(inputs) == len(prompt) - 2 and inputs[0] is None
    logits = model(input_ids=torch.tensor([prompt])).logits[0].float()
    want = torch.log_softmax(logits[2:-1], -1).topk(4)
    assert [[e[1] for e in pos] for pos in inputs[1:]] == want.indices.tolist()
    assert [e[2] for e in meta["input_token_logprobs"]] == [tok.decode([t]) for t in prompt[2:]]
    # Top log-probs without text: the third element is null.
    plain = _post(engine, {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 2,
                           "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert all(e[2] is None for pos in plain["meta_info"]["output_top_logprobs"] for e in pos)
    assert plain["meta_info"]["input_top_logprobs"] == [None]


@pytest.mark.slow
def test_repetition_penalty_and_logit_bias_change_greedy_output(engine, tiny):
    model, tok = tiny
    prompt = chat_prompt(tok, "Hi")
    sp = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    plain = _post(engine, {"input_ids": prompt, "sampling_params": sp})["output_ids"]
    assert plain == greedy_decode(model, prompt, 40)
    assert len(set(plain)) < len(plain), "the fixture expects greedy to repeat some token"
    # A strong repetition penalty: tokens already generated are pushed down.
    rep = _post(engine, {"input_ids": prompt,
                         "sampling_params": {**sp, "repetition_penalty": 2.0}})["output_ids"]
    assert rep != plain and len(set(rep)) > len(set(plain))
    # logit_bias: a large bias on one token makes greedy pick it every step...
    target = 1234
    biased = _post(engine, {"input_ids": prompt, "return_logprob": True, "sampling_params": {
        **sp, "max_new_tokens": 5, "logit_bias": {str(target): 100.0}}})
    assert biased["output_ids"] == [target] * 5
    # ...and a large negative one bans the token greedy would pick first.
    banned = _post(engine, {"input_ids": prompt, "sampling_params": {
        **sp, "max_new_tokens": 3, "logit_bias": {str(plain[0]): -100.0}}})["output_ids"]
    assert banned[0] != plain[0]


@pytest.mark.slow
def test_a_streamed_batch_carries_index_and_weight_version(engine):
    body = {"input_ids": [[5, 6, 7], [9, 10]], "stream": True, "return_logprob": True,
            "sampling_params": {"n": 2, "max_new_tokens": 5, "temperature": 1.0,
                                "ignore_eos": True}}
    chunks = _stream(engine, body)
    assert {c["index"] for c in chunks} == {0, 1, 2, 3}
    assert all(c["meta_info"]["weight_version"] == "default" for c in chunks)
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1, 2, 3]
    assert all(len(c["output_ids"]) == 5 for c in finals.values())


@pytest.mark.slow
def test_per_prompt_options_of_a_batch(engine, tiny):
    model, _ = tiny
    out = _post(engine, {"input_ids": [[5, 6, 7], [9, 10, 11, 12]],
                         "return_logprob": [True, False], "logprob_start_len": [1, None],
                         "sampling_params": [{"max_new_tokens": 3, "temperature": 0},
                                             {"max_new_tokens": 5, "temperature": 0}]})
    assert [len(o["output_ids"]) for o in out] == [3, 5]
    assert out[1]["output_ids"] == greedy_decode(model, [9, 10, 11, 12], 5)
    assert [e[1] for e in out[0]["meta_info"]["input_token_logprobs"]] == [6, 7]
    assert "output_token_logprobs" not in out[1]["meta_info"]
    status, reply = engine.post("/generate", {"input_ids": [[5, 6], [7, 8]],
                                              "sampling_params": [{"n": 2}, {"n": 3}]})
    assert status == 400 and "same for every prompt" in json.dumps(reply)
    status, reply = engine.post("/generate", {"input_ids": [[5, 6], [7, 8]],
                                              "return_logprob": [True]})
    assert status == 400 and "1 values for a batch of 2" in json.dumps(reply)


def test_input_logprobs_in_chunks_equal_one_log_softmax(monkeypatch):
    from rollmesh.engine.builtin import scheduler
    from rollmesh.engine.builtin.sampling import SamplingParams

    monkeypatch.setattr(scheduler, "INPUT_LOGPROB_CHUNK", 3)
    ids = list(range(1, 12))
    r = scheduler.Request("x", ids, SamplingParams(), 1, lambda _: None)
    r.logprob_start, r.top_logprobs_num = 2, 2
    logits = torch.randn(len(ids) - 2, 50)  # positions 2..10; the last scores the first output
    scheduler.Scheduler._input_logprobs(r, logits)
    full = torch.log_softmax(logits[:-1], -1)
    want = full.gather(1, torch.tensor(ids[3:])[:, None])[:, 0]
    assert r.input_logprobs[0] is None and len(r.input_logprobs) == len(ids) - 2
    assert torch.allclose(torch.tensor(r.input_logprobs[1:]), want)
    assert r.input_top_logprobs[0] is None
    assert [[t for _, t in pos] for pos in r.input_top_logprobs[1:]] == \
        full.topk(2).indices.tolist()


# -- held to SGLang 0.5.23's bodies (tests/fixtures/sglang/generate_*.json) ----------------------

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sglang"
# The value of these depends on what the model generates, not on the wire format.
_MODEL_DEPENDENT = {"finish_reason"}
# meta_info keys the built-in engine adds to SGLang's (docs/sglang-api.md, "Built-in engine
# extensions"; the same list as test_sglang_fixtures.BUILTIN_EXTENSIONS): allowed, not required.
_BUILTIN_EXTENSIONS = {"output_token_weight_versions"}


def _shape_diff(want: Any, got: Any, path: str = "") -> list[str]:
    """Where `got` differs from `want` in keys, nesting or JSON types (values may differ)."""
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"{path}: expected an object, got {type(got).__name__}"]
        out = [f"{path}.{k}: missing" for k in want if k not in got]
        extensions = _BUILTIN_EXTENSIONS if path.endswith("meta_info") else set()
        out += [f"{path}.{k}: not in SGLang's body" for k in got
                if k not in want and k not in extensions]
        for k in want:
            if k in got and k not in _MODEL_DEPENDENT:
                out += _shape_diff(want[k], got[k], f"{path}.{k}")
        return out
    if isinstance(want, list):
        if not isinstance(got, list):
            return [f"{path}: expected a list, got {type(got).__name__}"]
        if len(want) == len(got):
            return [d for i, (w, g) in enumerate(zip(want, got))
                    for d in _shape_diff(w, g, f"{path}[{i}]")]
        sample = next((w for w in want if w is not None), None)
        return [] if sample is None else [
            d for i, g in enumerate(got) for d in _shape_diff(sample, g, f"{path}[{i}]")]
    if want is None or got is None:
        return [] if want is got else [f"{path}: {got!r} where SGLang has {want!r}"]
    number = (int, float)
    if isinstance(want, bool) or isinstance(got, bool):
        same = isinstance(want, bool) and isinstance(got, bool)
    elif isinstance(want, float) or isinstance(got, float):
        same = isinstance(want, number) and isinstance(got, number)
    else:
        same = type(want) is type(got)
    return [] if same else [f"{path}: {type(got).__name__} where SGLang has "
                            f"{type(want).__name__}"]


def _first_and_last(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The shape of a stream's only chunk: the fixture's last chunk with the meta_info keys
    that only the first chunk has (response_sent_to_client_ts) added."""
    first, last = chunks[0]["meta_info"], chunks[-1]["meta_info"]
    meta = {**last, **{k: v for k, v in first.items() if k not in last}}
    return {**chunks[-1], "meta_info": meta}


def _fixture_cases() -> list[str]:
    names = sorted(p.name for p in FIXTURES.glob("generate_*.json"))
    # abort: test_engine_interrupt; lora (an adapter loaded first):
    # tests/engine/test_sglang_fixtures.py::test_engine_lora_routes_have_sglangs_shape
    return [n for n in names if n not in ("generate_abort.json", "generate_lora.json")]


@pytest.mark.slow
@pytest.mark.parametrize("name", _fixture_cases())
def test_engine_answers_fixture_requests_in_sglangs_shape(engine, name):
    fx = json.loads((FIXTURES / name).read_text())
    body = fx["request"]
    if "stream" in fx:
        chunks = _stream(engine, body)
        want = fx["stream"]
        # A stream's first and last chunks (and any between) have their own keys. Tokens made
        # while the previous event was being written go out together (the scheduler thread can
        # run several decode steps before the event loop sends one), so a short answer may
        # come as one chunk: then it is the first response sent and the finished one at once,
        # with the last chunk's keys and the first's response_sent_to_client_ts (as SGLang's
        # non-streamed answer, generate_single.json: the first response, finished).
        def ends(w: list, g: list) -> list[tuple]:
            return [(w[0], g[0]), (w[-1], g[-1])] if len(g) > 1 else [(_first_and_last(w), g[0])]

        pairs = ends(want, chunks)
        if len(want) > 2 and len(chunks) > 2:
            pairs.append((want[1], chunks[1]))
        if isinstance(body["input_ids"][0], list):  # a batch: per index
            pairs = []
            for index in {c["index"] for c in want}:
                pairs += ends([c for c in want if c["index"] == index],
                              [c for c in chunks if c["index"] == index])
        diffs = [d for w, g in pairs for d in _shape_diff(w, g, "chunk")]
    else:
        status, got = engine.post("/generate", body)
        assert status == fx["status"], got
        diffs = _shape_diff(fx["response"], got, "response")
    assert not diffs, f"{name}: " + "; ".join(diffs)


@pytest.mark.slow
def test_weight_version_changes_mid_stream(tmp_path):
    """Every chunk carries the engine's weight version of its newest token; the finished
    response's weight_versions spans say which tokens came from which version."""
    from engine_harness import Engine

    e = Engine(tmp_path / "engine.log")
    try:
        body = {"input_ids": [5, 6, 7], "stream": True,
                "sampling_params": {"max_new_tokens": 400, "temperature": 0,
                                    "ignore_eos": True}}
        req = urllib.request.Request(e.url + "/generate", data=json.dumps(body).encode(),
                                     method="POST")
        chunks = []
        with urllib.request.urlopen(req, timeout=60) as resp:
            for line in resp:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunks.append(json.loads(line[len(b"data: "):]))
                if len(chunks) == 3:
                    status, _ = e.post("/update_weight_version",
                                       {"new_version": "v2", "abort_all_requests": False})
                    assert status == 200
    finally:
        e.stop()
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    spans = final["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "v2"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"]
    assert spans[1]["end"] == 400
    assert final["meta_info"]["weight_version"] == "v2"
    assert chunks[0]["meta_info"]["weight_version"] == "default"
    for c in chunks:  # each chunk: the version of its newest token
        n = len(c["output_ids"])
        assert c["meta_info"]["weight_version"] == ("default" if n <= spans[0]["end"] else "v2")
