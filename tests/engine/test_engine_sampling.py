"""The sampler and sampling_params validation, in-process (no server)."""

from __future__ import annotations

import pytest
import torch

from rollmesh.engine.sampling import BadRequest, SamplingParams, parse_sampling_params, sample


def _params(**kw) -> SamplingParams:
    return parse_sampling_params(kw, vocab_size=100)


def test_parse_defaults_nulls_and_normalisation():
    p = _params()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k) == (128, 1.0, 1.0, -1)
    p = _params(temperature=None, stop="###", min_p=0.1, stream_interval=4, json_schema=None)
    assert p.temperature == 1.0 and p.stop == ["###"] and p.min_p == 0.1
    for bad in ({"ignore_eos": 1}, {"max_new_tokens": 2.5}, {"max_new_tokens": True},
                {"stop": [""]}, {"top_k": -2}, {"min_p": 2}, {"frequency_penalty": 0.5}):
        with pytest.raises(BadRequest):
            parse_sampling_params(bad, vocab_size=100)


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
    top5 = torch.log_softmax((logits[1] / 0.8).topk(5).values, -1)
    rank = (logits[1] / 0.8).topk(5).indices.tolist().index(tokens[1])
    assert abs(logprobs[1] - float(top5[rank])) < 1e-5


def test_top_k_one_is_greedy_with_log_prob_zero():
    logits = torch.randn(2, 30)
    tokens, logprobs = sample(logits, [_params(top_k=1)] * 2, [None] * 2,
                              torch.Generator().manual_seed(2))
    assert tokens == logits.argmax(-1).tolist() and logprobs == [0.0, 0.0]


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
