"""The gateway's side of bounded pools, without a stack: `priority` and `policy.start_by_s` in a
submission (and their 422s), `QueueFull` as 429 with the queue's own Retry-After, a PENDING
job's `admission` in the job's view (without the tenant), a pool's queue as one tenant may see
it (`GET /v1/pools/{pool}/queue` on the app, its client faked), EXPIRED among the page's end
states, and the jobs-in-flight default that lets a tenant queue a batch of a thousand."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import httpx
import pytest

from configuration.settings import GatewaySettings, LimitSettings
from gateway.app import create_app
from gateway.errors import (
    QUEUE_FULL_RETRY_AFTER_S,
    ApiError,
    LimitExceeded,
    QueueFull,
    api_error_for,
)
from gateway.submission import job_request
from gateway.views import JobFacts, JobViews, etag, queue_view
from starter import JobClient
from starter import errors as client_errors
from tests.support.cli import example
from tests.support.gateway import KEYS, TEST_SETTINGS, RunningGateway
from workflows.admission import Admission, PoolQueueView, QueueEntry
from workflows.contracts import JobRequest, JobState, JobStatus

NOW = datetime(2026, 12, 7, 12, 0, 0, tzinfo=UTC)
REASON = "tenant 'acme' has 5 jobs waiting for pool 'gpu', its max_pending is 5"


def body(**fields: Any) -> dict[str, Any]:
    return {"graph": example(4), "pool": "gpu", **fields}


# --- priority and start_by_s ------------------------------------------------------------------


def test_priority_and_start_by_s_pass_through_to_the_request() -> None:
    request, detached = job_request(body(priority=1, policy={"start_by_s": 30}), "acme")
    assert (request.priority, request.policy.start_by_s, detached) == (1, 30.0, True)
    assert request.labels["tenant"] == "acme"
    plain, _ = job_request(body(), "acme")
    assert (plain.priority, plain.policy.start_by_s) == (3, None)


@pytest.mark.parametrize("priority", [0, 6, -1, "2", 2.0, True, None])
def test_a_bad_priority_is_422_naming_the_field_and_its_range(priority: Any) -> None:
    with pytest.raises(ApiError) as refused:
        job_request(body(priority=priority), "acme")
    error = refused.value
    assert (error.status_code, error.error_type) == (422, "InvalidRequest")
    [problem] = error.extra["problems"]
    assert problem["loc"] == ["priority"], problem
    assert "from 1 (starts first) to 5 (starts last), 3 when left out" in problem["message"]
    assert error.message.startswith("priority: "), error.message


@pytest.mark.parametrize("start_by_s", [0, -5, "30", "soon"])
def test_a_bad_start_by_s_is_422_naming_the_field(start_by_s: Any) -> None:
    with pytest.raises(ApiError) as refused:
        job_request(body(policy={"start_by_s": start_by_s}), "acme")
    [problem] = refused.value.extra["problems"]
    assert problem["loc"] == ["policy", "start_by_s"], problem
    assert "else the job ends EXPIRED" in problem["message"], problem


def test_other_problems_keep_their_own_words() -> None:
    with pytest.raises(ApiError) as refused:
        job_request(body(priority=9, policy={"execution_timeout_s": "x"}), "acme")
    problems = {tuple(p["loc"]): p["message"] for p in refused.value.extra["problems"]}
    assert "starts first" in problems[("priority",)]
    assert "starts first" not in problems[("policy", "execution_timeout_s")]


# --- QueueFull --------------------------------------------------------------------------------


@pytest.mark.parametrize(("estimate", "header"), [(2.3, "3"), (0.2, "1"), (60.0, "60")])
def test_queue_full_is_429_with_the_queues_wait_rounded_up(estimate: float, header: str) -> None:
    refused = client_errors.QueueFull("gpu", "acme", REASON, estimate)
    error = api_error_for(refused)
    assert (error.status_code, error.error_type) == (429, "QueueFull")
    assert error.headers == {"Retry-After": header}
    # The client library's words, as the CLI prints them.
    assert error.message == str(refused)
    assert error.message.startswith(f"queue full: {REASON}; nothing was started")
    assert error.body()["error"] == {
        "type": "QueueFull",
        "message": str(refused),
        "pool": "gpu",
        "reason": REASON,
        "retry_after_s": estimate,
    }


def test_queue_full_without_an_estimate_asks_for_the_documented_fallback() -> None:
    error = api_error_for(client_errors.QueueFull("gpu", "acme", REASON, None))
    assert error.status_code == 429
    assert error.headers == {"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)}
    assert error.message.endswith("nothing was started, try again later")
    assert error.body()["error"]["retry_after_s"] is None


def test_the_gateways_queue_full_is_a_limit_like_too_many_jobs() -> None:
    mine = QueueFull.of(client_errors.QueueFull("gpu", "acme", REASON, 4.01))
    assert isinstance(mine, LimitExceeded) and mine.retry_after_s == 5
    assert (
        api_error_for(mine).body()
        == api_error_for(client_errors.QueueFull("gpu", "acme", REASON, 4.01)).body()
    )


def test_no_queue_for_a_pool_is_404_saying_why() -> None:
    error = api_error_for(client_errors.NoPoolQueue("gpu"))
    assert (error.status_code, error.error_type) == (404, "NoPoolQueue")
    assert "pool 'gpu'" in error.message and "max_running" in error.message
    assert error.extra == {"pool": "gpu"}


def test_the_jobs_in_flight_default_lets_a_tenant_queue_a_batch_of_a_thousand(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DURABLE_COMFY_TENANT_MAX_JOBS", raising=False)
    monkeypatch.delenv("DURABLE_COMFY_SETTINGS_FILE", raising=False)
    assert LimitSettings().tenant_max_jobs == 2000


# --- the job's admission ----------------------------------------------------------------------

ADMISSION = Admission(
    pool="gpu",
    job_id="acme.1",
    position=12,
    ahead=11,
    waiting=40,
    priority=2,
    tenant="acme",
    eta_s=180.0,
    as_of=NOW,
)
PENDING = JobStatus(job_id="acme.1", state=JobState.PENDING, seq=4, admission=ADMISSION)


async def test_a_pending_jobs_view_carries_its_admission_without_the_tenant() -> None:
    views = JobViews(cast(JobClient, None), JobFacts())
    view = await views.status(PENDING)
    assert view["state"] == "PENDING" and view["terminal"] is False
    assert view["admission"] == {
        "pool": "gpu",
        "granted": False,
        "position": 12,
        "ahead": 11,
        "waiting": 40,
        "priority": 2,
        "eta_s": 180.0,
        "as_of": "2026-12-07T12:00:00Z",
        # Set for a job its tenant's daily budget holds (docs/queue.md, "Budgets").
        "held": None,
        "resets_at": None,
        # A pool of many servers, a group's failover (docs/pools.md).
        "server": None,
        "unhealthy": None,
        "note": None,
        "moves": [],
    }
    assert "live_progress" not in view
    # A job on an unbounded pool has none.
    plain = await views.status(JobStatus(job_id="acme.2", state=JobState.RUNNING))
    assert plain["admission"] is None
    # Nobody's tenant moves the tag: it is not part of what the client is shown.
    other = PENDING.model_copy(update={"admission": ADMISSION.model_copy(update={"tenant": "x"})})
    assert etag(other) == etag(PENDING)


def test_an_expired_jobs_status_in_an_error_body_is_terminal_without_the_tenant() -> None:
    expired = PENDING.model_copy(update={"state": JobState.EXPIRED, "seq": 6})
    error = api_error_for(client_errors.JobAlreadyEnded("acme.1", expired, "nothing to cancel"))
    status = error.body()["error"]["status"]
    assert (status["state"], status["terminal"]) == ("EXPIRED", True)
    assert "tenant" not in status["admission"]


# --- a pool's queue as one tenant sees it -----------------------------------------------------


def entry(job_id: str, tenant: str, state: str, position: int | None, age_s: float) -> QueueEntry:
    return QueueEntry(
        job_id=job_id,
        tenant=tenant,
        priority=2 if position == 1 else 3,
        state=state,
        position=position,
        since=NOW - timedelta(seconds=age_s),
        detail="teardown FAILED: the prompt may still run" if state == "unsettled" else "",
    )


VIEW = PoolQueueView(
    pool="gpu",
    max_running=3,
    running=3,
    waiting=4,
    entries=[
        entry("beta.secret-1", "beta", "waiting", 1, 5),
        entry("acme.w2", "acme", "waiting", 2, 40),
        entry("beta.secret-2", "beta", "waiting", 3, 4),
        entry("acme.w4", "acme", "waiting", 4, 30),
        entry("acme.r1", "acme", "running", None, 61.25),
        entry("beta.secret-3", "beta", "running", None, 12),
        entry("acme.u1", "acme", "unsettled", None, 300),
    ],
    tenants={"beta": (2, 1), "acme": (2, 2)},
    eta_s_per_start=20.04,
)


def test_a_tenant_sees_its_own_jobs_and_only_totals_of_everyone_elses() -> None:
    shown = queue_view(VIEW, "acme", NOW)
    assert [(j["job_id"], j["state"], j["position"]) for j in shown["jobs"]] == [
        ("acme.w2", "waiting", 2),
        ("acme.w4", "waiting", 4),
        ("acme.u1", "unsettled", None),
        ("acme.r1", "running", None),
    ]
    first = shown["jobs"][0]
    assert (first["priority"], first["age_s"], first["eta_s"]) == (3, 40.0, 40.1)
    assert shown["jobs"][3]["age_s"] == 61.2 and shown["jobs"][3]["eta_s"] is None
    assert "teardown FAILED" in shown["jobs"][2]["detail"]
    assert {k: v for k, v in shown.items() if k != "jobs"} == {
        "pool": "gpu",
        "max_running": 3,
        "running": 3,
        "waiting": 4,
        "eta_s_per_start": 20.0,
        "eta_s": 80.2,
        "mine": {"waiting": 2, "running": 2},
        "others": {"waiting": 2, "running": 1},
    }
    text = json.dumps(shown)
    assert "beta" not in text and "secret" not in text, text


def test_a_tenant_with_nothing_in_the_queue_sees_totals_only() -> None:
    shown = queue_view(VIEW.model_copy(update={"eta_s_per_start": None}), "gamma", NOW)
    assert shown["jobs"] == [] and shown["mine"] == {"waiting": 0, "running": 0}
    assert shown["others"] == {"waiting": 4, "running": 3}
    assert shown["eta_s"] is None and shown["eta_s_per_start"] is None
    assert "acme" not in json.dumps(shown) and "beta" not in json.dumps(shown)


class QueueClient:
    """What the route asks of `JobClient`: the pool's queue."""

    query_timeout = timedelta(seconds=0.5)

    store = None  # no bucket: the request's output is left to the worker's check

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.started: list[JobRequest] = []

    async def start(self, job: JobRequest, **_: Any) -> Any:
        self.started.append(job)
        raise AssertionError("a refused job is never started")

    async def pool_queue(self, pool: str) -> PoolQueueView:
        self.asked.append(pool)
        if pool == "gpu":
            return VIEW
        if pool == "stuck":
            await asyncio.sleep(5)
        raise client_errors.NoPoolQueue(pool)


@pytest.fixture
async def app_http() -> AsyncIterator[tuple[httpx.AsyncClient, QueueClient]]:
    keys = ",".join(f"{tenant}:{key}" for tenant, key in KEYS.items())
    # acme may ask for 2 at best; everyone else for 4 (the `default` entry).
    tenants = '{"acme": {"max_priority": 2}, "default": {"max_priority": 4}}'
    settings = GatewaySettings(
        **{"DURABLE_COMFY_API_KEYS": keys, "DURABLE_COMFY_TENANTS": tenants, **TEST_SETTINGS}  # type: ignore[arg-type]
    )
    fake = QueueClient()

    async def never() -> JobClient:
        raise AssertionError("the test sets the client")

    app = create_app(settings, never)
    app.state.gateway._client = cast(JobClient, fake)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        yield http, fake


async def test_the_queue_route_answers_the_callers_view(
    app_http: tuple[httpx.AsyncClient, QueueClient],
) -> None:
    http, _ = app_http
    mine = await http.get("/v1/pools/gpu/queue", headers=RunningGateway.auth("acme"))
    assert mine.status_code == 200, mine.text
    assert [j["job_id"] for j in mine.json()["jobs"]] == [
        "acme.w2",
        "acme.w4",
        "acme.u1",
        "acme.r1",
    ]
    theirs = await http.get("/v1/pools/gpu/queue", headers=RunningGateway.auth("beta"))
    assert [j["job_id"] for j in theirs.json()["jobs"]] == [
        "beta.secret-1",
        "beta.secret-2",
        "beta.secret-3",
    ]
    assert theirs.json()["others"] == {"waiting": 2, "running": 2}
    assert "acme" not in theirs.text


async def test_the_queue_route_refuses_without_a_key_and_names_a_missing_queue(
    app_http: tuple[httpx.AsyncClient, QueueClient],
) -> None:
    http, fake = app_http
    nobody = await http.get("/v1/pools/gpu/queue")
    assert nobody.status_code == 401 and nobody.json()["error"]["type"] == "Unauthorized"
    missing = await http.get("/v1/pools/cpu/queue", headers=RunningGateway.auth("acme"))
    assert missing.status_code == 404, missing.text
    error = missing.json()["error"]
    assert error["type"] == "NoPoolQueue" and error["pool"] == "cpu"
    assert "no queue runs for pool 'cpu'" in error["message"]
    bad = await http.get("/v1/pools/a%20b/queue", headers=RunningGateway.auth("acme"))
    assert bad.status_code == 422 and bad.json()["error"]["problems"][0]["loc"] == ["path", "pool"]
    stuck = await http.get("/v1/pools/stuck/queue", headers=RunningGateway.auth("acme"))
    assert stuck.status_code == 503, stuck.text
    assert stuck.json()["error"]["type"] == "PoolQueueUnanswered"
    assert stuck.headers["retry-after"] == "5"
    # Refused before the queue was asked: no key, a bad name.
    assert fake.asked == ["cpu", "stuck"]


async def test_the_config_ends_on_expired_and_the_openapi_shows_the_new_fields(
    app_http: tuple[httpx.AsyncClient, QueueClient],
) -> None:
    http, _ = app_http
    config = (await http.get("/v1/config")).json()
    assert "EXPIRED" in config["terminal_states"] and "PENDING" not in config["terminal_states"]
    document = (await http.get("/openapi.json")).json()
    assert "/v1/pools/{pool}/queue" in document["paths"]
    submission = document["components"]["schemas"]["JobSubmission"]
    assert submission["properties"]["priority"]["minimum"] == 1
    assert submission["properties"]["priority"]["maximum"] == 5
    policy = document["components"]["schemas"]["JobPolicy"]
    assert "start_by_s" in policy["properties"]


@pytest.mark.parametrize(("tenant", "priority", "best"), [("acme", 1, 2), ("beta", 3, 4)])
async def test_a_priority_better_than_the_tenants_best_is_403_and_nothing_starts(
    app_http: tuple[httpx.AsyncClient, QueueClient], tenant: str, priority: int, best: int
) -> None:
    http, fake = app_http
    refused = await http.post(
        "/v1/jobs", json=body(priority=priority), headers=RunningGateway.auth(tenant)
    )
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert error["type"] == "PriorityNotAllowed"
    assert (
        f"priority {priority} is not allowed for tenant {tenant!r}: its best is {best}"
        in (error["message"])
    )
    assert fake.started == []
