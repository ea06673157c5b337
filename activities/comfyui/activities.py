"""Activities that talk to a ComfyUI pool: prepare, and stop (one check).

Submitting and following a prompt live in `follow.py`, storing its outputs in `offload.py`.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any, Literal

import structlog

from activities.comfyui.graph import output_nodes, refuse_foreign_files, refuse_hostile_graph
from activities.comfyui.pools import ComfyPools, PoolHealth
from activities.comfyui.registry import PoolRegistries
from activities.errors import fatal, from_comfy
from activities.inputs import input_bytes
from activities.storage import ArtifactStore
from protocol.comfyui.client import ComfyClient
from protocol.comfyui.events import ending_of
from protocol.errors import ComfyError
from workflows.activity_io import (
    PreparedJob,
    PrepareInput,
    StopCheck,
    StopInput,
)
from workflows.errors import GraphFormatError
from workflows.graph import apply_overrides, bind_files, load_node_files
from workflows.graph import sampler_steps as graph_sampler_steps
from workflows.shared import ErrorType

log = structlog.get_logger(__name__)

MAX_INPUT_BYTES = 100 * 1024 * 1024  # ComfyUI's own --max-upload-size default


class ComfyActivities:
    def __init__(self, pools: ComfyPools, store: ArtifactStore) -> None:
        self._pools = pools
        self._store = store
        self._registries = PoolRegistries()

    async def prepare_prompt(self, req: PrepareInput) -> PreparedJob:
        """Check the graph against the pool's node registry and bind input files to it."""
        pool = self._pools.resolve(req.pool)
        config = self._pools.config(pool)
        refuse_hostile_graph(req, pool, config)
        client = self._pools.client(pool)
        for index, overrides in enumerate(req.segments):
            try:
                apply_overrides(req.graph, overrides)  # names only nodes that exist
            except GraphFormatError as exc:
                raise fatal(ErrorType.INVALID_REQUEST, f"segment {index}: {exc}") from exc
        try:
            problems, object_info = await self._registries.check(pool, client, req.graph)
        except ComfyError as exc:
            raise from_comfy(exc, "reading the node registry") from exc
        if problems:
            raise fatal(ErrorType.INVALID_GRAPH, "; ".join(problems), problems=problems)
        file_inputs = refuse_foreign_files(req, pool, config, object_info)

        bound: dict[str, str] = {}
        for node_id, input_name, file_name in load_node_files(req.graph, file_inputs):
            ref = req.inputs.get(file_name)
            if ref is None:
                # Unreachable after refuse_hostile_graph: a load node reads declared inputs
                # only, never whatever the backend's input folder holds (another job's upload).
                raise fatal(
                    ErrorType.MISSING_INPUT,
                    f"node {node_id} loads {file_name!r}, which is not in the request's inputs",
                    node_id=node_id,
                    input=input_name,
                )
            if file_name not in bound:
                data = await input_bytes(self._store, file_name, ref, limit=MAX_INPUT_BYTES)
                stored_as = upload_name(req.job_id, file_name)
                try:
                    bound[file_name] = await client.upload_image(stored_as, data)
                except ComfyError as exc:
                    raise from_comfy(exc, f"uploading input {file_name!r}") from exc
        graph = bind_files(req.graph, bound, file_inputs)
        log.info("prepared", job_id=req.job_id, pool=pool, inputs=len(bound))
        return PreparedJob(
            pool=pool,
            kind="comfyui",
            graph=graph,
            sampler_steps=graph_sampler_steps(graph),
            nodes_total=len(graph),
            output_nodes=output_nodes(graph, object_info),
        )

    async def stop_prompt(self, req: StopInput) -> StopCheck:
        """One check of a stop: dequeue if queued, interrupt if running, say how it ended.

        The workflow repeats it on a durable backoff until the prompt is gone or the teardown
        horizon passes: interrupts are cooperative, and a node without a progress hook runs
        to its end first. Re-sending a prompt-scoped interrupt is harmless (it only ever
        touches this prompt).
        """
        client = self._pools.client(req.named_pool)
        bound = log.bind(job_id=req.job_id, prompt_id=req.prompt_id)
        try:
            return await stop_step(client, req, self._pools.health, bound)
        except ComfyError as exc:
            # Expected while a backend restarts, and the workflow asks again: one line per
            # check, the traceback only for the last one.
            bound.warning("stop_check_unreachable", error=str(exc), exc_info=req.final)
            return StopCheck(
                at=datetime.now(UTC), position="unreachable", message=f"{type(exc).__name__}: {exc}"
            )


async def stop_step(
    client: ComfyClient, req: StopInput, health: PoolHealth, bound: Any
) -> StopCheck:
    place = await client.queue_place(req.prompt_id)
    action: Literal["none", "dequeued", "interrupt_sent"] = "none"
    if place.where == "pending":
        await client.delete_pending(req.prompt_id)
        action = "dequeued"
    elif place.where == "running":
        await client.interrupt(req.prompt_id)
        action = "interrupt_sent"
    freed = False
    if req.free_memory:
        await client.free(unload_models=True, free_memory=True)
        freed = True
    if action != "none":
        # A dequeue is immediate; an interrupt lands at the next node or step, often at once.
        place = await client.queue_place(req.prompt_id)
    now = datetime.now(UTC)
    if place.where is not None:
        if req.final:
            health.mark_busy(req.named_pool, req.prompt_id, req.job_id)
        bound.info("stop_pending", position=place.where, action=action)
        return StopCheck(at=now, position=place.where, action=action, freed_memory=freed)
    ending = ending_of(await client.history(req.prompt_id))
    if ending.outcome == "unknown" and await client.job_state(req.prompt_id) in (
        "pending",
        "in_progress",
    ):
        # /queue and /api/jobs disagree for a moment around a prompt's start: ask again later.
        return StopCheck(at=now, position="running", action=action, freed_memory=freed)
    bound.info("stop_confirmed", action=action, ended=ending.outcome, node=ending.node)
    return StopCheck(
        at=now,
        position="gone",
        action=action,
        ended=ending.outcome,
        node=ending.node,
        node_type=ending.node_type,
        message=ending.message,
        freed_memory=freed,
    )


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def upload_name(job_id: str, file_name: str) -> str:
    """A backend-side name unique to the job, so concurrent jobs never overwrite each other."""
    base = _UNSAFE.sub("_", file_name.rsplit("/", 1)[-1]).strip("._") or "input"
    return f"dc_{_UNSAFE.sub('_', job_id)}_{base}"
