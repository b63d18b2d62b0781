"""The /generate wire format of the built-in engine: request validation and response bodies.

Pure functions over JSON-like values (no HTTP, no threads), so SGLang's contract can be checked
field by field. A request the engine refuses raises `BadRequest` with the message the client
gets (HTTP 400).

Forms, as SGLang's `GenerateReqInput.normalize_batch_and_arguments` and the tokenizer manager's
`_handle_batch_request` define them:
- one prompt (`text` a string, `input_ids` a list of ints) and n = 1: one response object;
- a batch (`text` a list of strings, `input_ids` a list of lists), or n > 1: a JSON list of
  response objects, prompt-major (prompt 0's n samples, then prompt 1's, ...). A string `rid` of
  a batch becomes `rid_0`, `rid_1`, ... (one per response); a list of rids must have one per
  prompt, and with n > 1 each sample's id is `<that rid>_<k>` (SGLang gives every sample a
  fresh uuid instead; a prefix keeps /abort_request of the request's rid aborting them all);
- streamed batches: every event is one response object, with `index` (its place in the list).
Log-prob options (`logprob_start_len`, `top_logprobs_num`, `return_text_in_logprobs`) only
matter with `return_logprob`; without it they are ignored, as in SGLang.
"""

from __future__ import annotations

import itertools
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from rollmesh.engine.builtin.sampling import BadRequest, SamplingParams, parse_sampling_params
from rollmesh.engine.builtin.scheduler import Request

# GenerateReqInput fields this engine implements.
_FIELDS = {"text", "input_ids", "sampling_params", "rid", "stream", "return_logprob",
           "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "lora_path"}
# GenerateReqInput fields that do not change the answer here (metrics, scheduling priority,
# cache namespaces of a prefix cache this engine does not have, data-parallel routing).
_NO_EFFECT = {"log_metrics", "priority", "extra_key", "cache_salt", "data_parallel_rank",
              "routed_dp_rank", "no_logs", "custom_labels", "conversation_id"}
# GenerateReqInput fields that would change the answer and are not implemented: refused when set
# to anything but null/false/empty.
_REFUSED = ("input_embeds", "image_data", "video_data", "audio_data", "modalities",
            "token_ids_logprob", "return_hidden_states", "return_routed_experts",
            "return_entropy", "session_params", "lora_id",
            "custom_logit_processor", "bootstrap_host", "bootstrap_port", "bootstrap_room",
            "bootstrap_pair_key", "input_multi_ids", "require_reasoning", "background")

_group_ids = itertools.count()


MAX_REQUESTS_PER_CALL = 4096  # prompts times n in one call (`--max-requests-per-call`)
# A token's text is rarely longer than this many characters: a text prompt longer than
# context_length times it cannot fit, and is refused before the tokenizer spends minutes on it.
MAX_CHARS_PER_TOKEN = 64


@dataclass(frozen=True)
class ModelLimits:
    context_length: int
    vocab_size: int
    max_requests: int = MAX_REQUESTS_PER_CALL


@dataclass
class GenerateCall:
    """A parsed /generate body: its requests in response order, and how to answer."""

    requests: list[Request]
    batched: bool  # answer a JSON list (a batch, or n > 1), else one object
    stream: bool
    return_logprob: bool  # by any prompt (each request's own: logprob_start is not None)


def _noop(_: Request) -> None:
    pass


def parse_generate(body: Any, limits: ModelLimits, tokenizer: Any) -> tuple[Request, bool]:
    """One validated scheduler Request and whether log-probs were asked for (a body with one
    prompt and n = 1; batches and n > 1 go through `parse_generate_call`)."""
    call = parse_generate_call(body, limits, tokenizer)
    if call.batched:
        raise BadRequest("this route takes one prompt with n = 1")
    return call.requests[0], call.return_logprob


def parse_generate_call(body: Any, limits: ModelLimits, tokenizer: Any) -> GenerateCall:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _check_fields(body)
    prompts, batched = _prompts(body, limits, tokenizer)
    for key in ("stream", "return_text_in_logprobs"):
        if not isinstance(body.get(key) if body.get(key) is not None else False, bool):
            raise BadRequest(f"{key} must be a boolean")
    stream = bool(body.get("stream"))
    with_text = bool(body.get("return_text_in_logprobs"))
    params = _sampling_params(body.get("sampling_params"), len(prompts), batched, limits)
    n = params[0].n
    if any(p.n != n for p in params):
        raise BadRequest("sampling_params.n must be the same for every prompt of a batch")
    if len(prompts) * n > limits.max_requests:
        raise BadRequest(f"{len(prompts)} prompts times n = {n} is {len(prompts) * n} "
                         f"requests, over this engine's limit of {limits.max_requests} per call")
    batched = batched or n > 1
    # SGLang's per-prompt options: one value for all prompts, or (a batch, n = 1) a list.
    lists = batched and n == 1
    return_logprob = _option(body, "return_logprob", False, len(prompts), lists, _boolean)
    starts = _option(body, "logprob_start_len", -1, len(prompts), lists, _integer(-1))
    tops = _option(body, "top_logprobs_num", 0, len(prompts), lists, _integer(0))
    rids = _rids(body.get("rid"), len(prompts), n, batched)
    lora = _lora_path(body.get("lora_path"), len(prompts), batched)

    requests: list[Request] = []
    for p, input_ids in enumerate(prompts):
        sp = params[p]
        max_new = _max_new_tokens(len(input_ids), sp, limits)
        start = starts[p]
        where = f" (prompt {p} of the batch)" if batched else ""
        if return_logprob[p] and start >= len(input_ids):
            raise BadRequest(f"logprob_start_len ({start}) is higher than the number of input "
                             f"tokens ({len(input_ids)}); use a smaller logprob_start_len{where}")
        key = f"group-{next(_group_ids)}" if n > 1 else None
        for k in range(n):
            r = Request(rid=rids[p * n + k], input_ids=input_ids, params=sp,
                        max_new_tokens=max_new, on_progress=_noop, stream=stream,
                        prefill_key=key, lora=lora)
            if return_logprob[p]:
                # -1: output log-probs only; SGLang still lists the last prompt token (None),
                # except for a prefill-only request (max_new_tokens 0), which lists none.
                default = len(input_ids) - (1 if max_new else 0)
                r.logprob_start = default if start == -1 else start
                r.top_logprobs_num = tops[p]
                r.return_text_in_logprobs = with_text
            requests.append(r)
    return GenerateCall(requests, batched, stream, any(return_logprob))


def _sampling_params(raw: Any, prompts: int, batched: bool,
                     limits: ModelLimits) -> list[SamplingParams]:
    """One SamplingParams per prompt: one object for all, or (a batch) a list of objects."""
    if isinstance(raw, list):
        if not batched:
            raise BadRequest("sampling_params must be a JSON object (a list is for a batch)")
        if len(raw) != prompts:
            raise BadRequest(f"sampling_params: {len(raw)} objects for a batch of {prompts} "
                             f"prompts")
        return [_one_sampling_params(r, limits) for r in raw]
    return [_one_sampling_params(raw, limits)] * prompts


def _one_sampling_params(raw: Any, limits: ModelLimits) -> SamplingParams:
    if isinstance(raw, dict):
        for key, value in raw.items():
            # Python's json accepts NaN and Infinity (not JSON): a NaN temperature would pass
            # every range check (NaN < 0 is false) and sample from NaN probabilities.
            if isinstance(value, float) and not math.isfinite(value):
                raise BadRequest(f"sampling_params.{key} must be a finite number, got {value!r}")
    return parse_sampling_params(raw, limits.vocab_size)


def _option(body: dict[str, Any], key: str, default: Any, prompts: int, lists: bool,
            check: Any) -> list[Any]:
    """A per-prompt option's value for each prompt; a list of values where SGLang takes one
    (a batch with n = 1)."""
    value = body.get(key)
    if isinstance(value, list):
        if not lists:
            raise BadRequest(f"{key}: a list of values is for a batch with n = 1")
        if len(value) != prompts:
            raise BadRequest(f"{key}: {len(value)} values for a batch of {prompts} prompts")
        return [default if v is None else check(key, v) for v in value]
    return [default if value is None else check(key, value)] * prompts


def _boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be a boolean")
    return value


def _integer(minimum: int) -> Any:
    def check(key: str, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise BadRequest(f"{key} must be an integer, got {value!r}")
        if value < minimum:
            raise BadRequest(f"{key} must be >= {minimum}, got {value}")
        return value
    return check


def _check_fields(body: dict[str, Any]) -> None:
    for key in _REFUSED:
        if body.get(key) not in (None, False, [], {}):
            raise BadRequest(f"{key} is not supported by the built-in engine")
    # Other keys are not SGLang's: FastAPI drops them there, and so does this engine.


def _prompts(body: dict[str, Any], limits: ModelLimits,
             tokenizer: Any) -> tuple[list[list[int]], bool]:
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise BadRequest("exactly one of text or input_ids is required")
    if has_text:
        text = body["text"]
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a list of strings")
        longest = max(map(len, texts), default=0)
        if longest > limits.context_length * MAX_CHARS_PER_TOKEN:
            raise BadRequest(f"a text prompt of {longest} characters cannot fit the context "
                             f"length ({limits.context_length} tokens); refused before "
                             "tokenizing")
        prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    else:
        value = body["input_ids"]
        if not isinstance(value, list):
            raise BadRequest("input_ids must be a list of token ids (or a list of such lists)")
        batched = bool(value) and isinstance(value[0], list)
        prompts = [_token_ids(v, limits.vocab_size) for v in (value if batched else [value])]
    if batched and not prompts:
        raise BadRequest("the batch is empty: text or input_ids lists no prompt")
    for i, ids in enumerate(prompts):
        where = f" (prompt {i} of the batch)" if batched else ""
        if not ids:
            raise BadRequest(f"the prompt is empty{where}")
        if len(ids) >= limits.context_length:
            raise BadRequest(f"The input ({len(ids)} tokens) is longer than the model's context "
                             f"length ({limits.context_length} tokens).{where}")
    return prompts, batched


def _lora_path(value: Any, prompts: int, batched: bool) -> str | None:
    """The LoRA adapter a call names (`lora_path`: a name, or for a batch a list of one per
    prompt); the built-in engine serves one merged adapter (lora.py), so a batch must name
    the same one (or none) for every prompt. Whether it is loaded is the server's check."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list) and batched:
        if len(value) != prompts:
            raise BadRequest(f"lora_path: {len(value)} adapters for a batch of {prompts} prompts")
        if not all(v is None or isinstance(v, str) for v in value):
            raise BadRequest("lora_path: a list must hold adapter names (strings) or null")
        names = {v or None for v in value}
        if len(names) > 1:
            raise BadRequest(f"lora_path names different adapters in one batch "
                             f"({sorted(map(str, names))}); the built-in engine serves one "
                             "merged adapter: every prompt must name the same one")
        return names.pop()
    raise BadRequest("lora_path must be a string (or, for a batch, a list of strings)")


def _token_ids(value: Any, vocab_size: int) -> list[int]:
    if not isinstance(value, list):
        raise BadRequest("input_ids: a batch must be a list of lists of token ids")
    for t in value:
        if not isinstance(t, int) or isinstance(t, bool):
            raise BadRequest(f"input_ids: {t!r} is not an integer token id")
        if not 0 <= t < vocab_size:
            raise BadRequest(f"input_ids: token id {t} is outside the vocabulary [0, {vocab_size})")
    return list(value)


def _rids(rid: Any, prompts: int, n: int, batched: bool) -> list[str]:
    total = prompts * n
    if rid is None:
        return [uuid.uuid4().hex for _ in range(total)]
    if isinstance(rid, str):
        return [rid] if not batched else [f"{rid}_{i}" for i in range(total)]
    if isinstance(rid, list) and batched and all(isinstance(r, str) for r in rid):
        if len(rid) != prompts:
            raise BadRequest(f"rid: {len(rid)} request ids for a batch of {prompts} prompts")
        if len(set(rid)) != len(rid):
            raise BadRequest(f"Duplicate request IDs detected within the request: {rid}")
        return list(rid) if n == 1 else [f"{r}_{k}" for r in rid for k in range(n)]
    raise BadRequest("rid must be a string (or, for a batch, a list of strings)")


def _max_new_tokens(prompt: int, params: SamplingParams, limits: ModelLimits) -> int:
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
    return max_new


def generate_response(r: Request, return_logprob: bool, tokenizer: Any, *,
                      first_response: bool = True) -> dict[str, Any]:
    """SGLang's response body for `r`, complete or (streaming) so far.

    meta_info as SGLang 0.5.23's tokenizer manager builds it (tests/fixtures/sglang/
    generate_*.json): `weight_versions` (spans of output tokens per weight version) and
    `e2e_latency` once finished, `response_sent_to_client_ts` on the first response sent
    (`first_response`: every non-streamed answer, a stream's first chunk). Fields of features
    this engine lacks have their neutral value: no retractions, no reasoning parser, one
    data-parallel rank.
    """
    output_ids = list(r.output_ids)
    n = len(output_ids)
    meta: dict[str, Any] = {
        "id": r.rid,
        "finish_reason": r.finish_reason,
        "prompt_tokens": len(r.input_ids),
        "weight_version": _version_of_token(r, n - 1),
        "num_retractions": 0,
    }
    if return_logprob:
        meta.update(logprob_meta(r, n, tokenizer))
    meta.update(reasoning_tokens=0, completion_tokens=n, cached_tokens=r.cached_tokens)
    if r.finished:
        meta["weight_versions"] = [dict(span) for span in r.weight_versions]
    # rollmesh extension (not SGLang's; clients that do not read it ignore it): the weight
    # version of every output token, on every response and stream chunk.
    meta["output_token_weight_versions"] = token_versions(r, n)
    meta["dp_rank"] = 0
    if r.finished:
        meta["e2e_latency"] = time.perf_counter() - r.received_at
    if first_response:
        meta["response_sent_to_client_ts"] = time.time()
    return {"text": _text(r, output_ids, tokenizer), "output_ids": output_ids, "meta_info": meta}


def token_versions(r: Request, n: int) -> list[str]:
    """The weight version of each of the first `n` output tokens, from the request's spans
    (`output_token_weight_versions`, a built-in-engine extension; docs/sglang-api.md). The
    scheduler extends the spans before it appends a token, so they always cover `n`."""
    out: list[str] = []
    for span in list(r.weight_versions):
        out += [span["version"]] * (span["end"] - span["start"])
    return out[:n]


def _version_of_token(r: Request, index: int) -> str:
    """The weight version output token `index` was sampled with (SGLang: the last span's); the
    engine's current one before the first token."""
    for span in reversed(list(r.weight_versions)):
        if span["start"] <= index < span["end"]:
            return span["version"]
    return r.weight_version


def response_of(r: Request, tokenizer: Any, *, first_response: bool = True) -> dict[str, Any]:
    """`generate_response` with the request's own return_logprob (prompts of one batch may
    differ)."""
    return generate_response(r, r.logprob_start is not None, tokenizer,
                             first_response=first_response)


def logprob_meta(r: Request, n: int, tokenizer: Any) -> dict[str, Any]:
    """SGLang's meta_info log-prob keys (TokenizerManager.add_logprob_to_meta_info): entries
    `[logprob, token_id, text or null]`; top ones a list per position (None where the position
    has no prediction: the first input token)."""
    with_text = r.return_text_in_logprobs

    def entries(values: list, ids: list[int]) -> list[list[Any]]:
        texts = _texts(ids, tokenizer) if with_text else [None] * len(ids)
        return [[v, t, s] for v, t, s in zip(values, ids, texts)]

    def top(positions: list) -> list[list[list[Any]] | None]:
        return [entries([v for v, _ in pos], [t for _, t in pos]) if pos else None
                for pos in positions]

    start = r.logprob_start if r.logprob_start is not None else len(r.input_ids) - 1
    input_ids = r.input_ids[start:]
    meta: dict[str, Any] = {
        "input_token_logprobs": entries(r.input_logprobs, input_ids[: len(r.input_logprobs)]),
        "output_token_logprobs": entries(r.output_logprobs[:n], r.output_ids[:n]),
        "output_token_logprobs_length": n,
    }
    if r.top_logprobs_num > 0:
        meta["input_top_logprobs"] = top(r.input_top_logprobs)
        meta["output_top_logprobs"] = top(r.output_top_logprobs[:n])
    return meta


def _texts(ids: list[int], tokenizer: Any) -> list[str]:
    return [tokenizer.decode([t]) for t in ids]


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
