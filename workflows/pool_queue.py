"""`PoolQueue`: the dispatcher of one bounded pool, the one place its slots are counted.

Jobs of a pool with `max_running` ask it for a slot once checked (the update `ask`, answered at
once, or the signal `request`), and give the slot back (`release`) once their prompt has
provably ended; it answers with the grant or a place in line, and tells a waiting job its
grant, and its place again as the line moves, by the signal `admission`. Who starts
next is workflows/admission.py's rule (priority, then tenants' fair shares, then first come).

Everything it knows is in its own history, so the bound holds across any number of workers,
a worker `kill -9`ed, a Temporal restart and continue-as-new (it carries its holders and its
line). A holder whose workflow closed without releasing (`temporal workflow terminate`) is
found by the `closed_jobs` activity every `reclaim_every_s`, and a grant whose job is gone is
taken back at once. A holder whose teardown was not confirmed keeps its slot until it is
settled: by the provider's execution timeout surely over, or by an operator's `release`.

It continues as new when its history grows long, after an idle hour, and as soon as the
deployment's current version changes (`is_target_worker_deployment_version_changed`); each new
run starts on the current version (`AUTO_UPGRADE` for its start only; each run is pinned like
the jobs), so an upgrade reaches the dispatcher at once and the old version can drain. Its
messages are tolerant models, read alike by an older job and a newer dispatcher.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from workflows import shared
    from workflows.admission import (
        TELL_PLACES_EVERY_S,
        TELL_PLACES_TO,
        Admission,
        EndpointHealth,
        Holder,
        LinePlaces,
        PoolDrain,
        PoolHealthView,
        PoolLine,
        PoolQueueView,
        QueueRoom,
        QueueState,
        ServerWatch,
        SlotRelease,
        SlotRequest,
        SlotUnsettled,
        worth_telling,
    )

# At most this many places are told in one pass of the loop, so that a slot freed meanwhile
# is granted after one such batch at the most, not after a whole line's.
TELL_AT_ONCE = 100
# A run with nothing held and nothing waiting continues as new after this long, so an idle
# dispatcher also moves to the current version.
IDLE_RUN_S = 3600.0
# The server health watch's own limits (activities/comfyui/server_health.py returns within 10
# minutes and heartbeats every second).
WATCH_SERVERS_FOR_S = 660.0
WATCH_HEARTBEAT_S = 30.0


class QueueMetrics:
    """The queue's metrics, on the SDK's workflow meter (silent while replaying): starts and
    their wait per pool and tenant, and the line's depth as the worker that last ran the
    dispatcher saw it (gauges: a dashboard takes their `max by (pool, tenant)`)."""

    def __init__(self, pool: str) -> None:
        meter = workflow.metric_meter()
        self._pool = pool
        self._starts = meter.create_counter(
            "durable_comfy_queue_starts", "Jobs granted a slot of a bounded pool"
        )
        self._wait = meter.create_histogram_float(
            "durable_comfy_queue_wait_seconds", "Time PENDING in a pool's queue", "s"
        )
        self._waiting = meter.create_gauge(
            "durable_comfy_queue_waiting", "Jobs waiting in a pool's queue"
        )
        self._running = meter.create_gauge(
            "durable_comfy_queue_running", "Jobs holding a slot of a bounded pool"
        )
        self._server_running = meter.create_gauge(
            "durable_comfy_pool_server_running", "Jobs on one server of a pool of many"
        )
        self._server_healthy = meter.create_gauge(
            "durable_comfy_pool_server_healthy",
            "1 when a server of a pool of many takes work, 0 when unhealthy or drained",
        )
        self._server_failures = meter.create_counter(
            "durable_comfy_pool_server_failures", "Times a server of a pool turned unhealthy"
        )
        self._tenants: set[str] = set()

    def server_failed(self, server: str) -> None:
        self._server_failures.add(1, {"pool": self._pool, "server": server})

    def granted(self, holder: Holder) -> None:
        labels = {"pool": self._pool, "tenant": holder.tenant}
        self._starts.add(1, labels)
        if holder.asked_at is not None:
            waited = (holder.granted_at - holder.asked_at).total_seconds()
            self._wait.record(max(waited, 0.0), labels)

    def depth(self, line: PoolLine) -> None:
        counts = line.tenant_counts()
        self._tenants |= set(counts)
        for tenant in self._tenants:
            waiting, _ = counts.get(tenant, (0, 0))
            self._waiting.set(waiting, {"pool": self._pool, "tenant": tenant})
        self._running.set(len(line.state.holders), {"pool": self._pool})
        for server in line.server_views():
            labels = {"pool": self._pool, "server": server.url}
            self._server_running.set(server.running, labels)
            self._server_healthy.set(1 if server.health == "healthy" else 0, labels)


@workflow.defn(name=shared.POOL_QUEUE_WORKFLOW_TYPE)
class PoolQueue:
    @workflow.init
    def __init__(self, state: QueueState) -> None:
        self._line = PoolLine(state)
        self._metrics = QueueMetrics(state.pool)
        self._news = True
        # Waiting jobs that have not heard their place yet (carried: the waiters the last run
        # had told need no telling again), and the place each heard last.
        waiting = set(self._line.waiting_ids())
        self._untold: set[str] = {j for j in state.untold if j in waiting}
        self._told: dict[str, int] = {}
        # Holders to tell of their grant: granted by a `request`'s or an `ask`'s arrival (the
        # asker itself hears it in the update's answer), or asking again (a job's run that did
        # not hear its grant); carried, when the last run ended before telling them.
        self._regrant: set[str] = {j for j in state.unheard if j in self._line.state.holders}
        self._reclaimed = 0

    @workflow.run
    async def run(self, state: QueueState) -> None:
        reclaim = asyncio.create_task(self._reclaim_closed_holders())
        ticker = asyncio.create_task(self._tick_while_anyone_waits())
        health = asyncio.create_task(self._watch_servers())
        endpoint = asyncio.create_task(self._watch_endpoint())
        started = workflow.now()
        next_telling = started
        while not self._should_continue(started):
            # The 10 s refresh of places comes from `_tick_while_anyone_waits` (one timer per
            # 10 s; a timer here would be started and cancelled at every pass).
            wake = self._line.next_settle_at()
            timeout = None
            if wake is not None:
                timeout = max((wake - workflow.now()).total_seconds(), 0.001)
            try:
                await workflow.wait_condition(
                    lambda: self._news or self._should_continue(started),
                    timeout=timeout,
                    timeout_summary="next settle or position",
                )
            except TimeoutError:
                pass
            self._news = False
            now = workflow.now()
            for job_id in self._line.settle_due(now):
                self._line.release(job_id, now)
            await self._grant(now)
            refresh = now >= next_telling
            if self._untold or refresh:
                if await self._tell_positions(now, refresh=refresh) and self._untold:
                    # More to tell: the next pass goes on (after any grant due meanwhile).
                    self._news = True
                if refresh:
                    next_telling = now + timedelta(seconds=TELL_PLACES_EVERY_S)
            self._metrics.depth(self._line)
        reclaim.cancel()
        ticker.cancel()
        health.cancel()
        endpoint.cancel()
        with contextlib.suppress(asyncio.CancelledError, ActivityError):
            # Its activity's cancellation, retrieved (unretrieved, asyncio logs it).
            await reclaim
        with contextlib.suppress(asyncio.CancelledError, ActivityError):
            await health
        with contextlib.suppress(asyncio.CancelledError, ActivityError):
            await endpoint
        with contextlib.suppress(asyncio.CancelledError):
            await ticker
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(
            self._line.snapshot(self._untold, self._regrant),
            initial_versioning_behavior=workflow.ContinueAsNewVersioningBehavior.AUTO_UPGRADE,
        )

    def _should_continue(self, started: Any) -> bool:
        info = workflow.info()
        limit = self._line.state.history_limit
        if info.is_continue_as_new_suggested() or info.get_current_history_length() > limit:
            return True
        if info.is_target_worker_deployment_version_changed():
            # A new version is current: the next run starts on it (its workers serve the jobs
            # that ask now), and the old version can drain.
            return True
        idle = not self._line.waiting and not self._line.state.holders
        return idle and (workflow.now() - started).total_seconds() > IDLE_RUN_S

    # -- grants and places --------------------------------------------------------------------

    def _grant_now(self, now: Any) -> None:
        """Every free slot to the next in line; each grantee is told by `_grant`."""
        for holder in self._line.grants(now):
            self._metrics.granted(holder)
            if not holder.in_follow:
                self._regrant.add(holder.job_id)
            self._untold.discard(holder.job_id)
            self._told.pop(holder.job_id, None)

    async def _grant(self, now: Any) -> None:
        self._grant_now(now)
        holders = self._line.state.holders
        granted = sorted(j for j in self._regrant if j in holders)
        self._regrant.clear()
        if not granted:
            return
        answers = [self._line.granted(job_id, now) for job_id in granted]
        results = await asyncio.gather(
            *(self._tell(answer, job_id) for answer, job_id in zip(answers, granted, strict=True))
        )
        for job_id, delivered in zip(granted, results, strict=True):
            if not delivered:
                # Its job is gone (closed, terminated): the slot is free again.
                self._line.release(job_id, workflow.now())
                self._news = True

    async def _tell_positions(self, now: Any, *, refresh: bool) -> bool:
        """The new waiters their place, the first `TELL_AT_ONCE` of them in line order; on a
        refresh, also the first in line whose place moved. True when it told anyone."""
        self._untold &= {j for j in self._line.waiting_ids() if not self._line.watched(j)}
        tellings: list[tuple[str, int]] = []
        untold_left = len(self._untold)
        for job_id, position in self._line.places():
            if len(tellings) >= TELL_AT_ONCE:
                break
            if job_id in self._untold:
                tellings.append((job_id, position))
                untold_left -= 1
            elif (
                refresh
                and position <= TELL_PLACES_TO
                and worth_telling(self._told.get(job_id), position)
                and not self._line.watched(job_id)
            ):
                tellings.append((job_id, position))
            elif untold_left == 0 and (not refresh or position > TELL_PLACES_TO):
                break  # nothing further down the line to tell
        for job_id, position in tellings:
            self._untold.discard(job_id)
            self._told[job_id] = position
        answers = [self._line.answer(job_id, position, now) for job_id, position in tellings]
        results = await asyncio.gather(
            *(self._tell(a, job_id) for (job_id, _), a in zip(tellings, answers, strict=True))
        )
        for (job_id, _), delivered in zip(tellings, results, strict=True):
            if not delivered:
                self._line.release(job_id, workflow.now())
                self._told.pop(job_id, None)
        return bool(tellings)

    async def _tell(self, admission: Admission, job_id: str) -> bool:
        """Signal the job; False when it is gone (closed or unknown)."""
        try:
            await workflow.get_external_workflow_handle(job_id).signal(
                shared.SIGNAL_ADMISSION, admission
            )
        except asyncio.CancelledError:
            raise
        except Exception:
            return False
        return True

    async def _tick_while_anyone_waits(self) -> None:
        """A pass of the loop every 10 s while anyone waits: places told by signal are
        refreshed, and a new current version is noticed (`_should_continue`) even when no job
        signals (those waiting in line in their follows send nothing until a slot frees)."""
        while True:
            await workflow.wait_condition(lambda: self._line.waiting > 0)
            await workflow.sleep(
                timedelta(seconds=TELL_PLACES_EVERY_S), summary="places and version"
            )
            self._news = True

    # -- holders whose job closed -------------------------------------------------------------

    async def _reclaim_closed_holders(self) -> None:
        while True:
            await workflow.wait_condition(lambda: bool(self._line.state.holders))
            await workflow.sleep(
                timedelta(seconds=self._line.state.reclaim_every_s), summary="reclaim sweep"
            )
            held = sorted(self._line.state.holders)
            if not held:
                continue
            closed: list[str] = await workflow.execute_activity(
                shared.ACTIVITY_CLOSED_JOBS,
                args=[self._line.state.pool, held],
                result_type=list[str],
                start_to_close_timeout=timedelta(seconds=60),
                retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=30)),
            )
            now = workflow.now()
            for job_id in closed:
                if self._line.release(job_id, now):
                    # Still held here when its job had closed: terminated, or ended without a
                    # word (one that released meanwhile was let go by its release, not here).
                    workflow.logger.warning(
                        "pool_slot_reclaimed",
                        extra={"pool": self._line.state.pool, "job_id": job_id},
                    )
                    self._reclaimed += 1
                    self._news = True

    # -- the servers of a pool of many ------------------------------------------------------

    async def _watch_servers(self) -> None:
        """The health of the pool's servers, as one watch (an activity) sees it: its answer
        comes when a server turns unhealthy or healthy again; no job is granted a server
        that is not healthy (its running jobs stay with it: their follows re-attach)."""
        state = self._line.state
        while True:
            await workflow.wait_condition(lambda: bool(state.servers))
            watch = ServerWatch(
                pool=state.pool,
                servers=list(state.servers),
                unhealthy={
                    server: known.unhealthy
                    for server, known in state.server_states.items()
                    if known.unhealthy is not None and server in state.servers
                },
            )
            seen: dict[str, str | None] = await workflow.execute_activity(
                shared.ACTIVITY_WATCH_SERVERS,
                watch,
                result_type=dict[str, str | None],
                start_to_close_timeout=timedelta(seconds=WATCH_SERVERS_FOR_S),
                heartbeat_timeout=timedelta(seconds=WATCH_HEARTBEAT_S),
                retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=10)),
                summary="server health",
            )
            now = workflow.now()
            was = self._line.unhealthy()
            for server, reason in sorted(seen.items()):
                if self._line.set_health(server, reason, now):
                    if reason is not None:
                        self._metrics.server_failed(server)
                    workflow.logger.warning(
                        "pool_server_health",
                        extra={"pool": state.pool, "server": server, "unhealthy": reason},
                    )
                    self._news = True
            if was is None and self._line.unhealthy() is not None:
                self._tell_every_waiter()

    async def _watch_endpoint(self) -> None:
        """A runpod pool's endpoint, as one watch (an activity reading `/health`) sees it: its
        answer comes when the endpoint turns unable to take a job (no worker idle, ready or
        starting, some unhealthy or throttled), able again, or cold. Unable, the pool grants
        nothing, and every waiting job hears why (a job of a group moves to its next pool)."""
        state = self._line.state
        while True:
            await workflow.wait_condition(lambda: state.endpoint_watch)
            health: EndpointHealth = await workflow.execute_activity(
                shared.ACTIVITY_WATCH_ENDPOINT,
                args=[state.pool, state.endpoint],
                result_type=EndpointHealth,
                start_to_close_timeout=timedelta(seconds=WATCH_SERVERS_FOR_S),
                heartbeat_timeout=timedelta(seconds=WATCH_HEARTBEAT_S),
                retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=10)),
                summary="endpoint health",
            )
            was = self._line.unhealthy()
            if self._line.set_endpoint(health):
                workflow.logger.warning(
                    "pool_endpoint_health",
                    extra={"pool": state.pool, "unhealthy": health.unhealthy, "cold": health.cold},
                )
                self._news = True
                if was is None and self._line.unhealthy() is not None:
                    self._tell_every_waiter()

    def _tell_every_waiter(self) -> None:
        """Each waiting job hears its place again, now with why the pool takes no work: those
        waiting by signal from the loop, a follow waiting in line from its next look."""
        self._untold |= {j for j in self._line.waiting_ids() if not self._line.watched(j)}
        self._news = True

    @workflow.update(name=shared.UPDATE_POOL_DRAIN)
    def drain(self, payload: Any = None) -> PoolQueueView:
        """`pool drain` / `pool undrain`: a drained server (or pool) is granted no new job;
        what runs there finishes. Durable: every worker's jobs get their grants here."""
        order = PoolDrain.model_validate(payload)
        now = workflow.now()
        self._line.drain(order.server, order.by if order.drain else None, now)
        self._news = True
        return self._line.view(now)

    @drain.validator
    def _drain_names_a_server(self, payload: Any = None) -> None:
        order = PoolDrain.model_validate(payload)
        servers = self._line.state.servers
        if order.server is not None and servers and order.server not in servers:
            raise ValueError(
                f"{order.server} is not a server of pool {self._line.state.pool!r} "
                f"(its servers: {', '.join(servers)})"
            )

    # -- messages -----------------------------------------------------------------------------

    @workflow.signal(name=shared.SIGNAL_SLOT_REQUEST)
    def request(self, payload: Any = None) -> None:
        try:
            ask = SlotRequest.model_validate(payload)
        except ValueError:
            return  # nothing to answer to: a request names its job
        self._line.request(ask, workflow.now())
        if ask.in_follow:
            pass  # its follow watches for the grant and its place (queries `holders`, `places`)
        elif ask.job_id in self._line.state.holders:
            self._regrant.add(ask.job_id)
        else:
            self._untold.add(ask.job_id)
        self._news = True

    @workflow.update(name=shared.UPDATE_SLOT_ASK)
    def ask(self, payload: Any = None) -> Admission:
        """`request`, answered at once: the grant when a slot is free, else the place in line
        (the check's activity asks this way, and hands the answer to its job: no signal back,
        and on an idle pool no wait for one)."""
        ask = SlotRequest.model_validate(payload)
        now = workflow.now()
        self._line.request(ask, now)
        self._news = True
        self._grant_now(now)
        # The asker hears this answer; others granted now are told by the loop.
        self._regrant.discard(ask.job_id)
        if ask.job_id in self._line.state.holders:
            return self._line.granted(ask.job_id, now)
        answer = self._line.admission_of(ask.job_id, now)
        assert answer is not None
        self._untold.discard(ask.job_id)
        self._told[ask.job_id] = answer.position or 0
        return answer

    @ask.validator
    def _ask_is_readable(self, payload: Any = None) -> None:
        # Refused before it is written to the history: the asker falls back to the signal.
        SlotRequest.model_validate(payload)

    @workflow.signal(name=shared.SIGNAL_SLOT_RELEASE)
    def release(self, payload: Any = None) -> None:
        try:
            note = SlotRelease.model_validate(payload)
        except ValueError:
            return
        self._line.release(note.job_id, workflow.now())
        self._untold.discard(note.job_id)
        self._told.pop(note.job_id, None)
        self._news = True

    @workflow.signal(name=shared.SIGNAL_SLOT_UNSETTLED)
    def unsettled(self, payload: Any = None) -> None:
        try:
            note = SlotUnsettled.model_validate(payload)
        except ValueError:
            return
        if not self._line.unsettled(note):
            # Not a holder: still in line (its follow was granted nothing it could have sent),
            # so its place goes back.
            self._line.release(note.job_id, workflow.now())
        self._news = True

    @workflow.query(name=shared.QUERY_POOL_QUEUE)
    def queue(self, _ignored: Any = None) -> PoolQueueView:
        return self._line.view(workflow.now())

    @workflow.query(name=shared.QUERY_SLOT_HOLDERS)
    def holders(self, _ignored: Any = None) -> list[str]:
        """Who holds a slot: a follow waiting in line watches for its job here."""
        return sorted(self._line.state.holders)

    @workflow.query(name=shared.QUERY_LINE_PLACES)
    def places(self, job_ids: Any = None) -> LinePlaces:
        wanted = [j for j in job_ids if isinstance(j, str)] if isinstance(job_ids, list) else []
        return self._line.places_of(wanted)

    @workflow.query(name=shared.QUERY_POOL_HEALTH)
    def health(self, _ignored: Any = None) -> PoolHealthView:
        return self._line.health_view()

    @workflow.query(name=shared.QUERY_ROOM)
    def room(self, tenant: Any = None) -> QueueRoom:
        return self._line.room(tenant if isinstance(tenant, str) else shared.DEFAULT_TENANT)

    @workflow.query(name=shared.QUERY_ADMISSION)
    def admission(self, job_id: Any = None) -> Admission | None:
        if not isinstance(job_id, str):
            return None
        return self._line.admission_of(job_id, workflow.now())
