"""The built-in engine on CUDA (model and KV cache on the GPU) against transformers `generate`
on the same GPU, token for token, in float32 (so no bf16 kernel choice can flip a near tie) and
in bfloat16 (the engine's default on a GPU) for a batch of prompts."""

from __future__ import annotations

import pytest
import torch

from rollmesh.models.loading import build_tiny
from tests.engine.engine_harness import Engine, chat_prompt

pytestmark = pytest.mark.slow

NEW = 24


def _generate(model, prompt: list[int]) -> list[int]:
    gen = model.generation_config.__class__(do_sample=False, max_new_tokens=NEW,
                                            min_new_tokens=0, eos_token_id=None, pad_token_id=0)
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, generation_config=gen, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_on_cuda_is_transformers_generate(tmp_path, dtype):
    spec = "tiny:hidden=128,layers=4,heads=4,kv_heads=2"
    model, tok = build_tiny(spec)
    model = model.to("cuda", getattr(torch, dtype))
    prompts = [chat_prompt(tok, q) for q in ("Add 2 and 3.", "What is seven times six?",
                                             "Name a colour.")]
    engine = Engine(tmp_path / "engine.log", "--device", "cuda", "--dtype", dtype, model=spec)
    try:
        status, info = engine.get("/get_server_info")
        assert status == 200
        for prompt in prompts:  # one by one: the same batch shape as generate's
            out = engine.generate(prompt, max_new_tokens=NEW, temperature=0, ignore_eos=True)
            with torch.no_grad():
                assert out["output_ids"] == _generate(model, prompt)
    finally:
        assert engine.stop() == 0, engine.log()
