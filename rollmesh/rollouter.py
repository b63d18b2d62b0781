"""The rollouter role (a singleton): owns every sample from admission until the MessageQueue.

    admit prompt groups under the staleness capacity
      -> dispatch trajectories to agent workers that hold credit (the cancel queue first)
      -> finished: dispatch to reward workers; interrupted: back into the cancel queue
      -> a group scored whole: filter (e.g. DAPO), then put it into the MessageQueue, with
         whatever else is ready in one PutGroups (held and retried while the queue is full:
         back-pressure)

Capacity (AReaL's bound, in groups): min(max_concurrent - running,
(max_staleness + v + 1) * groups_per_version - (accepted + running)), where v is the live weight
version and groups_per_version = batch_groups * sync_every. A filtered or failed group frees its
place; an accepted one counts for good. Over-sampling (`rollout.over_sampling`) applies only to
what is still to be accepted, and only with a group filter that drops groups: the headroom
left (the bound minus the accepted groups) is multiplied by min(over_sampling, 1 / (1 - the
filter's observed rejection rate)), so accepted groups never take more than their share and an
unfiltered run never generates groups that could only end up stale.

Engine outages: the rollouter probes the engines' /health (`engines` in its spec); while none
is healthy it admits no new prompt (the dataset cursor stands still; generations already
admitted wait in the workers, up to rollout.engine_wait_s) and says so in its stats
(`engines_healthy`, `admission`); it admits again as soon as one answers.

Evaluation answers are resumed like training trajectories when a sync interrupts them (their
partial tokens kept), and each is labelled by the version its round started at (metadata
`eval_version`), so an eval whose answers outlast a sync interval still finishes. A round samples
rollout.eval_n answers per prompt and ends in one summary (stats `eval`, the `eval` log line):
mean reward, pass@k and the same per data_source (rollmesh.evaluation).

Pause (from the synchronizer): stop dispatching, send Cancel to every agent worker, answer
Paused once no trajectory is out with a worker, but for those a worker holds (`Held`: loops
whose own code cannot move, e.g. openai_agent; their generations are stopped, they stay counted
as out with that worker and come back after the Resume); with `sync.pause_mode = "in_place"`
send no Cancel and answer Paused at once (the engines keep the requests through the sync).
Resume(version): tell the agent workers (held trajectories go on), dispatch the cancel queue
first, then new prompts. A worker that dies (silent for `liveness` heartbeats, or unreachable)
has its trajectories re-queued as they were when dispatched. A rollouter restarted between a
Pause and its Resume comes back paused (the journal records both) and waits for the Resume.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import importlib.metadata
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgpack

from rollmesh.trajectories import load_tokenizer, new_trajectory
from rollmesh.config import ExperimentConfig, parse_config
from rollmesh.data import (
    Dataset, PromptGroup, PromptRow, PromptSource, chat_messages, render_prompt,
)
from rollmesh.durable_log import DurableLog
from rollmesh.engine.client import EngineClient, run_api_key
from rollmesh.evaluation import eval_summary
from rollmesh.message_queue import put_ready
from rollmesh.protocol import (
    Assign, Cancel, Group, Heartbeat, Held, Metrics, Ok, Pause, Paused, Resume, Returned,
    Score, Scored, StatsRequest, Trajectory, WorkerHello,
)
from rollmesh.runtime import RoleContext
from rollmesh.transport import Channel, Liveness, PeerTimeout, RemoteError, RpcClient, RpcServer

# -- group filters ---------------------------------------------------------------------------------


def keep_all(group: Group) -> bool:
    return True


def dapo_filter(group: Group) -> bool:
    """DAPO's dynamic sampling: a group whose rewards are all equal carries no signal."""
    rewards = {t.reward for t in group.trajectories}
    return len(rewards) > 1


def get_group_filter(name: str) -> Callable[[Group], bool]:
    filters: dict[str, Callable[[Group], bool]] = {"none": keep_all, "dapo": dapo_filter}
    for ep in importlib.metadata.entry_points(group="rollmesh.group_filters"):
        filters[ep.name] = ep.load()
    if name not in filters:
        raise KeyError(f"unknown group filter {name!r} (known: {', '.join(sorted(filters))})")
    return filters[name]



# -- durable state -------------------------------------------------------------------------------


@dataclass
class OpenGroup:
    row: int  # the dataset row's index
    size: int
    version: int
    dropped: int = 0  # samples already dropped (a dropped group's stragglers come back later)
    done: bool = False  # queued, or dropped as a whole


class JournalDiskError(OSError):
    """The rollouter's journal could not be written (disk full...): the change did not happen."""


class Journal:
    """The rollouter's state on disk, so that a restarted rollouter (kill -9, or
    `rollmesh launch --resume`) goes on where this one stood: an append-only log
    (`rollmesh.durable_log`) of msgpack records

        admit   group id, row, size, version, the prompt cursor after it
        queued  group id (the MessageQueue accepted it)
        drop    group id, reason, samples
        pause   a Pause arrived (the synchronizer is about to broadcast)
        version a Resume: the weight version it brought, and rollout is not paused

    Replayed, it gives the cursor, the counters of the accounting identity and the groups that
    were admitted but neither queued nor dropped: those were in flight in the lost process and
    are generated again from their prompts, under the same group ids, so each is counted once.
    A group queued but not yet journaled as such when the process died is generated again too;
    the MessageQueue drops the second copy by its group id. Compaction: past `compact_bytes` the
    log is rewritten as one snapshot record (cursor, version, counters, the open groups).

    `paused` is whether the last word of the synchronizer was a Pause: a rollouter restarted
    in the middle of a weight sync must not generate until that sync's Resume reaches it.
    """

    def __init__(self, path: str | Path, log: Any, compact_bytes: int = 8 << 20):
        self.file, records = DurableLog.open(path, fsync_interval_s=1.0, log=log)
        if log is None:
            from rollmesh.log import get_logger
            log = get_logger("rollmesh.rollouter")
        self.log = log
        self.error: str | None = None  # the last failed write
        self._compact_after = 0.0
        self.compact_bytes = compact_bytes
        self.cursor: dict[str, Any] | None = None
        self.version = 0
        self.paused = False
        self.counters: collections.Counter[str] = collections.Counter()
        self.dropped: collections.Counter[str] = collections.Counter()
        self.groups: dict[str, OpenGroup] = {}
        for raw in records:
            self._apply(msgpack.unpackb(raw, raw=False))
        self.replayed = len(records)

    def _apply(self, r: dict[str, Any]) -> None:
        kind = r["k"]
        if kind == "snapshot":
            self.cursor, self.version = r["cursor"], r["version"]
            self.paused = r.get("paused", False)
            self.counters = collections.Counter(r["counters"])
            self.dropped = collections.Counter(r["dropped"])
            self.groups = {gid: OpenGroup(*g) for gid, g in r["groups"].items()}
        elif kind == "admit":
            self.groups[r["g"]] = OpenGroup(r["row"], r["n"], r["v"])
            self.cursor = r["cursor"]
            self.counters["admitted_groups"] += 1
            self.counters["admitted_samples"] += r["n"]
        elif kind == "queued":
            self.groups.pop(r["g"], None)
            self.counters["accepted_groups"] += 1
            self.counters["queued_groups"] += 1
            self.counters["queued_samples"] += r["n"]
        elif kind == "drop":
            self.dropped[r["reason"]] += r["n"]
            g = self.groups.get(r["g"])
            if g is not None:
                g.dropped += r["n"]
                if r.get("whole"):
                    g.done = True
                    self.counters["rejected_groups"] += 1
                if g.done and g.dropped >= g.size:
                    del self.groups[r["g"]]
        elif kind == "pause":
            self.paused = True
        elif kind == "version":
            self.version = max(self.version, r["v"])
            self.paused = False

    def _write(self, record: dict[str, Any]) -> None:
        """Write-ahead: on disk (in the kernel) first, then applied. A write that fails (disk
        full, file size limit) is cut back off the file and changes nothing here; it raises
        JournalDiskError naming the file, which stops the rollouter (the launcher restarts it,
        and the replay starts from the whole records on disk; nothing was acknowledged that
        is not in them). A failed compaction only leaves the log longer."""
        try:
            self.file.append(msgpack.packb(record, use_bin_type=True))
        except OSError as e:
            self.error = f"{e.filename or self.file.path}: {e.strerror}"
            self.log.error("journal_write_failed", path=str(self.file.path), error=str(e),
                           record=record["k"])
            raise JournalDiskError(f"rollouter cannot write its journal {self.file.path}: "
                                   f"{e.strerror}") from None
        self._apply(record)
        if self.file.size > self.compact_bytes and time.monotonic() >= self._compact_after:
            try:
                self.compact()
            except OSError as e:
                self._compact_after = time.monotonic() + 30.0
                self.log.warning("journal_compaction_failed", path=str(self.file.path),
                                 error=str(e), retry_in_s=30)

    def admitted(self, group: PromptGroup, cursor: dict[str, Any], version: int) -> None:
        self._write({"k": "admit", "g": group.group_id, "row": group.row.index,
                     "n": group.group_size, "v": version, "cursor": cursor})

    def queued(self, group_id: str, samples: int) -> None:
        self._write({"k": "queued", "g": group_id, "n": samples})

    def drop(self, group_id: str, reason: str, samples: int, whole: bool = False) -> None:
        if samples or whole:
            self._write({"k": "drop", "g": group_id, "reason": reason, "n": samples,
                         "whole": whole})

    def new_version(self, version: int) -> None:
        """A Resume at `version` (a failed sync resumes at the version it had)."""
        if version > self.version or self.paused:
            self._write({"k": "version", "v": version})

    def pause(self) -> None:
        if not self.paused:
            self._write({"k": "pause"})

    def recover(self) -> tuple[list[tuple[str, OpenGroup]], int]:
        """After a replay: the open groups to generate again, and the samples of dropped
        groups that were still out with workers in the lost process (now dropped for good)."""
        lost = 0
        for gid, g in list(self.groups.items()):
            if g.done:  # dropped whole; its stragglers died with the old process
                lost += g.size - g.dropped
                self.drop(gid, "group_failed", g.size - g.dropped)
                self.groups.pop(gid, None)
        return [(gid, g) for gid, g in self.groups.items()], lost

    def compact(self) -> None:
        """Rewrite the log as one snapshot of everything a replay would build."""
        snapshot = {"k": "snapshot", "cursor": self.cursor, "version": self.version,
                    "paused": self.paused,
                    "counters": dict(self.counters), "dropped": dict(self.dropped),
                    "groups": {gid: [g.row, g.size, g.version, g.dropped, g.done]
                               for gid, g in self.groups.items()}}
        self.file.rewrite([msgpack.packb(snapshot, use_bin_type=True)])

    def close(self) -> None:
        self.file.close()


# -- state ---------------------------------------------------------------------------------------


@dataclass
class Worker:
    peer: bytes
    name: str
    kind: str
    credits: int
    out: dict[str, Trajectory] = field(default_factory=dict)  # sample id -> as dispatched
    held: set[str] = field(default_factory=set)  # of `out`: held by the worker through a sync

    @property
    def free(self) -> int:
        return self.credits - len(self.out)


class WorkerPool:
    """The registered workers, with an index of the freest one per kind.

    A dispatch takes the worker of its kind with the most free credits (ties: the one that has
    waited longest), in O(log workers): one lazy max-heap per kind whose entries are
    (free credits when pushed, order, worker), pushed at every change of a worker's load and
    checked against its load now when they reach the top (benchmarks/simulate.py --scale: the
    scan of every worker per dispatch made one rollouter saturate at ~1,100 GPUs). Trajectories
    go to a worker and come back only through `give` and `take_back`, which keep the per-kind
    counts of what is out (what a pause drains) exact.
    """

    def __init__(self) -> None:
        self._by_peer: dict[bytes, Worker] = {}
        self._heaps: dict[str, list[tuple[int, int, Worker]]] = collections.defaultdict(list)
        self._out: collections.Counter[str] = collections.Counter()
        self._order = itertools.count()

    def get(self, peer: bytes) -> Worker | None:
        return self._by_peer.get(peer)

    def values(self):
        return self._by_peer.values()

    def __len__(self) -> int:
        return len(self._by_peer)

    def add(self, worker: Worker) -> None:
        self._by_peer[worker.peer] = worker
        self._out[worker.kind] += len(worker.out)
        self._push(worker)

    def remove(self, worker: Worker) -> bool:
        """Forget the worker (what it held is the caller's to re-queue); False if unknown."""
        if self._by_peer.get(worker.peer) is not worker:
            return False
        del self._by_peer[worker.peer]
        self._out[worker.kind] -= len(worker.out)
        return True

    def give(self, worker: Worker, traj: Trajectory) -> None:
        if traj.sample_id not in worker.out:
            self._out[worker.kind] += 1
        worker.out[traj.sample_id] = traj
        self._push(worker)

    def take_back(self, worker: Worker, sample_id: str) -> Trajectory | None:
        traj = worker.out.pop(sample_id, None)
        if traj is not None:
            self._out[worker.kind] -= 1
            self._push(worker)
        return traj

    def out(self, kind: str) -> int:
        """Trajectories out with the workers of this kind."""
        return self._out[kind]

    def freest(self, kind: str) -> Worker | None:
        heap = self._heaps[kind]
        while heap:
            neg_free, _, worker = heap[0]
            if (self._by_peer.get(worker.peer) is worker and worker.free > 0
                    and -neg_free == worker.free):
                return worker
            heapq.heappop(heap)  # outdated: the worker's load changed since, or it is gone
        return None

    def _push(self, worker: Worker) -> None:
        if self._by_peer.get(worker.peer) is not worker:
            return
        heap = self._heaps[worker.kind]
        heapq.heappush(heap, (-worker.free, next(self._order), worker))
        if len(heap) > 4 * len(self._by_peer) + 64:  # outdated entries buried deep: rebuild
            heap[:] = [(-w.free, next(self._order), w) for w in self._by_peer.values()
                       if w.kind == worker.kind]
            heapq.heapify(heap)


@dataclass
class GroupState:
    size: int
    version_admitted: int
    scored: list[Trajectory] = field(default_factory=list)


class Rollouter:
    def __init__(self, ctx: RoleContext, exp: ExperimentConfig, source: PromptSource,
                 tokenizer: Any, channel: Channel, mq: RpcClient, journal: Journal | None = None):
        self.ctx, self.log, self.exp = ctx, ctx.log, exp
        self.journal = journal
        self.source, self.tokenizer = source, tokenizer
        self.channel, self.mq = channel, mq
        self.group_filter = get_group_filter(exp.rollout.group_filter)
        self.version = 0
        self.paused = False
        self.synchronizer_spoke = False  # a Pause or Resume since this process started
        self.workers = WorkerPool()
        self.liveness = Liveness(ctx.spec.heartbeat_s, ctx.spec.liveness)
        self.pending: collections.deque[Trajectory] = collections.deque()  # admitted, new
        self.cancel_queue: collections.deque[Trajectory] = collections.deque()
        self.to_score: collections.deque[Trajectory] = collections.deque()
        self.groups: dict[str, GroupState] = {}
        self.ready: collections.deque[Group] = collections.deque()  # accepted, not yet queued
        self.ready_added = asyncio.Event()
        self.counters: collections.Counter[str] = collections.Counter()
        self.dropped: collections.Counter[str] = collections.Counter()  # reason -> samples
        self.changed = asyncio.Event()
        self.drained = asyncio.Event()
        self.announce_resume = False  # tell the agent workers at the next dispatch
        # Trajectories agent workers hold through the sync in progress (`Held`), and those
        # workers: a pause does not wait for them (kept as a count: _check_drained runs at
        # every return, and must not scan the workers).
        self.held_count = 0
        self.holding: dict[bytes, Worker] = {}
        # The loop classes rows name, loaded as they come (`_loop_metadata`); None: unknown.
        self.loops: dict[str, type | None] = {}
        # Evaluation of the held-out set: outside the training accounting, one round per
        # eval_every versions, dispatched after the cancel queue and before new prompts.
        self.eval_rows = (Dataset.from_config(exp.data, eval=True).rows
                          if exp.rollout.eval_every and exp.data.eval_path else [])
        self.eval_queue: collections.deque[Trajectory] = collections.deque()
        self.eval_runs: dict[int, dict[str, Any]] = {}
        self.last_eval: dict[str, Any] | None = None
        if self.eval_rows and getattr(exp.rollout, "eval_n", 1) > 1 \
                and exp.rollout.eval_temperature == 0:
            self.log.warning("eval_n_greedy", eval_n=exp.rollout.eval_n,
                             hint="rollout.eval_temperature = 0 samples the same answer "
                                  "eval_n times: pass@k for k > 1 equals pass@1")
        # Engine health (watch_engines): None until the first probe, or without engine URLs.
        self.engines: list[str] = []
        self.engines_healthy: int | None = None
        self.queue_stale_groups = 0  # groups the MessageQueue dropped as stale (watch_queue)
        self.queue_unreachable_since: float | None = None  # the queue stopped answering
        self.admission_stopped_since: float | None = None

    # -- capacity and admission --------------------------------------------------------------

    @property
    def running_groups(self) -> int:
        return len(self.groups)  # admitted and not yet accepted or rejected

    def over_sampling(self) -> float:
        """The factor on the headroom still to be accepted (module docstring): 1 without a
        filter that drops groups; else `rollout.over_sampling`, lowered to what the filter's
        observed rejection rate calls for once enough groups went through it."""
        r = self.exp.rollout
        if self.group_filter is keep_all or r.over_sampling <= 1.0:
            return 1.0
        filtered = self.counters["filtered_groups"]
        seen = filtered + self.counters["accepted_groups"]
        if seen < 2 * r.batch_groups:  # too few to tell: the configured prior
            return r.over_sampling
        rate = min(filtered / seen, 0.95)
        return min(r.over_sampling, 1.0 / (1.0 - rate))

    def capacity(self) -> int:
        r, s = self.exp.rollout, self.exp.staleness
        per_version = r.batch_groups * self.exp.sync.sync_every
        concurrency = r.max_concurrent - self.running_groups
        # Groups the queue dropped as stale never reach the trainer: their places in the bound
        # are given back (else each stale drop would lower admission for good, down to 0).
        headroom = ((s.max_staleness + self.version + 1) * per_version
                    - (self.counters["accepted_groups"] - self.queue_stale_groups))
        staleness = int(max(0, headroom) * self.over_sampling()) - self.running_groups
        return min(concurrency, staleness)

    @property
    def admission(self) -> str:
        if self.paused:
            return "paused (weight sync)"
        if self.engines_healthy == 0:
            return "stopped: no healthy engine"
        return "open"

    def start_eval(self) -> None:
        """A round of the held-out set at this version, if one is due: eval_n responses per
        prompt (ids eval-v{version}-{prompt}-{j}), all scored, summarised when the last one
        is in (`eval_scored`)."""
        v, every = self.version, self.exp.rollout.eval_every
        if not self.eval_rows or v % every or v in self.eval_runs:
            return
        eval_n = getattr(self.exp.rollout, "eval_n", 1)
        self.eval_runs[v] = {"n": len(self.eval_rows) * eval_n, "records": [],
                             "resumed": 0, "response_tokens": 0}
        for i, row in enumerate(self.eval_rows):
            prompt = render_prompt(row, self.tokenizer, self.exp.data.system_prompt)
            for j in range(eval_n):
                loop = row.agent_loop or self.exp.data.default_agent_loop
                self.eval_queue.append(new_trajectory(
                    f"eval-v{v:06d}-{i:04d}-{j:02d}", f"eval-v{v:06d}", i * eval_n + j, prompt,
                    agent_loop=loop, label=row.label,
                    metadata={**row.metadata, **self._loop_metadata(row, loop),
                              "eval_version": v, "eval_prompt": i,
                              "sampling": {"temperature": self.exp.rollout.eval_temperature}}))

    @staticmethod
    def is_eval(traj: Trajectory) -> bool:
        return "eval_version" in traj.metadata

    def eval_returned(self, traj: Trajectory) -> None:
        if traj.status == "finished":
            self.to_score.append(traj)
        elif traj.status == "interrupted":
            # Resumed like a training trajectory: its partial tokens are kept (an answer
            # longer than a sync interval still finishes); it stays labelled by the version
            # its round started at (metadata eval_version).
            self.counters["eval_interrupted"] += 1
            self.eval_queue.appendleft(traj)
        else:
            self.eval_scored(traj)

    def eval_scored(self, traj: Trajectory) -> None:
        run = self.eval_runs.get(traj.metadata["eval_version"])
        if run is None:
            return
        ok = traj.status == "finished" and traj.reward_status == "ok"
        run["records"].append({"prompt": traj.metadata.get("eval_prompt", traj.index),
                               "reward": traj.reward if ok else None,  # None: failed
                               "data_source": traj.metadata.get("data_source")})
        generated = traj.versions[traj.loss_mask == 1]
        run["response_tokens"] += int(generated.size)
        run["resumed"] += int(len(set(generated.tolist())) > 1)  # went on across a sync
        if len(run["records"]) == run["n"]:
            v = traj.metadata["eval_version"]
            summary = eval_summary(run["records"], eval_n=getattr(self.exp.rollout, "eval_n", 1),
                                   threshold=getattr(self.exp.rollout, "eval_pass_threshold",
                                                     1.0))
            self.last_eval = {"version": v, **summary, "answers_resumed": run["resumed"],
                              "response_tokens": run["response_tokens"]}
            del self.eval_runs[v]
            self.log.info("eval", **self.last_eval)

    def admit(self) -> None:
        if self.engines_healthy == 0:  # nothing could generate it: keep the cursor where it is
            return
        while not self.paused and self.capacity() > 0:
            group = self.source.next_group()
            prompt = render_prompt(group.row, self.tokenizer, self.exp.data.system_prompt)
            if len(prompt) > self.exp.data.max_prompt_tokens:
                self.counters["skipped_prompts"] += 1
                continue
            self._start_group(group, prompt, self.version)
            self.counters["admitted_groups"] += 1
            self.counters["admitted_samples"] += group.group_size
            if self.journal is not None:
                self.journal.admitted(group, self.source.state(), self.version)

    def _start_group(self, group: PromptGroup, prompt: list[int], version: int) -> None:
        loop = group.row.agent_loop or self.exp.data.default_agent_loop
        meta = {**group.row.metadata, "row": group.row.index,
                **self._loop_metadata(group.row, loop)}
        if group.row.tools is not None:
            meta["tools"] = group.row.tools
        for i in range(group.group_size):
            self.pending.append(new_trajectory(
                f"{group.group_id}-{i:03d}", group.group_id, i, prompt, agent_loop=loop,
                label=group.row.label, metadata=meta))
        self.groups[group.group_id] = GroupState(group.group_size, version)

    def _loop_metadata(self, row: PromptRow, loop: str) -> dict[str, Any]:
        """What the row's loop needs besides the prompt's tokens: the row's chat messages (the
        system prompt applied) for loops with `takes_messages` (openai_agent)."""
        if loop not in self.loops:  # only the loops rows name; one that fails to load fails
            try:  # on the workers, where it runs, not here
                eps = importlib.metadata.entry_points(group="rollmesh.agent_loops", name=loop)
                self.loops[loop] = next(iter(eps)).load() if eps else None
            except Exception as e:
                self.log.warning("agent_loop_not_loaded", loop=loop, error=str(e))
                self.loops[loop] = None
        if getattr(self.loops[loop], "takes_messages", False):
            return {"messages": chat_messages(row, self.exp.data.system_prompt)}
        return {}

    def restore(self) -> None:
        """Go on from the journal of a previous rollouter of this run, if there is one."""
        j = self.journal
        if j is None or not j.replayed:
            return
        if j.cursor is not None:
            self.source.restore(j.cursor)
        self.version = j.version
        if j.paused and self.ctx.spec.restart > 0:
            # Killed between a sync's Pause and its Resume: the engines may be half-way
            # through the broadcast. Generate nothing until the synchronizer's Resume (it
            # asks again until a rollouter answers); `resume_if_forgotten` is the backstop.
            self.paused = True
        elif j.paused:
            # A new launch (`--resume`): fresh engines and synchronizer, no sync in progress.
            j.new_version(self.version)
        for key in ("admitted_groups", "admitted_samples", "accepted_groups", "queued_groups",
                    "queued_samples", "rejected_groups"):
            self.counters[key] = j.counters[key]
        reopen, lost = j.recover()
        self.dropped = collections.Counter(j.dropped)
        rows = {row.index: row for row in self.source.rows}
        for gid, g in reopen:  # in flight in the lost process: generate them again
            row = rows[g.row]
            prompt = render_prompt(row, self.tokenizer, self.exp.data.system_prompt)
            self._start_group(PromptGroup(gid, row, g.size, 0), prompt, g.version)
        self.counters["restored_groups"] = len(reopen)
        self.log.warning("restored", records=j.replayed, version=self.version,
                         paused=self.paused,
                         cursor=j.cursor, regenerated_groups=len(reopen),
                         stragglers_dropped=lost, admitted=self.counters["admitted_samples"],
                         queued=self.counters["queued_samples"], dropped=dict(self.dropped))

    # -- dispatch ----------------------------------------------------------------------------

    def _free_worker(self, kind: str) -> Worker | None:
        return self.workers.freest(kind)

    async def dispatch(self) -> None:
        if self.announce_resume and not self.paused:
            self.announce_resume = False
            for w in list(self.workers.values()):
                if w.kind == "agent" and not await self.channel.send(
                        w.peer, Resume(version=self.version)):
                    await self.worker_lost(w, "unreachable")
        self.admit()
        while not self.paused and (self.cancel_queue or self.eval_queue or self.pending):
            worker = self._free_worker("agent")
            if worker is None:
                break
            queue = self.cancel_queue or self.eval_queue or self.pending
            traj = queue.popleft()
            await self._send(worker, traj, Assign(trajectory=traj))
        while self.to_score:
            worker = self._free_worker("reward")
            if worker is None:
                break
            traj = self.to_score.popleft()
            await self._send(worker, traj, Score(trajectory=traj))

    async def _send(self, worker: Worker, traj: Trajectory, msg: Any) -> None:
        self.workers.give(worker, traj)
        if not await self.channel.send(worker.peer, msg):
            await self.worker_lost(worker, "unreachable")

    async def worker_lost(self, worker: Worker, why: str) -> None:
        """Re-queue everything the worker held, as it was when dispatched."""
        if not self.workers.remove(worker):
            return
        self.liveness.forget(worker.peer.hex())
        back = list(worker.out.values())
        self.held_count -= len(worker.held)
        self.holding.pop(worker.peer, None)
        for traj in back:
            (self.cancel_queue if worker.kind == "agent" else self.to_score).appendleft(traj)
        self.counters["workers_lost"] += 1
        self.log.error("worker_lost", worker=worker.name, why=why, requeued=len(back))
        self._check_drained()

    # -- results -----------------------------------------------------------------------------

    def returned(self, worker: Worker, traj: Trajectory) -> None:
        if self.workers.take_back(worker, traj.sample_id) is None:
            self.counters["unexpected_returns"] += 1  # e.g. from a worker declared dead earlier
            return
        if traj.sample_id in worker.held:
            worker.held.discard(traj.sample_id)
            self.held_count -= 1
        if self.is_eval(traj):
            self.eval_returned(traj)
        elif traj.group_id not in self.groups:  # its group was already given up
            self._drop_straggler(traj)
        elif traj.status == "finished":
            self.to_score.append(traj)
        elif traj.status == "interrupted":
            self.cancel_queue.append(traj)
            self.counters["interrupted"] += 1
        else:  # failed: retry from where it stood, then give the group up
            attempts = int(traj.metadata.get("attempts", 0)) + 1
            traj.metadata["attempts"] = attempts
            if attempts <= self.exp.rollout.max_retries:
                traj.status = "running"
                self.cancel_queue.append(traj)
            else:
                self.finish_group(traj.group_id, None, "generation_failed", extra=[traj])
        self._check_drained()

    def scored(self, worker: Worker, traj: Trajectory) -> None:
        if self.workers.take_back(worker, traj.sample_id) is None:
            self.counters["unexpected_returns"] += 1
            return
        if self.is_eval(traj):
            self.eval_scored(traj)
            return
        state = self.groups.get(traj.group_id)
        if state is None:  # its group was already given up
            self._drop_straggler(traj)
            return
        state.scored.append(traj)
        if len(state.scored) == state.size:
            trajs = sorted(state.scored, key=lambda t: t.index)
            group = Group(group_id=traj.group_id, trajectories=trajs,
                          version_admitted=state.version_admitted)
            if any(t.reward_status != "ok" for t in trajs):
                self.finish_group(traj.group_id, None, "reward_failed")
            elif not self.group_filter(group):
                self.counters["filtered_groups"] += 1
                self.finish_group(traj.group_id, None, "filtered")
            else:
                self.finish_group(traj.group_id, group, None)

    def _drop_straggler(self, traj: Trajectory) -> None:
        self.dropped["group_failed"] += 1
        if self.journal is not None:
            self.journal.drop(traj.group_id, "group_failed", 1)

    def finish_group(self, group_id: str, group: Group | None, reason: str | None,
                     extra: list[Trajectory] = ()) -> None:
        """A group leaves the running set: accepted (to the queue) or dropped with a reason."""
        state = self.groups.pop(group_id)
        if group is not None:
            self.ready.append(group)
            self.ready_added.set()
            self.counters["accepted_groups"] += 1
            return
        # Dropped: the scored ones and the failed ones are in hand; the rest are still out
        # somewhere and are dropped when they come back (see scored / returned).
        n = len(state.scored) + len(extra)
        self.counters["rejected_groups"] += 1
        # Its samples still queued here go with it; those out with workers are dropped when
        # they come back (reason "group_failed").
        for q in (self.pending, self.cancel_queue, self.to_score):
            keep = [t for t in q if t.group_id != group_id]
            n += len(q) - len(keep)
            q.clear()
            q.extend(keep)
        self.dropped[reason] += n
        if self.journal is not None:
            self.journal.drop(group_id, reason, n, whole=True)

    # -- pause / resume ----------------------------------------------------------------------

    def agent_out(self) -> int:
        return self.workers.out("agent")

    def agent_draining(self) -> int:
        """Trajectories out with agent workers that a pause waits for: all but the held."""
        return self.workers.out("agent") - self.held_count

    def held(self, worker: Worker, sample_ids: list[str]) -> None:
        """A worker holds these through the sync (`Held`): out with it, not draining."""
        if not self.paused:  # a Resume crossed it: they run already
            self.counters["late_holds"] += 1
            return
        new = {sid for sid in sample_ids if sid in worker.out} - worker.held
        worker.held |= new
        self.holding[worker.peer] = worker
        self.held_count += len(new)
        self.counters["held_through_sync"] += len(new)
        self._check_drained()

    def _check_drained(self) -> None:
        if self.paused and self.agent_draining() == 0:
            self.drained.set()
        self.changed.set()

    async def pause(self, mode: str) -> Paused:
        self.synchronizer_spoke = True
        if self.journal is not None:
            self.journal.pause()
        self.paused = True
        self.drained.clear()
        if mode == "in_place":
            # The engines keep the requests (and their KV) through the sync and continue them
            # under the new weights: no Cancel, nothing to drain. Dispatching stops; what is
            # out with workers stays there and comes back as it finishes.
            self.log.info("paused", mode=mode, in_flight=self.agent_out(),
                          cancel_queue=len(self.cancel_queue))
            return Paused(in_flight=self.agent_out(), cancel_queue=len(self.cancel_queue))
        started = time.monotonic()
        for w in list(self.workers.values()):
            if w.kind == "agent" and not await self.channel.send(w.peer, Cancel(reason=mode)):
                await self.worker_lost(w, "unreachable")
        self._check_drained()
        await self.drained.wait()
        self.log.info("paused", mode=mode, cancel_queue=len(self.cancel_queue),
                      held=self.agent_out(), drain_s=round(time.monotonic() - started, 3))
        return Paused(in_flight=self.agent_out(), cancel_queue=len(self.cancel_queue))

    def resume(self, version: int) -> None:
        self.synchronizer_spoke = True
        self.version = max(self.version, version)
        if self.journal is not None:
            self.journal.new_version(self.version)
        self.paused = False
        held = self.held_count
        for w in self.holding.values():
            w.held.clear()  # they generate again
        self.holding.clear()
        self.held_count = 0
        self.announce_resume = True
        self.start_eval()
        self.log.info("resumed", version=self.version, cancel_queue=len(self.cancel_queue),
                      held=held)
        self.changed.set()

    async def resume_if_forgotten(self, after_s: float) -> None:
        """A restart came back paused (the journal's last word was a Pause). The synchronizer
        re-sends its Resume until a rollouter answers or the sync's time limit runs out, and
        then resumes rollout whatever happened; if this process heard neither Pause nor Resume
        by then, it does the same rather than stall the run."""
        await asyncio.sleep(after_s)
        if self.paused and not self.synchronizer_spoke:
            self.log.error("resume_never_came", waited_s=after_s, version=self.version)
            self.resume(self.version)

    # -- accounting --------------------------------------------------------------------------

    def in_flight(self) -> int:
        """Samples this process holds right now, counted where they are."""
        def train(ts: Any) -> int:
            return sum(not self.is_eval(t) for t in ts)

        return (len(self.pending) + train(self.cancel_queue) + train(self.to_score)
                + sum(train(w.out.values()) for w in self.workers.values())
                + sum(len(s.scored) for s in self.groups.values())
                + sum(len(g.trajectories) for g in self.ready))

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters, "version": self.version, "paused": self.paused,
            "capacity": self.capacity(), "running_groups": self.running_groups,
            "in_flight": self.in_flight(), "pending": len(self.pending),
            "cancel_queue": len(self.cancel_queue), "to_score": len(self.to_score),
            "held": self.held_count,
            "ready_groups": len(self.ready), "dropped": dict(self.dropped),
            "workers": {w.name: {"kind": w.kind, "credits": w.credits, "out": len(w.out)}
                        for w in self.workers.values()},
            "channel_protocol_errors": self.channel.protocol_errors,
            "eval": self.last_eval, "eval_pending": len(self.eval_queue),
            "cursor": self.source.state(),
            "engines_healthy": self.engines_healthy, "engines": len(self.engines),
            "admission": self.admission, "queue_stale_groups": self.queue_stale_groups,
            "journal_error": self.journal.error if self.journal is not None else None,
            "queue_unreachable_s": (None if self.queue_unreachable_since is None else
                                    round(time.monotonic() - self.queue_unreachable_since, 1)),
            "admission_stopped_s": (round(time.monotonic() - self.admission_stopped_since, 1)
                                    if self.admission_stopped_since is not None else None),
            "over_sampling": round(self.over_sampling(), 3),
        }

    async def watch_queue(self, interval_s: float = 1.0) -> None:
        """Ask the MessageQueue for its stats every `interval_s`, on a short leash: its stale
        drops (samples; groups are data.group_size each) give places in the bound back
        (`capacity`), and a queue that does not answer is reported (stats
        `queue_unreachable_s`, the monitor's header) while it is cut off."""
        size = self.exp.data.group_size
        while True:
            try:
                reply = await self.mq.request(StatsRequest(), timeout_s=3, retries=0)
                groups = int(reply.values.get("dropped", {}).get("stale", 0)) // size
            except PeerTimeout:
                if self.queue_unreachable_since is None:
                    self.queue_unreachable_since = time.monotonic()
                    self.log.error("queue_unreachable", queue=self.mq.address)
            except (RemoteError, TypeError, ValueError, AttributeError) as e:
                self.log.warning("queue_stats_failed", error=str(e))
            else:
                if self.queue_unreachable_since is not None:
                    self.log.warning("queue_reachable", unreachable_s=round(
                        time.monotonic() - self.queue_unreachable_since, 1))
                    self.queue_unreachable_since = None
                if groups > self.queue_stale_groups:
                    self.log.info("queue_dropped_stale", groups=groups - self.queue_stale_groups,
                                  total=groups)
                    self.queue_stale_groups = groups
                    self.changed.set()
            await asyncio.sleep(interval_s)

    async def watch_engines(self, urls: list[str], api_key: str | None,
                            interval_s: float = 1.0) -> None:
        """Probe every engine's /health; while none answers, admit nothing (`admit`)."""
        self.engines = list(urls)
        async with EngineClient(urls, api_key=api_key, connect_timeout_s=2.0) as client:
            while True:
                answers = await asyncio.gather(*(client.health(u) for u in urls))
                healthy = sum(answers)
                if healthy == 0 and self.engines_healthy != 0:
                    self.admission_stopped_since = time.monotonic()
                    self.counters["admission_stops"] += 1
                    self.log.error("admission_stopped", reason="no healthy engine",
                                   engines=urls, in_flight=self.in_flight(),
                                   cursor=self.source.state())
                elif healthy and self.engines_healthy == 0:
                    stopped = time.monotonic() - (self.admission_stopped_since or time.monotonic())
                    self.admission_stopped_since = None
                    self.log.warning("admission_resumed", engines_healthy=healthy,
                                     stopped_s=round(stopped, 1))
                if healthy != self.engines_healthy:
                    self.engines_healthy = healthy
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
                self.workers.add(Worker(peer, msg.worker, msg.kind, max(1, msg.credits)))
                self.log.info("worker_joined", worker=msg.worker, kind=msg.kind,
                              credits=msg.credits)
                if msg.kind == "agent" and not self.paused:
                    # not in a sync: what it may still hold from one (a restarted rollouter
                    # never sends that sync's Resume) goes on
                    await self.channel.send(peer, Resume(version=self.version))
            elif worker is None:
                self.counters["messages_from_unknown_peers"] += 1
                continue
            else:
                traj = getattr(msg, "trajectory", None)
                dispatched = worker.out.get(traj.sample_id) if traj is not None else None
                try:
                    if isinstance(msg, Returned):
                        self.returned(worker, msg.trajectory)
                    elif isinstance(msg, Held):
                        self.held(worker, msg.sample_ids)
                    elif isinstance(msg, Scored):
                        self.scored(worker, msg.trajectory)
                    elif not isinstance(msg, (Heartbeat, Metrics)):
                        self.counters["unexpected_messages"] += 1
                except Exception as e:  # well-formed on the wire, nonsense inside: one
                    # worker's bad record must not stop the rollouter; its trajectory is
                    # re-queued as dispatched when the worker is dropped
                    self.counters["bad_records"] += 1
                    if dispatched is not None:  # back as it was sent, to be re-queued
                        self.workers.give(worker, dispatched)
                    self.log.error("bad_record", worker=worker.name, type=type(msg).__name__,
                                   error=f"{type(e).__name__}: {e}")
                    await self.worker_lost(worker, f"sent a bad record: {e}")
            self.changed.set()

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
        is full (`message_queue.put_ready`)."""
        def queued(group: Group) -> None:
            if self.journal is not None:
                self.journal.queued(group.group_id, len(group.trajectories))
            self.counters["queued_samples"] += len(group.trajectories)
            self.counters["queued_groups"] += 1
            self.changed.set()

        def full() -> None:
            self.counters["queue_full_waits"] += 1

        await put_ready(self.mq, self.ready, self.ready_added, queued, log=self.log, full=full)


async def main(ctx: RoleContext) -> None:
    """Role entry. config: experiment, bind (worker channel), control (RPC), message_queue,
    engines (URLs, optional: admission stops while none is healthy), state_dir (journal)."""
    exp = parse_config(ExperimentConfig, ctx.config["experiment"], "rollouter spec")
    source = PromptSource.from_config(exp.data)
    tokenizer = load_tokenizer(exp.model)
    channel = Channel(ctx.transport, ctx.config["bind"], name="rollouter")
    mq = RpcClient(ctx.transport, ctx.config["message_queue"], timeout_s=30, name="message queue")
    state_dir = ctx.config.get("state_dir")
    journal = Journal(Path(state_dir) / "rollouter.log", ctx.log) if state_dir else None
    r = Rollouter(ctx, exp, source, tokenizer, channel, mq, journal)
    r.restore()

    async def pause(msg: Pause, peer: bytes) -> Paused:
        return await r.pause(msg.mode)

    async def resume(msg: Resume, peer: bytes) -> Ok:
        r.resume(msg.version)
        return Ok()

    async def stats(msg: StatsRequest, peer: bytes) -> Metrics:
        return Metrics(role="rollouter", host=ctx.spec.host,
                       values={**r.stats(), "protocol_errors": control.stats.protocol_errors})

    control = RpcServer(ctx.transport, ctx.config["control"],
                        {Pause: pause, Resume: resume, StatsRequest: stats}, name="rollouter")
    coros = [r.receive(), r.schedule(), r.heartbeats(), r.put_ready(), r.watch_queue(),
             control.serve()]
    if ctx.config.get("engines"):  # no new prompt while no engine can generate it
        coros.append(r.watch_engines(ctx.config["engines"], run_api_key(ctx.spec.keys_dir)))
    tasks = [asyncio.create_task(c) for c in coros]
    backstop = (asyncio.create_task(r.resume_if_forgotten(exp.sync.timeout_s + 10))
                if r.paused else None)
    r.start_eval()  # version 0: the policy before any training
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
    ctx.log.info("stats", **{k: v for k, v in r.stats().items() if k != "workers"})
    if journal is not None:
        journal.close()
    channel.close()
    control.close()
    mq.close()
