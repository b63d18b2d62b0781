"""The agent-loop worker role: runs many agent loops at once against the engine servers.

It joins the rollouter's channel with a number of credits (trajectories it runs at once), runs
each assigned trajectory with the loop the trajectory names, and returns it finished, or
interrupted on a Cancel: in-flight generations are aborted on the engines (their partial tokens
are kept in the trajectory), tool calls already running finish first, and every trajectory is
shipped back as it stands so any worker can resume it. The aborts come from whoever paused
rollout (the synchronizer, the launcher: `EngineClient.abort_while`): a worker holds the
engines' API key only, which cannot abort, pause or change what an engine serves
(rollmesh.engine.auth). A worker that stops drops its generations in flight instead.

Engine outages: a generation whose engine dies is sent again to another healthy engine (or the
restarted one) from the trajectory's tokens so far; with no engine healthy it waits, up to
`rollout.engine_wait_s`, and a Cancel meanwhile returns it interrupted with what it holds. Only
an outage longer than the limit makes it `failed` (the rollouter's max_retries then apply).

Loops that stay on their worker (`stays_on_worker`, e.g. `openai_agent`, whose user coroutine
cannot move): at a Cancel their generations are aborted too (partial tokens kept), but the
trajectories stay here, waiting for the Resume; once none of them generates the worker sends
`Held` with their ids, so the rollouter counts them as out with this worker without waiting for
them. At the rollouter's Resume (or its next Assign) they go on. A worker that stops hands them
back interrupted (they start over elsewhere).
"""

from __future__ import annotations

import asyncio
import os
import time
import traceback
from typing import Any

from rollmesh.agents.loops import Interrupted, LoopContext, get_agent_loop, load_agent_loops
from rollmesh.config import ExperimentConfig, parse_config
from rollmesh.engine.auth import EngineKeys
from rollmesh.engine.client import EngineClient
from rollmesh.models.lora import ADAPTER_NAME
from rollmesh.config import AgentWorkerSettings
from rollmesh.wire.messages import Assign, Cancel, Held, Resume, Returned, Trajectory
from rollmesh.runtime.process import RoleContext
from rollmesh.core.trajectory import load_tokenizer
from rollmesh.wire.channels import ChannelClient
from rollmesh.runtime.worker_loop import serve_worker


class AgentWorker:
    def __init__(self, ctx: RoleContext, exp: ExperimentConfig, client: EngineClient,
                 channel: ChannelClient):
        self.ctx = ctx
        self.log = ctx.log
        self.channel = channel
        self.loops = load_agent_loops()
        self.cancelling = asyncio.Event()
        self.loop_ctx = LoopContext(client, load_tokenizer(exp.model), exp.rollout,
                                    max_context=exp.model.max_context, cancelling=self.cancelling)
        self.running: dict[str, asyncio.Task] = {}
        self.pinned: set[str] = set()  # running trajectories whose loop stays on this worker
        self.counts = {"finished": 0, "interrupted": 0, "failed": 0}
        self.name = f"{ctx.spec.role}-{ctx.spec.instance}"
        self.cancelling_task: asyncio.Task | None = None  # the last Cancel's, while it runs

    async def run_one(self, traj: Trajectory) -> None:
        try:
            loop = get_agent_loop(traj.agent_loop, self.loops)(self.loop_ctx)
            await loop.run(traj)
            if traj.status != "finished":
                raise RuntimeError(f"agent loop {traj.agent_loop} returned without finishing")
        except Interrupted:
            traj.status = "interrupted"
            traj.interrupted_at = [*traj.interrupted_at, len(traj.token_ids)]
        except Exception as e:
            traj.status, traj.error = "failed", f"{type(e).__name__}: {e}"
            self.log.warning("trajectory_failed", sample=traj.sample_id, error=traj.error,
                             trace=traceback.format_exc(limit=3))
        finally:
            self.running.pop(traj.sample_id, None)
            self.pinned.discard(traj.sample_id)
        self.counts[traj.status] += 1
        await self.channel.send(Returned(trajectory=traj))

    def start(self, traj: Trajectory) -> None:
        """Run `traj` (known as pinned at once: a Cancel may come before its task starts)."""
        if getattr(self.loops.get(traj.agent_loop), "stays_on_worker", False):
            self.pinned.add(traj.sample_id)
        self.running[traj.sample_id] = asyncio.create_task(self.run_one(traj))

    async def cancel(self, reason: str, *, final: bool = False) -> None:
        """Stop everything in flight (a sync's generations are aborted by the engines' admin
        key holder who paused rollout, `final` ones dropped here); each loop returns its
        trajectory as it stands, but for loops that stay on this worker: once their
        generations are stopped, the rollouter is told they are held (module docstring).
        `final`: the worker is stopping, every trajectory goes back."""
        self.loop_ctx.resumed.clear()  # before `cancelling`: no held call starts again
        if final:
            self.loop_ctx.stopping.set()
        self.cancelling.set()
        n = len(self.running)
        if final:  # no sync aborts them: stop waiting (the engines abort them once we hang up)
            self.loop_ctx.drop_all()
        moving = [t for sid, t in self.running.items() if final or sid not in self.pinned]
        await asyncio.gather(*moving, return_exceptions=True)
        if self.loop_ctx.endpoint is not None:
            await self.loop_ctx.endpoint.quiesced()
        held = sorted(sid for sid in self.running if sid in self.pinned)
        self.cancelling.clear()
        if held:
            await self.channel.send(Held(sample_ids=held))
        self.log.info("cancelled", reason=reason, trajectories=n, held=len(held))

    def stats(self) -> dict[str, Any]:
        client = self.loop_ctx.client
        held = 0 if self.loop_ctx.resumed.is_set() else len(self.pinned)
        return {"running": len(self.running), "held": held, **self.counts,
                "generated_tokens": self.loop_ctx.generated_tokens,
                "engines_healthy": getattr(client, "healthy_count", None),
                # per engine URL: requests, prompt tokens, of which prefix-cached, hit rate
                # (summed over the agent workers by the monitor)
                "prefix_cache": client.cache_stats() if hasattr(client, "cache_stats") else {}}

    async def serve(self, credits: int) -> None:
        await serve_worker(self.ctx, self.channel, name=self.name, kind="agent", credits=credits,
                           handle=self.handle, stats=self.stats)

    async def handle(self, msg: Any) -> None:
        """A message from the rollouter (heartbeats and stats requests: rollmesh.runtime.worker_loop)."""
        if isinstance(msg, Assign):
            if self.cancelling_task is not None and not self.cancelling_task.done():
                await self.cancelling_task  # a resume after a cancel: ship the partials first
            self.loop_ctx.resumed.set()  # an Assign comes only when not paused
            self.start(msg.trajectory)
        elif isinstance(msg, Cancel):
            self.cancelling_task = asyncio.create_task(self.cancel(msg.reason))
        elif isinstance(msg, Resume):
            if self.cancelling_task is not None and not self.cancelling_task.done():
                await self.cancelling_task
            self.loop_ctx.resumed.set()  # held trajectories go on
        else:
            self.log.warning("unexpected_message", type=type(msg).__name__)


async def main(ctx: RoleContext) -> None:
    """Role entry. settings: rollmesh.config.AgentWorkerSettings."""
    settings = parse_config(AgentWorkerSettings, ctx.config, "agent worker spec")
    exp = settings.experiment
    identity = f"agent-{ctx.spec.instance}-{os.getpid()}-{time.time_ns() & 0xFFFF:x}".encode()
    channel = ChannelClient(ctx.transport, settings.rollouter, identity=identity)
    # a generation waits through an engine outage (and moves off a dead engine) for up to
    # rollout.engine_wait_s before it fails; a Cancel (weight sync) ends the wait
    # engine.router: /generate goes through the router, the rest to each engine; without one,
    # engine.routing: a trajectory's requests go to its group's engine (affinity) or each to
    # the least loaded; every worker's client picks alike for a group id, without talking
    async with EngineClient(settings.engines, api_key=EngineKeys.load(ctx.spec.keys_dir).api,
                            wait_s=exp.rollout.engine_wait_s, router_url=settings.router,
                            routing=exp.engine.routing,
                            # LoRA: every generation names the policy's adapter
                            lora_path=ADAPTER_NAME if exp.model.lora.enabled else None,
                            ) as client:
        worker = AgentWorker(ctx, exp, client, channel)
        python = worker.loop_ctx.tools.get("python")
        if callable(getattr(python, "check", None)):  # model code runs isolated, or not at all
            ctx.log.info("python_tool_checked", **await python.check())
        serving = asyncio.create_task(worker.serve(settings.credits))
        ctx.set_status(worker.stats)
        await ctx.ready()
        stop = asyncio.create_task(ctx.stopping.wait())
        await asyncio.wait({serving, stop}, return_when=asyncio.FIRST_COMPLETED)
        if serving.done():
            serving.result()  # a crash of the serve loop is this role's fatal error
        serving.cancel()
        # Stopping: hand back what runs, so nothing is lost with this process.
        if worker.running:
            await worker.cancel("worker stopping", final=True)
        await worker.loop_ctx.close()
        ctx.log.info("stats", **worker.stats())
    channel.close()
