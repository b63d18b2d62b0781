"""Structured logging for every rollmesh process: role and host on every line.

JSON lines when the stream is not a terminal (what the launcher collects), a readable console
format when it is; `file=PATH` adds a JSON-lines file sink (the launcher's RUN/logs/launcher.log),
and `stream=False` leaves the file the only sink. Standard-library logging (transformers, aiohttp, ...) is routed through the
same processors so third-party lines carry role and host too.
"""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path
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
    stream: TextIO | None | bool = None,
    json: bool | None = None,
    level: str = "info",
    file: str | Path | None = None,
    **identity: Any,
) -> structlog.stdlib.BoundLogger:
    """Configure structlog for this process and return a logger bound to it.

    `stream`: where lines go (default stdout; False: nowhere but `file`); `json`: JSON lines
    (default: unless `stream` is a terminal); `file`: also JSON lines appended to this file."""
    if stream is True or stream is None:
        stream = sys.stdout
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
    def formatter(as_json: bool) -> logging.Formatter:
        renderer: Any = (structlog.processors.JSONRenderer() if as_json
                         else structlog.dev.ConsoleRenderer(colors=False))
        return structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
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
    handlers: list[logging.Handler] = []
    if stream is not False:
        handler = logging.StreamHandler(stream)  # type: ignore[arg-type]
        handler.setFormatter(formatter(json))
        handlers.append(handler)
    if file is not None:
        Path(file).parent.mkdir(parents=True, exist_ok=True)
        to_file = logging.FileHandler(file, encoding="utf-8")
        to_file.setFormatter(formatter(True))
        handlers.append(to_file)
    root = logging.getLogger()
    for old in root.handlers:
        if isinstance(old, logging.FileHandler):
            old.close()
    root.handlers[:] = handlers
    root.setLevel(level.upper())
    return structlog.get_logger("rollmesh")


def get_logger(name: str = "rollmesh", **context: Any) -> Any:
    """A logger that picks up the configuration when it first logs, not when it is made:
    modules create theirs at import, before `configure_logging` runs."""
    return structlog.get_logger(name, **context)
