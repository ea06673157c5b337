"""RunPod's per-window request limits (per 10 s: /run 1000, /status and /stream 2000, /cancel
100), answered 429. Windows slide in real time: they are about real client traffic, whatever
the simulator clock's speed."""

from __future__ import annotations

import math
import time
from collections import Counter, deque

from .settings import RateLimits

# Route name -> the limit bucket it counts against (routes not listed are not limited).
BUCKETS = {
    "run": "run",
    "runsync": "run",
    "status": "status",
    "stream": "status",
    "cancel": "cancel",
}


class RateLimiter:
    def __init__(self, limits: RateLimits) -> None:
        self.limits = limits
        self._hits: dict[str, deque[float]] = {}
        self.refused = 0
        # Every public API call by route, answered or refused (the ledger's `api_calls`).
        self.calls: Counter[str] = Counter()

    def hit(self, route: str) -> int | None:
        """Count a request; None if allowed, else the seconds to wait (Retry-After)."""
        self.calls[route] += 1
        bucket = BUCKETS.get(route)
        if bucket is None:
            return None
        limit: int = getattr(self.limits, bucket)
        now = time.monotonic()
        hits = self._hits.setdefault(bucket, deque())
        while hits and hits[0] <= now - self.limits.window_s:
            hits.popleft()
        if len(hits) >= limit:
            self.refused += 1
            return max(1, math.ceil(hits[0] + self.limits.window_s - now))
        hits.append(now)
        return None
