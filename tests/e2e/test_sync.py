"""End-to-end tests of sync (they start processes); the unit tests and the
helpers they share are in tests/unit/test_sync.py."""

from __future__ import annotations

import asyncio

import pytest

from rollmesh.models.loading import build_tiny
from rollmesh.wire.messages import StatsRequest, SyncRequest
from rollmesh.wire.transport import RemoteError, RpcClient, Transport
from tests.engine.engine_harness import chat_prompt, greedy_decode, teacher_forced_logprobs
from tests.helpers.rollout_stack import experiment, start_stack, stop_stack, write_dataset
from tests.unit.test_sync import ROWS, start_training
from tests.unit.test_trainer import read_metrics, wait_exit


# each rank count, each wire form and each sync mode once (all eight took ~300 s of the suite;
# both forms arrive whole in test_buckets_arrive_whole_in_either_wire_form, the overlapped
# sync's bit-exact weights also in tests/unit/test_sync_overlap.py)
@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "load_format", "overlap"), [
    (1, "tensor", False), (2, "flattened_bucket", True)])
def test_after_a_sync_the_engine_decodes_exactly_as_the_trainers_model(tmp_path, ranks,
                                                                       load_format, overlap):
    """Train, sync (pause -> broadcast in buckets -> version -> resume), twice; then the engine's
    greedy output equals the exported trainer model's, token for token. With two ranks the
    parameters are gathered from FSDP shards while rank 0 broadcasts; flattened, each bucket is
    one broadcast of its bytes, pipelined, and the second sync lands straight in the storage
    the first one left in the engine's model. Overlapped (`sync.overlap`), the ranks gather
    into rank 0's snapshot and train on while it is sent; the end of training waits for the
    last one."""
    from transformers import AutoModelForCausalLM

    exp = experiment(write_dataset(tmp_path / "d.jsonl", ROWS), "rollout.max_new_tokens=16",
                     f"trainer.ranks={ranks}", 'algorithm.loss="ppo"', "trainer.warmup_steps=0",
                     "trainer.total_steps=2", "trainer.lr=1e-3", "sync.sync_every=1",
                     "sync.bucket_mb=0.5", "trainer.micro_batch_tokens=512",
                     f'sync.load_format="{load_format}"', f"sync.overlap={str(overlap).lower()}",
                     "algorithm.entropy_coef=0.05")  # a gradient even if every reward is 0

    async def body():
        with Transport() as t:
            stack = await start_stack(t, tmp_path, exp)
            try:
                sync_rpc, trainers = await start_training(stack, exp, tmp_path)
                assert await wait_exit(trainers, 240) == [0] * ranks
                client = RpcClient(t, sync_rpc, timeout_s=30)
                sync_stats = (await client.request(StatsRequest())).values
                with pytest.raises(RemoteError, match="not newer"):
                    await client.request(SyncRequest(version=1))
                client.close()
                rollout = await stack.driver.rollouter_stats()
                mq = await stack.driver.mq_stats()
                info = stack.engine.get("/get_model_info")[1]
                _, tokenizer = build_tiny("tiny")
                prompt = chat_prompt(tokenizer, "What is 3 plus 2?")
                out = stack.engine.generate(prompt, max_new_tokens=12, temperature=0,
                                            ignore_eos=True)
                return sync_stats, rollout, mq, info, prompt, out
            finally:
                await stop_stack(stack)

    sync_stats, rollout, mq, info, prompt, out = asyncio.run(body())
    assert info["weight_version"] == "2"
    assert rollout["version"] == 2 and rollout["paused"] is False and mq["version"] == 2
    assert sync_stats["version"] == 2 and sync_stats["syncs"] == 2 and sync_stats["failures"] == 0
    last = sync_stats["last"]
    assert last["bytes"] == 385600 * 4 and last["pause_s"] >= 0
    assert last["trainer_idle_s"] >= last["broadcast_s"] > 0 and last["resume_s"] > 0
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [(m["step"], m["version"], m["published_version"]) for m in metrics] == [(1, 0, 1),
                                                                                    (2, 1, 2)]
    if overlap:  # each row: the trainer's wait, and the previous (background) sync's timings
        assert [m.get("synced_version") for m in metrics] == [None, 1]
        assert metrics[1]["sync_broadcast_s"] > 0 and metrics[1]["sync_attempts"] == 1
        assert all(m["sync_idle_s"] == pytest.approx(m["sync_finish_s"] + m["sync_snapshot_s"])
                   for m in metrics)
    else:
        assert all(m["sync_idle_s"] >= m["sync_broadcast_s"] for m in metrics)

    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "export/version_2",
                                                   local_files_only=True)
    initial, _ = build_tiny("tiny")
    assert out["output_ids"] == greedy_decode(trained, prompt, 12)
    # ...and the engine really serves the trained weights, not the initial ones
    engine_lp = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
    assert engine_lp == pytest.approx(
        teacher_forced_logprobs(trained, prompt, out["output_ids"]), abs=1e-4)
    assert max(abs(a - b) for a, b in zip(
        engine_lp, teacher_forced_logprobs(initial, prompt, out["output_ids"]))) > 1e-3


@pytest.mark.slow
def test_two_ranks_retry_a_broadcast_an_engine_failed(tmp_path):
    """Two trainer ranks; after the first sync the engine leaves the weight-update group (as a
    restarted engine would have), so the next broadcast really fails. Rank 0 finishes the
    parameter gather with rank 1 anyway, the group is built anew and the sync is retried: every
    version is published, and the engine ends up decoding exactly as the trained model."""
    from transformers import AutoModelForCausalLM

    exp = experiment(write_dataset(tmp_path / "d.jsonl", ROWS), "rollout.max_new_tokens=16",
                     "trainer.ranks=2", 'algorithm.loss="ppo"', "trainer.warmup_steps=0",
                     "trainer.total_steps=3", "trainer.lr=1e-3", "sync.sync_every=1",
                     "sync.bucket_mb=0.5", "trainer.micro_batch_tokens=512",
                     'sync.load_format="flattened_bucket"', "sync.timeout_s=120",
                     "algorithm.entropy_coef=0.05",
                     'sync.transport="broadcast"')  # the weight-update group's retry

    async def body():
        with Transport() as t:
            stack = await start_stack(t, tmp_path, exp)
            try:
                sync_rpc, trainers = await start_training(stack, exp, tmp_path)
                deadline = asyncio.get_running_loop().time() + 240
                while stack.engine.get("/get_model_info")[1]["weight_version"] != "1":
                    assert asyncio.get_running_loop().time() < deadline, "no first sync"
                    await asyncio.sleep(0.05)
                status, left = stack.engine.post("/destroy_weights_update_group",
                                                 {"group_name": "weight_update_group"})
                assert status == 200 and left["success"], left
                assert await wait_exit(trainers, 300) == [0, 0]
                client = RpcClient(t, sync_rpc, timeout_s=30)
                sync_stats = (await client.request(StatsRequest())).values
                client.close()
                info = stack.engine.get("/get_model_info")[1]
                _, tokenizer = build_tiny("tiny")
                prompt = chat_prompt(tokenizer, "What is 1 plus 3?")
                out = stack.engine.generate(prompt, max_new_tokens=12, temperature=0,
                                            ignore_eos=True)
                return sync_stats, info, prompt, out
            finally:
                await stop_stack(stack)

    sync_stats, info, prompt, out = asyncio.run(body())
    assert info["weight_version"] == "3"
    assert sync_stats["version"] == 3 and sync_stats["syncs"] == 3
    assert sync_stats["failures"] == 1  # the failed attempt, then its retry
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["published_version"] for m in metrics] == [1, 2, 3]
    assert sorted(m["sync_attempts"] for m in metrics) == [1, 1, 2]
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "export/version_3",
                                                   local_files_only=True)
    assert out["output_ids"] == greedy_decode(trained, prompt, 12)
