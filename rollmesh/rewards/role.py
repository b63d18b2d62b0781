"""The reward worker role: scores finished trajectories, each call isolated and time-limited.

It joins the rollouter's channel with credits, decodes each trajectory's response (everything
after the prompt), and scores it with the experiment's reward function (or the one the row
names in `metadata["reward"]`) in a `RewardSandbox` child process: a function that raises,
hangs or crashes is recorded on the sample (reward_status error/timeout, the reason in
`error`), never turned into a silent 0, and never takes this process down. A function that
declares a `trajectory` parameter also gets the trajectory's view (`trajectory_view`), built
here only for such a function.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from pathlib import Path
from typing import Any

from rollmesh.config import ExperimentConfig, parse_config
from rollmesh.config import RewardWorkerSettings
from rollmesh.wire.messages import Score, Scored, Trajectory
from rollmesh.rewards.sandbox import RewardSandbox
from rollmesh.rewards.trajectory import trajectory_view
from rollmesh.runtime.process import RoleContext
from rollmesh.core.trajectory import load_tokenizer
from rollmesh.wire.channels import ChannelClient
from rollmesh.runtime.worker_loop import serve_worker


class RewardWorker:
    def __init__(self, ctx: RoleContext, exp: ExperimentConfig, sandbox: RewardSandbox,
                 channel: ChannelClient):
        self.ctx, self.exp, self.sandbox, self.channel = ctx, exp, sandbox, channel
        self.tokenizer = load_tokenizer(exp.model)
        self.name = f"{ctx.spec.role}-{ctx.spec.instance}"
        self.counts = {"ok": 0, "error": 0, "timeout": 0}
        self.tasks: set[asyncio.Task] = set()

    async def score(self, traj: Trajectory) -> None:
        response = self.tokenizer.decode(traj.token_ids[traj.prompt_len:].tolist(),
                                         skip_special_tokens=True)
        name = str(traj.metadata.get("reward") or self.exp.rollout.reward)
        try:
            result = await self.sandbox.score(
                name, response, traj.label, traj.metadata, self.exp.rollout.reward_timeout_s,
                trajectory=functools.partial(trajectory_view, traj, self.tokenizer))
            scored = Scored(sample_id=traj.sample_id, reward=result.reward,
                            reward_status=result.status, error=result.error,
                            reward_info=result.info)
        except Exception as e:  # the sandbox itself failed (e.g. could not start a child)
            scored = Scored(sample_id=traj.sample_id, reward=None, reward_status="error",
                            error=f"reward sandbox: {type(e).__name__}: {e}")
        self.counts[scored.reward_status] += 1
        if scored.reward_status != "ok":
            self.ctx.log.warning("reward_failed", sample=traj.sample_id, reward=name,
                                 status=scored.reward_status, error=scored.error)
        await self.channel.send(scored)  # what scoring adds: the rollouter holds the rest

    async def serve(self, credits: int) -> None:
        await serve_worker(self.ctx, self.channel, name=self.name, kind="reward", credits=credits,
                           handle=self.handle, stats=lambda: dict(self.counts))

    async def handle(self, msg: Any) -> None:
        """A message from the rollouter (heartbeats and stats requests: rollmesh.runtime.worker_loop)."""
        if isinstance(msg, Score):
            task = asyncio.create_task(self.score(msg.trajectory))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)


async def main(ctx: RoleContext) -> None:
    """Role entry. settings: rollmesh.config.RewardWorkerSettings."""
    settings = parse_config(RewardWorkerSettings, ctx.config, "reward worker spec")
    exp, pool = settings.experiment, settings.pool
    identity = f"reward-{ctx.spec.instance}-{os.getpid()}-{time.time_ns() & 0xFFFF:x}".encode()
    channel = ChannelClient(ctx.transport, settings.rollouter, identity=identity)
    run_dir = [str(Path(ctx.spec.keys_dir).parent)] if ctx.spec.keys_dir else []
    async with RewardSandbox(pool, memory_limit_mb=exp.rollout.reward_memory_mb,
                             contained=not exp.rollout.reward_allow_unsafe,
                             hide=run_dir) as sandbox:
        await sandbox.start()
        ctx.log.info("reward_isolation", isolation=sandbox.isolation)
        worker = RewardWorker(ctx, exp, sandbox, channel)
        serving = asyncio.create_task(worker.serve(credits=pool * 4))
        ctx.set_status(lambda: dict(worker.counts))
        await ctx.ready()
        await asyncio.wait({serving, asyncio.create_task(ctx.stopping.wait())},
                           return_when=asyncio.FIRST_COMPLETED)
        if serving.done():
            serving.result()
        serving.cancel()
        ctx.log.info("stats", **worker.counts)
    channel.close()

