"""The rollout side for real: engine, MessageQueue, rollouter, agent and reward workers, each a
process; the test drives versions and consumption over the real protocol."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest
import structlog

from rollmesh.engine.client import EngineClient
from rollmesh.core.trajectory import oldest_version
from rollmesh.wire.messages import Resume, WeightVersion
from rollmesh.rollout.journal import Journal
from rollmesh.wire.transport import Transport
from tests.helpers.rollout_stack import accounting, experiment, start_stack, stop_stack, write_dataset

ROWS = [{"prompt": f"What is {a} plus {b}?", "label": str(a + b)}
        for a in range(4) for b in range(4)]


def run(tmp_path, exp, body, **kw):
    async def main():
        with Transport() as t:
            stack = await start_stack(t, tmp_path, exp, **kw)
            try:
                return await body(stack)
            finally:
                await stop_stack(stack)

    return asyncio.run(main())


def generated_versions(traj) -> set[int]:
    return set(np.unique(traj.versions[traj.loss_mask == 1]).tolist())


async def settle(d, consumed: int):
    """Pause, then wait until the two processes' counters add up (nothing in transit)."""
    await d.pause()
    return await d.wait_for(
        lambda s: (lambda a, b: a == b)(*accounting(s, consumed))
        and s["rollouter"]["to_score"] == 0 and s["rollouter"]["ready_groups"] == 0,
        what="the accounting to settle")


def test_staleness_bound_holds_and_stale_samples_are_dropped(tmp_path):
    """The `oldest_token` rule: nothing handed out past the bound, stale groups dropped."""
    exp = experiment(write_dataset(tmp_path / "d.jsonl", ROWS), "rollout.max_new_tokens=12",
                     "staleness.max_staleness=1", "staleness.measure=oldest_token")

    async def body(stack):
        d = stack.driver
        consumed, seen = 0, []
        for step in range(4):
            groups = await d.take(2)
            assert len(groups) == 2
            for g in groups:
                seen.append(d.version - oldest_version(g))
                consumed += len(g.trajectories)
            await d.sync()
        # three syncs with nothing consumed: what is queued now is too old to hand out (the
        # queue drops it at hand-out), and what is still generating can no longer be trained
        # (the rollouter drops it at the resume, or when it comes back)
        await d.wait_for(lambda s: s["mq"]["depth_groups"] >= 2, what="groups queued")
        for _ in range(3):
            await d.sync()
        await d.wait_for(lambda s: s["mq"]["depth_groups"] > 0, what="groups queued")
        groups = await d.take(2)
        for g in groups:
            seen.append(d.version - oldest_version(g))
            consumed += len(g.trajectories)
        # the stale groups' places in the bound are given back: admission goes on past the
        # bound that counts them as accepted (it would have stopped there for good)
        per_version = exp.rollout.batch_groups * exp.sync.sync_every
        bound = (exp.staleness.max_staleness + d.version + 1) * per_version
        given_back = await d.wait_for(
            lambda s: s["mq"]["dropped"].get("stale", 0) > 0
            and s["rollouter"]["queue_stale_groups"] * exp.data.group_size
            == s["mq"]["dropped"]["stale"] and s["rollouter"]["admitted_groups"] > bound,
            what="the stale groups' places given back")
        for _ in range(given_back["mq"]["depth_groups"] // 2):  # room for what is ready
            for g in await d.take(2):
                seen.append(d.version - oldest_version(g))
                consumed += len(g.trajectories)
        stats = await settle(d, consumed)
        return seen, stats, consumed, given_back

    seen, stats, consumed, given_back = run(tmp_path, exp, body)
    assert max(seen) <= 1, seen
    assert stats["mq"]["dropped"].get("stale", 0) > 0 and given_back
    assert set(stats["mq"]["staleness_hist"]) <= {"0", "1"}
    admitted, accounted = accounting(stats, consumed)
    assert admitted == accounted and admitted > consumed


def test_under_the_admission_rule_old_groups_are_trained_and_admission_holds_the_bound(tmp_path):
    """The default rule (`staleness.measure = "admission"`): groups queued before three syncs
    in which nothing was consumed are handed out, not dropped (each with both ages counted),
    the earliest admitted first, and admission never passed (max_staleness + v + 1) x
    per_version groups."""
    exp = experiment(write_dataset(tmp_path / "d.jsonl", ROWS), "rollout.max_new_tokens=12",
                     "staleness.max_staleness=1")
    assert exp.staleness.measure == "admission"
    per_version = exp.rollout.batch_groups * exp.sync.sync_every

    async def body(stack):
        d = stack.driver
        consumed, seen, admitted_at = 0, [], []
        for step in range(2):
            for g in await d.take(2):
                consumed += len(g.trajectories)
            await d.sync()
        await d.wait_for(lambda s: s["mq"]["depth_groups"] >= 2, what="groups queued")
        for _ in range(3):
            await d.sync()
        # nothing consumed for three versions: admission stops at its bound, nothing is dropped
        full = await d.wait_for(
            lambda s: s["rollouter"]["running_groups"] == 0 and s["rollouter"]["pending"] == 0,
            what="the rollout to stop at its admission bound")
        for g in await d.take(2):
            seen.append(d.version - oldest_version(g))
            admitted_at.append(g.version_admitted)
            consumed += len(g.trajectories)
        for _ in range(10):  # the queue is full of trainable groups: take until all are in it
            if (await d.rollouter_stats())["ready_groups"] == 0:
                break
            consumed += sum(len(g.trajectories) for g in await d.take(2))
        stats = await settle(d, consumed)
        return seen, admitted_at, full, stats, consumed, d.version

    seen, admitted_at, full, stats, consumed, version = run(tmp_path, exp, body)
    assert min(seen) >= 3, seen  # made at version <= 2, handed out at 5: kept
    assert admitted_at == sorted(admitted_at) and max(admitted_at) <= 2, admitted_at
    assert stats["mq"]["dropped"].get("stale", 0) == 0 and "stale" not in stats["rollouter"][
        "dropped"], stats
    bound = (exp.staleness.max_staleness + version + 1) * per_version
    assert stats["rollouter"]["admitted_groups"] <= bound, (stats["rollouter"], bound)
    assert full["rollouter"]["admitted_groups"] <= bound
    ages = {int(k) for k in stats["mq"]["admission_age_hist"]}
    assert max(ages) >= 3 and stats["mq"]["staleness_measure"] == "admission"
    admitted, accounted = accounting(stats, consumed)
    assert admitted == accounted


def test_pause_mid_generation_resumes_without_generating_anything_twice(tmp_path):
    exp = experiment(write_dataset(tmp_path / "d.jsonl", ROWS), "rollout.max_new_tokens=2000",
                     "model.max_context=2200", "staleness.max_staleness=1",
                     "rollout.batch_groups=2")

    async def body(stack):
        d = stack.driver
        # capacity at version 0: (1 + 0 + 1) * 2 = 4 groups = 8 generations; pause mid-way
        # (each request has ~40 of its 2000 tokens: far from done, whatever the machine's load).
        # The random tiny model can sample its EOS early, so a request or two may have ended.
        for _ in range(3000):
            engine = stack.engine.stats()
            if engine["running_requests"] >= 6 and engine["generated_tokens"] >= 300:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError(f"never saw 6 requests mid-generation: {engine}")
        paused = await d.sync()  # version 1: 2 more groups admitted
        stats = await d.wait_for(lambda s: s["mq"]["depth_groups"] == 6
                                 and s["rollouter"]["in_flight"] == 0, timeout_s=300,
                                 what="all 6 groups queued")
        groups = await d.take(6)
        engine_tokens = stack.engine.stats()["generated_tokens"]
        return paused, stats, groups, engine_tokens

    paused, stats, groups, engine_tokens = run(tmp_path, exp, body)
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 12
    assert paused.in_flight == 0 and paused.cancel_queue > 0
    assert stats["rollouter"]["interrupted"] == paused.cancel_queue  # every partial came back
    two_versions = [t for t in trajs if generated_versions(t) == {0, 1}]
    assert len(two_versions) >= 2, [generated_versions(t) for t in trajs]
    for t in trajs:
        n = len(t.token_ids)
        assert t.status == "finished" and len(t.logprobs) == len(t.versions) == len(t.loss_mask) == n
        assert (t.versions[: t.prompt_len] == -1).all() and t.loss_mask[: t.prompt_len].sum() == 0
        # a resumed trajectory is one contiguous response: versions never go backwards
        gen = t.versions[t.loss_mask == 1]
        assert (np.diff(gen) >= 0).all()
    # nothing generated twice: the engine produced exactly the tokens the trajectories hold
    assert engine_tokens == sum(int(t.loss_mask.sum()) for t in trajs)


@pytest.mark.long
def test_an_in_place_pause_mid_generation_keeps_every_request_running(tmp_path):
    """sync.pause_mode = "in_place": the rollouter answers the Pause at once with its
    trajectories still out with the workers (no Cancel, nothing to the cancel queue), the engine
    holds them across the version change, and they finish with tokens of both versions."""
    exp = experiment(write_dataset(tmp_path / "d.jsonl", ROWS), "rollout.max_new_tokens=2000",
                     "model.max_context=2200", "staleness.max_staleness=1",
                     "rollout.batch_groups=2", "sync.pause_mode=in_place")

    async def body(stack):
        d = stack.driver
        for _ in range(3000):
            engine = stack.engine.stats()
            if engine["running_requests"] >= 6 and engine["generated_tokens"] >= 300:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError(f"never saw 6 requests mid-generation: {engine}")
        paused = await d.sync("in_place")
        stats = await d.wait_for(lambda s: s["mq"]["depth_groups"] == 6
                                 and s["rollouter"]["in_flight"] == 0, timeout_s=300,
                                 what="all 6 groups queued")
        groups = await d.take(6)
        engine_tokens = stack.engine.stats()["generated_tokens"]
        return paused, stats, groups, engine_tokens

    paused, stats, groups, engine_tokens = run(tmp_path, exp, body)
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 12
    assert paused.in_flight >= 6 and paused.cancel_queue == 0, paused
    assert stats["rollouter"].get("interrupted", 0) == 0  # nothing went to the cancel queue
    two_versions = [t for t in trajs if generated_versions(t) == {0, 1}]
    assert len(two_versions) >= 2, [generated_versions(t) for t in trajs]
    for t in trajs:
        assert t.status == "finished"
        assert (np.diff(t.versions[t.loss_mask == 1]) >= 0).all()
    assert engine_tokens == sum(int(t.loss_mask.sum()) for t in trajs)


def test_custom_agent_loop_from_an_entry_point_runs_end_to_end(tmp_path):
    rows = [{"prompt": "What is 2 plus 2?", "label": "4", "agent_loop": "self_check"}] * 4
    exp = experiment(write_dataset(tmp_path / "d.jsonl", rows), "rollout.max_new_tokens=8")

    async def body(stack):
        return await stack.driver.take(2)

    groups = run(tmp_path, exp, body)
    for t in (t for g in groups for t in g.trajectories):
        assert t.agent_loop == "self_check" and t.num_turns == 2 and t.status == "finished"
        # answer tokens, then the check prompt (mask 0), then the second answer
        runs = np.flatnonzero(np.diff(t.loss_mask[t.prompt_len:].astype(int)))
        assert len(runs) >= 2 and t.loss_mask[t.prompt_len:].sum() > 0
        assert t.loop_state["phase"] == "done"


def test_failing_and_hanging_rewards_are_recorded_and_lose_nothing(tmp_path):
    rows = [{"prompt": "What is 1 plus 1?", "label": "2", "reward": "tests.helpers.rollout_rewards:raises"},
            {"prompt": "What is 1 plus 2?", "label": "3", "reward": "tests.helpers.rollout_rewards:hangs"},
            {"prompt": "What is 1 plus 3?", "label": "4"}]
    exp = experiment(write_dataset(tmp_path / "d.jsonl", rows), "rollout.max_new_tokens=6",
                     "rollout.reward_timeout_s=1.0", "data.shuffle=false",
                     "staleness.max_staleness=0", "rollout.batch_groups=3")

    async def body(stack):
        d = stack.driver
        # version 0 admits 3 groups, one of each row: only the good one reaches the queue
        good = await d.take(1)
        # the raising group fails at once, the hanging one after its 1 s time limit: wait for
        # both to be recorded (while a hang runs its samples are in flight, and count as such)
        await d.wait_for(lambda s: s["rollouter"]["dropped"].get("reward_failed", 0) >= 4,
                         timeout_s=60, what="both failing groups recorded")
        stats = await settle(d, 2)
        return good, stats, [c.process.poll() for c in stack.rewards]

    good, stats, alive = run(tmp_path, exp, body)
    assert alive == [None]  # the reward worker survived a raise and a hang
    assert [t.reward_status for t in good[0].trajectories] == ["ok", "ok"]
    # rejected groups free their place, so the raising and hanging rows come round again:
    # every one of their samples is dropped as reward_failed, none is scored 0
    dropped = stats["rollouter"]["dropped"]
    assert set(dropped) == {"reward_failed"} and dropped["reward_failed"] >= 4
    admitted, accounted = accounting(stats, 2)
    assert admitted == accounted


def test_killed_agent_worker_has_its_samples_redispatched(tmp_path):
    # a deep staleness bound: 36 groups admitted at once, so both workers are surely busy
    exp = experiment(write_dataset(tmp_path / "d.jsonl", ROWS), "rollout.max_new_tokens=360",
                     "staleness.max_staleness=8", "rollout.batch_groups=4",
                     "rollout.max_concurrent=64")

    async def body(stack):
        d = stack.driver
        await d.wait_for(lambda s: all(w["out"] > 0 for w in s["rollouter"]["workers"].values()
                                       if w["kind"] == "agent"), what="both workers busy",
                         timeout_s=60)
        victim = stack.agents[0]
        os.kill(victim.process.pid, signal.SIGKILL)
        groups = await d.take(4, timeout_s=300)
        consumed = sum(len(g.trajectories) for g in groups)
        stats = await settle(d, consumed)
        return groups, stats

    groups, stats = run(tmp_path, exp, body, agents=2)
    assert len(groups) == 4
    assert stats["rollouter"]["workers_lost"] == 1
    assert all(t.status == "finished" for g in groups for t in g.trajectories)
    admitted, accounted = accounting(stats, sum(len(g.trajectories) for g in groups))
    assert admitted == accounted


@pytest.mark.long
def test_rollouter_killed_during_a_sync_comes_back_paused_until_its_resume(tmp_path):
    # Killed between Pause and Resume, the new rollouter must not generate while the engines
    # may be half-way through a broadcast: it waits for the Resume the synchronizer re-sends.
    exp = experiment(write_dataset(tmp_path / "d.jsonl", ROWS), "rollout.max_new_tokens=2000",
                     "model.max_context=2200")

    async def body(stack):
        d = stack.driver
        for _ in range(3000):  # mid-generation, so that the journal has groups in flight
            if stack.engine.stats()["running_requests"] >= 6:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError(f"never saw 6 requests running: {stack.engine.stats()}")
        await d.pause()  # the sync begins
        os.kill(stack.rollouter.process.pid, signal.SIGKILL)
        await asyncio.to_thread(stack.rollouter.process.wait)
        stack.rollouter = stack.sup.respawn(stack.rollouter)
        await stack.sup.wait_ready(stack.rollouter, 120)
        # the broadcast would run now: two seconds in which nothing may be generated
        tokens = stack.engine.stats()["generated_tokens"]
        await asyncio.sleep(2.0)
        during = await d.rollouter_stats()
        generated_while_paused = stack.engine.stats()["generated_tokens"] - tokens
        d.version += 1
        async with EngineClient([stack.engine.url]) as client:
            await client.update_weight_version(str(d.version))
        await d.mq.request(WeightVersion(version=d.version))
        await d.rollouter.request(Resume(version=d.version))  # the sync ends
        groups = await d.take(2, timeout_s=300)
        consumed = sum(len(g.trajectories) for g in groups)
        stats = await settle(d, consumed)
        return during, generated_while_paused, groups, stats, consumed

    during, generated_while_paused, groups, stats, consumed = run(
        tmp_path, exp, body, rollouter_config={"state_dir": str(tmp_path / "state")})
    assert during["paused"] and during["restored_groups"] > 0, during
    assert generated_while_paused == 0
    for t in (t for g in groups for t in g.trajectories):
        assert t.status == "finished"
        if during["restored_groups"] == 4:  # all were in flight (none hit EOS before the kill):
            # generated again from the Resume on, so at version 1 only
            assert set(t.versions[t.loss_mask == 1].tolist()) == {1}
    assert stats["rollouter"]["version"] == 1
    admitted, accounted = accounting(stats, consumed)
    assert admitted == accounted


@pytest.mark.long
def test_a_paused_journal_does_not_hold_a_new_launch_and_a_lost_resume_does_not_stall(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    j = Journal(state / "rollouter.log", structlog.get_logger("test"))
    j.pause()  # the last launch died in the middle of a sync
    j.close()
    exp = experiment(write_dataset(tmp_path / "d.jsonl", ROWS), "rollout.max_new_tokens=12",
                     "sync.timeout_s=1")

    async def body(stack):
        d = stack.driver
        first = await d.rollouter_stats()  # a new launch (`--resume`): nothing to wait for
        groups = await d.take(2)
        await d.pause()
        os.kill(stack.rollouter.process.pid, signal.SIGKILL)
        await asyncio.to_thread(stack.rollouter.process.wait)
        stack.rollouter = stack.sup.respawn(stack.rollouter)
        await stack.sup.wait_ready(stack.rollouter, 120)
        restarted = await d.rollouter_stats()
        # no Resume ever comes: after the sync's time limit (+10 s) it resumes by itself
        later = await d.wait_for(lambda s: not s["rollouter"]["paused"], timeout_s=60,
                                 what="the backstop's resume")
        groups += await d.take(2)
        return first, restarted, later, groups

    first, restarted, later, groups = run(tmp_path, exp, body,
                                          rollouter_config={"state_dir": str(state)})
    assert not first["paused"] and restarted["paused"] and not later["rollouter"]["paused"]
    assert len(groups) == 4
    log = (tmp_path / "logs" / "rollouter-0.log").read_text()
    assert "resume_never_came" in log


pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_over_sampling_without_a_filter_generates_nothing_that_goes_stale(tmp_path):
    """rollout.over_sampling = 3 with no group filter, the trainer the bottleneck (it takes a
    batch only when the rollout has generated all it may): over-sampling only makes up for
    groups a filter drops, so nothing is admitted past the staleness bound and nothing is
    dropped as stale. (Before, the whole bound was multiplied: 12 groups admitted at version 0
    for 2 per step, and the surplus went stale.)"""
    exp = experiment(write_dataset(tmp_path / "d.jsonl", ROWS), "rollout.max_new_tokens=8",
                     "staleness.max_staleness=1", "rollout.batch_groups=2",
                     "rollout.over_sampling=3", "rollout.max_concurrent=16")

    def all_generated(s):
        r = s["rollouter"]
        return (r["capacity"] == 0 and r["running_groups"] == 0 and r["ready_groups"] == 0
                and s["mq"]["depth_groups"] >= 2)

    async def body(stack):
        d = stack.driver
        consumed, admitted = 0, []
        for _ in range(4):
            stats = await d.wait_for(all_generated, what="the rollout to generate all it may")
            admitted.append(stats["rollouter"]["admitted_groups"])
            for g in await d.take(2):
                consumed += len(g.trajectories)
            await d.sync()
        stats = await d.wait_for(all_generated, what="the rollout to generate all it may")
        return admitted, await settle(d, consumed), consumed

    admitted, stats, consumed = run(tmp_path, exp, body)
    assert admitted == [4, 6, 8, 10], admitted  # (max_staleness + v + 1) * 2, never x3
    assert stats["mq"]["dropped"].get("stale", 0) == 0, stats["mq"]["dropped"]
    assert not any(stats["rollouter"]["dropped"].values()), stats["rollouter"]["dropped"]
    assert stats["rollouter"]["over_sampling"] == 1.0
    admitted_samples, accounted = accounting(stats, consumed)
    assert admitted_samples == accounted
