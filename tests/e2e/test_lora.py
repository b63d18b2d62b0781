"""LoRA end to end (`model.lora.rank > 0`): real processes. The trainer's ranks train the adapters
alone and each sync sends them alone (written in peft's format, loaded by the built-in engine
over SGLang's LoRA routes); the engine's output then equals the trainer's adapted model, token
for token. A launched run survives kill -9 of the trainer and of the engine, losing nothing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from rollmesh.config import LoraConfig
from rollmesh.engine.lora_init import write_identity
from rollmesh.models.loading import build_tiny
from rollmesh.wire.messages import StatsRequest
from rollmesh.wire.transport import RpcClient, Transport
from tests.e2e.test_launcher import (
    assert_nothing_trained_twice,
    assert_staleness_rule,
    check_accounting,
    finish,
    kill_and_await_restart,
    launch,
    metrics,
    status,
    wait_for,
)
from tests.engine.engine_harness import chat_prompt, greedy_decode, teacher_forced_logprobs
from tests.helpers.rollout_stack import ENV, experiment, start_stack, stop_stack, write_dataset
from tests.unit.test_sync import ROWS
from tests.unit.test_trainer import read_metrics, spawn_trainers, wait_exit

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_after_a_lora_sync_the_engine_decodes_exactly_as_the_trainers_adapted_model(tmp_path):
    """Two trainer ranks (FSDP2 shards of the adapters gathered for each sync), two syncs; the
    engine started with the identity adapter serves `policy` at version 2, each sync moved the
    adapter's bytes only, and greedy decoding naming `policy` equals the exported (merged)
    model's, while the engine's own weights stay the base model's."""
    from transformers import AutoModelForCausalLM

    from rollmesh.wire.transport import free_port

    initial = tmp_path / "initial"
    write_identity(str(initial), "tiny", LoraConfig(rank=4))
    exp = experiment(write_dataset(tmp_path / "d.jsonl", ROWS), "rollout.max_new_tokens=16",
                     "trainer.ranks=2", 'algorithm.loss="ppo"', "trainer.warmup_steps=0",
                     "trainer.total_steps=2", "trainer.lr=1e-2", "sync.sync_every=1",
                     "trainer.micro_batch_tokens=512", "model.lora.rank=4",
                     "algorithm.use_reference=true", "algorithm.kl_coef=0.01",
                     "algorithm.entropy_coef=0.05")  # a gradient even if every reward is 0

    async def body():
        with Transport() as t:
            stack = await start_stack(t, tmp_path, exp, engine_args=(
                "--enable-lora", "--lora-paths", f"policy={initial}", "--max-lora-rank", "4"))
            try:
                sup, spec = stack.sup, stack.mq.spec.config["experiment"]
                syncer = sup.spawn("synchronizer", "rollmesh.sync.role:main", env=ENV, config={
                    "experiment": spec, "rollouter": stack.rollouter.endpoints["rpc"],
                    "message_queue": stack.mq.endpoints["rpc"],
                    "bind": f"tcp://127.0.0.1:{free_port()}"})
                sync_rpc = (await sup.wait_ready(syncer, 120))["rpc"]
                trainers = spawn_trainers(sup, exp, {
                    "message_queue": stack.mq.endpoints["rpc"], "synchronizer": sync_rpc,
                    "engines": [stack.engine.url], "export_dir": str(tmp_path / "export"),
                    "metrics_path": str(tmp_path / "metrics.jsonl"),
                    "lora_dir": str(tmp_path / "lora")})
                assert await wait_exit(trainers, 300) == [0, 0]
                client = RpcClient(t, sync_rpc, timeout_s=30)
                sync_stats = (await client.request(StatsRequest())).values
                client.close()
                rollout = await stack.driver.rollouter_stats()
                info = stack.engine.get("/get_model_info")[1]
                _, tokenizer = build_tiny("tiny")
                prompt = chat_prompt(tokenizer, "What is 3 plus 2?")
                status_, out = stack.engine.post("/generate", {
                    "input_ids": prompt, "return_logprob": True, "lora_path": "policy",
                    "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                        "ignore_eos": True}})
                assert status_ == 200, out
                norm = stack.engine.post("/get_weights_by_name", {
                    "name": "model.layers.0.self_attn.q_proj.weight", "truncate_size": 2})[1]
                return sync_stats, rollout, info, prompt, out, norm
            finally:
                await stop_stack(stack)

    sync_stats, rollout, info, prompt, out, _ = asyncio.run(body())
    assert info["weight_version"] == "2" and rollout["version"] == 2
    assert sync_stats["version"] == 2 and sync_stats["syncs"] == 2 and sync_stats["failures"] == 0
    # the adapter's tensors alone: 2 layers x 7 projections, r = 4, float32
    adapter_bytes = sync_stats["last"]["bytes"]
    assert 0 < adapter_bytes < 385600 * 4 * 0.2, adapter_bytes
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(m["step"], m["published_version"]) for m in rows] == [(1, 1), (2, 2)]
    # the previous version's adapter is kept, older ones go
    assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == ["v1", "v2"]

    exported = tmp_path / "export" / "version_2"
    assert (exported / "adapter" / "adapter_config.json").is_file()
    trained = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    initial_model, _ = build_tiny("tiny")
    assert out["output_ids"] == greedy_decode(trained, prompt, 12)
    engine_lp = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
    assert engine_lp == pytest.approx(
        teacher_forced_logprobs(trained, prompt, out["output_ids"]), abs=1e-4)
    assert max(abs(a - b) for a, b in zip(engine_lp, teacher_forced_logprobs(
        initial_model, prompt, out["output_ids"]))) > 1e-3  # the adapter changed the policy


@pytest.mark.long
def test_a_launched_lora_run_survives_kill_9_of_the_trainer_and_the_engine(tmp_path):
    """`launch/lora_local.toml` (rank 8, lm_head among the targets), a checkpoint every 4 steps:
    kill -9 of the trainer (it resumes from its checkpoint and sends the engines its adapter
    again) and of the engine (it restarts with the identity adapter at version 0 and is sent
    the current one);
    the run completes, accounts for every sample, trains nothing twice, and exports the merged
    policy with its adapter."""
    run_dir = tmp_path / "run"
    steps = 24
    proc = launch(run_dir, "--set", f"trainer.total_steps={steps}",
                  "--set", "trainer.checkpoint_every=4", cluster="launch/lora_local.toml")
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 6, 300, "training under way", proc)
        kill_and_await_restart(run_dir, "trainer[0]")
        wait_for(lambda: len(metrics(run_dir)) >= 12, 300, "training after the resume", proc)
        kill_and_await_restart(run_dir, "engine[0]")

        def caught_up() -> bool:
            load = status(run_dir).get("engines") or [{}]
            served = load[0].get("weight_version")
            latest = metrics(run_dir)[-1]["version"]
            return served not in (None, "0") and int(served) >= latest - 1

        wait_for(caught_up, 180, "the restarted engine to hold the current adapter", proc)
    finally:
        out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    rows = metrics(run_dir)
    assert max(r["step"] for r in rows) == steps
    summary = check_accounting(run_dir)
    assert_staleness_rule(rows, summary)  # per-token versions as with full weights
    assert_nothing_trained_twice(rows)
    procs = {p["name"]: p for p in status(run_dir)["processes"]}
    assert procs["trainer[0]"]["restarts"] == 1 and procs["engine[0]"]["restarts"] == 1
    policy = run_dir / "policy"
    config = json.loads((policy / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8
    assert not any(".lora_" in k for k in _keys(policy / "model.safetensors"))  # merged
    engine_log = (run_dir / "logs" / "engine-0.log").read_text()
    assert engine_log.count("\"lora_loaded\"") >= 2  # at start, and a sync after the restart


def _keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return list(f.keys())
