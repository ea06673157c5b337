"""The worker's own ComfyUI: waiting for it to come up and staging input files (stopping our
prompt is endpoint/stopping.py). The HTTP calls themselves are
`activities.comfyui.client.ComfyClient`'s."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

import structlog

from activities.comfyui.client import ComfyClient, ComfyError
from activities.comfyui.follower import ComfyGone
from activities.runpod.contract import InputImage
from endpoint.inputs import decode_image
from endpoint.job_files import JobFiles

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


async def stage_images(client: ComfyClient, images: list[InputImage], files: JobFiles) -> None:
    """Upload the job's input files to ComfyUI's input folder under their own names (`files`
    keeps them, for their removal once the prompt has ended)."""
    for index, image in enumerate(images):
        data = decode_image(index, image)
        files.uploading(image.name)
        stored = await client.upload_image(image.name, data, overwrite=True)
        files.uploaded(stored)
        log.info("input_staged", name=image.name, stored_as=stored, size=len(data))
