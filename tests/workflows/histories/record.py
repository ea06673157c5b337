"""Record the replay histories: `python -m tests.workflows.histories.record [scenario ...]`.

Runs InferenceJob on the time-skipping server with the stand-in activities
(tests/support/workflow_fakes.py) through every way a job ends, and a job that continued as
new, reconnected or waited for a decision, and writes each history (of the last run) as
`<scenario>.json` beside this file.
tests/workflows/test_replay_histories.py replays every one against today's code.

These are the 1.0 baseline. A change to the workflow's commands fails their replay: a job still
running when its workers are upgraded would fail the same way. Running jobs stay on the worker
version they started on (Worker Versioning, docs/upgrading.md), so the usual answer is to
re-record the histories here with the change; a `workflow.patched()` branch is for a change that
must reach jobs already running (docs/upgrading.md says when, and how it is retired).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle, WorkflowHistory
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from configuration.tenants import TenantConfig
from tests.support.workflow_fakes import (
    GRAPH,
    FakeBackend,
    Script,
    start_job,
    start_time_skipping,
)
from workflows.activity_io import WebhookAttempt, WebhookDeliveryInput
from workflows.admission import Holder, QueueState, SlotRelease
from workflows.batches import BatchInput
from workflows.budget_ledger import TenantLedger
from workflows.budgets import RESET_JITTER_MAX_S, BudgetLimits, LedgerState
from workflows.contracts import (
    CancelRequest,
    JobPolicy,
    JobRequest,
    JobState,
    JobStatus,
    ResumeRequest,
    WebhookSpec,
)
from workflows.inference_job import InferenceJob
from workflows.job_batch import JobBatch
from workflows.pool_queue import PoolQueue
from workflows.shared import (
    ACTIVITY_DELIVER_WEBHOOK,
    BATCH_LABEL,
    QUERY_STATUS,
    SIGNAL_CANCEL,
    SIGNAL_CANCEL_REASON,
    SIGNAL_CLIENT_SEEN,
    SIGNAL_LEDGER_LIMITS,
    SIGNAL_RESUME,
    SIGNAL_SLOT_RELEASE,
    TENANT_LABEL,
    UPDATE_ENDED,
    UPDATE_RESUME,
    ErrorType,
    ledger_id,
    pool_queue_id,
)

HERE = Path(__file__).parent
SEGMENTS = "segments"  # in a scenario's settings: the request's segments, not a policy field
# In a scenario's settings: a graph sent unchecked (as a client that skips the checks would).
UNCHECKED_GRAPH = "unchecked_graph"
# In a scenario's settings: the request's webhook.
WEBHOOK = "webhook"
# In a scenario's settings: the bounded pool's one slot is already held by another job.
POOL_FULL = "pool_full"
# In a scenario's settings: the job is one of a batch's (its `batch` label), which it tells its end.
BATCH = "batch"
# In a scenario's settings: the job's tenant (its `tenant` label), which has a daily budget of
# 30 GPU-seconds; with OVER_BUDGET its ledger says it spent 40 today already. Its ledger is
# terminated at the scenario's end while its worker still runs: a ledger left behind, its reset
# timer firing with no worker to run its task, keeps the time-skipping server from skipping.
TENANT = "tenant"
OVER_BUDGET = "over_budget"
BUDGETED = {
    "acme": TenantConfig(gpu_seconds_per_day=30),
    "beta": TenantConfig(gpu_seconds_per_day=30),
}
CYCLE = {
    "1": {"class_type": "A", "inputs": {"x": ["2", 0]}},
    "2": {"class_type": "B", "inputs": {"y": ["1", 0]}},
}
Scenario = tuple[
    Script, dict[str, Any], Callable[[WorkflowHandle[Any, JobStatus]], Awaitable[None]] | None
]


async def cancel_soon(handle: WorkflowHandle[Any, JobStatus]) -> None:
    await asyncio.sleep(0.5)
    await handle.signal(SIGNAL_CANCEL, CancelRequest(reason="recorded cancel"))


async def decide_after_malformed_messages(handle: WorkflowHandle[Any, JobStatus]) -> None:
    """What plain clients send (nothing, misspelt fields), then the resume update."""
    for _ in range(100):
        status = await handle.query(QUERY_STATUS, result_type=JobStatus)
        if status.state == JobState.NEEDS_DECISION:
            break
        await asyncio.sleep(0.05)
    await handle.signal(SIGNAL_CLIENT_SEEN)
    await handle.signal(SIGNAL_RESUME, {"resubmt": True})
    await handle.execute_update(UPDATE_RESUME, ResumeRequest(resubmit=True))


async def cancel_with_reason(handle: WorkflowHandle[Any, JobStatus]) -> None:
    await asyncio.sleep(0.5)
    await handle.signal(SIGNAL_CANCEL_REASON, CancelRequest(reason="recorded reason"))
    await handle.cancel()


class FakeReceiver:
    """`deliver_webhook` without a network: each event's first attempt answered 503, the next
    delivered (so the history holds a retry's timer)."""

    def __init__(self) -> None:
        self.attempts: Counter[str] = Counter()

    @activity.defn(name=ACTIVITY_DELIVER_WEBHOOK)
    async def deliver_webhook(self, req: WebhookDeliveryInput) -> WebhookAttempt:
        self.attempts[req.webhook_id] += 1
        now = activity.info().current_attempt_scheduled_time
        if self.attempts[req.webhook_id] == 1:
            return WebhookAttempt(outcome="retry", status_code=503, error="HTTP 503", at=now)
        return WebhookAttempt(outcome="delivered", status_code=204, at=now)


async def release_the_other_holder(handle: WorkflowHandle[Any, JobStatus]) -> None:
    """Once the job is PENDING (its follow waits in line), the job that held the pool's one
    slot gives it back: the follow sees its grant and submits."""
    for _ in range(200):
        status = await handle.query(QUERY_STATUS, result_type=JobStatus)
        if status.state == JobState.PENDING:
            break
        await asyncio.sleep(0.05)
    task_queue = (await handle.describe()).task_queue
    queue = handle._client.get_workflow_handle(pool_queue_id(task_queue, "comfyui"))
    await queue.signal(SIGNAL_SLOT_RELEASE, SlotRelease(job_id="another-job"))


async def wait_for_the_end(handle: WorkflowHandle[Any, JobStatus]) -> None:
    """JobClient.wait's update: answered once the job is terminal, deliveries or not."""
    await handle.execute_update(UPDATE_ENDED, result_type=JobStatus)


SCENARIOS: dict[str, Scenario] = {
    # The follow stores the outputs and saw the prompt end: no offload, no stop check.
    "completed": (Script(), {"abandon_after_s": None}, None),
    "cancelled": (
        Script(follow_failures=[ErrorType.CONNECTION_LOST] * 20),
        {"abandon_after_s": None, "reconnect": {"base_delay_s": 30, "max_delay_s": 30}},
        cancel_soon,
    ),
    "abandoned": (
        Script(follow_failures=[ErrorType.CONNECTION_LOST] * 20),
        {"abandon_after_s": 120, "reconnect": {"base_delay_s": 50, "max_delay_s": 50}},
        None,
    ),
    "reconnected": (
        Script(follow_failures=[ErrorType.CONNECTION_LOST] * 3),
        {"abandon_after_s": None},
        None,
    ),
    # A stop confirmed over several checks, and a prompt the backend lost.
    "stopped_slowly": (
        Script(block_in="follow_prompt", stop_running_checks=3),
        {"abandon_after_s": None},
        cancel_soon,
    ),
    "lost": (
        Script(follow_failures=[ErrorType.PROMPT_LOST]),
        {"abandon_after_s": None},
        None,
    ),
    # Messages from plain clients, the resume update, a reasoned Temporal cancel.
    "decided": (
        Script(follow_failures=[ErrorType.PROMPT_LOST] * 2),
        {"abandon_after_s": None},
        decide_after_malformed_messages,
    ),
    "canceled_with_reason": (
        Script(block_in="follow_prompt"),
        {"abandon_after_s": None},
        cancel_with_reason,
    ),
    "queue_timeout": (
        Script(block_in="follow_prompt", queued_at=2),
        {"abandon_after_s": None, "queue_timeout_s": 2},
        None,
    ),
    # A prompt that fails on the backend: stopped, outputs kept, FAILED typed.
    "failed": (
        Script(fatal_in={"follow_prompt": ErrorType.OUT_OF_MEMORY}),
        {"abandon_after_s": None},
        None,
    ),
    # An input that breaks a check fails the workflow typed, before any activity.
    "refused": (Script(), {"abandon_after_s": None, UNCHECKED_GRAPH: CYCLE}, None),
    # The last run of a job that continued as new twice, carry and all.
    "continued": (
        Script(),
        {"abandon_after_s": None, "history_budget_events": 10, SEGMENTS: [{}, {}, {}]},
        None,
    ),
    # (Before the bounded pools': their queues outlive their scenarios, and a queue's timer
    # firing with no worker keeps the time-skipping server from skipping to the reset.)
    # A job of a tenant with a daily budget: its check says so (a report before it submits),
    # and it tells the tenant's ledger its spend (`spent`) once it has ended.
    "budgeted": (
        Script(tenants=BUDGETED, cost_s=12.0),
        {"abandon_after_s": None, TENANT: "acme"},
        None,
    ),
    # Its tenant's budget spent for today: PENDING, held, on a timer until the reset, then
    # checked again; it runs, and tells the ledger its spend of the new day.
    "budget_held": (
        Script(tenants=BUDGETED, cost_s=12.0),
        {"abandon_after_s": None, TENANT: "beta", OVER_BUDGET: True},
        None,
    ),
    # A bounded pool (`max_running`): the follow that checks it finds it bounded, the job asks
    # its queue for a slot (by signal: the check could not), is granted at once, runs, and
    # gives the slot back.
    "queued": (Script(max_running=1), {"abandon_after_s": None}, None),
    # The same, the check having asked the queue (its `ask` update): granted there, the same
    # follow submits (one follow, as on an open pool).
    "queued_asked": (Script(max_running=1, ask_in_check=True), {"abandon_after_s": None}, None),
    # Its pool full, the check's follow told a place waits in line itself: PENDING from its
    # report, granted when the other holder gives the slot back, and the same follow submits.
    "queued_in_line": (
        Script(max_running=1, ask_in_check=True, wait_in_line=True),
        {"abandon_after_s": None, POOL_FULL: True},
        release_the_other_holder,
    ),
    # Its pool full: PENDING in our queue (its place from the check's ask) until start_by_s,
    # then EXPIRED with nothing sent.
    "expired": (
        Script(max_running=1, ask_in_check=True),
        {"abandon_after_s": None, "start_by_s": 30, POOL_FULL: True},
        None,
    ),
    # A job of a batch: it tells its batch its end (`job_ended`), once it is terminal.
    "batched": (Script(), {"abandon_after_s": None, BATCH: True}, None),
    # A job with a webhook: its outputs and its end delivered, each after one retry, while
    # the `ended` update answered at the job's end.
    "webhook": (
        Script(),
        {
            "abandon_after_s": None,
            WEBHOOK: WebhookSpec(
                url="https://hooks.example.com/jobs", events=["output_stored", "completed"]
            ),
        },
        wait_for_the_end,
    ),
}


async def fill_the_pool(client: Client, task_queue: str) -> None:
    """Start the pool's queue with its one slot held by another job (which never ends)."""
    now = datetime.now(UTC)
    holder = Holder(job_id="another-job", tenant="local", granted_at=now)
    state = QueueState(pool="comfyui", max_running=1, holders={holder.job_id: holder})
    await client.start_workflow(
        PoolQueue.run, state, id=pool_queue_id(task_queue, "comfyui"), task_queue=task_queue
    )


async def spend_the_budget(client: Client, task_queue: str, tenant: str) -> None:
    """Start the tenant's ledger with 40 of its 30 GPU-seconds spent today."""
    limits = BudgetLimits(tenant=tenant, gpu_seconds_per_day=30)
    state = LedgerState(limits=limits, gpu_s=40.0, jobs=2, counted=["earlier-1", "earlier-2"])
    await client.start_workflow(
        TenantLedger.run,
        state,
        id=ledger_id(tenant),
        task_queue=task_queue,
        start_signal=SIGNAL_LEDGER_LIMITS,
        start_signal_args=[limits],
    )


async def ended_history(handle: WorkflowHandle[Any, JobStatus]) -> WorkflowHistory:
    try:
        await handle.result()
    except WorkflowFailureError:
        pass
    return await handle.fetch_history()


async def until_held_then_reset(env: WorkflowEnvironment, handle: WorkflowHandle[Any, Any]) -> None:
    """A job its tenant's budget holds: once PENDING, the server's clock past the reset (and
    the job's jitter after it); any other job, nothing."""
    for _ in range(100):
        status = await handle.query(QUERY_STATUS, result_type=JobStatus)
        if status.terminal:
            return
        admission = status.admission
        if status.state == JobState.PENDING and admission and admission.resets_at:
            now = await env.get_current_time()
            await env.sleep(admission.resets_at - now + timedelta(seconds=RESET_JITTER_MAX_S + 5))
            return
        await asyncio.sleep(0.05)


async def start_batch(client: Client, task_queue: str) -> WorkflowHandle[Any, Any]:
    """A batch for the job to tell (one that waits for another job: it outlives the recording,
    which ends it)."""
    batch_id = f"batch-{task_queue}"
    state = BatchInput(batch_id=batch_id, job_ids=[f"{batch_id}-0001"])
    return await client.start_workflow(JobBatch.run, state, id=batch_id, task_queue=task_queue)


async def record(only: list[str] | None = None) -> None:
    env = await start_time_skipping()
    try:
        for name, (script, policy, action) in SCENARIOS.items():
            if only and name not in only:
                continue
            backend = FakeBackend(script)
            task_queue = f"record-{name}"
            async with Worker(
                env.client,
                task_queue=task_queue,
                workflows=[InferenceJob, PoolQueue, JobBatch, TenantLedger],
                activities=[*backend.activities(), FakeReceiver().deliver_webhook],
                graceful_shutdown_timeout=timedelta(seconds=1),
            ):
                settings = dict(policy)
                if settings.pop(POOL_FULL, False):
                    await fill_the_pool(env.client, task_queue)
                tenant = settings.pop(TENANT, None)
                if settings.pop(OVER_BUDGET, False):
                    await spend_the_budget(env.client, task_queue, tenant)
                unchecked = settings.pop(UNCHECKED_GRAPH, None)
                batch = (
                    await start_batch(env.client, task_queue) if settings.pop(BATCH, 0) else None
                )
                labels = {BATCH_LABEL: batch.id} if batch is not None else {}
                fields = {
                    "labels": labels | ({TENANT_LABEL: tenant} if tenant else {}),
                    "segments": settings.pop(SEGMENTS, []),
                    "webhook": settings.pop(WEBHOOK, None),
                    "policy": JobPolicy.model_validate({"heartbeat_timeout_s": 1} | settings),
                }
                request = (
                    JobRequest(graph=GRAPH, **fields)
                    if unchecked is None
                    else JobRequest.model_construct(graph=unchecked, **fields)
                )
                if tenant is not None:
                    # A ledger's reset timer must fire only when the scenario means it to:
                    # skipped by itself, the server passes it while the job ends, and a ledger
                    # terminated in the middle of its continue-as-new stops it skipping at all.
                    with env.auto_time_skipping_disabled():
                        handle = await start_job(env.client, task_queue, request)
                        await until_held_then_reset(env, handle)
                        history = await ended_history(handle)
                else:
                    handle = await start_job(env.client, task_queue, request)
                    if action is not None:
                        await action(handle)
                    history = await ended_history(handle)
                if batch is not None:
                    await batch.terminate("recorded")
                if tenant is not None:
                    await env.client.get_workflow_handle(ledger_id(tenant)).terminate("recorded")
            write_history(HERE / f"{name}.json", history)
    finally:
        await env.shutdown()


def write_history(path: Path, history: WorkflowHistory) -> None:
    """The history as the replay tests read it (indented: a re-recording's diff is readable)."""
    path.write_text(json.dumps(json.loads(history.to_json()), indent=1) + "\n")
    print(f"wrote {path} ({len(history.events)} events)")


if __name__ == "__main__":
    # `record.py decided lost` records only those scenarios.
    asyncio.run(record(sys.argv[1:]))
