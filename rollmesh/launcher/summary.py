"""The launcher's accounting: what it asks every rollouter and MessageQueue shard at the end of
a run (`collect_accounting`: summary.json) and every few seconds (`snapshot`: the progress
watchdog, rollmesh.launcher.watchdog).

A role may run as several shards (`[roles.rollouter] count = N`, `[roles.message_queue]
count = M`: `rollouter[0..N-1]`, `message_queue[0..M-1]` in the plan); each answers its own
StatsRequest. The figures here are totals over every shard (`RolloutStatus.combine`,
`QueueStatus.combine`, `merge_values`: rollmesh.core.accounting) and, in summary.json, each
shard's own balance too. With one shard of each, the totals are that shard's figures.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Sequence

from rollmesh.core.accounting import (
    QueueStatus, RolloutStatus, TrainerStatus, dropped_by_reason, identity, merge_values,
)
from rollmesh.engine.auth import EngineKeys
from rollmesh.engine.client import EngineClient, version_number
from rollmesh.launcher.plan import Planned, _connect
from rollmesh.launcher.watchdog import Snapshot
from rollmesh.wire.messages import Pause, StatsRequest
from rollmesh.wire.transport import PeerTimeout, RemoteError, RpcClient, Transport, TransportError

# The whole stats dicts collect_accounting returns (Launcher.summary), left out of
# summary.json, which holds the identity, the shard counts and each shard's balance.
WHOLE_STATS = ("rollouter", "message_queue", "rollouters", "message_queues")
SETTLE_POLLS = 100  # StatsRequest rounds, 0.1 s apart, for scored groups to reach the queue


def shards(plan: list[Planned], role: str) -> list[Planned]:
    """The role's processes in the plan, in shard (instance) order."""
    return sorted((p for p in plan if p.proc.role == role), key=lambda p: p.proc.index)


def stats_port(p: Planned) -> int:
    """Where a process answers StatsRequest: the rollouter on its control port, the others
    on their own port."""
    return p.port("control") if p.proc.role == "rollouter" else p.proc.port


async def request_stats(transport: Transport, p: Planned,
                        timeout_s: float = 5.0) -> dict[str, Any] | None:
    """One process's StatsRequest, once; None if it does not answer."""
    client = RpcClient(transport, _connect(p.host, stats_port(p)), timeout_s=timeout_s,
                       retries=0)
    try:
        return (await client.request(StatsRequest())).values
    except (PeerTimeout, RemoteError, TransportError):
        return None
    finally:
        client.close()


async def _every(transport: Transport, procs: list[Planned]) -> list[dict[str, Any]] | None:
    """Every shard's stats, or None unless every one answered (a total over some shards would
    read as counts going backwards)."""
    got = await asyncio.gather(*(request_stats(transport, p) for p in procs))
    return None if not got or any(v is None for v in got) else list(got)  # type: ignore[misc]


async def snapshot(transport: Transport, plan: list[Planned], *, engine_urls: list[str],
                   engine_key: str | None, batch_samples: int) -> Snapshot:
    """Where the run stands, for the progress watchdog: the trainer's step and version (its
    stats RPC), each engine's weight version (/get_server_info), the samples dropped by reason
    and queued, summed over every rollouter and MessageQueue shard (unknown while a shard does
    not answer)."""
    trainer = next((p for p in plan if p.proc.role == "trainer" and p.proc.index == 0), None)
    tr, rs, qs = await asyncio.gather(
        request_stats(transport, trainer) if trainer is not None else _none(),
        _every(transport, shards(plan, "rollouter")),
        _every(transport, shards(plan, "message_queue")))
    versions: list[int | None] = []
    if engine_urls:
        async with EngineClient(engine_urls, retries=0, api_key=engine_key) as client:
            for info in await client.server_info_each(timeout_s=5):
                state = ((info or {}).get("internal_states") or [{}])[0]
                v = (info or {}).get("weight_version", state.get("weight_version"))
                versions.append(None if info is None else version_number(v))
    trainer_status = TrainerStatus.parse(tr) if tr else None
    rollout = RolloutStatus.combine([RolloutStatus.parse(v) for v in rs]) if rs else None
    queue = QueueStatus.combine([QueueStatus.parse(v) for v in qs]) if qs else None
    return Snapshot(
        t=time.monotonic(),
        trainer_step=trainer_status.step if trainer_status else None,
        trainer_version=trainer_status.version if trainer_status else None,
        engine_versions=versions,
        dropped=dropped_by_reason(*(s.dropped for s in (rollout, queue) if s is not None)),
        generated=rollout.queued_samples if rollout and rollout.queued_any else None,
        queue_depth=queue.depth_samples if queue else None,
        batch_samples=batch_samples,
        outstanding=rollout.outstanding if rollout else None)


async def _none() -> None:
    return None


def shard_balances(rollouters: list[RolloutStatus], queues: list[QueueStatus]
                   ) -> dict[str, list[dict[str, Any]]]:
    """Each shard's own figures and balance (`off`: 0 when it balances), in shard order."""
    return {
        "rollouter": [{"shard": i, "admitted": r.admitted_samples, "queued": r.queued_samples,
                       "in_flight": r.in_flight, "dropped": dict(r.dropped), "off": r.off}
                      for i, r in enumerate(rollouters)],
        "message_queue": [{"shard": i, "put": q.put_samples, "consumed": q.consumed_samples,
                           "depth": q.depth_samples, "dropped": dict(q.dropped), "off": q.off}
                          for i, q in enumerate(queues)],
    }


async def collect_accounting(transport: Transport, plan: list[Planned],
                             engine_urls: Sequence[str] = (),
                             engine_keys: EngineKeys | None = None) -> dict[str, Any]:
    """The end of a run: pause every rollouter shard at once (abort: the engines' requests
    are aborted meanwhile, `EngineClient.abort_while`, with the run's admin key), poll every
    rollouter's and MessageQueue's stats until no rollouter holds a sample in transit to the
    queue (`RolloutStatus.settled`), then the identity over the totals. Returns the identity's terms
    (`Identity.summary`), `rollouter` and `message_queue` (the shards' stats merged,
    `merge_values`), `rollouters` and `message_queues` (each shard's, in shard order),
    `shards` (how many of each) and `balances` (`shard_balances`); {} without a rollouter or a
    queue in the plan; {"error": why} if they could not be asked."""
    rollouters, queues = shards(plan, "rollouter"), shards(plan, "message_queue")
    if not rollouters or not queues:
        return {}
    r_clients = [RpcClient(transport, _connect(p.host, stats_port(p)), timeout_s=30, retries=0)
                 for p in rollouters]
    q_clients = [RpcClient(transport, _connect(p.host, stats_port(p)), timeout_s=10, retries=0)
                 for p in queues]

    async def stats(clients: list[RpcClient]) -> list[dict[str, Any]]:
        return [m.values for m in await asyncio.gather(*(c.request(StatsRequest())
                                                          for c in clients))]

    try:
        pausing = asyncio.gather(*(c.request(Pause(mode="abort"), timeout_s=60)
                                   for c in r_clients))
        if engine_urls:
            keys = engine_keys or EngineKeys()
            async with EngineClient(list(engine_urls), retries=0, api_key=keys.api,
                                    admin_key=keys.admin) as engines:
                await engines.abort_while(pausing)
        else:
            await pausing
        for _ in range(SETTLE_POLLS):  # let scored groups reach the queue: nothing in transit
            r, q = await asyncio.gather(stats(r_clients), stats(q_clients))
            if all(RolloutStatus.parse(v).settled for v in r):
                break
            await asyncio.sleep(0.1)
        rs, qs = [RolloutStatus.parse(v) for v in r], [QueueStatus.parse(v) for v in q]
        ident = identity(RolloutStatus.combine(rs), QueueStatus.combine(qs))
        return {**ident.summary(), "rollouter": merge_values(r), "message_queue": merge_values(q),
                "rollouters": r, "message_queues": q,
                "shards": {"rollouter": len(r), "message_queue": len(q)},
                "balances": shard_balances(rs, qs)}
    except Exception as e:  # the run is ending anyway: record why there is no accounting
        return {"error": f"could not collect the accounting: {type(e).__name__}: {e}"}
    finally:
        for c in (*r_clients, *q_clients):
            c.close()


def summary_json(summary: dict[str, Any]) -> dict[str, Any]:
    """What summary.json holds of the launcher's summary: all but the whole stats dicts."""
    return {k: v for k, v in summary.items() if k not in WHOLE_STATS}
