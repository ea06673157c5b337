"""Tenants, keys and limits over real HTTP (docs/http-api.md: Authentication, Errors 401, 404,
429, 503): uvicorn in this process in front of the local stack, its keys from a keys file (plain
and hashed entries, per-tenant limits).

Two gateways: one in front of a worker, whose jobs run; one in front of a task queue no worker
serves, whose jobs stay QUEUED (in flight for as long as the test needs) and whose replica
limits are one request and one stream at a time.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import structlog
import typer
import websockets
from temporalio.client import Client
from typer.testing import CliRunner

from configuration.settings import GatewaySettings
from devstack.models import RunningStack
from gateway import cli
from gateway.auth import hash_key
from gateway.limits import Limits, jobs_in_flight_query
from starter import JobClient, JobRequest
from tests.support.cli import RunningWorker, example, s3_settings
from tests.support.gateway import TEST_SETTINGS, job_body, serving_app

KEYS = {tenant: f"{tenant}-{uuid.uuid4().hex}" for tenant in ("acme", "beta", "slow", "few")}
# acme's and few's lines hold only hashes; slow and few have limits of their own.
KEYS_FILE = (
    "# the test's tenants\n"
    f"acme:sha256:{hash_key(KEYS['acme'])}\n"
    f"beta:{KEYS['beta']}\n"
    f"slow:{KEYS['slow']} rps=0.01 burst=3   # a token every 100 s\n"
    f"few:sha256:{hash_key(KEYS['few'])} max_jobs=2\n"
)
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "ABANDONED")


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


class Gateway:
    def __init__(
        self, url: str, client: Callable[[], Awaitable[JobClient]], limits: Limits
    ) -> None:
        self.url = url
        self.ws_url = url.replace("http://", "ws://")
        self.connect_client = client
        self.limits = limits


@asynccontextmanager
async def serving(
    factory: Callable[[], Awaitable[JobClient]], keys_file: Path, **settings: Any
) -> AsyncIterator[Gateway]:
    """The gateway on a free port with these keys and settings, stopped on the way out."""
    values = {**TEST_SETTINGS, "DURABLE_COMFY_API_KEYS_FILE": str(keys_file), **settings}
    async with serving_app(GatewaySettings.model_validate(values), factory) as running:
        yield Gateway(running.url, factory, running.state.limits)


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gateway-keys") / "keys"
    path.write_text(KEYS_FILE)
    path.chmod(0o600)
    return path


def client_factory(
    stack: RunningStack, task_queue: str, query_timeout_s: float = 10.0
) -> Callable[[], Awaitable[JobClient]]:
    async def connect() -> JobClient:
        return await JobClient.connect(
            stack.temporal_address,
            stack.namespace,
            task_queue=task_queue,
            s3=s3_settings(stack),
            query_timeout_s=query_timeout_s,
        )

    return connect


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def working(
    local_stack: RunningStack, worker: RunningWorker, keys_file: Path
) -> AsyncIterator[Gateway]:
    """In front of a worker: jobs run to their end."""
    async with serving(client_factory(local_stack, worker.task_queue), keys_file) as gateway:
        yield gateway


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def idle(local_stack: RunningStack, keys_file: Path) -> AsyncIterator[Gateway]:
    """In front of a queue nobody serves (jobs stay QUEUED; a status query waits its whole
    timeout), allowing one request and one stream at a time."""
    queue = f"gw-no-worker-{uuid.uuid4().hex[:8]}"
    async with serving(
        client_factory(local_stack, queue, query_timeout_s=120),
        keys_file,
        DURABLE_COMFY_GATEWAY_MAX_REQUESTS=1,
        DURABLE_COMFY_GATEWAY_MAX_STREAMS=1,
    ) as gateway:
        client = await gateway.connect_client()
        try:
            yield gateway
        finally:
            # Nothing of this module stays open on the dev server.
            query = f'TaskQueue = "{queue}" AND ExecutionStatus = "Running"'
            async for execution in client.temporal.list_workflows(query):
                await client.temporal.get_workflow_handle(execution.id).terminate("test over")
            await client.close()


def assert_error(answer: httpx.Response, status: int, error_type: str) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"].startswith("application/json")
    error: dict[str, Any] = answer.json()["error"]
    assert error["type"] == error_type and error["message"]
    return error


async def seen_by_visibility(temporal: Client, query: str, count: int) -> None:
    """Visibility follows the jobs shortly after they start: wait until it counts them."""
    for _ in range(100):
        if (await temporal.count_workflows(query)).count >= count:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"visibility never counted {count} for {query}")


# --- keys ------------------------------------------------------------------------------------


async def test_no_key_a_wrong_key_or_a_malformed_header_is_401_json_on_every_route(
    working: Gateway, http: httpx.AsyncClient
) -> None:
    job_id = f"acme.{uuid.uuid4().hex}"
    routes = [
        ("GET", "/v1/jobs"),
        ("POST", "/v1/jobs"),
        ("GET", f"/v1/jobs/{job_id}"),
        ("GET", f"/v1/jobs/{job_id}/events"),
        ("GET", f"/v1/jobs/{job_id}/artifacts"),
        ("POST", f"/v1/jobs/{job_id}/cancel"),
        ("POST", f"/v1/jobs/{job_id}/resume"),
    ]
    wrong = f"acme-{uuid.uuid4().hex}"
    headers: list[dict[str, str]] = [
        {},
        {"Authorization": f"Bearer {wrong}"},
        {"Authorization": f"Basic {KEYS['acme']}"},
        # The hash a keys file holds is not a key.
        {"Authorization": f"Bearer sha256:{hash_key(KEYS['acme'])}"},
        {"Authorization": f"Bearer {hash_key(KEYS['acme'])}"},
    ]
    with structlog.testing.capture_logs() as logs:
        for method, route in routes:
            for header in headers:
                answer = await http.request(
                    method, working.url + route, headers=header, json=job_body()
                )
                error = assert_error(answer, 401, "Unauthorized")
                assert answer.headers["www-authenticate"] == "Bearer"
                assert wrong not in error["message"] and KEYS["acme"] not in error["message"]
    assert wrong not in str(logs) and KEYS["acme"] not in str(logs)

    for header in headers:
        async with websockets.connect(
            f"{working.ws_url}/v1/jobs/{job_id}/ws", additional_headers=header
        ) as ws:
            if not header:  # a browser's way: the key as the first message, here none
                await ws.send(json.dumps({"hello": "there"}))
            message = json.loads(await ws.recv())
            assert (
                message["event"] == "error" and message["data"]["error"]["type"] == "Unauthorized"
            )
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
        assert ws.close_code == 4401


async def test_plain_and_hashed_keys_from_the_file_let_their_tenants_in(
    working: Gateway, http: httpx.AsyncClient
) -> None:
    for tenant in ("acme", "beta"):
        answer = await http.get(f"{working.url}/v1/jobs", headers=auth(tenant))
        assert answer.status_code == 200, answer.text


# --- another tenant's job, and a job of none -------------------------------------------------


async def not_found_everywhere(
    gateway: Gateway, http: httpx.AsyncClient, job_id: str, tenant: str
) -> None:
    """Every route of `job_id` answers `tenant` as if there were no such job."""
    base = f"{gateway.url}/v1/jobs/{job_id}"
    for method, path in (
        ("GET", ""),
        ("GET", "/events"),
        ("GET", "/events?since=0"),
        ("GET", "/artifacts"),
        ("POST", "/cancel"),
        ("POST", "/resume"),
    ):
        answer = await http.request(method, base + path, headers=auth(tenant))
        error = assert_error(answer, 404, "JobNotFound")
        assert error["job_id"] == job_id
    async with websockets.connect(
        f"{gateway.ws_url}/v1/jobs/{job_id}/ws?since=0", additional_headers=auth(tenant)
    ) as ws:
        message = json.loads(await ws.recv())
        assert message["data"]["error"]["type"] == "JobNotFound"
        with pytest.raises(websockets.ConnectionClosed):
            await ws.recv()
    assert ws.close_code == 4404
    listed = await http.get(f"{gateway.url}/v1/jobs?page_size=200", headers=auth(tenant))
    assert listed.status_code == 200
    assert job_id not in [job["job_id"] for job in listed.json()["jobs"]]


async def test_another_tenants_job_is_not_found_and_not_touched(
    working: Gateway, http: httpx.AsyncClient
) -> None:
    submitted = await http.post(f"{working.url}/v1/jobs", json=job_body(), headers=auth("acme"))
    assert submitted.status_code == 201, submitted.text
    job_id = submitted.json()["job_id"]
    client = await working.connect_client()
    try:
        await seen_by_visibility(client.temporal, f'WorkflowId = "{job_id}"', 1)
    finally:
        await client.close()

    await not_found_everywhere(working, http, job_id, "beta")

    # beta's cancel did nothing: the job runs to its end, and acme lists it.
    for _ in range(600):
        view = (await http.get(f"{working.url}/v1/jobs/{job_id}", headers=auth("acme"))).json()
        if view["state"] in ENDED:
            break
        await asyncio.sleep(0.2)
    assert view["state"] == "COMPLETED", view
    listed = await http.get(f"{working.url}/v1/jobs?page_size=200", headers=auth("acme"))
    assert job_id in [job["job_id"] for job in listed.json()["jobs"]]


async def test_a_job_started_without_a_tenant_is_nobodys(
    working: Gateway, worker: RunningWorker, http: httpx.AsyncClient
) -> None:
    """Started with JobClient and no `tenant` label: no tenant of the gateway sees it."""
    status = await worker.client.submit(JobRequest(graph=example()))
    await seen_by_visibility(worker.client.temporal, f'WorkflowId = "{status.job_id}"', 1)
    for tenant in ("acme", "beta"):
        await not_found_everywhere(working, http, status.job_id, tenant)
    assert (await worker.client.result(status.job_id)).state.value == "COMPLETED"


# --- per-tenant limits -----------------------------------------------------------------------


async def test_over_its_requests_per_second_a_tenant_gets_429_with_retry_after(
    working: Gateway, http: httpx.AsyncClient
) -> None:
    """`slow` has a burst of 3 and a token every 100 s (its line in the keys file)."""
    jobs = f"{working.url}/v1/jobs"
    for _ in range(3):
        assert (await http.get(jobs, headers=auth("slow"))).status_code == 200
    refused = await http.get(jobs, headers=auth("slow"))
    error = assert_error(refused, 429, "RateLimited")
    assert "slow" in error["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 100
    # Every route counts, streams too; the WebSocket closes with 4429.
    assert_error(await http.get(f"{jobs}/slow.x/events", headers=auth("slow")), 429, "RateLimited")
    async with websockets.connect(
        f"{working.ws_url}/v1/jobs/slow.x/ws", additional_headers=auth("slow")
    ) as ws:
        assert json.loads(await ws.recv())["data"]["error"]["type"] == "RateLimited"
        with pytest.raises(websockets.ConnectionClosed):
            await ws.recv()
    assert ws.close_code == 4429
    # Other tenants have buckets of their own.
    assert (await http.get(jobs, headers=auth("beta"))).status_code == 200


async def test_over_its_jobs_in_flight_a_tenant_gets_429_too_many_jobs(
    idle: Gateway, http: httpx.AsyncClient
) -> None:
    """`few` may have 2 jobs in flight; the idle gateway's jobs stay QUEUED."""
    jobs = f"{idle.url}/v1/jobs"
    for _ in range(2):
        answer = await http.post(jobs, json=job_body(), headers=auth("few"))
        assert answer.status_code == 201, answer.text
    client = await idle.connect_client()
    try:
        await seen_by_visibility(client.temporal, jobs_in_flight_query("few"), 2)
    finally:
        await client.close()

    refused = await http.post(jobs, json=job_body(), headers=auth("few"))
    error = assert_error(refused, 429, "TooManyJobs")
    assert "2 jobs in flight, its limit is 2" in error["message"]
    assert refused.headers["retry-after"] == "5"
    # Another tenant is not held back by few's jobs.
    assert (await http.post(jobs, json=job_body(), headers=auth("beta"))).status_code == 201


# --- the replica's limits --------------------------------------------------------------------


async def test_over_its_concurrent_requests_the_gateway_answers_503_until_one_ends(
    idle: Gateway, http: httpx.AsyncClient
) -> None:
    """The idle gateway serves one request at a time: a submission whose body is still on its
    way holds it."""
    release = asyncio.Event()
    body = json.dumps(job_body()).encode()

    async def slowly() -> AsyncIterator[bytes]:
        yield body[:10]
        await release.wait()
        yield body[10:]

    headers = auth("acme") | {"Content-Type": "application/json"}
    async with httpx.AsyncClient(trust_env=False, timeout=60) as other:
        # Another client (its own connection): one pool would queue our requests behind it.
        holding = asyncio.create_task(
            other.post(f"{idle.url}/v1/jobs", content=slowly(), headers=headers)
        )
        try:
            # Until the submission is in (it holds the one slot), a GET could take the slot.
            for _ in range(200):
                if idle.limits.requests_open == 1:
                    break
                await asyncio.sleep(0.05)
            refused = await http.get(f"{idle.url}/v1/jobs", headers=auth("beta"))
            error = assert_error(refused, 503, "Overloaded")
            assert "1 requests open" in error["message"]
            assert refused.headers["retry-after"] == "1"
        finally:
            release.set()
        assert (await holding).status_code == 201
    assert (await http.get(f"{idle.url}/v1/jobs", headers=auth("beta"))).status_code == 200


async def test_over_its_open_streams_the_gateway_answers_503_until_one_closes(
    idle: Gateway, http: httpx.AsyncClient
) -> None:
    """One stream at a time: a stream of a job nobody answers for stays open."""
    submitted = await http.post(f"{idle.url}/v1/jobs", json=job_body(), headers=auth("beta"))
    assert submitted.status_code == 201, submitted.text
    events = f"{idle.url}/v1/jobs/{submitted.json()['job_id']}/events"
    async with http.stream("GET", events, headers=auth("beta")) as first:
        assert first.status_code == 200
        lines = first.aiter_lines()
        assert (await anext(lines)).startswith("retry:")

        # Streamed, not read whole: a stream let in would wait for a status nobody gives.
        async with http.stream("GET", events, headers=auth("beta")) as refused:
            assert refused.status_code == 503
            await refused.aread()
            assert_error(refused, 503, "Overloaded")
            assert refused.headers["retry-after"] == "1"
        ws_url = events.replace("http://", "ws://").replace("/events", "/ws")
        async with websockets.connect(ws_url, additional_headers=auth("beta")) as ws:
            # A guard, not a measure: a socket let in would wait as long for its first message.
            async with asyncio.timeout(30):
                first_message = json.loads(await ws.recv())
            assert first_message["data"]["error"]["type"] == "Overloaded"
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
        assert ws.close_code == 4503
        # Requests that are not streams are counted apart.
        assert (await http.get(f"{idle.url}/v1/jobs", headers=auth("beta"))).status_code == 200

    # The first stream closed: its slot comes back once the gateway sees it gone.
    for _ in range(200):
        async with http.stream("GET", events, headers=auth("beta")) as again:
            if again.status_code == 200:
                break
            await again.aread()
            assert_error(again, 503, "Overloaded")
        await asyncio.sleep(0.05)
    assert again.status_code == 200


# --- starting ---------------------------------------------------------------------------------


def gateway_command(
    args: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, str]:
    """`durable-comfy gateway ARGS`, stopped before it would serve: a check that let it
    through must not leave it listening (on 0.0.0.0 at that)."""

    def refused_to_serve(*args: object, **kwargs: object) -> None:
        raise AssertionError("the gateway got past its checks and would serve")

    monkeypatch.setattr(cli, "create_app", refused_to_serve)
    app = typer.Typer()
    app.command()(cli.command)
    result = CliRunner().invoke(app, args, env=env)
    return result.exit_code, result.output


def test_without_keys_the_gateway_refuses_to_listen_beyond_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    unset = {"DURABLE_COMFY_API_KEYS": "", "DURABLE_COMFY_API_KEYS_FILE": ""}
    code, output = gateway_command(["--host", "0.0.0.0", "--port", "1"], unset, monkeypatch)
    assert code == 2
    assert "loopback address only" in output and "DURABLE_COMFY_API_KEYS" in output


def test_a_bad_keys_entry_stops_the_gateway_naming_it_not_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "keys"
    secret = f"pasted-{uuid.uuid4().hex}"
    path.write_text(f"acme:{KEYS['acme']}\n{secret}\n")
    path.chmod(0o600)
    env = {"DURABLE_COMFY_API_KEYS": "", "DURABLE_COMFY_API_KEYS_FILE": str(path)}
    code, output = gateway_command(["--host", "127.0.0.1", "--port", "1"], env, monkeypatch)
    assert code == 2
    assert f"{path} line 2" in output
    assert secret not in output and KEYS["acme"] not in output
