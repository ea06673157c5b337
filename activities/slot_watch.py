"""Waiting in a bounded pool's line inside the follow that checked the job.

A check told a place in line (workflows/pool_queue.py answers `ask` with one) need not hand the
wait to its job: the follow keeps its worker slot, as a follow whose prompt waits in the
provider's own queue does, and watches the pool's dispatcher for its grant. It then submits
in the same attempt. The job's history gets no grant signal, no workflow task to hear it and no
second follow; the dispatcher's gets no signal to the job. What the job hears is its place:
one `progress` report when it starts to wait (PENDING), and again when the place has halved
among the first 50 (admission.worth_telling), read every `PLACES_EVERY_S`.

One watch per pool and task queue in each worker, shared by every follow of it waiting there:
a query `holders` every tenth of the pool's time between starts (50 ms to 1 s: a grant is seen
that long after it), and a query `places` for all of them every `PLACES_EVERY_S`. Queries are
not written to any history. A follow that has waited its `slot_wait_s`, or finds the worker's
room for waiters full, leaves the wait to its job as before (`needs_slot`; the queue then tells
it by signal).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import structlog
from temporalio.client import Client, WorkflowQueryFailedError
from temporalio.service import RPCError

from workflows.admission import (
    TELL_PLACES_EVERY_S,
    TELL_PLACES_TO,
    Admission,
    LinePlaces,
    PoolHealthView,
    SlotRequest,
    placed,
    worth_telling,
)
from workflows.shared import (
    QUERY_ADMISSION,
    QUERY_LINE_PLACES,
    QUERY_POOL_HEALTH,
    QUERY_SLOT_HOLDERS,
    pool_queue_id,
)

log = structlog.get_logger(__name__)

# How often a watch asks who holds a slot (one query for all of a worker's waiters): a tenth of
# the pool's time between starts (a grant waits at most that to be seen), within these bounds.
POLL_S = 0.05
MAX_POLL_S = 1.0
POLL_SHARE_OF_A_START = 0.1
# How often it reads its waiters' places (the dispatcher's own cadence for telling places).
PLACES_EVERY_S = TELL_PLACES_EVERY_S
# How often the places of new waiters (not told one yet) are read: the first report of a job
# asked by signal waits for its place, rather than say "not known yet".
PLACES_AT_MOST_EVERY_S = 0.5
# A waiter the queue has not known this long (neither placed nor holding: a dispatcher started
# afresh) asks again.
ASK_AGAIN_EVERY_S = 10.0
# How long a failed query waits before the next.
RETRY_S = 1.0
# How often a watch with a job of a group waiting asks whether the pool takes work.
HEALTH_EVERY_S = 1.0

# Activity slots of a worker that follows waiting in line never take: the worker's other work
# (running jobs' stops, offloads, webhooks, queue sweeps) always has these.
KEPT_FREE = 100

Tell = Callable[[Admission], Awaitable[None]]
Ask = Callable[[str, str, SlotRequest], Awaitable[None]]


@dataclass
class _Waiter:
    request: SlotRequest
    tell: Tell
    granted: asyncio.Event = field(default_factory=asyncio.Event)
    # The place it last told its job (None: none yet).
    told: int | None = None
    # Since when the queue has not known it (neither placed nor holding), if it has not.
    missing_since: float | None = None
    # Its queue cannot be watched: `granted` is set to end the wait, which is handed to the job.
    unwatchable: bool = False
    # A job of a group: when its pool takes no work, the wait ends and goes to the job (which
    # may move to the group's next pool); `leaving` says why.
    leave_when_unhealthy: bool = False
    leaving: str | None = None
    # A job of a group with a start deadline: when its place here would start it later, its
    # wait ends too.
    start_by: datetime | None = None


class _PoolWatch:
    """The waiters of one pool's line in this worker, and the task that watches for them."""

    def __init__(self, client: Client, task_queue: str, pool: str, ask: Ask) -> None:
        self._handle = client.get_workflow_handle(pool_queue_id(task_queue, pool))
        self._task_queue, self._pool, self._ask = task_queue, pool, ask
        self.waiters: dict[str, _Waiter] = {}
        self._task: asyncio.Task[None] | None = None
        self._telling: set[asyncio.Task[None]] = set()
        # When every waiter's place is read again, and when those not told any yet may be; when
        # the pool's health is read again (while a job of a group waits).
        self._all_places_at = 0.0
        self._new_places_at = 0.0
        self._health_at = 0.0
        self._poll_s = POLL_S

    def add(self, waiter: _Waiter) -> None:
        self.waiters[waiter.request.job_id] = waiter
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._watch())

    def remove(self, waiter: _Waiter) -> None:
        if self.waiters.get(waiter.request.job_id) is waiter:
            del self.waiters[waiter.request.job_id]

    async def _watch(self) -> None:
        while self.waiters:
            try:
                await self._look()
            except WorkflowQueryFailedError as exc:
                # A dispatcher without these queries (of a version before them): its waiters
                # hand the wait to their jobs, which it tells by signal.
                log.warning("pool_line_not_watchable", pool=self._pool, error=str(exc))
                for waiter in self.waiters.values():
                    waiter.unwatchable = True
                    waiter.granted.set()
                await asyncio.sleep(RETRY_S)
            except (RPCError, ValueError) as exc:
                # A dispatcher continuing as new, or not started yet: the next look.
                log.debug("pool_line_watch_failed", pool=self._pool, error=str(exc))
                await asyncio.sleep(RETRY_S)
            else:
                await asyncio.sleep(self._poll_s)

    async def _look(self) -> None:
        held = set(await self._handle.query(QUERY_SLOT_HOLDERS, result_type=list[str]))
        for job_id in held & self.waiters.keys():
            self.waiters[job_id].granted.set()
        now = time.monotonic()
        await self._leave_if_unhealthy(now)
        waiting = {j: w for j, w in self.waiters.items() if not w.granted.is_set()}
        if now >= self._all_places_at:
            # Every waiter's place (its job hears it when it has halved among the first 50).
            ids = sorted(waiting)
            self._all_places_at = now + PLACES_EVERY_S
        elif now >= self._new_places_at:
            # Only those that have not told their job any place yet (a burst of checks joins
            # the line at once: a look at the whole line for each would cost the queue more
            # than its grants).
            ids = sorted(j for j, w in waiting.items() if w.told is None)
        else:
            return
        if not ids:
            return
        self._new_places_at = now + PLACES_AT_MOST_EVERY_S
        places = await self._handle.query(QUERY_LINE_PLACES, ids, result_type=LinePlaces)
        if places.per_start_s is not None:
            share = places.per_start_s * POLL_SHARE_OF_A_START
            self._poll_s = min(max(share, POLL_S), MAX_POLL_S)
        for job_id in ids:
            waiter = self.waiters.get(job_id)
            if waiter is None or waiter.granted.is_set():
                continue
            position = places.places.get(job_id)
            if position is None:
                self._unknown(waiter, now)
                continue
            waiter.missing_since = None
            if self._too_late(waiter, position, places):
                continue
            if waiter.told is None or (
                position <= TELL_PLACES_TO and worth_telling(waiter.told, position)
            ):
                waiter.told = position
                self._tell(waiter, self._place(waiter, position, places))

    def _too_late(self, waiter: _Waiter, position: int, places: LinePlaces) -> bool:
        """A job of a group whose start deadline its place here would pass (by the queue's
        pace): its wait ends, handed to the job, which moves to the group's next pool."""
        if waiter.start_by is None or places.per_start_s is None:
            return False
        eta = position * places.per_start_s
        left = (waiter.start_by - datetime.now(UTC)).total_seconds()
        if eta <= left:
            return False
        waiter.leaving = f"estimated start in {eta:.0f} s, {max(left, 0):.0f} s left of start_by_s"
        waiter.granted.set()
        return True

    async def _leave_if_unhealthy(self, now: float) -> None:
        """Every `HEALTH_EVERY_S` while a job of a group waits here: if the pool takes no work,
        those jobs' waits end (handed to the jobs, which move to the group's next pool)."""
        leavers = [
            w for w in self.waiters.values() if w.leave_when_unhealthy and not w.granted.is_set()
        ]
        if not leavers or now < self._health_at:
            return
        self._health_at = now + HEALTH_EVERY_S
        try:
            health = await self._handle.query(QUERY_POOL_HEALTH, result_type=PoolHealthView)
        except WorkflowQueryFailedError:
            return  # a dispatcher of a version without the query: its jobs wait as before
        if health.unhealthy is None:
            return
        for waiter in leavers:
            waiter.leaving = health.unhealthy
            waiter.granted.set()
        log.info("pool_line_left_unhealthy", pool=self._pool, jobs=len(leavers))

    def _unknown(self, waiter: _Waiter, now: float) -> None:
        """Neither placed nor holding: granted since the look at holders, its request not read
        yet by a busy queue, or unknown to it (a dispatcher started afresh): after
        `ASK_AGAIN_EVERY_S` of that, it asks again (a repeat changes nothing)."""
        if waiter.missing_since is None:
            waiter.missing_since = now
        elif now - waiter.missing_since >= ASK_AGAIN_EVERY_S:
            waiter.missing_since = now
            self._spawn(self._ask(self._task_queue, self._pool, waiter.request))
            log.info("pool_slot_asked_again", pool=self._pool, job_id=waiter.request.job_id)

    def _place(self, waiter: _Waiter, position: int, places: LinePlaces) -> Admission:
        return placed(
            self._pool,
            waiter.request.job_id,
            position,
            waiting=places.waiting,
            priority=waiter.request.priority,
            tenant=waiter.request.tenant,
            per_start_s=places.per_start_s,
            as_of=datetime.now(UTC),
        )

    def _tell(self, waiter: _Waiter, place: Admission) -> None:
        self._spawn(waiter.tell(place))

    def _spawn(self, work: Awaitable[None]) -> None:
        async def run() -> None:
            try:
                await work
            except Exception as exc:  # advisory: the job hears the next one
                log.warning("pool_line_tell_failed", pool=self._pool, error=str(exc))

        task = asyncio.create_task(run())
        self._telling.add(task)
        task.add_done_callback(self._telling.discard)


def waiters_room(max_concurrent_activities: int) -> int:
    """How many follows of a worker may wait in line at once: all its activity slots but
    `KEPT_FREE` (at least half of them stay free)."""
    return max(max_concurrent_activities - KEPT_FREE, max_concurrent_activities // 2, 0)


class SlotWatch:
    """The worker's follows waiting in line, at most `capacity` at once (each holds an activity
    slot of the worker: the rest of them hand the wait to their job)."""

    def __init__(self, client: Client, ask_by_signal: Ask, capacity: int) -> None:
        self._client = client
        self._ask = ask_by_signal
        self._capacity = capacity
        self._pools: dict[tuple[str, str], _PoolWatch] = {}
        self._waiting = 0

    def has_room(self) -> bool:
        return self._waiting < self._capacity

    async def wait(
        self,
        task_queue: str,
        pool: str,
        request: SlotRequest,
        answer: Admission | None,
        *,
        wait_s: float,
        tell: Tell,
        heartbeat: Callable[[], None],
        heartbeat_every_s: float,
        leave_when_unhealthy: bool = False,
        start_by: datetime | None = None,
    ) -> bool:
        """Until the job holds a slot (True), or `wait_s` has passed (False: the queue was
        asked again to tell the job by signal, as a check that did not wait). `answer` is the
        queue's answer to the check, when it gave one: told at once when it has a place."""
        key = (task_queue, pool)
        watch = self._pools.get(key)
        if watch is None:
            watch = self._pools[key] = _PoolWatch(self._client, task_queue, pool, self._ask)
        waiter = _Waiter(
            request, tell, leave_when_unhealthy=leave_when_unhealthy, start_by=start_by
        )
        if answer is not None and answer.position is not None:
            waiter.told = answer.position
            await tell(answer)
        self._waiting += 1
        watch.add(waiter)
        give_up_at = time.monotonic() + wait_s
        try:
            while not waiter.granted.is_set():
                left = give_up_at - time.monotonic()
                if left <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        waiter.granted.wait(), timeout=min(left, heartbeat_every_s)
                    )
                heartbeat()
            if waiter.granted.is_set() and not waiter.unwatchable and waiter.leaving is None:
                return True
            loud = request.model_copy(update={"in_follow": False})
            await self._ask(task_queue, pool, loud)
            log.info("pool_slot_wait_handed_to_job", pool=pool, job_id=request.job_id)
            return False
        finally:
            self._waiting -= 1
            watch.remove(waiter)

    async def admission_of(self, task_queue: str, pool: str, job_id: str) -> Admission | None:
        """The queue's word on one job (query `admission`): a granted job's server. None when
        the queue cannot be asked now (the follow then goes on without a server named, and
        asks again at its next attempt)."""
        handle = self._client.get_workflow_handle(pool_queue_id(task_queue, pool))
        for _ in range(3):
            try:
                answer = await handle.query(QUERY_ADMISSION, job_id)
                return None if answer is None else Admission.model_validate(answer)
            except (RPCError, WorkflowQueryFailedError, ValueError) as exc:
                log.warning("pool_admission_unreadable", pool=pool, job_id=job_id, error=str(exc))
                await asyncio.sleep(RETRY_S)
        return None
