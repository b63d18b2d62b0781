"""End-to-end tests of architectures (they start processes); the unit tests and the
helpers they share are in tests/unit/test_architectures.py."""

from __future__ import annotations

import json

import pytest
import torch

from rollmesh.models.loading import ModelSpecError, load_model
from rollmesh.training.checkpoint import export_hf
from rollmesh.weight_sync.tensors import check_update, load_weights
from tests.unit.test_architectures import (  # noqa: F401 - pytest fixtures
    CPU,
    GEMMA2,
    LOGPROB_ATOL,
    NEW_TOKENS,
    _engine_greedy,
    _hf_greedy,
    _prompt,
    _trained_state,
    _trainer_logprobs,
    engines,
    served,
)


@pytest.mark.slow
def test_engine_greedy_is_transformers_generate(served):
    _, path, engine, model, tokenizer = served
    prompt = _prompt(tokenizer)
    with torch.no_grad():
        expected = _hf_greedy(model, prompt, NEW_TOKENS)
    got, _ = _engine_greedy(engine, prompt)
    assert got == expected and len(set(got)) > 1  # a real decode, not one token repeated
    info = engine.get("/get_model_info")[1]
    assert info["model_path"] == str(path)


@pytest.mark.slow
def test_trainer_logprobs_match_the_engines(served):
    """The trainer as it runs: its state built from the checkpoint (sharded loading, FSDP),
    the engine's sample packed into a batch, `batch_logprobs` on it (the old log-probs it
    recomputes) against the engine's behaviour log-probs."""
    import numpy as np

    from rollmesh.training.batching import from_groups
    from rollmesh.training.state import build_state
    from rollmesh.training.step import batch_logprobs
    from rollmesh.wire.messages import Group, Trajectory
    from tests.unit.test_trainer import experiment

    _, path, engine, model, tokenizer = served
    prompt = _prompt(tokenizer)
    output, engine_lp = _engine_greedy(engine, prompt)
    ids = np.asarray(prompt + output, np.int32)
    mask = np.r_[np.zeros(len(prompt)), np.ones(len(output))].astype(np.uint8)
    traj = Trajectory(sample_id="s", group_id="g", token_ids=ids, loss_mask=mask,
                      logprobs=np.r_[np.zeros(len(prompt)), engine_lp].astype(np.float32),
                      versions=np.where(mask == 1, 0, -1).astype(np.int32),
                      prompt_len=len(prompt), index=0, status="finished", reward=1.0,
                      reward_status="ok")
    state = build_state(experiment(f'model.path="{path}"', "model.max_context=1024",
                                   "trainer.micro_batch_tokens=1024"))
    trainer_lp = batch_logprobs(state, from_groups([Group("g", [traj])]), state.model)
    trainer_lp = trainer_lp[0, len(prompt):len(ids)].tolist()
    assert len(engine_lp) == len(trainer_lp) == NEW_TOKENS
    assert max(abs(a - b) for a, b in zip(engine_lp, trainer_lp)) < LOGPROB_ATOL
    # the same as scoring the sequence in one pass outside the trainer
    assert max(abs(a - b) for a, b in zip(_trainer_logprobs(model, prompt, output),
                                          trainer_lp)) < LOGPROB_ATOL


@pytest.mark.slow
def test_a_sync_leaves_the_engine_with_the_trainers_weights(served):
    """The trainer as it runs: state built from the checkpoint (sharded loading, FSDP), one
    policy update, then its own publisher (FSDP gather, buckets, the weight-update group) to the
    real engine. The engine's loading code places every gathered tensor bit for bit (the tied
    lm_head through its embedding), the engine's weights read back equal them, and the engine
    then decodes as the trained model does."""
    import asyncio

    from rollmesh.training.checkpoint import full_state_dict
    from rollmesh.training.ranks import Ranks
    from rollmesh.training.weight_sender import WeightSender
    from rollmesh.wire.transport import Transport

    _, path, engine, before, tokenizer = served
    exp, state = _trained_state(path, "sync.bucket_mb=0.05")  # several buckets
    trained = full_state_dict(state.model, Ranks())
    assert not all(torch.equal(t, before.get_parameter(n)) for n, t in trained.items())

    # the engine's own loader, in an engine-side copy: bit for bit, aliases included
    receiver, _ = load_model(str(path), CPU, torch.float32)
    names = list(trained)
    check_update(receiver, names, [list(t.shape) for t in trained.values()],
                 ["float32"] * len(names))
    assert load_weights(receiver, trained.items()) == len(trained)
    for name, tensor in receiver.named_parameters(remove_duplicate=False):
        source = name if name in trained else "model.embed_tokens.weight"  # tied lm_head
        assert torch.equal(tensor, trained[source]), name

    async def publish() -> int:
        with Transport() as transport:
            publisher = WeightSender(transport, {"engines": [engine.url],
                                              "synchronizer": "tcp://127.0.0.1:1"},
                                  exp.sync, CPU)
            await publisher.open()
            try:
                await publisher.join_weight_group()
                sent = await publisher.broadcast(state.model, torch.float32, 1)
            finally:
                publisher.reset_group()
                await publisher.engines.destroy_weights_update_group("weight_update_group")
                await publisher.close()
            return sent

    assert asyncio.run(publish()) == sum(t.numel() * 4 for t in trained.values())
    assert engine.get("/get_model_info")[1]["weight_version"] == "1"
    # and in the engine itself, read back through SGLang's /get_weights_by_name
    for name, tensor in receiver.named_parameters(remove_duplicate=False):
        status, rows = engine.request("POST", "/get_weights_by_name",
                                      {"name": name, "truncate_size": tensor.shape[0]})
        assert status == 200, rows
        assert torch.equal(torch.tensor(rows, dtype=torch.float32), tensor.detach()), name
    prompt = _prompt(tokenizer)
    with torch.no_grad():
        expected = _hf_greedy(receiver, prompt, NEW_TOKENS)
    got, engine_lp = _engine_greedy(engine, prompt)
    assert got == expected
    trainer_lp = _trainer_logprobs(receiver, prompt, got)
    assert max(abs(a - b) for a, b in zip(engine_lp, trainer_lp)) < LOGPROB_ATOL


@pytest.mark.slow
def test_exported_policy_reloads_in_transformers(served, tmp_path):
    """The trainer's export of its FSDP policy reloads in transformers (tied or not, the chat
    template kept) with the trainer's logits, bit for bit."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, path, _, _, tokenizer = served
    _, state = _trained_state(path)
    out = export_hf(tmp_path / "policy", model=state.model, tokenizer=state.tokenizer)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] == state.model.config.tie_word_embeddings
    reloaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok.chat_template == tokenizer.chat_template
    prompt = _prompt(tok)
    assert prompt == _prompt(tokenizer)
    ids = torch.tensor([prompt])
    state.model.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, state.model(input_ids=ids).logits)


@pytest.mark.slow
def test_gemma2_is_served_with_the_attention_it_supports(engines):
    """Gemma2 has no SDPA path (soft-capped attention logits): the engine loads it eagerly
    instead of failing, and decodes as transformers does."""
    path, engine = engines[GEMMA2]
    tokenizer_path = path.parent / "gemma2-tokenizer"
    with pytest.raises(ModelSpecError, match="no tokenizer files"):  # none of its own
        load_model(str(path), CPU, torch.float32)
    model, tokenizer = load_model(str(path), CPU, torch.float32,
                                  tokenizer_path=str(tokenizer_path))
    assert model.config._attn_implementation == "eager"
    info = engine.get("/get_model_info")[1]
    assert info["tokenizer_path"] == str(tokenizer_path)
    prompt = list(tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 plus 30?"}], add_generation_prompt=True,
        tokenize=True, return_dict=True)["input_ids"])
    assert prompt[0] == tokenizer.bos_token_id
    with torch.no_grad():
        expected = _hf_greedy(model, prompt, NEW_TOKENS)
    out = engine.generate(prompt, max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    assert out["text"] == tokenizer.decode(out["output_ids"])  # detokenized by that tokenizer
    got, engine_lp = _engine_greedy(engine, prompt)
    assert got == expected and len(set(got)) > 1
    trainer_lp = _trainer_logprobs(model, prompt, got)
    assert max(abs(a - b) for a, b in zip(engine_lp, trainer_lp)) < LOGPROB_ATOL
