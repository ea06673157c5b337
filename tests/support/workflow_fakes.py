"""Stand-ins for workflow tests: activities on the time-skipping server, and the workflow runtime
for unit tests of workflow code that run without one.

Each fake activity records what the workflow asked of it and follows a script: fail some attempts
with a given error, or block (heartbeating) until the workflow cancels it.

`FakeWorkflow` (installed with `install_fake_workflow`) stands in for the `temporalio.workflow`
functions workflow code calls: a clock that moves only when told to or when the code sleeps,
and records of the search-attribute upserts, current details, timers, condition waits, metrics
and activity calls. A test that needs more of one of them subclasses it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar, overload
from uuid import UUID

import pytest
from temporalio import activity, workflow
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.common import TypedSearchAttributes
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.budgets import BudgetActivities
from activities.pool_queue import PoolQueueActivities
from activities.slot_watch import SlotWatch
from configuration.tenants import TenantConfig
from workflows import job_book
from workflows.activity_io import (
    FollowHeartbeat,
    FollowInput,
    FollowResult,
    OffloadInput,
    OffloadResult,
    PreparedJob,
    PrepareInput,
    StopCheck,
    StopInput,
)
from workflows.admission import Admission, PoolBound, SlotRelease, SlotRequest
from workflows.budget_ledger import TenantLedger
from workflows.budgets import BudgetHold, Spent
from workflows.contracts import (
    Artifact,
    Checkpoint,
    JobCost,
    JobPolicy,
    JobRequest,
    JobStatus,
    ProgressReport,
)
from workflows.failures import as_refused_before_submission
from workflows.inference_job import InferenceJob
from workflows.job_input import JobInput
from workflows.pool_queue import PoolQueue
from workflows.shared import (
    ACTIVITY_CLOSED_JOBS,
    ACTIVITY_OPEN_POOL_QUEUE,
    ACTIVITY_RECORD_SPEND,
    QUERY_STATUS,
    SA_JOB_POOL,
    SA_JOB_PROGRESS,
    SA_JOB_STATE,
    SA_TENANT,
    SIGNAL_PROGRESS,
    WORKFLOW_TYPE,
    ErrorType,
)

GRAPH: dict[str, Any] = {
    "1": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
    "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "t"}},
}
SHA = "a" * 64
BLOCK_CAP_S = 60.0
HEARTBEAT_TIMEOUT = "heartbeat-timeout"


async def start_time_skipping() -> WorkflowEnvironment:
    server = Path(sys.executable).parent / "temporal-test-server"
    env = await WorkflowEnvironment.start_time_skipping(
        data_converter=pydantic_data_converter, test_server_existing_path=str(server)
    )
    await env.client.operator_service.add_search_attributes(
        AddSearchAttributesRequest(
            namespace=env.client.namespace,
            search_attributes={
                SA_JOB_STATE: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
                SA_JOB_PROGRESS: IndexedValueType.INDEXED_VALUE_TYPE_INT,
                SA_JOB_POOL: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
                SA_TENANT: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
            },
        )
    )
    return env


def artifact(job_id: str, segment: int, node: str = "2") -> Artifact:
    key = f"jobs/{job_id}/{segment}/{node}/t_00001_.png"
    return Artifact(
        key=key,
        uri=f"s3://bucket/{key}",
        size=10,
        sha256=SHA,
        content_type="image/png",
        node_id=node,
        segment=segment,
    )


@dataclass
class Script:
    """What the fake backend does. Failures are consumed in order, one per attempt."""

    block_in: str | None = None  # an activity name that waits until cancelled
    # Error types to fail follow attempts with, or HEARTBEAT_TIMEOUT to go silent.
    follow_failures: list[str] = field(default_factory=list)
    fatal_in: dict[str, str] = field(default_factory=dict)  # activity name -> error type
    follow_step: int = 3  # the step the first failed follow attempt reports having reached
    advance: bool = True  # whether each later attempt reports one step more (progress)
    # Stop checks that still find the prompt running before it is gone (-1: never gone).
    stop_running_checks: int = 0
    # Stop checks (the first ones) that cannot reach the backend at all.
    stop_unreachable_checks: int = 0
    # The submitted prompt waits in the backend's queue (at this place) instead of running.
    queued_at: int | None = None
    # The pool is bounded (`max_running`): the check names its bound, and nothing is submitted
    # before the job holds a slot of its queue (workflows/pool_queue.py).
    max_running: int | None = None
    # The check asks the pool's queue itself, as the real one does (the dispatcher's `ask`
    # update, through PoolQueueActivities.ask), and hands the job its answer; and the follow
    # that saw the last prompt end gives the slot back itself, as the real one does.
    ask_in_check: bool = False
    # With `ask_in_check`: a check told a place waits in line itself (the real SlotWatch,
    # activities/slot_watch.py, watching the dispatcher), tells the job its place, and submits
    # once granted, as JobActivities.follow_prompt does when the workflow lets it wait.
    wait_in_line: bool = False
    # Tenants' settings with budgets: the check reads the tenant's ledger (the real
    # BudgetActivities, activities/budgets.py) and holds the job when its spend is at a limit.
    tenants: dict[str, TenantConfig] | None = None
    budget_day_s: float = 86400.0
    # Each successful follow's provider job ran this long (a RunPod job's execution seconds).
    cost_s: float | None = None


class FakeBackend:
    def __init__(self, script: Script | None = None) -> None:
        self.script = script or Script()
        self.calls: list[str] = []
        self.prepared: list[PrepareInput] = []
        # The follow requests that submitted a prompt the backend did not hold yet.
        self.submitted: list[FollowInput] = []
        self.followed: list[FollowInput] = []
        self.offloaded: list[OffloadInput] = []
        self.teardowns: list[StopInput] = []
        self.known: set[str] = set()  # prompt ids the fake backend holds
        self.step_after_reports: int | None = None
        self.finished: set[str] = set()  # prompt ids that ran to their end
        self.blocked = asyncio.Event()
        self.interrupted = asyncio.Event()
        # When set by a test: each follow, once submitted, waits (heartbeating) until it is set.
        self.follow_gate: asyncio.Event | None = None

    async def _enter(self, name: str) -> None:
        self.calls.append(name)
        if name in self.script.fatal_in:
            error_type = self.script.fatal_in[name]
            raise ApplicationError(f"{name} failed", type=error_type, non_retryable=True)
        if self.script.block_in == name:
            self.blocked.set()
            for _ in range(int(BLOCK_CAP_S / 0.1)):
                if name == "follow_prompt" and self.interrupted.is_set():
                    # What ComfyUI does to a running prompt it is told to interrupt.
                    raise ApplicationError(
                        "prompt interrupted", type=ErrorType.INTERRUPTED, non_retryable=True
                    )
                activity.heartbeat()
                await asyncio.sleep(0.1)
            raise ApplicationError("blocked too long", non_retryable=True)

    def bound(self, pool: str | None) -> PoolBound | None:
        if self.script.max_running is None:
            return None
        return PoolBound(pool=pool or "comfyui", max_running=self.script.max_running)

    async def ask_in_check(
        self, req: PrepareInput, bound: PoolBound | None, *, in_follow: bool = False
    ) -> dict[str, Any]:
        """`slot_asked` and `admission` of a check on a bounded pool (nothing unless asked)."""
        if bound is None or not self.script.ask_in_check or req.accepted_at is None:
            return {}
        real = PoolQueueActivities(activity.client(), _NoWorkLeft())  # type: ignore[arg-type]
        ask = self._slot_request(req, bound, in_follow=in_follow)
        # Bounded, as the real check is by its heartbeat timeout: an update the time-skipping
        # server never answers (seen once under CI load) fails this attempt, and the next asks
        # again (a repeat changes nothing), instead of hanging the test.
        answer = await asyncio.wait_for(real.ask(bound.pool, ask), timeout=5)
        return {"slot_asked": True, "admission": answer}

    @staticmethod
    def _slot_request(req: PrepareInput, bound: PoolBound, *, in_follow: bool) -> SlotRequest:
        assert req.accepted_at is not None
        return SlotRequest(
            job_id=req.job_id,
            tenant=req.tenant or "local",
            priority=req.priority,
            max_running=bound.max_running,
            accepted_at=req.accepted_at,
            in_follow=in_follow,
        )

    async def check_budget(self, req: PrepareInput) -> tuple[str | None, BudgetHold | None]:
        """As JobActivities._prepare: the tenant's ledger read, and the job held or not."""
        if self.script.tenants is None:
            return None, None
        budgets = BudgetActivities(activity.client(), self.script.tenants, self.script.budget_day_s)
        return await budgets.check(req.tenant or "local", req.job_id, req.pool or "comfyui")

    async def wait_in_line(self, req: FollowInput, bound: PoolBound, answer: Any) -> bool:
        """As JobActivities._wait_in_line: the real watch, the job told its place."""
        assert req.prepare is not None
        real = PoolQueueActivities(activity.client(), _NoWorkLeft())  # type: ignore[arg-type]
        watch = SlotWatch(activity.client(), real.request_on, capacity=10)

        async def tell(place: Admission) -> None:
            report = ProgressReport(attempt_client_id=req.client_id, slot=bound, admission=place)
            await activity.client().get_workflow_handle(req.job_id).signal(SIGNAL_PROGRESS, report)

        return await watch.wait(
            activity.info().task_queue,
            bound.pool,
            self._slot_request(req.prepare, bound, in_follow=True),
            answer,
            wait_s=req.slot_wait_s,
            tell=tell,
            heartbeat=activity.heartbeat,
            heartbeat_every_s=0.2,
        )

    @activity.defn(name="prepare_prompt")
    async def prepare(self, req: PrepareInput) -> PreparedJob:
        self.prepared.append(req)
        await self._enter("prepare_prompt")
        budget, held = await self.check_budget(req)
        bound = self.bound(req.pool) if held is None else None
        return PreparedJob(
            pool=req.pool or "comfyui",
            kind="comfyui",
            graph=req.graph,
            sampler_steps={"1": 10},
            nodes_total=len(req.graph),
            output_nodes=["2"],
            bound=bound,
            budget=budget,
            held=held,
            **(await self.ask_in_check(req, bound) if held is None else {}),
        )

    @activity.defn(name="follow_prompt")
    async def follow(self, req: FollowInput) -> FollowResult:
        self.followed.append(req)
        held: dict[str, Any] = {}
        budget: str | None = None
        if req.prepare is not None:
            # A request that stages nothing is checked here, as JobActivities.follow_prompt does.
            self.prepared.append(req.prepare)
            try:
                await self._enter("prepare_prompt")
            except ApplicationError as refusal:
                if not refusal.non_retryable:
                    raise
                raise as_refused_before_submission(refusal) from refusal
            budget, hold = await self.check_budget(req.prepare)
            if hold is not None:
                return FollowResult(
                    prompt_id=req.prompt_id,
                    outcome="held",
                    checkpoint=req.checkpoint or Checkpoint(job_id=req.job_id),
                    pool=req.prepare.pool or "comfyui",
                    kind="comfyui",
                    budget=budget,
                    held=hold,
                )
            if budget is not None:
                # As JobActivities.follow_prompt: the job hears whose budget counts it first.
                report = ProgressReport(attempt_client_id=req.client_id, budget=budget)
                handle = activity.client().get_workflow_handle(req.job_id)
                await handle.signal(SIGNAL_PROGRESS, report)
            bound = self.bound(req.prepare.pool)
            if bound is not None and not req.slot_held:
                waits = self.script.wait_in_line and req.slot_wait_s > 0
                asked = await self.ask_in_check(req.prepare, bound, in_follow=waits)
                answer = asked.get("admission")
                if waits and asked and not (answer is not None and answer.granted):
                    if await self.wait_in_line(req, bound, answer):
                        answer = Admission(pool=bound.pool, job_id=req.job_id, granted=True)
                        asked["admission"] = answer
                if answer is not None and answer.granted:
                    # As JobActivities.follow_prompt does: granted in the check, it submits.
                    req = req.model_copy(update={"slot_held": True, "slot_bound": bound})
                    held = {"bound": bound, **asked}
                else:
                    return FollowResult(
                        prompt_id=req.prompt_id,
                        outcome="needs_slot",
                        checkpoint=req.checkpoint or Checkpoint(job_id=req.job_id),
                        pool=bound.pool,
                        kind="comfyui",
                        bound=bound,
                        **asked,
                    )
        if req.graph is not None:
            # The follow activity submits first (socket open), unless the backend knows it.
            await self._enter("submit")
            if req.prompt_id not in self.known:
                self.known.add(req.prompt_id)
                self.submitted.append(req)
            # As the real follower does: the workflow hears that the backend has the prompt.
            queued = self.script.queued_at
            checked = req.prepare is not None
            report = ProgressReport(
                slot=req.slot_bound,
                attempt_client_id=req.client_id,
                stage="running" if queued is None else "queued",
                queue_position=queued,
                # A follow that checked the request names the pool that took it.
                pool=(req.prepare.pool or "comfyui") if req.prepare is not None else None,
                kind="comfyui" if checked else None,
                checkpoint=Checkpoint(
                    job_id=req.job_id,
                    segment=req.segment,
                    prompt_id=req.prompt_id,
                    client_id=req.client_id,
                    submitted_at=datetime.now(UTC),
                ),
            )
            handle = activity.client().get_workflow_handle(req.job_id)
            await handle.signal(SIGNAL_PROGRESS, report)
        await self._enter("follow_prompt")
        while self.follow_gate is not None and not self.follow_gate.is_set():
            activity.heartbeat()
            await asyncio.sleep(0.1)
        if self.script.follow_failures:
            failure = self.script.follow_failures.pop(0)
            checkpoint = Checkpoint(
                job_id=req.job_id,
                segment=req.segment,
                prompt_id=req.prompt_id,
                client_id=req.client_id,
                step=self.script.follow_step + (len(self.followed) if self.script.advance else 0),
                submitted_at=datetime.now(UTC),
            )
            if failure == ErrorType.PROMPT_LOST:
                self.known.discard(req.prompt_id)
            reached = FollowHeartbeat(checkpoint=checkpoint).model_dump(mode="json")
            if failure == HEARTBEAT_TIMEOUT:
                # A worker that dies mid-follow: its last heartbeat is all that is left.
                activity.heartbeat(reached)
                await asyncio.sleep(BLOCK_CAP_S)
            raise ApplicationError(
                f"follow attempt failed: {failure}",
                reached,
                type=failure,
                non_retryable=failure in (ErrorType.PROMPT_LOST, ErrorType.OUT_OF_MEMORY),
            )
        # A report from another (stale) socket must not count; the current one must.
        handle = activity.client().get_workflow_handle(req.job_id)
        stale = ProgressReport(attempt_client_id="someone-else", step=99, total_steps=10)
        await handle.signal(SIGNAL_PROGRESS, stale)
        current = ProgressReport(attempt_client_id=req.client_id, step=1, total_steps=10)
        await handle.signal(SIGNAL_PROGRESS, current)
        status = await handle.query(QUERY_STATUS, result_type=JobStatus)
        self.step_after_reports = status.progress.step
        self.finished.add(req.prompt_id)
        released = False
        if self.script.ask_in_check and req.slot_held and req.segment == req.segments - 1:
            # As JobActivities.follow_prompt does: the last prompt ended, its slot goes back.
            real = PoolQueueActivities(activity.client(), _NoWorkLeft())  # type: ignore[arg-type]
            released = await real.release(req.pool or "comfyui", SlotRelease(job_id=req.job_id))
        return FollowResult(
            prompt_id=req.prompt_id,
            outcome="success",
            artifacts=[artifact(req.job_id, req.segment)],
            checkpoint=Checkpoint(job_id=req.job_id, prompt_id=req.prompt_id, step=10),
            pool=(req.prepare.pool or "comfyui") if req.prepare is not None else None,
            kind="comfyui" if req.prepare is not None else None,
            slot_released=released,
            budget=budget,
            cost=None
            if self.script.cost_s is None
            else JobCost(provider_job_id=f"rp-{req.prompt_id}", execution_s=self.script.cost_s),
            **held,
        )

    @activity.defn(name="offload_outputs")
    async def offload(self, req: OffloadInput) -> OffloadResult:
        self.offloaded.append(req)
        await self._enter("offload_outputs" + (":partial" if req.partial else ""))
        return OffloadResult(artifacts=list(req.stored))

    @activity.defn(name="stop_prompt")
    async def stop(self, req: StopInput) -> StopCheck:
        self.teardowns.append(req)
        self.interrupted.set()
        await self._enter("stop_prompt")
        now = datetime.now(UTC)
        if len(self.teardowns) <= self.script.stop_unreachable_checks:
            return StopCheck(at=now, position="unreachable", message="ComfyUnavailable: refused")
        checks = self.script.stop_running_checks
        if checks < 0 or len(self.teardowns) <= checks:
            return StopCheck(at=now, position="running", action="interrupt_sent")
        if req.prompt_id not in self.known:
            return StopCheck(at=now, position="gone", ended="unknown")
        if req.prompt_id in self.finished:
            return StopCheck(at=now, position="gone", ended="success")
        return StopCheck(at=now, position="gone", ended="interrupted", node="1", node_type="X")

    def activities(self) -> list[Any]:
        queues = queue_activities(self.script.tenants or {}, self.script.budget_day_s)
        return [self.prepare, self.follow, self.offload, self.stop, *queues]


class _NoWorkLeft:
    """The orphan sweep's answer for a pool the fakes serve: nothing of a closed job is left."""

    async def work_left(self, pool: str, job_ids: set[str]) -> set[str]:
        return set()


def queue_activities(
    tenants: dict[str, TenantConfig] | None = None, budget_day_s: float = 86400.0
) -> list[Any]:
    """The pool queue's own activities (activities/pool_queue.py) on the test's server, and the
    budget ledger's (activities/budgets.py) with `tenants`' settings."""
    queues = _Queues(tenants or {}, budget_day_s)
    return [queues.open_pool_queue, queues.closed_jobs, queues.record_spend]


class _Queues:
    def __init__(self, tenants: dict[str, TenantConfig], budget_day_s: float) -> None:
        self.tenants, self.budget_day_s = tenants, budget_day_s

    @activity.defn(name=ACTIVITY_OPEN_POOL_QUEUE)
    async def open_pool_queue(self, pool: str, request: SlotRequest) -> None:
        real = PoolQueueActivities(activity.client(), _NoWorkLeft())  # type: ignore[arg-type]
        await real.open_pool_queue(pool, request)

    @activity.defn(name=ACTIVITY_RECORD_SPEND)
    async def record_spend(self, tenant: str, spent: Spent) -> None:
        budgets = BudgetActivities(activity.client(), self.tenants, self.budget_day_s)
        await budgets.record_spend(tenant, spent)

    @activity.defn(name=ACTIVITY_CLOSED_JOBS)
    async def closed_jobs(self, pool: str, job_ids: list[str]) -> list[str]:
        real = PoolQueueActivities(activity.client(), _NoWorkLeft())  # type: ignore[arg-type]
        return await real.closed_jobs(pool, job_ids)


@asynccontextmanager
async def job_worker(client: Client, backend: FakeBackend) -> AsyncIterator[str]:
    task_queue = f"tq-{uuid.uuid4()}"
    async with Worker(
        client,
        task_queue=task_queue,
        workflows=[InferenceJob, PoolQueue, TenantLedger],
        activities=backend.activities(),
        graceful_shutdown_timeout=timedelta(seconds=1),
    ):
        yield task_queue


async def start_job(
    client: Client, task_queue: str, request: JobRequest
) -> WorkflowHandle[Any, JobStatus]:
    return await client.start_workflow(
        WORKFLOW_TYPE,
        JobInput(request=request),
        id=f"job-{uuid.uuid4()}",
        task_queue=task_queue,
        result_type=JobStatus,
    )


async def outcome(handle: WorkflowHandle[Any, JobStatus]) -> tuple[JobStatus, BaseException | None]:
    """How the job ended: its final status, and the failure its result raised (None if none)."""
    error: BaseException | None = None
    try:
        await handle.result()
    except WorkflowFailureError as exc:
        error = exc
    return await handle.query(QUERY_STATUS, result_type=JobStatus), error


def request(**policy: Any) -> JobRequest:
    """A detached job unless the test sets `abandon_after_s`; short heartbeats, because an
    activity hears of a cancel only on its next sent heartbeat (at most every 0.8 x timeout)."""
    defaults = {"abandon_after_s": None, "heartbeat_timeout_s": 1}
    return JobRequest(graph=GRAPH, policy=JobPolicy.model_validate(defaults | policy))


# -- the workflow runtime, for unit tests without a server ------------------------------------

T0 = datetime(2026, 1, 1, tzinfo=UTC)
FAKE_UUID = uuid.UUID("0f0f0f0f-0000-4000-8000-000000000001")

# One step of a `wait_condition` script: it gets the condition waited on and either returns
# (the condition holds now) or raises TimeoutError (the wait's timer fired).
Step = Callable[[Callable[[], bool]], None]


def holds(condition: Callable[[], bool]) -> None:
    """The condition already holds: the wait returns at once."""
    assert condition()


def fires(condition: Callable[[], bool]) -> None:
    """The condition still does not hold: the timer fires."""
    assert not condition()
    raise TimeoutError


def made_true_by(action: Callable[[], None]) -> Step:
    """The condition does not hold yet; `action` (a signal arriving, say) makes it hold."""

    def step(condition: Callable[[], bool]) -> None:
        assert not condition()
        action()
        assert condition()

    return step


@dataclass
class Counter:
    counters: dict[str, int]
    key: str

    def add(self, value: int, attributes: dict[str, str] | None = None) -> None:
        self.counters[self.key] = self.counters.get(self.key, 0) + value


@dataclass
class Histogram:
    histograms: list[tuple[str, str, str, float, dict[str, str]]]
    name: str
    description: str
    unit: str

    def record(self, value: float, attributes: dict[str, str]) -> None:
        self.histograms.append((self.name, self.description, self.unit, value, attributes))


@dataclass
class FakeWorkflow:
    """What workflow code asked of the runtime. Each method stands in for the
    `temporalio.workflow` function of the same name; `workflow.now()` is `now`, and
    `workflow.random()` is the fake itself (its `.random()` is `draw`)."""

    now: datetime = T0
    uuid: UUID = FAKE_UUID
    draw: float = 0.5
    # Played in order by `wait_condition`; a wait with no step left fails the test.
    conditions: list[Step] = field(default_factory=list)
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("fake_workflow"))
    # Recorded: {attribute name: value} per upsert; every details text; (seconds, summary) of
    # each timer; (timeout seconds or None, timeout summary) of each condition wait.
    upserts: list[dict[str, Any]] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    sleeps: list[tuple[float, str | None]] = field(default_factory=list)
    waits: list[tuple[float | None, str | None]] = field(default_factory=list)
    # "name: description" -> sum added; (name, description, unit, value, attributes) per record.
    counters: dict[str, int] = field(default_factory=dict)
    histograms: list[tuple[str, str, str, float, dict[str, str]]] = field(default_factory=list)
    # (activity, argument, options) of each `execute_activity`; each returns `activity_result`.
    activities: list[tuple[str, Any, dict[str, Any]]] = field(default_factory=list)
    activity_result: Any = None

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    def uuid4(self) -> UUID:
        return self.uuid

    def random(self) -> float:
        return self.draw

    def upsert_search_attributes(self, updates: list[Any]) -> None:
        self.upserts.append({u.key.name: u.value for u in updates})

    def set_current_details(self, details: str) -> None:
        self.details.append(details)

    async def sleep(self, duration: timedelta, *, summary: str | None = None) -> None:
        self.sleeps.append((duration.total_seconds(), summary))
        self.now += duration

    async def wait_condition(
        self,
        fn: Callable[[], bool],
        *,
        timeout: timedelta | None = None,  # noqa: ASYNC109 (workflow.wait_condition's own)
        timeout_summary: str | None = None,
    ) -> None:
        seconds = timeout.total_seconds() if timeout is not None else None
        self.waits.append((seconds, timeout_summary))
        assert self.conditions, f"an unexpected wait_condition ({seconds} s, {timeout_summary})"
        self.conditions.pop(0)(fn)

    def metric_meter(self) -> FakeWorkflow:
        return self

    def create_counter(self, name: str, description: str) -> Counter:
        return Counter(self.counters, f"{name}: {description}")

    def create_histogram_float(self, name: str, description: str, unit: str) -> Histogram:
        return Histogram(self.histograms, name, description, unit)

    async def execute_activity(self, activity: str, arg: Any, **options: Any) -> Any:
        self.activities.append((activity, arg, options))
        return self.activity_result

    def info(self) -> Any:
        """A run started with no search attributes (a client of our own sets the first state)."""
        return SimpleNamespace(
            typed_search_attributes=TypedSearchAttributes.empty,
            workflow_id="j",
            first_execution_run_id="run-1",
        )

    async def execute_local_activity(self, activity: str, arg: Any, **options: Any) -> Any:
        """Recorded as activities are, with `local=True` among its options."""
        return await self.execute_activity(activity, arg, local=True, **options)


F = TypeVar("F", bound=FakeWorkflow)


@overload
def install_fake_workflow(monkeypatch: pytest.MonkeyPatch) -> FakeWorkflow: ...
@overload
def install_fake_workflow(monkeypatch: pytest.MonkeyPatch, fake: F) -> F: ...
def install_fake_workflow(
    monkeypatch: pytest.MonkeyPatch, fake: FakeWorkflow | None = None
) -> FakeWorkflow:
    """Put `fake` (a plain `FakeWorkflow` if none) in place of the `temporalio.workflow`
    functions workflow code calls, for this test; returns it."""
    fake = fake if fake is not None else FakeWorkflow()
    monkeypatch.setattr(workflow, "now", lambda: fake.now)
    monkeypatch.setattr(workflow, "random", lambda: fake)
    monkeypatch.setattr(workflow, "logger", fake.logger)
    # No workflow event loop here: each search-attribute change is upserted at once (their
    # coalescing into one upsert per workflow task is tested with a loop, test_job_book_unit).
    monkeypatch.setattr(job_book, "at_task_end", lambda callback, _changes: callback())
    for name in (
        "uuid4",
        "upsert_search_attributes",
        "set_current_details",
        "sleep",
        "wait_condition",
        "metric_meter",
        "execute_activity",
        "execute_local_activity",
        "info",
    ):
        monkeypatch.setattr(workflow, name, getattr(fake, name))
    return fake


def after_activity(cause: BaseException | None) -> ActivityError:
    """`cause` as the workflow sees it: wrapped in the failure of the activity that raised it."""
    error = ActivityError(
        "activity failed",
        scheduled_event_id=5,
        started_event_id=6,
        identity="1@worker",
        activity_type="follow_prompt",
        activity_id="1",
        retry_state=None,
    )
    error.__cause__ = cause
    return error
