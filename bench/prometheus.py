"""Samples of Prometheus text exposition (the Temporal server's and a worker's /metrics)."""

from __future__ import annotations

import re
from collections.abc import Iterator

_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$"
)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """Each sample line's name, labels and value; comments and what cannot be read are left out."""
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        yield match["name"], dict(_LABEL.findall(match["labels"] or "")), value
