"""`workflows/job_book.py` on its own: every status write, search attribute and the UI's details.

`JobBook` calls a few `temporalio.workflow` functions (the clock, uuid4, search attributes,
current details, the logger); here they are stand-ins, so each write is checked without a server.
"""

from __future__ import annotations

import logging
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.support.workflow_fakes import FAKE_UUID, T0, FakeWorkflow
from workflows.activity_io import FollowResult
from workflows.contracts import (
    MAX_NOTICES,
    Artifact,
    BackendInfo,
    Checkpoint,
    Decision,
    Delivery,
    JobCost,
    JobError,
    JobState,
    JobStatus,
    Progress,
    ProgressReport,
    Teardown,
    TeardownStep,
)
from workflows.job_book import JobBook
from workflows.shared import SA_JOB_POOL, SA_JOB_PROGRESS, SA_JOB_STATE

CLIENT_ID = f"dc-{FAKE_UUID}"  # what the book makes of workflow.uuid4()


def _artifact(key: str, segment: int = 0) -> Artifact:
    return Artifact(
        key=key,
        uri=f"s3://b/{key}",
        size=1,
        sha256="0" * 64,
        content_type="image/png",
        node_id="9",
        segment=segment,
    )


def _report(step: int = 0, total: int = 0, **kw: Any) -> ProgressReport:
    return ProgressReport(attempt_client_id=CLIENT_ID, step=step, total_steps=total, **kw)


def _book(**status: Any) -> JobBook:
    return JobBook(JobStatus(job_id="j1", **status))


# -- a new book -----------------------------------------------------------------------------


def test_a_new_book_takes_the_prompt_from_the_checkpoint_and_starts_the_clock(
    wf: FakeWorkflow,
) -> None:
    fresh = _book()
    assert fresh.prompt_id is None
    assert fresh.client_id is None
    assert fresh.last_progress_at == T0
    assert fresh.backend_state == JobState.RUNNING
    carried = _book(checkpoint=Checkpoint(job_id="j1", prompt_id="p-7"))
    assert carried.prompt_id == "p-7"
    # Nothing written yet: no seq bump, no search attribute.
    assert fresh.status.seq == 0 and wf.upserts == []


def test_the_first_progress_upsert_is_sent_even_at_zero(wf: FakeWorkflow) -> None:
    book = _book()
    book.apply_progress(_report())
    assert wf.upserts == [{SA_JOB_PROGRESS: 0}]
    book.apply_progress(_report())
    assert wf.upserts == [{SA_JOB_PROGRESS: 0}]


# -- the run --------------------------------------------------------------------------------


def test_prepared_on_records_the_backend_and_upserts_the_pool(wf: FakeWorkflow) -> None:
    book = _book()
    book.prepared_on("gpu-a", "runpod")
    assert book.status.backend == BackendInfo(pool="gpu-a", kind="runpod")
    assert wf.upserts == [{SA_JOB_POOL: "gpu-a"}]
    assert book.status.seq == 1


def test_the_pool_named_by_the_follow_that_checked_the_request(wf: FakeWorkflow) -> None:
    """A request that stages nothing: its first progress report (or its result) names the
    pool, after the prompt was submitted; said twice, it is recorded once."""
    book = _book()
    book.new_submission(0, "p-1", 20)
    book.apply_progress(_report(1, 20, worker_id="w9", pool="gpu-a", kind="comfyui"))
    assert book.status.backend == BackendInfo(
        pool="gpu-a", kind="comfyui", provider_job_id="p-1", worker_id="w9"
    )
    book.prepared_on("gpu-a", "comfyui")  # the follow's result says it again
    assert book.status.backend.worker_id == "w9"
    assert [u for u in wf.upserts if SA_JOB_POOL in u] == [{SA_JOB_POOL: "gpu-a"}]


def test_begin_segment_counts_sampler_steps_or_else_nodes(wf: FakeWorkflow) -> None:
    book = _book()
    book.begin_segment(1, 4, 20, 7)
    assert book.status.progress == Progress(
        segment=1, segments=4, total_steps=20, fraction=0.25, unit="steps"
    )
    book.begin_segment(2, 4, 0, 7)
    assert book.status.progress == Progress(
        segment=2, segments=4, total_steps=7, fraction=0.5, unit="nodes"
    )
    assert book.status.seq == 2


def test_new_submission_records_the_prompt_before_it_is_sent(wf: FakeWorkflow) -> None:
    book = _book(backend=BackendInfo(pool="p"))
    book.status.progress.queue_position = 3
    book.backend_state = JobState.WAITING
    wf.advance(5)
    checkpoint = book.new_submission(2, "p-1", 30)
    assert checkpoint == Checkpoint(
        job_id="j1",
        segment=2,
        prompt_id="p-1",
        client_id=CLIENT_ID,
        total_steps=30,
        updated_at=T0 + timedelta(seconds=5),
    )
    assert book.status.checkpoint == checkpoint
    assert book.client_id == CLIENT_ID and book.prompt_id == "p-1"
    assert book.status.backend is not None and book.status.backend.provider_job_id == "p-1"
    assert book.backend_state == JobState.RUNNING
    assert book.status.progress.queue_position is None
    assert book.last_progress_at == T0 + timedelta(seconds=5)
    assert book.status.seq == 1
    assert not book.submitted()
    # Without a backend yet (a cancel before prepare): nothing to name the prompt on.
    bare = _book()
    bare.new_submission(0, "p-2", 1)
    assert bare.status.backend is None and bare.prompt_id == "p-2"


def test_submitted_needs_the_current_prompt_acknowledged(wf: FakeWorkflow) -> None:
    book = _book()
    assert not book.submitted()
    checkpoint = book.new_submission(0, "p-1", 10)
    assert not book.submitted()
    book.set_checkpoint(checkpoint.model_copy(update={"submitted_at": T0}))
    assert book.submitted()
    assert book.status.seq == 2
    book.prompt_id = "p-2"  # a newer prompt the backend has not acknowledged
    assert not book.submitted()


def test_restart_and_end_of_a_segment(wf: FakeWorkflow) -> None:
    book = _book()
    book.begin_segment(1, 4, 20, 0)
    book.apply_progress(_report(12, 20))
    book.restart_prompt()
    assert book.status.progress.step == 0
    wf.advance(9)
    seq = book.status.seq
    book.end_segment()
    assert book.status.progress.step == 20
    assert book.status.progress.fraction == 0.5
    assert book.last_progress_at == T0 + timedelta(seconds=9)
    assert book.status.seq == seq + 1


def test_reconnecting_counts_and_sets_the_error_and_state(wf: FakeWorkflow) -> None:
    book = _book(state=JobState.RUNNING)
    error = JobError(type="Net", message="gone", retryable=True)
    book.reconnecting(error, JobState.RECONNECTING)
    book.reconnecting(error, JobState.RECONNECTING)
    assert book.status.reconnects == 2
    assert book.status.error == error
    assert book.status.state == JobState.RECONNECTING
    book.set_error(None)
    assert book.status.error is None
    assert book.status.seq == 3


def test_ask_waits_for_a_person(wf: FakeWorkflow) -> None:
    book = _book(state=JobState.RUNNING)
    decision = Decision(reason="ambiguous submit", options={"resume": "re-attach"})
    book.ask(decision)
    assert book.status.decision == decision
    assert book.status.state == JobState.NEEDS_DECISION
    assert wf.upserts[-1][SA_JOB_STATE] == "NEEDS_DECISION"


def test_a_cost_per_provider_job_the_latest_reading_wins(wf: FakeWorkflow) -> None:
    book = _book()
    book.add_cost(JobCost(provider_job_id="rp-1", execution_s=5.0))
    book.add_cost(JobCost(provider_job_id="rp-2", execution_s=7.0))
    book.add_cost(JobCost(provider_job_id="rp-1", execution_s=9.0))
    assert book.status.cost == [
        JobCost(provider_job_id="rp-2", execution_s=7.0),
        JobCost(provider_job_id="rp-1", execution_s=9.0),
    ]
    assert book.status.seq == 3


def test_each_provider_job_is_a_delivery_with_what_became_of_it(wf: FakeWorkflow) -> None:
    """A fenced delivery and the one that completed the job, each with its billed seconds; a
    later reading of a job without an outcome (its final figures) keeps what became of it."""
    book = _book()
    book.add_cost(
        JobCost(provider_job_id="rp-1", execution_s=9.0, outcome="fenced", lower_bound=True)
    )
    book.add_cost(JobCost(provider_job_id="rp-2", execution_s=7.0, billed_after_end_s=5.0))
    book.add_cost(JobCost(provider_job_id="rp-2", execution_s=7.5, outcome="completed"))
    book.add_cost(JobCost(provider_job_id="rp-1", execution_s=12.0, billed_after_end_s=5.0))
    assert book.status.deliveries == [
        Delivery(provider_job_id="rp-2", outcome="completed", billed_s=7.5),
        Delivery(provider_job_id="rp-1", outcome="fenced", billed_s=17.0),
    ]
    assert [c.outcome for c in book.status.cost] == ["completed", "fenced"]


def test_teardown_and_contact(wf: FakeWorkflow) -> None:
    book = _book()
    book.set_teardown(Teardown(state="STOPPING"))
    assert book.status.teardown.state == "STOPPING"
    wf.advance(3)
    book.contact()
    book.contact()
    assert book.contacts == 2
    assert book.status.last_client_contact_at == T0 + timedelta(seconds=3)
    assert book.status.seq == 3


# -- reports from the follow activity -------------------------------------------------------


def test_progress_moves_forward_only_and_sets_the_fraction(wf: FakeWorkflow) -> None:
    book = _book()
    book.begin_segment(1, 4, 20, 0)
    wf.advance(1)
    book.apply_progress(_report(10, 20))
    progress = book.status.progress
    assert (progress.step, progress.total_steps, progress.fraction) == (10, 20, 0.375)
    assert book.last_progress_at == T0 + timedelta(seconds=1)
    wf.advance(1)
    book.apply_progress(_report(4, 0))  # late, from an older socket
    assert (progress.step, progress.total_steps) == (10, 20)
    assert progress.fraction == 0.375  # the fraction follows the kept step, never backwards
    assert book.last_progress_at == T0 + timedelta(seconds=1)  # no progress: no clock reset
    book.apply_progress(_report(10, 20))  # the same step again is no progress either
    assert book.last_progress_at == T0 + timedelta(seconds=1)
    book.apply_progress(_report(25, 20))  # past the end: the fraction stops at the segment's
    assert progress.step == 25 and progress.fraction == 0.5


def test_progress_without_a_known_total_leaves_the_fraction(wf: FakeWorkflow) -> None:
    book = _book()
    book.status.progress.fraction = 0.25
    book.apply_progress(_report(3, 0))
    assert book.status.progress.fraction == 0.25
    assert book.status.progress.step == 3


def test_progress_with_no_segments_counts_as_one(wf: FakeWorkflow) -> None:
    book = _book(progress=Progress(segments=0))
    book.apply_progress(_report(5, 10))
    assert book.status.progress.fraction == 0.5


def test_a_report_carries_checkpoint_artifact_and_worker(wf: FakeWorkflow) -> None:
    book = _book(backend=BackendInfo(pool="p"))
    wf.advance(2)
    checkpoint = Checkpoint(job_id="j1", prompt_id="p-1", step=3)
    book.apply_progress(
        _report(0, 0, artifact=_artifact("a"), checkpoint=checkpoint, worker_id="w9")
    )
    assert book.status.checkpoint == checkpoint
    assert [a.key for a in book.status.artifacts] == ["a"]
    assert book.status.backend is not None and book.status.backend.worker_id == "w9"
    assert book.last_progress_at == T0 + timedelta(seconds=2)  # an artifact is progress
    wf.advance(2)
    book.apply_progress(_report(0, 0, artifact=_artifact("a"), worker_id=None))
    assert len(book.status.artifacts) == 1
    assert book.status.backend.worker_id == "w9"
    assert book.status.checkpoint == checkpoint  # a report without one keeps it
    assert book.status.seq == 2
    # No backend yet: the worker is not recorded anywhere, and nothing breaks.
    bare = _book()
    bare.apply_progress(_report(1, 2, worker_id="w1"))
    assert bare.status.backend is None


def test_search_attribute_progress_only_in_whole_tens(wf: FakeWorkflow) -> None:
    book = _book()
    book.begin_segment(0, 1, 100, 0)
    for step in (1, 5, 9, 10, 19, 20, 100):
        book.apply_progress(_report(step, 100))
    assert wf.upserts == [
        {SA_JOB_PROGRESS: 0},
        {SA_JOB_PROGRESS: 10},
        {SA_JOB_PROGRESS: 20},
        {SA_JOB_PROGRESS: 100},
    ]
    assert book.coarse_progress() == 100


def test_stage_changes_only_when_asked(wf: FakeWorkflow) -> None:
    book = _book(state=JobState.RUNNING)
    book.apply_progress(_report(stage="queued", queue_position=2, node="5"))
    assert book.backend_state == JobState.RUNNING
    assert book.status.progress.queue_position is None and book.status.progress.node is None
    assert book.status.state == JobState.RUNNING


@pytest.mark.parametrize("state", [JobState.SUBMITTING, JobState.WAITING, JobState.RUNNING])
def test_a_queued_prompt_is_waiting_with_its_place_then_running(
    wf: FakeWorkflow, state: JobState
) -> None:
    book = _book(state=state)
    book.apply_progress(_report(stage="queued", queue_position=2), stage_changes=True)
    assert (book.backend_state, book.status.state) == (JobState.WAITING, JobState.WAITING)
    assert book.status.progress.queue_position == 2
    book.apply_progress(_report(1, 10, stage="running", node="5"), stage_changes=True)
    assert (book.backend_state, book.status.state) == (JobState.RUNNING, JobState.RUNNING)
    assert book.status.progress.queue_position is None
    assert book.status.progress.node == "5"
    states = [u[SA_JOB_STATE] for u in wf.upserts if SA_JOB_STATE in u]
    assert states == (["RUNNING"] if state == JobState.WAITING else ["WAITING", "RUNNING"])


@pytest.mark.parametrize(
    "state", [JobState.RECONNECTING, JobState.NEEDS_DECISION, JobState.STOPPING]
)
def test_a_stage_does_not_move_a_job_that_is_elsewhere(wf: FakeWorkflow, state: JobState) -> None:
    book = _book(state=state)
    book.apply_progress(_report(stage="queued", queue_position=1), stage_changes=True)
    assert book.status.state == state
    assert book.backend_state == JobState.WAITING


def test_notices_are_logged_and_only_the_latest_kept(
    wf: FakeWorkflow, caplog: pytest.LogCaptureFixture
) -> None:
    book = _book()
    with caplog.at_level(logging.WARNING, logger=wf.logger.name):
        for i in range(MAX_NOTICES + 2):
            wf.advance(1)
            book.notice(f"n{i}")
    notices = book.status.notices
    assert len(notices) == MAX_NOTICES
    assert notices[0].message == "n2" and notices[-1].message == f"n{MAX_NOTICES + 1}"
    assert notices[-1].at == T0 + timedelta(seconds=MAX_NOTICES + 2)
    assert caplog.messages[0] == "job j1: n0"
    assert book.status.seq == MAX_NOTICES + 2


def test_artifacts_merge_by_key_and_by_segment(wf: FakeWorkflow) -> None:
    book = _book()
    book.merge_artifacts([_artifact("a"), _artifact("a"), _artifact("b", 1)])
    assert [a.key for a in book.status.artifacts] == ["a", "b"]
    wf.advance(4)
    book.merge_artifacts([_artifact("b", 1)])
    assert book.last_progress_at == T0  # nothing new: no progress
    book.merge_artifacts([_artifact("c", 1)])
    assert book.last_progress_at == T0 + timedelta(seconds=4)
    assert [a.key for a in book.artifacts_of(1)] == ["b", "c"]
    assert [a.key for a in book.artifacts_of(0)] == ["a"]


# -- status writes --------------------------------------------------------------------------


CHANGES: dict[str, Any] = {
    "set_state": lambda b: b.set_state(JobState.RUNNING),
    "prepared_on": lambda b: b.prepared_on("q", "runpod"),
    "begin_segment": lambda b: b.begin_segment(0, 1, 10, 2),
    "new_submission": lambda b: b.new_submission(0, "p-2", 10),
    "set_checkpoint": lambda b: b.set_checkpoint(Checkpoint(job_id="j1", prompt_id="p-1")),
    "followed": lambda b: b.followed(
        FollowResult(
            prompt_id="p-1",
            outcome="success",
            artifacts=[_artifact("a"), _artifact("b")],
            checkpoint=Checkpoint(job_id="j1", prompt_id="p-1", step=10),
            cost=JobCost(provider_job_id="r-1", execution_s=2.0),
            other_costs=[JobCost(provider_job_id="r-0", execution_s=1.0)],
        )
    ),
    "restart_prompt": lambda b: b.restart_prompt(),
    "end_segment": lambda b: b.end_segment(),
    "reconnecting": lambda b: b.reconnecting(
        JobError(type="ConnectionLost", message="x"), JobState.RECONNECTING
    ),
    "set_error": lambda b: b.set_error(None),
    "ask": lambda b: b.ask(Decision(reason="r", since=T0)),
    "add_cost": lambda b: b.add_cost(JobCost(provider_job_id="r-1", execution_s=2.0)),
    "merge_artifacts": lambda b: b.merge_artifacts([_artifact("a"), _artifact("b")]),
    "contact": lambda b: b.contact(),
    "notice": lambda b: b.notice("n"),
    "set_teardown": lambda b: b.set_teardown(Teardown(state="SKIPPED")),
    "teardown_started": lambda b: b.teardown_started(),
    "stop_checked": lambda b: b.stop_checked(),
    "add_teardown_step": lambda b: b.add_teardown_step(TeardownStep(at=T0, action="dequeued")),
    "teardown_waiting": lambda b: b.teardown_waiting("waiting"),
    "end_teardown": lambda b: b.end_teardown("CONFIRMED", "done"),
    "apply_progress": lambda b: b.apply_progress(
        _report(3, 10, stage="queued", queue_position=1, artifact=_artifact("a")),
        stage_changes=True,
    ),
}


@pytest.mark.parametrize("change", CHANGES)
def test_every_change_bumps_seq_once_and_refreshes_the_details(
    wf: FakeWorkflow, change: str
) -> None:
    book = _book(state=JobState.SUBMITTING, backend=BackendInfo(pool="p"))
    wf.advance(7)
    CHANGES[change](book)
    assert book.status.seq == 1
    assert book.status.updated_at == T0 + timedelta(seconds=7)
    assert wf.details == [book.details()]


# A write to the status or to a part of it, in another workflow module: an assignment to an
# attribute of a status-shaped name, or a list of the status grown in place.
STATUS_WRITE = re.compile(
    r"\b(status|record|teardown|progress|checkpoint|backend|decision)(\.\w+)+\s*[-+]?=[^=]"
    r"|\.(steps|artifacts|notices|cost)\.(append|extend|insert)\("
    r"|\b(book|_book)\.(finished_prompt|prompt_id|client_id|backend_state)\s*=[^=]"
)


def status_writes(source: str) -> list[int]:
    return [n for n, line in enumerate(source.splitlines(), 1) if STATUS_WRITE.search(line)]


def test_the_status_is_written_only_by_the_book() -> None:
    """Every other workflow module reads the status and the book; none writes them (the
    book's methods bump `seq` once per change, which clients' `watch` relies on)."""
    root = Path(__file__).parents[2] / "workflows"
    offenders = {
        path.name: status_writes(path.read_text())
        for path in sorted(root.glob("*.py"))
        if path.name not in ("job_book.py", "contracts.py")
    }
    assert {name: lines for name, lines in offenders.items() if lines} == {}


def test_the_write_check_sees_the_writes_it_looks_for() -> None:
    source = """
        record.state = "STOPPING"
        record.checks += 1
        self._book.status.teardown.detail = x
        steps.append(step); self.record.steps.append(step)
        book.finished_prompt = prompt_id
        if record.state == "STOPPING": pass
    """
    assert status_writes(source) == [2, 3, 4, 5, 6]


def test_a_late_report_after_a_restart_never_moves_the_fraction_back(wf: FakeWorkflow) -> None:
    book = _book()
    book.begin_segment(0, 2, 10, 0)
    book.apply_progress(_report(8, 10))
    assert book.status.progress.fraction == 0.4
    book.restart_prompt()  # the backend lost the prompt: it runs again from step 0
    book.apply_progress(_report(2, 10))
    assert book.status.progress.step == 2
    assert book.status.progress.fraction == 0.4
    book.apply_progress(_report(9, 10))
    assert book.status.progress.fraction == 0.45


def test_state_changes_upsert_state_and_progress(wf: FakeWorkflow) -> None:
    book = _book()
    book.status.progress.fraction = 0.47
    book.set_state(JobState.QUEUED)  # the very first write: upserted although unchanged
    assert wf.upserts == [{SA_JOB_STATE: "QUEUED", SA_JOB_PROGRESS: 40}]
    book.set_state(JobState.QUEUED)
    assert len(wf.upserts) == 1
    book.set_state(JobState.RUNNING)
    assert wf.upserts[-1] == {SA_JOB_STATE: "RUNNING", SA_JOB_PROGRESS: 40}
    assert book.status.state == JobState.RUNNING
    assert book.status.seq == 3
    assert wf.details[-1] == book.details()
    assert wf.details[-1].startswith("**RUNNING**")


def test_an_unchanged_state_later_upserts_nothing(wf: FakeWorkflow) -> None:
    book = _book(seq=4, state=JobState.RUNNING)
    book.set_state(JobState.RUNNING)
    assert wf.upserts == []
    assert len(wf.details) == 1


# -- the Temporal UI's current details ------------------------------------------------------


def test_details_of_a_bare_job(wf: FakeWorkflow) -> None:
    assert _book().details() == "**QUEUED** — 0 %"
    done = _book(state=JobState.COMPLETED, progress=Progress(fraction=1.0))
    assert done.details() == "**COMPLETED** — 100 %"


def test_details_of_a_running_job(wf: FakeWorkflow) -> None:
    book = _book(
        state=JobState.RUNNING,
        backend=BackendInfo(pool="gpu"),
        reconnects=2,
        error=JobError(type="Net", message="lost"),
        artifacts=[_artifact("a")],
        progress=Progress(segment=1, segments=3, step=4, total_steps=20, fraction=0.4, node="7"),
    )
    assert book.details() == "  \n".join(
        [
            "**RUNNING** — 40 % (4/20 steps, segment 2/3)",
            "pool `gpu`, node 7",
            "2 reconnect(s)",
            "error `Net`: lost",
            "1 artifact(s) stored",
        ]
    )


def test_details_of_a_waiting_job_name_its_place_not_a_node(wf: FakeWorkflow) -> None:
    progress = Progress(queue_position=3, node="7", total_steps=5, unit="nodes")
    book = _book(state=JobState.WAITING, backend=BackendInfo(pool="gpu"), progress=progress)
    assert book.details() == "  \n".join(
        [
            "**WAITING** — 0 % (0/5 nodes, segment 1/1)",
            "place 3 in the backend's queue",
            "pool `gpu`",
        ]
    )
    book.status.progress.queue_position = None
    assert "queue" not in book.details()
    book.status.state = JobState.RUNNING
    book.status.progress.queue_position = 3
    assert "queue" not in book.details()


def test_details_of_a_decision_and_a_teardown(wf: FakeWorkflow) -> None:
    decision = Decision(reason="ambiguous", options={"resume": "re-attach", "cancel": "stop"})
    book = _book(
        state=JobState.NEEDS_DECISION,
        decision=decision,
        teardown=Teardown(state="FAILED", detail="p-1 still running"),
    )
    assert book.details() == "  \n".join(
        [
            "**NEEDS_DECISION** — 0 %",
            "waiting for a decision: ambiguous",
            "- `resume`: re-attach",
            "- `cancel`: stop",
            "teardown FAILED: p-1 still running",
        ]
    )
    book.status.state = JobState.RUNNING  # a past decision is not shown
    assert book.details() == "**RUNNING** — 0 %  \nteardown FAILED: p-1 still running"


def test_the_eta_follows_the_pace_since_the_first_step(wf: FakeWorkflow) -> None:
    book = _book(state=JobState.RUNNING)
    progress = book.status.progress
    assert book._details.eta_s(book.status) is None  # no step yet: no pace to start from
    progress.fraction = 0.25
    assert book._details.eta_s(book.status) is None  # the pace starts here
    wf.advance(30)
    progress.fraction = 0.26
    assert book._details.eta_s(book.status) is None  # too little done to tell
    progress.fraction = 0.5
    assert book._details.eta_s(book.status) == pytest.approx(
        60.0
    )  # a quarter in 30 s: half to go in 60 s
    assert "about 60 s to go" in book.details()
    wf.advance(30)
    progress.fraction = 1.0
    assert book._details.eta_s(book.status) is None
    progress.fraction = 0.75
    book.status.state = JobState.WAITING
    assert book._details.eta_s(book.status) is None


def test_the_eta_shows_from_two_hundredths_done(wf: FakeWorkflow) -> None:
    book = _book(state=JobState.RUNNING)
    book.status.progress.fraction = 0.005
    book._details.eta_s(book.status)
    wf.advance(2)
    book.status.progress.fraction = 0.025  # exactly 0.02 more, in floats too
    assert book._details.eta_s(book.status) == pytest.approx(97.5)


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0.4, "0 s"),
        (89.4, "89 s"),
        (90, "2 min"),
        (5399, "90 min"),
        (5400, "1.5 h"),
        (5580, "1.6 h"),
    ],
)
def test_the_eta_is_shown_in_a_readable_unit(wf: FakeWorkflow, seconds: float, shown: str) -> None:
    book = _book(state=JobState.RUNNING)
    book.status.progress.fraction = 0.25
    book._details.eta_s(book.status)
    wf.advance(seconds / 2)  # a quarter done: the remaining half takes twice as long
    book.status.progress.fraction = 0.5
    assert book.details() == f"**RUNNING** — 50 %  \nabout {shown} to go"


def test_the_backends_own_job_id_replaces_the_prompt_id_once_named(wf: FakeWorkflow) -> None:
    book = _book()
    book.prepared_on("gpu-a", "runpod")
    book.new_submission(0, "p-1", 10)
    assert book.status.backend is not None and book.status.backend.provider_job_id == "p-1"
    named = Checkpoint(job_id="j1", prompt_id="p-1", provider_job_id="rp-7")
    book.apply_progress(_report(step=1, checkpoint=named))
    assert book.status.backend.provider_job_id == "rp-7"
    book.set_checkpoint(named.model_copy(update={"provider_job_id": "rp-8"}))
    assert book.status.backend.provider_job_id == "rp-8"
    book.set_checkpoint(Checkpoint(job_id="j1", prompt_id="p-1"))
    assert book.status.backend.provider_job_id == "rp-8", "a checkpoint naming none keeps it"


def test_details_show_backend_text_as_text_never_as_markup(wf: FakeWorkflow) -> None:
    """An error message or a node's name comes from a backend: in the UI's Markdown it must
    not become a link, an image or a new line of its own."""
    book = _book(
        state=JobState.RUNNING,
        backend=BackendInfo(pool="gpu"),
        error=JobError(
            type="Net", message="see [here](https://evil.example)\n# owned " + "x" * 400
        ),
        progress=Progress(node="![img](https://evil.example/p.png)"),
    )
    details = book.details()
    assert "[here](" not in details and "![img](" not in details
    assert "\\[here\\]\\(https://evil.example\\)" in details
    assert "\n#" not in details
    error_line = next(line for line in details.split("  \n") if line.startswith("error"))
    assert len(error_line) < 350 and error_line.endswith("…")
