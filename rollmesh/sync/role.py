"""The parameter synchronizer role (a singleton): one weight sync at a time, in order.

The message flow of one sync (docs/architecture.md, "One weight sync, step by step"); every
arrow is a request that the callee answers, and nobody waits on a request to itself:

    trainer rank 0                synchronizer                 rollouter       MessageQueue
    SyncRequest(v+1) ---------->  Pause(mode) ---------------> (drain)
                                  (abort mode: every engine's requests aborted meanwhile)
                                  <------------------------- Paused
    <-------------------------- SyncGo(v+1, pause_s)          "broadcast now"
    (rank 0: /update_weights_from_distributed fired at every engine, buckets broadcast over
     the weight-update group, replies collected; the first sync builds the group)
    SyncDone(v+1, ok) --------->  WeightVersion(v+1) ------------------------------> (drops stale)
                                  Resume(v+1) -------------> (cancel queue first)
    <-------------------------- Ok

The answer to SyncRequest is the synchronizer's "broadcast" to the trainer: the trainer needs
no server of its own, and the broadcast runs while no RPC is outstanding on the synchronizer's
side, so neither can wait on the other. The trainer is idle from SyncRequest to the Ok, unless
it overlaps its syncs (`sync.overlap`): then a background task of rank 0 sends a snapshot of the
weights along this same flow while the trainer computes, and `trainer_idle_s` here is the
sync's length, not the trainer's wait (its own `sync_idle_s` metric).

A sync is `ok` only if every engine that is serving holds the new version: before publishing it
to the MessageQueue, the synchronizer reads every engine's /get_server_info (config `engines`);
an engine that answers with another version (it restarted during or after the broadcast, with
the initial weights) makes SyncDone(ok) fail with an error naming it, the sync stays in
progress, and the trainer reports the attempt failed and tries again with the group rebuilt.
An engine that does not answer is not serving (the launcher is restarting it); when it is back,
the trainer's check (`rollmesh.training.weight_sender.WeightSender.engines_behind`, at every step
and whenever its wait for a batch comes back empty) sees it behind and sends it the current
weights again: SyncRequest(republish=True), accepted at any version, always with the group
rebuilt.

Failure: SyncDone(ok=False) resumes rollout at the old version (the trainer fails loudly, the
engines' weights are suspect); a trainer that never reports back within `sync.timeout_s` after
SyncGo gets the same (rollout must not stay paused forever). A repeated SyncRequest for the
version in progress is answered like the first; one for a version at or below the published
one is refused. Versions need not be consecutive: a trainer resumed from a checkpoint continues
its own sequence.

Rewind: a trainer that resumes at an older version than the rollout side's (the run was cut, or
the trainer died, past its checkpoint; the queue's version says so) republishes with
`SyncRequest.rewind`. The weights of the versions after its checkpoint no longer exist (it makes
new ones under the same numbers), so this sync pauses rollout in abort mode, and once the
broadcast is done sends Resume(rewind) to every rollouter, then WeightVersion(rewind) to every
queue shard: each goes back to the version and drops once, reason "lost_weights", what the lost
versions admitted or generated (`RolloutCore.rewind`, `MessageQueue.rewind`); the batches the
queue handed out and the trainer trains again are kept.

Timings of each sync (pause, broadcast, resume, trainer idle) are kept and answered to
StatsRequest as Metrics.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

from rollmesh.config import ExperimentConfig, parse_config, queue_addresses
from rollmesh.config import SynchronizerSettings
from rollmesh.wire.messages import (
    EnginesChanged,
    Metrics,
    Ok,
    Pause,
    Paused,
    Resume,
    StatsRequest,
    SyncDone,
    SyncGo,
    SyncRequest,
    WeightVersion,
)
from rollmesh.engine.answers import serves_other_version
from rollmesh.engine.auth import EngineKeys
from rollmesh.engine.client import EngineClient
from rollmesh.runtime.process import RoleContext
from rollmesh.wire.transport import RpcClient, RpcServer


PAUSE_RETRY_S = 10.0
# After EnginesChanged, rollout is paused (a restarted engine serves the initial weights: all it
# generates would be stale) until the trainer re-publishes; resumed anyway after this long.
HOLD_S = 30.0


@dataclass
class Sync:
    version: int
    requested: float
    go: SyncGo | None = None
    paused: asyncio.Future = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    watchdog: asyncio.Task | None = None
    changes: int = 0  # the engine restarts this sync's group rebuild covers
    rewind: bool = False  # a republish that takes the rollout side back (SyncRequest.rewind)


class Fanout:
    """Several shards of one role (rollouters, queue shards) asked as one: each request goes to
    every shard at once and is answered once all have answered (Paused: the sums of what each
    holds); the first failure is raised, and Pause, Resume and WeightVersion are idempotent, so
    the retry asks every shard again."""

    def __init__(self, clients: list[RpcClient]):
        self.clients = clients
        self.address = ", ".join(c.address for c in clients)

    async def request(self, msg: Any, **kwargs: Any) -> Any:
        answers = await asyncio.gather(*(c.request(msg, **kwargs) for c in self.clients))
        if all(isinstance(a, Paused) for a in answers):
            return Paused(in_flight=sum(a.in_flight for a in answers),
                          cancel_queue=sum(a.cancel_queue for a in answers))
        return answers[0]

    def close(self) -> None:
        for c in self.clients:
            c.close()


def fanout(ctx: RoleContext, addresses: list[str], name: str, **kwargs: Any) -> Any:
    """One RpcClient, or a Fanout over one per shard."""
    clients = [RpcClient(ctx.transport, a, name=f"{name} {j}" if len(addresses) > 1 else name,
                         **kwargs) for j, a in enumerate(addresses)]
    return clients[0] if len(clients) == 1 else Fanout(clients)


class Synchronizer:
    def __init__(self, ctx: RoleContext, exp: ExperimentConfig, rollouter: RpcClient | Fanout,
                 mq: RpcClient | Fanout, version: int = 0, engines: EngineClient | None = None):
        self.ctx, self.log = ctx, ctx.log
        self.exp = exp
        self.rollouter, self.mq = rollouter, mq
        self.version = version  # the version the engines serve
        self.current: Sync | None = None
        self.lock = asyncio.Lock()  # one sync at a time, start to finish
        self.history: list[dict[str, Any]] = []
        self.failures = 0
        self.engines = engines  # to check the engines' versions before publishing one
        # Engine restarts heard of (EnginesChanged), and how many of them the last successful
        # sync that rebuilt the group covered: a restart announced during a sync is not lost.
        self.changes = 0
        self.covered = 0
        self.holding: asyncio.Task | None = None  # rollout paused for a restarted engine
        self.abandoned: set[int] = set()  # versions whose sync this process gave up waiting for

    async def request(self, msg: SyncRequest) -> SyncGo:
        current = self.current
        if current is not None and current.version == msg.version:
            return await asyncio.shield(current.paused)  # a retry of the sync in progress
        if msg.version <= self.version and not msg.republish:
            raise ValueError(f"version {msg.version} is not newer than the published "
                             f"version {self.version}")
        await self.lock.acquire()
        if self.holding is not None and self.holding is not asyncio.current_task():
            self.holding.cancel()  # this sync resumes rollout when it is done
            self.holding = None
        sync = self.current = Sync(msg.version, time.monotonic(), changes=self.changes,
                                   rewind=msg.rewind and msg.republish)
        try:
            started = time.monotonic()
            # a rewind's pause aborts what is out, so that the rollouter has every trajectory
            # in hand, with what it generated, when it decides what the lost weights made
            mode = "abort" if sync.rewind else self.exp.sync.pause_mode
            paused: Paused = await self.pause(mode)
            sync.go = SyncGo(version=msg.version, pause_s=time.monotonic() - started,
                             cancel_queue=paused.cancel_queue,
                             rebuild_group=self.rebuild or msg.republish)
        except BaseException as e:
            self.current = None
            self.lock.release()
            sync.paused.set_exception(e if isinstance(e, Exception) else RuntimeError(str(e)))
            sync.paused.exception()  # retrieved: no "never retrieved" warning
            raise
        sync.paused.set_result(sync.go)
        sync.watchdog = asyncio.create_task(self._watchdog(sync))
        self.log.info("sync_paused", version=msg.version, pause_s=round(sync.go.pause_s, 4),
                      cancel_queue=paused.cancel_queue, republish=msg.republish,
                      rebuild_group=sync.go.rebuild_group)
        return sync.go

    @property
    def rebuild(self) -> bool:
        """An engine was restarted since the last successful sync that rebuilt the group."""
        return self.changes > self.covered

    def engines_changed(self) -> None:
        self.changes += 1

    def hold(self) -> None:
        """An engine restarted with the initial weights: pause rollout until the trainer sends
        it the current version (it checks at every step and every empty wait for a batch), so
        that nothing is generated at version 0 only to be dropped as stale. Not during a sync
        (it rebuilds the group and checks the versions), not at version 0, and for HOLD_S at
        most (a trainer that never re-publishes does not leave rollout paused)."""
        if self.version == 0 or self.current is not None or self.holding is not None:
            return
        self.holding = asyncio.create_task(self._hold())

    async def _hold(self) -> None:
        try:
            if self.engines is None or not await self.engines_behind(self.version):
                return  # it already holds the version (a sync's retry sent it) or cannot tell
            if self.lock.locked():
                return  # a sync is starting: it rebuilds the group and checks the versions
            await self.pause(self.exp.sync.pause_mode)
            self.log.info("rollout_held", version=self.version, hold_s=HOLD_S,
                          reason="an engine restarted with the initial weights")
            deadline = time.monotonic() + HOLD_S
            while time.monotonic() < deadline:  # a sync that starts cancels this task
                await asyncio.sleep(1.0)
                if not await self.engines_behind(self.version):
                    break
            else:
                self.log.warning("rollout_hold_expired", version=self.version)
            if not self.lock.locked() and self.current is None:
                await self.rollouter.request(Resume(version=self.version), **self._patient())
        except Exception as e:  # noqa: BLE001 - the next sync resumes rollout anyway
            self.log.warning("rollout_hold_failed", error=str(e)[:300])
        finally:
            self.holding = None

    async def engines_behind(self, version: int) -> list[str]:
        """The engines that answer /get_server_info with a version other than `version`
        (one that does not answer is not serving: it is left out)."""
        if self.engines is None:
            return []
        infos = await self.engines.server_info_each(timeout_s=5.0)
        return [f"{s.url} at version {info.get('weight_version')}"
                for s, info in zip(self.engines.servers, infos)
                if info is not None and serves_other_version(info, version)]

    async def pause(self, mode: str) -> Paused:
        """Pause rollout; in abort mode the engines' requests are aborted here until the
        rollouter has its trajectories back (`EngineClient.abort_while`: the workers cannot)."""
        pending = self.rollouter.request(Pause(mode=mode), **self._patient())
        if mode == "abort" and self.engines is not None:
            return await self.engines.abort_while(pending)
        return await pending

    def _patient(self) -> dict[str, Any]:
        """Pause and Resume are idempotent: ask again every PAUSE_RETRY_S (a rollouter that
        restarted since the first ask never saw it), within the sync's time limit."""
        limit = self.exp.sync.timeout_s
        per_try = min(limit, PAUSE_RETRY_S)
        return {"timeout_s": per_try, "retries": max(0, math.ceil(limit / per_try) - 1)}

    async def done(self, msg: SyncDone) -> Ok:
        sync = self.current
        if sync is None and msg.ok and msg.version == self.version:
            return Ok(message=f"version {self.version}")  # a retry of one already finished
        if sync is None and msg.version > self.version and msg.version not in self.abandoned:
            # A sync the previous synchronizer process started before it died: the trainer
            # finished it. Publish the version (or not) and resume rollout, as it would have.
            behind = await self.engines_behind(msg.version) if msg.ok else []
            if behind:
                raise ValueError(f"sync of version {msg.version} is not done: "
                                 f"{'; '.join(behind)} (restarted?)")
            self.log.warning("sync_adopted", version=msg.version, ok=msg.ok)
            await self.lock.acquire()
            sync = self.current = Sync(msg.version, time.monotonic())
            sync.go = SyncGo(version=msg.version, pause_s=0.0, cancel_queue=0)
            sync.paused.set_result(sync.go)
            await self._finish(sync, msg)
            return Ok(message=f"version {self.version}")
        if sync is None or sync.version != msg.version:
            raise ValueError(f"SyncDone for version {msg.version}, but the sync in progress is "
                             f"{sync.version if sync else 'none'}")
        if msg.ok:
            behind = await self.engines_behind(msg.version)
            if self.current is not sync:  # the watchdog gave it up meanwhile
                raise ValueError(f"sync of version {msg.version} was given up after "
                                 f"sync.timeout_s={self.exp.sync.timeout_s:g}")
            if behind:
                # Not ok: the sync stays in progress (rollout paused, the watchdog running);
                # the trainer reports the attempt failed and broadcasts again, group rebuilt.
                self.log.warning("sync_engine_behind", version=msg.version, engines=behind)
                raise ValueError(f"sync of version {msg.version} is not done: "
                                 f"{'; '.join(behind)} (restarted?)")
        if sync.watchdog is not None:
            sync.watchdog.cancel()
        await self._finish(sync, msg)
        return Ok(message=f"version {self.version}")

    async def _watchdog(self, sync: Sync) -> None:
        await asyncio.sleep(self.exp.sync.timeout_s)
        self.log.error("sync_timed_out", version=sync.version, timeout_s=self.exp.sync.timeout_s)
        self.abandoned.add(sync.version)
        if self.exp.sync.pause_mode == "in_place" and self.engines is not None:
            # The trainer paused the engines in place and never came back to continue them:
            # without this they would hold their requests until a restarted trainer syncs.
            try:
                await self.engines.resume()
                self.log.warning("engines_continued", version=sync.version,
                                 reason="in-place sync abandoned")
            except Exception as e:  # noqa: BLE001 - an engine that is down continues nothing
                self.log.error("engines_continue_failed", version=sync.version, error=str(e))
        await self._finish(sync, SyncDone(version=sync.version, ok=False,
                                          error="the trainer did not report back in time"))

    async def _finish(self, sync: Sync, msg: SyncDone) -> None:
        """Publish the version (if the broadcast worked) and resume rollout, whatever happened."""
        if self.current is not sync:
            return
        self.current = None
        started = time.monotonic()
        try:
            if msg.ok and sync.rewind:
                # Rollouters first: each drops what the lost versions made and is no longer
                # about to put any of it; then the queue drops what it holds of it.
                await self.rollouter.request(Resume(version=msg.version, rewind=True),
                                             **self._patient())
                await self.mq.request(WeightVersion(version=msg.version, rewind=True))
                self.version = msg.version
                self.log.warning("rewound", version=msg.version)
            elif msg.ok:
                await self.mq.request(WeightVersion(version=msg.version))
                self.version = msg.version
                if sync.go is not None and sync.go.rebuild_group:
                    # every engine restarted before this sync's SyncGo is in the new group
                    self.covered = max(self.covered, sync.changes)
            else:
                self.failures += 1
                self.log.error("sync_failed", version=msg.version, error=msg.error,
                               retrying=msg.retrying)
            if (msg.ok and not sync.rewind) or (not msg.ok and not msg.retrying):
                # After a failure the engines may hold part of the new weights: when the
                # trainer retries, rollout stays paused until a broadcast completes.
                await self.rollouter.request(Resume(version=self.version), **self._patient())
        finally:
            self.lock.release()
        now = time.monotonic()
        assert sync.go is not None
        timings = {"version": msg.version, "ok": msg.ok, "pause_s": sync.go.pause_s,
                   "broadcast_s": msg.broadcast_s, "resume_s": now - started,
                   "trainer_idle_s": now - sync.requested, "bytes": msg.bytes,
                   "cancel_queue": sync.go.cancel_queue}
        self.history.append(timings)
        del self.history[:-1000]
        self.log.info("sync_done", **{k: (round(v, 4) if isinstance(v, float) else v)
                                      for k, v in timings.items()})

    def stats(self) -> dict[str, Any]:
        ok = [h for h in self.history if h["ok"]]

        def mean(key: str) -> float:
            return sum(h[key] for h in ok) / len(ok) if ok else 0.0

        last = self.history[-1] if self.history else None
        if last is not None:
            last = {**last, "total_s": last["pause_s"] + last["broadcast_s"] + last["resume_s"]}
        return {"version": self.version, "syncs": len(ok), "failures": self.failures,
                "in_progress": self.current.version if self.current else None,
                "last": last, "last_sync": last,
                "mean_pause_s": mean("pause_s"), "mean_broadcast_s": mean("broadcast_s"),
                "mean_resume_s": mean("resume_s"), "mean_trainer_idle_s": mean("trainer_idle_s")}


async def main(ctx: RoleContext) -> None:
    """Role entry. settings: rollmesh.config.SynchronizerSettings."""
    settings = parse_config(SynchronizerSettings, ctx.config, "synchronizer spec")
    exp = settings.experiment
    # every rollout shard is paused and resumed, every queue shard told the version
    rollouter = fanout(ctx, settings.rollouters or [settings.rollouter], "rollouter",
                       timeout_s=exp.sync.timeout_s, retries=0)
    mq = fanout(ctx, queue_addresses(settings), "message queue", timeout_s=30)
    engines = None
    if settings.engines:
        keys = EngineKeys.load(ctx.spec.keys_dir, admin=True)  # it aborts and resumes them
        engines = EngineClient(settings.engines, api_key=keys.api, admin_key=keys.admin)
        await engines.__aenter__()
    sync = Synchronizer(ctx, exp, rollouter, mq, settings.version, engines)

    async def on_request(msg: SyncRequest, peer: bytes) -> SyncGo:
        return await sync.request(msg)

    async def on_done(msg: SyncDone, peer: bytes) -> Ok:
        return await sync.done(msg)

    async def on_stats(msg: StatsRequest, peer: bytes) -> Metrics:
        return Metrics(role="synchronizer", host=ctx.spec.host, values=sync.stats())

    async def on_engines_changed(msg: EnginesChanged, peer: bytes) -> Ok:
        sync.engines_changed()
        sync.hold()
        ctx.log.info("engines_changed", reason=msg.reason)
        return Ok()

    # only the trainer's sync path moves the version; the launcher says an engine restarted
    server = RpcServer(ctx.transport, settings.bind,
                       {SyncRequest: on_request, SyncDone: on_done, StatsRequest: on_stats,
                        EnginesChanged: on_engines_changed}, name="synchronizer",
                       allow={SyncRequest: {"trainer"}, SyncDone: {"trainer"},
                              EnginesChanged: {"launcher"}, StatsRequest: None})
    serving = asyncio.create_task(server.serve())
    ctx.set_status(sync.stats)
    await ctx.ready(rpc=server.address)
    await ctx.stopping.wait()
    serving.cancel()
    ctx.log.info("stats", **{k: v for k, v in sync.stats().items()
                             if k not in ("last", "last_sync")})
    for c in (rollouter, mq):
        c.close()
    if engines is not None:
        await engines.close()
    server.close()
