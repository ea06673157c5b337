"""A tenant reads and writes only its own part of the bucket (docs/security.md, *Tenants*), on
the local stack through the gateway: `jobs/{tenant}/` and `_staged/{tenant}/`.

One tenant's result is another tenant's secret: job IDs are not (they travel in URLs, webhooks
and logs), so naming another tenant's artifact as an `s3://` input must be refused, at the
gateway (422) and, for a client that skips it, in the worker's prepare before anything runs.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from activities.runpod.follow import one_chunk
from devstack.models import RunningStack
from starter import JobRequest
from tests.support.cli import RunningWorker
from tests.support.gateway import (
    RunningGateway,
    job_body,
    running_gateway,
    stack_client_factory,
    wait_state,
)
from workflows.contracts import JobState
from workflows.shared import ErrorType


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gateway(
    local_stack: RunningStack, worker: RunningWorker
) -> AsyncIterator[RunningGateway]:
    async with running_gateway(stack_client_factory(local_stack, worker)) as running:
        yield running


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def acme_artifact(gateway: RunningGateway) -> dict[str, Any]:
    """A result of tenant acme's: what the other tenant will try to read."""
    async with httpx.AsyncClient(timeout=60) as http:
        answer = await http.post(f"{gateway.url}/v1/jobs", json=job_body(4), headers=gateway.auth())
        assert answer.status_code == 201, answer.text
        view = await wait_state(http, gateway, answer.json()["job_id"])
    assert view["state"] == "COMPLETED", view
    artifact: dict[str, Any] = view["artifacts"][0]
    return artifact


def load_and_save(uri: str) -> dict[str, Any]:
    """A graph that copies the image it loads: the output would be the input's pixels."""
    return {
        "graph": {
            "1": {"class_type": "LoadImage", "inputs": {"image": "stolen.png"}},
            "2": {
                "class_type": "SaveImage",
                "inputs": {"images": ["1", 0], "filename_prefix": "copy"},
            },
        },
        "inputs": {"stolen.png": {"kind": "s3", "uri": uri}},
        "pool": "comfyui",
    }


async def test_a_tenants_jobs_are_stored_under_its_own_prefix(
    acme_artifact: dict[str, Any],
) -> None:
    assert acme_artifact["key"].startswith("jobs/acme/acme."), acme_artifact["key"]


async def test_another_tenants_artifact_as_an_input_is_refused_by_the_gateway(
    gateway: RunningGateway, acme_artifact: dict[str, Any]
) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        answer = await http.post(
            f"{gateway.url}/v1/jobs",
            json=load_and_save(acme_artifact["uri"]),
            headers=gateway.auth("beta"),
        )
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["type"] == "InvalidRequest"
    [problem] = error["problems"]
    assert problem["loc"] == ["inputs", "stolen.png", "uri"]
    assert "outside tenant 'beta'" in problem["message"]
    assert "POST /v1/uploads" in problem["message"]


async def test_a_client_that_skips_the_gateway_is_refused_by_the_worker_before_any_gpu_time(
    worker: RunningWorker, acme_artifact: dict[str, Any]
) -> None:
    body = load_and_save(acme_artifact["uri"])
    request = JobRequest.model_validate({**body, "labels": {"tenant": "beta"}})
    submitted = await worker.client.submit(request)
    final = await worker.client.wait(submitted.job_id)
    assert final.state == JobState.FAILED
    assert final.error is not None and final.error.type == ErrorType.INVALID_REQUEST
    assert "stolen.png" in final.error.message and "outside tenant 'beta'" in final.error.message
    assert final.teardown is not None and final.teardown.state == "SKIPPED", "nothing submitted"
    assert final.artifacts == []


async def test_a_job_without_a_tenant_is_not_confined(
    worker: RunningWorker, acme_artifact: dict[str, Any]
) -> None:
    """The SDK's single-tenant use: the caller is trusted with what the worker can read."""
    submitted = await worker.client.submit(
        JobRequest.model_validate(load_and_save(acme_artifact["uri"]))
    )
    final = await worker.client.wait(submitted.job_id)
    assert final.state == JobState.COMPLETED, final.error


async def test_a_tenants_own_staged_file_is_accepted(
    gateway: RunningGateway, worker: RunningWorker, local_stack: RunningStack
) -> None:
    data = await _image_bytes(gateway, worker)
    digest = hashlib.sha256(data).hexdigest()
    key = f"_staged/beta/{digest}/mine.png"
    await worker.store.upload_stream(key, one_chunk(data), content_type="image/png")
    async with httpx.AsyncClient(timeout=60) as http:
        answer = await http.post(
            f"{gateway.url}/v1/jobs",
            json=load_and_save(f"s3://{local_stack.bucket}/{key}"),
            headers=gateway.auth("beta"),
        )
        assert answer.status_code == 201, answer.text
        view = await wait_state(http, gateway, answer.json()["job_id"], "beta")
    assert view["state"] == "COMPLETED", view
    assert all(a["key"].startswith("jobs/beta/") for a in view["artifacts"])


@pytest.mark.parametrize(
    ("output", "field"),
    [
        ({"prefix": "jobs/acme"}, "prefix"),
        ({"prefix": "jobs"}, "prefix"),
        ({"prefix": "jobs/beta/../acme"}, "prefix"),
        ({"prefix": "elsewhere/beta"}, "prefix"),
        ({"bucket": "someone-elses-bucket"}, "bucket"),
    ],
)
async def test_storage_outside_the_tenants_area_is_refused(
    gateway: RunningGateway, output: dict[str, str], field: str
) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        answer = await http.post(
            f"{gateway.url}/v1/jobs",
            json=job_body(2, output=output),
            headers=gateway.auth("beta"),
        )
    assert answer.status_code == 422, answer.text
    [problem] = answer.json()["error"]["problems"]
    assert problem["loc"] == ["output", field]


async def test_a_folder_of_the_tenants_area_is_its_to_choose(gateway: RunningGateway) -> None:
    folder = f"jobs/beta/project-{uuid.uuid4().hex[:6]}"
    async with httpx.AsyncClient(timeout=60) as http:
        answer = await http.post(
            f"{gateway.url}/v1/jobs",
            json=job_body(2, output={"prefix": folder}),
            headers=gateway.auth("beta"),
        )
        assert answer.status_code == 201, answer.text
        view = await wait_state(http, gateway, answer.json()["job_id"], "beta")
    assert view["state"] == "COMPLETED", view
    assert view["artifacts"][0]["key"].startswith(folder + "/beta.")


async def _image_bytes(gateway: RunningGateway, worker: RunningWorker) -> bytes:
    """A PNG the simulator made, read back from the bucket."""
    async with httpx.AsyncClient(timeout=60) as http:
        answer = await http.post(
            f"{gateway.url}/v1/jobs", json=job_body(2), headers=gateway.auth("beta")
        )
        view = await wait_state(http, gateway, answer.json()["job_id"], "beta")
    key = view["artifacts"][0]["key"]
    return await worker.store.read_bytes(key, limit=10 * 1024 * 1024)


async def test_an_upload_is_an_input_of_its_own_tenants_jobs_only(
    gateway: RunningGateway, worker: RunningWorker
) -> None:
    """`POST /v1/uploads` as beta, the PUT, a job of beta's using it: COMPLETED. The same uri
    in acme's job: refused by the gateway, and by the worker for a client that skips it."""
    data = await _image_bytes(gateway, worker)
    declared = {
        "filename": "shared.png",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "content_type": "image/png",
    }
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        presigned = await http.post(
            f"{gateway.url}/v1/uploads", json=declared, headers=gateway.auth("beta")
        )
        assert presigned.status_code == 201, presigned.text
        upload = presigned.json()
        assert upload["uri"].split("/", 3)[3].startswith("_staged/beta/")
        stored = await http.put(upload["put_url"], content=data, headers=upload["headers"])
        assert stored.status_code == 200, stored.text

        own = await http.post(
            f"{gateway.url}/v1/jobs",
            json=load_and_save(upload["uri"]),
            headers=gateway.auth("beta"),
        )
        assert own.status_code == 201, own.text
        view = await wait_state(http, gateway, own.json()["job_id"], "beta")
        assert view["state"] == "COMPLETED", view

        other = await http.post(
            f"{gateway.url}/v1/jobs", json=load_and_save(upload["uri"]), headers=gateway.auth()
        )
    assert other.status_code == 422, other.text
    assert other.json()["error"]["problems"][0]["loc"] == ["inputs", "stolen.png", "uri"]
    request = JobRequest.model_validate(
        {**load_and_save(upload["uri"]), "labels": {"tenant": "acme"}}
    )
    final = await worker.client.wait((await worker.client.submit(request)).job_id)
    assert final.state == JobState.FAILED and final.error is not None
    assert final.error.type == ErrorType.INVALID_REQUEST
