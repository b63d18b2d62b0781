"""Rewind (issue 34): a trainer that resumes at an older weight version than the rollout side's
(the run was cut, or the trainer died, past its checkpoint) takes the rollouter and the
MessageQueue back to its version, and what the lost versions admitted or generated is dropped
once, reason "lost_weights"; the rest is kept, and the batches the queue handed out and the
trainer trains again stay as they were."""

from __future__ import annotations

from rollmesh.core.trajectory import append_tokens, made_after
from rollmesh.mq.store import MessageQueue
from rollmesh.rollout.journal import Journal
from rollmesh.wire.messages import Scored
from tests.unit.test_message_queue import balance, group, ids
from tests.unit.test_rollout_core import (
    LOG, dispatched_groups, generated, identity_holds, make_core, worker,
)


def test_made_after_reads_generated_tokens_only():
    g = group(1, version=3)
    assert made_after(g, 2) and not made_after(g, 3)
    assert not made_after(group(2, version=0), 0)  # prompt tokens (-1) never count


def test_queue_rewind_drops_what_newer_weights_made_keeps_hand_outs_and_survives_a_restart(
        tmp_path):
    q = MessageQueue(100, 1, state_dir=tmp_path)
    for i, (v, admitted) in enumerate([(2, 2), (3, 3), (4, 4), (5, 5), (4, 6), (2, 2)]):
        assert q.put(group(i, version=v, admitted=admitted))
    q.set_version(6)
    handed = q.hand_out(1, 2, 6)  # the two oldest, trained at version 6 by the lost trainer
    assert handed is not None and ids(handed[0]) == ["g-00000", "g-00005"]
    before = q.stats()
    # the trainer resumes at version 3: groups with tokens of 4 and 5, or admitted at 6, go
    assert q.rewind(3) == 3 * 2
    s = q.stats()
    assert s["version"] == 3 and s["dropped"] == {"lost_weights": 6}
    assert s["depth_groups"] == 1 and balance(s) == 0
    assert s["put_samples"] == before["put_samples"]
    # its places in the bound go back to the rollouter (counted with the stale drops)
    assert q.stale_by_origin == {"0": 6}
    # the batch handed out for step 1 is handed again as it was (the step is trained again)
    again = q.hand_out(1, 2, 3)
    assert again is not None and ids(again[0]) == ["g-00000", "g-00005"] and again[2]
    assert q.rewind(3) == 0  # once
    q.close()
    reopened = MessageQueue(100, 1, state_dir=tmp_path)
    r = reopened.stats()
    assert r["version"] == 3 and r["dropped"] == {"lost_weights": 6} and r["depth_groups"] == 1
    assert reopened.stale_by_origin == {"0": 6}
    reopened.compact()
    reopened.close()
    compacted = MessageQueue(100, 1, state_dir=tmp_path)
    assert compacted.stats()["version"] == 3 and compacted.stale_by_origin == {"0": 6}
    compacted.close()


def test_rollouter_rewind_drops_running_and_ready_groups_of_the_lost_versions(tmp_path):
    core = make_core(tmp_path, "staleness.max_staleness=3", "rollout.max_concurrent=8")
    core.version = 2  # admitted at version 2, generated on through syncs to 4
    gids = dispatched_groups(list(core.dispatch()))
    core.version = 4
    assert len(gids) >= 4
    clean, lost_tokens, young, ready_lost = gids[:4]
    core.groups[young].version_admitted = 5  # admitted by a version the rewind goes back from
    core.pause("abort")
    generated(core, clean, 2, "interrupted")  # tokens of version 2: kept
    generated(core, lost_tokens, 4, "interrupted")  # tokens of version 4: made by lost weights
    generated(core, young, None, "interrupted")
    # a group accepted, not yet in a put, with tokens of version 4
    generated(core, ready_lost, 4, "finished")
    scorer = worker(core, b"reward")
    for send in list(core.dispatch()):
        traj = send.msg.trajectory
        if traj.group_id == ready_lost:
            core.scored(scorer, Scored(sample_id=traj.sample_id, reward=1.0, reward_status="ok"))
    assert [g.group_id for g in core.ready] == [ready_lost]
    others = [g for g in gids[4:]]
    for gid in others:
        generated(core, gid, 3, "interrupted")  # tokens of version 3: kept
    assert core.rewind(3) == 2
    assert core.version == 3 and core.journal.version == 3
    assert clean in core.groups and all(g in core.groups for g in others)
    assert lost_tokens not in core.groups and not core.ready
    assert dict(core.dropped) == {"lost_weights": 4}
    # admitted by a lost version, nothing generated: it waits for version 5
    assert young in core.groups and {t.group_id for t in core.waiting} == {young}
    assert identity_holds(core)
    core.resume(3)
    # the kept ones go on at version 3
    assert {clean, *others} <= set(dispatched_groups(list(core.dispatch())))


def test_a_sample_back_after_a_rewind_dropped_its_group_is_dropped_as_lost_weights(tmp_path):
    core = make_core(tmp_path)
    core.version = 1
    gid = dispatched_groups(list(core.dispatch()))[0]
    core.version = 2
    agent = worker(core, b"agent")
    first, second = [t for t in agent.out.values() if t.group_id == gid]
    append_tokens(first, [5], [-0.1], 2)
    first.status = "interrupted"
    assert core.returned(agent, first)
    core.pause("abort")  # `second` is still out (a loop that holds it through the sync)
    core.rewind(1)
    assert gid not in core.groups and core.stale_out == {gid: (1, "lost_weights")}
    second.status = "finished"
    assert core.returned(agent, second)
    assert dict(core.dropped) == {"lost_weights": 2} and core.stale_out == {}
    assert identity_holds(core)


def test_a_ready_group_in_a_put_is_left_to_the_queue(tmp_path):
    core = make_core(tmp_path)
    core.version = 1
    gid = dispatched_groups(list(core.dispatch()))[0]
    core.version = 2
    generated(core, gid, 2, "finished")
    scorer = worker(core, b"reward")
    for send in list(core.dispatch()):
        core.scored(scorer, Scored(sample_id=send.msg.trajectory.sample_id, reward=1.0,
                                   reward_status="ok"))
    assert len(core.ready) == 1
    core.sending[0].add(id(core.ready[0]))  # the put loop has it in a put not yet answered
    core.rewind(1)
    assert len(core.ready) == 1 and not any(core.dropped.values())  # the queue's rewind drops it there
    assert identity_holds(core)


def test_the_journal_replays_a_rewind(tmp_path):
    j = Journal(tmp_path / "rollouter.log", LOG)
    j.new_version(7)
    j.rewound(3)
    j.close()
    again = Journal(tmp_path / "rollouter.log", LOG)
    assert again.version == 3
    again.compact()
    again.close()
    assert Journal(tmp_path / "rollouter.log", LOG).version == 3


def test_groups_admitted_after_the_rewind_version_wait_for_it_with_nothing_generated(tmp_path):
    """What a relaunched rollouter regenerates (admitted by the lost versions, nothing
    generated: it waits paused for the trainer) is not dropped, whose first copy the queue may
    hold, but waits until the version comes back to its own, and is generated then."""
    core = make_core(tmp_path, "rollout.max_concurrent=4")
    core.version = 5
    gids = dispatched_groups(list(core.dispatch()))
    core.pause("abort")
    generated(core, gids[0], None, "interrupted")  # back with nothing generated
    early = [gid for gid in gids if gid != gids[0]]
    for gid in early:
        generated(core, gid, None, "interrupted")
    assert core.rewind(3) == 0 and not any(core.dropped.values())
    core.resume(3)
    assert len(core.waiting) == 2 * len(gids) and not dispatched_groups(list(core.dispatch()))
    assert identity_holds(core)
    core.pause("abort")
    core.resume(4)
    assert not dispatched_groups(list(core.dispatch()))
    core.pause("abort")
    core.resume(5)  # their version: generated now
    assert set(dispatched_groups(list(core.dispatch()))) == set(gids)
    assert not core.waiting and identity_holds(core)
