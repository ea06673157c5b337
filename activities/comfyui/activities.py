"""Activities that talk to a ComfyUI pool: prepare, and stop (one check).

Submitting and following a prompt live in `follow.py`, storing its outputs in `offload.py`.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any, Literal

import structlog

from activities.comfyui.graph import output_nodes, refuse_foreign_files, refuse_hostile_graph
from activities.comfyui.pools import ComfyPools, PoolHealth, find_prompt
from activities.comfyui.registry import PoolRegistries
from activities.errors import fatal, from_comfy, from_storage
from activities.inputs import input_bytes
from activities.storage import ArtifactStore
from protocol.comfyui.client import ComfyClient
from protocol.comfyui.events import ending_of
from protocol.errors import ComfyError, ComfyUnavailable
from protocol.keys import content_type_for, safe_component
from protocol.runpod.contract import S3Target, inputs_folder
from workflows.activity_io import (
    PreparedJob,
    PrepareInput,
    StopCheck,
    StopInput,
)
from workflows.errors import GraphFormatError, StorageError
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
        # A pool of many servers runs the same nodes on each: any that answers tells them.
        # Its input files are staged in the bucket, since the queue picks the server later;
        # the follow uploads them to that server before the prompt.
        clients = self._pools.clients_of(pool)
        staging = config.assigns_servers
        for index, overrides in enumerate(req.segments):
            try:
                apply_overrides(req.graph, overrides)  # names only nodes that exist
            except GraphFormatError as exc:
                raise fatal(ErrorType.INVALID_REQUEST, f"segment {index}: {exc}") from exc
        problems, object_info, client = await self._check_registry(pool, clients, req.graph)
        if problems:
            raise fatal(ErrorType.INVALID_GRAPH, "; ".join(problems), problems=problems)
        file_inputs = refuse_foreign_files(req, pool, config, object_info)

        bound: dict[str, str] = {}
        staged: dict[str, str] = {}
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
                if staging:
                    staged[stored_as] = await self._stage(req, stored_as, data)
                    bound[file_name] = stored_as
                    continue
                try:
                    bound[file_name] = await client.upload_image(stored_as, data)
                except ComfyError as exc:
                    raise from_comfy(exc, f"uploading input {file_name!r}") from exc
        graph = bind_files(req.graph, bound, file_inputs)
        log.info("prepared", job_id=req.job_id, pool=pool, inputs=len(bound), staged=staging)
        return PreparedJob(
            pool=pool,
            kind="comfyui",
            graph=graph,
            sampler_steps=graph_sampler_steps(graph),
            nodes_total=len(graph),
            output_nodes=output_nodes(graph, object_info),
            staged_inputs=staged,
        )

    async def _check_registry(
        self, pool: str, clients: list[ComfyClient], graph: dict[str, Any]
    ) -> tuple[list[str], dict[str, Any], ComfyClient]:
        """The graph's problems by the pool's node registry, read from the first of its servers
        that answers (all but the last may fail: `ComfyUnavailable` only when none answers)."""
        for index, client in enumerate(clients):
            try:
                problems, object_info = await self._registries.check(pool, client, graph)
            except ComfyUnavailable as exc:
                if index < len(clients) - 1:
                    log.info("registry_server_unreachable", pool=pool, server=client.base_url)
                    continue
                raise from_comfy(exc, "reading the node registry") from exc
            except ComfyError as exc:
                raise from_comfy(exc, "reading the node registry") from exc
            return problems, object_info, client
        raise AssertionError("a comfyui pool has at least one server")

    async def _stage(self, req: PrepareInput, stored_as: str, data: bytes) -> str:
        """The input file in the job's folder of the bucket, for the follow to upload."""
        bucket = req.output.bucket or self._store.settings.bucket
        target = S3Target(bucket=bucket, prefix=req.output.prefix)
        key = f"{inputs_folder(target, req.job_id)}/{safe_component(stored_as)}"
        try:
            await self._store.put_small(
                key, data, content_type=content_type_for(stored_as), bucket=bucket
            )
        except StorageError as exc:
            raise from_storage(exc, f"staging input {stored_as!r}") from exc
        return key

    async def stop_prompt(self, req: StopInput) -> StopCheck:
        """One check of a stop: dequeue if queued, interrupt if running, say how it ended.

        The workflow repeats it on a durable backoff until the prompt is gone or the teardown
        horizon passes: interrupts are cooperative, and a node without a progress hook runs
        to its end first. Re-sending a prompt-scoped interrupt is harmless (it only ever
        touches this prompt).
        """
        bound = log.bind(job_id=req.job_id, prompt_id=req.prompt_id, server=req.server)
        try:
            client = await self._stop_client(req)
            if client is None:
                # On no server of the pool (each answered): never sent, or gone with a
                # restart; `stop_step` on any of them says which, by the request's terms.
                client = self._pools.clients_of(req.named_pool)[0]
            where = self._pools.health_key(req.named_pool, client)
            return await stop_step(client, req, self._pools.health, bound, where)
        except ComfyError as exc:
            # Expected while a backend restarts, and the workflow asks again: one line per
            # check, the traceback only for the last one.
            bound.warning("stop_check_unreachable", error=str(exc), exc_info=req.final)
            return StopCheck(
                at=datetime.now(UTC), position="unreachable", message=f"{type(exc).__name__}: {exc}"
            )

    async def _stop_client(self, req: StopInput) -> ComfyClient | None:
        """The server to stop the prompt on: the one named, else (a pool of many servers, the
        job never heard where its prompt went) the one holding it; None when none does. A
        server that cannot be asked leaves it unknown: `ComfyUnavailable`, the check is
        "unreachable" and asked again."""
        pool = self._pools.resolve(req.named_pool)
        if req.server is not None or not self._pools.config(pool).assigns_servers:
            return self._pools.client(pool, req.server)
        found, unreachable = await find_prompt(self._pools.clients_of(pool), req.prompt_id)
        if found is None and unreachable:
            raise ComfyUnavailable(f"servers {', '.join(unreachable)} could not be asked")
        return found


async def stop_step(
    client: ComfyClient, req: StopInput, health: PoolHealth, bound: Any, where: str
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
            health.mark_busy(where, req.prompt_id, req.job_id)
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
