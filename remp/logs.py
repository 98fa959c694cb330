"""structlog set-up shared by every remp process.

Console output by default, one JSON object per line when ``REMP_LOG_FORMAT=json``. Context given
to :func:`configure` (e.g. ``node``) is added to every line, from every thread.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure(level: str | None = None, **static_context: object) -> None:
    fmt = os.environ.get("REMP_LOG_FORMAT", "console").lower()
    if fmt not in ("console", "json"):
        raise ValueError(f"REMP_LOG_FORMAT must be 'console' or 'json', got {fmt!r}")
    lvl = getattr(logging, (level or os.environ.get("REMP_LOG_LEVEL", "INFO")).upper(), logging.INFO)

    def add_static(_logger, _name, event_dict):
        for k, v in static_context.items():
            event_dict.setdefault(k, v)
        return event_dict

    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_static,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str | None = None):
    return structlog.get_logger(name) if name else structlog.get_logger()
