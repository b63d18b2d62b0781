"""The sampler and sampling_params validation, in-process (no server)."""

from __future__ import annotations

import pytest
import torch

from rollmesh.algorithms.logits import token_logprobs
from rollmesh.engine.builtin.sampling import (
    BadRequest,
    SamplingParams,
    parse_sampling_params,
    process_logits,
    sample,
    sample_rows,
)


def _params(**kw) -> SamplingParams:
    return parse_sampling_params(kw, vocab_size=100)


def test_parse_defaults_nulls_and_normalisation():
    p = _params()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k) == (128, 1.0, 1.0, -1)
    p = _params(temperature=None, stop="###", min_p=0.1, stream_interval=4, json_schema=None)
    assert p.temperature == 1.0 and p.stop == ["###"] and p.min_p == 0.1
    for bad in ({"ignore_eos": 1}, {"max_new_tokens": 2.5}, {"max_new_tokens": True},
                {"stop": [""]}, {"top_k": -2}, {"min_p": 2}, {"frequency_penalty": 2.5},
                {"presence_penalty": -3}, {"repetition_penalty": 0}, {"repetition_penalty": 2.1},
                {"n": 0}, {"logit_bias": {"100": 1.0}}, {"logit_bias": {"x": 1.0}},
                {"logit_bias": [1]}, {"logit_bias": {"3": "big"}}, {"custom_params": 3},
                {"regex": "a+"}, {"stop_regex": "x+"}, {"beam_width": 4}, {"watermark": True},
                {"choice": ["a", "b"]}):
        with pytest.raises(BadRequest):
            parse_sampling_params(bad, vocab_size=100)
    p = _params(stop_regex=None, beam_width=1, watermark=False, choice=[])  # neutral: fine
    p = _params(n=4, repetition_penalty=1.3, frequency_penalty=-0.5, presence_penalty=2,
                logit_bias={"7": -1.5}, custom_params={"thinking_budget": 10})
    assert (p.n, p.repetition_penalty, p.logit_bias) == (4, 1.3, {7: -1.5})
    assert p.custom_params == {"thinking_budget": 10}


def test_greedy_rows_take_the_argmax_with_the_raw_log_softmax():
    logits = torch.randn(3, 50)
    gen = torch.Generator().manual_seed(0)
    tokens, logprobs = sample(logits, [_params(temperature=0)] * 3, [None] * 3, gen)
    assert tokens == logits.argmax(-1).tolist()
    want = torch.log_softmax(logits, -1).max(-1).values
    assert torch.allclose(torch.tensor(logprobs), want)


def test_mixed_batch_greedy_and_sampled_rows():
    logits = torch.randn(4, 50)
    params = [_params(temperature=0), _params(temperature=0.8, top_k=5), _params(temperature=0),
              _params(temperature=1.0, top_p=0.5)]
    tokens, logprobs = sample(logits, params, [None] * 4, torch.Generator().manual_seed(1))
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    assert tokens[1] in (logits[1] / 0.8).topk(5).indices.tolist()
    # Reported: the temperature-scaled distribution over the whole vocabulary (SGLang's).
    assert abs(logprobs[1] - float(torch.log_softmax(logits[1] / 0.8, -1)[tokens[1]])) < 1e-5
    assert abs(logprobs[3] - float(torch.log_softmax(logits[3], -1)[tokens[3]])) < 1e-5


def test_top_k_one_is_greedy_and_reports_the_unfiltered_log_prob():
    logits = torch.randn(2, 30)
    tokens, logprobs = sample(logits, [_params(top_k=1, temperature=0.5)] * 2, [None] * 2,
                              torch.Generator().manual_seed(2))
    assert tokens == logits.argmax(-1).tolist()
    want = torch.log_softmax(logits / 0.5, -1).max(-1).values
    assert torch.allclose(torch.tensor(logprobs), want)


@pytest.mark.parametrize(("temperature", "top_p", "top_k"),
                         [(1.0, 0.5, -1), (0.7, 1.0, 5), (0.7, 0.5, 5), (1.3, 0.9, 20)])
def test_log_probs_equal_the_trainers_recomputation(temperature, top_p, top_k):
    """The behaviour log-probs are what the trainer's token_logprobs computes from the same
    logits and temperature, whatever top-p / top-k filtered the draw."""
    logits = torch.randn(64, 300) * 3
    params = [_params(temperature=temperature, top_p=top_p, top_k=top_k)] * 64
    tokens, logprobs = sample(logits, params, [None] * 64, torch.Generator().manual_seed(5))
    trainer = token_logprobs(logits, torch.tensor(tokens), temperature)
    assert torch.allclose(torch.tensor(logprobs), trainer, atol=1e-5, rtol=0)
    # ...and the draws stayed inside the filter.
    if top_k > 0:
        allowed = (logits / temperature).topk(top_k, dim=-1).indices
        assert all(t in row for t, row in zip(tokens, allowed.tolist()))


def test_penalties_and_logit_bias_follow_sglang():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    rep = _params(repetition_penalty=2.0)
    freq = _params(frequency_penalty=0.5, presence_penalty=0.25, logit_bias={"2": 4.0})
    out = process_logits(logits, [rep, freq], outputs=[[0, 1, 1], [0, 0, 3]])
    # repetition: positive logits of seen tokens halved, negative ones doubled; unseen untouched
    assert out[0].tolist() == [1.0, -2.0, 0.5, 3.0]
    # frequency * count + presence * seen subtracted; logit_bias added
    assert out[1].tolist() == [2.0 - 1.0 - 0.25, -1.0, 4.5, 3.0 - 0.5 - 0.25]
    assert logits[0].tolist() == [2.0, -1.0, 0.5, 3.0], "the model's logits are not modified"
    # Greedy on the penalised logits, with their log-prob.
    s = sample_rows(logits[:1], [_params(temperature=0, repetition_penalty=2.0)], [None],
                    torch.Generator().manual_seed(0), outputs=[[3]])
    assert s.tokens == [0]
    assert abs(s.logprobs[0] - float(torch.log_softmax(torch.tensor([2.0, -1, 0.5, 1.5]), 0)[0])
               ) < 1e-6


def test_top_logprobs_are_sorted_and_from_the_reported_distribution():
    logits = torch.randn(3, 40)
    s = sample_rows(logits, [_params(temperature=0), _params(temperature=0.5), _params()],
                    [None] * 3, torch.Generator().manual_seed(6), top_logprobs=[4, 2, 0])
    assert [len(t) for t in s.top] == [4, 2, 0]
    assert s.top[0][0] == (s.logprobs[0], s.tokens[0])  # greedy: the sampled token leads
    for row, temp, top in ((0, 1.0, s.top[0]), (1, 0.5, s.top[1])):
        want = torch.log_softmax(logits[row] / temp, -1).topk(len(top))
        assert [t for _, t in top] == want.indices.tolist()
        assert torch.allclose(torch.tensor([v for v, _ in top]), want.values)


def test_samples_follow_the_reported_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -8.0]]).repeat(20000, 1)
    params = [_params(temperature=0.9)] * len(logits)
    tokens, logprobs = sample(logits, params, [None] * len(logits),
                              torch.Generator().manual_seed(3))
    freq = torch.bincount(torch.tensor(tokens), minlength=5).float() / len(tokens)
    want = torch.softmax(logits[0] / 0.9, -1)
    assert torch.allclose(freq, want, atol=0.012)
    for t, lp in zip(tokens[:50], logprobs[:50]):
        assert abs(lp - float(torch.log(want[t]))) < 1e-5


def test_a_row_generator_makes_its_sample_independent_of_the_batch():
    logits = torch.randn(3, 200)
    p = _params(temperature=1.0, sampling_seed=7)

    def row_sample(batch_logits, row):
        gens = [None] * len(batch_logits)
        gens[row] = torch.Generator().manual_seed(7)
        return sample(batch_logits, [p] * len(batch_logits), gens,
                      torch.Generator().manual_seed(row + 10))[0][row]

    alone = row_sample(logits[1:2], 0)
    assert row_sample(logits, 1) == alone


def test_banned_tokens_are_never_sampled():
    logits = torch.zeros(500, 4)
    logits[:, 3] = 5.0
    tokens, _ = sample(logits, [_params()] * 500, [None] * 500, torch.Generator().manual_seed(4),
                       banned=[[3]] * 500)
    assert 3 not in tokens
