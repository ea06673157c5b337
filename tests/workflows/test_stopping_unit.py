"""workflows/stopping.py without a server: `PromptStop` against a scripted `calls.stop`.

The workflow's clock, timers, random draws and metrics are replaced by fakes, so each test
states exactly when the checks ran, how long the job waited between them, and what the job's
`status.teardown` said at every wait and at the end, word for word: it is what a client sees.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError

from tests.support.workflow_fakes import FakeWorkflow, install_fake_workflow
from workflows import activity_calls
from workflows.activity_io import StopCheck, StopInput
from workflows.contracts import (
    Checkpoint,
    JobCost,
    JobError,
    JobPolicy,
    JobState,
    JobStatus,
    OutputSpec,
    ReconnectPolicy,
    StopAction,
    Teardown,
    TeardownStep,
)
from workflows.job_book import JobBook, StopOrder
from workflows.shared import ErrorType
from workflows.stopping import ConfirmedStop, PromptStop, stop_reason

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
# The backend answers a little after the workflow asked: steps it reports carry its time.
CHECK_LAG = timedelta(seconds=0.25)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


class Runaway(BaseException):
    """A mutant that never stops checking: fail the test instead of hanging it."""


Answer = dict[str, Any] | Exception


@dataclass
class World(FakeWorkflow):
    """The fakes: the workflow runtime (clock, timers, draws, metrics); the job book; the
    backend's answers."""

    answers: list[Answer] = field(default_factory=list)
    check_takes_s: float = 0.0
    now: datetime = T0
    draw: float = 0.0
    requests: list[StopInput] = field(default_factory=list)
    # The job's teardown record as it stood at each timer.
    records_at_sleep: list[Teardown] = field(default_factory=list)
    status: JobStatus = field(default_factory=lambda: JobStatus(job_id="job-1"))
    published: Teardown | None = None
    was_submitted: bool = True
    # JobBook.finished_prompt: the prompt whose successful end the follow saw.
    finished_prompt: str | None = None
    states: list[JobState] = field(default_factory=list)
    costs: list[JobCost] = field(default_factory=list)

    # calls.stop
    async def stop(self, req: StopInput) -> StopCheck:
        self.requests.append(req)
        if len(self.requests) > 60:
            raise Runaway
        answer = self.answers[min(len(self.requests), len(self.answers)) - 1]
        self.now += timedelta(seconds=self.check_takes_s)
        if isinstance(answer, Exception):
            raise answer
        return StopCheck(at=self.now + CHECK_LAG, **answer)

    async def sleep(self, duration: timedelta, *, summary: str | None = None) -> None:
        assert self.published == self.status.teardown, "the job waits with its record published"
        self.records_at_sleep.append(self.record.model_copy(deep=True))
        await super().sleep(duration, summary=summary)

    # workflow.set_current_details: the book published the status as it is now
    def set_current_details(self, details: str) -> None:
        super().set_current_details(details)
        self.published = self.status.teardown.model_copy(deep=True)

    @property
    def book(self) -> JobBook:
        return WorldBook(self)

    @property
    def record(self) -> Teardown:
        return self.status.teardown


class WorldBook(JobBook):
    """The real book (every teardown write goes through it), on the world's status; what the
    stop asks of the rest of the job is recorded instead."""

    def __init__(self, world: World) -> None:
        super().__init__(world.status)
        self.world = world
        self.finished_prompt = world.finished_prompt

    def set_state(self, state: JobState) -> None:
        self.world.states.append(state)

    def submitted(self) -> bool:
        return self.world.was_submitted

    def add_cost(self, cost: JobCost) -> None:
        self.world.costs.append(cost)
        super().add_cost(cost)


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> World:
    w = install_fake_workflow(monkeypatch, World())
    monkeypatch.setattr(activity_calls, "stop", w.stop)
    return w


def order(state: JobState, error_type: str | None = None) -> StopOrder:
    """How the job ends: `state`, for an error of `error_type` (None: none)."""
    error = JobError(type=error_type, message="it broke") if error_type is not None else None
    return StopOrder(state, error)


def policy(horizon_s: float = 900, base_s: float = 2, max_s: float = 30) -> JobPolicy:
    return JobPolicy(
        teardown_horizon_s=horizon_s,
        reconnect=ReconnectPolicy(base_delay_s=base_s, max_delay_s=max_s, horizon_s=600),
    )


async def confirm(
    world: World,
    stop: PromptStop,
    reason: str = "after cancel",
    *,
    submitted: bool = True,
    settled: bool = False,
    free_memory: bool = False,
) -> Teardown:
    await stop.confirm(
        "gpu", "p1", reason, submitted=submitted, settled=settled, free_memory=free_memory
    )
    assert world.published == world.record, "the job ends the stop with its record published"
    return world.record


RUNNING = {"position": "running", "action": "interrupt_sent"}
INTERRUPTED = {"position": "gone", "ended": "interrupted", "node": "3", "node_type": "KSampler"}
NO_RECORD = {"position": "gone", "ended": "unknown"}
DOWN = ApplicationError("connection refused")


def step(
    seconds: float, action: StopAction, node: str | None = None, detail: str = ""
) -> TeardownStep:
    return TeardownStep(at=at(seconds), action=action, node=node, detail=detail)


def test_the_stop_reason_names_what_the_teardown_follows() -> None:
    assert [stop_reason(s) for s in JobState] == [
        "after queued",
        "after preparing",
        "after pending",
        "after submitting",
        "after waiting",
        "after running",
        "after reconnecting",
        "after uploading",
        "after stopping",
        "after needs_decision",
        "after completion",
        "after failure",
        "after cancel",
        "after abandonment",
        "after expiry",
        "after terminated",
        "after timed_out",
    ]
    assert stop_reason(JobState.FAILED, timed_out=True) == "after the execution deadline"
    assert stop_reason(JobState.FAILED, False) == "after failure"


def test_the_summary_words_every_step_in_order(world: World) -> None:
    stop = PromptStop(world.book, policy())
    assert stop.summary() == "nothing to stop yet"
    actions: list[StopAction] = [
        "never_queued",
        "dequeued",
        "interrupt_sent",
        "interrupted",
        "finished",
        "failed",
        "gone",
        "freed_memory",
        "still_running",
        "check_failed",
        "interrupted",
    ]
    world.record.steps = [step(0, a, detail="node 3 (KSampler)") for a in actions[:-1]]
    world.record.steps.append(step(0, "interrupted"))
    assert stop.summary() == (
        "never queued, dequeued before it started, interrupt sent, "
        "interrupted at node 3 (KSampler), had already finished, had failed, "
        "gone from the backend (no record of how it ended), memory freed, still running, "
        "backend unreachable, interrupted"
    )
    assert stop.record is world.status.teardown


async def test_a_running_prompt_is_interrupted_then_confirmed_gone(world: World) -> None:
    world.answers = [RUNNING, RUNNING, INTERRUPTED]
    world.draw = 0.5
    record = await confirm(world, PromptStop(world.book, policy(base_s=2)))

    asked = StopInput(job_id="job-1", pool="gpu", prompt_id="p1", reason="after cancel")
    assert world.requests == [asked, asked, asked]
    assert world.sleeps == [(1.5, "stop check 2"), (3.0, "stop check 3")]
    waiting = [(s.state, s.detail, s.checks) for s in world.records_at_sleep]
    assert waiting == [
        ("STOPPING", "after cancel: waiting for prompt p1 to leave pool 'gpu' "
         "(interrupt sent; check 1)", 1),
        ("STOPPING", "after cancel: waiting for prompt p1 to leave pool 'gpu' "
         "(interrupt sent; check 2)", 2),
    ]  # fmt: skip
    assert record == Teardown(
        state="CONFIRMED",
        at=at(4.5),
        detail="after cancel: interrupt sent, interrupted at node 3 (KSampler)",
        started_at=T0,
        checks=3,
        steps=[
            step(0.25, "interrupt_sent"),
            step(4.75, "interrupted", node="3", detail="node 3 (KSampler)"),
        ],
    )
    assert world.histograms == [
        (
            "durable_comfy_teardown_seconds",
            "From a stop's start to its end",
            "s",
            4.5,
            {"state": "CONFIRMED"},
        )
    ]


async def test_a_job_stopped_before_its_pool_was_named_learns_it_from_the_check(
    world: World,
) -> None:
    """A request checked by its follow, stopped before that follow said which pool took it:
    the job names no pool (None), the worker checks its default one and says which."""
    named = {"pool": "gpu-a", "kind": "runpod"}
    world.answers = [RUNNING | named, INTERRUPTED | named]
    stop = PromptStop(world.book, policy(base_s=2))
    await stop.confirm(None, "p1", "after cancel", submitted=True, settled=False)
    assert [r.pool for r in world.requests] == [None, "gpu-a"]
    assert world.status.backend is not None
    assert (world.status.backend.pool, world.status.backend.kind) == ("gpu-a", "runpod")
    assert "pool 'gpu-a'" in world.records_at_sleep[0].detail


async def test_the_waits_between_checks_double_up_to_fifteen_seconds(world: World) -> None:
    world.answers = [*[RUNNING] * 7, INTERRUPTED]
    record = await confirm(world, PromptStop(world.book, policy(base_s=1, max_s=60)))
    assert [seconds for seconds, _ in world.sleeps] == [0.5, 1, 2, 4, 7.5, 7.5, 7.5]
    assert (record.state, record.checks) == ("CONFIRMED", 8)


async def test_past_the_horizon_the_stop_fails_naming_prompt_pool_and_checks(
    world: World,
) -> None:
    world.answers = [RUNNING]
    # Delays of 10·2^n s, capped at 15 s (not the policy's 60), times a draw of 0.5..1.
    record = await confirm(
        world, PromptStop(world.book, policy(horizon_s=28, base_s=10, max_s=60)), "after failure"
    )

    assert world.sleeps == [
        (5.0, "stop check 2"),
        (7.5, "stop check 3"),
        (7.5, "stop check 4"),
        (7.5, "stop check 5"),
        (0.5, "stop check 6"),
    ]
    assert [r.final for r in world.requests] == [False] * 5 + [True]
    assert record == Teardown(
        state="FAILED",
        at=at(28),
        detail="after failure: prompt p1 was still running on pool 'gpu' after the teardown "
        "horizon (28 s, 6 checks); the pool takes no new work from this worker until it is "
        "gone. interrupt sent, still running",
        started_at=T0,
        checks=6,
        steps=[
            step(0.25, "interrupt_sent"),
            step(28, "still_running", detail="prompt p1 on pool gpu: running"),
        ],
    )
    assert [m[3:] for m in world.histograms] == [(28.0, {"state": "FAILED"})]


async def test_an_unreachable_backend_is_asked_again_until_the_horizon(world: World) -> None:
    world.answers = [{"position": "unreachable", "message": "socket closed"}, DOWN]
    record = await confirm(world, PromptStop(world.book, policy(horizon_s=10, base_s=4, max_s=4)))

    assert world.sleeps == [(2.0, f"stop check {n}") for n in range(2, 7)]
    assert record.state == "FAILED"
    assert record.detail == (
        "after cancel: prompt p1 was still unreachable on pool 'gpu' after the teardown "
        "horizon (10 s, 6 checks); the pool takes no new work from this worker until it is "
        "gone. backend unreachable, still running"
    )
    assert record.steps == [
        step(0.25, "check_failed", detail="socket closed"),
        step(10, "still_running", detail="prompt p1 on pool gpu: unreachable"),
    ]


async def test_a_failed_check_between_others_is_recorded_once_in_order(world: World) -> None:
    world.answers = [RUNNING, DOWN, DOWN, RUNNING, INTERRUPTED]
    record = await confirm(world, PromptStop(world.book, policy(base_s=1)))

    assert [(s.action, s.detail) for s in record.steps] == [
        ("interrupt_sent", ""),
        ("check_failed", "connection refused"),
        ("interrupt_sent", ""),
        ("interrupted", "node 3 (KSampler)"),
    ]
    assert record.steps[1].at == at(0.5), "a failed check is dated by the workflow"
    assert record.detail == (
        "after cancel: interrupt sent, backend unreachable, interrupt sent, "
        "interrupted at node 3 (KSampler)"
    )


async def test_a_check_that_outlasts_the_horizon_is_followed_by_the_last_one_at_once(
    world: World,
) -> None:
    world.answers = [RUNNING]
    world.check_takes_s = 10
    record = await confirm(world, PromptStop(world.book, policy(horizon_s=10)))

    assert world.sleeps == []
    assert [r.final for r in world.requests] == [False, True]
    assert (record.state, record.checks) == ("FAILED", 2)


async def test_a_prompt_not_yet_submitted_waits_for_the_settled_pass(world: World) -> None:
    world.answers = [NO_RECORD]
    stop = PromptStop(world.book, policy())
    early = await confirm(world, stop, submitted=False, settled=False)
    assert early == Teardown(
        state="STOPPING",
        detail="after cancel: prompt p1 not on the backend (yet)",
        started_at=T0,
        checks=1,
    )
    assert world.histograms == [] and world.sleeps == []
    assert world.requests[0].submitted is False

    world.now = at(60)
    settled = await confirm(world, stop, submitted=False, settled=True)
    assert settled == Teardown(
        state="CONFIRMED",
        at=at(60),
        detail="after cancel: never queued",
        started_at=T0,
        checks=2,
        steps=[step(60.25, "never_queued")],
    )
    assert [m[3:] for m in world.histograms] == [(60.0, {"state": "CONFIRMED"})]


async def test_the_horizon_counts_from_the_first_stop_across_stops(world: World) -> None:
    world.answers = [NO_RECORD, RUNNING]
    stop = PromptStop(world.book, policy(horizon_s=30))
    await confirm(world, stop, submitted=False)
    world.now = at(100)
    record = await confirm(world, stop, "after failure", settled=True)

    assert [r.final for r in world.requests] == [False, True]
    assert record.state == "FAILED" and record.started_at == T0
    assert "(30 s, 2 checks)" in record.detail


@pytest.mark.parametrize(
    ("submitted", "settled", "state"),
    [(True, False, "CONFIRMED"), (False, True, "CONFIRMED"), (False, False, "STOPPING")],
)
async def test_no_record_of_the_prompt_is_final_once_it_was_submitted_or_the_work_settled(
    world: World, submitted: bool, settled: bool, state: str
) -> None:
    world.answers = [NO_RECORD]
    record = await confirm(
        world, PromptStop(world.book, policy()), submitted=submitted, settled=settled
    )
    assert record.state == state
    assert [s.action for s in record.steps] == (
        ["gone"] if submitted else ["never_queued"] if settled else []
    )


async def test_a_submitted_prompt_with_no_record_is_gone(world: World) -> None:
    world.answers = [NO_RECORD]
    record = await confirm(world, PromptStop(world.book, policy()))
    assert record.detail == "after cancel: gone from the backend (no record of how it ended)"
    assert record.steps == [
        step(0.25, "gone", detail="no longer queued, no record of how it ended")
    ]


async def test_an_interrupted_prompt_that_was_never_acknowledged_is_gone(world: World) -> None:
    world.answers = [RUNNING, {"position": "gone"}]
    record = await confirm(world, PromptStop(world.book, policy()), submitted=False)
    assert record.state == "CONFIRMED"
    assert [s.action for s in record.steps] == ["interrupt_sent", "gone"]


async def test_a_dequeued_prompt_is_confirmed_by_the_dequeue_alone(world: World) -> None:
    world.answers = [{"position": "gone", "action": "dequeued"}]
    stop = PromptStop(world.book, policy())
    record = await confirm(world, stop, submitted=False)
    assert record.state == "CONFIRMED"
    assert record.detail == "after cancel: dequeued before it started"
    assert record.steps == [step(0.25, "dequeued")]

    world.answers = [{"position": "gone"}]
    record = await confirm(world, stop, submitted=False, settled=True)
    assert record.detail == "after cancel: dequeued before it started"
    assert len(record.steps) == 1


@pytest.mark.parametrize(
    ("answer", "steps", "detail"),
    [
        (
            {"position": "gone", "ended": "success"},
            [("finished", None, "")],
            "after completion: had already finished",
        ),
        (
            {"position": "gone", "ended": "error", "node": "7", "node_type": "VAEDecode",
             "message": "CUDA error"},
            [("failed", "7", "node 7 (VAEDecode): CUDA error")],
            "after completion: had failed",
        ),
        (
            {"position": "gone", "ended": "interrupted"},
            [("interrupted", None, "")],
            "after completion: interrupted",
        ),
    ],
)  # fmt: skip
async def test_how_the_prompt_ended_on_its_own_is_recorded(
    world: World, answer: Answer, steps: list[tuple[str, str | None, str]], detail: str
) -> None:
    world.answers = [answer]
    record = await confirm(world, PromptStop(world.book, policy()), "after completion")
    assert [(s.action, s.node, s.detail) for s in record.steps] == steps
    assert record.detail == detail
    assert record.steps[0].at == at(0.25)


async def test_memory_is_freed_once_with_the_first_check_that_manages_it(world: World) -> None:
    world.answers = [
        {"position": "running", "action": "interrupt_sent"},
        {"position": "running", "freed_memory": True},
        {"position": "running", "freed_memory": False},
        INTERRUPTED,
    ]
    record = await confirm(world, PromptStop(world.book, policy()), free_memory=True)
    assert [r.free_memory for r in world.requests] == [True, True, False, False]
    assert [s.action for s in record.steps] == ["interrupt_sent", "freed_memory", "interrupted"]
    assert record.steps[1].at == at(1.25)
    assert record.detail == (
        "after cancel: interrupt sent, memory freed, interrupted at node 3 (KSampler)"
    )


async def test_memory_is_not_freed_unless_asked(world: World) -> None:
    world.answers = [INTERRUPTED]
    await confirm(world, PromptStop(world.book, policy()))
    assert [r.free_memory for r in world.requests] == [False]


async def test_a_stop_checks_at_once_then_confirms_after_the_work_settled(world: World) -> None:
    world.answers = [NO_RECORD]
    world.was_submitted = False
    stop = ConfirmedStop(world.book, policy())
    stop.begin(order(JobState.CANCELLED, ErrorType.CANCELLED), "gpu", "p1")
    assert world.states == [JobState.STOPPING]
    await asyncio.sleep(0)
    assert len(world.requests) == 1, "the early pass checks before the work has settled"
    assert world.record.detail == "after cancel: prompt p1 not on the backend (yet)"

    await stop.settle(order(JobState.CANCELLED), "gpu", "p1")
    assert world.states == [JobState.STOPPING, JobState.STOPPING]
    assert [(r.reason, r.submitted, r.free_memory) for r in world.requests] == [
        ("after cancel", False, False),
        ("after cancel", False, False),
    ]
    assert world.record.state == "CONFIRMED"
    assert world.record.detail == "after cancel: never queued"


async def test_the_settled_pass_waits_for_the_early_one(world: World) -> None:
    world.answers = [RUNNING, RUNNING, INTERRUPTED]
    stop = ConfirmedStop(world.book, policy())
    stop.begin(order(JobState.CANCELLED, ErrorType.CANCELLED), "gpu", "p1")
    await stop.settle(order(JobState.CANCELLED), "gpu", "p1")
    assert len(world.requests) == 4, "three early checks to the interrupt, then one settled"
    assert world.sleeps == [(1.0, "stop check 2"), (2.0, "stop check 3")]
    assert world.record.detail == "after cancel: interrupt sent, interrupted at node 3 (KSampler)"


@pytest.mark.parametrize(
    ("error_type", "reason", "free_memory"),
    [
        (ErrorType.TIMEOUT, "after the execution deadline", False),
        (ErrorType.OUT_OF_MEMORY, "after failure", True),
        (ErrorType.EXECUTION_ERROR, "after failure", False),
    ],
)
async def test_a_failed_job_stops_for_its_error(
    world: World, error_type: str, reason: str, free_memory: bool
) -> None:
    world.answers = [INTERRUPTED]
    stop = ConfirmedStop(world.book, policy())
    stop.begin(order(JobState.FAILED, error_type), "gpu", "p1")
    error = JobError(type=error_type, message="it broke")
    await stop.settle(StopOrder(JobState.FAILED, error), "gpu", "p1")
    assert [(r.reason, r.submitted, r.free_memory) for r in world.requests] == [
        (reason, True, False),
        (reason, True, free_memory),
    ]


@pytest.mark.parametrize("pool", ["gpu", None])
async def test_without_a_prompt_only_the_settled_pass_checks(
    world: World, pool: str | None
) -> None:
    world.answers = [NO_RECORD]
    stop = ConfirmedStop(world.book, policy())
    stop.begin(order(JobState.CANCELLED, ErrorType.CANCELLED), pool, None)
    await asyncio.sleep(0)
    assert world.requests == [] and world.states == [JobState.STOPPING]
    await stop.settle(order(JobState.CANCELLED), "gpu", "p2")
    assert [(r.pool, r.prompt_id) for r in world.requests] == [("gpu", "p2")]


async def test_a_prompt_on_a_pool_not_named_yet_is_checked_at_once_on_the_default(
    world: World,
) -> None:
    """A request checked by its follow, cancelled before that follow named the pool: the
    early pass asks the worker's default pool (None), as the follow itself did."""
    world.answers = [NO_RECORD]
    ConfirmedStop(world.book, policy()).begin(order(JobState.CANCELLED), None, "p1")
    await asyncio.sleep(0)
    assert [(r.pool, r.prompt_id) for r in world.requests] == [(None, "p1")]


async def test_a_completed_job_confirms_without_entering_stopping(world: World) -> None:
    world.answers = [{"position": "gone", "ended": "success"}]
    await ConfirmedStop(world.book, policy()).settle(order(JobState.COMPLETED), "gpu", "p1")
    assert world.states == []
    assert [(r.reason, r.free_memory) for r in world.requests] == [("after completion", False)]
    assert world.record.detail == "after completion: had already finished"


@pytest.mark.parametrize(
    ("finished_prompt", "state", "checks"),
    [
        ("p1", JobState.COMPLETED, 0),  # its end was seen: nothing to ask
        ("p0", JobState.COMPLETED, 1),  # another prompt's end says nothing of this one
        (None, JobState.COMPLETED, 1),
        ("p1", JobState.FAILED, 1),  # a failure after the follow still checks
    ],
)
async def test_a_prompt_whose_end_the_follow_saw_needs_no_check_on_completion(
    world: World, finished_prompt: str | None, state: JobState, checks: int
) -> None:
    world.finished_prompt = finished_prompt
    world.answers = [{"position": "gone", "ended": "success"}]
    await ConfirmedStop(world.book, policy()).settle(order(state), "gpu", "p1")
    assert len(world.requests) == checks
    assert world.record.state == "CONFIRMED"
    assert [s.action for s in world.record.steps] == ["finished"]
    if checks == 0:
        assert world.record.detail == "after completion: had already finished"
        assert world.record.started_at == world.record.at == T0


@pytest.mark.parametrize(
    ("checkpoint", "provider_job_id"),
    [
        (None, None),
        (Checkpoint(job_id="job-1", prompt_id="p1", provider_job_id="rp-9"), "rp-9"),
        (Checkpoint(job_id="job-1", prompt_id="p0", provider_job_id="rp-8"), None),
    ],
)
async def test_each_check_names_the_backends_own_job_id_when_it_is_this_prompts(
    world: World, checkpoint: Checkpoint | None, provider_job_id: str | None
) -> None:
    world.status.checkpoint = checkpoint
    world.answers = [RUNNING, INTERRUPTED]
    await confirm(world, PromptStop(world.book, policy()))
    assert [r.provider_job_id for r in world.requests] == [provider_job_id] * 2


async def test_each_check_carries_the_jobs_output_spec(world: World) -> None:
    output = OutputSpec(bucket="b", prefix="tenant-1")
    world.answers = [RUNNING, INTERRUPTED]
    await confirm(world, PromptStop(world.book, policy(), output))
    stop = ConfirmedStop(world.book, policy(), output)
    await stop.settle(order(JobState.CANCELLED), "gpu", "p1")
    await confirm(world, PromptStop(world.book, policy()))
    assert [r.output for r in world.requests] == [output] * 3 + [OutputSpec()]


async def test_what_the_provider_job_cost_goes_into_the_book(world: World) -> None:
    cost = JobCost(provider_job_id="rp-9", execution_s=12.5)
    world.answers = [
        {"position": "unreachable", "message": "socket closed", "cost": cost},
        {**INTERRUPTED, "cost": cost},
    ]
    await confirm(world, PromptStop(world.book, policy()))
    assert world.costs == [cost, cost]


# -- what a backend may end a stop with -----------------------------------------------------------


async def test_a_backend_that_gave_up_on_the_prompt_fails_the_teardown_at_once(
    world: World,
) -> None:
    """Our RunPod handler replaced its worker at its stop horizon: no further check could
    change anything, so the stop fails now (not at the teardown horizon), naming the worker."""
    message = "prompt p1 was still running on RunPod worker w-7 after the handler's stop horizon"
    world.answers = [
        RUNNING,
        {"position": "stuck", "worker_id": "w-7", "worker_replaced": True, "node": "4",
         "message": message},
    ]  # fmt: skip
    record = await confirm(world, PromptStop(world.book, policy(horizon_s=900)))
    assert len(world.requests) == 2 and len(world.sleeps) == 1
    assert record.state == "FAILED"
    assert [(s.action, s.node, s.detail) for s in record.steps] == [
        ("interrupt_sent", None, ""),
        ("still_running", "4", message),
        ("worker_replaced", None, "w-7"),
    ]
    assert record.detail == (
        f"after cancel: {message}. interrupt sent, still running, worker replaced"
    )
    assert world.histograms[-1][-1] == {"state": "FAILED"}


async def test_a_backend_that_cannot_tell_whether_the_prompt_stopped_is_unconfirmed(
    world: World,
) -> None:
    """A stock worker-comfyui endpoint: the provider's job was cancelled, and that is all."""
    message = "RunPod job rp-1 was cancelled; a stock worker-comfyui handler cannot stop it"
    world.answers = [
        {"position": "gone", "action": "cancel_sent", "ended": "unknown", "confirmed": False,
         "message": message},
    ]  # fmt: skip
    record = await confirm(world, PromptStop(world.book, policy()))
    assert record.state == "UNCONFIRMED"
    assert [(s.action, s.detail) for s in record.steps] == [("cancel_sent", message)]
    assert record.detail == (
        f"after cancel: {message}. provider job cancelled (the worker cannot be told to stop "
        "the prompt)"
    )
    assert "interrupt" not in " ".join(s.action for s in record.steps)


async def test_a_prompt_the_backend_refused_was_never_queued(world: World) -> None:
    world.answers = [{"position": "gone", "ended": "never_queued", "message": "rejected"}]
    record = await confirm(world, PromptStop(world.book, policy()), "after failure")
    assert record.state == "CONFIRMED"
    assert [(s.action, s.detail) for s in record.steps] == [("never_queued", "rejected")]
    assert record.detail == "after failure: never queued"
