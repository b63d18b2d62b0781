"""Real architectures through every path a checkpoint takes: the built-in engine serves a local
Qwen2.5 / Qwen3 / Llama-3.1 (tied and untied embeddings, sharded safetensors) or Gemma2
directory; its greedy output is transformers' `generate`; the trainer's log-probs of that
output are the engine's; a weight sync leaves the engine with the trainer's weights; and the
exported `policy/` reloads in transformers with the same logits.

The checkpoints are written by tests/helpers/hf_checkpoints.py (random weights, tiny shapes, each
family's special tokens and chat template)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rollmesh.algorithms.logits import token_logprobs
from rollmesh.models.loading import load_model
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


def _trained_state(path, *overrides: str):
    """(experiment, trainer state) built from the checkpoint as the trainer builds it (sharded
    loading, FSDP), after one policy update."""
    from rollmesh.training.batching import from_groups
    from rollmesh.training.state import build_state
    from rollmesh.training.step import prepare, update_policy
    from tests.unit.test_trainer import experiment, make_groups

    exp = experiment(f'model.path="{path}"', *overrides)
    state = build_state(exp)
    update_policy(state, prepare(state, from_groups(make_groups(1))))
    return exp, state


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
    from tests.unit.test_trainer import experiment

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
