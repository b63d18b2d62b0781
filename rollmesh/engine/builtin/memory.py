"""The built-in engine's memory hand-over, as SGLang 0.5.23 serves it (colocated mode):

    GET|POST /release_memory_occupation, /resume_memory_occupation   body {"tags": [...] | null}

Tags (SGLang's `constants.py`): `kv_cache`, `weights`, `cuda_graph`; none or empty = all three.
SGLang frees the memory through its memory saver and answers 200 with a `null` body; it asserts
an idle engine first ("release_memory_occupation should be called only when server is idle."),
which here is a 400 in SGLang's error form (`{"error": {"message": ...}}`) instead of a dead
scheduler. What each tag does here, on the scheduler thread:
- `kv_cache`: the running batch's KV (none: idle), the prefix cache and the decode path's slot
  cache and graphs are dropped; `cuda_graph`: the decode path's captured graphs. While either is
  released nothing is admitted: a /generate that arrives waits (held, not failed) until resumed.
- `weights`: the model's parameters and buffers go to host memory (on a GPU; on CPU they stay,
  only the state is kept) and come back on resume, values intact (SGLang discards them unless
  `--enable-weights-cpu-backup`: a colocated trainer sends new weights right after a resume
  anyway). A weight update while the weights are released is refused (weight_routes.py): the
  sender resumes `weights` first.
"""

from __future__ import annotations

from typing import Any

import torch
from aiohttp import web

from rollmesh.engine.builtin.bodies import MalformedBody, read_body
from rollmesh.engine.builtin.scheduler import Scheduler

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES
NOT_IDLE = "release_memory_occupation should be called only when server is idle."


def _error(message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=400)


async def _tags(request: web.Request) -> list[str]:
    body = await read_body(request, optional=True)
    tags = body.get("tags")
    if tags is None or tags == []:
        return list(MEMORY_TAGS)
    if not isinstance(tags, list) or any(t not in MEMORY_TAGS for t in tags):
        raise MalformedBody(f"tags must be a list of {list(MEMORY_TAGS)} or null, got {tags!r}")
    return tags


class MemoryRoutes:
    """The memory routes of one EngineServer (server.py): its scheduler, log and device."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def register(self, router: web.UrlDispatcher) -> None:
        for method in ("GET", "POST"):
            router.add_route(method, "/release_memory_occupation", self.release)
            router.add_route(method, "/resume_memory_occupation", self.resume)

    async def release(self, request: web.Request) -> web.Response:
        tags = await _tags(request)

        def release(s: Scheduler) -> str | None:
            # SGLang's is_fully_idle(ignore_waiting=paused): waiting requests may stay queued
            # only while generation is paused
            if s.running or (s.waiting and not s.paused):
                return NOT_IDLE
            already = [t for t in tags if t in s.memory_released]
            if already:
                return f"already released: {already}"
            s.release_kv()  # idle: only caches go (their KV is the weights' own anyway)
            if "weights" in tags:
                _move_model(s.model, torch.device("cpu"))
            s.memory_released.update(tags)
            return None

        error = await self.server.scheduler_call("call", release)
        if error is not None:
            return _error(error)
        # decode_steps: a colocated run's check that nothing decodes while it is released
        self.server.log.info("memory_released", tags=tags,
                             decode_steps=self.server.scheduler.decode_steps)
        return web.json_response(None)

    async def resume(self, request: web.Request) -> web.Response:
        tags = await _tags(request)

        def resume(s: Scheduler) -> str | None:
            missing = [t for t in tags if t not in s.memory_released]
            if missing:
                return f"not released: {missing}"
            if "weights" in tags:
                _move_model(s.model, s.device)
            s.memory_released.difference_update(tags)
            return None

        error = await self.server.scheduler_call("call", resume)
        if error is not None:
            return _error(error)
        self.server.log.info("memory_resumed", tags=tags,
                             decode_steps=self.server.scheduler.decode_steps)
        return web.json_response(None)


def _move_model(model: torch.nn.Module, device: torch.device) -> None:
    """Parameters and buffers to `device` in place (the same Parameter objects: anything that
    holds them, the decode path's fused copies aside, stays valid); on CUDA the freed blocks
    go back to the driver, so a colocated trainer can use them."""
    if next(model.parameters()).device == device:
        return
    model.to(device)
    if device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.empty_cache()
