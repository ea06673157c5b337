"""The orphan sweep: prompts still on a pool whose job is over.

`temporal workflow terminate` (or a run timeout) ends a job without its teardown: the prompt
keeps the GPU busy and nobody is left to stop it. Every prompt this system submits carries a tag
in ComfyUI's `extra_data` (the job id and the Temporal namespace); each worker periodically
lists every pool's queue and stops the tagged prompts whose workflow is closed or unknown: a
pending one is dequeued, a running one interrupted (prompt-scoped, so nothing else is touched).
Prompts of other namespaces or of other systems are never touched. Running it on several workers
is harmless: dequeue and prompt-scoped interrupt are idempotent.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Mapping
from typing import Any, Literal

import structlog
from pydantic import BaseModel
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from activities.comfyui.client import ComfyClient, ComfyError

log = structlog.get_logger(__name__)

TAG_KEY = "durable_comfy"


def prompt_tag(job_id: str, segment: int) -> dict[str, Any]:
    """The `extra_data` every prompt is submitted with: whose it is."""
    namespace = activity.info().namespace if activity.in_activity() else ""
    return {TAG_KEY: {"job_id": job_id, "segment": segment, "namespace": namespace}}


class SweptPrompt(BaseModel):
    pool: str
    prompt_id: str
    job_id: str
    job: str  # the workflow's status, or "unknown"
    action: Literal["dequeued", "interrupted"]


class OrphanSweeper:
    """Stops the prompts of closed or unknown jobs on every ComfyUI pool of this worker."""

    def __init__(
        self,
        temporal: Client,
        pools: Mapping[str, ComfyClient],
        *,
        on_swept: Callable[[SweptPrompt], None] | None = None,
    ) -> None:
        self._temporal = temporal
        self._pools = pools
        self._on_swept = on_swept

    async def run(self, interval_s: float, stop: asyncio.Event) -> None:
        """Sweep every `interval_s` (jittered, so many workers do not sweep in step)."""
        while not stop.is_set():
            try:
                await self.sweep_once()
            except Exception:  # a sweep must never take the worker down
                log.exception("orphan_sweep_failed")
            delay = interval_s * random.uniform(0.75, 1.25)
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay)
            except TimeoutError:
                pass

    async def sweep_once(self) -> list[SweptPrompt]:
        swept: list[SweptPrompt] = []
        for pool, client in self._pools.items():
            try:
                swept += await self._sweep_pool(pool, client)
            except ComfyError as exc:
                log.info("orphan_sweep_pool_unreachable", pool=pool, error=str(exc))
        return swept

    async def _sweep_pool(self, pool: str, client: ComfyClient) -> list[SweptPrompt]:
        queue = await client.queue()
        swept: list[SweptPrompt] = []
        for where in ("queue_running", "queue_pending"):
            for item in queue.get(where, []):
                job_id = self._our_job(item)
                if job_id is None:
                    continue
                job = await self._job_state(job_id)
                if job == "RUNNING":
                    continue
                prompt_id = str(item[1])
                if where == "queue_pending":
                    await client.delete_pending(prompt_id)
                    action: Literal["dequeued", "interrupted"] = "dequeued"
                else:
                    await client.interrupt(prompt_id)
                    action = "interrupted"
                orphan = SweptPrompt(
                    pool=pool, prompt_id=prompt_id, job_id=job_id, job=job, action=action
                )
                log.warning("orphan_swept", **orphan.model_dump())
                if self._on_swept is not None:
                    self._on_swept(orphan)
                swept.append(orphan)
        return swept

    def _our_job(self, item: list[Any]) -> str | None:
        extra = item[3] if len(item) > 3 and isinstance(item[3], dict) else {}
        tag = extra.get(TAG_KEY)
        if not isinstance(tag, dict) or tag.get("namespace") != self._temporal.namespace:
            return None
        job_id = tag.get("job_id")
        return job_id if isinstance(job_id, str) and job_id else None

    async def _job_state(self, job_id: str) -> str:
        """The workflow's status name; "unknown" when Temporal has no such workflow."""
        try:
            described = await self._temporal.get_workflow_handle(job_id).describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return "unknown"
            raise
        status = described.status
        if status is None:
            return "unknown"
        return "RUNNING" if status == WorkflowExecutionStatus.RUNNING else status.name
