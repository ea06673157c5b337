"""The workflow's one argument: the request, and what a continued run carries over."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from workflows.activity_io import PreparedJob
from workflows.contracts import JobEvent, JobRequest, JobStatus


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
