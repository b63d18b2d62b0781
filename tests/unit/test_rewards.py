"""rollmesh.rewards: the built-in functions (gsm8k, exact_match, tool_answer, remote against a
local aiohttp server), lookup by entry point and by "module:function", output checking, the trajectory view,
and RewardSandbox with functions that raise, hang, exit, crash, hog memory or return non-numbers
(tests/reward_fixtures.py)."""

from __future__ import annotations

import asyncio
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

from rollmesh.rewards import (
    RewardOutputError,
    RewardResult,
    RewardSandbox,
    UnknownRewardError,
    available_rewards,
    check_reward_output,
    exact_match_reward,
    get_reward_fn,
    gsm8k_reward,
    remote_reward,
    tool_answer_reward,
    wants_trajectory,
)
from rollmesh.config import RolloutConfig
from rollmesh.rewards.trajectory import trajectory_view
from rollmesh.core.trajectory import append_observation, append_tokens, new_trajectory
from tests import reward_fixtures

REPO = Path(__file__).resolve().parents[2]
FIX = "tests.reward_fixtures:"

# -- gsm8k ---------------------------------------------------------------------------------------

GSM8K_CASES = [
    (r"Half of 48 is 24, so 48 + 24 = 72. \boxed{72}", "72", 1.0),
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72", 1.0),
    ("#### 72\nI hope this helps, in 3 ways.", "72", 1.0),  # the #### answer, not the last number
    ("The answer is 72.", "72", 1.0),
    ("72.0", "72", 1.0),
    ("She earned $72 in total.", "72", 1.0),
    ("The total is 1,000 apples.", "1000", 1.0),
    ("1000", "1,000", 1.0),
    ("The temperature fell to -5 degrees.", "-5", 1.0),
    ("The answer is 71.", "72", 0.0),
    ("It could be 72, but after checking, the answer is 73.", "72", 0.0),
    ("72,000", "72", 0.0),
    (r"\boxed{5}", "-5", 0.0),
    ("I do not know.", "72", 0.0),
    ("", "72", 0.0),
]


@pytest.mark.parametrize("response,label,reward", GSM8K_CASES)
def test_gsm8k(response, label, reward):
    out = gsm8k_reward(response, label, {})
    assert out["reward"] == reward
    assert check_reward_output(out, "gsm8k")[0] == reward


def test_gsm8k_reports_the_extracted_answer_and_rejects_bad_labels():
    assert gsm8k_reward("so the answer is 71", "72", {})["extracted"] == "71"
    assert gsm8k_reward("no number", "72", {})["extracted"] is None
    with pytest.raises(ValueError, match="gsm8k needs a label"):
        gsm8k_reward("72", None, {})
    with pytest.raises(ValueError, match="the label 'many' is not a number"):
        gsm8k_reward("72", "many", {})


# -- exact_match ---------------------------------------------------------------------------------


@pytest.mark.parametrize("response,label,reward", [
    ("Paris", "Paris", 1.0),
    ("  paris.\n", "Paris", 1.0),
    ("New   York", "new york", 1.0),
    ("Ｐａｒｉｓ", "Paris", 1.0),  # full-width letters, NFKC
    ("42", 42, 1.0),
    ("Lyon", ["Paris", "Lyon"], 1.0),
    ("Paris, France", "Paris", 0.0),
    ("", "Paris", 0.0),
])
def test_exact_match(response, label, reward):
    assert exact_match_reward(response, label, {}) == reward


def test_exact_match_needs_a_label():
    with pytest.raises(ValueError, match="exact_match needs a label"):
        exact_match_reward("x", None, {})


# -- tool_answer ---------------------------------------------------------------------------------


def agent_view(last: str, results: list[str], earlier: str = "Let me use the calculator.") -> dict:
    """A trajectory view: an assistant turn, the tool results, the last assistant turn."""
    turns = [{"role": "assistant", "text": earlier, "tokens": 8},
             {"role": "observation", "text": "\n".join(results), "tokens": 4},
             {"role": "assistant", "text": last, "tokens": 6}]
    calls = [{"name": "calculator", "arguments": {"expression": "1+1"}, "result": r}
             for r in results]
    return {"prompt": "q", "turns": turns, "tool_calls": calls, "num_turns": 2,
            "finish_reason": "stop", "agent_loop": "tool_agent"}


@pytest.mark.parametrize("last,results,label,reward,answer", [
    ("The answer is 1363.", ["1363"], 1363, 1.0, "1363"),
    ("So there are 1,363 apples.", ["1363"], 1363, 1.0, "1,363"),
    ("1363.0", ["1363"], 1363, 1.0, "1363.0"),
    ("The answer is 1363.", ["1363"], "1,363", 1.0, "1363"),
    ("The answer is 1363", ["1363"], 1363.0, 1.0, "1363"),
    ("It fell to -12 degrees.", ["-12"], -12, 1.0, "-12"),
    ("It fell 12 degrees.", ["-12"], -12, 0.0, "12"),
    ("About 3.5 hours.", ["3.5"], "3.5", 1.0, "3.5"),
    ("First 1362, then 1363.", ["1363"], 1363, 1.0, "1363"),  # the last number counts
    ("1363, or maybe 1362.", ["1363"], 1363, 0.0, "1362"),
    ("I am not sure.", ["1363"], 1363, 0.0, None),
])
def test_tool_answer_compares_the_last_number_of_the_last_turn(last, results, label, reward,
                                                                answer):
    out = tool_answer_reward(last, label, {}, agent_view(last, results))
    assert out == {"reward": reward, "answer": answer, "tool_calls": len(results),
                   "used_tool": True}


@pytest.mark.parametrize("results", [
    [],  # a correct answer without any tool call
    ["malformed tool call: Expecting value: line 1 column 2 (char 1)"],
    ["unknown tool 'search' (available: calculator)"],
    ["tool calculator failed: ValueError: unsupported expression", "error: CPU time limit "
     "(10 s) exceeded", "tool python timed out after 10s", "Traceback (most recent call last):"],
])
def test_tool_answer_needs_a_tool_used_successfully(results):
    out = tool_answer_reward("1363", 1363, {}, agent_view("The answer is 1363.", results))
    assert out == {"reward": 0.0, "answer": "1363", "tool_calls": len(results),
                   "used_tool": False}
    ok = tool_answer_reward("", 1363, {}, agent_view("1363", [*results, "1363"]))
    assert (ok["reward"], ok["used_tool"]) == (1.0, True)  # one successful call is enough


def test_tool_answer_reads_only_the_last_assistant_turn_and_needs_a_numeric_label():
    view = agent_view("Done.", ["1363"], earlier="The answer is 1363.")
    assert tool_answer_reward("", 1363, {}, view)["answer"] is None
    no_turns = {**view, "turns": []}
    assert tool_answer_reward("", 1363, {}, no_turns)["reward"] == 0.0
    with pytest.raises(ValueError, match="tool_answer needs a label"):
        tool_answer_reward("", None, {}, view)
    with pytest.raises(ValueError, match="the label 'many' is not a number"):
        tool_answer_reward("", "many", {}, view)


def test_the_readme_trajectory_reward_runs():
    """The README's example of a reward that reads the trajectory, as written there."""
    readme = (REPO / "README.md").read_text()
    code = readme.split("# my_rewards.py", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {}
    exec(compile(code, "README.md (my_rewards.py)", "exec"), namespace)
    fn = namespace["used_calculator"]
    assert wants_trajectory(fn)
    assert fn("", 42, {}, trajectory=agent_view("It is 42.", ["42"])) == {"reward": 1.0,
                                                                          "used": True}
    assert fn("", 42, {}, trajectory=agent_view("It is 42.", [])) == {"reward": 0.0,
                                                                      "used": False}


# -- remote --------------------------------------------------------------------------------------


class RewardModel:
    """A tiny aiohttp reward model on 127.0.0.1: reward = len(response) / 10."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    async def __aenter__(self) -> RewardModel:
        from aiohttp import web

        async def score(request):
            body = await request.json()
            self.seen.append(body)
            if body["response"] == "fail":
                return web.Response(status=500, text="model exploded")
            if body["response"] == "slow":
                await asyncio.sleep(0.8)
            return web.json_response({"reward": len(body["response"]) / 10, "model": "tiny"})

        app = web.Application()
        app.router.add_post("/score", score)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/score"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


def test_remote_reward(monkeypatch):
    async def main():
        async with RewardModel() as rm:
            meta = {"reward_url": rm.url, "task": 7}
            out = await asyncio.to_thread(remote_reward, "abcd", {"x": 1}, meta)
            assert out == {"reward": 0.4, "model": "tiny"}
            assert rm.seen == [{"response": "abcd", "label": {"x": 1}, "metadata": meta}]

            with pytest.raises(RuntimeError, match="answered HTTP 500: model exploded"):
                await asyncio.to_thread(remote_reward, "fail", None, {"reward_url": rm.url})
            slow = {"reward_url": rm.url, "reward_timeout_s": 0.3}
            with pytest.raises(ConnectionError, match="unreachable: timed out"):
                await asyncio.to_thread(remote_reward, "slow", None, slow)

            # The configured URL ($ROLLMESH_REWARD_URL), through the sandbox.
            monkeypatch.setenv("ROLLMESH_REWARD_URL", rm.url)
            async with RewardSandbox(1) as sb:
                res = await sb.score("remote", "abcdefgh", "l", {}, timeout_s=10)
            assert (res.status, res.reward, res.info) == ("ok", 0.8, {"model": "tiny"})

    monkeypatch.delenv("ROLLMESH_REWARD_URL", raising=False)
    with pytest.raises(ValueError, match=r"no URL \(set metadata\['reward_url'\] or \$ROLLMESH_"):
        remote_reward("x", None, {})
    asyncio.run(main())


# -- registry and output checks ------------------------------------------------------------------


def test_lookup_by_entry_point_and_module_path():
    assert {"gsm8k", "exact_match", "remote", "tool_answer"} <= set(available_rewards())
    assert get_reward_fn("gsm8k") is gsm8k_reward
    assert get_reward_fn("exact_match") is exact_match_reward
    assert get_reward_fn("remote") is remote_reward
    assert get_reward_fn("tool_answer") is tool_answer_reward
    assert get_reward_fn(FIX + "constant") is reward_fixtures.constant


def test_unknown_names():
    with pytest.raises(UnknownRewardError) as err:
        get_reward_fn("gsm9k")
    names = ", ".join(available_rewards())
    assert str(err.value) == (
        f"unknown reward function 'gsm9k'; available: {names} (entry points in group "
        "'rollmesh.rewards'), or give 'module:function'"
    )
    with pytest.raises(UnknownRewardError, match=r"cannot load reward function 'no_such_mod:f': "
                                                 "ModuleNotFoundError"):
        get_reward_fn("no_such_mod:f")
    with pytest.raises(UnknownRewardError, match="has no attribute 'nope'"):
        get_reward_fn(FIX + "nope")
    with pytest.raises(UnknownRewardError, match="is a int, not callable"):
        get_reward_fn(FIX + "not_callable")


def test_check_reward_output():
    import numpy as np

    assert check_reward_output(1, "f") == (1.0, {})
    assert check_reward_output(np.float32(0.5), "f") == (0.5, {})
    assert check_reward_output({"reward": 0.5, "n": [1, "a"]}, "f") == (0.5, {"n": [1, "a"]})
    for bad, msg in [
        ("1.0", "reward function 'f' returned str '1.0', expected a number or a dict"),
        (None, "returned NoneType None"),
        ({"score": 1}, "returned a dict without 'reward' (keys: score)"),
        ({"reward": "1"}, "returned str '1'"),
        (float("nan"), "returned a non-finite reward nan"),
        ({"reward": 1.0, "obj": object()}, "returned info that is not plain data"),
        ({"reward": 1.0, "m": {1: 2}}, "returned info that is not plain data"),
    ]:
        with pytest.raises(RewardOutputError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            check_reward_output(bad, "f")


# -- the trajectory view -------------------------------------------------------------------------


def test_trajectory_view_splits_the_response_into_turns_at_loss_mask_boundaries():
    from tests.helpers.hf_checkpoints import build_tokenizer

    tok = build_tokenizer("qwen2.5")

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    prompt = enc(tok.apply_chat_template([{"role": "user", "content": "What is 6 times 7?"}],
                                         tokenize=False, add_generation_prompt=True))
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
    obs = enc("\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
              "<|im_start|>assistant\n")
    first, resumed = enc("The answer"), enc(" is 42.") + [tok.eos_token_id]
    t = new_trajectory("s", "g", 0, prompt, agent_loop="tool_agent")
    append_tokens(t, enc(call) + [tok.eos_token_id], [-0.1] * (len(enc(call)) + 1), 3)
    append_observation(t, obs)
    append_tokens(t, first, [-0.1] * len(first), 3)  # interrupted by a weight sync ...
    append_tokens(t, resumed, [-0.1] * len(resumed), 4)  # ... and resumed: still one turn
    calls = [{"name": "calculator", "arguments": {"expression": "6*7"}, "result": "42"}]
    t.loop_state = {"turn": 2, "tool_calls": 1, "calls": calls}
    t.num_turns, t.finish_reason = 2, "stop"

    view = trajectory_view(t, tok)
    assert view == {
        "prompt": "system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                  "\nuser\nWhat is 6 times 7?\nassistant\n",
        "turns": [
            {"role": "assistant", "text": call, "tokens": len(enc(call)) + 1},
            {"role": "observation", "text": "\nuser\n<tool_response>\n42\n</tool_response>\n"
                                            "assistant\n", "tokens": len(obs)},
            {"role": "assistant", "text": "The answer is 42.",
             "tokens": len(first) + len(resumed)},
        ],
        "tool_calls": calls, "num_turns": 2, "finish_reason": "stop", "agent_loop": "tool_agent"}
    assert msgpack.unpackb(msgpack.packb(view)) == view  # plain data: it crosses the pipe

    bare = trajectory_view(new_trajectory("s", "g", 0, prompt, agent_loop="single_turn"), tok)
    assert (bare["turns"], bare["tool_calls"], bare["num_turns"]) == ([], [], 0)


# -- sandbox -------------------------------------------------------------------------------------


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def pid_of(sb: RewardSandbox) -> int:
    """The host pid of the process serving `sb` (a one-child sandbox): a contained child is the
    first process of its PID namespace (the function sees pid 1)."""
    res = await sb.score(FIX + "pid", "", None, {}, timeout_s=10)
    assert res.status == "ok", res
    (child,) = sb._children
    return child.proc.pid


def test_sandbox_scores_and_survives_every_failure():
    async def main():
        async with RewardSandbox(1, stderr=subprocess.DEVNULL) as sb:
            ok = await sb.score("gsm8k", r"so \boxed{72}", "72", {}, timeout_s=5)
            assert (ok.status, ok.reward, ok.error, ok.info) == ("ok", 1.0, "", {"extracted": "72"})
            assert ok.elapsed_s < 1.0  # math-verify's import is warm-up, not scoring time
            res = await sb.score(FIX + "with_info", "abc", [1], {}, timeout_s=5)
            assert (res.reward, res.info) == (0.25, {"length": 3, "label_seen": [1]})
            res = await sb.score(FIX + "chatty", "", None, {}, timeout_s=5)  # fd 1 is not the pipe
            assert (res.status, res.reward) == ("ok", 1.0)
            first_pid = await pid_of(sb)

            res = await sb.score(FIX + "raising", "x", None, {}, timeout_s=5)
            assert (res.status, res.reward) == ("error", None)
            assert res.error == "ValueError: bad response 'x'"
            assert "in raising" in res.info["traceback"]
            assert await pid_of(sb) == first_pid  # an exception does not cost the process

            for fn, timeout_s in (("hanging", 0.5), ("busy_loop", 0.5)):
                t0 = time.monotonic()
                res = await sb.score(FIX + fn, "", None, {}, timeout_s=timeout_s)
                assert time.monotonic() - t0 < timeout_s + 1.0
                assert (res.status, res.reward) == ("timeout", None)
                assert res.error == "timed out after 0.5s"
                assert not alive(first_pid)
                first_pid = await pid_of(sb)  # a fresh process serves the next call

            res = await sb.score(FIX + "exiting", "", None, {}, timeout_s=5)
            assert (res.status, res.reward, res.error) == (
                "error", None, "reward process died with exit code 3")
            assert await pid_of(sb) != first_pid
            res = await sb.score(FIX + "segfault", "", None, {}, timeout_s=5)
            assert res.error == "reward process died with exit code -11 (SIGSEGV)"

            for fn, error in [
                ("returns_string", "RewardOutputError: reward function "
                 "'tests.reward_fixtures:returns_string' returned str '1.0', expected a number "
                 "or a dict with a numeric 'reward'"),
                ("returns_nan", "RewardOutputError: reward function "
                 "'tests.reward_fixtures:returns_nan' returned a non-finite reward nan"),
                ("nope", "UnknownRewardError: cannot load reward function "
                 "'tests.reward_fixtures:nope': AttributeError: module "
                 "'tests.reward_fixtures' has no attribute 'nope'"),
            ]:
                res = await sb.score(FIX + fn, "", None, {}, timeout_s=5)
                assert (res.status, res.reward, res.error) == ("error", None, error)
            res = await sb.score("gsm9k", "", None, {}, timeout_s=5)
            assert res.status == "error"
            assert "unknown reward function 'gsm9k'; available:" in res.error
            res = await sb.score("exact_match", "", None, {"bad": object()}, timeout_s=5)
            assert res.status == "error" and res.error.startswith("request is not plain data")
            res = await sb.score("exact_match", "Paris", "paris", {}, timeout_s=5)
            assert (res.status, res.reward) == ("ok", 1.0)

            last_pid = await pid_of(sb)
        assert not alive(last_pid)  # close() killed it
        with pytest.raises(RuntimeError, match="closed"):
            await sb.score("exact_match", "", "", {}, timeout_s=1)

    asyncio.run(main())


def test_sandbox_runs_calls_concurrently():
    async def main():
        async with RewardSandbox(2) as sb:
            await sb.start()
            t0 = time.monotonic()
            calls = [sb.score(FIX + "sleepy", "", None, {"sleep_s": 0.4}, timeout_s=5)
                     for _ in range(4)]
            calls.append(sb.score(FIX + "pid", "", None, {}, timeout_s=5))
            calls.append(sb.score(FIX + "pid", "", None, {}, timeout_s=5))
            results = await asyncio.gather(*calls)
            took = time.monotonic() - t0
        assert [r.status for r in results] == ["ok"] * 6
        assert 0.8 <= took < 1.6  # two children: 4 x 0.4 s in two rounds
        assert len({r.info["pid"] for r in results[4:]}) <= 2

    asyncio.run(main())


def test_sandbox_memory_limit_and_cancellation():
    async def main():
        # the limit the reward worker sets by default (rollout.reward_memory_mb)
        limit = RolloutConfig().reward_memory_mb
        async with RewardSandbox(1, memory_limit_mb=limit) as sb:
            assert (await sb.score("gsm8k", r"\boxed{1}", "1", {}, timeout_s=10)).reward == 1.0
            res = await sb.score(FIX + "greedy", "", None, {}, timeout_s=10)
            assert (res.status, res.reward) == ("error", None)
            assert res.error == f"MemoryError (memory limit {limit} MiB, rollout.reward_memory_mb)"
            res = await sb.score(FIX + "unbounded", "", None, {}, timeout_s=30)
            assert (res.status, res.reward) == ("error", None)
            assert res.error == f"MemoryError (memory limit {limit} MiB, rollout.reward_memory_mb)"
            assert (await sb.score("gsm8k", r"\boxed{2}", "1", {}, timeout_s=10)).reward == 0.0
            pid = await pid_of(sb)
            task = asyncio.create_task(sb.score(FIX + "hanging", "", None, {}, timeout_s=30))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not alive(pid)  # its state was unknown: killed
            assert (await sb.score(FIX + "constant", "", None, {}, timeout_s=5)).reward == 0.5

    asyncio.run(main())


VIEW = {"prompt": "What is 6 times 7?",
        "turns": [{"role": "assistant", "text": "<tool_call>...</tool_call>", "tokens": 9},
                  {"role": "observation", "text": "tool\n42\nassistant\n", "tokens": 7},
                  {"role": "assistant", "text": "It is 42.", "tokens": 5}],
        "tool_calls": [{"name": "calculator", "arguments": {"expression": "6*7"}, "result": "42"}],
        "num_turns": 2, "finish_reason": "stop", "agent_loop": "tool_agent"}


def test_wants_trajectory_reads_the_signature():
    def positional_only(response, label, metadata, trajectory, /):
        return 0.0

    assert wants_trajectory(reward_fixtures.reads_trajectory)
    assert wants_trajectory(reward_fixtures.reads_trajectory_by_keyword)
    assert not wants_trajectory(reward_fixtures.takes_any_keyword)
    assert not wants_trajectory(positional_only)
    assert not wants_trajectory(gsm8k_reward)
    assert not wants_trajectory(max)  # no signature to read


def test_sandbox_builds_and_passes_the_trajectory_only_to_functions_that_take_it():
    built = []

    def view() -> dict:
        built.append(1)
        return VIEW

    async def main():
        async with RewardSandbox(1, stderr=subprocess.DEVNULL) as sb:
            res = await sb.score(FIX + "with_info", "abc", [1], {}, timeout_s=5, trajectory=view)
            assert (res.status, res.reward, res.info) == (
                "ok", 0.25, {"length": 3, "label_seen": [1]})
            res = await sb.score(FIX + "takes_any_keyword", "", None, {}, 5, trajectory=view)
            assert (res.status, res.reward) == ("ok", 0.0)
            assert built == []  # never built for a function that does not take it

            res = await sb.score(FIX + "reads_trajectory", "It is 42.", None, {}, 5,
                                 trajectory=view)
            assert (res.status, res.reward, res.info) == ("ok", 2.0, {
                "roles": ["assistant", "observation", "assistant"], "tools": ["calculator"],
                "response": "It is 42."})
            res = await sb.score(FIX + "reads_trajectory_by_keyword", "", None, {}, 5,
                                 trajectory=view)
            assert (res.status, res.reward) == ("ok", 1.0)
            assert built == [1, 1]

            pid = await pid_of(sb)
            res = await sb.score(FIX + "trajectory_raising", "", None, {}, 5, trajectory=view)
            assert (res.status, res.reward, res.error) == (
                "error", None, "ValueError: no answer in 2 turns")
            assert "in trajectory_raising" in res.info["traceback"]
            res = await sb.score(FIX + "reads_trajectory", "", None, {}, 5)  # none given
            assert (res.status, res.reward, res.error) == (
                "error", None, "ValueError: reward function 'tests.reward_fixtures:"
                "reads_trajectory' takes a trajectory (its `trajectory` parameter), and this "
                "request carries none")
            assert await pid_of(sb) == pid  # failures like any other: the process serves on

    asyncio.run(main())


def test_the_reward_worker_gives_the_trajectory_view_to_functions_that_take_it():
    """RewardWorker.score with a real sandbox: the view of the trajectory it was sent (tiny's
    tokenizer), the built-in tool_answer by its entry point, an old-style function scored as
    before, a raising one recorded as an error."""
    from types import SimpleNamespace

    from rollmesh.core.trajectory import load_tokenizer
    from rollmesh.runtime.log import get_logger
    from rollmesh.rewards.role import RewardWorker

    tok = load_tokenizer("tiny")

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    def trajectory(reward: str, label: Any) -> Any:
        t = new_trajectory("s", "g", 0, enc("What is 6 times 7?"), agent_loop="tool_agent",
                           label=label, metadata={"reward": reward})
        said, seen, answer = enc("Let me compute."), enc(" 42 "), enc("It is 42.")
        append_tokens(t, said, [-0.1] * len(said), 0)
        append_observation(t, seen)
        append_tokens(t, answer, [-0.1] * len(answer), 1)
        t.loop_state["calls"] = [{"name": "calculator", "arguments": {}, "result": "42"}]
        t.num_turns, t.status = 2, "finished"
        return t

    class Channel:
        def __init__(self) -> None:
            self.sent: list[Any] = []

        async def send(self, msg: Any) -> None:
            self.sent.append(msg)

    async def main():
        ctx = SimpleNamespace(spec=SimpleNamespace(role="reward_worker", instance=0),
                              log=get_logger("test"))
        exp = SimpleNamespace(model="tiny", rollout=RolloutConfig(reward="exact_match",
                                                                  reward_timeout_s=10))
        async with RewardSandbox(1, stderr=subprocess.DEVNULL) as sb:
            worker = RewardWorker(ctx, exp, sb, Channel())
            for reward, label in ((FIX + "reads_trajectory", None), ("tool_answer", 42),
                                  ("exact_match", "It is 42."),
                                  (FIX + "trajectory_raising", None)):
                await worker.score(trajectory(reward, label))
            return list(worker.channel.sent), worker.counts  # the Scored records

    (reads, builtin, old, raising), counts = asyncio.run(main())
    assert (reads.reward_status, reads.reward, reads.reward_info) == ("ok", 2.0, {
        "roles": ["assistant", "observation", "assistant"], "tools": ["calculator"],
        "response": "Let me compute. 42 It is 42."})
    assert (builtin.reward_status, builtin.reward, builtin.reward_info) == (
        "ok", 1.0, {"answer": "42", "tool_calls": 1, "used_tool": True})
    assert (old.reward_status, old.reward) == ("ok", 0.0)  # the whole response, not the label
    assert (raising.reward_status, raising.reward, raising.error) == (
        "error", None, "ValueError: no answer in 2 turns")
    assert counts == {"ok": 3, "error": 1, "timeout": 0}


def test_serve_answers_malformed_requests():
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollmesh.rewards", "serve"], cwd=REPO,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )

    def frame(body: bytes) -> None:
        proc.stdin.write(struct.pack(">I", len(body)) + body)
        proc.stdin.flush()

    def reply() -> dict:
        (n,) = struct.unpack(">I", proc.stdout.read(4))
        return msgpack.unpackb(proc.stdout.read(n))

    try:
        assert reply()["op"] == "ready"
        frame(b"\xc1")  # never valid msgpack
        assert reply()["error"].startswith("undecodable request")
        frame(msgpack.packb({"op": "exec", "fn": "os:system"}))
        assert reply() == {
            "ok": False, "error": "malformed request: {'op': 'exec', 'fn': 'os:system'}"
        }
        frame(msgpack.packb({"op": "call", "fn": "exact_match", "response": "a", "label": "A"}))
        assert reply() == {"ok": True, "reward": 1.0, "info": {}}
        proc.stdin.close()  # the parent went away: the child exits
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()


def test_reward_result_is_plain_data():
    r = RewardResult("timeout", error="timed out after 1s", elapsed_s=1.0)
    assert msgpack.unpackb(msgpack.packb(r.to_dict())) == {
        "status": "timeout", "reward": None, "error": "timed out after 1s", "info": {},
        "elapsed_s": 1.0,
    }


def test_a_hostile_reward_function_meets_a_boundary(tmp_path, monkeypatch):
    """Issue 35, item 10: a reward function from a dataset ran as root with the worker's
    environment and network: it read the run's keys, reached a listener, used 1 GiB under a
    512 MiB limit and killed its parent. Contained (the default), it finds none of that: no
    file of the run (its directory hidden even where it lies inside what is visible), no
    network, none of the worker's environment, no process to signal, /dev/shm of its memory
    limit that dies with it, and (as root) a uid of its own."""
    import socket

    run = tmp_path / "run"
    (run / "keys").mkdir(parents=True, mode=0o700)
    secret = run / "keys" / "server.key_secret"
    secret.write_text("the run's secret key")
    secret.chmod(0o600)
    hidden = Path(__file__).resolve().parents[1] / "packages"  # visible (under the cwd, on sys.path) unless hidden
    monkeypatch.setenv("ROLLMESH_TEST_SECRET_TOKEN", "hf_secret")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    meta = {"secret": str(secret), "hidden": str(hidden), "port": listener.getsockname()[1],
            "worker": os.getpid()}

    async def main():
        async with RewardSandbox(1, memory_limit_mb=128, hide=[str(hidden)],
                                 stderr=subprocess.DEVNULL) as sb:
            res = await sb.score(FIX + "hostile", "", None, meta, timeout_s=20)
            return res, sb.isolation

    try:
        res, isolation = asyncio.run(main())
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing reached it
    finally:
        listener.close()
    assert res.status == "ok", res
    found = {k.removeprefix("found_"): v for k, v in res.info.items()}
    assert found["secret"] is False and found["hidden"] is False, found
    assert found["network"] is False and found["env"] == [], found
    assert found["signal_worker"] is False, found
    assert found["shm_mb"] <= 128, found
    assert not os.path.exists("/dev/shm/rollmesh-test-ballast")
    if os.geteuid() == 0:
        assert found["uid"] != 0, found
    assert "no network" in isolation and "private root" in isolation, isolation


def test_a_reward_functions_shared_memory_counts_against_its_limit():
    """Issue 35, items 7 and 10: a reward function used 1 GiB under a 512 MiB limit; an
    anonymous shared mapping is not "data", so RLIMIT_DATA let it through. Contained, the
    process is in a memory cgroup of reward_memory_mb + 128 MiB: 600 MiB touched under 128 MiB
    is stopped and scored an error naming the limit. Where no memory cgroup can be made here,
    the sandbox says so, and the test stops there."""
    async def main():
        async with RewardSandbox(1, memory_limit_mb=128, stderr=subprocess.DEVNULL) as sb:
            res = await sb.score(FIX + "shared_ballast", "", None, {"mb": 600}, timeout_s=60)
            return res, sb.isolation

    res, isolation = asyncio.run(main())
    if "data limit only" in isolation:
        pytest.skip(f"no memory cgroup can be made here: {isolation}")
    assert "memory cgroup" in isolation, isolation
    assert res.status == "error" and "memory limit is 128 MiB" in res.error, res


def test_a_killed_reward_process_leaves_no_memory_cgroup():
    """A reward process the worker kills (a timeout, the sandbox's close) cannot remove its
    memory cgroup itself: 144 empty groups were left on this machine by the tests before the
    worker removed them after the kill. Now none is left."""
    from rollmesh.runtime.memcg import _own_group

    own = _own_group()
    if own is None:
        pytest.skip("no memory cgroup here")
    groups = lambda: set(Path(own[0]).glob("rollmesh-reward-*"))  # noqa: E731
    before = groups()

    async def main():
        async with RewardSandbox(1, memory_limit_mb=128, stderr=subprocess.DEVNULL) as sb:
            call = asyncio.create_task(sb.score(FIX + "busy_loop", "", None, {}, timeout_s=4))
            await asyncio.sleep(2)
            made = groups() - before  # the running process's group
            return await call, sb.isolation, made

    res, isolation, made = asyncio.run(main())
    if "memory cgroup" not in isolation:
        pytest.skip(f"no memory cgroup can be made here: {isolation}")
    assert res.status == "timeout", res
    assert made, "the sandbox's processes made no group to look for"
    assert not (groups() - before), groups() - before
