"""End-to-end tests of in_place_sync (they start processes); the unit tests and the
helpers they share are in tests/unit/test_in_place_sync.py."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from rollmesh.agents.loops import SingleTurn
from rollmesh.core.trajectory import new_trajectory
from rollmesh.engine.client import EngineClient
from rollmesh.models.loading import build_tiny
from rollmesh.mq.store import MessageQueue
from rollmesh.training import batching
from tests.engine.engine_harness import REPO, Engine, chat_prompt
from tests.helpers.router import ROUTERS, maybe_router
from tests.unit.test_in_place_sync import broadcast, context, group_of, wait_decoding


@pytest.mark.slow
@pytest.mark.parametrize("router", ROUTERS)
def test_an_in_place_sync_keeps_the_requests_and_stamps_each_token(tmp_path, router):
    """A group of two long answers; mid-answer, an in-place sync as the trainer's publisher
    makes it (engines paused in place, a real broadcast of new weights as version 1, engines
    resumed). The answers finish (not aborted), their tokens carry 0 up to the sync and 1 after
    it, the trainer's batch staleness counts the oldest token, and the MessageQueue hands the
    group to a trainer at version 1 but drops it (stale) for one at version 2 (bound 1).
    Through SGLang's router too: generation goes through it, the pause and the update to the
    engine, and the per-token versions come back through it unchanged."""
    engine = Engine(tmp_path / "engine.log", "--weight-version", "0")
    _, tok = build_tiny("tiny")
    n = 250

    async def run() -> tuple[list, int]:
        with maybe_router(router, [engine.url], tmp_path / "router.log") as router_url:
            return await go(router_url)

    async def go(router_url) -> tuple[list, int]:
        async with EngineClient([engine.url], router_url=router_url) as client:
            ctx = context(client, tok)
            prompt = chat_prompt(tok, "Tell a long story across a weight sync")
            trajs = [new_trajectory(f"s{i}", "g", i, prompt, agent_loop="single_turn",
                                    metadata={"sampling": {"max_new_tokens": n,
                                                           "ignore_eos": True}})
                     for i in range(2)]
            loops = [asyncio.create_task(SingleTurn(ctx).run(t)) for t in trajs]
            await wait_decoding(engine, running=2)
            await client.pause("in_place")  # weight_sync/sender.py, right after SyncGo
            made_at_0 = (await asyncio.to_thread(engine.stats))["generated_tokens"]
            replies = await asyncio.to_thread(broadcast, engine.url, "tiny:seed=1", "1")
            assert replies["update"]["success"], replies
            assert not any(loop.done() for loop in loops)
            await client.resume()  # after the broadcast, before SyncDone
            await asyncio.wait_for(asyncio.gather(*loops), 120)
            return trajs, made_at_0

    try:
        trajs, made_at_0 = asyncio.run(run())
    finally:
        assert engine.stop() == 0, engine.log()

    made_at = []
    for t in trajs:
        assert t.finish_reason == "length" and t.status == "finished"  # not aborted
        generated = t.versions[t.prompt_len:]
        assert len(generated) == n
        k = int((generated == 0).sum())  # tokens made before the sync
        assert 0 < k < n and generated.tolist() == [0] * k + [1] * (n - k)
        assert (t.versions[: t.prompt_len] == -1).all()
        made_at.append(k)
    assert sum(made_at) == made_at_0  # exactly what the engine had made when it paused

    # What the trainer reports as batch staleness (trainer.py: batching.staleness)
    for t in trajs:
        t.reward = 1.0  # scored (the reward workers' part)
    data = batching.from_groups([group_of("g", trajs)])
    assert batching.staleness(data.versions, data.mask, 1).tolist() == [1, 1]
    assert batching.staleness(data.versions, data.mask, 2).tolist() == [2, 2]

    # The MessageQueue's bound by the oldest token (max_staleness 1): handed out at version 1,
    # dropped at 2.
    q = MessageQueue(capacity_groups=8, max_staleness=1, measure="oldest_token")
    assert q.put(group_of("g1", trajs))
    assert [g.group_id for g in q.take(1, version=1)] == ["g1"]
    assert q.staleness_hist == {1: 2}
    assert q.put(group_of("g2", trajs))
    assert q.take(1, version=2) is None
    assert q.dropped == {"stale": 2} and q.depth_samples == 0


@pytest.mark.slow
def test_a_launched_run_with_in_place_syncs_aborts_nothing(tmp_path):
    """`rollmesh launch` of the embedded default with `sync.pause_mode = "in_place"` and long
    answers (every row asks ignore_eos; an engine running at most 8 requests, so generation is
    the bottleneck and answers are running at every sync): the trainer's publisher pauses the
    engine in place at each sync, the requests running at that moment are kept and finished
    (none aborted until the run ends), every trained batch follows the staleness rule, and
    the accounting identity holds."""
    from tests.e2e.test_launcher import (
        assert_staleness_rule, check_accounting, finish, launch, metrics,
    )

    rows = [json.loads(line) for line in (REPO / "configs/data/letters_train.jsonl").open()]
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({**r, "sampling": {"ignore_eos": True}}) + "\n"
                            for r in rows))
    run_dir = tmp_path / "run"
    steps = 5
    proc = launch(run_dir, "--set", 'sync.pause_mode="in_place"', "--set",
                  f"trainer.total_steps={steps}", "--set", "rollout.max_new_tokens=160", "--set",
                  "engine.max_running_requests=8", "--set",
                  f"data.train_path={json.dumps(str(data))}", "--set", "rollout.eval_every=0")
    out = finish(proc, timeout_s=300)
    assert proc.returncode == 0, out[-3000:]
    summary = check_accounting(run_dir)
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert_staleness_rule(rows, summary)

    events = [json.loads(line) for line in (run_dir / "logs/engine-0.log").open()
              if line.startswith("{")]
    pauses = [e for e in events if e["event"] == "generation_paused"]
    assert len(pauses) == steps and {e["mode"] for e in pauses} == {"in_place"}
    # Syncs mid-answer are likely here but not certain on a loaded machine (every pause found
    # the engine idle in one run of the whole suite); tests/engine/test_engine_in_place.py
    # holds a request across an in-place sync for certain. None was cut (the requests still
    # running when the run ends are aborted then):
    assert not [e for e in events if e["event"] == "requests_aborted"
                and e["timestamp"] < pauses[-1]["timestamp"]]
    # no update asked the engine to flush its cache with requests kept (SGLang's scheduler
    # would die on that assert)
    assert not [e for e in events if e["event"] == "flush_cache_with_requests_kept"]
    # the rollouter answered each sync's Pause at once, trajectories still out with the
    # workers (the launcher's own Pause at the end, to collect the summary, is mode abort)
    paused = [json.loads(line) for line in (run_dir / "logs/rollouter-0.log").open()
              if '"event": "paused"' in line]
    in_place = [e for e in paused if e.get("mode") == "in_place"]
    assert len(in_place) >= steps and paused[:len(in_place)] == in_place, paused
    # (that some sync found trajectories out is likely, not certain: a loaded CI machine once
    # found the rollouter idle at every one; tests/e2e/test_rollout.py's in-place test pauses with
    # six requests running for certain)
    assert all(e["cancel_queue"] == 0 for e in in_place), in_place

    # What reached the MessageQueue (its log's puts): answers that ran across a sync carry the
    # old version on their first tokens and the new one after, never the other way round.
    from rollmesh.mq.store import decode_entry
    from rollmesh.runtime.durable_log import DurableLog

    journal, payloads = DurableLog.open(run_dir / "message_queue" / "queue.log")
    journal.close()
    spans = []
    for entry in map(decode_entry, payloads):
        if entry[0] == "put":
            for t in entry[2].trajectories:
                v = t.versions[t.prompt_len:][t.loss_mask[t.prompt_len:] > 0]
                assert (np.diff(v) >= 0).all(), v  # versions only grow along an answer
                spans.append(len(set(v.tolist())))
    assert spans, "nothing reached the MessageQueue"
    # (that some answer was made by two versions is likely, not certain: in one run of the
    # whole suite on CI every sync found the engine between answers; the test above holds two
    # answers across an in-place sync for certain and checks the stamps token by token)
