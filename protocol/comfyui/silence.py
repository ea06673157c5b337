"""A silence allowance for one socket: each wait for a frame may last `seconds`, and the time
between waits (handling a frame, uploading an output) never counts.

`asyncio.timeout` around every `recv` does the same with a timer created and cancelled per
frame; following a thousand prompts, whose frames come every few milliseconds, that was a fifth
of the worker's CPU (bench/RESULTS.md, the worker profile). Here one timer per socket lags
behind the deadline: each wait only moves a number, and the timer, when it fires early, re-arms
itself at the deadline as it stands, so it fires about once per allowance, not once per frame.

A wait that outlives its allowance raises `TimeoutError`. The cancel it uses is undone exactly
as `asyncio.timeout` undoes its own (Python 3.11): a cancel from anyone else (Temporal's, the
platform's job-stop) that lands in the same moment, or while a frame arrives, still propagates
as `CancelledError` and is never swallowed. `asyncio.wait_for` would swallow it on 3.11.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class SilenceTimer:
    """Use within one task, one wait at a time; `close()` (or the `with` block's end) drops the
    timer."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = 0.0
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._waiting: asyncio.Task[object] | None = None
        self._fired = False

    async def wait(self, awaitable: Awaitable[T]) -> T:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("SilenceTimer.wait must run inside a task")
        self.deadline = self._loop.time() + self.seconds
        if self._timer is None:
            self._timer = self._loop.call_at(self.deadline, self._on_timer)
        cancelling = task.cancelling()
        self._waiting, self._fired = task, False
        try:
            return await awaitable
        except BaseException as exc:
            # Ours was one cancel request among the task's: take it back; only when no one
            # else's is left is this our silence rather than their cancel.
            if self._fired and task.uncancel() <= cancelling:
                if isinstance(exc, asyncio.CancelledError):
                    raise TimeoutError(f"nothing came for {self.seconds:g} s") from None
            raise
        finally:
            self._waiting = None

    def _on_timer(self) -> None:
        self._timer = None
        if self._waiting is None:
            return  # between waits: the next wait arms it again
        if self._loop.time() < self.deadline:
            self._timer = self._loop.call_at(self.deadline, self._on_timer)
            return
        self._fired = True
        self._waiting.cancel()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def __enter__(self) -> SilenceTimer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
