"""openai_agent: agents written against the OpenAI API, driven with the real `openai` package
against the built-in engine (served in this process, on a thread of its own, over real HTTP)."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("openai")

import openai  # noqa: E402
from aiohttp import ClientSession, web  # noqa: E402

from rollmesh.agents.loops import LoopContext  # noqa: E402
from rollmesh.config import RolloutConfig  # noqa: E402
from rollmesh.engine.client import EngineClient  # noqa: E402
from rollmesh.models.loading import build_tiny  # noqa: E402
from rollmesh.runtime.log import get_logger  # noqa: E402
from rollmesh.agents.openai_agent import (  # noqa: E402
    AgentError, CallError, OpenAIAgent, OpenAIEndpoint, Session, message_difference,
    normalize_message, recorded_tool_calls, resolve_agent,
)
from rollmesh.core.trajectory import new_trajectory  # noqa: E402
from tests.engine.engine_harness import teacher_forced_logprobs  # noqa: E402

HERE = "tests.unit.test_openai_agent"
LOOPS = {"openai_agent": OpenAIAgent}  # until the package is reinstalled with its entry point
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
TOOL_TURN = "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


# -- the built-in engine, in this process ----------------------------------------------------


class ThreadEngine:
    """rollmesh's built-in engine (tiny, version 0) on an event loop of its own thread."""

    def __init__(self) -> None:
        from rollmesh.engine.builtin.server import EngineServer, _parser

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start() -> str:
            model, tok = build_tiny("tiny")
            args = _parser().parse_args(["--model", "tiny", "--port", "0", "--seed", "0",
                                         "--weight-version", "0"])
            args.api_key = None
            self.server = EngineServer(args, model, tok, get_logger("rollmesh.engine"))
            self.runner = web.AppRunner(self.server.app(), access_log=None)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

        self.url = asyncio.run_coroutine_threadsafe(start(), self.loop).result(180)

    def running_outputs(self) -> list[int]:
        return [len(r.output_ids) for r in list(self.server.scheduler.running)]

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def engine():
    e = ThreadEngine()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def tiny():
    import torch

    model, tok = build_tiny("tiny")
    with torch.no_grad():
        yield model, tok


async def post(url: str, path: str, body: dict[str, Any]) -> Any:
    async with ClientSession() as http, http.post(url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json(content_type=None)


def context(client: EngineClient, tok: Any, **rollout: Any) -> LoopContext:
    rollout = {"max_new_tokens": 16, "max_turns": 4, **rollout}
    return LoopContext(client, tok, RolloutConfig(**rollout), max_context=512,
                       cancelling=asyncio.Event())


def trajectory(sample_id: str, agent: str, question: str) -> Any:
    return new_trajectory(sample_id, "g", 0, [1, 2, 3], agent_loop="openai_agent", metadata={
        "messages": [{"role": "user", "content": question}], "openai_agent": f"{HERE}:{agent}"})


# -- agents (what users write) ---------------------------------------------------------------


async def two_turn_agent(client: openai.AsyncOpenAI, row: dict) -> dict:
    """Asks, gets a reply, appends a tool result, asks again (the SDK's own message echoed)."""
    messages = list(row["messages"])
    first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                 max_tokens=8, logprobs=True)
    messages.append(first.choices[0].message.model_dump())  # refusal, audio ...: None
    messages.append({"role": "tool", "tool_call_id": "call_0", "content": "42"})
    second = await client.chat.completions.create(model="policy", messages=messages,
                                                  max_tokens=6, logprobs=True)
    return {"replies": [first.model_dump(), second.model_dump()]}


async def long_agent(client: openai.AsyncOpenAI, row: dict) -> dict:
    """One call, long enough to be caught by a weight sync."""
    reply = await client.chat.completions.create(
        model="policy", messages=row["messages"], max_tokens=48, extra_body={"ignore_eos": True})
    return {"content": reply.choices[0].message.content, "calls": 1,
            "completion_tokens": reply.usage.completion_tokens,
            "finish_reason": reply.choices[0].finish_reason}


async def history_rewriting_agent(client: openai.AsyncOpenAI, row: dict) -> str:
    messages = list(row["messages"])
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages.append({"role": "assistant", "content": first.choices[0].message.content})
    messages.append({"role": "user", "content": "And then?"})
    messages[0] = {"role": "user", "content": row["messages"][0]["content"] + " (edited)"}
    try:  # the agent swallows the error: the trajectory fails all the same
        await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    except openai.BadRequestError as e:
        return f"refused: {e.message}"
    return "accepted"


async def broken_agent(client: openai.AsyncOpenAI, row: dict) -> None:
    await client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=2)
    raise KeyError("the agent's own bug")


async def streaming_agent(client: openai.AsyncOpenAI, row: dict) -> str:
    try:
        await client.chat.completions.create(model="policy", messages=row["messages"],
                                             stream=True)
    except openai.BadRequestError as e:
        return e.message
    return "streamed"


async def chatty_agent(client: openai.AsyncOpenAI, row: dict) -> int:
    """Keeps talking until the endpoint refuses (rollout.max_turns)."""
    messages = list(row["messages"])
    for turn in range(100):
        reply = await client.chat.completions.create(model="policy", messages=messages,
                                                     max_tokens=2)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"more {turn}"}]
    return 100


def sync_agent(client: Any, row: dict) -> None:  # not async: refused before it runs
    return None


# -- tests -------------------------------------------------------------------------------------


def test_two_agents_record_exactly_the_sampled_tokens(engine, tiny):
    """Two 2-turn agents at once on one endpoint: each trajectory is the first call's rendered
    prompt, the engine's tokens (mask 1, their version, the engine's log-probs: those of the
    model on exactly that prefix), the tool message as the template renders it (mask 0), the
    second reply; the replies the agent got are those tokens decoded."""
    model, tok = tiny

    async def body():
        async with EngineClient([engine.url]) as client:
            ctx = context(client, tok)
            version = int((await post(engine.url, "/update_weight_version",
                                      {"new_version": "7", "abort_all_requests": False}))
                          ["new_version"])
            trajs = [trajectory(f"s{i}", "two_turn_agent", q) for i, q in
                     enumerate(["What is 12 plus 30?", "Name a letter."])]
            await asyncio.gather(*(OpenAIAgent(ctx).run(t) for t in trajs))
            await ctx.close()
            return trajs, version

    trajs, version = asyncio.run(body())
    prompts = []
    for t in trajs:
        assert t.status == "finished" and t.num_turns == 2
        question = t.metadata["messages"][0]["content"]
        prompt = tok.encode(tok.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False)
        ids = t.token_ids.tolist()
        (o1, s1, e1), (o2, s2, e2) = t.loop_state["completions"]
        # the tool message, for the reward: its id answers none of the reply's calls
        assert t.loop_state["calls"] == [{"name": None, "arguments": {}, "result": "42"}]
        assert t.prompt_len == len(prompt) == o1 == s1 and ids[:s1] == prompt
        assert e1 == o2 and e2 == len(ids)
        ended = ids[e1 - 1] == tok.eos_token_id
        assert tok.decode(ids[o2:s2]) == ("" if ended else "<|im_end|>") + "\n" + TOOL_TURN
        assert t.loss_mask.tolist() == [0] * s1 + [1] * (e1 - s1) + [0] * (s2 - o2) \
            + [1] * (e2 - s2)
        assert set(t.versions[t.loss_mask == 1].tolist()) == {version}
        assert set(t.versions[t.loss_mask == 0].tolist()) == {-1}
        replies = t.metadata["agent_result"]["replies"]
        for reply, (start, end) in zip(replies, [(s1, e1), (s2, e2)]):
            choice = reply["choices"][0]
            assert choice["message"]["content"] == tok.decode(ids[start:end],
                                                              skip_special_tokens=True)
            usage = reply["usage"]
            assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) \
                == (start, end - start, end)
            sent = [c["logprob"] for c in choice["logprobs"]["content"]]
            np.testing.assert_allclose(sent, t.logprobs[start:end], rtol=0, atol=1e-6)
            assert choice["finish_reason"] == ("stop" if ids[end - 1] == tok.eos_token_id
                                               else "length")
            # behaviour log-probs: the model's own, teacher-forced on the recorded prefix
            expected = teacher_forced_logprobs(model, ids[:start], ids[start:end])
            np.testing.assert_allclose(t.logprobs[start:end], expected, rtol=0, atol=2e-3)
            assert all(math.isfinite(x) and x <= 0 for x in t.logprobs[start:end])
        prompts.append(ids[:s1])
    assert prompts[0] != prompts[1]  # each agent wrote to its own trajectory


def test_rewritten_history_fails_the_trajectory_naming_the_message(engine, tiny):
    _, tok = tiny

    async def body():
        async with EngineClient([engine.url]) as client:
            ctx = context(client, tok)
            t = trajectory("s", "history_rewriting_agent", "Count to three.")
            with pytest.raises(AgentError) as err:
                await OpenAIAgent(ctx).run(t)
            await ctx.close()
            return t, str(err.value)

    t, error = asyncio.run(body())
    assert error.startswith("messages[0] (user) does not continue the trajectory: content "
                            "differs at character 15: ' (edited)' here, '' in the trajectory")
    assert t.status != "finished" and "agent_result" not in t.metadata


def test_an_agent_that_raises_fails_its_trajectory_and_the_endpoint_serves_on(engine, tiny):
    _, tok = tiny

    async def body():
        async with EngineClient([engine.url]) as client:
            ctx = context(client, tok)
            bad = trajectory("bad", "broken_agent", "Hello?")
            with pytest.raises(AgentError, match=r"the agent tests.unit.test_openai_agent:"
                                                 r"broken_agent raised KeyError: \"the agent's "
                                                 r"own bug\""):
                await OpenAIAgent(ctx).run(bad)
            good = trajectory("good", "long_agent", "Hello?")
            await OpenAIAgent(ctx).run(good)
            streaming = trajectory("stream", "streaming_agent", "Hello?")
            with pytest.raises(AgentError, match="made no chat completion call"):
                await OpenAIAgent(ctx).run(streaming)
            chatty = trajectory("chatty", "chatty_agent", "Hello?")
            await OpenAIAgent(ctx).run(chatty)
            await ctx.close()
            return good, streaming, chatty

    good, streaming, chatty = asyncio.run(body())
    assert good.status == "finished" and good.metadata["agent_result"]["completion_tokens"] == 16
    # the rollout's per-turn budget (16) caps the agent's max_tokens (48)
    assert good.metadata["agent_result"]["finish_reason"] == "length"
    # the turn limit ends the conversation: a "length" finish, the agent's error kept
    assert chatty.status == "finished" and chatty.num_turns == 4
    assert chatty.finish_reason == "length"
    assert "turn limit: rollout.max_turns = 4" in chatty.metadata["agent_error"]


def test_requests_the_endpoint_cannot_serve_are_clear_errors(engine, tiny):
    _, tok = tiny

    async def body():
        async with EngineClient([engine.url]) as client:
            ctx = context(client, tok)
            endpoint = await OpenAIEndpoint.of(ctx)
            s = endpoint.open(trajectory("s", "long_agent", "Hi"))
            api = openai.AsyncOpenAI(base_url=endpoint.base_url(s), api_key=s.key, max_retries=0)
            msgs = [{"role": "user", "content": "Hi"}]
            errors = []
            for kwargs in ({"stream": True}, {"n": 2}, {"logit_bias": {"1": 5}},
                           {"response_format": {"type": "json_object"}}):
                with pytest.raises(openai.BadRequestError) as e:
                    await api.chat.completions.create(model="p", messages=msgs, **kwargs)
                errors.append(e.value.message)
            models = await api.models.list()
            other = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{endpoint.port}/v1",
                                       api_key="wrong", max_retries=0)
            with pytest.raises(openai.NotFoundError):
                await other.chat.completions.create(model="p", messages=msgs)
            by_key = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{endpoint.port}/v1",
                                        api_key=s.key, max_retries=0)
            reply = await by_key.chat.completions.create(model="p", messages=msgs, max_tokens=2)
            for c in (api, other, by_key):
                await c.close()
            await ctx.close()
            return errors, models, reply

    errors, models, reply = asyncio.run(body())
    assert all(e.startswith("Error code: 400 - ") for e in errors)  # the SDK's prefix
    errors = [e.removeprefix("Error code: 400 - ") for e in errors]
    assert errors[0].startswith("stream: true is not supported")
    assert errors[1] == "n must be 1: each call extends one trajectory"
    assert errors[2] == "logit_bias is not supported by rollmesh's openai_agent endpoint"
    assert errors[3].startswith("response_format other than {'type': 'text'}")
    assert [m.id for m in models.data] == [tok.name_or_path or "policy"]
    assert reply.usage.completion_tokens == 2  # the bearer key names the trajectory too


def test_the_readme_example_agent_runs(engine, tiny):
    """The README's example, as written there, against the engine."""
    import sys
    import types

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = readme.split("# my_agents.py", 1)[1].split("\n", 1)[1].split("```", 1)[0]
    module = types.ModuleType("readme_agents")
    exec(compile(code, "README.md (my_agents.py)", "exec"), module.__dict__)
    sys.modules["readme_agents"] = module
    _, tok = tiny

    async def body():
        async with EngineClient([engine.url]) as client:
            ctx = context(client, tok)
            t = trajectory("s", "x", "What is 2 plus 2?")
            t.metadata["openai_agent"] = "readme_agents:math_agent"
            await OpenAIAgent(ctx).run(t)
            await ctx.close()
            return t

    try:
        t = asyncio.run(body())
    finally:
        del sys.modules["readme_agents"]
    assert t.status == "finished" and t.num_turns >= 1
    assert isinstance(t.metadata["agent_result"], (str, type(None)))


def test_agent_functions_are_checked():
    assert resolve_agent(f"{HERE}:long_agent") is long_agent
    for spec, why in ((f"{HERE}", "expected 'package.module:function'"),
                      ("no_such_module_xyz:f", "cannot import no_such_module_xyz"),
                      (f"{HERE}:nope", f"{HERE} has no nope"),
                      (f"{HERE}:sync_agent", "must be an async function")):
        with pytest.raises(ValueError, match=why):
            resolve_agent(spec)


def test_tool_calls_are_parsed_and_the_tool_turn_rendered_by_the_template():
    """With Qwen2.5's template: a Hermes <tool_call> reply becomes `tool_calls` (finish_reason
    tool_calls); the agent's echo of it (the SDK's dump) continues the trajectory, and the tool
    result is appended as the template renders a tool turn; a changed argument is named."""
    from rollmesh.agents.loops import next_turn_ids
    from rollmesh.core.trajectory import append_tokens
    from rollmesh.agents.openai_agent import ChatRequest
    from tests.helpers.hf_checkpoints import build_tokenizer

    tok = build_tokenizer("qwen2.5")
    ctx = context(EngineClient(["http://127.0.0.1:9"]), tok)
    endpoint = OpenAIEndpoint(ctx)
    user = [{"role": "user", "content": "What is 12 plus 30?"}]
    req = ChatRequest([normalize_message(0, user[0])], TOOLS, None, {}, False, {}, "p")
    s = Session("k", trajectory("s", "x", "q"))
    s.traj.token_ids = np.asarray(endpoint.render(req), np.int32)
    for a in ("logprobs", "versions", "loss_mask"):
        setattr(s.traj, a, np.zeros(len(s.traj.token_ids), getattr(s.traj, a).dtype))
    s.history = list(req.messages)
    start = len(s.traj.token_ids)
    call = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
            '"12+30"}}\n</tool_call>')
    out = tok.encode(call, add_special_tokens=False) + [tok.eos_token_id]
    append_tokens(s.traj, out, [-0.1] * len(out), 3)
    reply = endpoint.answer(s, req, start, start, "stop", None)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me compute."
    (tc,) = choice["message"]["tool_calls"]
    assert tc["function"] == {"name": "calculator", "arguments": '{"expression": "12+30"}'}
    # the agent echoes the SDK's message object and answers the call
    sdk = openai.types.chat.ChatCompletionMessage.model_validate(choice["message"]).model_dump()
    sent = [normalize_message(i, m) for i, m in enumerate(
        [*user, sdk, {"role": "tool", "tool_call_id": tc["id"], "content": "42"}])]
    new = endpoint.new_messages(s, sent)
    assert [m["role"] for m in new] == ["tool"]
    # recorded for the reward: the call it answers found by tool_call_id
    assert recorded_tool_calls(s.history, new) == [
        {"name": "calculator", "arguments": {"expression": "12+30"}, "result": "42"}]
    other = normalize_message(3, {"role": "tool", "tool_call_id": "call_x", "name": "search",
                                  "content": "none"})
    assert recorded_tool_calls(s.history, [other]) == [
        {"name": "search", "arguments": {}, "result": "none"}]
    # the agent's own history may hold any id and name: neither breaks the record
    odd = normalize_message(0, {"role": "assistant", "content": "", "tool_calls": [
        {"id": ["call_x"], "function": {"name": "f", "arguments": "{}"}},
        {"id": "call_x", "function": {"name": 5, "arguments": '{"n": 1e999}'}}]})
    assert recorded_tool_calls([odd], [{**other, "name": None}]) == [
        {"name": None, "arguments": {"n": math.inf}, "result": "none"}]
    obs = next_turn_ids(tok, new, turn_ended=True)
    assert tok.decode(obs) == ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response>"
                               "<|im_end|>\n<|im_start|>assistant\n")
    changed = json.loads(json.dumps(sdk))
    changed["tool_calls"][0]["function"]["arguments"] = '{"expression": "12+31"}'
    with pytest.raises(CallError, match=r"messages\[1\] \(assistant\) does not continue the "
                                        r"trajectory: tool_calls differs"):
        endpoint.new_messages(s, [sent[0], normalize_message(1, changed), sent[2]])
    assert message_difference(sent[1], normalize_message(1, sdk)) is None


# -- a weight sync during a call, through the real rollouter and agent worker -------------------


SPEC = SimpleNamespace(role="agent", instance=0, host="local", heartbeat_s=60.0, liveness=5,
                       restart=0)


def _rollouter(tmp_path: Path, agent: str):
    """An in-process rollouter on a real ZeroMQ channel (one row, groups of 2, one group per
    version), with its transport and experiment."""
    from rollmesh.core.trajectory import load_tokenizer
    from rollmesh.rollout.data import PromptSource
    from rollmesh.rollout.role import Rollouter
    from rollmesh.wire.transport import RpcClient, Transport
    from rollmesh.wire.channels import Channel
    from tests.helpers.rollout_stack import experiment, write_dataset

    rows = [{"prompt": "Tell me a story.", "label": "x", "agent_loop": "openai_agent",
             "openai_agent": f"{HERE}:{agent}"}]
    exp = experiment(write_dataset(tmp_path / "rows.jsonl", rows), "rollout.max_new_tokens=64",
                     "rollout.batch_groups=1", "staleness.max_staleness=0")
    t = Transport()
    channel = Channel(t, "tcp://127.0.0.1:*", name="rollouter")
    r = Rollouter(SimpleNamespace(log=get_logger("rollouter"), spec=SPEC), exp,
                  PromptSource.from_config(exp.data), load_tokenizer(exp.model), channel,
                  RpcClient(t, "tcp://127.0.0.1:9", name="unused"), None)
    r.loops.update(LOOPS)
    return t, r, exp


async def _stack(engine_url: str, tmp_path: Path, agent: str):
    """An in-process rollouter and agent worker over a real ZeroMQ channel."""
    from rollmesh.agents.role import AgentWorker
    from rollmesh.wire.channels import ChannelClient

    t, r, exp = _rollouter(tmp_path, agent)
    client = await EngineClient([engine_url]).__aenter__()
    worker = AgentWorker(SimpleNamespace(log=get_logger("agent"), spec=SPEC), exp, client,
                         ChannelClient(t, r.channel.address, identity=b"agent-0"))
    worker.loops.update(LOOPS)
    return t, r, worker, client


def accounted(r) -> bool:
    """The accounting identity: admitted = queued + dropped + in flight."""
    c = r.counters
    return c["admitted_samples"] == c["queued_samples"] + sum(r.dropped.values()) + r.in_flight()


def test_a_sync_during_a_call_is_invisible_to_the_agent(engine, tmp_path):
    """Rollouter Pause (abort mode) while both agents of a group are mid-call: the synchronizer
    aborts their generations, the worker keeps the trajectories (Held) and the rollouter
    answers Paused without them, counting them as out; after the Resume each call goes on from
    its partial tokens under the new version and returns ONE completion with the whole
    answer."""

    async def body():
        t, r, worker, client = await _stack(engine.url, tmp_path, "long_agent")
        # the rollouter's version (0), then its next one at the Resume: a token of a version
        # past that is refused as invalid (core.validate)
        version = int((await post(engine.url, "/update_weight_version",
                                  {"new_version": "0", "abort_all_requests": False}))
                      ["new_version"])
        tasks = [asyncio.create_task(c) for c in (r.receive(), r.schedule(), worker.serve(4))]
        frozen = False
        try:
            for _ in range(600):  # both requests under way: freeze the engine there
                if sum(n >= 4 for n in engine.running_outputs()) == 2:
                    await post(engine.url, "/pause_generation", {"mode": "in_place"})
                    frozen = True
                    break
                await asyncio.sleep(0.01)
            assert frozen, "the two calls never reached the engine"
            async with EngineClient([engine.url]) as admin:  # the synchronizer's aborts
                paused = await asyncio.wait_for(admin.abort_while(r.pause("abort")), 60)
            seen = {"paused": paused, "stats": r.stats(), "worker": worker.stats(),
                    "accounted": accounted(r)}
            await post(engine.url, "/update_weight_version",
                       {"new_version": str(version + 1), "abort_all_requests": False})
            await post(engine.url, "/continue_generation", {})
            frozen = False
            r.resume(1)
            r.changed.set()
            first = r.exp.data.group_size
            for _ in range(3000):
                done = [x for x in r.to_score if x.group_id == r.to_score[0].group_id]
                if len(done) == first:
                    break
                await asyncio.sleep(0.01)
            seen["accounted_after"] = accounted(r)
            return seen, done, version, r
        finally:
            if frozen:
                await post(engine.url, "/continue_generation", {})
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await worker.cancel("test over", final=True)
            await worker.loop_ctx.close()
            await client.close()
            t.close()

    seen, done, version, r = asyncio.run(body())
    assert seen["paused"].in_flight == 2 and seen["paused"].cancel_queue == 0
    assert seen["stats"]["held"] == 2 and seen["stats"]["held_through_sync"] == 2
    assert seen["stats"]["in_flight"] == 2 and seen["accounted"] and seen["accounted_after"]
    assert seen["worker"]["held"] == 2 and seen["worker"]["interrupted"] == 0
    assert r.counters["interrupted"] == 0 and r.counters["unexpected_returns"] == 0
    assert len(done) == 2
    for traj in done:
        assert traj.status == "finished" and traj.num_turns == 1
        assert traj.loop_state["resumed_calls"] == 1
        generated = traj.versions[traj.loss_mask == 1].tolist()
        cut = generated.index(version + 1)
        assert 4 <= cut < 48 and generated == [version] * cut + [version + 1] * (48 - cut)
        # held through the sync, the cut is recorded as for a trajectory returned interrupted
        assert traj.interrupted_at == [traj.prompt_len + cut]
        from rollmesh.training.batching import trajectory_counts

        assert trajectory_counts([traj])["samples_resumed_mid_turn"] == 1
        result = traj.metadata["agent_result"]  # one completion, the whole answer
        assert result["completion_tokens"] == 48 and result["finish_reason"] == "length"
        from rollmesh.models.loading import tiny_tokenizer

        tok = tiny_tokenizer()
        assert result["content"] == tok.decode(traj.token_ids[traj.prompt_len:].tolist(),
                                               skip_special_tokens=True)
        assert traj.prompt_len == len(traj.token_ids) - 48


def test_held_trajectories_are_counted_once_whatever_happens_to_them(tmp_path):
    """The rollouter's side of Held: a pause does not wait for held trajectories, they stay
    in flight; one that comes back, or whose worker dies, leaves the held count; the accounting
    identity holds at every step; the row's chat messages reach openai_agent trajectories."""
    from rollmesh.wire.messages import WorkerHello
    from rollmesh.rollout.workers import Worker
    from rollmesh.wire.channels import ChannelClient

    async def body():
        t, r, _ = _rollouter(tmp_path, "long_agent")
        try:
            peer = ChannelClient(t, r.channel.address, identity=b"worker-a")
            await peer.send(WorkerHello(worker="agent-a", kind="agent", credits=4))
            who, _ = await asyncio.wait_for(r.channel.recv(), 10)  # connected: routable
            w = Worker(who, "agent-a", "agent", 4)
            r.workers.add(w)
            await r.dispatch()
            out = sorted(w.out)
            assert len(out) == 2 and accounted(r)
            messages = w.out[out[0]].metadata["messages"]
            pausing = asyncio.create_task(r.pause("abort"))
            await asyncio.sleep(0.05)
            assert not pausing.done()  # nothing held yet: the pause waits
            r.held(w, [*out, "not-out-with-it"])
            paused = await asyncio.wait_for(pausing, 5)
            assert paused.in_flight == 2 and r.stats()["held"] == 2 and accounted(r)
            traj = w.out[out[0]]
            traj.status = "finished"
            r.returned(w, traj)  # a held agent that finished during the sync
            assert r.stats()["held"] == 1 and list(r.to_score) == [traj] and accounted(r)
            await r.worker_lost(w, "silent")  # the worker died holding the other
            assert r.stats()["held"] == 0 and len(r.cancel_queue) == 1 and accounted(r)
            assert r.in_flight() == 2 and r.counters["held_through_sync"] == 2
            r.resume(1)
            r.held(w, out)  # a Held that crossed the Resume changes nothing
            assert r.counters["late_holds"] == 1 and r.stats()["held"] == 0
            return messages
        finally:
            t.close()

    messages = asyncio.run(body())
    assert messages == [{"role": "user", "content": "Tell me a story."}]
