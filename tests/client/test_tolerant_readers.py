"""A reader one version behind the worker that wrote a status still reads it: what a
worker writes and a client reads ignores fields it does not know and takes states and kinds it
does not know by their name, reading whether the job has ended from the status's own
`terminal`; requests stay strict."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any, cast

import pytest
from pydantic import ValidationError
from rich.console import Console
from temporalio.client import WorkflowExecutionDescription, WorkflowExecutionStatus
from temporalio.common import SearchAttributePair, TypedSearchAttributes

from starter.cli.render import print_summary
from starter.execution import bare_status
from workflows.contracts import (
    JobEvents,
    JobRequest,
    JobState,
    JobStatus,
    UnknownState,
    known_state,
)
from workflows.shared import PROGRESS_KEY, STATE_KEY

AT = "2026-12-06T12:00:00Z"


def newer_status(state: str, *, terminal: bool) -> dict[str, Any]:
    """A status as a later worker writes it: a state this version lacks, and fields it does not
    know at the top and inside."""
    return {
        "job_id": "job-newer",
        "state": state,
        "terminal": terminal,
        "seq": 9,
        "queue": {"position": 3, "tier": "gold"},
        "progress": {"step": 4, "total_steps": 20, "fraction": 0.2, "eta_s": 12.5},
        "artifacts": [
            {
                "key": "jobs/job-newer/0/9/a.png",
                "uri": "s3://b/jobs/job-newer/0/9/a.png",
                "size": 3,
                "sha256": "0" * 64,
                "content_type": "image/png",
                "node_id": "9",
                "width": 512,
            }
        ],
        "cost": [{"provider_job_id": "rp-1", "execution_s": 2.0, "gpu": "A100"}],
        "teardown": {"state": "PENDING", "steps": [], "budget_s": 30},
    }


def test_a_newer_workers_status_is_read_with_its_state_by_name() -> None:
    status = JobStatus.model_validate(newer_status("PAUSED", terminal=False))
    assert status.state == "PAUSED" and isinstance(status.state, UnknownState)
    assert status.state.value == "PAUSED" and not status.terminal
    assert status.progress.step == 4 and status.artifacts[0].size == 3
    assert status.cost[0].execution_s == 2.0
    # Read through JSON too, as a query answer or an HTTP body is.
    again = JobStatus.model_validate_json(
        JobStatus.model_validate(newer_status("X", terminal=True)).model_dump_json()
    )
    assert again.state == "X" and again.terminal


def test_whether_an_unknown_state_ended_is_the_writers_word() -> None:
    ended = JobStatus.model_validate(newer_status("ARCHIVED", terminal=True))
    assert ended.terminal, "a client waiting for the end stops here"
    # Written with every status, from the state itself for this version's own.
    written = JobStatus(job_id="j", state=JobState.COMPLETED).model_dump(mode="json")
    assert written["terminal"] is True
    assert (
        JobStatus(job_id="j", state=JobState.RUNNING).model_dump(mode="json")["terminal"] is False
    )
    # A known state is judged by this version, whatever a writer said.
    assert JobStatus.model_validate({"job_id": "j", "state": "FAILED", "terminal": False}).terminal


def test_a_journal_entry_of_a_kind_this_version_lacks_is_kept_by_its_name() -> None:
    events = JobEvents.model_validate(
        {
            "status": newer_status("PAUSED", terminal=False),
            "events": [
                {"seq": 8, "at": AT, "kind": "state", "state": "PAUSED", "by": "operator"},
                {"seq": 9, "at": AT, "kind": "queue_moved", "position": 2},
            ],
        }
    )
    assert [e.kind for e in events.events] == ["state", "queue_moved"]
    assert events.events[0].state == "PAUSED"


def test_requests_stay_strict() -> None:
    graph = {"1": {"class_type": "SaveImage", "inputs": {}}}
    with pytest.raises(ValidationError, match="priorty"):
        JobRequest.model_validate({"graph": graph, "priorty": 5})


def test_the_workflow_takes_only_its_own_states() -> None:
    assert known_state(JobState.RUNNING) is JobState.RUNNING
    with pytest.raises(ValueError, match="PAUSED"):
        known_state(UnknownState("PAUSED"))


def test_the_cli_shows_an_unknown_state_by_its_name() -> None:
    console = Console(record=True, width=120)
    print_summary(JobStatus.model_validate(newer_status("PAUSED", terminal=False)), console)
    assert "job-newer: PAUSED" in console.export_text()


def described(state: str, status: WorkflowExecutionStatus) -> WorkflowExecutionDescription:
    attributes = TypedSearchAttributes(
        [SearchAttributePair(STATE_KEY, state), SearchAttributePair(PROGRESS_KEY, 40)]
    )
    now = datetime.now(UTC)
    closed = None if status == WorkflowExecutionStatus.RUNNING else now
    fake = SimpleNamespace(
        typed_search_attributes=attributes, status=status, start_time=now, close_time=closed
    )
    return cast(WorkflowExecutionDescription, fake)


def test_temporals_record_of_an_unknown_state_is_shown_by_name_not_as_queued() -> None:
    running = bare_status("job-1", described("PAUSED", WorkflowExecutionStatus.RUNNING))
    assert running.state == "PAUSED" and not running.terminal
    closed = bare_status("job-1", described("ARCHIVED", WorkflowExecutionStatus.COMPLETED))
    assert closed.state == "ARCHIVED" and closed.terminal
    known = bare_status("job-1", described("RUNNING", WorkflowExecutionStatus.RUNNING))
    assert known.state is JobState.RUNNING and known.progress.fraction == 0.4
