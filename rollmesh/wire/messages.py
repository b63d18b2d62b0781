"""The message records rollmesh processes exchange, each a `record` (a slotted dataclass whose
field types `rollmesh.wire.protocol` checks on decode). Grouped by who talks: a role and its
parent, the rollouter and its workers, the synchronizer, the MessageQueue and its clients."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np

from rollmesh.wire.protocol import PROTOCOL_VERSION, Framed, record


def _now() -> float:
    import time

    return time.time()


# -- lifecycle and control (role process <-> its parent / launcher) --------------------------


@record
class Hello:
    """First message of a role process to its parent; the parent checks the protocol version."""

    role: str
    host: str
    pid: int
    instance: int = 0
    protocol_version: int = PROTOCOL_VERSION


@record
class Ready:
    """The role has bound its sockets and can serve; `endpoints` says where."""

    role: str
    host: str
    pid: int
    instance: int = 0
    endpoints: dict[str, str] = dataclasses.field(default_factory=dict)


@record
class Heartbeat:
    """Liveness, both ways: sender identity and a sequence number."""

    sender: str
    seq: int
    time: float = dataclasses.field(default_factory=_now)


@record
class Fatal:
    """Sent by a role just before it exits on an unrecoverable error."""

    role: str
    host: str
    pid: int
    error: str
    instance: int = 0
    traceback: str = ""


@record
class Ok:
    """Generic success reply."""

    message: str = ""


@record
class ErrorReply:
    """Generic failure reply: `code` is machine-readable (protocol, unexpected, handler...)."""

    code: str
    message: str


@record
class Metrics:
    """Status published to the launcher's hub: counters and gauges of one role process."""

    role: str
    host: str
    values: dict[str, Any]
    time: float = dataclasses.field(default_factory=_now)


@record
class EvalResult:
    """One finished evaluation round of the held-out set, published by the rollouter on the
    status hub (topic `eval.rollouter.<instance>`) when the round ends and again every status
    interval (pub/sub may drop one; a subscriber keeps the newest by `version`).

    `version`: the weights the round evaluated. `n`: responses with a reward; `failed`: those
    whose generation or scoring failed (never a pass). `reward_mean`: over the n (None if
    n = 0). `pass_at`: pass@k by str(k) (`rollmesh.core.evaluation.pass_ks`). `by_source`: the same
    figures per data_source ({"prompts", "n", "failed", "reward_mean", "pass_at"}).
    `answers_resumed`: answers generated across a sync; `response_tokens`: their tokens."""

    version: int
    prompts: int
    n: int
    failed: int
    reward_mean: float | None
    pass_at: dict[str, float]
    by_source: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    answers_resumed: int = 0
    response_tokens: int = 0

    def summary(self) -> dict[str, Any]:
        """The round as `rollmesh.core.evaluation`'s summary dict (eval_metrics, the monitor)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if not out["by_source"]:
            del out["by_source"]
        return out


# -- data plane --------------------------------------------------------------------------------


@record
class Trajectory:
    """One sample: prompt plus everything generated and observed so far, one row per token.

    `versions` is the weight version that produced each token (-1 for prompt, tool and
    environment tokens); `loss_mask` is 1 exactly for generated tokens; `logprobs` holds the
    behaviour log-prob of generated tokens (0 elsewhere). `loop_state` is the agent loop's own
    resumable state: plain data, so any worker can continue the trajectory.
    """

    sample_id: str
    group_id: str
    token_ids: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # float32 [n]
    versions: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # uint8 [n]
    prompt_len: int
    index: int = 0  # position in its group
    agent_loop: str = "single_turn"
    status: str = "running"  # running | interrupted | finished | failed
    finish_reason: str | None = None
    num_turns: int = 0
    reward: float | None = None
    reward_status: str | None = None  # ok | error | timeout (never a silent 0)
    error: str = ""  # why generation or scoring failed
    label: Any = None
    loop_state: dict[str, Any] = dataclasses.field(default_factory=dict)
    reward_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Token counts at which a weight sync interrupted it (it went on from there, on whichever
    # worker resumed it): where the tokens on both sides are generated, mid-turn.
    interrupted_at: list[int] = dataclasses.field(default_factory=list)


@record
class Group(Framed):
    """The n samples of one prompt, which move through the MessageQueue together (nested in a
    PutGroups or a Batch as its own frames: the queue stores and forwards them as received)."""

    group_id: str
    trajectories: list[Trajectory]
    version_admitted: int = 0


@record
class WeightVersion:
    """A new policy weight version is live on the engines. `rewind`: the trainer resumed at
    `version`, older than the queue's; queued groups made by newer weights (which no longer
    exist) are dropped, reason "lost_weights" (`rollmesh.mq.store.MessageQueue.rewind`)."""

    version: int
    rewind: bool = False


# -- rollout plane: rollouter <-> agent-loop and reward workers (a Channel each way) -------------


@record
class WorkerHello:
    """A worker joins the rollouter's channel with `credits` trajectories it can run at once."""

    worker: str
    kind: Literal["agent", "reward"]
    credits: int


@record
class Assign:
    """Rollouter -> agent worker: run (or resume) this trajectory."""

    trajectory: Trajectory


@record
class Cancel:
    """Rollouter -> agent workers: abort generation, return every trajectory as it stands."""

    reason: str = ""


@record
class Returned:
    """Agent worker -> rollouter: a trajectory finished, interrupted or failed."""

    trajectory: Trajectory


@record
class Held:
    """Agent worker -> rollouter, answering a Cancel: these trajectories stay on the worker
    through the sync (their loop's own code cannot move, e.g. `openai_agent`'s user coroutine).
    Their generations are stopped (partial tokens kept); each goes on after the Resume and comes
    back finished or failed. The rollouter counts them as out with the worker, not as draining."""

    sample_ids: list[str]


@record
class Score:
    """Rollouter -> reward worker: score this finished trajectory."""

    trajectory: Trajectory


@record
class Scored:
    """Reward worker -> rollouter: what scoring added to the trajectory `sample_id`, its reward
    (or a recorded failure). The rollouter holds the trajectory it sent in Score and joins the
    two (`RolloutCore.scored`): the token arrays do not travel back."""

    sample_id: str
    reward: float | None
    reward_status: str  # ok | error | timeout (never a silent 0)
    error: str = ""  # why scoring failed
    reward_info: dict[str, Any] = dataclasses.field(default_factory=dict)


# -- weight sync: synchronizer -> rollouter (request-reply) ------------------------------------


@record
class Pause:
    """Stop dispatching and interrupt everything in flight; answered by Paused once drained."""

    mode: str = "abort"


@record
class Paused:
    in_flight: int
    cancel_queue: int


@record
class Resume:
    """Weights of `version` are live: resume, cancel queue first. Synchronizer -> rollouter;
    and rollouter -> agent workers, whose held trajectories (`Held`) then go on. `rewind`
    (synchronizer -> rollouter): the trainer resumed at `version`, older than the rollouter's;
    what was admitted at or generated by a newer version is dropped, reason "lost_weights"
    (`rollmesh.rollout.core.RolloutCore.rewind`)."""

    version: int
    rewind: bool = False


# -- weight sync: trainer rank 0 <-> synchronizer (request-reply) --------------------------------


@record
class SyncRequest:
    """Trainer rank 0 -> synchronizer: `version` is trained, pause rollout so it can be broadcast.

    Answered with SyncGo once the rollouter has paused (nothing in flight): the answer is the
    synchronizer's "broadcast now". The trainer then broadcasts and reports with SyncDone.
    """

    version: int
    step: int = 0
    # The trainer sends `version` again (an engine restarted and serves older weights, or the
    # trainer resumed): accepted at any version, and the weight-update group is built anew.
    republish: bool = False
    # A republish by a trainer that resumed at an older version than the rollout side's (the
    # run was cut and went on from a checkpoint): the rollouter and the queue go back to
    # `version` and drop what newer weights made (`rollmesh.sync.role`, "Rewind").
    rewind: bool = False


@record
class SyncGo:
    """Synchronizer -> trainer rank 0: rollout is paused; broadcast `version` to the engines."""

    version: int
    pause_s: float  # Pause sent -> Paused received
    cancel_queue: int = 0  # interrupted trajectories waiting to resume
    rebuild_group: bool = False  # the engine set changed: build the weight-update group anew


@record
class EnginesChanged:
    """Launcher -> synchronizer: an engine was restarted; the next sync rebuilds the group so
    the new process receives the current weights."""

    reason: str = ""


@record
class StopRun:
    """Anyone holding the run's keys -> the launcher's control socket (`rollmesh stop RUN`,
    from any machine that reaches it): shut the whole run down as Ctrl-C does. Answered with
    Ok at once; the caller then waits for the launcher to go (it stops answering)."""

    reason: str = ""


@record
class SyncDone:
    """Trainer rank 0 -> synchronizer: the engines hold `version` (ok), or the broadcast failed.

    Answered with Ok once the MessageQueue knows the version and the rollouter has resumed.
    """

    version: int
    ok: bool = True
    error: str = ""
    broadcast_s: float = 0.0
    bytes: int = 0
    retrying: bool = False  # failed, and the trainer tries again at once: keep rollout paused


# -- MessageQueue (request-reply) ----------------------------------------------------------------


@record
class PutGroups:
    """Several groups in one put (the rollouter sends what is ready). Answered with
    PutGroupsReply once every group it accepts is in the queue's log, in one write."""

    groups: list[Group]


@record
class PutGroupsReply:
    # The first `accepted` groups are in the queue (or were already: a retry); the rest were
    # refused because the queue is full: keep them and send them again (back-pressure).
    accepted: int
    depth: int
    # Samples the queue has dropped as stale, or as made by weights a rewind threw away
    # ("lost_weights"), in all: the rollouter gives their places in the staleness bound back.
    dropped_stale: int = 0
    # The same by rollout shard ("<i>": the samples of shard i's groups, known by their ids,
    # core.trajectory.group_origin): with several rollouters each gives back its own.
    stale_by_origin: dict[str, int] = dataclasses.field(default_factory=dict)


@record
class Batch:
    groups: list[Group]
    version: int
    step: int = 0  # the step it is for (OpenBatchStream)
    redelivered: bool = False  # the batch already handed out for this step, sent again


@record
class OpenBatchStream:
    """Trainer -> MessageQueue: hand out the batches for steps `next_step`, `next_step` + 1, ...
    up to `through_step` (each `groups` groups at `version`), pushed as groups become available:
    answered by one Batch per step, in step order, under this request's correlation id, for as
    long as the stream is open. A stream is the queue's one consumer: opening one ends the one
    before (a restarted trainer, or one that lost a push). The queue keeps the batch it handed
    out for a step until a `committed_step` (the step of the trainer's latest checkpoint, here
    or in a BatchCredit) covers it, so a new stream from a step already handed out (a resumed
    trainer, a lost push) gets the same groups again."""

    stream: int  # the consumer's id for it: BatchCredit names it
    groups: int
    version: int
    next_step: int
    through_step: int
    committed_step: int = 0


@record
class BatchCredit:
    """Trainer -> MessageQueue: the open stream may go on up to `through_step` (never back), at
    `version` from now on, and the trainer's latest checkpoint holds `committed_step`.
    Answered with StreamState."""

    stream: int
    version: int
    through_step: int
    committed_step: int = 0


@record
class StreamState:
    open: bool  # False: no such stream (the queue restarted, or another replaced it): open one
    next_step: int  # the step the stream hands out next


@record
class StatsRequest:
    """Ask a role for its counters; answered with Metrics."""
