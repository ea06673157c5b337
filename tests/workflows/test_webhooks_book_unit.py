"""The webhook sender's bookkeeping in the job's status, on its own (workflow functions stood
in): subscribed journal entries count as pending from the change that wrote them, each attempt
updates its delivery, and none of it adds a journal entry."""

from __future__ import annotations

from tests.support.workflow_fakes import T0, FakeWorkflow
from workflows.activity_io import WebhookAttempt
from workflows.contracts import (
    MAX_WEBHOOK_DELIVERIES,
    Artifact,
    JobState,
    JobStatus,
    WebhookSpec,
    WebhookStatus,
)
from workflows.job_book import JobBook
from workflows.webhooks import WebhookSender


def book(events: list[str]) -> JobBook:
    webhook = WebhookStatus(url="https://h/hook", events=events)
    return JobBook(JobStatus(job_id="j", webhook=webhook))


def sender(jobs: JobBook) -> WebhookSender:
    assert jobs.status.webhook is not None
    spec = WebhookSpec(url="https://h/hook?token=t", events=jobs.status.webhook.events)
    return WebhookSender(jobs, spec, "local")


def artifact(key: str) -> Artifact:
    return Artifact(
        key=key, uri=f"s3://b/{key}", size=1, sha256="0" * 64, content_type="image/png", node_id="9"
    )


def attempt(outcome: str, status_code: int | None) -> WebhookAttempt:
    return WebhookAttempt(outcome=outcome, status_code=status_code, at=T0)


def test_subscribed_entries_are_pending_from_the_change_that_wrote_them(wf: FakeWorkflow) -> None:
    jobs = book(["completed", "output_stored"])
    sender(jobs)
    jobs.set_state(JobState.QUEUED)
    jobs.set_state(JobState.RUNNING)
    jobs.merge_artifacts([artifact("a"), artifact("b")])
    assert jobs.status.webhook is not None and jobs.status.webhook.pending == 2
    jobs.set_state(JobState.COMPLETED)
    assert jobs.status.webhook.pending == 3, "the ending counts in the status that reads terminal"


def test_each_attempt_updates_its_delivery_without_a_journal_entry(wf: FakeWorkflow) -> None:
    jobs = book(["completed"])
    hook = sender(jobs)
    jobs.set_state(JobState.COMPLETED)
    journal, seq = list(jobs.journal), jobs.status.seq
    hook.sending("msg_1", "completed", seq)
    hook.sending("msg_1", "completed", seq)  # a continued run's next attempt: no copy
    wf.advance(1)
    hook.attempted("msg_1", attempt("retry", 503), "retrying")
    hook.attempted("msg_1", attempt("delivered", 204), "delivered")
    webhook = jobs.status.webhook
    assert webhook is not None
    [delivery] = webhook.deliveries
    assert (delivery.state, delivery.attempts, delivery.last_status_code) == ("delivered", 2, 204)
    assert (webhook.delivered, webhook.failed, webhook.pending) == (1, 0, 0)
    assert jobs.journal == journal, "webhook bookkeeping is no journal entry"
    assert jobs.status.seq == seq + 3, "each write is a status change"
    assert hook.attempts("msg_1") == 2


def test_a_refusal_fails_what_is_pending_and_what_comes_later(wf: FakeWorkflow) -> None:
    jobs = book(["output_stored", "completed"])
    hook = sender(jobs)
    jobs.merge_artifacts([artifact("a"), artifact("b")])
    hook.sending("msg_1", "output_stored", jobs.status.seq)
    hook.attempted("msg_1", attempt("refused", None), "failed")
    hook.refused("https://h/hook: 10.0.0.1: private (10/8)")
    jobs.set_state(JobState.COMPLETED)
    webhook = jobs.status.webhook
    assert webhook is not None
    assert (webhook.failed, webhook.pending) == (3, 0)
    assert hook.refused_reason() is not None


def test_deliveries_are_bounded_and_giving_up_fails_the_open_ones(wf: FakeWorkflow) -> None:
    jobs = book(["output_stored"])
    hook = sender(jobs)
    jobs.merge_artifacts([artifact(str(n)) for n in range(MAX_WEBHOOK_DELIVERIES + 5)])
    for n in range(MAX_WEBHOOK_DELIVERIES + 5):
        hook.sending(f"msg_{n}", "output_stored", jobs.status.seq)
    webhook = jobs.status.webhook
    assert webhook is not None and len(webhook.deliveries) == MAX_WEBHOOK_DELIVERIES
    assert webhook.deliveries[0].webhook_id == "msg_5", "the latest are kept"
    hook.given_up("not delivered: the job's workflow was cancelled")
    assert (webhook.failed, webhook.pending) == (MAX_WEBHOOK_DELIVERIES + 5, 0)
    assert {d.state for d in webhook.deliveries} == {"failed"}
