"""The job's webhook: its journal's entries, POSTed in order to the URL the request names.

The journal (workflows/job_book.py) is the source: each state change, stored output and tenth of
progress the request subscribed to becomes one delivery, one at a time, in journal order, each
an attempt of the `deliver_webhook` activity (activities/webhooks.py signs and sends it).

Retries are the workflow's own, on durable timers: Temporal computes an activity's retry
intervals without jitter, and a receiver that comes back after an outage would get every job's
retry in the same second. Each retry waits `U(0, min(ceiling, 1 s·2^n))` (full jitter), the
ceiling being 10 minutes, or a tenth of the retry horizon when that is shorter (so a short
horizon still gets about ten attempts). An event is retried until its horizon has passed since
it happened; a 410 Gone ends its retries at once, and a URL the worker refuses ends them all.

The job never waits for a delivery: the sender runs beside the work, and the job's state becomes
terminal exactly as it would without a webhook. Only then does the workflow wait for the sender
to finish (workflows/inference_job.py), bounded by the horizon. A continued run carries the
sender's cursor, so no entry is lost or sent twice across runs (an attempt cut short by the
continue-as-new is tried again with the same `webhook-id`, on which receivers deduplicate).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Collection, Sequence
from datetime import timedelta
from typing import Final

from temporalio import workflow
from temporalio.exceptions import ActivityError, is_cancelled_exception

with workflow.unsafe.imports_passed_through():
    from workflows import activity_calls as calls
    from workflows.activity_io import WebhookAttempt, WebhookDeliveryInput
    from workflows.contracts import (
        ENDINGS,
        MAX_WEBHOOK_DELIVERIES,
        JobEvent,
        JobState,
        WebhookDelivery,
        WebhookDeliveryState,
        WebhookEventName,
        WebhookSpec,
    )
    from workflows.failures import job_error
    from workflows.job_book import JobBook

# A journal entry's place: its seq, and its index among the entries written under that seq (one
# change can store several outputs at once).
JournalKey = tuple[int, int]
BEFORE_EVERYTHING: Final[JournalKey] = (0, -1)

RETRY_BASE_S: Final = 1.0
RETRY_CEILING_S: Final = 600.0

_STATE_EVENTS: Final[dict[str, WebhookEventName]] = {
    **{
        state: ending.webhook_event
        for state, ending in ENDINGS.items()
        if ending.webhook_event is not None
    },
    JobState.NEEDS_DECISION: "needs_decision",
}


def webhook_event(entry: JobEvent) -> WebhookEventName | None:
    """The webhook event a journal entry is, or None for one no webhook sends (RUNNING, ...)."""
    if entry.kind == "state":
        return _STATE_EVENTS.get(entry.state) if entry.state is not None else None
    if entry.kind == "output_stored":
        return "output_stored"
    return "progress"


def keyed(journal: Sequence[JobEvent]) -> list[tuple[JournalKey, JobEvent]]:
    """Each entry with its key, in journal order."""
    result: list[tuple[JournalKey, JobEvent]] = []
    seq, index = -1, -1
    for entry in journal:
        index = index + 1 if entry.seq == seq else 0
        seq = entry.seq
        result.append(((seq, index), entry))
    return result


def due(
    journal: Sequence[JobEvent], after: JournalKey, events: Collection[str]
) -> list[tuple[JournalKey, JobEvent, WebhookEventName]]:
    """The subscribed entries after `after`, in order, each with its event name."""
    if not journal or journal[-1].seq < after[0]:
        return []  # the common case, each activation: nothing new
    found: list[tuple[JournalKey, JobEvent, WebhookEventName]] = []
    for key, entry in keyed(journal):
        event = webhook_event(entry)
        if key > after and event is not None and event in events:
            found.append((key, entry, event))
    return found


def webhook_id(job_id: str, first_run_id: str, key: JournalKey) -> str:
    """Standard Webhooks' `webhook-id`: one per event, the same on every retry and across
    continue-as-new (the first run's ID tells a reused job ID's events apart)."""
    digest = hashlib.sha256(f"{job_id}.{first_run_id}.{key[0]}.{key[1]}".encode()).hexdigest()
    return f"msg_{digest[:32]}"


def retry_delay(retry: int, horizon_s: float, u: float) -> float:
    """Full jitter: `U(0, min(ceiling, base·2^retry))`, `u` drawn from [0, 1)."""
    ceiling = min(RETRY_CEILING_S, horizon_s / 10)
    return min(ceiling, RETRY_BASE_S * 2.0 ** min(retry, 62)) * u


class WebhookSender:
    """Delivers the job's subscribed journal entries, in order, until the job has ended and
    every one is delivered or given up, and keeps `status.webhook` true to how that went.
    `cursor` is the last entry handled."""

    def __init__(
        self,
        book: JobBook,
        spec: WebhookSpec,
        tenant: str,
        cursor: JournalKey = BEFORE_EVERYTHING,
    ) -> None:
        self._book = book
        self._spec = spec
        self._tenant = tenant
        self.cursor = cursor
        info = workflow.info()
        self._job_id = info.workflow_id
        self._first_run_id = info.first_execution_run_id
        self._task: asyncio.Task[None] | None = None
        book.on_journal(self._count)

    # -- its task beside the job's work -------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def hand_over(self) -> JournalKey | None:
        """Before continuing as new: the cursor the next run delivers after. An attempt cut
        short here is made again there, with the same webhook-id."""
        if self._task is None:
            return None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        return self.cursor

    async def deliver_the_rest(self) -> None:
        """Once the job has ended: wait for every event to be delivered (or given up), within
        their horizons."""
        sender = self._task
        if sender is None:
            return
        try:
            await asyncio.shield(sender)
        except asyncio.CancelledError:
            # A Temporal cancel after the job ended (the UI's button): stop delivering.
            sender.cancel()
            try:
                await sender
            except asyncio.CancelledError:
                pass
            self.given_up("not delivered: the job's workflow was cancelled")

    async def _run(self) -> None:
        while True:
            await workflow.wait_condition(lambda: self._has_work() or self._book.status.terminal)
            if self.refused_reason() is not None:
                return
            pending = due(self._book.journal, self.cursor, self._spec.events)
            if not pending:
                self.settled()
                return
            key, entry, event = pending[0]
            await self._deliver(key, entry, event)
            self.cursor = key

    def _has_work(self) -> bool:
        journal = self._book.journal
        return (
            bool(journal)
            and journal[-1].seq >= self.cursor[0]
            and bool(due(journal, self.cursor, self._spec.events))
        )

    async def _deliver(self, key: JournalKey, entry: JobEvent, event: WebhookEventName) -> None:
        """Attempts until delivered or given up; each one recorded in the status."""
        spec = self._spec
        wid = webhook_id(self._job_id, self._first_run_id, key)
        self.sending(wid, event, entry.seq)
        deadline = entry.at + timedelta(seconds=spec.retry_horizon_s)
        retry = 0
        while True:
            request = WebhookDeliveryInput(
                job_id=self._job_id,
                tenant=self._tenant,
                url=spec.url,
                webhook_id=wid,
                event=event,
                entry=entry,
                attempt=self.attempts(wid) + 1,
            )
            try:
                attempt = await calls.deliver_webhook(request)
            except ActivityError as err:
                if is_cancelled_exception(err):
                    # The sender itself was cancelled mid-attempt (a Temporal cancel after the
                    # end, or continue-as-new): the SDK reports that as the activity's error,
                    # and retrying it would keep delivering after the stop.
                    raise asyncio.CancelledError from err
                # The attempt's own timeout, or a worker lost mid-attempt: try again.
                message = job_error(err).message
                attempt = WebhookAttempt(outcome="retry", error=message, at=workflow.now())
            now = workflow.now()
            if attempt.outcome == "delivered":
                self.attempted(wid, attempt, "delivered")
                return
            if attempt.outcome != "retry" or now >= deadline:
                self.attempted(wid, attempt, "failed")
                if attempt.outcome == "refused":
                    self.refused(attempt.error or "refused")
                return
            self.attempted(wid, attempt, "retrying")
            delay = retry_delay(retry, spec.retry_horizon_s, workflow.random().random())
            remaining = (deadline - now).total_seconds()
            retry += 1
            # The last attempt lands on the horizon, not past it.
            await workflow.sleep(
                max(0.001, min(delay, remaining)), summary=f"webhook {event} retry {retry}"
            )

    # -- the deliveries in the job's status (no journal entry of their own) -------------------

    def sending(self, webhook_id: str, event: WebhookEventName, seq: int) -> None:
        """An event's first attempt is about to go (or, after a continue-as-new, its next)."""
        webhook = self._book.status.webhook
        if webhook is None or self._delivery(webhook_id) is not None:
            return
        webhook.deliveries.append(
            WebhookDelivery(webhook_id=webhook_id, event=event, seq=seq, at=workflow.now())
        )
        del webhook.deliveries[:-MAX_WEBHOOK_DELIVERIES]
        self._book.changed()

    def attempted(
        self, webhook_id: str, attempt: WebhookAttempt, state: WebhookDeliveryState
    ) -> None:
        """One attempt's outcome; `delivered` and `failed` end the event's delivery."""
        webhook, delivery = self._book.status.webhook, self._delivery(webhook_id)
        if webhook is None or delivery is None:
            return
        delivery.attempts += 1
        delivery.last_status_code = attempt.status_code
        delivery.last_error = attempt.error
        delivery.at = attempt.at
        delivery.state = state
        if state == "delivered":
            webhook.delivered += 1
        elif state == "failed":
            webhook.failed += 1
        if state in ("delivered", "failed"):
            webhook.pending = max(0, webhook.pending - 1)
        self._book.changed()

    def refused(self, reason: str) -> None:
        """Nothing more is sent: every event not yet delivered counts as failed."""
        webhook = self._book.status.webhook
        if webhook is None:
            return
        webhook.refused = reason
        webhook.failed += webhook.pending
        webhook.pending = 0
        self._book.changed()

    def given_up(self, reason: str) -> None:
        """Deliveries stop before their horizon (the workflow was cancelled after the end)."""
        webhook = self._book.status.webhook
        if webhook is None or not webhook.pending:
            return
        for delivery in webhook.deliveries:
            if delivery.state in ("pending", "retrying"):
                delivery.state = "failed"
                delivery.last_error = reason
                delivery.at = workflow.now()
        webhook.failed += webhook.pending
        webhook.pending = 0
        self._book.changed()

    def settled(self) -> None:
        """The sender found nothing left: a count still pending was of entries the bounded
        journal no longer held (a sender far behind), which can no longer be sent."""
        self.given_up("no longer in the job's journal")

    def attempts(self, webhook_id: str) -> int:
        delivery = self._delivery(webhook_id)
        return delivery.attempts if delivery is not None else 0

    def refused_reason(self) -> str | None:
        webhook = self._book.status.webhook
        return webhook.refused if webhook is not None else None

    def _delivery(self, webhook_id: str) -> WebhookDelivery | None:
        webhook = self._book.status.webhook
        if webhook is None:
            return None
        return next((d for d in webhook.deliveries if d.webhook_id == webhook_id), None)

    def _count(self, entries: list[JobEvent]) -> None:
        """New journal entries the webhook subscribes to: pending from the change that wrote
        them, so a status that reads terminal already counts its own ending's delivery."""
        webhook = self._book.status.webhook
        if webhook is None:
            return
        subscribed = sum(1 for entry in entries if webhook_event(entry) in webhook.events)
        if webhook.refused is not None:
            webhook.failed += subscribed
        else:
            webhook.pending += subscribed
