"""The worker's reads of a tenant's ledger (activities/budgets.py), against a faked Temporal
client: a tenant without a budget asks nothing; the first job of one starts its ledger with the
worker's limits; limits that differ are told again; over budget, a hold until the reset; a
ledger that does not answer fails the check retryably, never lets the job through."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import ActivityEnvironment

from activities.budgets import BudgetActivities
from configuration.tenants import TenantConfig
from workflows.budgets import BudgetUsage, Spent
from workflows.shared import ErrorType, ledger_id

TENANTS = {"acme": TenantConfig(gpu_seconds_per_day=30)}


class FakeTemporal:
    """The ledger's query answers `answers` in turn (an exception is raised); every start
    (signal-with-start) is recorded."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.queried: list[str] = []
        self.started: list[dict[str, Any]] = []

    def get_workflow_handle(self, workflow_id: str) -> Any:
        temporal = self

        class Handle:
            async def query(self, *_args: Any, **_kwargs: Any) -> Any:
                temporal.queried.append(workflow_id)
                answer = temporal.answers.pop(0)
                if isinstance(answer, BaseException):
                    raise answer
                return answer

        return Handle()

    async def start_workflow(self, *args: Any, **kwargs: Any) -> None:
        self.started.append(kwargs)


def usage(gpu_s: float, limit: float | None = 30.0, **fields: Any) -> BudgetUsage:
    return BudgetUsage(
        tenant="acme",
        gpu_s=gpu_s,
        gpu_seconds_per_day=limit,
        resets_at=datetime.now(UTC) + timedelta(hours=1),
        **fields,
    )


async def check(temporal: FakeTemporal, tenant: str = "acme") -> tuple[Any, Any]:
    budgets = BudgetActivities(temporal, TENANTS, 86400.0)  # type: ignore[arg-type]
    return await ActivityEnvironment().run(budgets.check, tenant, "j", "gpu")


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(asyncio, "sleep", _no_sleep)


async def _no_sleep(_seconds: float) -> None:
    return None


async def test_a_tenant_without_a_budget_asks_nothing() -> None:
    temporal = FakeTemporal()
    assert await check(temporal, "free") == (None, None)
    assert temporal.queried == [] and temporal.started == []


async def test_the_first_job_starts_the_ledger_with_the_workers_limits() -> None:
    temporal = FakeTemporal(RPCError("not found", RPCStatusCode.NOT_FOUND, b""))
    assert await check(temporal) == ("acme", None)
    [started] = temporal.started
    assert started["id"] == ledger_id("acme") and started["start_signal"] == "limits"
    [limits] = started["start_signal_args"]
    assert (limits.tenant, limits.gpu_seconds_per_day, limits.day_s) == ("acme", 30.0, 86400.0)


async def test_within_budget_runs_and_limits_that_differ_are_told() -> None:
    temporal = FakeTemporal(usage(10.0), usage(10.0, limit=20.0))
    assert await check(temporal) == ("acme", None)
    assert temporal.started == [], "the same limits: nothing to tell"
    assert await check(temporal) == ("acme", None)
    assert len(temporal.started) == 1, "the ledger had other limits"


async def test_over_budget_holds_until_the_reset() -> None:
    over = usage(31.0)
    tenant, hold = await check(FakeTemporal(over))
    assert tenant == "acme" and hold is not None
    assert (hold.resets_at, hold.pool) == (over.resets_at, "gpu")
    assert "31.0 of its 30 GPU-seconds" in hold.reason


async def test_a_ledger_that_does_not_answer_fails_the_check_retryably() -> None:
    busy = RPCError("busy", RPCStatusCode.RESOURCE_EXHAUSTED, b"")
    with pytest.raises(ApplicationError) as caught:
        await check(FakeTemporal(*[busy] * 5))
    assert caught.value.type == ErrorType.BUDGET_UNKNOWN and not caught.value.non_retryable
    late = RPCError("deadline", RPCStatusCode.DEADLINE_EXCEEDED, b"")
    temporal = FakeTemporal(late)
    with pytest.raises(ApplicationError) as caught:
        await check(temporal)
    assert "no answer in time" in caught.value.message and len(temporal.queried) == 1
    # Answered on a later try: the check goes on.
    assert await check(FakeTemporal(busy, usage(1.0))) == ("acme", None)


async def test_a_spend_whose_ledger_is_gone_starts_it_again() -> None:
    temporal = FakeTemporal()
    budgets = BudgetActivities(temporal, TENANTS, 20.0)  # type: ignore[arg-type]
    spent = Spent(job_id="j", gpu_s=12.0)
    await ActivityEnvironment().run(budgets.record_spend, "acme", spent)
    [started] = temporal.started
    assert started["start_signal"] == "spent" and started["start_signal_args"] == [spent]
