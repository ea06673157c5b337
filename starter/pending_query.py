"""A watch's status query, asked in the background.

A worker busy with many jobs answers queries late: each waits behind that worker's workflow
tasks. A watch that awaited its query would freeze for as long, showing nothing, although the
workflow's description (read from the server alone) already carries the follow activity's
latest heartbeat. `PendingQuery` lets the watch ask, wait a little, and go on showing the
heartbeat's steps on the last answer until the new one arrives.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
Asked = TypeVar("Asked")


class PendingQuery(Generic[T, Asked]):
    """At most one query in flight, remembered with what it was asked about (`asked`)."""

    def __init__(self, ask: Callable[[], Awaitable[T]]) -> None:
        self._ask = ask
        self._task: asyncio.Future[T] | None = None
        self._asked: Asked | None = None

    @property
    def in_flight(self) -> bool:
        return self._task is not None

    def ask(self, asked: Asked) -> None:
        """Send the query unless one is already in flight (its answer will be as useful)."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._ask())
            self._asked = asked

    async def answer(self, wait_s: float | None) -> tuple[T, Asked | None] | None:
        """The answer and what it was asked about, if it arrives within `wait_s` (None: wait as
        long as it takes); None if it is still out. A failed query raises its error here."""
        task = self._task
        if task is None:
            return None
        if not task.done():
            await asyncio.wait({task}, timeout=wait_s)
            if not task.done():
                return None
        self._task = None
        return task.result(), self._asked

    def cancel(self) -> None:
        """Drop the query in flight (its late answer would be stale)."""
        task, self._task = self._task, None
        if task is None:
            return
        if task.done():
            if not task.cancelled():
                task.exception()  # retrieved: a dropped failure is not "never retrieved"
        else:
            task.cancel()
