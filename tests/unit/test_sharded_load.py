"""The trainer's shard-by-shard loading (`rollmesh.models.sharded`): the weights each rank holds
are, gathered, those of `from_pretrained` bit for bit, and training on them is what training on
the whole-model path (every rank builds the whole model, then shards) gives, bit for bit."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rollmesh.models.loading import load_model, tiny_tokenizer
from rollmesh.training.batching import from_groups
from rollmesh.models.sharded import (
    CheckpointFiles, UnsupportedCheckpoint, checkpoint_keys, empty_causal_lm,
)
from rollmesh.training.state import build_state
from rollmesh.training.step import prepare, update_policy
from rollmesh.wire.transport import free_port
from tests.unit.test_trainer import GAE, experiment, make_groups


def write_checkpoint(path: Path, *, tied: bool, dtype: torch.dtype) -> Path:
    """A Qwen2 checkpoint whose dims do not split evenly over 2 ranks (vocab, MLP, heads)."""
    tokenizer = tiny_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer) + 1, hidden_size=40, intermediate_size=75,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, rope_theta=1e6, tie_word_embeddings=tied,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = Qwen2ForCausalLM(config)
    model.to(dtype).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


CHECKPOINTS = {"tied_bf16": {"tied": True, "dtype": torch.bfloat16},
               "untied_fp32": {"tied": False, "dtype": torch.float32}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: write_checkpoint(root / name, **kw) for name, kw in CHECKPOINTS.items()}


def reference(path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True,
                                                attn_implementation="sdpa")


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for name in want:
        assert got[name].dtype == want[name].dtype, (what, name)
        assert torch.equal(got[name], want[name]), (what, name)


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_one_rank_loads_what_from_pretrained_loads(checkpoints, name):
    exp = experiment(f'model.path="{checkpoints[name]}"')
    state = build_state(exp)
    want = reference(checkpoints[name])
    assert_same(dict(state.model.named_parameters()), dict(want.named_parameters()), "params")
    assert_same(dict(state.model.named_buffers()), dict(want.named_buffers()), "buffers")
    assert state.model.config.to_dict() == {**want.config.to_dict(),
                                            "architectures": ["Qwen2ForCausalLM"]}
    assert state.model.generation_config.to_dict() == want.generation_config.to_dict()
    # the loader's kernel is SDPA; the trainer switches to its packed-row kernel
    assert want.config._attn_implementation == "sdpa"
    assert state.model.config._attn_implementation == "rollmesh_varlen"
    tied = state.model.lm_head.weight is state.model.model.embed_tokens.weight
    assert tied == CHECKPOINTS[name]["tied"]
    assert state.model.training and all(p.requires_grad for p in state.model.parameters())
    assert state.tokenizer.encode("48/2 = 24") == tiny_tokenizer().encode("48/2 = 24")


def _other_architecture(name: str) -> Any:
    from transformers import (
        Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config,
        Qwen3ForCausalLM,
    )

    tokenizer = tiny_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    if name == "llama3_tied":  # Llama-3's rope scaling: inv_freq is not the plain formula
        return LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128}))
    if name == "gemma2_tied":  # no SDPA path: eager attention, as the engine loads it
        return Gemma2ForCausalLM(Gemma2Config(**common, head_dim=12, tie_word_embeddings=True))
    return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, tie_word_embeddings=False))


@pytest.mark.parametrize("arch", ["llama3_tied", "qwen3_untied", "gemma2_tied"])
def test_other_architectures_load_as_from_pretrained_loads(tmp_path, arch):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = _other_architecture(arch)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    state = build_state(experiment(f'model.path="{tmp_path}"'))
    want, _ = load_model(str(tmp_path), torch.device("cpu"), torch.float32)  # the engine's load
    assert_same(dict(state.model.named_parameters()), dict(want.named_parameters()), arch)
    assert_same(dict(state.model.named_buffers()), dict(want.named_buffers()), arch)
    assert want.config._attn_implementation == ("eager" if arch == "gemma2_tied" else "sdpa")
    assert state.model.config._attn_implementation == "rollmesh_varlen"  # trainer.packing
    assert (state.model.lm_head.weight is state.model.model.embed_tokens.weight) == (
        arch != "qwen3_untied")


def test_a_checkpoint_with_other_names_is_refused_before_anything_is_allocated(tmp_path,
                                                                            checkpoints):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "renamed"
    path.mkdir()
    for f in checkpoints["untied_fp32"].iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.scale"] = tensors.pop("model.norm.weight")
    tensors["model.rotary_emb.inv_freq"] = torch.zeros(5)  # old checkpoints stored it
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = empty_causal_lm(path, torch.float32)
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(UnsupportedCheckpoint, match="model.norm.weight"):
        checkpoint_keys(model, CheckpointFiles(path))
    # the trainer then falls back to the whole model, loaded as from_pretrained loads it
    state = build_state(experiment(f'model.path="{path}"'))
    assert not any(p.is_meta for p in state.model.parameters())

    # a stored non-persistent buffer is ignored, as from_pretrained ignores it
    tensors["model.norm.weight"] = tensors.pop("model.norm.scale")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    state = build_state(experiment(f'model.path="{path}"'))
    want = reference(path)
    assert_same(dict(state.model.named_buffers()), dict(want.named_buffers()), "buffers")
    assert state.model.model.rotary_emb.inv_freq.abs().min() > 0
    with pytest.raises(UnsupportedCheckpoint, match="no model.safetensors"):
        CheckpointFiles(tmp_path)


# -- two ranks -------------------------------------------------------------------------------------


def _gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from rollmesh.training.ranks import full_tensor

    return {n: full_tensor(p).clone() for n, p in model.named_parameters()}


def _rank(rank: int, rendezvous: str, paths: dict[str, str]) -> dict[str, Any]:
    """One trainer rank: for each checkpoint, the sharded and the whole-model states, their
    gathered weights before and after one step with GAE and a reference model, and the stats."""
    from rollmesh.training.ranks import close_ranks, init_ranks

    torch.set_num_threads(1)
    ranks = init_ranks(rendezvous, rank, 2, "gloo", timeout_s=60)  # a failing rank: no hang
    out: dict[str, Any] = {}
    try:
        data = from_groups(make_groups(5))
        for name, path in paths.items():
            exp = experiment("trainer.ranks=2", f'model.path="{path}"', *GAE,
                             "algorithm.use_reference=true", "algorithm.kl_coef=0.1")
            for how in ("sharded", "whole"):
                state = build_state(exp, ranks, whole=how == "whole")
                model = state.model
                result = {"model": _gathered(model), "ref": _gathered(state.ref_model),
                          "critic": _gathered(state.critic),
                          "tied": model.lm_head.weight is model.model.embed_tokens.weight,
                          "local": {n: tuple(p.to_local().shape)
                                    for n, p in model.named_parameters()}}
                result["stats"] = update_policy(state, prepare(state, data))
                result["model_after"] = _gathered(state.model)
                result["critic_after"] = _gathered(state.critic)
                out[f"{name}/{how}"] = result
    finally:
        close_ranks(ranks)
    return out


def test_two_ranks_load_their_shards_exactly_and_train_as_the_whole_model_path(checkpoints):
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    paths = {name: str(p) for name, p in checkpoints.items()}
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        results = pool.starmap(_rank, [(r, rendezvous, paths) for r in range(2)], chunksize=1)
    got = results[0]
    for name, path in checkpoints.items():
        want = reference(path)
        weights = {n: p.detach() for n, p in want.named_parameters()}
        sharded, whole = got[f"{name}/sharded"], got[f"{name}/whole"]
        assert sharded["tied"] == CHECKPOINTS[name]["tied"]
        vocab = want.config.vocab_size  # odd: rank 0 holds one row more
        assert sharded["local"]["model.embed_tokens.weight"] == (vocab // 2 + 1, 40)
        assert results[1][f"{name}/sharded"]["local"]["model.embed_tokens.weight"] == (
            vocab // 2, 40)
        assert_same(sharded["model"], weights, f"{name} policy")
        assert_same(sharded["ref"], weights, f"{name} reference")
        decoder = {f"model.{n}": p.detach() for n, p in want.model.named_parameters()}
        assert_same({n: t for n, t in sharded["critic"].items() if n.startswith("model.")},
                    decoder, f"{name} critic decoder")
        for key in ("model", "ref", "critic", "model_after", "critic_after"):
            assert_same(sharded[key], whole[key], f"{name} {key}: sharded vs whole")
        assert sharded["stats"] == whole["stats"], name
        assert sharded["stats"]["grad_norm"] > 0
        assert sharded["critic"]["value_head.weight"].abs().sum() > 0
        assert not torch.equal(sharded["model_after"]["model.norm.weight"],
                               sharded["model"]["model.norm.weight"])  # it did train
