"""SGLang's HTTP bodies (tests/fixtures/sglang/*.json, taken from SGLang 0.5.23's source; see
docs/sglang-api.md) hold both sides of rollmesh to SGLang:

(a) rollmesh's EngineClient parses every fixture response, served by a stub server that answers
    each route with its fixture (and the requests the client sends have SGLang's field types);
(b) the built-in engine answers each fixture request with the same keys, nesting and types,
    compared recursively; a mismatch names the field path, e.g.
    `meta_info.output_token_logprobs[0][2]: expected null|str, got int`.

Each fixture models what varies in SGLang's answer explicitly: `_types` (a path whose type is a
union, e.g. a log-prob entry's text `str|null`), `_optional` (a key SGLang sends only
sometimes, with when), `_open` (an object of which the fixture lists only some keys: SGLang's
/get_server_info has one per server argument) and `_tuples` (fixed-length lists such as
`[logprob, token_id, text]`). Every other key must be there, with the fixture value's type, and
a key the fixture does not have is a mismatch too, except the built-in engine's documented
extensions (BUILTIN_EXTENSIONS: keys SGLang does not send, which clients that do not read them
ignore; docs/sglang-api.md, "Built-in engine extensions").
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_harness import Engine

from rollmesh.weight_sync.buckets import WeightSpec
from rollmesh.weight_sync.handles import LOAD_FORMAT as HANDLES_FORMAT
from rollmesh.weight_sync.handles import encode_handles, layout, tensor_body
from rollmesh.engine.client import (
    EngineClient,
    EngineRequestError,
    GenerateOutput,
    error_message,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sglang"
NAMES = sorted(p.stem for p in FIXTURES.glob("*.json"))


def load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


# -- the shape comparison --------------------------------------------------------------------------


# Keys the built-in engine adds to SGLang's bodies, by generic path (docs/sglang-api.md, "Built-in
# engine extensions"): allowed in its answers, never required. Their values are tested where the
# feature is (tests/engine/test_engine_in_place.py).
BUILTIN_EXTENSIONS = frozenset({
    "meta_info.output_token_weight_versions",  # the weight version of every output token
})


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    for t, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"),
                    (list, "list"), (dict, "dict")):
        if isinstance(v, t):
            return name
    return type(v).__name__


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class Shape:
    """A fixture's declared variations, keyed by generic path (`[*]` for any list item)."""

    def __init__(self, fixture: dict[str, Any]) -> None:
        self.types = {p: set(t.split("|")) for p, t in fixture.get("_types", {}).items()}
        self.optional = set(fixture.get("_optional", {})) | BUILTIN_EXTENSIONS
        self.open = set(fixture.get("_open", []))
        self.tuples = set(fixture.get("_tuples", []))

    def errors(self, actual: Any, expected: Any) -> list[str]:
        out: list[str] = []
        # A list body (a batch) is checked item by item under the item's own paths.
        if isinstance(expected, list) and "" not in self.tuples and "" not in self.types:
            if not isinstance(actual, list):
                return [f"<body>: expected list, got {_kind(actual)}"]
            if len(actual) != len(expected):
                out.append(f"<body>: expected {len(expected)} responses, got {len(actual)}")
            for i, (a, e) in enumerate(zip(actual, expected)):
                self._check(a, e, f"[{i}]", "", out)
            return out
        self._check(actual, expected, "", "", out)
        return out

    def _check(self, actual: Any, expected: Any, path: str, generic: str, out: list[str]) -> None:
        allowed = self.types.get(generic, {_kind(expected)})
        kind = _kind(actual)
        if kind not in allowed:
            out.append(f"{path or '<body>'}: expected {'|'.join(sorted(allowed))}, got {kind}")
            return
        if kind == "dict" and isinstance(expected, dict):
            for key, value in expected.items():
                if key not in actual:
                    if _join(generic, key) not in self.optional:
                        out.append(f"{_join(path, key)}: missing")
                    continue
                self._check(actual[key], value, _join(path, key), _join(generic, key), out)
            if generic not in self.open:
                for key in sorted(actual.keys() - expected.keys()):
                    if _join(generic, key) not in self.optional:
                        out.append(f"{_join(path, key)}: not in SGLang's response")
        elif kind == "list" and isinstance(expected, list):
            if generic in self.tuples:
                if len(actual) != len(expected):
                    out.append(f"{path}: expected {len(expected)} items, got {len(actual)}")
                    return
                for i, (a, e) in enumerate(zip(actual, expected)):
                    self._check(a, e, f"{path}[{i}]", f"{generic}[{i}]", out)
            elif expected:
                for i, a in enumerate(actual):
                    # the fixture item of the same kind (a union list holds one of each)
                    e = next((x for x in expected if _kind(x) == _kind(a)), expected[0])
                    self._check(a, e, f"{path}[{i}]", f"{generic}[*]", out)


def test_the_shape_check_names_the_field_path():
    fx = load("generate_logprobs_text")
    shape = Shape(fx)
    good = json.loads(json.dumps(fx["response"]))
    assert shape.errors(good, fx["response"]) == []
    bad = json.loads(json.dumps(good))
    bad["meta_info"]["output_token_logprobs"][0][2] = 7
    del bad["meta_info"]["cached_tokens"]
    bad["meta_info"]["extra"] = 1
    bad["meta_info"]["output_token_logprobs"][1] = [-1.0, 12]
    assert shape.errors(bad, fx["response"]) == [
        "meta_info.output_token_logprobs[0][2]: expected null|str, got int",
        "meta_info.output_token_logprobs[1]: expected 3 items, got 2",
        "meta_info.cached_tokens: missing",
        "meta_info.extra: not in SGLang's response",
    ]
    # a declared union accepts each of its types, and nothing else
    bad["meta_info"]["output_top_logprobs"][0] = None
    bad["meta_info"]["output_top_logprobs"][1] = "x"
    assert ("meta_info.output_top_logprobs[1]: expected list|null, got str"
            in shape.errors(bad, fx["response"]))
    assert not any("output_top_logprobs[0]" in e for e in shape.errors(bad, fx["response"]))


def test_every_fixture_names_its_source():
    assert len(NAMES) >= 40
    for name in NAMES:
        fx = load(name)
        assert fx["_release"].startswith("sglang 0.5.23"), name
        assert fx["_source"] and all(s["file"] and s["lines"] for s in fx["_source"]), name
        assert fx["method"] in ("GET", "POST") and fx["path"].startswith("/"), name
        assert "response" in fx or "stream" in fx, name


# -- (a) the client parses every fixture response -------------------------------------------------


class StubSGLang:
    """An aiohttp server answering each route with a fixture's status and body, recording the
    request bodies it gets."""

    def __init__(self, routes: dict[tuple[str, str], str]) -> None:
        self.routes = routes
        self.requests: dict[str, list[Any]] = defaultdict(list)

    async def __aenter__(self) -> str:
        from aiohttp import web

        async def handle(request: web.Request) -> web.StreamResponse:
            name = self.routes.get((request.method, request.path))
            if name is None:
                return web.json_response({"detail": "Not Found"}, status=404)
            raw = await request.read()
            self.requests[name].append(json.loads(raw) if raw else None)
            fx = load(name)
            body = fx.get("body", "json")
            if body == "empty":
                return web.Response(status=fx["status"])
            if body == "text":
                return web.Response(status=fx["status"], text=fx["response"])
            return web.json_response(fx["response"], status=fx["status"])

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: Any) -> None:
        await self.runner.cleanup()


def _request_type_errors(name: str, sent: Any) -> list[str]:
    """The client's request body against the fixture's: every key they share has SGLang's
    type (the client may leave out fields that have defaults)."""
    fx = load(name)
    expected = fx["request"] or {}
    shape = Shape(fx)
    errors = []
    for key, value in (sent or {}).items():
        if key not in expected:
            errors.append(f"{name}: the client sends {key!r}, which the fixture does not show")
            continue
        out: list[str] = []
        shape._check(value, expected[key], key, key, out)
        errors += [f"{name}: {e}" for e in out]
    return errors


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("generate")])
def test_client_parses_generate_responses(name):
    fx = load(name)
    bodies = fx["response"] if "response" in fx else [fx["stream"][-1]]
    for body in bodies if isinstance(bodies, list) else [bodies]:
        out = GenerateOutput.from_response(body["meta_info"]["id"], "http://x", body)
        meta = body["meta_info"]
        assert out.output_ids == body["output_ids"]
        assert out.finish_reason == meta["finish_reason"]["type"]
        assert out.weight_version == meta["weight_version"]
        assert out.prompt_tokens == meta["prompt_tokens"]
        assert out.logprobs == [t[0] for t in meta.get("output_token_logprobs", [])]


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("error")])
def test_client_reads_every_error_shape(name):
    fx = load(name)
    body = fx["response"]
    expected = (body["error"]["message"] if isinstance(body.get("error"), dict)
                else body.get("error") if isinstance(body.get("error"), str) else body["message"])
    assert error_message(json.dumps(body)) == expected
    assert error_message("Cache not flushed.\n") == "Cache not flushed."


def test_client_against_sglang_bodies():
    routes = {
        ("POST", "/generate"): "generate_logprobs",
        ("POST", "/abort_request"): "abort_request",
        ("POST", "/pause_generation"): "pause_generation_retract",
        ("POST", "/continue_generation"): "continue_generation",
        ("POST", "/flush_cache"): "flush_cache",
        ("GET", "/health"): "health",
        ("GET", "/health_generate"): "health_generate",
        ("GET", "/get_model_info"): "get_model_info",
        ("GET", "/get_server_info"): "get_server_info",
        ("POST", "/init_weights_update_group"): "init_weights_update_group",
        ("POST", "/update_weights_from_distributed"):
            "update_weights_from_distributed_flattened_bucket",
        ("POST", "/destroy_weights_update_group"): "destroy_weights_update_group",
        ("POST", "/update_weights_from_disk"): "update_weights_from_disk",
        ("POST", "/update_weight_version"): "update_weight_version",
        ("POST", "/update_weights_from_tensor"): "update_weights_from_tensor",
        ("POST", "/begin_weight_update"): "begin_weight_update",
        ("POST", "/end_weight_update"): "end_weight_update",
        ("POST", "/release_memory_occupation"): "release_memory_occupation",
        ("POST", "/resume_memory_occupation"): "resume_memory_occupation",
    }
    stub = StubSGLang(routes)

    async def main() -> None:
        async with stub as url, EngineClient([url], retries=0) as client:
            fx = load("generate_logprobs")
            out = await client.generate([5, 6, 7], {"max_new_tokens": 2, "temperature": 0},
                                        rid="fx-lp")
            assert out.output_ids == fx["response"]["output_ids"]
            assert out.logprobs == [-0.52, -1.3] and out.finish_reason == "length"
            assert await client.health(url) and await client.health(url, generate=True)
            await client.pause("retract")
            await client.resume()
            await client.flush_cache()
            await client.release_memory(["kv_cache"])  # colocated mode's turn
            await client.resume_memory(["kv_cache"])
            await client.abort_all()
            assert await client.weight_versions() == ["default"]
            info = (await client.server_info())[0]
            assert info["max_total_num_tokens"] == 1048576
            named = load("update_weights_from_distributed_flattened_bucket")["request"]
            await client.start_init_weights_update_group("10.0.0.1", 29600)
            await client.start_update_weights_from_distributed(
                named["names"], named["dtypes"], named["shapes"], weight_version="3",
                load_format="flattened_bucket")
            await client.destroy_weights_update_group()
            await client.update_weights_from_disk("/ckpt/step_3", "3")
            await client.update_weight_version("4")
            # the body the trainer sends by handle (sync.transport = "handles")
            entries, size = layout([WeightSpec("lm_head.weight", torch.bfloat16, (4, 2))])
            table = encode_handles(entries, segment="rollmesh_w_1_1", segment_size=size)
            await client.weight_update_session(begin=True)
            await client.update_weights_from_tensor(
                lambda _s: tensor_body([table], HANDLES_FORMAT, "3", True))
            await client.weight_update_session(begin=False)

        _assert_sglang_requests(stub, routes)

    asyncio.run(main())


def _assert_sglang_requests(stub: Any, routes: dict[tuple[str, str], str]) -> None:
    """Every request the stub got has SGLang's field types, and every route was called."""
    errors = []
    for name, sent in stub.requests.items():
        for body in sent:
            errors += _request_type_errors(name, body)
    assert errors == []
    assert set(stub.requests) == set(routes.values())


@pytest.mark.parametrize(("name", "status"), [("error_generate_duplicate_rid", 400),
                                             ("error_generate_schema", 400),
                                             ("error_validation", 400),
                                             ("error_unauthorized", 401),
                                             ("update_weights_from_disk_failed", 400),
                                             ("load_lora_adapter_failed", 400)])
def test_client_error_names_sglangs_message(name, status):
    fx = load(name)
    routes = {(fx["method"], fx["path"]): name}

    async def main() -> None:
        async with StubSGLang(routes) as url, EngineClient([url], retries=0) as client:
            with pytest.raises(EngineRequestError) as e:
                if fx["path"] == "/generate":
                    await client.generate([5, 6, 7], {"max_new_tokens": 2})
                elif fx["path"] == "/update_weights_from_disk":
                    await client.update_weights_from_disk("/no/such/dir", "3")
                elif fx["path"] == "/pause_generation":
                    await client.pause("abort")
                elif fx["path"] == "/load_lora_adapter":
                    await client.load_lora_adapter("policy", "/ckpt/lora/v3")
                else:
                    await client.model_info()
            assert e.value.status == status
            assert error_message(json.dumps(fx["response"])) in str(e.value)
            assert "{" not in str(e.value).split(f"HTTP {status}: ", 1)[1][:1]

    asyncio.run(main())


def test_client_lora_against_sglang_bodies():
    """The trainer's LoRA sync and a rollout client naming the adapter, against SGLang's
    bodies: the requests have SGLang's field types."""
    routes = {("POST", "/generate"): "generate_lora",
              ("POST", "/load_lora_adapter"): "load_lora_adapter",
              ("POST", "/unload_lora_adapter"): "unload_lora_adapter"}
    stub = StubSGLang(routes)

    async def main() -> None:
        async with stub as url, EngineClient([url], retries=0, lora_path="policy") as client:
            await client.unload_lora_adapter("policy", missing_ok=True)
            await client.load_lora_adapter("policy", "/ckpt/lora/v3")
            out = await client.generate([5, 6, 7], {"max_new_tokens": 4, "temperature": 0},
                                        return_logprob=False)
            assert out.output_ids == load("generate_lora")["response"]["output_ids"]
        assert stub.requests["generate_lora"][0]["lora_path"] == "policy"
        _assert_sglang_requests(stub, routes)

    asyncio.run(main())


# -- (b) the built-in engine answers with SGLang's shapes -----------------------------------------


def _call(engine: Engine, fx: dict[str, Any]) -> tuple[int, Any]:
    if fx["method"] == "GET":
        return engine.get(fx["path"])
    return engine.post(fx["path"], fx["request"])


def _engine_request(engine: Engine, name: str) -> dict[str, Any]:
    """The fixture request, fitted to the tiny random model so that it finishes as the
    fixture's did: the stop token or string is one the model is about to produce (found by a
    first greedy run), and the others ignore EOS, which would end them early with a stop."""
    body = json.loads(json.dumps(load(name)["request"]))
    sp = body["sampling_params"]
    if name in ("generate_stop_token", "generate_stop_string"):
        status, probe = engine.post("/generate", {
            "input_ids": body["input_ids"], "sampling_params": {
                "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
        assert status == 200, probe
        if name == "generate_stop_token":
            sp["stop_token_ids"] = [probe["output_ids"][2]]
        else:
            sp["stop"] = [probe["text"][2:5]]  # ends well before max_new_tokens
    else:
        sp["ignore_eos"] = True
    return body


def _stream(engine: Engine, body: dict[str, Any]) -> list[dict[str, Any]]:
    req = urllib.request.Request(engine.url + "/generate", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def _by_position(chunks: list[dict[str, Any]]) -> dict[Any, list[dict[str, Any]]]:
    groups: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for c in chunks:
        groups[c.get("index")].append(c)
    return groups


def _template(sequence: list[dict[str, Any]], i: int, n: int) -> dict[str, Any]:
    """The fixture chunk an engine chunk is held to: first to first, last to last, others to
    an intermediate one."""
    if i == n - 1:
        return sequence[-1]
    if i == 0:
        return sequence[0]
    return sequence[1] if len(sequence) > 2 else sequence[0]


# generate_abort needs an abort while it runs: test_engine_abort_has_sglangs_shape;
# generate_lora an adapter loaded: test_engine_lora_routes_have_sglangs_shape
GENERATE = [n for n in NAMES if n.startswith("generate")
            and n not in ("generate_abort", "generate_lora")]


@pytest.mark.slow
@pytest.mark.parametrize("name", GENERATE)
def test_engine_generate_has_sglangs_shape(engine, name):
    fx = load(name)
    shape = Shape(fx)
    body = _engine_request(engine, name)
    if "stream" in fx:
        chunks = _stream(engine, body)
        errors = []
        expected = _by_position(fx["stream"])
        got = _by_position(chunks)
        assert set(got) == set(expected), (sorted(got, key=str), sorted(expected, key=str))
        for index, seq in got.items():
            for i, chunk in enumerate(seq):
                tpl = _template(expected[index], i, len(seq))
                errors += [f"chunk {index}/{i}: {e}" for e in shape.errors(chunk, tpl)]
        assert errors == [], "\n".join(errors)
        return
    status, reply = engine.post("/generate", body)
    assert status == fx["status"], reply
    errors = shape.errors(reply, fx["response"])
    assert errors == [], "\n".join(errors)
    if name == "generate_stop_token" and reply["meta_info"]["finish_reason"]["type"] == "stop":
        assert isinstance(reply["meta_info"]["finish_reason"]["matched"], int)


def _wait_running(engine: Engine, result: dict[str, Any], timeout: float = 60) -> None:
    """Until the engine runs a request (the one a thread just sent, whose reply lands in
    `result`); fails if that request was answered first or nothing ran in time."""
    deadline = time.monotonic() + timeout
    while engine.stats()["running_requests"] == 0:
        assert "r" not in result, f"answered before it could be interrupted: {result['r']}"
        assert time.monotonic() < deadline, "the engine never ran the request"
        time.sleep(0.01)


@pytest.mark.slow
def test_engine_abort_has_sglangs_shape(engine):
    fx = load("generate_abort")
    body = _engine_request(engine, "generate_abort")
    body["sampling_params"].update(max_new_tokens=3000, ignore_eos=True)
    result: dict[str, Any] = {}
    t = threading.Thread(target=lambda: result.update(r=engine.post("/generate", body)))
    t.start()
    _wait_running(engine, result)
    status, reply = engine.post("/abort_request", load("abort_request")["request"] | {
        "rid": body["rid"]})
    assert status == 200 and reply is None
    t.join(60)
    status, reply = result["r"]
    assert status == 200
    errors = Shape(fx).errors(reply, fx["response"])
    assert errors == [], "\n".join(errors)


@pytest.mark.slow
def test_engine_refuses_a_duplicate_rid(engine):
    fx = load("error_generate_duplicate_rid")
    body = json.loads(json.dumps(fx["request"]))
    body["sampling_params"].update(max_new_tokens=3000, ignore_eos=True)
    result: dict[str, Any] = {}
    t = threading.Thread(target=lambda: result.update(r=engine.post("/generate", body)))
    t.start()
    _wait_running(engine, result)
    status, reply = engine.post("/generate", body)
    assert status == fx["status"], reply
    assert Shape(fx).errors(reply, fx["response"]) == []
    assert reply == fx["response"]  # the very message
    engine.post("/abort_request", {"rid": body["rid"]})
    t.join(60)
    assert result["r"][0] == 200
    # once the first has finished, the rid is free again
    body["sampling_params"].update(max_new_tokens=2)
    assert engine.post("/generate", body)[0] == 200


CONTROL = ["abort_request", "abort_request_all", "pause_generation_abort",
           "pause_generation_retract", "pause_generation_in_place", "continue_generation",
           "flush_cache", "health", "health_generate", "get_model_info", "get_weight_version",
           "get_server_info", "v1_loads", "tokenize", "tokenize_batch", "error_validation",
           "update_weights_from_distributed_failed", "error_generate_too_long",
           "update_weights_from_tensor_failed", "begin_weight_update", "end_weight_update"]


@pytest.mark.slow
@pytest.mark.parametrize("name", CONTROL)
def test_engine_routes_have_sglangs_shape(engine, name):
    fx = load(name)
    try:
        status, reply = _call(engine, fx)
    finally:
        if name.startswith("pause_generation"):
            assert engine.post("/continue_generation", {})[0] == 200
    assert status == fx["status"], reply
    body = fx.get("body", "json")
    if body == "empty":
        assert reply is None, reply
        return
    if body == "text":
        assert isinstance(reply, str) and reply, reply
        return
    errors = Shape(fx).errors(reply, fx["response"])
    assert errors == [], "\n".join(errors)


@pytest.mark.slow
def test_engine_update_weight_version_has_sglangs_shape(tmp_path):
    e = Engine(tmp_path / "engine.log")
    try:
        for name in ("update_weight_version", "update_weights_from_disk_failed"):
            fx = load(name)
            status, reply = _call(e, fx)
            assert status == fx["status"], reply
            assert Shape(fx).errors(reply, fx["response"]) == [], name
        assert e.get("/get_weight_version")[1] == {"weight_version": "4"}
    finally:
        e.stop()


@pytest.mark.slow
def test_engine_api_key_as_sglang(tmp_path):
    key_file = tmp_path / "engine.token"
    key_file.write_text("k3y\n")
    key_file.chmod(0o600)
    e = Engine(tmp_path / "engine.log", "--api-key-file", str(key_file))
    try:
        fx = load("error_unauthorized")
        status, reply = e.get(fx["path"])
        assert status == 401 and reply == fx["response"]
        for path in ("/health", "/health_generate"):
            assert e.get(path)[0] == 200, path  # every /health* probe is open
        req = urllib.request.Request(e.url + "/get_weight_version",
                                     headers={"Authorization": "bearer k3y"})
        with urllib.request.urlopen(req, timeout=30) as resp:  # scheme case-insensitive
            assert resp.status == 200
    finally:
        e.stop()


@pytest.mark.slow
@pytest.mark.parametrize("load_format", ["tensor", "flattened_bucket"])
def test_engine_weight_sync_has_sglangs_shape(tmp_path, load_format):
    """A real broadcast (the trainer side in a subprocess): the replies of init, update and
    destroy against the fixtures."""
    import subprocess
    import sys

    from engine_harness import REPO, free_port, repo_env

    here = Path(__file__).parent
    e = Engine(tmp_path / "engine.log")
    try:
        if load_format == "tensor":
            cmd = [sys.executable, str(here / "trainer_broadcast.py"), e.url, str(free_port()),
                   "tiny:seed=3", "3"]
        else:
            steps = json.dumps([{"spec": "tiny:seed=3", "version": "3"}])
            cmd = [sys.executable, str(here / "bucket_broadcast.py"), e.url, str(free_port()),
                   steps]
        done = subprocess.run(cmd, cwd=REPO, env=repo_env(), capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        replies = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        e.stop()
    if load_format == "tensor":
        pairs = [("init", "init_weights_update_group"),
                 ("update", "update_weights_from_distributed_tensor"),
                 ("destroy", "destroy_weights_update_group")]
        for key, name in pairs:
            fx = load(name)
            assert Shape(fx).errors(replies[key], fx["response"]) == [], (name, replies[key])
    else:
        fx = load("update_weights_from_distributed_flattened_bucket")
        updates = [r for step in replies["updates"] for r in step]  # per step, per bucket
        assert updates, replies
        for reply in updates:
            assert Shape(fx).errors(reply, fx["response"]) == [], reply
        for key, name in (("init", "init_weights_update_group"),
                          ("destroy", "destroy_weights_update_group")):
            fx = load(name)
            assert Shape(fx).errors(replies[key], fx["response"]) == [], (name, replies[key])


@pytest.mark.slow
def test_engine_refusals_as_sglang(engine):
    """SGLang's 400s on the routes it validates: /tokenize wants a JSON content type and one of
    prompt or messages; /v1/loads knows its include sections."""
    fx = load("error_validation")
    shape = Shape(fx)
    req = urllib.request.Request(engine.url + "/tokenize", data=b'{"prompt": "hi"}',
                                 method="POST", headers={"Content-Type": "text/plain"})
    try:
        urllib.request.urlopen(req, timeout=30)
        raise AssertionError("a text/plain /tokenize was accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 400
        reply = json.loads(e.read())
    assert shape.errors(reply, fx["response"]) == [] and "application/json" in reply["message"]
    status, reply = engine.post("/tokenize", {"prompt": "hi", "messages": []})
    assert status == 400 and shape.errors(reply, fx["response"]) == []
    assert "Exactly one of 'prompt' or 'messages'" in reply["message"]
    status, reply = engine.get("/v1/loads?include=core,bogus")
    assert status == 400 and "bogus" in reply["error"]["message"]
    status, reply = engine.get("/v1/loads?include=core")
    assert status == 200 and reply["loads"][0]["dp_rank"] == 0
    status, reply = engine.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and reply["count"] == len(reply["tokens"]) > 0


@pytest.mark.slow
def test_engine_lora_routes_have_sglangs_shape(tmp_path):
    """A LoRA-enabled engine (SGLang's flags without an initial adapter): load, a refused
    second load, a /generate naming the adapter, unload, against the fixtures; the fixtures'
    lora_path is replaced by an adapter directory written for the tiny model."""
    from engine_harness import write_lora_adapter

    from rollmesh.models.loading import build_tiny

    adapter = tmp_path / "adapter"
    model, _ = build_tiny("tiny")
    write_lora_adapter(adapter, model, ["model.layers.0.self_attn.q_proj",
                                        "model.layers.1.mlp.down_proj"])
    e = Engine(tmp_path / "engine.log", "--enable-lora", "--max-lora-rank", "8",
               "--lora-target-modules", "all")
    try:
        for name in ("load_lora_adapter", "load_lora_adapter_failed", "generate_lora",
                     "unload_lora_adapter"):
            fx = load(name)
            body = json.loads(json.dumps(fx["request"]))
            if "lora_path" in body and name != "generate_lora":
                body["lora_path"] = str(adapter)
            if name == "generate_lora":
                body["sampling_params"]["ignore_eos"] = True
            status, reply = e.post(fx["path"], body)
            assert status == fx["status"], (name, reply)
            assert Shape(fx).errors(reply, fx["response"]) == [], (name, reply)
            if name.endswith("_failed"):
                assert reply["error_message"] == fx["response"]["error_message"]
            if name == "load_lora_adapter":
                assert reply["loaded_adapters"] == {"policy": str(adapter)}
        status, reply = e.post("/unload_lora_adapter", {"lora_name": "policy"})
        assert status == 400 and Shape(load("unload_lora_adapter")).errors(
            reply, load("unload_lora_adapter")["response"]) == []
        assert reply["error_message"] == ("LoRA with name policy does not exist. Loaded LoRAs: "
                                          "dict_keys([])") and reply["loaded_adapters"] is None
    finally:
        e.stop()
