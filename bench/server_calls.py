"""The Temporal dev server's own count of the calls it served, from its Prometheus metrics.

`service_requests{service_name="frontend", operation=...}` counts every RPC a client or worker
made (heartbeats, polls, signals, describes, task completions); `persistence_requests` counts
the database operations they caused. Read before and after a phase, the difference says what a
job, or a second of a batch, costs the server in calls: the "where the time went" of its CPU.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import httpx

from bench.prometheus import samples

PERSISTENCE = "(database operations)"


@dataclass
class ServerCalls:
    """Calls by operation (frontend RPCs), plus the database operations under PERSISTENCE."""

    counts: Counter[str] = field(default_factory=Counter)

    def minus(self, before: ServerCalls) -> ServerCalls:
        return ServerCalls(
            Counter({k: v - before.counts.get(k, 0) for k, v in self.counts.items()})
        )

    @property
    def rpcs(self) -> int:
        return sum(v for k, v in self.counts.items() if k != PERSISTENCE)

    def top(self, n: int = 8) -> list[tuple[str, int]]:
        calls = [(k, v) for k, v in self.counts.items() if k != PERSISTENCE and v > 0]
        return sorted(calls, key=lambda kv: -kv[1])[:n]


def parse(text: str, namespace: str = "default") -> ServerCalls:
    counts: Counter[str] = Counter()
    for name, labels, value in samples(text):
        if name not in ("service_requests", "persistence_requests"):
            continue
        if labels.get("namespace") != namespace:
            continue
        if name == "persistence_requests":
            counts[PERSISTENCE] += int(value)
        elif labels.get("service_name") == "frontend":
            counts[labels.get("operation", "?")] += int(value)
    return ServerCalls(counts)


async def server_calls(http: httpx.AsyncClient, metrics_url: str) -> ServerCalls:
    """Now's totals; empty when the server exposes no metrics (the figures then say 0)."""
    if not metrics_url:
        return ServerCalls()
    try:
        response = await http.get(metrics_url)
        response.raise_for_status()
    except httpx.HTTPError:
        return ServerCalls()
    return parse(response.text)


def calls_table(calls: ServerCalls, per: float, unit: str) -> list[str]:
    """The busiest RPCs and the database operations, `per` (jobs, seconds) each."""
    rows = [f"| {name} | {v / per:.3g} |" for name, v in calls.top()]
    return [
        f"| server call | per {unit} |",
        "|---|---|",
        *rows,
        f"| all RPCs | {calls.rpcs / per:.3g} |",
        f"| {PERSISTENCE} | {calls.counts.get(PERSISTENCE, 0) / per:.3g} |",
    ]
