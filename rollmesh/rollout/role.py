"""The rollouter role: owns every sample from admission until the MessageQueue.

With several rollouters (`[roles.rollouter] count`), each is a rollout shard: its own prompts
(the dataset rows whose index is its shard modulo the count), workers, journal and share of the
admission bound; only shard 0 runs evaluation rounds. With several queue shards it routes each
group it admits to one (`RolloutCore.route`) and runs one put loop per shard.

Its rules (capacity, admission, dispatch, returned and scored trajectories, group completion,
pause bookkeeping), its journal, group filters and evaluation rounds live in `rollmesh.rollout`
(`core.RolloutCore`), without sockets. This module is the role around them: it receives the
workers' messages and hands them to the core, sends what the core's actions say, exchanges
heartbeats with the workers (a worker silent for `liveness` heartbeats, or unreachable, is lost:
its trajectories are re-queued as they were when dispatched), answers the synchronizer's Pause,
Resume and StatsRequest, and runs the put loop: the groups the core accepted go to the
MessageQueue, what is ready in one PutGroups (held and retried while the queue is full:
back-pressure); the replies say how many samples the queue dropped as stale, whose places in
the bound admission gives back. Each finished evaluation round is published to the status hub
(`announce_evals`) for the trainer's metrics rows.

Engine outages: the rollouter probes the engines' /health (`engines` in its spec); while none
is healthy it admits no new prompt (the dataset cursor stands still; generations already
admitted wait in the workers, up to rollout.engine_wait_s) and says so in its stats
(`engines_healthy`, `admission`); it admits again as soon as one answers.

Pause (from the synchronizer): stop dispatching, send Cancel to every agent worker, answer
Paused once no trajectory is out with a worker, but for those a worker holds (`Held`: loops
whose own code cannot move, e.g. openai_agent; their generations are stopped, they stay counted
as out with that worker and come back after the Resume); with `sync.pause_mode = "in_place"`
send no Cancel and answer Paused at once (the engines keep the requests through the sync).
Resume(version): tell the agent workers (held trajectories go on), dispatch the cancel queue
first, then new prompts. A rollouter restarted between a Pause and its Resume comes back paused
(the journal records both) and waits for the Resume.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any

from rollmesh.config import ExperimentConfig, parse_config, queue_addresses
from rollmesh.rollout.data import PromptSource
from rollmesh.engine.auth import EngineKeys
from rollmesh.engine.client import EngineClient
from rollmesh.mq.client import put_ready
from rollmesh.config import RolloutSettings
from rollmesh.wire.messages import (
    Group,
    Heartbeat,
    Held,
    Metrics,
    Ok,
    Pause,
    Paused,
    PutGroupsReply,
    Resume,
    Returned,
    Scored,
    StatsRequest,
    Trajectory,
    WorkerHello,
)
from rollmesh.rollout.core import RolloutCore, Send
from rollmesh.rollout.eval_round import EvalRounds
from rollmesh.rollout.journal import Journal
from rollmesh.rollout.workers import Worker, WorkerPool
from rollmesh.runtime.process import RoleContext
from rollmesh.core.trajectory import load_tokenizer
from rollmesh.wire.transport import RpcClient, RpcServer
from rollmesh.wire.channels import Channel, Liveness


class Rollouter:
    """The role: the core (`self.core`), its channel to the workers and its client of the
    MessageQueue. `changed` wakes the dispatch loop, `drained` a pause, `ready_added` the put
    loop of each queue shard."""

    def __init__(self, ctx: RoleContext, exp: ExperimentConfig, source: PromptSource,
                 tokenizer: Any, channel: Channel, mq: RpcClient | list[RpcClient],
                 journal: Journal | None = None, *, shard: int = 0, shards: int = 1):
        self.ctx, self.log, self.exp = ctx, ctx.log, exp
        self.queues = mq if isinstance(mq, list) else [mq]  # one client per queue shard
        self.core = RolloutCore(exp, source, tokenizer, journal, ctx.log, shard=shard,
                                shards=shards, queues=len(self.queues))
        self.channel, self.mq = channel, self.queues[0]
        self.liveness = Liveness(ctx.spec.heartbeat_s, ctx.spec.liveness)
        self.changed = asyncio.Event()
        self.drained = asyncio.Event()
        self.ready_added = [asyncio.Event() for _ in self.queues]  # one per queue shard
        # a queue shard stopped answering: since when, by shard
        self.unreachable: dict[int, float] = {}

    # -- the core's state, read through ----------------------------------------------------

    @property
    def workers(self) -> WorkerPool:
        return self.core.workers

    @property
    def loops(self) -> dict[str, type | None]:
        return self.core.loops

    @property
    def counters(self) -> collections.Counter[str]:
        return self.core.counters

    @property
    def dropped(self) -> collections.Counter[str]:
        return self.core.dropped

    @property
    def cancel_queue(self) -> collections.deque[Trajectory]:
        return self.core.cancel_queue

    @property
    def to_score(self) -> collections.deque[Trajectory]:
        return self.core.to_score

    @property
    def paused(self) -> bool:
        return self.core.paused

    def in_flight(self) -> int:
        return self.core.in_flight()

    @property
    def queue_unreachable_since(self) -> float | None:
        """Since when a queue shard has not answered (the earliest), None: all answer."""
        return min(self.unreachable.values(), default=None)

    def stats(self) -> dict[str, Any]:
        unreachable = self.queue_unreachable_since
        return self.core.stats(
            protocol_errors=self.channel.protocol_errors, now=time.monotonic(),
            queue_unreachable_s=(None if unreachable is None else
                                 round(time.monotonic() - unreachable, 1)))

    # -- the core's actions, carried out ---------------------------------------------------

    async def send(self, action: Send) -> None:
        if not await self.channel.send(action.worker.peer, action.msg):
            await self.worker_lost(action.worker, "unreachable")

    async def dispatch(self) -> None:
        for action in self.core.dispatch():
            await self.send(action)

    async def worker_lost(self, worker: Worker, why: str) -> None:
        """Re-queue everything the worker held, as it was when dispatched."""
        if self.core.worker_lost(worker, why):
            self.liveness.forget(worker.peer.hex())
            self._check_drained()

    def returned(self, worker: Worker, traj: Trajectory) -> None:
        if self.core.returned(worker, traj):
            self._check_drained()

    def held(self, worker: Worker, sample_ids: list[str]) -> None:
        if self.core.held(worker, sample_ids):
            self._check_drained()

    def scored(self, worker: Worker, scored: Scored) -> None:
        group = self.core.scored(worker, scored)
        if group is not None:
            self.ready_added[self.core.queue_of(group)].set()

    def _check_drained(self) -> None:
        if self.core.drained:
            self.drained.set()
        self.changed.set()

    async def pause(self, mode: str) -> Paused:
        cancels = self.core.pause(mode)
        self.drained.clear()
        if mode == "in_place":
            # The engines keep the requests (and their KV) through the sync and continue them
            # under the new weights: no Cancel, nothing to drain. Dispatching stops; what is
            # out with workers stays there and comes back as it finishes.
            self.log.info("paused", mode=mode, in_flight=self.core.agent_out(),
                          cancel_queue=len(self.cancel_queue))
            return Paused(in_flight=self.core.agent_out(), cancel_queue=len(self.cancel_queue))
        started = time.monotonic()
        for action in cancels:
            await self.send(action)
        self._check_drained()
        await self.drained.wait()
        self.log.info("paused", mode=mode, cancel_queue=len(self.cancel_queue),
                      held=self.core.agent_out(), drain_s=round(time.monotonic() - started, 3))
        return Paused(in_flight=self.core.agent_out(), cancel_queue=len(self.cancel_queue))

    def resume(self, version: int) -> None:
        self.core.resume(version)
        self.changed.set()

    async def resume_if_forgotten(self, after_s: float) -> None:
        """A restart came back paused (the journal's last word was a Pause). The synchronizer
        re-sends its Resume until a rollouter answers or the sync's time limit runs out, and
        then resumes rollout whatever happened; if this process heard neither Pause nor Resume
        by then, it does the same rather than stall the run."""
        await asyncio.sleep(after_s)
        if self.core.paused and not self.core.synchronizer_spoke:
            self.log.error("resume_never_came", waited_s=after_s, version=self.core.version)
            self.resume(self.core.version)

    # -- what the queue and the engines say --------------------------------------------------

    def queue_heard(self, reply: PutGroupsReply, queue: int = 0) -> None:
        """Queue shard `queue` answered a put: its stale drops of this rollouter's groups
        (samples; groups are data.group_size each; with one rollouter all of its drops) give
        places in the bound back (`RolloutCore.queue_stale`), its depth steers the routing,
        and a queue reported cut off is reachable again."""
        since = self.unreachable.pop(queue, None)
        if since is not None:
            self.log.warning("queue_reachable", queue=queue,
                             unreachable_s=round(time.monotonic() - since, 1))
        self.core.queue_depth[queue] = reply.depth
        stale = (reply.dropped_stale if self.core.shards == 1
                 else reply.stale_by_origin.get(str(self.core.shard), 0))
        if self.core.queue_stale(stale // self.exp.data.group_size, queue):
            self.changed.set()

    def queue_unheard(self, queue: int = 0) -> None:
        """A put went unanswered on the put loop's short leash: the queue is reported cut off
        (stats `queue_unreachable_s`, the monitor's header) until it answers again."""
        if queue not in self.unreachable:
            self.unreachable[queue] = time.monotonic()
            self.log.error("queue_unreachable", queue=self.queues[queue].address)

    async def watch_engines(self, urls: list[str], api_key: str | None,
                            interval_s: float = 1.0) -> None:
        """Probe every engine's /health; while none answers, admit nothing
        (`RolloutCore.engines_seen`)."""
        self.core.engines = list(urls)
        async with EngineClient(urls, api_key=api_key, connect_timeout_s=2.0) as client:
            while True:
                answers = await asyncio.gather(*(client.health(u) for u in urls))
                if self.core.engines_seen(sum(answers), urls, time.monotonic()):
                    self.changed.set()
                await asyncio.sleep(interval_s)

    # -- loops -------------------------------------------------------------------------------

    async def receive(self) -> None:
        while True:
            peer, msg = await self.channel.recv()
            self.liveness.beat(peer.hex())
            worker = self.workers.get(peer)
            if isinstance(msg, WorkerHello):
                if worker is not None:
                    await self.worker_lost(worker, "re-registered")
                resume = self.core.worker_joined(peer, msg)
                if resume is not None:
                    await self.channel.send(peer, resume)
            elif worker is None:
                self.core.events["messages_from_unknown_peers"] += 1
                continue
            else:
                await self.handle(worker, msg)
            self.changed.set()

    async def handle(self, worker: Worker, msg: Any) -> None:
        """One message from a registered worker."""
        sample_id = (msg.sample_id if isinstance(msg, Scored)
                     else getattr(getattr(msg, "trajectory", None), "sample_id", None))
        dispatched = worker.out.get(sample_id) if sample_id is not None else None
        try:
            if isinstance(msg, Returned):
                self.returned(worker, msg.trajectory)
            elif isinstance(msg, Held):
                self.held(worker, msg.sample_ids)
            elif isinstance(msg, Scored):
                self.scored(worker, msg)
            elif not isinstance(msg, (Heartbeat, Metrics)):
                self.core.events["unexpected_messages"] += 1
        except Exception as e:  # well-formed on the wire, nonsense inside: one
            # worker's bad record must not stop the rollouter; its trajectory is
            # re-queued as dispatched when the worker is dropped
            self.core.events["bad_records"] += 1
            if dispatched is not None:  # back as it was sent, to be re-queued
                self.workers.give(worker, dispatched)
            self.log.error("bad_record", worker=worker.name, type=type(msg).__name__,
                           error=f"{type(e).__name__}: {e}")
            await self.worker_lost(worker, f"sent a bad record: {e}")

    async def schedule(self) -> None:
        while True:
            await self.changed.wait()
            self.changed.clear()
            await self.dispatch()

    async def heartbeats(self) -> None:
        seq = 0
        while True:
            await asyncio.sleep(self.liveness.interval_s)
            seq += 1
            for w in list(self.workers.values()):
                if not self.liveness.is_alive(w.peer.hex()):
                    await self.worker_lost(w, "silent")
                elif not await self.channel.send(w.peer, Heartbeat(sender="rollouter", seq=seq)):
                    await self.worker_lost(w, "unreachable")
            self.changed.set()

    async def put_ready(self) -> None:
        """Move accepted groups into the MessageQueue, what is ready in one put; wait while it
        is full (`rollmesh.mq.client.put_ready`). Its replies carry the queue's stale drops
        (`queue_heard`); with nothing to put it still sends an empty put every second. One put
        loop per queue shard, each over the groups routed to it."""
        def queued(group: Group) -> None:
            self.core.queued(group)
            self.changed.set()

        def full() -> None:
            self.core.events["queue_full_waits"] += 1

        loops = [put_ready(mq, self.core.readies[j], self.ready_added[j], queued, log=self.log,
                           full=full, heard=lambda reply, j=j: self.queue_heard(reply, j),
                           unheard=lambda j=j: self.queue_unheard(j),
                           sending=self.core.sending[j])
                 for j, mq in enumerate(self.queues)]
        await asyncio.gather(*loops)


async def announce_evals(ctx: RoleContext, evals: EvalRounds) -> None:
    """Publish each finished evaluation round to the status hub as it ends (topic
    `eval.rollouter.<instance>`), and the newest again every status interval: pub/sub drops
    a message sent before a subscriber is connected or past a full buffer, and the trainer
    keeps the newest by version, so a repeat costs nothing and a loss lasts one interval."""
    ended = asyncio.Event()
    evals.on_result = lambda result: ended.set()
    while True:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(ended.wait(), ctx.spec.status_interval_s)
        ended.clear()
        if evals.last is not None:
            await ctx.announce("eval", evals.last)


async def main(ctx: RoleContext) -> None:
    """Role entry. settings: rollmesh.config.RolloutSettings."""
    settings = parse_config(RolloutSettings, ctx.config, "rollouter spec")
    exp = settings.experiment
    if settings.shard >= settings.shards:
        raise ValueError(f"rollouter spec: shard: expected int < shards ({settings.shards}), "
                         f"got {settings.shard}")
    if settings.shard > 0:  # evaluation rounds run on rollout shard 0 only
        exp = dataclasses.replace(exp, rollout=dataclasses.replace(exp.rollout, eval_every=0))
    source = PromptSource.from_config(exp.data, shard=settings.shard, shards=settings.shards)
    tokenizer = load_tokenizer(exp.model)
    channel = Channel(ctx.transport, settings.bind, name="rollouter",
                      allow={"agent_worker", "reward_worker"})
    queues = [RpcClient(ctx.transport, address, timeout_s=30,
                        name=f"message queue {j}" if j else "message queue")
              for j, address in enumerate(queue_addresses(settings))]
    state_dir = settings.state_dir
    journal = Journal(Path(state_dir) / "rollouter.log", ctx.log) if state_dir else None
    r = Rollouter(ctx, exp, source, tokenizer, channel, queues, journal, shard=settings.shard,
                  shards=settings.shards)
    r.core.restore(restarted=ctx.spec.restart > 0)

    async def pause(msg: Pause, peer: bytes) -> Paused:
        return await r.pause(msg.mode)

    async def resume(msg: Resume, peer: bytes) -> Ok:
        if msg.rewind:  # the trainer resumed at an older version: what newer weights made goes
            r.core.rewind(msg.version)
        r.resume(msg.version)
        return Ok()

    async def stats(msg: StatsRequest, peer: bytes) -> Metrics:
        return Metrics(role="rollouter", host=ctx.spec.host,
                       values={**r.stats(), "protocol_errors": control.stats.protocol_errors})

    # the synchronizer pauses and resumes; the launcher pauses (abort) for the run's summary
    control = RpcServer(ctx.transport, settings.control,
                        {Pause: pause, Resume: resume, StatsRequest: stats}, name="rollouter",
                        allow={Pause: {"synchronizer", "launcher"}, Resume: {"synchronizer"},
                               StatsRequest: None})
    coros = [r.receive(), r.schedule(), r.heartbeats(), r.put_ready(), control.serve()]
    if r.core.eval.rows and ctx.publisher is not None:
        coros.append(announce_evals(ctx, r.core.eval))
    if settings.engines:  # no new prompt while no engine can generate it
        coros.append(r.watch_engines(settings.engines, EngineKeys.load(ctx.spec.keys_dir).api))
    tasks = [asyncio.create_task(c) for c in coros]
    backstop = (asyncio.create_task(r.resume_if_forgotten(exp.sync.timeout_s + 10))
                if r.paused else None)
    r.core.start_eval()  # version 0: the policy before any training
    r.changed.set()
    ctx.set_status(lambda: {k: v for k, v in r.stats().items() if k != "cursor"})
    await ctx.ready(channel=channel.address, rpc=control.address)
    await asyncio.wait([asyncio.create_task(ctx.stopping.wait()), *tasks],
                       return_when=asyncio.FIRST_COMPLETED)
    if backstop is not None:
        backstop.cancel()
    for t in tasks:
        if t.done() and t.exception():
            raise t.exception()
        t.cancel()
    # let the cancelled loops unwind (the engine probe's HTTP session closes in its `async
    # with`; not awaited, it was reported unclosed at every exit)
    await asyncio.wait(tasks, timeout=5)
    ctx.log.info("stats", **{k: v for k, v in r.stats().items() if k != "workers"})
    if journal is not None:
        journal.close()
    channel.close()
    control.close()
    for mq in queues:
        mq.close()
