"""The built-in engine's OpenAI answers: the bodies of /v1/completions, /v1/chat/completions
and /v1/models, and the SSE chunks of a streamed call (`Streamer`), built from the scheduler's
finished or advancing requests as SGLang 0.5.23 builds them (`serving_completions.py`,
`serving_chat.py`, `usage_processor.py`, `sse_utils.py`).

The routes and what they follow of SGLang: `rollmesh.engine.builtin.openai_api`; the tool-call
parsing and log-prob shapes the agent endpoint shares: `rollmesh.engine.openai_common`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from rollmesh.engine.builtin import api
from rollmesh.engine.builtin.openai_requests import OpenAICall, ServedModel
from rollmesh.engine.builtin.scheduler import Request
from rollmesh.engine.openai_common import (
    OpenAIError, TokenBytes, chat_logprobs, parse_sglang_tool_calls, tool_call_entries,
)

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
            parsed = parse_sglang_tool_calls(text, call.tools, parser)
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


class Streamer:
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
            parsed = parse_sglang_tool_calls(text, self.call.tools, self.parser)
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
