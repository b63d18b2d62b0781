"""The HTTP bodies the built-in server's route modules share (`server`, `weight_routes`): a
request's JSON object (`read_body`, `MalformedBody`) and SGLang's plain error reply
(`error_reply`)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from rollmesh.engine.builtin.sampling import BadRequest


def error_reply(message: str, status: int = 400) -> web.Response:
    """SGLang's error body for a request its tokenizer manager refuses (a ValueError:
    http_server.py `_create_error_response`): `{"error": {"message": ...}}`."""
    return web.json_response({"error": {"message": message}}, status=status)


class MalformedBody(BadRequest):
    """The body is not a JSON object: FastAPI's RequestValidationError in SGLang, answered in
    the OpenAI ErrorResponse shape (http_server.py, the RequestValidationError handler)."""


async def read_body(request: web.Request, *, optional: bool = False) -> dict[str, Any]:
    """The request's JSON object ({} for an empty body where `optional`); MalformedBody
    otherwise."""
    raw = await request.read()
    if not raw.strip() and optional:
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MalformedBody(f"malformed JSON: {e}") from None
    except RecursionError:
        raise MalformedBody("malformed JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise MalformedBody("the request body must be a JSON object")
    return body
