"""The pieces agent loops are made of: token bookkeeping, tool-call parsing, tools."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from rollmesh.agents.loops import (
    load_agent_loops, parse_tool_agent_calls, parse_version, run_tool,
)
from rollmesh.agents.tools import calculator
from rollmesh.core.trajectory import append_observation, append_tokens, new_trajectory


def test_token_rows_carry_mask_version_and_logprob():
    t = new_trajectory("s-1", "g-1", 0, [5, 6, 7], agent_loop="single_turn")
    append_tokens(t, [8, 9], [-0.5, -0.25], 3)
    append_observation(t, [10])
    append_tokens(t, [11], [-1.0], 4)
    assert t.token_ids.tolist() == [5, 6, 7, 8, 9, 10, 11] and t.prompt_len == 3
    assert t.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 1]
    assert t.versions.tolist() == [-1, -1, -1, 3, 3, -1, 4]
    np.testing.assert_allclose(t.logprobs, [0, 0, 0, -0.5, -0.25, 0, -1.0])


def test_weight_versions_must_be_integers():
    assert parse_version("7") == 7
    with pytest.raises(ValueError, match="start engines with --weight-version 0"):
        parse_version("default")


def test_tool_calls_are_parsed_in_order_and_malformed_ones_reported():
    text = ('think <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}'
            '</tool_call> and <tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}'
            '</tool_call> <tool_call>{not json}</tool_call> <tool_call>{"arguments": {}}</tool_call>')
    calls = parse_tool_agent_calls(text)
    assert calls[0] == {"name": "calculator", "arguments": {"expression": "2+3"}}
    assert calls[1] == {"name": "search", "arguments": {"q": "x"}}
    assert calls[2]["error"].startswith("malformed tool call:")
    assert calls[3]["error"] == 'malformed tool call: expected {"name": str, "arguments": {...}}'
    assert parse_tool_agent_calls("no calls here") == []


def test_every_tool_failure_is_a_message_for_the_model():
    async def slow(x: int) -> str:
        await asyncio.sleep(10)
        return "late"

    def broken() -> str:
        raise KeyError("nope")

    tools = {"calculator": calculator, "slow": slow, "broken": broken, "data": lambda: {"a": 1}}

    async def main():
        return await asyncio.gather(
            run_tool(tools, {"name": "calculator", "arguments": {"expression": "(3+4)*2"}}, 1),
            run_tool(tools, {"name": "slow", "arguments": {"x": 1}}, 0.2),
            run_tool(tools, {"name": "broken", "arguments": {}}, 1),
            run_tool(tools, {"name": "nosuch", "arguments": {}}, 1),
            run_tool(tools, {"error": "malformed tool call: x"}, 1),
            run_tool(tools, {"name": "calculator", "arguments": {"expr": "1"}}, 1),
            run_tool(tools, {"name": "data", "arguments": {}}, 1))

    start = time.monotonic()
    out = asyncio.run(main())
    assert time.monotonic() - start < 2  # the calls ran concurrently, the slow one timed out
    assert out[0] == "14"
    assert out[1] == "tool slow timed out after 0.2s"
    assert out[2] == "tool broken failed: KeyError: 'nope'"
    assert out[3] == "unknown tool 'nosuch' (available: broken, calculator, data, slow)"
    assert out[4] == "malformed tool call: x"
    assert out[5].startswith("tool calculator failed: TypeError")
    assert out[6] == '{"a": 1}'


def test_calculator_evaluates_arithmetic_and_nothing_else():
    assert calculator("12 / 4 + 2 ** 3") == "11"
    assert calculator("-7 // 2") == "-4"
    for bad in ("__import__('os').system('true')", "x + 1", "2 ** 1000", "[1, 2]"):
        with pytest.raises(ValueError):
            calculator(bad)


def test_builtin_loops_are_registered_as_entry_points():
    loops = load_agent_loops()
    assert {"single_turn", "tool_agent", "openai_agent"} <= set(loops)  # needs pip install -e .


# -- tool responses through the chat template ----------------------------------------------


def _generated_turn(tok, messages, tools, reply: str) -> list[int]:
    """A prompt as the rollouter renders it, then the model's turn ending in eos."""
    prompt = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                     add_generation_prompt=True)
    return tok.encode(prompt + reply + tok.eos_token, add_special_tokens=False)


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3", "llama3.1"])
def test_tool_responses_continue_the_conversation_as_the_template_renders_it(family):
    """prompt + generated turn + observation == the template's rendering of the whole
    conversation with the tool results, token for token."""
    from rollmesh.agents.loops import next_turn_ids, tool_observation
    from tests.helpers.hf_checkpoints import build_tokenizer

    tok = build_tokenizer(family)
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    user = [{"role": "user", "content": "What is 12 plus 30?"}]
    reply = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+30"}}\n'
             '</tool_call>')
    results = ["42", "unknown tool 'x'"]
    ids = _generated_turn(tok, user, tools, reply)
    obs = tool_observation(tok, results, turn_ended=True)
    whole = tok.apply_chat_template(
        [*user, {"role": "assistant", "content": reply},
         *({"role": "tool", "content": r} for r in results)],
        tools=tools, tokenize=False, add_generation_prompt=True)
    assert tok.decode(ids + obs) == whole
    assert ids + obs == tok.encode(whole, add_special_tokens=False)
    if family == "qwen2.5":
        assert tok.decode(obs) == ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n"
                                   "<tool_response>\nunknown tool 'x'\n</tool_response><|im_end|>"
                                   "\n<|im_start|>assistant\n")
    # any next turn, a user's reply too (what the example self_check loop appends)
    check = [{"role": "user", "content": "Check your answer."}]
    again = tok.apply_chat_template([*user, {"role": "assistant", "content": reply}, *check],
                                    tools=tools, tokenize=False, add_generation_prompt=True)
    assert ids + next_turn_ids(tok, check, turn_ended=True) == tok.encode(
        again, add_special_tokens=False)
    # a turn cut by a stop string, not ended by eos: the observation closes it
    cut = tool_observation(tok, results, turn_ended=False)
    assert cut == tok.encode(tok.eos_token, add_special_tokens=False) + obs


def test_a_template_that_cannot_render_tool_turns_is_a_clear_error():
    from rollmesh.agents.loops import ChatTemplateError, tool_observation
    from tests.helpers.hf_checkpoints import build_tokenizer

    gemma = build_tokenizer("gemma2")  # roles must alternate user/assistant: no tool role
    with pytest.raises(ChatTemplateError, match="cannot render tool messages after an assistant turn: .*alternate"):
        tool_observation(gemma, ["42"], turn_ended=True)
    bare = build_tokenizer("qwen2.5")
    bare.chat_template = None
    with pytest.raises(ChatTemplateError, match="needs a chat template"):
        tool_observation(bare, ["42"], turn_ended=True)


def test_load_tokenizer_honours_tokenizer_path_and_trust_remote_code(tmp_path, monkeypatch):
    """`model.tokenizer_path` replaces the model's tokenizer; `model.trust_remote_code` reaches
    transformers."""
    import transformers

    from rollmesh.core.trajectory import load_tokenizer
    from rollmesh.config import ModelConfig
    from tests.helpers.hf_checkpoints import build_tokenizer

    build_tokenizer("llama3.1").save_pretrained(tmp_path / "tok")
    assert load_tokenizer(ModelConfig(path="tiny")).eos_token == "<|im_end|>"
    tok = load_tokenizer(ModelConfig(path="tiny", tokenizer_path=str(tmp_path / "tok")))
    assert tok.eos_token == "<|eot_id|>"
    seen = {}
    real = transformers.AutoTokenizer.from_pretrained

    def spy(*a, **kw):
        seen.update(kw)
        return real(*a, **kw)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    load_tokenizer(ModelConfig(path="tiny", tokenizer_path=str(tmp_path / "tok"),
                               trust_remote_code=True))
    assert seen["trust_remote_code"] is True and seen["local_files_only"] is True


USER = [{"role": "user", "content": "What is 12 plus 30?"}]
SCHEMA = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
CALL = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+30"}}\n'
        '</tool_call>')


def run_tool_agent(tok, replies: list[str], tools: dict | None = None):
    """tool_agent on USER (rendered with a calculator tool) against an engine that answers
    `replies` in turn, each ended by eos: the trajectory, and the prompt ids of each request."""
    from rollmesh.agents.loops import LoopContext, ToolAgent
    from rollmesh.config import RolloutConfig
    from rollmesh.rollout.data import PromptRow, render_prompt
    from rollmesh.engine.client import GenerateOutput

    prompts = []

    class Client:
        def new_rid(self) -> str:
            return f"r{len(prompts)}"

        async def generate(self, ids, params, rid, **kw):  # wait_s, cancel
            prompts.append(list(ids))
            out = tok.encode(replies[len(prompts) - 1], add_special_tokens=False)
            out.append(tok.eos_token_id)
            return GenerateOutput(rid, "e", out, [-0.5] * len(out), "stop", "3", len(ids))

    ctx = LoopContext(Client(), tok, RolloutConfig(max_new_tokens=64, max_turns=4),
                      max_context=4096, cancelling=asyncio.Event(), tools=tools)
    prompt = render_prompt(PromptRow(0, USER, tools=SCHEMA), tok)
    traj = new_trajectory("s", "g", 0, prompt, agent_loop="tool_agent")
    asyncio.run(ToolAgent(ctx).run(traj))
    return traj, prompts


def test_tool_agent_appends_the_templates_tool_turn_between_generated_turns():
    """A whole tool_agent run with the Qwen2.5 template: prompt, a generated tool call, the
    calculator's answer as the template renders a tool turn (mask 0), the final answer; the
    token row is exactly the template's rendering of that conversation."""
    from tests.helpers.hf_checkpoints import build_tokenizer

    tok = build_tokenizer("qwen2.5")
    replies = [CALL, "The answer is 42."]
    traj, prompts = run_tool_agent(tok, replies)
    prompt = prompts[0]  # the row as the rollouter renders it
    assert traj.num_turns == 2 and traj.loop_state["tool_calls"] == 1
    whole = tok.apply_chat_template(
        [*USER, {"role": "assistant", "content": CALL}, {"role": "tool", "content": "42"},
         {"role": "assistant", "content": replies[1]}], tools=SCHEMA, tokenize=False)
    # the template ends the last turn with "<|im_end|>\n"; generation stops at <|im_end|>
    assert tok.decode(traj.token_ids.tolist()) + "\n" == whole
    observation = tok.decode(prompts[1][len(prompt):])
    assert observation.endswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n"
                                "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    mask = traj.loss_mask[len(prompt):].tolist()
    first = len(tok.encode(CALL, add_special_tokens=False)) + 1
    n_obs = len(prompts[1]) - len(prompt) - first
    assert mask == [1] * first + [0] * n_obs + [1] * (len(mask) - first - n_obs)


def test_tool_agent_records_each_executed_call_for_the_reward():
    """loop_state["calls"]: every call in order with its arguments and its result (cut to
    2,000 characters), a malformed one without name or arguments; the count stays too."""
    import msgpack

    from rollmesh.agents.loops import recorded_call
    from tests.helpers.hf_checkpoints import build_tokenizer

    tok = build_tokenizer("qwen2.5")
    tools = {"calculator": calculator, "echo": lambda text: text * 1100}
    replies = [CALL + '<tool_call>{"name": "calculator"</tool_call>',
               '<tool_call>{"name": "echo", "arguments": {"text": "ab"}}</tool_call>'
               '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>',
               "The answer is 42."]
    traj, _ = run_tool_agent(tok, replies, tools)
    calls = traj.loop_state["calls"]
    assert traj.num_turns == 3 and traj.loop_state["tool_calls"] == 4
    assert calls[0] == {"name": "calculator", "arguments": {"expression": "12+30"},
                        "result": "42"}
    assert calls[1]["name"] is None and calls[1]["arguments"] == {}
    assert calls[1]["result"].startswith("malformed tool call: ")
    assert calls[2] == {"name": "echo", "arguments": {"text": "ab"}, "result": "ab" * 1000}
    assert calls[3] == {"name": "search", "arguments": {"q": "x"},
                        "result": "unknown tool 'search' (available: calculator, echo)"}
    assert msgpack.unpackb(msgpack.packb(traj.loop_state)) == traj.loop_state  # crosses the wire
    huge = recorded_call({"name": "calculator", "arguments": {"n": 10 ** 30}}, "x")
    assert huge["arguments"] == {"json": '{"n": 1000000000000000000000000000000}'}


@pytest.mark.parametrize("replies,reward,used_tool", [
    ([CALL, "The answer is 42."], 1.0, True),
    (['<tool_call>{"name": "calculator"</tool_call>', "The answer is 42."], 0.0, False),
    (["The answer is 42."], 0.0, False),  # right, but without the tool
])
def test_tool_answer_scores_a_tool_agent_trajectory_by_its_view(replies, reward, used_tool):
    """tool_agent's token row and recorded calls, through the view, to the built-in reward."""
    from rollmesh.rewards import tool_answer_reward
    from rollmesh.rewards.trajectory import trajectory_view
    from tests.helpers.hf_checkpoints import build_tokenizer

    tok = build_tokenizer("qwen2.5")
    traj, _ = run_tool_agent(tok, replies)
    view = trajectory_view(traj, tok)
    assert [t["role"] for t in view["turns"]] == ["assistant", "observation"] * (
        len(replies) - 1) + ["assistant"]
    assert view["turns"][-1]["text"] == "The answer is 42."
    out = tool_answer_reward("", 42, {}, view)
    assert out == {"reward": reward, "answer": "42", "tool_calls": len(replies) - 1,
                   "used_tool": used_tool}


# -- hostile model output (issue 35) ----------------------------------------------------------


@pytest.mark.timeout(30)
def test_the_calculator_refuses_a_result_too_large_before_computing_it():
    """`(((9**99)**99)**99)**99` held the interpreter lock in a big-integer power: the tool's
    time limit never fired and the agent worker froze. Refused now, before the power."""
    for bad in ("(((9**99)**99)**99)**99", "(9**99)**99", "(10**90) * (10**90) * (10**90) ** 99"):
        with pytest.raises(ValueError, match="too large"):
            calculator(bad)
    assert calculator("(2**64) * (2**64)") == str(2**128)
    assert calculator("9**99") == str(9**99)


@pytest.mark.timeout(30)
def test_unclosed_tool_call_markers_and_deep_json_are_parsed_in_one_pass_without_a_crash():
    """8,000 unclosed `<tool_call>` blocked the event loop for 7 s (a lazy regex rescanning
    the rest from each); 80,000 now take one pass. JSON nested past the parser's stack is a
    malformed call the model is told of, not an uncaught RecursionError."""
    from rollmesh.engine.openai_common import parse_sglang_tool_calls

    assert parse_tool_agent_calls("<tool_call>" * 80_000) == []
    tools = [{"type": "function", "function": {"name": "calculator"}}]
    assert parse_sglang_tool_calls("<tool_call>\n" * 80_000, tools, "qwen25").calls == []
    deep = "[" * 100_000 + "]" * 100_000
    calls = parse_tool_agent_calls(f"<tool_call>{deep}</tool_call>"
                                   '<tool_call> {"name": "calculator", "arguments": {}} </tool_call>')
    assert calls[0]["error"] == "malformed tool call: JSON nested too deeply"
    assert calls[1] == {"name": "calculator", "arguments": {}}
    assert parse_sglang_tool_calls(f"<tool_call>\n{deep}\n</tool_call>", tools, "qwen25").calls == []
