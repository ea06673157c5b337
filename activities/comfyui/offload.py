"""Storing ComfyUI outputs in S3: each file once, streamed, verified.

`OutputUploader` is shared by `follow_prompt` (uploads as each node finishes) and
`offload_outputs` (reconciles against `/history`, the source of truth, once the prompt ended;
with `partial`, keeps what finished after a failure or cancel).

Output records are untrusted (a custom node or a hostile backend writes them). Only `type:
output` records are artifacts; previews (`temp`) and anything else are never fetched. Before
`/view` is asked, a record is refused (`OutputMissing`, non-retryable, naming it) when its names
could leave ComfyUI's output folder (`client.check_view_request`), or when its subfolder is
another run's folder (`dc_<job>_<segment>_<prompt>`, `workflows.graph.run_tag`): every literal
save prefix is rewritten into this run's folder, and a saving node whose prefix differs never
hits another run's cache, so no record of ours points there; following it would read another
job's output. A record outside every run folder is kept: a prefix we could not rewrite (linked
from a `PrimitiveString`) saves there, and a cache hit then names an earlier identical run's
file. Whatever the names, the S3 key is `protocol.keys.artifact_key`, inside the job's folder.

`/view` is read with aiohttp (`view_stream`), not through the shared httpx client: httpx's
HTTP/1.1 path (anyio, h11's buffers) costs the event loop that also sends the parts to S3 about
twice aiohttp's CPU per byte received (0.9-1.2 against 0.45-0.5 s per GiB here), and an upload
of a large output is bounded by that loop (bench group 5). Each upload has a session and a
connection of its own: outputs arrive a node apart, mostly after the shared pool's keep-alive
would have dropped its connection anyway. The same checks, status mapping and errors as
`ComfyClient.view`; a client built on a transport of its own (a mock, an in-process app) is read
through that transport, which aiohttp cannot reach.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import httpx
import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.comfyui.pools import ComfyPools, locate_prompt
from activities.errors import fatal, from_comfy, from_storage, history_failure, retryable
from activities.metrics import count_offloaded
from activities.storage import ArtifactStore
from protocol.comfyui.client import ComfyClient, check_view_request
from protocol.comfyui.events import output_files
from protocol.comfyui.history import (
    failed_in_history,
    history_messages,
    history_when_written,
    outputs_of,
)
from protocol.errors import (
    ComfyError,
    ComfyHTTPError,
    ComfyUnavailable,
    HistoryMissing,
    UnsafeOutputName,
)
from protocol.keys import artifact_key, content_type_for, in_another_run, shown
from workflows.activity_io import OffloadInput, OffloadResult
from workflows.contracts import Artifact, OutputSpec
from workflows.errors import StorageError
from workflows.shared import ErrorType

log = structlog.get_logger(__name__)

MAX_PARALLEL_UPLOADS = 2
# The worker's httpx client's: 5 s to connect, 30 s at most between two reads of the body.
VIEW_CONNECT_TIMEOUT_S = 5.0
VIEW_READ_TIMEOUT_S = 30.0


@functools.cache
def _tls_context() -> ssl.SSLContext:
    # What the worker's httpx client (trust_env=False) verifies with: the same CA bundle as every
    # other ComfyUI call. Built once: loading the bundle takes 30-50 ms.
    return httpx.create_ssl_context(trust_env=False)


def _reads_network(client: ComfyClient) -> bool:
    """True when `client` reaches ComfyUI over the network (httpx's own HTTP transport), where
    aiohttp reaches it too."""
    transport = getattr(getattr(client, "_http", None), "_transport", None)
    return isinstance(transport, httpx.AsyncHTTPTransport)


@asynccontextmanager
async def view_stream(
    client: ComfyClient, filename: str, subfolder: str, kind: str
) -> AsyncIterator[AsyncIterator[bytes]]:
    """An output file's bytes from ComfyUI's GET /view, chunks as they arrive (module
    docstring): `ComfyClient.view`'s contract (`UnsafeOutputName` before anything is sent,
    `ComfyUnavailable` for no connection, a timeout or a 5xx, `ComfyHTTPError` for any other
    status but 200), read with aiohttp."""
    if not _reads_network(client):
        async with client.view(filename, subfolder, kind) as chunks:
            yield chunks
        return
    check_view_request(filename, subfolder, kind)
    params = {"filename": filename, "subfolder": subfolder, "type": kind}
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=VIEW_CONNECT_TIMEOUT_S, sock_read=VIEW_READ_TIMEOUT_S
    )
    url = client.base_url + "/view"
    async with AsyncExitStack() as stack:
        try:
            session = await stack.enter_async_context(
                aiohttp.ClientSession(timeout=timeout, trust_env=False)
            )
            response = await stack.enter_async_context(
                session.get(
                    url,
                    params=params,
                    allow_redirects=False,  # as httpx: a redirect is an answer, not followed
                    ssl=_tls_context() if url.startswith("https:") else True,
                )
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ComfyUnavailable(f"GET /view: {type(exc).__name__}: {exc}") from exc
        if response.status >= 500:
            raise ComfyUnavailable(f"GET /view: HTTP {response.status}")
        if response.status != 200:
            raise ComfyHTTPError(
                f"GET /view {shown(filename)}: HTTP {response.status}", response.status
            )
        # Chunks as aiohttp received them (up to 256 KiB, asyncio's read size), not re-chunked:
        # the uploader cuts its own parts. A failure mid-body surfaces in the consumer's loop.
        yield response.content.iter_any()


class OutputUploader:
    """Streams ComfyUI output files (`/view`) into S3, each file at most once."""

    def __init__(
        self,
        client: ComfyClient,
        store: ArtifactStore,
        *,
        job_id: str,
        segment: int,
        output: OutputSpec,
        stored: list[Artifact],
        run_tag: str,
    ) -> None:
        self._run_tag = run_tag
        self._client = client
        self._store = store
        self._job_id = job_id
        self._segment = segment
        self._output = output
        self.artifacts: dict[str, Artifact] = {a.key: a for a in stored}
        # Keys this uploader stored itself: each confirmed by `upload_stream` as it was stored.
        self.confirmed: set[str] = set()
        self._in_flight: set[str] = set()
        self._limit = asyncio.Semaphore(MAX_PARALLEL_UPLOADS)

    def key_for(self, node_id: str, item: Mapping[str, str]) -> str:
        return artifact_key(
            self._output.prefix, self._job_id, self._segment, node_id, item["filename"]
        )

    def wanted(self, node_id: str, item: Mapping[str, str]) -> bool:
        """Only saved outputs are artifacts; previews (`temp`) are not kept."""
        if item.get("type", "output") != "output":
            return False
        key = self.key_for(node_id, item)
        return key not in self.artifacts and key not in self._in_flight

    async def upload(self, node_id: str, item: Mapping[str, str]) -> Artifact:
        """Store one output file that this prompt's own record (event or history) names.

        Whatever named the file (a literal prefix rewritten to the run tag, a linked
        `PrimitiveString`, a custom node's own input) the record is the prompt's, so the file
        is its output, in the run's folder or outside every run's folder (a linked prefix, or a
        cache hit naming an earlier identical run's file). One in another run's folder, or whose
        names could leave the output folder, is refused before anything is fetched (module
        docstring).
        """
        self._refuse_unsafe(node_id, item)
        if not _from_this_run(item, self._run_tag):
            log.info(
                "output_outside_run_folder",
                job_id=self._job_id,
                node_id=node_id,
                filename=item.get("filename"),
                subfolder=item.get("subfolder", ""),
            )
        key = self.key_for(node_id, item)
        self._in_flight.add(key)
        try:
            async with self._limit:
                content_type = content_type_for(item["filename"])
                async with view_stream(
                    self._client,
                    item["filename"],
                    item.get("subfolder", ""),
                    item.get("type", "output"),
                ) as chunks:
                    stored = await self._store.upload_stream(
                        key, chunks, content_type=content_type, bucket=self._output.bucket
                    )
        except ComfyError as exc:
            raise from_comfy(exc, f"fetching output {shown(item['filename'])}") from exc
        except StorageError as exc:
            raise from_storage(exc, f"storing {key}") from exc
        finally:
            self._in_flight.discard(key)
        artifact = Artifact(
            **stored.model_dump(exclude={"bucket"}), node_id=node_id, segment=self._segment
        )
        self.artifacts[key] = artifact
        self.confirmed.add(key)
        count_offloaded(stored.size)
        log.info("artifact_stored", job_id=self._job_id, key=key, size=stored.size)
        return artifact

    def _refuse_unsafe(self, node_id: str, item: Mapping[str, str]) -> None:
        subfolder = item.get("subfolder", "")
        try:
            check_view_request(item["filename"], subfolder, item.get("type", "output"))
        except UnsafeOutputName as exc:
            reason = str(exc)
        else:
            if not in_another_run(subfolder, self._run_tag):
                return
            reason = (
                f"output {shown(item['filename'])} is in another run's folder "
                f"{shown(subfolder)}, not this run's {shown(self._run_tag)}: refused, not fetched"
            )
        log.warning("output_refused", job_id=self._job_id, node_id=node_id, reason=reason)
        raise fatal(ErrorType.OUTPUT_MISSING, f"node {shown(node_id)}: {reason}")


class OffloadActivities:
    def __init__(self, pools: ComfyPools, store: ArtifactStore) -> None:
        self._pools = pools
        self._store = store

    async def _client_of(self, req: OffloadInput) -> ComfyClient:
        """The server that ran the prompt: the one named, else (a pool of many servers whose
        job never said) the one whose history holds it."""
        config = self._pools.config(self._pools.resolve(req.named_pool))
        if req.server is not None or not config.assigns_servers:
            return self._pools.client(req.named_pool, req.server)
        client = await locate_prompt(self._pools.clients_of(req.named_pool), req.prompt_id)
        if client is None:
            raise retryable(
                ErrorType.BACKEND_UNAVAILABLE,
                f"no server of pool {req.named_pool!r} could be found to hold prompt "
                f"{req.prompt_id}",
            )
        return client

    async def offload_outputs(
        self,
        req: OffloadInput,
        *,
        beat: Callable[[], None] | None = None,
        confirmed: Collection[str] = (),
        history: Awaitable[dict[str, Any]] | None = None,
    ) -> OffloadResult:
        """Store every saved output the history lists, and verify in S3 each one this activity
        did not itself store and confirm (`confirmed`: the keys the follow stored just before,
        in the same activity; earlier attempts' artifacts are asked for again).

        `beat` heartbeats between uploads (default: a bare heartbeat); the follow activity
        passes its own, so its checkpoint stays the activity's heartbeat details. `history`: the
        ended prompt's `finished_history`, when the follow has already begun reading it."""
        beat = beat or activity.heartbeat
        client = await self._client_of(req)
        uploader = OutputUploader(
            client,
            self._store,
            job_id=req.job_id,
            segment=req.segment,
            output=req.output,
            stored=list(req.stored),
            run_tag=req.run_tag,
        )
        if req.partial:
            await self._keep_finished(client, uploader, req, beat)
        else:
            entry = await (history or finished_history(client, req.prompt_id))
            for node_id, item in output_files(outputs_of(entry)):
                if uploader.wanted(node_id, item):
                    await uploader.upload(node_id, item)
                    beat()
        for artifact in uploader.artifacts.values():
            if artifact.key in confirmed or artifact.key in uploader.confirmed:
                continue
            head = await self._store.head(artifact.key, bucket=req.output.bucket)
            if head is None or head.size != artifact.size or head.sha256 != artifact.sha256:
                raise retryable(
                    ErrorType.STORAGE_ERROR,
                    f"{artifact.uri} is not stored as stated (size {artifact.size}, "
                    f"sha256 {artifact.sha256[:12]}...)",
                )
        return OffloadResult(artifacts=sorted(uploader.artifacts.values(), key=lambda a: a.key))

    @staticmethod
    async def _keep_finished(
        client: ComfyClient, uploader: OutputUploader, req: OffloadInput, beat: Callable[[], None]
    ) -> None:
        """After a failure or cancel: store what finished, and never fail over what did not."""
        try:
            entry = await client.history(req.prompt_id)
        except ComfyError as exc:
            log.warning("keep_finished_no_history", job_id=req.job_id, error=str(exc))
            return
        for node_id, item in output_files(outputs_of(entry)):
            if not uploader.wanted(node_id, item):
                continue
            try:
                await uploader.upload(node_id, item)
            except ApplicationError as exc:
                log.warning("keep_finished_skipped", job_id=req.job_id, error=exc.message)
            beat()


def _from_this_run(item: Mapping[str, str], run_tag: str) -> bool:
    subfolder = item.get("subfolder", "")
    return subfolder == run_tag or subfolder.startswith(run_tag + "/")


async def finished_history(client: ComfyClient, prompt_id: str) -> dict[str, Any]:
    """The ended prompt's history entry (`history_when_written`), its failure typed."""
    try:
        entry = await history_when_written(client, prompt_id)
    except (HistoryMissing, ComfyError) as exc:
        raise from_comfy(exc, f"reading the history of prompt {prompt_id}") from exc
    if failed_in_history(entry):
        raise history_failure(history_messages(entry))
    return entry
