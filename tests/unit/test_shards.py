"""Rollout shards and queue shards (issue 33), their rules without a launched run: each
rollouter's shard of the prompts and of the admission bound, the routing of its groups over the
queue shards (balanced, journaled), the queue's stale drops by rollout shard, and the trainer's
batch taken as a fixed share from each queue shard, the same groups after any restart. The
launched 2 x 2 runs with kill -9 are tests/e2e/test_shards.py."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest
import structlog

from rollmesh.config import default_shards
from rollmesh.core.trajectory import group_origin, load_tokenizer
from rollmesh.mq.client import ShardedFeed, shares
from rollmesh.mq.store import MessageQueue, default_capacity
from rollmesh.rollout.core import RolloutCore, share_of
from rollmesh.rollout.data import PromptSource
from rollmesh.rollout.journal import Journal
from rollmesh.rollout.workers import Worker
from rollmesh.wire.messages import Group, PutGroups, Trajectory
from rollmesh.wire.transport import RpcClient
from tests.helpers.rollout_stack import experiment, write_dataset
from tests.unit.test_message_queue import kill_and_respawn, spawn_queue
from tests.unit.test_rollout_core import ROWS, finish
from tests.unit.test_trainer import with_supervisor

LOG = structlog.get_logger("test")


def shard_core(tmp_path: Path, shard: int, shards: int, queues: int = 1,
               journal: Journal | None = None, *overrides: str) -> RolloutCore:
    exp = experiment(write_dataset(tmp_path / "rows.jsonl", ROWS), *overrides)
    core = RolloutCore(exp, PromptSource.from_config(exp.data, shard=shard, shards=shards),
                       load_tokenizer(exp.model), journal, LOG, shard=shard, shards=shards,
                       queues=queues)
    core.workers.add(Worker(b"agent", "agent-0", "agent", 1000))
    core.workers.add(Worker(b"reward", "reward-0", "reward", 1000))
    return core


# -- shares -----------------------------------------------------------------------------------


@pytest.mark.parametrize("total,shards", [(4, 1), (4, 2), (7, 3), (2, 5), (0, 2)])
def test_shares_sum_to_the_whole_and_differ_by_at_most_one(total, shards):
    parts = [share_of(total, j, shards) for j in range(shards)]
    assert sum(parts) == total and max(parts) - min(parts) <= 1
    assert shares(total, shards) == parts


def test_default_shard_counts_grow_with_the_cluster():
    assert default_shards(8) == (1, 1) and default_shards(600) == (1, 1)
    assert default_shards(1024) == (2, 1) and default_shards(10_000) == (17, 4)
    assert default_shards(100_000) == (167, 34)


# -- the prompts --------------------------------------------------------------------------------


def test_rollout_shards_own_disjoint_prompts_that_cover_the_dataset(tmp_path):
    exp = experiment(write_dataset(tmp_path / "rows.jsonl", ROWS))
    sources = [PromptSource.from_config(exp.data, shard=j, shards=3) for j in range(3)]
    rows = [{r.index for r in s.rows} for s in sources]
    assert set().union(*rows) == set(range(len(ROWS))) and sum(map(len, rows)) == len(ROWS)
    for j, s in enumerate(sources):
        assert all(i % 3 == j for i in rows[j])
        gid = s.next_group().group_id
        assert gid.startswith(f"s{j}-e0-r") and group_origin(gid) == j
    one = PromptSource.from_config(exp.data)
    assert group_origin(one.next_group().group_id) == 0  # e0-r..-g0, as before shards
    assert group_origin("s12-e3-r4-g5") == 12 and group_origin("sx-e0") == 0
    with pytest.raises(ValueError, match="fewer rows than rollouters"):
        PromptSource(sources[0].rows[:1], 2, shard=1, shards=2)


# -- admission: each shard its share of the bound ------------------------------------------------


def test_two_rollout_shards_together_admit_what_one_would(tmp_path):
    """max_staleness 1, batch_groups 2: one rollouter admits 4 groups at version 0; two admit
    2 each, and at version 1 (6 in all) 3 each."""
    cores = [shard_core(tmp_path, j, 2) for j in range(2)]
    for core in cores:
        list(core.dispatch())
    assert [c.running_groups for c in cores] == [2, 2]
    for core in cores:
        core.resume(1)
        list(core.dispatch())
    assert [c.running_groups for c in cores] == [3, 3]
    ids = [g for c in cores for g in c.groups]
    assert len(set(ids)) == 6 and {group_origin(g) for g in ids} == {0, 1}


# -- routing over queue shards -------------------------------------------------------------------


def test_groups_are_routed_to_the_emptiest_queue_shard_and_the_choice_is_journaled(tmp_path):
    journal = Journal(tmp_path / "journal.log", LOG)
    core = shard_core(tmp_path, 0, 1, 2, journal, "staleness.max_staleness=5",
                      "rollout.max_concurrent=64")  # 12 groups
    core.queue_depth = [5, 0]  # shard 0 holds 5 groups: the next 5 go to shard 1
    list(core.dispatch())
    by = {gid: s.queue for gid, s in core.groups.items()}
    assert len(by) == 12
    # 5 to shard 1 to even up, then in turn: 4 + 3 (shard 0 first: admission serial 6)
    assert sorted(collections.Counter(by.values()).items()) == [(0, 4), (1, 8)]
    # accepted groups wait in their shard's own `ready`
    gid = next(g for g, q in by.items() if q == 1)
    finish(core, gid, [1.0, 0.0])
    assert [g.group_id for g in core.readies[1]] == [gid] and not core.ready
    assert core.ready_groups() == 1 and core.accepted_groups() == 1
    # a restarted rollouter regenerates its open groups for the same shards
    journal.close()
    again = shard_core(tmp_path, 0, 1, 2, Journal(tmp_path / "journal.log", LOG))
    again.restore(restarted=True)
    assert {g: s.queue for g, s in again.groups.items()} == by  # gid too: not queued yet
    # ... also after a compaction
    again.journal.compact()
    again.journal.close()
    third = shard_core(tmp_path, 0, 1, 2, Journal(tmp_path / "journal.log", LOG))
    third.restore(restarted=True)
    assert {g: s.queue for g, s in third.groups.items()} == by


def test_stale_drops_are_given_back_per_queue_shard(tmp_path):
    core = shard_core(tmp_path, 1, 2, 2)
    assert core.queue_stale(3, queue=0) and core.queue_stale(2, queue=1)
    assert not core.queue_stale(2, queue=1)  # nothing new
    assert core.queue_stale_groups == 5


# -- the queue's stale drops, by rollout shard ---------------------------------------------------


def stale_group(gid: str, version: int = 0) -> Group:
    n = 6
    trajs = [Trajectory(sample_id=f"{gid}-{j}", group_id=gid,
                        token_ids=np.arange(n, dtype=np.int32),
                        logprobs=np.zeros(n, np.float32),
                        versions=np.array([-1, -1, version, version, version, version],
                                          np.int32),
                        loss_mask=np.array([0, 0, 1, 1, 1, 1], np.uint8), prompt_len=2, index=j,
                        status="finished", reward=float(j), reward_status="ok")
             for j in range(2)]
    return Group(group_id=gid, trajectories=trajs)


def test_the_queue_counts_stale_drops_by_rollout_shard_across_restarts(tmp_path):
    q = MessageQueue(16, 1, measure="oldest_token", state_dir=tmp_path)
    assert q.put_many([stale_group("s0-e0-r0-g0"), stale_group("s1-e0-r1-g0"),
                       stale_group("s1-e0-r3-g1"), stale_group("s1-e0-r5-g2", version=3)]) == 4
    assert q.drop_stale(3) == 6
    assert q.stale_by_origin == {"0": 2, "1": 4} and q.dropped["stale"] == 6
    q.close()
    again = MessageQueue(16, 1, measure="oldest_token", state_dir=tmp_path)
    assert again.stale_by_origin == {"0": 2, "1": 4}
    again.compact()
    again.close()
    third = MessageQueue(16, 1, measure="oldest_token", state_dir=tmp_path)
    assert third.stale_by_origin == {"0": 2, "1": 4} and third.depth_groups == 1
    third.close()


def test_each_queue_shard_holds_its_part_of_the_capacity(tmp_path):
    exp = experiment(write_dataset(tmp_path / "rows.jsonl", ROWS))  # (1 + 2) * 2 groups
    assert default_capacity(exp) == 6
    assert default_capacity(exp, 2) == 3 + 1 and default_capacity(exp, 4) == 2 + 1


# -- the trainer's batch across queue shards, against real queue processes -----------------------


def group_of(gid: str) -> Group:
    return stale_group(gid)


def test_a_batch_is_a_share_from_each_shard_and_the_same_after_restarts(tmp_path):
    """Two queue shards, batches of 3 groups: 2 from shard 0 and 1 from shard 1 each step. A
    shard short of groups holds the step back (the other's share is kept, not taken twice);
    a trainer restarted from its checkpoint, across a kill -9 of a shard, gets the very same
    groups for the steps after it."""
    async def body(t, sup):
        queues = [spawn_queue(sup, tmp_path / f"mq{j}", instance=j) for j in range(2)]
        addresses = [(await sup.wait_ready(q, 60))["rpc"] for q in queues]
        producers = [RpcClient(t, a, timeout_s=10, retries=3) for a in addresses]
        await producers[0].request(PutGroups(groups=[group_of(f"a{i}") for i in range(6)]))
        await producers[1].request(PutGroups(groups=[group_of("b0")]))
        consumers = [RpcClient(t, a, timeout_s=10) for a in addresses]
        feed = ShardedFeed(consumers, 3)
        first = await feed.get(1, 0, 2, 0, timeout_s=10)
        short = await feed.get(2, 0, 3, 0, timeout_s=1.0)  # shard 1 has nothing for step 2
        await producers[1].request(PutGroups(groups=[group_of("b1"), group_of("b2")]))
        second = await feed.get(2, 0, 3, 0, timeout_s=10)
        third = await feed.get(3, 0, 3, 1, timeout_s=10)  # checkpoint at step 1
        feed.close()
        queues[1] = await kill_and_respawn(sup, queues[1])
        restarted = ShardedFeed(consumers, 3)  # the trainer, back from its step-1 checkpoint
        again = [await restarted.get(s, 0, 3, 1, timeout_s=10) for s in (2, 3)]
        restarted.close()
        for c in (*producers, *consumers):
            c.close()
        return first, short, second, third, again

    first, short, second, third, again = with_supervisor(tmp_path, body)
    ids = [[g.group_id for g in b.groups] for b in (first, second, third)]
    assert ids[0] == ["a0", "a1", "b0"] and short is None
    assert ids[1] == ["a2", "a3", "b1"] and ids[2] == ["a4", "a5", "b2"]
    assert [[g.group_id for g in b.groups] for b in again] == ids[1:]
    assert all(b.redelivered for b in again)


def test_a_batch_smaller_than_the_shards_is_refused():
    with pytest.raises(ValueError, match="at least the number of queue shards"):
        ShardedFeed([None, None, None], 2)  # type: ignore[list-item]


def test_without_a_rollouter_shard_count_the_routing_is_the_one_queue(tmp_path):
    core = shard_core(tmp_path, 0, 1)
    list(core.dispatch())
    assert {s.queue for s in core.groups.values()} == {0} and core.route() == 0


def test_a_resumed_run_keeps_its_shard_counts():
    from rollmesh.config import ConfigError, load_cluster
    from rollmesh.launcher.commands import _same_shards

    root = Path(__file__).resolve().parents[2]
    saved = load_cluster(root / "launch/local.toml", machine_problems=[])
    same = load_cluster(root / "launch/local.toml", ["trainer.total_steps=3"],
                        machine_problems=[])
    _same_shards(same, saved)
    more = load_cluster(root / "launch/local.toml", ["roles.message_queue.count=2"],
                        machine_problems=[])
    with pytest.raises(ConfigError, match=r"roles.message_queue.count: expected 1 \(a resumed "
                                          r"run keeps its shard counts.*got 2"):
        _same_shards(more, saved)


def test_an_exit_by_a_signal_is_told_from_an_error_exit():
    from rollmesh.launcher.supervisor import killed

    assert killed(-9) and killed(137) and killed(143)  # local child; through ssh or srun
    assert not killed(0) and not killed(1) and not killed(2) and not killed(None)
