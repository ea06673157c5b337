"""The job's messages: the `status` query, the signals and the updates `InferenceJob` answers.

Every handler takes `Any` and reads it in workflows/messages.py: a plain client may send
nothing, `{}` or a misspelt field, and a signature that cannot take it would fail every workflow
task from then on. What a message changes goes through the job's book (workflows/job_book.py)
or its controls (workflows/job_controls.py); a stop goes through `_request_stop`, which the
workflow defines.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.contracts import (
        CancelRequest,
        EventsQuery,
        JobEvents,
        JobState,
        JobStatus,
        ProgressReport,
        ResumeRequest,
    )
    from workflows.job_book import JobBook, JobControls
    from workflows.messages import M, lenient_message, strict_message
    from workflows.shared import (
        QUERY_EVENTS,
        QUERY_STATUS,
        SIGNAL_CANCEL,
        SIGNAL_CANCEL_REASON,
        SIGNAL_CLIENT_SEEN,
        SIGNAL_PROGRESS,
        SIGNAL_RESUME,
        UPDATE_ATTACH,
        UPDATE_ENDED,
        UPDATE_RESUME,
    )


class JobMessages:
    """The handlers, as a base of the workflow class (Temporal finds them on it)."""

    _status: JobStatus
    _book: JobBook
    _controls: JobControls
    _cancel_reason: str | None
    _continuing: bool

    def _cancel(self, reason: str, *, via_temporal: bool = False) -> None:
        raise NotImplementedError

    @workflow.query(name=QUERY_STATUS)
    def status(self, _ignored: Any = None) -> JobStatus:
        return self._status

    @workflow.query(name=QUERY_EVENTS)
    def events(self, payload: Any = None) -> JobEvents:
        """The journal after `since` (a seq the caller saw), then the status it leads to."""
        since = EventsQuery.model_validate(payload or {}).since
        journal = self._book.journal
        return JobEvents(
            status=self._status,
            events=[entry for entry in journal if entry.seq > since],
            first_seq=journal[0].seq if journal else 0,
        )

    @workflow.signal(name=SIGNAL_PROGRESS)
    def progress(self, payload: Any = None) -> None:
        try:
            report = ProgressReport.model_validate(payload)
        except ValidationError as exc:
            self._book.notice(f"progress: ignored a malformed report ({exc.error_count()} errors)")
            return
        if report.attempt_client_id != self._book.client_id or self._status.terminal:
            return  # from a socket of an earlier submission, or too late
        # A stopping job stays STOPPING whatever the backend last said of the prompt.
        self._book.apply_progress(report, stage_changes=self._controls.stop is None)

    @workflow.signal(name=SIGNAL_CLIENT_SEEN)
    def client_seen(self, _ignored: Any = None) -> None:
        self._book.contact()

    @workflow.update(name=UPDATE_ATTACH)
    def attach(self, payload: Any = None) -> JobStatus:
        self._book.contact()
        return self._status

    @attach.validator
    def _validate_attach(self, payload: Any = None) -> None:
        if payload not in (None, {}):
            raise ValueError("attach takes no argument (or {})")

    @workflow.update(name=UPDATE_ENDED)
    async def ended(self, _ignored: Any = None) -> JobStatus:
        """The status once it is terminal: what `JobClient.wait` needs while the workflow
        still delivers its webhooks. A run about to continue as new answers with its last
        status (not terminal): the caller asks the next run."""
        await workflow.wait_condition(lambda: self._status.terminal or self._continuing)
        return self._status

    @workflow.signal(name=SIGNAL_CANCEL)
    def cancel(self, payload: Any = None) -> None:
        request = self._read(CancelRequest, payload, "cancel", scalar_field="reason")
        self._cancel(request.reason)

    @workflow.signal(name=SIGNAL_CANCEL_REASON)
    def cancel_reason(self, payload: Any = None) -> None:
        """The reason for a Temporal cancel that follows (JobClient.cancel sends both)."""
        request = self._read(CancelRequest, payload, "cancel_reason", scalar_field="reason")
        self._cancel_reason = request.reason

    @workflow.signal(name=SIGNAL_RESUME)
    def resume(self, payload: Any = None) -> None:
        message, notes = lenient_message(ResumeRequest, payload, scalar_field="resubmit")
        self._book.contact()
        if notes:
            # A decision is not guessed from a garbled message (was `resubmt` meant?).
            self._book.notice(f"resume: ignored, nothing done: {'; '.join(notes)}")
            return
        if self._status.state != JobState.NEEDS_DECISION:
            self._book.notice(f"resume: ignored, the job is {self._status.state.value}")
            return
        self._controls.resume = message

    @workflow.update(name=UPDATE_RESUME)
    async def resume_update(self, payload: Any = None) -> JobStatus:
        """Continue a NEEDS_DECISION job; answers once the job has left that state."""
        self._book.contact()
        self._controls.resume = ResumeRequest.model_validate(payload or {})
        await workflow.wait_condition(lambda: self._status.state != JobState.NEEDS_DECISION)
        return self._status

    @resume_update.validator
    def _validate_resume(self, payload: Any = None) -> None:
        request = strict_message(ResumeRequest, payload, what="resume")
        state = self._status.state
        if state != JobState.NEEDS_DECISION:
            raise ValueError(
                f"the job is {state.value}: resume only continues a job that waits for a "
                "decision (NEEDS_DECISION)"
            )
        decision = self._status.decision
        if not request.resubmit and decision is not None and not decision.reattach_possible:
            raise ValueError(
                f"cannot re-attach: {decision.reason}. Resume with resubmit=true "
                f"({decision.options.get('resume --resubmit', 'run the prompt again')}), or "
                "cancel the job"
            )

    def _read(
        self, model: type[M], payload: Any, what: str, *, scalar_field: str | None = None
    ) -> M:
        message, notes = lenient_message(model, payload, scalar_field=scalar_field)
        for note in notes:
            self._book.notice(f"{what}: {note}")
        return message
