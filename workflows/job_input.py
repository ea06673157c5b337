"""The workflow's one argument (the request, and what a continued run carries over), and how
the workflow reads it so that no input can fail a workflow task.

`InferenceJob` takes its argument raw and reads it here. A client that skipped the checks
(`temporal workflow start --input`, another SDK, an old client) may send anything: JSON nested
a hundred thousand levels deep, a graph with a cycle, a `LoadImage` of a file it did not send.
What cannot be read, or breaks a rule, becomes a `Refusal`: the job fails as a *workflow*
(`InvalidGraph`, `MissingInput` or `InvalidRequest`, non-retryable, each problem's node and
field in the details), never as a workflow task that Temporal retries forever.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from temporalio import workflow
from temporalio.common import RawValue

with workflow.unsafe.imports_passed_through():
    from workflows.activity_io import PreparedJob
    from workflows.contracts import JobError, JobEvent, JobRequest, JobStatus
    from workflows.errors import GraphRefused, RequestRefused, UndeclaredInputFile, safe_text
    from workflows.job_book import BookCarry
    from workflows.pool_slot import SlotCarry
    from workflows.shared import ErrorType


class JobCarry(BaseModel):
    """What a job carries across continue-as-new: where it is and what it has."""

    status: JobStatus
    prepared: PreparedJob
    next_segment: int
    # The job's journal so far (workflows/job_book.py): a follower's replay spans runs.
    journal: list[JobEvent] = []
    # The webhook sender's last handled journal entry, (seq, index within it): the next run
    # delivers from the one after, so no event is lost or sent twice across runs.
    webhook_cursor: tuple[int, int] | None = None
    # The slot of its bounded pool's queue the job holds (workflows/pool_slot.py).
    slot: SlotCarry | None = None
    # Whose daily budget counts the job, and what its prompts ran (workflows/job_book.py).
    book: BookCarry | None = None


class JobInput(BaseModel):
    """`InferenceJob`'s argument. A bare `JobRequest` is accepted too: what plain clients
    (`temporal workflow start --input`) and every earlier version of the client send."""

    model_config = ConfigDict(extra="forbid")

    request: JobRequest
    carry: JobCarry | None = None

    @model_validator(mode="before")
    @classmethod
    def _bare_request(cls, data: Any) -> Any:
        if isinstance(data, JobRequest):
            return {"request": data}
        if isinstance(data, dict) and "request" not in data:
            return {"request": data}
        return data


MAX_MESSAGE_CHARS = 4000
MAX_DETAILED_PROBLEMS = 50


@dataclass
class Refusal:
    """Why the input is refused. `error` is the job's error; `problems` name node and field."""

    error: JobError
    problems: list[dict[str, str | None]] = field(default_factory=list)


@dataclass
class InputReading:
    """The input to run (a placeholder when there is nothing readable), and any refusal."""

    input: JobInput
    refusal: Refusal | None = None


def read_job_input(raw: Any) -> InputReading:
    """The workflow's argument, decoded and checked; never raises."""
    try:
        data = (
            workflow.payload_converter().from_payload(raw.payload)
            if isinstance(raw, RawValue)
            else raw
        )
    except Exception as exc:  # any payload: not JSON, nested past the parser's limit, ...
        return _unreadable(f"the job's input cannot be decoded: {type(exc).__name__}: {exc}")
    try:
        job_input = JobInput.model_validate(data)
    except ValidationError as exc:
        return InputReading(_placeholder(), refusal_of(exc))
    except Exception as exc:  # a validator that broke on a hostile value: still a refusal
        return _unreadable(f"the job's input cannot be read: {type(exc).__name__}: {exc}")
    if job_input.carry is not None and workflow.info().continued_run_id is None:
        # A carry skips prepare (its graph goes straight to the backend): only the job's own
        # continue-as-new may hand one over, never a client's start.
        return InputReading(job_input, _carry_from_a_client())
    return InputReading(job_input)


def _carry_from_a_client() -> Refusal:
    message = (
        "the request was refused before anything ran: carry is what a job hands to its own "
        "continuation; start a job with the request alone"
    )
    problem = {"node": None, "field": "carry", "message": message}
    return Refusal(JobError(type=ErrorType.INVALID_REQUEST, message=message), [problem])


def refusal_of(exc: ValidationError) -> Refusal:
    """The job's error for a request that failed validation: its type from the first problem
    (an undeclared input file, a bad graph, anything else), every problem in the message."""
    error_type = ErrorType.INVALID_REQUEST
    problems: list[dict[str, str | None]] = []
    lines: list[str] = []
    for index, error in enumerate(exc.errors(include_url=False, include_input=False)):
        loc = ".".join(str(part) for part in error["loc"])
        loc = loc.removeprefix("request.") if loc != "request" else loc
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, GraphRefused):
            if index == 0:
                missing = isinstance(cause, UndeclaredInputFile)
                error_type = ErrorType.MISSING_INPUT if missing else ErrorType.INVALID_GRAPH
            problems += [problem.as_dict() for problem in cause.problems]
            lines.append(f"{loc}: {cause}")
        elif isinstance(cause, RequestRefused):
            problems.append(
                {"node": None, "field": safe_text(cause.field), "message": safe_text(str(cause))}
            )
            lines.append(str(cause))
        else:
            problems.append({"node": None, "field": safe_text(loc), "message": error["msg"]})
            lines.append(f"{loc}: {error['msg']}")
    message = safe_text("the request was refused before anything ran: " + "; ".join(lines))
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 3] + "..."
    return Refusal(JobError(type=error_type, message=message), problems[:MAX_DETAILED_PROBLEMS])


def _unreadable(message: str) -> InputReading:
    error = JobError(type=ErrorType.INVALID_REQUEST, message=safe_text(message[:MAX_MESSAGE_CHARS]))
    return InputReading(_placeholder(), Refusal(error))


def _placeholder() -> JobInput:
    """An input for a job that has none worth the name: the status needs one, and the run
    refuses the job before anything reads it. Built without validation on purpose."""
    return JobInput.model_construct(request=JobRequest.model_construct(graph={}), carry=None)


def history_is_long(budget_events: int) -> bool:
    """Time to continue as new: the server suggests it, or half the job's budget is used."""
    info = workflow.info()
    return info.is_continue_as_new_suggested() or info.get_current_history_length() > (
        budget_events // 2
    )
