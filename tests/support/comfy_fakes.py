"""A ComfyUI and an S3 store small enough to drive PromptFollower and OutputUploader in-process.

HTTP goes through `httpx.MockTransport` (nothing leaves the process); the WebSocket is a real
`websockets` server on 127.0.0.1, port 0, because the follower opens it itself. Each connection
plays the next script of `ScriptedSocket.scripts`: frames, pauses, a cut, or silence.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import httpx
from temporalio.client import Client
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from activities.storage import ArtifactStore, StoredObject
from workflows.activity_io import FollowInput
from workflows.contracts import OutputSpec, ProgressReport
from workflows.errors import StorageError

PROMPT_ID = "prompt-1"
CLIENT_ID = "dc-client-1"
PNG = b"\x89PNG fake bytes"
GRAPH: dict[str, Any] = {"3": {"class_type": "KSampler", "inputs": {}}}
KEY = "jobs/job-1/0/9/img_00001_.png"


def request(**changes: Any) -> FollowInput:
    """The follow activity's input for the one prompt these fakes know, with `changes`."""
    base: dict[str, Any] = {
        "job_id": "job-1",
        "pool": "comfyui",
        "prompt_id": PROMPT_ID,
        "client_id": CLIENT_ID,
        "run_tag": "dc_job-1_0_prompt-1",
        "sampler_steps": {"3": 10},
        "nodes_total": 4,
        "output": OutputSpec(bucket="out"),
        "progress_interval_s": 0.0,
    }
    return FollowInput.model_validate(base | changes)


RUN_TAG = "dc_job-1_0_prompt-1"

Step = Callable[[ServerConnection], Awaitable[None]]


def frame(kind: str, **data: Any) -> dict[str, Any]:
    """A ComfyUI event about PROMPT_ID unless `prompt_id` says otherwise."""
    return {"type": kind, "data": {"prompt_id": PROMPT_ID} | data}


def image(name: str, subfolder: str = RUN_TAG, kind: str = "output") -> dict[str, str]:
    return {"filename": name, "subfolder": subfolder, "type": kind}


def executed(node: str, *images: dict[str, str]) -> dict[str, Any]:
    return frame("executed", node=node, display_node=node, output={"images": list(images)})


def send(*frames: dict[str, Any]) -> Step:
    async def step(ws: ServerConnection) -> None:
        for item in frames:
            await ws.send(json.dumps(item))

    return step


def pause(seconds: float) -> Step:
    async def step(_ws: ServerConnection) -> None:
        await asyncio.sleep(seconds)

    return step


def wait_for(event: asyncio.Event) -> Step:
    async def step(_ws: ServerConnection) -> None:
        await asyncio.wait_for(event.wait(), 5)

    return step


def call(action: Callable[[], None]) -> Step:
    async def step(_ws: ServerConnection) -> None:
        action()

    return step


async def cut(ws: ServerConnection) -> None:
    """A connection lost without a close handshake, as when ComfyUI dies or a proxy drops it."""
    ws.transport.abort()


@dataclass
class ScriptedSocket:
    """ComfyUI's /ws: connection N plays scripts[N], then stays open and silent."""

    scripts: list[list[Step]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    # Each handshake's Sec-WebSocket-Extensions offer (None: the client offered none).
    offered_extensions: list[str | None] = field(default_factory=list)

    @property
    def connections(self) -> int:
        return len(self.paths)

    async def handle(self, ws: ServerConnection) -> None:
        index = len(self.paths)
        self.paths.append(ws.request.path if ws.request else "")
        self.offered_extensions.append(
            ws.request.headers.get("Sec-WebSocket-Extensions") if ws.request else None
        )
        script = self.scripts[index] if index < len(self.scripts) else []
        try:
            for step in script:
                await step(ws)
            await ws.wait_closed()
        except ConnectionClosed:
            pass


@dataclass
class FakeComfy:
    """ComfyUI's HTTP API as far as the follower and the uploader use it."""

    running: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    history: dict[str, dict[str, Any]] = field(default_factory=dict)
    jobs: dict[str, str] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    view_status: int = 200
    # Where a POSTed prompt goes: "running", "pending" or nowhere (None).
    on_post: str | None = "running"
    posted: list[dict[str, Any]] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    # Called before a look at where a prompt is (GET /queue, or /api/jobs/{id}) is answered,
    # with how many looks there were (1 for the first).
    before_look: Callable[[int], None] | None = None
    # False: a ComfyUI before 0.8, without /api/jobs (its 404 is aiohttp's plain text).
    jobs_api: bool = True

    def count(self, prefix: str) -> int:
        return sum(1 for r in self.requests if r.startswith(prefix))

    def looks(self) -> int:
        return self.count("GET /queue") + self.count("GET /api/jobs/")

    def finish(self, prompt_id: str, *images: tuple[str, dict[str, str]]) -> None:
        """The prompt leaves the queue and its history entry lists `images` as (node, item)."""
        for queue in (self.running, self.pending):
            if prompt_id in queue:
                queue.remove(prompt_id)
        outputs: dict[str, Any] = {}
        for node, item in images:
            outputs.setdefault(node, {"images": []})["images"].append(item)
        self.history[prompt_id] = {
            "outputs": outputs,
            "status": {"status_str": "success", "completed": True, "messages": []},
        }

    def start(self, prompt_id: str) -> None:
        if prompt_id in self.pending:
            self.pending.remove(prompt_id)
        self.running.append(prompt_id)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.requests.append(f"{request.method} {path}")
        if path == "/queue" and request.method == "GET":
            if self.before_look is not None:
                self.before_look(self.looks())
            return httpx.Response(200, json=self._queue())
        if match := re.fullmatch(r"/history/(.+)", path):
            prompt_id = match.group(1)
            entry = self.history.get(prompt_id)
            return httpx.Response(200, json={prompt_id: entry} if entry else {})
        if path.startswith("/api/jobs") and not self.jobs_api:
            return httpx.Response(404, text="404: Not Found")
        if match := re.fullmatch(r"/api/jobs/(.+)", path):
            if self.before_look is not None:
                self.before_look(self.looks())
            job = self._job(match.group(1))
            if job is None:
                return httpx.Response(404, json={"error": "Job not found"})
            return httpx.Response(200, json=job)
        if path == "/api/jobs":
            assert request.url.params.get("status") == "pending", "only the pending are listed"
            pending = [self._job(p) for p in reversed(self.pending)]
            return httpx.Response(200, json={"jobs": pending, "pagination": {}})
        if path == "/prompt" and request.method == "POST":
            body = json.loads(request.content)
            self.posted.append(body)
            if self.on_post == "running":
                self.running.append(body["prompt_id"])
            elif self.on_post == "pending":
                self.pending.append(body["prompt_id"])
            return httpx.Response(
                200, json={"prompt_id": body["prompt_id"], "number": 1, "node_errors": {}}
            )
        if path == "/view":
            name = request.url.params["filename"]
            if self.view_status != 200 or name not in self.files:
                return httpx.Response(self.view_status if self.view_status != 200 else 404)
            return httpx.Response(200, content=self.files[name])
        if path == "/system_stats":
            return httpx.Response(200, json={"system": {}, "devices": []})
        return httpx.Response(404)

    def _job(self, prompt_id: str) -> dict[str, Any] | None:
        """As /api/jobs/{id} answers: `jobs` says a status of its own (the API disagreeing with
        the queue); otherwise the queue's and history's."""
        numbered = {pid: 10 + n for n, pid in enumerate(self.running + self.pending)}
        status = self.jobs.get(prompt_id)
        if status is None and prompt_id in self.history:
            failed = self.history[prompt_id].get("status", {}).get("status_str") == "error"
            status = "failed" if failed else "completed"
        elif status is None and prompt_id in numbered:
            status = "in_progress" if prompt_id in self.running else "pending"
        if status is None:
            return None
        return {"id": prompt_id, "status": status, "priority": numbered.get(prompt_id, 0)}

    def _queue(self) -> dict[str, list[list[Any]]]:
        # Numbers out of order on purpose: the place in line comes from `number`, not the list.
        numbered = {pid: 10 + n for n, pid in enumerate(self.running + self.pending)}
        return {
            "queue_running": [[numbered[p], p, {}, {}, []] for p in self.running],
            "queue_pending": [[numbered[p], p, {}, {}, []] for p in reversed(self.pending)],
        }


class FakeStore(ArtifactStore):
    """S3 in a dict. `fail` raises on upload of a key; `corrupt` makes `head` disagree."""

    def __init__(self) -> None:  # no S3 settings: nothing here talks to S3
        self.objects: dict[str, StoredObject] = {}
        self.uploads: list[str] = []
        self.fail: dict[str, StorageError] = {}
        self.corrupt: set[str] = set()
        self.heads: list[str] = []
        self.stored = asyncio.Event()

    async def upload_stream(
        self,
        key: str,
        chunks: AsyncIterable[bytes],
        *,
        content_type: str,
        bucket: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> StoredObject:
        self.uploads.append(key)
        body = b"".join([chunk async for chunk in chunks])
        if key in self.fail:
            raise self.fail[key]
        stored = StoredObject(
            bucket=bucket or "bucket",
            key=key,
            uri=f"s3://{bucket or 'bucket'}/{key}",
            size=len(body),
            sha256=hashlib.sha256(body).hexdigest(),
            content_type=content_type,
        )
        self.objects[key] = stored
        self.stored.set()
        return stored

    async def head(self, key: str, *, bucket: str | None = None) -> StoredObject | None:
        self.heads.append(key)
        found = self.objects.get(key)
        if found is not None and key in self.corrupt:
            return found.model_copy(update={"sha256": "0" * 64})
        return found


class _Handle:
    def __init__(self, sink: list[ProgressReport]) -> None:
        self._sink = sink

    async def signal(self, name: str, arg: Any) -> None:
        assert name == "progress"
        self._sink.append(arg)


class SignalRecorder:
    """Stands in for `activity.client()`: keeps the progress reports the follower sends."""

    def __init__(self) -> None:
        self.reports: list[ProgressReport] = []

    def get_workflow_handle(self, workflow_id: str) -> _Handle:
        return _Handle(self.reports)

    def as_client(self) -> Client:
        return cast(Client, self)

    def stages(self) -> list[tuple[str, int | None]]:
        return [(r.stage, r.queue_position) for r in self.reports]


@asynccontextmanager
async def comfy_on_loopback(
    comfy: FakeComfy, socket: ScriptedSocket
) -> AsyncIterator[tuple[str, httpx.AsyncClient]]:
    """The base URL (its host:port is the WebSocket server) and an HTTP client for `comfy`."""
    async with serve(socket.handle, "127.0.0.1", 0) as server:
        host, port = next(iter(server.sockets)).getsockname()[:2]
        transport = httpx.MockTransport(comfy.handle)
        async with httpx.AsyncClient(transport=transport) as http:
            yield f"http://{host}:{port}", http
