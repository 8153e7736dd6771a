"""structlog configuration: JSON lines with request id and identities bound per request.

Keys, tokens and signatures are never logged: the processor below drops any event field
whose name says it holds one, wherever it came from.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

SENSITIVE = ("authorization", "signature", "token", "secret", "private", "password", "attestation")


def _drop_sensitive(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key in list(event):
        lowered = key.lower()
        if key == "event" or lowered.endswith("_id"):
            continue
        if any(word in lowered for word in SENSITIVE):
            event[key] = "[redacted]"
    return event


def configure_logging(level: str = "INFO", *, json: bool = True, colors: bool | None = None) -> None:
    """``colors`` (console lines only): ANSI colours; by default only when stdout is a terminal,
    so that a log file or a pipe gets plain text."""
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(
            colors=sys.stdout.isatty() if colors is None else colors,
            exception_formatter=structlog.dev.plain_traceback,
        )
    )
    # Tracebacks without local variables: locals hold request headers (tokens, signatures).
    tracebacks: list[Any] = (
        [
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            )
        ]
        if json
        else []
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _drop_sensitive,
            *tracebacks,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        # One write per record, its newline included (PrintLogger's print() wrote the two apart:
        # with PYTHONUNBUFFERED, as the image runs, another worker's record on the same stdout
        # could come between them, and neither line was JSON any more).
        logger_factory=structlog.WriteLoggerFactory(file=sys.stdout),
        cache_logger_on_first_use=False,
    )
