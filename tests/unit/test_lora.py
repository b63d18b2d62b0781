"""LoRA on the trainer (`[model.lora]`): only peft's adapters train, the reference is the base
model with them off, FSDP2 shards them as any parameter, checkpoints hold the adapters and their
optimizer state, and the export is the merged model plus the adapters in peft's format."""

from __future__ import annotations

import json
import multiprocessing
from typing import Any

import pytest
import torch
from safetensors import safe_open

from rollmesh.config import ConfigError, LoraConfig
from rollmesh.engine.launch import engine_launch
from rollmesh.engine.lora_init import write_identity
from rollmesh.models.loading import build_tiny
from rollmesh.models.lora import inject, peft_key
from rollmesh.training import checkpoint
from rollmesh.training.batching import from_groups
from rollmesh.training.forward import fused_head_supported
from rollmesh.training.lora import adapters_disabled, merged_state_dict
from rollmesh.training.state import build_state
from rollmesh.training.step import batch_logprobs, prepare, update_policy
from rollmesh.wire.transport import free_port
from tests.unit.test_checkpoint import load_state, save_state
from tests.unit.test_sharded_load import write_checkpoint
from tests.unit.test_trainer import experiment, make_groups, torch_threads

LORA = ("model.lora.rank=4", "algorithm.use_reference=true", "algorithm.kl_coef=0.1")


def lora_state(*overrides: str):
    with torch_threads(1):
        return build_state(experiment(*LORA, *overrides))


def adapters(state) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in state.model.named_parameters()
            if ".lora_" in n}


def bases(state) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in state.model.named_parameters()
            if ".lora_" not in n}


def test_only_the_adapters_train_and_the_reference_is_the_base_model():
    state = lora_state()
    assert state.ref_model is None  # no second copy of the weights
    trainable = [n for n, p in state.model.named_parameters() if p.requires_grad]
    # 2 layers x 7 projections x (A, B)
    assert len(trainable) == 28 and all(".lora_" in n for n in trainable)
    in_optimizer = {id(p) for g in state.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in state.model.parameters() if p.requires_grad}
    # B = 0: the adapted policy is the base model exactly, weight for weight
    base, _ = build_tiny("tiny")
    want = {n: p for n, p in base.named_parameters()}
    got = {n.replace(".base_layer.", "."): p for n, p in bases(state).items()}
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert all(not p.any() for n, p in adapters(state).items() if ".lora_B." in n)
    assert all(p.abs().sum() > 0 for n, p in adapters(state).items() if ".lora_A." in n)

    groups = make_groups(3)
    before_base, before_adapters = bases(state), adapters(state)
    with torch_threads(1):
        for _ in range(3):
            stats = update_policy(state, prepare(state, from_groups(groups)))
        data = prepare(state, from_groups(groups))
    assert stats["grad_norm"] > 0
    after = bases(state)
    assert all(torch.equal(after[n], before_base[n]) for n in after)  # frozen
    moved = adapters(state)
    assert all(not torch.equal(moved[n], before_adapters[n]) for n in moved if ".lora_B." in n)
    # reference = the base model (adapters off) = what a full-weight state with no update gives
    full = build_state(experiment("algorithm.use_reference=true", "algorithm.kl_coef=0.1"))
    with torch_threads(1):
        want_ref = batch_logprobs(full, data, full.model)
        policy = batch_logprobs(state, data, state.model)
    assert torch.allclose(data.ref, want_ref, atol=1e-6)
    assert not torch.allclose(policy, want_ref, atol=1e-4)  # the adapters changed the policy
    with adapters_disabled(state.model):
        assert torch.allclose(batch_logprobs(state, data, state.model), want_ref, atol=1e-6)
    assert torch.equal(batch_logprobs(state, data, state.model), policy)  # on again


def test_lora_config_is_checked():
    with pytest.raises(ConfigError, match="sync.pause_mode"):
        experiment(*LORA, 'sync.pause_mode="in_place"')
    with pytest.raises(ConfigError, match="sync.overlap"):
        experiment(*LORA, "sync.overlap=true")
    with pytest.raises(ConfigError, match="model.lora.target_modules"):
        experiment(*LORA, "model.lora.target_modules=[]")
    with pytest.raises(ConfigError, match="model.lora.target_modules"):
        experiment(*LORA, 'model.lora.target_modules=["q_proj", "../x"]')
    with pytest.raises(ConfigError, match="model.lora.rank"):
        experiment("model.lora.rank=-1")
    with pytest.raises(ValueError, match="no_such_proj"):
        build_state(experiment(*LORA, 'model.lora.target_modules=["no_such_proj"]'))
    assert experiment(*LORA).model.lora.scale_alpha == 8.0  # default alpha = 2 * rank


def test_checkpoint_holds_the_adapters_and_resumes_exactly(tmp_path):
    state = lora_state()
    groups = [make_groups(s) for s in (3, 4, 5)]
    with torch_threads(1):
        update_policy(state, prepare(state, from_groups(groups[0])))
        state.step, state.version = 1, 1
        path = save_state(tmp_path, state)
        keys = checkpoint.read_tensors(path, "model")
        assert sorted(keys) == sorted(adapters(state))  # the adapters alone
        optim = checkpoint.read_tensors(path, "optimizer")
        assert {k.rsplit(".", 1)[0] for k in optim} == set(adapters(state))
        assert json.loads((path / "trainer_state.json").read_text())["lora"] is True
        uninterrupted = [update_policy(state, prepare(state, from_groups(g)))
                         for g in groups[1:]]

        fresh = lora_state()
        load_state(path, fresh)
        resumed = [update_policy(fresh, prepare(fresh, from_groups(g))) for g in groups[1:]]
    assert resumed == uninterrupted
    want, got = adapters(state), adapters(fresh)
    assert all(torch.equal(want[n], got[n]) for n in want)

    full = build_state(experiment())
    with pytest.raises(ValueError, match="LoRA run cannot resume a full-weight one"):
        load_state(path, full)


def test_export_is_the_merged_model_and_the_adapters_in_peft_format(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # lm_head among the targets: its adapter too is merged and exported, and the trainer's
    # fused head (which reads the head's weight) steps aside for the wrapped head's own forward
    state = lora_state('model.lora.target_modules=["q_proj", "down_proj", "lm_head"]')
    assert not fused_head_supported(state.model)
    assert fused_head_supported(lora_state().model)
    with torch_threads(1):
        for seed in (3, 4):
            update_policy(state, prepare(state, from_groups(make_groups(seed))))
    out = checkpoint.export_hf(tmp_path / "policy", model=state.model, tokenizer=state.tokenizer,
                               lora=state.exp.model.lora)
    ids = torch.tensor([[5, 17, 99, 4, 250, 31, 8]])
    state.model.eval()
    with torch.no_grad():
        want = state.model(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-5)
        base, _ = build_tiny("tiny")
        peft_model = PeftModel.from_pretrained(base, out / "adapter")
        assert torch.allclose(peft_model(input_ids=ids).logits, want, atol=1e-5)
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert sorted(config["target_modules"]) == ["down_proj", "lm_head", "q_proj"]
    with pytest.raises(ValueError, match="pass its `lora` config"):
        checkpoint.export_hf(tmp_path / "x", model=state.model, tokenizer=None)


def test_the_engines_start_with_the_identity_adapter(tmp_path):
    cfg = LoraConfig(rank=4)
    write_identity(str(tmp_path / "v0"), "tiny", cfg)
    model, _ = build_tiny("tiny")
    inject(model, cfg)
    want = {peft_key(n): tuple(p.shape) for n, p in model.named_parameters() if ".lora_" in n}
    with safe_open(tmp_path / "v0" / "adapter_model.safetensors", "pt") as f:
        got = {k: tuple(f.get_tensor(k).shape) for k in f.keys()}
        assert all(not f.get_tensor(k).any() for k in f.keys())
    assert got == want
    exp = experiment(*LORA)
    launch = engine_launch(exp.engine, exp.model, "127.0.0.1", 30000, python="py",
                           lora_dir=str(tmp_path / "initial"))
    argv = launch.argv
    cut = argv.index("--")
    assert argv[:3] == ["py", "-m", "rollmesh.engine.lora_init"]
    assert argv[cut + 1:cut + 5] == ["py", "-m", "rollmesh", "engine"]
    assert argv[argv.index("--lora-paths") + 1] == f"policy={tmp_path / 'initial'}"
    assert "--enable-lora" in argv and argv[argv.index("--max-lora-rank") + 1] == "4"
    plain = engine_launch(exp.engine, experiment().model, "127.0.0.1", 30000, python="py")
    assert "--enable-lora" not in plain.argv


# -- two ranks -------------------------------------------------------------------------------------


def _rank(rank: int, rendezvous: str, path: str) -> dict[str, Any]:
    from rollmesh.training.ranks import close_ranks, full_tensor, init_ranks

    torch.set_num_threads(1)
    ranks = init_ranks(rendezvous, rank, 2, "gloo", timeout_s=60)
    out: dict[str, Any] = {}
    try:
        data = from_groups(make_groups(5))
        for how in ("sharded", "whole"):
            exp = experiment("trainer.ranks=2", f'model.path="{path}"', *LORA)
            state = build_state(exp, ranks, whole=how == "whole")
            stats = update_policy(state, prepare(state, from_groups(make_groups(5))))
            stats = update_policy(state, prepare(state, data))
            out[how] = {"stats": stats,
                        "adapters": {n: full_tensor(p).clone()
                                     for n, p in state.model.named_parameters()
                                     if ".lora_" in n},
                        "merged": merged_state_dict(state.model, ranks.is_main)}
    finally:
        close_ranks(ranks)
    return out


def test_two_ranks_shard_the_adapters_and_train_as_one_rank(tmp_path):
    path = write_checkpoint(tmp_path / "ckpt", tied=False, dtype=torch.float32)
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        results = pool.starmap(_rank, [(r, rendezvous, str(path)) for r in range(2)],
                               chunksize=1)
    got = results[0]
    sharded, whole = got["sharded"], got["whole"]
    assert sharded["stats"] == whole["stats"]
    for n, t in sharded["adapters"].items():
        assert torch.equal(t, whole["adapters"][n]), n
    with torch_threads(1):
        one = build_state(experiment(f'model.path="{path}"', *LORA))
        update_policy(one, prepare(one, from_groups(make_groups(5))))
        stats = update_policy(one, prepare(one, from_groups(make_groups(5))))
    assert stats["grad_norm"] > 0
    assert abs(stats["loss"] - sharded["stats"]["loss"]) < 1e-5
    for n, p in one.model.named_parameters():
        if ".lora_" in n:
            assert torch.allclose(p, sharded["adapters"][n], atol=1e-5), n
    merged = merged_state_dict(one.model, True)
    assert merged.keys() == sharded["merged"].keys()
    assert all(torch.allclose(merged[k], sharded["merged"][k], atol=1e-5) for k in merged)
