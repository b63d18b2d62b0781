"""LoRA on a GPU: the trainer's adapters train on CUDA in bfloat16 autocast with the base frozen
and the reference the base model, and the built-in engine on CUDA serves a loaded adapter as
peft's own model decodes it."""

from __future__ import annotations

import pytest
import torch

from rollmesh.models.loading import build_tiny
from rollmesh.training.batching import from_groups
from rollmesh.training.state import build_state
from rollmesh.training.step import batch_logprobs, prepare, update_policy
from tests.engine.engine_harness import Engine, greedy_decode
from tests.unit.test_trainer import experiment, make_groups


def test_lora_trains_on_cuda_with_the_base_frozen():
    exp = experiment("model.lora.rank=8", "algorithm.use_reference=true",
                     "algorithm.kl_coef=0.1", 'model.dtype="bfloat16"',
                     'trainer.device="cuda"')
    state = build_state(exp, device=torch.device("cuda"))
    base = {n: p.detach().clone() for n, p in state.model.named_parameters() if ".lora_" not in n}
    groups = make_groups(3)
    for _ in range(3):
        stats = update_policy(state, prepare(state, from_groups(groups)))
    assert stats["grad_norm"] > 0 and stats["loss"] == stats["loss"]  # finite
    for n, p in state.model.named_parameters():
        if ".lora_" not in n:
            assert torch.equal(p, base[n]), n
    data = prepare(state, from_groups(groups))
    full = build_state(experiment("algorithm.use_reference=true", "algorithm.kl_coef=0.1",
                                  'model.dtype="bfloat16"', 'trainer.device="cuda"'),
                       device=torch.device("cuda"))
    want = batch_logprobs(full, data, full.model)
    assert torch.allclose(data.ref, want, atol=2e-2)


@pytest.mark.parametrize("backend", ["hf", "fast"])
def test_engine_on_cuda_serves_the_adapter_as_peft(tmp_path, backend):
    from peft import LoraConfig, get_peft_model

    model, tokenizer = build_tiny("tiny")
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(
        r=8, lora_alpha=16, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.mul_(20)  # an adapter that changes the greedy tokens
    peft_model.save_pretrained(tmp_path / "adapter")
    engine = Engine(tmp_path / "engine.log", "--device", "cuda", "--dtype", "float32",
                    "--decode-backend", backend, "--enable-lora", "--max-lora-rank", "8")
    try:
        status, out = engine.post("/load_lora_adapter", {"lora_name": "a",
                                                         "lora_path": str(tmp_path / "adapter")})
        assert status == 200 and out["success"], out
        prompt = tokenizer("What is 2 plus 2?")["input_ids"]
        status, got = engine.post("/generate", {
            "input_ids": prompt, "lora_path": "a",
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})
        assert status == 200, got
    finally:
        engine.stop()
    with torch.no_grad():
        assert got["output_ids"] == greedy_decode(peft_model.eval(), prompt, 12)
