"""The built-in engine's weight routes, as SGLang 0.5.23 serves them (docs/sglang-api.md):

    POST /init_weights_update_group, /update_weights_from_distributed,
         /destroy_weights_update_group, /update_weights_from_disk, /update_weight_version,
         /update_weights_from_tensor (by handle: `rollmesh.weight_sync.handles`; this engine
         takes only load_format "rollmesh_handles", never a pickle),
         /begin_weight_update, /end_weight_update (SGLang's session around updates)
    GET|POST /get_weights_by_name

bound to a running `EngineServer` (server.py: its scheduler, model, device and log). A
broadcast is received on the scheduler thread (`scheduler_call`), so the event loop keeps
answering while the scheduler is blocked inside the collective; the process groups this engine
joined (`groups`) live here until destroyed or the server shuts down. What both ends of a
weight update share (buckets, the group, tensor checks) is `rollmesh.weight_sync`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from rollmesh.engine.builtin.bodies import MalformedBody, error_reply, read_body
from rollmesh.engine.builtin.scheduler import Scheduler
from rollmesh.weight_sync.buckets import (
    LOAD_FORMATS,
    WeightSpec,
    receive_bucket,
    receive_bucket_into,
    receive_weights,
)
from rollmesh.weight_sync.group import destroy_weight_update_group, init_weight_update_group
from rollmesh.weight_sync.handles import LOAD_FORMAT as HANDLES_FORMAT
from rollmesh.weight_sync.handles import decode_handles, load_from_handles
from rollmesh.weight_sync.tensors import (
    WeightUpdateError,
    check_update,
    dtype_from_name,
    load_weights,
    model_tensors,
)


def _result(success: bool, message: str, **extra: Any) -> web.Response:
    """SGLang's weight-route body: `{"success", "message"}` (+ `num_paused_requests` from
    /update_weights_from_disk), 200 or 400."""
    return web.json_response({"success": success, "message": message, **extra},
                             status=200 if success else 400)


class WeightRoutes:
    """The weight-update handlers of one EngineServer, and the weight-update groups it joined."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.groups: dict[str, tuple[Any, str]] = {}  # group_name -> (process group, backend)
        # Receive buffer for flattened buckets that cannot land in the model directly (another
        # dtype than the model's) or are drained; kept while a weight-update group exists.
        self._recv_buffer: torch.Tensor | None = None
        self.session_open = False  # between /begin_weight_update and /end_weight_update
        self.updates_outside_session = 0

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_post("/init_weights_update_group", self.init_weights_update_group)
        router.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        router.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        router.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        router.add_post("/update_weight_version", self.update_weight_version)
        router.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        router.add_post("/begin_weight_update", self.weight_update_session)
        router.add_post("/end_weight_update", self.weight_update_session)
        router.add_route("GET", "/get_weights_by_name", self.get_weights_by_name)
        router.add_route("POST", "/get_weights_by_name", self.get_weights_by_name)

    def destroy_groups(self) -> None:
        """At shutdown: leave every weight-update group."""
        for group, _ in self.groups.values():
            destroy_weight_update_group(group)
        self.groups.clear()

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        b = await read_body(request)
        try:
            address, port = str(b["master_address"]), int(b["master_port"])
            rank, world = int(b.get("rank_offset", 1)), int(b["world_size"])
        except (KeyError, TypeError, ValueError) as e:
            return _result(False, f"init_weights_update_group: bad or missing field: {e}")
        name, backend = b.get("group_name", "weight_update_group"), b.get("backend", "nccl")
        if name in self.groups:
            return _result(False, f"weight update group {name!r} already exists")
        if backend == "nccl" and self.server.device.type != "cuda":
            return _result(False, "backend nccl needs a CUDA engine; this engine runs on "
                                  f"{self.server.device.type}: use backend gloo")
        timeout = float(b.get("timeout", 600))
        self.server.log.info("weight_group_joining", group=name, rank=rank, world_size=world,
                      backend=backend, master=f"{address}:{port}")
        try:
            # A thread, not the scheduler: the rendezvous waits for the trainer, generation goes on.
            group = await asyncio.to_thread(init_weight_update_group, address, port, rank, world,
                                            name, backend, timeout)
        except Exception as e:
            self.server.log.warning("weight_group_failed", group=name, error=str(e))
            return _result(False, f"failed to join weight update group {name!r}: {e}")
        self.groups[name] = (group, backend)
        self.server.log.info("weight_group_joined", group=name, rank=rank)
        return _result(True, "Succeeded to initialize custom process group.")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        b = await read_body(request)
        self._count_outside_session("update_weights_from_distributed")
        if (refused := self._released()) is not None:
            return refused
        names, dtypes, shapes = b.get("names"), b.get("dtypes"), b.get("shapes")
        if not all(isinstance(x, list) for x in (names, dtypes, shapes)):
            return _result(False, "names, dtypes and shapes must be lists")
        name = b.get("group_name", "weight_update_group")
        if name not in self.groups:
            return _result(False, f"no weight update group {name!r}: call "
                                  "/init_weights_update_group first")
        group, backend = self.groups[name]
        version = b.get("weight_version")
        load_format = b.get("load_format") or "tensor"
        if load_format not in LOAD_FORMATS:
            # Refused before the broadcast, which it cannot take part in: the sender is then
            # stuck until its group's timeout. Only a sender ignoring the contract gets here.
            return _result(False, f"load_format must be one of {list(LOAD_FORMATS)}, "
                                  f"got {load_format!r}")
        recv_device = self.server.device if backend == "nccl" else torch.device("cpu")

        def receive(s: Scheduler) -> int:
            start = time.perf_counter()
            s.weights_changing()
            try:
                check_update(self.server.model, names, shapes, dtypes)
            except WeightUpdateError:
                # The trainer broadcasts everything regardless: take part (drain), then refuse,
                # model intact. Only an unknown dtype name, or lists of different lengths,
                # leave the byte count unknown; then nothing can be drained.
                if load_format == "flattened_bucket":
                    self._recv_buffer = self._drain_buffer(names, dtypes, shapes, recv_device)
                    receive_bucket(group, names, dtypes, shapes, load_format, recv_device,
                                   self._recv_buffer)
                else:
                    for _ in receive_weights(group, names, dtypes, shapes, recv_device):
                        pass
                raise
            if load_format == "flattened_bucket":
                targets = model_tensors(self.server.model)
                if all(targets[n].dtype != dtype_from_name(d) for n, d in zip(names, dtypes)):
                    # cast into the model (another dtype on the wire): a reused buffer
                    self._recv_buffer = self._drain_buffer(names, dtypes, shapes, recv_device)
                n = receive_bucket_into(group, targets, names, dtypes, shapes, load_format,
                                        recv_device, self._recv_buffer)
            else:
                n = load_weights(self.server.model,
                                 receive_weights(group, names, dtypes, shapes, recv_device))
            if version is not None:
                s.weight_version = str(version)
            self.server.log.info("weights_updated", source="distributed", tensors=n,
                          load_format=load_format, weight_version=s.weight_version,
                          seconds=time.perf_counter() - start)
            return n

        if b.get("abort_all_requests", False):
            self.server.scheduler.abort(abort_all=True)
        self._warn_unflushable(b, "distributed")
        try:
            n = await self.server.scheduler_call("call", receive)
        except (WeightUpdateError, RuntimeError, ValueError) as e:
            self.server.log.warning("weights_update_failed", source="distributed", error=str(e))
            return _result(False, f"update_weights_from_distributed failed: {e}")
        return _result(True, f"Succeeded to update parameter online ({n} tensors).")

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """SGLang's body (`serialized_named_tensors`, one entry per TP rank: this engine has
        one), each entry rollmesh's msgpack handle table; the tensors are copied from the
        trainer's shared memory (or CUDA IPC buffer) into the model on the scheduler thread."""
        b = await read_body(request)
        self._count_outside_session("update_weights_from_tensor")
        if (refused := self._released()) is not None:
            return refused
        load_format, entries = b.get("load_format"), b.get("serialized_named_tensors")
        if load_format != HANDLES_FORMAT:
            return _result(False, f"load_format {load_format!r}: this engine takes only "
                                  f"{HANDLES_FORMAT!r} (handles in msgpack; it reads no pickle)")
        if not isinstance(entries, list) or len(entries) != 1:
            return _result(False, "serialized_named_tensors: expected a list of one entry "
                                  "(this engine has one TP rank)")
        version = b.get("weight_version")
        if version is not None and not isinstance(version, str):
            return _result(False, f"weight_version must be a string, got {version!r}")
        try:
            table = decode_handles(entries[0])
        except WeightUpdateError as e:
            return _result(False, f"update_weights_from_tensor failed: {e}")

        def load(s: Scheduler) -> int:
            start = time.perf_counter()
            s.weights_changing()
            n = load_from_handles(self.server.model, table)
            if version is not None:  # only once every tensor is in
                s.weight_version = version
            self.server.log.info("weights_updated", source="tensor", kind=table["kind"],
                                 tensors=n, weight_version=s.weight_version,
                                 seconds=time.perf_counter() - start)
            return n

        if b.get("abort_all_requests", False):
            self.server.scheduler.abort(abort_all=True)
        self._warn_unflushable(b, "tensor")
        try:
            n = await self.server.scheduler_call("call", load)
        except (WeightUpdateError, RuntimeError, ValueError) as e:
            self.server.log.warning("weights_update_failed", source="tensor", error=str(e))
            return _result(False, f"update_weights_from_tensor failed: {e}")
        return _result(True, f"Succeeded to update parameter online ({n} tensors).")

    async def weight_update_session(self, request: web.Request) -> web.Response:
        """/begin_weight_update and /end_weight_update, answered as SGLang 0.5.23 answers them
        (`scheduler_components/weight_updater.py`: one session at a time). SGLang refuses a
        weight update outside a session; this engine loads it anyway but counts and logs it
        (`weight_updates_outside_session`), so that a sender that would fail against SGLang
        shows here."""
        await read_body(request, optional=True)
        begin = request.path.endswith("/begin_weight_update")
        if begin and self.session_open:
            return _result(False, "a weight-update session is already open; "
                                  "call end_weight_update() first")
        if not begin and not self.session_open:
            return _result(False, "no weight-update session is open; "
                                  "call begin_weight_update() first")
        self.session_open = begin
        return _result(True, "Success")

    def _released(self) -> web.Response | None:
        """A weight update while the weights are given back (memory.py) has nowhere to land;
        one while a LoRA adapter is merged into them (lora.py) would stale its base copy."""
        if "weights" in self.server.scheduler.memory_released:
            return _result(False, "the weights are released (/release_memory_occupation): "
                                  "resume them (/resume_memory_occupation) before an update")
        lora = getattr(self.server, "lora", None)
        refused = lora.refuse_weight_update() if lora is not None else None
        if refused is not None:
            return _result(False, refused)
        return None

    def _count_outside_session(self, route: str) -> None:
        if not self.session_open:
            self.updates_outside_session += 1
            self.server.log.warning("weight_update_outside_session", route=route,
                                    hint="SGLang 0.5.23 refuses it: call /begin_weight_update "
                                         "first and /end_weight_update after")

    def _warn_unflushable(self, body: dict[str, Any], source: str) -> None:
        """An update asking `flush_cache` (the default) while requests are kept (an in-place
        pause, or none): this engine clears its prefix cache and goes on, but SGLang flushes after
        loading and asserts that it is idle, so its scheduler would die here. A sender meant for
        both engines must send `flush_cache: false` while requests are kept in place."""
        s = self.server.scheduler
        kept = len(s.running) + len(s.waiting)
        if body.get("flush_cache", True) and kept:
            self.server.log.warning("flush_cache_with_requests_kept", source=source, requests=kept,
                             paused=s.paused,
                             hint="SGLang would fail this update (its cache flush needs an "
                                  "idle engine): send flush_cache false during in-place syncs")

    def _drain_buffer(self, names: list, dtypes: list, shapes: list,
                      device: torch.device) -> torch.Tensor | None:
        """The receive buffer, grown to hold this bucket (scheduler thread)."""
        nbytes = sum(WeightSpec(str(n), dtype_from_name(d), tuple(int(x) for x in s)).nbytes
                     for n, d, s in zip(names, dtypes, shapes, strict=True))
        buf = self._recv_buffer
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        b = await read_body(request, optional=True)
        name = b.get("group_name", "weight_update_group")
        if name not in self.groups:
            return _result(False, f"no weight update group {name!r}")
        group, _ = self.groups.pop(name)
        if not self.groups:
            self._recv_buffer = None
        await self.server.scheduler_call("call", lambda _s: destroy_weight_update_group(group))
        self.server.log.info("weight_group_destroyed", group=name)
        return _result(True, "Succeeded to destroy custom process group.")

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        b = await read_body(request)
        if (refused := self._released()) is not None:
            return refused
        path = b.get("model_path")
        if not isinstance(path, str):
            raise MalformedBody("model_path (a checkpoint directory) is required")
        version = b.get("weight_version")

        def load(s: Scheduler) -> int:
            s.weights_changing()
            tensors = _read_checkpoint(Path(path))
            check_update(self.server.model, list(tensors), [t.shape for t in tensors.values()])
            missing = set(dict(self.server.model.named_parameters())) - set(tensors)
            if missing:
                raise WeightUpdateError(f"checkpoint {path} lacks {sorted(missing)[:5]}")
            n = load_weights(self.server.model, tensors.items())
            if version is not None:
                s.weight_version = str(version)
            self.server.log.info("weights_updated", source="disk", path=path, tensors=n,
                          weight_version=s.weight_version)
            return n

        if b.get("abort_all_requests", False):
            self.server.scheduler.abort(abort_all=True)
        self._warn_unflushable(b, "disk")
        try:
            n = await self.server.scheduler_call("call", load)
        except (WeightUpdateError, OSError, RuntimeError, ValueError) as e:
            self.server.log.warning("weights_update_failed", source="disk", path=path, error=str(e))
            return _result(False, f"update_weights_from_disk failed: {e}",
                           num_paused_requests=0)
        return _result(True, f"Succeeded to update model weights ({n} tensors).",
                       num_paused_requests=0)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        b = await read_body(request)
        version = b.get("new_version")
        if not isinstance(version, str):
            raise MalformedBody(f"new_version is required: a string, got {version!r}")
        if b.get("abort_all_requests", True):
            self.server.scheduler.abort(abort_all=True)

        def set_version(s: Scheduler) -> None:
            s.weight_version = str(version)

        await self.server.scheduler_call("call", set_version)
        self.server.log.info("weight_version_updated", weight_version=str(version))
        return web.json_response({"success": True,
                                  "message": f"Weight version updated to {version}",
                                  "new_version": version})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's test route: the first `truncate_size` rows (or elements) of a parameter, as
        float32 numbers (`models/llama.py` get_weights_by_name: a tied lm_head answers with the
        embedding). Exact for float32 and bfloat16 weights, so a test can check a sync bit for
        bit; an unknown name is SGLang's 400 "Get parameter by name failed"."""
        b = await read_body(request)
        name, truncate = b.get("name"), b.get("truncate_size", 100)
        if not isinstance(name, str):
            raise MalformedBody(f"name is required: a string, got {name!r}")
        if not isinstance(truncate, int) or isinstance(truncate, bool) or truncate < 0:
            raise MalformedBody(f"truncate_size must be an integer >= 0, got {truncate!r}")

        def read(s: Scheduler) -> list | None:
            params = dict(s.model.named_parameters(remove_duplicate=False))
            tensor = params.get(name)
            if tensor is None:
                return None
            return tensor.detach()[:truncate].to("cpu", torch.float32).tolist()

        values = await self.server.scheduler_call("call", read)
        if values is None:
            self.server.log.warning("get_weights_by_name_unknown", name=name)
            return error_reply("Get parameter by name failed")
        return web.json_response(values)


def _read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"no *.safetensors files in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors
