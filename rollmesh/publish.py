"""The trainer's side of a weight sync: the synchronizer handshake and the broadcast to engines.

`sync_weights` runs on every trainer rank at a sync point. Rank 0 asks the synchronizer
(SyncRequest, answered SyncGo once rollout is paused), tells the other ranks to go, broadcasts,
and reports (SyncDone); the other ranks take part in gathering each parameter from the FSDP
shards (`full_tensor`, a collective) in the same order. Flow and failure handling of the whole
sync: `rollmesh.synchronizer`.

The broadcast follows docs/sglang-contract.md: the first sync fires `/init_weights_update_group`
at every engine, joins the group as rank 0, then collects the replies; every bucket fires
`/update_weights_from_distributed` (its names, dtypes, shapes), broadcasts the bucket's tensors
in that order (`rollmesh.weight_buckets`), then collects. Engines report the new version only
with the last bucket. Memory on rank 0: one gathered tensor, plus one bucket buffer when buckets
travel flattened.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import torch

from rollmesh.engine.client import EngineClient, EngineError
from rollmesh.protocol import SyncDone, SyncGo, SyncRequest
from rollmesh.ranks import full_tensor
from rollmesh.transport import RpcClient, Transport, free_port
from rollmesh.weight_buckets import WeightSpec, plan_buckets, send_bucket, update_body
from rollmesh.weights import init_weight_update_group

GROUP = "weight_update_group"
SYNC_ATTEMPTS = 3  # broadcasts tried for one version before the trainer gives up


def weight_specs(model: torch.nn.Module, dtype: torch.dtype) -> list[WeightSpec]:
    """What the engines receive: every parameter, model order, in the engines' dtype."""
    return [WeightSpec(name, dtype, tuple(p.shape)) for name, p in model.named_parameters()]


def gathered(model: torch.nn.Module, names: list[str]) -> Iterator[torch.Tensor]:
    """Each named parameter whole, one at a time (all-gathered across ranks under FSDP)."""
    params = dict(model.named_parameters())
    for name in names:
        yield full_tensor(params[name])


class Publisher:
    """Rank 0's connections for syncs: the synchronizer and the engines' weight-update group."""

    def __init__(self, transport: Transport, config: dict[str, Any], sync: Any,
                 device: torch.device):
        if not config.get("engines"):
            raise ValueError("trainer spec: `synchronizer` is set but `engines` (URLs) is not")
        self.sync = sync  # SyncConfig
        self.synchronizer = RpcClient(transport, config["synchronizer"], timeout_s=sync.timeout_s,
                                      retries=0, name="synchronizer")
        self.engines = EngineClient(config["engines"], tp_sizes=config.get("engine_tp_sizes"),
                                    control_timeout_s=sync.timeout_s)
        self.address = config.get("weight_sync_address", "127.0.0.1")
        self.backend = sync.backend if sync.backend != "auto" else (
            "nccl" if device.type == "cuda" else "gloo")
        self.device = device if self.backend == "nccl" else torch.device("cpu")
        self.group = None

    async def open(self) -> None:
        await self.engines.__aenter__()

    async def close(self) -> None:
        await self.engines.close()
        self.synchronizer.close()

    async def join_weight_group(self) -> None:
        """Fire /init_weights_update_group, join as rank 0, then collect the replies."""
        try:  # a group left by a previous trainer process (restart) would refuse a new one
            await self.engines.destroy_weights_update_group(GROUP)
        except EngineError:
            pass
        port = free_port(self.address)
        joining = self.engines.start_init_weights_update_group(self.address, port, GROUP,
                                                               backend=self.backend)
        try:
            self.group = await asyncio.to_thread(
                init_weight_update_group, self.address, port, 0,
                self.engines.weight_group_world_size, GROUP, self.backend, self.sync.timeout_s)
        finally:
            await joining

    def _start_update(self, body: dict[str, Any]) -> asyncio.Task:
        return self.engines.start_update_weights_from_distributed(
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

    async def broadcast(self, model: torch.nn.Module, dtype: torch.dtype, version: int) -> int:
        """All buckets to every engine; returns the bytes sent."""
        if self.group is None:
            await self.join_weight_group()
        bucket_bytes = int(self.sync.bucket_mb * 2**20)
        buckets = plan_buckets(weight_specs(model, dtype), bucket_bytes)
        load_format = self.sync.load_format
        # One bucket buffer for the whole sync (freed after it): built in place bucket by bucket.
        buffer = (torch.empty(min(bucket_bytes, max(sum(s.nbytes for s in b) for b in buckets)),
                              dtype=torch.uint8, device=self.device)
                  if load_format == "flattened_bucket" else None)
        sent = 0
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            body = update_body(bucket, weight_version=str(version if last else version - 1),
                               load_format=load_format, flush_cache=last, group_name=GROUP)
            replies = self._start_update(body)
            try:
                sent += await asyncio.to_thread(send_bucket, self.group, bucket,
                                                gathered(model, body["names"]), load_format,
                                                self.device, buffer)
            finally:
                await replies
        return sent


async def sync_weights(state: Any, publisher: Publisher | None) -> dict[str, Any]:
    """Publish version + 1 (every rank calls; rank 0 talks, the others gather with it).
    `state` is the trainer's TrainState; returns rank 0's timings."""
    ranks, version = state.ranks, state.version + 1
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
            names = [s.name for s in weight_specs(state.model, state.compute_dtype)]
            await asyncio.to_thread(lambda: [None for _ in gathered(state.model, names)])
    if publisher is None:
        await asyncio.to_thread(ranks.share, {"op": "skip"})
        return {}
    started = time.monotonic()
    for attempt in range(1, SYNC_ATTEMPTS + 1):
        try:
            go: SyncGo = await publisher.synchronizer.request(
                SyncRequest(version=version, step=state.step))
        except BaseException:
            await asyncio.to_thread(ranks.share, {"op": "abort"})
            raise
        await asyncio.to_thread(ranks.share, {"op": "broadcast"})
        paused = time.monotonic()
        if go.rebuild_group or attempt > 1:
            publisher.reset_group()
        try:
            sent = await publisher.broadcast(state.model, state.compute_dtype, version)
            break
        except BaseException as e:
            # An engine died mid-sync (the launcher restarts it): keep rollout paused, build
            # the group anew once every engine answers, and send the whole weights again.
            # After the last attempt rollout resumes at the old version and this trainer stops.
            # (With several ranks a failed broadcast leaves the others inside the parameter
            # gather, so only a single-rank trainer retries for now.)
            retrying = (attempt < SYNC_ATTEMPTS and isinstance(e, Exception)
                        and ranks.world == 1)
            await publisher.synchronizer.request(SyncDone(version=version, ok=False,
                                                          error=str(e)[:2000],
                                                          retrying=retrying))
            if not retrying:
                await asyncio.to_thread(ranks.share, {"op": "abort"})
                raise
            await publisher.engines.wait_healthy(publisher.sync.timeout_s)
    broadcast = time.monotonic()
    await publisher.synchronizer.request(SyncDone(version=version, broadcast_s=broadcast - paused,
                                                  bytes=sent))
    await asyncio.to_thread(ranks.share, {"op": "done"})
    done = time.monotonic()
    state.version = version
    return {"published_version": version, "sync_pause_s": go.pause_s,
            "sync_wait_s": paused - started, "sync_broadcast_s": broadcast - paused,
            "sync_resume_s": done - broadcast, "sync_idle_s": done - started, "sync_bytes": sent}
