"""/generate on a real engine process: the response contract, log-probs, greedy, batching."""

from __future__ import annotations

import json
import math
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from engine_harness import chat_prompt, greedy_decode, teacher_forced_logprobs

from rollmesh.algorithms.logits import token_logprobs

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April. How many clips?",
    "Weng earns $12 an hour for babysitting.",
    "Betty is saving money for a new wallet which costs $100.",
    "James writes a 3-page letter to 2 different friends twice a week.",
    "Hi",
    "Mark has a garden with flowers. He planted plants of three different colors in it. "
    "Ten of them are yellow, and there are 80% more of those in purple.",
]


def test_response_shape_and_length_finish(engine, tiny):
    _, tok = tiny
    prompt = chat_prompt(tok, QUESTIONS[0])
    assert engine.post("/flush_cache")[0] == 200  # no chat-template prefix cached by others
    out = engine.generate(prompt, max_new_tokens=7, temperature=1.0, ignore_eos=True, rid="s-00001")
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["id"] == "s-00001"
    assert meta["finish_reason"] == {"type": "length", "length": 7}
    assert meta["prompt_tokens"] == len(prompt)
    assert meta["completion_tokens"] == len(out["output_ids"]) == 7
    assert meta["cached_tokens"] == 0
    assert meta["weight_version"] == "default"
    assert meta["e2e_latency"] > 0
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == out["output_ids"]
    assert all(t[2] is None and isinstance(t[0], float) and t[0] <= 0 for t in triples)
    assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)


def test_stop_token_finish_keeps_the_token_in_output_ids(engine, tiny):
    model, tok = tiny
    prompt = chat_prompt(tok, QUESTIONS[1])
    expected = greedy_decode(model, prompt, 5)
    stop = expected[3]
    first = expected.index(stop)
    out = engine.generate(prompt, max_new_tokens=20, temperature=0, stop_token_ids=[stop])
    assert out["output_ids"] == expected[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == tok.decode(expected[:first], skip_special_tokens=True)


def test_eos_finish(engine, tiny):
    model, tok = tiny
    prompt = chat_prompt(tok, "What is 2+3?")  # greedy reaches <|im_end|> within a few tokens
    expected = greedy_decode(model, prompt, 12)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert eos in expected, "the fixture prompt is expected to end with eos"
    out = engine.generate(prompt, max_new_tokens=12, temperature=0)
    assert out["output_ids"] == expected[: expected.index(eos) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    # ignore_eos runs on to the length limit, past the eos token.
    out = engine.generate(prompt, max_new_tokens=12, temperature=0, ignore_eos=True)
    assert out["output_ids"] == expected and out["meta_info"]["finish_reason"]["type"] == "length"


def test_logprobs_match_teacher_forcing_at_temperature_one(engine, tiny):
    model, tok = tiny
    # Concurrent requests of different lengths: batched decoding with left padding.
    jobs = [(chat_prompt(tok, q), 20 + 15 * i) for i, q in enumerate(QUESTIONS)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: engine.generate(
            j[0], max_new_tokens=j[1], temperature=1.0, top_p=1.0, top_k=-1, ignore_eos=True),
            jobs))
    for (prompt, n), out in zip(jobs, outs):
        got = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
        want = teacher_forced_logprobs(model, prompt, out["output_ids"])
        assert len(got) == n
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4


@pytest.mark.parametrize(("top_p", "top_k"), [(0.5, -1), (1.0, 5), (0.5, 5)])
def test_behaviour_logprobs_equal_the_trainers_recomputation(engine, tiny, top_p, top_k):
    """With top-p / top-k sampling the engine reports the temperature-scaled distribution over
    the whole vocabulary (SGLang's), which is what the trainer recomputes: its log-prob path
    (token_logprobs(logits, tokens, temperature, shift=True)) on the same tokens agrees within
    1e-4. The draws themselves stayed inside the filter."""
    model, tok = tiny
    prompt = chat_prompt(tok, QUESTIONS[2])
    temp = 0.7
    out = engine.generate(prompt, max_new_tokens=25, temperature=temp, top_k=top_k, top_p=top_p,
                          ignore_eos=True)
    tokens = torch.tensor([prompt + out["output_ids"]])
    logits = model(input_ids=tokens).logits
    trainer = token_logprobs(logits, tokens, temp, shift=True)[0, len(prompt):]
    got = torch.tensor([t[0] for t in out["meta_info"]["output_token_logprobs"]])
    assert float((got - trainer).abs().max()) < 1e-4
    scaled = logits[0, len(prompt) - 1 : -1].float() / temp
    for row, token in zip(scaled, out["output_ids"]):
        values, order = row.sort(descending=True)
        keep = top_k if top_k > 0 else len(values)
        probs = torch.softmax(values[:keep], dim=-1)
        keep = int(((probs.cumsum(0) - probs) <= top_p).sum())
        assert token in order[:keep].tolist()


def test_greedy_is_deterministic_and_logprob_is_raw_log_softmax(engine, tiny):
    model, tok = tiny
    prompt = chat_prompt(tok, QUESTIONS[3])
    a = engine.generate(prompt, max_new_tokens=30, temperature=0, ignore_eos=True)
    b = engine.generate(prompt, max_new_tokens=30, temperature=0, ignore_eos=True)
    assert a["output_ids"] == b["output_ids"] == greedy_decode(model, prompt, 30)
    got = [t[0] for t in a["meta_info"]["output_token_logprobs"]]
    want = teacher_forced_logprobs(model, prompt, a["output_ids"])
    assert max(abs(x - y) for x, y in zip(got, want)) < 1e-4


def test_concurrent_requests_match_one_at_a_time(engine, tiny):
    _, tok = tiny
    jobs = [(chat_prompt(tok, q), 10 + 17 * i) for i, q in enumerate(QUESTIONS)]
    jobs += [(list(range(3, 3 + 5 * k)), 33) for k in (1, 7, 20)]  # raw prompts of other lengths

    def run(job):
        prompt, n = job
        return engine.generate(prompt, max_new_tokens=n, temperature=0, ignore_eos=True)

    alone = [run(j) for j in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(run, jobs))
    assert engine.stats()["peak_running_requests"] >= 4, "requests were not batched"
    for a, b in zip(alone, together):
        assert a["output_ids"] == b["output_ids"]
        la = [t[0] for t in a["meta_info"]["output_token_logprobs"]]
        lb = [t[0] for t in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-4


def test_sampling_seed_reproduces_a_sample(engine, tiny):
    _, tok = tiny
    prompt = chat_prompt(tok, QUESTIONS[0])
    kw = dict(max_new_tokens=20, temperature=1.0, ignore_eos=True)
    a = engine.generate(prompt, sampling_seed=1234, **kw)
    b = engine.generate(prompt, sampling_seed=1234, **kw)
    c = engine.generate(prompt, sampling_seed=99, **kw)
    assert a["output_ids"] == b["output_ids"] != c["output_ids"]


def test_text_prompt_stop_string_and_min_new_tokens(engine, tiny):
    model, tok = tiny
    prompt = chat_prompt(tok, QUESTIONS[4])
    ids = greedy_decode(model, prompt, 12)
    full = tok.decode(ids)
    stop = full[4:6]
    out = engine.generate(prompt, max_new_tokens=12, temperature=0, ignore_eos=True, stop=stop)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop in tok.decode(out["output_ids"]) and stop not in out["text"]
    kept = engine.generate(prompt, max_new_tokens=12, temperature=0, ignore_eos=True, stop=stop,
                           no_stop_trim=True)
    assert stop in kept["text"]

    eos = tok.convert_tokens_to_ids("<|im_end|>")
    status, out = engine.post("/generate", {"text": "What is 2+3?", "sampling_params": {
        "max_new_tokens": 30, "temperature": 1.0, "min_new_tokens": 30}})
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length"
    assert eos not in out["output_ids"]


def test_stream_sends_events_then_done(engine, tiny):
    _, tok = tiny
    body = {"input_ids": chat_prompt(tok, QUESTIONS[0]), "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(engine.url + "/generate", data=json.dumps(body).encode(),
                                 method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = [line[len(b"data: "):] for line in resp.read().split(b"\n\n") if line]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 200}
    assert len(final["output_ids"]) == 200
    # Events are cumulative; several tokens may share one event when the client lags.
    assert len(chunks) >= 2
    for c in chunks[:-1]:
        assert c["meta_info"]["finish_reason"] is None
        assert c["output_ids"] == final["output_ids"][: len(c["output_ids"])]
    # SGLang puts the server's weight version in every chunk, not only the last.
    assert all(c["meta_info"]["weight_version"] == "default" for c in chunks)


@pytest.mark.parametrize("path", ["/get_model_info", "/model_info"])
def test_model_info(engine, path):
    status, info = engine.get(path)
    assert status == 200 and info["is_generation"] is True
    assert info["model_path"] == "tiny" and info["weight_version"] == "default"


def test_server_info_and_health(engine):
    for path in ("/get_server_info", "/server_info"):
        status, info = engine.get(path)
        assert status == 200 and info["context_length"] == 4096 and "internal_states" in info
    assert engine.get("/health")[0] == 200
    assert engine.get("/health_generate")[0] == 200
    assert not math.isnan(engine.stats()["decode_steps"])
