"""Logging for the simulators: both streams (ours via structlog, aiohttp's via logging) go to
stderr, every line tagged, so a shared log never passes a simulator off as the real service."""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

import structlog


def configure_sim_logging(tag: str) -> None:
    """`tag` such as "comfy-sim": every line starts with `[tag]`."""

    def tagged(_logger: object, _method: str, event: MutableMapping[str, Any]) -> Mapping[str, Any]:
        event["event"] = f"[{tag}] {event.get('event', '')}"
        return event

    logging.basicConfig(level=logging.INFO, format=f"[{tag}] %(levelname)s %(message)s")
    structlog.configure(
        processors=[
            tagged,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
