"""`workflows/segment_run.py` on its own: one segment's submit, follow, re-attach, resubmit.

The activities and the workflow runtime are stand-ins that record what the segment asked for
and play a script of outcomes, so each path (re-attach, resubmit, ask a person, give up) is
checked step by step without a server.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError

from tests.support.workflow_fakes import (
    FAKE_UUID,
    T0,
    FakeWorkflow,
    install_fake_workflow,
    made_true_by,
)
from tests.support.workflow_fakes import after_activity as failed
from workflows import activity_calls
from workflows.activity_io import (
    FollowHeartbeat,
    FollowInput,
    FollowResult,
    OffloadInput,
    OffloadResult,
    PreparedJob,
    PrepareInput,
)
from workflows.contracts import (
    Artifact,
    Checkpoint,
    JobCost,
    JobError,
    JobPolicy,
    JobRequest,
    JobState,
    JobStatus,
    ReconnectPolicy,
    ResumeRequest,
)
from workflows.job_book import JobBook, JobControls, StopOrder
from workflows.segment_run import SegmentRun
from workflows.shared import AT_MOST_ONCE, AT_MOST_ONCE_RESUBMITS, ErrorType

# The workflow's metrics, as a metrics backend lists them (name and help text).
RECONNECTS = "durable_comfy_reconnects: Durable reconnect timers"
RESUBMISSIONS = "durable_comfy_resubmissions: Prompts submitted again after the backend lost them"
PROMPT = str(FAKE_UUID)  # what workflow.uuid4() gives
GRAPH: dict[str, Any] = {
    "1": {"class_type": "KSampler", "inputs": {"seed": 1, "steps": 20}},
    "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "t"}},
}
PREPARED = PreparedJob(
    pool="gpu",
    kind="comfyui",
    graph=GRAPH,
    sampler_steps={"1": 20},
    nodes_total=2,
    staged_inputs={"in.png": "s3://b/in.png"},
)


def artifact(key: str, segment: int = 0) -> Artifact:
    return Artifact(
        key=key,
        uri=f"s3://b/{key}",
        size=1,
        sha256="0" * 64,
        content_type="image/png",
        node_id="2",
        segment=segment,
    )


def connection_lost(
    checkpoint: Checkpoint | None = None, artifacts: list[Artifact] | None = None
) -> ActivityError:
    details = []
    if checkpoint is not None:
        heartbeat = FollowHeartbeat(checkpoint=checkpoint, artifacts=artifacts or [])
        details = [heartbeat.model_dump(mode="json")]
    return failed(ApplicationError("socket closed", *details, type=ErrorType.CONNECTION_LOST))


def prompt_lost() -> ActivityError:
    return failed(ApplicationError("not in queue nor history", type=ErrorType.PROMPT_LOST))


def worker_lost() -> ActivityError:
    """A RunPod pool with claims lost the worker that ran the prompt: it cannot run twice."""
    return failed(
        ApplicationError(
            "RunPod job TIMED_OUT: the worker stopped reporting",
            {"provider_job_id": "rp-1"},
            {AT_MOST_ONCE: True},
            type=ErrorType.PROMPT_LOST,
            non_retryable=True,
        )
    )


def ambiguous() -> ActivityError:
    return failed(
        ApplicationError("the submission's answer was lost", type=ErrorType.SUBMISSION_AMBIGUOUS)
    )


@dataclass
class Backend(FakeWorkflow):
    """The workflow runtime and the activities, as the segment sees them."""

    follow_outcomes: list[FollowResult | BaseException | Callable[[FollowInput], Any]] = field(
        default_factory=list
    )
    follows: list[FollowInput] = field(default_factory=list)
    states_at_follow: list[str] = field(default_factory=list)
    offloads: list[OffloadInput] = field(default_factory=list)
    during_sleep: list[tuple[str, JobError | None, int]] = field(default_factory=list)
    book: JobBook | None = None

    async def follow(self, req: FollowInput, policy: JobPolicy) -> FollowResult:
        assert self.book is not None
        self.follows.append(req)
        self.states_at_follow.append(self.book.status.state)
        outcome = self.follow_outcomes.pop(0)
        if callable(outcome):
            outcome = outcome(req)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def offload(self, req: OffloadInput) -> OffloadResult:
        self.offloads.append(req)
        return OffloadResult(artifacts=[])

    async def sleep(self, duration: timedelta, *, summary: str | None = None) -> None:
        assert self.book is not None
        status = self.book.status
        self.during_sleep.append((status.state, status.error, status.reconnects))
        await super().sleep(duration, summary=summary)


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> Backend:
    fake = install_fake_workflow(monkeypatch, Backend())
    monkeypatch.setattr(activity_calls, "follow", fake.follow)
    monkeypatch.setattr(activity_calls, "offload", fake.offload)
    return fake


def policy(**kw: Any) -> JobPolicy:
    return JobPolicy(
        reconnect=ReconnectPolicy(base_delay_s=2.0, max_delay_s=30.0, horizon_s=100.0), **kw
    )


def segment(
    backend: Backend,
    *,
    segment_no: int = 0,
    controls: JobControls | None = None,
    **request: Any,
) -> tuple[SegmentRun, JobBook, JobControls]:
    book = JobBook(JobStatus(job_id="j1", state=JobState.PREPARING))
    book.prepared_on("gpu", "comfyui")
    backend.book = book
    if controls is not None:
        book.controls = controls
    job = JobRequest(graph=GRAPH, **({"policy": policy()} | request))
    run = SegmentRun(book, job, PREPARED, segment_no)
    return run, book, book.controls


def sent(req: FollowInput) -> Checkpoint:
    """The checkpoint a follow attempt started from (the segment always sends one)."""
    assert req.checkpoint is not None
    return req.checkpoint


def done(req: FollowInput, *keys: str, step: int = 20) -> FollowResult:
    checkpoint = sent(req).model_copy(
        update={"step": step, "submitted_at": sent(req).submitted_at or T0}
    )
    return FollowResult(
        prompt_id=req.prompt_id,
        outcome="success",
        artifacts=[artifact(k, req.segment) for k in keys],
        checkpoint=checkpoint,
    )


def at_step(step: int, *, submitted: bool = True, prompt: str = PROMPT) -> Checkpoint:
    return Checkpoint(
        job_id="j1",
        prompt_id=prompt,
        client_id=f"dc-{PROMPT}",
        step=step,
        total_steps=20,
        submitted_at=T0 if submitted else None,
    )


# -- a segment that runs through ------------------------------------------------------------


async def test_a_segment_submits_follows_and_ends_with_the_follows_outputs(
    backend: Backend,
) -> None:
    cost = JobCost(provider_job_id="rp-1", execution_s=12.0)
    backend.follow_outcomes = [
        lambda req: done(req, "a").model_copy(update={"cost": cost}),
    ]
    run, book, _ = segment(backend, policy=policy(execution_timeout_s=600.0, queue_timeout_s=120.0))
    await run.run()
    tag = f"dc_j1_0_{PROMPT[:8]}"
    [follow] = backend.follows
    assert follow == FollowInput(
        job_id="j1",
        pool="gpu",
        prompt_id=PROMPT,
        client_id=f"dc-{PROMPT}",
        segment=0,
        segments=1,
        run_tag=tag,
        sampler_steps={"1": 20},
        nodes_total=2,
        output=run._request.output,
        progress_interval_s=2.0,
        checkpoint=sent(follow),
        stored=[],
        graph=follow.graph,
        first_post=True,  # a fresh prompt ID: posted without asking the backend first
        execution_timeout_s=600.0,
        queue_timeout_s=120.0,
        staged_inputs={"in.png": "s3://b/in.png"},
        teardown_horizon_s=900.0,
    )
    assert follow.graph is not None
    assert follow.graph["2"]["inputs"]["filename_prefix"].startswith(f"{tag}/")
    assert sent(follow).prompt_id == PROMPT and sent(follow).submitted_at is None
    assert backend.states_at_follow == [JobState.SUBMITTING]
    # The follow stored and verified the outputs: no offload of its own.
    assert backend.offloads == []
    assert [a.key for a in book.status.artifacts] == ["a"]
    assert book.status.checkpoint is not None and book.status.checkpoint.step == 20
    assert book.finished_prompt == PROMPT
    progress = book.status.progress
    assert (progress.step, progress.total_steps, progress.fraction) == (20, 20, 1.0)
    assert backend.sleeps == []
    assert book.status.cost == [cost]


async def test_a_follow_that_checks_the_request_names_the_pool_for_what_follows(
    backend: Backend,
) -> None:
    """A request that stages nothing: each attempt checks it until one names the pool that
    took the job; the status, the pool's search attribute and later attempts then use it."""
    check = PrepareInput(job_id="j1", pool=None, graph=GRAPH)
    backend.follow_outcomes = [
        connection_lost(at_step(3)),
        lambda req: done(req, "a").model_copy(update={"pool": "gpu", "kind": "runpod"}),
        lambda req: done(req, "b"),
    ]
    book = JobBook(JobStatus(job_id="j1", state=JobState.QUEUED))
    backend.book = book
    job = JobRequest(graph=GRAPH, policy=policy(), segments=[{}, {}])
    unchecked = PREPARED.model_copy(update={"pool": None, "kind": None})
    await SegmentRun(book, job, unchecked, 0).run(check=check)
    first, second = backend.follows
    assert (first.pool, first.prepare) == (None, check)
    assert (second.pool, second.prepare) == (None, check), "not checked yet: checked again"
    assert book.status.backend is not None
    assert (book.status.backend.pool, book.status.backend.kind) == ("gpu", "runpod")
    assert book.status.backend.provider_job_id == PROMPT
    await SegmentRun(book, job, unchecked, 1).run(check=check)
    assert (backend.follows[2].pool, backend.follows[2].prepare) == ("gpu", None)


async def test_each_segment_runs_its_own_overrides(backend: Backend) -> None:
    segments = [{"1": {"seed": 10}}, {"1": {"seed": 11}}]
    backend.follow_outcomes = [lambda req: done(req, "b", step=20)]
    run, book, _ = segment(backend, segment_no=1, segments=segments)
    book.merge_artifacts([artifact("a", 0)])
    await run.run()
    [follow] = backend.follows
    assert follow.graph is not None and follow.graph["1"]["inputs"]["seed"] == 11
    assert (follow.segment, follow.segments) == (1, 2)
    assert follow.run_tag == f"dc_j1_1_{PROMPT[:8]}"
    assert [a.key for a in book.artifacts_of(1)] == ["b"] and backend.offloads == []
    assert book.status.progress.fraction == 1.0
    assert book.status.progress.segment == 1


async def test_a_graph_without_samplers_counts_nodes(backend: Backend) -> None:
    backend.follow_outcomes = [lambda req: done(req, "a", step=2)]
    run, book, _ = segment(backend)
    run._prepared = PREPARED.model_copy(update={"sampler_steps": {}})
    await run.run()
    assert sent(backend.follows[0]).total_steps == 2
    assert (book.status.progress.unit, book.status.progress.total_steps) == ("nodes", 2)


async def test_a_segment_without_saved_output_fails(backend: Backend) -> None:
    backend.follow_outcomes = [lambda req: done(req)]
    run, book, _ = segment(backend, segment_no=1, segments=[{}, {}])
    book.merge_artifacts([artifact("a", 0)])  # the segment before saved one; this one none
    with pytest.raises(ApplicationError) as raised:
        await run.run()
    assert raised.value.type == ErrorType.OUTPUT_MISSING and raised.value.non_retryable
    assert raised.value.message == (
        "segment 1 finished without any saved output (add a SaveImage node?)"
    )


# -- re-attaching -------------------------------------------------------------------------


async def test_a_broken_path_backs_off_then_re_attaches_from_the_checkpoint(
    backend: Backend,
) -> None:
    backend.follow_outcomes = [
        connection_lost(at_step(5), [artifact("a")]),
        connection_lost(),
        lambda req: done(req, "a"),
    ]
    run, book, _ = segment(backend, policy=policy(progress_interval_s=0.5))
    await run.run()
    assert backend.sleeps == [(1.5, "reconnect 1"), (3.0, "reconnect 2")]
    lost = JobError(type=ErrorType.CONNECTION_LOST, message="socket closed", retryable=True)
    assert backend.during_sleep == [
        (JobState.RECONNECTING, lost, 1),
        (JobState.RECONNECTING, lost, 2),
    ]
    assert book.status.error is None
    assert backend.counters == {RECONNECTS: 2}
    first, second, third = backend.follows
    assert first.graph is not None
    # Acknowledged by the backend: re-attach, never submit again.
    assert second.graph is None and third.graph is None
    assert sent(second).step == 5 and sent(second).submitted_at == T0
    # What the failed attempt stored is never uploaded twice.
    assert first.stored == [] and second.stored == third.stored == [artifact("a")]
    assert {req.progress_interval_s for req in backend.follows} == {0.5}
    assert third.checkpoint == sent(second)
    assert backend.states_at_follow == [JobState.SUBMITTING, JobState.RUNNING, JobState.RUNNING]


async def test_a_backend_that_never_took_the_prompt_is_still_submitting(
    backend: Backend,
) -> None:
    backend.follow_outcomes = [connection_lost(), lambda req: done(req, "a")]
    run, _, _ = segment(backend)
    await run.run()
    assert [state for state, _, _ in backend.during_sleep] == [JobState.SUBMITTING]
    assert backend.states_at_follow == [JobState.SUBMITTING, JobState.SUBMITTING]
    assert all(req.graph is not None for req in backend.follows)


async def test_the_furthest_checkpoint_of_this_prompt_wins(backend: Backend) -> None:
    run, book, _ = segment(backend)
    current = at_step(3, submitted=False)
    book.status.checkpoint = at_step(8, submitted=False)
    recovered = at_step(6)  # less far, but it knows the backend took the prompt
    best = run._furthest(current, recovered)
    assert best.step == 8 and best.submitted_at == T0
    assert book.status.checkpoint == best
    assert book.last_progress_at == T0
    # Another prompt's checkpoints do not count.
    backend.now += timedelta(seconds=5)
    book.status.checkpoint = None
    other = at_step(15, prompt="other")
    assert run._furthest(current, other) == current
    assert book.last_progress_at == T0  # no further: the reconnect horizon keeps counting
    uploaded = current.model_copy(update={"uploaded": ["x"]})
    assert run._furthest(current, uploaded) == uploaded  # an upload is progress too
    assert book.last_progress_at == T0 + timedelta(seconds=5)


async def test_the_furthest_checkpoint_keeps_its_own_submission_time(backend: Backend) -> None:
    run, book, _ = segment(backend)
    later = T0 + timedelta(seconds=9)
    book.status.checkpoint = at_step(8).model_copy(update={"submitted_at": later})
    assert run._furthest(at_step(3), at_step(6)).submitted_at == later


async def test_a_step_further_marks_progress(backend: Backend) -> None:
    run, book, _ = segment(backend)
    book.status.checkpoint = None
    backend.now += timedelta(seconds=5)
    assert run._furthest(at_step(3), at_step(4)).step == 4
    assert book.last_progress_at == T0 + timedelta(seconds=5)


def idle_for(backend: Backend, seconds: float) -> Callable[[FollowInput], Any]:
    """The follow attempt fails after `seconds` without any progress."""

    def outcome(req: FollowInput) -> ActivityError:
        backend.now += timedelta(seconds=seconds)
        return connection_lost()

    return outcome


async def test_no_progress_past_the_reconnect_horizon_gives_up(backend: Backend) -> None:
    backend.follow_outcomes = [idle_for(backend, 101)]
    run, _, _ = segment(backend)
    with pytest.raises(ApplicationError) as raised:
        await run.run()
    assert raised.value.type == ErrorType.CONNECTION_LOST and raised.value.non_retryable
    assert raised.value.message == (
        "no progress for 101 s (reconnect horizon 100 s) after 0 reconnect attempt(s); "
        "last error: socket closed"
    )
    assert backend.sleeps == []


async def test_the_horizon_is_counted_from_the_last_progress(backend: Backend) -> None:
    backend.follow_outcomes = [
        idle_for(backend, 100),  # exactly the horizon: not past it
        connection_lost(at_step(1)),  # 101.5 s after the submission, but a step further
        idle_for(backend, 95),
        idle_for(backend, 2),
    ]
    run, _, _ = segment(backend)
    with pytest.raises(ApplicationError) as raised:
        await run.run()
    assert [summary for _, summary in backend.sleeps] == [f"reconnect {i}" for i in (1, 2, 3)]
    assert raised.value.message.startswith("no progress for 106 s (reconnect horizon 100 s)")
    assert "after 3 reconnect attempt(s)" in raised.value.message


@pytest.mark.parametrize(
    "error",
    [
        failed(ApplicationError("bad graph", type=ErrorType.PROMPT_REJECTED, non_retryable=True)),
        failed(CancelledError()),
    ],
)
async def test_fatal_and_cancelled_failures_end_the_segment(
    backend: Backend, error: BaseException
) -> None:
    backend.follow_outcomes = [error]
    run, _, _ = segment(backend)
    with pytest.raises(ActivityError):
        await run.run()
    assert backend.sleeps == [] and len(backend.follows) == 1


async def test_a_failure_after_a_stop_order_ends_the_segment(backend: Backend) -> None:
    backend.follow_outcomes = [connection_lost()]
    stop = StopOrder(state=JobState.CANCELLED, error=JobError(type="Cancelled", message="c"))
    run, _, _ = segment(backend, controls=JobControls(stop=stop))
    with pytest.raises(ActivityError):
        await run.run()
    assert backend.sleeps == []


# -- a lost prompt --------------------------------------------------------------------------


async def test_a_lost_prompt_is_submitted_again_from_its_first_step(backend: Backend) -> None:
    backend.follow_outcomes = [
        connection_lost(at_step(5)),
        prompt_lost(),
        connection_lost(),
        lambda req: done(req, "a"),
    ]
    run, _, controls = segment(backend)
    await run.run()
    assert controls.resubmits == 1
    assert backend.counters == {RECONNECTS: 2, RESUBMISSIONS: 1}
    third = backend.follows[2]
    # The same prompt id, not yet acknowledged: the graph goes again, from step 0.
    assert third.prompt_id == PROMPT and third.graph is not None
    assert sent(third).submitted_at is None and sent(third).step == 0
    assert sent(third).total_steps == 20
    # The reconnect count starts over for the new submission.
    assert [summary for _, summary in backend.sleeps] == ["reconnect 1", "reconnect 1"]
    assert backend.states_at_follow[2] == JobState.SUBMITTING


async def test_losses_that_cannot_run_twice_are_resubmitted_without_asking(
    backend: Backend,
) -> None:
    # Found by `make soak`: two RunPod worker crashes in a row on one job (claims) left it
    # waiting for a person, though a claim makes each resubmission safe.
    losses: list[Any] = [worker_lost() for _ in range(AT_MOST_ONCE_RESUBMITS)]
    backend.follow_outcomes = [*losses, lambda req: done(req, "a")]
    run, book, controls = segment(backend, policy=policy(on_ambiguous_submit="pause"))
    backend.conditions = [lambda _: pytest.fail(f"asked a person: {book.status.decision}")]
    await run.run()
    assert controls.resubmits == controls.unasked_resubmits == AT_MOST_ONCE_RESUBMITS
    assert all(follow.graph is not None for follow in backend.follows[1:])


async def test_past_the_unasked_resubmissions_the_policy_decides(backend: Backend) -> None:
    backend.follow_outcomes = [worker_lost() for _ in range(AT_MOST_ONCE_RESUBMITS + 1)]
    run, _, controls = segment(backend, policy=policy(on_ambiguous_submit="fail"))
    with pytest.raises(ApplicationError) as raised:
        await run.run()
    assert raised.value.type == ErrorType.PROMPT_LOST and raised.value.non_retryable
    assert controls.resubmits == AT_MOST_ONCE_RESUBMITS


async def test_a_second_loss_fails_when_the_policy_says_fail(backend: Backend) -> None:
    backend.follow_outcomes = [prompt_lost()]
    run, _, _ = segment(
        backend,
        controls=JobControls(resubmits=1),
        policy=policy(on_ambiguous_submit="fail"),
    )
    with pytest.raises(ApplicationError) as raised:
        await run.run()
    assert raised.value.message == "ComfyUI lost the prompt twice"
    assert raised.value.type == ErrorType.PROMPT_LOST and raised.value.non_retryable


async def test_a_second_loss_is_resubmitted_when_the_policy_says_so(backend: Backend) -> None:
    backend.follow_outcomes = [prompt_lost(), lambda req: done(req, "a")]
    run, _, controls = segment(
        backend,
        controls=JobControls(resubmits=1),
        policy=policy(on_ambiguous_submit="resubmit"),
    )
    await run.run()
    assert controls.resubmits == 2
    assert backend.follows[1].graph is not None


@pytest.mark.parametrize("resubmit", [True, False])
async def test_a_second_loss_asks_a_person_when_the_policy_says_pause(
    backend: Backend, resubmit: bool
) -> None:
    backend.follow_outcomes = [connection_lost(at_step(7)), prompt_lost(), lambda r: done(r, "a")]
    controls = JobControls(resubmits=1, resume=ResumeRequest())
    run, book, _ = segment(backend, controls=controls, policy=policy(on_ambiguous_submit="pause"))
    seen: list[Any] = []

    def answer() -> None:
        seen.append((book.status.state, book.status.decision))
        controls.resume = ResumeRequest(resubmit=resubmit)

    backend.conditions = [made_true_by(answer)]
    backend.now += timedelta(seconds=1)
    await run.run()
    [(state, decision)] = seen
    assert state == JobState.NEEDS_DECISION
    assert decision.reason == (
        f"the backend lost prompt {PROMPT} again after 2 submission(s): it is neither queued, "
        "running nor in its history (a ComfyUI restart forgets both)"
    )
    assert decision.options == {
        "resume --resubmit": (
            "submit it once more: it runs again from the start (20 steps), paid for again; "
            "outputs already stored are kept"
        ),
        "cancel": "end the job as CANCELLED; outputs already stored are kept",
    }
    assert not decision.reattach_possible
    assert decision.since == T0 + timedelta(seconds=2.5)  # after a 1.5 s backoff
    last = backend.follows[-1]
    if resubmit:
        assert controls.resubmits == 2
        assert last.graph is not None and sent(last).submitted_at is None
    else:  # re-attach to what the backend may still have
        assert controls.resubmits == 1
        assert last.graph is None and sent(last).step == 7


async def test_an_ambiguous_submission_fails_when_the_policy_says_fail(backend: Backend) -> None:
    backend.follow_outcomes = [ambiguous()]
    run, _, controls = segment(backend, policy=policy(on_ambiguous_submit="fail"))
    with pytest.raises(ApplicationError) as raised:
        await run.run()
    assert raised.value.message == (
        "the submission's answer was lost (on_ambiguous_submit is 'fail')"
    )
    assert raised.value.type == ErrorType.SUBMISSION_AMBIGUOUS and raised.value.non_retryable
    assert controls.resubmits == 0


async def test_an_ambiguous_submission_is_sent_again_when_the_policy_says_so(
    backend: Backend,
) -> None:
    backend.follow_outcomes = [
        connection_lost(),
        ambiguous(),
        connection_lost(),
        lambda req: done(req, "a"),
    ]
    run, book, controls = segment(
        backend,
        controls=JobControls(resubmits=1),  # a prompt lost earlier in the job
        policy=policy(on_ambiguous_submit="resubmit"),
    )
    await run.run()
    assert controls.resubmits == 2
    assert backend.counters == {RECONNECTS: 2, RESUBMISSIONS: 1}
    # Submitted again under the same prompt id, from its first step; the backoff starts over.
    assert [sent(req).prompt_id for req in backend.follows] == [PROMPT] * 4
    assert all(req.graph is not None for req in backend.follows)
    assert [summary for _, summary in backend.sleeps] == ["reconnect 1", "reconnect 1"]
    assert book.status.decision is None


async def test_an_ambiguous_submission_waits_for_a_resume_with_resubmit(
    backend: Backend,
) -> None:
    backend.follow_outcomes = [connection_lost(at_step(4)), ambiguous(), lambda r: done(r, "a")]
    run, book, controls = segment(backend, policy=policy(on_ambiguous_submit="pause"))
    controls.resume = ResumeRequest(resubmit=True)  # an answer to an earlier question
    answers = [ResumeRequest(resubmit=False), ResumeRequest(resubmit=True)]
    seen: list[Any] = []

    def answer() -> None:
        seen.append((book.status.state, book.status.decision, len(book.status.notices)))
        controls.resume = answers.pop(0)

    backend.conditions = [made_true_by(answer), made_true_by(answer)]
    await run.run()
    assert answers == [] and controls.resubmits == 1
    (state, decision, notices), again = seen
    assert state == JobState.NEEDS_DECISION and notices == 0
    assert again[2] == 1
    assert [n.message for n in book.status.notices] == [
        "resume: nothing to re-attach to; resume with resubmit=true"
    ]
    assert decision.reason == (
        f"the backend may or may not have prompt {PROMPT}: the submission's answer was lost; "
        "this pool cannot tell (no claims), and submitting again may run it twice"
    )
    assert decision.options == {
        "resume --resubmit": (
            "submit it again: if the first submission did arrive, it runs and is paid for "
            "twice; outputs already stored are kept"
        ),
        "cancel": (
            "end the job as CANCELLED; a first submission that did arrive is not stopped "
            "(its job ID on the backend is unknown)"
        ),
    }
    assert not decision.reattach_possible
    assert decision.since == T0 + timedelta(seconds=1.5)
    last = backend.follows[-1]
    assert last.graph is not None and sent(last).step == 0 and sent(last).total_steps == 20


async def test_the_decision_counts_nodes_when_there_are_no_steps(backend: Backend) -> None:
    run, book, _ = segment(backend)
    book.begin_segment(0, 1, 0, 4)
    checkpoint = Checkpoint(job_id="j1", prompt_id=PROMPT)
    options = run._lost_prompt_decision(checkpoint).options
    assert "(4 nodes)" in options["resume --resubmit"]
