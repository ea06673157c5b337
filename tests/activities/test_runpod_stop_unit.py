"""A stop on a RunPod pool says only what is known: against the
scripted RunPod and the in-memory bucket of test_runpod_backend_unit, no server.

Our handler (claims): RunPod's CANCELLED is not the prompt's end; only the handler's stop record
in the claim is, never a lease that ran out. A prompt the handler gave up on is "stuck". A stock
handler cannot stop its prompt: "cancel_sent", the prompt's end unknown, its cost a lower bound.
A graph ComfyUI refused was never queued.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from temporalio.exceptions import ApplicationError

from activities.runpod import submissions
from activities.runpod.cost import job_cost
from activities.runpod.follow import stop_horizon
from activities.runpod.models import RunPodJob
from configuration.pools import PoolConfig
from protocol.runpod.contract import (
    DEFAULT_STOP_HORIZON_S,
    Claim,
    ClaimOutcome,
    EarlierHolder,
    PromptFate,
    S3Target,
    StopRecord,
    claim_key,
    delivery_key,
)
from tests.activities.test_runpod_backend_unit import (
    BUCKET,
    HOLDER,
    JOB_ID,
    OUR_KEY,
    PNG,
    PROMPT,
    RUNPOD_JOB,
    MemoryStore,
    ScriptedRunPod,
    backend,
    completed,
    env,
    follow_input,
    stop_input,
)
from workflows.activity_io import StopCheck
from workflows.shared import ErrorType

WORKER = "w-gpu-7"
RUNNING = {"id": RUNPOD_JOB, "status": "IN_PROGRESS", "workerId": WORKER}
CANCELLED = {
    "id": RUNPOD_JOB,
    "status": "CANCELLED",
    "workerId": WORKER,
    "delayTime": 900,
    "executionTime": 16_200,
}


def put_claim(
    store: MemoryStore,
    *,
    lease_left_s: float = 40,
    stopping_since: datetime | None = None,
    outcome: ClaimOutcome | None = None,
    holder: str = RUNPOD_JOB,
) -> Claim:
    now = datetime.now(UTC)
    claim = Claim(
        submission=PROMPT,
        job_id=JOB_ID,
        prompt_id=PROMPT,
        holder=holder,
        worker_id=WORKER,
        lease_until=now + timedelta(seconds=lease_left_s),
        renewed_at=now,
        stopping_since=stopping_since,
        outcome=outcome,
    )
    store.put(claim_key(S3Target(bucket=BUCKET), JOB_ID, PROMPT), claim.model_dump_json().encode())
    return claim


def stopped(fate: PromptFate, *, replaced: bool = False, took_s: float = 6.0) -> ClaimOutcome:
    now = datetime.now(UTC)
    record = StopRecord(
        prompt=fate,
        started_at=now - timedelta(seconds=took_s),
        at=now,
        checks=3,
        requests=1,
        node="4" if fate in ("interrupted", "failed", "still_running") else None,
        node_type="SlowBlur" if fate in ("interrupted", "failed", "still_running") else None,
        detail="" if fate != "failed" else "node 4 raised",
        worker_id=WORKER,
        worker_replaced=replaced,
    )
    return ClaimOutcome(state="cancelled", at=now, stop=record)


async def check(
    store: MemoryStore, statuses: list[dict[str, Any]], *, claims: bool = True
) -> tuple[StopCheck, ScriptedRunPod]:
    runpod = ScriptedRunPod(statuses=statuses)
    result = await env([]).run(backend(runpod, store, claims=claims).stop, stop_input())
    return result, runpod


# -- our handler: the claim, never the lease ------------------------------------------------------


async def test_a_cancelled_job_whose_handler_is_still_stopping_is_running() -> None:
    store = MemoryStore()
    since = datetime.now(UTC) - timedelta(seconds=3)
    put_claim(store, stopping_since=since)
    first, runpod = await check(store, [RUNNING, CANCELLED])
    assert ("POST", "cancel") in runpod.requests
    assert (first.position, first.action) == ("running", "interrupt_sent")
    assert RUNPOD_JOB in first.message and WORKER in first.message and PROMPT in first.message
    assert f"since {since:%H:%M:%S}" in first.message
    assert first.worker_id == WORKER


async def test_a_lapsed_lease_is_never_read_as_the_prompts_end() -> None:
    """The handler stopped renewing, the claim has no outcome: nothing says the
    prompt stopped (it ran 41 s more on the real ComfyUI). The workflow keeps checking and
    fails the teardown at its horizon."""
    store = MemoryStore()
    claim = put_claim(
        store, lease_left_s=-6, stopping_since=datetime.now(UTC) - timedelta(minutes=1)
    )
    result, _ = await check(store, [CANCELLED])
    assert result.position == "running", result
    assert result.ended is None and result.cost is None
    assert f"stopped renewing its claim at {claim.lease_until:%H:%M:%S}" in result.message
    assert "nothing confirms" in result.message and PROMPT in result.message


async def test_a_worker_runpod_lost_with_its_lease_lapsed_took_its_prompt_along() -> None:
    """TIMED_OUT short of the execution limit (RunPod stopped hearing from the worker) and a
    lapsed lease with no outcome: two witnesses that the worker, one container with its
    ComfyUI, is gone. Only a CANCELLED job's lapse is not evidence (its prompt may run on)."""
    store = MemoryStore()
    put_claim(store, lease_left_s=-6)
    lost = {**CANCELLED, "status": "TIMED_OUT"}
    result, _ = await check(store, [lost])
    assert (result.position, result.ended) == ("gone", "unknown"), result
    assert (
        result.confirmed and WORKER in result.message and "went with its worker" in result.message
    )
    put_claim(store, lease_left_s=30)  # still renewed: alive after all, whatever RunPod says
    result, _ = await check(store, [lost])
    assert result.position == "running", result


async def test_a_job_runpod_took_off_its_claims_worker_left_the_prompt_with_that_worker() -> None:
    """The worker crashed, RunPod put the job back in its queue (no worker, no execution) and
    the cancel found it there: the claim's worker is not the job's any more, and its lease
    lapsed. A CANCELLED job still on the claim's worker is not judged so (its prompt may run on)."""
    store = MemoryStore()
    put_claim(store, lease_left_s=-6)
    requeued = {"id": RUNPOD_JOB, "status": "IN_QUEUE", "delayTime": 900}
    cancelled = {"id": RUNPOD_JOB, "status": "CANCELLED", "delayTime": 900}
    result, _ = await check(store, [requeued, cancelled])
    assert (result.position, result.ended, result.action) == ("gone", "unknown", "dequeued")
    assert WORKER in result.message and "off that worker" in result.message
    result, _ = await check(store, [CANCELLED])  # on the claim's worker, with its run counted
    assert result.position == "running", result


@pytest.mark.parametrize(
    ("fate", "ended", "action", "node"),
    [
        ("dequeued", "unknown", "dequeued", None),
        ("interrupted", "interrupted", "none", "4"),
        ("finished", "success", "none", None),
        ("failed", "error", "none", "4"),
        ("gone", "unknown", "none", None),
        ("never_submitted", "unknown", "none", None),
    ],
)
async def test_the_handlers_stop_record_says_how_the_prompt_ended(
    fate: PromptFate, ended: str, action: str, node: str | None
) -> None:
    store = MemoryStore()
    put_claim(store, outcome=stopped(fate))
    result, runpod = await check(store, [CANCELLED])
    assert ("POST", "cancel") not in runpod.requests
    assert (result.position, result.ended, result.action) == ("gone", ended, action)
    assert result.confirmed and result.node == node and result.worker_id == WORKER
    assert result.cost is not None and not result.cost.lower_bound
    # RunPod's 16.2 s end at the cancel; the 6 s the handler spent stopping were billed too.
    assert result.cost.execution_s == 16.2
    assert result.cost.billed_after_end_s == pytest.approx(5.0 + 6.0)
    assert "stopping the prompt" in result.cost.note


async def test_a_prompt_still_running_at_the_handlers_horizon_is_stuck_with_its_worker() -> None:
    store = MemoryStore()
    put_claim(store, outcome=stopped("still_running", replaced=True, took_s=100))
    result, _ = await check(store, [CANCELLED])
    assert result.position == "stuck"
    assert (result.worker_id, result.worker_replaced, result.node) == (WORKER, True, "4")
    assert (
        f"prompt {PROMPT} was still running on RunPod worker {WORKER} after the handler's stop "
        "horizon; the handler replaced the worker"
    ) in result.message
    assert result.cost is not None and result.cost.billed_after_end_s == pytest.approx(105.0)


async def test_a_job_that_ended_by_itself_ends_as_its_claim_says() -> None:
    store = MemoryStore()
    put_claim(store, outcome=ClaimOutcome(state="completed", at=datetime.now(UTC)))
    done = completed([])
    result, _ = await check(store, [done])
    assert (result.position, result.ended, result.confirmed) == ("gone", "success", True)
    assert result.cost is not None and not result.cost.lower_bound


async def test_a_cancelled_claim_without_a_stop_record_is_unconfirmed() -> None:
    """A handler from before stop records wrote "cancelled" after trying for a few seconds:
    no confirmation either."""
    store = MemoryStore()
    put_claim(store, outcome=ClaimOutcome(state="cancelled", at=datetime.now(UTC)))
    result, _ = await check(store, [CANCELLED])
    assert (result.position, result.ended, result.confirmed) == ("gone", "unknown", False)


async def test_a_handler_answer_without_its_claim_outcome_ends_as_answered() -> None:
    """The handler returned (RunPod has its answer) but could not record the outcome (a
    storage outage): its answer says how the prompt ended; its lease is no question."""
    store = MemoryStore()
    put_claim(store, lease_left_s=30)
    failed = {
        "id": RUNPOD_JOB,
        "status": "FAILED",
        "workerId": WORKER,
        "executionTime": 900,
        "error": "storage: EndpointConnectionError",
        "output": {"error_type": "StorageError"},
    }
    result, _ = await check(store, [failed])
    assert (result.position, result.ended) == ("gone", "error")


async def test_the_claims_holder_is_stopped_when_the_known_job_has_ended() -> None:
    """The workflow knows an older RunPod job of the submission (it ended); the claim names the
    job that took it over and runs the prompt now: that one is cancelled and judged."""
    store = MemoryStore()
    put_claim(store, holder=HOLDER, stopping_since=None)
    asked: list[tuple[str, str]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        route, job = request.url.path.split("/")[3:5]
        asked.append((route, job))
        if job == RUNPOD_JOB:
            return httpx.Response(200, json={"id": RUNPOD_JOB, "status": "TIMED_OUT"})
        cancelled = any(r == "cancel" for r, _ in asked)
        state = "CANCELLED" if cancelled else "IN_PROGRESS"
        return httpx.Response(200, json={"id": HOLDER, "status": state, "workerId": "w2"})

    runpod = ScriptedRunPod()
    pool_backend = backend(runpod, store, transport=httpx.MockTransport(handle))
    result = await env([]).run(pool_backend.stop, stop_input())
    assert ("cancel", HOLDER) in asked and ("cancel", RUNPOD_JOB) not in asked
    assert (result.position, result.action) == ("running", "interrupt_sent")
    assert HOLDER in result.message

    # Once the holder recorded its stop, that record is the verdict.
    put_claim(store, holder=HOLDER, outcome=stopped("interrupted"))
    result = await env([]).run(pool_backend.stop, stop_input())
    assert (result.position, result.ended, result.node) == ("gone", "interrupted", "4")


# -- a stock handler: the cancel is all that is known ----------------------------------------------


async def test_a_stock_cancel_is_a_cancel_sent_and_the_prompts_end_is_unknown() -> None:
    """runpod 1.7.x has no job-stop and the stock handler never calls /interrupt."""
    store = MemoryStore()
    first, runpod = await check(store, [RUNNING, CANCELLED], claims=False)
    assert ("POST", "cancel") in runpod.requests
    assert (first.action, first.position, first.ended) == ("cancel_sent", "gone", "unknown")
    assert not first.confirmed and first.worker_id == WORKER
    assert f"RunPod job {RUNPOD_JOB} was cancelled" in first.message
    assert "a stock worker-comfyui handler cannot stop its prompt" in first.message
    assert f"may run to its end on worker {WORKER}" in first.message
    # What RunPod counted ends at the cancel; the worker runs on, billing: a lower bound.
    assert first.cost is not None and first.cost.lower_bound
    assert first.cost.execution_s == 16.2 and "stock worker-comfyui" in first.cost.note
    # The settled pass's check sends nothing more and knows nothing more.
    again, runpod = await check(store, [CANCELLED], claims=False)
    assert ("POST", "cancel") not in runpod.requests
    assert (again.action, again.position, again.confirmed) == ("none", "gone", False)


async def test_a_stock_job_cancelled_while_queued_is_dequeued_for_sure() -> None:
    store = MemoryStore()
    queued = {"id": RUNPOD_JOB, "status": "IN_QUEUE"}
    gone = {"id": RUNPOD_JOB, "status": "CANCELLED"}
    result, _ = await check(store, [queued, gone], claims=False)
    assert (result.action, result.position, result.confirmed) == ("dequeued", "gone", True)
    assert result.cost is not None and not result.cost.lower_bound


async def test_a_stock_follow_that_sees_its_job_cancelled_reports_a_lower_bound() -> None:
    """The follow's failure carries the cancelled job's cost too (the workflow keeps it)."""
    store = MemoryStore()
    runpod = ScriptedRunPod(statuses=[CANCELLED])
    with pytest.raises(ApplicationError) as failed:
        await env([]).run(backend(runpod, store, claims=False).follow, follow_input())
    assert failed.value.type == ErrorType.CANCELLED
    cost = failed.value.details[0]["cost"]
    assert cost["lower_bound"] is True and cost["execution_s"] == 16.2 and cost["note"]


# -- a graph ComfyUI refused was never queued ----------------------------------------------------


async def test_a_rejected_graph_on_our_handler_was_never_queued() -> None:
    store = MemoryStore()
    put_claim(
        store,
        outcome=ClaimOutcome(
            state="failed",
            error="ComfyUI rejected the workflow: node 5 (KSamplerr) does not exist",
            error_type="PromptRejected",
            at=datetime.now(UTC),
        ),
    )
    rejected = {
        "id": RUNPOD_JOB,
        "status": "FAILED",
        "workerId": WORKER,
        "error": "ComfyUI rejected the workflow: node 5 (KSamplerr) does not exist",
        "output": {"error_type": "PromptRejected"},
    }
    result, _ = await check(store, [rejected])
    assert (result.position, result.ended) == ("gone", "never_queued")
    # Before the handler recorded anything, its answer alone says the same.
    store = MemoryStore()
    put_claim(store)
    result, _ = await check(store, [rejected])
    assert (result.position, result.ended) == ("gone", "never_queued")


async def test_a_rejected_graph_on_a_stock_endpoint_was_never_queued() -> None:
    store = MemoryStore()
    rejected = {
        "id": RUNPOD_JOB,
        "status": "FAILED",
        "workerId": WORKER,
        "error": "Workflow validation failed:\n• Node 5 (errors): [{'type': 'required_input_"
        "missing', 'message': 'Required input is missing', 'details': 'model', 'extra_info': "
        "{'input_name': 'model'}}]\n• Node 5 (dependent_outputs): ['9']\n• Node 5 "
        "(class_type): KSampler",
    }
    result, _ = await check(store, [rejected], claims=False)
    assert (result.position, result.ended, result.confirmed) == ("gone", "never_queued", True)
    assert "node 5 (KSampler): input 'model': Required input is missing" in result.message


# -- the handler's stop horizon -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("teardown_s", "handler_s"),
    [(None, DEFAULT_STOP_HORIZON_S), (900.0, 810.0), (120.0, 105.0), (60.0, 45.0), (8.0, 5.0)],
)
async def test_the_handler_stops_for_the_teardown_horizon_less_a_margin(
    teardown_s: float | None, handler_s: float
) -> None:
    assert stop_horizon(teardown_s) == handler_s
    store = MemoryStore()
    store.put(OUR_KEY, PNG)
    runpod = ScriptedRunPod(statuses=[completed([])])
    req = follow_input().model_copy(update={"teardown_horizon_s": teardown_s})
    with pytest.raises(ApplicationError):  # no outputs: what was sent is what matters here
        await env([]).run(backend(runpod, store).follow, req)
    assert runpod.bodies[0]["input"]["durable_comfy"]["stop_horizon_s"] == handler_s


async def test_a_stop_that_sees_the_runpod_job_ended_forgets_its_submission_record() -> None:
    """Once RunPod's job is over nothing is left for the orphan sweep to cancel; while it runs
    the record stays, so a terminate between two checks is still swept."""
    store = MemoryStore()
    key = submissions.record_key("cloud", JOB_ID, PROMPT)
    store.put(key, b"{}")
    put_claim(store, stopping_since=datetime.now(UTC))
    await check(store, [RUNNING, RUNNING])
    assert (BUCKET, key) in store.objects
    await check(store, [RUNNING, CANCELLED])
    assert (BUCKET, key) not in store.objects


# -- the job's other RunPod jobs ------------------------------------------------------------------

OTHER_JOB = "rp-lost-answer"


@pytest.mark.parametrize("still_running", [False, True], ids=["ended", "running"])
async def test_a_stop_with_a_verdict_costs_the_deliveries_only_their_markers_name(
    still_running: bool,
) -> None:
    """A `/run` whose answer was lost made a RunPod job the workflow never heard of; its
    delivery marker names it. The stop reads what it billed once it has a verdict; one still
    running is cancelled (the job is being stopped). What became of one that ended before the
    stop (here: given up by the follow as `crashed`, so CANCELLED) is the follow's word: the
    reading says nothing of it, and the workflow keeps it."""
    store = MemoryStore()
    put_claim(store, outcome=stopped("interrupted"))
    for runpod_job in (RUNPOD_JOB, OTHER_JOB):
        store.put(delivery_key(S3Target(bucket=BUCKET), JOB_ID, PROMPT, runpod_job), b"{}")
    other = {"id": OTHER_JOB, "workerId": "w-gpu-8", "delayTime": 300, "executionTime": 1_200}
    after = [{**other, "status": "IN_PROGRESS"}, {**other, "status": "CANCELLED"}]
    result, runpod = await check(
        store, [CANCELLED, *(after if still_running else [{**other, "status": "CANCELLED"}])]
    )
    assert result.position == "gone" and result.cost is not None
    assert result.cost.provider_job_id == RUNPOD_JOB
    [cost] = result.other_costs
    assert cost.provider_job_id == OTHER_JOB and cost.execution_s == 1.2
    assert cost.outcome == ("cancelled" if still_running else None)
    assert (("POST", "cancel") in runpod.requests) == still_running


async def test_a_stop_still_waiting_on_the_handler_reads_no_other_delivery() -> None:
    """Until the stop has a verdict no listing is made: a check runs every few seconds."""
    store = MemoryStore()
    put_claim(store, stopping_since=datetime.now(UTC))
    store.put(delivery_key(S3Target(bucket=BUCKET), JOB_ID, PROMPT, OTHER_JOB), b"{}")
    result, _ = await check(store, [RUNNING, CANCELLED])
    assert result.position == "running" and result.other_costs == []


def test_the_dead_holder_of_a_redelivered_job_is_in_its_cost() -> None:
    """RunPod gave the job to another worker after its first one died, then it was cancelled
    while queued: RunPod's figures say 0 s, the dead worker billed until it died, which is
    before its lease's end. The cost counts the claim's span, and says so."""
    now = datetime.now(UTC)
    claim = Claim(
        submission=PROMPT,
        job_id=JOB_ID,
        prompt_id=PROMPT,
        holder=RUNPOD_JOB,
        worker_id=WORKER,
        claimed_at=now - timedelta(seconds=12),
        renewed_at=now - timedelta(seconds=4),
        lease_until=now + timedelta(seconds=1),
    )
    requeued = RunPodJob.model_validate({"id": RUNPOD_JOB, "status": "CANCELLED"})
    cost = job_cost(requeued, PoolConfig(kind="runpod", endpoint_id="ep1"), claim=claim)
    assert cost.execution_s == pytest.approx(13.0) and cost.outcome == "cancelled"
    assert f"1 earlier delivery of the job (worker {WORKER})" in cost.note
    # Taken over by its next delivery (worker w-2), which then completed: the span is read from
    # `earlier`, and the holder now is no earlier delivery.
    taken = claim.model_copy(
        update={
            "worker_id": "w-2",
            "claimed_at": now,
            "earlier": [
                EarlierHolder(
                    holder=RUNPOD_JOB,
                    worker_id=WORKER,
                    claimed_at=claim.claimed_at,
                    renewed_at=claim.renewed_at,
                    lease_until=claim.lease_until,
                ),
                EarlierHolder(  # another RunPod job's holder: its own cost
                    holder=OTHER_JOB, worker_id="w-3", renewed_at=now, lease_until=now
                ),
            ],
        }
    )
    done = RunPodJob.model_validate(
        {"id": RUNPOD_JOB, "status": "COMPLETED", "workerId": "w-2", "executionTime": 5_000}
    )
    assert job_cost(
        done, PoolConfig(kind="runpod", endpoint_id="ep1"), claim=taken
    ).execution_s == (pytest.approx(18.0))
    # The holder on the worker the job is on now is the job's own delivery: nothing added.
    assert job_cost(
        done,
        PoolConfig(kind="runpod", endpoint_id="ep1"),
        claim=taken.model_copy(update={"earlier": []}),
    ).execution_s == pytest.approx(5.0)
