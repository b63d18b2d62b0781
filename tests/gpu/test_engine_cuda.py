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


# ---- the fast decode path (decoder.py) on CUDA, in process ----
def _fast_run(model, tok, prompts: list[list[int]], news: list[int], *, running: int,
              graphs: bool, before=None, buckets: bool | None = None):
    import threading

    from rollmesh.engine.builtin.sampling import SamplingParams
    from rollmesh.engine.builtin.scheduler import Request, Scheduler

    s = Scheduler(model, tok, weight_version="0", max_running_requests=running, seed=0,
                  decode_backend="fast", decode_graphs=graphs)
    assert s.fast is not None and s.fast.graphs == graphs
    if buckets is not None:
        s.fast.buckets = buckets
    reqs = [Request(rid=f"r{i}", input_ids=p, max_new_tokens=n, on_progress=lambda _r: None,
                    params=SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=n))
            for i, (p, n) in enumerate(zip(prompts, news))]
    done = threading.Semaphore(0)
    for r in reqs:
        r.on_progress = lambda r: r.finished and done.release()
    s.start()
    try:
        if before is not None:
            s.submit("call", before).result(timeout=120)
        s.add_all(reqs)
        for _ in reqs:
            while not done.acquire(timeout=0.5):
                assert s.alive(), f"the scheduler died: {s.fatal!r}"
    finally:
        s.submit("shutdown").result(timeout=60)
    return s, reqs


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 2000, (5 + 3 * i,), generator=g).tolist() for i in range(n)]


def _generate_n(model, prompt: list[int], n: int) -> list[int]:
    gen = model.generation_config.__class__(do_sample=False, max_new_tokens=n, min_new_tokens=0,
                                            eos_token_id=None, pad_token_id=0)
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = model.generate(ids, generation_config=gen, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


def test_fast_path_cuda_graphs_equal_generate_float32():
    """Graphs captured per batch bucket, requests joining and leaving (3 slots for 6
    requests of different lengths): each one's tokens equal generate's on it alone."""
    model, tok = build_tiny("tiny:hidden=128,layers=4,heads=4,kv_heads=2")
    model = model.to("cuda")
    prompts, news = _prompts(6), [20, 7, 33, 12, 25, 9]
    s, reqs = _fast_run(model, tok, prompts, news, running=3, graphs=True)
    assert s.fast._graphs, "no CUDA graph was captured"
    for r, p, n in zip(reqs, prompts, news):
        assert r.output_ids == _generate_n(model, p, n), r.rid


def test_fast_path_cuda_graphs_bfloat16_match_eager():
    """bfloat16 (the engine's default on a GPU): the graphs replay the eager step's kernels
    (the eager run padded to the same buckets, so every shape is the same), so both give the
    same tokens; and every log-prob is a finite log-probability."""
    model, tok = build_tiny("tiny:hidden=128,layers=4,heads=4,kv_heads=2")
    model = model.to("cuda", torch.bfloat16)
    prompts, news = _prompts(5), [16, 30, 8, 21, 12]
    _, graphed = _fast_run(model, tok, prompts, news, running=4, graphs=True)
    _, eager = _fast_run(model, tok, prompts, news, running=4, graphs=False, buckets=True)
    for a, b, n in zip(graphed, eager, news):
        assert len(a.output_ids) == n
        assert a.output_ids == b.output_ids, a.rid
        assert all(lp <= 0.0 and lp == lp for lp in a.output_logprobs)


def test_fast_path_cuda_graphs_follow_a_weight_load():
    """New weights copied in place (weights_changing first, as the weight routes do): the
    captured graphs read the refreshed fused copies, so the output equals generate with the
    NEW weights."""
    from rollmesh.models.loading import build_tiny as build

    model, tok = build("tiny:hidden=128,layers=4,heads=4,kv_heads=2")
    new, _ = build("tiny:hidden=128,layers=4,heads=4,kv_heads=2,seed=5")
    model, new = model.to("cuda"), new.to("cuda")
    prompts, news = _prompts(3), [14, 14, 14]
    s, _ = _fast_run(model, tok, prompts, news, running=4, graphs=True)

    def load(sched) -> None:
        # Capture graphs on the old weights first, in this very scheduler.
        from rollmesh.engine.builtin.sampling import SamplingParams
        from rollmesh.engine.builtin.scheduler import Request

        warm = Request(rid="warm", input_ids=prompts[0], max_new_tokens=4,
                       on_progress=lambda _r: None,
                       params=SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=4))
        sched.waiting.append(warm)
        sched._admit()
        while sched.running:
            sched._decode_step()
        assert sched.fast._graphs
        sched.weights_changing()
        with torch.no_grad():
            for p, q in zip(model.parameters(), new.parameters()):
                p.copy_(q)

    _, after = _fast_run(model, tok, prompts, news, running=4, graphs=True, before=load)
    for r, p, n in zip(after, prompts, news):
        assert r.output_ids == _generate_n(new, p, n), r.rid
