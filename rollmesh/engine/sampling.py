"""Sampling for the built-in engine: `sampling_params` validation and the batched sampler.

Validation follows SGLang 0.5.23: an unknown key is refused with `unknown field ...`; keys
SGLang knows but this engine does not implement are refused when set to a non-default value, so
that nothing is silently ignored that would change what is sampled.

Log-probs are those of the distribution actually sampled from: log-softmax, in float32, of the
logits after temperature, top-k, top-p and min-p (and the min_new_tokens stop-token mask).
At temperature 0 (greedy) the log-prob is the log-softmax of the raw logits: there is no sampled
distribution, and the raw one is what a teacher-forced forward pass reports.
"""

from __future__ import annotations

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

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def needs_filter(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)


# Keys SGLang accepts that change sampling and are not implemented here: allowed only unset.
_UNSUPPORTED = ("json_schema", "regex", "ebnf", "structural_tag", "custom_params", "logit_bias")
# Keys SGLang accepts that do not change what is sampled: accepted and ignored.
_IGNORED = ("stream_interval",)


def _number(key: str, value: Any, *, integer: bool = False) -> float | int:
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if not ok or isinstance(value, bool):
        kind = "an integer" if integer else "a number"
        raise BadRequest(f"sampling_params.{key} must be {kind}, got {value!r}")
    return value


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
            if value is not None:
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
    if p.n != 1:
        raise BadRequest("sampling_params.n: the built-in engine generates one sample per "
                         "request (n=1); send n requests instead")
    for key, default in (("repetition_penalty", 1.0), ("frequency_penalty", 0.0),
                         ("presence_penalty", 0.0)):
        if getattr(p, key) != default:
            raise BadRequest(f"sampling_params.{key}={getattr(p, key)} is not supported by the "
                             f"built-in engine (only the default {default})")


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
    logits = logits.float()
    if banned and any(banned):
        logits = logits.clone()
        for i, ids in enumerate(banned):
            if ids:
                logits[i, ids] = float("-inf")
    greedy = [p.greedy for p in params]
    if all(greedy):
        # Temperature 0: the raw distribution (see module docstring).
        raw = torch.log_softmax(logits, dim=-1)
        tokens = raw.argmax(dim=-1)
        return tokens.tolist(), raw.gather(1, tokens[:, None])[:, 0].tolist()

    device = logits.device
    scaled = logits
    if any(not g and p.temperature != 1.0 for p, g in zip(params, greedy)):
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        scaled = logits / torch.tensor(temps, device=device)[:, None]
    if any(p.needs_filter for p in params):
        scaled = _filter(scaled, params)
    logprobs = torch.log_softmax(scaled, dim=-1)
    tokens = _inverse_cdf(logprobs, generators, greedy, shared_generator)
    if any(greedy):
        rows = torch.tensor([i for i, g in enumerate(greedy) if g], device=device)
        raw = torch.log_softmax(logits[rows], dim=-1)
        tokens[rows] = raw.argmax(dim=-1)
        logprobs[rows] = raw
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()


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
