"""OutputUploader and offload_outputs in-process: ComfyUI on an httpx mock, S3 in a dict."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.comfyui.offload import OffloadActivities, OutputUploader
from activities.comfyui.pools import ComfyPools
from configuration.pools import PoolConfig
from configuration.settings import WorkerSettings
from protocol.comfyui.client import ComfyClient
from tests.support.comfy_fakes import PROMPT_ID, RUN_TAG, FakeComfy, FakeStore, image
from workflows.activity_io import OffloadInput, OffloadResult
from workflows.contracts import Artifact, OutputSpec
from workflows.errors import StorageError
from workflows.shared import ErrorType

BASE_URL = "http://127.0.0.1:1"  # never dialled: the mock transport answers
FILES = {"a.png": b"first image", "b.png": b"second image", "c.webp": b"third"}


def key(node: str, name: str) -> str:
    return f"jobs/job-1/0/{node}/{name}"


class Offload:
    def __init__(self, comfy: FakeComfy, http: httpx.AsyncClient) -> None:
        self.comfy = comfy
        self.store = FakeStore()
        settings = WorkerSettings(pools={"comfyui": PoolConfig(kind="comfyui", url=BASE_URL)})
        self.activities = OffloadActivities(ComfyPools(settings, http), self.store)
        self.http = http
        self.beats = 0

    async def run(self, **changes: Any) -> OffloadResult:
        req = OffloadInput.model_validate(
            {
                "job_id": "job-1",
                "pool": "comfyui",
                "prompt_id": PROMPT_ID,
                "run_tag": RUN_TAG,
                "output": OutputSpec(bucket="out"),
            }
            | changes
        )
        env = ActivityEnvironment()
        env.on_heartbeat = lambda *_details: self._beat()
        result: OffloadResult = await env.run(self.activities.offload_outputs, req)
        return result

    def _beat(self) -> None:
        self.beats += 1

    def uploader(self, stored: list[Artifact] | None = None) -> OutputUploader:
        return OutputUploader(
            ComfyClient(BASE_URL, self.http),
            self.store,
            job_id="job-1",
            segment=0,
            output=OutputSpec(bucket="out"),
            stored=stored or [],
            run_tag=RUN_TAG,
        )


@pytest_asyncio.fixture
async def offload() -> AsyncIterator[Offload]:
    comfy = FakeComfy(files=dict(FILES))
    comfy.finish(
        PROMPT_ID,
        ("9", image("a.png")),
        ("9", image("b.png")),
        ("12", image("c.webp")),
        ("8", image("preview.png", kind="temp")),
    )
    async with httpx.AsyncClient(transport=httpx.MockTransport(comfy.handle)) as http:
        yield Offload(comfy, http)


async def test_every_saved_output_in_history_is_stored_and_verified(offload: Offload) -> None:
    result = await offload.run()
    assert [a.key for a in result.artifacts] == [
        key("12", "c.webp"),
        key("9", "a.png"),
        key("9", "b.png"),
    ]
    webp = result.artifacts[0]
    assert webp.size == len(FILES["c.webp"]) and webp.content_type == "image/webp"
    assert webp.uri == f"s3://out/{key('12', 'c.webp')}" and webp.node_id == "12"
    assert "preview.png" not in str(offload.store.uploads), "previews are not kept"
    assert offload.beats == 3


async def test_outputs_already_stored_are_not_fetched_again(offload: Offload) -> None:
    first = await offload.run()
    offload.store.uploads.clear()
    views = offload.comfy.count("GET /view")
    again = await offload.run(stored=first.artifacts[:2])
    assert offload.store.uploads == [key("9", "b.png")]
    assert offload.comfy.count("GET /view") == views + 1
    assert [a.key for a in again.artifacts] == [a.key for a in first.artifacts]


async def test_what_it_stored_itself_is_not_asked_again_and_what_was_stored_before_is(
    offload: Offload,
) -> None:
    # upload_stream returns only once the store confirmed the bytes: a HEAD after it is waste.
    first = await offload.run()
    assert offload.store.heads == []
    await offload.run(stored=first.artifacts[:2])
    assert sorted(offload.store.heads) == sorted(a.key for a in first.artifacts[:2])


async def test_a_stored_object_that_does_not_match_is_a_retryable_storage_error(
    offload: Offload,
) -> None:
    first = await offload.run()
    offload.store.corrupt.add(key("9", "b.png"))
    with pytest.raises(ApplicationError) as caught:
        await offload.run(stored=first.artifacts)
    assert caught.value.type == ErrorType.STORAGE_ERROR and not caught.value.non_retryable
    assert key("9", "b.png") in caught.value.message


async def test_a_stored_object_that_vanished_is_a_retryable_storage_error(
    offload: Offload,
) -> None:
    first = await offload.run()
    del offload.store.objects[key("9", "a.png")]
    offload.comfy.history[PROMPT_ID]["outputs"] = {}
    with pytest.raises(ApplicationError) as caught:
        await offload.run(stored=first.artifacts)
    assert caught.value.type == ErrorType.STORAGE_ERROR and not caught.value.non_retryable


async def test_partial_keeps_going_past_a_file_that_fails(offload: Offload) -> None:
    offload.store.fail[key("9", "a.png")] = StorageError("SlowDown", retryable=True)
    result = await offload.run(partial=True)
    assert [a.key for a in result.artifacts] == [key("12", "c.webp"), key("9", "b.png")]


async def test_a_full_offload_fails_on_a_file_that_fails(offload: Offload) -> None:
    offload.store.fail[key("9", "a.png")] = StorageError("SlowDown", retryable=True)
    with pytest.raises(ApplicationError) as caught:
        await offload.run()
    assert caught.value.type == ErrorType.STORAGE_ERROR and not caught.value.non_retryable


async def test_partial_without_history_keeps_what_it_has(offload: Offload) -> None:
    del offload.comfy.history[PROMPT_ID]
    assert (await offload.run(partial=True)).artifacts == []


async def test_a_failed_prompt_fails_the_offload_with_its_own_reason(offload: Offload) -> None:
    messages = [["execution_error", {"node_id": "3", "exception_message": "boom"}]]
    offload.comfy.history[PROMPT_ID]["status"] = {"status_str": "error", "messages": messages}
    with pytest.raises(ApplicationError) as caught:
        await offload.run()
    assert caught.value.type == ErrorType.EXECUTION_ERROR and "boom" in caught.value.message


async def test_the_uploader_takes_each_file_once_and_never_previews(offload: Offload) -> None:
    uploader = offload.uploader()
    saved = image("a.png")
    assert uploader.wanted("9", saved)
    assert not uploader.wanted("9", image("a.png", kind="temp"))
    artifact = await uploader.upload("9", saved)
    assert not uploader.wanted("9", saved)
    assert uploader.wanted("10", saved), "the same file name of another node is another key"
    assert artifact.sha256 == offload.store.objects[artifact.key].sha256
    assert artifact.segment == 0 and artifact.node_id == "9"


async def test_a_cached_output_outside_the_run_folder_is_still_stored(offload: Offload) -> None:
    uploader = offload.uploader()
    artifact = await uploader.upload("9", image("a.png", subfolder="dc_earlier_run"))
    assert artifact.key == key("9", "a.png")


async def test_an_output_comfyui_no_longer_has_is_fatal(offload: Offload) -> None:
    uploader = offload.uploader()
    with pytest.raises(ApplicationError) as caught:
        await uploader.upload("9", image("gone.png"))
    assert caught.value.type == ErrorType.BACKEND_ERROR and caught.value.non_retryable
    assert uploader.wanted("9", image("gone.png")), "a failed upload may be tried again"


def test_view_reads_the_socket_in_large_pieces() -> None:
    # httpcore's 64 KiB reads cost about 2 s of event-loop CPU per GiB of /view, on the loop that
    # also sends the parts (bench group 5); importing the client raises them to 256 KiB.
    import httpcore

    from protocol.comfyui import client

    assert client.HTTP11_READ_BYTES == 256 * 1024
    assert httpcore.AsyncHTTP11Connection.READ_NUM_BYTES >= client.HTTP11_READ_BYTES
