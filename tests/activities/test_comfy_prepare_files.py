"""A comfyui pool's prepare holds every file input to the job's own files, the ones its server's
`/object_info` marks included, and uploads and binds each under the job's own name: against a
scripted ComfyUI (httpx.MockTransport), no server."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import pytest
from temporalio.exceptions import ApplicationError

from activities.comfyui.activities import ComfyActivities
from activities.comfyui.pools import ComfyPools
from activities.storage import ArtifactStore
from configuration.pools import PoolConfig
from configuration.settings import S3Settings, WorkerSettings
from workflows.activity_io import PrepareInput
from workflows.contracts import InlineInput
from workflows.shared import ErrorType

OBJECT_INFO: dict[str, Any] = {
    # A custom node pack's loader: its upload widget is the only sign it reads a file.
    "VHS_LoadVideo": {
        "input": {"required": {"video": [["a.mp4"], {"video_upload": True}]}},
        "output": ["IMAGE"],
    },
    # One whose path input carries no marker: only the pool's loader_inputs names it.
    "PathLoader": {"input": {"required": {"path": ["STRING", {}]}}, "output": ["IMAGE"]},
    "SaveImage": {
        "input": {"required": {"images": ["IMAGE"], "filename_prefix": ["STRING", {}]}},
        "output": [],
        "output_node": True,
    },
}


class Comfy:
    def __init__(self) -> None:
        self.uploads: list[str] = []
        self.prompts = 0

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/object_info":
            return httpx.Response(200, json=OBJECT_INFO)
        if request.url.path == "/upload/image":
            name = request.content.split(b'filename="', 1)[1].split(b'"', 1)[0].decode()
            self.uploads.append(name)
            return httpx.Response(200, json={"name": name, "subfolder": "", "type": "input"})
        self.prompts += 1
        return httpx.Response(404)


def graph_of(class_type: str, name: str, value: str) -> dict[str, Any]:
    return {
        "1": {"class_type": class_type, "inputs": {name: value}},
        "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "x"}},
    }


async def prepare(comfy: Comfy, req: PrepareInput, **pool: Any) -> Any:
    settings = WorkerSettings(
        pools={"gpu": PoolConfig(kind="comfyui", url="http://comfy.test", **pool)},
        default_pool="gpu",
    )
    async with httpx.AsyncClient(transport=httpx.MockTransport(comfy.handle)) as http:
        store = ArtifactStore(S3Settings.from_env({}, bucket="art"))  # never opened: inline only
        return await ComfyActivities(ComfyPools(settings, http), store).prepare_prompt(req)


async def test_a_marked_custom_loader_is_refused_another_jobs_file() -> None:
    comfy = Comfy()
    req = PrepareInput(job_id="j", pool="gpu", graph=graph_of("VHS_LoadVideo", "video", "a.mp4"))
    with pytest.raises(ApplicationError) as refused:
        await prepare(comfy, req)
    assert refused.value.type == ErrorType.MISSING_INPUT and refused.value.non_retryable
    assert "node '1' (VHS_LoadVideo) input 'video'" in refused.value.message
    assert comfy.uploads == [] and comfy.prompts == 0


async def test_a_marked_custom_loader_gets_the_jobs_own_upload_bound() -> None:
    comfy = Comfy()
    clip = InlineInput(filename="clip.mp4", data_b64=base64.b64encode(b"video").decode())
    req = PrepareInput(
        job_id="j",
        pool="gpu",
        graph=graph_of("VHS_LoadVideo", "video", "clip.mp4"),
        inputs={"clip.mp4": clip},
    )
    prepared = await prepare(comfy, req)
    assert comfy.uploads == ["dc_j_clip.mp4"]
    assert prepared.graph["1"]["inputs"]["video"] == "dc_j_clip.mp4"


async def test_a_pools_loader_inputs_name_an_unmarked_loader() -> None:
    comfy = Comfy()
    req = PrepareInput(job_id="j", pool="gpu", graph=graph_of("PathLoader", "path", "x.png"))
    await prepare(comfy, req)  # an ordinary string, as far as the registry tells
    with pytest.raises(ApplicationError) as refused:
        await prepare(comfy, req, loader_inputs={"PathLoader": ["path"]})
    assert refused.value.type == ErrorType.MISSING_INPUT
    assert comfy.uploads == []
