"""The fast decode path (decoder.py) against transformers: greedy output token for token equal
to `generate` on every supported architecture (Gemma2 stays on the HF path, chosen
automatically), requests joining and leaving mid-way, log-probs against HF's own logits, fresh
weights after a load, and the aten ops and host syncs one step costs."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# (as a package module: tests/helpers on sys.path would shadow the stdlib's `queue` with
# tests/helpers/queue.py in every process spawned later, and the two-rank pools hung)
from tests.helpers.hf_checkpoints import build_model, build_tokenizer  # noqa: E402

from rollmesh.engine.builtin.decoder import FastDecoder, unsupported_reason  # noqa: E402
from rollmesh.engine.builtin.sampling import SamplingParams  # noqa: E402
from rollmesh.engine.builtin.scheduler import Request, Scheduler  # noqa: E402

LOGPROB_TOL = 1e-4
FAMILIES = ["qwen2.5", "qwen3", "llama3.1", "gemma2"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    tok = build_tokenizer(request.param)
    return request.param, build_model(request.param, tok, tied=request.param == "qwen3"), tok


def _prompt(n: int, seed: int, vocab: int = 200) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (n,), generator=g).tolist()


def _run(model, tok, requests: list[Request], *, running: int = 64, backend: str = "auto",
         prefix_cache_tokens: int | None = 4096, before=None) -> Scheduler:
    s = Scheduler(model, tok, weight_version="0", max_running_requests=running, seed=0,
                  prefix_cache_tokens=prefix_cache_tokens, decode_backend=backend)
    s.start()
    try:
        if before is not None:
            s.submit("call", before).result(timeout=60)
        done = threading.Semaphore(0)
        for r in requests:
            r.on_progress = lambda r: r.finished and done.release()
        s.add_all(requests)
        for _ in requests:
            while not done.acquire(timeout=0.2):
                assert s.alive(), f"the scheduler died: {s.fatal!r}"
    finally:
        s.submit("shutdown").result(timeout=30)
    return s


def _greedy(rid: str, ids: list[int], new: int) -> Request:
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=new)
    return Request(rid=rid, input_ids=ids, params=params, max_new_tokens=new,
                   on_progress=lambda _r: None)


def _generate(model, ids: list[int], new: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=0,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _hf_logprobs(model, r: Request) -> list[float]:
    full = torch.tensor([r.input_ids + r.output_ids])
    logits = model(input_ids=full).logits[0].float()
    steps = torch.log_softmax(logits[len(r.input_ids) - 1 : -1], dim=-1)
    return steps.gather(1, torch.tensor(r.output_ids)[:, None])[:, 0].tolist()


def test_backend_choice(family_model):
    family, model, tok = family_model
    reason = unsupported_reason(model)
    assert (reason is None) == (family != "gemma2"), reason
    s = Scheduler(model, tok, weight_version="0", max_running_requests=4)
    assert (s.fast is not None) == (family != "gemma2")
    if family == "gemma2":
        with pytest.raises(ValueError, match="decode backend fast: model_type 'gemma2'"):
            Scheduler(model, tok, weight_version="0", max_running_requests=4,
                      decode_backend="fast")
    with pytest.raises(ValueError, match="decode backend must be"):
        Scheduler(model, tok, weight_version="0", max_running_requests=4, decode_backend="x")


def test_length_dependent_rope_stays_on_the_hf_path():
    tok = build_tokenizer("llama3.1")
    model = build_model("llama3.1", tok, tied=False)
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    assert unsupported_reason(model) == "rope_type 'dynamic'"


def test_greedy_equals_generate_joining_and_leaving(family_model):
    """Two slots for five requests of different lengths: requests join as others leave, and
    each one's tokens equal `generate` run on it alone; log-probs equal HF's log-softmax."""
    _, model, tok = family_model
    lengths = [(7, 12), (3, 20), (11, 5), (5, 16), (9, 9)]
    requests = [_greedy(f"r{i}", _prompt(n, i), new) for i, (n, new) in enumerate(lengths)]
    _run(model, tok, requests, running=2)
    for r, (_, new) in zip(requests, lengths):
        assert r.output_ids == _generate(model, r.input_ids, new), r.rid
        assert r.output_logprobs == pytest.approx(_hf_logprobs(model, r), abs=LOGPROB_TOL)


def test_bucketed_shapes_equal_generate():
    """The shapes CUDA graphs are captured with, run eagerly on CPU: the batch padded to a
    power of two (padded rows writing into the spare slot) and power-of-two attention
    windows; requests join and leave, and each equals generate."""
    tok = build_tokenizer("qwen2.5")
    model = build_model("qwen2.5", tok, tied=False)
    lengths = [(7, 30), (3, 9), (20, 14), (5, 3), (9, 22)]
    requests = [_greedy(f"r{i}", _prompt(n, 40 + i), new) for i, (n, new) in enumerate(lengths)]

    slot_rows: list[list[int]] = []

    def pad(s: Scheduler) -> None:
        s.fast.buckets = True
        step = s.fast.forward_step

        def recorded(*args):
            slot_rows.append(args[2].tolist())
            return step(*args)

        s.fast.forward_step = recorded

    s = _run(model, tok, requests, running=3, before=pad)
    assert slot_rows[0][3:] == [s.fast.kv.spare]  # 3 rows padded to 4: the spare slot
    for r, (_, new) in zip(requests, lengths):
        assert r.output_ids == _generate(model, r.input_ids, new), r.rid
        assert r.output_logprobs == pytest.approx(_hf_logprobs(model, r), abs=LOGPROB_TOL)


def test_greedy_batched_with_shared_prefix_joins(family_model):
    """A GRPO-like group (same prompt, prefix cache: later samples join with cached KV) in one
    batch with other prompts: every row equals `generate`."""
    _, model, tok = family_model
    group = _prompt(9, 100)
    # Admitted together: the group's prompt is prefilled once, copied into four slots.
    together = [_greedy(f"g{i}", group, 10) for i in range(4)] + [
        _greedy("o1", _prompt(4, 101), 14), _greedy("o2", _prompt(13, 102), 6)]
    # Then one at a time on one scheduler: later ones find the prompt in the prefix cache and
    # join the batch with the cached KV (no prefill forward).
    apart = [_greedy(f"h{i}", group, 10 + i) for i in range(3)]
    s = _run(model, tok, together)
    _run(model, tok, apart, running=2)
    assert s.prefill_forwards <= 3
    for r in together + apart:
        assert r.output_ids == _generate(model, r.input_ids, r.max_new_tokens), r.rid


def test_fast_path_follows_a_weight_load():
    """After new weights are copied in (in place, as the weight routes do, with
    weights_changing first) the fast path equals generate with the NEW weights."""
    tok = build_tokenizer("qwen2.5")
    model = build_model("qwen2.5", tok, tied=False, seed=0)
    new = build_model("qwen2.5", tok, tied=False, seed=1)
    ids = _prompt(8, 7)
    old_tokens = _generate(model, ids, 12)

    def load(s: Scheduler) -> None:
        s.weights_changing()
        with torch.no_grad():
            for p, q in zip(model.parameters(), new.parameters()):
                p.copy_(q)

    before = [_greedy("a", ids, 12)]
    s = _run(model, tok, before)  # warms a scheduler on the old weights: fused copies built
    assert s.fast is not None and before[0].output_ids == old_tokens
    after = [_greedy("b", ids, 12)]
    _run(model, tok, after, before=load)
    new_tokens = _generate(new, ids, 12)
    assert new_tokens != old_tokens  # else the test could not tell the weights apart
    assert after[0].output_ids == new_tokens


def test_fused_weights_rebuilt_without_the_hook():
    """A parameter changed in place without weights_changing still reaches the fast path (its
    version counter moves): a stale fused copy is never used."""
    tok = build_tokenizer("qwen2.5")
    model = build_model("qwen2.5", tok, tied=False, seed=0)
    fast = FastDecoder(model, slots=2)
    assert not fast.refresh()
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight.mul_(0.5)
    assert fast.refresh()
    q, k, _ = model.model.layers[1].self_attn.q_proj, model.model.layers[1].self_attn.k_proj, 0
    fused = fast.layers[1].qkv
    assert torch.equal(fused[q.weight.shape[0] : q.weight.shape[0] + k.weight.shape[0]],
                       k.weight)


def test_release_memory_then_decode_again():
    """After release_memory (fused copies, graphs and an idle slot cache dropped) the next
    requests rebuild them and still equal generate."""
    tok = build_tokenizer("qwen3")
    model = build_model("qwen3", tok, tied=True)
    ids = _prompt(10, 3)
    s = Scheduler(model, tok, weight_version="0", max_running_requests=4, seed=0)
    for _ in range(2):
        r = _greedy("a", ids, 9)
        with torch.inference_mode():
            s.waiting.append(r)
            s._admit()
            while s.running:
                s._decode_step()
        assert r.output_ids == _generate(model, ids, 9)
        s.fast.release_memory()
        assert s.fast.layers == [] and s.fast.kv.capacity == 16


class _Count(TorchDispatchMode):
    SYNCS = ("_local_scalar_dense", "item", "is_nonzero", "nonzero", "equal")

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func.__name__.split(".")[0] in self.SYNCS:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


def _count_steps(s: Scheduler, steps: int) -> _Count:
    counter = _Count()
    with torch.inference_mode(), counter:
        for _ in range(steps):
            s._decode_step()
    return counter


@pytest.mark.parametrize("batch", [1, 8])
def test_ops_and_syncs_per_step(batch):
    """The fast step's aten ops and host syncs per step, against the HF path's on the same
    batch (counted, not timed: figures for the benchmark's table)."""
    from rollmesh.models.loading import build_tiny

    model, tok = build_tiny("tiny")
    counts = {}
    for backend in ("fast", "hf"):
        s = Scheduler(model, tok, weight_version="0", max_running_requests=batch, seed=0,
                      decode_backend=backend)
        reqs = [_greedy(f"r{i}", _prompt(6 + i, i), 64) for i in range(batch)]
        with torch.inference_mode():
            s.waiting.extend(reqs)
            s._admit()
        counts[backend] = _count_steps(s, 4)
    fast, hf = counts["fast"], counts["hf"]
    print(f"batch {batch}: fast {fast.ops / 4:.0f} ops, {fast.syncs / 4:.1f} syncs per step; "
          f"hf {hf.ops / 4:.0f} ops, {hf.syncs / 4:.1f} syncs per step")
    # Eager on CPU the step is about as many ops as HF's (transformers 5's forward is lean;
    # what the fast path saves is the cache's growth by concatenation, and on CUDA the graph
    # makes the whole step one launch); it never reads a value back mid-step.
    assert fast.ops < hf.ops
    assert fast.syncs == 0 and hf.syncs >= 4


COMPILED_STEP = """
import torch
from rollmesh.engine.builtin.decoder import FastDecoder
from rollmesh.models.loading import build_tiny

model, _ = build_tiny("tiny")
fast = FastDecoder(model, slots=4)
kv = fast.kv
torch.manual_seed(0)
prompt_kv = [(torch.randn(fast.kv_heads, 6, fast.head_dim),
              torch.randn(fast.kv_heads, 6, fast.head_dim)) for _ in fast.layers]
for slot in range(3):
    kv.write(kv.take(), prompt_kv, 6)
fast._rope(64)
args = [torch.tensor([5, 9, 11]), torch.tensor([6, 6, 6]), torch.tensor([0, 1, 2]),
        torch.tensor([0.0, 0.7, 1.0]), torch.tensor([4, 100000, 100000]),
        torch.tensor([1.0, 0.9, 1.0]), torch.tensor([0.0, 0.0, 0.1]),
        torch.tensor([0.3, 0.6, 0.9], dtype=torch.float64)]
with torch.inference_mode():
    eager = fast.forward_step(*args, 16, 2)
    compiled = torch.compile(fast.forward_step, fullgraph=True)(*args, 16, 2)
assert torch.equal(eager[0], compiled[0]), (eager[0], compiled[0])
torch.testing.assert_close(eager[1], compiled[1], atol=1e-4, rtol=1e-4)
print("compiled step equals eager")
"""


@pytest.mark.slow
def test_compiled_step_equals_eager():
    """torch.compile(fullgraph=True) of the step traces without a graph break and gives the
    eager step's tokens (what CUDA-graph capture needs: no host sync, no Python branching on
    tensor values). In a process of its own, so that inductor's compile workers and caches stay
    out of the test process."""
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(repo), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-c", COMPILED_STEP], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "compiled step equals eager" in out.stdout, \
        out.stderr[-3000:]


def _sampled(rid: str, ids: list[int], new: int, **kw) -> Request:
    params = SamplingParams(**{"ignore_eos": True, **kw, "max_new_tokens": new})
    r = Request(rid=rid, input_ids=ids, params=params, max_new_tokens=new,
                on_progress=lambda _r: None)
    return r


def test_sampled_rows_logprobs_are_the_tempered_distribution():
    """Rows sampled inside the fast step (temperature, top-k, top-p, min-p): each chosen
    token's log-prob is HF's log_softmax(logits / T) at it (the unfiltered distribution, as
    sampling.py reports), and each token lies inside the row's top-k."""
    from rollmesh.models.loading import build_tiny

    model, tok = build_tiny("tiny")
    reqs = [_sampled("t", _prompt(6, 1), 12, temperature=0.7),
            _sampled("k", _prompt(9, 2), 12, temperature=1.3, top_k=3),
            _sampled("p", _prompt(4, 3), 12, temperature=1.0, top_p=0.8, min_p=0.05),
            _greedy("g", _prompt(7, 4), 12)]
    s = _run(model, tok, reqs)
    assert s.fast is not None
    for r in reqs:
        full = torch.tensor([r.input_ids + r.output_ids])
        logits = model(input_ids=full).logits[0, len(r.input_ids) - 1 : -1].float()
        t = r.params.temperature if not r.params.greedy else 1.0
        want = torch.log_softmax(logits / t, dim=-1)
        chosen = torch.tensor(r.output_ids)
        got = want.gather(1, chosen[:, None])[:, 0].tolist()
        assert r.output_logprobs == pytest.approx(got, abs=LOGPROB_TOL), r.rid
        if r.params.top_k > 0:
            top = logits.topk(r.params.top_k, dim=-1).indices
            assert (top == chosen[:, None]).any(dim=-1).all(), r.rid


def test_filter_and_draw_equal_sampling_py():
    """decoder._filter and its inverse-CDF draw are sampling.py's, row parameters as tensors:
    the same uniforms pick the same tokens."""
    from rollmesh.engine.builtin import sampling
    from rollmesh.engine.builtin.decoder import _filter

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g) * 3
    params = [SamplingParams(top_k=5), SamplingParams(top_p=0.7), SamplingParams(min_p=0.2),
              SamplingParams(top_k=40, top_p=0.9, min_p=0.01), SamplingParams()]
    want = sampling._filter(logits, params)
    got = _filter(logits, torch.tensor([p.top_k if p.top_k > 0 else 300 for p in params]),
                  torch.tensor([p.top_p for p in params]), torch.tensor([p.min_p for p in params]))
    assert torch.equal(torch.isinf(want), torch.isinf(got))
    u = torch.rand(5, 1, generator=g, dtype=torch.float64)
    shared = torch.Generator().manual_seed(1)
    ref = sampling._inverse_cdf(torch.log_softmax(want, -1), [None] * 5, [False] * 5, shared)
    cdf = torch.log_softmax(got, -1).exp().cumsum(-1, dtype=torch.float64)
    mine = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]
    shared = torch.Generator().manual_seed(1)
    u_ref = torch.rand(5, 1, generator=shared, dtype=torch.float64)
    mine_ref = torch.searchsorted(cdf, u_ref * cdf[:, -1:], right=True)[:, 0]
    assert torch.equal(ref, mine_ref)
    assert torch.isfinite(got.gather(1, mine[:, None])).all()


def test_general_sampler_rows_match_the_hf_path():
    """Rows the fused sampler cannot serve exactly (their own seed, penalties, min_new_tokens
    bans, top log-probs, logit_bias) go through sample_rows on the fast step's logits: the
    same tokens as the HF decode path gives them, with greedy and fused rows beside them."""
    from rollmesh.models.loading import build_tiny

    model, tok = build_tiny("tiny")

    def batch() -> list[Request]:
        top = _sampled("top", _prompt(5, 11), 10, temperature=0.0)
        top.top_logprobs_num = 3
        return [_sampled("seed", _prompt(6, 12), 10, temperature=0.9, sampling_seed=5),
                _sampled("pen", _prompt(7, 13), 10, temperature=0.0, repetition_penalty=1.5,
                         frequency_penalty=0.5),
                _sampled("min", _prompt(3, 14), 10, temperature=0.0, min_new_tokens=6,
                         ignore_eos=False),
                _sampled("bias", _prompt(8, 15), 10, temperature=0.0,
                         logit_bias={7: 50.0}),
                top, _greedy("g", _prompt(9, 16), 10)]

    fast, hf = batch(), batch()
    _run(model, tok, fast, backend="fast")
    _run(model, tok, hf, backend="hf")
    for a, b in zip(fast, hf):
        assert a.output_ids == b.output_ids, a.rid
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=LOGPROB_TOL), a.rid
        assert [[t for _, t in row] for row in a.output_top_logprobs] == \
            [[t for _, t in row] for row in b.output_top_logprobs], a.rid
    assert fast[3].output_ids.count(7) >= 9  # the bias reached the fast path's rows
