"""The rollouter's rules driven directly, without sockets or processes (`rollmesh.rollout.core`):
AReaL's staleness bound on admission (`RolloutCore.capacity`) and the DAPO group filter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import structlog

from rollmesh.rollout.data import PromptSource
from rollmesh.wire.messages import Assign, Group, Score, Scored
from rollmesh.rollout.core import RolloutCore
from rollmesh.rollout.filters import dapo_filter, get_group_filter, keep_all
from rollmesh.rollout.workers import Worker
from rollmesh.core.trajectory import load_tokenizer, new_trajectory
from tests.helpers.rollout_stack import experiment, write_dataset

LOG = structlog.get_logger("test")
ROWS = [{"prompt": f"What is {i} + {i}?", "label": str(2 * i)} for i in range(20)]


def make_core(tmp_path: Path, *overrides: str) -> RolloutCore:
    """A core over 20 rows, groups of 2, batch_groups 2, max_staleness 1 (rollout_stack's
    defaults), with one agent and one reward worker of ample credit."""
    exp = experiment(write_dataset(tmp_path / "rows.jsonl", ROWS), *overrides)
    core = RolloutCore(exp, PromptSource.from_config(exp.data), load_tokenizer(exp.model), None,
                       LOG)
    core.workers.add(Worker(b"agent", "agent-0", "agent", 1000))
    core.workers.add(Worker(b"reward", "reward-0", "reward", 1000))
    return core


def worker(core: RolloutCore, peer: bytes) -> Worker:
    w = core.workers.get(peer)
    assert w is not None
    return w


def finish(core: RolloutCore, group_id: str, rewards: list[float]) -> None:
    """Generate and score every sample of a group the core dispatched: finished by the agent
    worker, then scored with `rewards` (one per sample, by index)."""
    agent, scorer = worker(core, b"agent"), worker(core, b"reward")
    for traj in [t for t in agent.out.values() if t.group_id == group_id]:
        traj.status = "finished"
        assert core.returned(agent, traj)
    sends = list(core.dispatch())
    for send in sends:
        if isinstance(send.msg, Score) and send.msg.trajectory.group_id == group_id:
            traj = send.msg.trajectory
            core.scored(scorer, Scored(sample_id=traj.sample_id, reward=rewards[traj.index],
                                       reward_status="ok"))


def dispatched_groups(sends) -> list[str]:
    return sorted({s.msg.trajectory.group_id for s in sends if isinstance(s.msg, Assign)})


# -- AReaL's bound --------------------------------------------------------------------------


def test_admission_stops_at_the_staleness_bound(tmp_path):
    """(max_staleness + v + 1) * batch_groups * sync_every groups at version 0: 4 groups with
    max_staleness 1, batch_groups 2; no more however many workers are free."""
    core = make_core(tmp_path)
    assert core.capacity() == 4
    sends = list(core.dispatch())
    assert len(dispatched_groups(sends)) == 4 and core.running_groups == 4
    assert core.capacity() == 0 and list(core.dispatch()) == []
    assert core.counters["admitted_groups"] == 4 and core.counters["admitted_samples"] == 8


def test_the_bound_counts_sync_every_and_max_concurrent(tmp_path):
    assert make_core(tmp_path, "sync.sync_every=2",  # (1 + 0 + 1) * 2 * 2
                     "rollout.max_concurrent=20").capacity() == 8
    assert make_core(tmp_path, "rollout.max_concurrent=3").capacity() == 3
    assert make_core(tmp_path, "staleness.max_staleness=0").capacity() == 2


def test_accepted_groups_count_for_good_and_rejected_ones_free_their_place(tmp_path):
    core = make_core(tmp_path)
    groups = dispatched_groups(list(core.dispatch()))
    finish(core, groups[0], [1.0, 0.0])  # accepted: still takes its place
    assert len(core.ready) == 1 and core.accepted_groups() == 1
    assert core.running_groups == 3 and core.capacity() == 0
    core.queued(core.ready.popleft())  # in the queue now: still counted
    assert core.accepted_groups() == 1 and core.capacity() == 0
    finish(core, groups[1], [1.0, 1.0])  # equal rewards, but no filter: accepted too
    assert core.accepted_groups() == 2 and core.running_groups == 2 and core.capacity() == 0


def test_a_filtered_group_frees_its_place(tmp_path):
    core = make_core(tmp_path, 'rollout.group_filter="dapo"', "rollout.over_sampling=1.0")
    groups = dispatched_groups(list(core.dispatch()))
    assert core.capacity() == 0
    finish(core, groups[0], [1.0, 1.0])  # no signal: dropped
    assert core.dropped["filtered"] == 2 and core.running_groups == 3
    assert core.capacity() == 1


def test_each_version_adds_a_version_of_headroom(tmp_path):
    core = make_core(tmp_path)
    list(core.dispatch())
    core.pause("abort")
    assert core.capacity() == 0 and list(core.dispatch()) == []  # paused: nothing admitted
    core.resume(1)
    assert core.capacity() == 2  # (1 + 1 + 1) * 2 - 4 running
    list(core.dispatch())
    assert core.running_groups == 6 and core.capacity() == 0


def test_groups_the_queue_dropped_as_stale_give_their_places_back(tmp_path):
    core = make_core(tmp_path)
    groups = dispatched_groups(list(core.dispatch()))
    for gid in groups[:2]:
        finish(core, gid, [1.0, 0.0])
    while core.ready:
        core.queued(core.ready.popleft())
    assert core.accepted_groups() == 2 and core.capacity() == 0
    assert core.queue_stale(1) and not core.queue_stale(1)
    assert core.capacity() == 1


def test_over_sampling_applies_to_the_headroom_left_with_a_dropping_filter(tmp_path):
    core = make_core(tmp_path, 'rollout.group_filter="dapo"', "rollout.over_sampling=1.5")
    assert core.over_sampling() == 1.5 and core.capacity() == 6  # int(4 * 1.5)
    unfiltered = make_core(tmp_path, "rollout.over_sampling=1.5")
    assert unfiltered.over_sampling() == 1.0 and unfiltered.capacity() == 4


def test_no_admission_while_no_engine_is_healthy(tmp_path):
    core = make_core(tmp_path)
    core.engines_seen(0, ["http://e"], now=0.0)
    assert list(core.dispatch()) == [] and core.source.state() == make_core(
        tmp_path).source.state()
    assert core.engines_seen(1, ["http://e"], now=1.0)
    assert len(dispatched_groups(list(core.dispatch()))) == 4


# -- the DAPO filter ------------------------------------------------------------------------


def group_of(rewards: list[float | None]) -> Group:
    trajs = []
    for i, r in enumerate(rewards):
        t = new_trajectory(f"g-{i}", "g", i, [1, 2], agent_loop="single_turn")
        t.reward = r
        trajs.append(t)
    return Group(group_id="g", trajectories=trajs, version_admitted=0)


@pytest.mark.parametrize("rewards, keep", [
    ([1.0, 1.0, 1.0, 1.0], False),  # all solved: no signal
    ([0.0, 0.0], False),  # all failed: no signal
    ([1.0, 0.0, 1.0, 1.0], True),
    ([0.5, 0.25], True),
])
def test_dapo_keeps_a_group_only_if_its_rewards_differ(rewards, keep):
    assert dapo_filter(group_of(rewards)) is keep
    assert keep_all(group_of(rewards)) is True


def test_group_filters_by_name():
    assert get_group_filter("dapo") is dapo_filter and get_group_filter("none") is keep_all
    with pytest.raises(KeyError, match="unknown group filter 'nope'"):
        get_group_filter("nope")


def test_dapo_in_the_core_drops_uniform_groups_and_accepts_the_others(tmp_path):
    core = make_core(tmp_path, 'rollout.group_filter="dapo"', "rollout.over_sampling=1.0")
    groups = dispatched_groups(list(core.dispatch()))
    finish(core, groups[0], [1.0, 1.0])
    finish(core, groups[1], [0.0, 1.0])
    assert [g.group_id for g in core.ready] == [groups[1]]
    assert core.counters["filtered_groups"] == 1 and core.counters["rejected_groups"] == 1
    assert dict(core.dropped) == {"filtered": 2}
    # the accounting identity holds: admitted = queued + dropped + in flight
    c = core.counters
    assert c["admitted_samples"] == c["queued_samples"] + sum(core.dropped.values()) \
        + core.in_flight()
    accepted = core.ready[0]
    assert np.array_equal([t.index for t in accepted.trajectories], [0, 1])


# -- the journal: one apply path ------------------------------------------------------------


def test_the_live_counters_are_what_a_replay_of_the_journal_gives(tmp_path):
    from rollmesh.rollout.journal import Journal

    core = make_core(tmp_path, 'rollout.group_filter="dapo"', "rollout.over_sampling=1.0")
    core.journal = Journal(tmp_path / "rollouter.log", LOG)
    groups = dispatched_groups(list(core.dispatch()))
    finish(core, groups[0], [1.0, 1.0])  # filtered
    finish(core, groups[1], [0.0, 1.0])  # accepted, then queued
    core.queued(core.ready.popleft())
    finish(core, groups[2], [1.0, 0.0])  # accepted, not yet queued
    live = core.counters
    core.journal.close()
    replayed = Journal(tmp_path / "rollouter.log", LOG)
    for key in ("admitted_groups", "admitted_samples", "queued_groups", "queued_samples",
                "rejected_groups"):
        assert live[key] == replayed.counters[key], key
    assert live["accepted_groups"] == replayed.counters["accepted_groups"] + 1  # the ready one
    assert dict(core.dropped) == dict(replayed.dropped) == {"filtered": 2}


# -- groups past the bound in flight ---------------------------------------------------------


def generated(core: RolloutCore, group_id: str, version: int | None, status: str) -> list:
    """Every sample of the group out with the agent worker comes back with 2 tokens generated
    at `version` (None: none generated yet), `status` (finished or interrupted)."""
    from rollmesh.core.trajectory import append_tokens

    agent = worker(core, b"agent")
    back = []
    for traj in [t for t in agent.out.values() if t.group_id == group_id]:
        if version is not None:
            append_tokens(traj, [5, 6], [-0.1, -0.2], version)
        traj.status = status
        assert core.returned(agent, traj)
        back.append(traj)
    return back


def identity_holds(core: RolloutCore) -> bool:
    c = core.counters
    return c["admitted_samples"] == (c["queued_samples"] + sum(core.dropped.values())
                                     + core.in_flight())


def test_a_group_past_the_bound_is_dropped_at_the_resume_not_generated_on(tmp_path):
    core = make_core(tmp_path, "staleness.measure=oldest_token")  # max_staleness 1
    old, young = dispatched_groups(list(core.dispatch()))[:2]
    core.pause("abort")
    generated(core, old, 0, "interrupted")
    generated(core, young, None, "interrupted")  # queued at the engine: nothing generated
    core.resume(1)
    # version 1: tokens of version 0 are within the bound; both resume
    assert core.events["stale_groups_dropped"] == 0
    sends = list(core.dispatch())
    assert {old, young} <= set(dispatched_groups(sends))
    core.pause("abort")
    generated(core, old, 1, "interrupted")  # its oldest tokens are still version 0
    generated(core, young, 1, "interrupted")
    held = core.capacity()
    core.resume(2)  # bound 2 - 1 = 1: `old` can only be dropped at hand-out now
    assert core.events["stale_groups_dropped"] == 1
    assert old not in core.groups and young in core.groups
    assert dict(core.dropped) == {"stale": 2}  # both its samples, dropped here
    assert all(t.group_id != old for t in core.cancel_queue)
    assert old not in dispatched_groups(list(core.dispatch()))  # never generated on
    assert core.capacity() > held - 1  # its place is free again (a version of headroom too)
    assert identity_holds(core)


def test_a_sample_back_after_its_group_was_dropped_as_stale_is_dropped_as_stale(tmp_path):
    core = make_core(tmp_path, "staleness.measure=oldest_token")
    gid = dispatched_groups(list(core.dispatch()))[0]
    agent = worker(core, b"agent")
    first, second = [t for t in agent.out.values() if t.group_id == gid]
    from rollmesh.core.trajectory import append_tokens

    append_tokens(first, [5], [-0.1], 0)
    first.status = "finished"
    assert core.returned(agent, first)  # to be scored
    core.pause("abort")
    core.resume(3)  # `first` holds version 0 < 3 - 1: the group goes, `second` is still out
    assert gid not in core.groups and core.stale_out == {gid: (1, "stale")}
    assert dict(core.dropped) == {"stale": 1}
    append_tokens(second, [7], [-0.3], 3)
    second.status = "finished"
    assert core.returned(agent, second)
    assert dict(core.dropped) == {"stale": 2} and core.stale_out == {}
    assert identity_holds(core)


def test_a_sample_past_the_bound_when_it_comes_back_drops_its_group(tmp_path):
    core = make_core(tmp_path, "staleness.measure=oldest_token")
    gid = dispatched_groups(list(core.dispatch()))[0]
    core.version = 2  # two syncs while it generated (as a held sample's would go on)
    back = generated(core, gid, 0, "finished")
    assert gid not in core.groups and dict(core.dropped) == {"stale": 2}
    assert not any(isinstance(s.msg, Score) and s.msg.trajectory.group_id == gid
                   for s in core.dispatch())
    assert back and core.stale_out == {}
    assert identity_holds(core)


def test_a_sample_scored_across_a_sync_past_the_bound_drops_its_group(tmp_path):
    core = make_core(tmp_path, "staleness.measure=oldest_token")
    gid = dispatched_groups(list(core.dispatch()))[0]
    generated(core, gid, 0, "finished")
    scoring = [s.msg.trajectory for s in core.dispatch() if isinstance(s.msg, Score)
               and s.msg.trajectory.group_id == gid]
    assert len(scoring) == 2
    core.pause("abort")
    core.resume(2)  # both are out with the reward worker: nothing in hand to look at
    assert gid in core.groups
    scorer = worker(core, b"reward")
    for traj in scoring:
        core.scored(scorer, Scored(sample_id=traj.sample_id, reward=1.0, reward_status="ok"))
    assert gid not in core.groups and not core.ready
    assert dict(core.dropped) == {"stale": 2} and core.stale_out == {}
    assert identity_holds(core)


def test_under_the_admission_measure_a_group_spanning_syncs_is_generated_on_and_accepted(
        tmp_path):
    """The default rule: the bound was applied at admission, so a group whose tokens span
    more versions than max_staleness (the longest answers) goes on through the resumes and is
    accepted, nothing dropped, every token keeping its own version."""
    core = make_core(tmp_path)  # max_staleness 1, staleness.measure = "admission"
    gid = dispatched_groups(list(core.dispatch()))[0]
    core.pause("abort")
    generated(core, gid, 0, "interrupted")
    core.resume(3)  # its tokens of version 0 are 3 versions old
    assert core.events["stale_groups_dropped"] == 0 and gid in core.groups
    assert gid in dispatched_groups(list(core.dispatch()))  # resumed, not dropped
    finish(core, gid, [0.0, 1.0])
    assert [g.group_id for g in core.ready] == [gid] and not core.dropped
    assert core.ready[0].version_admitted == 0
    versions = core.ready[0].trajectories[0].versions
    assert 0 in set(versions.tolist())  # the version-0 tokens are kept, as they were made
    assert identity_holds(core)


def test_within_the_bound_nothing_is_dropped_early(tmp_path):
    core = make_core(tmp_path, "staleness.max_staleness=3")
    gid = dispatched_groups(list(core.dispatch()))[0]
    generated(core, gid, 0, "finished")
    core.pause("abort")
    core.resume(3)  # 3 - 0 = 3: still trainable
    finish(core, gid, [0.0, 1.0])
    assert [g.group_id for g in core.ready] == [gid] and not core.dropped


# -- invalid samples (issue 35) ------------------------------------------------------------------


@pytest.mark.parametrize("ids, logprobs, version, why", [
    ([2**30], [-0.1], 0, "token id 1073741824 is outside the vocabulary"),
    ([-1], [-0.1], 0, "token id -1 is negative"),
    ([5], [-0.1], 7, "weight version 7 is in the future (latest 1)"),
    ([5], [float("nan")], 0, "log-prob is NaN"),
])
def test_a_sample_an_agent_loop_spoiled_drops_its_group_as_invalid(tmp_path, ids, logprobs,
                                                                   version, why):
    """A buggy or hostile agent loop returns a row the trainer cannot take (a token id past the
    vocabulary crashed the trainer with an IndexError): its group is dropped, reason
    "invalid", logged with the worker it came from; its sample still out is dropped as
    "invalid" when it comes back; nothing is scored; the identity holds."""
    from rollmesh.core.trajectory import append_tokens

    core = make_core(tmp_path)
    events = []
    core.log = type("L", (), {"error": lambda self, ev, **kw: events.append((ev, kw)),
                              "info": lambda self, ev, **kw: None,
                              "warning": lambda self, ev, **kw: None})()
    gid = dispatched_groups(list(core.dispatch()))[0]
    agent = worker(core, b"agent")
    first, second = [t for t in agent.out.values() if t.group_id == gid]
    first.token_ids = first.token_ids.astype(np.int64)  # 2**30 fits a row's int32 too
    append_tokens(first, ids, logprobs, version)
    first.status = "finished"
    assert core.returned(agent, first)
    assert gid not in core.groups and core.stale_out == {gid: (1, "invalid")}
    assert [(ev, kw["worker"], kw["group"]) for ev, kw in events] == [
        ("sample_invalid", "agent-0", gid)]
    assert why in events[0][1]["why"]
    append_tokens(second, [5], [-0.1], 0)
    second.status = "finished"
    assert core.returned(agent, second)
    assert dict(core.dropped) == {"invalid": 2} and core.stale_out == {}
    assert not any(isinstance(s.msg, Score) and s.msg.trajectory.group_id == gid
                   for s in core.dispatch())
    assert identity_holds(core)


def test_a_reward_that_is_not_a_finite_number_drops_its_group_as_invalid(tmp_path):
    core = make_core(tmp_path)
    gid = dispatched_groups(list(core.dispatch()))[0]
    finish(core, gid, [1.0, float("inf")])
    assert gid not in core.groups and not core.ready_groups()
    assert dict(core.dropped) == {"invalid": 2}
    assert identity_holds(core)
