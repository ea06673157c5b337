"""`eventually`: poll a probe until it answers, with a deadline instead of a bare sleep.

Chaos tests wait for things that happen "soon" in another process (a worker polling, a server
coming back, a prompt reaching step N). A fixed sleep is either too short on a loaded 2-core CI
machine or wastes time everywhere else; polling with a deadline is neither.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

POLL_INTERVAL_S = 0.05


class ChaosTimeout(AssertionError):
    """A condition did not come true in time. An AssertionError, so pytest reports a failure."""


async def eventually(
    probe: Callable[[], Awaitable[T]],
    *,
    timeout_s: float,
    what: str,
    accept: Callable[[T], bool] | None = None,
    interval_s: float = POLL_INTERVAL_S,
) -> T:
    """Call `probe` until `accept(value)` (default: truthiness) holds; return that value.

    A probe that raises counts as "not yet": services under test are down on purpose in these
    tests, so a refused connection is an expected answer, not an error. The last value and the
    last exception go into the timeout message, which is what one needs to debug a red run.
    """
    ok = accept if accept is not None else bool
    deadline = time.monotonic() + timeout_s
    last_value: object = "(no value yet)"
    last_error: BaseException | None = None
    while True:
        remaining = deadline - time.monotonic()
        try:
            value = await asyncio.wait_for(probe(), timeout=max(0.2, remaining))
        except Exception as exc:  # includes TimeoutError from wait_for
            last_error = exc
        else:
            if ok(value):
                return value
            last_value = value
        if time.monotonic() >= deadline:
            raise ChaosTimeout(
                f"{what}: not within {timeout_s:.1f}s (last value: {last_value!r}; "
                f"last error: {last_error!r})"
            )
        await asyncio.sleep(interval_s)


async def until(predicate: Callable[[], bool], *, timeout_s: float, what: str) -> None:
    """`eventually` for a synchronous condition on local state (e.g. a recorder's last status)."""

    async def probe() -> bool:
        return predicate()

    await eventually(probe, timeout_s=timeout_s, what=what)
