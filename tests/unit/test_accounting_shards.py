"""The accounting over a role's shards: the typed statuses combined, whole stats dicts merged
(rollmesh.core.accounting), each shard's balance (rollmesh.launcher.summary), and the monitor's
totals and per-shard lines (rollmesh.observe.monitor, rollmesh.observe.render)."""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace

import pytest
from rich.console import Console

from rollmesh.config.cluster import Process
from rollmesh.config.roles import ROLE
from rollmesh.core.accounting import (
    MERGE_RULES, Identity, QueueStatus, RolloutStatus, identity, merge_values,
)
from rollmesh.launcher.plan import Planned
from rollmesh.observe.monitor import StatusBoard
from rollmesh.observe.render import render
from rollmesh.launcher.summary import (
    WHOLE_STATS, collect_accounting, shard_balances, snapshot, summary_json,
)
from rollmesh.wire.messages import Metrics, Pause, Paused, StatsRequest
from rollmesh.wire.transport import RpcServer, Transport

# Two rollouter shards as RolloutCore.stats reports them (with every key it has), each
# balancing: shard 0: 64 admitted = 12 in flight + 6 dropped + 46 queued; shard 1: 40 = 9 in
# flight + 3 dropped + 28 queued.
R0 = {
    "admitted_groups": 16, "admitted_samples": 64, "accepted_groups": 12, "queued_groups": 11,
    "queued_samples": 46, "interrupted": 5, "workers_lost": 1,
    "version": 3, "paused": False, "capacity": 4, "running_groups": 4, "in_flight": 12,
    "pending": 2, "cancel_queue": 3, "to_score": 1, "held": 0, "ready_groups": 1,
    "dropped": {"filtered": 4, "reward_failed": 2},
    "workers": {"agent_worker-0": {"kind": "agent", "credits": 8, "out": 4},
                "reward_worker-0": {"kind": "reward", "credits": 8, "out": 1}},
    "channel_protocol_errors": 1,
    "eval": {"version": 2, "prompts": 4, "n": 8, "failed": 0, "reward_mean": 0.5,
             "pass_at": {"1": 0.5}},
    "eval_pending": 0, "cursor": {"cursor": {"n_rows": 100, "epoch": 0, "offset": 16},
                                  "serial": 16},
    "engines_healthy": 2, "engines": 2, "admission": "open", "queue_stale_groups": 0,
    "staleness_measure": "admission", "journal_error": None, "queue_unreachable_s": None,
    "admission_stopped_s": None, "over_sampling": 1.0, "protocol_errors": 0, "shard": 0,
}
R1 = {
    "admitted_groups": 10, "admitted_samples": 40, "accepted_groups": 7,
    "version": 2, "paused": True, "capacity": 4, "running_groups": 3, "in_flight": 9,
    "pending": 0, "cancel_queue": 5, "to_score": 0, "held": 2, "ready_groups": 0,
    "dropped": {"generation_failed": 1, "filtered": 2},
    "workers": {"agent_worker-1": {"kind": "agent", "credits": 8, "out": 3},
                "reward_worker-1": {"kind": "reward", "credits": 8, "out": 0}},
    "channel_protocol_errors": 0,
    "eval": {"version": 3, "prompts": 4, "n": 8, "failed": 1, "reward_mean": 0.75,
             "pass_at": {"1": 0.75}},
    "eval_pending": 2, "cursor": {"cursor": {"n_rows": 100, "epoch": 0, "offset": 10},
                                  "serial": 10},
    "engines_healthy": 1, "engines": 2, "admission": "stopped: no healthy engine",
    "queue_stale_groups": 1, "staleness_measure": "admission",
    "journal_error": "RUN/rollouter/rollouter.log: disk full", "queue_unreachable_s": 2.5,
    "admission_stopped_s": 4.0, "over_sampling": 1.25, "protocol_errors": 3, "shard": 1,
    "queued_groups": 7, "queued_samples": 28,
}
# Two queue shards as MessageQueue.stats reports them, durable; each balances: shard 0: put 46
# = 36 consumed + 8 deep + 2 dropped; shard 1: put 28 = 20 + 8 + 0.
Q0 = {
    "depth_groups": 2, "depth_samples": 8, "capacity_groups": 12, "version": 3,
    "put_samples": 46, "consumed_samples": 36, "dropped": {"stale": 2}, "rejected_puts": 1,
    "staleness_hist": {"0": 20, "1": 12, "2": 4}, "admission_age_hist": {"0": 30, "1": 6},
    "staleness_measure": "admission", "consumed_per_s": 3.5, "max_staleness": 2,
    "pending_batches": 1, "pending_samples": 8, "committed_step": 4, "redelivered_batches": 0,
    "duplicate_puts": 1, "evicted_batches": 0, "durable": True, "log_bytes": 1000,
    "log_live_bytes": 800, "log_compactions": 1, "log_fsyncs": 10, "replayed_records": 0,
    "log_error": None, "log_write_failures": 0, "protocol_errors": 0, "shard": 0,
}
Q1 = {
    "depth_groups": 2, "depth_samples": 8, "capacity_groups": 12, "version": 2,
    "put_samples": 28, "consumed_samples": 20, "dropped": {}, "rejected_puts": 0,
    "staleness_hist": {"1": 8, "10": 1, "0": 11}, "admission_age_hist": {"0": 20},
    "staleness_measure": "admission", "consumed_per_s": 1.5, "max_staleness": 2,
    "pending_batches": 0, "pending_samples": 0, "committed_step": 3, "redelivered_batches": 2,
    "duplicate_puts": 0, "evicted_batches": 1, "durable": False, "log_bytes": 0,
    "log_live_bytes": 0, "log_compactions": 0, "log_fsyncs": 0, "replayed_records": 5,
    "log_error": "RUN/message_queue/queue.log: disk full", "log_write_failures": 2,
    "protocol_errors": 4, "shard": 1,
}


def test_one_shard_merges_to_itself():
    for d in (R0, R1, Q0, Q1):
        merged = merge_values([d])
        assert merged == d and list(merged) == list(d)
        assert merged is not d and merged["dropped"] is not d["dropped"]  # a copy
    assert merge_values([]) == {}


def test_every_reported_key_has_its_rule():
    """The rules named for the keys that are not plain counts; every key of both stats dicts
    is either there or a count (int, or a dict of counts) the type rule sums."""
    for d in (R0, R1, Q0, Q1):
        for key, value in d.items():
            if key in MERGE_RULES:
                continue
            assert (type(value) is int or type(value) is float or key in ("paused", "workers")
                    or (isinstance(value, dict) and all(
                        type(v) is int or isinstance(v, dict) for v in value.values()))), key


def test_rollouter_shards_merge_by_their_rules():
    m = merge_values([R0, R1])
    # counts summed, the counters that only one shard has counted included
    assert (m["admitted_samples"], m["admitted_groups"], m["queued_samples"]) == (104, 26, 74)
    assert (m["interrupted"], m["workers_lost"], m["in_flight"], m["capacity"]) == (5, 1, 21, 8)
    assert (m["cancel_queue"], m["held"], m["ready_groups"], m["eval_pending"]) == (8, 2, 1, 2)
    assert (m["protocol_errors"], m["channel_protocol_errors"], m["queue_stale_groups"]) == (3, 1, 1)
    assert m["dropped"] == {"filtered": 6, "reward_failed": 2, "generation_failed": 1}
    assert list(m["dropped"]) == ["filtered", "reward_failed", "generation_failed"]
    assert m["workers"] == {**R0["workers"], **R1["workers"]}  # the union
    assert m["version"] == 2 and m["paused"] is True  # the oldest; any shard paused
    assert m["eval"] == R1["eval"]  # the newest round
    assert m["engines_healthy"] == 1 and m["engines"] == 2
    assert m["admission"] == "stopped: no healthy engine"  # a stopped shard shows
    assert m["journal_error"] == R1["journal_error"]  # None in shard 0: absent
    assert (m["queue_unreachable_s"], m["admission_stopped_s"], m["over_sampling"]) == (2.5, 4.0, 1.25)
    assert m["staleness_measure"] == "admission"
    for own in ("shard", "cursor", "pid", "instance"):  # each process's own
        assert own not in m
    assert R0["dropped"] == {"filtered": 4, "reward_failed": 2}  # the inputs are untouched


def test_queue_shards_merge_by_their_rules():
    m = merge_values([Q0, Q1])
    assert (m["depth_samples"], m["depth_groups"], m["capacity_groups"]) == (16, 4, 24)
    assert (m["put_samples"], m["consumed_samples"], m["rejected_puts"]) == (74, 56, 1)
    assert m["consumed_per_s"] == 5.0 and m["max_staleness"] == 2
    assert m["version"] == 2 and m["committed_step"] == 3
    assert m["dropped"] == {"stale": 2}
    assert m["staleness_hist"] == {"0": 31, "1": 20, "2": 4, "10": 1}
    assert list(m["staleness_hist"]) == ["0", "1", "2", "10"]  # numeric order
    assert m["admission_age_hist"] == {"0": 50, "1": 6}
    assert m["durable"] is False  # one shard without its log: not durable
    assert m["log_error"] == Q1["log_error"]
    assert (m["log_bytes"], m["replayed_records"], m["log_write_failures"]) == (1000, 5, 2)
    assert (m["redelivered_batches"], m["duplicate_puts"], m["evicted_batches"]) == (2, 1, 1)
    assert "shard" not in m


def test_the_type_rules_for_other_keys():
    m = merge_values([{"a": 1, "b": 0.5, "c": True, "d": "x", "e": [1], "f": {"g": 1},
                       "h": None},
                      {"a": 2, "b": 0.25, "c": False, "d": "y", "e": [2, 3], "f": {"g": 2, "k": 1},
                       "h": None, "i": None}])
    assert m == {"a": 3, "b": 0.75, "c": True, "d": "x", "e": [1, 2, 3], "f": {"g": 3, "k": 1},
                 "h": None, "i": None}


def test_combined_statuses_sum_every_count():
    r = RolloutStatus.combine([RolloutStatus.parse(R0), RolloutStatus.parse(R1)])
    assert r == RolloutStatus(
        admitted_samples=104, queued_samples=74, queued_any=True, in_flight=21,
        dropped={"filtered": 6, "reward_failed": 2, "generation_failed": 1}, pending=2,
        cancel_queue=8, to_score=1, ready_groups=1, out=8)
    q = QueueStatus.combine([QueueStatus.parse(Q0), QueueStatus.parse(Q1)])
    assert q == QueueStatus(put_samples=74, consumed_samples=56, depth_samples=16,
                            dropped={"stale": 2})
    # the same as parsing the merged dicts
    assert r == RolloutStatus.parse(merge_values([R0, R1]))
    assert q == QueueStatus.parse(merge_values([Q0, Q1]))
    # queued_any: any shard has queued
    fresh = {k: v for k, v in R1.items() if k != "queued_samples"}
    assert not RolloutStatus.parse(fresh).queued_any
    assert RolloutStatus.combine([RolloutStatus.parse(fresh), RolloutStatus.parse(R0)]).queued_any
    assert not RolloutStatus.combine([RolloutStatus.parse(fresh)]).queued_any
    one = RolloutStatus.parse(R0)
    assert RolloutStatus.combine([one]) == one
    with pytest.raises(ValueError):
        QueueStatus.combine([])


def test_the_identity_holds_over_two_shards_when_each_balances():
    rs = [RolloutStatus.parse(R0), RolloutStatus.parse(R1)]
    qs = [QueueStatus.parse(Q0), QueueStatus.parse(Q1)]
    assert [r.off for r in rs] == [0, 0] and [q.off for q in qs] == [0, 0]
    ident = identity(RolloutStatus.combine(rs), QueueStatus.combine(qs))
    # 104 admitted = 56 consumed + 11 dropped + 37 in flight (21 + 16)
    assert ident == Identity(admitted=104, consumed=56, in_flight=37,
                             dropped={"filtered": 6, "reward_failed": 2, "generation_failed": 1,
                                      "stale": 2})
    assert ident.holds and ident.accounted == 104
    # a sample lost in shard 1's queue: the total is off by it, and the shard's balance says where
    leak = QueueStatus.parse({**Q1, "depth_samples": 7})
    off = identity(RolloutStatus.combine(rs), QueueStatus.combine([qs[0], leak]))
    assert off.difference == 1 and not off.holds
    balances = shard_balances(rs, [qs[0], leak])
    assert [b["off"] for b in balances["message_queue"]] == [0, 1]
    assert [b["off"] for b in balances["rollouter"]] == [0, 0]


def test_shard_balances_and_what_summary_json_holds():
    rs = [RolloutStatus.parse(R0), RolloutStatus.parse(R1)]
    qs = [QueueStatus.parse(Q0), QueueStatus.parse(Q1)]
    b = shard_balances(rs, qs)
    assert b["rollouter"] == [
        {"shard": 0, "admitted": 64, "queued": 46, "in_flight": 12,
         "dropped": {"filtered": 4, "reward_failed": 2}, "off": 0},
        {"shard": 1, "admitted": 40, "queued": 28, "in_flight": 9,
         "dropped": {"generation_failed": 1, "filtered": 2}, "off": 0}]
    assert b["message_queue"] == [
        {"shard": 0, "put": 46, "consumed": 36, "depth": 8, "dropped": {"stale": 2}, "off": 0},
        {"shard": 1, "put": 28, "consumed": 20, "depth": 8, "dropped": {}, "off": 0}]
    summary = {"max_staleness": 2, "staleness_measure": "admission", "admitted": 104,
               "rollouter": merge_values([R0, R1]), "message_queue": merge_values([Q0, Q1]),
               "rollouters": [R0, R1], "message_queues": [Q0, Q1],
               "shards": {"rollouter": 2, "message_queue": 2}, "balances": b}
    written = summary_json(copy.deepcopy(summary))
    assert set(written) == {"max_staleness", "staleness_measure", "admitted", "shards",
                            "balances"}
    assert not set(written) & set(WHOLE_STATS)


# -- the launcher's accounting against real RPC servers standing for the shards ----------------


class FakeShard:
    """A rollouter or MessageQueue shard's control socket: answers Pause and StatsRequest.
    A rollouter shard holds one group between scoring and the queue until paused, and puts it
    (its `on_put`) at its second StatsRequest after the pause: the launcher must wait for it."""

    def __init__(self, t, role: str, values: dict, on_put=None):
        self.role, self.values, self.on_put = role, copy.deepcopy(values), on_put
        self.broken = False  # answers StatsRequest with an error (ErrorReply)
        self.paused, self.polls = 0, 0
        self.server = RpcServer(t, "tcp://127.0.0.1:0", {Pause: self.pause,
                                                          StatsRequest: self.stats}, name=role)
        self.task = asyncio.create_task(self.server.serve())

    @property
    def port(self) -> int:
        port = int(self.server.address.rsplit(":", 1)[1])
        return port - ROLE[self.role].ports.index("control") if self.role == "rollouter" else port

    async def pause(self, msg, peer):
        self.paused += 1
        return Paused(in_flight=self.values["in_flight"], cancel_queue=0)

    async def stats(self, msg, peer):
        if self.broken:
            raise RuntimeError("stats broke")
        if self.paused:
            self.polls += 1
            if self.polls == 2 and self.on_put is not None:
                self.on_put(self)
        return Metrics(role=self.role, host="local", values=copy.deepcopy(self.values))

    async def close(self):
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.server.close()


# R0 with nothing between scoring and the queue (the launcher waits for that)
SETTLED_R0 = {**R0, "to_score": 0, "ready_groups": 0}


def planned(shard: FakeShard, index: int) -> Planned:
    return Planned(proc=Process(shard.role, index, "local", (), shard.port),
                   host=SimpleNamespace(address="127.0.0.1"))  # type: ignore[arg-type]


def test_collect_accounting_pauses_every_rollouter_and_waits_for_every_shard_to_settle():
    # rollouter shard 1 holds 4 scored samples (to_score) when paused, and puts them to queue
    # shard 1 at its second stats: the figures must be read after that (settled).
    held = {**R1, "admitted_samples": 44, "in_flight": 13, "to_score": 4, "ready_groups": 0}

    def put(shard: FakeShard) -> None:
        shard.values.update(in_flight=9, to_score=0, queued_samples=32, queued_groups=8)
        queues[1].values.update(put_samples=32, depth_samples=12, depth_groups=3)

    async def main():
        with Transport() as t:
            nonlocal queues
            rollouters = [FakeShard(t, "rollouter", SETTLED_R0),
                          FakeShard(t, "rollouter", held, put)]
            queues = [FakeShard(t, "message_queue", Q0), FakeShard(t, "message_queue", Q1)]
            # the plan in another order than the shards': the summary is in shard order
            plan = [planned(queues[1], 1), planned(rollouters[1], 1), planned(queues[0], 0),
                    planned(rollouters[0], 0)]
            try:
                out = await collect_accounting(t, plan)
                paused = [r.paused for r in rollouters], [q.paused for q in queues]
                queues[0].broken = True
                failed = await collect_accounting(t, plan)
            finally:
                for s in (*rollouters, *queues):
                    await s.close()
            return out, failed, *paused

    queues: list[FakeShard] = []
    out, failed, r_paused, q_paused = asyncio.run(main())
    assert r_paused == [1, 1] and q_paused == [0, 0]  # every rollouter paused, once
    # 108 admitted = 56 consumed + 11 dropped + (21 + 20) in flight, with shard 1's group put
    assert (out["admitted"], out["consumed"], out["in_flight"]) == (108, 56, 41)
    assert out["dropped"] == {"filtered": 6, "reward_failed": 2, "generation_failed": 1,
                              "stale": 2}
    assert Identity.from_summary(out).holds
    assert out["shards"] == {"rollouter": 2, "message_queue": 2}
    assert [r["shard"] for r in out["rollouters"]] == [0, 1]
    assert [q["put_samples"] for q in out["message_queues"]] == [46, 32]
    assert out["rollouter"]["admitted_samples"] == 108 and out["rollouter"]["to_score"] == 0
    assert out["message_queue"]["depth_samples"] == 20
    assert [b["off"] for b in out["balances"]["rollouter"]] == [0, 0]
    assert [b["off"] for b in out["balances"]["message_queue"]] == [0, 0]
    assert [b["admitted"] for b in out["balances"]["rollouter"]] == [64, 44]
    assert set(summary_json(out)) == {"admitted", "consumed", "in_flight", "dropped", "shards",
                                      "balances"}
    # a shard that cannot answer: no accounting, and why
    assert set(failed) == {"error"} and "could not collect the accounting" in failed["error"]


def test_one_shard_collects_what_it_did_before_plus_the_shard_keys():
    async def main():
        with Transport() as t:
            shards = [FakeShard(t, "rollouter", SETTLED_R0), FakeShard(t, "message_queue", Q0)]
            try:
                return await collect_accounting(t, [planned(s, 0) for s in shards])
            finally:
                for s in shards:
                    await s.close()

    out = asyncio.run(main())
    ident = identity(RolloutStatus.parse(SETTLED_R0), QueueStatus.parse(Q0))
    # the keys of before, with the single shard's dicts as they were reported
    assert {k: out[k] for k in ("admitted", "consumed", "in_flight", "dropped")} == ident.summary()
    assert out["rollouter"] == SETTLED_R0 and out["message_queue"] == Q0
    assert out["rollouters"] == [SETTLED_R0] and out["message_queues"] == [Q0]
    assert out["shards"] == {"rollouter": 1, "message_queue": 1}
    assert list(out) == ["admitted", "consumed", "in_flight", "dropped", "rollouter",
                         "message_queue", "rollouters", "message_queues", "shards", "balances"]


def test_the_watchdogs_snapshot_totals_every_shard_and_none_while_one_does_not_answer():
    async def main():
        with Transport() as t:
            shards = [FakeShard(t, "rollouter", R0), FakeShard(t, "rollouter", R1),
                      FakeShard(t, "message_queue", Q0), FakeShard(t, "message_queue", Q1)]
            plan = [planned(s, i % 2) for i, s in enumerate(shards)]
            try:
                whole = await snapshot(t, plan, engine_urls=[], engine_key=None, batch_samples=8)
                shards[3].broken = True
                partial = await snapshot(t, plan, engine_urls=[], engine_key=None,
                                         batch_samples=8)
            finally:
                for s in shards:
                    await s.close()
            return whole, partial

    whole, partial = asyncio.run(main())
    assert whole.trainer_step is None  # no trainer in this plan
    assert whole.generated == 74 and whole.queue_depth == 16
    assert whole.outstanding == (2 + 3 + 5) + (0 + 5 + 3)
    assert whole.dropped == {"filtered": 6, "reward_failed": 2, "generation_failed": 1,
                             "stale": 2}
    # one queue shard without an answer: the queue's figures unknown, not half of them
    assert partial.queue_depth is None and partial.generated == 74
    assert partial.dropped == {"filtered": 6, "reward_failed": 2, "generation_failed": 1}


# -- the monitor: totals over every instance heard, and each shard's line -----------------------


def board_of(rollouters: list[dict], queues: list[dict], now: float = 1.0) -> StatusBoard:
    """A board that heard these rollouter and queue instances (0, 1, ...), each as its role
    publishes it (with its instance, pid and ready), twice: each instance counts once."""
    board = StatusBoard()
    for _ in range(2):
        for role, shards in (("rollouter", rollouters), ("message_queue", queues)):
            for i, stats in enumerate(shards):
                values = {"instance": i, "pid": 1000 + i, "ready": True, **stats}
                board.update(f"metrics.{role}.{i}", Metrics(role=role, host="local",
                                                            values=values), now)
    return board


def rendered(board: StatusBoard, width: int = 200) -> str:
    console = Console(record=True, width=width)
    console.print(render(board.snapshot(now=1.5), width=width))
    return console.export_text()


def test_the_monitor_totals_every_shard_and_shows_each():
    board = board_of([R0, R1], [Q0, Q1])
    snap = board.snapshot(now=1.5)
    ro, q, acc = snap["rollouter"], snap["queue"], snap["accounting"]
    assert (ro["admitted"], ro["admitted_groups"], ro["in_flight"], ro["queued_samples"]) == (
        104, 26, 21, 74)
    assert (ro["agent_workers"], ro["reward_workers"], ro["version"], ro["paused"]) == (
        2, 2, 2, True)
    assert ro["dropped"] == {"filtered": 6, "generation_failed": 1, "reward_failed": 2}
    assert ro["admission"] == "stopped: no healthy engine" and ro["engines_healthy"] == 1
    assert (q["depth"], q["put"], q["consumed"], q["consumed_per_s"]) == (16, 74, 56, 5.0)
    assert q["staleness_hist"] == {"0": 31, "1": 20, "2": 4, "10": 1}
    assert q["dropped_by"]["message_queue"] == {"stale": 2}
    assert snap["eval"]["version"] == 3  # the newest round of either shard
    assert acc == {"admitted": 104, "consumed": 56, "dropped_total": 11, "in_flight": 37,
                   "difference": 0, "holds": True, "rollouter_balances": True,
                   "queue_balances": True, "between": 0}
    assert snap["shards"] == {
        "rollouter": [
            {"instance": 0, "admitted": 64, "in_flight": 12, "queued": 46, "dropped": 6,
             "paused": False, "off": 0},
            {"instance": 1, "admitted": 40, "in_flight": 9, "queued": 28, "dropped": 3,
             "paused": True, "off": 0}],
        "message_queue": [
            {"instance": 0, "depth": 8, "put": 46, "consumed": 36, "dropped": 2, "off": 0},
            {"instance": 1, "depth": 8, "put": 28, "consumed": 20, "dropped": 0, "off": 0}]}
    text = rendered(board)
    assert "admitted 104 = consumed 56 + dropped 11 + in flight 37  ✓ holds" in text
    assert "104 samples (26 groups)" in text and "16 samples (4 / 24 groups)" in text
    lines = text.splitlines()
    header = next(i for i, l in enumerate(lines) if "shard" in l and "in flight" in l)
    assert lines[header + 1].split("│")[-2].split() == ["0", "64", "12", "46", "6", "ok"]
    assert lines[header + 2].split("│")[-2].split() == ["1", "40", "9", "28", "3", "ok"]
    qheader = next(i for i, l in enumerate(lines) if "shard" in l and "consumed" in l)
    assert lines[qheader + 1].split("│")[-2].split() == ["0", "8", "46", "36", "2", "ok"]
    assert lines[qheader + 2].split("│")[-2].split() == ["1", "8", "28", "20", "0", "ok"]


def test_a_shard_that_does_not_balance_is_named():
    # queue shard 1 lost a sample, rollouter shard 0 counts one too many admitted: the total
    # is off by 2, and each side's line says which shard
    board = board_of([{**R0, "admitted_samples": 65}, R1], [Q0, {**Q1, "depth_samples": 7}])
    snap = board.snapshot(now=1.5)
    acc = snap["accounting"]
    assert acc["difference"] == 2 and acc["holds"] is False
    assert not acc["rollouter_balances"] and not acc["queue_balances"]
    assert [s["off"] for s in snap["shards"]["rollouter"]] == [1, 0]
    assert [s["off"] for s in snap["shards"]["message_queue"]] == [0, 1]
    text = rendered(board)
    assert ("✗ off by 2: the rollouter and the MessageQueue does not balance (rollouter shard 0, "
            "MessageQueue shard 1)") in text
    assert text.count("off +1") == 2
    # two leaks that cancel out in the total still show as two shards off
    board = board_of([{**R0, "admitted_samples": 65}, {**R1, "admitted_samples": 39}], [Q0, Q1])
    acc = board.snapshot(now=1.5)["accounting"]
    assert acc["difference"] == 0 and not acc["rollouter_balances"]
    assert "off +1" in rendered(board) and "off -1" in rendered(board)


def test_the_accounting_waits_for_every_instance():
    board = board_of([R0, {"status_error": "RuntimeError: not yet"}], [Q0, Q1])
    snap = board.snapshot(now=1.5)
    assert snap["accounting"]["holds"] is None  # not a total over one shard
    assert [s["off"] for s in snap["shards"]["rollouter"]] == [0, None]
    assert "waiting for the rollouter and the MessageQueue" in rendered(board)


def test_one_instance_each_shows_what_it_did_before():
    board = board_of([R0], [Q0])
    snap = board.snapshot(now=1.5)
    assert "shards" not in snap
    # the panels as drawn from that instance's own dict, unmerged (as the monitor did before)
    r_raw = {"instance": 0, "pid": 1000, "ready": True, **R0}
    q_raw = {"instance": 0, "pid": 1000, "ready": True, **Q0}
    assert snap["rollouter"] == StatusBoard._rollouter(r_raw)
    assert snap["queue"] == StatusBoard._queue(q_raw, r_raw)
    assert snap["eval"]["version"] == R0["eval"]["version"] and snap["eval"]["n"] == 8
    assert snap["rollouter"]["admitted"] == 64 and snap["queue"]["depth"] == 8
    assert snap["accounting"]["admitted"] == 64 and snap["accounting"]["holds"] is True
    text = rendered(board)
    assert "shard" not in text and "balance" not in text
    assert "admitted 64 = consumed 36 + dropped 8 + in flight 20  ✓ holds" in text
    # two rollouters and one queue: the per-shard lines, the queue's one line too
    two = board_of([R0, R1], [Q0]).snapshot(now=1.5)
    assert len(two["shards"]["rollouter"]) == 2 and len(two["shards"]["message_queue"]) == 1
