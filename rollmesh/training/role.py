"""The trainer role: batches in, policy updates, weights out to the engines, checkpoints.

The algorithm (`train`), on every rank: get the step's batch (`next_batch`: rank 0 asks the
MessageQueue and shares it) -> `training.step.prepare` (old and reference log-probs, the
critic's old values for GAE, advantages) -> `training.step.update_policy`
(`trainer.mini_batches` optimizer updates) -> the step's metrics row -> every `sync.sync_every`
steps a weight sync (`training.weight_sender.sync_weights`: blocking, or with `sync.overlap` sent
from a snapshot while the next step computes) -> every `trainer.checkpoint_every` steps a
checkpoint (`rollmesh.training.checkpoint`). The state and how it is built: `rollmesh.training.state`;
the step's math: `rollmesh.training.step`.

Versions: the trainer's version is the number of weight syncs it has published (the engines
start at version 0 = the initial weights). It asks for batches at its version; a sync publishes
version + 1 (protocol in `rollmesh.sync.role`). A resumed trainer continues the sequence.
The queue streams the batches (`mq.client.BatchFeed`): the next step's batch is taken and
sent while this step trains, when both train at the same version.

Evaluations (`rollout.eval_every`): the rollouter publishes each finished round to the launcher's
status hub as an `EvalResult`; rank 0 subscribes (`Evaluations`) and writes the newest round
not yet reported into the next step's metrics row (eval_pass@k, eval/{source}/...).

Ranks: K processes (role instances 0..K-1), each its own role process, join the trainer's own
process group at `rendezvous` (rank 0 hosts the TCPStore): gloo on CPU, nccl on GPUs; the
models are sharded with FSDP2 (`training.state.shard`; 2 CPU ranks match 1 rank within ~1e-6
after two steps). Rank 0 alone talks to the other roles (`Link`); it sends each batch and each
decision (train, sync, stop) to the other ranks as msgpack bytes (`rollmesh.training.ranks`). Every rank
holds the whole batch and computes what is cheap on it (advantages, normalisers, every rank's
micro-batch plan).

The role's settings (`rollmesh.config.TrainerSettings`; every rank gets the same, `instance` is
the rank): the queue, the synchronizer (without it nothing is synced) and the engines, the
rendezvous (K > 1), where metrics, checkpoints (the latest one there is resumed) and exports go.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from rollmesh.training import checkpoint
from rollmesh.wire import protocol
from rollmesh.config import parse_config, queue_addresses, to_dict
from rollmesh.runtime.durable_log import write_atomic
from rollmesh.runtime.log import get_logger
from rollmesh.core.validate import invalid_group_reason
from rollmesh.engine.auth import EngineKeys
from rollmesh.models.loading import resolve_device
from rollmesh.core.evaluation import eval_metrics
from rollmesh.mq.client import STREAM_AHEAD, BatchFeed, ShardedFeed
from rollmesh.training.metrics_sink import MetricsSinks, require_extras
from rollmesh.config import TrainerSettings
from rollmesh.wire.messages import Batch, EvalResult, Group, Metrics, StatsRequest
from rollmesh.training.ranks import close_ranks, init_ranks
from rollmesh.runtime.process import RoleContext
from rollmesh.training.batching import from_groups
from rollmesh.training.colocate import Turn
from rollmesh.training.state import TrainState, build_state
from rollmesh.training.step import prepare, step_metrics, update_policy
from rollmesh.wire.transport import RpcClient, RpcServer
from rollmesh.wire.channels import Subscriber
from rollmesh.training.weight_sender import WeightSender, finish_sync, sync_weights

run = asyncio.to_thread  # torch work leaves the event loop free for heartbeats and stats
log = get_logger("rollmesh.training")
TRAINED_AGAIN = "metrics.trained-again.jsonl"  # beside metrics.jsonl: rows of steps trained again


def checkpoint_dir(settings: TrainerSettings) -> str | None:
    """Where this trainer's checkpoints go (the role's settings, else trainer.checkpoint_dir)."""
    return settings.checkpoint_dir or settings.experiment.trainer.checkpoint_dir


# -- rank 0's connections -----------------------------------------------------------------------


class Link:
    """Rank 0's connections to the other roles: queue, stats server, weight sender, and the
    status hub's evaluation results (`Evaluations`). `checkpoint_step`: the step of the latest
    checkpoint (None without a checkpoint directory), read from the directory once (`resumed`)
    and then kept by `save_checkpoint`."""

    def __init__(self, ctx: RoleContext, settings: TrainerSettings, state: TrainState,
                 resumed: Path | None = None):
        self.ctx, self.state = ctx, state
        t = ctx.transport
        # one client per queue shard; with several, each step's batch is a share from each
        self.queues = [RpcClient(t, address, timeout_s=60,
                                 name=f"message queue {j}" if j else "message queue")
                       for j, address in enumerate(queue_addresses(settings))]
        self.mq = self.queues[0]
        groups = state.exp.rollout.batch_groups
        self.feed: BatchFeed | ShardedFeed = (
            BatchFeed(self.mq, groups, log=ctx.log) if len(self.queues) == 1
            else ShardedFeed(self.queues, groups, log=ctx.log))
        self.evals = Evaluations(ctx if state.exp.rollout.eval_every else None)
        self.prefix_cache = PrefixCacheFigures(ctx)
        self.sender = (WeightSender(t, to_dict(settings), state.exp.sync, state.device,
                                    keys=EngineKeys.load(ctx.spec.keys_dir, admin=True))
                       if settings.synchronizer else None)
        self.server = RpcServer(t, settings.bind, {StatsRequest: self._stats}, name="trainer",
                                allow={StatsRequest: None})  # any key of the run
        self._serving: asyncio.Task | None = None
        self.last_metrics: dict[str, Any] = {}
        # colocated mode's turn on the device (training/colocate.py); None: not colocated
        self.phase: str | None = "generate" if settings.colocate else None
        metrics_path = settings.metrics_path
        self.metrics_path = Path(metrics_path) if metrics_path else None
        if self.metrics_path is not None:  # on another host, the run's directory is new there
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        self.sinks: MetricsSinks | None = None  # TensorBoard and W&B, opened by `open`
        self.checkpoint_step = (int(resumed.name.rsplit("_", 1)[-1]) if resumed is not None
                                else 0 if checkpoint_dir(settings) else None)
        self.saved_at = time.monotonic()  # the latest checkpoint (trainer.checkpoint_every_s)

    async def open(self) -> dict[str, str]:
        self.sinks = await run(MetricsSinks.open, self.state.exp, self.metrics_path, self.ctx.log)
        if self.sender is not None:
            await self.sender.open()
        self._serving = asyncio.create_task(self.server.serve())
        self.evals.open()
        self.prefix_cache.open()
        return {"rpc": self.server.address}

    async def close(self) -> None:
        if self._serving is not None:
            self._serving.cancel()
        if self.sender is not None:
            await self.sender.close()
        self.feed.close()
        self.evals.close()
        self.prefix_cache.close()
        for mq in self.queues:
            mq.close()
        self.server.close()
        if self.sinks is not None:  # W&B finishes its run and stops its service process
            sinks, self.sinks = self.sinks, None
            await run(sinks.close)

    async def _stats(self, msg: StatsRequest, peer: bytes) -> Metrics:
        s = self.state
        return Metrics(role="trainer", host=self.ctx.spec.host, values={
            "step": s.step, "version": s.version, "samples_consumed": s.samples_consumed,
            "phase": self.phase,
            "last": self.last_metrics})

    def report(self, metrics: dict[str, Any]) -> None:
        self.last_metrics = metrics
        self.ctx.log.info("step", **{k: (round(v, 6) if isinstance(v, float) else v)
                                     for k, v in metrics.items()})
        if self.metrics_path is not None:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(metrics) + "\n")
        if self.sinks is not None:
            self.sinks.log(metrics)

    async def rollout_version(self) -> int:
        """The newest weight version a queue shard knows (0 if none answers): what the rollout
        side was told last, by this trainer or by the one before it."""
        answers = await asyncio.gather(*(q.request(StatsRequest(), timeout_s=10, retries=5)
                                         for q in self.queues), return_exceptions=True)
        versions = [a.values.get("version", 0) for a in answers if isinstance(a, Metrics)]
        return max([v for v in versions if isinstance(v, int)], default=0)

    async def engines_behind(self) -> list[str]:
        """The engines serving another version than the trainer's (logged; [] if none)."""
        assert self.sender is not None
        behind = await self.sender.engines_behind(self.state.version)
        if behind:
            self.ctx.log.warning("engines_behind", version=self.state.version, engines=behind)
        return behind

    async def republish(self) -> None:
        """Send the trainer's version again (every rank is in `sync_weights` with rank 0).
        A failure is logged, not fatal: the next check tries again."""
        try:
            timings = await sync_weights(self.state, self.sender, republish=True)
        except Exception as e:  # noqa: BLE001 - the engines stay behind; checked again soon
            self.ctx.log.error("republish_failed", version=self.state.version, error=str(e)[:500])
            await asyncio.sleep(1.0)
            return
        self.ctx.log.info("weights_republished", version=self.state.version,
                          broadcast_s=round(timings.get("sync_broadcast_s", 0.0), 4),
                          attempts=timings.get("sync_attempts"))


class PrefixCacheFigures:
    """The engines' prefix-cache hit rate for metrics.jsonl, from the agent workers' status (each
    publishes its client's per-engine counters, `prefix_cache`, on the hub every status interval
    as topic `metrics.agent_worker.<i>`; rank 0 subscribes). `step_metrics` gives, for the
    prompt tokens sent since the last row, the share the engines found cached: overall
    (`prefix_cache_hit_rate`) and per engine (`prefix_cache_hit_rate/<host:port>`); nothing when
    no new count was heard (steps closer together than the workers' status interval, 1 s, skip
    it: the next row covers their tokens) or there is no hub. A worker's counters start again
    when it restarts: its figures then count from zero."""

    def __init__(self, ctx: RoleContext | None):
        self.ctx = ctx
        self.latest: dict[str, dict[str, tuple[int, int]]] = {}  # topic -> url -> (prompt, cached)
        self._reported: dict[tuple[str, str], tuple[int, int]] = {}
        self._sub: Subscriber | None = None
        self._task: asyncio.Task | None = None

    def open(self) -> None:
        self._sub = self.ctx.subscribe("metrics.agent_worker.") if self.ctx is not None else None
        if self._sub is not None:
            self._task = asyncio.create_task(self._receive(self._sub), name="prefix_cache")

    def take(self, topic: str, rec: Any) -> None:
        values = rec.values if isinstance(rec, Metrics) and isinstance(rec.values, dict) else {}
        figures = values.get("prefix_cache")
        if not isinstance(figures, dict):
            return
        counts = {}
        for url, c in figures.items():
            try:
                counts[str(url)] = (int(c["prompt_tokens"]), int(c["cached_tokens"]))
            except (KeyError, TypeError, ValueError):
                continue
        self.latest[topic] = counts

    def step_metrics(self) -> dict[str, float]:
        sent: dict[str, list[int]] = {}
        for topic, counts in self.latest.items():
            for url, (prompt, cached) in counts.items():
                before = self._reported.get((topic, url), (0, 0))
                if prompt < before[0] or cached < before[1]:
                    before = (0, 0)  # the worker restarted: its counters began again
                self._reported[(topic, url)] = (prompt, cached)
                t = sent.setdefault(url, [0, 0])
                t[0] += prompt - before[0]
                t[1] += cached - before[1]
        out: dict[str, float] = {}
        total = [sum(t[0] for t in sent.values()), sum(t[1] for t in sent.values())]
        if total[0] > 0:
            out["prefix_cache_hit_rate"] = round(total[1] / total[0], 4)
        for url, (prompt, cached) in sorted(sent.items()):
            if prompt > 0:
                name = url.split("://", 1)[-1]
                out[f"prefix_cache_hit_rate/{name}"] = round(cached / prompt, 4)
        return out

    async def _receive(self, sub: Subscriber) -> None:
        while True:
            topic, rec = await sub.recv()
            self.take(topic, rec)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._sub is not None:
            self._sub.close()


class Evaluations:
    """The rollouter's evaluation results, as it publishes them to the status hub (topic
    `eval.rollouter.`): each round when it ends, and the newest again every status interval.
    Keeps the newest by version, so a message pub/sub dropped is made good by the next one and
    an older one arriving late changes nothing; `unreported` hands each version out once
    (`reported`: the last handed out, for the trainer's stats). Without a hub (no launcher) or
    without evaluation (`ctx` None) nothing arrives; the training is the same."""

    def __init__(self, ctx: RoleContext | None):
        self.ctx = ctx
        self.newest: EvalResult | None = None
        self.reported: EvalResult | None = None
        self._sub: Subscriber | None = None
        self._task: asyncio.Task | None = None

    def open(self) -> None:
        self._sub = self.ctx.subscribe("eval.rollouter.") if self.ctx is not None else None
        if self._sub is not None:
            self._task = asyncio.create_task(self._receive(self._sub), name="evaluations")

    def take(self, rec: Any) -> None:
        if not isinstance(rec, EvalResult):
            if self.ctx is not None:
                self.ctx.log.warning("unexpected_eval_record", type=type(rec).__name__)
            return
        if self.newest is None or rec.version > self.newest.version:
            self.newest = rec

    def unreported(self) -> EvalResult | None:
        """The newest result if it is newer than the last one handed out (it becomes that)."""
        latest = self.newest
        if latest is None or (self.reported is not None
                              and latest.version <= self.reported.version):
            return None
        self.reported = latest
        return latest

    async def _receive(self, sub: Subscriber) -> None:
        while True:
            _, rec = await sub.recv()  # a malformed one is counted and skipped by recv
            self.take(rec)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._sub is not None:
            self._sub.close()


# -- batches in ------------------------------------------------------------------------------------


async def next_batch(ctx: RoleContext, state: TrainState, link: Link | None) -> Batch | None:
    """Rank 0 pulls a batch at its version and shares it with every rank; None: stop.

    Before each request for a batch (so at every step, and again whenever a wait for one comes
    back empty), rank 0 checks that every engine serving holds the trainer's version: one that
    restarted has the initial weights, generates nothing the trainer can use, and would get the
    weights only at the next sync, which may never come if every sample is stale. An engine
    behind gets the current version again at once (every rank takes part in the gather)."""
    ranks = state.ranks
    if not ranks.is_main:
        while True:
            order = await run(ranks.share)
            if order["op"] == "stop":
                return None
            if order["op"] == "batch":
                state.checkpoint_due = bool(order.get("checkpoint_due"))
                return protocol.decode(order["frames"], Batch)
            if order["op"] == "republish":
                with contextlib.suppress(RuntimeError):  # rank 0 gave up; it tries again later
                    await sync_weights(state, None, republish=True)
            if order["op"] == "idle":  # as rank 0: a checkpoint written while idle is latest
                await settle_checkpoint(ctx, state, None, wait=False)
    assert link is not None
    exp = state.exp
    while True:
        if ctx.stopping.is_set() or state.step >= exp.trainer.total_steps:
            await run(ranks.share, {"op": "stop"})
            return None
        # (not while an overlapped sync is in flight: the engines are behind on purpose, and
        # one that restarts is sent the weights by its retry or the next sync)
        if (link.sender is not None and not link.sender.pending()
                and await link.engines_behind()):
            await run(ranks.share, {"op": "republish"})
            await link.republish()
        # The queue keeps each batch it hands out until a checkpoint covers its step, and hands
        # a resumed trainer the same batch again: say which step this is for and which step the
        # latest checkpoint holds (no checkpoint directory: nothing to resume, all done with).
        committed = link.checkpoint_step if link.checkpoint_step is not None else state.step
        # The queue streams the batches: the next one comes while this step trains, if that
        # step trains at the same version (the queue checks staleness at the trainer's version)
        step = state.step + 1
        through = min(step + STREAM_AHEAD, last_step_at_version(state, link),
                      exp.trainer.total_steps)
        batch = await link.feed.get(step, state.version, through, committed, timeout_s=2.0)
        if batch is not None and batch.groups:
            frames = [memoryview(f).tobytes() for f in protocol.encode(batch)]
            every_s = exp.trainer.checkpoint_every_s
            state.checkpoint_due = bool(every_s and link.checkpoint_step is not None
                                        and time.monotonic() - link.saved_at >= every_s)
            await run(ranks.share, {"op": "batch", "frames": frames,
                                    "checkpoint_due": state.checkpoint_due})
            return batch
        await run(ranks.share, {"op": "idle"})  # the other ranks wait in a collective: wake them
        await settle_checkpoint(ctx, state, link, wait=False)  # every rank, as after a step


def last_step_at_version(state: TrainState, link: Link) -> int:
    """The last step the trainer trains at its current weight version: `train` syncs (version
    + 1) after every step that is a multiple of sync.sync_every, and only with a synchronizer."""
    if link.sender is None:
        return state.exp.trainer.total_steps
    every = state.exp.sync.sync_every
    return -(-(state.step + 1) // every) * every


# -- the role --------------------------------------------------------------------------------------


async def save_checkpoint(ctx: RoleContext, state: TrainState, link: Link | None,
                          directory: str | Path) -> None:
    """Start checkpoint `state.step` (every rank): the previous one settled first, then the
    step waits for the copy of its shards to host memory alone; the writing goes on in the
    background (`settle_checkpoint` after each step)."""
    await settle_checkpoint(ctx, state, link, wait=True)
    state.pending_save = await run(
        checkpoint.start_save, directory, model=state.model, optimizer=state.optimizer,
        scheduler=state.scheduler, step=state.step, version=state.version, ranks=state.ranks,
        tokenizer=state.tokenizer, samples_consumed=state.samples_consumed,
        critic=state.critic, critic_optimizer=state.critic_optimizer,
        critic_scheduler=state.critic_scheduler, keep=state.exp.trainer.keep_checkpoints)


async def settle_checkpoint(ctx: RoleContext, state: TrainState, link: Link | None,
                            wait: bool) -> None:
    """The pending checkpoint, if any (every rank, together): `wait` for it, or poll (not
    written yet on every rank: polled again after the next step). Once it is `latest` (and
    only then: the queue may then forget the batches up to its step) the link learns its step;
    an abandoned one changes nothing (logged; the next save tries again)."""
    pending = state.pending_save
    if pending is None:
        return
    result = await run(pending.wait if wait else pending.poll, state.ranks)
    if result is None:
        return
    state.pending_save = None
    step, version = pending.step, pending.version
    if result is False:
        ctx.log.error("checkpoint_abandoned", step=step, error=(pending.error or "")[:500])
        return
    if link is not None:
        link.checkpoint_step = step
        link.saved_at = time.monotonic()
    if state.ranks.is_main:
        ctx.log.info("checkpoint_saved", path=str(result), step=step, version=version,
                     copy_s=round(pending.copy_s, 4), write_s=round(pending.write_s, 4))


async def train(ctx: RoleContext, settings: TrainerSettings, state: TrainState,
                link: Link | None) -> None:
    """The algorithm, on every rank: batch -> step -> metrics row -> weight sync -> checkpoint,
    until the last step or a stop; then the overlapped sync in flight, a last checkpoint and
    the final export."""
    exp = state.exp
    sender = link.sender if link else None
    ckpt_dir = checkpoint_dir(settings)
    every = exp.trainer.checkpoint_every
    saved_at = state.step
    await publish_resumed(ctx, state, link)
    while True:
        waited = time.monotonic()
        batch = await next_batch(ctx, state, link)
        if batch is None:
            break
        if settings.colocate:  # the engines give the device back for the step
            async with Turn(state, sender, link) as turn:
                metrics = await train_step(state, batch, waited)
            metrics.update(turn.metrics())
        else:
            metrics = await train_step(state, batch, waited)
        if state.step % exp.sync.sync_every == 0:
            metrics.update(await sync_weights(state, sender))
            await export_version(settings, state)
        if link is not None and settings.colocate:
            link.phase = "generate"
        if link is not None:
            evaluated = link.evals.unreported()  # each round once, the step after it arrives
            if evaluated is not None:
                metrics.update(eval_metrics(evaluated.summary()))  # eval_pass@k, eval/{source}/..
            metrics.update(link.prefix_cache.step_metrics())  # prefix_cache_hit_rate[/engine]
            link.report(metrics)
        # after the step's row: a checkpoint never holds a step whose row was not written
        # (killed in between, the step is trained again and its row written again)
        await settle_checkpoint(ctx, state, link, wait=False)  # written: it becomes latest
        if ckpt_dir and ((every and state.step % every == 0) or state.checkpoint_due):
            # (overlapped: the sync in flight first, so that a checkpoint's version was sent)
            await finish_sync(state, sender)
            await save_checkpoint(ctx, state, link, ckpt_dir)
            saved_at = state.step
    await finish_sync(state, sender)  # overlapped: the last one
    if ckpt_dir and state.step != saved_at:
        await save_checkpoint(ctx, state, link, ckpt_dir)
    await settle_checkpoint(ctx, state, link, wait=True)
    if settings.final_export_dir:  # the policy the run ends with, in Hugging Face format
        await run(checkpoint.export_hf, Path(settings.final_export_dir), model=state.model,
                  tokenizer=state.tokenizer, dtype=state.compute_dtype, ranks=state.ranks,
                  lora=state.exp.model.lora)


async def publish_resumed(ctx: RoleContext, state: TrainState, link: Link | None) -> None:
    """A trainer that starts past version 0, or finds the rollout side ahead of it (every
    rank calls; rank 0 decides and tells the others): the engines (re)started with the
    initial weights, or hold newer ones that died with the trainer that made them. Send them
    this checkpoint's weights under its own version before any batch, so that what they
    generate is stamped right and the batches the queue hands again are as before. The rollout
    side ahead (the queue's version is newer: the run was cut, or the trainer died, past this
    checkpoint): the republish rewinds it (`SyncRequest.rewind`), and the rollouter and the
    queue drop once what the lost versions made, reason "lost_weights"."""
    order = None
    if state.ranks.is_main:
        assert link is not None
        ahead = await link.rollout_version()
        order = {"publish": state.version > 0 or ahead > state.version,
                 "rewind": ahead > state.version, "ahead": ahead}
    order = await run(state.ranks.share, order)
    if not order["publish"]:
        return
    sender = link.sender if link is not None else None
    if sender is not None:
        sender.rewind = order["rewind"]
    try:
        resync = await sync_weights(state, sender, republish=True)
    finally:
        if sender is not None:
            sender.rewind = False
    ctx.log.info("resumed_weights_published", version=state.version,
                 rollout_version=order["ahead"], rewound=order["rewind"],
                 broadcast_s=resync.get("sync_broadcast_s"))


async def train_step(state: TrainState, batch: Batch, waited: float) -> dict[str, Any]:
    """One step on `batch` (every rank): prepare it, update, count it; returns the step's
    metrics row (`waited`: when the wait for the batch began)."""
    started = time.monotonic()
    groups, invalid = valid_groups(state, batch.groups)
    # invalid samples were handed out all the same: consumed, as the queue counts them
    state.samples_consumed += invalid
    if not groups:  # the step goes by (the queue counts steps) and trains on nothing
        state.step += 1
        return {"step": state.step, "version": state.version, "time": time.time(),
                "invalid_samples": invalid, "samples": 0, "wait_s": started - waited,
                "samples_consumed": state.samples_consumed,
                "group_ids": [g.group_id for g in batch.groups]}
    data = await run(prepare, state, from_groups(groups))
    stats = await run(update_policy, state, data)
    state.step += 1
    state.samples_consumed += data.size
    metrics = step_metrics(state, data, stats, time.monotonic() - started)
    if invalid:
        metrics["invalid_samples"] = invalid
    metrics["wait_s"] = started - waited
    metrics["group_ids"] = [g.group_id for g in batch.groups]  # what this step trained on
    return metrics


def valid_groups(state: TrainState, groups: list[Group]) -> tuple[list[Group], int]:
    """The batch's groups the model can take, and how many samples were left out (every rank
    alike). The rollouter and the queue check each sample as it enters (`core.validate`); this
    is the last guard, with the model's own bound: a token id past the embedding's rows would
    crash the step (an IndexError) and, restarted, the trainer would meet it again."""
    vocab = state.model.get_input_embeddings().num_embeddings
    keep, invalid = [], 0
    for g in groups:
        why = invalid_group_reason(g, vocab_size=vocab)
        if why is None:
            keep.append(g)
        else:
            invalid += len(g.trajectories)
            log.error("batch_group_invalid", group=g.group_id, why=why, step=state.step + 1)
    return keep, invalid


async def export_version(settings: TrainerSettings, state: TrainState) -> None:
    """With `export_dir`: what the engines now serve, for evaluation and tests."""
    export_dir = settings.export_dir
    if export_dir:
        await run(checkpoint.export_hf, Path(export_dir) / f"version_{state.version}",
                  model=state.model, tokenizer=state.tokenizer, dtype=state.compute_dtype,
                  ranks=state.ranks, lora=state.exp.model.lora)


class HistoryWithoutCheckpoint(RuntimeError):
    """A trainer starting without a checkpoint where metrics.jsonl holds trained steps, and no
    checkpoint can come: starting from fresh weights would throw that training away."""


def trim_metrics(path: Path, step: int, log: Any) -> None:
    """A trainer (re)started from the checkpoint of `step` trains the steps after it again (on
    the same batches): their rows move to `metrics.trained-again.jsonl` beside it (appended,
    synced first: no row is ever lost), so metrics.jsonl holds each step once. Replaced whole
    (a reader sees the old file or the new one); a torn last line goes too."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    keep, moved = [], []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if line.endswith("\n") and isinstance(row, dict) and row.get("step", 0) <= step:
            keep.append(line)
        elif line.endswith("\n"):
            moved.append(line)
    if len(keep) != len(lines):
        if moved:
            with open(path.with_name(TRAINED_AGAIN), "a") as f:
                f.write("".join(moved))
                f.flush()
                os.fsync(f.fileno())
        write_atomic(path, "".join(keep), fsync=True)
        log.info("metrics_trimmed", path=str(path), checkpoint_step=step,
                 rows_moved=len(moved), moved_to=TRAINED_AGAIN,
                 torn=len(lines) - len(keep) - len(moved))


def refuse_fresh_start(path: Path | None, settings: TrainerSettings) -> None:
    """Raise `HistoryWithoutCheckpoint` when this trainer has no checkpoint to resume from,
    metrics.jsonl already holds trained steps (it is a restart, or `--resume` of a run), and
    checkpoints are off (`trainer.checkpoint_every` and `checkpoint_every_s` both 0): the
    queue keeps no batch for a trainer that never checkpoints, so starting again from fresh
    weights would silently replace a run's training with a new one. (With checkpoints on and
    none written yet, the trainer starts again from step 1 on the batches the queue kept for
    it, and the rows of those steps move to metrics.trained-again.jsonl.)"""
    exp = settings.experiment.trainer
    if path is None or not path.exists() or (
            checkpoint_dir(settings) and (exp.checkpoint_every or exp.checkpoint_every_s)):
        return
    steps = 0
    with open(path) as f:
        for line in f:
            steps += line.startswith("{") and line.endswith("\n")
    if steps:
        raise HistoryWithoutCheckpoint(
            f"{path} holds {steps} trained steps but there is no checkpoint to resume from "
            "(trainer.checkpoint_every = 0 and trainer.checkpoint_every_s = 0): starting "
            "again from the initial weights would discard that training, so the trainer "
            "refuses. Start a new run, or turn checkpoints on (they cost little: they are "
            "written in the background).")


async def main(ctx: RoleContext) -> None:
    """Role entry (one process per rank; instance = rank); settings: the module's docstring."""
    settings = parse_config(TrainerSettings, ctx.config, "trainer spec")
    exp = settings.experiment
    if settings.threads:
        torch.set_num_threads(settings.threads)
    device = resolve_device(exp.trainer.device)
    if device.type == "cuda":
        torch.cuda.set_device(settings.device_index)
    backend = exp.trainer.backend if exp.trainer.backend != "auto" else (
        "nccl" if device.type == "cuda" else "gloo")
    ranks = await run(init_ranks, settings.rendezvous, ctx.spec.instance,
                      exp.trainer.ranks, backend)
    link = None
    try:
        if ranks.is_main:  # a missing extra fails now, before the model loads
            await run(require_extras, exp)
        state = await run(build_state, exp, ranks, device)
        ckpt_dir = checkpoint_dir(settings)
        # the one scan of the directory: `Link` keeps the latest checkpoint's step from here
        resume = checkpoint.latest(ckpt_dir) if ckpt_dir else None
        if resume is None and ranks.is_main and settings.metrics_path:
            refuse_fresh_start(Path(settings.metrics_path), settings)
        if resume is not None:
            saved = await run(checkpoint.load, resume, model=state.model,
                              optimizer=state.optimizer, scheduler=state.scheduler, ranks=ranks,
                              critic=state.critic, critic_optimizer=state.critic_optimizer,
                              critic_scheduler=state.critic_scheduler)
            state.step, state.version = saved["step"], saved["version"]
            state.samples_consumed = saved["samples_consumed"]
            ctx.log.info("resumed", path=str(resume), step=state.step, version=state.version)
        if ranks.is_main and settings.metrics_path:
            trim_metrics(Path(settings.metrics_path), state.step, ctx.log)
        endpoints: dict[str, str] = {}
        if ranks.is_main:
            link = Link(ctx, settings, state, resumed=resume)
            endpoints = await link.open()
            ctx.set_status(lambda: {
                "step": state.step, "version": state.version,
                "samples_consumed": state.samples_consumed, **link.last_metrics,
                **({"eval_reward_mean": link.evals.reported.reward_mean,
                    "eval_version": link.evals.reported.version}
                   if link.evals.reported else {})})
        ctx.log.info("trainer_config", rank=ranks.rank, ranks=ranks.world, device=str(device),
                     backend=backend, sharding="fsdp2" if ranks.world > 1 else "none",
                     params=sum(math.prod(p.shape) for p in state.model.parameters()),
                     critic_params=(sum(math.prod(p.shape) for p in state.critic.parameters())
                                    if state.critic is not None else 0))
        await ctx.ready(**endpoints)
        await train(ctx, settings, state, link)
    finally:
        if link is not None:
            await link.close()
        close_ranks(ranks)
