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
from typing import TYPE_CHECKING, Final

from temporalio import workflow
from temporalio.exceptions import ActivityError, is_cancelled_exception

with workflow.unsafe.imports_passed_through():
    from workflows import activity_calls as calls
    from workflows.activity_io import WebhookAttempt, WebhookDeliveryInput
    from workflows.contracts import ENDINGS, JobEvent, JobState, WebhookEventName, WebhookSpec
    from workflows.failures import job_error

if TYPE_CHECKING:
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


def shown_url(url: str) -> str:
    """The URL as the status and the logs show it: without its query or fragment (a token)."""
    return url.split("#", 1)[0].split("?", 1)[0]


class WebhookSender:
    """Delivers the job's subscribed journal entries, in order, until the job has ended and
    every one is delivered or given up. `cursor` is the last entry handled."""

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

    async def run(self) -> None:
        while True:
            await workflow.wait_condition(lambda: self._has_work() or self._book.status.terminal)
            if self._book.webhook_refused_reason() is not None:
                return
            pending = due(self._book.journal, self.cursor, self._spec.events)
            if not pending:
                self._book.webhook_settled()
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
        """Attempts until delivered or given up; the book records each one."""
        book, spec = self._book, self._spec
        wid = webhook_id(self._job_id, self._first_run_id, key)
        book.webhook_sending(wid, event, entry.seq)
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
                attempt=book.webhook_attempts(wid) + 1,
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
                book.webhook_attempted(wid, attempt, "delivered")
                return
            if attempt.outcome != "retry" or now >= deadline:
                book.webhook_attempted(wid, attempt, "failed")
                if attempt.outcome == "refused":
                    book.webhook_refused(attempt.error or "refused")
                return
            book.webhook_attempted(wid, attempt, "retrying")
            delay = retry_delay(retry, spec.retry_horizon_s, workflow.random().random())
            remaining = (deadline - now).total_seconds()
            retry += 1
            # The last attempt lands on the horizon, not past it.
            await workflow.sleep(
                max(0.001, min(delay, remaining)), summary=f"webhook {event} retry {retry}"
            )
