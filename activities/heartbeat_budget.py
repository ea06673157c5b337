"""How often each followed prompt's heartbeat goes to the Temporal server: a budget per worker.

A follow activity's heartbeat carries the prompt's step to every client (`starter.progress`),
so it must reach the server often; but each one is a call to the server (and, on Temporal Cloud,
a billed action), and building it costs the worker CPU. A fixed rate per job does not scale: a
worker following 1,000 prompts at 0.4 s each sends 2,500 calls a second and spends its CPU
serializing steps nobody reads in between. So the worker has one budget, heartbeats per second
(`WorkerSettings.heartbeat_budget_per_s`), shared by the prompts it follows:

- each prompt heartbeats at most every `interval()`: the number it follows divided by the
  budget, but never more often than `fastest_s` (`heartbeat_throttle_s`) and never less often
  than `FRESHNESS_S` (1 s): a client sees every running prompt's step at least once a second,
  which wins over the budget when the worker follows more prompts than it allows (logged);
- a heartbeat is sent only when it carries something new (a step, a stage, a stored output),
  or as a sign of life within the heartbeat timeout (`keepalive_s`); milestones the workflow
  must not miss (a submission, a stored output, the end) go at once;
- between sends, frames only mark the pacer: the heartbeat is built once, when it is due.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Hashable

import structlog

log = structlog.get_logger(__name__)

# The freshness promise: a running prompt's step reaches the server at least this often.
FRESHNESS_S = 1.0


class HeartbeatBudget:
    """One worker's heartbeats per second, and the prompts that share them."""

    def __init__(
        self,
        per_s: float,
        fastest_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_s = per_s
        self.fastest_s = min(fastest_s, FRESHNESS_S)
        self.following = 0
        self._jobs: Counter[str] = Counter()  # the jobs whose prompts are followed, and how many
        self._clock = clock
        self._over = False

    def interval(self) -> float:
        """How long each followed prompt waits between heartbeats now."""
        share = self.following / self.per_s
        return min(FRESHNESS_S, max(self.fastest_s, share))

    def pacer(
        self,
        send: Callable[[], None],
        mark: Callable[[], Hashable],
        keepalive_s: float,
        *,
        job_id: str = "",
    ) -> HeartbeatPacer:
        """A pacer for one followed prompt (of `job_id`); counted in the budget while entered
        (`with`)."""
        return HeartbeatPacer(self, send, mark, keepalive_s, self._clock, job_id)

    def is_following(self, job_id: str) -> bool:
        """Whether a prompt of `job_id` is being followed by this worker now."""
        return self._jobs[job_id] > 0

    def _join(self, change: int, job_id: str) -> None:
        self.following += change
        if job_id:
            self._jobs[job_id] += change
            if self._jobs[job_id] <= 0:
                del self._jobs[job_id]
        self._note_load()

    def _note_load(self) -> None:
        """Say once when the prompts followed need more than the budget, and when they fit
        again."""
        over = self.following / FRESHNESS_S > self.per_s
        if over == self._over:
            return
        self._over = over
        if over:
            log.warning(
                "heartbeat_budget_exceeded",
                following=self.following,
                budget_per_s=self.per_s,
                sending_per_s=self.following / FRESHNESS_S,
                detail="each followed prompt still heartbeats once a second",
            )
        else:
            log.info("heartbeat_budget_kept", following=self.following, budget_per_s=self.per_s)


class HeartbeatPacer:
    """When one followed prompt's heartbeat is sent: see the module's docstring.

    `mark()` names what the heartbeat would carry (equal marks: nothing new); `send()` builds
    and sends it (`activity.heartbeat`). Its timer is scheduled from the activity's own task, so
    the send runs in the activity's context."""

    def __init__(
        self,
        budget: HeartbeatBudget,
        send: Callable[[], None],
        mark: Callable[[], Hashable],
        keepalive_s: float,
        clock: Callable[[], float],
        job_id: str = "",
    ) -> None:
        self._budget = budget
        self._job_id = job_id
        self._send = send
        self._mark = mark
        self._keepalive_s = keepalive_s
        self._clock = clock
        self._sent_at = -float("inf")
        self._sent_mark: Hashable = object()
        self._timer: asyncio.TimerHandle | None = None
        self.sent = 0

    def beat(self, *, now: bool = False) -> None:
        """Something may have changed: send if it did and the prompt's turn has come (or `now`),
        else once its turn comes; with nothing new, only a sign of life when one is due."""
        at = self._clock()
        if now:
            self._flush(at)
            return
        if self._mark() == self._sent_mark:
            if at - self._sent_at >= self._keepalive_s:
                self._flush(at)
            return
        wait = self._sent_at + self._budget.interval() - at
        if wait <= 0:
            self._flush(at)
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(wait, self._on_turn)

    def __enter__(self) -> HeartbeatPacer:
        self._budget._join(1, self._job_id)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
        self._budget._join(-1, self._job_id)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_turn(self) -> None:
        self._timer = None
        if self._mark() != self._sent_mark:
            self._flush(self._clock())

    def _flush(self, at: float) -> None:
        self.close()
        self._sent_mark = self._mark()
        self._sent_at = at
        self.sent += 1
        self._send()
