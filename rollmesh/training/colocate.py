"""Colocated mode (the cluster file's `colocate = true`): the engines and the trainer take turns on
the same devices, as verl's hybrid engine and slime's `--colocate` do.

One turn, around each trainer step (`Turn`, on every rank; rank 0 alone talks):
    rank 0  SyncRequest(v+1) -> the synchronizer pauses rollout (abort: in-flight generations
            come back partial and wait in the cancel queue, as at any sync)
    rank 0  /release_memory_occupation {tags: engine.release_while_training} on every engine
    every   the optimizer state back on the device (trainer.offload_optimizer)
    every   the step
    every   the optimizer state to host memory again (trainer.offload_optimizer)
    rank 0  /resume_memory_occupation on every engine (all of it: the weights come next)
then the ordinary `sync_weights` of v+1: its SyncRequest repeats the one in progress and is
answered with the same SyncGo (the synchronizer's rule), the weights go to the engines, and
SyncDone resumes rollout. So the staleness rules, the cancel queue and the accounting are those
of the split mode with sync_every = 1; only the device is shared in time instead of in space.

The phase (`generate` while rank 0 waits for a batch, `train` during a turn, `sync` while the
weights go) is in the trainer's stats for the monitor; each metrics row carries the turn's
timings (`colocate_*`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from rollmesh.engine.client import EngineError
from rollmesh.runtime.log import get_logger
from rollmesh.wire.messages import SyncRequest

log = get_logger("rollmesh.training.colocate")
RELEASE_TRIES = 20  # an engine still finishing its aborts is not idle yet: asked again
RELEASE_RETRY_S = 0.25


def optimizers(state: Any) -> list[torch.optim.Optimizer]:
    return [o for o in (state.optimizer, state.critic_optimizer) if o is not None]


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Every state tensor of `optimizer` that lives on the parameters' device class to `device`
    (copies, pinned on the way to the host of a GPU); the scalar `step` counters stay where
    AdamW keeps them. Returns the bytes moved."""
    moved = 0
    pin = device.type == "cpu" and torch.cuda.is_available()
    for st in optimizer.state.values():
        for key, value in st.items():
            if not torch.is_tensor(value) or value.dim() == 0:
                continue
            if value.device.type == "cpu" and device.type == "cpu":
                st[key] = value.clone()  # CPU only: a real copy all the same, so tests see it
            else:
                copy = value.to(device, copy=True, non_blocking=not pin)
                st[key] = copy.pin_memory() if pin and not copy.is_pinned() else copy
            moved += value.numel() * value.element_size()
    if device.type == "cuda" or pin:
        torch.cuda.synchronize()
    return moved


class Turn:
    """One colocated turn on every rank (`async with Turn(state, link): step`); `metrics()`:
    its timings, for the step's row."""

    def __init__(self, state: Any, sender: Any, link: Any | None) -> None:
        self.state, self.sender, self.link = state, sender, link
        self.exp = state.exp
        self.timings: dict[str, Any] = {}
        self.released: list[str] = []  # the tags the engines were asked to give back

    async def __aenter__(self) -> Turn:
        self.started = time.monotonic()
        if self.state.ranks.is_main and self.sender is not None:
            self._phase("train")
            go = await self.sender.synchronizer.request(
                SyncRequest(version=self.state.version + 1, step=self.state.step + 1))
            self.timings["colocate_pause_s"] = go.pause_s
            released = time.monotonic()
            await self._release()
            self.timings["colocate_release_s"] = time.monotonic() - released
        if self.exp.trainer.offload_optimizer:
            loaded = time.monotonic()
            await asyncio.to_thread(self._move, self.state.device)
            self.timings["colocate_optimizer_load_s"] = time.monotonic() - loaded
        self.stepping = time.monotonic()
        return self

    async def __aexit__(self, kind: Any, exc: Any, tb: Any) -> None:
        self.timings["colocate_step_s"] = time.monotonic() - self.stepping
        if self.exp.trainer.offload_optimizer:
            offloaded = time.monotonic()
            moved = await asyncio.to_thread(self._move, torch.device("cpu"))
            self.timings["colocate_optimizer_offload_s"] = time.monotonic() - offloaded
            self.timings["colocate_optimizer_bytes"] = moved  # each way
        if self.state.ranks.is_main and self.sender is not None:
            resumed = time.monotonic()
            await self._resume()
            self.timings["colocate_resume_s"] = time.monotonic() - resumed
            self._phase("sync")
        self.timings["colocate_turn_s"] = time.monotonic() - self.started
        # (a failed step: the exception goes on; the synchronizer's watchdog resumes rollout)

    def _move(self, device: torch.device) -> int:
        return sum(move_optimizer_state(o, device) for o in optimizers(self.state))

    def _phase(self, phase: str) -> None:
        if self.link is not None:
            self.link.phase = phase

    async def _release(self) -> None:
        """Every serving engine gives back `engine.release_while_training`. An engine is idle
        once its aborts are through; one that stays busy (or fails) keeps its memory: logged,
        and the step runs anyway (nothing is lost; on a full GPU the step may then not fit)."""
        tags = list(self.exp.engine.release_while_training)
        if not tags:
            return
        for attempt in range(RELEASE_TRIES):
            try:
                await self.sender.engines.release_memory(tags)
                self.released = tags
                return
            except EngineError as e:
                error = e
                await asyncio.sleep(RELEASE_RETRY_S)
        self.released = tags  # some may have: resumed (a "not released" answer is ignored)
        log.warning("engine_release_failed", tags=tags, attempts=RELEASE_TRIES,
                    error=str(error)[:500])

    async def _resume(self) -> None:
        tags = self.released
        if not tags:
            return
        try:
            await self.sender.engines.resume_memory(tags)
        except EngineError as e:  # one restarted meanwhile holds its memory already
            log.warning("engine_resume_failed", tags=tags, error=str(e)[:500])

    def metrics(self) -> dict[str, Any]:
        return dict(self.timings)
