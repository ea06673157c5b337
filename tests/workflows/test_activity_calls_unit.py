"""workflows/activity_calls.py: what the durability story asks of each activity call.

The follow runs once, on the job policy's timeouts, and a cancel of it waits until it lands; a
stop is one check per call; prepare and offload are retried, and an upload heartbeats; each
call's summary in the Temporal UI names its segment, or its stop's reason. All checked against
the policy and the inputs on a recording `execute_activity`, not against copied numbers.
"""

from __future__ import annotations

from typing import Any, TypeVar

import pytest
from pydantic import BaseModel
from temporalio import workflow

from tests.support.workflow_fakes import FakeWorkflow
from workflows import activity_calls as calls
from workflows.activity_io import FollowInput, OffloadInput, PrepareInput, StopInput
from workflows.contracts import JobPolicy

M = TypeVar("M", bound=BaseModel)


def only_with(model: type[M], **fields: Any) -> M:
    """An input with just the fields the call reads (the activities' inputs are not tested here)."""
    return model.model_construct(**fields)


def options(wf: FakeWorkflow) -> dict[str, Any]:
    [(_activity, _arg, opts)] = wf.activities
    return opts


async def test_the_follow_runs_once_on_the_job_policys_timeouts_and_waits_for_its_cancel(
    wf: FakeWorkflow,
) -> None:
    policy = JobPolicy(execution_timeout_s=612, heartbeat_timeout_s=23)
    await calls.follow(only_with(FollowInput, segment=4), policy)
    opts = options(wf)
    # The workflow owns reconnects (durable, jittered, bounded by the horizon).
    assert opts["retry_policy"].maximum_attempts == 1
    # A dead worker is noticed after the job's heartbeat timeout; a follow may run as long
    # as the job may.
    assert opts["heartbeat_timeout"].total_seconds() == policy.heartbeat_timeout_s
    assert opts["start_to_close_timeout"].total_seconds() == policy.execution_timeout_s
    # Teardown must see the real end state, not a cancel still on its way to the worker.
    assert (
        opts["cancellation_type"] == workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED
    )
    assert "segment 4" in opts["summary"]


@pytest.mark.parametrize("final", [False, True])
async def test_a_stop_is_one_check_per_call(wf: FakeWorkflow, final: bool) -> None:
    # The workflow repeats the check on durable timers until the prompt is gone.
    await calls.stop(only_with(StopInput, reason="after cancel", final=final))
    opts = options(wf)
    assert opts["retry_policy"].maximum_attempts == 1
    assert "after cancel" in opts["summary"]
    assert ("last check" in opts["summary"]) == final


async def test_a_prepare_that_stages_inputs_is_an_activity_with_retries(wf: FakeWorkflow) -> None:
    """Inputs to download and upload: an activity of its own, not held in a workflow task."""
    staging = only_with(PrepareInput, job_id="j", inputs={"a.png": {"url": "https://x/a.png"}})
    await calls.prepare(staging)
    opts = options(wf)
    assert "local" not in opts and opts["retry_policy"].maximum_attempts != 1


async def test_a_prepare_is_an_activity_with_retries(wf: FakeWorkflow) -> None:
    """Only a request that stages inputs is prepared (downloads and uploads of up to 100 MB):
    an activity of its own, retried while the pool is slow or down."""
    await calls.prepare(only_with(PrepareInput, job_id="j"))
    opts = options(wf)
    assert "local" not in opts
    assert opts["retry_policy"].maximum_attempts != 1


@pytest.mark.parametrize("partial", [False, True])
async def test_an_offload_is_retried_and_heartbeats(wf: FakeWorkflow, partial: bool) -> None:
    await calls.offload(only_with(OffloadInput, segment=3, partial=partial))
    opts = options(wf)
    assert opts["retry_policy"].maximum_attempts != 1
    # A worker that dies mid-upload is noticed long before the upload's own time limit.
    assert opts["heartbeat_timeout"] < opts["start_to_close_timeout"]
    assert "segment 3" in opts["summary"]
    assert ("partial" in opts["summary"]) == partial


async def summaries(wf: FakeWorkflow) -> list[str]:
    """Every call's summary, in the order an operator meets them in the Temporal UI."""
    policy = JobPolicy()
    await calls.prepare(only_with(PrepareInput, job_id="j"))
    await calls.follow(only_with(FollowInput, segment=0), policy)
    await calls.offload(only_with(OffloadInput, segment=1, partial=False))
    await calls.offload(only_with(OffloadInput, segment=1, partial=True))
    await calls.stop(only_with(StopInput, reason="cancelled", final=False))
    await calls.stop(only_with(StopInput, reason="cancelled", final=True))
    return [opts["summary"] for _activity, _arg, opts in wf.activities]


async def test_the_ui_summaries_word_for_word(wf: FakeWorkflow) -> None:
    # The text operators read and search in the UI's event list (docs/operations.md).
    assert await summaries(wf) == [
        "prepare",
        "follow segment 0",
        "offload segment 1",
        "offload segment 1 (partial)",
        "stop prompt (cancelled)",
        "stop prompt (cancelled) (last check)",
    ]
