"""Stopping a job: the timers that order it from outside the work, stopping its prompt for
good, and the record of how that went.

The deadline, abandonment and a queue wait each wait on a durable timer and, when it fires,
order the stop with a typed reason; the job's one stop path (`InferenceJob._stop`) does the
rest, as for a cancel.

ComfyUI interrupts cooperatively: a node checks the flag only in its progress hook or at the
next node boundary, so a big blur or a model load runs on for many seconds after `/interrupt`.
A stop is therefore confirmed, not requested: each check dequeues the prompt if it waits,
interrupts it if it runs, and reads how it ended once it is gone; between checks the workflow
waits on a durable, jittered timer. Only past `policy.teardown_horizon_s` does the stop give up:
teardown FAILED, naming the prompt and the pool, and the worker marks the pool busy until the
prompt is gone.

Every check adds to one `Teardown` record in the job's status, across retries, across the early
stop (at the moment of a cancel) and the final one (after the work settled).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Literal

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows import activity_calls as calls
    from workflows.activity_io import OffloadInput, StopCheck, StopInput
    from workflows.admission import place_in_line
    from workflows.contracts import (
        ENDINGS,
        JobError,
        JobPolicy,
        JobState,
        OutputSpec,
        StopAction,
        Teardown,
        TeardownStep,
    )
    from workflows.failures import job_error
    from workflows.graph import run_tag
    from workflows.job_book import JobBook, StopOrder
    from workflows.pool_slot import PoolSlot
    from workflows.shared import ErrorType, reconnect_delay

# Checks never wait longer than this apart: a prompt that stopped should not keep its job
# waiting for long, and the horizon still bounds how many checks there are.
MAX_CHECK_INTERVAL_S = 15.0


def stop_reason(state: JobState, timed_out: bool = False) -> str:
    """How the Temporal UI labels the stop: what the teardown follows, never its own outcome."""
    if timed_out:
        return "after the execution deadline"
    ending = ENDINGS.get(state)
    return ending.stop_label if ending is not None else f"after {state.value.lower()}"


# -- the timers that order a stop from outside the work ------------------------------------

OrderStop = Callable[[StopOrder], None]


def start_guards(
    policy: JobPolicy, book: JobBook, stop: OrderStop, slot: PoolSlot
) -> list[asyncio.Task[None]]:
    """The policy's guards, each a task beside the job's work until it ends."""
    line = TimeInLine()
    slot.on_wait, slot.on_granted_after_wait = line.waits, line.granted
    running = [asyncio.create_task(execution_deadline(policy, stop, line))]
    if policy.abandon_after_s is not None:
        watchdog = abandon_watchdog(policy.abandon_after_s, book, stop)
        running.append(asyncio.create_task(watchdog))
    if policy.queue_timeout_s is not None:
        queue = queue_watchdog(policy.queue_timeout_s, book, stop)
        running.append(asyncio.create_task(queue))
    if policy.start_by_s is not None:
        running.append(asyncio.create_task(start_deadline(policy.start_by_s, book, stop)))
    return running


async def start_deadline(start_by_s: float, book: JobBook, stop: OrderStop) -> None:
    """Counted from acceptance: a prompt that has not begun to run by then (the job PENDING in
    our queue, or its prompt queued at the provider) is withdrawn, and the job ends EXPIRED."""
    accepted = book.status.created_at or workflow.now()
    left = start_by_s - (workflow.now() - accepted).total_seconds()
    try:
        await workflow.wait_condition(
            lambda: book.began_running,
            timeout=timedelta(seconds=max(left, 0.001)),
            timeout_summary="start deadline",
        )
    except TimeoutError:
        where = _where_it_waits(book)
        message = f"not begun to run within start_by_s ({start_by_s:.0f} s): {where}"
        stop(StopOrder(JobState.EXPIRED, JobError(type=ErrorType.EXPIRED, message=message)))


def _where_it_waits(book: JobBook) -> str:
    admission = book.status.admission
    if book.pending and admission is not None and admission.held is not None:
        return place_in_line(admission)
    if book.pending and admission is not None:
        return f"place {admission.position or '?'} in the queue of pool {admission.pool}"
    if book.status.state == JobState.WAITING:
        place = book.status.progress.queue_position
        return "in the backend's queue" + (f" (place {place})" if place is not None else "")
    return f"still {book.status.state.value}"


class TimeInLine:
    """How long the job has been PENDING in our queue, which its execution deadline does not
    count (the deadline's timer runs from the start and, when it fires, sleeps that much more:
    a job that waits and then runs within its deadline costs no timer more than any other)."""

    def __init__(self) -> None:
        self.since: datetime | None = None
        self.total_s = 0.0

    @property
    def waiting(self) -> bool:
        return self.since is not None

    def waits(self) -> None:
        self.since = workflow.now()

    def granted(self) -> None:
        if self.since is not None:
            self.total_s += (workflow.now() - self.since).total_seconds()
            self.since = None


async def execution_deadline(
    policy: JobPolicy, stop: OrderStop, line: TimeInLine | None = None
) -> None:
    timeout = timedelta(seconds=policy.execution_timeout_s)
    await workflow.sleep(timeout, summary="execution deadline")
    counted = 0.0
    while line is not None:
        if line.waiting:
            await workflow.wait_condition(lambda: not line.waiting)
        owed = line.total_s - counted
        if owed <= 0:
            break
        counted = line.total_s
        await workflow.sleep(timedelta(seconds=owed), summary="execution deadline (time in line)")
    message = f"the job ran past execution_timeout_s ({policy.execution_timeout_s:.0f} s)"
    stop(StopOrder(JobState.FAILED, JobError(type=ErrorType.TIMEOUT, message=message)))


async def abandon_watchdog(abandon_after_s: float, book: JobBook, stop: OrderStop) -> None:
    """No client contact (a query does not count: it leaves no trace) for `abandon_after_s`."""
    while True:
        seen = book.contacts
        try:
            await workflow.wait_condition(
                lambda seen=seen: book.contacts != seen,  # type: ignore[misc]
                timeout=timedelta(seconds=abandon_after_s),
                timeout_summary="abandon watchdog",
            )
        except TimeoutError:
            message = f"no client contact for {abandon_after_s:.0f} s"
            stop(StopOrder(JobState.ABANDONED, JobError(type=ErrorType.ABANDONED, message=message)))
            return


async def queue_watchdog(queue_timeout_s: float, book: JobBook, stop: OrderStop) -> None:
    """A prompt that waits in the backend's queue longer than `queue_timeout_s` fails the job
    (`QueueTimeout`): the GPU it waits for is not coming in time."""
    while True:
        await workflow.wait_condition(lambda: book.backend_state == JobState.WAITING)
        waiting_for = book.prompt_id

        def moved_on(prompt: str | None = waiting_for) -> bool:
            return book.backend_state != JobState.WAITING or book.prompt_id != prompt

        try:
            await workflow.wait_condition(
                moved_on,
                timeout=timedelta(seconds=queue_timeout_s),
                timeout_summary="queue timeout",
            )
        except TimeoutError:
            position = book.status.progress.queue_position
            message = (
                f"prompt {waiting_for} waited in the backend's queue (place {position}) "
                f"longer than queue_timeout_s ({queue_timeout_s:.0f} s)"
            )
            stop(
                StopOrder(JobState.FAILED, JobError(type=ErrorType.QUEUE_TIMEOUT, message=message))
            )
            return


# -- stopping the prompt ---------------------------------------------------------------------


class PromptStop:
    """Stops one job's prompt on its pool and keeps `status.teardown` true to what happened."""

    def __init__(self, book: JobBook, policy: JobPolicy, output: OutputSpec | None = None) -> None:
        self._book = book
        self._policy = policy
        self._output = output or OutputSpec()
        self._freed = False

    @property
    def record(self) -> Teardown:
        return self._book.status.teardown

    async def confirm(
        self,
        pool: str | None,
        prompt_id: str,
        reason: str,
        *,
        submitted: bool,
        settled: bool,
        free_memory: bool = False,
    ) -> None:
        """Check until the prompt is gone, or the teardown horizon has passed.

        `settled`: the job's own work has ended, so nothing can submit the prompt any more and
        "no record of it" is final ("never queued"). An early stop, while the work may still be
        submitting, leaves that verdict to the settled pass.
        """
        started_at = self._book.teardown_started()
        deadline = started_at + timedelta(seconds=self._policy.teardown_horizon_s)
        attempt = 0
        while True:
            final = workflow.now() >= deadline
            check = await self._check(
                StopInput(
                    job_id=self._book.status.job_id,
                    pool=pool,
                    prompt_id=prompt_id,
                    reason=reason,
                    free_memory=free_memory and not self._freed,
                    submitted=submitted,
                    final=final,
                    provider_job_id=self._provider_job_id(prompt_id),
                    output=self._output,
                    server=self._book.server,
                )
            )
            checks = self._book.stop_checked()
            if check is not None and check.pool and check.kind:
                self._book.prepared_on(check.pool, check.kind)
                pool = check.pool  # the pool the job had not named yet
            if check is not None and check.slot is not None and self._book.on_slot_held:
                self._book.on_slot_held(check.slot)  # unless the job knows its slot already
            if check is not None:
                self._note(check, submitted=submitted, settled=settled)
            if check is not None and check.position == "stuck":
                # The backend gave up on the prompt itself: asking again would change nothing.
                self._end("FAILED", f"{reason}: {check.message}. {self.summary()}")
                return
            if check is not None and check.position == "gone":
                if not check.confirmed:
                    self._end("UNCONFIRMED", f"{reason}: {check.message}. {self.summary()}")
                elif settled or submitted or self._acted():
                    self._end("CONFIRMED", f"{reason}: {self.summary()}")
                else:
                    # Not on the backend yet, and the work may still be submitting it: the
                    # settled pass decides.
                    self._book.teardown_waiting(
                        f"{reason}: prompt {prompt_id} not on the backend (yet)"
                    )
                return
            if final:
                where = check.position if check is not None else "unreachable"
                self._add(
                    "still_running",
                    detail=f"prompt {prompt_id} on {_named(pool, quoted=False)}: {where}",
                )
                self._end(
                    "FAILED",
                    f"{reason}: prompt {prompt_id} was still {where} on {_named(pool)} after the "
                    f"teardown horizon ({self._policy.teardown_horizon_s:.0f} s, "
                    f"{checks} checks); the pool takes no new work from this worker "
                    f"until it is gone. {self.summary()}",
                )
                return
            self._book.teardown_waiting(
                f"{reason}: waiting for prompt {prompt_id} to leave {_named(pool)} "
                f"({self.summary()}; check {checks})"
            )
            reconnect = self._policy.reconnect
            delay = reconnect_delay(
                attempt,
                reconnect.base_delay_s,
                min(reconnect.max_delay_s, MAX_CHECK_INTERVAL_S),
                workflow.random().random(),
            )
            remaining = (deadline - workflow.now()).total_seconds()
            if remaining > 0:
                await workflow.sleep(
                    timedelta(seconds=min(delay, remaining)),
                    summary=f"stop check {checks + 1}",
                )
            attempt += 1

    def seen_finished(self, prompt_id: str, reason: str) -> None:
        """The record of a stop that needed no check: the prompt's end was already seen."""
        self._book.teardown_started()
        self._add("finished", detail=f"prompt {prompt_id}: its end was seen by the follow")
        self._end("CONFIRMED", f"{reason}: {self.summary()}")

    def _provider_job_id(self, prompt_id: str) -> str | None:
        checkpoint = self._book.status.checkpoint
        if checkpoint is None or checkpoint.prompt_id != prompt_id:
            return None
        return checkpoint.provider_job_id

    async def _check(self, req: StopInput) -> StopCheck | None:
        try:
            return await calls.stop(req)
        except Exception as err:  # the backend did not answer: record it, ask again later
            self._add("check_failed", detail=job_error(err).message)
            return None

    def _note(self, check: StopCheck, *, submitted: bool, settled: bool) -> None:
        for cost in [*check.other_costs, *([check.cost] if check.cost is not None else [])]:
            self._book.add_cost(cost)
        if check.position == "unreachable":
            self._add("check_failed", at_check=check, detail=check.message)
            return
        if check.freed_memory:
            self._freed = True
            self._add("freed_memory", at_check=check)
        if check.action == "dequeued":
            self._add("dequeued", at_check=check)
        elif check.action == "interrupt_sent":
            self._add("interrupt_sent", at_check=check)
        elif check.action == "cancel_sent":
            self._add("cancel_sent", at_check=check, detail=check.message)
        if check.position == "stuck":
            self._add("still_running", at_check=check, node=check.node, detail=check.message)
            if check.worker_replaced:
                self._add("worker_replaced", at_check=check, detail=check.worker_id or "")
            return
        if check.position != "gone":
            return
        if not check.confirmed:
            return  # nothing is known of how the prompt ended: the stop's detail says why
        node = check.node
        where = f"node {node} ({check.node_type})" if node else ""
        if check.ended == "interrupted":
            self._add("interrupted", at_check=check, node=node, detail=where)
        elif check.ended == "success":
            self._add("finished", at_check=check)
        elif check.ended == "error":
            self._add("failed", at_check=check, node=node, detail=f"{where}: {check.message}")
        elif check.ended == "never_queued":
            self._add("never_queued", at_check=check, detail=check.message)
        elif self._last_action() == "dequeued":
            pass  # a dequeued prompt leaves no history: the dequeue says it all
        elif not submitted and not self._acted():
            if settled:
                self._add("never_queued", at_check=check)
        else:
            self._add("gone", at_check=check, detail="no longer queued, no record of how it ended")

    def _add(
        self,
        action: StopAction,
        *,
        at_check: StopCheck | None = None,
        node: str | None = None,
        detail: str = "",
    ) -> None:
        steps = self.record.steps
        if steps and steps[-1].action == action and steps[-1].node == node:
            return  # a repeated observation (a re-sent interrupt, a second pass) adds nothing
        at = at_check.at if at_check is not None else workflow.now()
        self._book.add_teardown_step(TeardownStep(at=at, action=action, node=node, detail=detail))

    def _last_action(self) -> StopAction | None:
        return self.record.steps[-1].action if self.record.steps else None

    def _acted(self) -> bool:
        return any(
            s.action in ("dequeued", "interrupt_sent", "cancel_sent") for s in self.record.steps
        )

    def _end(self, state: Literal["CONFIRMED", "FAILED", "UNCONFIRMED"], detail: str) -> None:
        record = self._book.end_teardown(state, detail)
        if record.started_at is not None and record.at is not None:
            seconds = (record.at - record.started_at).total_seconds()
            workflow.metric_meter().create_histogram_float(
                "durable_comfy_teardown_seconds", "From a stop's start to its end", "s"
            ).record(seconds, {"state": state})

    def summary(self) -> str:
        """What was done and seen, in order: "interrupt sent, interrupted at node 3 (...)"."""
        words = {
            "never_queued": "never queued",
            "dequeued": "dequeued before it started",
            "interrupt_sent": "interrupt sent",
            "interrupted": "interrupted",
            "finished": "had already finished",
            "failed": "had failed",
            "gone": "gone from the backend (no record of how it ended)",
            "freed_memory": "memory freed",
            "still_running": "still running",
            "check_failed": "backend unreachable",
            "cancel_sent": "provider job cancelled (the worker cannot be told to stop the prompt)",
            "worker_replaced": "worker replaced",
        }
        parts = []
        for step in self.record.steps:
            text = words[step.action]
            if step.action == "interrupted" and step.detail:
                text += f" at {step.detail}"
            parts.append(text)
        return ", ".join(parts) or "nothing to stop yet"


class ConfirmedStop:
    """A job's stop: an early pass the moment it is asked for, then one after the work ended.

    The follow activity hears of its cancel only on its next heartbeat, so the early pass stops
    the GPU at once; the settled pass confirms, and alone may say "never queued".
    """

    def __init__(self, book: JobBook, policy: JobPolicy, output: OutputSpec | None = None) -> None:
        self._book = book
        self._output = output or OutputSpec()
        self._stop = PromptStop(book, policy, output)
        self._early: asyncio.Task[None] | None = None

    def begin(self, order: StopOrder, pool: str | None, prompt_id: str | None) -> None:
        """`prompt_id` None: nothing submitted yet, the settled pass alone checks."""
        self._book.set_state(JobState.STOPPING)
        if prompt_id is not None and not self._book.awaiting_slot:
            self._early = asyncio.create_task(
                self._stop.confirm(
                    pool,
                    prompt_id,
                    stop_reason(order.state, order.timed_out),
                    submitted=self._book.submitted(),
                    settled=False,
                )
            )

    async def settle(self, ending: StopOrder, pool: str | None, prompt_id: str) -> None:
        """`ending`: the order the job stopped by, else how its work ended."""
        state, error = ending.state, ending.error
        if (
            state == JobState.COMPLETED
            and self._early is None
            and self._book.finished_prompt == prompt_id
        ):
            # The follow saw the prompt end successfully on the backend: there is nothing left
            # to stop, and asking again would cost the job a round trip.
            self._stop.seen_finished(prompt_id, stop_reason(state))
            return
        if state != JobState.COMPLETED:
            self._book.set_state(JobState.STOPPING)
        if self._early is not None:
            await self._early
        await self._stop.confirm(
            pool,
            prompt_id,
            stop_reason(state, ending.timed_out),
            submitted=self._book.submitted(),
            settled=True,
            free_memory=error is not None and error.type == ErrorType.OUT_OF_MEMORY,
        )

    async def keep_finished(self, pool: str | None) -> None:
        """After a stop that was not a completion: store what the stopped prompt finished
        (never fails the job; the warning says why nothing was kept)."""
        book = self._book
        job_id, checkpoint = book.status.job_id, book.status.checkpoint
        if checkpoint is None or checkpoint.prompt_id is None:
            return
        try:
            kept = await calls.offload(
                OffloadInput(
                    job_id=job_id,
                    pool=pool,
                    prompt_id=checkpoint.prompt_id,
                    segment=checkpoint.segment,
                    run_tag=run_tag(job_id, checkpoint.segment, checkpoint.prompt_id),
                    output=self._output,
                    stored=book.artifacts_of(checkpoint.segment),
                    partial=True,
                    server=checkpoint.server or book.server,
                )
            )
        except Exception as err:
            # The cause, not the ActivityError's "Activity task failed": what to look at.
            workflow.logger.warning("keeping finished outputs failed: %s", job_error(err).message)
            return
        book.merge_artifacts(kept.artifacts)


def _named(pool: str | None, *, quoted: bool = True) -> str:
    """A pool for people; None when the job's check had not named it yet (the worker's
    default)."""
    if pool is None:
        return "the worker's default pool"
    return f"pool {pool!r}" if quoted else f"pool {pool}"
