"""Evaluation users can read: pass@k (the unbiased estimator, checked against every subset),
a round's summary per data_source, the flat keys of the metrics row, the monitor's eval panel,
the rollouter's results reaching the trainer through the status hub, and a real short run with rollout.eval_n answers per prompt."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
import types
from pathlib import Path

import msgpack
import pytest
from rich.console import Console

from rollmesh.core.evaluation import eval_metrics, eval_summary, pass_at_k, pass_ks
from rollmesh.runtime.log import get_logger
from rollmesh.observe.monitor import StatusBoard
from rollmesh.observe.render import render
from rollmesh.wire.protocol import ProtocolError, decode, encode
from rollmesh.wire.messages import EvalResult, Metrics
from rollmesh.rollout.role import announce_evals
from rollmesh.runtime.process import RoleContext, RoleSpec
from rollmesh.training.role import Evaluations
from rollmesh.wire.transport import Transport
from rollmesh.wire.channels import Publisher, StatusProxy

ROOT = Path(__file__).resolve().parents[2]


# -- pass@k ---------------------------------------------------------------------------------------


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of the k-subsets of n answers (the first c passed) holding a passed one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_the_share_of_subsets_with_a_pass():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert math.isclose(pass_at_k(n, c, k), brute_force_pass_at_k(n, c, k),
                                    abs_tol=1e-12), (n, c, k)


def test_pass_at_k_known_values_and_bad_input():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # C(3,2)/C(5,2)
    assert pass_at_k(7, 0, 3) == 0.0 and pass_at_k(7, 7, 3) == 1.0
    assert pass_at_k(4, 1, 4) == 1.0  # every answer drawn: the passed one is among them
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)  # exact binomials: no overflow
    for bad, match in (((3, 4, 1), "0 <= c <= n"), ((3, 1, 4), "1 <= k <= n"),
                       ((3, 1, 0), "1 <= k <= n"), ((0, 0, 1), "1 <= k <= n")):
        with pytest.raises(ValueError, match=match):
            pass_at_k(*bad)
    with pytest.raises(TypeError, match="k must be an int"):
        pass_at_k(4, 1, 2.0)


def test_reported_ks_are_powers_of_two_below_eval_n_and_eval_n():
    assert pass_ks(1) == [1]
    assert pass_ks(2) == [1, 2]
    assert pass_ks(4) == [1, 2, 4]
    assert pass_ks(6) == [1, 2, 4, 6]
    assert pass_ks(16) == [1, 2, 4, 8, 16]
    with pytest.raises(ValueError, match="eval_n"):
        pass_ks(0)


# -- a round's summary ----------------------------------------------------------------------------


def records(prompt, source, rewards):
    return [{"prompt": prompt, "data_source": source, "reward": r} for r in rewards]


def test_summary_per_data_source_with_failed_answers():
    recs = [
        *records(0, "gsm8k", [1.0, 0.0, 1.0, 0.0]),   # c=2 of 4
        *records(1, "gsm8k", [0.0, 0.0, 0.0, 0.0]),   # c=0
        *records(2, "math", [1.0, 1.0, 1.0, None]),   # a failed answer: not passed, c=3 of 4
        *records(3, "math", [0.5, 0.25, 0.0, 1.0]),   # c=1 (threshold 1.0)
    ]
    s = eval_summary(recs, eval_n=4, threshold=1.0)
    assert (s["prompts"], s["n"], s["failed"]) == (4, 15, 1)
    assert s["reward_mean"] == pytest.approx(sum(r["reward"] for r in recs
                                                 if r["reward"] is not None) / 15)
    for k in (1, 2, 4):
        want = sum(pass_at_k(4, c, k) for c in (2, 0, 3, 1)) / 4
        assert s["pass_at"][str(k)] == pytest.approx(want), k
    assert list(s["pass_at"]) == ["1", "2", "4"]
    assert s["pass_at"]["1"] == pytest.approx((0.5 + 0 + 0.75 + 0.25) / 4)

    g, m = s["by_source"]["gsm8k"], s["by_source"]["math"]
    assert list(s["by_source"]) == ["gsm8k", "math"]
    assert (g["prompts"], g["n"], g["failed"], m["prompts"], m["n"], m["failed"]) == (
        2, 8, 0, 2, 7, 1)
    assert g["reward_mean"] == pytest.approx(2 / 8)
    assert m["reward_mean"] == pytest.approx(4.75 / 7)
    assert g["pass_at"] == pytest.approx({"1": 0.25, "2": (pass_at_k(4, 2, 2)) / 2, "4": 0.5})
    assert m["pass_at"] == pytest.approx({"1": 0.5, "2": (pass_at_k(4, 3, 2) + 0.5) / 2,
                                          "4": 1.0})

    # A lower threshold: partial rewards pass.
    assert eval_summary(recs, eval_n=4, threshold=0.5)["by_source"]["math"]["pass_at"]["1"] == (
        pytest.approx((3 / 4 + 2 / 4) / 2))


def test_summary_without_sources_and_with_short_prompts():
    recs = [*records(0, None, [1.0, 0.0, 0.0, 0.0]),
            *records(1, None, [1.0, None])]  # two of its answers never came: n=2 < 4
    s = eval_summary(recs, eval_n=4)
    assert "by_source" not in s  # no row names a data_source
    assert s["pass_at"]["1"] == pytest.approx((0.25 + 0.5) / 2)
    assert s["pass_at"]["2"] == pytest.approx((pass_at_k(4, 1, 2) + 1.0) / 2)
    assert s["pass_at"]["4"] == 1.0  # prompt 1 has fewer than 4 answers: left out of k=4
    assert (s["prompts"], s["n"], s["failed"]) == (2, 5, 1)

    # Rows without a source are left out of by_source, kept in the overall figures.
    mixed = eval_summary([*records(0, "a", [1.0]), *records(1, None, [0.0])])
    assert mixed["by_source"] == {"a": {"prompts": 1, "n": 1, "failed": 0, "reward_mean": 1.0,
                                        "pass_at": {"1": 1.0}}}
    assert mixed["prompts"] == 2 and mixed["pass_at"] == {"1": 0.5}

    every_answer_failed = eval_summary(records(0, None, [None, None]), eval_n=2)
    assert every_answer_failed["reward_mean"] is None
    assert every_answer_failed["pass_at"] == {"1": 0.0, "2": 0.0}


def test_metrics_row_keys():
    summary = {"version": 4, **eval_summary([*records(0, "openai/gsm8k", [1.0, 0.0]),
                                             *records(1, "math", [0.0, 0.0])], eval_n=2)}
    row = eval_metrics(summary)
    assert row == pytest.approx({
        "eval_reward_mean": 0.25, "eval_version": 4, "eval_samples": 4, "eval_failed": 0,
        "eval_prompts": 2, "eval_pass@1": 0.25, "eval_pass@2": 0.5,
        "eval/openai/gsm8k/reward_mean": 0.5, "eval/openai/gsm8k/pass@1": 0.5,
        "eval/openai/gsm8k/pass@2": 1.0,
        "eval/math/reward_mean": 0.0, "eval/math/pass@1": 0.0, "eval/math/pass@2": 0.0})


# -- the monitor ----------------------------------------------------------------------------------


def eval_stat(sources: int = 2) -> dict:
    recs = [r for i in range(sources * 2)
            for r in records(i, f"source{i % sources:02d}", [1.0, 0.0, 0.5, 1.0][: 1 + i % 4])]
    return {"version": 6, **eval_summary(recs, eval_n=4), "answers_resumed": 0,
            "response_tokens": 99}


def board_with(rollouter: dict | None, trainer: dict | None = None) -> StatusBoard:
    board = StatusBoard()
    if rollouter is not None:
        board.update("metrics.rollouter.0",
                     Metrics(role="rollouter", host="h", values={"instance": 0, **rollouter}), 1.0)
    if trainer is not None:
        board.update("metrics.trainer.0",
                     Metrics(role="trainer", host="h", values={"instance": 0, **trainer}), 1.0)
    return board


def text_of(board: StatusBoard, width: int = 160) -> str:
    console = Console(record=True, width=width)
    console.print(render(board.snapshot(1.5), width=width))
    return console.export_text()


def test_monitor_shows_the_last_eval_with_pass_at_k_and_sources():
    ev = eval_stat()
    board = board_with({"eval": ev, "eval_pending": 3})
    snap = board.snapshot(1.5)["eval"]
    assert snap["version"] == 6 and snap["pending"] == 3
    assert snap["pass_at"] == ev["pass_at"] and snap["reward_mean"] == ev["reward_mean"]
    assert snap["by_source"] == {s: {k: f[k] for k in ("prompts", "n", "failed", "reward_mean",
                                                       "pass_at")}
                                 for s, f in ev["by_source"].items()}
    json.dumps(board.snapshot(1.5))  # what --json prints
    text = text_of(board)
    assert "Last eval" in text and "pass@1" in text and "pass@4" in text
    assert "source00" in text and "source01" in text
    narrow = text_of(board, width=90)  # one column
    assert "Last eval" in narrow and "source01" in narrow

    many = text_of(board_with({"eval": eval_stat(sources=11)}))
    assert "source07" in many and "source08" not in many and "... 3 more" in many


def test_monitor_eval_before_any_round_and_from_the_trainer_alone():
    assert board_with({"eval": None}).snapshot(1.5)["eval"] is None
    assert "Last eval" not in text_of(board_with({"eval": None}))
    board = board_with(None, {"step": 3, "eval_reward_mean": 0.5, "eval_version": 2})
    ev = board.snapshot(1.5)["eval"]
    assert ev["version"] == 2 and ev["reward_mean"] == 0.5 and ev["pass_at"] == {}
    assert "Last eval" in text_of(board)


# -- a real run -----------------------------------------------------------------------------------

SOURCES = ("letters/people", "letters/sea")


# -- the hand-off: rollouter -> status hub -> trainer --------------------------------------------


def eval_result(version: int, reward: float = 0.5, sources: int = 2) -> EvalResult:
    figures = {"prompts": 3, "n": 6, "failed": 0, "reward_mean": reward,
               "pass_at": {"1": reward, "2": min(1.0, 2 * reward)}}
    return EvalResult(version=version, prompts=3 * sources, n=6 * sources, failed=1,
                      reward_mean=reward, pass_at={"1": reward, "2": min(1.0, 2 * reward)},
                      by_source={f"source{i:02d}": dict(figures) for i in range(sources)},
                      answers_resumed=2, response_tokens=640)


def test_an_eval_result_crosses_the_wire_typed_and_strictly_checked():
    rec = eval_result(4)
    assert decode(encode(rec)) == rec
    none = EvalResult(version=0, prompts=2, n=0, failed=2, reward_mean=None, pass_at={})
    assert decode(encode(none)) == none and "by_source" not in none.summary()
    frames = encode(rec)
    body = msgpack.unpackb(frames[1])
    body["pass_at"] = {"1": "half"}
    with pytest.raises(ProtocolError, match="pass_at"):
        decode([frames[0], msgpack.packb(body)])
    # its summary is what eval_summary gives, so the metrics row keys are unchanged
    row = eval_metrics(rec.summary())
    assert row["eval_version"] == 4 and row["eval_pass@2"] == 1.0
    assert row["eval/source01/pass@1"] == 0.5 and row["eval_failed"] == 1


def test_the_trainer_reports_each_round_once_and_the_newest_by_version():
    evals = Evaluations(None)
    assert evals.unreported() is None
    evals.take(eval_result(2))
    assert evals.unreported().version == 2
    evals.take(eval_result(2))  # the rollouter's repeat every status interval
    assert evals.unreported() is None
    evals.take(eval_result(6))
    evals.take(eval_result(4))  # late and older: changes nothing
    evals.take(Metrics(role="rollouter", host="h", values={}))  # not an EvalResult: ignored
    got = evals.unreported()
    assert got.version == 6 and evals.reported is got and evals.unreported() is None


def role_context(t: Transport, hub: StatusProxy, role: str, interval_s: float) -> RoleContext:
    spec = RoleSpec(role=role, entry="x:y", control="tcp://127.0.0.1:1",
                    status_hub=hub.frontend, status_feed=hub.backend, status_interval_s=interval_s)
    ctx = RoleContext(spec, t, control=None, log=get_logger("test"))
    ctx.publisher = Publisher(t, hub.frontend)
    return ctx


def test_a_finished_round_reaches_the_trainer_through_the_hub_at_once_and_again():
    async def until(cond, timeout_s: float = 10.0) -> None:
        began = time.monotonic()
        while not cond() and time.monotonic() - began < timeout_s:
            await asyncio.sleep(0.01)

    async def main():
        with Transport() as t:
            hub = StatusProxy(t, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
            # a status interval far longer than the test: what arrives was sent as the round ended
            rollouter = role_context(t, hub, "rollouter", interval_s=600)
            rounds = types.SimpleNamespace(last=None, on_result=None)
            announcing = asyncio.create_task(announce_evals(rollouter, rounds))
            evals = Evaluations(role_context(t, hub, "trainer", 600))
            evals.open()
            await asyncio.sleep(0.5)  # the subscription reaches the hub; nothing ended yet
            assert evals.newest is None
            rounds.last = eval_result(0, reward=0.25)
            rounds.on_result(rounds.last)  # a round ends
            await until(lambda: evals.newest is not None)
            assert evals.unreported() == rounds.last
            announcing.cancel()
            # the newest again every interval: a trainer that subscribes later (restarted)
            # gets it, as does one whose message was dropped
            again = asyncio.create_task(announce_evals(role_context(t, hub, "rollouter", 0.2),
                                                       rounds))
            late = Evaluations(role_context(t, hub, "trainer", 600))
            late.open()
            await until(lambda: late.newest is not None)
            assert late.unreported() == rounds.last
            assert evals.unreported() is None  # the repeats report nothing twice
            again.cancel()
            for e in (evals, late):
                e.close()
            hub.close()

    asyncio.run(main())


def test_without_a_hub_there_is_nothing_to_subscribe_or_announce():
    async def main():
        with Transport() as t:
            spec = RoleSpec(role="trainer", entry="x:y", control="tcp://127.0.0.1:1")
            ctx = RoleContext(spec, t, control=None, log=get_logger("test"))
            assert ctx.subscribe("eval.") is None
            assert await ctx.announce("eval", eval_result(0)) is False
            evals = Evaluations(ctx)
            evals.open()  # no hub: nothing to receive, training goes on the same
            assert evals.unreported() is None
            evals.close()

    asyncio.run(main())


def write_eval_set(path: Path, prompts: int = 4) -> Path:
    rows = [json.loads(line) for line in
            (ROOT / "configs/data/letters_eval.jsonl").read_text().splitlines()[:prompts]]
    path.write_text("".join(json.dumps({**r, "data_source": SOURCES[i % 2]}) + "\n"
                            for i, r in enumerate(rows)))
    return path


