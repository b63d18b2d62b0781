"""rollmesh's own reward functions: `gsm8k` (math answer checking), `exact_match`, `remote`
(a reward model behind HTTP), `letter_share` (the CPU default's toy task), `tool_answer` (an
agent's numeric answer, reached with a tool). Registered as entry points in pyproject.toml."""

from __future__ import annotations

import json
import os
import re
import threading
import unicodedata
import urllib.error
import urllib.request
from decimal import Decimal, InvalidOperation
from typing import Any

__all__ = ["exact_match_reward", "gsm8k_reward", "letter_share_reward", "make_remote_reward",
           "remote_reward", "tool_answer_reward"]


# -- letter_share: the toy task of the embedded CPU default ----------------------------------


def letter_share_reward(response: str, label: Any, metadata: dict) -> dict[str, Any]:
    """The share of the response's words that contain the letter `label` (in [0, 1]).

    A toy objective with a dense signal, so that a randomly initialised tiny model shows
    learning by RL within minutes on a CPU: about a third of tiny's vocabulary contains "e", so
    the untrained policy starts near 0.35 and can only get better by choosing its words.
    """
    if not isinstance(label, str) or len(label) != 1:
        raise ValueError(f"letter_share: the label must be one letter, got {label!r}")
    words = [w for w in "".join(c if c.isalpha() else " " for c in response).split()]
    if not words:
        return {"reward": 0.0, "words": 0}
    hits = sum(label.lower() in w.lower() for w in words)
    return {"reward": hits / len(words), "words": len(words)}


# -- gsm8k -------------------------------------------------------------------------------------


def gsm8k_reward(response: str, label: Any, metadata: dict) -> dict[str, Any]:
    """1.0 if the response's final answer equals the label numerically, else 0.0.

    The answer is what follows the response's last `####` if it has one (GSM8K's own format),
    otherwise what math-verify extracts (`\\boxed{}` first, then "the answer is ...", then the
    last number; commas, `$` and units handled). Info: `extracted` (the answer found, or None).
    """
    from math_verify import ExprExtractionConfig, parse, verify

    if label is None:
        raise ValueError("gsm8k needs a label (the reference answer), got None")
    # math-verify's own time limit uses SIGALRM, which works only in the main thread; elsewhere
    # the caller's time limit (the reward sandbox) has to do.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(str(label).replace(",", ""), [ExprExtractionConfig()], parsing_timeout=limit)
    if not gold:
        raise ValueError(f"gsm8k: the label {label!r} is not a number")
    if "####" in response:
        tail = response.rsplit("####", 1)[1].strip()
        response = tail.splitlines()[0] if tail else ""
    pred = parse(response, parsing_timeout=limit)
    correct = bool(pred) and verify(gold, pred, timeout_seconds=limit)
    return {"reward": 1.0 if correct else 0.0, "extracted": str(pred[-1]) if pred else None}


def _gsm8k_warmup() -> None:
    # Importing math-verify (sympy, antlr) and its first parse take ~0.4 s: not scoring time.
    gsm8k_reward("\\boxed{1}", "1", {})


gsm8k_reward.warmup = _gsm8k_warmup  # type: ignore[attr-defined]


# -- exact_match -------------------------------------------------------------------------------


def _normalise(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).casefold()
    return " ".join(text.split()).rstrip(".").strip()


def exact_match_reward(response: str, label: Any, metadata: dict) -> float:
    """1.0 if the response equals the label after normalisation (Unicode NFKC, case, runs of
    whitespace, a trailing full stop), else 0.0. A list label accepts any of its items."""
    if label is None:
        raise ValueError("exact_match needs a label (the reference answer), got None")
    labels = label if isinstance(label, list) else [label]
    got = _normalise(response)
    return 1.0 if any(got == _normalise(str(x)) for x in labels) else 0.0


# -- tool_answer -------------------------------------------------------------------------------

_NUMBER = re.compile(r"(?<![\d.])-?\d+(?:,\d{3})*(?:\.\d+)?")  # 42, -12, 1,363, 1363.0
# What a failed call's result starts with: rollmesh's tool errors (agents.loops.run_tool), the
# python tool's "error: ..." lines, a traceback.
_FAILED_CALL = re.compile(r"\s*(error|traceback|unknown tool|malformed tool call|"
                          r"tool \S+ (failed|timed out))", re.IGNORECASE)


def _number(text: str) -> Decimal | None:
    try:
        value = Decimal(text.strip().replace(",", ""))
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def tool_answer_reward(response: str, label: Any, metadata: dict,
                       trajectory: dict[str, Any]) -> dict[str, Any]:
    """1.0 if the agent used a tool successfully and its final answer equals the label, else 0.

    Reads the trajectory view (`tool_agent`, `openai_agent`). The answer is the last number
    (integer or decimal, thousands commas allowed) in the last assistant turn, compared with
    the label as numbers ("1363", "1363.0" and "1,363" all equal 1363). A tool was used
    successfully if some recorded call's result is not an error (does not start with "error",
    "unknown tool", "malformed tool call", "tool ... failed/timed out" or a traceback). Info:
    `answer` (the number as written, or None), `tool_calls` (how many), `used_tool`.
    """
    if label is None:
        raise ValueError("tool_answer needs a label (the reference answer), got None")
    gold = _number(str(label))
    if gold is None:
        raise ValueError(f"tool_answer: the label {label!r} is not a number")
    said = [t["text"] for t in trajectory["turns"] if t["role"] == "assistant"]
    found = _NUMBER.findall(said[-1]) if said else []
    answer = found[-1] if found else None
    calls = trajectory["tool_calls"]
    used = any(not _FAILED_CALL.match(c["result"]) for c in calls)
    correct = answer is not None and _number(answer) == gold
    return {"reward": 1.0 if used and correct else 0.0, "answer": answer,
            "tool_calls": len(calls), "used_tool": used}


# -- remote ------------------------------------------------------------------------------------

URL_ENV = "ROLLMESH_REWARD_URL"
TIMEOUT_ENV = "ROLLMESH_REWARD_HTTP_TIMEOUT_S"


def _post_for_reward(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            payload = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read(500).decode(errors="replace")
        raise RuntimeError(f"reward model at {url} answered HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ConnectionError(f"reward model at {url} unreachable: {reason}") from None
    try:
        reply = json.loads(payload)
    except ValueError:
        raise ValueError(f"reward model at {url} answered non-JSON: {payload[:200]!r}") from None
    if not isinstance(reply, dict) or "reward" not in reply:
        raise ValueError(f"reward model at {url} answered without 'reward': {payload[:200]!r}")
    return reply


def remote_reward(response: str, label: Any, metadata: dict) -> dict[str, Any]:
    """POST `{"response", "label", "metadata"}` as JSON to a reward model, which answers
    `{"reward": float, ...}` (the other fields become the reward's info). The URL is
    `metadata["reward_url"]`, else $ROLLMESH_REWARD_URL; the HTTP timeout
    `metadata["reward_timeout_s"]`, else $ROLLMESH_REWARD_HTTP_TIMEOUT_S, else 30 s."""
    url = metadata.get("reward_url") or os.environ.get(URL_ENV)
    if not url:
        raise ValueError(f"remote reward: no URL (set metadata['reward_url'] or ${URL_ENV})")
    timeout_s = float(metadata.get("reward_timeout_s") or os.environ.get(TIMEOUT_ENV) or 30.0)
    return _post_for_reward(
        url, {"response": response, "label": label, "metadata": metadata}, timeout_s
    )


def make_remote_reward(url: str, timeout_s: float = 30.0) -> Any:
    """A remote reward function bound to `url`: assign it in a module and name it by
    `"module:attribute"` (or an entry point) to use a fixed reward model."""

    def reward(response: str, label: Any, metadata: dict) -> dict[str, Any]:
        return _post_for_reward(
            url, {"response": response, "label": label, "metadata": metadata}, timeout_s
        )

    return reward
