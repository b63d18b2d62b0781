"""Network partitions (issue 13, item 5) at the transport level: a TCP relay the test controls
(`tests/helpers/relay.py`) sits between the two ends of a link, black-holes it for longer than the
heartbeat limit (interval x liveness), then heals it.

The links the roles use are these two patterns: the worker channel (ROUTER <-> DEALER: agent
and reward workers <-> rollouter) and request-reply (RpcClient <-> RpcServer: rollouter ->
MessageQueue puts, trainer -> MessageQueue batches, heartbeats). Checked: while cut, the far
side is declared dead within the limit; after the heal the link carries messages again by
itself (no restart), both when the held connections come back (TCP's retransmissions) and when
they are lost for good (a NAT or firewall that forgot them: only ZMTP heartbeats notice those);
nothing sent over a kept connection is lost; a link that delays every message by 200 ms is
slower, not wrong.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from rollmesh.wire.messages import Heartbeat, Ok
from rollmesh.wire.transport import PeerTimeout, RpcClient, RpcServer, Transport
from rollmesh.wire.channels import Channel, ChannelClient, Heartbeater, Liveness
from tests.helpers.relay import Relay

INTERVAL_S, LIVENESS = 0.2, 3  # the heartbeat limit: 0.6 s
ZMTP = {"heartbeat_ms": 200, "heartbeat_timeout_ms": 1000}


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


async def until(predicate, timeout_s: float, step_s: float = 0.05) -> float:
    """Seconds until `predicate()` holds (polled state of real sockets), or fail."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s}s"
        await asyncio.sleep(step_s)
    return time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("keep_connections", [True, False], ids=["held", "lost"])
def test_worker_channel_through_a_partition_is_declared_dead_then_recovers(keep_connections):
    async def main():
        with Transport(**ZMTP) as t:
            channel = Channel(t, "tcp://127.0.0.1:0", name="rollouter")
            relay = Relay(port_of(channel.address))
            worker = ChannelClient(t, relay.address, identity=b"worker-0")
            live = Liveness(interval_s=INTERVAL_S, liveness=LIVENESS)
            got: list[int] = []  # worker -> rollouter sequence numbers, as received

            async def rollouter():  # beats the worker every interval, counts its answers
                seq = 0
                while True:
                    seq += 1
                    await channel.send(b"worker-0", Heartbeat(sender="rollouter", seq=seq))
                    try:
                        peer, msg = await asyncio.wait_for(channel.recv(), INTERVAL_S)
                    except TimeoutError:
                        continue
                    live.beat(peer.decode())
                    got.append(msg.seq)

            async def answer():  # the worker answers each heartbeat with its own sequence
                n = 0
                while True:
                    await worker.recv()
                    n += 1
                    await worker.send(Heartbeat(sender="worker-0", seq=n))

            tasks = [asyncio.create_task(rollouter()), asyncio.create_task(answer())]
            await until(lambda: len(got) >= 3, 10)
            relay.black_hole()
            dead_after = await until(lambda: not live.is_alive("worker-0"), 5)
            await asyncio.sleep(3 * INTERVAL_S * LIVENESS)  # cut well past the limit
            assert not live.is_alive("worker-0")  # shown dead all along the cut
            cut_at = len(got)
            relay.heal(keep_connections=keep_connections)
            recovered = await until(lambda: live.is_alive("worker-0") and len(got) > cut_at + 3,
                                    15)
            for task in tasks:
                task.cancel()
            worker.close()
            channel.close()
            relay.close()
            return dead_after, relay.cut_s(), recovered, got, relay.connections

    dead_after, cut_s, recovered, got, connections = asyncio.run(main())
    print(f"declared dead after {dead_after:.2f}s, cut {cut_s:.2f}s, recovered in "
          f"{recovered:.2f}s, connections {connections}")
    assert dead_after <= INTERVAL_S * LIVENESS + 1.0
    assert cut_s > INTERVAL_S * LIVENESS
    assert got == sorted(got)  # in order, whatever came through
    if not keep_connections:  # ZMTP heartbeats dropped the dead connection; a new one served
        assert connections >= 2


@pytest.mark.slow
@pytest.mark.parametrize("keep_connections", [True, False], ids=["held", "lost"])
def test_rpc_through_a_partition_times_out_then_recovers(keep_connections):
    async def main():
        with Transport(**ZMTP) as t:
            served = []

            async def ok(msg, peer):
                served.append(msg.seq)
                return Heartbeat(sender="queue", seq=msg.seq)

            server = RpcServer(t, "tcp://127.0.0.1:0", {Heartbeat: ok}, name="message_queue")
            serving = asyncio.create_task(server.serve())
            relay = Relay(port_of(server.address))
            client = RpcClient(t, relay.address, timeout_s=INTERVAL_S, retries=0)
            dead = asyncio.get_running_loop().create_future()
            live = Liveness(interval_s=INTERVAL_S, liveness=LIVENESS)
            beater = asyncio.create_task(Heartbeater(
                client, "rollouter", live, lambda: dead.set_result(time.monotonic())).run())
            await until(lambda: len(served) >= 3, 10)
            relay.black_hole()
            cut_at = time.monotonic()
            await asyncio.wait_for(dead, 5)  # the Heartbeater declared the queue dead
            dead_after = dead.result() - cut_at
            await beater
            with pytest.raises(PeerTimeout):
                await client.request(Heartbeat(sender="rollouter", seq=1000))
            await asyncio.sleep(INTERVAL_S * LIVENESS)
            relay.heal(keep_connections=keep_connections)
            healed = time.monotonic()
            # the caller retries, as the rollouter's put loop and the trainer do
            while True:
                try:
                    reply = await client.request(Heartbeat(sender="rollouter", seq=2000),
                                                 timeout_s=0.5, retries=0)
                    break
                except PeerTimeout:
                    assert time.monotonic() - healed < 15, "the link never came back"
            recovered = time.monotonic() - healed
            assert reply.seq == 2000
            client.close()
            serving.cancel()
            server.close()
            relay.close()
            return dead_after, relay.cut_s(), recovered

    dead_after, cut_s, recovered = asyncio.run(main())
    print(f"declared dead after {dead_after:.2f}s, cut {cut_s:.2f}s, recovered in "
          f"{recovered:.2f}s")
    assert dead_after <= INTERVAL_S * LIVENESS + 1.0 and cut_s > INTERVAL_S * LIVENESS


@pytest.mark.slow
def test_a_link_that_delays_every_message_is_slower_not_wrong():
    async def main():
        with Transport(**ZMTP) as t:
            async def echo(msg, peer):
                return Ok(message=str(msg.seq))

            server = RpcServer(t, "tcp://127.0.0.1:0", {Heartbeat: echo}, name="message_queue")
            serving = asyncio.create_task(server.serve())
            relay = Relay(port_of(server.address))
            relay.delay(0.2)
            client = RpcClient(t, relay.address, timeout_s=5, retries=0)
            started = time.monotonic()
            replies = await asyncio.gather(*(client.request(Heartbeat(sender="c", seq=i))
                                             for i in range(50)))
            took = time.monotonic() - started
            channel = Channel(t, "tcp://127.0.0.1:0")
            relay2 = Relay(port_of(channel.address))
            relay2.delay(0.2)
            worker = ChannelClient(t, relay2.address, identity=b"w")
            for i in range(100):
                await worker.send(Heartbeat(sender="w", seq=i))
            seqs = [(await asyncio.wait_for(channel.recv(), 10))[1].seq for _ in range(100)]
            for x in (client, worker, channel, server, relay, relay2):
                x.close()
            serving.cancel()
            return replies, took, seqs

    replies, took, seqs = asyncio.run(main())
    assert [r.message for r in replies] == [str(i) for i in range(50)]
    assert took >= 0.4  # there and back through the delay: it did delay
    assert seqs == list(range(100))  # every message, in order


# -- a real rollout side: the rollouter cut off from its agent worker and from the queue ---------


ROWS = [{"prompt": f"What is {a} plus {b}?", "label": str(a + b)}
        for a in range(4) for b in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("delayed", [False, True], ids=["black_hole", "delay_200ms"])
def test_rollout_cut_off_from_its_worker_and_the_queue_resumes_by_itself(tmp_path, delayed):
    """Agent worker <-> rollouter and rollouter -> MessageQueue both go through relays; both are
    black-holed past the heartbeat limit (0.5 s x 4), then healed with the held connections
    lost. The rollouter's status shows the worker gone (what the monitor displays) while cut;
    afterwards generation and queueing go on by themselves; no group is handed out twice, and
    admitted = consumed + dropped + in flight. With `delayed`, both links delay every message by
    200 ms instead: the same steps finish, nothing dropped, the identity holds."""
    from rollmesh.config import to_dict
    from rollmesh.observe.monitor import StatusBoard
    from rollmesh.launcher.supervisor import Supervisor
    from rollmesh.wire.transport import free_port
    from tests.engine.engine_harness import Engine
    from tests.helpers.rollout_stack import ENV, Driver, accounting, experiment, write_dataset

    exp = experiment(write_dataset(tmp_path / "rows.jsonl", ROWS))
    spec = to_dict(exp)

    async def main():
        with Transport() as t:
            sup = Supervisor(t, heartbeat_s=0.5, liveness=4, log_dir=tmp_path / "logs")
            engine = await asyncio.to_thread(Engine, tmp_path / "engine.log",
                                             "--weight-version", "0")
            relays = []
            try:
                mq = sup.spawn("message_queue", "rollmesh.mq.role:main", env=ENV, config={
                    "experiment": spec, "bind": f"tcp://127.0.0.1:{free_port()}"})
                mq_rpc = (await sup.wait_ready(mq, 120))["rpc"]
                to_mq = Relay(port_of(mq_rpc))
                bind = f"tcp://127.0.0.1:{free_port()}"
                to_rollouter = Relay(port_of(bind))
                relays += [to_mq, to_rollouter]
                rollouter = sup.spawn("rollouter", "rollmesh.rollout.role:main", env=ENV, config={
                    "experiment": spec, "bind": bind,
                    "control": f"tcp://127.0.0.1:{free_port()}", "message_queue": to_mq.address})
                eps = await sup.wait_ready(rollouter, 120)
                reward = sup.spawn("reward_worker", "rollmesh.rewards.role:main", env=ENV,
                                   config={"experiment": spec, "rollouter": eps["channel"],
                                           "pool": 2})
                await sup.wait_ready(reward, 120)
                agent = sup.spawn("agent_worker", "rollmesh.agents.role:main", env=ENV, config={
                    "experiment": spec, "rollouter": to_rollouter.address,
                    "engines": [engine.url], "credits": 16})
                await sup.wait_ready(agent, 120)
                d = Driver(t, eps["rpc"], mq_rpc, engine.url)
                shown = lambda s: StatusBoard._rollouter(s["rollouter"])["agent_workers"]  # noqa: E731
                taken: list[str] = []

                async def take(n):
                    groups = await d.take(n, timeout_s=120)
                    taken.extend(g.group_id for g in groups)
                    return sum(len(g.trajectories) for g in groups)

                await d.wait_for(lambda s: s["mq"]["depth_groups"] >= 2 and shown(s) == 1,
                                 what="groups queued")
                consumed = await take(2)
                if delayed:  # every message on both links 200 ms late: slower, not wrong
                    for r in relays:
                        r.delay(0.2)
                    for _ in range(2):
                        await d.sync()
                        consumed += await take(2)
                    await d.pause()
                    stats = await d.wait_for(
                        lambda s: (lambda a, b: a == b)(*accounting(s, consumed)), timeout_s=60,
                        what="the accounting to settle")
                    d.close()
                    return stats, taken, 0.0, 0.0, 0.0, 0.0
                for r in relays:
                    r.black_hole()
                cut = time.monotonic()
                s = await d.wait_for(lambda s: shown(s) == 0, timeout_s=20,
                                     what="the worker shown dead")
                dead_after = time.monotonic() - cut
                put_before = s["mq"]["put_samples"]
                await asyncio.sleep(4.0)  # well past the limit (2 s)
                s = await d.wait_for(lambda s: True)
                assert shown(s) == 0 and s["mq"]["put_samples"] == put_before  # nothing passed
                for r in relays:
                    r.heal(keep_connections=False)
                healed = time.monotonic()
                await d.wait_for(lambda s: shown(s) == 1, timeout_s=60, what="worker back")
                recovered = time.monotonic() - healed
                consumed += await take(2)
                await d.sync()  # the staleness bound admits more: generated, put through the
                await d.wait_for(lambda s: s["mq"]["put_samples"] > put_before,  # healed link
                                 timeout_s=60, what="groups queued again")
                queued_again = time.monotonic() - healed
                consumed += await take(2)
                await d.pause()
                stats = await d.wait_for(
                    lambda s: (lambda a, b: a == b)(*accounting(s, consumed)), timeout_s=60,
                    what="the accounting to settle")
                d.close()
                return stats, taken, dead_after, to_mq.cut_s(), recovered, queued_again
            finally:
                for r in relays:
                    r.close()
                await sup.close(grace_s=10)
                await asyncio.to_thread(engine.stop)

    stats, taken, dead_after, cut_s, recovered, queued_again = asyncio.run(main())
    print(f"worker shown dead {dead_after:.2f}s into the cut; cut {cut_s:.2f}s; worker back "
          f"{recovered:.2f}s after the heal, groups queued again {queued_again:.2f}s; dropped {stats['rollouter']['dropped']} "
          f"{stats['mq']['dropped']}")
    assert len(taken) == len(set(taken)) == 6  # no group handed out twice
    assert sum(stats["rollouter"]["dropped"].values()) + sum(stats["mq"]["dropped"].values()) == 0
    admitted, accounted = accounting(stats, 12)
    assert admitted == accounted
    if not delayed:
        assert stats["rollouter"]["workers_lost"] >= 1


# -- a whole run: the trainer and the rollouter cut off from the MessageQueue -----------------------

# `rollmesh launch` with the plan's MessageQueue address, as the trainer and the rollouter are
# handed it, pointed at the test's relay (the MessageQueue itself binds its usual port).
LAUNCH_THROUGH_RELAY = """
import os, sys
import rollmesh.launcher.launcher as launcher
planned = launcher.build_plan
def build_plan(*args, **kwargs):
    plan = planned(*args, **kwargs)
    for p in plan:
        if p.proc.role in ("trainer", "rollouter"):
            p.config["message_queue"] = os.environ["ROLLMESH_TEST_MQ_RELAY"]
    return plan
launcher.build_plan = build_plan
from rollmesh.cli import main
sys.argv[0] = "rollmesh"
raise SystemExit(main())
"""


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_with_the_queue_cut_off_from_trainer_and_rollouter_resumes_and_finishes(tmp_path):
    """A real `rollmesh launch` (embedded default) whose trainer -> MessageQueue and rollouter ->
    MessageQueue links both go through one relay. Mid-run the relay black-holes them for 8 s
    (past the heartbeat limit, 1 s x 3, and past nothing else: the RPCs' own timeouts are
    20-30 s), then heals with the held connections lost for good. The run resumes by itself and
    finishes (exit 0, every step once), summary.json's identity holds, no group is in two steps,
    and the cut really stopped the traffic (the trainer made no step in its last seconds).
    What the monitor shows meanwhile: every role alive (they report to the launcher directly,
    not through the relay), the trainer's step frozen, the rollouter's ready_groups piling up
    while the queue's put count stands still; no role is shown dead for this link."""
    import json
    import os
    import subprocess
    import sys

    from tests.e2e.test_launcher import (
        ROOT, assert_nothing_trained_twice, check_accounting, finish, free_ports_base, metrics,
        rollmesh, wait_for,
    )

    base = free_ports_base()
    mq_port = free_ports_base(8)
    while abs(mq_port - base) < 64:
        mq_port = free_ports_base(8)
    relay = Relay(mq_port)
    steps, run_dir = 16, tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH_THROUGH_RELAY, "launch", "launch/local.toml", "--quiet",
         "--run-dir", str(run_dir), "--set", f"ports.base={base}",
         "--set", f"ports.message_queue={mq_port}", "--set", f"trainer.total_steps={steps}",
         "--set", "rollout.eval_every=0"],
        cwd=ROOT, env={**os.environ, "ROLLMESH_TEST_MQ_RELAY": relay.address},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 3, 300, "training under way", proc)
        assert relay.connections >= 2  # trainer and rollouter both reach the queue through it
        relay.black_hole()
        cut = time.monotonic()
        rows_at_cut = len(metrics(run_dir))
        time.sleep(max(0.0, cut + 4.0 - time.monotonic()))  # a step under way may finish
        rows_mid_cut = len(metrics(run_dir))
        time.sleep(max(0.0, cut + 5.5 - time.monotonic()))
        # what the monitor shows while cut off (read-only, from the launcher's status hub)
        snap = rollmesh("monitor", str(run_dir), "--json", "--once", "--wait", "5")
        time.sleep(max(0.0, cut + 9.0 - time.monotonic()))  # the cut: 9 s, past the limit (3 s)
        rows_at_heal = len(metrics(run_dir))
        connections_at_heal = relay.connections
        relay.heal(keep_connections=False)
        healed = time.monotonic()
        wait_for(lambda: len(metrics(run_dir)) > rows_at_heal, 120, "a step after the heal",
                 proc)
        recovered = time.monotonic() - healed
    finally:
        out = finish(proc, 300)
        relay.close()
    print(f"cut {relay.cut_s():.1f}s (rows {rows_at_cut} -> {rows_mid_cut} -> {rows_at_heal}); "
          f"first step {recovered:.1f}s after the heal; connections {connections_at_heal} -> "
          f"{relay.connections}; run {time.monotonic() - cut:.1f}s from the cut to its end")
    assert snap.returncode == 0, snap.stdout + snap.stderr
    shown = json.loads(snap.stdout)
    print("monitor mid-cut: roles", {r["name"]: r["liveness"] for r in shown["roles"]},
          "rollouter", {k: shown["rollouter"].get(k) for k in (
              "ready_groups", "queued_samples", "admission", "paused", "queue_unreachable_s")},
          "queue", {k: shown["queue"].get(k) for k in ("put", "depth", "dropped")
                    } if shown["queue"] else None, "trainer step", shown["trainer"]["step"])
    # the monitor showed the queue cut off from the rollouter (asked every second, 3 s leash)
    assert shown["rollouter"]["queue_unreachable_s"] is not None, shown["rollouter"]
    assert proc.returncode == 0, out[-3000:]
    assert rows_at_heal == rows_mid_cut  # nothing got through the black hole
    assert relay.connections > connections_at_heal  # the lost connections were made anew
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert_nothing_trained_twice(rows)
    summary = check_accounting(run_dir)
    assert summary["consumed"] == rows[-1]["samples_consumed"], summary
    # nothing failed: the only drops allowed are `stale` ones, accounted for. Measured: groups
    # that piled up in the rollouter during the cut can still miss the bound after the heal
    # (0, 8 or 16 samples of 576 over runs here); no run without a cut dropped any.
    assert set(summary["dropped"]) <= {"stale"}, summary
    print(f"summary: admitted {summary['admitted']} consumed {summary['consumed']} "
          f"dropped {summary['dropped']} in flight {summary['in_flight']}")
