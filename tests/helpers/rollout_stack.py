"""A real rollout side for the tests: one built-in engine, the MessageQueue, the rollouter, agent
and reward workers, each its own process started through the role runtime. The test itself
plays trainer and synchronizer over the real protocol (`Driver`): it takes batches through the
queue's stream as the trainer does (`tests.helpers.queue.Trainer`)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollmesh.core.accounting import QueueStatus, RolloutStatus, identity
from rollmesh.config import ExperimentConfig, load_experiment, to_dict
from rollmesh.engine.client import EngineClient
from rollmesh.wire.messages import (
    Group,
    Pause,
    Paused,
    Resume,
    StatsRequest,
    WeightVersion,
)
from rollmesh.launcher.supervisor import Child, Supervisor
from rollmesh.wire.transport import RpcClient, Transport, free_port
from tests.engine.engine_harness import Engine
from tests.helpers.queue import Trainer

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def write_dataset(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def experiment(dataset: Path, *overrides: str) -> ExperimentConfig:
    base = [f"data.train_path={json.dumps(str(dataset))}", 'data.format="jsonl"',
            'data.prompt_key="prompt"', 'data.label_key="label"', "data.group_size=2",
            "rollout.max_new_tokens=32", "rollout.batch_groups=2", "rollout.max_concurrent=8",
            "staleness.max_staleness=1", "model.max_context=512", "data.max_prompt_tokens=128",
            'rollout.reward="exact_match"', "rollout.eval_every=0"]
    return load_experiment(ROOT / "configs/tiny_cpu.toml", overrides=[*base, *overrides])


@dataclass
class Stack:
    sup: Supervisor
    transport: Transport
    engine: Engine
    mq: Child
    rollouter: Child
    agents: list[Child]
    rewards: list[Child]
    driver: Driver


class Driver:
    """The test's side of the protocol: what the trainer and the synchronizer say."""

    def __init__(self, t: Transport, rollouter_rpc: str, mq_rpc: str, engine_url: str):
        self.rollouter = RpcClient(t, rollouter_rpc, timeout_s=120, name="rollouter")
        self.mq = RpcClient(t, mq_rpc, timeout_s=120, name="message queue")
        self.engine_url = engine_url
        self.version = 0
        self.trainer = Trainer(self.mq)  # the trainer's stream of batches
        self.step = 0  # the last step taken (each taken is committed by the next take)

    async def rollouter_stats(self) -> dict[str, Any]:
        return (await self.rollouter.request(StatsRequest())).values

    async def mq_stats(self) -> dict[str, Any]:
        return (await self.mq.request(StatsRequest())).values

    async def pause(self, mode: str = "abort") -> Paused:
        """Pause rollout as the synchronizer does: in abort mode the engine's requests are
        aborted until the rollouter answers (the workers cannot abort: rollmesh.engine.auth)."""
        pending = self.rollouter.request(Pause(mode=mode))
        if mode != "abort":
            return await pending
        async with EngineClient([self.engine_url]) as client:
            return await client.abort_while(pending)

    async def sync(self, mode: str = "abort") -> Paused:
        """What the synchronizer does, with a version bump in place of a broadcast; in place,
        the engine is paused in place around it as the trainer's publisher does."""
        paused = await self.pause(mode)
        self.version += 1
        async with EngineClient([self.engine_url]) as client:
            if mode == "in_place":
                await client.pause("in_place")
            await client.update_weight_version(str(self.version))
            if mode == "in_place":
                await client.resume()
        await self.mq.request(WeightVersion(version=self.version))
        await self.rollouter.request(Resume(version=self.version))
        return paused

    async def take(self, groups: int, timeout_s: float = 60) -> list[Group]:
        """What the trainer does for its next step (the one before committed, as by a
        checkpoint after every step): the batch of `groups` groups at the driver's version
        from the queue's stream; none ([]) if it did not come within `timeout_s`."""
        batch = await self.trainer.take(self.step + 1, self.step, groups=groups,
                                        version=self.version, timeout_s=timeout_s)
        if batch is None:
            return []
        self.step += 1
        return batch.groups

    async def wait_for(self, predicate, timeout_s: float = 120, what: str = "") -> dict[str, Any]:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            stats = {"rollouter": await self.rollouter_stats(), "mq": await self.mq_stats()}
            if predicate(stats):
                return stats
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {stats}")
            await asyncio.sleep(0.2)

    def close(self) -> None:
        self.trainer.close()
        self.rollouter.close()
        self.mq.close()


def accounting(stats: dict[str, Any], consumed: int) -> tuple[int, int]:
    """(admitted, consumed + dropped + in flight) across the rollouter and the queue."""
    queue = QueueStatus.parse(stats["mq"])
    assert queue.consumed_samples == consumed
    ident = identity(RolloutStatus.parse(stats["rollouter"]), queue)
    return ident.admitted, ident.accounted


async def start_stack(t: Transport, tmp: Path, exp: ExperimentConfig, *, agents: int = 1,
                      rewards: int = 1, credits: int = 64, engine_args: tuple[str, ...] = (),
                      rollouter_config: dict[str, Any] | None = None,
                      watch_engines: bool = False) -> Stack:
    sup = Supervisor(t, heartbeat_s=0.5, liveness=4, log_dir=tmp / "logs")
    engine = await asyncio.to_thread(Engine, tmp / "engine.log", "--weight-version", "0",
                                     *engine_args)
    spec = to_dict(exp)
    mq = sup.spawn("message_queue", "rollmesh.mq.role:main", env=ENV,
                   config={"experiment": spec, "bind": f"tcp://127.0.0.1:{free_port()}"})
    mq_rpc = (await sup.wait_ready(mq, 120))["rpc"]
    rollouter = sup.spawn("rollouter", "rollmesh.rollout.role:main", env=ENV, config={
        "experiment": spec, "bind": f"tcp://127.0.0.1:{free_port()}",
        "control": f"tcp://127.0.0.1:{free_port()}", "message_queue": mq_rpc,
        # watch_engines: the engine URL as the launcher gives it (admission stops in an outage)
        **({"engines": [engine.url]} if watch_engines else {}), **(rollouter_config or {})})
    eps = await sup.wait_ready(rollouter, 120)
    reward_children = [sup.spawn("reward_worker", "rollmesh.rewards.role:main", instance=i,
                                 env=ENV, config={"experiment": spec, "rollouter": eps["channel"],
                                                  "pool": 2})
                       for i in range(rewards)]
    for c in reward_children:
        await sup.wait_ready(c, 120)
    # agent workers last: generation starts when the first one joins, so the test's body
    # begins close to that moment however slowly the other processes started
    agent_children = [sup.spawn("agent_worker", "rollmesh.agents.role:main", instance=i, env=ENV,
                                config={"experiment": spec, "rollouter": eps["channel"],
                                        "engines": [engine.url], "credits": credits})
                      for i in range(agents)]
    for c in agent_children:
        await sup.wait_ready(c, 120)
    return Stack(sup, t, engine, mq, rollouter, agent_children, reward_children,
                 Driver(t, eps["rpc"], mq_rpc, engine.url))


async def stop_stack(stack: Stack) -> None:
    stack.driver.close()
    await stack.sup.close(grace_s=10)
    await asyncio.to_thread(stack.engine.stop)

