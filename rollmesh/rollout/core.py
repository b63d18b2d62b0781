"""The rollouter's state and rules, without sockets: what `rollmesh.rollout.role` runs.

    admit prompt groups under the staleness capacity
      -> dispatch trajectories to agent workers that hold credit (the cancel queue first)
      -> finished: dispatch to reward workers; interrupted: back into the cancel queue
      -> a group scored whole: filter (e.g. DAPO), then `ready` for the role's put loop

`RolloutCore` holds every sample from admission until the MessageQueue accepts its group, and
changes only by its methods. Those that send return actions (`Send`: this message to this
worker; `dispatch` yields them one at a time, so a worker lost on a send is dropped before the
next choice): the role sends them, and a worker it cannot reach goes to `worker_lost`.

Capacity (AReaL's bound, in groups): min(max_concurrent - running,
(max_staleness + v + 1) * groups_per_version - (accepted + running)), where v is the live weight
version and groups_per_version = batch_groups * sync_every. A filtered or failed group frees its
place; an accepted one counts for good. Over-sampling (`rollout.over_sampling`) applies only to
what is still to be accepted, and only with a group filter that drops groups: the headroom
left (the bound minus the accepted groups) is multiplied by min(over_sampling, 1 / (1 - the
filter's observed rejection rate)), so accepted groups never take more than their share and an
unfiltered run never generates groups that could only end up stale. Groups the MessageQueue
dropped as stale give their places back (`queue_stale`). A running group that can no longer be
trained (a sample holds a token older than version - max_staleness) is dropped here as stale,
at the resume or when such a sample comes back, instead of being generated on (`drop_stale`),
under `staleness.measure = "oldest_token"` only: under `admission` (the default) the capacity
above is the bound, and an admitted group is generated on across syncs and trained whatever
the versions its tokens span (each token with its own behaviour log-prob), so the longest
answers are not the ones dropped.

Pause bookkeeping: `pause` stops dispatching and, but for `in_place`, names the agent workers
to Cancel; the role answers Paused once `drained` (no trajectory out with an agent worker, but
for those a worker holds: `held`). `resume` goes on at the new version: the agent workers are
told at the next dispatch, the cancel queue goes first, and an evaluation round starts if due.

Counters: those of the accounting identity (admitted, accepted, queued, rejected groups; the
dropped samples by reason) are the journal's, changed by its records only (`Journal._apply`);
`events` are this process's own (interrupted, skipped prompts, workers lost...). `counters`
shows both.
"""

from __future__ import annotations

import collections
import importlib.metadata
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from rollmesh.config import ExperimentConfig
from rollmesh.rollout.data import PromptGroup, PromptRow, PromptSource, chat_messages, render_prompt
from rollmesh.wire.messages import (
    Assign, Cancel, Group, Resume, Score, Scored, Trajectory, WorkerHello,
)
from rollmesh.rollout.eval_round import EvalRounds, is_eval
from rollmesh.rollout.filters import get_group_filter, keep_all
from rollmesh.rollout.journal import Journal
from rollmesh.rollout.workers import Worker, WorkerPool
from rollmesh.core.trajectory import is_stale, made_after, new_trajectory, oldest_version
from rollmesh.core.validate import INVALID, invalid_reason, vocabulary_size

__all__ = ["GroupState", "RolloutCore", "Send"]


@dataclass(frozen=True)
class Send:
    """An action: send `msg` to `worker` (a worker that cannot be reached is lost)."""

    worker: Worker
    msg: Any


@dataclass
class GroupState:
    size: int
    version_admitted: int
    scored: list[Trajectory] = field(default_factory=list)
    queue: int = 0  # the queue shard it goes to (journaled at admission)


def share_of(total: int, shard: int, shards: int) -> int:
    """Shard `shard`'s part of `total` split over `shards`: the parts sum to `total` exactly."""
    return total // shards + (1 if shard < total % shards else 0)


class RolloutCore:
    def __init__(self, exp: ExperimentConfig, source: PromptSource, tokenizer: Any,
                 journal: Journal | None, log: Any, *, shard: int = 0, shards: int = 1,
                 queues: int = 1):
        self.exp, self.source, self.tokenizer, self.log = exp, source, tokenizer, log
        # Rollout shards: this one's index and how many there are (its share of the bound,
        # `capacity`); queue shards: how many its accepted groups are routed over (`route`).
        self.shard, self.shards, self.queues = shard, shards, queues
        self.journal = journal if journal is not None else Journal(None, log)
        self.group_filter = get_group_filter(exp.rollout.group_filter)
        # the bound on a row's token ids (`core.validate`): an id past it crashes the trainer
        self.vocab_size = vocabulary_size(exp.model.path, tokenizer) if tokenizer else None
        self.version = 0
        self.paused = False
        self.synchronizer_spoke = False  # a Pause or Resume since this process started
        self.workers = WorkerPool()
        self.pending: collections.deque[Trajectory] = collections.deque()  # admitted, new
        # new trajectories of groups admitted at a version newer than this one (after a
        # rewind: `rewind`), until the version comes back to theirs (`resume`)
        self.waiting: collections.deque[Trajectory] = collections.deque()
        self.cancel_queue: collections.deque[Trajectory] = collections.deque()
        self.to_score: collections.deque[Trajectory] = collections.deque()
        self.groups: dict[str, GroupState] = {}
        # accepted, not yet queued: one deque per queue shard (`ready` is the first's)
        self.readies: list[collections.deque[Group]] = [collections.deque()
                                                        for _ in range(queues)]
        self.ready = self.readies[0]
        # Each queue shard's depth in groups, as its last reply said, and the running groups
        # bound for it (`route`).
        self.queue_depth = [0] * queues
        self.bound_to = [0] * queues
        self.events: collections.Counter[str] = collections.Counter()
        self.announce_resume = False  # tell the agent workers at the next dispatch
        # Trajectories agent workers hold through the sync in progress (`Held`), and those
        # workers: a pause does not wait for them (kept as a count: `drained` is asked at
        # every return, and must not scan the workers).
        self.held_count = 0
        self.holding: dict[bytes, Worker] = {}
        # The loop classes rows name, loaded as they come (`loop_metadata`); None: unknown.
        self.loops: dict[str, type | None] = {}
        self.eval = EvalRounds(exp, log, self.events)
        # Engine health (`engines_seen`): None until the first probe, or without engine URLs.
        self.engines: list[str] = []
        self.engines_healthy: int | None = None
        # Groups of this rollouter each queue shard dropped as stale (`queue_stale`), and
        # their sum.
        self.queue_stale_by = [0] * queues
        self.queue_stale_groups = 0
        # Groups dropped here as stale (`drop_stale`) or lost_weights (`rewind`) with samples
        # still out with workers: group id -> (those samples, the reason they are dropped with
        # when they come back).
        self.stale_out: dict[str, tuple[int, str]] = {}
        # per queue shard, the ids (`id(group)`) of ready groups in a put not yet answered
        # (the put loops keep them: `mq.client.put_ready`'s `sending`)
        self.sending: list[set[int]] = [set() for _ in range(queues)]
        self.admission_stopped_since: float | None = None

    # -- counters ----------------------------------------------------------------------------

    @property
    def counters(self) -> collections.Counter[str]:
        """Every counter, read-only: this process's `events` and the journal's."""
        c = collections.Counter(self.events)
        c.update(self.journal.counters)
        if self.ready_groups():
            c["accepted_groups"] += self.ready_groups()
        return c

    @property
    def dropped(self) -> collections.Counter[str]:
        """Samples dropped, by reason (the journal's)."""
        return self.journal.dropped

    def ready_groups(self) -> int:
        """Groups accepted and not yet in a queue shard."""
        return sum(map(len, self.readies))

    def accepted_groups(self) -> int:
        """Groups accepted: queued (the journal's) and ready to be put."""
        return self.journal.counters["accepted_groups"] + self.ready_groups()

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
        filtered = self.events["filtered_groups"]
        seen = filtered + self.accepted_groups()
        if seen < 2 * r.batch_groups:  # too few to tell: the configured prior
            return r.over_sampling
        rate = min(filtered / seen, 0.95)
        return min(r.over_sampling, 1.0 / (1.0 - rate))

    def capacity(self) -> int:
        """With several rollout shards each has its share of the bound and of max_concurrent
        (`share_of`: the shares sum to the whole), so the promise holds for the run."""
        r, s = self.exp.rollout, self.exp.staleness
        per_version = r.batch_groups * self.exp.sync.sync_every
        concurrent = max(1, share_of(r.max_concurrent, self.shard, self.shards))
        concurrency = concurrent - self.running_groups
        # Groups the queue dropped as stale never reach the trainer: their places in the bound
        # are given back (else each stale drop would lower admission for good, down to 0).
        bound = share_of((s.max_staleness + self.version + 1) * per_version, self.shard,
                         self.shards)
        headroom = bound - (self.accepted_groups() - self.queue_stale_groups)
        staleness = int(max(0, headroom) * self.over_sampling()) - self.running_groups
        return min(concurrency, staleness)

    @property
    def admission(self) -> str:
        if self.paused:
            return "paused (weight sync)"
        if self.engines_healthy == 0:
            return "stopped: no healthy engine"
        return "open"

    def admit(self) -> None:
        if self.engines_healthy == 0:  # nothing could generate it: keep the cursor where it is
            return
        while not self.paused and self.capacity() > 0:
            group = self.source.next_group()
            prompt = render_prompt(group.row, self.tokenizer, self.exp.data.system_prompt)
            if len(prompt) > self.exp.data.max_prompt_tokens:
                self.events["skipped_prompts"] += 1
                continue
            queue = self.route()
            self._start_group(group, prompt, self.version, queue)
            self.journal.admitted(group, self.source.state(), self.version, queue)

    def route(self) -> int:
        """The queue shard a group admitted now goes to: the one with the fewest groups, as
        its last reply said, plus this rollouter's groups bound for it (running or ready), so
        that every shard holds about the same and none runs dry (the trainer takes the same
        share of every batch from each). Ties go round by the admission serial. Journaled with
        the admission: a group generated again after a restart goes to the same shard, which
        knows it by its id."""
        if self.queues == 1:
            return 0
        load = [self.queue_depth[j] + self.bound_to[j] + len(self.readies[j])
                for j in range(self.queues)]
        turn = self.source.serial
        return min(range(self.queues), key=lambda j: (load[j], (j - turn) % self.queues))

    def _start_group(self, group: PromptGroup, prompt: list[int], version: int,
                     queue: int = 0) -> None:
        loop = group.row.agent_loop or self.exp.data.default_agent_loop
        meta = {**group.row.metadata, "row": group.row.index,
                **self.loop_metadata(group.row, loop)}
        if group.row.tools is not None:
            meta["tools"] = group.row.tools
        for i in range(group.group_size):
            self.pending.append(new_trajectory(
                f"{group.group_id}-{i:03d}", group.group_id, i, prompt, agent_loop=loop,
                label=group.row.label, metadata=meta))
        state = self.groups[group.group_id] = GroupState(
            group.group_size, version, queue=queue if queue < self.queues else 0)
        self.bound_to[state.queue] += 1

    def loop_metadata(self, row: PromptRow, loop: str) -> dict[str, Any]:
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

    def start_eval(self) -> None:
        """An evaluation round at this version, if one is due (`EvalRounds.start`)."""
        self.eval.start(self.version, self.tokenizer, self.loop_metadata)

    def restore(self, restarted: bool) -> None:
        """Go on from the journal of a previous rollouter of this run, if there is one.
        `restarted`: this process replaces one of the same launch (not a `--resume`)."""
        j = self.journal
        if not j.replayed:
            return
        if j.cursor is not None:
            self.source.restore(j.cursor)
        self.version = j.version
        if j.paused and restarted:
            # Killed between a sync's Pause and its Resume: the engines may be half-way
            # through the broadcast. Generate nothing until the synchronizer's Resume (it
            # asks again until a rollouter answers); the role's `resume_if_forgotten` is
            # the backstop.
            self.paused = True
        elif not restarted and self.version > 0:
            # A new launch (`--resume`) of a run past version 0: the engines start with the
            # initial weights, and the trainer may resume at an older version than this one
            # (its checkpoint). Generate nothing until its first publication says which (a
            # Resume, with `rewind` if older: `rewind`); the role's `resume_if_forgotten` is
            # the backstop.
            j.pause()
            self.paused = True
        elif j.paused:
            # A new launch (`--resume`): fresh engines and synchronizer, no sync in progress.
            j.new_version(self.version)
        reopen, lost = j.recover()
        rows = {row.index: row for row in self.source.rows}
        for gid, g in reopen:  # in flight in the lost process: generate them again
            row = rows[g.row]
            prompt = render_prompt(row, self.tokenizer, self.exp.data.system_prompt)
            self._start_group(PromptGroup(gid, row, g.size, 0), prompt, g.version, g.queue)
        self.events["restored_groups"] = len(reopen)
        counters = self.counters
        self.log.warning("restored", records=j.replayed, version=self.version,
                         paused=self.paused,
                         cursor=j.cursor, regenerated_groups=len(reopen),
                         stragglers_dropped=lost, admitted=counters["admitted_samples"],
                         queued=counters["queued_samples"], dropped=dict(self.dropped))

    # -- dispatch ----------------------------------------------------------------------------

    def dispatch(self) -> Iterator[Send]:
        """Admit what the bound allows, then hand out work to the freest workers: to agent
        workers the cancel queue first, then the evaluation queue, then new trajectories (none
        while paused); to reward workers what is to be scored. Yields each send after the
        trajectory is counted as out with its worker."""
        if self.announce_resume and not self.paused:
            self.announce_resume = False
            for w in list(self.workers.values()):
                if w.kind == "agent":
                    yield Send(w, Resume(version=self.version))
        self.admit()
        while not self.paused and (self.cancel_queue or self.eval.queue or self.pending):
            worker = self.workers.freest("agent")
            if worker is None:
                break
            queue = self.cancel_queue or self.eval.queue or self.pending
            traj = queue.popleft()
            self.workers.give(worker, traj)
            yield Send(worker, Assign(trajectory=traj))
        while self.to_score:
            worker = self.workers.freest("reward")
            if worker is None:
                break
            traj = self.to_score.popleft()
            self.workers.give(worker, traj)
            yield Send(worker, Score(trajectory=traj))

    def worker_joined(self, peer: bytes, hello: WorkerHello) -> Resume | None:
        """Register a worker; for an agent worker outside a sync, the Resume to send it (what
        it may still hold from a sync, which a restarted rollouter never resumes, goes on)."""
        self.workers.add(Worker(peer, hello.worker, hello.kind, max(1, hello.credits)))
        self.log.info("worker_joined", worker=hello.worker, kind=hello.kind,
                      credits=hello.credits)
        if hello.kind == "agent" and not self.paused:
            return Resume(version=self.version)
        return None

    def worker_lost(self, worker: Worker, why: str) -> bool:
        """Re-queue everything the worker held, as it was when dispatched; False if the worker
        was already gone."""
        if not self.workers.remove(worker):
            return False
        back = list(worker.out.values())
        self.held_count -= len(worker.held)
        self.holding.pop(worker.peer, None)
        for traj in back:
            (self.cancel_queue if worker.kind == "agent" else self.to_score).appendleft(traj)
        self.events["workers_lost"] += 1
        self.log.error("worker_lost", worker=worker.name, why=why, requeued=len(back))
        return True

    # -- results -----------------------------------------------------------------------------

    def returned(self, worker: Worker, traj: Trajectory) -> bool:
        """A trajectory back from its agent worker; False if it was not out with it."""
        if self.workers.take_back(worker, traj.sample_id) is None:
            self.events["unexpected_returns"] += 1  # e.g. from a worker declared dead earlier
            return False
        if traj.sample_id in worker.held:
            worker.held.discard(traj.sample_id)
            self.held_count -= 1
        if is_eval(traj):
            if self.eval.returned(traj):
                self.to_score.append(traj)
        elif traj.group_id not in self.groups:  # its group was already given up
            self._drop_straggler(traj)
        elif self.drop_invalid(worker, traj, scored=False):
            pass  # a row the trainer could not take: its group goes, reason "invalid"
        elif traj.status in ("finished", "interrupted") and self.drop_stale(traj):
            pass  # past the bound already: its group is dropped, this sample with it
        elif traj.status == "finished":
            self.to_score.append(traj)
        elif traj.status == "interrupted":
            self.cancel_queue.append(traj)
            self.events["interrupted"] += 1
        else:  # failed: retry from where it stood, then give the group up
            attempts = int(traj.metadata.get("attempts", 0)) + 1
            traj.metadata["attempts"] = attempts
            if attempts <= self.exp.rollout.max_retries:
                traj.status = "running"
                self.cancel_queue.append(traj)
            else:
                self.finish_group(traj.group_id, None, "generation_failed", extra=[traj])
        return True

    def scored(self, worker: Worker, scored: Scored) -> Group | None:
        """A reward back from its reward worker, joined with the trajectory sent to it (a
        Scored for a trajectory not out with that worker counts as an unexpected return); its
        group completes with the last one. Returns the group if that accepted it (it is in
        `ready`)."""
        dispatched = self.workers.take_back(worker, scored.sample_id)
        if dispatched is None:
            self.events["unexpected_returns"] += 1
            return None
        # a copy (the arrays shared): the one sent stays as it was, to be re-queued if this
        # record turns out to be bad
        traj = replace(dispatched, reward=scored.reward, reward_status=scored.reward_status,
                       error=scored.error, reward_info=scored.reward_info)
        if is_eval(traj):
            self.eval.scored(traj)
            return None
        state = self.groups.get(traj.group_id)
        if state is None:  # its group was already given up
            self._drop_straggler(traj)
            return None
        if self.drop_stale(traj):
            return None  # a version went by while it was scored: past the bound now
        if traj.reward_status == "ok" and self.drop_invalid(worker, traj, scored=True):
            return None  # a reward that is not a finite number
        state.scored.append(traj)
        if len(state.scored) == state.size:
            return self.complete(traj.group_id, state)
        return None

    def complete(self, group_id: str, state: GroupState) -> Group | None:
        """A group scored whole: dropped if a score failed or the filter rejects it, else
        accepted (returned)."""
        trajs = sorted(state.scored, key=lambda t: t.index)
        group = Group(group_id=group_id, trajectories=trajs,
                      version_admitted=state.version_admitted)
        if any(t.reward_status != "ok" for t in trajs):
            self.finish_group(group_id, None, "reward_failed")
        elif not self.group_filter(group):
            self.events["filtered_groups"] += 1
            self.finish_group(group_id, None, "filtered")
        else:
            self.finish_group(group_id, group, None)
            return group
        return None

    def drop_invalid(self, worker: Worker, traj: Trajectory, *, scored: bool) -> bool:
        """Drop `traj`'s group, reason "invalid", if the row is not one the trainer can take
        (`core.validate`: token ids past the vocabulary, arrays of different lengths, a version
        from the future (past the engines' next one), a reward that is not a finite number): an
        agent loop or a reward function is user code. Logged with the worker it came from."""
        why = invalid_reason(traj, vocab_size=self.vocab_size, max_version=self.version + 1,
                             scored=scored)
        if why is None:
            return False
        out = self.finish_group(traj.group_id, None, INVALID, extra=[traj])
        if out > 0:
            self.stale_out[traj.group_id] = (out, INVALID)
        self.events["invalid_groups"] += 1
        self.log.error("sample_invalid", group=traj.group_id, sample=traj.sample_id,
                       worker=worker.name, why=why, still_out=max(out, 0))
        return True

    def _drop_straggler(self, traj: Trajectory) -> None:
        left, reason = self.stale_out.get(traj.group_id, (0, "group_failed"))
        self.journal.drop(traj.group_id, reason, 1)
        if left == 1:
            del self.stale_out[traj.group_id]
        elif left > 1:
            self.stale_out[traj.group_id] = (left - 1, reason)

    # -- staleness in flight -----------------------------------------------------------------

    def drop_stale(self, traj: Trajectory | None = None) -> int:
        """Drop now, as stale, the groups that can no longer be trained: one of their samples
        in hand (`traj`, just back; or, without it, every one the rollouter holds) is already
        stale at the engines' version (`core.trajectory.is_stale`): the trainer takes batches at
        that version or later, so the MessageQueue would drop it at hand-out. Generating the
        rest would only feed that drop: their places and the engines' time go to new prompts
        instead. Returns how many groups were dropped. Nothing is dropped under
        `staleness.measure = "admission"` (the bound was applied at admission)."""
        if not self.exp.staleness.drops_in_flight:
            return 0
        max_staleness = self.exp.staleness.max_staleness
        if traj is not None:
            candidates: Any = (traj,)
        else:
            candidates = [*self.cancel_queue, *self.to_score,
                          *(t for g in self.groups.values() for t in g.scored)]
        doomed: dict[str, int] = {}
        for t in candidates:
            if t.group_id in self.groups and t.group_id not in doomed and not is_eval(t):
                oldest = oldest_version(t)
                if oldest is not None and is_stale(oldest, self.version, max_staleness):
                    doomed[t.group_id] = oldest
        for gid, oldest in doomed.items():
            extra = [traj] if traj is not None and traj.group_id == gid else []
            out = self.finish_group(gid, None, "stale", extra=extra)
            if out > 0:
                self.stale_out[gid] = (out, "stale")
            self.events["stale_groups_dropped"] += 1
            self.log.info("group_dropped_stale", group=gid, oldest_version=oldest,
                          version=self.version, max_staleness=self.exp.staleness.max_staleness,
                          still_out=max(out, 0))
        return len(doomed)

    def finish_group(self, group_id: str, group: Group | None, reason: str | None,
                     extra: list[Trajectory] = ()) -> int:
        """A group leaves the running set: accepted (to `ready`) or dropped with a reason.
        Returns the samples still out with workers (dropped when they come back)."""
        state = self.groups.pop(group_id)
        self.bound_to[state.queue] -= 1
        if group is not None:
            self.readies[state.queue].append(group)
            return 0
        # Dropped: the scored ones and the failed ones are in hand; the rest are still out
        # somewhere and are dropped when they come back (see scored / returned).
        n = len(state.scored) + len(extra)
        # Its samples still queued here go with it; those out with workers are dropped when
        # they come back (reason "group_failed").
        for q in (self.pending, self.waiting, self.cancel_queue, self.to_score):
            keep = [t for t in q if t.group_id != group_id]
            n += len(q) - len(keep)
            q.clear()
            q.extend(keep)
        self.journal.drop(group_id, reason, n, whole=True)
        return state.size - n

    def queue_of(self, group: Group) -> int:
        """The queue shard whose `ready` holds an accepted group."""
        return next((j for j, ready in enumerate(self.readies) if ready and ready[-1] is group),
                    0) if self.queues > 1 else 0

    def queued(self, group: Group) -> None:
        """The MessageQueue has the group (it left `ready`)."""
        self.journal.queued(group.group_id, len(group.trajectories))

    # -- pause / resume ----------------------------------------------------------------------

    def agent_out(self) -> int:
        return self.workers.out("agent")

    def agent_draining(self) -> int:
        """Trajectories out with agent workers that a pause waits for: all but the held."""
        return self.workers.out("agent") - self.held_count

    @property
    def drained(self) -> bool:
        """Paused, and nothing out with an agent worker that the pause waits for."""
        return self.paused and self.agent_draining() == 0

    def held(self, worker: Worker, sample_ids: list[str]) -> bool:
        """A worker holds these through the sync (`Held`): out with it, not draining. False if
        a Resume crossed it (they run already)."""
        if not self.paused:
            self.events["late_holds"] += 1
            return False
        new = {sid for sid in sample_ids if sid in worker.out} - worker.held
        worker.held |= new
        self.holding[worker.peer] = worker
        self.held_count += len(new)
        self.events["held_through_sync"] += len(new)
        return True

    def pause(self, mode: str) -> list[Send]:
        """Stop dispatching (journaled first). `in_place`: nothing to send, what is out stays
        out; otherwise the Cancel to every agent worker."""
        self.synchronizer_spoke = True
        self.journal.pause()
        self.paused = True
        if mode == "in_place":
            return []
        return [Send(w, Cancel(reason=mode)) for w in list(self.workers.values())
                if w.kind == "agent"]

    def resume(self, version: int) -> None:
        self.synchronizer_spoke = True
        self.version = max(self.version, version)
        self.journal.new_version(self.version)
        self.paused = False
        if self.waiting:
            self._wait_or_go()
        held = self.held_count
        for w in self.holding.values():
            w.held.clear()  # they generate again
        self.holding.clear()
        self.held_count = 0
        self.announce_resume = True
        stale = self.drop_stale()
        self.start_eval()
        self.log.info("resumed", version=self.version, cancel_queue=len(self.cancel_queue),
                      held=held, stale_groups_dropped=stale)

    def rewind(self, version: int) -> int:
        """The trainer resumed at `version`, older than this rollouter's (a cut run went on
        from its checkpoint; the synchronizer's Resume(rewind) after a Pause in abort mode, so
        that the trajectories come back with what they generated). The weights of the versions
        after it no longer exist: the trainer makes new ones under the same numbers. So the
        version is `version` again (journaled), and every group holding a token one
        generated is dropped, reason "lost_weights": running groups (their samples out with
        workers are dropped as they come back), and accepted groups not yet in a put (those in
        a put are the queue's: its rewind drops them). Groups admitted at a newer version with
        nothing generated yet (those a relaunched rollouter regenerates: it waits paused for
        the trainer, `restore`) wait, undispatched, until the version comes back to theirs
        (`resume`): they are generated at the version they were admitted at, and one whose
        first copy the queue already holds is recognised there by its id. The others go on at
        `version`. The admission bound follows the version back, so nothing is admitted until
        the trainer's version climbs past what was accepted. Returns the groups dropped."""
        was = self.version
        self.version = version
        self.journal.rewound(version)

        def lost(trajs: Any) -> bool:
            return any(made_after(t, version) for t in trajs)

        running: dict[str, list[Trajectory]] = {gid: list(g.scored)
                                                for gid, g in self.groups.items()}
        out = [t for w in self.workers.values() for t in w.out.values()]
        for t in (*self.cancel_queue, *self.to_score, *out):
            if t.group_id in running:
                running[t.group_id].append(t)
        doomed = [gid for gid, trajs in running.items() if lost(trajs)]
        for gid in doomed:
            left = self.finish_group(gid, None, "lost_weights")
            if left > 0:
                self.stale_out[gid] = (left, "lost_weights")
        ready_lost = 0
        for j, ready in enumerate(self.readies):
            keep = []
            for g in ready:
                if id(g) not in self.sending[j] and lost(g.trajectories):
                    self.journal.drop(g.group_id, "lost_weights", len(g.trajectories),
                                      whole=True)
                    ready_lost += 1
                else:
                    keep.append(g)
            ready.clear()
            ready.extend(keep)
        self._wait_or_go()
        self.events["lost_weights_groups"] += len(doomed) + ready_lost
        self.log.warning("rewound", version=version, was=was, running_dropped=len(doomed),
                         ready_dropped=ready_lost, running=len(self.groups),
                         waiting=len(self.waiting),
                         dropped=dict(self.dropped))
        return len(doomed) + ready_lost

    def _wait_or_go(self) -> None:
        """New trajectories of groups admitted after this version wait (`rewind`); those
        whose version has come back go, ahead of the new ones."""
        def early(t: Trajectory) -> bool:
            g = self.groups.get(t.group_id)
            return g is not None and g.version_admitted > self.version

        back = [t for t in self.waiting if not early(t)]
        held = [t for t in (*self.cancel_queue, *self.pending) if early(t)]
        if not back and not held:
            return
        for q, first in ((self.waiting, [t for t in self.waiting if early(t)] + held),
                         (self.cancel_queue, back + [t for t in self.cancel_queue
                                                     if not early(t)]),
                         (self.pending, [t for t in self.pending if not early(t)])):
            q.clear()
            q.extend(first)

    # -- what the role learns from the queue and the engines ---------------------------------

    def queue_stale(self, groups: int, queue: int = 0) -> bool:
        """Queue shard `queue` has dropped `groups` of this rollouter's groups as stale in
        all: True if more than known (their places in the bound come back)."""
        if groups <= self.queue_stale_by[queue]:
            return False
        self.log.info("queue_dropped_stale", groups=groups - self.queue_stale_by[queue],
                      total=groups, queue=queue)
        self.queue_stale_by[queue] = groups
        self.queue_stale_groups = sum(self.queue_stale_by)
        return True

    def engines_seen(self, healthy: int, urls: list[str], now: float) -> bool:
        """A probe found `healthy` engines answering: none stops admission, one again
        resumes it. True if the count changed."""
        if healthy == 0 and self.engines_healthy != 0:
            self.admission_stopped_since = now
            self.events["admission_stops"] += 1
            self.log.error("admission_stopped", reason="no healthy engine",
                           engines=urls, in_flight=self.in_flight(),
                           cursor=self.source.state())
        elif healthy and self.engines_healthy == 0:
            stopped = now - (self.admission_stopped_since or now)
            self.admission_stopped_since = None
            self.log.warning("admission_resumed", engines_healthy=healthy,
                             stopped_s=round(stopped, 1))
        if healthy == self.engines_healthy:
            return False
        self.engines_healthy = healthy
        return True

    # -- accounting --------------------------------------------------------------------------

    def in_flight(self) -> int:
        """Samples this process holds right now, counted where they are."""
        def train(ts: Any) -> int:
            return sum(not is_eval(t) for t in ts)

        return (len(self.pending) + len(self.waiting) + train(self.cancel_queue)
                + train(self.to_score)
                + sum(train(w.out.values()) for w in self.workers.values())
                + sum(len(s.scored) for s in self.groups.values())
                + sum(len(g.trajectories) for ready in self.readies for g in ready))

    def stats(self, *, protocol_errors: int, queue_unreachable_s: float | None,
              now: float) -> dict[str, Any]:
        return {
            **self.counters, "version": self.version, "paused": self.paused,
            "capacity": self.capacity(), "running_groups": self.running_groups,
            "in_flight": self.in_flight(), "pending": len(self.pending),
            "waiting": len(self.waiting),
            "cancel_queue": len(self.cancel_queue), "to_score": len(self.to_score),
            "held": self.held_count,
            "ready_groups": self.ready_groups(), "dropped": dict(self.dropped),
            "shard": self.shard, "shards": self.shards,
            "workers": {w.name: {"kind": w.kind, "credits": w.credits, "out": len(w.out)}
                        for w in self.workers.values()},
            "channel_protocol_errors": protocol_errors,
            "eval": self.eval.last.summary() if self.eval.last else None,
            "eval_pending": len(self.eval.queue),
            "cursor": self.source.state(),
            "engines_healthy": self.engines_healthy, "engines": len(self.engines),
            "admission": self.admission, "queue_stale_groups": self.queue_stale_groups,
            "staleness_measure": self.exp.staleness.measure,
            "journal_error": self.journal.error,
            "queue_unreachable_s": queue_unreachable_s,
            "admission_stopped_s": (round(now - self.admission_stopped_since, 1)
                                    if self.admission_stopped_since is not None else None),
            "over_sampling": round(self.over_sampling(), 3),
        }
