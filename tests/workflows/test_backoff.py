"""The reconnect delay: bounded, really jittered, and what the workflow's timers actually use.

The committed `reconnected` history only proves what the code did when it was recorded; here the
workflow runs today's `reconnect_delay` on the time-skipping server and its timers are compared
with the function's own answers.
"""

from __future__ import annotations

from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

import workflows.shared
from tests.support.workflow_fakes import (
    GRAPH,
    FakeBackend,
    Script,
    job_worker,
    start_job,
)
from workflows.contracts import JobPolicy, JobRequest, JobState, JobStatus
from workflows.shared import QUERY_STATUS, ErrorType, reconnect_delay

DRAWS = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.999999]


@pytest.mark.parametrize(
    ("attempt", "ceiling"), [(0, 2.0), (1, 4.0), (2, 8.0), (3, 10.0), (40, 10.0)]
)
def test_the_draw_spreads_the_delay_over_half_to_all_of_the_ceiling(
    attempt: int, ceiling: float
) -> None:
    delays = [reconnect_delay(attempt, 2.0, 10.0, u) for u in DRAWS]
    assert delays == sorted(delays) and len(set(delays)) == len(DRAWS), "jitter follows u"
    assert delays[0] == ceiling / 2
    assert all(ceiling / 2 <= d < ceiling for d in delays)
    assert delays[-1] == pytest.approx(ceiling, rel=1e-5)
    assert reconnect_delay(attempt, 2.0, 10.0, 0.5) == pytest.approx(ceiling * 0.75)


def test_the_delay_doubles_until_the_ceiling() -> None:
    assert [reconnect_delay(n, 1.0, 30.0, 0.0) for n in range(7)] == [
        0.5,
        1.0,
        2.0,
        4.0,
        8.0,
        15.0,
        15.0,
    ]
    assert reconnect_delay(10_000, 1.0, 30.0, 0.5) == 22.5, "huge attempts do not overflow"


@pytest.mark.parametrize(
    ("attempt", "u", "message"),
    [
        (-1, 0.5, "attempt must be >= 0"),
        (0, -0.1, "u must be in [0, 1)"),
        (0, 1.0, "u must be in [0, 1)"),
        (0, 1.5, "u must be in [0, 1)"),
    ],
)
def test_out_of_range_arguments_are_refused_saying_which(
    attempt: int, u: float, message: str
) -> None:
    with pytest.raises(ValueError) as refused:
        reconnect_delay(attempt, 1.0, 30.0, u)
    assert str(refused.value) == message


def test_attempt_zero_and_a_draw_just_below_one_are_allowed() -> None:
    assert reconnect_delay(0, 1.0, 30.0, 0.0) == 0.5
    assert reconnect_delay(62, 1.0, 1e30, 0.0) == 2.0**61
    assert reconnect_delay(63, 1.0, 1e30, 0.0) == 2.0**61, "the exponent stops at 62"


async def test_the_workflows_reconnect_timers_are_the_functions_answers(
    env: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch
) -> None:
    answers: list[tuple[tuple[int, float, float, float], float]] = []
    real = workflows.shared.reconnect_delay

    def recorded(attempt: int, base_s: float, max_s: float, u: float) -> float:
        delay = real(attempt, base_s, max_s, u)
        answers.append(((attempt, base_s, max_s, u), delay))
        return delay

    # The workflow looks the function up in this passed-through module at each reconnect.
    monkeypatch.setattr(workflows.shared, "reconnect_delay", recorded)
    backend = FakeBackend(Script(follow_failures=[ErrorType.CONNECTION_LOST] * 4))
    policy = JobPolicy.model_validate(
        {
            "abandon_after_s": None,
            "heartbeat_timeout_s": 1,
            "reconnect": {"base_delay_s": 3, "max_delay_s": 10},
        }
    )
    async with job_worker(env.client, backend) as tq:
        handle = await start_job(env.client, tq, JobRequest(graph=GRAPH, policy=policy))
        await handle.result()
        status = JobStatus.model_validate(await handle.query(QUERY_STATUS))
        timers = [
            event.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta()
            async for event in handle.fetch_history_events()
            if event.event_type == EventType.EVENT_TYPE_TIMER_STARTED
            and _summary(event).startswith("reconnect")
        ]
    # A replay (a query, a cache eviction) asks again with the same draw: count each once.
    answers = list(dict.fromkeys(answers))
    assert status.state == JobState.COMPLETED and status.reconnects == 4
    assert [args[:3] for args, _ in answers] == [(n, 3.0, 10.0) for n in range(4)]
    draws = [args[3] for args, _ in answers]
    assert len(set(draws)) == 4 and all(0.0 <= u < 1.0 for u in draws), "a fresh draw each time"
    assert [t.total_seconds() for t in timers] == pytest.approx([d for _, d in answers], abs=1e-3)


def _summary(event: Any) -> str:
    if not event.user_metadata.HasField("summary"):
        return ""
    return str(
        pydantic_data_converter.payload_converter.from_payload(event.user_metadata.summary, str)
    )
