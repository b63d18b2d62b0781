"""LoRA adapters on the built-in engine (rollmesh/engine/builtin/lora.py), as the trainer syncs
them: peft's adapter directory, /unload_lora_adapter + /load_lora_adapter, and every /generate
naming the adapter (`lora_path`). Greedy tokens are held to peft's own model, token for token,
on both decode backends; every hostile adapter is refused with a 400 naming the problem and
leaves the engine's tokens as they were."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch
from engine_harness import Engine, chat_prompt, greedy_decode

from rollmesh.engine.builtin import lora
from rollmesh.models.loading import build_tiny

pytestmark = pytest.mark.slow

TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]  # fused QKV/gate-up and a plain one
PROMPTS = ["Natalia sold clips to 48 of her friends in April.", "What is 2+3?"]
N = 8  # greedy tokens compared


def make_adapter(path: Path, seed: int, *, r: int = 8, alpha: int = 16,
                 rslora: bool = False) -> torch.nn.Module:
    """A peft adapter on `tiny` with random (non-zero) B, saved to `path`; its peft model."""
    from peft import LoraConfig, get_peft_model

    base, _ = build_tiny("tiny")
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS,
                                            init_lora_weights=False, use_rslora=rslora))
    with torch.no_grad():  # B large enough that greedy tokens move away from the base's
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    model.save_pretrained(str(path))
    return model.eval()


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """Adapters v1 and v2 on disk, and the greedy tokens of the base model and of each
    adapter's peft model for every prompt."""
    root = tmp_path_factory.mktemp("adapters")
    base, tok = build_tiny("tiny")
    prompts = [chat_prompt(tok, q) for q in PROMPTS]
    out = {"root": root, "prompts": prompts,
           "base": [greedy_decode(base, p, N) for p in prompts]}
    with torch.no_grad():
        for version, seed in (("v1", 1), ("v2", 2)):
            model = make_adapter(root / version, seed)
            out[version] = [greedy_decode(model, p, N) for p in prompts]
    for version in ("v1", "v2"):
        assert out[version] != out["base"], f"adapter {version} does not change greedy tokens"
    assert out["v1"] != out["v2"]
    return out


def tokens(engine: Engine, refs, lora_path: str | None = "policy") -> list[list[int]]:
    outs = []
    for p in refs["prompts"]:
        body = {"input_ids": p, "sampling_params": {"max_new_tokens": N, "temperature": 0,
                                                    "ignore_eos": True}}
        if lora_path is not None:
            body["lora_path"] = lora_path
        status, reply = engine.post("/generate", body)
        assert status == 200, reply
        outs.append(reply["output_ids"])
    return outs


def load(engine: Engine, path: Path | str, name: str = "policy") -> tuple[int, dict]:
    return engine.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def unload(engine: Engine, name: str = "policy") -> tuple[int, dict]:
    return engine.post("/unload_lora_adapter", {"lora_name": name})


def start(tmp_path: Path, refs, backend: str) -> Engine:
    return Engine(tmp_path / f"engine-{backend}.log", "--decode-backend", backend,
                  "--lora-paths", f"policy={refs['root'] / 'v1'}", "--max-lora-rank", "8",
                  "--lora-target-modules", *TARGETS)


@pytest.mark.parametrize("backend", ["hf", "fast"])
def test_adapter_tokens_match_peft_and_sync_cycles(tmp_path, refs, backend):
    e = start(tmp_path, refs, backend)
    try:
        assert f"backend={backend}" in e.log() or f'"backend": "{backend}"' in e.log()
        # --lora-paths name=path: served from the start
        assert tokens(e, refs) == refs["v1"]
        # a sync: unload (base back, exactly), load the next version, tokens follow it
        status, reply = unload(e)
        assert status == 200 and reply["success"] and reply["loaded_adapters"] == {}, reply
        assert tokens(e, refs, None) == refs["base"]
        status, reply = load(e, refs["root"] / "v2")
        assert status == 200, reply
        assert reply == {"rid": None, "http_worker_ipc": None, "success": True,
                         "error_message": "", "loaded_adapters": {
                             "policy": str(refs["root"] / "v2")}}
        assert tokens(e, refs) == refs["v2"]  # no stale merge, no stale prefix cache
        # and back: the base copy kept across the cycle is the base's
        assert unload(e)[0] == 200 and load(e, refs["root"] / "v1")[0] == 200
        assert tokens(e, refs) == refs["v1"]
        assert e.post("/update_weight_version", {"new_version": "2",
                                                 "abort_all_requests": False})[0] == 200
        assert tokens(e, refs) == refs["v1"]
    finally:
        e.stop()


def test_requests_and_routes_the_engine_refuses(tmp_path, refs):
    """One engine (hf backend): the requests it refuses while an adapter is merged and while
    none is, then every hostile adapter, each leaving the base tokens as they were."""
    e = start(tmp_path, refs, "hf")
    try:
        v1, v2 = refs["root"] / "v1", refs["root"] / "v2"
        prompt = refs["prompts"][0]

        def gen(**extra):
            return e.post("/generate", {"input_ids": prompt,
                                        "sampling_params": {"max_new_tokens": 2}, **extra})

        # merged: a base request, another name, a name never loaded, a mixed batch
        status, reply = gen()
        assert status == 400 and "must name it" in reply["error"]["message"], reply
        status, reply = e.post("/v1/completions", {"model": "tiny", "prompt": "Hi",
                                                   "max_tokens": 1})
        assert status == 400 and "must name it" in json.dumps(reply), reply
        status, reply = gen(lora_path="nope")
        assert status == 400, reply
        assert reply["error"]["message"].startswith(
            "Got LoRA adapter that has never been loaded: nope"), reply
        status, reply = e.post("/generate", {"input_ids": [prompt, prompt],
                                             "lora_path": ["policy", None],
                                             "sampling_params": {"max_new_tokens": 2}})
        assert status == 400 and "same one" in reply["error"]["message"], reply
        status, reply = e.post("/generate", {"input_ids": [prompt, prompt],
                                             "lora_path": ["policy", "policy"],
                                             "sampling_params": {"max_new_tokens": 2}})
        assert status == 200 and len(reply) == 2, reply
        # a second adapter, the same name again, a full weight update: refused
        status, reply = load(e, v2, "other")
        assert status == 400 and "one adapter at a time" in reply["error_message"], reply
        assert reply["loaded_adapters"] == {"policy": str(v1)}
        status, reply = load(e, v2)
        assert status == 400, reply
        assert reply["error_message"] == ("Failed to load LoRA adapter policy because it is "
                                          "already loaded")
        status, reply = e.post("/update_weights_from_disk", {"model_path": str(v2)})
        assert status == 400 and "unload it first" in reply["message"], reply
        status, reply = unload(e, "other")
        assert status == 400 and reply["loaded_adapters"] is None, reply
        assert reply["error_message"] == ("LoRA with name other does not exist. Loaded LoRAs: "
                                          "dict_keys(['policy'])")
        # a name loaded before: refused while another one is merged
        assert unload(e)[0] == 200 and load(e, v2, "other")[0] == 200
        assert unload(e, "other")[0] == 200 and load(e, v1)[0] == 200
        status, reply = gen(lora_path="other")
        assert status == 400 and "one merged adapter" in reply["error"]["message"], reply
        assert tokens(e, refs) == refs["v1"]

        # nothing merged: hostile adapters, each refused before any weight changes
        assert unload(e)[0] == 200
        base = refs["base"]
        for why, path in hostile_adapters(tmp_path / "hostile", v1).items():
            status, reply = load(e, path)
            assert status == 400 and reply["success"] is False, (why, reply)
            assert why in reply["error_message"], (why, reply["error_message"])
            assert reply["loaded_adapters"] == {}, reply
            assert tokens(e, refs, None) == base, why
        status, reply = e.post("/load_lora_adapter", {"lora_name": "policy"})
        assert status == 400 and "lora_path" in reply["message"], reply
        status, reply = gen(lora_path="policy")  # loaded before, not now: a 400 at admission
        assert status == 400 and "unloaded" in reply["meta_info"]["finish_reason"]["message"]
        assert tokens(e, refs, None) == base
        assert load(e, v1)[0] == 200 and tokens(e, refs) == refs["v1"]
        asyncio.run(client_sync(e, refs))
    finally:
        e.stop()


async def client_sync(e: Engine, refs) -> None:
    """EngineClient's side of a sync, as the trainer runs it, and its lora_path."""
    from rollmesh.engine.client import EngineClient, EngineError

    v1, v2 = str(refs["root"] / "v1"), str(refs["root"] / "v2")
    async with EngineClient([e.url], retries=0, lora_path="policy") as c:
        await c.unload_lora_adapter("policy", missing_ok=True)
        await c.unload_lora_adapter("policy", missing_ok=True)  # not loaded: ignored
        with pytest.raises(EngineError, match="LoRA with name policy does not exist"):
            await c.unload_lora_adapter("policy")
        with pytest.raises(EngineError, match="is not an existing directory"):
            await c.load_lora_adapter("policy", "/no/such/adapter")
        await c.load_lora_adapter("policy", v2)
        out = await c.generate(refs["prompts"][1], {"max_new_tokens": N, "temperature": 0,
                                                    "ignore_eos": True})
        assert out.output_ids == refs["v2"][1]
        await c.unload_lora_adapter("policy")
        await c.load_lora_adapter("policy", v1)


def hostile_adapters(root: Path, good: Path) -> dict[str, Path]:
    """Adapter directories the engine must refuse, by a phrase its message holds."""
    from safetensors.torch import load_file, save_file

    config = json.loads((good / lora.CONFIG_FILE).read_text())
    tensors = load_file(str(good / lora.WEIGHTS_FILE))
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"  # merged last
    assert key in tensors
    out: dict[str, Path] = {}

    def variant(why: str, cfg: dict | None = None, ts: dict | None = None,
                raw_config: bytes | None = None) -> None:
        d = root / f"case{len(out)}"
        d.mkdir(parents=True)
        if raw_config is not None:
            (d / lora.CONFIG_FILE).write_bytes(raw_config)
        else:
            (d / lora.CONFIG_FILE).write_text(json.dumps(config | (cfg or {})))
        if ts is not None:
            save_file(ts, str(d / lora.WEIGHTS_FILE))
        out[why] = d

    out["is not an existing directory"] = root / "no-such-dir"
    variant("reads no pickle", ts=None)
    torch.save(tensors, out["reads no pickle"] / "adapter_model.bin")
    variant("not valid JSON", raw_config=b"{r: 8", ts=tensors)
    variant("r must be a positive integer", {"r": 0}, tensors)
    variant("larger than --max-lora-rank", {"r": 16}, tensors)
    variant("use_dora", {"use_dora": True}, tensors)
    variant("modules_to_save", {"modules_to_save": ["lm_head"]}, tensors)
    variant("bias", {"bias": "all"}, tensors)
    variant("fan_in_fan_out", {"fan_in_fan_out": True}, tensors)
    variant("rank_pattern", {"rank_pattern": {"q_proj": 4}}, tensors)
    variant("lora_alpha must be a finite number", {"lora_alpha": "16"}, tensors)
    variant("is not a LoRA factor", None, tensors | {"base_model.model.evil": torch.zeros(1)})
    variant("is not a Linear module", None, tensors | {
        "base_model.model.model.norm.lora_A.weight": torch.zeros(8, 64)})
    variant("is not in --lora-target-modules", None, tensors | {
        "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight": torch.zeros(8, 64),
        "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight": torch.zeros(64, 8)})
    variant("shape [64, 4]", None, tensors | {key: torch.zeros(64, 4)})
    variant("is not a floating type", None, tensors | {key: torch.zeros(64, 8, dtype=torch.int32)})
    nan = tensors[key].clone()
    nan[3, 3] = math.nan
    variant("not finite", None, tensors | {key: nan})
    variant("lora_B.weight is missing", None, {k: v for k, v in tensors.items() if k != key})
    variant("no LoRA factors", None, {})
    d = root / "garbage"
    d.mkdir()
    (d / lora.CONFIG_FILE).write_text(json.dumps(config))
    (d / lora.WEIGHTS_FILE).write_bytes(b"\xff" * 64)
    out["cannot be read"] = d
    return out


def test_engine_without_lora_refuses_as_sglang(engine):
    status, reply = engine.post("/load_lora_adapter", {"lora_name": "p", "lora_path": "/x"})
    assert status == 400 and reply == {
        "rid": None, "http_worker_ipc": None, "success": False,
        "error_message": lora.NOT_ENABLED, "loaded_adapters": None}
    status, reply = engine.post("/generate", {"input_ids": [5, 6], "lora_path": "p",
                                              "sampling_params": {"max_new_tokens": 1}})
    assert status == 400
    assert "was requested, but LoRA is not enabled" in reply["error"]["message"]


@pytest.mark.parametrize("rslora", [False, True])
def test_merge_and_restore_in_process(tmp_path, rslora):
    """read_adapter + merge equal peft's own merge; restore gives the base back bit for bit."""
    peft_model = make_adapter(tmp_path / "a", 5, r=4, alpha=8, rslora=rslora)
    model, _ = build_tiny("tiny")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = lora.LoRAState(enabled=True, max_rank=8, target_modules=None)
    adapter = lora.read_adapter("a", str(tmp_path / "a"), model, max_rank=8, target_modules=None)
    assert adapter.scale == (8 / math.sqrt(4) if rslora else 8 / 4)
    with torch.no_grad():
        state.merge(model, adapter)
        merged = peft_model.merge_and_unload().state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, merged[k], rtol=1e-5, atol=1e-6)
    state.restore(model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_lora_paths_forms():
    assert lora.parse_lora_paths(["policy=/a/b", "/c", '{"lora_name": "x", "lora_path": "/y"}']) \
        == [("policy", "/a/b"), ("/c", "/c"), ("x", "/y")]
    with pytest.raises(lora.LoRAError, match="lora_name"):
        lora.parse_lora_paths(['{"lora_path": "/y"}'])
