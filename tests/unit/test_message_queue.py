"""The MessageQueue's durability and its hand-out protocol with the trainer (issue 9).

In-process: replay after a reopen, torn tails, compaction keeping the disk bounded, hand-out
kept per step until committed. Real processes: the MessageQueue role killed with SIGKILL and
respawned at the same address keeps its groups and counters; a "restarted trainer" (a new
client) asking for the same step gets the very same groups; a commit removes them from the log;
the accounting identity holds throughout."""

from __future__ import annotations

import asyncio
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest

from rollmesh.core.accounting import QueueStatus
from rollmesh.config import load_experiment, to_dict
from rollmesh.runtime.durable_log import HEADER, DurableLog
from rollmesh.mq.store import LOG_NAME, MessageQueue, decode_entry, encode_entry
from rollmesh.wire.messages import Batch, Group, StatsRequest, Trajectory
from rollmesh.launcher.supervisor import Supervisor
from rollmesh.wire.transport import RpcClient, free_port
from tests.helpers.queue import Trainer

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def group(i: int, version: int = 0, size: int = 2, tokens: int = 24,
          admitted: int | None = None) -> Group:
    """Group i, its tokens made at `version`, admitted at `admitted` (default: `version`)."""
    admitted = version if admitted is None else admitted
    rng = np.random.default_rng(i)
    prompt = tokens // 3
    trajs = [Trajectory(
        sample_id=f"s-{i:05d}-{j}", group_id=f"g-{i:05d}",
        token_ids=rng.integers(0, 1000, tokens).astype(np.int32),
        logprobs=-rng.random(tokens).astype(np.float32),
        versions=np.where(np.arange(tokens) < prompt, -1, version).astype(np.int32),
        loss_mask=(np.arange(tokens) >= prompt).astype(np.uint8), prompt_len=prompt, index=j,
        status="finished", reward=float(j % 2), reward_status="ok", metadata={"row": i})
        for j in range(size)]
    return Group(group_id=f"g-{i:05d}", trajectories=trajs, version_admitted=admitted)


def ids(groups: list[Group]) -> list[str]:
    return [g.group_id for g in groups]


def balance(s: dict) -> int:
    """put - (consumed + depth + dropped): 0 when the queue accounts for every sample."""
    return QueueStatus.parse(s).off


def durable_view(stats: dict) -> dict:
    """What must survive a restart (rates and this process's own counters left out)."""
    keep = ("depth_groups", "depth_samples", "version", "put_samples", "consumed_samples",
            "dropped", "rejected_puts", "staleness_hist", "admission_age_hist",
            "pending_batches", "pending_samples",
            "committed_step")
    return {k: stats[k] for k in keep}


# -- in-process ----------------------------------------------------------------------------------


def test_reopened_queue_has_its_groups_hand_outs_counters_and_version(tmp_path):
    q = MessageQueue(100, 1, measure="oldest_token", state_dir=tmp_path)
    for i in range(8):
        assert q.put(group(i))
    first = q.take(2, 0, step=1)
    q.take(1, 0)  # untracked (step 0): gone once handed out
    q.set_version(2)
    assert q.drop_stale(2) == 2 * 5  # the five groups left, made at version 0: stale at 2
    for i in range(8, 11):
        q.put(group(i, version=2))
    before = q.stats()
    assert balance(before) == 0 and before["dropped"] == {"stale": 10}
    q.close()

    again = MessageQueue(100, 1, measure="oldest_token", state_dir=tmp_path)
    after = again.stats()
    assert durable_view(after) == durable_view(before)
    assert after["replayed_records"] > 0
    assert ids(again.take(3, 2, step=2)) == ["g-00008", "g-00009", "g-00010"]
    assert ids(again.redeliver(1).groups) == ids(first)
    assert again.redeliver(1).groups[0].trajectories[1].token_ids.tolist() == \
        first[0].trajectories[1].token_ids.tolist()
    again.close()


def test_a_torn_last_record_loses_only_that_record(tmp_path):
    q = MessageQueue(100, 1, state_dir=tmp_path)
    for i in range(5):
        q.put(group(i))
    q.close()
    path = tmp_path / LOG_NAME
    path.write_bytes(path.read_bytes()[:-10])  # the last put was being written at the kill
    again = MessageQueue(100, 1, state_dir=tmp_path)
    assert again.stats()["depth_groups"] == 4 and again.put_samples == 8
    assert again.journal.discarded_bytes > 0
    assert again.put(group(4))  # accepted again: it was never acknowledged
    assert ids(again.take(5, 0)) == [f"g-{i:05d}" for i in range(5)]
    again.close()


def test_a_put_retried_after_a_restart_is_not_queued_twice(tmp_path):
    q = MessageQueue(100, 1, state_dir=tmp_path)
    assert q.put(group(1))
    q.close()
    again = MessageQueue(100, 1, state_dir=tmp_path)
    assert again.put(group(1))  # the reply was lost, the rollouter sends it again
    assert again.stats()["depth_groups"] == 1 and again.put_samples == 2
    assert again.duplicate_puts == 1 and balance(again.stats()) == 0
    again.close()


def test_compaction_keeps_the_log_within_its_bound_over_ten_thousand_puts(tmp_path):
    """Bound: file <= max(2 x (live + 4 KiB + the ids ever put), floor) + one record. Here live
    is at most 4 groups of ~600 bytes, the 10,000 ids take ~90 KiB, the floor is 64 KiB."""
    floor = 64 << 10
    q = MessageQueue(100, 1, state_dir=tmp_path, compact_floor_bytes=floor)
    biggest = live = 0
    for i in range(10_000):
        q.put(group(i))
        if i % 2:
            step = i // 2 + 1  # a trainer checkpointing every step: step - 1 committed
            q.commit(step - 1)
            q.take(2, 0, step=step)
        biggest = max(biggest, q.journal.size)
        live = max(live, q.live_bytes)
    one_record = HEADER.size + len(encode_entry(["put", 0, group(0)]))
    ids_bytes = sum(len(f"g-{i:05d}") + 2 for i in range(10_000))
    bound = max(2 * (live + 4096 + ids_bytes), floor) + one_record
    assert biggest <= bound < 256 << 10, (biggest, bound)
    assert q.journal.appended_records == 10_000 + 5_000 + 4_999  # puts, takes, commits
    assert q.journal.compactions >= 10
    s = q.stats()
    assert s["consumed_samples"] == 20_000 and s["pending_batches"] == 1 and balance(s) == 0
    q.close()
    again = MessageQueue(100, 1, state_dir=tmp_path, compact_floor_bytes=floor)
    assert durable_view(again.stats()) == durable_view(s)
    assert ids(again.redeliver(5000).groups) == ["g-09998", "g-09999"]
    again.close()


def test_a_queue_killed_after_recycled_compactions_replays_to_the_same_state(tmp_path):
    """The log is recycled (each compaction writes over the file the one before replaced):
    a kill at any point replays the groups, the hand-outs kept, the counters and the version,
    never a record of a file's earlier life; the log and its spare stay within two bounds."""
    floor = 16 << 10
    q = MessageQueue(1000, 1, state_dir=tmp_path / "q", compact_floor_bytes=floor)
    kills = 0
    for i in range(3000):
        q.put(group(i, version=i // 500))
        if i % 2 and i % 10 != 9:  # a few groups more put than taken: the queue grows
            step = i // 2 + 1
            q.commit(step - 2)  # two steps kept at a time
            q.take(2, i // 500, step=step)
        if i % 250 == 0:
            q.set_version(i // 500)
        if i % 97 == 0 and q.journal.compactions >= 2:  # killed here: the files as they are
            copy = tmp_path / f"kill{kills}"
            shutil.copytree(tmp_path / "q", copy)
            again = MessageQueue(1000, 1, state_dir=copy, compact_floor_bytes=floor)
            assert durable_view(again.stats()) == durable_view(q.stats())
            assert sorted(again.pending) == sorted(q.pending)
            for step, p in q.pending.items():
                assert ids(again.redeliver(step).groups) == ids(p.groups)
            assert ids(g for _, g in again.queued.values()) == \
                ids(g for _, g in q.queued.values())
            again.close()
            kills += 1
    assert kills >= 10 and q.journal.compactions >= 10 and q.journal.salt == q.journal.compactions
    bound = max(2 * (q.live_bytes + 4096 + q._seen_bytes), floor) + 4096
    files = {f.name: f.stat().st_size for f in (tmp_path / "q").iterdir()}
    assert set(files) == {LOG_NAME, LOG_NAME + ".compact"}  # the log and its spare
    assert max(files.values()) <= bound, (files, bound)
    s = q.stats()
    q.close()
    assert [f.name for f in (tmp_path / "q").iterdir()] == [LOG_NAME]  # spare deleted
    again = MessageQueue(1000, 1, state_dir=tmp_path / "q", compact_floor_bytes=floor)
    assert durable_view(again.stats()) == durable_view(s) and again.journal.discarded_bytes == 0
    again.close()


def test_a_batch_is_kept_per_step_until_a_checkpoint_covers_it(tmp_path):
    q = MessageQueue(100, 1, state_dir=tmp_path)
    for i in range(6):
        q.put(group(i))
    q.take(2, 0, step=1)
    b2 = q.take(2, 0, step=2)
    assert q.consumed_samples == 8 and sorted(q.pending) == [1, 2]
    assert ids(q.redeliver(2).groups) == ids(b2)  # counted once
    assert q.consumed_samples == 8 and q.redelivered_batches == 1
    q.commit(1)
    assert q.redeliver(1) is None and sorted(q.pending) == [2]
    # a step a checkpoint already covers is handed new data and not kept
    assert ids(q.take(1, 0, step=1)) == ["g-00004"] and sorted(q.pending) == [2]
    q.compact()
    q.close()
    entries = [decode_entry(p) for p in DurableLog.open(tmp_path / LOG_NAME)[1]]
    held = [e[2].group_id for e in entries if e[0] == "put"]
    assert held == ids(b2) + ["g-00005"]  # b1 and g-00004 are gone (only their ids remain)
    assert set(entries[-1][1]["seen_ids"]) == {f"g-{i:05d}" for i in range(6)}


def test_uncommitted_hand_outs_are_bounded(tmp_path):
    q = MessageQueue(100, 1, state_dir=tmp_path, max_pending_batches=3)
    for i in range(10):
        q.put(group(i))
    for step in range(1, 6):
        q.take(1, 0, step=step)
    assert sorted(q.pending) == [3, 4, 5] and q.evicted_batches == 2
    assert balance(q.stats()) == 0
    q.close()
    assert sorted(MessageQueue(100, 1, state_dir=tmp_path).pending) == [3, 4, 5]


# -- real processes ------------------------------------------------------------------------------


def experiment(*overrides: str):
    return load_experiment(ROOT / "configs/tiny_cpu.toml",
                           overrides=["staleness.max_staleness=1", *overrides])


def spawn_queue(sup: Supervisor, state_dir: Path, overrides: tuple[str, ...] = (),
                instance: int = 0, **config):
    """A MessageQueue process over the test experiment with `overrides` (KEY=VALUE)."""
    return sup.spawn("message_queue", "rollmesh.mq.role:main", env=ENV, instance=instance,
                     config={"experiment": to_dict(experiment(*overrides)),
                             "bind": f"tcp://127.0.0.1:{free_port()}",
                             "state_dir": str(state_dir), **config})


async def kill_and_respawn(sup: Supervisor, child):
    child.process.send_signal(signal.SIGKILL)
    assert await asyncio.to_thread(child.process.wait) == -signal.SIGKILL
    child = sup.respawn(child)  # same spec: same address, same state directory
    await sup.wait_ready(child, 60)
    return child


async def get(trainer: Trainer, step: int, committed: int, n: int = 2,
              version: int = 0) -> Batch:
    batch = await trainer.take(step, committed, groups=n, version=version)
    assert batch is not None, f"no batch of {n} groups for step {step}"
    return batch


async def stats(client: RpcClient) -> dict:
    return (await client.request(StatsRequest())).values


def test_a_group_generated_again_after_it_was_trained_on_is_not_queued(tmp_path):
    """A rollouter killed between the queue's accept and its own journal generates the group
    again under the same id; by then the first copy may be trained on and compacted away."""
    q = MessageQueue(100, 1, state_dir=tmp_path)
    assert q.put(group(1)) and q.put(group(2))
    q.take(2, 0, step=1)
    q.commit(1)
    q.compact()
    q.close()
    again = MessageQueue(100, 1, state_dir=tmp_path)
    assert again.put(group(1))  # accepted (the sender must not retry forever) ...
    s = again.stats()
    assert s["depth_groups"] == 0 and s["duplicate_puts"] == 1  # ... but not queued again
    assert s["consumed_samples"] == s["put_samples"] and balance(s) == 0
    again.close()


def test_the_oldest_generated_groups_are_handed_out_first(tmp_path):
    """A group put late (its answers were resumed across an engine restart) but generated at
    an older version goes out before fresher ones put before it: it meets its deadline instead
    of going stale one version later. Same version: put order. The order survives a reopen."""
    q = MessageQueue(100, 1, state_dir=tmp_path)
    for i, v in enumerate([2, 2, 1, 2, 1]):
        assert q.put(group(i, version=v))
    assert ids(q.take(1, version=2)) == ["g-00002"]
    q.close()
    again = MessageQueue(100, 1, state_dir=tmp_path)
    assert ids(again.take(2, version=2)) == ["g-00004", "g-00000"]
    assert ids(again.take(2, version=3)) == ["g-00001", "g-00003"]
    assert again.stats()["dropped"] == {} and balance(again.stats()) == 0
    again.close()


def test_admission_measure_keeps_long_groups_orders_by_admission_and_counts_both_ages(tmp_path):
    """Under `staleness.measure = "admission"` a group whose tokens are older than the bound
    is handed out, not dropped; the earliest admitted goes first; the two ages it had when
    handed out (staleness: of its oldest token; age since admission) are counted, and both
    histograms survive a reopen. Under `oldest_token` the same group is dropped."""
    q = MessageQueue(100, 1, measure="admission", state_dir=tmp_path)
    q.put(group(0, version=4, admitted=4))  # short: admitted and made at 4
    q.put(group(1, version=1, admitted=0))  # long: admitted at 0, oldest token from 1
    q.set_version(4)
    assert q.drop_stale(4) == 0
    assert ids(q.take(1, version=4)) == ["g-00001"]  # admitted first
    s = q.stats()
    assert s["staleness_hist"] == {"3": 2} and s["admission_age_hist"] == {"4": 2}
    assert s["dropped"] == {} and s["staleness_measure"] == "admission" and balance(s) == 0
    q.close()
    again = MessageQueue(100, 1, measure="admission", state_dir=tmp_path)
    assert durable_view(again.stats()) == durable_view(s)
    again.compact()  # the counters record carries both histograms
    again.close()
    third = MessageQueue(100, 1, measure="admission", state_dir=tmp_path)
    assert third.stats()["admission_age_hist"] == {"4": 2}
    third.close()

    strict = MessageQueue(100, 1, measure="oldest_token")
    strict.put(group(1, version=1, admitted=0))
    assert strict.take(1, version=4) is None and strict.dropped["stale"] == 2


def test_an_unknown_staleness_measure_is_refused_by_name():
    with pytest.raises(ValueError, match="'newest'"):
        MessageQueue(10, 1, measure="newest")
