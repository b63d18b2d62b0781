"""Structured logging for every rollmesh process: role and host on every line.

JSON lines when the stream is not a terminal (what the launcher collects), a readable console
format when it is. Standard-library logging (transformers, aiohttp, ...) is routed through the
same processors so third-party lines carry role and host too.
"""

from __future__ import annotations

import logging
import socket
import sys
from typing import Any, TextIO

import structlog

_identity: dict[str, Any] = {"role": "main", "host": socket.gethostname()}


def _add_identity(_logger: Any, _name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    # A processor, not contextvars: threads and executor tasks must carry the identity too.
    for key, value in _identity.items():
        event_dict.setdefault(key, value)
    return event_dict


def configure_logging(
    role: str,
    host: str | None = None,
    *,
    stream: TextIO | None = None,
    json: bool | None = None,
    level: str = "info",
    **identity: Any,
) -> structlog.stdlib.BoundLogger:
    """Configure structlog for this process and return a logger bound to it."""
    stream = stream if stream is not None else sys.stdout
    if json is None:
        json = not (hasattr(stream, "isatty") and stream.isatty())
    _identity.clear()
    _identity.update(role=role, host=host or socket.gethostname(), **identity)

    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_identity,
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    return structlog.get_logger("rollmesh")


def get_logger(name: str = "rollmesh", **context: Any) -> Any:
    """A logger that picks up the configuration when it first logs, not when it is made:
    modules create theirs at import, before `configure_logging` runs."""
    return structlog.get_logger(name, **context)
