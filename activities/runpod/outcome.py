"""Reading a RunPod job: pure functions from a `/status` answer to what the orchestrator does.

    Queued            IN_QUEUE: keep polling (the workflow's own queue timeout applies)
    Running           IN_PROGRESS, with our handler's `ProgressUpdate` when it sent one (a stock
                      worker sends none): keep polling, heartbeat the checkpoint
    Succeeded         COMPLETED with a usable `EndpointOutput`: verify / fetch its records
    ClaimedElsewhere  COMPLETED by a delivery that found the submission claimed by another
                      RunPod job: follow that job instead (it is ours, already paid for)
    Failed            everything else, typed with `workflows.shared.ErrorType`:

        COMPLETED with `output.error`           handler's error_type, else PromptRejected
                                                for a stock handler's rejection of the graph
                                                (`rejection.stock_rejection`), else
                                                ExecutionError
        COMPLETED with `output.errors`          OutputMissing (some outputs never arrived)
        COMPLETED without output                OutputMissing (the result was lost on the way)
        COMPLETED with unusable records         OutputMissing, with the usable ones (kept)
        FAILED                                  handler's error_type, else read from the text:
                                                PromptRejected (a stock handler's rejection),
                                                OutOfMemory, BackendFault, ExecutionError
        CANCELLED                               Cancelled
        TIMED_OUT, never picked up              QueueTimeout
        TIMED_OUT, ran into executionTimeout    Timeout
        TIMED_OUT, worker stopped reporting     PromptLost (`resubmit`: a worker crash)
        404 (see `read_gone`)                   QueueTimeout / PromptLost / OutputMissing

`Failed.resubmit` marks the failures of a worker rather than of the graph: submitting the same
submission again (or `/retry` of the same job) may well succeed, and with claims it cannot run
twice. Every other terminal failure is final for the job. `Failed.retryable` is True only when
asking RunPod again may give another answer (an unknown state).

A StorageError of our handler is not final by itself: the orchestrator re-reads the claim
(`after_storage_failure`), which says whether the run is recoverable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from activities.runpod.artifacts import artifact_source
from activities.runpod.models import RunPodJob, RunPodState, RunPolicy, is_job_id
from activities.runpod.rejection import stock_rejection
from protocol.comfyui.events import is_fatal_device_error, is_out_of_memory
from protocol.runpod.contract import ArtifactRecord, Claim, EndpointOutput, ProgressUpdate
from workflows.errors import UnusableArtifact
from workflows.shared import ErrorType

PROGRESS_KIND = "durable_comfy.progress"
# TIMED_OUT with executionTime this close to executionTimeout was the timeout, not a crash.
_TIMEOUT_SLACK_MS = 1000
_MAX_MESSAGE = 1000
# Error types our handler reports that a fresh worker may well not hit (its ComfyUI never
# came up, it lost the prompt): the run is worth submitting again.
_WORKER_TROUBLE = {ErrorType.BACKEND_UNAVAILABLE, ErrorType.PROMPT_LOST}
# Handler error types outside `ErrorType`, and what they are here.
_HANDLER_TYPES = {"OutputTooLarge": ErrorType.OUTPUT_MISSING}
_KNOWN_TYPES = {
    value for name, value in vars(ErrorType).items() if name.isupper() and isinstance(value, str)
}


@dataclass(frozen=True)
class Queued:
    job_id: str
    delay_ms: float | None = None


@dataclass(frozen=True)
class Running:
    job_id: str
    worker_id: str | None = None
    # None for a stock worker, or before our handler's first update.
    progress: ProgressUpdate | None = None


@dataclass(frozen=True)
class Succeeded:
    job_id: str
    output: EndpointOutput
    worker_id: str | None = None
    delay_ms: float | None = None
    execution_ms: float | None = None

    @property
    def stock(self) -> bool:
        """A stock worker-comfyui answer: base64 or presigned URLs, nothing to verify against."""
        return self.output.submission is None


@dataclass(frozen=True)
class ClaimedElsewhere:
    """This delivery ran nothing: RunPod job `holder` holds the submission's claim.

    `holder` None: the answer did not say (or said something that is not a job id); read the
    claim object (`protocol.runpod.contract.claim_key`) to find it.
    """

    job_id: str
    holder: str | None
    submission: str | None = None


@dataclass(frozen=True)
class Failed:
    job_id: str
    error_type: str
    message: str
    state: str  # RunPod's status, or "GONE" for a 404
    resubmit: bool = False
    retryable: bool = False
    # The platform replaces the worker after this job (our handler's refresh_worker).
    refresh_worker: bool = False
    worker_id: str | None = None
    # Outputs our handler stored before it failed: kept, as the ComfyUI backend keeps them.
    artifacts: list[ArtifactRecord] = field(default_factory=list)
    # Our handler's `EndpointError.claim_recorded`: whether the claim holds this failure as its
    # outcome. None where the answer does not say (a stock worker, an older handler).
    claim_recorded: bool | None = None


Outcome = Queued | Running | Succeeded | ClaimedElsewhere | Failed


def read_job(
    job: RunPodJob, *, submission: str | None = None, policy: RunPolicy | None = None
) -> Outcome:
    """What `job` (a `/status` answer) means. `submission`: the token we sent, when we sent
    one (progress and outputs of another submission are not ours); `policy`: what we sent, so
    a TIMED_OUT at the execution limit reads as a timeout rather than a crash."""
    state = job.state
    if state is RunPodState.IN_QUEUE:
        return Queued(job.id, job.delay_time_ms)
    if state is RunPodState.IN_PROGRESS:
        return Running(job.id, job.worker_id, read_progress(job.output, submission))
    if state is RunPodState.COMPLETED:
        return _completed(job, submission)
    if state is RunPodState.FAILED:
        return _failed(job)
    if state is RunPodState.CANCELLED:
        return _failure(job, ErrorType.CANCELLED, "was cancelled")
    if state is RunPodState.TIMED_OUT:
        return _timed_out(job, policy)
    return Failed(
        job.id,
        ErrorType.BACKEND_UNAVAILABLE,
        f"RunPod job {job.id} is in a state this orchestrator does not know: {job.status[:40]!r}",
        state=job.status,
        retryable=True,
        worker_id=job.worker_id,
    )


def read_gone(job_id: str, last_seen: RunPodState | None) -> Failed:
    """`/status` answered 404. What that means depends on what we saw last.

    Queued: the ttl ran out before a worker took it. Running or never seen: RunPod lost it (the
    ttl ended mid-run, or the id is wrong): worth submitting again, which claims make safe.
    Finished but not yet read: the result outlived its retention (30 min); with claims, the
    claim object still holds the outcome and its records.
    """
    if last_seen is RunPodState.IN_QUEUE:
        return Failed(
            job_id,
            ErrorType.QUEUE_TIMEOUT,
            f"RunPod job {job_id} expired while queued (its ttl ran out before a worker took it)",
            state="GONE",
        )
    if last_seen is not None and last_seen.terminal:
        return Failed(
            job_id,
            ErrorType.OUTPUT_MISSING,
            f"RunPod job {job_id} ended {last_seen.value} and its result expired before it was "
            "read (RunPod keeps results 30 min)",
            state="GONE",
        )
    seen = "while running" if last_seen is RunPodState.IN_PROGRESS else "(never seen by us)"
    return Failed(
        job_id,
        ErrorType.PROMPT_LOST,
        f"RunPod no longer knows job {job_id} {seen}: its ttl expired or the id is wrong",
        state="GONE",
        resubmit=True,
    )


def read_progress(output: Any, submission: str | None = None) -> ProgressUpdate | None:
    """Our handler's checkpoint from an IN_PROGRESS `output`; None for anything else (a stock
    worker's, another submission's, or an update we cannot read: progress is advisory)."""
    if not isinstance(output, dict) or output.get("kind") != PROGRESS_KIND:
        return None
    try:
        update = ProgressUpdate.model_validate(output)
    except ValidationError:
        return None
    if submission is not None and update.submission != submission:
        return None
    return update


# --- the terminal states ------------------------------------------------------------------------


def _completed(job: RunPodJob, submission: str | None) -> Outcome:
    output = job.output
    if output is None or output == {} or output == "" or output == []:
        return _failure(
            job,
            ErrorType.OUTPUT_MISSING,
            "COMPLETED without any output: the worker's result was lost on the way (a rejected "
            "job-done)",
        )
    if not isinstance(output, dict):
        return _failure(
            job,
            ErrorType.BACKEND_ERROR,
            f"COMPLETED with an output that is not an object: {_text(output)[:200]}",
        )
    if output.get("error"):
        error_type = _handler_type(output.get("error_type"))
        described = _describe(output.get("error"), output.get("details"))
        rejected = _stock_rejection(error_type, output.get("error"), output.get("details"))
        if rejected is not None:
            error_type, described = ErrorType.PROMPT_REJECTED, rejected
        error_type = error_type or ErrorType.EXECUTION_ERROR
        return _failure(
            job,
            error_type,
            f"COMPLETED with an error: {described}",
            resubmit=error_type in _WORKER_TROUBLE,
            artifacts=_records(output.get("images")),
        )
    if output.get("status") == "claimed_elsewhere":
        holder = output.get("claim_holder")
        ours = output.get("submission")
        return ClaimedElsewhere(
            job.id,
            holder if is_job_id(holder) and holder != job.id else None,
            ours if isinstance(ours, str) else None,
        )
    errors = output.get("errors")
    if errors:
        listed = errors if isinstance(errors, list) else [errors]
        return _failure(
            job,
            ErrorType.OUTPUT_MISSING,
            f"COMPLETED with {len(listed)} error(s): {'; '.join(_text(e) for e in listed)}",
            artifacts=_records(output.get("images")),
        )
    try:
        parsed = EndpointOutput.model_validate(output)
    except ValidationError as exc:
        return _failure(
            job, ErrorType.BACKEND_ERROR, f"COMPLETED with an unreadable output: {_errors(exc)}"
        )
    if submission is not None and parsed.submission not in (None, submission):
        return _failure(
            job,
            ErrorType.BACKEND_ERROR,
            f"COMPLETED with the output of submission {parsed.submission!r}, not {submission!r}",
        )
    ours = parsed.submission is not None
    usable: list[ArtifactRecord] = []
    refused: list[str] = []
    for record in parsed.images:
        try:
            artifact_source(record, verifiable=ours)
        except UnusableArtifact as exc:
            refused.append(str(exc))
        else:
            usable.append(record)
    if refused:
        # The usable records go with the failure, so the job still keeps them (verified like
        # any other); the refused ones are never read.
        return _failure(
            job,
            ErrorType.OUTPUT_MISSING,
            f"COMPLETED, but {len(refused)} output(s) refused: {'; '.join(refused)}",
            artifacts=usable,
        )
    return Succeeded(job.id, parsed, job.worker_id, job.delay_time_ms, job.execution_time_ms)


def _failed(job: RunPodJob) -> Failed:
    """FAILED: `error` is the handler's text (or the SDK's JSON for an exception); `output`
    keeps the rest of our handler's `EndpointError` (error_type, details, stored images)."""
    extra = job.output if isinstance(job.output, dict) else {}
    text, sdk_type = _error_text(job.error)
    details = extra.get("details")
    message = _describe(text or "no error text", details)
    error_type = _handler_type(extra.get("error_type"))
    rejected = _stock_rejection(error_type, text, details)
    if rejected is not None:
        error_type, message = ErrorType.PROMPT_REJECTED, rejected
    if error_type is None:
        probe = {"exception_type": sdk_type or "", "exception_message": message}
        if is_out_of_memory(probe):
            error_type = ErrorType.OUT_OF_MEMORY
        elif is_fatal_device_error(probe):
            error_type = ErrorType.BACKEND_FAULT
        else:
            error_type = ErrorType.EXECUTION_ERROR
    return _failure(
        job,
        error_type,
        f"FAILED: {message}",
        resubmit=error_type in _WORKER_TROUBLE,
        # /status does not show the SDK's stopPod; a device fault is what our handler
        # answers with refresh_worker, and an explicit flag is believed too.
        refresh_worker=error_type == ErrorType.BACKEND_FAULT or extra.get("refresh_worker") is True,
        artifacts=_records(extra.get("images")),
    )


def _timed_out(job: RunPodJob, policy: RunPolicy | None) -> Failed:
    executed = job.execution_time_ms or 0
    if not job.worker_id and not executed:
        return _failure(
            job,
            ErrorType.QUEUE_TIMEOUT,
            "TIMED_OUT before any worker took it (its ttl ran out in the queue)",
        )
    if policy is not None and executed >= policy.execution_timeout_ms - _TIMEOUT_SLACK_MS:
        return _failure(
            job,
            ErrorType.TIMEOUT,
            f"TIMED_OUT after {executed / 1000:.0f} s, its executionTimeout "
            f"({policy.execution_timeout_ms / 1000:.0f} s)",
        )
    return _failure(
        job,
        ErrorType.PROMPT_LOST,
        f"TIMED_OUT after {executed / 1000:.0f} s of execution: the worker stopped reporting "
        "(a crash or a lost worker)",
        resubmit=True,
    )


# --- helpers ------------------------------------------------------------------------------------


def _failure(
    job: RunPodJob,
    error_type: str,
    what: str,
    *,
    resubmit: bool = False,
    refresh_worker: bool = False,
    artifacts: list[ArtifactRecord] | None = None,
) -> Failed:
    worker = f" on worker {job.worker_id}" if job.worker_id else ""
    said = job.output.get("claim_recorded") if isinstance(job.output, dict) else None
    return Failed(
        job.id,
        error_type,
        f"RunPod job {job.id}{worker} {what}"[:_MAX_MESSAGE],
        state=job.status,
        resubmit=resubmit,
        refresh_worker=refresh_worker,
        worker_id=job.worker_id,
        artifacts=artifacts or [],
        claim_recorded=said if isinstance(said, bool) else None,
    )


def _handler_type(value: Any) -> str | None:
    """Our handler's `error_type` as an `ErrorType` value; None when absent or unknown."""
    if not isinstance(value, str):
        return None
    value = _HANDLER_TYPES.get(value, value)
    return value if value in _KNOWN_TYPES else None


def _error_text(error: Any) -> tuple[str, str | None]:
    """The message of a FAILED job's `error`, and the exception's type when the SDK caught one
    (it sends `{error_type, error_message, error_traceback, ...}` as a JSON string)."""
    if isinstance(error, str):
        try:
            decoded = json.loads(error)
        except ValueError:
            return error, None
        if not isinstance(decoded, dict):
            return error, None
        error = decoded
    if isinstance(error, dict):
        message = error.get("error_message") or error.get("message") or error.get("error")
        kind = error.get("error_type")
        return _text(message if message is not None else error), (
            str(kind) if kind is not None else None
        )
    return ("" if error is None else _text(error)), None


def _describe(error: Any, details: Any) -> str:
    """The error, and whichever details add to it (our handler once sent its whole reason as
    both: "X (X)")."""
    text = _text(error)
    if isinstance(details, list):
        listed = [_text(d) for d in details[:5]]
    else:
        listed = [_text(details)] if isinstance(details, str | dict) and details else []
    extra = [d for d in dict.fromkeys(listed) if d and d not in text]
    if extra:
        text += " (" + "; ".join(extra) + ")"
    return text


def _stock_rejection(error_type: str | None, error: Any, details: Any) -> str | None:
    """A stock handler's rejection of the graph, in plain per-node words (None: not one). Our
    handler types its own (`error_type`), so only an untyped text is read."""
    if error_type is not None or not isinstance(error, str):
        return None
    rejected = stock_rejection(error)
    return (
        None if rejected is None else _describe(f"ComfyUI rejected the graph: {rejected}", details)
    )


def _records(value: Any) -> list[ArtifactRecord]:
    """The valid records of a failed job's `images` (kept, never trusted for more)."""
    if not isinstance(value, list):
        return []
    records = []
    for item in value:
        try:
            records.append(ArtifactRecord.model_validate(item))
        except ValidationError:
            continue
    return records


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:_MAX_MESSAGE]


def _errors(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])


# --- a storage failure of our handler -----------------------------------------------------------


def after_storage_failure(failed: Failed, claim: Claim | None) -> Failed | list[ArtifactRecord]:
    """What our handler's StorageError (`failed`) means, given the submission's claim read
    again by the orchestrator, whose own S3 calls are retried.

    completed claim         the handler did store everything and recorded it: its records
                            (the caller verifies them as any others)
    failed / cancelled      finished by the handler (or its answer says it recorded the
                            failure, `claim_recorded`): final, as it says
    no claim, no outcome    the handler could not record how the run ended (or never got the
                            claim): worker trouble; the same submission goes out again once
                            the lease has run out, and the claim keeps it at most once
    """
    if failed.error_type != ErrorType.STORAGE_ERROR:
        return failed
    outcome = claim.outcome if claim is not None else None
    if outcome is not None and outcome.state == "completed":
        return list(outcome.images)
    if outcome is not None or failed.claim_recorded:
        return failed
    why = "it holds no claim" if claim is None else "its claim records no outcome"
    return replace(
        failed,
        message=f"{failed.message}; {why}, so the run is submitted again"[:_MAX_MESSAGE],
        resubmit=True,
    )
