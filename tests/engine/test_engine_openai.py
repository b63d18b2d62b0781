"""The OpenAI-compatible routes (/v1/models, /v1/completions, /v1/chat/completions) of a real
engine process, driven by the official `openai` client with the run's API key; and the pure
parts of rollmesh.engine.builtin.openai_requests / openai_responses and
rollmesh.engine.openai_common (tool-call parsing, chat rendering with tools, streaming)."""

from __future__ import annotations

import json
import math
import os
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
from engine_harness import Engine

from rollmesh.engine.builtin import api
from rollmesh.engine import openai_common
from rollmesh.engine.builtin import openai_requests, openai_responses
from rollmesh.models.loading import tiny_tokenizer
from rollmesh.engine.builtin.sampling import parse_sampling_params
from rollmesh.engine.builtin.scheduler import Request

KEY = "test-openai-key"
QUESTION = "Natalia sold clips to 48 of her friends in April. How many clips?"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("openai")
    key_file = d / "engine.token"
    key_file.write_text(KEY + "\n")
    os.chmod(key_file, 0o600)
    e = Engine(d / "engine.log", "--api-key-file", str(key_file), "--tool-call-parser", "qwen25")
    yield e
    e.stop()


@pytest.fixture(scope="module")
def client(served: Engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def generate(engine: Engine, body: dict[str, Any]) -> dict[str, Any]:
    """/generate with the API key (the harness's helper sends none)."""
    req = urllib.request.Request(engine.url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def rendered(messages: list[dict[str, Any]]) -> list[int]:
    """The prompt SGLang builds: the template rendered to text, encoded without specials."""
    tok = tiny_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": QUESTION}]


# ---- over HTTP, with the openai client -----------------------------------------------------
@pytest.mark.slow
def test_models_lists_the_served_model(client: openai.OpenAI):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].object == "model" and models[0].max_model_len == 4096
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@pytest.mark.slow
def test_greedy_chat_equals_generate_on_the_rendered_prompt(served: Engine,
                                                             client: openai.OpenAI):
    ids = rendered(MESSAGES)
    ref = generate(served, {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0}})
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12,
                                         temperature=0, extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.prompt_token_ids == ids
    assert choice.response_token_ids == ref["output_ids"]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref["text"]
    assert choice.finish_reason == ref["meta_info"]["finish_reason"]["type"]
    assert out.object == "chat.completion" and out.model == "tiny"
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(ref["output_ids"])
    assert out.usage.total_tokens == len(ids) + len(ref["output_ids"])
    n = len(ref["output_ids"])
    assert out.metadata == {"weight_version": "default",
                            "weight_versions": [{"version": "default", "start": 0, "end": n}]}


@pytest.mark.slow
def test_streamed_chat_adds_up_to_the_answer(client: openai.OpenAI):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.slow
def test_stop_string_is_trimmed_streamed_or_not(served: Engine, client: openai.OpenAI):
    ids = rendered(MESSAGES)
    ref = generate(served, {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}})
    text = ref["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]  # a piece from the middle of the output
    assert stop.strip(), text
    before = text[: text.find(stop)]
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, stop=[stop],
                  extra_body={"ignore_eos": True})
    out = client.chat.completions.create(**kwargs)
    assert out.choices[0].message.content == before
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].matched_stop == stop
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in client.chat.completions.create(**kwargs, stream=True))
    assert streamed == before


@pytest.mark.slow
def test_completion_equals_generate_and_counts_usage(served: Engine, client: openai.OpenAI):
    ref = generate(served, {"text": QUESTION, "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}, "return_logprob": True})
    out = client.completions.create(model="tiny", prompt=QUESTION, max_tokens=5, temperature=0,
                                    logprobs=2, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert out.object == "text_completion"
    assert choice.text == ref["text"]
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    assert out.usage.completion_tokens == 5
    want = [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
    assert choice.logprobs.token_logprobs == pytest.approx(want, abs=1e-5)
    assert [len(t) for t in choice.logprobs.top_logprobs] == [2] * 5
    # greedy: the token drawn is the most likely one
    for tok, top in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs):
        assert max(top, key=top.get) == tok
    echoed = client.completions.create(model="tiny", prompt=QUESTION, max_tokens=5,
                                       temperature=0, echo=True, extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == QUESTION + ref["text"]
    streamed = list(client.completions.create(model="tiny", prompt=QUESTION, max_tokens=5,
                                              temperature=0, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == ref["text"]
    assert streamed[-1].choices[0].finish_reason == "length"


@pytest.mark.slow
def test_max_tokens_ends_with_length(client: openai.OpenAI):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3,
                                         temperature=1.0, seed=7,
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 3
    newer = client.chat.completions.create(model="tiny", messages=MESSAGES,
                                           max_completion_tokens=2, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert newer.usage.completion_tokens == 2


@pytest.mark.slow
def test_n_choices_share_the_prompt(client: openai.OpenAI):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, n=2, max_tokens=6,
                                         temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == len(rendered(MESSAGES))  # counted once, not per choice
    assert out.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, n=2,
                                                 max_tokens=6, temperature=1.0, stream=True,
                                                 extra_body={"ignore_eos": True}))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}
    texts = client.completions.create(model="tiny", prompt=["Hi", "Weng earns"], n=2,
                                      max_tokens=4, extra_body={"ignore_eos": True})
    assert [c.index for c in texts.choices] == [0, 1, 2, 3]
    assert texts.usage.completion_tokens == 16


@pytest.mark.slow
def test_chat_logprobs_are_the_engines(served: Engine, client: openai.OpenAI):
    ids = rendered(MESSAGES)
    ref = generate(served, {"input_ids": ids, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6,
                                         temperature=0, logprobs=True, top_logprobs=3,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    want = ref["meta_info"]["output_token_logprobs"]
    assert [c.logprob for c in content] == pytest.approx([lp for lp, _, _ in want], abs=1e-5)
    tok = tiny_tokenizer()
    for entry, (_, token_id, _) in zip(content, want):
        assert entry.token == tok.decode([token_id])
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the top one was drawn
        assert all(math.isfinite(t.logprob) for t in entry.top_logprobs)
        if "\ufffd" not in entry.token:  # a whole character: its bytes are its UTF-8
            assert bytes(entry.bytes) == entry.token.encode()
    streamed = [c for c in client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
        stream=True, extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs]
    assert [e.logprob for c in streamed for e in c.choices[0].logprobs.content] == \
        pytest.approx([lp for lp, _, _ in want], abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kwargs,needle", [
    ({"extra_body": {"regex": "[0-9]+"}}, "regex"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"temperature": -1}, "temperature"),
    ({"tool_choice": "required", "tools": [{"type": "function",
                                            "function": {"name": "add"}}]}, "tool_choice"),
    ({"max_tokens": 10**6}, "max_completion_tokens"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_unsupported_or_bad_fields_get_an_openai_error(client: openai.OpenAI, kwargs, needle):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, **kwargs)
    body = info.value.body
    assert body["object"] == "error" and body["code"] == 400 and body["type"]
    assert needle in body["message"]


@pytest.mark.slow
def test_empty_prompt_and_lora_model_are_refused(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError, match="Prompt cannot be empty"):
        client.completions.create(model="tiny", prompt="")
    with pytest.raises(openai.BadRequestError, match="LoRA"):
        client.completions.create(model="tiny:my-adapter", prompt="Hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="Messages cannot be empty"):
        client.chat.completions.create(model="tiny", messages=[])


@pytest.mark.slow
def test_the_api_key_is_required(served: Engine):
    wrong = openai.OpenAI(base_url=f"{served.url}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)


# ---- SGLang's shapes (tests/fixtures/sglang/v1_*.json) --------------------------------------
def _post_raw(engine: Engine, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    req = urllib.request.Request(engine.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _chunk_kind(chunk: dict[str, Any]) -> str:
    if not chunk["choices"]:
        return "usage"
    choice = chunk["choices"][0]
    if choice.get("delta", {}).get("role"):
        return "role"
    return "finish" if choice["finish_reason"] else "content"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["v1_models", "v1_chat_completions", "v1_completions",
                                  "v1_chat_completions_error", "v1_chat_completions_stream",
                                  "v1_completions_stream"])
def test_answers_have_sglangs_shape(served: Engine, name: str):
    from test_sglang_fixtures import Shape, load

    fx = load(name)
    shape = Shape(fx)
    if fx["method"] == "GET":
        status, raw = 200, urllib.request.urlopen(urllib.request.Request(
            served.url + fx["path"], headers={"Authorization": f"Bearer {KEY}"})).read()
    else:
        request = dict(fx["request"])
        if "stream" in fx:
            # the tiny random model may say EOS first; then its one chunk is content and finish
            # at once. SGLang's own `ignore_eos` keeps the three tokens the fixture shows.
            request["ignore_eos"] = True
        status, raw = _post_raw(served, fx["path"], request)
    assert status == fx["status"], raw
    if "stream" not in fx:
        reply = json.loads(raw)
        assert shape.errors(reply, fx["response"]) == []
        if name.endswith("error"):
            assert reply["message"].startswith("max_completion_tokens is too large: 1000000000.")
        return
    events = [line[len("data: "):] for line in raw.decode().splitlines()
              if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    # Tokens made while the engine's event loop was busy go out together (SGLang's tokenizer
    # manager, too, sends only a request's newest output): the fixture's three completion
    # tokens may come as one chunk, content and finish at once. That chunk then holds the whole
    # answer; the content chunk's own shape: test_a_stream_fed_token_by_token_has_sglangs_chunks.
    kinds = [_chunk_kind(c) for c in chunks]
    if fx["path"] == "/v1/completions" and [k for k in kinds if k != "usage"] == ["finish"]:
        del request["stream"], request["stream_options"]
        status, whole = _post_raw(served, fx["path"], request)
        assert status == 200, whole
        assert chunks[0]["choices"][0]["text"] == json.loads(whole)["choices"][0]["text"]
        required = {"finish", "usage"}
    else:
        required = None
    assert _stream_errors(fx, chunks, required) == []


def _stream_errors(fx: dict[str, Any], chunks: list[dict[str, Any]],
                   required: set[str] | None = None) -> list[str]:
    """Where a stream's chunks differ from the fixture's chunks of their kind (role, content,
    finish, usage); every kind of the fixture must be there unless `required` says which."""
    from test_sglang_fixtures import Shape

    shape = Shape(fx)
    templates = {_chunk_kind(c): c for c in fx["stream"]}
    templates.setdefault("finish", templates["content"])  # completions: on the last content
    kinds = [_chunk_kind(c) for c in chunks]
    errors = [f"chunk kinds {kinds}, SGLang's {sorted(templates)}"] \
        if set(kinds) - set(templates) or (required or set(templates)) - set(kinds) else []
    return errors + [f"chunk {i} ({k}): {e}" for i, (c, k) in enumerate(zip(chunks, kinds))
                     if k in templates for e in shape.errors(c, templates[k])]


@pytest.mark.parametrize("name", ["v1_completions_stream", "v1_chat_completions_stream"])
def test_a_stream_fed_token_by_token_has_sglangs_chunks(name: str):
    """The streamer driven one token at a time (over HTTP, tokens may coalesce into one chunk):
    every kind of SGLang's chunks, content included, in SGLang's shape."""
    from test_sglang_fixtures import load

    fx = load(name)
    tok = tiny_tokenizer()
    served = openai_requests.ServedModel("default", api.ModelLimits(context_length=4096,
                                                                    vocab_size=len(tok)))
    parse = openai_requests.parse_completion if "messages" not in fx["request"] \
        else openai_requests.parse_chat
    call = parse({**fx["request"], "ignore_eos": True}, served, tok)
    (live,) = call.requests
    streamer = openai_responses.Streamer(call, tok, openai_common.TokenBytes(tok), None)
    tokens = tok.encode(" Paris is the capital", add_special_tokens=False)[:live.max_new_tokens]
    assert len(tokens) == live.max_new_tokens >= 2
    chunks = []
    for k, token in enumerate(tokens):
        live.output_ids.append(token)
        if k == len(tokens) - 1:
            live.finish_reason = {"type": "length", "length": len(tokens)}
        chunks += streamer.events(0)
    chunks += streamer.closing()
    chunks = json.loads(json.dumps(chunks))  # as sent
    assert _stream_errors(fx, chunks) == []  # every kind required


# ---- pure functions ------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                    "b": {"type": "number"}}}}}]
# The tool part of Qwen2.5's template, on the tiny tokenizer's ChatML.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_tools_reach_the_chat_template_as_sglang_dumps_them():
    tok = tiny_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    msgs = [{"role": "user", "content": "2+3?"}]
    tools = openai_common.parse_tools(TOOLS)
    ids = openai_requests.render_chat(tok, msgs, tools, {}, False)
    text = tok.decode(ids)
    # Tool.model_dump(): the function's keys as sent, then the wrapper's defer_loading (null).
    assert ('{"type": "function", "function": {"name": "add", "description": "Add two '
            'numbers."') in text
    assert '"defer_loading": null}' in text
    assert ids == tok.encode(tok.apply_chat_template(msgs, tools=tools, tokenize=False,
                                                     add_generation_prompt=True),
                             add_special_tokens=False)
    assert "<tools>" not in tok.decode(openai_requests.render_chat(tok, msgs, None, {}, False))


def test_a_last_assistant_message_is_continued_or_taken_as_the_users():
    tok = tiny_tokenizer()
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]
    cont = tok.decode(openai_requests.render_chat(tok, msgs, None, {}, True))
    assert cont.endswith("<|im_start|>assistant\nHello the")
    as_user = tok.decode(openai_requests.render_chat(tok, msgs, None, {}, False))
    assert as_user.endswith("<|im_start|>user\nHello the<|im_end|>\n<|im_start|>assistant\n")


def test_parse_tool_calls_qwen25_and_hermes():
    out = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
           '</tool_call>\n<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
    parse = openai_common.parse_sglang_tool_calls
    parsed = parse(out, openai_common.parse_tools(TOOLS), "qwen25")
    assert parsed.text == "Let me add."
    assert parsed.calls == [{"name": "add", "arguments": '{"a": 2, "b": 3}'}]  # nope: unknown
    bad = parse("<tool_call>\n{oops}\n</tool_call>", TOOLS, "qwen25")
    assert bad.calls == [] and bad.text == ""
    hermes = parse('x<tool_call>{"name": "add", "arguments": {"a": 1}}'
                   '</tool_call>', TOOLS, "hermes")
    assert hermes.text == "x" and hermes.calls == [{"name": "add", "arguments": '{"a": 1}'}]
    assert parse("<tool_call>{oops", TOOLS, "hermes").text == \
        "<tool_call>{oops"
    assert parse("plain", TOOLS, "qwen25").calls == []


def _finished_request(tok: Any, text: str, rid: str = "r") -> Request:
    r = Request(rid=rid, input_ids=[1, 2, 3], params=parse_sampling_params({}, len(tok)),
                max_new_tokens=64, on_progress=lambda _: None)
    r.output_ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    r.finish_reason = {"type": "stop", "matched": tok.eos_token_id}
    r.weight_version = "v1"
    return r


def test_chat_answer_with_a_tool_call_streamed_or_not():
    tok = tiny_tokenizer()
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    call = openai_requests.OpenAICall("chat", "m", [_finished_request(tok, text)], 1, False,
                                      tools=openai_common.parse_tools(TOOLS))
    tb = openai_common.TokenBytes(tok)
    body = openai_responses.chat_response(call, tok, tb, "qwen25")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["matched_stop"] is None
    assert choice["message"]["content"] == "Sure."
    (tc,) = choice["message"]["tool_calls"]
    assert tc["type"] == "function" and tc["id"].startswith("call_") and tc["index"] == 0
    assert tc["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}

    # Streaming, fed token by token: the marker never leaks into content.
    full = _finished_request(tok, text)
    live = Request(rid="r", input_ids=[1, 2, 3], params=full.params, max_new_tokens=64,
                   on_progress=lambda _: None)
    scall = openai_requests.OpenAICall("chat", "m", [live], 1, True, tools=call.tools)
    streamer = openai_responses.Streamer(scall, tok, tb, "qwen25")
    events = []
    for k, token in enumerate(full.output_ids):
        live.output_ids.append(token)
        if k == len(full.output_ids) - 1:
            live.finish_reason = full.finish_reason
        events += streamer.events(0)
    events += streamer.closing()
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure."
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    assert [c["function"] for c in calls] == [tc["function"]]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_stream_safe_holds_back_a_possible_stop_string_and_broken_utf8():
    assert openai_responses.stream_safe("hello wor", ["world"]) == "hello "
    assert openai_responses.stream_safe("hello", ["xyz"]) == "hello"
    assert openai_responses.stream_safe("abc\ufffd", []) == "abc"


def test_tools_and_fields_are_validated():
    served = openai_requests.ServedModel("m", api.ModelLimits(context_length=64, vocab_size=2048))
    tok = tiny_tokenizer()
    with pytest.raises(openai_common.OpenAIError, match="tools\\[0\\]"):
        openai_requests.parse_chat({"messages": MESSAGES, "tools": [{"type": "function"}]},
                                   served, tok)
    with pytest.raises(openai_common.OpenAIError, match="content part 'image_url'"):
        openai_requests.parse_chat({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}, served, tok)
    with pytest.raises(openai_common.OpenAIError, match="context length"):
        openai_requests.parse_chat({"messages": MESSAGES, "max_tokens": 60}, served, tok)
    with pytest.raises(openai_common.OpenAIError, match="seed must be an integer"):
        openai_requests.parse_completion({"prompt": "Hi", "seed": "x"}, served, tok)
    ok = openai_requests.parse_chat({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "max_tokens": 2},
        served, tok)
    assert tok.decode(ok.requests[0].input_ids).endswith("user\na b<|im_end|>\n"
                                                          "<|im_start|>assistant\n")


def test_chat_sampling_defaults_come_from_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "do_sample": True}))
    defaults = openai_requests.generation_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    served = openai_requests.ServedModel("m", api.ModelLimits(context_length=512,
                                                              vocab_size=2048),
                                         chat_defaults=defaults)
    tok = tiny_tokenizer()
    p = openai_requests.parse_chat({"messages": MESSAGES, "max_tokens": 2, "top_p": 0.5},
                                   served, tok).requests[0].params
    assert (p.temperature, p.top_p, p.top_k) == (0.7, 0.5, 20)  # the request's value wins
    # completions keep the OpenAI defaults, as SGLang's
    c = openai_requests.parse_completion({"prompt": "Hi"}, served, tok).requests[0]
    assert (c.params.temperature, c.params.top_p, c.params.top_k, c.max_new_tokens) == \
        (1.0, 1.0, -1, 16)
    assert openai_requests.generation_defaults(str(tmp_path / "none")) == {}
