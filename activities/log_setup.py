"""structlog set-up shared by the worker and the CLI: key-value lines on stderr."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(level: str | None = None, *, json: bool = False) -> None:
    name = (level or os.environ.get("DURABLE_COMFY_LOG_LEVEL", "INFO")).upper()
    numeric = logging.getLevelNamesMapping().get(name, logging.INFO)
    logging.basicConfig(
        stream=sys.stderr, level=max(numeric, logging.WARNING), format="%(message)s"
    )
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
