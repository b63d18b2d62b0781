"""The OpenAI-compatible routes of the built-in engine, as SGLang 0.5.23 serves them.

    GET  /v1/models, /v1/models/{model}
    POST /v1/completions, /v1/chat/completions   (JSON, or SSE with "stream": true)

Read from SGLang 0.5.23's `srt/entrypoints/openai/` (`protocol.py`, `serving_chat.py`,
`serving_completions.py`, `serving_base.py`, `utils.py`, `usage_processor.py`, `sse_utils.py`)
and `srt/function_call/{qwen25,hermes}_detector.py`. An OpenAI request is translated into the
/generate body SGLang's handlers build (`GenerateReqInput`: `input_ids` or `text`,
`sampling_params`, `return_logprob`, `top_logprobs_num`, `logprob_start_len`,
`return_text_in_logprobs`), parsed by api.py like any /generate body, and run on the scheduler
the way server.generate runs it; the answer is built from the same response bodies.

What follows SGLang: the field names, defaults and shapes of requests, choices, chunks, usage and
`metadata.weight_version`; errors `{"object": "error", "message", "type", "param", "code"}` with
the HTTP status in `code`; chat prompts rendered by the tokenizer's own chat template
(`apply_chat_template(tokenize=False, add_generation_prompt=True, tools=...)`, then encoded
without special tokens), `tools` handed to the template unless `tool_choice` is "none", a last
assistant message turned into a user one unless `continue_final_message`; chat sampling defaults
(temperature, top_p, top_k, min_p, repetition_penalty) from the checkpoint's
generation_config.json where it has them; streamed chat sends a role chunk, content deltas, then
one finish chunk per choice, an optional usage chunk and `data: [DONE]`; tool calls parsed only
with `--tool-call-parser` (qwen25/qwen: `<tool_call>\\n{json}\\n</tool_call>`, hermes:
`<tool_call>{json}</tool_call>`), finish_reason "tool_calls" after a natural stop.

Where it differs (each on the side of refusing rather than guessing): a field SGLang's pydantic
models would drop unseen is refused as unknown; fields SGLang implements and this engine does
not (constrained decoding, `tool_choice` "required" or a named tool, LoRA, multimodal content,
reasoning parsers, hidden states, ...) are refused when set; a streamed delta holds back text
that may still turn out to be part of a stop string or of an unfinished UTF-8 character, so the
deltas add up to the non-streamed text; log-probs of held-back tokens ride on the next chunk
instead of being dropped; a streamed tool call arrives whole in one delta (name and arguments)
rather than in argument fragments; message content parts are flattened to text for every
template (SGLang keeps them as parts for templates that loop over them).

This module holds the routes (`OpenAIRoutes`); a request is read by `openai_requests`, answered
by `openai_responses`, and the message, tool and log-prob rules the agent endpoint
(`rollmesh.agents.openai_agent`) shares are in `rollmesh.engine.openai_common`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from rollmesh.engine.builtin.openai_requests import (
    OpenAICall, ServedModel, generation_defaults, parse_chat, parse_completion,
)
from rollmesh.engine.builtin.openai_responses import (
    Streamer, abort_error, chat_response, completion_response, model_card, models_body,
)
from rollmesh.engine.builtin.sampling import BadRequest
from rollmesh.engine.openai_common import OpenAIError, TokenBytes


def error_body(message: str, status: int = 400, err_type: str = "BadRequestError") -> dict:
    """serving_base.create_error_response: the HTTP status is repeated in `code`."""
    return {"object": "error", "message": message, "type": err_type, "param": None,
            "code": status}


def error_response(e: OpenAIError) -> web.Response:
    return web.json_response(error_body(e.message, e.status, e.err_type), status=e.status)


# ---- HTTP ---------------------------------------------------------------------------------
class OpenAIRoutes:
    """The handlers, bound to a running EngineServer (its scheduler, tokenizer, limits)."""

    def __init__(self, server: Any) -> None:
        self.server = server
        args = server.args
        self.served = ServedModel(
            name=getattr(args, "served_model_name", None) or args.model,
            limits=server.limits,
            tool_call_parser=getattr(args, "tool_call_parser", None),
            chat_defaults=generation_defaults(args.model),
        )
        self.token_bytes = TokenBytes(server.tokenizer)

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_get("/v1/models", self.models)
        router.add_get("/v1/models/{model:.+}", self.retrieve_model)
        router.add_post("/v1/completions", self.completions)
        router.add_post("/v1/chat/completions", self.chat_completions)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(models_body(self.served))

    async def retrieve_model(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        if model != self.served.name:
            return web.json_response({"error": {
                "message": f"The model '{model}' does not exist", "type": "invalid_request_error",
                "param": "model", "code": "model_not_found"}}, status=404)
        return web.json_response(model_card(self.served))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_chat)

    async def _serve(self, request: web.Request,
                     parse: Callable[[Any, ServedModel, Any], OpenAICall]) -> web.StreamResponse:
        tokenizer = self.server.tokenizer
        try:
            call = parse(await _json_body(request), self.served, tokenizer)
        except OpenAIError as e:
            return error_response(e)
        scheduler = self.server.scheduler
        if not scheduler.alive():
            return error_response(OpenAIError("engine scheduler is not running", 503,
                                              "ServiceUnavailable"))
        try:  # a live rid is refused, as /generate refuses it
            progress = self.server.submit(call.requests)
        except BadRequest as e:
            return error_response(OpenAIError(str(e)))
        with self.server.abort_if_gone(call.requests):
            if call.stream:
                return await self._stream(request, call, progress)
            await self.server.finished(call.requests, progress)
        error = abort_error(call)
        if error is not None:
            return error_response(error)
        if call.kind == "chat":
            body = chat_response(call, tokenizer, self.token_bytes, self.served.tool_call_parser)
        else:
            body = completion_response(call, tokenizer, self.token_bytes)
        return web.json_response(body)

    async def _stream(self, request: web.Request, call: OpenAICall,
                      progress: asyncio.Queue[int]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        streamer = Streamer(call, self.server.tokenizer, self.token_bytes,
                             self.served.tool_call_parser)

        async def send(event: dict[str, Any]) -> None:
            await resp.write(f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode())

        failed = False
        while not all(st.done for st in streamer.state):
            i = await progress.get()
            error = abort_error(call) if call.requests[i].finished else None
            if error is not None:
                # serving_*: a system abort ends the stream with an error event.
                await send({"error": error_body(error.message, error.status, error.err_type)})
                for req in call.requests:
                    self.server.scheduler.abort_request(req)
                failed = True
                break
            for event in streamer.events(i):
                await send(event)
        if not failed:
            for event in streamer.closing():
                await send(event)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _json_body(request: web.Request) -> Any:
    """SGLang's validate_json_request and FastAPI's parsing, as 400 ErrorResponses."""
    media = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise OpenAIError(f"Unsupported Media Type: Only 'application/json' is allowed "
                          f"(got {media or 'no Content-Type'!r})", 400, "Bad Request")
    raw = await request.read()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"malformed JSON: {e}", 400, "Bad Request") from None
    except RecursionError:
        raise OpenAIError("malformed JSON: nested too deeply", 400, "Bad Request") from None
