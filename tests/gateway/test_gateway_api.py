"""The gateway's answers over real HTTP (docs/http-api.md): submit and its idempotency, refusals
that name what is wrong, tenants that cannot see each other's jobs, ETags, cancel, list,
readiness. uvicorn in this process, in front of a worker of the local stack."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import websockets

from devstack.free_ports import free_port
from devstack.models import RunningStack
from starter import JobClient
from tests.support.cli import RunningWorker, cli_env, run_cli, start_cli
from tests.support.gateway import (
    KEYS,
    RunningGateway,
    job_body,
    running_gateway,
    sse_events,
    wait_state,
)
from workflows.contracts import TERMINAL_STATES


async def submit(
    http: httpx.AsyncClient,
    gateway: RunningGateway,
    body: dict[str, Any],
    tenant: str = "acme",
    key: str | None = None,
) -> httpx.Response:
    headers = gateway.auth(tenant) | ({"Idempotency-Key": key} if key else {})
    return await http.post(f"{gateway.url}/v1/jobs", json=body, headers=headers)


async def test_the_same_key_and_request_is_the_same_job_and_another_request_conflicts(
    gateway: RunningGateway, http: httpx.AsyncClient
) -> None:
    key = f"order-{uuid.uuid4().hex}"
    body = job_body()
    first = await submit(http, gateway, body, key=key)
    assert first.status_code == 201, first.text
    job_id = first.json()["job_id"]
    assert job_id.startswith("acme.")
    assert first.headers["location"] == f"/v1/jobs/{job_id}"
    assert first.json()["links"]["events"] == f"/v1/jobs/{job_id}/events"

    again = await submit(http, gateway, body, key=key)
    assert again.status_code == 200, again.text
    assert again.json()["job_id"] == job_id

    other = await submit(http, gateway, job_body(), key=key)
    assert other.status_code == 409, other.text
    error = other.json()["error"]
    assert error["type"] == "JobConflict" and error["job_id"] == job_id

    # The same key of another tenant is another job.
    theirs = await submit(http, gateway, body, tenant="beta", key=key)
    assert theirs.status_code == 201 and theirs.json()["job_id"] != job_id

    final = await wait_state(http, gateway, job_id)
    assert final["state"] == "COMPLETED"
    [artifact] = final["artifacts"]
    image = await http.get(artifact["url"])
    assert image.status_code == 200 and image.content.startswith(b"\x89PNG")
    listed = await http.get(f"{gateway.url}/v1/jobs/{job_id}/artifacts", headers=gateway.auth())
    [again_artifact] = listed.json()["artifacts"]
    assert again_artifact["sha256"] == artifact["sha256"]
    assert (await http.get(again_artifact["url"])).content == image.content


async def test_refusals_name_the_field_and_the_node(
    gateway: RunningGateway, http: httpx.AsyncClient
) -> None:
    policy = await submit(http, gateway, job_body(policy={"execution_timeout_s": "30"}))
    assert policy.status_code == 422, policy.text
    error = policy.json()["error"]
    assert error["type"] == "InvalidRequest"
    assert ["policy", "execution_timeout_s"] in [p["loc"] for p in error["problems"]]

    body = job_body()
    del body["graph"]["8"]["class_type"]
    graph = await submit(http, gateway, body)
    assert graph.status_code == 422, graph.text
    error = graph.json()["error"]
    assert error["type"] == "InvalidGraph"
    [problem] = error["problems"]
    assert problem["loc"] == ["graph", "8", "class_type"] and problem["node"] == "8"

    unknown = await submit(http, gateway, job_body(colour="blue"))
    assert unknown.status_code == 422
    assert ["colour"] in [p["loc"] for p in unknown.json()["error"]["problems"]]

    not_json = await http.post(
        f"{gateway.url}/v1/jobs", content=b"{graph", headers=gateway.auth("acme")
    )
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "BadRequest"

    bad_key = await submit(http, gateway, job_body(), key="tab\tkey")
    assert bad_key.status_code == 400

    for url in ("http://hooks.example.com/h", "https://127.0.0.1/h"):
        hook = await submit(http, gateway, job_body(webhook={"url": url}))
        assert hook.status_code == 422, hook.text
        [problem] = hook.json()["error"]["problems"]
        assert problem["loc"] == ["webhook", "url"], problem


async def test_bodies_over_the_limit_are_refused_before_they_are_read(
    gateway: RunningGateway, http: httpx.AsyncClient
) -> None:
    big = b'{"graph": {"1": "' + b"x" * (128 * 1024) + b'"}}'
    declared = await http.post(f"{gateway.url}/v1/jobs", content=big, headers=gateway.auth())
    assert declared.status_code == 413, declared.text
    assert declared.json()["error"]["type"] == "RequestTooLarge"

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(big), 8192):
            yield big[start : start + 8192]

    streamed = await http.post(f"{gateway.url}/v1/jobs", content=chunks(), headers=gateway.auth())
    assert streamed.status_code == 413, streamed.text


async def test_another_tenants_job_is_not_found_anywhere(
    gateway: RunningGateway, http: httpx.AsyncClient
) -> None:
    job_id = (await submit(http, gateway, job_body())).json()["job_id"]
    unknown_id = f"beta.{uuid.uuid4().hex}"
    base = gateway.url + "/v1/jobs"
    beta = gateway.auth("beta")

    for path in ("", "/artifacts"):
        theirs = await http.get(f"{base}/{job_id}{path}", headers=beta)
        nobody = await http.get(f"{base}/{unknown_id}{path}", headers=beta)
        assert theirs.status_code == nobody.status_code == 404
        assert theirs.json()["error"]["type"] == nobody.json()["error"]["type"] == "JobNotFound"
    events = await http.get(f"{base}/{job_id}/events", headers=beta)
    assert events.status_code == 404
    cancel = await http.post(f"{base}/{job_id}/cancel", headers=beta)
    assert cancel.status_code == 404
    resume = await http.post(f"{base}/{job_id}/resume", headers=beta)
    assert resume.status_code == 404
    async with websockets.connect(f"{gateway.url.replace('http', 'ws')}/v1/jobs/{job_id}/ws") as ws:
        await ws.send(
            '{"authorization": "Bearer ' + gateway.auth("beta")["Authorization"][7:] + '"}'
        )
        message = await ws.recv()
        assert '"JobNotFound"' in str(message)
    assert ws.close_code == 4404

    anonymous = await http.get(f"{base}/{job_id}")
    assert anonymous.status_code == 401 and anonymous.json()["error"]["type"] == "Unauthorized"
    wrong = await http.get(f"{base}/{job_id}", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    # The owner still sees it, and it still runs to its end.
    assert (await wait_state(http, gateway, job_id))["state"] == "COMPLETED"


async def test_an_unchanged_job_answers_304_to_its_etag(
    gateway: RunningGateway, http: httpx.AsyncClient
) -> None:
    job_id = (await submit(http, gateway, job_body())).json()["job_id"]
    await wait_state(http, gateway, job_id)
    url = f"{gateway.url}/v1/jobs/{job_id}"
    first = await http.get(url, headers=gateway.auth())
    tag = first.headers["etag"]
    assert tag.startswith(f'"{first.json()["seq"]}.{first.json()["progress"]["step"]}.')
    same = await http.get(url, headers=gateway.auth() | {"If-None-Match": tag})
    assert same.status_code == 304 and same.headers["etag"] == tag and same.content == b""
    other = await http.get(url, headers=gateway.auth() | {"If-None-Match": '"1.0.x"'})
    assert other.status_code == 200


async def test_cancel_ends_the_job_cancelled(
    gateway: RunningGateway, http: httpx.AsyncClient
) -> None:
    job_id = (await submit(http, gateway, job_body(steps=3000))).json()["job_id"]
    url = f"{gateway.url}/v1/jobs/{job_id}"
    while True:
        if (await http.get(url, headers=gateway.auth())).json()["state"] == "RUNNING":
            break
        await asyncio.sleep(0.1)
    refused = await http.post(f"{url}/resume", json={"resubmit": False}, headers=gateway.auth())
    assert refused.status_code == 409 and refused.json()["error"]["type"] == "ResumeRefused"
    sent = await http.post(f"{url}/cancel", json={"reason": "test"}, headers=gateway.auth())
    assert sent.status_code == 202, sent.text
    final = await wait_state(http, gateway, job_id)
    assert final["state"] == "CANCELLED"
    again = await http.post(f"{url}/cancel", headers=gateway.auth())
    assert again.status_code == 409 and again.json()["error"]["type"] == "JobAlreadyEnded"


async def test_the_list_holds_the_tenants_jobs_filtered_and_paginated(
    gateway: RunningGateway, http: httpx.AsyncClient
) -> None:
    ids = [
        (await submit(http, gateway, job_body(), tenant="gamma")).json()["job_id"] for _ in "abc"
    ]
    for job_id in ids:
        await wait_state(http, gateway, job_id, tenant="gamma")
    url = f"{gateway.url}/v1/jobs"
    gamma = gateway.auth("gamma")
    # Visibility follows the jobs by a moment: wait until it shows them ended.
    while True:
        page = (await http.get(url, params={"state": "completed"}, headers=gamma)).json()
        if {job["job_id"] for job in page["jobs"]} >= set(ids):
            break
        await asyncio.sleep(0.2)
    assert {job["job_id"] for job in page["jobs"]} == set(ids)
    assert all(job["state"] == "COMPLETED" and job["pool"] == "comfyui" for job in page["jobs"])

    running = await http.get(url, params={"state": "RUNNING"}, headers=gamma)
    assert running.json()["jobs"] == []
    elsewhere = await http.get(url, params={"pool": "runpod"}, headers=gamma)
    assert elsewhere.json()["jobs"] == []
    here = await http.get(url, params={"pool": "comfyui"}, headers=gamma)
    assert {job["job_id"] for job in here.json()["jobs"]} == set(ids)
    bad = await http.get(url, params={"state": "SLEEPING"}, headers=gamma)
    assert bad.status_code == 422 and bad.json()["error"]["problems"][0]["loc"] == [
        "query",
        "state",
    ]

    seen: list[str] = []
    token: str | None = None
    while True:
        params: dict[str, Any] = {"page_size": 2} | ({"page_token": token} if token else {})
        answer = (await http.get(url, params=params, headers=gamma)).json()
        assert len(answer["jobs"]) <= 2
        seen += [job["job_id"] for job in answer["jobs"]]
        token = answer["next_page_token"]
        if token is None:
            break
    assert sorted(seen) == sorted(ids), "every job once, across pages"
    # Another tenant's list holds none of them.
    acme = (await http.get(url, headers=gateway.auth("acme"))).json()
    assert not set(ids) & {job["job_id"] for job in acme["jobs"]}


async def test_readiness_follows_temporal(gateway: RunningGateway, http: httpx.AsyncClient) -> None:
    assert (await http.get(f"{gateway.url}/readyz")).status_code == 200
    assert (await http.get(f"{gateway.url}/healthz")).status_code == 200

    closed = f"127.0.0.1:{free_port()}"

    async def nowhere() -> JobClient:
        return await JobClient.connect(closed, "default", s3_from_environment=False)

    async with running_gateway(nowhere, wait_ready=False) as cut_off:
        ready = await http.get(f"{cut_off.url}/readyz")
        assert ready.status_code == 503 and int(ready.headers["retry-after"]) >= 1
        assert ready.json()["error"]["type"] == "TemporalUnavailable"
        assert (await http.get(f"{cut_off.url}/healthz")).status_code == 200
        job = await http.get(f"{cut_off.url}/v1/jobs/acme.x", headers=cut_off.auth())
        assert job.status_code == 503 and job.json()["error"]["type"] == "TemporalUnavailable"


async def test_the_page_its_config_and_the_openapi_document(
    gateway: RunningGateway, http: httpx.AsyncClient
) -> None:
    config = (await http.get(f"{gateway.url}/v1/config")).json()
    assert config["auth_required"] is True
    assert config["example_graph"]["3"]["class_type"] == "KSampler"
    assert config["terminal_states"] == sorted(s.value for s in TERMINAL_STATES)
    page = await http.get(f"{gateway.url}/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    document = (await http.get(f"{gateway.url}/openapi.json")).json()
    assert "/v1/jobs/{job_id}/events" in document["paths"]
    assert "JobSubmission" in document["components"]["schemas"]
    missing = await http.get(f"{gateway.url}/v1/nothing-here", headers=gateway.auth())
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFound"


@pytest.mark.parametrize("route", ["/v1/jobs/acme.none"])
async def test_no_key_is_401_before_anything_else(
    gateway: RunningGateway, http: httpx.AsyncClient, route: str
) -> None:
    answer = await http.get(gateway.url + route)
    assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer"


async def test_the_command_serves_and_logs_no_key_or_query_string(
    local_stack: RunningStack, worker: RunningWorker, http: httpx.AsyncClient
) -> None:
    env = cli_env(local_stack, worker.task_queue) | {
        "DURABLE_COMFY_API_KEYS": f"acme:{KEYS['acme']}",
        "DURABLE_COMFY_LOG_LEVEL": "INFO",
    }
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = await start_cli("gateway", "--host", "127.0.0.1", "--port", str(port), env=env)
    auth = {"Authorization": f"Bearer {KEYS['acme']}"}
    try:
        while True:
            try:
                if (await http.get(f"{url}/readyz")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.returncode is None, "the gateway exited"
            await asyncio.sleep(0.1)
        answer = await http.post(f"{url}/v1/jobs", json=job_body(), headers=auth)
        job_id = answer.json()["job_id"]
        async for event in sse_events(http, f"{url}/v1/jobs/{job_id}/events?since=0", auth):
            if event.event == "end":
                break
        final = await http.get(f"{url}/v1/jobs/{job_id}?note=sekrit", headers=auth)
        assert "X-Amz-Signature" in final.json()["artifacts"][0]["url"]
    finally:
        process.terminate()
        _, err_bytes = await asyncio.wait_for(process.communicate(), timeout=30)
    err = err_bytes.decode()
    assert "gateway_started" in err and f"127.0.0.1:{port}" in err, err[-2000:]
    assert f"/v1/jobs/{job_id}" in err, "requests are logged"
    for secret in (KEYS["acme"], "sekrit", "since=0", "X-Amz-Signature", "Bearer"):
        assert secret not in err, secret


async def test_the_command_refuses_to_serve_without_keys_off_loopback(
    local_stack: RunningStack, worker: RunningWorker
) -> None:
    env = cli_env(local_stack, worker.task_queue)
    env.pop("DURABLE_COMFY_API_KEYS", None)
    env.pop("DURABLE_COMFY_API_KEYS_FILE", None)
    code, _, err = await run_cli("gateway", "--host", "0.0.0.0", "--port", "1", env=env)
    assert code == 2 and "loopback" in err and "DURABLE_COMFY_API_KEYS" in err, err


async def test_with_no_worker_a_repeated_submission_is_still_the_same_job(
    local_stack: RunningStack, http: httpx.AsyncClient
) -> None:
    async def unserved() -> JobClient:
        return await JobClient.connect(
            local_stack.temporal_address,
            local_stack.namespace,
            task_queue=f"gw-nobody-{uuid.uuid4().hex[:8]}",
            query_timeout_s=1.0,
            s3_from_environment=False,
        )

    async with running_gateway(unserved) as idle:
        key = f"again-{uuid.uuid4().hex}"
        body = job_body()
        first = await submit(http, idle, body, key=key)
        assert first.status_code == 201, first.text
        again = await submit(http, idle, body, key=key)
        assert again.status_code == 200, again.text
        assert again.json()["job_id"] == first.json()["job_id"]
        assert again.json()["state"] == "QUEUED"
        job_id = first.json()["job_id"]
        status = await http.get(f"{idle.url}/v1/jobs/{job_id}", headers=idle.auth())
        assert status.status_code == 503 and status.json()["error"]["type"] == "JobUnanswered"
        assert int(status.headers["retry-after"]) >= 1
        # A stream of it stays open, kept alive, while its follower waits for an answer.
        events = f"{idle.url}/v1/jobs/{job_id}/events"
        async with http.stream("GET", events, headers=idle.auth()) as stream:
            assert stream.status_code == 200
            lines = stream.aiter_lines()
            assert await anext(lines) == "retry: 1000"
            assert [await anext(lines) for _ in range(2)] == ["", ": keep-alive"]
        cancel = await http.post(f"{idle.url}/v1/jobs/{job_id}/cancel", headers=idle.auth())
        assert cancel.status_code == 202, cancel.text
