"""End-to-end tests of checkpoint (they start processes); the unit tests and the
helpers they share are in tests/unit/test_checkpoint.py."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

from rollmesh.training import checkpoint
from tests.engine.engine_harness import Engine, chat_prompt, greedy_decode
from tests.unit.test_checkpoint import trained_state
from tests.unit.test_trainer import (
    GAE,
    experiment,
    make_groups,
    max_diff,
    params_of,
    put_groups,
    read_metrics,
    reference_run,
    spawn_trainers,
    start_queue,
    wait_exit,
    with_supervisor,
)


@pytest.mark.slow
@pytest.mark.parametrize("ranks,overrides", [
    (1, ()), (2, ()), (2, (*GAE, "algorithm.critic_lr=2e-4"))], ids=["1", "2", "2-gae"])
def test_killed_trainer_resumes_and_its_next_step_matches_an_uninterrupted_run(tmp_path, ranks,
                                                                               overrides):
    """Trainer process(es): step 1, checkpoint, SIGKILL; new processes resume and run step 2.
    Step 2's loss and parameters equal those of one uninterrupted one-rank run (fixed seeds):
    bit for bit with one rank, within float rounding with two (sharded load). With GAE the
    sharded critic, its AdamW state and schedule are restored too."""
    batches = [make_groups(20), make_groups(21)]
    # two mini-batches: step 2's loss includes an update made with the restored AdamW state,
    # and the cosine warm-up makes the restored scheduler matter
    common = ("trainer.total_steps=2", "trainer.mini_batches=2", "trainer.warmup_steps=2",
              'trainer.lr_schedule="cosine"', "trainer.checkpoint_every=1", "trainer.lr=2e-4",
              *overrides)
    exp = experiment(f"trainer.ranks={ranks}", *common)
    config = {"metrics_path": str(tmp_path / "metrics.jsonl"),
              "checkpoint_dir": str(tmp_path / "ckpt")}

    async def body(t, sup):
        mq = await start_queue(sup, exp)
        await put_groups(t, mq, batches[0])
        first = spawn_trainers(sup, exp, {**config, "message_queue": mq})
        deadline = time.monotonic() + 120
        while checkpoint.latest(tmp_path / "ckpt") is None:
            assert all(c.process.poll() is None for c in first) and time.monotonic() < deadline
            await asyncio.sleep(0.05)
        for sig in (signal.SIGSTOP, signal.SIGKILL):  # frozen first: no rank sees another die
            for c in first:  # waiting for batch 2: killed mid-run
                c.process.send_signal(sig)
        for c in first:
            c.process.wait()
        second = spawn_trainers(sup, exp, {**config, "message_queue": mq})
        # Batch 2 goes in a while after the new trainers started. (This wait dates from the
        # trainer's long-polled GetBatch, which could take batch 2 with it; the dead trainer's
        # batch stream may still take it, and the queue then keeps it for step 2 and hands it
        # to the new trainers' stream again.)
        await asyncio.sleep(6)
        await put_groups(t, mq, batches[1])
        return [c.process.returncode for c in first], await wait_exit(second)

    killed, codes = with_supervisor(tmp_path, body)
    assert killed == [-signal.SIGKILL] * ranks and codes == [0] * ranks
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    state, stats = reference_run(experiment(*common), batches)
    tolerance = 1e-7 if ranks == 1 else 1e-5
    assert metrics[1]["loss"] == pytest.approx(stats[1]["loss"], abs=tolerance)
    assert metrics[1]["lr"] == pytest.approx(stats[1]["lr"], rel=1e-9)
    resumed = checkpoint.read_tensors(tmp_path / "ckpt/step_00000002", "model")
    assert max_diff(resumed, params_of(state)) < tolerance
    if overrides:
        assert metrics[1]["value_loss"] == pytest.approx(stats[1]["value_loss"], abs=tolerance)
        critic = checkpoint.read_tensors(tmp_path / "ckpt/step_00000002", "critic")
        assert max_diff(critic, params_of(state, "critic")) < tolerance
    log = (tmp_path / "logs/trainer-0.log").read_text()
    assert '"event": "resumed"' in log


@pytest.mark.slow
def test_export_loads_in_transformers_and_in_the_built_in_engine(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exp, state = trained_state()
    out = checkpoint.export_hf(tmp_path / "export", model=state.model, tokenizer=state.tokenizer)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["dtype"] == "float32"
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert max_diff(dict(hf.named_parameters()), params_of(state)) == 0
    prompt = chat_prompt(tok, "What is 2 plus 3?")
    assert prompt == chat_prompt(state.tokenizer, "What is 2 plus 3?")
    expected = greedy_decode(state.model.eval(), prompt, 8)
    engine = Engine(tmp_path / "engine.log", model=str(out))
    try:
        got = engine.generate(prompt, max_new_tokens=8, temperature=0, ignore_eos=True)
    finally:
        engine.stop()
    assert got["output_ids"] == expected
