"""The MessageQueue's two ways, for the tests that talk to it: groups go in through PutGroups
(the record the rollouter's `rollmesh.mq.client.put_ready` sends) and batches come out through
the trainer's stream (`rollmesh.mq.client.BatchFeed`: OpenBatchStream, BatchCredit, Batch).

`put` and `put_group` send one PutGroups and return what the queue said; `Trainer` takes the
batch for one step at a time as the trainer role does, with credit through that step only (so
nothing is taken ahead of the test's asking)."""

from __future__ import annotations

import asyncio
from typing import Any

from rollmesh.mq.client import BatchFeed
from rollmesh.wire.messages import Batch, Group, PutGroups, PutGroupsReply
from rollmesh.wire.protocol import ProtocolError
from rollmesh.wire.transport import RpcClient


async def put(client: RpcClient, groups: list[Group], **request: Any) -> PutGroupsReply:
    """One PutGroups of `groups`: the reply says how many of the first ones the queue holds
    (the rest: it is full, send them again). `request`: RpcClient.request's options."""
    reply = await client.request(PutGroups(groups=groups), **request)
    if not isinstance(reply, PutGroupsReply):
        raise ProtocolError(f"PutGroups answered with {type(reply).__name__}")
    return reply


async def put_group(client: RpcClient, group: Group, **request: Any) -> bool:
    """One group in one PutGroups: True if the queue holds it (False: full, send it again)."""
    return (await put(client, [group], **request)).accepted == 1


class Trainer:
    """The trainer's end of the hand-out over `client`: one `BatchFeed` (one stream) for as
    long as the batch size stays the same; a batch of another size opens a new one."""

    def __init__(self, client: RpcClient):
        self.client = client
        self.feed: BatchFeed | None = None

    async def take(self, step: int, committed: int = 0, *, groups: int, version: int = 0,
                   timeout_s: float = 10.0) -> Batch | None:
        """The batch of `groups` groups for `step` at `version`, saying that the latest
        checkpoint holds step `committed`; None if none came within `timeout_s`. As the
        trainer does, it asks again after a wait that came back empty (a broken stream, a
        queue that restarted) until the time is up."""
        if self.feed is None or self.feed.groups != groups:
            self.close()
            self.feed = BatchFeed(self.client, groups)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            left = deadline - loop.time()
            batch = await self.feed.get(step, version, step, committed, max(0.0, left))
            if batch is not None:
                return batch
            if deadline - loop.time() <= 0:
                return None
            await asyncio.sleep(0.05)  # a stream that broke at once: not a busy loop

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()
            self.feed = None
