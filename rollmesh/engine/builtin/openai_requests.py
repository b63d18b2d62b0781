"""The built-in engine's OpenAI requests: a /v1/completions or /v1/chat/completions body read
as SGLang 0.5.23 reads it (`serving_completions.py`, `serving_chat.py`, `protocol.py`) and
turned into scheduler requests (`OpenAICall`); a body the engine refuses raises `OpenAIError`.

The routes and what they follow of SGLang: `rollmesh.engine.builtin.openai_api`; the message
and tool checks the agent endpoint shares: `rollmesh.engine.openai_common`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollmesh.engine.builtin import api
from rollmesh.engine.builtin.sampling import BadRequest
from rollmesh.engine.builtin.scheduler import Request
from rollmesh.engine.openai_common import (
    NO_EFFECT, OpenAIError, parse_tool_choice, parse_tools, template_message,
)

DEFAULT_MODEL_NAME = "default"  # protocol.py: the `model` a request may leave out
# model_config.get_default_sampling_params: the generation_config.json keys chat defaults take.
_GENERATION_DEFAULT_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")

# ---- request fields ----------------------------------------------------------------------
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
        elif key not in known and key not in NO_EFFECT:
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
                              f"built-in engine's OpenAI routes serve no adapter (it serves "
                              f"one merged adapter on /generate, named by lora_path)")
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
    tools = parse_tools(body.get("tools"))
    tool_choice = parse_tool_choice(body, tools)
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
                                            "a boolean")),
                                max_chars=served.limits.context_length * api.MAX_CHARS_PER_TOKEN)
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
    parse_calls = use_tools and served.tool_call_parser is not None
    return OpenAICall("chat", model, gen.requests, n, stream, include_usage, continuous,
                      logprobs=logprobs, tools=tools if parse_calls else None,
                      return_token_ids=return_token_ids,
                      return_prompt_token_ids=return_token_ids or return_prompt_ids)


def render_chat(tokenizer: Any, messages: list[Any], tools: list[dict[str, Any]] | None,
                template_kwargs: dict[str, Any], continue_final_message: bool,
                max_chars: int | None = None) -> list[int]:
    """The prompt ids of a chat, rendered by the tokenizer's own chat template as SGLang's
    _apply_jinja_template does (render to text, then encode without special tokens)."""
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError("the model's tokenizer has no chat template; use /v1/completions")
    if "chat_template" in template_kwargs:
        raise OpenAIError("Request-supplied chat_template is not allowed.")
    msgs = [template_message(i, m) for i, m in enumerate(messages)]
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
    chars = len(text) + len(prefix or "")
    if max_chars is not None and chars > max_chars:  # before the tokenizer spends minutes on it
        raise OpenAIError(f"the rendered chat of {chars} characters cannot fit the context "
                          "length; refused before tokenizing")
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if prefix:
        extra = list(tokenizer.encode(prefix))
        if extra and extra[0] == tokenizer.bos_token_id:
            extra = extra[1:]
        ids += extra
    return ids
