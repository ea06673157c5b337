"""The job's journal (`JobBook.journal`): what a follower that was away replays, each once.

Every entry is numbered with the status `seq` its change wrote, so "the entries after N" is the
exact set a client that saw seq N missed. The fake workflow runtime stands in for Temporal.
"""

from __future__ import annotations

import pytest

from workflows.contracts import (
    MAX_JOURNAL,
    Artifact,
    JobError,
    JobEvent,
    JobState,
    JobStatus,
    Progress,
    ProgressReport,
)
from workflows.job_book import JobBook

CLIENT_ID_UNUSED = "dc-any"


pytestmark = pytest.mark.usefixtures("wf")


def _artifact(key: str) -> Artifact:
    return Artifact(
        key=key,
        uri=f"s3://b/{key}",
        size=1,
        sha256="0" * 64,
        content_type="image/png",
        node_id="9",
    )


def _kinds(journal: list[JobEvent]) -> list[tuple[int, str, object]]:
    shown: list[tuple[int, str, object]] = []
    for entry in journal:
        value: object = entry.state or (entry.artifact.key if entry.artifact else entry.percent)
        shown.append((entry.seq, entry.kind, value))
    return shown


def test_a_new_job_journals_its_first_state_and_every_change_under_the_seq_that_wrote_it() -> None:
    book = JobBook(JobStatus(job_id="j1", progress=Progress(total_steps=10)))
    book.set_state(JobState.QUEUED)
    book.set_state(JobState.PREPARING)
    book.set_state(JobState.PREPARING)  # no change of state: no entry
    book.contact()  # a status change that a follower need not replay
    book.merge_artifacts([_artifact("a.png"), _artifact("b.png")])
    book.merge_artifacts([_artifact("a.png")])  # already stored: no entry
    assert _kinds(book.journal) == [
        (1, "state", JobState.QUEUED),
        (2, "state", JobState.PREPARING),
        (5, "output_stored", "a.png"),
        (5, "output_stored", "b.png"),
    ]
    assert book.status.seq == 5


def test_progress_is_journaled_in_tenths_and_never_backwards() -> None:
    book = JobBook(JobStatus(job_id="j1", state=JobState.RUNNING, progress=Progress()))
    book.set_state(JobState.RUNNING)
    for step in (1, 2, 3, 5, 4, 10):
        book.apply_progress(
            ProgressReport(attempt_client_id=CLIENT_ID_UNUSED, step=step, total_steps=10)
        )
    progress = [entry.percent for entry in book.journal if entry.kind == "progress"]
    assert progress == [10, 20, 30, 50, 100]


def test_an_ending_carries_its_error_and_a_running_state_none() -> None:
    book = JobBook(JobStatus(job_id="j1"))
    book.set_error(JobError(type="ConnectionLost", message="socket closed"))
    book.set_state(JobState.RECONNECTING)
    book.set_error(JobError(type="Cancelled", message="by a client"))
    book.set_state(JobState.CANCELLED)
    states = [entry for entry in book.journal if entry.kind == "state"]
    assert [entry.state for entry in states] == [
        JobState.QUEUED,
        JobState.RECONNECTING,
        JobState.CANCELLED,
    ]
    assert states[1].error is None
    assert states[2].error == JobError(type="Cancelled", message="by a client")


def test_a_continued_run_goes_on_from_its_carried_journal_without_repeating_it() -> None:
    first = JobBook(JobStatus(job_id="j1"))
    first.set_state(JobState.RUNNING)
    first.merge_artifacts([_artifact("a.png")])
    carried = list(first.journal)
    second = JobBook(first.status.model_copy(deep=True), list(carried))
    second.set_state(JobState.RUNNING)  # the continued run's first write: same state
    second.merge_artifacts([_artifact("b.png")])
    assert _kinds(second.journal)[: len(carried)] == _kinds(carried)
    assert _kinds(second.journal)[len(carried) :] == [(second.status.seq, "output_stored", "b.png")]


def test_the_journal_keeps_the_latest_entries_only() -> None:
    book = JobBook(JobStatus(job_id="j1"))
    for n in range(MAX_JOURNAL + 20):
        book.merge_artifacts([_artifact(f"{n}.png")])
    assert len(book.journal) == MAX_JOURNAL
    assert book.journal[-1].artifact is not None
    assert book.journal[-1].artifact.key == f"{MAX_JOURNAL + 19}.png"
    seqs = [entry.seq for entry in book.journal]
    assert seqs == sorted(seqs)
