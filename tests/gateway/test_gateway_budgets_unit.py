"""The gateway's side of tenants' daily budgets, without a stack: `BudgetExceeded` as 429 with a
Retry-After until the reset (from `POST /v1/jobs`, the client library's refusal passed on), and
`GET /v1/usage` answering the caller's tenant only (the app's client faked). The CLI's exit code
for the same refusal, and its `tenants` table."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest

from configuration.settings import GatewaySettings
from gateway.app import create_app
from gateway.errors import api_error_for
from starter import JobClient
from starter import errors as client_errors
from starter.cli.common import ExitCode, exit_code_for
from starter.cli.tenants import usage_lines
from tests.support.cli import example
from tests.support.gateway import KEYS, TEST_SETTINGS, RunningGateway
from workflows.budgets import BudgetUsage

REASON = "tenant 'acme' has spent 31.2 of its 30 GPU-seconds today"


def refusal(in_s: float = 100.0) -> client_errors.BudgetExceeded:
    resets = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=in_s)
    return client_errors.BudgetExceeded(
        "acme", REASON, resets, spent_gpu_s=31.2, gpu_seconds_per_day=30.0
    )


def test_budget_exceeded_is_429_with_retry_after_until_the_reset() -> None:
    refused = refusal(100.0)
    assert "resets at" in str(refused) and "UTC" in str(refused)
    assert "nothing was started" in str(refused)
    error = api_error_for(refused)
    assert (error.status_code, error.error_type) == (429, "BudgetExceeded")
    assert 98 <= int(error.headers["Retry-After"]) <= 101
    body = error.body()["error"]
    assert body["tenant"] == "acme" and body["reason"] == REASON
    assert body["resets_at"] == refused.resets_at.isoformat()
    assert body["spent"] == {"gpu_s": 31.2, "usd": 0.0}
    assert body["limits"] == {"gpu_seconds_per_day": 30.0, "usd_per_day": None}
    # Past the reset already (a slow answer): still at least a second.
    assert api_error_for(refusal(-5.0)).headers["Retry-After"] == "1"


def test_the_cli_exits_with_the_capacity_code() -> None:
    assert exit_code_for(refusal()) == ExitCode.QUEUE_FULL and int(ExitCode.QUEUE_FULL) == 5


def test_the_tenants_table() -> None:
    now = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
    over = BudgetUsage(
        tenant="acme",
        gpu_s=31.25,
        usd=0.0125,
        jobs=3,
        gpu_seconds_per_day=30,
        over=True,
        over_budget="refuse",
        resets_at=datetime(2026, 12, 8, tzinfo=UTC),
    )
    within = BudgetUsage(tenant="beta", gpu_s=2.0, usd_per_day=1.5, resets_at=over.resets_at)
    header, acme, beta = usage_lines([over, within], now)
    assert header.split() == ["tenant", "gpu_s", "limit", "usd", "limit", "jobs", "state", "resets"]
    assert acme.split() == [
        "acme",
        "31.2",
        "30",
        "0.0125",
        "-",
        "3",
        "over",
        "(refuse)",
        "00:00",
        "UTC",
    ]
    assert beta.split()[:7] == ["beta", "2.0", "-", "0.0000", "1.5", "0", "within"]
    # A reading of a day that is over says nothing of today.
    [_, stale] = usage_lines([over], datetime(2026, 12, 8, 0, 0, 1, tzinfo=UTC))
    assert "within" in stale


class UsageClient:
    """What the routes ask of `JobClient`: a tenant's ledger, and a start refused over budget."""

    query_timeout = timedelta(seconds=0.5)
    store = None

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.started: list[Any] = []
        # The gateway's count of the tenant's jobs in flight: none.
        self.temporal = SimpleNamespace(count_workflows=self._none_in_flight)

    @staticmethod
    async def _none_in_flight(_query: str) -> Any:
        return SimpleNamespace(count=0)

    @contextmanager
    def translated_errors(self) -> Iterator[None]:
        yield

    async def tenant_usage(self, tenant: str) -> BudgetUsage | None:
        self.asked.append(tenant)
        if tenant != "acme":
            return None
        return BudgetUsage(
            tenant="acme",
            gpu_s=31.2,
            jobs=2,
            gpu_seconds_per_day=30,
            over=True,
            reason=REASON,
            over_budget="refuse",
            day_started_at=datetime.now(UTC) - timedelta(seconds=10),
            resets_at=datetime.now(UTC) + timedelta(seconds=50),
        )

    async def start(self, job: Any, **_: Any) -> Any:
        self.started.append(job)
        raise refusal(50.0)


@pytest.fixture
async def app_http() -> AsyncIterator[tuple[httpx.AsyncClient, UsageClient]]:
    keys = ",".join(f"{tenant}:{key}" for tenant, key in KEYS.items())
    tenants = '{"beta": {"usd_per_day": 2.5}}'
    settings = GatewaySettings(
        **{"DURABLE_COMFY_API_KEYS": keys, "DURABLE_COMFY_TENANTS": tenants, **TEST_SETTINGS}  # type: ignore[arg-type]
    )
    fake = UsageClient()

    async def never() -> JobClient:
        raise AssertionError("the test sets the client")

    app = create_app(settings, never)
    app.state.gateway._client = cast(JobClient, fake)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        yield http, fake


async def test_usage_answers_the_callers_tenant(
    app_http: tuple[httpx.AsyncClient, UsageClient],
) -> None:
    http, fake = app_http
    mine = await http.get("/v1/usage", headers=RunningGateway.auth("acme"))
    assert mine.status_code == 200, mine.text
    shown = mine.json()
    assert (shown["tenant"], shown["gpu_s"], shown["jobs"], shown["over"]) == (
        "acme",
        31.2,
        2,
        True,
    )
    assert shown["limits"] == {"gpu_seconds_per_day": 30.0, "usd_per_day": None}
    assert shown["over_budget"] == "refuse" and shown["reason"] == REASON
    assert shown["resets_at"] is not None
    theirs = await http.get("/v1/usage", headers=RunningGateway.auth("beta"))
    assert theirs.status_code == 200, theirs.text
    shown = theirs.json()
    assert (shown["tenant"], shown["gpu_s"], shown["over"], shown["budgeted"]) == (
        "beta",
        0.0,
        False,
        True,
    )
    assert shown["limits"] == {"gpu_seconds_per_day": None, "usd_per_day": 2.5}
    assert "acme" not in theirs.text
    nobody = await http.get("/v1/usage")
    assert nobody.status_code == 401
    assert fake.asked == ["acme", "beta"]


async def test_a_submission_over_budget_is_429(
    app_http: tuple[httpx.AsyncClient, UsageClient],
) -> None:
    http, fake = app_http
    job = {"graph": example(4), "pool": "gpu"}
    refused = await http.post("/v1/jobs", json=job, headers=RunningGateway.auth("acme"))
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["type"] == "BudgetExceeded" and error["tenant"] == "acme"
    assert 48 <= int(refused.headers["retry-after"]) <= 51
    assert len(fake.started) == 1
