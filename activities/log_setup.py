"""structlog set-up shared by the worker and the CLI: every log line goes to stderr.

stdout belongs to results (the CLI's `--json` lines). On a terminal the lines are key-value for
people; anywhere else (a pipe, a file, a log collector) one JSON object per line. Standard
`logging` records (the Temporal SDK's, its Rust core's once forwarded) are rendered the same way.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

_SHARED: list[structlog.typing.Processor] = [
    structlog.contextvars.merge_contextvars,
    structlog.processors.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


class _StderrHandler(logging.StreamHandler[TextIO]):
    """Ours, so configuring again replaces it and leaves a host's handlers (pytest's) alone."""


def configure_logging(
    level: str, *, json: bool | None = None, stdlib_level: str = "WARNING"
) -> None:
    """`level` is the caller's setting (DURABLE_COMFY_LOG_LEVEL, read by its settings); an
    unknown name means INFO. `json=None` decides by stderr: key-value on a TTY, JSON lines
    otherwise.

    Standard-library loggers stay at `stdlib_level` or quieter: the SDK and botocore are
    chatty at INFO.
    """
    name = level.upper()
    numeric = logging.getLevelNamesMapping().get(name, logging.INFO)
    as_json = json if json is not None else not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if as_json
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    handler = _StderrHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *_SHARED],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    stdlib_numeric = logging.getLevelNamesMapping().get(stdlib_level.upper(), logging.WARNING)
    root.setLevel(max(numeric, stdlib_numeric))
    structlog.configure(
        processors=[*_SHARED, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
