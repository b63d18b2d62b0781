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
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from rollmesh.engine.builtin import api
from rollmesh.engine.builtin.sampling import BadRequest
from rollmesh.engine.builtin.scheduler import Request

from rollmesh.config.engine_args import TOOL_CALL_PARSERS  # noqa: E402
DEFAULT_MODEL_NAME = "default"  # protocol.py: the `model` a request may leave out
# model_config.get_default_sampling_params: the generation_config.json keys chat defaults take.
_GENERATION_DEFAULT_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")

# ---- request fields ----------------------------------------------------------------------
# Accepted and without effect here: metadata, request routing, cache namespaces of a prefix
# cache this engine does not have.
_NO_EFFECT = {"user", "store", "metadata", "service_tier", "safety_identifier",
              "prompt_cache_key", "extra_key", "cache_salt", "priority", "data_parallel_rank",
              "routed_dp_rank", "disagg_prefill_dp_rank", "custom_labels"}
# SGLang implements these and this engine does not: refused unless null/false/empty/0.
_REFUSED_COMMON = ("json_schema", "regex", "ebnf", "stop_regex", "lora_path", "session_id",
                   "session_params", "custom_logit_processor", "watermark", "images_config",
                   "mm_processor_kwargs", "return_hidden_states", "return_routed_experts",
                   "routed_experts_start_len", "return_cached_tokens_details",
                   "return_spec_tokens_details", "bootstrap_host", "bootstrap_port",
                   "bootstrap_room")
_REFUSED_CHAT = _REFUSED_COMMON + (
    "video_config", "max_dynamic_patch", "min_dynamic_patch", "use_audio_in_video",
    "return_meta_info", "return_input_ids_in_sglext", "return_output_ids_in_sglext",
    "return_sampling_mask", "sampling_logprobs_mode", "return_flat_raw_output_top_logprobs",
    "reasoning_effort", "reasoning", "thinking", "task")
_SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                    "presence_penalty", "repetition_penalty", "logit_bias", "seed", "stop",
                    "stop_token_ids", "n", "min_tokens", "ignore_eos", "no_stop_trim",
                    "skip_special_tokens", "custom_params"}
_COMPLETION_FIELDS = _SAMPLING_FIELDS | {
    "model", "prompt", "best_of", "echo", "logprobs", "max_tokens", "stream", "stream_options",
    "suffix", "return_token_ids", "rid", "response_format"}
_CHAT_FIELDS = _SAMPLING_FIELDS | {
    "model", "messages", "logprobs", "top_logprobs", "max_tokens", "max_completion_tokens",
    "stream", "stream_options", "tools", "tool_choice", "parallel_tool_calls",
    "continue_final_message", "chat_template_kwargs", "input_ids", "rid", "return_token_ids",
    "return_prompt_token_ids", "response_format", "separate_reasoning", "stream_reasoning",
    "return_flat_raw_top_logprobs_b64"}
# api.py's messages name /generate's sampling_params; the client sent the OpenAI names.
_RENAMED = {"sampling_params.max_new_tokens": "max_tokens", "sampling_params.min_new_tokens":
            "min_tokens", "sampling_params.sampling_seed": "seed", "sampling_params.": ""}
_MESSAGE_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder",
                  "root")  # case-insensitive; "user" is exact (protocol.py)


class OpenAIError(Exception):
    """A request answered with SGLang's ErrorResponse body."""

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message, self.status, self.err_type = message, status, err_type


def error_body(message: str, status: int = 400, err_type: str = "BadRequestError") -> dict:
    """serving_base.create_error_response: the HTTP status is repeated in `code`."""
    return {"object": "error", "message": message, "type": err_type, "param": None,
            "code": status}


def error_response(e: OpenAIError) -> web.Response:
    return web.json_response(error_body(e.message, e.status, e.err_type), status=e.status)


@dataclass(frozen=True)
class ServedModel:
    """What the routes need to know of the model: its name, limits and chat behaviour."""

    name: str
    limits: api.ModelLimits
    tool_call_parser: str | None = None
    chat_defaults: dict[str, Any] = field(default_factory=dict)


@dataclass
class OpenAICall:
    """A parsed OpenAI request: the scheduler requests (prompt-major, n per prompt) and how to
    answer them."""

    kind: str  # "chat" | "completion"
    model: str
    requests: list[Request]
    n: int
    stream: bool
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: bool = False
    echo: list[str] | None = None  # completions: the text put before each prompt's choices
    echo_logprobs: bool = False  # completions: the prompt's log-probs lead each choice's
    tools: list[dict[str, Any]] | None = None  # chat: tools whose calls are parsed
    return_token_ids: bool = False
    return_prompt_token_ids: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


def generation_defaults(model_path: str) -> dict[str, Any]:
    """The checkpoint's recommended chat sampling parameters (SGLang's --sampling-defaults
    model): the keys of generation_config.json among _GENERATION_DEFAULT_KEYS, if it has one."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {k: config[k] for k in _GENERATION_DEFAULT_KEYS if config.get(k) is not None}


# ---- field checks ------------------------------------------------------------------------
def _check_fields(body: dict[str, Any], known: set[str], refused: tuple[str, ...],
                  what: str) -> None:
    for key, value in body.items():
        if key in refused:
            if value not in (None, False, 0, "", [], {}):
                raise OpenAIError(f"{key} is not supported by the built-in engine")
        elif key not in known and key not in _NO_EFFECT:
            raise OpenAIError(f"unknown field {key!r} in the {what} request (the built-in "
                              f"engine refuses fields it does not implement)")


def _typed(body: dict[str, Any], key: str, types: Any, default: Any, what: str) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise OpenAIError(f"{key} must be {what}, got {value!r}")
    return value


def _as_tuple(types: Any) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def _positive(body: dict[str, Any], key: str) -> int | None:
    value = _typed(body, key, int, None, "an integer")
    if value is not None and value <= 0:
        raise OpenAIError(f"{key} must be positive")
    return value


def _stream_options(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    opts = _typed(body, "stream_options", dict, None, "an object")
    if opts is None:
        return False, False
    if not stream:
        raise OpenAIError("stream_options is only allowed when stream is true")
    unknown = set(opts) - {"include_usage", "continuous_usage_stats"}
    if unknown:
        raise OpenAIError(f"unknown field(s) {sorted(unknown)} in stream_options")
    return (bool(_typed(opts, "include_usage", bool, False, "a boolean")),
            bool(_typed(opts, "continuous_usage_stats", bool, False, "a boolean")))


def _model_name(body: dict[str, Any], served: ServedModel) -> str:
    """The request's `model`, echoed in the answer; a LoRA adapter named in it
    ('base:adapter', serving_base._parse_model_parameter) is refused."""
    model = _typed(body, "model", str, DEFAULT_MODEL_NAME, "a string")
    if ":" in model and model != served.name:
        prefix = f"{served.name}:"
        adapter = model[len(prefix):] if model.startswith(prefix) else model.split(":", 1)[1]
        if adapter.strip():
            raise OpenAIError(f"model {model!r} names a LoRA adapter ({adapter.strip()!r}); the "
                              f"built-in engine serves no adapters")
    return model


def _response_format(body: dict[str, Any]) -> None:
    fmt = body.get("response_format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") != "text":
        raise OpenAIError("response_format other than {'type': 'text'} needs constrained "
                          "decoding, which the built-in engine does not support")


def _sampling_params(body: dict[str, Any], max_new_tokens: int | None,
                     defaults: dict[str, Any]) -> dict[str, Any]:
    """SGLang's sampling_params of an OpenAI request (to_sampling_params /
    _build_sampling_params); null fields take `defaults`, then the engine's own."""
    def pick(key: str) -> Any:
        value = body.get(key)
        return defaults.get(key) if value is None else value

    return {
        "temperature": pick("temperature"), "max_new_tokens": max_new_tokens,
        "min_new_tokens": body.get("min_tokens"), "stop": body.get("stop"),
        "stop_token_ids": body.get("stop_token_ids"), "top_p": pick("top_p"),
        "top_k": pick("top_k"), "min_p": pick("min_p"),
        "presence_penalty": body.get("presence_penalty"),
        "frequency_penalty": body.get("frequency_penalty"),
        "repetition_penalty": pick("repetition_penalty"), "n": body.get("n"),
        "no_stop_trim": body.get("no_stop_trim"), "ignore_eos": body.get("ignore_eos"),
        "skip_special_tokens": body.get("skip_special_tokens"),
        "logit_bias": body.get("logit_bias"), "custom_params": body.get("custom_params"),
        "sampling_seed": body.get("seed"),
    }


def _generate(gen_body: dict[str, Any], served: ServedModel, tokenizer: Any) -> api.GenerateCall:
    try:
        return api.parse_generate_call(gen_body, served.limits, tokenizer)
    except BadRequest as e:
        message = str(e)
        for old, new in _RENAMED.items():
            message = message.replace(old, new)
        raise OpenAIError(message) from None


def _opened(body: Any, served: ServedModel, known: set[str], refused: tuple[str, ...],
            what: str) -> str:
    """The checks every OpenAI body passes first: an object, fields this route takes, the
    served model's name (returned)."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    _check_fields(body, known, refused, what)
    return _model_name(body, served)


# ---- /v1/completions ---------------------------------------------------------------------
def parse_completion(body: Any, served: ServedModel, tokenizer: Any) -> OpenAICall:
    """A /v1/completions body as scheduler requests (serving_completions.py)."""
    model = _opened(body, served, _COMPLETION_FIELDS, _REFUSED_COMMON, "completion")
    prompt = body.get("prompt")
    if prompt is None:
        raise OpenAIError("prompt is required")
    if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):
        raise OpenAIError("Prompt cannot be empty")
    if isinstance(prompt, str) or (isinstance(prompt, list) and isinstance(prompt[0], str)):
        prompt_kwargs: dict[str, Any] = {"text": prompt}
    else:
        prompt_kwargs = {"input_ids": prompt}
    if body.get("suffix"):
        raise OpenAIError("suffix is not supported by the built-in engine")
    n = _typed(body, "n", int, 1, "an integer")
    best_of = _typed(body, "best_of", int, None, "an integer")
    if best_of is not None and best_of != n:
        raise OpenAIError(f"best_of ({best_of}) other than n ({n}) is not supported by the "
                          f"built-in engine")
    _response_format(body)
    max_tokens = _positive(body, "max_tokens")
    logprobs = _typed(body, "logprobs", int, None, "an integer")
    if logprobs is not None and logprobs < 0:
        raise OpenAIError(f"logprobs must be >= 0, got {logprobs}")
    echo = bool(_typed(body, "echo", bool, False, "a boolean"))
    stream = bool(_typed(body, "stream", bool, False, "a boolean"))
    include_usage, continuous = _stream_options(body, stream)
    return_token_ids = bool(_typed(body, "return_token_ids", bool, False, "a boolean"))
    gen = _generate({
        **prompt_kwargs,
        "sampling_params": _sampling_params(body, 16 if max_tokens is None else max_tokens, {}),
        "return_logprob": logprobs is not None,
        "top_logprobs_num": logprobs or 0,
        "logprob_start_len": 0 if echo and logprobs else -1,
        "return_text_in_logprobs": True,
        "stream": stream,
        "rid": body.get("rid"),
    }, served, tokenizer)
    echo_texts = None
    if echo:
        batch = isinstance(prompt, list) and not isinstance(prompt[0], int)
        prompts = prompt if batch else [prompt]
        echo_texts = [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=True)
                      for p in prompts]
    return OpenAICall("completion", model, gen.requests, n, stream, include_usage, continuous,
                      logprobs=logprobs is not None, echo=echo_texts,
                      echo_logprobs=echo and bool(logprobs),
                      return_token_ids=return_token_ids, return_prompt_token_ids=return_token_ids)


# ---- /v1/chat/completions ----------------------------------------------------------------
def parse_chat(body: Any, served: ServedModel, tokenizer: Any) -> OpenAICall:
    """A /v1/chat/completions body as scheduler requests (serving_chat.py)."""
    model = _opened(body, served, _CHAT_FIELDS, _REFUSED_CHAT, "chat completion")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("Messages cannot be empty." if messages == [] else
                          "messages must be a non-empty list of message objects")
    stream = bool(_typed(body, "stream", bool, False, "a boolean"))
    include_usage, continuous = _stream_options(body, stream)
    return_token_ids = bool(_typed(body, "return_token_ids", bool, False, "a boolean"))
    return_prompt_ids = bool(_typed(body, "return_prompt_token_ids", bool, False, "a boolean"))
    if stream and (return_token_ids or return_prompt_ids):
        key = "return_token_ids" if return_token_ids else "return_prompt_token_ids"
        raise OpenAIError(f"{key} is not supported with streaming on /v1/chat/completions. "
                          f"Please set stream=false when using {key}=true.")
    _response_format(body)
    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body, tools)
    use_tools = bool(tools) and tool_choice != "none"
    max_tokens = _positive(body, "max_completion_tokens") or _positive(body, "max_tokens")
    if max_tokens is not None and max_tokens > served.limits.context_length:
        raise OpenAIError(f"max_completion_tokens is too large: {max_tokens}.This model supports "
                          f"at most {served.limits.context_length} completion tokens.")
    logprobs = bool(_typed(body, "logprobs", bool, False, "a boolean"))
    top = _typed(body, "top_logprobs", int, 0, "an integer")
    if top < 0:
        raise OpenAIError(f"top_logprobs must be >= 0, got {top}")
    input_ids = body.get("input_ids")
    if input_ids is not None and (not isinstance(input_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in input_ids)):
        raise OpenAIError("input_ids must be a list of token ids (one prompt)")
    if input_ids is None:
        input_ids = render_chat(tokenizer, messages, tools if use_tools else None,
                                _typed(body, "chat_template_kwargs", dict, {}, "an object"),
                                bool(_typed(body, "continue_final_message", bool, False,
                                            "a boolean")))
    sampling = _sampling_params(body, max_tokens, served.chat_defaults)
    if use_tools:
        sampling["skip_special_tokens"] = False  # as SGLang: tool-call markers may be special
    gen = _generate({
        "input_ids": input_ids,
        "sampling_params": sampling,
        "return_logprob": logprobs,
        "top_logprobs_num": top if logprobs else 0,
        "logprob_start_len": -1,
        "return_text_in_logprobs": True,
        "stream": stream,
        "rid": body.get("rid"),
    }, served, tokenizer)
    n = len(gen.requests)
    parse_tools = use_tools and served.tool_call_parser is not None
    return OpenAICall("chat", model, gen.requests, n, stream, include_usage, continuous,
                      logprobs=logprobs, tools=tools if parse_tools else None,
                      return_token_ids=return_token_ids,
                      return_prompt_token_ids=return_token_ids or return_prompt_ids)


def _tools(raw: Any) -> list[dict[str, Any]]:
    """The request's tools as SGLang hands them to the template (Tool.model_dump()): the
    function's keys in the client's order, null description and parameters where left out."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise OpenAIError("tools must be a list of {'type': 'function', 'function': {...}}")
    tools = []
    for i, tool in enumerate(raw):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise OpenAIError(f"tools[{i}] must be {{'type': 'function', 'function': "
                              f"{{'name': str, ...}}}}")
        unknown = set(tool) - {"type", "function", "defer_loading"}
        if unknown or tool.get("type", "function") != "function":
            raise OpenAIError(f"tools[{i}]: only function tools are supported "
                              f"(unexpected {sorted(unknown) or tool.get('type')!r})")
        fn_unknown = set(fn) - {"name", "description", "parameters", "strict", "defer_loading"}
        if fn_unknown:
            raise OpenAIError(f"tools[{i}].function: unknown field(s) {sorted(fn_unknown)}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise OpenAIError(f"tools[{i}].function.parameters must be a JSON Schema object")
        dumped = {"description": None, "name": fn["name"], "parameters": None,
                  "strict": fn.get("strict"), "defer_loading": fn.get("defer_loading")}
        dumped.update(fn)
        if dumped["defer_loading"] is None:
            dumped.pop("defer_loading")
        if dumped["strict"] is None:
            dumped.pop("strict")
        ordered = {k: dumped[k] for k in fn if k in dumped}
        ordered.update({k: v for k, v in dumped.items() if k not in ordered})
        tools.append({"type": "function", "function": ordered,
                      "defer_loading": tool.get("defer_loading")})
    return tools


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]]) -> str:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto"):
        return choice
    if choice == "required" or isinstance(choice, dict):
        # SGLang forces these with a JSON-schema or structural-tag grammar.
        raise OpenAIError("tool_choice 'required' or a named tool needs constrained decoding, "
                          "which the built-in engine does not support; use 'auto' or 'none'")
    raise OpenAIError(f"tool_choice must be 'none', 'auto', 'required' or a named tool, got "
                      f"{choice!r}")


def render_chat(tokenizer: Any, messages: list[Any], tools: list[dict[str, Any]] | None,
                template_kwargs: dict[str, Any], continue_final_message: bool) -> list[int]:
    """The prompt ids of a chat, rendered by the tokenizer's own chat template as SGLang's
    _apply_jinja_template does (render to text, then encode without special tokens)."""
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError("the model's tokenizer has no chat template; use /v1/completions")
    if "chat_template" in template_kwargs:
        raise OpenAIError("Request-supplied chat_template is not allowed.")
    msgs = [_template_message(i, m) for i, m in enumerate(messages)]
    prefix = None
    if msgs[-1]["role"] == "assistant" and isinstance(msgs[-1]["content"], str):
        # _handle_last_assistant_message: continue it, or it is taken as the user's turn.
        if continue_final_message:
            prefix, msgs = msgs[-1]["content"], msgs[:-1]
        else:
            msgs[-1] = {"role": "user", "content": msgs[-1]["content"]}
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                             tools=tools, **template_kwargs)
    except Exception as e:  # jinja's raise_exception, a template reading a missing key, ...
        raise OpenAIError(f"chat template failed: {type(e).__name__}: {e}") from None
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if prefix:
        extra = list(tokenizer.encode(prefix))
        if extra and extra[0] == tokenizer.bos_token_id:
            extra = extra[1:]
        ids += extra
    return ids


def _template_message(i: int, m: Any) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise OpenAIError(f"messages[{i}] must be an object with a role")
    role = m.get("role")
    if not isinstance(role, str) or (role != "user" and role.lower() not in _MESSAGE_ROLES):
        raise OpenAIError(f"messages[{i}].role must be one of 'user', "
                          f"{', '.join(repr(r) for r in _MESSAGE_ROLES)}, got {role!r}")
    unknown = set(m) - {"role", "content", "name", "tool_call_id", "tool_calls",
                        "reasoning_content"}
    if unknown:
        raise OpenAIError(f"messages[{i}]: unsupported field(s) {sorted(unknown)}")
    out: dict[str, Any] = {"role": role if role == "user" else role.lower(),
                           "content": _text_content(i, m.get("content"))}
    for key in ("tool_call_id", "name", "reasoning_content"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise OpenAIError(f"messages[{i}].{key} must be a string")
            out[key] = m[key]
    if m.get("tool_calls") is not None:
        out["tool_calls"] = [_history_tool_call(i, c) for c in _list(m["tool_calls"], i)]
    return out


def _list(value: Any, i: int) -> list:
    if not isinstance(value, list):
        raise OpenAIError(f"messages[{i}].tool_calls must be a list")
    return value


def _text_content(i: int, content: Any) -> str:
    """A message's text: a string, or text parts joined by spaces (SGLang's 'string' template
    content format); None is the empty string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIError(f"messages[{i}]: content part {kind!r} is not supported by "
                                  f"the built-in engine (text only)")
            if not isinstance(part.get("text"), str):
                raise OpenAIError(f"messages[{i}]: a text content part needs a 'text' string")
            parts.append(part["text"])
        return " ".join(parts)
    raise OpenAIError(f"messages[{i}].content must be a string or a list of text parts")


def _history_tool_call(i: int, call: Any) -> dict[str, Any]:
    """An earlier assistant turn's tool call, its arguments parsed to an object for the
    template (normalize_assistant_tool_call_arguments)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        raise OpenAIError(f"messages[{i}].tool_calls: each call needs a 'function' object")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise OpenAIError("Assistant tool call function.arguments must be valid JSON.") \
                from None
        if not isinstance(args, dict):
            raise OpenAIError("Assistant tool call function.arguments must be a JSON object.")
    return {"id": call.get("id"), "index": call.get("index"), "type": "function",
            "function": {"name": fn.get("name"), "arguments": args}}


# ---- tool calls in the output -------------------------------------------------------------
@dataclass
class ParsedToolCalls:
    text: str
    calls: list[dict[str, Any]]  # {"name", "arguments" (a JSON string)}


def parse_tool_calls(text: str, tools: list[dict[str, Any]], parser: str) -> ParsedToolCalls:
    """Tool calls in a completed output, as SGLang's Qwen25Detector (qwen25, qwen) or
    HermesDetector (hermes) find them: the text before the first marker, stripped, stays
    content; calls of functions not in `tools` are dropped; malformed JSON drops that call
    (qwen25) or every call (hermes: the whole text stays content)."""
    import re

    names = {t["function"]["name"] for t in tools}
    bot = "<tool_call>\n" if parser in ("qwen25", "qwen") else "<tool_call>"
    idx = text.find(bot)
    if idx < 0:
        return ParsedToolCalls(text, [])
    normal = text[:idx].strip()
    if parser == "hermes":
        blocks = [a or b for a, b in
                  re.findall(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", text, re.DOTALL)]
    else:
        blocks = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.DOTALL)
    calls: list[dict[str, Any]] = []
    for raw in blocks:
        if not raw:
            continue
        try:
            parsed = json.loads(raw.strip())
        except json.JSONDecodeError:
            if parser == "hermes":
                return ParsedToolCalls(text, [])
            continue
        for act in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(act, dict) or act.get("name") not in names:
                continue  # "Model attempted to call undefined function"
            args = act.get("parameters") or act.get("arguments", {})
            calls.append({"name": act["name"], "arguments": json.dumps(args, ensure_ascii=False)})
    return ParsedToolCalls(normal, calls)


def tool_call_entries(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "index": i, "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}}
            for i, c in enumerate(calls)]


# ---- log-probs -----------------------------------------------------------------------------
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _byte_decoder()


class TokenBytes:
    """A token's raw bytes (utils.token_id_to_bytes): through the byte decoder for a byte-level
    BPE tokenizer, else None (callers then use the token's text)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        probe = tokenizer.encode("é", add_special_tokens=False)
        self.byte_level = b"".join(bytes(self._raw(t) or [0xFF]) for t in probe) == "é".encode()

    def _raw(self, token_id: int) -> list[int] | None:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not piece or any(ch not in _BYTE_DECODER for ch in piece):
            return None
        return [_BYTE_DECODER[ch] for ch in piece]

    def __call__(self, token_id: int) -> list[int] | None:
        return self._raw(token_id) if self.byte_level else None

    def lossless_text(self, token_id: int, text: str | None) -> str:
        """utils._lossless_token_text: a fragment of a UTF-8 character as latin-1."""
        if text is not None and "\ufffd" not in text:
            return text
        raw = self(token_id)
        if raw is None:
            return text or ""
        try:
            bytes(raw).decode("utf-8")
            return text or ""
        except UnicodeDecodeError:
            return bytes(raw).decode("latin-1")


def chat_logprobs(entries: list[list[Any]], tops: list[Any] | None,
                  token_bytes: TokenBytes) -> dict[str, Any]:
    """ChoiceLogprobs from /generate's `[logprob, token_id, text]` entries."""
    def item(lp: float, tid: int, text: str | None) -> dict[str, Any]:
        raw = token_bytes(tid)
        return {"token": text or "", "bytes": raw if raw is not None else
                list((text or "").encode()), "logprob": lp}

    content = []
    for k, (lp, tid, text) in enumerate(entries):
        row = tops[k] if tops and k < len(tops) else None
        content.append({**item(lp, tid, text),
                        "top_logprobs": [item(*t) for t in row or []]})
    return {"content": content}


def completion_logprobs(entries: list[list[Any]], tops: list[Any],
                        token_bytes: TokenBytes) -> dict[str, Any]:
    """LogProbs (to_openai_style_logprobs): input entries (echo) then output ones."""
    return {
        "text_offset": [-1] * len(entries),
        "token_logprobs": [lp for lp, _, _ in entries],
        "tokens": [token_bytes.lossless_text(tid, text) for _, tid, text in entries],
        "top_logprobs": [None if row is None else
                         {token_bytes.lossless_text(tid, text): lp for lp, tid, text in row}
                         for row in tops],
    }


# ---- responses ----------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """UsageInfo as SGLang serialises it (no prefix cache: no prompt_tokens_details)."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None,
            "reasoning_tokens": 0, "completion_tokens_details": None}


def call_usage(call: OpenAICall) -> dict[str, Any]:
    """Prompt tokens once per prompt (every n-th request), completion tokens of every choice."""
    return usage(sum(len(r.input_ids) for r in call.requests[::call.n]),
                 sum(len(r.output_ids) for r in call.requests))


def weight_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    """`metadata` of an answer (weight_versions.build_endpoint_weight_version_metadata): the
    first choice's weight_version, and its spans where /generate lists them."""
    out = {"weight_version": meta["weight_version"]}
    if "weight_versions" in meta:
        out["weight_versions"] = meta["weight_versions"]
    return out


def _finish(r: Request) -> tuple[str | None, Any]:
    reason = r.finish_reason
    return (reason["type"], reason.get("matched")) if reason else (None, None)


def abort_error(call: OpenAICall) -> OpenAIError | None:
    """An abort with a status code (engine stopped, crashed) is an error, not a finish reason
    (tokenizer_manager._handle_abort_finish_reason); a plain /abort_request is "abort"."""
    for r in call.requests:
        reason = r.finish_reason or {}
        if reason.get("type") == "abort" and reason.get("status_code"):
            return OpenAIError(reason.get("message") or "Generation aborted.",
                               int(reason["status_code"]), reason.get("err_type") or "Aborted")
    return None


def completion_response(call: OpenAICall, tokenizer: Any,
                        token_bytes: TokenBytes) -> dict[str, Any]:
    choices, metas = [], []
    for i, r in enumerate(call.requests):
        body = api.response_of(r, tokenizer)
        metas.append(body["meta_info"])
        text = body["text"]
        if call.echo is not None:
            text = call.echo[i // call.n] + text
        reason, matched = _finish(r)
        choice: dict[str, Any] = {"index": i, "text": text,
                                  "logprobs": _completion_choice_logprobs(call, body, token_bytes),
                                  "finish_reason": reason, "matched_stop": matched}
        if call.return_token_ids:
            choice["token_ids"] = body["output_ids"]
            choice["prompt_token_ids"] = list(r.input_ids)
        choices.append(choice)
    return {"id": call.requests[0].rid, "object": "text_completion", "created": call.created,
            "model": call.model, "choices": choices, "usage": call_usage(call),
            "metadata": weight_metadata(metas[0])}


def _completion_choice_logprobs(call: OpenAICall, body: dict[str, Any],
                                token_bytes: TokenBytes, start: int = 0,
                                with_input: bool = True) -> dict[str, Any] | None:
    if not call.logprobs:
        return None
    meta = body["meta_info"]
    entries = meta["output_token_logprobs"][start:]
    tops = meta.get("output_top_logprobs", [])[start:]
    if call.echo_logprobs and with_input:
        entries = meta["input_token_logprobs"] + entries
        tops = meta.get("input_top_logprobs", []) + tops
    return completion_logprobs(entries, tops, token_bytes)


def chat_response(call: OpenAICall, tokenizer: Any, token_bytes: TokenBytes,
                  parser: str | None) -> dict[str, Any]:
    choices, metas = [], []
    for i, r in enumerate(call.requests):
        body = api.response_of(r, tokenizer)
        metas.append(body["meta_info"])
        reason, matched = _finish(r)
        text, tool_calls = body["text"], None
        if call.tools is not None and parser is not None:
            parsed = parse_tool_calls(text, call.tools, parser)
            text = parsed.text
            if parsed.calls:
                tool_calls = tool_call_entries(parsed.calls)
                if reason == "stop":
                    reason, matched = "tool_calls", None
        message: dict[str, Any] = {"role": "assistant", "content": text or "",
                                   "reasoning_content": None}
        if tool_calls is not None:
            message["tool_calls"] = tool_calls
        meta = body["meta_info"]
        choice: dict[str, Any] = {
            "index": i, "message": message,
            "logprobs": chat_logprobs(meta["output_token_logprobs"],
                                      meta.get("output_top_logprobs"), token_bytes)
            if call.logprobs else None,
            "finish_reason": reason, "matched_stop": matched}
        if call.return_prompt_token_ids:
            choice["prompt_token_ids"] = list(r.input_ids)
        if call.return_token_ids:
            choice["response_token_ids"] = body["output_ids"]
        choices.append(choice)
    return {"id": call.requests[0].rid, "object": "chat.completion", "created": call.created,
            "model": call.model, "choices": choices, "usage": call_usage(call),
            "metadata": weight_metadata(metas[0])}


def stream_safe(text: str, stops: list[str]) -> str:
    """The part of an unfinished output's text that can be sent: without a trailing
    replacement character (an unfinished UTF-8 character) and without a tail that may be the
    start of a stop string (trimmed from the text if it completes)."""
    text = text.rstrip("\ufffd")
    hold = 0
    for s in stops:
        for k in range(min(len(s), len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return text[: len(text) - hold]


def chat_chunk(call: OpenAICall, rid: str, index: int, *, delta: dict[str, Any] | None = None,
               logprobs: Any = None, finish_reason: str | None = None, matched: Any = None,
               chunk_usage: dict[str, Any] | None = None) -> dict[str, Any]:
    """sse_utils.build_sse_content: reasoning_content always present in the delta."""
    chunk: dict[str, Any] = {
        "id": rid, "object": "chat.completion.chunk", "created": call.created,
        "model": call.model,
        "choices": [{"index": index, "delta": {"reasoning_content": None, **(delta or {})},
                     "logprobs": logprobs, "finish_reason": finish_reason,
                     "matched_stop": matched}]}
    if chunk_usage is not None:
        chunk["usage"] = chunk_usage
    return chunk


def completion_chunk(call: OpenAICall, rid: str, index: int, text: str, logprobs: Any,
                     finish_reason: str | None, matched: Any,
                     chunk_usage: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": call.created, "model": call.model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": finish_reason, "matched_stop": matched}],
            "usage": chunk_usage}


def models_body(served: ServedModel) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(served)]}


def model_card(served: ServedModel) -> dict[str, Any]:
    return {"id": served.name, "object": "model", "created": int(time.time()),
            "owned_by": "sglang", "root": served.name, "parent": None,
            "max_model_len": served.limits.context_length}


# ---- streaming state -----------------------------------------------------------------------
@dataclass
class _ChoiceStream:
    """What one choice has sent so far."""

    chars: int = 0  # of the (echo-less) text
    tokens: int = 0  # output tokens whose log-probs were sent
    started: bool = False
    done: bool = False


class _Streamer:
    """Turns scheduler progress into SSE events for one call."""

    def __init__(self, call: OpenAICall, tokenizer: Any, token_bytes: TokenBytes,
                 parser: str | None) -> None:
        self.call, self.tokenizer, self.token_bytes, self.parser = call, tokenizer, \
            token_bytes, parser
        self.state = [_ChoiceStream() for _ in call.requests]
        self.finishes: dict[int, tuple[str, Any]] = {}  # choice -> finish_reason, matched

    def events(self, i: int) -> list[dict[str, Any]]:
        """The events of choice i after it advanced (empty when nothing new can be sent)."""
        st, r = self.state[i], self.call.requests[i]
        if st.done:
            return []
        body = api.response_of(r, self.tokenizer)
        finished = r.finished
        text = body["text"]
        if self.call.kind == "chat" and self.call.tools is not None and not finished:
            # A tool call is sent whole once the output is complete: hold back from its marker
            # (and the whitespace before it, which the parser strips).
            cut = text.find("<tool_call>")
            text = stream_safe(text if cut < 0 else text[:cut], ["<tool_call>"]).rstrip()
        if not finished:
            text = stream_safe(text, r.params.stop)
        delta = text[st.chars:] if len(text) > st.chars else ""
        n_out = len(body["output_ids"])
        usage_now = (usage(len(r.input_ids), n_out) if self.call.continuous_usage else None)
        st.done = finished
        if self.call.kind == "completion":
            return self._completion_event(i, st, r, body, delta, text, n_out, usage_now)
        return self._chat_events(i, st, r, body, delta, text, n_out, usage_now)

    def _completion_event(self, i: int, st: _ChoiceStream, r: Request, body: dict[str, Any],
                          delta: str, text: str, n_out: int,
                          usage_now: dict[str, Any] | None) -> list[dict[str, Any]]:
        first = not st.started
        if not (delta or r.finished or first):
            return []
        if first and self.call.echo is not None:
            delta = self.call.echo[i // self.call.n] + delta
        logprobs = _completion_choice_logprobs(self.call, body, self.token_bytes, st.tokens,
                                               with_input=first)
        st.started, st.chars, st.tokens = True, len(text), n_out
        reason, matched = _finish(r)
        return [completion_chunk(self.call, r.rid, i, delta, logprobs, reason, matched,
                                 usage_now)]

    def _chat_events(self, i: int, st: _ChoiceStream, r: Request, body: dict[str, Any],
                     delta: str, text: str, n_out: int,
                     usage_now: dict[str, Any] | None) -> list[dict[str, Any]]:
        events = []
        if not st.started:
            st.started = True
            events.append(chat_chunk(self.call, r.rid, i,
                                     delta={"role": "assistant", "content": ""}))
        logprobs = None
        if self.call.logprobs and (delta or r.finished) and n_out > st.tokens:
            meta = body["meta_info"]
            logprobs = chat_logprobs(meta["output_token_logprobs"][st.tokens:],
                                     meta.get("output_top_logprobs", [])[st.tokens:],
                                     self.token_bytes)
            st.tokens = n_out
        tool_calls = None
        if r.finished and self.call.tools is not None and self.parser is not None:
            # The content is what the parser leaves (as in the non-streamed answer).
            parsed = parse_tool_calls(text, self.call.tools, self.parser)
            text = parsed.text
            delta = text[st.chars:] if len(text) > st.chars else ""
            tool_calls = tool_call_entries(parsed.calls) if parsed.calls else None
        if delta or logprobs is not None:
            events.append(chat_chunk(self.call, r.rid, i, delta={"content": delta},
                                     logprobs=logprobs, chunk_usage=usage_now))
        if tool_calls:
            events.append(chat_chunk(self.call, r.rid, i, delta={"tool_calls": tool_calls}))
        st.chars = len(text)
        if r.finished:
            reason, matched = _finish(r)
            if tool_calls and reason == "stop":
                reason, matched = "tool_calls", None
            self.finishes[i] = (reason, matched)
        return events

    def closing(self) -> list[dict[str, Any]]:
        """After every choice finished: chat's finish chunks, then the usage chunk if asked."""
        events = []
        if self.call.kind == "chat":
            for i, (reason, matched) in self.finishes.items():
                events.append(chat_chunk(self.call, self.call.requests[i].rid, i, delta={},
                                         finish_reason=reason, matched=matched))
        if self.call.include_usage:
            events.append({"id": self.call.requests[0].rid,
                           "object": "chat.completion.chunk" if self.call.kind == "chat"
                           else "text_completion", "created": self.call.created,
                           "model": self.call.model, "choices": [],
                           "usage": _stream_usage(call_usage(self.call), self.call.kind)})
        return events


def _stream_usage(u: dict[str, Any], kind: str) -> dict[str, Any]:
    # serving_completions dumps its usage chunk with exclude_none.
    return u if kind == "chat" else {k: v for k, v in u.items() if v is not None}


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
        streamer = _Streamer(call, self.server.tokenizer, self.token_bytes,
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
