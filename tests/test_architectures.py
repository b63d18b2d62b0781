"""Real architectures through every path a checkpoint takes: the built-in engine serves a local
Qwen2.5 / Qwen3 / Llama-3.1 (tied and untied embeddings, sharded safetensors) or Gemma2
directory; its greedy output is transformers' `generate`; the trainer's log-probs of that
output are the engine's; a weight sync leaves the engine with the trainer's weights; and the
exported `policy/` reloads in transformers with the same logits.

The checkpoints are written by tests/helpers/hf_checkpoints.py (random weights, tiny shapes, each
family's special tokens and chat template)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rollmesh.algorithms.logits import token_logprobs
from rollmesh.training.checkpoint import export_hf
from rollmesh.models.loading import ModelSpecError, load_model
from rollmesh.weight_sync.tensors import check_update, load_weights
from tests.engine.engine_harness import Engine
from tests.helpers.hf_checkpoints import write_checkpoint

CPU = torch.device("cpu")
# (family, tied embeddings, max_shard_size): every family once with a sharded checkpoint
CASES = [("qwen2.5", False, "200KB"), ("qwen3", True, "200KB"),
         ("llama3.1", False, "200KB"), ("llama3.1", True, None)]
GEMMA2 = ("gemma2", False, None)
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
NEW_TOKENS = 12
# The engine decodes with a KV cache one token at a time; the trainer scores the whole sequence
# in one pass: the same float32 model, different summation orders. Measured: at most 2e-6.
LOGPROB_ATOL = 2e-5


def _id(case) -> str:
    family, tied, shards = case
    return f"{family}-{'tied' if tied else 'untied'}{'-sharded' if shards else ''}"


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Every case's checkpoint and engine, the engines started side by side (each takes
    seconds to import and load); all stopped at the end, also when one fails to start."""
    root = tmp_path_factory.mktemp("architectures")

    paths = {case: write_checkpoint(case[0], root / _id(case), tied=case[1],
                                    max_shard_size=case[2]) for case in [*CASES, GEMMA2]}

    # Gemma2's tokenizer lives elsewhere: its engine is given --tokenizer-path
    gemma_tokenizer = root / "gemma2-tokenizer"
    gemma_tokenizer.mkdir()
    for f in list(paths[GEMMA2].iterdir()):
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            f.rename(gemma_tokenizer / f.name)
    flags = {GEMMA2: ["--tokenizer-path", str(gemma_tokenizer)]}

    def start(case):
        return paths[case], Engine(root / f"{_id(case)}.log", "--weight-version", "0",
                                   "--device", "cpu", "--dtype", "float32",
                                   *flags.get(case, []), model=str(paths[case]))

    with ThreadPoolExecutor(len(paths)) as pool:
        futures = {case: pool.submit(start, case) for case in paths}
    failed = [f.exception() for f in futures.values() if f.exception() is not None]
    started = {case: f.result() for case, f in futures.items() if f.exception() is None}
    try:
        if failed:
            raise failed[0]
        yield started
    finally:
        codes = {_id(case): (engine.stop(), engine) for case, (_, engine) in started.items()}
    for name, (code, engine) in codes.items():
        assert code == 0, f"{name}: {engine.log()}"


@pytest.fixture(params=CASES, ids=_id)
def served(request, engines):
    family, _, shards = request.param
    path, engine = engines[request.param]
    if shards:
        assert len(list(path.glob("*.safetensors"))) >= 2
    model, tokenizer = load_model(str(path), CPU, torch.float32)
    return family, path, engine, model, tokenizer


def _prompt(tokenizer) -> list[int]:
    messages = [{"role": "system", "content": "You add numbers."},
                {"role": "user", "content": "What is 12 plus 30?"}]
    ids = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    assert len(ids) > 60  # the tools' system text is there
    return list(ids)


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    gen = model.generation_config.__class__(do_sample=False, max_new_tokens=n, min_new_tokens=0,
                                            eos_token_id=None, pad_token_id=0)
    out = model.generate(torch.tensor([prompt]), generation_config=gen,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def _engine_greedy(engine: Engine, prompt: list[int]) -> tuple[list[int], list[float]]:
    out = engine.generate(prompt, max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    logprobs = [float(lp) for lp, _tok, *_ in out["meta_info"]["output_token_logprobs"]]
    return out["output_ids"], logprobs


def _trainer_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    """The trainer's own scoring: one forward pass, `token_logprobs` with shift=True."""
    tokens = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    return token_logprobs(logits, tokens, 1.0, shift=True)[0, len(prompt):].tolist()


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

    from rollmesh.wire.messages import Group, Trajectory
    from rollmesh.training.batching import from_groups
    from rollmesh.training.state import build_state
    from rollmesh.training.step import batch_logprobs
    from tests.test_trainer import experiment

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


def _trained_state(path, *overrides: str):
    """(experiment, trainer state) built from the checkpoint as the trainer builds it (sharded
    loading, FSDP), after one policy update."""
    from rollmesh.training.batching import from_groups
    from rollmesh.training.state import build_state
    from rollmesh.training.step import prepare, update_policy
    from tests.test_trainer import experiment, make_groups

    exp = experiment(f'model.path="{path}"', *overrides)
    state = build_state(exp)
    update_policy(state, prepare(state, from_groups(make_groups(1))))
    return exp, state


@pytest.mark.slow
def test_a_sync_leaves_the_engine_with_the_trainers_weights(served):
    """The trainer as it runs: state built from the checkpoint (sharded loading, FSDP), one
    policy update, then its own publisher (FSDP gather, buckets, the weight-update group) to the
    real engine. The engine's loading code places every gathered tensor bit for bit (the tied
    lm_head through its embedding), the engine's weights read back equal them, and the engine
    then decodes as the trained model does."""
    import asyncio

    from rollmesh.training.checkpoint import full_state_dict
    from rollmesh.training.weight_sender import WeightSender
    from rollmesh.training.ranks import Ranks
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


def test_trust_remote_code_runs_the_checkpoints_own_code(tmp_path):
    """`model.trust_remote_code` reaches every loader: without it a checkpoint with its own
    modelling code is refused; with it, that code builds the model. The engine's and SGLang's
    command lines carry it and `model.tokenizer_path`."""
    from rollmesh.config import EngineConfig, ModelConfig
    from rollmesh.engine.launch import engine_launch
    from tests.helpers.hf_checkpoints import write_remote_code_checkpoint

    path = write_remote_code_checkpoint(tmp_path / "remote")
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_model(str(path), CPU, torch.float32)
    model, tokenizer = load_model(str(path), CPU, torch.float32, trust_remote_code=True)
    assert type(model).__name__ == "RemoteForCausalLM"
    assert type(model).__module__.endswith("modeling_remote")
    assert tokenizer.eos_token == "<|im_end|>"

    cfg = ModelConfig(path=str(path), tokenizer_path="/tok", trust_remote_code=True)
    for kind in ("builtin", "sglang"):
        argv = engine_launch(EngineConfig(kind=kind), cfg, "127.0.0.1", 1).argv
        at = argv.index("--tokenizer-path")
        assert argv[at + 1] == "/tok" and "--trust-remote-code" in argv
    argv = engine_launch(EngineConfig(kind="builtin"), ModelConfig(path="tiny"), "h", 1).argv
    assert "--tokenizer-path" not in argv and "--trust-remote-code" not in argv


def test_the_trainer_takes_tokenizer_path_and_trust_remote_code(tmp_path):
    """The trainer's loaders (sharded from a directory; whole for tiny) honour both keys."""
    from rollmesh.training.state import build_state
    from tests.helpers.hf_checkpoints import build_tokenizer, write_remote_code_checkpoint
    from tests.test_trainer import experiment

    path = write_remote_code_checkpoint(tmp_path / "remote")
    build_tokenizer("llama3.1").save_pretrained(tmp_path / "tok")
    with pytest.raises(ValueError, match="trust_remote_code"):
        build_state(experiment(f'model.path="{path}"'))
    state = build_state(experiment(f'model.path="{path}"', "model.trust_remote_code=true",
                                   f'model.tokenizer_path="{tmp_path / "tok"}"'))
    assert "RemoteForCausalLM" in type(state.model).__name__
    assert state.tokenizer.eos_token == "<|eot_id|>"
    state = build_state(experiment(f'model.tokenizer_path="{tmp_path / "tok"}"'))
    assert state.tokenizer.eos_token == "<|eot_id|>"
