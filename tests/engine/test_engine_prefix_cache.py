"""The prompt prefilled once: requests for the same prompt (a GRPO group) share one prefill, in
the same admission or later through the prefix cache, and generate exactly what they generate
with sharing off (`--disable-radix-cache`); the cache's radix tree counts each token once, keeps
its budget, and is emptied by /flush_cache and by every weight update."""

from __future__ import annotations

import threading

import pytest
import torch

from rollmesh.engine.builtin.kvcache import PrefixCache
from rollmesh.engine.builtin.sampling import SamplingParams
from rollmesh.engine.builtin.scheduler import Request, Scheduler

LOGPROB_TOL = 1e-4  # float32: another forward shape, another summation order


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 2000, (n,), generator=g).tolist()


def _request(rid: str, ids: list[int], *, seed: int | None = None, greedy: bool = False,
             new: int = 16, logprob_start: int | None = None, top: int = 0) -> Request:
    params = SamplingParams(temperature=0.0 if greedy else 1.0, sampling_seed=seed,
                            ignore_eos=True, max_new_tokens=new)
    r = Request(rid=rid, input_ids=ids, params=params, max_new_tokens=new,
                on_progress=lambda _r: None)
    r.logprob_start, r.top_logprobs_num = logprob_start, top
    return r


class Running:
    """A scheduler thread on the test's model; `run` submits waves of requests, each wave at
    once (admitted together) and finished before the next."""

    def __init__(self, tiny, prefix_cache_tokens: int | None) -> None:
        model, tok = tiny
        self.s = Scheduler(model, tok, weight_version="0", max_running_requests=64, seed=0,
                           prefix_cache_tokens=prefix_cache_tokens)
        self.s.start()

    def run(self, *waves: list[Request]) -> list[Request]:
        for wave in waves:
            done = threading.Semaphore(0)
            for r in wave:
                r.on_progress = lambda r, done=done: r.finished and done.release()
            self.s.add_all(wave)
            for _ in wave:
                while not done.acquire(timeout=0.2):
                    assert self.s.alive(), f"the scheduler died: {self.s.fatal!r}"
        return [r for wave in waves for r in wave]

    def stop(self) -> None:
        self.s.submit("shutdown").result(timeout=30)


@pytest.fixture
def schedulers(tiny):
    started: list[Running] = []

    def make(prefix_cache_tokens: int | None) -> Running:
        started.append(Running(tiny, prefix_cache_tokens))
        return started[-1]

    yield make
    for r in started:
        r.stop()


def _same_generation(shared: list[Request], alone: list[Request]) -> None:
    for a, b in zip(shared, alone, strict=True):
        assert a.finish_reason == b.finish_reason, a.rid
        assert a.output_ids == b.output_ids, a.rid
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=LOGPROB_TOL), a.rid
        assert len(a.input_logprobs) == len(b.input_logprobs), a.rid
        assert a.input_logprobs[1:] == pytest.approx(b.input_logprobs[1:], abs=LOGPROB_TOL)
        assert len(a.input_top_logprobs) == len(b.input_top_logprobs), a.rid
        assert [len(t) for t in a.output_top_logprobs] == [len(t) for t in b.output_top_logprobs]
        for x, y in zip(a.input_top_logprobs[1:], b.input_top_logprobs[1:]):
            assert [t for _, t in x] == [t for _, t in y]


def _grpo_waves(prompt: list[int]) -> tuple[list[Request], list[Request]]:
    """A group of 8 for one prompt: 3 arrive together (one prefill row, copied), then 5 more
    (found in the cache); greedy and sampled with per-request seeds."""
    first = [_request("g0", prompt, seed=0), _request("g1", prompt, seed=1),
             _request("g2", prompt, greedy=True)]
    later = [_request(f"g{k}", prompt, seed=k) for k in range(3, 7)]
    later.append(_request("g7", prompt, greedy=True, logprob_start=len(prompt) - 1, top=2))
    return first, later


@pytest.mark.parametrize("budget", [65536, 0])
def test_a_group_is_prefilled_once_and_generates_what_it_does_alone(schedulers, budget):
    prompt = _ids(300, seed=1)
    shared_engine, alone_engine = schedulers(budget), schedulers(None)
    shared = shared_engine.run(*_grpo_waves(prompt))
    alone = alone_engine.run(*_grpo_waves(prompt))
    _same_generation(shared, alone)
    assert len({tuple(r.output_ids) for r in shared if r.params.sampling_seed is not None}) == 6

    s, a = shared_engine.s.stats(), alone_engine.s.stats()
    assert a["prefill_tokens"] == 8 * len(prompt) and a["cached_prompt_tokens"] == 0
    assert [r.cached_tokens for r in alone] == [0] * 8
    if budget:  # the later five found all but the last token cached: they joined the batch
        # with the cached KV, their last prompt token run by the next decode step
        assert s["prefill_tokens"] == len(prompt) + 5 and s["prefill_forwards"] == 1
        assert [r.cached_tokens for r in shared] == [0] + [len(prompt) - 1] * 7
        assert s["prefix_cache_tokens"] == len(prompt)
    else:  # no cache: each wave prefilled the prompt once
        assert s["prefill_tokens"] == 2 * len(prompt)
        assert [r.cached_tokens for r in shared] == [0, 299, 299, 0, 299, 299, 299, 299]
        assert s["prefix_cache_tokens"] == 0
    assert s["cached_prompt_tokens"] == sum(r.cached_tokens for r in shared)


def test_partial_prefixes_and_input_logprobs_match_a_full_prefill(schedulers):
    """Rows of one prefill forward with cached prefixes of different lengths (left-padded
    past), and requests asking input log-probs from a position before the cached end."""
    a, tail = _ids(60, seed=2), _ids(6, seed=3)

    def waves() -> list[list[Request]]:
        return [[_request("a", a, greedy=True)],
                [_request("a+t", a + tail, seed=1),  # 60 cached, 6 to prefill
                 _request("t", tail, greedy=True),  # nothing cached, 6 to prefill
                 _request("a25+t", a[:25] + tail, seed=2),  # 25 cached, 6 to prefill
                 _request("a+t logprobs", a + tail[:3] + tail, seed=3, logprob_start=10,
                          top=3)]]  # matches 10 tokens only: 59 to prefill

    shared_engine, alone_engine = schedulers(65536), schedulers(None)
    shared = shared_engine.run(*waves())
    alone = alone_engine.run(*waves())
    _same_generation(shared, alone)
    assert [r.cached_tokens for r in shared] == [0, 60, 0, 25, 10]
    # a, then one forward for the three 6-token rest, one for the 59
    assert shared_engine.s.stats()["prefill_forwards"] == 3
    assert len(shared[-1].input_logprobs) == len(a) + 9 - 10 and shared[-1].input_logprobs[1]
    # each token once: a, t, and the three tails that part from a's path (edges split)
    assert shared_engine.s.stats()["prefix_cache_tokens"] == 60 + 6 + 6 + 6 + 6


def test_a_small_cache_evicts_and_still_generates_the_same(schedulers):
    prompts = [_ids(40, seed=10 + i) for i in range(4)]

    def waves() -> list[list[Request]]:
        return [[_request(f"p{i}-{k}", p, seed=k) for k in range(2)] for i, p in
                enumerate(prompts)] + [[_request("p0-again", prompts[0], seed=9)]]

    shared_engine, alone_engine = schedulers(100), schedulers(None)
    shared = shared_engine.run(*waves())
    alone = alone_engine.run(*waves())
    _same_generation(shared, alone)
    s = shared_engine.s.stats()
    assert s["prefix_cache_tokens"] <= 100
    # p0 goes for p2, p1 for p3, p2 for p0 again (p0, the least recently used, was gone)
    assert s["prefix_cache_evicted_tokens"] == 3 * 40
    assert shared[-1].cached_tokens == 0


def test_flush_empties_the_cache_and_refuses_while_requests_are_pending(schedulers):
    engine = schedulers(65536)
    prompt = _ids(30, seed=4)
    engine.run([_request("x", prompt)])
    assert engine.s.stats()["prefix_cache_tokens"] == 30
    slow = _request("slow", prompt, new=200)
    engine.s.add(slow)
    assert engine.s.submit("flush").result(timeout=30) is False  # pending: SGLang refuses
    engine.s.abort("slow")
    assert engine.s.submit("flush").result(timeout=30) is True
    assert engine.s.stats()["prefix_cache_tokens"] == 0
    assert engine.run([_request("y", prompt)])[0].cached_tokens == 0
    assert engine.s.stats()["prefix_cache_tokens"] == 30
    engine.s.submit("call", lambda s: s.weights_changing()).result(timeout=30)
    assert engine.s.stats()["prefix_cache_tokens"] == 0


# ---- the radix tree alone ----
def _kv(ids: list[int], layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """KV whose every entry names its token (keys) and layer (values): what `match` returns
    shows which tokens it holds."""
    keys = torch.tensor(ids, dtype=torch.float32)[None, :, None].expand(2, len(ids), 3)
    return [(keys.clone(), torch.full((2, len(ids), 3), float(layer))) for layer in
            range(layers)]


def _tokens_of(kv) -> list[int]:
    return [int(x) for x in kv[0][0][0, :, 0]]


def test_radix_tree_shares_prefixes_splits_and_evicts_least_recently_used():
    cache = PrefixCache(max_tokens=30)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    b = [1, 2, 3, 4, 5, 6, 20, 21, 22, 23]  # shares 6 with a
    cache.insert(a, _kv(a))
    cache.insert(b, _kv(b))
    assert cache.tokens == 14  # the shared 6 counted once
    n, kv = cache.match(b, limit=9)
    assert n == 9 and _tokens_of(kv) == b[:9] and float(kv[1][1][0, 0, 0]) == 1.0
    n, kv = cache.match(a + [99], limit=11)
    assert n == 10 and _tokens_of(kv) == a
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 50], limit=8)[0] == 7  # inside an edge
    assert cache.match([2, 3], limit=2) == (0, None)
    cache.insert(a[:4], _kv(a[:4]))  # a prefix of what is there: nothing new
    assert cache.tokens == 14

    # over budget: least recently used leaves go first (b's tail: a was matched after it)
    c = list(range(100, 120))
    cache.insert(c, _kv(c))
    assert cache.tokens == 30 and cache.evicted_tokens == 4
    assert cache.match(b, limit=10)[0] == 6 and cache.match(a, limit=10)[0] == 10
    d = list(range(200, 215))
    cache.insert(d, _kv(d))  # c, the least recently used, goes; a stays
    assert cache.tokens == 25 and cache.match(d, limit=15)[0] == 15
    assert cache.match(a, limit=10)[0] == 10
    assert cache.match(c, limit=20)[0] == 0
    cache.insert(list(range(300, 340)), _kv(list(range(300, 340))))  # larger than the budget
    assert cache.match(list(range(300, 340)), limit=40)[0] == 0 and cache.tokens <= 30
    cache.clear()
    assert cache.tokens == 0 and cache.match(d, limit=15) == (0, None)
    with pytest.raises(ValueError, match="prefix cache size"):
        PrefixCache(-1)


def test_disable_radix_cache_is_sglangs_flag_and_turns_sharing_off(tiny):
    from rollmesh.engine.builtin.server import EngineServer, _parser
    from rollmesh.engine.launch import check_builtin_args
    from rollmesh.runtime.log import get_logger

    model, tok = tiny
    check_builtin_args(["--disable-radix-cache"])  # engine.extra_args, as for SGLang
    check_builtin_args(["--prefix-cache-max-tokens", "0"])
    for argv, cache in ([], 65536), (["--disable-radix-cache"], None), \
            (["--prefix-cache-max-tokens", "512"], 512):
        args = _parser().parse_args(["--model", "tiny", "--port", "1", *argv])
        s = EngineServer(args, model, tok, get_logger("test")).scheduler
        assert (s.prefix_cache and s.prefix_cache.max_tokens) == cache
    with pytest.raises(SystemExit):
        _parser().parse_args(["--model", "tiny", "--port", "1", "--prefix-cache-max-tokens", "-1"])
