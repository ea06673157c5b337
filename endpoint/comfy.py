"""The worker's own ComfyUI: waiting for it to come up, staging input files, and forgetting a
prompt a takeover must run again (stopping our prompt is endpoint/stopping.py). The HTTP calls
themselves are `protocol.comfyui.client.ComfyClient`'s, but for `POST /history`."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

import httpx
import structlog

from endpoint.inputs import decode_image
from endpoint.job_files import JobFiles
from protocol.comfyui.client import ComfyClient
from protocol.comfyui.events import ending_of
from protocol.errors import ComfyError, ComfyGone, ComfyHTTPError, ComfyUnavailable
from protocol.runpod.contract import InputImage

log = structlog.get_logger(__name__)

POLL_S = 0.5


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


async def wait_for_comfy(
    client: ComfyClient,
    *,
    pid: int | None,
    timeout_s: float,
    on_waiting: Callable[[], None] | None = None,
) -> None:
    """Return once ComfyUI answers `/system_stats`.

    While its process (`pid`) lives there is no cap: a cold start that loads custom nodes or
    large models can take many minutes, and the platform's executionTimeout bounds the job.
    Without a pid, `timeout_s` does.
    """
    started = time.monotonic()
    told = False
    while True:
        try:
            await client.system_stats()
            if told:
                log.info("comfy_ready", waited_s=round(time.monotonic() - started, 1))
            return
        except ComfyError as exc:
            reason = str(exc)
        if pid is not None and not process_alive(pid):
            raise ComfyGone(f"ComfyUI (pid {pid}) exited before answering: {reason}")
        if pid is None and time.monotonic() - started > timeout_s:
            raise ComfyGone(f"ComfyUI did not answer within {timeout_s:.0f} s: {reason}")
        if not told:
            told = True
            log.info("comfy_waiting", url=client.base_url, pid=pid, reason=reason)
            if on_waiting is not None:
                on_waiting()
        await asyncio.sleep(POLL_S)


async def forget_interrupted(client: ComfyClient, prompt_id: str) -> bool:
    """Drop the prompt's history entry when it says the prompt was interrupted; True if so.

    A delivery that takes a claim over runs the prompt again under the same ID, and the
    follower re-attaches to any prompt ComfyUI knows, even an ended one: right for a prompt
    that runs or succeeded here (a re-delivery to this worker), wrong for one a fence or a lost
    claim interrupted here, which would answer for the new run as interrupted. ComfyUI's
    `POST /history {"delete": [id]}` forgets it, and the prompt is submitted anew."""
    entry = await client.history(prompt_id)
    if entry is None or ending_of(entry).outcome != "interrupted":
        return False
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as http:
        try:
            response = await http.post(f"{client.base_url}/history", json={"delete": [prompt_id]})
        except httpx.TransportError as exc:
            raise ComfyUnavailable(f"POST /history: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise ComfyHTTPError(f"POST /history: HTTP {response.status_code}", response.status_code)
    log.info("interrupted_prompt_forgotten", prompt_id=prompt_id)
    return True


async def stage_images(client: ComfyClient, images: list[InputImage], files: JobFiles) -> None:
    """Upload the job's input files to ComfyUI's input folder under their own names (`files`
    keeps them, for their removal once the prompt has ended)."""
    for index, image in enumerate(images):
        data = decode_image(index, image)
        files.uploading(image.name)
        stored = await client.upload_image(image.name, data, overwrite=True)
        files.uploaded(stored)
        log.info("input_staged", name=image.name, stored_as=stored, size=len(data))
