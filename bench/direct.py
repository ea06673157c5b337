"""The baseline for the overhead: the same work a job does, done directly by a script.

Open ComfyUI's socket, POST /prompt, follow the socket to the end of the prompt, GET /view each
output and put_object it to S3. No durability: no checkpoint, no verification, no retry. The
HTTP and S3 clients stay open between runs, as the worker's do.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import httpx
from botocore.exceptions import ConnectTimeoutError
from pydantic import BaseModel

from activities.storage import ArtifactStore
from protocol.comfyui.socket import comfy_socket

PUT_ATTEMPTS = 4


class DirectRun(BaseModel):
    """Epoch seconds of each phase's end, from `started`."""

    started: float
    queued: float  # POST /prompt answered
    executed: float  # the socket said the prompt is done
    closed: float  # the socket closed (its close handshake is the client's to wait for)
    stored: float  # every output in S3
    outputs: int
    prompt_id: str = ""
    # (step, epoch seconds) of each `progress` frame as this client received it
    steps: list[tuple[int, float]] = []

    @property
    def seconds(self) -> float:
        return self.stored - self.started


def _ws_url(comfy_url: str, client_id: str) -> str:
    base = comfy_url.rstrip("/").replace("https://", "wss://").replace("http://", "ws://")
    return f"{base}/ws?clientId={client_id}"


async def run_direct(
    http: httpx.AsyncClient, store: ArtifactStore, comfy_url: str, graph: dict[str, Any]
) -> DirectRun:
    started = time.time()
    client_id = uuid.uuid4().hex
    images: list[dict[str, Any]] = []
    steps: list[tuple[int, float]] = []
    # No keepalive pings: with a thousand sockets on one loop (the scale group's baseline) a
    # pong waits behind the frames queued before it longer than websockets' 20 s, and the
    # baseline would fail for its client's load, not for the work it measures.
    async with comfy_socket(_ws_url(comfy_url, client_id), max_size=None, ping_interval=None) as ws:
        response = await http.post(
            f"{comfy_url}/prompt", json={"prompt": graph, "client_id": client_id}
        )
        response.raise_for_status()
        prompt_id = response.json()["prompt_id"]
        queued = time.time()
        async for frame in ws:
            if not isinstance(frame, str):
                continue  # binary previews
            message = json.loads(frame)
            data = message.get("data") or {}
            if data.get("prompt_id") != prompt_id:
                continue
            kind = message.get("type")
            if kind == "progress":
                steps.append((int(data.get("value", 0)), time.time()))
            elif kind == "executed":
                images.extend((data.get("output") or {}).get("images") or [])
            elif kind in ("execution_error", "execution_interrupted"):
                raise RuntimeError(f"direct prompt {prompt_id} ended with {kind}")
            elif kind == "executing" and data.get("node") is None:
                executed = time.time()
                break
        else:
            raise RuntimeError(f"direct prompt {prompt_id}: the socket closed before its end")
    closed = time.time()
    for image in images:
        view = await http.get(
            f"{comfy_url}/view",
            params={
                "filename": image["filename"],
                "subfolder": image.get("subfolder", ""),
                "type": image.get("type", "output"),
            },
        )
        view.raise_for_status()
        for attempt in range(1, PUT_ATTEMPTS + 1):
            try:
                await store.client.put_object(
                    Bucket=store.settings.bucket,
                    Key=f"bench-direct/{prompt_id}/{image['filename']}",
                    Body=view.content,
                    ContentType=view.headers.get("content-type", "application/octet-stream"),
                )
                break
            except ConnectTimeoutError:
                # A thousand of these at once on 2 cores: the loop may not get to a connect
                # within the store's 5 s. A direct client would try again; so does this one.
                if attempt == PUT_ATTEMPTS:
                    raise
    return DirectRun(
        started=started,
        queued=queued,
        executed=executed,
        closed=closed,
        stored=time.time(),
        outputs=len(images),
        prompt_id=prompt_id,
        steps=steps,
    )
