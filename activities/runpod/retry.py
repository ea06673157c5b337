"""How long `RunPodClient` waits by itself before asking again, and for how long at most.

RunPod rate-limits per 10 s window (429) and its gateway has short 5xx bursts: waiting a second
or two inside the call is cheaper than failing the activity. The waiting is bounded (attempts
and a total budget kept under the follow activity's heartbeat timeout); past it the error goes
to the caller, and Temporal's retry (with `next_retry_delay` from Retry-After) takes over.

The delay is the workflow's reconnect formula, `min(base·2^n, max)·U(0.5, 1)` (one function,
`workflows.shared.reconnect_delay`), added on top of Retry-After: Retry-After is a floor the
platform asked for, and the jitter keeps every worker that was throttled in the same window
from coming back in the same instant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

from workflows.shared import reconnect_delay

# A Retry-After beyond this is not believed (a misconfigured proxy); the caller still backs off.
MAX_RETRY_AFTER_S = 3600.0


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5  # tries per call, the first one included
    base_s: float = 0.5
    max_s: float = 8.0
    # Total sleeping per call. Under the default heartbeat timeout (20 s): a call that waits
    # longer would look like a dead worker to Temporal.
    budget_s: float = 10.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_s < 0 or self.max_s < self.base_s or self.budget_s < 0:
            raise ValueError(f"invalid retry policy: {self}")

    def delay(self, attempt: int, retry_after: float | None, u: float) -> float:
        """The wait before try `attempt + 2`: Retry-After (if any) plus the jittered backoff."""
        return (retry_after or 0.0) + reconnect_delay(attempt, self.base_s, self.max_s, u)


NO_RETRY = RetryPolicy(attempts=1, budget_s=0.0)


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None if absent or
    unreadable. Never negative, never above `MAX_RETRY_AFTER_S`."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - (now or datetime.now(UTC))).total_seconds()
    if not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)
