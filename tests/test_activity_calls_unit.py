"""workflows/activity_calls.py: each activity's name, timeouts, retries and Temporal UI summary.

These are the numbers the durability story rests on (who retries, for how long, who waits for a
cancel to land), so each call is compared whole against a recording `execute_activity`.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any, TypeVar, cast

import pytest
from pydantic import BaseModel
from temporalio import workflow
from temporalio.common import RetryPolicy

from workflows import activity_calls as calls
from workflows.activity_io import (
    FollowInput,
    FollowResult,
    OffloadInput,
    OffloadResult,
    PreparedJob,
    PrepareInput,
    StopCheck,
    StopInput,
)
from workflows.contracts import JobPolicy, ReconnectPolicy

POLICY = JobPolicy(
    execution_timeout_s=600,
    heartbeat_timeout_s=25,
    reconnect=ReconnectPolicy(base_delay_s=3, max_delay_s=40, horizon_s=700),
)
QUICK = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=10,
)
ONCE = RetryPolicy(maximum_attempts=1)

M = TypeVar("M", bound=BaseModel)


def only_with(model: type[M], **fields: Any) -> M:
    """An input with just the fields the call reads (the activities' inputs are not tested here)."""
    return model.model_construct(**fields)


class Recorded:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []

    async def execute_activity(self, activity: str, arg: Any, **options: Any) -> object:
        self.calls.append((activity, arg, options))
        return self

    def only(self) -> tuple[str, Any, dict[str, Any]]:
        assert len(self.calls) == 1
        return self.calls[0]


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorded]:
    rec = Recorded()
    monkeypatch.setattr(workflow, "execute_activity", rec.execute_activity)
    yield rec


def test_the_shared_retry_policies() -> None:
    assert calls.QUICK_RETRY == QUICK
    assert calls.ONE_ATTEMPT == ONCE


async def test_prepare(recorded: Recorded) -> None:
    req = only_with(PrepareInput, job_id="j")
    assert cast(object, await calls.prepare(req)) is recorded
    assert recorded.only() == (
        "prepare_prompt",
        req,
        {
            "result_type": PreparedJob,
            "start_to_close_timeout": timedelta(minutes=2),
            "retry_policy": QUICK,
            "summary": "prepare",
        },
    )


async def test_follow_runs_once_and_waits_for_its_cancel_to_land(recorded: Recorded) -> None:
    req = only_with(FollowInput, segment=1)
    assert cast(object, await calls.follow(req, POLICY)) is recorded
    assert recorded.only() == (
        "follow_prompt",
        req,
        {
            "result_type": FollowResult,
            "start_to_close_timeout": timedelta(seconds=600),
            "heartbeat_timeout": timedelta(seconds=25),
            "retry_policy": ONCE,
            "cancellation_type": workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            "summary": "follow segment 1",
        },
    )


@pytest.mark.parametrize(
    ("partial", "summary"), [(False, "offload segment 3"), (True, "offload segment 3 (partial)")]
)
async def test_offload(recorded: Recorded, partial: bool, summary: str) -> None:
    req = only_with(OffloadInput, segment=3, partial=partial)
    assert cast(object, await calls.offload(req)) is recorded
    assert recorded.only() == (
        "offload_outputs",
        req,
        {
            "result_type": OffloadResult,
            "start_to_close_timeout": timedelta(minutes=30),
            "heartbeat_timeout": timedelta(minutes=2),
            "retry_policy": QUICK,
            "summary": summary,
        },
    )


@pytest.mark.parametrize(
    ("final", "summary"),
    [(False, "stop prompt (after failure)"), (True, "stop prompt (after failure) (last check)")],
)
async def test_stop_is_one_check_per_call(recorded: Recorded, final: bool, summary: str) -> None:
    req = only_with(StopInput, reason="after failure", final=final)
    assert cast(object, await calls.stop(req)) is recorded
    assert recorded.only() == (
        "stop_prompt",
        req,
        {
            "result_type": StopCheck,
            "start_to_close_timeout": timedelta(seconds=30),
            "retry_policy": ONCE,
            "summary": summary,
        },
    )
