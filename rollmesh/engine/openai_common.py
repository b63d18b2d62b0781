"""What the OpenAI-compatible routes of the built-in engine and rollmesh's `openai_agent`
endpoint share: how an OpenAI chat request's messages and tools are read, how tool calls are
found in a model's output, and the OpenAI log-prob shapes.

Users: `rollmesh.engine.builtin.openai_requests` / `openai_responses` (the engine's
/v1/chat/completions, as SGLang 0.5.23 serves it: see `rollmesh.engine.builtin.openai_api`) and
`rollmesh.agents.openai_agent` (the endpoint an agent written against the OpenAI API calls).
Everything here follows SGLang 0.5.23's `srt/entrypoints/openai/` (`protocol.py`,
`serving_chat.py`, `utils.py`) and `srt/function_call/{qwen25,hermes}_detector.py`; a request
either side cannot honour raises `OpenAIError` with the message its client gets.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

# ---- request fields and messages ----------------------------------------------------------
# Request fields accepted and without effect (in the engine's routes and the agent endpoint):
# metadata, request routing, cache namespaces of a prefix cache neither has.
NO_EFFECT = {"user", "store", "metadata", "service_tier", "safety_identifier",
             "prompt_cache_key", "extra_key", "cache_salt", "priority", "data_parallel_rank",
             "routed_dp_rank", "disagg_prefill_dp_rank", "custom_labels"}
_MESSAGE_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder",
                  "root")  # case-insensitive; "user" is exact (protocol.py)


class OpenAIError(Exception):
    """A request answered with SGLang's ErrorResponse body."""

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message, self.status, self.err_type = message, status, err_type


def parse_tools(raw: Any) -> list[dict[str, Any]]:
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


def parse_tool_choice(body: dict[str, Any], tools: list[dict[str, Any]]) -> str:
    """The request's tool_choice: "auto" (the default when there are tools) or "none";
    "required" and a named tool are refused."""
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


def template_message(i: int, m: Any) -> dict[str, Any]:
    """messages[i] as the chat template gets it: a known role, the content as text, the
    tool calls of an earlier assistant turn with their arguments parsed to objects."""
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


def parse_sglang_tool_calls(text: str, tools: list[dict[str, Any]],
                            parser: str) -> ParsedToolCalls:
    """Tool calls in a completed output, as SGLang's named `--tool-call-parser` detectors find
    them, Qwen25Detector (qwen25, qwen) or HermesDetector (hermes): the text before the first
    marker, stripped, stays content; calls of functions not in `tools` are dropped; malformed
    JSON drops that call (qwen25) or every call (hermes: the whole text stays content); the
    arguments come back as a JSON string (OpenAI's `function.arguments`).

    Not the `tool_agent` loop's grammar: that one is
    `rollmesh.agents.loops.parse_tool_agent_calls` (any whitespace inside the markers, no tool
    list, every malformed call kept as an error the model is shown)."""
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
    else:  # each block found with str.find: a lazy regex is quadratic in unclosed markers
        blocks, i = [], 0
        while (a := text.find("<tool_call>\n", i)) >= 0 and \
                (b := text.find("\n</tool_call>", a + 12)) >= 0:
            blocks.append(text[a + 12:b])
            i = b + 13
    calls: list[dict[str, Any]] = []
    for raw in blocks:
        if not raw:
            continue
        try:
            parsed = json.loads(raw.strip())
        except (json.JSONDecodeError, RecursionError):  # deep nesting: malformed, not a crash
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
