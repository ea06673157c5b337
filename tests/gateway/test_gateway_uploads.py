"""`POST /v1/uploads` over real HTTP (docs/http-api.md, Uploads): a presigned PUT into the
caller's staging area of the local stack's SeaweedFS, held by its signature to the declared
size, type and sha256; the refusals that name their field; and a file uploaded that way used
by a job, end to end. uvicorn in this process, in front of a worker of the local stack."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest_asyncio
import structlog

from activities.comfyui.activities import upload_name
from configuration.settings import GatewaySettings
from devstack.models import RunningStack
from protocol.keys import safe_component
from starter import JobClient
from tests.support.cli import RunningWorker
from tests.support.gateway import (
    KEYS,
    TEST_SETTINGS,
    RunningGateway,
    serving_app,
    stack_client_factory,
    wait_state,
)

MiB = 1024 * 1024
UPLOAD_MAX_BYTES = 1 * MiB
UPLOAD_TTL_S = 120


def settings() -> GatewaySettings:
    keys = ",".join(f"{tenant}:{key}" for tenant, key in KEYS.items())
    return GatewaySettings.model_validate(
        {
            **TEST_SETTINGS,
            "DURABLE_COMFY_API_KEYS": keys,
            "DURABLE_COMFY_GATEWAY_UPLOAD_MAX_BYTES": UPLOAD_MAX_BYTES,
            "DURABLE_COMFY_GATEWAY_UPLOAD_TTL_S": UPLOAD_TTL_S,
        }
    )


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gateway(
    local_stack: RunningStack, worker: RunningWorker
) -> AsyncIterator[RunningGateway]:
    async with serving_app(settings(), stack_client_factory(local_stack, worker)) as running:
        yield running


def bucketless_factory(stack: RunningStack) -> Callable[[], Awaitable[JobClient]]:
    async def connect() -> JobClient:
        return await JobClient.connect(
            stack.temporal_address, stack.namespace, s3_from_environment=False
        )

    return connect


def a_file(size: int = 4096) -> bytes:
    """PNG-looking bytes of their own (no other test's object at their key)."""
    return b"\x89PNG\r\n\x1a\n" + os.urandom(size - 8)


def declared(data: bytes, filename: str = "cat.png", **changed: Any) -> dict[str, Any]:
    body = {
        "filename": filename,
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "content_type": "image/png",
    }
    return body | changed


async def presign(
    http: httpx.AsyncClient, gateway: RunningGateway, body: Any, tenant: str = "acme"
) -> httpx.Response:
    return await http.post(f"{gateway.url}/v1/uploads", json=body, headers=gateway.auth(tenant))


async def put(
    http: httpx.AsyncClient, answer: dict[str, Any], data: bytes, **headers: str
) -> httpx.Response:
    """The PUT as a client sends it: the answer's headers (Content-Length is the body's own, as
    an HTTP client sets it), with `headers` changed or, given "", left out."""
    sent = {k: v for k, v in answer["headers"].items() if k.lower() != "content-length"}
    sent |= headers
    return await http.put(
        answer["put_url"], content=data, headers={k: v for k, v in sent.items() if v}
    )


def problem_locs(answer: httpx.Response) -> list[list[Any]]:
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["type"] == "InvalidRequest", error
    return [p["loc"] for p in error["problems"]]


async def test_the_put_stores_exactly_the_declared_file_in_the_tenants_staging_area(
    gateway: RunningGateway,
    http: httpx.AsyncClient,
    worker: RunningWorker,
    local_stack: RunningStack,
) -> None:
    data = a_file()
    digest = hashlib.sha256(data).hexdigest()
    asked_at = datetime.now(UTC)
    with structlog.testing.capture_logs() as logs:
        answer = await presign(http, gateway, declared(data))
    answered_at = datetime.now(UTC)
    assert answer.status_code == 201, answer.text
    view = answer.json()
    # Logged with what was signed, never the URL (a bearer credential).
    [logged] = [entry for entry in logs if entry["event"] == "upload_presigned"]
    assert (logged["tenant"], logged["size"]) == ("acme", len(data)), logged
    assert not [entry for entry in logs if "X-Amz-Signature" in repr(entry)], logs
    assert set(view) == {"uri", "put_url", "expires_at", "headers", "exists"}, view
    key = f"_staged/acme/{digest}/cat.png"
    assert logged["key"] == key, logged
    assert view["uri"] == f"s3://{local_stack.bucket}/{key}"
    assert view["exists"] is False
    assert view["headers"] == {
        "Content-Type": "image/png",
        "Content-Length": str(len(data)),
        "x-amz-checksum-sha256": view["headers"]["x-amz-checksum-sha256"],
        "x-amz-meta-sha256": digest,
    }
    expires_at = datetime.fromisoformat(view["expires_at"])
    ttl = timedelta(seconds=UPLOAD_TTL_S)
    # Signed between the ask and the answer (a loaded machine takes a while in between).
    assert asked_at + ttl - timedelta(seconds=2) <= expires_at <= answered_at + ttl, view
    query = parse_qs(urlsplit(view["put_url"]).query)
    assert query["X-Amz-Expires"] == [str(UPLOAD_TTL_S)]
    signed = query["X-Amz-SignedHeaders"][0].split(";")
    assert {h.lower() for h in view["headers"]} <= set(signed), signed

    # Anything but the declared file is refused by the store, and nothing is kept of it.
    other = bytearray(data)
    other[100] ^= 0xFF
    refused = {
        "other bytes": await put(http, view, bytes(other)),
        "a byte more": await put(http, view, data + b"\0"),
        "a byte less": await put(http, view, data[:-1]),
        "another type": await put(http, view, data, **{"Content-Type": "image/jpeg"}),
        "no checksum": await put(http, view, data, **{"x-amz-checksum-sha256": ""}),
        "other metadata": await put(http, view, data, **{"x-amz-meta-sha256": "0" * 64}),
    }
    assert {why: r.status_code for why, r in refused.items()} == {
        "other bytes": 400,
        "a byte more": 403,
        "a byte less": 403,
        "another type": 403,
        "no checksum": 403,
        "other metadata": 403,
    }, {why: r.text[:200] for why, r in refused.items()}
    assert "BadDigest" in refused["other bytes"].text
    assert await worker.store.head(key) is None

    # The declared file, with the headers exactly as answered (Content-Length included).
    stored = await http.put(view["put_url"], content=data, headers=view["headers"])
    assert stored.status_code == 200, stored.text
    found = await worker.store.head(key)
    assert found is not None
    assert (found.size, found.sha256, found.content_type) == (len(data), digest, "image/png")

    again = await presign(http, gateway, declared(data))
    assert again.status_code == 201 and again.json()["exists"] is True, again.text
    # A name of another file with the same bytes is another object, not yet there.
    renamed = await presign(http, gateway, declared(data, "dog.png"))
    assert renamed.json()["exists"] is False, renamed.text


async def test_each_tenant_gets_a_key_of_its_own_with_a_safe_name(
    gateway: RunningGateway, http: httpx.AsyncClient
) -> None:
    data = a_file()
    digest = hashlib.sha256(data).hexdigest()
    uris = {}
    for tenant in ("acme", "beta"):
        answer = await presign(http, gateway, declared(data), tenant=tenant)
        assert answer.status_code == 201, answer.text
        uris[tenant] = answer.json()["uri"]
    assert uris["acme"].endswith(f"/_staged/acme/{digest}/cat.png"), uris
    assert uris["beta"].endswith(f"/_staged/beta/{digest}/cat.png"), uris

    # A name with characters no key should hold is one sanitised key component.
    name = "my cat ..(1).png"
    answer = await presign(http, gateway, declared(data, name))
    assert answer.status_code == 201, answer.text
    key = answer.json()["uri"].split("/", 3)[3]
    assert key == f"_staged/acme/{digest}/{safe_component(name)}"
    assert key.endswith(".png") and " " not in key and ".." not in key


async def test_refusals_name_the_field_and_what_to_send(
    gateway: RunningGateway, http: httpx.AsyncClient
) -> None:
    data = a_file()

    over = await presign(http, gateway, declared(data, size=UPLOAD_MAX_BYTES + 1))
    assert problem_locs(over) == [["size"]]
    assert f"at most {UPLOAD_MAX_BYTES:,} bytes" in over.text
    at_limit = await presign(http, gateway, declared(data, size=UPLOAD_MAX_BYTES))
    assert at_limit.status_code == 201, at_limit.text

    html = await presign(http, gateway, declared(data, "x.html", content_type="text/html"))
    assert sorted(problem_locs(html)) == [["content_type"], ["filename"]], html.text
    assert "image/png" in html.text and ".png" in html.text  # what may be sent
    # application/octet-stream is a .latent's type, and no other file's: not any file at all.
    octet = {"content_type": "application/octet-stream"}
    latent = await presign(http, gateway, declared(data, "x.latent", **octet))
    assert latent.status_code == 201, latent.text
    for name in ("x.html", "x.safetensors", "x"):
        assert problem_locs(await presign(http, gateway, declared(data, name, **octet))) == [
            ["filename"]
        ], name
    not_latent = await presign(http, gateway, declared(data, **octet))
    assert problem_locs(not_latent) == [["content_type"]]
    assert "send content_type 'image/png'" in not_latent.text, not_latent.text

    mismatch = await presign(http, gateway, declared(data, "cat.jpg"))
    assert problem_locs(mismatch) == [["content_type"]]
    assert "send content_type 'image/jpeg'" in mismatch.text, mismatch.text

    for bad in ("A" * 64, "a" * 63, "g" * 64, ""):
        answer = await presign(http, gateway, declared(data, sha256=bad))
        assert problem_locs(answer) == [["sha256"]], bad
        assert "64 lowercase hex digits" in answer.text
    for name in ("", "   ", "a/cat.png", "..\\cat.png", "cat\n.png"):
        assert problem_locs(await presign(http, gateway, declared(data, name))) == [["filename"]]
    for size in ("4096", 4096.0, True, 0, -1):
        assert problem_locs(await presign(http, gateway, declared(data, size=size))) == [["size"]]
    assert problem_locs(await presign(http, gateway, declared(data, colour="blue"))) == [["colour"]]
    missing = {k: v for k, v in declared(data).items() if k != "sha256"}
    assert problem_locs(await presign(http, gateway, missing)) == [["sha256"]]
    assert problem_locs(await presign(http, gateway, ["cat.png"])) == [[]]

    not_json = await http.post(f"{gateway.url}/v1/uploads", content=b"{cat", headers=gateway.auth())
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "BadRequest"
    anonymous = await http.post(f"{gateway.url}/v1/uploads", json=declared(data))
    assert anonymous.status_code == 401, anonymous.text


async def test_a_gateway_without_a_bucket_says_what_to_set(
    local_stack: RunningStack, http: httpx.AsyncClient
) -> None:
    async with serving_app(settings(), bucketless_factory(local_stack)) as bucketless:
        answer = await presign(http, bucketless, declared(a_file()))
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["type"] == "UploadsUnavailable", error
    assert "DURABLE_COMFY_BUCKET" in error["message"], error


async def test_the_route_and_its_body_are_in_the_openapi_document(
    gateway: RunningGateway, http: httpx.AsyncClient
) -> None:
    document = (await http.get(f"{gateway.url}/openapi.json")).json()
    route = document["paths"]["/v1/uploads"]["post"]
    body = route["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/UploadRequest"}
    schema = document["components"]["schemas"]["UploadRequest"]
    assert set(schema["required"]) == {"filename", "size", "sha256", "content_type"}
    assert schema["additionalProperties"] is False
    answer = route["responses"]["201"]["content"]["application/json"]["schema"]
    assert answer == {"$ref": "#/components/schemas/UploadAnswer"}
    config = (await http.get(f"{gateway.url}/v1/config")).json()
    assert config["uploads"]["max_bytes"] == UPLOAD_MAX_BYTES
    assert config["uploads"]["types"][".png"] == "image/png"
    assert ".html" not in config["uploads"]["types"]


async def test_an_uploaded_file_is_an_input_of_the_tenants_job(
    gateway: RunningGateway, http: httpx.AsyncClient, local_stack: RunningStack
) -> None:
    """POST /v1/uploads, the PUT, then a job whose LoadImage names the file: COMPLETED, and
    ComfyUI got the file's very bytes."""
    data = a_file(64 * 1024)
    view = (await presign(http, gateway, declared(data, "photo.png"))).json()
    stored = await http.put(view["put_url"], content=data, headers=view["headers"])
    assert stored.status_code == 200, stored.text
    graph = {
        "1": {"class_type": "LoadImage", "inputs": {"image": "photo.png"}},
        "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "up"}},
    }
    body = {
        "graph": graph,
        "pool": "comfyui",
        "inputs": {"photo.png": {"kind": "s3", "uri": view["uri"]}},
        "labels": {"run": uuid.uuid4().hex},
    }
    submitted = await http.post(f"{gateway.url}/v1/jobs", json=body, headers=gateway.auth())
    assert submitted.status_code == 201, submitted.text
    job_id = submitted.json()["job_id"]

    final = await wait_state(http, gateway, job_id)

    assert final["state"] == "COMPLETED", final["error"]
    assert final["artifacts"], final
    received = await http.get(
        f"{local_stack.comfyui_url}/view",
        params={"filename": upload_name(job_id, "photo.png"), "type": "input"},
    )
    assert received.status_code == 200, received.text
    assert received.content == data, "ComfyUI got other bytes than the uploaded file"
