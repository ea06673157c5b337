"""The project's own counters from a worker's Prometheus endpoint (activities/metrics.py)."""

from __future__ import annotations

import re
from collections import Counter

import httpx

_SAMPLE = re.compile(r"^durable_comfy_(?P<name>[a-z_]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse(text: str, names: tuple[str, ...]) -> Counter[str]:
    """`name` (without the `durable_comfy_` prefix) or `name{label=value}` for each of its
    labels but the SDK's own (`service_name`, `namespace`, `task_queue`), summed."""
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match["name"] not in names:
            continue
        labels = [
            f"{k}={v}"
            for k, v in _LABEL.findall(match["labels"] or "")
            if k not in ("service_name", "namespace", "task_queue")
        ]
        key = match["name"] + (f"{{{','.join(labels)}}}" if labels else "")
        counts[key] += int(float(match["value"]))
    return counts


async def worker_counters(
    http: httpx.AsyncClient, metrics_url: str, names: tuple[str, ...]
) -> Counter[str]:
    """Now's totals of the counters `names`; empty when they cannot be read."""
    try:
        response = await http.get(metrics_url, timeout=5)
        response.raise_for_status()
    except httpx.HTTPError:
        return Counter()
    return parse(response.text, names)
