"""End-to-end tests of message_queue (they start processes); the unit tests and the
helpers they share are in tests/unit/test_message_queue.py."""

from __future__ import annotations

import shutil

import pytest

from rollmesh.config import to_dict
from rollmesh.mq.store import LOG_NAME, MessageQueue, decode_entry
from rollmesh.runtime.durable_log import DurableLog
from rollmesh.wire.messages import WeightVersion
from rollmesh.wire.transport import RpcClient, free_port
from tests.helpers.queue import Trainer, put_group
from tests.unit.test_message_queue import (
    ENV,
    balance,
    durable_view,
    get,
    group,
    ids,
    kill_and_respawn,
    spawn_queue,
    stats,
)
from tests.unit.test_trainer import with_supervisor


@pytest.mark.slow
def test_killed_queue_comes_back_at_its_address_with_its_groups_and_counters(tmp_path):
    async def body(t, sup):
        # the oldest-token rule, which drops at a new version (the admission rule never does)
        mq = spawn_queue(sup, tmp_path / "mq", ("staleness.measure=oldest_token",))
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
    from tests.unit.test_trainer import experiment as trainer_experiment
    from tests.unit.test_trainer import (
        make_groups,
        read_metrics,
        reference_run,
        spawn_trainers,
        wait_exit,
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
    # step 2's request says "checkpoint at step 1" only if that checkpoint, written in the
    # background, was already latest: then step 1 is forgotten; step 2 is held either way
    assert end["committed_step"] in (0, 1)
    assert end["pending_batches"] == 2 - end["committed_step"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_launcher_restarts_a_killed_queue_and_the_run_completes_accounting_for_everything(
        tmp_path):
    from tests.e2e.test_launcher import (
        assert_nothing_trained_twice,
        check_accounting,
        finish,
        kill_and_await_restart,
        launch,
        metrics,
        wait_for,
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
