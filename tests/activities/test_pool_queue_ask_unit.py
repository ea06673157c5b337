"""The check's ask of a bounded pool's dispatcher (activities/pool_queue.py): by update, again
while the server refuses it as busy, and by signal when that lasts or the dispatcher cannot
answer (an older version). A burst of checks on one worker is queued, not sent at once."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities import pool_queue
from activities.pool_queue import PoolQueueActivities
from workflows.admission import Admission, SlotRequest

ASK = SlotRequest(job_id="j1", tenant="t", max_running=1, accepted_at=datetime.now(UTC))


class FakeTemporal:
    """Answers `refusals` updates with `refusal`, then the grant; counts what it was sent."""

    def __init__(self, refusals: int = 0, refusal: Exception | None = None) -> None:
        self.refusals, self.refusal = refusals, refusal
        self.updates = self.signals = self.in_flight = self.most_in_flight = 0

    async def execute_update_with_start_workflow(self, *_: Any, **__: Any) -> Admission:
        self.updates += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.01)
            if self.updates <= self.refusals:
                assert self.refusal is not None
                raise self.refusal
            return Admission(pool="gpu", job_id="j1", granted=True)
        finally:
            self.in_flight -= 1

    async def start_workflow(self, *_: Any, **kwargs: Any) -> None:
        assert kwargs["start_signal"] == "request"
        self.signals += 1


def busy() -> RPCError:
    return RPCError(
        "limit on number of concurrent in-flight updates has been reached (10)",
        RPCStatusCode.RESOURCE_EXHAUSTED,
        b"",
    )


async def test_a_busy_dispatcher_is_asked_again_and_answers() -> None:
    temporal = FakeTemporal(refusals=3, refusal=busy())
    queues = PoolQueueActivities(temporal, None)  # type: ignore[arg-type]
    answer = await queues.ask_on("tq", "gpu", ASK)
    assert answer is not None and answer.granted
    assert (temporal.updates, temporal.signals) == (4, 0)


async def test_a_dispatcher_busy_for_too_long_gets_the_request_by_signal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pool_queue, "_ASK_BUSY_FOR_S", 0.3)
    temporal = FakeTemporal(refusals=1000, refusal=busy())
    queues = PoolQueueActivities(temporal, None)  # type: ignore[arg-type]
    assert await queues.ask_on("tq", "gpu", ASK) is None
    assert temporal.signals == 1 and 2 <= temporal.updates < 20


async def test_a_dispatcher_without_the_update_gets_the_request_by_signal() -> None:
    unknown = WorkflowUpdateFailedError(ApplicationError("update handler for ask not found"))
    temporal = FakeTemporal(refusals=1, refusal=unknown)
    queues = PoolQueueActivities(temporal, None)  # type: ignore[arg-type]
    assert await queues.ask_on("tq", "gpu", ASK) is None
    assert (temporal.updates, temporal.signals) == (1, 1)


async def test_another_server_error_fails_the_ask() -> None:
    denied = RPCError("denied", RPCStatusCode.PERMISSION_DENIED, b"")
    temporal = FakeTemporal(refusals=1, refusal=denied)
    queues = PoolQueueActivities(temporal, None)  # type: ignore[arg-type]
    with pytest.raises(RPCError):
        await queues.ask_on("tq", "gpu", ASK)
    assert temporal.signals == 0


async def test_a_burst_of_checks_asks_a_few_at_a_time() -> None:
    temporal = FakeTemporal()
    queues = PoolQueueActivities(temporal, None)  # type: ignore[arg-type]
    answers = await asyncio.gather(*(queues.ask_on("tq", "gpu", ASK) for _ in range(40)))
    assert all(a is not None and a.granted for a in answers)
    assert temporal.updates == 40 and temporal.most_in_flight == pool_queue._ASK_AT_ONCE
