"""The trainer's side of a weight sync: the synchronizer handshake and the broadcast to engines.

`sync_weights` runs on every trainer rank at a sync point. Rank 0 asks the synchronizer
(SyncRequest, answered SyncGo once rollout is paused), tells the other ranks to go, broadcasts,
and reports (SyncDone); the other ranks take part in gathering each parameter from the FSDP
shards (`full_tensor`, a collective) in the same order. Flow and failure handling of the whole
sync: `rollmesh.sync.role`.

The broadcast follows docs/sglang-api.md: the first sync fires `/init_weights_update_group`
at every engine, joins the group as rank 0, then collects the replies; every bucket fires
`/update_weights_from_distributed` (its names, dtypes, shapes), broadcasts the bucket's tensors
in that order (`rollmesh.weight_sync.buckets`), then collects. Engines report the new version only
with the last bucket. `sync.load_format = "flattened_bucket"` sends each bucket as one broadcast
of its bytes (SGLang and the built-in engine both take it), pipelined: bucket i+1 is packed while
bucket i is on the wire. Memory on rank 0: one gathered tensor, plus at most two bucket buffers
(kept between syncs) when buckets travel flattened.

By handle (`sync.transport = "handles"`, or "auto" with every engine on this host): no group
and no broadcast; `_send_handles` packs the weights into one buffer kept between syncs (shared
memory, or CUDA memory shared by IPC) and sends each engine its handles on
`/update_weights_from_tensor` (`rollmesh.weight_sync.handles`); the rest of the flow is the same.

In-place pause (`sync.pause_mode = "in_place"`): the rollouter pauses without cancelling
anything, and rank 0 pauses the engines in place (`/pause_generation {"mode": "in_place"}`, the
requests and their KV kept) right after SyncGo, before the first bucket, and resumes them
(`/continue_generation`) after the broadcast, whether it worked or not, before SyncDone.

LoRA (`model.lora.rank > 0`): every rank gathers the adapters alone (`adapter_tensors`, in
lock-step as for a broadcast) and rank 0 writes them in peft's format to `<lora_dir>/v<N>`
(`send_adapter`); every engine then unloads the adapter `policy`, loads the new directory under
that name (SGLang's `/unload_lora_adapter`, `/load_lora_adapter`) and is told the version
(`/update_weight_version`). Rollout is paused in abort mode meanwhile (in-place is refused:
SGLang unloads an adapter only once its requests finish), so no request runs between the
unload and the load, and resumed partial rollouts name `policy` again. The directory of the
previous version is kept (an engine restarted mid-sync may still read it), older ones go.
Same attempts, verify and SyncDone as a broadcast; no group.

Engines that die: the group is built with the engines that answer /health (`choose_members`),
so a sync never waits for one the launcher is restarting. After a broadcast every serving engine
must report the new version (`verify`, and the synchronizer checks again before publishing it);
a restarted engine (initial weights, version 0) fails the attempt, which is retried with the
group rebuilt. Between syncs the trainer checks the engines (`engines_behind`, at every step and
every empty wait for a batch) and sends its version again to one behind
(`sync_weights(republish=True)`). A failed broadcast drops the group at once (`reset_group`):
gloo then closes its connections, so an engine still waiting for the rest of that broadcast
fails at once instead of holding its scheduler until the group's timeout.

Retries: a failed broadcast is tried again (SYNC_ATTEMPTS in all) with the group built anew, on
any number of ranks: rank 0 finishes the gather loop in lock-step with the other ranks even
after a failure (gathering, no longer sending), so every rank is back at `ranks.share` for the
next order: "broadcast" (again), "done" or "abort". Attempts that failed because an engine died
or restarted do not count towards SYNC_ATTEMPTS (up to SYNC_ATTEMPTS_WITH_RESTARTS in all).

Overlapped (`sync.overlap = true`): at a sync every rank gathers the parameters once, in
lock-step as for a broadcast, and rank 0 copies them, cast to the engines' dtype, into its
snapshot (`rollmesh.weight_sync.buckets.Snapshot`, kept from sync to sync); the trainer's version is
the snapshot's from then on (the batches it asks for, its staleness, as after a blocking sync)
and it goes on with its next step, while a background task on rank 0 runs the very same sync
(SyncRequest, broadcast, verify, SyncDone, the retries and their group rebuilds) from the
snapshot: the engines receive exactly the snapshot's bytes under its version, and rollout
resumes only after every engine holds them (the synchronizer's SyncDone, as ever). The other
ranks take no part in it (the snapshot is whole on rank 0). At most one is in flight: the next
sync, a checkpoint and the end of training first wait for it (`finish_sync`); a failure of the
background sync (after its retries) is raised there, on every rank, as a blocking sync would
raise it; while one is in flight the engines are behind by design and the trainer does not
re-publish (`WeightSender.pending`). On a GPU the snapshot lies on the GPU when it fits (free
memory beyond the snapshot >= SNAPSHOT_HEADROOM of the device), else in pinned host memory;
it is copied on a side stream that first waits for the compute stream (an event recorded after
the optimizer's update), the next optimizer step waits for the copy (a pre-step hook), and the
background broadcast runs on that side stream once the copy is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import shutil
import time
import traceback
from collections.abc import AsyncIterator, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from rollmesh.engine.answers import serves_other_version
from rollmesh.engine.client import EngineClient, EngineError, EngineKeys
from rollmesh.runtime.log import get_logger
from rollmesh.wire.messages import SyncDone, SyncGo, SyncRequest
from rollmesh.training.ranks import full_tensor
from rollmesh.wire.transport import RpcClient, Transport, free_port
from rollmesh.weight_sync.buckets import (
    BucketSender, Snapshot, WeightSpec, plan_buckets, update_body,
)
from rollmesh.weight_sync.group import init_weight_update_group
from rollmesh.weight_sync import handles
from rollmesh.models.lora import ADAPTER_NAME, config_dict, write_adapter
from rollmesh.training.lora import adapter_tensors

log = get_logger("rollmesh.weight_sync")

GROUP = "weight_update_group"
SYNC_ATTEMPTS = 3  # broadcasts tried for one version before the trainer gives up
# Attempts that failed because an engine died or restarted (the launcher brings it back) do not
# count towards SYNC_ATTEMPTS, up to this many attempts in all.
SYNC_ATTEMPTS_WITH_RESTARTS = 10
DESTROY_TIMEOUT_S = 30.0  # an engine that cannot drop its old group in this time is not waited for
# An overlapped sync's snapshot goes on the GPU only if this share of the GPU's memory stays
# free beside it (the next steps' activations), else into pinned host memory.
SNAPSHOT_HEADROOM = 0.1


def forget_frames(e: BaseException) -> None:
    """Clear the locals of the frames `e` and the exceptions chained to it hold: a failed
    broadcast's frames hold the weight-update group, which must go (see `reset_group`)."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        traceback.clear_frames(x.__traceback__)
        stack += [x.__context__, x.__cause__]


def weight_specs(model: torch.nn.Module, dtype: torch.dtype) -> list[WeightSpec]:
    """What the engines receive: every parameter, model order, in the engines' dtype."""
    return [WeightSpec(name, dtype, tuple(p.shape)) for name, p in model.named_parameters()]


def gather_along(state: Any) -> None:
    """A rank other than 0, once per sync attempt: the gathers rank 0 makes (collectives), in
    the same order (the adapters alone under LoRA)."""
    if state.exp.model.lora.enabled:
        for _ in adapter_tensors(state.model):
            pass
        return
    names = [s.name for s in weight_specs(state.model, state.compute_dtype)]
    for _ in gathered(state.model, names):
        pass


def gathered(model: torch.nn.Module, names: list[str]) -> Iterator[torch.Tensor]:
    """Each named parameter whole, one at a time (all-gathered across ranks under FSDP)."""
    params = dict(model.named_parameters())
    for name in names:
        yield full_tensor(params[name])


class WeightSender:
    """Rank 0's connections for syncs: the synchronizer and the engines' weight-update group."""

    def __init__(self, transport: Transport, config: dict[str, Any], sync: Any,
                 device: torch.device, keys: EngineKeys = EngineKeys()):
        if not config.get("engines"):
            raise ValueError("trainer spec: `synchronizer` is set but `engines` (URLs) is not")
        self.sync = sync  # SyncConfig
        self.rewind = False  # the next republish goes back to an older version (SyncRequest)
        # SyncRequest and SyncDone may be sent again (a synchronizer restarted mid-sync never
        # saw them; one that did answers a repeat as the first): ask every 10 s, within the
        # sync's time limit
        per_try = min(sync.timeout_s, 10.0)
        self.synchronizer = RpcClient(transport, config["synchronizer"], timeout_s=per_try,
                                      retries=max(0, math.ceil(sync.timeout_s / per_try) - 1),
                                      name="synchronizer")
        self.auth = {"api_key": keys.api, "admin_key": keys.admin}  # it changes the weights
        self.engines = EngineClient(config["engines"], tp_sizes=config.get("engine_tp_sizes"),
                                    control_timeout_s=sync.timeout_s, **self.auth)
        # The engines in the current weight-update group: those serving when it was built. An
        # engine that is down then (the launcher restarts it) is left out, so a sync does not
        # wait for it; back, it answers with an older version and is sent the weights again.
        self.members: EngineClient | None = None
        self.address = config.get("weight_sync_address", "127.0.0.1")
        self.backend = sync.backend if sync.backend != "auto" else (
            "nccl" if device.type == "cuda" else "gloo")
        self.device = device if self.backend == "nccl" else torch.device("cpu")
        self.model_device = device
        self.group = None
        self.sender: BucketSender | None = None
        # Overlapped syncs (sync.overlap): rank 0's snapshot, the background sync sending it,
        # and the timings of the last one finished, for the next metrics row.
        self.snapshot: Snapshot | None = None
        self.background: asyncio.Task | None = None
        self.finished: dict[str, Any] = {}
        self.stream: Any = None  # CUDA: the side stream snapshots are copied and sent on
        self.copied: Any = None  # CUDA: the event recorded after the last snapshot's copies
        self.hooked: Any = None  # the optimizer whose steps wait for `copied`
        # sync.transport: "handles" sends by handle on this host (`_send_handles`), no group
        self.engine_kind = (config.get("experiment") or {}).get("engine", {}).get("kind",
                                                                                  "builtin")
        self.transport = handles.choose_transport(sync.transport, config["engines"],
                                                  self.address, self.engine_kind, device)
        self.packed: handles.Packed | None = None  # the handles' flat buffer, kept
        # LoRA: where rank 0 writes each version's adapter for the engines to load
        self.lora_dir = config.get("lora_dir")

    async def open(self) -> None:
        await self.engines.__aenter__()

    async def close(self) -> None:
        if self.background is not None and not self.background.done():
            self.background.cancel()  # the trainer is failing: the sync reports itself failed
        if self.background is not None:
            with contextlib.suppress(BaseException):
                await self.background
            self.background = None
        if self.members is not None:
            await self.members.close()
        await self.engines.close()
        self.synchronizer.close()
        if self.packed is not None:  # the shared-memory segment is unlinked
            self.packed.close()

    async def choose_members(self) -> None:
        """The engines the next group is built with: those that answer /health now."""
        live = [s for s in self.engines.servers if await self.engines.health(s.url)]
        if not live:
            raise EngineError("no engine answers /health: none to send the weights to")
        if self.members is not None:
            await self.members.close()
        self.members = EngineClient([s.url for s in live], tp_sizes=[s.tp_size for s in live],
                                    control_timeout_s=self.sync.timeout_s, **self.auth)
        await self.members.__aenter__()
        if len(live) < len(self.engines.servers):
            log.warning("weight_group_without", engines=[s.url for s in self.engines.servers
                                                         if s not in live])

    async def join_weight_group(self) -> None:
        """Fire /init_weights_update_group, join as rank 0, then collect the replies."""
        if self.members is None:
            await self.choose_members()
        members = self.members
        assert members is not None
        try:  # a group left by a previous trainer process (restart) would refuse a new one
            await asyncio.wait_for(members.destroy_weights_update_group(GROUP),
                                   DESTROY_TIMEOUT_S)
        except (EngineError, asyncio.TimeoutError):
            pass
        port = free_port(self.address)
        joining = members.start_init_weights_update_group(self.address, port, GROUP,
                                                          backend=self.backend)
        rendezvous = asyncio.ensure_future(asyncio.to_thread(
            init_weight_update_group, self.address, port, 0,
            members.weight_group_world_size, GROUP, self.backend, self.sync.timeout_s))
        await asyncio.wait((joining, rendezvous), return_when=asyncio.FIRST_EXCEPTION)
        if joining.done() and joining.exception() is not None and not rendezvous.done():
            # An engine refused to join: the rendezvous would wait for it until sync.timeout_s.
            # Leave it to time out on its own (its port is used by nobody else) and fail now.
            rendezvous.add_done_callback(lambda f: f.cancelled() or f.exception())
            await joining  # raises the engine's refusal
        try:
            self.group = await rendezvous
        finally:
            await joining

    async def engines_behind(self, version: int) -> list[str]:
        """The engines that serve weights other than `version`: each that answers
        /get_server_info with another weight_version (a restarted engine has the initial
        weights, version 0). One that does not answer is not serving and is left out: when it
        is back, it answers behind."""
        infos = await self.engines.server_info_each(timeout_s=5.0)
        return [f"{s.url} at version {info.get('weight_version')}"
                for s, info in zip(self.engines.servers, infos)
                if info is not None and serves_other_version(info, version)]

    async def wait_serving(self) -> None:
        """Until at least one engine answers /health (within sync.timeout_s): the next attempt
        goes to those that serve; one still restarting is sent the weights when it is back."""
        deadline = time.monotonic() + self.sync.timeout_s
        while not any([await self.engines.health(s.url) for s in self.engines.servers]):
            if time.monotonic() > deadline:
                raise EngineError(f"no engine answers /health after {self.sync.timeout_s:g}s")
            await asyncio.sleep(0.5)

    async def engine_restarted(self, old: int, new: int) -> bool:
        """After a failed attempt: an engine is down, or serves neither `old` nor `new` (it came
        back with the initial weights), so the failure was the engine's death, not a fault of
        the weights or the trainer."""
        infos = await self.engines.server_info_each(timeout_s=5.0)
        return any(info is None or serves_other_version(info, old, new) for info in infos)

    async def verify(self, version: int) -> None:
        """After a broadcast: every engine that serves holds `version`, else EngineError."""
        behind = await self.engines_behind(version)
        if behind:
            raise EngineError(f"after the broadcast of version {version}: "
                              f"{'; '.join(behind)} (restarted during the sync?)")

    def _start_update(self, body: dict[str, Any]) -> asyncio.Task:
        assert self.members is not None
        return self.members.start_update_weights_from_distributed(
            body["names"], body["dtypes"], body["shapes"], group_name=GROUP,
            weight_version=body["weight_version"], flush_cache=body["flush_cache"],
            load_format=body.get("load_format"))

    def reset_group(self) -> None:
        """Forget the weight-update group (an engine was restarted): the next broadcast builds
        it anew with every engine, after destroying what the engines still hold."""
        if self.group is not None:
            try:
                torch.distributed.destroy_process_group(self.group)
            except Exception:  # a member is gone; the group is being replaced anyway
                pass
            self.group = None
            self.sender = None
            # The last reference gone, gloo closes its connections: an engine still waiting
            # for a tensor of a broadcast that failed (another member died) fails at once,
            # instead of holding its scheduler until the group's timeout (sync.timeout_s).
            gc.collect()

    async def broadcast(self, model: torch.nn.Module, dtype: torch.dtype, version: int) -> int:
        """All buckets to every engine; returns the bytes sent.

        Every parameter is gathered, in model order, whatever fails: the other trainer ranks
        gather in lock-step (`full_tensor` is a collective), so after a failure rank 0 goes on
        gathering without sending, then raises. Flattened buckets are pipelined: bucket i+1 is
        packed while bucket i is on the wire; its announcement waits for the replies of bucket
        i (the engines take the buckets in announcement order)."""
        specs = weight_specs(model, dtype)
        tensors = gathered(model, [s.name for s in specs])
        try:
            return await self._send(specs, version, tensors=tensors)
        finally:
            # the rest of the gather loop (nothing left after a success)
            await asyncio.to_thread(lambda: [None for _ in tensors])

    async def broadcast_snapshot(self, snapshot: Snapshot, version: int) -> int:
        """As `broadcast`, from `snapshot` (rank 0 alone: nothing is gathered), on the side
        stream on a GPU once the snapshot's copies are done."""
        if self.copied is not None:  # the GPU's copies into the snapshot are finished
            await asyncio.to_thread(self.copied.synchronize)
        return await self._send(snapshot.specs, version, snapshot=snapshot)

    async def _send(self, specs: list[WeightSpec], version: int, *,
                    tensors: Iterator[torch.Tensor] | None = None,
                    snapshot: Snapshot | None = None) -> int:
        in_place = self.sync.pause_mode == "in_place"
        try:
            if self.group is None:  # the group is built anew with the engines serving now
                await self.choose_members()
            if in_place:  # the engines keep their requests (and KV) while the weights land
                assert self.members is not None
                await self.members.pause("in_place")
            async with self._update_session():
                if self.transport == "handles":
                    return await self._send_handles(specs, version, tensors, snapshot)
                return await self._broadcast(specs, tensors, version, snapshot)
        finally:
            if in_place:
                await self.resume_engines()

    @contextlib.asynccontextmanager
    async def _update_session(self) -> AsyncIterator[None]:
        """SGLang 0.5.23 loads weights (from a broadcast or from tensors) only between
        /begin_weight_update and /end_weight_update (its weight_updater refuses them
        otherwise). Sent to every engine kind: the built-in engine answers the session as SGLang
        does and counts updates outside one."""
        assert self.members is not None
        with contextlib.suppress(EngineError):  # one a failed trainer left open
            await self.members.weight_update_session(begin=False)
        await self.members.weight_update_session(begin=True)
        try:
            yield
        finally:
            await self.members.weight_update_session(begin=False)

    async def _send_handles(self, specs: list[WeightSpec], version: int,
                            tensors: Iterator[torch.Tensor] | None,
                            snapshot: Snapshot | None) -> int:
        """sync.transport = "handles": every tensor packed into the kept flat buffer (shared
        memory, or one CUDA buffer shared by IPC), then one /update_weights_from_tensor per
        engine carrying its handles; the engines copy from it and answer, then the buffer may
        change again. Same attempts, verify and SyncDone as a broadcast; no group."""
        assert self.members is not None
        members = self.members
        packed = self.packed = self.packed or handles.Packed(self.model_device)
        entries, size = handles.layout(specs)

        def fill() -> None:
            packed.ensure(size)
            src = tensors if snapshot is None else (snapshot.tensor(i)
                                                    for i in range(len(specs)))
            packed.fill(entries, src)

        await asyncio.to_thread(fill)
        assert packed.flat is not None
        if packed.device.type == "cuda":
            cuda = handles.cuda_handle(packed.flat)
            named = [(e.name, handles.view_of(packed.flat, e)) for e in entries]
        flush = self.sync.pause_mode != "in_place"

        def body_for(server: Any) -> dict[str, Any]:
            if self.engine_kind == "sglang":  # SGLang's own pickled form (it reads it)
                return handles.tensor_body(handles.sglang_payload(named, server.tp_size),
                                           None, str(version), flush)
            table = (handles.encode_handles(entries, cuda=cuda) if packed.device.type == "cuda"
                     else handles.encode_handles(entries, segment=packed.name,
                                                 segment_size=size))
            return handles.tensor_body([table], handles.LOAD_FORMAT, str(version), flush)

        await members.update_weights_from_tensor(body_for)
        return sum(e.nbytes for e in entries)

    async def send_adapter(self, model: torch.nn.Module, dtype: torch.dtype, version: int,
                           lora: Any, base_path: str) -> int:
        """LoRA: the adapters gathered (with the other ranks, whatever fails), in the engines'
        `dtype`, written to `<lora_dir>/v<version>`, and loaded by every engine under `policy`
        at `version` (module docstring); returns the bytes of the adapter's tensors."""
        tensors = adapter_tensors(model, dtype)
        try:
            named = await asyncio.to_thread(dict, tensors)
        finally:
            await asyncio.to_thread(lambda: [None for _ in tensors])
        if not self.lora_dir:  # after the gather: the other ranks took part in it
            raise ValueError("trainer settings: model.lora.rank > 0 but `lora_dir` (where the "
                             "adapters go for the engines) is not set")
        root = Path(self.lora_dir).absolute()
        path = root / f"v{version}"
        sent = await asyncio.to_thread(write_adapter, path, named,
                                       config_dict(lora, base_path))
        if self.members is None:
            await self.choose_members()
        members = self.members
        assert members is not None
        await members.unload_lora_adapter(ADAPTER_NAME, missing_ok=True)
        await members.load_lora_adapter(ADAPTER_NAME, str(path))
        await members.update_weight_version(str(version))
        await asyncio.to_thread(_prune_adapters, root, version)
        return sent

    # -- overlapped syncs (rank 0) ------------------------------------------------------------

    def take_snapshot(self, model: torch.nn.Module, dtype: torch.dtype,
                      optimizer: torch.optim.Optimizer | None = None) -> Snapshot:
        """Every parameter gathered (in lock-step with the other ranks, whatever fails) and
        copied, cast to `dtype`, into the snapshot (in a thread: it blocks). On a GPU the
        copies are queued on the side stream and this returns before they are done: the
        background broadcast and `optimizer`'s next step wait for them."""
        specs = weight_specs(model, dtype)
        tensors = gathered(model, [s.name for s in specs])
        try:
            snapshot = self._snapshot_for(specs)
            if self.model_device.type != "cuda":
                snapshot.fill(tensors)  # a plain copy
                return snapshot
            self._copy_on_side_stream(snapshot, tensors, optimizer)
            return snapshot
        finally:
            for _ in tensors:  # the rest of the gather (nothing left after a success)
                pass

    def _snapshot_for(self, specs: list[WeightSpec]) -> Snapshot:
        """The snapshot buffer for `specs`: the one of the last sync (placed once), else a new
        one: on the GPU that sends (nccl) when it fits there beside SNAPSHOT_HEADROOM of its
        memory, else in host memory, pinned when the model is on a GPU."""
        if self.snapshot is not None and self.snapshot.specs == specs:
            return self.snapshot
        self.snapshot = None  # the old buffer goes before the new one comes
        nbytes = sum(s.nbytes for s in specs)
        device, pin = torch.device("cpu"), self.model_device.type == "cuda"
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            if nbytes <= free - SNAPSHOT_HEADROOM * total:
                device, pin = self.device, False
        self.snapshot = Snapshot(specs, device, pin_memory=pin)
        log.info("sync_snapshot_buffer", device=str(device), pinned=pin,
                 bytes=self.snapshot.nbytes)
        return self.snapshot

    def _copy_on_side_stream(self, snapshot: Snapshot, tensors: Iterator[torch.Tensor],
                             optimizer: torch.optim.Optimizer | None) -> None:
        """CUDA: each gathered tensor copied on the side stream, after an event recorded on
        the compute stream once it is ready; the event `copied` closes the copies."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=self.model_device)
        if optimizer is not None and self.hooked is not optimizer:
            optimizer.register_step_pre_hook(self._before_update)
            self.hooked = optimizer
        compute, side = torch.cuda.current_stream(self.model_device), self.stream
        for i, t in enumerate(tensors):  # gathered on the compute stream
            ready = compute.record_event()  # the optimizer's update and the gather are queued
            side.wait_event(ready)
            with torch.cuda.stream(side):
                snapshot.put(i, t, non_blocking=True)
            if t.is_cuda:  # not reused by the compute stream before the side stream read it
                t.record_stream(side)
        self.copied = side.record_event()

    def _before_update(self, *_: Any) -> None:
        """The optimizer's pre-step hook: its update waits (on the GPU) for the snapshot's
        copies, which may read the parameters themselves."""
        if self.copied is not None:
            torch.cuda.current_stream(self.model_device).wait_event(self.copied)

    def start_background(self, snapshot: Snapshot, version: int, step: int, old: int,
                         ranks: int) -> None:
        """The sync of `version` from `snapshot`, in a task; `finish` waits for it."""
        assert self.background is None, "an overlapped sync is already in flight"

        async def run() -> dict[str, Any]:
            timings = await _attempts(self, version, step, old, ranks, republish=False,
                                      send=lambda: self.broadcast_snapshot(snapshot, version))
            log.info("sync_overlapped_done", **{k: (round(v, 4) if isinstance(v, float) else v)
                                                for k, v in timings.items()})
            return {"synced_version": version, **{k: v for k, v in timings.items()
                                                  if k not in ("published_version",
                                                               "sync_idle_s")},
                    "sync_background_s": timings["sync_idle_s"]}

        self.background = asyncio.create_task(run())

    def pending(self) -> bool:
        """An overlapped sync is in flight, or failed and not yet raised (`finish`): the
        engines may be behind on purpose; nothing is re-published meanwhile."""
        task = self.background
        return task is not None and (not task.done() or task.cancelled()
                                     or task.exception() is not None)

    async def finish(self) -> None:
        """Wait for the overlapped sync in flight (if any); raise its failure. Its timings
        are kept for the next metrics row (`take_finished`)."""
        task, self.background = self.background, None
        if task is not None:
            self.finished = await task

    def take_finished(self) -> dict[str, Any]:
        finished, self.finished = self.finished, {}
        return finished

    async def resume_engines(self) -> None:
        """/continue_generation on every engine after an in-place pause, whatever the broadcast
        did (never raises: an engine that died meanwhile comes back unpaused; one that does not
        answer is asked again once)."""
        for attempt in (1, 2):
            try:
                assert self.members is not None
                await self.members.resume()
                return
            except Exception as e:  # noqa: BLE001 - logged; SyncDone must still be sent
                log.warning("engines_resume_failed", attempt=attempt, error=str(e)[:500])

    async def _broadcast(self, specs: list[WeightSpec], tensors: Iterator[torch.Tensor] | None,
                         version: int, snapshot: Snapshot | None = None) -> int:
        """The buckets, from the gathered `tensors` or from `snapshot` (exactly one given)."""
        if self.group is None:
            await self.join_weight_group()
        bucket_bytes = int(self.sync.bucket_mb * 2**20)
        buckets = plan_buckets(specs, bucket_bytes)
        load_format = self.sync.load_format
        # Two bucket buffers, filled in turn, kept from sync to sync (their pages stay mapped;
        # on a GPU the caching allocator would keep them reserved anyway): rank 0 holds at most
        # two buckets' worth of memory for syncs.
        capacity = max((sum(s.nbytes for s in b) for b in buckets if len(b) > 1), default=0)
        sender = self.sender
        if (sender is None or sender.group is not self.group or sender.capacity != capacity
                or sender.load_format != load_format):
            self.sender = None  # the old buffers go before the new ones come
            sender = self.sender = BucketSender(self.group, load_format, self.device, capacity)
        # From a snapshot on a GPU, packing and broadcasts run on the side stream: the NCCL
        # stream then waits for that one only, not for the training kernels queued meanwhile.
        stream = self.stream if snapshot is not None else None
        firsts = [0]
        for bucket in buckets:
            firsts.append(firsts[-1] + len(bucket))

        def call(fn: Any, *args: Any) -> Any:
            if stream is None:
                return asyncio.to_thread(fn, *args)
            return asyncio.to_thread(_on_stream, stream, fn, *args)

        def pack(i: int) -> Any:
            if snapshot is not None:
                return call(sender.pack_from, snapshot, firsts[i], buckets[i])
            assert tensors is not None
            return call(sender.pack, buckets[i], islice(tensors, len(buckets[i])))

        sent = 0
        packing = asyncio.create_task(pack(0))
        try:
            for i, bucket in enumerate(buckets):
                last = i == len(buckets) - 1
                # No cache flush under an in-place pause: SGLang's flush asserts an idle engine
                # and its scheduler dies with requests kept (their KV stays, by design).
                flush = last and self.sync.pause_mode != "in_place"
                body = update_body(bucket, weight_version=str(version if last else version - 1),
                                   load_format=load_format, flush_cache=flush, group_name=GROUP)
                packed = await packing
                replies = self._start_update(body)
                try:
                    sent += await call(sender.start, packed)
                    del packed
                    if not last:  # packs while the engines receive
                        packing = asyncio.create_task(pack(i + 1))
                    await call(sender.wait)
                finally:
                    await replies
        finally:
            with contextlib.suppress(BaseException):
                await packing  # it consumes the gather: finished before anything else gathers
        return sent


def _prune_adapters(root: Path, version: int) -> None:
    """The adapter directories of versions before `version - 1` (and unfinished writes) go."""
    for d in root.iterdir():
        if d.name.startswith(".tmp-") or (
                d.name[:1] == "v" and d.name[1:].isdigit() and int(d.name[1:]) < version - 1):
            shutil.rmtree(d, ignore_errors=True)


def _on_stream(stream: Any, fn: Any, *args: Any) -> Any:
    """`fn(*args)` with `stream` as this thread's current CUDA stream."""
    with torch.cuda.stream(stream):
        return fn(*args)


async def _attempts(sender: WeightSender, version: int, step: int, old: int, ranks: int, *,
                    republish: bool, send: Any, before_each: Any = None) -> dict[str, Any]:
    """Rank 0: one sync, attempt after attempt (SyncRequest -> `before_each()` -> `send()` ->
    verify -> SyncDone) until one works or the attempts are used up; returns its timings.
    `old`: the version the engines held before (an engine at neither is one that restarted)."""
    started = time.monotonic()
    failures = 0  # failed attempts that no engine restart explains
    for attempt in range(1, SYNC_ATTEMPTS_WITH_RESTARTS + 1):
        go: SyncGo = await sender.synchronizer.request(
            SyncRequest(version=version, step=step, republish=republish,
                        rewind=republish and sender.rewind))
        if before_each is not None:
            await before_each()
        paused = time.monotonic()
        if go.rebuild_group or attempt > 1:
            sender.reset_group()
        try:
            # Whatever fails, this returns (or raises) only after the whole gather loop,
            # so the other ranks are back waiting for the next order.
            sent = await send()
            broadcast = time.monotonic()
            # ok only if every serving engine holds the version (one that restarted
            # during the sync has the initial weights): checked here, and again by the
            # synchronizer before it publishes the version (it refuses SyncDone if not)
            await sender.verify(version)
            await sender.synchronizer.request(SyncDone(
                version=version, broadcast_s=broadcast - paused, bytes=sent))
            break
        except BaseException as e:
            # Drop the group now (the failed broadcast's frames hold it too): the engines
            # still in it stop waiting for the rest of this broadcast.
            forget_frames(e)
            sender.reset_group()
            # An engine died or refused mid-sync (the launcher restarts a dead one): keep
            # rollout paused, build the group anew once every engine answers, and send the
            # whole weights again (blocking: on every rank, they gather again; overlapped: the
            # same snapshot). After the last attempt rollout resumes at the old version and
            # this trainer stops. An engine restart is what an attempt is retried for: it does
            # not use up the attempts.
            restarted = (isinstance(e, Exception)
                         and await sender.engine_restarted(old, version))
            failures += not restarted
            retrying = (failures < SYNC_ATTEMPTS and attempt < SYNC_ATTEMPTS_WITH_RESTARTS
                        and isinstance(e, Exception))
            log.warning("sync_broadcast_failed", version=version, attempt=attempt,
                        retrying=retrying, engine_restarted=restarted, ranks=ranks,
                        error=str(e)[:500])
            await sender.synchronizer.request(SyncDone(version=version, ok=False,
                                                          error=str(e)[:2000],
                                                          retrying=retrying))
            if not retrying:
                raise
            await sender.wait_serving()
    done = time.monotonic()
    return {"published_version": version, "sync_pause_s": go.pause_s,
            "sync_wait_s": paused - started, "sync_broadcast_s": broadcast - paused,
            "sync_resume_s": done - broadcast, "sync_idle_s": done - started, "sync_bytes": sent,
            "sync_attempts": attempt}


async def sync_weights(state: Any, sender: WeightSender | None, *,
                       republish: bool = False) -> dict[str, Any]:
    """Publish version + 1 (every rank calls; rank 0 talks, the others gather with it).
    `state` is the trainer's TrainState; returns rank 0's timings. `republish`: send the
    current version again (a resumed trainer: the engines started from the initial weights),
    always blocking. With `sync.overlap` a sync returns once the snapshot is taken
    (`start_overlapped`)."""
    if state.exp.sync.overlap and not republish:
        return await start_overlapped(state, sender)
    ranks = state.ranks
    version = state.version if republish else state.version + 1
    if not ranks.is_main:  # gather with rank 0 once per broadcast attempt, until it says done
        while True:
            order = await asyncio.to_thread(ranks.share)
            if order["op"] == "skip":
                return {}
            if order["op"] == "done":
                state.version = version
                return {}
            if order["op"] != "broadcast":
                raise RuntimeError(f"rank 0 could not sync version {version}")
            await asyncio.to_thread(gather_along, state)
    if sender is None:
        await asyncio.to_thread(ranks.share, {"op": "skip"})
        return {}
    told = False  # the other ranks have their last order ("done" or "abort")
    try:
        if sender.pending():  # the trainer checks first: never two syncs at once
            raise RuntimeError(f"version {version}: an overlapped sync is still in flight")

        async def order_gather() -> None:
            await asyncio.to_thread(ranks.share, {"op": "broadcast"})

        lora = state.exp.model.lora

        def send() -> Any:
            if lora.enabled:
                return sender.send_adapter(state.model, state.compute_dtype, version, lora,
                                           state.exp.model.path)
            return sender.broadcast(state.model, state.compute_dtype, version)

        timings = await _attempts(
            sender, version, state.step, state.version, ranks.world, republish=republish,
            before_each=order_gather, send=send)
        told = True
        await asyncio.to_thread(ranks.share, {"op": "done"})
    except BaseException:
        if not told:
            told = True
            await asyncio.to_thread(ranks.share, {"op": "abort"})
        raise
    state.version = version
    return timings


async def start_overlapped(state: Any, sender: WeightSender | None) -> dict[str, Any]:
    """An overlapped sync of version + 1 (every rank calls): wait for the one in flight, take
    the snapshot (every rank gathers, rank 0 copies), start its background sync on rank 0, and
    return. Returns rank 0's timings: `sync_idle_s` (the trainer held here: `sync_finish_s`
    waiting for the previous sync + `sync_snapshot_s`) and those of the previous background
    sync (`synced_version`, `sync_broadcast_s`, ...)."""
    ranks = state.ranks
    version = state.version + 1
    names = [s.name for s in weight_specs(state.model, state.compute_dtype)]
    if not ranks.is_main:
        order = await asyncio.to_thread(ranks.share)
        if order["op"] == "skip":
            return {}
        if order["op"] != "snapshot":
            raise RuntimeError(f"rank 0 could not sync version {state.version}")
        await asyncio.to_thread(lambda: [None for _ in gathered(state.model, names)])
        if (await asyncio.to_thread(ranks.share))["op"] != "done":
            raise RuntimeError(f"rank 0 could not take the snapshot of version {version}")
        state.version = version
        return {}
    if sender is None:
        await asyncio.to_thread(ranks.share, {"op": "skip"})
        return {}
    started = time.monotonic()
    try:
        await sender.finish()  # at most one in flight; its failure is raised here
    except BaseException:
        await asyncio.to_thread(ranks.share, {"op": "abort"})
        raise
    finished = time.monotonic()
    await asyncio.to_thread(ranks.share, {"op": "snapshot"})
    try:
        snapshot = await asyncio.to_thread(sender.take_snapshot, state.model,
                                           state.compute_dtype, state.optimizer)
    except BaseException:
        await asyncio.to_thread(ranks.share, {"op": "abort"})
        raise
    await asyncio.to_thread(ranks.share, {"op": "done"})
    taken = time.monotonic()
    sender.start_background(snapshot, version, state.step, state.version, ranks.world)
    state.version = version  # the trainer's parameters are the snapshot's version
    return {"published_version": version, "sync_idle_s": taken - started,
            "sync_finish_s": finished - started, "sync_snapshot_s": taken - finished,
            **sender.take_finished()}


async def finish_sync(state: Any, sender: WeightSender | None) -> dict[str, Any]:
    """Every rank, before a checkpoint and at the end of training: wait for the overlapped
    sync in flight, if any (nothing to do without `sync.overlap`). Its failure is raised on
    every rank, as a blocking sync raises it."""
    if not state.exp.sync.overlap:
        return {}
    ranks = state.ranks
    if not ranks.is_main:
        if (await asyncio.to_thread(ranks.share))["op"] != "done":
            raise RuntimeError(f"rank 0 could not sync version {state.version}")
        return {}
    try:
        if sender is not None:
            await sender.finish()
    except BaseException:
        await asyncio.to_thread(ranks.share, {"op": "abort"})
        raise
    await asyncio.to_thread(ranks.share, {"op": "done"})
    return sender.finished if sender is not None else {}
