"""The simulator clock: the platform's timers (TTL, execution timeout, idle timeout, retention,
billing) run on it, `speed` times faster than real time, so tests can live through a 24-hour TTL
or a 10-minute execution timeout in a second."""

from __future__ import annotations

import asyncio
import time


class SimClock:
    def __init__(self, speed: float = 1.0) -> None:
        self.speed = speed
        self._t0 = time.monotonic()
        self.started_at_unix = time.time()

    def now(self) -> float:
        """Simulated seconds since the simulator started."""
        return (time.monotonic() - self._t0) * self.speed

    def real_seconds(self, sim_seconds: float) -> float:
        return max(0.0, sim_seconds) / self.speed

    async def sleep(self, sim_seconds: float) -> None:
        await asyncio.sleep(self.real_seconds(sim_seconds))


class Changes:
    """A broadcast "something changed" signal for long-polls: waiters wake on the next notify().

    Each notify() completes the current event and starts a new one, so a waiter never misses a
    change that happens after it started waiting and never sees one twice.
    """

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout_s: float) -> None:
        event = self._event
        try:
            await asyncio.wait_for(event.wait(), timeout=max(0.0, timeout_s))
        except TimeoutError:
            pass
