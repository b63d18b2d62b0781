"""Discrete-event simulation of RL post-training on 32-128 GPU clusters: sync vs async.

    .venv/bin/python benchmarks/simulate.py [--gpus 32,64,128] [--staleness 1,2,4]
        [--steps 12] [--warmup 3] [--seed 0] [--calibrate FIGURES.json]
        [--mq-capacity 758] [--json PATH]   (every cost below is a flag too: --help)

What is simulated (pure Python + numpy, seeded, a few seconds a scale):

  engines    GPUs / --tp inference engines with continuous batching (at most --max-batch
             sequences each). Between events every running sequence gains one token per decode
             step, and a decode step costs  base + per_seq * batch + per_ctx_token * (sum of the
             batch's context lengths)  (weights read once, a little compute per sequence, the
             KV cache read per context token); solved in closed form between events, so a
             16k-token tail costs no more to simulate than a short answer. A sample admitted to
             an engine first costs a prefill of its prompt (--prefill-tok-s per GPU).
  lengths    response lengths lognormal (median --len-median, shape --len-sigma; a fit of the
             shape of math RL responses: most a few thousand tokens, a long tail), clipped to
             --len-max; prompts --prompt-len tokens.
  trainer    one training step on B = --batch samples (verl's recipe: 512 prompts x 16
             responses) costs  tokens / (--train-tok-s * n_ref * (n / n_ref) ** --train-scaling)
             for the update, plus the same with --logprob-tok-s for the old log-prob pass where
             it is recomputed (--sync-logprobs, --async-logprobs; the published numbers show
             the trainer scaling sublinearly from 64 to 128 GPUs).
  modes
    colocated sync   all GPUs generate the batch, then all GPUs train, then --switch-s to swap
                     training and inference state (verl's hybrid engine).
    disagg sync      R GPUs generate, T = GPUs - R train, one batch per weight version
                     (staleness 0): the same pipeline as async with max_staleness 0.
    async s          the same split, AReaL's admission bound: admitted <= (s + v + 1) * B
                     while at most --max-concurrent run; the trainer takes the first B finished
                     samples (a sample older than s versions is dropped, counted); after each
                     step a weight sync pauses every engine for --sync-s (partial rollout: the
                     in-flight sequences keep their tokens and resume; with
                     --resume-prefill full they also pay a prefill of their whole context).
    Splits R:T are swept (--splits, fractions of the GPUs for rollout); the best is reported.

Defaults (a 7B model on H20-class GPUs, the setting of verl's fully-async recipe README,
"Asynchronous Training on 7B Model", Qwen2.5-Math-7B, DAPO, rollout.n 16, 512 prompts per step):
the trainer costs are fitted to its colocated-sync rows (update_actor 113.81 s and old_log_prob
53.92 s per step on 128 GPUs, update 133.41 s on 64), the decode costs to its 128-GPU colocated
gen time (177.85 s per step) with these lengths. Published: fully async 2.35-2.67x over
colocated sync on 128 GPUs (verl), up to 2.77x (AReaL). `--calibrate FILE` reads a JSON object
whose keys are any of these flags' names (e.g. {"decode_base_ms": 5.1, "train_tok_s": 2900})
to replace the defaults with measured figures (the file wins over flags).

Scale limits of rollmesh's own processes: each trained sample crosses the MessageQueue once
(PutGroup in, GetBatch out) and the rollouter about 4 + 2 x (interruptions) times (Assign,
Returned, Score, Scored, plus one Assign/Returned pair per resume). Needed rates at each scale
are printed beside --mq-capacity, the measured MessageQueue samples/s (default 758/s:
benchmarks/mq.py with 8,192-token samples on the 2-core development VM, commit b61b464; pass
the figure measured on the target machine).

The scale study, 1,024 to 100,000 GPUs (benchmarks/README.md, "Scaling on paper"):

    .venv/bin/python benchmarks/simulate.py --scale [--scale-models 7b,32b]
        [--scale-gpus 128,1024,10000,100000] [--scale-cell 128] [--scale-staleness 2]
        [--scale-splits 0.25,0.3125,0.375,0.5,0.625]
        [--scale-level 0.5] [--scale-check-gpus 1024] [--process-costs COSTS.json]

  For each model preset (MODELS: the calibrated 7B above, and a 32B-class model derived from
  it), the cell (--scale-cell GPUs, every split of --scale-splits) is simulated and its fastest run
  gives what one GPU asks of rollmesh's processes: samples/s, tokens per sample, resumes per
  sample, engine slots. Weak scaling: a cluster m times larger trains a batch m times larger,
  so these hold per GPU at any size (`--scale-check-gpus` simulates such a size whole to show
  it). The per-message costs of the rollouter and the MessageQueue (ProcessCosts: main-thread
  CPU per sample, per group or put, per token, per resume, per worker scanned; measured by
  benchmarks/rollout_cost.py, whose `--costs FILE` output `--process-costs` reads) turn the
  rates into the load of each one's thread, and the size where it reaches 100% is where one
  saturates; printed beside: the remedies (an index of free workers instead of the scan, puts
  of several groups, several rollouters, queue shards) and how many of each keep every thread
  under --scale-level at each size. Last, the shards rollmesh starts by default at each size
  (`rollmesh.config.default_shards`: rollouters, queue shards): each rollouter's thread, each of
  its put loops (one per queue shard) and each queue shard's thread at that size (the single
  process's load divided by the count, plus each process's fixed idle load), and whether every
  one is under --scale-level (benchmarks/shards.py's `--costs FILE` gives per-shard costs).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.results import row, write  # noqa: E402
from rollmesh.config import default_shards  # noqa: E402


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


@dataclass
class Costs:
    tp: int = 1                    # GPUs per inference engine
    max_batch: int = 256           # running sequences per engine, at most
    decode_base_ms: float = 9.0    # per decode step: weights read, launch overhead
    decode_per_seq_ms: float = 0.05    # per decode step and running sequence
    decode_per_ctx_ms: float = 1.4e-5  # per decode step and context token (KV read: 57 KB/token
                                       # for 7B GQA at ~4 TB/s)
    prefill_tok_s: float = 8000.0  # per GPU (7B: ~14 GFLOP/token at ~75% of 148 TFLOPS)
    train_tok_s: float = 3160.0    # update: tokens/s per GPU at n_ref GPUs
    logprob_tok_s: float = 6680.0  # old log-prob forward: tokens/s per GPU at n_ref GPUs
    train_scaling: float = 0.23    # trainer throughput ~ n ** this beyond n_ref (64 -> 128 GPUs:
                                   # update 133.41 s -> 113.81 s in the published table)
    n_ref: int = 64
    sync_logprobs: bool = True     # sync modes: old log-probs recomputed (verl colocated)
    async_logprobs: bool = False   # async: recompute too (rollmesh's `recompute`), or use the
                                   # engine's behaviour log-probs (verl's published async runs:
                                   # old_log_prob "\\" in its table; rollmesh's `bypass`)
    switch_s: float = 10.0         # colocated: swap training <-> inference state per step
    sync_s: float = 4.0            # disaggregated: weight broadcast (rollout paused)
    resume_prefill: str = "none"   # none (pause in place, KV kept) | full (re-prefill context)
    len_median: float = 2000.0
    len_sigma: float = 0.9
    len_max: int = 16384
    len_min: int = 16
    prompt_len: int = 300
    batch: int = 8192              # samples per trainer step (512 prompts x 16)


@dataclass
class Result:
    mode: str
    gpus: int
    rollout_gpus: int
    train_gpus: int
    staleness: float | None
    step_s: float                  # steady-state seconds per trainer step
    samples_per_s: float
    trainer_idle: float            # fraction of steady-state wall the trainer waits for data
    engine_busy: float             # fraction of engine-time spent decoding or prefilling
    dropped: int
    interruptions: int
    step_times: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        if self.mode == "colocated":
            return "colocated sync"
        if self.staleness == 0:
            return f"disagg sync {self.rollout_gpus}:{self.train_gpus}"
        s = "inf" if self.staleness is None else f"{self.staleness:g}"
        return f"async s={s} {self.rollout_gpus}:{self.train_gpus}"


# --------------------------------------------------------------------------------------------
# The engines: continuous batching, solved in closed form between events
# --------------------------------------------------------------------------------------------


class Engine:
    """Running sequences advance together, one token per decode step. `v` counts decode steps
    since start; a sequence admitted at v0 with r tokens to go finishes at v = v0 + r. The sum of
    the running sequences' context lengths `ctx` grows by `batch` per step, so the time of dv
    steps is  dv * (base + per_seq * b + per_ctx * ctx) + per_ctx * b * dv^2 / 2."""

    __slots__ = ("idx", "c", "t", "v", "ctx", "heap", "waiting", "stall", "epoch", "busy")

    def __init__(self, idx: int, c: Costs):
        self.idx, self.c = idx, c
        self.t = 0.0          # time up to which `v` is known
        self.v = 0.0
        self.ctx = 0.0        # sum of running contexts at v
        self.heap: list[tuple[float, int]] = []   # (finish v, sample id)
        self.waiting: list[int] = []
        self.stall = 0.0      # no decoding before this time (prefill, sync pause)
        self.epoch = 0
        self.busy = 0.0       # seconds spent decoding or prefilling

    @property
    def b(self) -> int:
        return len(self.heap)

    def _coef(self) -> tuple[float, float]:
        c = self.c
        lin = (c.decode_base_ms + c.decode_per_seq_ms * self.b + c.decode_per_ctx_ms * self.ctx)
        return lin / 1000.0, c.decode_per_ctx_ms * self.b / 2000.0

    def time_for(self, dv: float) -> float:
        lin, quad = self._coef()
        return dv * lin + quad * dv * dv

    def steps_in(self, dt: float) -> float:
        lin, quad = self._coef()
        if quad <= 0:
            return dt / lin
        return (-lin + math.sqrt(lin * lin + 4 * quad * dt)) / (2 * quad)

    def advance(self, t: float) -> None:
        """Bring `v` and `ctx` up to time t."""
        start = max(self.t, self.stall)
        if self.b and t > start:
            dv = self.steps_in(t - start)
            if self.heap:  # never past the next finish (callers advance to event times)
                dv = min(dv, self.heap[0][0] - self.v)
            self.busy += t - start
            self.v += dv
            self.ctx += self.b * dv
        self.t = max(self.t, t)

    def next_finish(self) -> float | None:
        if not self.heap:
            return None
        start = max(self.t, self.stall)
        return start + self.time_for(self.heap[0][0] - self.v)


# --------------------------------------------------------------------------------------------
# The simulation
# --------------------------------------------------------------------------------------------


def draw_lengths(c: Costs, n: int, rng: np.random.Generator) -> np.ndarray:
    raw = rng.lognormal(math.log(c.len_median), c.len_sigma, size=n)
    return np.clip(np.round(raw), c.len_min, c.len_max).astype(np.int64)


def train_seconds(c: Costs, tokens: float, gpus: int, recompute: bool) -> float:
    eff = c.n_ref * (gpus / c.n_ref) ** c.train_scaling if gpus > c.n_ref else gpus
    t = tokens / (c.train_tok_s * eff)
    if recompute:
        t += tokens / (c.logprob_tok_s * eff)
    return t


def simulate(c: Costs, gpus: int, rollout_gpus: int, staleness: float | None, *,
             colocated: bool = False, steps: int = 12, warmup: int = 3, seed: int = 0,
             max_concurrent: int | None = None) -> Result:
    """One run. colocated: rollout and training share all `gpus` (staleness is taken as 0);
    staleness None: no admission bound beyond max_concurrent."""
    rng = np.random.default_rng(seed)
    if colocated:
        rollout_gpus, train_gpus, staleness, pause = gpus, gpus, 0, c.switch_s
    else:
        train_gpus, pause = gpus - rollout_gpus, c.sync_s
    if rollout_gpus < c.tp or train_gpus < 1:
        raise ValueError(f"split {rollout_gpus}:{train_gpus} of {gpus} GPUs leaves a side empty")
    engines = [Engine(i, c) for i in range(rollout_gpus // c.tp)]
    cap_running = max_concurrent or len(engines) * c.max_batch
    B = c.batch
    recompute = c.sync_logprobs if staleness == 0 else c.async_logprobs
    prefill_rate = c.prefill_tok_s * c.tp

    # per-sample arrays, grown on demand
    target = np.zeros(0, np.int64)
    admitted_v = np.zeros(0, np.int64)     # weight version at admission
    n_admitted = 0
    running = 0
    accepted = 0                           # finished samples (into the queue)
    queue: list[int] = []                  # finished, not consumed (FIFO)
    q_head = 0
    version = 0
    dropped = interruptions = 0
    events: list[tuple[float, int, int, int]] = []  # (time, kind, engine, epoch)
    FINISH, TRAIN_DONE, SYNC_DONE = 0, 1, 2
    trainer_busy = False
    paused = False
    step_done_times: list[float] = []
    wait_started = 0.0
    idle_log: list[float] = []             # trainer wait before each step
    seq_start_v: dict[int, float] = {}
    load = np.zeros(len(engines))          # running + waiting per engine
    seq_ctx0: dict[int, float] = {}

    def schedule(e: Engine) -> None:
        e.epoch += 1
        t = e.next_finish()
        if t is not None:
            heapq.heappush(events, (t, FINISH, e.idx, e.epoch))

    def start_seq(e: Engine, sid: int, now: float) -> None:
        ctx0 = float(c.prompt_len)
        e.ctx += ctx0
        seq_start_v[sid], seq_ctx0[sid] = e.v, ctx0
        heapq.heappush(e.heap, (e.v + float(target[sid]), sid))
        pre = c.prompt_len / prefill_rate
        e.stall = max(e.stall, now) + pre
        e.busy += pre

    def admit(now: float) -> None:
        nonlocal n_admitted, running, target, admitted_v
        if paused:
            return
        if staleness is None:
            room = cap_running - running
        else:
            room = min(cap_running - running,
                       int((staleness + version + 1) * B) - (accepted + running))
        if room <= 0:
            return
        if n_admitted + room > len(target):
            grow = max(room, B)
            target = np.concatenate([target, draw_lengths(c, grow, rng)])
            admitted_v = np.concatenate([admitted_v, np.zeros(grow, np.int64)])
        touched = set()
        for sid in range(n_admitted, n_admitted + room):
            admitted_v[sid] = version
            e = engines[int(np.argmin(load))]
            load[e.idx] += 1
            e.advance(now)
            if e.b < c.max_batch:
                start_seq(e, sid, now)
            else:
                e.waiting.append(sid)
            touched.add(e.idx)
        n_admitted += room
        running += room
        for i in touched:
            schedule(engines[i])

    def try_train(now: float) -> None:
        nonlocal trainer_busy, q_head, dropped
        if trainer_busy or paused:
            return
        while len(queue) - q_head >= B:
            take = queue[q_head:q_head + B]
            q_head += B
            batch = [sid for sid in take
                     if staleness is None or version - admitted_v[sid] <= staleness]
            dropped += B - len(batch)
            if len(batch) == B:
                break
            queue[q_head - len(batch):q_head] = batch  # the fresh ones back, in order
            q_head -= len(batch)
        else:
            return
        trainer_busy = True
        idle_log.append(now - wait_started)
        tokens = float(target[batch].sum()) + B * c.prompt_len
        done = now + train_seconds(c, tokens, train_gpus, recompute)
        heapq.heappush(events, (done, TRAIN_DONE, -1, 0))

    now = 0.0
    admit(now)
    while len(step_done_times) < steps:
        if not events:
            raise RuntimeError("simulation stalled (no events): check the parameters")
        now, kind, idx, epoch = heapq.heappop(events)
        if kind == FINISH:
            e = engines[idx]
            if epoch != e.epoch:
                continue
            e.advance(now)
            while e.heap and e.heap[0][0] <= e.v + 1e-6:
                _, sid = heapq.heappop(e.heap)
                e.ctx -= seq_ctx0.pop(sid) + (e.v - seq_start_v.pop(sid))
                running -= 1
                accepted += 1
                load[idx] -= 1
                queue.append(sid)
                if e.waiting and not paused:
                    start_seq(e, e.waiting.pop(0), now)
            if not e.heap:
                e.ctx = 0.0  # no float drift
            schedule(e)
            admit(now)
            try_train(now)
        elif kind == TRAIN_DONE:
            trainer_busy = False
            # the weight sync: pause every engine for `pause` seconds
            paused = True
            for e in engines:
                e.advance(now)
                if e.b:
                    interruptions += e.b
                extra = 0.0
                if c.resume_prefill == "full" and e.b:
                    extra = e.ctx / prefill_rate
                    e.busy += extra
                e.stall = max(e.stall, now) + pause + extra
                schedule(e)
            heapq.heappush(events, (now + pause, SYNC_DONE, -1, 0))
        else:  # SYNC_DONE
            paused = False
            version += 1
            step_done_times.append(now)
            wait_started = now
            for e in engines:
                while e.waiting and e.b < c.max_batch:
                    start_seq(e, e.waiting.pop(0), now)
                schedule(e)
            admit(now)
            try_train(now)

    w = min(warmup, steps - 1)
    span = step_done_times[-1] - step_done_times[w - 1] if w > 0 else step_done_times[-1]
    n = steps - w if w > 0 else steps
    step_s = span / n
    idle = sum(idle_log[w:]) / span if span > 0 else 0.0
    busy = sum(e.busy for e in engines) / (len(engines) * step_done_times[-1])
    return Result("colocated" if colocated else "disagg", gpus, rollout_gpus, train_gpus,
                  staleness, step_s, B / step_s, idle, busy, dropped, interruptions,
                  step_done_times)


def sweep(c: Costs, gpus: int, staleness: float | None, splits: list[float],
          **kw) -> list[Result]:
    out = []
    for f in splits:
        r = int(round(gpus * f / c.tp)) * c.tp
        if r < c.tp or gpus - r < 1:
            continue
        out.append(simulate(c, gpus, r, staleness, **kw))
    return out


def analytic_pipeline_step(c: Costs, rollout_gpus: int, train_gpus: int, length: int,
                           recompute: bool) -> float:
    """Seconds per step of a perfect pipeline with every sample `length` tokens long, engines
    always full, no prefill and no sync pause: max(generation, training) per batch."""
    engines = rollout_gpus // c.tp
    b = c.max_batch
    # one wave: b sequences from prompt_len to prompt_len + length tokens
    ctx0 = b * c.prompt_len
    lin = (c.decode_base_ms + c.decode_per_seq_ms * b + c.decode_per_ctx_ms * ctx0) / 1000.0
    quad = c.decode_per_ctx_ms * b / 2000.0
    wave = length * lin + quad * length * length
    gen = c.batch / (engines * b) * wave
    tokens = c.batch * (length + c.prompt_len)
    return max(gen, train_seconds(c, tokens, train_gpus, recompute))


# --------------------------------------------------------------------------------------------
# Scale on paper: the cluster size at which one rollouter or one MessageQueue saturates
# --------------------------------------------------------------------------------------------

# Model presets: changes to Costs(). "7b" is the calibrated default above. "32b" is derived
# from it for a Qwen2.5-32B-class model (32.8B parameters, 64 layers, 8 KV heads of 128; the
# 7B: 7.6B, 28 layers, 4 KV heads of 128), same GPUs, same lengths, rollout at TP 4:
#   decode_base_ms     16.4 GB of bf16 weights read per GPU and step (7B at TP 1: 15.2 GB):
#                      9.0 x 16.4 / 15.2 = 9.7 ms, plus 2 all-reduces per layer x 64 layers at
#                      ~18 us = 2.3 ms -> 12 ms
#   decode_per_seq_ms  16.4 GFLOP per token per GPU (7B: 15.2) -> 0.05 x 1.08 = 0.054
#   decode_per_ctx_ms  KV 262 KB per token, 65.5 KB per GPU at TP 4 (7B: 57.3 KB) -> 1.6e-5
#   prefill, train, logprob tokens/s per GPU: the 7B's / 4.3 (FLOPs per token)
#   sync_s, switch_s   the 7B's x 4.3 (bytes of weights to move)
#   max_batch          256 sequences per engine of 4 GPUs: 318 GB of KV room per engine /
#                      262 KB per token holds 256 sequences of ~4.7k tokens (the mean is ~3.2k)
MODELS: dict[str, dict[str, Any]] = {
    "7b": {},
    "32b": dict(tp=4, decode_base_ms=12.0, decode_per_seq_ms=0.054, decode_per_ctx_ms=1.6e-5,
                prefill_tok_s=1860.0, train_tok_s=735.0, logprob_tok_s=1550.0, sync_s=17.0,
                switch_s=43.0),
}


@dataclass
class ProcessCosts:
    """Main-thread CPU of rollmesh's two singletons per unit of work (each is one asyncio thread:
    one core is its ceiling), as `benchmarks/rollout_cost.py` measures them on real role
    processes; `--process-costs FILE` reads the JSON its `--costs FILE` writes. The defaults are
    its runs of 2026-11-25 on the 2-core development VM while other sessions' tests and
    benchmarks ran (1-minute load average 5-12 on 2 cores: every figure is an upper bound of
    what a quiet core costs):
      rollouter figures   `rollout_cost.py --repeat 3` (medians of 3; the stack settings
                          32:16:0, 1024:16:0, 32:4:0, 32:16:1)
      queue, scan, codec  `rollout_cost.py --settings "" --repeat 5` (medians of 5)

    rollouter  per sample: Assign, Returned, Score, Scored, its share of the journal, the
               admission and the bookkeeping (`rollouter_per_sample_us`); per group: the
               prompt's chat template, the journal's admit/queued records, the PutGroup and
               its reply, the group filter (`rollouter_per_group_us`, from groups of 4 vs 16);
               per prompt token (the chat template's tokenisation per group, the arrays of each
               new trajectory; from 39- vs 1,029-token prompts); per resume (Assign + Returned
               again, and the syncs' Pause/Resume handling; from a sync after every batch); per
               token carried and message (the codec: encode or decode, one copy); and the
               choice of a worker, run for every Assign and every Score: the rollouter's index
               (`worker_index_ns` per dispatch, at 4,096 workers) or, as before it, a scan of
               every worker of the kind (`worker_scan_ns` per worker; `scan=True`).
    queue      per put (request, reply, one durable-log record: `queue_per_put_us`, from groups
               of 1 vs 16), per sample (its share of a put record and of the GetBatch reply,
               the accounting), per token (the durable log's crc32 and write, copies; from
               43-, 1,033- and 3,227-token samples).
    Assumptions, not measured here: `put_rtt_us` is benchmarks/wire.py's request-reply round
    trip (p50, 539 us in RESULTS.md: a 8,192-token sample each way); `credits` is what an
    agent worker takes (64: the agent worker's default, which `rollmesh launch` does not
    change); one reward worker per `gpus_per_reward_worker` rollout GPUs (one per 8-GPU node);
    the queue's fsync (once a second, on its event loop) blocks it for the bytes written since
    the last one at `disk_mb_s`.
    idle       `rollouter_idle_cores`, `queue_idle_cores`: what each process's thread spends
               whatever its load (heartbeats, stats and health polls, the put loop's tick), in
               cores; a fixed cost per process that sharding does not divide
               (benchmarks/shards.py measures them; 0 by default, as rollout_cost.py's figures
               are net of it)."""

    rollouter_per_sample_us: float = 416.0
    rollouter_per_group_us: float = 2362.0
    rollouter_per_prompt_token_ns: float = 319.0
    rollouter_per_resume_us: float = 424.0
    codec_per_token_ns: float = 1.25
    worker_scan_ns: float = 347.0
    worker_index_ns: float = 3045.0   # `rollout_cost.worker_index_ns(4096)`, 2026-11-25
    queue_per_sample_us: float = 119.0
    queue_per_put_us: float = 641.0
    queue_per_token_ns: float = 23.4
    put_rtt_us: float = 539.0
    credits: int = 64
    gpus_per_reward_worker: int = 8
    disk_mb_s: float = 1000.0
    bytes_per_token: int = 13     # token id int32, log-prob float32, version int32, mask uint8
    rollouter_idle_cores: float = 0.0
    queue_idle_cores: float = 0.0


@dataclass
class Workload:
    """What one GPU of a simulated cluster asks of the rollouter and the MessageQueue. Weak
    scaling: a cluster m times larger trains a batch m times larger (the same samples per GPU
    and step), so these per-GPU figures hold at any size (`weak_scaled` and the
    `--scale-check` run show it); a trainer that scales worse only lowers the rates."""

    model: str
    cell_gpus: int
    label: str                   # the best run of the cell, e.g. "async s=2 64:64"
    samples_per_gpu_s: float
    rollout_fraction: float
    seqs_per_rollout_gpu: float  # engine slots: max_batch / tp
    prompt_tokens: float
    tokens_per_sample: float     # prompt + mean response
    resumes_per_sample: float
    group_size: int = 16


@dataclass
class Load:
    """Utilisation of each singleton's thread at one size (1.0: saturated)."""

    gpus: int
    samples_per_s: float
    agent_workers: int           # per rollouter
    reward_workers: int          # per rollouter
    rollouter: float             # per rollouter
    rollouter_scan: float        # the part of `rollouter` spent choosing workers
    queue: float                 # per queue shard
    put_loop: float              # per put loop (one per rollouter and queue shard)


def weak_scaled(c: Costs, m: float) -> Costs:
    """The cell's costs for a cluster m times larger: a batch m times larger and the trainer's
    reference size (n_ref) m times larger, so each trainer GPU does the work it did in the cell
    (its throughput fit keeps its shape)."""
    return dataclasses.replace(c, batch=int(round(c.batch * m)), n_ref=int(round(c.n_ref * m)))


def rollouter_seconds_per_sample(w: Workload, p: ProcessCosts, agent_workers: int,
                                 reward_workers: int, scan: bool = False) -> float:
    """Main-thread seconds the rollouter spends per sample it queues."""
    r = w.resumes_per_sample
    us = (p.rollouter_per_sample_us + p.rollouter_per_group_us / w.group_size
          + p.rollouter_per_resume_us * r)
    ns = (p.rollouter_per_prompt_token_ns * w.prompt_tokens
          # one side of the codec for each message: Assign, Returned, Score, Scored, the put,
          # and an Assign + Returned per resume
          + p.codec_per_token_ns / 2 * w.tokens_per_sample * (5 + 2 * r))
    # the choice of a worker for (1 + resumes) Assigns and one Score
    if scan:  # before the index: each scans the agent (resp. reward) workers
        ns += p.worker_scan_ns * ((1 + r) * agent_workers + reward_workers)
    else:
        ns += p.worker_index_ns * (2 + r)
    return us * 1e-6 + ns * 1e-9


def queue_seconds_per_sample(w: Workload, p: ProcessCosts, groups_per_put: int = 1) -> float:
    """Main-thread seconds the MessageQueue spends per sample (put in, handed out), its fsync
    included (it runs on the event loop)."""
    fsync = w.tokens_per_sample * p.bytes_per_token / (p.disk_mb_s * 1e6)
    return (1e-6 * (p.queue_per_sample_us + p.queue_per_put_us / (w.group_size * groups_per_put))
            + 1e-9 * p.queue_per_token_ns * w.tokens_per_sample + fsync)


def load_at(w: Workload, p: ProcessCosts, gpus: float, *, rollouters: int = 1,
            queues: int = 1, groups_per_put: int = 1, scan: bool = False) -> Load:
    """Each singleton's utilisation at `gpus` GPUs: samples/s grow with the cluster, and so
    does the number of workers each dispatch scans. Several rollouters split the workers and the
    samples evenly (a data shard each); several queue shards split the samples (routed by
    balance), and each rollouter runs one put loop per queue shard. Each rollouter and queue
    shard also carries its fixed idle load (`rollouter_idle_cores`, `queue_idle_cores`)."""
    rate = w.samples_per_gpu_s * gpus
    rollout_gpus = w.rollout_fraction * gpus
    agents = math.ceil(rollout_gpus * w.seqs_per_rollout_gpu / p.credits / rollouters)
    rewards = math.ceil(rollout_gpus / p.gpus_per_reward_worker / rollouters)
    per_r = rate / rollouters
    full = rollouter_seconds_per_sample(w, p, agents, rewards, scan)
    bare = full
    bare -= (p.worker_scan_ns * ((1 + w.resumes_per_sample) * agents + rewards) if scan
             else p.worker_index_ns * (2 + w.resumes_per_sample)) * 1e-9
    q = queue_seconds_per_sample(w, p, groups_per_put)
    # the put loop waits for each reply: a round trip plus the queue's work on the put
    put_period = (p.put_rtt_us * 1e-6 / (w.group_size * groups_per_put) + q)
    return Load(int(round(gpus)), rate, agents, rewards,
                per_r * full + p.rollouter_idle_cores, per_r * (full - bare),
                rate / queues * q + p.queue_idle_cores, per_r / queues * put_period)


def saturation_gpus(w: Workload, p: ProcessCosts, which: str, level: float = 1.0,
                    **kw: Any) -> float:
    """The cluster size (GPUs) at which `which` (rollouter | queue | put_loop) reaches `level`
    of its thread: the load grows monotonically with the size, so bisect."""
    def f(g: float) -> float:
        return getattr(load_at(w, p, g, **kw), which)

    lo, hi = 1.0, 1.0
    while f(hi) < level:
        lo, hi = hi, hi * 2
        if hi > 1e9:
            return math.inf
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < level else (lo, mid)
    return hi


def shards_needed(w: Workload, p: ProcessCosts, gpus: int, which: str, level: float,
                  **kw: Any) -> int:
    """The fewest rollouters (which="rollouter") or queue shards ("queue") that keep each at or
    below `level` at `gpus` GPUs."""
    for n in range(1, 100_000):
        key = "rollouters" if which == "rollouter" else "queues"
        if getattr(load_at(w, p, gpus, **{**kw, key: n}), which) <= level:
            return n
    raise ValueError(f"no shard count up to 100,000 keeps the {which} under {level}")


def workload(c: Costs, model: str, cell_gpus: int, staleness: float | None,
             splits: list[float], **kw: Any) -> tuple[Workload, Result]:
    """Simulate the cell (every split), keep the fastest run, and read the per-GPU figures."""
    runs = sweep(c, cell_gpus, staleness, splits, **kw)
    if not runs:
        raise ValueError(f"no split of {cell_gpus} GPUs in {splits} leaves both sides GPUs")
    best = min(runs, key=lambda r: r.step_s)
    lengths = draw_lengths(c, 100_000, np.random.default_rng(kw.get("seed", 0)))
    resumes = best.interruptions / (len(best.step_times) * c.batch)
    return Workload(model, cell_gpus, best.label, best.samples_per_s / cell_gpus,
                    best.rollout_gpus / cell_gpus, c.max_batch / c.tp, float(c.prompt_len),
                    float(c.prompt_len + lengths.mean()), resumes), best


def scale_report(args: argparse.Namespace, p: ProcessCosts, base: dict[str, Any]) -> list:
    """The table of the scale study: per model, the needed rates and each singleton's load at
    every size, the sizes at which they saturate, and what it takes to stay below half load."""
    rows = []
    sizes = [int(g) for g in args.scale_gpus.split(",")]
    splits = [float(f) for f in args.scale_splits.split(",")]
    stale = None if args.scale_staleness in ("inf", "none") else float(args.scale_staleness)
    kw = dict(steps=args.steps, warmup=args.warmup, seed=args.seed)
    print(f"\nScale on paper (weak scaling from a {args.scale_cell}-GPU cell; async "
          f"max_staleness {args.scale_staleness}; per-process costs: "
          f"{args.process_costs or 'the defaults of ProcessCosts'})")
    for model in args.scale_models.split(","):
        if model not in MODELS:
            raise SystemExit(f"--scale-models: unknown model {model!r} (known: "
                             f"{', '.join(MODELS)})")
        c = Costs(**{**base, **MODELS[model]})
        w, best = workload(c, model, args.scale_cell, stale, splits, **kw)
        print(f"\n{model}: cell {args.scale_cell} GPUs, best {w.label}: "
              f"{w.samples_per_gpu_s:.3f} samples/s per GPU, {w.tokens_per_sample:.0f} tokens "
              f"per sample, {w.resumes_per_sample:.2f} resumes per sample, "
              f"{w.seqs_per_rollout_gpu:.0f} engine slots per rollout GPU")
        for g in [int(x) for x in args.scale_check_gpus.split(",") if x.strip()]:
            big = weak_scaled(c, g / args.scale_cell)
            r = simulate(big, g, int(round(best.rollout_gpus * g / args.scale_cell / c.tp))
                         * c.tp, stale, **kw)
            print(f"  check: the simulation itself at {g:,} GPUs (batch {big.batch:,}, split "
                  f"{r.rollout_gpus}:{r.train_gpus}): {r.samples_per_s / g:.3f} samples/s per "
                  f"GPU, {r.samples_per_s / g / w.samples_per_gpu_s:.3f}x the cell's")
        print(f"  {'GPUs':>7s} {'samples/s':>10s} {'agent wkrs':>10s} {'rollouter':>10s} "
              f"{'of it picks':>11s} {'put loop':>9s} {'queue':>7s}")
        for g in sizes:
            ld = load_at(w, p, g)
            print(f"  {g:7,d} {ld.samples_per_s:10,.0f} {ld.agent_workers:10,d} "
                  f"{ld.rollouter:9.0%} {ld.rollouter_scan / max(ld.rollouter, 1e-12):10.0%} "
                  f"{ld.put_loop:8.0%} {ld.queue:6.0%}")
        sat = {
            "rollouter (worker index)": saturation_gpus(w, p, "rollouter"),
            "rollouter, scanning every worker (before)": saturation_gpus(w, p, "rollouter",
                                                                         scan=True),
            "put loop (one PutGroup in flight)": saturation_gpus(w, p, "put_loop"),
            "queue": saturation_gpus(w, p, "queue"),
            "queue, 8 groups per put": saturation_gpus(w, p, "queue", groups_per_put=8),
        }
        print("  saturated (thread at 100%) at: " +
              "; ".join(f"{k} {v:,.0f} GPUs" for k, v in sat.items()))
        for g in sizes:
            r_scan = shards_needed(w, p, g, "rollouter", args.scale_level, scan=True)
            r_idx = shards_needed(w, p, g, "rollouter", args.scale_level)
            q_now = shards_needed(w, p, g, "queue", args.scale_level)
            q_bat = shards_needed(w, p, g, "queue", args.scale_level, groups_per_put=8)
            print(f"  at {g:,} GPUs, each under {args.scale_level:.0%}: rollouters {r_idx} "
                  f"(worker index) / {r_scan} (scan, before); queue shards {q_now} (one group "
                  f"per put) / {q_bat} (8 groups per put)")
        print("  with the default shards (rollmesh.config.default_shards), each process's load:")
        print(f"  {'GPUs':>7s} {'rollouters':>10s} {'queues':>6s} {'rollouter':>10s} "
              f"{'put loop':>9s} {'queue':>7s} {'all < ' + format(args.scale_level, '.0%'):>9s}"
              f" {'fewest rollouters / queues':>27s}")
        for g in sizes:
            n, m = default_shards(g)
            ld = load_at(w, p, g, rollouters=n, queues=m)
            ok = max(ld.rollouter, ld.put_loop, ld.queue) < args.scale_level
            try:
                fewest = (f"{shards_needed(w, p, g, 'rollouter', args.scale_level)} / "
                          f"{shards_needed(w, p, g, 'queue', args.scale_level)}")
            except ValueError:  # an idle load over the level: no count is enough
                fewest = "none"
            print(f"  {g:7,d} {n:10,d} {m:6,d} {ld.rollouter:9.1%} {ld.put_loop:8.1%} "
                  f"{ld.queue:6.1%} {'yes' if ok else 'NO':>9s} {fewest:>27s}")
            rows.append(row(f"busiest shard's load with the default shards ({n} rollouters, "
                            f"{m} queue shards) at {g:,} GPUs, {model}",
                            max(ld.rollouter, ld.put_loop, ld.queue), args.scale_level,
                            "share of a core", baseline_name="the planned load (--scale-level)",
                            higher_is_better=False, target=1.0,
                            note="rollouter thread, put loop and queue thread; costs: "
                                 f"{args.process_costs or 'ProcessCosts defaults'}"))
        for k, v in sat.items():
            rows.append(row(f"GPUs at which one {k} saturates, {model}", v, 1024.0, "GPUs",
                            baseline_name="1,024 GPUs (the size the sharding decision is "
                                          "made at)", higher_is_better=True,
                            note=f"weak scaling from a {args.scale_cell}-GPU simulated cell "
                                 f"({w.label}, {w.samples_per_gpu_s:.3f} samples/s per GPU); "
                                 f"costs from benchmarks/rollout_cost.py"))
    return rows


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default="32,64,128")
    p.add_argument("--staleness", default="1,2,4", help="async max_staleness values")
    p.add_argument("--splits", default="0.375,0.5,0.625",
                   help="fractions of the GPUs given to rollout, swept")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibrate", help="JSON object of measured figures (keys: the flags below)")
    p.add_argument("--mq-capacity", type=float, default=758.0,
                   help="measured MessageQueue samples/s (default: benchmarks/mq.py, "
                        "8,192-token samples, 2-core dev VM)")
    p.add_argument("--json", help="write result rows (benchmarks/results.py) here")
    p.add_argument("--scale", action="store_true",
                   help="the scale study instead (README 'Scaling on paper'): at what size one "
                        "rollouter or one MessageQueue saturates")
    p.add_argument("--scale-models", default="7b,32b", help=f"presets: {', '.join(MODELS)}")
    p.add_argument("--scale-gpus", default="128,1024,10000,100000")
    p.add_argument("--scale-cell", type=int, default=128,
                   help="GPUs of the simulated cell the per-GPU rates come from")
    p.add_argument("--scale-staleness", default="2")
    p.add_argument("--scale-splits", default="0.25,0.3125,0.375,0.5,0.625",
                   help="fractions of the cell's GPUs given to rollout, swept")
    p.add_argument("--scale-check-gpus", default="",
                   help="also simulate these sizes whole, weak-scaled (1,024: about a minute)")
    p.add_argument("--scale-level", type=float, default=0.5,
                   help="the load each rollouter / queue shard is planned for (headroom for "
                        "the burst of re-dispatches after a sync)")
    p.add_argument("--process-costs",
                   help="JSON of ProcessCosts fields (benchmarks/rollout_cost.py --costs)")
    defaults = Costs()
    for name, value in vars(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            p.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=value,
                           help=f"(default {value})")
        else:
            p.add_argument(flag, type=type(value), default=value, help=f"(default {value})")
    args = p.parse_args()
    values = {k: getattr(args, k) for k in vars(defaults)}
    if args.calibrate:
        measured = json.loads(Path(args.calibrate).read_text())
        unknown = set(measured) - set(values)
        if unknown:
            p.error(f"--calibrate: unknown keys {sorted(unknown)} (known: {sorted(values)})")
        values.update(measured)  # the file's figures win over the flags
    if values["resume_prefill"] not in ("none", "full"):
        p.error("--resume-prefill: expected none or full")
    c = Costs(**values)
    if args.scale:
        pc = ProcessCosts()
        if args.process_costs:
            measured = json.loads(Path(args.process_costs).read_text())
            known = {f.name for f in dataclasses.fields(ProcessCosts)}
            if set(measured) - known:
                p.error(f"--process-costs: unknown keys {sorted(set(measured) - known)} "
                        f"(known: {sorted(known)})")
            pc = dataclasses.replace(pc, **measured)
        write(args.json, scale_report(args, pc, values))
        return 0
    gpus_list = [int(g) for g in args.gpus.split(",")]
    stales = [float(s) if s not in ("inf", "none") else None for s in args.staleness.split(",")]
    splits = [float(f) for f in args.splits.split(",")]
    kw = dict(steps=args.steps, warmup=args.warmup, seed=args.seed)

    lengths = draw_lengths(c, 100_000, np.random.default_rng(args.seed))
    print(f"simulate: batch {c.batch} samples/step, lengths lognormal median {c.len_median:g} "
          f"sigma {c.len_sigma:g} clipped [{c.len_min}, {c.len_max}] (mean "
          f"{lengths.mean():.0f}, p90 {np.percentile(lengths, 90):.0f}, "
          f"{(lengths >= c.len_max).mean():.1%} at the cap), prompts {c.prompt_len}; "
          f"{args.steps} steps, steady state after {args.warmup}; seed {args.seed}")
    rows = []
    summary = []
    for g in gpus_list:
        colo = simulate(c, g, g, 0, colocated=True, **kw)
        disagg = sweep(c, g, 0, splits, **kw)
        best_sync = min(disagg, key=lambda r: r.step_s) if disagg else None
        print(f"\n{g} GPUs: {'mode':26s} {'s/step':>8s} {'samples/s':>10s} {'vs colo':>8s} "
              f"{'trainer idle':>12s} {'engine busy':>11s} {'dropped':>8s}")

        def line(r: Result) -> None:
            print(f"{'':10s}{r.label:26s} {r.step_s:8.1f} {r.samples_per_s:10.1f} "
                  f"{colo.step_s / r.step_s:7.2f}x {r.trainer_idle:12.1%} "
                  f"{r.engine_busy:11.1%} {r.dropped:8d}")

        line(colo)
        if best_sync:
            line(best_sync)
        best: dict[float | None, Result] = {}
        for s in stales:
            runs = sweep(c, g, s, splits, **kw)
            if runs:
                best[s] = min(runs, key=lambda r: r.step_s)
                line(best[s])
        top = min(best.values(), key=lambda r: r.step_s) if best else None
        if top is None:
            continue
        interrupts = top.interruptions / (len(top.step_times) * c.batch)
        mq_needed = top.samples_per_s          # one PutGroup in and one GetBatch out per sample
        rollouter_needed = top.samples_per_s * (4 + 2 * interrupts)
        print(f"{'':10s}best async: {top.label}, {colo.step_s / top.step_s:.2f}x colocated sync; "
              f"MessageQueue needs {mq_needed:.1f} samples/s (capacity {args.mq_capacity:g}: "
              f"headroom {args.mq_capacity / mq_needed:.0f}x, saturated near "
              f"{g * args.mq_capacity / mq_needed:,.0f} GPUs if the rate grows linearly); "
              f"rollouter {rollouter_needed:.0f} messages/s ({interrupts:.2f} resumes per "
              f"sample)")
        summary.append((g, colo, best, top, mq_needed))
    last = [x for x in summary if x[0] == max(gpus_list)]
    if last:
        g, colo, best, top, mq_needed = last[0]
        for s, r in best.items():
            note = (f"simulated 7B, batch {c.batch}, lognormal lengths median {c.len_median:g} "
                    f"max {c.len_max}; best split {r.rollout_gpus}:{r.train_gpus}, "
                    f"{r.dropped} samples dropped as stale in {args.steps} steps; published: "
                    f"verl fully-async 2.35-2.67x on 128 GPUs (staleness_threshold 0.5, 64:64), "
                    f"AReaL up to 2.77x")
            label = "inf" if s is None else f"{s:g}"
            rows.append(row(f"simulated async (max_staleness {label}) vs colocated sync, "
                            f"{g} GPUs", r.samples_per_s, colo.samples_per_s, "samples/s",
                            baseline_name="colocated sync (simulated)", higher_is_better=True,
                            note=note))
        rows.append(row(f"MessageQueue headroom at {g} GPUs (capacity / needed)",
                        args.mq_capacity, mq_needed, "samples/s",
                        baseline_name=f"samples/s the best simulated async run needs "
                                      f"({top.label})",
                        higher_is_better=True,
                        note="capacity: --mq-capacity (benchmarks/mq.py figure); needed: one "
                             "PutGroup in and one GetBatch out per trained sample"))
    write(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
