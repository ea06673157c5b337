"""The project's own counters from a worker's Prometheus endpoint (activities/metrics.py)."""

from __future__ import annotations

from collections import Counter

import httpx

from bench.prometheus import samples

PREFIX = "durable_comfy_"
# The SDK's own labels on every sample, left out of the keys.
SDK_LABELS = ("service_name", "namespace", "task_queue")


def parse(text: str, names: tuple[str, ...]) -> Counter[str]:
    """`name` (without the `durable_comfy_` prefix) or `name{label=value}` for each of its
    labels but the SDK's own, summed."""
    counts: Counter[str] = Counter()
    for full, labels, value in samples(text):
        name = full.removeprefix(PREFIX)
        if name == full or name not in names:
            continue
        kept = [f"{k}={v}" for k, v in labels.items() if k not in SDK_LABELS]
        counts[name + (f"{{{','.join(kept)}}}" if kept else "")] += int(value)
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
