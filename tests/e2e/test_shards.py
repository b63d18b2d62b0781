"""Rollout shards and queue shards in launched runs (issue 33): 2 rollouters x 2 queue shards of
the embedded default, with kill -9 of one rollout shard, one queue shard and the trainer in the
middle of the run. The launcher restarts each; nothing is lost (the identity holds in total and
on each shard), nothing is trained twice, the steps trained again after the trainer's restart
are trained on the same groups from both queue shards, and every queue shard hands out exactly
its share of every batch. The rules without processes are tests/unit/test_shards.py."""

from __future__ import annotations

import collections
import json

import pytest

from rollmesh.core.accounting import Identity
from rollmesh.core.trajectory import group_origin
from tests.e2e.test_launcher import (
    assert_nothing_trained_twice, check_accounting, finish, kill_and_await_restart, launch,
    metrics, wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CLUSTER = "launch/shards_local.toml"  # the embedded default, 2 rollouters x 2 queue shards


@pytest.mark.long
def test_two_by_two_shards_survive_kill_9_of_a_rollouter_a_queue_shard_and_the_trainer(
        tmp_path):
    run_dir = tmp_path / "run"
    steps, every = 28, 4
    proc = launch(run_dir, "--set", f"trainer.total_steps={steps}",
                  "--set", f"trainer.checkpoint_every={every}", "--set", "rollout.eval_every=0",
                  cluster=CLUSTER)
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 4, 300, "training under way", proc)
        kill_and_await_restart(run_dir, "rollouter[1]")
        wait_for(lambda: len(metrics(run_dir)) >= 10, 300, "training after the rollouter", proc)
        kill_and_await_restart(run_dir, "message_queue[0]")
        # past a checkpoint and not on one: some steps die with the trainer
        wait_for(lambda: len(metrics(run_dir)) >= 15 and len(metrics(run_dir)) % every != 0,
                 300, "training past a checkpoint", proc)
        before = metrics(run_dir)
        resumed_from = (before[-1]["step"] // every) * every
        kill_and_await_restart(run_dir, "trainer[0]")
    finally:
        out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), "each step once, in order"
    # the steps trained again were trained on the very same groups, from both queue shards
    lost = {b["step"]: b["group_ids"] for b in before if b["step"] > resumed_from}
    assert lost and all(r["group_ids"] == lost[r["step"]] for r in rows if r["step"] in lost)
    assert_nothing_trained_twice(rows)

    summary = check_accounting(run_dir)  # the identity, in total
    assert summary["consumed"] == rows[-1]["samples_consumed"], summary
    assert summary["shards"] == {"rollouter": 2, "message_queue": 2}
    group_size = rows[0]["samples"] // len(rows[0]["group_ids"])
    queues, rollouters = summary["balances"]["message_queue"], summary["balances"]["rollouter"]
    assert [q["shard"] for q in queues] == [0, 1] and [r["shard"] for r in rollouters] == [0, 1]
    for q in queues:  # a fixed share of each batch: 2 groups of the 4, each counted once
        assert q["consumed"] == steps * 2 * group_size and q["off"] == 0, q
        assert q["put"] == q["consumed"] + q["depth"] + sum(q["dropped"].values()), q
    for r in rollouters:  # each rollout shard balances on its own
        assert r["off"] == 0 and r["admitted"] > 0, r
        assert r["admitted"] == r["in_flight"] + sum(r["dropped"].values()) + r["queued"], r
    # both rollout shards fed the training, and each prompt came from its own shard's rows
    origins = collections.Counter(group_origin(g) for r in rows for g in r["group_ids"])
    assert set(origins) == {0, 1} and min(origins.values()) >= steps, origins
    for r in rows:
        for gid in r["group_ids"]:
            row = int(gid.split("-r", 1)[1].split("-", 1)[0])
            assert row % 2 == group_origin(gid), gid
    # the restarted rollouter and queue shard came back from their own state
    restored = [json.loads(line) for line in (run_dir / "logs/rollouter-1.log").open()
                if '"event": "restored"' in line]
    assert restored and restored[-1]["admitted"] > 0
    assert '"event": "replayed"' in (run_dir / "logs/message_queue-0.log").read_text()
    assert (run_dir / "rollouter-1" / "rollouter.log").is_file()
    assert (run_dir / "message_queue-1").is_dir()
    assert Identity.from_summary(summary).difference == 0
