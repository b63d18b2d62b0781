"""`rollmesh engine`: the built-in inference server, SGLang's HTTP contract on transformers.

    rollmesh engine --model tiny|CHECKPOINT_DIR --port P [--host 127.0.0.1]
        [--weight-version default] [--device auto|cpu|cuda] [--dtype auto|float32|bfloat16|float16]
        [--max-running-requests 64] [--seed S] [--threads N]
        [--disable-radix-cache] [--prefix-cache-max-tokens 65536]
        [--enable-lora] [--lora-paths NAME=PATH] [--max-lora-rank R]
        [--lora-target-modules MODULE ...]

This module owns the HTTP side and the process lifecycle: the aiohttp routes of
docs/sglang-api.md (the weight routes in weight_routes.py, the OpenAI ones in openai_api.py),
start-up (load, merge the `--lora-paths` adapter, warm up, serve) and graceful shutdown on
SIGTERM/SIGINT. LoRA adapters (lora.py) are merged into the weights, one at a time.
The model itself belongs to the scheduler thread (scheduler.py); handlers only submit work to it
and await the answer, so the event loop stays responsive even while a weight broadcast blocks
the scheduler inside a collective.

Where this engine differs from SGLang 0.5.23 (all within the contract): pause mode `retract`
keeps requests and their KV in place like `in_place` (same results, no memory is reclaimed);
the prefix cache (SGLang's radix cache: `--disable-radix-cache` turns it off) is a token-count
budget of its own, not a share of one KV pool, and every weight update clears it, whatever the
update's `flush_cache` says (SGLang keeps its cache when `flush_cache` is false, and so hands
out KV the old weights made); constrained decoding and the other request fields api.py lists
as refused get a 400 naming the field; a streamed response sends the whole response so far in each event (cumulative
`text` and `output_ids`); the n samples of one prompt get ids `<rid>_<k>`, not fresh uuids.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from rollmesh import __version__
from rollmesh.engine import auth
from rollmesh.engine.builtin import api
from rollmesh.models import loading as models
from rollmesh.engine.builtin import openai_api
from rollmesh.engine.builtin.bodies import MalformedBody, error_reply, read_body
from rollmesh.engine.builtin.sampling import BadRequest
from rollmesh.config import engine_args
from rollmesh.engine.builtin.scheduler import Request, Scheduler
from rollmesh.engine.builtin.weight_routes import WeightRoutes
from rollmesh.engine.builtin.memory import MemoryRoutes
from rollmesh.engine.builtin import lora
from rollmesh.runtime.log import configure_logging

PAUSE_MODES = ("abort", "retract", "in_place")
# SGLang's /flush_cache text (http_server.py `flush_cache`).
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running "
           "or waiting requests, the operation will not be performed.)\n")
# /v1/loads `include` sections (SGLang's LoadSnapshot.VALID_SECTIONS).
LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


def _validation_error(message: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "type": "Bad Request",
                              "param": None, "code": 400}, status=400)


@web.middleware
async def _bad_requests(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except MalformedBody as e:
        return _validation_error(str(e))
    except BadRequest as e:
        return error_reply(str(e))


def _api_key_guard(key: str | None, admin_key: str | None = None) -> Any:
    """SGLang's --api-key and --admin-api-key (rollmesh.engine.auth.decide): every route but
    the /health* probes needs `Authorization: Bearer <key>`, the admin routes (weights, the
    version, pause, abort, flush, memory, LoRA) the admin key where one is set: the engine's
    HTTP is reachable by anyone on the network, and its weight routes would let them replace
    the model. A refusal is SGLang's 401 `{"error": "Unauthorized"}`."""

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        if not auth.decide(request.method, request.path, request.headers.get("Authorization"),
                           key, admin_key):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return guard


def read_api_key(path: str | None) -> str | None:
    """The engine's API key from a file (one line; refused if others may read it)."""
    if not path:
        return None
    mode = os.stat(path).st_mode & 0o077
    if mode:
        raise PermissionError(f"{path}: the engine API key file must not be readable by group "
                              f"or others (mode {oct(os.stat(path).st_mode & 0o777)}; chmod 600)")
    key = Path(path).read_text().strip()
    if not key:
        raise ValueError(f"{path}: the engine API key file is empty")
    return key


class EngineServer:
    def __init__(self, args: argparse.Namespace, model: Any, tokenizer: Any, log: Any) -> None:
        self.args = args
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        config = model.config.get_text_config()
        self.limits = api.ModelLimits(
            context_length=config.max_position_embeddings,
            vocab_size=model.get_input_embeddings().num_embeddings,
            max_requests=getattr(args, "max_requests_per_call", api.MAX_REQUESTS_PER_CALL),
        )
        self.scheduler = Scheduler(
            model, tokenizer, weight_version=args.weight_version,
            max_running_requests=args.max_running_requests, seed=args.seed,
            prefix_cache_tokens=None if args.disable_radix_cache
            else args.prefix_cache_max_tokens,
            decode_backend=getattr(args, "decode_backend", "auto"),
            decode_graphs=False if getattr(args, "disable_cuda_graph", False) else None)
        self.weights = WeightRoutes(self)  # the weight routes and the groups they joined
        self.lora = lora.LoRARoutes(self, lora_state(args))  # /load_lora_adapter, ...
        if self.lora.state.enabled:
            self.scheduler.lora = self.lora.state  # requests checked again at admission
        # /generate requests by rid until they finish: a second request with a live rid is
        # refused, as SGLang's tokenizer manager refuses it (its rid_to_state).
        self._live: dict[str, Request] = {}
        self.startup_time = time.time()
        self.log = log

    def app(self) -> web.Application:
        middlewares = [_bad_requests]
        keys = getattr(self.args, "api_key", None), getattr(self.args, "admin_api_key", None)
        if any(keys):
            middlewares.insert(0, _api_key_guard(*keys))
        app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.model_info)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self.server_info)
        for path in ("/get_weight_version", "/weight_version"):
            r.add_get(path, self.weight_version)
        r.add_get("/v1/loads", self.loads)
        for path in ("/tokenize", "/v1/tokenize"):
            r.add_post(path, self.tokenize)
        self.weights.register(r)  # /init_weights_update_group, /update_weights_from_..., ...
        self.lora.register(r)  # /load_lora_adapter, /unload_lora_adapter
        MemoryRoutes(self).register(r)  # /release_memory_occupation, /resume_memory_occupation
        openai_api.OpenAIRoutes(self).register(r)  # /v1/models, /v1/completions, /v1/chat/...
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)
        return app

    # ---- lifecycle ----
    async def _on_startup(self, _app: web.Application) -> None:
        self.scheduler.start()
        for name, path in lora.parse_lora_paths(getattr(self.args, "lora_paths", None)):
            failed = await self.lora.load(name, path)  # --lora-paths: served from the start
            if failed is not None:
                raise RuntimeError(f"--lora-paths {name}={path}: {failed[0]}")
        # Warm up: a model the batch cache cannot serve fails here, not on the first client.
        warm, _ = api.parse_generate({"input_ids": [0, 0], "sampling_params": {
            "max_new_tokens": 2, "temperature": 0}}, self.limits, self.tokenizer)
        await self._run_internal(warm, timeout=300)
        if not self.scheduler.alive():
            raise RuntimeError(f"engine warm-up failed: {self.scheduler.fatal}")
        self.log.info("engine_ready", bind=self.args.host, port=self.args.port,
                      model=self.args.model, device=str(self.device),
                      dtype=str(self.model.dtype), weight_version=self.scheduler.weight_version,
                      context_length=self.limits.context_length,
                      max_running_requests=self.args.max_running_requests,
                      prefix_cache_max_tokens=None if self.args.disable_radix_cache
                      else self.args.prefix_cache_max_tokens)

    async def _on_shutdown(self, _app: web.Application) -> None:
        # Answer every in-flight /generate (abort, 503) before aiohttp waits for the handlers.
        self.log.info("engine_shutting_down", **self.scheduler.stats())
        if self.scheduler.alive():
            try:
                # Bounded: the scheduler may be stuck in a collective whose trainer is gone.
                await asyncio.wait_for(asyncio.wrap_future(self.scheduler.submit("shutdown")), 10)
            except TimeoutError:
                self.log.warning("scheduler_did_not_stop", busy_loading=self.scheduler.busy_loading)
                return
        self.weights.destroy_groups()

    async def scheduler_call(self, kind: str, *args: Any) -> Any:
        """Run `kind` on the scheduler thread (its `submit`) and await the result; 503 when
        the scheduler is not running."""
        if not self.scheduler.alive():
            raise web.HTTPServiceUnavailable(text="engine scheduler is not running")
        return await asyncio.wrap_future(self.scheduler.submit(kind, *args))

    def claim_rids(self, requests: list[Request]) -> None:
        """Register a /generate call's requests under their rids before they are scheduled;
        a rid that a request still in flight holds (or that the call names twice) is refused
        with SGLang's 400 (tokenizer_manager.py: "Duplicate request ID detected: <rid>").
        Finished requests are dropped here, so nothing needs releasing."""
        for rid in [rid for rid, r in self._live.items() if r.finished]:
            del self._live[rid]
        seen: set[str] = set()
        for req in requests:
            if req.rid in self._live or req.rid in seen:
                raise BadRequest(f"Duplicate request ID detected: {req.rid}")
            seen.add(req.rid)
        self._live.update((req.rid, req) for req in requests)

    # ---- generation ----
    def submit(self, requests: list[Request]) -> asyncio.Queue[int]:
        """Claim the requests' rids (BadRequest for a live one), hook their progress to a queue
        on this event loop (it receives the index of the request that advanced) and hand them
        to the scheduler together: a group shares its prefill. /generate and the OpenAI routes
        both come through here."""
        loop = asyncio.get_running_loop()
        progress: asyncio.Queue[int] = asyncio.Queue()

        def on_progress_of(i: int) -> Any:
            def on_progress(_: Request) -> None:  # scheduler thread
                # RuntimeError: the event loop is closed, nobody is waiting any more.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(progress.put_nowait, i)
            return on_progress

        for req in requests:
            self.lora.state.check_request(req.lora)  # BadRequest: an adapter it cannot have
        for i, req in enumerate(requests):
            req.on_progress = on_progress_of(i)
        self.claim_rids(requests)
        self.scheduler.add_all(requests)
        return progress

    @staticmethod
    async def finished(requests: list[Request], progress: asyncio.Queue[int]) -> None:
        while not all(r.finished for r in requests):
            await progress.get()

    @contextlib.contextmanager
    def abort_if_gone(self, requests: list[Request]) -> Iterator[None]:
        """A client that went away (its handler cancelled, its connection reset) aborts its
        requests: their batch slots are freed."""
        try:
            yield
        except (asyncio.CancelledError, ConnectionResetError):
            for req in requests:
                self.scheduler.abort_request(req)
            raise

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await read_body(request)
        call = api.parse_generate_call(body, self.limits, self.tokenizer)
        if not self.scheduler.alive():
            return error_reply("engine scheduler is not running", 503)
        progress = self.submit(call.requests)
        with self.abort_if_gone(call.requests):
            if call.stream:
                return await self._stream(request, call, progress)
            await self.finished(call.requests, progress)
        bodies = [api.response_of(r, self.tokenizer) for r in call.requests]
        status = max((r.finish_reason or {}).get("status_code") or 200 for r in call.requests)
        return web.json_response(bodies if call.batched else bodies[0], status=status)

    async def _stream(self, request: web.Request, call: api.GenerateCall,
                      progress: asyncio.Queue[int]) -> web.StreamResponse:
        # Each event carries one request's whole response so far (cumulative text and
        # output_ids); in a batch (or n > 1) it also carries its `index` in the list, as SGLang's
        # _handle_batch_request adds it.
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        sent = [0] * len(call.requests)
        started = [False] * len(call.requests)
        done = [False] * len(call.requests)
        while not all(done):
            i = await progress.get()
            req = call.requests[i]
            finished = req.finished
            if done[i] or (len(req.output_ids) <= sent[i] and not finished):
                continue
            body = api.response_of(req, self.tokenizer, first_response=not started[i])
            if call.batched:
                body["index"] = i
            sent[i], started[i], done[i] = len(body["output_ids"]), True, finished
            await resp.write(f"data: {json.dumps(body)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_body(request, optional=True)
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            raise MalformedBody("abort_request takes {'rid': str, 'abort_all': bool}")
        self.scheduler.abort(rid, abort_all)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await read_body(request, optional=True)
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise MalformedBody(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        await self.scheduler_call("pause", mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self.scheduler_call("continue")
        return web.json_response({"message": "Generation continued successfully.",
                                  "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if await self.scheduler_call("flush"):
            return web.Response(text=FLUSHED)
        return web.Response(status=400,
                            text="Cache not flushed: requests are running or waiting.\n")

    # ---- health and info ----
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.scheduler.alive() else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        if not self.scheduler.alive():
            return web.Response(status=503)
        s = self.scheduler
        if s.paused or s.busy_loading or s.memory_released:
            return web.Response(status=200)  # alive; it generates again once resumed
        if s.running:
            # Busy: decode steps advancing is proof enough, without queueing behind a full batch.
            steps, deadline = s.decode_steps, time.monotonic() + 30
            while time.monotonic() < deadline and s.running and s.decode_steps == steps:
                await asyncio.sleep(0.01)
            if s.decode_steps != steps:
                return web.Response(status=200)
        req, _ = api.parse_generate(
            {"input_ids": [0], "rid": f"health-{time.monotonic_ns()}",
             "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
            self.limits, self.tokenizer)
        if not await self._run_internal(req, timeout=30):
            return web.Response(status=503)
        ok = (req.finish_reason or {}).get("type") != "abort" or s.paused
        return web.Response(status=200 if ok else 503)

    async def _run_internal(self, req: Request, timeout: float) -> bool:
        """Run an engine-made request to the end; False if it did not finish in time."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def on_progress(_: Request) -> None:  # scheduler thread
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        req.on_progress = on_progress
        req.internal = True
        self.scheduler.add(req)
        try:
            await asyncio.wait_for(done, timeout=timeout)
        except TimeoutError:
            self.scheduler.abort_request(req)
            return False
        return True

    async def model_info(self, request: web.Request) -> web.Response:
        config = self.model.config
        return web.json_response({
            "model_path": self.args.model,
            "served_model_name": self.args.model,
            "tokenizer_path": self.args.tokenizer_path or self.args.model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.scheduler.weight_version,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": config.model_type,
            "architectures": config.architectures or [type(self.model).__name__],
        })

    async def server_info(self, request: web.Request) -> web.Response:
        a = self.args
        return web.json_response({
            "model_path": a.model, "tokenizer_path": a.tokenizer_path or a.model,
            "host": a.host, "port": a.port,
            "device": str(self.device), "dtype": str(self.model.dtype).removeprefix("torch."),
            "served_model_name": a.model, "tp_size": 1, "dp_size": 1, "pp_size": 1,
            "max_running_requests": a.max_running_requests,
            "disable_radix_cache": a.disable_radix_cache,
            "prefix_cache_max_tokens": a.prefix_cache_max_tokens,
            "random_seed": a.seed, "context_length": self.limits.context_length,
            "vocab_size": self.limits.vocab_size, "skip_tokenizer_init": False,
            "weight_version": self.scheduler.weight_version,
            "weight_update_groups": sorted(self.weights.groups),
            "weight_update_session_open": self.weights.session_open,
            "weight_updates_outside_session": self.weights.updates_outside_session,
            # SGLang's LoRA server arguments (as started; /load_lora_adapter's answer lists
            # the adapters loaded now)
            "enable_lora": self.lora.state.enabled or None,
            "max_lora_rank": getattr(a, "max_lora_rank", None),
            "lora_target_modules": getattr(a, "lora_target_modules", None),
            # SGLang's scheduler_info (scheduler.py `get_init_info`)
            "status": "ready", "max_total_num_tokens": self._token_capacity(),
            "max_req_input_len": self.limits.context_length - 1,
            "startup_time": self.startup_time,
            "version": __version__, "engine": "rollmesh-builtin",
            "internal_states": [self.scheduler.stats()],
        })

    async def weight_version(self, request: web.Request) -> web.Response:
        """`{"weight_version": ...}`: SGLang's /get_weight_version and /weight_version before
        0.5.23 (which answers 404 and reports it in /model_info); slime still polls it."""
        return web.json_response({"weight_version": self.scheduler.weight_version})

    def _token_capacity(self) -> int:
        # No fixed KV pool here: the most tokens a full batch can hold.
        return self.args.max_running_requests * self.limits.context_length

    async def loads(self, request: web.Request) -> web.Response:
        """SGLang's /v1/loads (entrypoints/v1_loads.py, managers/load_snapshot.py): one load
        per data-parallel rank, here the one rank 0, with the core keys (this engine has none
        of the optional sections: memory, speculative, lora, disaggregation, queues)."""
        q = request.query
        include = {s.strip() for s in q.get("include", "").split(",") if s.strip()}
        bad = include - LOAD_SECTIONS
        if bad:
            return error_reply(f"Invalid include sections: {sorted(bad)}. "
                          f"Valid options: {sorted(LOAD_SECTIONS)}")
        if q.get("dp_rank") not in (None, "0"):
            return error_reply(f"dp_rank {q.get('dp_rank')!r}: this engine has one rank, 0")
        fmt = q.get("format", "json")
        if fmt not in ("json", "prometheus"):
            return error_reply(f"format must be json or prometheus, got {fmt!r}")
        s = self.scheduler
        running, waiting = list(s.running), list(s.waiting)
        used = sum(len(r.input_ids) + len(r.output_ids) for r in running)
        capacity = self._token_capacity()
        load = {
            "timestamp": time.time(), "dp_rank": 0,
            "num_running_reqs": len(running), "num_waiting_reqs": len(waiting),
            "num_waiting_uncached_tokens": sum(len(r.input_ids) for r in waiting),
            "num_used_tokens": used, "num_total_tokens": used, "num_active_tokens": used,
            "num_prealloc_ready_tokens": 0, "max_total_num_tokens": capacity,
            "max_running_requests": self.args.max_running_requests,
            "token_usage": used / capacity if capacity else 0.0,
            "gen_throughput": 0.0,
            "cache_hit_rate": s.cached_prompt_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            "utilization": len(running) / self.args.max_running_requests,
            "total_prefill_uncached_tokens": s.prefill_tokens,
            "total_prefill_busy_us": 0, "decode_moments": None,
        }
        if fmt == "prometheus":
            lines = []
            for key, value in load.items():
                if key != "dp_rank" and isinstance(value, (int, float)):
                    lines += [f"# TYPE sglang_{key} gauge", f'sglang_{key}{{dp_rank="0"}} {value}']
            return web.Response(text="\n".join(lines) + "\n",
                                content_type="text/plain", charset="utf-8")
        return web.json_response({
            "timestamp": datetime.now(timezone.utc).isoformat(), "version": __version__,
            "accelerator": torch.cuda.get_device_name(self.device)
            if self.device.type == "cuda" else None,
            "num_accelerators": 1, "loads": [load],
        })

    async def tokenize(self, request: web.Request) -> web.Response:
        """SGLang's /tokenize (openai/serving_tokenize.py): `prompt` (a string or a list of
        them) or chat `messages` -> `{"tokens", "count", "max_model_len"}`."""
        if request.content_type != "application/json":  # SGLang's validate_json_request
            raise MalformedBody("Unsupported Media Type: Only 'application/json' is allowed")
        b = await read_body(request)
        prompt, messages = b.get("prompt"), b.get("messages")
        if (prompt is None) == (messages is None):
            raise MalformedBody("Exactly one of 'prompt' or 'messages' must be provided.")
        special = b.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise MalformedBody("add_special_tokens must be a boolean")
        max_len = getattr(self.tokenizer, "model_max_length", -1)
        if not isinstance(max_len, int) or not -(2**63) <= max_len < 2**64:
            max_len = self.limits.context_length
        if messages is not None:
            generation = b.get("add_generation_prompt")
            if not isinstance(messages, list) or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
                raise MalformedBody("messages must be a list of {role, content} objects")
            if generation is not None and not isinstance(generation, bool):
                raise MalformedBody("add_generation_prompt must be a boolean")
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True if generation is None else generation,
                tokenize=True, return_dict=True)["input_ids"]
            return web.json_response({"tokens": list(ids), "count": len(ids),
                                      "max_model_len": max_len})
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=special)
            return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": max_len})
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            ids_list = [self.tokenizer.encode(p, add_special_tokens=special) for p in prompt]
            return web.json_response({"tokens": ids_list, "count": [len(i) for i in ids_list],
                                      "max_model_len": max_len})
        raise MalformedBody("prompt must be a string or a list of strings")

def lora_state(args: argparse.Namespace) -> lora.LoRAState:
    """The LoRA settings of the command line, checked as SGLang's check_lora_server_args
    checks them (ValueError); `--lora-paths` enables LoRA unless --enable-lora is false."""
    paths = lora.parse_lora_paths(getattr(args, "lora_paths", None))
    enabled = bool(getattr(args, "enable_lora", None)) or bool(paths)
    rank = getattr(args, "max_lora_rank", None)
    targets = getattr(args, "lora_target_modules", None)
    if enabled:
        if not paths and not (rank and targets):
            raise lora.LoRAError(
                "When no initial --lora-paths is provided, you need to specify both "
                "--max-lora-rank and --lora-target-modules for LoRA initialization.")
        if targets and "all" in targets and len(targets) != 1:
            raise lora.LoRAError("If 'all' is specified in --lora-target-modules, it should be "
                                 "the only module specified.")
        if len(paths) > 1:
            raise lora.LoRAError(f"--lora-paths names {len(paths)} adapters: the built-in "
                                 "engine merges one adapter into its weights and holds at most "
                                 "one at a time")
    return lora.LoRAState(enabled=enabled, max_rank=rank,
                          target_modules=set(targets) if targets else None)


def _parser() -> argparse.ArgumentParser:
    return engine_args.parser(description=__doc__)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    log = configure_logging("engine", port=args.port)
    try:
        lora_state(args)
    except lora.LoRAError as e:
        log.error("engine_bad_lora_args", error=str(e))
        return 2
    try:
        args.api_key = read_api_key(args.api_key_file)
        args.admin_api_key = read_api_key(getattr(args, "admin_api_key_file", None))
    except (OSError, ValueError) as e:
        log.error("engine_bad_api_key", error=str(e))
        return 2
    if not args.api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("engine_unauthenticated", host=args.host,
                    hint="anyone who reaches this port can replace the weights: --api-key-file")
    threads = args.threads
    if not threads and models.is_tiny(args.model) and "OMP_NUM_THREADS" not in os.environ:
        threads = 1
    if threads:
        torch.set_num_threads(threads)
    try:
        device = models.resolve_device(args.device)
        dtype = models.resolve_dtype(args.dtype, device)
        start = time.perf_counter()
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model, tokenizer = models.load_model(
            args.model, device, dtype, tokenizer_path=args.tokenizer_path,
            trust_remote_code=args.trust_remote_code)
    except models.ModelSpecError as e:
        log.error("engine_bad_model", error=str(e))
        return 2
    for param in model.parameters():
        param.requires_grad_(False)
    log.info("model_loaded", model=args.model, device=str(device), dtype=str(dtype),
             threads=torch.get_num_threads(), seconds=round(time.perf_counter() - start, 2))
    server = EngineServer(args, model, tokenizer, log)
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None,
                shutdown_timeout=10, handler_cancellation=True)
    log.info("engine_stopped")
    return 0
