"""Agent loops: how a trajectory is generated, turn by turn, and how it resumes.

A loop is a class registered under the entry-point group `rollmesh.agent_loops` (rollmesh's own
`single_turn` and `tool_agent` too). Its whole state lives in the `Trajectory` it is given:
the token rows (ids, behaviour log-probs, weight versions, loss mask) and `loop_state`, plain
data that crosses the wire. Running a loop on an interrupted trajectory continues it: the prefix
is everything so far, and only what is still missing is generated.

A loop generates through `LoopContext.generate`, which appends the engine's tokens to the
trajectory (mask 1, the version that produced them) and raises `Interrupted` when the worker is
cancelling (a weight sync): the loop then returns nothing; the worker ships the trajectory as it
stands. Tool and environment tokens are appended with `append_observation` (mask 0, version -1).

Version stamping (what the staleness bound counts on). A request can run across a weight sync
(`sync.pause_mode = "in_place"`: the engines keep it and continue it under the new weights), so
its tokens may come from several versions:
- where the engine says which version made each token, each token gets its own
  (`GenerateOutput.token_versions`): the built-in engine's meta_info
  `output_token_weight_versions`, or SGLang 0.5.23's `weight_versions` spans;
- an engine that reports only one `weight_version` (the last token's) is stamped
  conservatively. The context remembers the version each engine reported last; a request
  starts with `start` = the lowest of them (asked from the engines once before any answer).
  If the answer reports `start`, no sync happened during it and every token gets that version;
  otherwise every token gets the oldest version it can have been made with, min(start,
  reported). Never newer than the truth: a token may count as staler than it is (and be
  dropped early), never fresher.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import inspect
import json
from collections.abc import Sequence
from typing import Any, Callable, Protocol

import msgpack

from rollmesh.config import RolloutConfig
from rollmesh.agents.tools import calculator
from rollmesh.engine.client import (
    EngineClient, GenerateOutput, GenerationCancelled, version_number,
)
from rollmesh.wire.messages import Trajectory
from rollmesh.core.trajectory import append_observation, append_tokens


class Interrupted(Exception):
    """The worker is cancelling: stop, the trajectory will be resumed later."""


class AgentLoop(Protocol):
    name: str

    def __init__(self, ctx: LoopContext) -> None: ...

    async def run(self, traj: Trajectory) -> None:
        """Advance `traj` until it is finished (set traj.status = "finished")."""


def token_stamps(out: GenerateOutput, start: int | None) -> int | list[int]:
    """The weight version(s) to stamp `out`'s tokens with (the rule in the module docstring):
    the engine's own per-token versions where it reports them; otherwise
    the reported version if no sync can have happened since the request started (it equals
    `start`, the oldest version the worker knew an engine at when it started), else `start`,
    the oldest version any of its tokens can carry."""
    if out.token_versions is not None:
        return out.token_versions
    reported = parse_version(out.weight_version)
    if start is None or reported == start:
        return reported
    return min(start, reported)


def parse_version(weight_version: str) -> int:
    """An engine's reported version as the stamping needs it: the client's rule
    (`rollmesh.engine.client.version_number`), a version it cannot read refused (ValueError)."""
    version = version_number(weight_version)
    if version is None:
        raise ValueError(f"engine reports weight_version {weight_version!r}: rollmesh needs "
                         "integer versions (start engines with --weight-version 0)")
    return version


class LoopContext:
    """What a loop gets from its worker: generation, the tokenizer, limits, tools."""

    def __init__(self, client: EngineClient, tokenizer: Any, rollout: RolloutConfig, *,
                 max_context: int, cancelling: asyncio.Event,
                 tools: dict[str, Callable[..., Any]] | None = None):
        self.client = client
        self.tokenizer = tokenizer
        self.rollout = rollout
        self.max_context = max_context
        self.cancelling = cancelling
        self.tools = configure_tools(tools if tools is not None else builtin_tools(), rollout)
        self.active: dict[str, asyncio.Future] = {}  # generations in flight, by rid
        # Loops whose trajectories stay on this worker through a weight sync (`openai_agent`:
        # the user's coroutine cannot move) wait for `resumed` before they generate again; the
        # worker clears it at a Cancel and sets it at the Resume. `stopping`: the worker is
        # going away, such loops hand their trajectories back as they stand.
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.stopping = asyncio.Event()
        self.endpoint: Any = None  # openai_agent's HTTP endpoint, started by its first run
        self.generated_tokens = 0  # what the engines produced for this worker, all told
        # Version stamping (module docstring): each engine's version as its last answer
        # reported it, and whether an engine reports per-token versions.
        self.server_versions: dict[str, int] = {}
        self.per_token_versions = False
        self._version_probe: asyncio.Future[int | None] | None = None

    def sampling_params(self, max_new_tokens: int, traj: Trajectory | None = None,
                        request: dict[str, Any] | None = None) -> dict[str, Any]:
        """The rollout's sampling, then a request's own (an agent's temperature, stop
        strings...), then the trajectory's overrides (e.g. greedy evaluation), which win."""
        r = self.rollout
        params = {"max_new_tokens": max_new_tokens, "temperature": r.temperature,
                  "top_p": r.top_p, "top_k": r.top_k}
        params.update(request or {})
        params["max_new_tokens"] = max_new_tokens
        if traj is not None:
            params.update(traj.metadata.get("sampling") or {})
            # a row's max_new_tokens is its whole budget: what is asked now is what is left
            params["max_new_tokens"] = min(int(params["max_new_tokens"]), max_new_tokens)
        return params

    def budget(self, traj: Trajectory) -> int:
        """Response tokens this trajectory may generate (per turn): its row's max_new_tokens
        where the row sets one, else the rollout's."""
        own = (traj.metadata.get("sampling") or {}).get("max_new_tokens")
        return int(own) if own is not None else self.rollout.max_new_tokens

    async def generate(self, traj: Trajectory, max_new_tokens: int,
                       sampling: dict[str, Any] | None = None) -> GenerateOutput:
        """Generate from everything the trajectory holds and append the result to it;
        `sampling`: a request's own sampling parameters (`sampling_params`)."""
        if self.cancelling.is_set():
            raise Interrupted()
        max_new_tokens = min(max_new_tokens, self.max_context - len(traj.token_ids) - 1)
        if max_new_tokens <= 0:
            raise ContextFull()
        start = await self.start_version()
        rid = self.client.new_rid()
        call = asyncio.ensure_future(self.client.generate(
            traj.token_ids.tolist(), self.sampling_params(max_new_tokens, traj, sampling),
            rid=rid, wait_s=self.rollout.engine_wait_s, cancel=self.cancelling,
            affinity=traj.group_id))
        self.active[rid] = call
        try:
            # Through an engine outage the client waits for a server (rollout.engine_wait_s)
            # and moves a request whose engine died to another; a cancel (weight sync) ends
            # that wait: the trajectory goes back as it stands, its partial tokens kept.
            # The group id as the affinity key: the group's siblings, each turn and each resume
            # after a sync (on whichever worker) go to the engine holding the shared prefix.
            out = await call
        except GenerationCancelled:
            raise Interrupted() from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if call.cancelled() and task is not None and not task.cancelling():
                raise Interrupted() from None  # dropped: the worker is stopping (drop_all)
            raise
        finally:
            self.active.pop(rid, None)
        append_tokens(traj, out.output_ids, out.logprobs, self.stamp(out, start))
        self.generated_tokens += len(out.output_ids)
        traj.finish_reason = out.finish_reason
        if out.aborted:
            raise Interrupted()
        return out

    async def start_version(self) -> int | None:
        """The oldest version an engine may hold as a request starts: the lowest any engine
        reported last. Needed only for engines that do not report per-token versions; before
        any answer it is asked once from the engines (/get_model_info), None if they cannot
        say (the request's tokens then get the version it reports). A cancel that arrived
        while the engines were asked interrupts (the request would escape the worker's abort)."""
        healthy = {s.url for s in getattr(self.client, "servers", []) if s.healthy}
        known = [v for url, v in self.server_versions.items() if url in healthy]
        if known or self.server_versions:
            return min(known or self.server_versions.values())
        if self.per_token_versions:
            return None
        if self._version_probe is None:
            self._version_probe = asyncio.ensure_future(self._probe_versions())
        version = await asyncio.shield(self._version_probe)
        if version is None:
            self._version_probe = None  # ask again next time
        if self.cancelling.is_set():
            raise Interrupted()
        return version

    async def _probe_versions(self) -> int | None:
        try:
            reported = await asyncio.wait_for(self.client.weight_versions(), 10)
            return min(parse_version(v) for v in reported) if reported else None
        except Exception:  # unreachable, an old route, a non-integer version: unknown
            return None

    def stamp(self, out: GenerateOutput, start: int | None) -> int | list[int]:
        """The versions for `out`'s tokens (token_stamps), and what the answer tells about
        its engine."""
        stamps = token_stamps(out, start)
        self.per_token_versions = self.per_token_versions or out.token_versions is not None
        self.server_versions[out.server] = parse_version(out.weight_version)
        return stamps

    def drop_all(self) -> None:
        """The worker is stopping: stop waiting for the generations in flight (the engines
        abort a request whose client went away). Their trajectories go back as they stood
        before these generations, which are lost; at a sync's Cancel they are not dropped:
        the engines abort them (EngineClient.abort_while), answering their partial tokens."""
        for call in list(self.active.values()):
            call.cancel()

    async def close(self) -> None:
        """Stop what the loops started on this worker (openai_agent's endpoint)."""
        if self.endpoint is not None:
            await self.endpoint.close()
            self.endpoint = None


class ContextFull(Exception):
    """The trajectory reached the model's context: it ends as a length finish."""


# --------------------------------------------------------------------------------------------
# single_turn
# --------------------------------------------------------------------------------------------


class SingleTurn:
    """One response to the prompt, up to `rollout.max_new_tokens`, resumable mid-response."""

    name = "single_turn"

    def __init__(self, ctx: LoopContext):
        self.ctx = ctx

    async def run(self, traj: Trajectory) -> None:
        already = len(traj.token_ids) - traj.prompt_len
        remaining = self.ctx.budget(traj) - already
        if remaining > 0:
            try:
                await self.ctx.generate(traj, remaining)
            except ContextFull:
                traj.finish_reason = "length"
        traj.num_turns = 1
        traj.status = "finished"


# --------------------------------------------------------------------------------------------
# tool_agent
# --------------------------------------------------------------------------------------------

_ASSISTANT_PROBE = "rollmesh-assistant-turn"  # stands for the generated turn when rendering
RECORDED_RESULT_CHARS = 2000  # of each tool result kept in loop_state["calls"]


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot render what a loop needs (named in the message)."""


def tool_observation(tokenizer: Any, results: Sequence[str], *, turn_ended: bool) -> list[int]:
    """The token ids that follow a generated assistant turn: the tool responses as the
    tokenizer's own chat template renders tool messages, and the next assistant header."""
    return next_turn_ids(tokenizer, [{"role": "tool", "content": r} for r in results],
                         turn_ended=turn_ended)


def next_turn_ids(tokenizer: Any, messages: Sequence[dict[str, Any]], *,
                  turn_ended: bool) -> list[int]:
    """The token ids that follow a generated assistant turn: `messages` (tool responses, a
    user's reply) rendered by the tokenizer's own chat template, then the next assistant header.

    The template renders [user, assistant, *messages] with the generation prompt; what comes
    after the assistant turn's end (`eos_token`, e.g. Qwen's <|im_end|>) is the observation. The
    rendering of [user] must be a prefix of it (a template that rewrites earlier turns cannot be
    continued token by token). `turn_ended`: the generated turn already ends with `eos_token`;
    otherwise (stopped by a stop string, say) the end of turn is part of the observation."""
    eot = getattr(tokenizer, "eos_token", None)
    if not getattr(tokenizer, "chat_template", None) or not eot:
        raise ChatTemplateError("the tokenizer needs a chat template and an eos_token to "
                                "render the next turn with")
    roles = "/".join(sorted({str(m.get("role")) for m in messages}))
    user = [{"role": "user", "content": "?"}]
    convo = [*user, {"role": "assistant", "content": _ASSISTANT_PROBE}, *messages]
    try:
        head = tokenizer.apply_chat_template(user, tokenize=False)
        full = tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja's TemplateError, raise_exception(...) in the template
        raise ChatTemplateError(f"the chat template cannot render {roles} messages after an "
                                f"assistant turn: {type(e).__name__}: {e}") from e
    at = full.find(_ASSISTANT_PROBE, len(head)) if full.startswith(head) else -1
    end = full.find(eot, at + len(_ASSISTANT_PROBE)) if at >= 0 else -1
    if end < 0:
        raise ChatTemplateError(
            f"the chat template's rendering of [user, assistant, {roles}] does not continue its "
            f"rendering of [user] with an assistant turn ended by {eot!r}")
    text = full[end if not turn_ended else end + len(eot):]
    return list(tokenizer.encode(text, add_special_tokens=False))


def parse_tool_agent_calls(text: str) -> list[dict[str, Any]]:
    """Every <tool_call>{"name": ..., "arguments": ...}</tool_call> in `text`, in order: the
    `tool_agent` loop's own grammar (any whitespace inside the markers, arguments an object or
    its JSON text, returned as an object; every tool name taken).

    A call that does not parse becomes {"error": why} so the model is told, not ignored.
    Not SGLang's named parsers (qwen25/qwen/hermes, which the built-in engine's
    /v1/chat/completions and the `openai_agent` endpoint use): those are
    `rollmesh.engine.openai_common.parse_sglang_tool_calls`.
    """
    calls = []
    for raw in tool_call_blocks(text):
        try:
            call = json.loads(raw)
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError('expected {"name": str, "arguments": {...}}')
            args = call.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(args, dict):
                raise ValueError("arguments must be an object")
            calls.append({"name": call["name"], "arguments": args})
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            calls.append({"error": f"malformed tool call: {e}", "raw": raw[:200]})
        except RecursionError:  # JSON nested deeper than the parser's stack
            calls.append({"error": "malformed tool call: JSON nested too deeply",
                          "raw": raw[:200]})
    return calls


def tool_call_blocks(text: str, start: str = "<tool_call>", end: str = "</tool_call>") -> list[str]:
    """The text between each `start` and the next `end`, whitespace stripped, in one pass
    (a lazy regex rescans the rest of the text from every unclosed marker: 8,000 of them in
    model output blocked the event loop for 7 s)."""
    blocks, i = [], 0
    while (a := text.find(start, i)) >= 0:
        b = text.find(end, a + len(start))
        if b < 0:
            break  # no end after this marker: none after a later one either
        blocks.append(text[a + len(start):b].strip())
        i = b + len(end)
    return blocks


async def run_tool(tools: dict[str, Callable[..., Any]], call: dict[str, Any],
                   timeout_s: float) -> str:
    """Run one call with a time limit; every failure is a message for the model."""
    if "error" in call:
        return call["error"]
    fn = tools.get(call["name"])
    if fn is None:
        return f"unknown tool {call['name']!r} (available: {', '.join(sorted(tools)) or 'none'})"
    try:
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
                getattr(fn, "__call__", None)):  # an object with an async __call__
            result = await asyncio.wait_for(fn(**call["arguments"]), timeout_s)
        else:
            result = await asyncio.wait_for(asyncio.to_thread(fn, **call["arguments"]),
                                            timeout_s)
    except asyncio.TimeoutError:
        return f"tool {call['name']} timed out after {timeout_s:g}s"
    except Exception as e:
        return f"tool {call['name']} failed: {type(e).__name__}: {e}"
    return result if isinstance(result, str) else json.dumps(result)


def recorded_call(call: dict[str, Any], result: str) -> dict[str, Any]:
    """An executed call as loop_state["calls"] keeps it for the reward (the trajectory view's
    tool_calls): {"name", "arguments", "result"}, the result cut to RECORDED_RESULT_CHARS; a
    malformed call has no name and no arguments, its result the error the model was given.
    Arguments that cannot cross the wire (a JSON integer beyond 64 bits) are kept as their
    JSON text, {"json": text}."""
    if "error" in call:
        return {"name": None, "arguments": {}, "result": result[:RECORDED_RESULT_CHARS]}
    args = call["arguments"]
    try:
        msgpack.packb(args)
    except OverflowError:
        args = {"json": json.dumps(args)}
    return {"name": call["name"], "arguments": args, "result": result[:RECORDED_RESULT_CHARS]}


class ToolAgent:
    """Multi-turn: generate -> parse tool calls -> run them concurrently -> feed results back.

    loop_state: {"turn": completed turns, "turn_start": token index where the current
    assistant turn began, "tool_calls": how many calls ran, "calls": each of them in order
    (`recorded_call`), for the reward}. A cancel during generation keeps the partial turn
    (resumed with the rest of the turn's budget); tool calls already running finish first,
    their results are appended, and the next turn starts on resume.
    """

    name = "tool_agent"

    def __init__(self, ctx: LoopContext):
        self.ctx = ctx

    async def run(self, traj: Trajectory) -> None:
        ctx, state = self.ctx, traj.loop_state
        state.setdefault("turn", 0)
        state.setdefault("turn_start", len(traj.token_ids))
        allowed = traj.metadata.get("tools")
        tools = {k: v for k, v in ctx.tools.items() if allowed is None or k in allowed}
        while state["turn"] < ctx.rollout.max_turns:
            remaining = ctx.budget(traj) - (len(traj.token_ids) - state["turn_start"])
            try:
                if remaining > 0:
                    await ctx.generate(traj, remaining)
            except ContextFull:
                traj.finish_reason = "length"
                break
            state["turn"] += 1
            text = ctx.tokenizer.decode(traj.token_ids[state["turn_start"]:].tolist(),
                                        skip_special_tokens=True)
            calls = parse_tool_agent_calls(text)
            if not calls or traj.finish_reason == "length":
                break
            results = await asyncio.gather(*(run_tool(tools, c, ctx.rollout.tool_timeout_s)
                                             for c in calls))
            ended = int(traj.token_ids[-1]) == ctx.tokenizer.eos_token_id
            append_observation(traj, tool_observation(ctx.tokenizer, results, turn_ended=ended))
            state["turn_start"] = len(traj.token_ids)
            state.setdefault("tool_calls", 0)
            state["tool_calls"] += len(calls)
            state.setdefault("calls", []).extend(map(recorded_call, calls, results))
            if len(traj.token_ids) >= ctx.max_context - 1:
                traj.finish_reason = "length"
                break
        traj.num_turns = state["turn"]
        traj.status = "finished"


# --------------------------------------------------------------------------------------------
# The tool registry
# --------------------------------------------------------------------------------------------

def builtin_tools() -> dict[str, Callable[..., Any]]:
    """Built-in tools plus those registered under the entry-point group `rollmesh.tools`."""
    tools: dict[str, Callable[..., Any]] = {"calculator": calculator}
    for ep in importlib.metadata.entry_points(group="rollmesh.tools"):
        tools[ep.name] = ep.load()
    return tools


def configure_tools(tools: dict[str, Callable[..., Any]],
                    rollout: RolloutConfig) -> dict[str, Callable[..., Any]]:
    """Each tool with a `configured(rollout)` method (the `python` tool: its limits) as the
    rollout configures it; the others as they are."""
    return {name: fn.configured(rollout) if callable(getattr(fn, "configured", None)) else fn
            for name, fn in tools.items()}


def load_agent_loops() -> dict[str, type]:
    """Every agent loop registered under `rollmesh.agent_loops`, by name."""
    loops = {}
    for ep in importlib.metadata.entry_points(group="rollmesh.agent_loops"):
        loops[ep.name] = ep.load()
    return loops


def get_agent_loop(name: str, loops: dict[str, type] | None = None) -> type:
    loops = load_agent_loops() if loops is None else loops
    if name not in loops:
        raise KeyError(f"unknown agent loop {name!r} (registered under 'rollmesh.agent_loops': "
                       f"{', '.join(sorted(loops)) or 'none'})")
    return loops[name]
