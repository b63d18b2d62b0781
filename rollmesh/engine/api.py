"""The /generate wire format of the built-in engine: request validation and response bodies.

Pure functions over JSON-like values (no HTTP, no threads), so the contract in
docs/sglang-contract.md can be checked field by field. A request the engine refuses raises
`BadRequest` with the message the client gets in `{"error": ...}` (HTTP 400).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from rollmesh.engine.sampling import BadRequest, parse_sampling_params
from rollmesh.engine.scheduler import Request


@dataclass(frozen=True)
class ModelLimits:
    context_length: int
    vocab_size: int


def _noop(_: Request) -> None:
    pass


def parse_generate(body: Any, limits: ModelLimits, tokenizer: Any) -> tuple[Request, bool]:
    """A validated scheduler Request and whether log-probs were asked for."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise BadRequest("exactly one of text or input_ids is required")
    if has_text:
        if not isinstance(body["text"], str):
            raise BadRequest("text must be a string (batched requests are not supported)")
        input_ids = tokenizer.encode(body["text"], add_special_tokens=False)
    else:
        input_ids = _token_ids(body["input_ids"], limits.vocab_size)
    if not input_ids:
        raise BadRequest("the prompt is empty")

    rid = body.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex
    elif not isinstance(rid, str):
        raise BadRequest("rid must be a string")
    for key in ("return_logprob", "stream"):
        if not isinstance(body.get(key, False), bool):
            raise BadRequest(f"{key} must be a boolean")
    if body.get("logprob_start_len", -1) not in (-1, None):
        raise BadRequest("logprob_start_len: the built-in engine returns output log-probs only "
                         "(logprob_start_len -1)")

    raw_params = body.get("sampling_params")
    if isinstance(raw_params, dict):
        for key, value in raw_params.items():
            # Python's json accepts NaN and Infinity (not JSON): a NaN temperature would pass
            # every range check (NaN < 0 is false) and sample from NaN probabilities.
            if isinstance(value, float) and not math.isfinite(value):
                raise BadRequest(f"sampling_params.{key} must be a finite number, got {value!r}")
    params = parse_sampling_params(raw_params, limits.vocab_size)
    prompt = len(input_ids)
    if prompt >= limits.context_length:
        raise BadRequest(f"The input ({prompt} tokens) is longer than the model's context "
                         f"length ({limits.context_length} tokens).")
    max_new = params.max_new_tokens
    if max_new is None:
        max_new = limits.context_length - prompt - 1
    if prompt + max_new >= limits.context_length:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of "
            f"{limits.context_length} tokens. You requested a total of {prompt + max_new} "
            f"tokens: {prompt} tokens from the input messages and {max_new} tokens for the "
            f"completion. Please reduce the number of tokens in the input messages or the "
            f"completion to fit within the limit."
        )
    request = Request(rid=rid, input_ids=input_ids, params=params, max_new_tokens=max_new,
                      on_progress=_noop, stream=body.get("stream", False))
    return request, body.get("return_logprob", False)


def _token_ids(value: Any, vocab_size: int) -> list[int]:
    if not isinstance(value, list):
        raise BadRequest("input_ids must be a list of token ids")
    if value and isinstance(value[0], list):
        raise BadRequest("batched input_ids are not supported: send one request per prompt")
    for t in value:
        if not isinstance(t, int) or isinstance(t, bool):
            raise BadRequest(f"input_ids: {t!r} is not an integer token id")
        if not 0 <= t < vocab_size:
            raise BadRequest(f"input_ids: token id {t} is outside the vocabulary [0, {vocab_size})")
    return list(value)


def generate_response(r: Request, return_logprob: bool, tokenizer: Any) -> dict[str, Any]:
    """SGLang's response body for `r`, complete or (streaming) so far."""
    output_ids = list(r.output_ids)
    n = len(output_ids)
    meta: dict[str, Any] = {
        "id": r.rid,
        "finish_reason": r.finish_reason,
        "prompt_tokens": len(r.input_ids),
        "completion_tokens": n,
        "cached_tokens": 0,
        "weight_version": r.weight_version,
        "e2e_latency": time.perf_counter() - r.received_at,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [
            [lp, t, None] for lp, t in zip(r.output_logprobs[:n], output_ids)
        ]
    return {"text": _text(r, output_ids, tokenizer), "output_ids": output_ids, "meta_info": meta}


def _text(r: Request, output_ids: list[int], tokenizer: Any) -> str:
    p, reason = r.params, r.finish_reason or {}
    matched = reason.get("matched") if reason.get("type") == "stop" else None
    ids = output_ids
    if isinstance(matched, int) and not p.no_stop_trim:
        ids = output_ids[:-1]  # the stop token is in output_ids, not in text
    text = tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
    if isinstance(matched, str) and not p.no_stop_trim:
        cut = text.find(matched)
        text = text[:cut] if cut >= 0 else text
    return text
