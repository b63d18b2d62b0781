"""What an engine's HTTP answers mean, for `rollmesh.engine.client` and every role that reads them.

- the one rule for an engine's weight version (`version_number`, `engine_version`,
  `serves_other_version`), which the trainer's and the synchronizer's checks, the client's own
  and the agent loops' stamping all apply;
- the errors (`EngineError` and its kinds) and what an error body says (`error_message`, in
  any of SGLang's shapes), and the router's codes for "the engine behind it is gone"
  (`router_upstream_gone`);
- one /generate answer in the fields rollmesh uses (`GenerateOutput`), its per-token weight
  versions read from either form an engine reports them in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


# ---- the engine's weight version: the one rule every role judges an engine by ---------------
def version_number(reported: Any) -> int | None:
    """A weight version as an engine reports it (/generate's `weight_version` and per-token
    versions, /get_server_info's and /get_model_info's `weight_version`) read as the integer
    rollmesh counts in (`int()`: 7 or "7"); None when there is none or it is not an integer (an
    SGLang started without --weight-version says "default"). An engine whose version is None is
    not judged by it (rollmesh starts its engines with --weight-version 0); a caller that needs
    the number refuses it (`rollmesh.agents.loops.parse_version`)."""
    try:
        return int(reported)
    except (TypeError, ValueError):
        return None


def engine_version(info: dict[str, Any]) -> int | None:
    """The weight version an engine's /get_server_info or /get_model_info answer reports:
    `version_number` of its `weight_version`."""
    return version_number(info.get("weight_version"))


def serves_other_version(info: dict[str, Any], *versions: int) -> bool:
    """Whether an engine's /get_server_info answer reports a version, and not one of
    `versions`: the engine holds other weights. An engine that reports no integer version is
    never judged so."""
    version = engine_version(info)
    return version is not None and version not in versions


class EngineError(RuntimeError):
    """A server answered with an error, or no server could answer after the retries."""

    def __init__(self, message: str, status: int | None = None, url: str | None = None):
        super().__init__(message)
        self.status = status
        self.url = url
        # a router's answer that the engine behind it did not answer (ROUTER_UPSTREAM_GONE)
        self.upstream_gone = False


def error_message(text: str) -> str:
    """What an error body says, in any of SGLang's shapes (docs/sglang-api.md, "Errors"):
    `{"error": {"message": ...}}` (a request its tokenizer manager refuses),
    `{"error": "..."}` (the /generate schema check, a missing API key),
    `{"success": false, "error_message": ...}` (the LoRA routes),
    `{"object": "error", "message": ...}` (FastAPI validation), `{"success": false,
    "message": ...}` (weight routes), `{"detail": ...}` (FastAPI's 404), or plain text
    (/flush_cache). Unparseable text is returned as it is, cut to 500 characters."""
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:500]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        for key in ("message", "error_message", "detail"):
            if isinstance(body.get(key), str):
                return body[key]
    return text.strip()[:500]


# The router's codes (SGLang's router, `error.code` in its 5xx bodies) for "the engine it sent
# the request to did not answer": an engine outage behind it, as a refused connection is for a
# server called directly. Its other 5xx (an engine's own error answer) count as errors.
ROUTER_UPSTREAM_GONE = frozenset({
    "call_upstream_request_error", "call_upstream_connection_failed",
    "call_upstream_request_failed", "call_upstream_body_error", "call_upstream_timeout",
})


def router_upstream_gone(status: int, text: str) -> bool:
    """Whether a router's error answer means the engine behind it is gone (above)."""
    if status in (502, 504):
        return True
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and err.get("code") in ROUTER_UPSTREAM_GONE


class EngineRequestError(EngineError):
    """HTTP 4xx: the request itself is wrong; retrying cannot help."""


class NoHealthyServer(EngineError):
    pass


class EngineUnavailable(NoHealthyServer):
    """A generation found no server able to run it for longer than its wait limit."""


class GenerationCancelled(Exception):
    """The caller's cancel event was set while a generation waited for a server: it was sent
    nowhere (or its server died), so there is no partial output to return."""


@dataclass
class GenerateOutput:
    """One /generate answer, in the fields rollmesh uses (and the raw body)."""

    rid: str
    server: str
    output_ids: list[int]
    logprobs: list[float]  # behaviour log-prob per output token ([] without return_logprob)
    finish_reason: str  # stop | length | abort
    weight_version: str
    prompt_tokens: int
    raw: dict[str, Any] = field(repr=False, default_factory=dict)
    # The weight version of each output token: the built-in engine's meta_info extension
    # `output_token_weight_versions`, else SGLang 0.5.23's `weight_versions` spans where they
    # cover every output token (docs/sglang-api.md); None when the engine reports neither: the
    # caller then knows only `weight_version`, the last token's.
    token_versions: list[int] | None = None

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"

    @classmethod
    def from_response(cls, rid: str, server: str, body: dict[str, Any]) -> GenerateOutput:
        try:
            meta = body["meta_info"]
            output_ids = list(body["output_ids"])
            triples = meta.get("output_token_logprobs") or []
            if triples and len(triples) != len(output_ids):
                raise ValueError(f"{len(triples)} log-probs for {len(output_ids)} tokens")
            if any(int(t[1]) != o for t, o in zip(triples, output_ids)):
                raise ValueError("log-prob token ids do not match output_ids")
            return cls(rid=rid, server=server, output_ids=output_ids,
                       logprobs=[float(t[0]) for t in triples],
                       finish_reason=str(meta["finish_reason"]["type"]),
                       weight_version=str(meta.get("weight_version", "default")),
                       prompt_tokens=int(meta.get("prompt_tokens", 0)), raw=body,
                       token_versions=_token_versions(meta, len(output_ids)))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise EngineError(f"{server}/generate: malformed response ({e})", url=server) from None


def count_of(value: Any) -> int:
    """A count an engine reports, 0 where it reports none or not a number."""
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return 0


def _token_versions(meta: dict[str, Any], n: int) -> list[int] | None:
    """`output_token_weight_versions` as ints, one per output token; without it, the
    `weight_versions` spans expanded (SGLang 0.5.23 records a span boundary at every weight
    update for the requests it keeps: `utils/weight_versions.py`), if they are contiguous from
    0 and cover exactly the n tokens. None when neither is there, the spans do not fit, or a
    version is not an integer (an engine started with `--weight-version default`: rollmesh's
    stamping refuses that through `weight_version` anyway). A per-token list of another length
    is a malformed response (ValueError): stamping tokens with guessed versions would hide stale
    ones."""
    versions = meta.get("output_token_weight_versions")
    if versions is None:
        versions = _expand_spans(meta.get("weight_versions"), n)
        if versions is None:
            return None
    if not isinstance(versions, list) or len(versions) != n:
        got = len(versions) if isinstance(versions, list) else type(versions).__name__
        raise ValueError(f"output_token_weight_versions: expected a list of {n} versions, "
                         f"got {got}")
    numbers = [version_number(v) for v in versions]
    return None if None in numbers else numbers  # type: ignore[return-value]


def _expand_spans(spans: Any, n: int) -> list[Any] | None:
    """[{"version", "start", "end"}, ...] -> one version per token, or None unless the spans
    are contiguous from 0 to exactly n."""
    if not isinstance(spans, list) or not spans:
        return None
    out: list[Any] = []
    for span in spans:
        if not isinstance(span, dict) or span.get("start") != len(out):
            return None
        end = span.get("end")
        if not isinstance(end, int) or end < len(out):
            return None
        out += [span.get("version")] * (end - len(out))
    return out if len(out) == n else None
