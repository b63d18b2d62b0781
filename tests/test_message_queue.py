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
from rollmesh.wire.messages import Batch, Group, StatsRequest, Trajectory, WeightVersion
from rollmesh.launcher.supervisor import Supervisor
from rollmesh.wire.transport import RpcClient, free_port
from tests.helpers.queue import Trainer, put_group
from tests.test_trainer import with_supervisor

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def group(i: int, version: int = 0, size: int = 2, tokens: int = 24) -> Group:
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
    return Group(group_id=f"g-{i:05d}", trajectories=trajs)


def ids(groups: list[Group]) -> list[str]:
    return [g.group_id for g in groups]


def balance(s: dict) -> int:
    """put - (consumed + depth + dropped): 0 when the queue accounts for every sample."""
    return QueueStatus.parse(s).off


def durable_view(stats: dict) -> dict:
    """What must survive a restart (rates and this process's own counters left out)."""
    keep = ("depth_groups", "depth_samples", "version", "put_samples", "consumed_samples",
            "dropped", "rejected_puts", "staleness_hist", "pending_batches", "pending_samples",
            "committed_step")
    return {k: stats[k] for k in keep}


# -- in-process ----------------------------------------------------------------------------------


def test_reopened_queue_has_its_groups_hand_outs_counters_and_version(tmp_path):
    q = MessageQueue(100, 1, state_dir=tmp_path)
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

    again = MessageQueue(100, 1, state_dir=tmp_path)
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


def spawn_queue(sup: Supervisor, state_dir: Path, **config):
    return sup.spawn("message_queue", "rollmesh.mq.role:main", env=ENV, config={
        "experiment": to_dict(experiment()), "bind": f"tcp://127.0.0.1:{free_port()}",
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


@pytest.mark.slow
def test_killed_queue_comes_back_at_its_address_with_its_groups_and_counters(tmp_path):
    async def body(t, sup):
        mq = spawn_queue(sup, tmp_path / "mq")
        address = (await sup.wait_ready(mq, 60))["rpc"]
        client = RpcClient(t, address, timeout_s=5, retries=3)  # survives the restart
        for i in range(6):
            assert await put_group(client, group(i))
        trainer = Trainer(client)
        handed = await get(trainer, step=1, committed=0)
        await client.request(WeightVersion(version=2))  # the 4 groups left are now stale
        for i in range(6, 9):
            assert await put_group(client, group(i, version=2))
        before = await stats(client)
        assert before["dropped"] == {"stale": 8} and balance(before) == 0

        pid = mq.process.pid
        mq = await kill_and_respawn(sup, mq)
        after = await stats(client)  # the same client, the same address
        assert mq.process.pid != pid and mq.restarts == 1
        assert durable_view(after) == durable_view(before) and after["replayed_records"] > 0
        new = await get(trainer, step=2, committed=1, n=3, version=2)
        assert ids(new.groups) == ["g-00006", "g-00007", "g-00008"] and not new.redelivered
        assert new.groups[2].trajectories[0].token_ids.tolist() == \
            group(8).trajectories[0].token_ids.tolist()
        end = await stats(client)
        trainer.close()
        client.close()
        return handed, end

    handed, end = with_supervisor(tmp_path, body)
    assert ids(handed.groups) == ["g-00000", "g-00001"]
    # accounting: 18 samples put = 10 consumed + 8 dropped (stale) + 0 queued
    assert (end["put_samples"], end["consumed_samples"], end["depth_samples"]) == (18, 10, 0)
    assert balance(end) == 0 and end["pending_batches"] == 1 and end["committed_step"] == 1


@pytest.mark.slow
def test_a_restarted_trainer_gets_the_same_batch_for_the_same_step(tmp_path):
    async def body(t, sup):
        mq = spawn_queue(sup, tmp_path / "mq", compact_floor_bytes=1)
        address = (await sup.wait_ready(mq, 60))["rpc"]
        producer = RpcClient(t, address, timeout_s=5, retries=3)
        for i in range(8):
            assert await put_group(producer, group(i))
        client = RpcClient(t, address, timeout_s=5)
        trainer = Trainer(client)
        first = [await get(trainer, step=s, committed=s - 1) for s in (1, 2)]
        # steps 1 and 2 handed out, checkpoint at step 1 ... then step 2 is lost with the
        # trainer (its checkpoint never written) and the queue is killed as well
        third = await get(trainer, step=3, committed=1)
        trainer.close()
        client.close()
        mq = await kill_and_respawn(sup, mq)
        client = RpcClient(t, address, timeout_s=5)  # a new trainer process, from step 1
        resumed = Trainer(client)
        again = [await get(resumed, step=s, committed=1) for s in (2, 3)]
        s = await stats(producer)
        # its checkpoint at step 3 is written: the next request commits steps 2 and 3
        fourth = await get(resumed, step=4, committed=3)
        end = await stats(producer)
        resumed.close()
        client.close()
        producer.close()
        await sup.stop([mq], grace_s=10)  # the log is left for the offline look below
        return first, third, again, s, fourth, end

    first, third, again, mid, fourth, end = with_supervisor(tmp_path, body)
    assert [ids(b.groups) for b in first] == [["g-00000", "g-00001"], ["g-00002", "g-00003"]]
    assert [ids(b.groups) for b in again] == [ids(first[1].groups), ids(third.groups)]
    assert all(b.redelivered for b in again) and mid["redelivered_batches"] == 2
    assert ids(fourth.groups) == ["g-00006", "g-00007"] and not fourth.redelivered
    # counted once: 8 groups of 2 put, 8 consumed by hand-outs for 4 steps, nothing twice
    assert (end["put_samples"], end["consumed_samples"], end["depth_samples"]) == (16, 16, 0)
    assert balance(end) == 0 and end["dropped"] == {}
    assert end["pending_batches"] == 1 and end["committed_step"] == 3

    # the log holds no trace of the committed steps' groups once compacted, only step 4's
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "mq", copy)
    q = MessageQueue(100, 1, state_dir=copy)
    assert sorted(q.pending) == [4] and ids(q.pending[4].groups) == ids(fourth.groups)
    q.compact()
    q.close()
    entries = [decode_entry(p) for p in DurableLog.open(copy / LOG_NAME)[1]]
    held = [e[2].group_id for e in entries if e[0] == "put"]
    assert held == ["g-00006", "g-00007"]
    # the trained groups' ids remain, so a copy generated again is recognised, not queued
    assert set(entries[-1][1]["seen_ids"]) == {f"g-0000{i}" for i in range(8)}


@pytest.mark.slow
def test_a_real_trainer_after_a_dead_one_trains_on_the_batch_it_was_handed(tmp_path):
    """A trainer took the batch for step 1 and died before any checkpoint (played by a client
    here); the real trainer process that starts next asks for step 1 and trains on exactly that
    batch, then on the next one: its losses equal an uninterrupted run on [A, B], and the queue
    counts A once."""
    from tests.test_trainer import (
        experiment as trainer_experiment, make_groups, read_metrics, reference_run,
        spawn_trainers, wait_exit,
    )

    batches = [make_groups(30), make_groups(31)]
    exp = trainer_experiment("trainer.total_steps=2", "trainer.checkpoint_every=1")

    async def body(t, sup):
        mq = sup.spawn("message_queue", "rollmesh.mq.role:main", env=ENV, config={
            "experiment": to_dict(exp), "bind": f"tcp://127.0.0.1:{free_port()}",
            "state_dir": str(tmp_path / "mq")})
        address = (await sup.wait_ready(mq, 60))["rpc"]
        client = RpcClient(t, address, timeout_s=30)
        for g in batches[0] + batches[1]:
            assert await put_group(client, g)
        dead = await get(Trainer(client), step=1, committed=0)  # the trainer that died with it
        trainers = spawn_trainers(sup, exp, {"message_queue": address,
                                             "metrics_path": str(tmp_path / "metrics.jsonl"),
                                             "checkpoint_dir": str(tmp_path / "ckpt")})
        codes = await wait_exit(trainers)
        end = await stats(client)
        client.close()
        return dead, codes, end

    dead, codes, end = with_supervisor(tmp_path, body)
    assert ids(dead.groups) == ids(batches[0]) and codes == [0]
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    _, reference = reference_run(exp, batches)
    assert [m["step"] for m in metrics] == [1, 2]
    for got, want in zip(metrics, reference):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-7)
    samples = sum(len(g.trajectories) for b in batches for g in b)
    assert end["redelivered_batches"] == 1
    assert (end["put_samples"], end["consumed_samples"], end["depth_samples"]) == \
        (samples, samples, 0)
    assert balance(end) == 0
    # step 2's request said "checkpoint at step 1": step 1 is forgotten, step 2 is still held
    assert end["committed_step"] == 1 and end["pending_batches"] == 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_launcher_restarts_a_killed_queue_and_the_run_completes_accounting_for_everything(
        tmp_path):
    from tests.test_launcher import (
        assert_nothing_trained_twice, check_accounting, finish, kill_and_await_restart, launch,
        metrics, wait_for,
    )

    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--set", "trainer.total_steps=40")
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 3, 300, "training under way", proc)
        kill_and_await_restart(run_dir, "message_queue[0]")
    finally:
        out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, 41))
    summary = check_accounting(run_dir)  # admitted = consumed + dropped + in flight
    # every sample the queue handed out was trained on, once: none lost with the old process
    assert summary["consumed"] == metrics(run_dir)[-1]["samples_consumed"]
    assert_nothing_trained_twice(metrics(run_dir))
    log = (run_dir / "logs/message_queue-0.log").read_text()
    assert '"event": "replayed"' in log
    assert (run_dir / "message_queue" / LOG_NAME).is_file()


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
