"""`openai_agent`: agents written against the OpenAI API, trained on the tokens they sampled.

The user's code is an ordinary async function,

    async def my_agent(client: openai.AsyncOpenAI, row: dict) -> Any

selected by `rollout.openai_agent = "package.module:function"` (or a row's own `openai_agent`
field). rollmesh calls it once per trajectory with a client whose base URL is this worker's
endpoint (`OpenAIEndpoint`: aiohttp on 127.0.0.1, a random port, one secret route key per
trajectory) and with the row: {"messages" (the row's prompt as chat messages, the system prompt
applied), "tools", "label", "metadata", "sample_id", "group_id", "index"}. What it returns (plain
data) is kept in `traj.metadata["agent_result"]` for the reward function.

Each POST /v1/chat/completions of the agent becomes part of ONE token row:
- the first call's messages (and tools) are rendered by the tokenizer's chat template with the
  generation prompt: that is the trajectory's prompt (it replaces the rollouter's rendering of
  the row, so an agent may add its own system prompt or tools);
- a later call must send the conversation the trajectory holds (every earlier message and the
  assistant replies it got, unchanged: compared message by message, field by field) and may
  append messages after the last reply (tool results, a user turn). Only those new messages are
  rendered (`agents.loops.next_turn_ids`, the template's own rendering of a turn after an
  assistant one) and appended as observation tokens (mask 0, version -1); nothing already
  recorded is rendered or tokenised again, so there is no re-tokenisation drift (a template that
  re-renders history, e.g. Qwen3 dropping earlier <think> blocks, cannot make the recorded
  tokens differ from the sampled ones). A request that rewrites, drops or reorders earlier
  messages fails the trajectory with an error naming the message and the field (a training
  sample must be the one sequence the model saw);
- the engines' /generate runs on the recorded token ids (`LoopContext.generate`: log-probs, a
  version per token, the context and turn limits); the reply is decoded from those tokens, with
  Hermes/Qwen `<tool_call>{json}</tool_call>` blocks parsed into `tool_calls` when the request
  gave tools.

loop_state: "completions", the token spans of each call ([observation start, generation
start, end]); "calls", the tool messages the agent appended, for the reward
(`recorded_tool_calls`: the trajectory view's tool_calls); "resumed_calls".

Weight syncs. The user's coroutine cannot move to another worker, so its trajectory stays here
across a sync. At a Cancel (abort mode) the worker clears `LoopContext.resumed` and the engines
abort every generation (the pauser's aborts: `EngineClient.abort_while`); a call that was
generating keeps its partial tokens (old version) and holds its HTTP request open; a call that
arrives meanwhile waits too. Once no generation of this endpoint is in
flight the worker tells the rollouter which trajectories it holds (`Held`: the rollouter counts
them as still out with the worker but does not wait for them to drain). At the Resume the calls
go on from prompt + partial tokens (new version) and each returns ONE completion whose text is
the whole answer; the agent never sees the sync. In `in_place` sync mode nothing is cancelled:
the engines keep the request. A trajectory that has to move anyway (its worker stopped or died,
a failed attempt retried) starts over from its prompt: the agent runs again from the start.

Failures: an exception in the agent fails the trajectory with its message (the rollouter's
max_retries apply), unless the endpoint had refused a call because a limit was reached
(`model.max_context`, `rollout.max_turns`): the trajectory then finishes as a "length" finish
and the agent's error is kept in metadata["agent_error"]. The worker is never affected.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import importlib
import inspect
import json
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from aiohttp import web

from rollmesh.agents.loops import (
    ChatTemplateError, ContextFull, Interrupted, LoopContext, next_turn_ids, recorded_call,
)
from rollmesh.engine.openai_common import (
    NO_EFFECT, OpenAIError, TokenBytes, chat_logprobs, parse_sglang_tool_calls,
    parse_tool_choice, parse_tools, template_message, tool_call_entries,
)
from rollmesh.runtime.log import get_logger
from rollmesh.wire.messages import Trajectory
from rollmesh.core.trajectory import append_observation

log = get_logger("rollmesh.agents.openai_agent")

ROW_KEY = "openai_agent"  # a row's own agent function, as rollout.openai_agent
# Fields an agent's assistant message carries back from the SDK (ChatCompletionMessage dumped):
# dropped when empty, refused otherwise.
_ECHOED = ("refusal", "annotations", "audio", "function_call")
_COMPARED = ("role", "content", "name", "tool_call_id", "reasoning_content", "tool_calls")
# Request fields: passed on to /generate's sampling_params (OpenAI name -> SGLang name).
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "stop": "stop", "stop_token_ids": "stop_token_ids", "seed": "sampling_seed",
             "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
             "repetition_penalty": "repetition_penalty", "min_tokens": "min_new_tokens",
             "ignore_eos": "ignore_eos"}
_ACCEPTED = {"model", "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens",
             "n", "stream", "logprobs", "top_logprobs", "chat_template_kwargs",
             "parallel_tool_calls", "response_format", *_SAMPLING}
_NO_PROGRESS_ABORTS = 5  # engine aborts in a row that gave no token, outside a sync: an error


class AgentError(RuntimeError):
    """The agent or its conversation cannot make a trajectory (the message says why)."""


class CallError(Exception):
    """A chat completion request answered with an OpenAI error body."""

    def __init__(self, message: str, status: int = 400, code: str | None = None,
                 err_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.status, self.code, self.err_type = message, status, code, err_type

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.err_type, "param": None,
                          "code": self.code}}
        return web.json_response(body, status=self.status)


# --------------------------------------------------------------------------------------------
# the agent function
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def resolve_agent(spec: str) -> Callable[..., Any]:
    """'package.module:function' (the function may be an attribute path, 'mod:Class.method')
    as the async function it names; a clear ValueError for anything else."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"openai agent {spec!r}: expected 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"openai agent {spec!r}: cannot import {module}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"openai agent {spec!r}: {module} has no {attr}")
        obj = getattr(obj, part)
    call = getattr(obj, "__call__", None)
    if not (inspect.iscoroutinefunction(obj) or inspect.iscoroutinefunction(call)):
        raise ValueError(f"openai agent {spec!r} must be an async function (`async def`): it runs "
                         "on the worker's event loop, beside the endpoint it calls")
    return obj


def _import_openai() -> Any:
    try:
        import openai
    except ImportError:
        raise AgentError("the openai_agent loop needs the openai package on the agent "
                         "workers' hosts: pip install 'rollmesh[openai]'") from None
    return openai


def row_of(traj: Trajectory) -> dict[str, Any]:
    """What the agent function gets besides its client (a copy: its own to change)."""
    meta = {k: v for k, v in traj.metadata.items() if k != "messages"}
    return copy.deepcopy({"messages": traj.metadata.get("messages"),
                          "tools": traj.metadata.get("tools"), "label": traj.label,
                          "metadata": meta, "sample_id": traj.sample_id,
                          "group_id": traj.group_id, "index": traj.index})


def _plain(value: Any, where: str = "result") -> Any:
    """`value` if it is plain data that can cross the wire (None, bool, int, float, str, lists
    and string-keyed dicts of them), else AgentError naming what is not."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise AgentError(f"the agent's {where} has a key {k!r} that is not a string")
        return {k: _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    raise AgentError(f"the agent's {where} is a {type(value).__name__}: return plain data "
                     "(None, bool, number, str, list, dict) for traj.metadata['agent_result']")


def restart(traj: Trajectory) -> None:
    """Back to its prompt: a trajectory that moved here (its worker died, a failed attempt
    retried) cannot continue its agent's coroutine, so the agent runs again from the start."""
    n = traj.prompt_len
    traj.token_ids, traj.logprobs = traj.token_ids[:n].copy(), traj.logprobs[:n].copy()
    traj.versions, traj.loss_mask = traj.versions[:n].copy(), traj.loss_mask[:n].copy()
    traj.loop_state = {}
    traj.finish_reason, traj.num_turns = None, 0
    for key in ("agent_result", "agent_error"):
        traj.metadata.pop(key, None)


def set_prompt(traj: Trajectory, ids: list[int]) -> None:
    """The first call's rendered prompt becomes the trajectory's prompt."""
    n = len(ids)
    traj.token_ids = np.asarray(ids, np.int32)
    traj.logprobs = np.zeros(n, np.float32)
    traj.versions = np.full(n, -1, np.int32)
    traj.loss_mask = np.zeros(n, np.uint8)
    traj.prompt_len = n


# --------------------------------------------------------------------------------------------
# messages
# --------------------------------------------------------------------------------------------


def normalize_message(i: int, m: Any) -> dict[str, Any]:
    """A request message as the chat template gets it (the engine's own normalisation: text
    content, tool-call arguments parsed to objects); the SDK's empty echo fields dropped."""
    if isinstance(m, dict):
        for key in _ECHOED:
            if key in m and m[key] in (None, "", [], {}):
                m = {k: v for k, v in m.items() if k != key}
    try:
        return template_message(i, m)
    except OpenAIError as e:
        raise CallError(e.message) from None


def _comparable(m: dict[str, Any]) -> dict[str, Any]:
    out = {k: m[k] for k in _COMPARED if m.get(k) not in (None, "", []) and k != "tool_calls"}
    if m.get("tool_calls"):
        out["tool_calls"] = [(c["function"]["name"],
                              json.dumps(c["function"]["arguments"], sort_keys=True))
                             for c in m["tool_calls"]]
    return out


def message_difference(held: dict[str, Any], sent: dict[str, Any]) -> str | None:
    """How `sent` differs from the message the trajectory holds, or None if it does not."""
    a, b = _comparable(held), _comparable(sent)
    for key in _COMPARED:
        if a.get(key) == b.get(key):
            continue
        if key == "content" and isinstance(a.get(key), str) and isinstance(b.get(key), str):
            x, y = a[key], b[key]
            at = next((k for k in range(min(len(x), len(y))) if x[k] != y[k]), min(len(x), len(y)))
            return (f"content differs at character {at}: {y[at:at + 30]!r} here, "
                    f"{x[at:at + 30]!r} in the trajectory")
        return f"{key} differs: {b.get(key)!r} here, {a.get(key)!r} in the trajectory"
    return None


def recorded_tool_calls(history: list[dict[str, Any]],
                        new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool messages among `new` as loop_state["calls"] keeps them for the reward
    (`agents.loops.recorded_call`): the message's name, else that of the assistant's call it
    answers (matched in `history` by tool_call_id), that call's arguments ({} if none matches),
    the message's content as the result."""
    asked = {c["id"]: c["function"] for m in history for c in m.get("tool_calls") or []
             if isinstance(c.get("id"), str)}  # the agent's own history may carry any id
    calls = []
    for m in (m for m in new if m["role"] == "tool"):
        fn = asked.get(m.get("tool_call_id"), {})
        name, args = m.get("name") or fn.get("name"), fn.get("arguments")
        call = {"name": name if isinstance(name, str) else None,
                "arguments": args if isinstance(args, dict) else {}}
        calls.append(recorded_call(call, m["content"]))
    return calls


# --------------------------------------------------------------------------------------------
# the endpoint
# --------------------------------------------------------------------------------------------


@dataclass
class Session:
    """One agent run: its trajectory and what the conversation holds so far."""

    key: str
    traj: Trajectory
    history: list[dict[str, Any]] = field(default_factory=list)  # our replies included
    turns: int = 0
    busy: bool = False
    quiet: asyncio.Event = field(default_factory=asyncio.Event)  # no call running
    ended: str | None = None  # a limit was reached: later calls are refused
    error: str | None = None  # the trajectory cannot be trained on: it fails with this
    finish_reason: str | None = None
    resumed_calls: int = 0  # calls that went on across a weight sync

    def __post_init__(self) -> None:
        self.quiet.set()


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None  # handed to the template and parsed in the output
    max_tokens: int | None
    sampling: dict[str, Any]
    logprobs: bool
    template_kwargs: dict[str, Any]
    model: str


class OpenAIEndpoint:
    """The worker's OpenAI-compatible endpoint: /v1/chat/completions and /v1/models, under
    /v1/traj/<key>/ (the route key of one agent run) or with the key as the bearer api_key."""

    def __init__(self, ctx: LoopContext) -> None:
        self.ctx = ctx
        self.sessions: dict[str, Session] = {}
        self.model_name = str(getattr(ctx.tokenizer, "name_or_path", "") or "policy")
        self.token_bytes = TokenBytes(ctx.tokenizer)
        self.runner: web.AppRunner | None = None
        self.started: asyncio.Future[None] | None = None  # runs that start at once share it
        self.port = 0
        self.generating = 0  # generations of this endpoint in flight on the engines
        self.idle = asyncio.Event()
        self.idle.set()
        self.handlers: set[asyncio.Task] = set()

    @classmethod
    async def of(cls, ctx: LoopContext) -> OpenAIEndpoint:
        """The worker's endpoint, started by the first run that needs it."""
        if ctx.endpoint is None:
            ctx.endpoint = cls(ctx)
        endpoint: OpenAIEndpoint = ctx.endpoint
        await endpoint.start()
        return endpoint

    async def start(self) -> None:
        if self.started is None:
            self.started = asyncio.ensure_future(self._start())
        await asyncio.shield(self.started)

    async def _start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        r = app.router
        r.add_post("/v1/traj/{key}/chat/completions", self.chat_completions)
        r.add_get("/v1/traj/{key}/models", self.models)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_get("/v1/models", self.models)
        runner = web.AppRunner(app, access_log=None)
        self.runner = runner
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(runner.addresses[0][1])
        log.info("openai_endpoint_started", port=self.port)

    async def close(self) -> None:
        for task in list(self.handlers):
            task.cancel()
        if self.started is not None and not self.started.done():
            self.started.cancel()
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        self.started = None

    # -- sessions ------------------------------------------------------------------------------

    def open(self, traj: Trajectory) -> Session:
        session = Session(secrets.token_urlsafe(18), traj)
        self.sessions[session.key] = session
        return session

    def base_url(self, session: Session) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traj/{session.key}"

    async def finish(self, session: Session) -> None:
        """The run is over: wait for a call still running (an agent that stopped waiting for
        its answer), then forget the session."""
        await session.quiet.wait()
        self.sessions.pop(session.key, None)

    async def quiesced(self) -> None:
        """Until no generation of this endpoint is in flight (a Cancel's aborts answered)."""
        await self.idle.wait()

    # -- routes --------------------------------------------------------------------------------

    def _session(self, request: web.Request) -> Session:
        key = request.match_info.get("key")
        if key is None:
            auth = request.headers.get("Authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        session = self.sessions.get(key or "")
        if session is None:
            raise CallError("no agent run of this worker has this key (its run is over, or the "
                            "client was not the one rollmesh gave the agent)", 404,
                            "not_found", "not_found_error")
        return session

    async def models(self, request: web.Request) -> web.Response:
        try:
            self._session(request)
        except CallError as e:
            return e.response()
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "rollmesh", "max_model_len": self.ctx.max_context}]})

    async def chat_completions(self, request: web.Request) -> web.Response:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            session = self._session(request)
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CallError(f"the request body is not JSON: {e}") from None
            return web.json_response(await self.complete(session, body))
        except CallError as e:
            return e.response()
        finally:
            self.handlers.discard(task)

    # -- one chat completion -------------------------------------------------------------------

    async def complete(self, s: Session, body: Any) -> dict[str, Any]:
        if s.busy:
            raise CallError("a chat completion of this trajectory is already running: an "
                            "openai_agent trajectory is one conversation, its calls one after "
                            "another", 409, "conflict")
        s.busy = True
        s.quiet.clear()
        try:
            return await self._complete(s, body)
        finally:
            s.busy = False
            s.quiet.set()

    async def _complete(self, s: Session, body: Any) -> dict[str, Any]:
        ctx, traj, tok = self.ctx, s.traj, self.ctx.tokenizer
        if s.error is not None:
            raise CallError(f"this trajectory has failed: {s.error}")
        if s.ended is not None:
            raise CallError(s.ended, code="context_length_exceeded")
        req = self.parse(body)
        if s.turns >= ctx.rollout.max_turns:
            s.ended = (f"turn limit: rollout.max_turns = {ctx.rollout.max_turns} chat "
                       "completions per trajectory")
            raise CallError(s.ended, code="context_length_exceeded")
        if req.messages[-1]["role"] == "assistant":
            raise CallError("the last message is an assistant message: continuing it is not "
                            "supported; send the conversation with a user or tool message last")
        observation_at = len(traj.token_ids)
        if s.turns == 0:
            ids = self.render(req)
            if len(ids) >= ctx.max_context - 1:
                s.error = (f"the first call's prompt has {len(ids)} tokens; model.max_context "
                           f"is {ctx.max_context}")
                raise CallError(s.error, code="context_length_exceeded")
            set_prompt(traj, ids)
            observation_at = len(ids)
        else:
            new = self.new_messages(s, req.messages)
            ended = int(traj.token_ids[-1]) == getattr(tok, "eos_token_id", None)
            try:
                obs = next_turn_ids(tok, new, turn_ended=ended)
            except ChatTemplateError as e:
                s.error = str(e)
                raise CallError(s.error) from None
            if len(traj.token_ids) + len(obs) >= ctx.max_context - 1:
                s.ended = (f"context full: the conversation would take "
                           f"{len(traj.token_ids) + len(obs)} tokens; model.max_context is "
                           f"{ctx.max_context}")
                raise CallError(s.ended, code="context_length_exceeded")
            append_observation(traj, obs)
            traj.loop_state.setdefault("calls", []).extend(recorded_tool_calls(s.history, new))
        s.history = list(req.messages)
        start = len(traj.token_ids)
        finish, matched = await self.generate(s, req, start)
        s.turns += 1
        return self.answer(s, req, observation_at, start, finish, matched)

    def parse(self, body: Any) -> ChatRequest:
        if not isinstance(body, dict):
            raise CallError("the request body must be a JSON object")
        for key, value in body.items():
            if key not in _ACCEPTED and key not in NO_EFFECT:
                raise CallError(f"{key} is not supported by rollmesh's openai_agent endpoint")
        if body.get("stream"):
            raise CallError("stream: true is not supported by rollmesh's openai_agent endpoint: "
                            "call chat.completions.create without streaming")
        if body.get("n") not in (None, 1):
            raise CallError("n must be 1: each call extends one trajectory")
        if body.get("top_logprobs"):
            raise CallError("top_logprobs is not supported by rollmesh's openai_agent endpoint")
        fmt = body.get("response_format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise CallError("response_format other than {'type': 'text'} needs constrained "
                            "decoding, which would change the sampled policy; not supported")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise CallError("messages must be a non-empty list of message objects")
        msgs = [normalize_message(i, m) for i, m in enumerate(messages)]
        try:
            tools = parse_tools(body.get("tools"))
            use_tools = bool(tools) and parse_tool_choice(body, tools) != "none"
        except OpenAIError as e:
            raise CallError(e.message) from None
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int)
                                       or isinstance(max_tokens, bool) or max_tokens <= 0):
            raise CallError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict) or "chat_template" in kwargs:
            raise CallError("chat_template_kwargs must be an object (and cannot set the template)")
        sampling = {_SAMPLING[k]: v for k, v in body.items() if k in _SAMPLING and v is not None}
        model = body.get("model") if isinstance(body.get("model"), str) else self.model_name
        return ChatRequest(msgs, tools if use_tools else None, max_tokens, sampling,
                           bool(body.get("logprobs")), kwargs, model)

    def render(self, req: ChatRequest) -> list[int]:
        """The first call's prompt: the chat template's rendering with the generation prompt,
        encoded without special tokens (as data.render_prompt and SGLang do)."""
        tok = self.ctx.tokenizer
        if not getattr(tok, "chat_template", None):
            raise CallError("the policy's tokenizer has no chat template")
        try:
            text = tok.apply_chat_template(req.messages, tools=req.tools, tokenize=False,
                                           add_generation_prompt=True, **req.template_kwargs)
        except Exception as e:  # jinja's raise_exception, a template reading a missing key
            raise CallError(f"chat template failed: {type(e).__name__}: {e}") from None
        return list(tok.encode(text, add_special_tokens=False))

    def new_messages(self, s: Session, msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages after the conversation the trajectory holds; a request that does not
        continue it fails the trajectory (its error names the first message that differs)."""
        for i, held in enumerate(s.history):
            if i >= len(msgs):
                s.error = (f"messages[{i}] ({held['role']}) is missing: the trajectory holds "
                           f"{len(s.history)} messages (the last, the assistant's reply), this "
                           f"request sends {len(msgs)}; an openai_agent conversation may only "
                           "grow after the reply it got")
                raise CallError(s.error)
            diff = message_difference(held, msgs[i])
            if diff is not None:
                s.error = (f"messages[{i}] ({msgs[i]['role']}) does not continue the trajectory: "
                           f"{diff}; an openai_agent conversation may only grow after the "
                           "reply it got (rewritten history cannot be trained on as one "
                           "token sequence)")
                raise CallError(s.error)
        new = msgs[len(s.history):]
        if not new:
            raise CallError("no message after the assistant's reply: append the tool results "
                            "or the user's next message")
        return new

    async def _gate(self) -> None:
        """Wait while a weight sync holds this worker's generations (LoopContext.resumed)."""
        ctx = self.ctx
        if ctx.resumed.is_set():
            return
        stop = asyncio.ensure_future(ctx.stopping.wait())
        go = asyncio.ensure_future(ctx.resumed.wait())
        try:
            await asyncio.wait({stop, go}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            go.cancel()
        if not ctx.resumed.is_set():
            raise CallError("the agent worker is stopping", 503, "unavailable", "server_error")

    async def generate(self, s: Session, req: ChatRequest, start: int) -> tuple[str, Any]:
        """Generate this call's completion; across a weight sync: its partial tokens kept, the
        rest generated after the Resume. (finish_reason, matched stop)."""
        ctx, traj = self.ctx, s.traj
        budget = ctx.budget(traj) if req.max_tokens is None else min(req.max_tokens,
                                                                      ctx.budget(traj))
        stalled, synced = 0, False
        while True:
            done = len(traj.token_ids) - start
            if done >= budget:
                return "length", None
            await self._gate()
            self.generating += 1
            self.idle.clear()
            try:
                out = await ctx.generate(traj, budget - done, req.sampling)
                if synced:
                    s.resumed_calls += 1
                reason = (out.raw.get("meta_info") or {}).get("finish_reason")
                return out.finish_reason, reason.get("matched") if isinstance(reason, dict) \
                    else None
            except Interrupted:
                if ctx.cancelling.is_set() or not ctx.resumed.is_set():
                    synced, stalled = True, 0  # a weight sync: go on after the Resume
                    # where the sync cut it, as the worker records for a trajectory it
                    # returns interrupted (training.batching.trajectory_counts)
                    traj.interrupted_at = [*traj.interrupted_at, len(traj.token_ids)]
                elif len(traj.token_ids) - start > done:
                    stalled = 0  # the engine aborted it on its own: go on
                else:
                    stalled += 1
                    if stalled >= _NO_PROGRESS_ABORTS:
                        s.error = (f"the engines aborted this generation {stalled} times in a "
                                   "row without a token")
                        raise CallError(s.error, 503, "engine_aborted", "server_error") from None
                    await asyncio.sleep(0.1 * stalled)
            except ContextFull:
                return "length", None
            except Exception as e:  # EngineError...: the trajectory fails, retried whole
                s.error = f"generation failed: {type(e).__name__}: {e}"
                raise CallError(s.error, 502, "engine_error", "server_error") from None
            finally:
                self.generating -= 1
                if self.generating == 0:
                    self.idle.set()

    def answer(self, s: Session, req: ChatRequest, observation_at: int, start: int,
               finish: str, matched: Any) -> dict[str, Any]:
        traj, tok = s.traj, self.ctx.tokenizer
        ids = traj.token_ids[start:].tolist()
        text = tok.decode(ids, skip_special_tokens=True)
        if isinstance(matched, str) and matched and text.endswith(matched):
            text = text[:-len(matched)]  # a stop string is not part of the content
        tool_calls = None
        if req.tools:
            parsed = parse_sglang_tool_calls(text, req.tools, "hermes")
            if parsed.calls:
                text, tool_calls = parsed.text, tool_call_entries(parsed.calls)
                if finish == "stop":
                    finish = "tool_calls"
        if traj.finish_reason == "abort":
            traj.finish_reason = finish
        s.finish_reason = "length" if finish == "length" else "stop"
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        s.history.append(normalize_message(len(s.history), message))
        traj.loop_state.setdefault("completions", []).append(
            [observation_at, start, len(ids) + start])
        logprobs = None
        if req.logprobs:
            entries = [[float(lp), int(t), tok.decode([int(t)])]
                       for lp, t in zip(traj.logprobs[start:].tolist(), ids)]
            logprobs = chat_logprobs(entries, None, self.token_bytes)
        versions = sorted({int(v) for v in traj.versions[start:].tolist()})
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion",
                "created": int(time.time()), "model": req.model,
                "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                             "finish_reason": finish}],
                "usage": {"prompt_tokens": start, "completion_tokens": len(ids),
                          "total_tokens": start + len(ids)},
                # SGLang's metadata.weight_version (strings, as OpenAI's metadata), and every
                # version of this completion's tokens (two across a weight sync)
                "metadata": {"weight_version": str(versions[-1]) if versions else "",
                             "weight_versions": ",".join(map(str, versions))}}


# --------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------


class OpenAIAgent:
    """Runs the user's OpenAI-API agent for one trajectory (module docstring)."""

    name = "openai_agent"
    stays_on_worker = True  # the worker holds it through a weight sync (Held)
    takes_messages = True  # the rollouter sends the row's chat messages in metadata

    def __init__(self, ctx: LoopContext):
        self.ctx = ctx

    async def run(self, traj: Trajectory) -> None:
        ctx = self.ctx
        spec = traj.metadata.get(ROW_KEY) or getattr(ctx.rollout, "openai_agent", "")
        if not spec:
            raise AgentError("no agent function: set rollout.openai_agent = "
                             "'package.module:function' (or the row's 'openai_agent' field)")
        if not isinstance(spec, str):
            raise AgentError(f"the row's {ROW_KEY!r} must be 'package.module:function', got "
                             f"{spec!r}")
        try:
            fn = resolve_agent(spec)
        except ValueError as e:
            raise AgentError(str(e)) from None
        openai = _import_openai()
        if not isinstance(traj.metadata.get("messages"), list):
            raise AgentError("the trajectory carries no row messages (metadata 'messages'): the "
                             "rollouter adds them for loops with takes_messages = True; is "
                             "openai_agent registered where the rollouter runs?")
        restart(traj)
        endpoint = await OpenAIEndpoint.of(ctx)
        session = endpoint.open(traj)
        http = openai.DefaultAsyncHttpxClient(trust_env=False)  # never through a proxy
        client = openai.AsyncOpenAI(base_url=endpoint.base_url(session), api_key=session.key,
                                    max_retries=0, timeout=None, http_client=http)
        user = asyncio.ensure_future(fn(client, row_of(traj)))
        stop = asyncio.ensure_future(ctx.stopping.wait())
        try:
            await asyncio.wait({user, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not user.done():
                user.cancel()
                await asyncio.gather(user, return_exceptions=True)
            await endpoint.finish(session)
            await client.close()
        if user.cancelled():  # the worker is stopping: the trajectory moves, starting over
            raise Interrupted()
        self.conclude(traj, session, spec, user)

    @staticmethod
    def conclude(traj: Trajectory, s: Session, spec: str, user: asyncio.Future) -> None:
        if s.error is not None:
            raise AgentError(s.error)
        exc = user.exception()
        if exc is not None:
            if s.ended is None:
                raise AgentError(f"the agent {spec} raised {type(exc).__name__}: {exc}") from exc
            traj.metadata["agent_error"] = f"{type(exc).__name__}: {exc}"
        else:
            traj.metadata["agent_result"] = _plain(user.result())
        if s.turns == 0:
            raise AgentError(f"the agent {spec} made no chat completion call: nothing to train "
                             "on")
        traj.num_turns = s.turns
        traj.finish_reason = "length" if s.ended else s.finish_reason
        traj.loop_state["resumed_calls"] = s.resumed_calls
        traj.status = "finished"
