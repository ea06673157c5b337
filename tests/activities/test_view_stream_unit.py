"""`offload.view_stream`: ComfyUI's GET /view read with aiohttp, with `ComfyClient.view`'s
contract, against a small aiohttp server on loopback (the uploader's network path)."""

from __future__ import annotations

import os
import ssl
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio
from aiohttp import web

from activities.comfyui.offload import OutputUploader, _reads_network, _tls_context, view_stream
from protocol.comfyui.client import ComfyClient
from protocol.errors import ComfyHTTPError, ComfyUnavailable, UnsafeOutputName
from tests.support.aiohttp_servers import served
from tests.support.comfy_fakes import RUN_TAG, FakeStore, image
from workflows.contracts import OutputSpec

BIG = os.urandom(3 * 1024 * 1024 + 17)


class Server:
    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        self.url = ""

    async def view(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.seen.append(query)
        name = query.get("filename", "")
        if name == "broken.png":
            return web.Response(status=503)
        if name == "moved.png":
            raise web.HTTPFound(location="/view?filename=a.png&subfolder=&type=output")
        if name != "a b&c.png" or query.get("type") != "output":
            return web.Response(status=404, text="no such file")
        response = web.StreamResponse(headers={"Content-Length": str(len(BIG))})
        await response.prepare(request)
        for start in range(0, len(BIG), 100_000):
            await response.write(BIG[start : start + 100_000])
        await response.write_eof()
        return response


@pytest_asyncio.fixture
async def server() -> AsyncIterator[Server]:
    state = Server()
    app = web.Application()
    app.router.add_get("/view", state.view)
    async with served(app) as port:
        state.url = f"http://127.0.0.1:{port}"
        yield state


@pytest_asyncio.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    # As the worker builds it: httpx's own network transport.
    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(30.0, connect=5.0)) as c:
        yield c


async def test_the_worker_s_client_is_read_with_aiohttp(http: httpx.AsyncClient) -> None:
    assert _reads_network(ComfyClient("http://127.0.0.1:1", http))
    mocked = httpx.AsyncClient(transport=httpx.MockTransport(lambda _r: httpx.Response(200)))
    async with mocked:
        assert not _reads_network(ComfyClient("http://127.0.0.1:1", mocked))


def test_https_is_verified_as_the_worker_s_httpx_client_verifies() -> None:
    context = _tls_context()
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert _tls_context() is context, "built once"


async def test_a_file_streams_whole_with_its_name_encoded(
    server: Server, http: httpx.AsyncClient
) -> None:
    got = bytearray()
    async with view_stream(ComfyClient(server.url, http), "a b&c.png", "", "output") as chunks:
        async for chunk in chunks:
            got += chunk
    assert bytes(got) == BIG
    assert server.seen == [{"filename": "a b&c.png", "subfolder": "", "type": "output"}]


async def test_statuses_map_as_the_client_s_own(server: Server, http: httpx.AsyncClient) -> None:
    client = ComfyClient(server.url, http)
    with pytest.raises(ComfyHTTPError) as missing:
        async with view_stream(client, "gone.png", "", "output"):
            pass
    assert missing.value.status_code == 404
    with pytest.raises(ComfyUnavailable, match="HTTP 503"):
        async with view_stream(client, "broken.png", "", "output"):
            pass
    with pytest.raises(ComfyHTTPError) as moved:
        async with view_stream(client, "moved.png", "", "output"):
            pass
    assert moved.value.status_code == 302, "a redirect is an answer, never followed"
    assert [q["filename"] for q in server.seen] == ["gone.png", "broken.png", "moved.png"]


async def test_no_server_is_unavailable(http: httpx.AsyncClient) -> None:
    with pytest.raises(ComfyUnavailable):
        async with view_stream(ComfyClient("http://127.0.0.1:1", http), "a.png", "", "output"):
            pass


async def test_an_unsafe_name_is_refused_before_anything_is_sent(
    server: Server, http: httpx.AsyncClient
) -> None:
    with pytest.raises(UnsafeOutputName):
        async with view_stream(ComfyClient(server.url, http), "../secret.png", "", "output"):
            pass
    assert server.seen == []


async def test_the_uploader_stores_a_file_read_over_the_network(
    server: Server, http: httpx.AsyncClient
) -> None:
    store = FakeStore()
    uploader = OutputUploader(
        ComfyClient(server.url, http),
        store,
        job_id="job-1",
        segment=0,
        output=OutputSpec(bucket="out"),
        stored=[],
        run_tag=RUN_TAG,
    )
    artifact = await uploader.upload("9", image("a b&c.png", subfolder=""))
    assert artifact.size == len(BIG)
    assert store.objects[artifact.key].size == len(BIG)
