"""Sampling for the built-in engine: `sampling_params` validation and the batched sampler.

Validation follows SGLang (0.5.23, `python/sglang/srt/sampling/sampling_params.py`): an unknown key is
refused with `unknown field ...`; keys SGLang knows but this engine does not implement
(constrained decoding) are refused when set, so nothing is silently ignored that would change
what is sampled. `custom_params` is accepted and unused, as SGLang does without a custom logit
processor (it is the processor's argument and nothing else reads it); `stream_interval` only
paces streaming.

What a row's logits go through, in SGLang's order (`SamplingBatchInfo.apply_logits_bias`, then
`Sampler.forward`): frequency and presence penalties (subtracted, by the counts of the tokens
this request generated so far), the repetition penalty (positive logits divided by it, negative
ones multiplied, for tokens generated so far), the min_new_tokens mask of stop tokens,
`logit_bias` (added); then temperature; then top-k, top-p and min-p choose the tokens the sample
may come from.

Log-probs (the behaviour policy a trainer's importance ratio divides by) are SGLang's default
ones: log-softmax, in float32, of the penalised logits divided by the temperature, over the
WHOLE vocabulary: top-k, top-p and min-p decide which token is drawn but are not applied to the
reported log-prob (SGLang returns `log(softmax(logits / T))`, taken before its top-k/top-p
sampling kernel; the filtered log-prob is not returned). That is exactly what the trainer
recomputes (`rollmesh.algorithms.logits.token_logprobs(logits, tokens, temperature)`), so the
two agree token for token whatever top_p/top_k are. At temperature 0 (greedy) the log-prob is
the log-softmax of the (penalised) logits at temperature 1. Top log-probs
(`top_logprobs_num`) are read off the same distribution. Penalties and logit_bias depend on the
request, not on the model: a trainer that recomputes log-probs without them sees a different
distribution, so RL rollouts should leave them at their defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

GREEDY_EPS = 1e-5  # SGLang treats temperatures below ~1e-6 as greedy; so do we, a bit wider.


class BadRequest(ValueError):
    """A request this engine refuses (HTTP 400), with a message for the caller."""


@dataclass
class SamplingParams:
    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    min_new_tokens: int = 0
    sampling_seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    custom_params: dict[str, Any] | None = None  # accepted, unused (see module docstring)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def needs_filter(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    @property
    def penalised(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


# Keys SGLang (0.5.23) accepts that change sampling and are not implemented here: allowed only
# unset (null, or their neutral value), refused otherwise.
_UNSUPPORTED = {"json_schema": (), "regex": (), "ebnf": (), "structural_tag": (),
                "stop_regex": ("", []), "choice": ([],), "watermark": (False,),
                "beam_width": (0, 1)}
# Keys SGLang accepts that do not change what is sampled: accepted and ignored.
_IGNORED = ("stream_interval",)


def _number(key: str, value: Any, *, integer: bool = False) -> float | int:
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if not ok or isinstance(value, bool):
        kind = "an integer" if integer else "a number"
        raise BadRequest(f"sampling_params.{key} must be {kind}, got {value!r}")
    return value


def _logit_bias(value: Any, vocab_size: int) -> dict[int, float]:
    """SGLang's form: {"token id as a string": bias}; keys must be ids inside the vocabulary."""
    if not isinstance(value, dict):
        raise BadRequest("sampling_params.logit_bias must be an object {token_id: bias}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise BadRequest(f"sampling_params.logit_bias: key {key!r} is not a token id") from None
        if not 0 <= token < vocab_size:
            raise BadRequest(f"sampling_params.logit_bias must have keys in [0, {vocab_size - 1}]"
                             f", got {key!r}")
        bias = _number(f"logit_bias[{key!r}]", bias)
        if not math.isfinite(bias):
            raise BadRequest(f"sampling_params.logit_bias[{key!r}] must be a finite number, "
                             f"got {bias!r}")
        out[token] = float(bias)
    return out


def parse_sampling_params(raw: Any, vocab_size: int) -> SamplingParams:
    """Validate a request's `sampling_params` object; raise BadRequest naming the field."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params must be a JSON object")
    p = SamplingParams()
    known = set(SamplingParams.__dataclass_fields__)
    for key, value in raw.items():
        if key in _IGNORED:
            continue
        if key in _UNSUPPORTED:
            neutral = _UNSUPPORTED[key]
            if value is not None and not any(value == v and type(value) is type(v)
                                              for v in neutral):
                raise BadRequest(f"sampling_params.{key} is not supported by the built-in engine")
            continue
        if key not in known:
            raise BadRequest(f"unknown field {key!r} in sampling_params")
        if value is None:
            continue  # null = the default, as in SGLang
        if key in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                   "no_stop_trim"):
            if not isinstance(value, bool):
                raise BadRequest(f"sampling_params.{key} must be a boolean, got {value!r}")
        elif key == "stop":
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
                raise BadRequest(
                    "sampling_params.stop must be a non-empty string or a list of them")
        elif key == "stop_token_ids":
            if not isinstance(value, list):
                raise BadRequest("sampling_params.stop_token_ids must be a list of token ids")
            for t in value:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                    raise BadRequest(f"sampling_params.stop_token_ids: {t!r} is not a token id")
        elif key == "logit_bias":
            value = _logit_bias(value, vocab_size)
        elif key == "custom_params":
            if not isinstance(value, dict):
                raise BadRequest("sampling_params.custom_params must be a JSON object")
        elif key in ("max_new_tokens", "top_k", "n", "min_new_tokens", "sampling_seed"):
            value = _number(key, value, integer=True)
        else:
            value = float(_number(key, value))
        setattr(p, key, value)
    _check_ranges(p)
    return p


def _check_ranges(p: SamplingParams) -> None:
    if p.max_new_tokens is not None and p.max_new_tokens < 0:
        raise BadRequest(f"sampling_params.max_new_tokens must be >= 0, got {p.max_new_tokens}")
    if p.temperature < 0:
        raise BadRequest(f"sampling_params.temperature must be >= 0, got {p.temperature}")
    if not 0.0 < p.top_p <= 1.0:
        raise BadRequest(f"sampling_params.top_p must be in (0, 1], got {p.top_p}")
    if p.top_k == 0 or p.top_k < -1:
        raise BadRequest(
            f"sampling_params.top_k must be -1 (whole vocabulary) or >= 1, got {p.top_k}")
    if not 0.0 <= p.min_p <= 1.0:
        raise BadRequest(f"sampling_params.min_p must be in [0, 1], got {p.min_p}")
    if p.min_new_tokens < 0:
        raise BadRequest(f"sampling_params.min_new_tokens must be >= 0, got {p.min_new_tokens}")
    if p.n < 1:
        raise BadRequest(f"sampling_params.n must be >= 1, got {p.n}")
    # SGLang 0.5.23's ranges (SamplingParams.verify).
    if not 0.0 < p.repetition_penalty <= 2.0:
        raise BadRequest(f"sampling_params.repetition_penalty must be in (0, 2] (1.0 = no "
                         f"penalty), got {p.repetition_penalty}")
    for key in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= getattr(p, key) <= 2.0:
            raise BadRequest(f"sampling_params.{key} must be in [-2, 2], got {getattr(p, key)}")


@dataclass
class Sampled:
    """One sampler step: a token per row, its log-prob and (where asked) the row's top log-probs
    as (log-prob, token id) pairs, best first."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[float, int]]]


def process_logits(logits: torch.Tensor, params: list[SamplingParams],
                   outputs: list[list[int]] | None = None,
                   banned: list[list[int]] | None = None) -> torch.Tensor:
    """Float32 logits after penalties, the min_new_tokens mask and logit_bias (module docstring).

    `outputs[i]` is the tokens row i generated so far (penalties count them), `banned[i]` the
    token ids masked out of row i. Returns `logits` converted, a copy where anything changed.
    """
    logits = logits.float()
    changed = False

    def writable() -> torch.Tensor:
        nonlocal logits, changed
        if not changed:
            logits, changed = logits.clone(), True
        return logits

    vocab = logits.shape[-1]
    for i, p in enumerate(params):
        if not p.penalised or not outputs or not outputs[i]:
            continue
        out = writable()
        counts = torch.bincount(torch.tensor(outputs[i], device=out.device), minlength=vocab)
        counts = counts[:vocab].to(out.dtype)
        seen = counts > 0
        if p.frequency_penalty or p.presence_penalty:
            out[i] -= p.frequency_penalty * counts + p.presence_penalty * seen.to(out.dtype)
        if p.repetition_penalty != 1.0:
            row = out[i]
            scaled = torch.where(row < 0, row * p.repetition_penalty, row / p.repetition_penalty)
            out[i] = torch.where(seen, scaled, row)
    if banned and any(banned):
        out = writable()
        for i, ids in enumerate(banned):
            if ids:
                out[i, ids] = float("-inf")
    for i, p in enumerate(params):
        if p.logit_bias:
            out = writable()
            ids = torch.tensor(list(p.logit_bias), device=out.device)
            out[i, ids] += torch.tensor(list(p.logit_bias.values()), device=out.device)
    return logits


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    shared_generator: torch.Generator,
    banned: list[list[int]] | None = None,
) -> tuple[list[int], list[float]]:
    """Sample one token per row of `logits` [B, V]; return (token ids, their log-probs).

    `generators[i]` is row i's own generator (sampling_seed) or None to draw from
    `shared_generator`. `banned[i]` lists token ids masked out of row i (min_new_tokens).
    """
    s = sample_rows(logits, params, generators, shared_generator, banned=banned)
    return s.tokens, s.logprobs


def sample_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    shared_generator: torch.Generator,
    *,
    banned: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    top_logprobs: list[int] | None = None,
) -> Sampled:
    """`sample`, with penalties (`outputs`: each row's tokens so far) and `top_logprobs[i]` top
    log-probs of row i (0: none)."""
    logits = process_logits(logits, params, outputs, banned)
    greedy = [p.greedy for p in params]
    device = logits.device
    scaled = logits
    if any(not g and p.temperature != 1.0 for p, g in zip(params, greedy)):
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        scaled = logits / torch.tensor(temps, device=device)[:, None]
    # The reported distribution: temperature-scaled, unfiltered (module docstring).
    logprobs = torch.log_softmax(scaled, dim=-1)
    if all(greedy):
        tokens = logprobs.argmax(dim=-1)
    else:
        pool = _filter(scaled, params) if any(p.needs_filter for p in params) else scaled
        tokens = _inverse_cdf(torch.log_softmax(pool, dim=-1), generators, greedy,
                              shared_generator)
        if any(greedy):
            rows = torch.tensor([i for i, g in enumerate(greedy) if g], device=device)
            tokens[rows] = logprobs[rows].argmax(dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    return Sampled(tokens.tolist(), chosen.tolist(), top_pairs(logprobs, top_logprobs))


def top_pairs(logprobs: torch.Tensor,
              nums: list[int] | None) -> list[list[tuple[float, int]]]:
    """Row i's `nums[i]` largest log-probs as (log-prob, token id), best first ([] for 0)."""
    rows = logprobs.shape[0]
    if not nums or not any(nums):
        return [[] for _ in range(rows)]
    k = min(max(nums), logprobs.shape[-1])
    values, ids = logprobs.topk(k, dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [list(zip(values[i][:n], ids[i][:n])) for i, n in enumerate(nums)]


def _inverse_cdf(logprobs: torch.Tensor, generators: list[torch.Generator | None],
                 greedy: list[bool], shared: torch.Generator) -> torch.Tensor:
    """One uniform per row, looked up in the row's CDF (float64, so no bias worth naming).

    Several times cheaper than a Gumbel/exponential race, which draws one number per vocabulary
    entry. A row with its own generator depends only on its own distribution and seed, never on
    the rest of the batch.
    """
    rows = logprobs.shape[0]
    u = torch.rand(rows, 1, generator=shared, device=shared.device, dtype=torch.float64)
    for i, gen in enumerate(generators):
        if gen is not None and not greedy[i]:
            u[i] = torch.rand(1, generator=gen, device=gen.device, dtype=torch.float64)
    cdf = logprobs.exp().cumsum(dim=-1, dtype=torch.float64)
    # right=True and u scaled by the total: the chosen token always has probability > 0.
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]
    return index.clamp_(max=logprobs.shape[-1] - 1)  # u * total rounding up to total: 2**-53


def _filter(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask logits outside top-k, then top-p (renormalised after top-k), then min-p."""
    vocab = scaled.shape[-1]
    device = scaled.device
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    values, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)
    remove = ranks[None, :] >= top_k[:, None]
    probs = torch.softmax(values.masked_fill(remove, float("-inf")), dim=-1)
    # Keep a token while the mass before it is below top_p: the first token always stays.
    remove |= (probs.cumsum(dim=-1) - probs) > top_p[:, None]
    remove |= probs < min_p[:, None] * probs[:, :1]
    mask = torch.empty_like(remove).scatter_(1, order, remove)
    return scaled.masked_fill(mask, float("-inf"))
