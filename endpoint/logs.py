"""structlog for the handler: one line per event to stdout, which RunPod's worker logs show.

Key-value on a terminal, JSON lines otherwise (the platform's log view, a file); the level comes
from ENDPOINT_LOG_LEVEL (default INFO).
"""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(level: str | None = None) -> None:
    name = (level or os.environ.get("ENDPOINT_LOG_LEVEL", "INFO")).upper()
    numeric = logging.getLevelNamesMapping().get(name, logging.INFO)
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer(colors=False)
        if sys.stdout.isatty()
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stdout),
        cache_logger_on_first_use=True,
    )
    # The SDK sets the root logger to INFO (logging.basicConfig in runpod's upload module), which
    # would log every HTTP request to ComfyUI and S3.
    for chatty in ("botocore", "boto3", "httpx", "httpcore", "urllib3"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
