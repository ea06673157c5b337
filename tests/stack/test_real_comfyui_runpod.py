"""The RunPod path against a real ComfyUI 0.8.0 (CPU, no models): `make test-real-comfyui`.

Two RunPod simulators, one per pool kind, each of whose workers gets a real ComfyUI of its own
(devstack.real_comfyui.RealComfyPerWorker: started while the worker initializes, stopped with
it), and per test a worker of ours serving a `runpod` pool on one of them, on the session's
local stack (Temporal dev server, SeaweedFS):

- our handler (endpoint/handler.py, .venv-endpoint) with the stack's bucket; pool `claims:
  true` with a short claim lease (CLAIM_LEASE_S), so that a stop outlasting it shows whether the
  orchestrator reads the handler's stop record or a lapsed lease;
- the unmodified worker-comfyui 5.8.5 handler (tests/runpod_handlers/worker_comfyui.py under
  .venv-stock; a test fixture outside the repository, AGPL-3.0); pool `claims: false`.

Graphs are model-free: big blurs stand in for slow GPU nodes, since ImageBlur has no progress
hook and ignores an interrupt until it ends. Every test ends with the ledger checks: nothing
queued or running, no worker billed past its idle timeout, and each worker's bill covered by
the `JobStatus.cost` of the jobs it ran. Skipped unless REAL_COMFYUI_DIR names a real ComfyUI
install; the stock tests also need .venv-stock and the fixture folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import pytest_asyncio
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError

from activities.runpod.claims import claim_target, read_claim
from activities.runpod.follow import one_chunk
from activities.storage import ArtifactStore
from configuration.pools import PoolConfig
from devstack.models import RunningStack
from devstack.real_comfyui import WorkerComfyUI
from devstack.runpod_sim import Ledger
from devstack.runpod_sim.ledger import LedgerJob
from faults.worker_proc import WorkerFleet
from protocol.comfyui.events import output_files
from protocol.runpod.contract import Claim, StopRecord, nodes_key
from starter import JobClient
from starter.connection import connect_temporal
from tests.stack.test_real_comfyui import REAL_DIR, accepted_prompts, blur_graph
from tests.support.comfy_sim import make_png, png_chunks, png_size
from tests.support.runpod_e2e import (
    API_KEY,
    IDLE_TIMEOUT_S,
    POOL,
    billing_matches,
    bucket_env,
    cost_matches,
    ended_statuses,
    most_at_once,
    provider_spans,
    runpod_pool,
    serving,
    settled_ledger,
)
from tests.support.runpod_sim import (
    ENDPOINT_VENV_MISSING,
    STOCK_LAUNCHER,
    STOCK_MISSING,
    RunpodSim,
    run_runpod_sim,
    stock_fixture_dir,
)
from workflows.contracts import (
    Artifact,
    JobPolicy,
    JobRequest,
    JobState,
    JobStatus,
    OutputSpec,
    S3Input,
)
from workflows.graph import safe_tag
from workflows.shared import WORKFLOW_TYPE, ErrorType

pytestmark = [
    pytest.mark.skipif(
        not REAL_DIR, reason="needs a real ComfyUI: make test-real-comfyui (REAL_COMFYUI_DIR)"
    ),
    pytest.mark.skipif(ENDPOINT_VENV_MISSING is not None, reason=str(ENDPOINT_VENV_MISSING)),
]
needs_stock = pytest.mark.skipif(STOCK_MISSING is not None, reason=str(STOCK_MISSING))

FACTORY = "devstack.real_comfyui:RealComfyPerWorker"
STOCK_POOL = "stock"
# Far shorter than what is left of the blur the cancel test stops.
CLAIM_LEASE_S = 10.0
# How long past a lapsed lease a silent holder is surely fenced (its watchdog is done within
# half of it): short, so the frozen-handler test waits seconds, not the default's 30.
FENCE_AFTER_S = 6.0
# A worker's cold start includes its real ComfyUI's (~7-15 s on 2 cores).
JOB_WITHIN_S = 240.0
BLUR_NODE, SAVE_NODE = "2", "3"
# Radius-31 blurs of 2048x2048 images take ~3 s each on 2 idle CPU cores, 3-5 times that
# while other work shares them. SLOW_BLUR must outlast the claim lease (and the short stop
# horizon) after the cancel even on idle cores: ~30 s; MID_BLUR leaves time enough to act
# mid-node: ~12 s.
SLOW_BLUR = (2048, 10)
MID_BLUR = (2048, 4)
CANCEL_AFTER_S = 3.0
# A teardown horizon whose stop horizon (less the orchestrator's margin: 10 s) ends mid-blur.
SHORT_TEARDOWN_S = 25.0
# A 256-px blur runs in well under a second; a job that queued behind the cancelled blur on
# the same ComfyUI would take the rest of that blur, tens of seconds.
QUICK_JOB_MAX_S = 8.0
STATUS_POLL_S = 0.05
WATCH_POLL_S = 0.1
# How soon after recording that it gave up the handler has its worker's ComfyUI killed.
REPLACED_WITHIN_S = 2.0

T = TypeVar("T")


# -- the endpoints -------------------------------------------------------------------------------


def real_endpoint_sim(
    work_dir: Path, *, handler: str, endpoint_id: str, env: Mapping[str, str]
) -> AbstractAsyncContextManager[RunpodSim]:
    """A RunPod simulator whose workers run `handler`, each in front of a real ComfyUI of its
    own (REAL_COMFYUI_DIR reaches the simulator from this process's environment); `env`'s
    variables reach every worker by name. Two workers at most, so that a job after a cancel can
    get a fresh one. An endpoint id of its own: the node registry is published per endpoint."""
    return run_runpod_sim(
        work_dir,
        *(f"--worker-env={name}" for name in env),
        f"--worker-env-factory={FACTORY}",
        f"--idle-timeout={IDLE_TIMEOUT_S}",
        "--max-workers=2",
        handler=handler,
        api_key=API_KEY,
        endpoint_id=endpoint_id,
        env=env,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def ours_sim(
    local_stack: RunningStack, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunpodSim]:
    # DURABLE_COMFY_BUCKET: each worker publishes its ComfyUI's /object_info as it starts.
    env = bucket_env(local_stack) | {"DURABLE_COMFY_BUCKET": local_stack.bucket}
    async with real_endpoint_sim(
        tmp_path_factory.mktemp("real-runpod-ours"),
        handler="endpoint/handler.py",
        endpoint_id="real-ours",
        env=env,
    ) as sim:
        yield sim


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stock_sim(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunpodSim]:
    async with real_endpoint_sim(
        tmp_path_factory.mktemp("real-runpod-stock"),
        handler=STOCK_LAUNCHER,
        endpoint_id="real-stock",
        env={"STOCK_WORKER_COMFYUI": str(stock_fixture_dir())},
    ) as sim:
        yield sim


class ComfyLogs:
    """What the workers' ComfyUIs logged from a point on (the logs as they were then; a
    worker started later logs from its start)."""

    def __init__(self, sim: RunpodSim) -> None:
        self.sim = sim
        self.offsets = {path: path.stat().st_size for path in self._logs()}

    def _logs(self) -> list[Path]:
        return sorted((self.sim.work_dir / "workers").glob("*/comfyui.log"))

    def text(self) -> str:
        parts = []
        for path in self._logs():
            with path.open("rb") as f:
                f.seek(self.offsets.get(path, 0))
                parts.append(f.read().decode(errors="replace"))
        return "\n".join(parts)

    def accepted_prompts(self) -> int:
        return accepted_prompts(self.text())


@dataclass
class Endpoint:
    """A simulator, a worker of ours serving a pool on it, and that worker's client."""

    stack: RunningStack
    sim: RunpodSim
    pool: PoolConfig
    client: JobClient
    store: ArtifactStore
    logs: ComfyLogs
    since: float = field(default_factory=time.time)
    # Jobs a test waits for alongside its own; awaited before the ledger checks whatever the
    # test's end.
    background: list[asyncio.Task[JobStatus]] = field(default_factory=list)

    def comfy(self, worker_id: str) -> WorkerComfyUI:
        return WorkerComfyUI.of(self.sim.work_dir / "workers" / worker_id)

    async def provider_jobs(self, submission: str) -> list[LedgerJob]:
        return (await self.sim.ledger()).jobs_for(submission)

    async def ledger_checks(self, client: JobClient | None = None) -> Ledger:
        """Nothing queued or running, nobody billed past the idle timeout, and each worker's
        bill covered by the costs of the jobs (on `client`'s queue) it ran."""
        client = client or self.client
        if self.background:
            await asyncio.wait(self.background, timeout=JOB_WITHIN_S)
        ledger = await settled_ledger(self.sim)
        billing_matches(ledger, await ended_statuses(client, since=self.since))
        return ledger


@pytest_asyncio.fixture(loop_scope="session")
async def ours(local_stack: RunningStack, ours_sim: RunpodSim) -> AsyncIterator[Endpoint]:
    await ours_sim.reset_faults()
    pool = runpod_pool(ours_sim, claim_lease_s=CLAIM_LEASE_S, fence_after_s=FENCE_AFTER_S)
    async with serving(local_stack, {POOL: pool}) as (client, store):
        endpoint = Endpoint(local_stack, ours_sim, pool, client, store, ComfyLogs(ours_sim))
        yield endpoint
        await endpoint.ledger_checks()


@pytest_asyncio.fixture(loop_scope="session")
async def stock(local_stack: RunningStack, stock_sim: RunpodSim) -> AsyncIterator[Endpoint]:
    await stock_sim.reset_faults()
    pool = runpod_pool(stock_sim, claims=False)
    async with serving(local_stack, {STOCK_POOL: pool}, default_pool=STOCK_POOL) as (c, store):
        endpoint = Endpoint(local_stack, stock_sim, pool, c, store, ComfyLogs(stock_sim))
        yield endpoint
        await endpoint.ledger_checks()


# -- helpers -------------------------------------------------------------------------------------


def job_of(graph: dict[str, Any]) -> JobRequest:
    policy = JobPolicy(abandon_after_s=None, heartbeat_timeout_s=5, progress_interval_s=0.5)
    return JobRequest(graph=graph, policy=policy)


def save_node(source: str, prefix: str) -> dict[str, Any]:
    return {"class_type": "SaveImage", "inputs": {"images": [source, 0], "filename_prefix": prefix}}


async def finish(client: JobClient, job: JobRequest) -> JobStatus:
    started = await client.submit(job)
    return await asyncio.wait_for(client.wait(started.job_id), JOB_WITHIN_S)


async def until(check: Callable[[], Awaitable[T | None]], within_s: float, what: str) -> T:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if (value := await check()) is not None:
            return value
        await asyncio.sleep(0.2)
    raise AssertionError(f"not within {within_s:g} s: {what}")


async def status_where(
    client: JobClient, job_id: str, ok: Callable[[JobStatus], bool], what: str
) -> JobStatus:
    async def check() -> JobStatus | None:
        status = await client.status(job_id)
        if ok(status):
            return status
        assert not status.terminal, status.model_dump_json(indent=1)
        return None

    return await until(check, JOB_WITHIN_S, what)


def submission_of(status: JobStatus) -> str:
    assert status.checkpoint is not None and status.checkpoint.prompt_id, status
    return status.checkpoint.prompt_id


def explain(final: JobStatus) -> str:
    return final.model_dump_json(indent=1, exclude={"graph"})


def written_for(sim: RunpodSim, job_id: str, folder: str | None = None) -> dict[str, str]:
    """The files the workers' ComfyUIs hold for a job (path under its output folder ->
    sha256): in the run folders the orchestrator's save prefixes name (`dc_{job}_...`), or in
    `folder` (a linked prefix names its own). Our handler removes them once stored: for its
    jobs this is what was left behind; the stock handler leaves them all."""
    found: dict[str, str] = {}
    for output in (sim.work_dir / "workers").glob("*/comfy/output"):
        roots = [output / folder] if folder else list(output.glob(f"dc_{safe_tag(job_id)}_*"))
        for root in roots:
            for path in sorted(root.rglob("*")):
                if path.is_file():
                    relative = str(path.relative_to(output))
                    found[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


async def saved_by_comfyui(store: ArtifactStore, artifact: Artifact) -> dict[str, Any]:
    """The artifact's bytes are a PNG a real ComfyUI's SaveImage wrote (our handler leaves no
    file behind to compare them with): its `prompt` text chunk, the graph ComfyUI ran, is
    returned; and its size and sha256 are the record's."""
    data = await store.read_bytes(artifact.key, limit=64 * 2**20)
    assert len(data) == artifact.size and hashlib.sha256(data).hexdigest() == artifact.sha256
    texts = dict(body.split(b"\0", 1) for kind, body in png_chunks(data) if kind == b"tEXt")
    assert b"prompt" in texts, f"{artifact.key}: no `prompt` chunk, not SaveImage's PNG"
    prompt: dict[str, Any] = json.loads(texts[b"prompt"])
    assert prompt[artifact.node_id]["class_type"] == "SaveImage", prompt
    return prompt


def run_prefix(prompt: dict[str, Any], job_id: str) -> str:
    """The save prefix ComfyUI ran, which the orchestrator put in the job's run folder."""
    prefix = str(prompt[SAVE_NODE]["inputs"]["filename_prefix"])
    assert prefix.startswith(f"dc_{safe_tag(job_id)}_"), prefix
    return prefix


async def assert_stored(store: ArtifactStore, artifacts: list[Artifact]) -> None:
    for artifact in artifacts:
        stored = await store.head(artifact.key)
        assert stored is not None, artifact
        assert stored.sha256 == artifact.sha256 and stored.size == artifact.size, artifact


def shas(artifacts: list[Artifact]) -> list[str]:
    return sorted(a.sha256 for a in artifacts)


async def comfy_get(comfy: WorkerComfyUI, path: str) -> Any:
    async with httpx.AsyncClient(timeout=5, trust_env=False) as http:
        response = await http.get(comfy.url + path)
    response.raise_for_status()
    return response.json()


def queued_ids(queue: Mapping[str, Any]) -> list[str]:
    """Prompt ids in a `/queue` answer, running then pending ([number, id, prompt, ...])."""
    return [entry[1] for entry in [*queue["queue_running"], *queue["queue_pending"]]]


def events_of(entry: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A `/history` entry's status messages by event (the last of each)."""
    return {event: data for event, data in entry["status"]["messages"]}


async def worker_of(endpoint: Endpoint, submission: str) -> str:
    async def delivered() -> str | None:
        jobs = await endpoint.provider_jobs(submission)
        return jobs[-1].deliveries[-1].worker_id if jobs and jobs[-1].deliveries else None

    return await until(delivered, JOB_WITHIN_S, "the RunPod job reaches a worker")


async def running_prompt(comfy: WorkerComfyUI) -> str:
    async def running() -> str | None:
        queue = await comfy_get(comfy, "/queue")
        return str(queue["queue_running"][0][1]) if queue["queue_running"] else None

    return await until(running, JOB_WITHIN_S, f"a prompt runs on {comfy.url}")


class PromptWatch:
    """Samples a ComfyUI's `/queue` every WATCH_POLL_S while a prompt is stopped: when it was
    last seen held, when it was first seen gone after that (and its `/history` entry then), and
    since when ComfyUI has not answered."""

    def __init__(self, comfy: WorkerComfyUI, prompt_id: str) -> None:
        self.comfy = comfy
        self.prompt_id = prompt_id
        self.last_held_at: float | None = None
        self.released_at: float | None = None
        self.unreachable_since: float | None = None
        self.entry: dict[str, Any] | None = None
        self._http = httpx.AsyncClient(timeout=2, trust_env=False)
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> PromptWatch:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._http.aclose()

    async def queue_now(self) -> dict[str, Any] | None:
        """`/queue` now; None when ComfyUI does not answer."""
        try:
            response = await self._http.get(self.comfy.url + "/queue")
            response.raise_for_status()
        except httpx.HTTPError:
            return None
        queue: dict[str, Any] = response.json()
        return queue

    async def _run(self) -> None:
        while True:
            queue = await self.queue_now()
            now = time.time()
            if queue is None:
                self.unreachable_since = self.unreachable_since or now
            elif self.prompt_id in queued_ids(queue):
                self.last_held_at, self.released_at = now, None
            elif self.released_at is None:
                self.released_at = now
                with contextlib.suppress(httpx.HTTPError):
                    history = await self._http.get(f"{self.comfy.url}/history/{self.prompt_id}")
                    self.entry = history.json().get(self.prompt_id)
            await asyncio.sleep(WATCH_POLL_S)

    def render(self, since: float) -> str:
        def at(moment: float | None) -> str:
            return "never" if moment is None else f"{moment - since:.1f} s"

        return (
            f"prompt last seen held at {at(self.last_held_at)}, gone at {at(self.released_at)}, "
            f"ComfyUI unreachable from {at(self.unreachable_since)}"
        )


async def claim_of(endpoint: Endpoint, final: JobStatus) -> Claim | None:
    target = claim_target(OutputSpec(), endpoint.store.settings.bucket)
    return await read_claim(endpoint.store, target, final.job_id, submission_of(final))


# -- our handler ---------------------------------------------------------------------------------


async def test_happy_path_stores_the_file_the_workers_comfyui_wrote(ours: Endpoint) -> None:
    final = await finish(ours.client, job_of(blur_graph(256, 1, radius=3)))
    assert final.state == JobState.COMPLETED, explain(final)
    [artifact] = final.artifacts
    assert artifact.node_id == SAVE_NODE
    run_prefix(await saved_by_comfyui(ours.store, artifact), final.job_id)
    assert png_size(await ours.store.read_bytes(artifact.key, limit=2**24)) == (256, 256)
    assert written_for(ours.sim, final.job_id) == {}, "stored, then removed from the worker"
    await assert_stored(ours.store, final.artifacts)
    assert final.teardown.state == "CONFIRMED", final.teardown
    assert ours.logs.accepted_prompts() == 1
    [provider_job] = await ours.provider_jobs(submission_of(final))
    assert provider_job.status == "COMPLETED" and len(provider_job.deliveries) == 1
    cost_matches(final.cost, await ours.sim.ledger(), submission_of(final))


async def test_a_finished_job_leaves_no_file_in_the_workers_comfyui(ours: Endpoint) -> None:
    """Everything the job put in its worker's real ComfyUI is gone once it completed: the
    input our handler uploaded (staged in S3 by the orchestrator), each file the prompt's
    history lists (its outputs, stored in S3 first, and its preview) and the run's folder; so
    the next job on that warm worker finds none of it."""
    key = f"uploads/{uuid.uuid4().hex}.png"
    await ours.store.upload_stream(
        key, one_chunk(make_png(32, 24, (200, 30, 60))), content_type="image/png"
    )
    graph = {
        "1": {"class_type": "LoadImage", "inputs": {"image": "in.png"}},
        BLUR_NODE: {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
        SAVE_NODE: save_node(BLUR_NODE, "real/out"),
        "4": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}},
    }
    uri = f"s3://{ours.store.settings.bucket}/{key}"
    policy = job_of(blur_graph(8, 1)).policy
    request = JobRequest(graph=graph, policy=policy, inputs={"in.png": S3Input(uri=uri)})
    final = await finish(ours.client, request)
    assert final.state == JobState.COMPLETED, explain(final)
    [artifact] = final.artifacts
    await assert_stored(ours.store, final.artifacts)
    prefix = run_prefix(await saved_by_comfyui(ours.store, artifact), final.job_id)

    prompt_id = submission_of(final)
    comfy = ours.comfy(await worker_of(ours, prompt_id))
    entry = (await comfy_get(comfy, f"/history/{prompt_id}"))[prompt_id]
    listed = [item for _node, item in output_files(entry["outputs"])]
    assert {item["type"] for item in listed} == {"output", "temp"}, listed
    folders = {"output": comfy.output_dir, "temp": comfy.temp_dir}
    for item in listed:
        path = folders[item["type"]] / item["subfolder"] / item["filename"]
        assert not path.exists(), f"{path} is left on the worker"
    uploaded = entry["prompt"][2]["1"]["inputs"]["image"]  # the name the handler uploaded
    assert not (comfy.input_dir / uploaded).exists(), f"input {uploaded} is left on the worker"
    assert not (comfy.output_dir / prefix.split("/")[0]).exists(), "the run's folder is left"
    assert written_for(ours.sim, final.job_id) == {}


async def test_a_saved_output_is_out_of_every_loaders_reach_before_any_runpod_job(
    ours: Endpoint,
) -> None:
    """A job saves an image; `LoadImageOutput` of it and an `[output]`-annotated `LoadImage` of
    it, sent raw past the client's check, fail typed with no RunPod job and no prompt reaching
    any worker's ComfyUI (a warm worker's folders outlive the job that wrote them)."""
    saved = await finish(ours.client, job_of(blur_graph(64, 1, radius=1)))
    assert saved.state == JobState.COMPLETED, explain(saved)
    prefix = run_prefix(await saved_by_comfyui(ours.store, saved.artifacts[0]), saved.job_id)
    theirs = f"{prefix}_00001_.png"
    jobs_before = len((await ours.sim.ledger()).jobs)
    accepted_before = ours.logs.accepted_prompts()
    for class_type, image in (("LoadImageOutput", theirs), ("LoadImage", f"{theirs} [output]")):
        graph = {
            "1": {"class_type": class_type, "inputs": {"image": image}},
            "2": save_node("1", "x"),
        }
        with pytest.raises(ValueError, match="not the job's own"):
            JobRequest(graph=graph)
        handle = await ours.client.temporal.start_workflow(
            WORKFLOW_TYPE,
            {"graph": graph, "pool": POOL},
            id=f"real-raw-{uuid.uuid4().hex[:8]}",
            task_queue=ours.client.task_queue,
        )
        with pytest.raises(WorkflowFailureError) as refused:
            await asyncio.wait_for(handle.result(), JOB_WITHIN_S)
        cause = refused.value.cause
        assert isinstance(cause, ApplicationError) and cause.type == ErrorType.INVALID_GRAPH
    assert len((await ours.sim.ledger()).jobs) == jobs_before, "no RunPod job for them"
    assert ours.logs.accepted_prompts() == accepted_before, "no prompt reached a ComfyUI"


async def test_a_typo_class_is_refused_before_any_runpod_job_once_the_nodes_are_published(
    ours: Endpoint,
) -> None:
    """The workers publish their real ComfyUI's /object_info as they start; against it the
    orchestrator refuses a class that is not installed before paying for a RunPod job."""
    key = nodes_key(ours.sim.endpoint_id)

    async def published() -> bool | None:
        return True if await ours.store.head(key) is not None else None

    if await ours.store.head(key) is None:  # no worker of this endpoint started yet
        await finish(ours.client, job_of(blur_graph(64, 1, radius=3)))
        await until(published, 30, f"a worker publishes {key}")
    jobs_before = len((await ours.sim.ledger()).jobs)
    graph = blur_graph(64, 1)
    graph[BLUR_NODE]["class_type"] = "ImageBlurr"
    final = await finish(ours.client, job_of(graph))
    assert final.state == JobState.FAILED, explain(final)
    assert final.error is not None and final.error.type == ErrorType.INVALID_GRAPH, final.error
    assert "ImageBlurr" in final.error.message
    assert final.teardown.state == "SKIPPED", final.teardown
    assert len((await ours.sim.ledger()).jobs) == jobs_before, "no RunPod job for it"


async def test_a_linked_save_prefix_completes_with_its_artifact(ours: Endpoint) -> None:
    graph = blur_graph(128, 1, radius=3)
    folder = f"linked-{uuid.uuid4().hex[:8]}"
    graph["4"] = {"class_type": "PrimitiveString", "inputs": {"value": f"{folder}/out"}}
    graph[SAVE_NODE]["inputs"]["filename_prefix"] = ["4", 0]
    final = await finish(ours.client, job_of(graph))
    assert final.state == JobState.COMPLETED, explain(final)
    # Named by the linked string, not by the run tag: found from the prompt's own record.
    [artifact] = final.artifacts
    assert artifact.node_id == SAVE_NODE
    prompt = await saved_by_comfyui(ours.store, artifact)
    assert prompt["4"]["inputs"]["value"] == f"{folder}/out", prompt
    # Stored, then removed from the worker, with the folder the linked prefix made.
    assert written_for(ours.sim, final.job_id, folder=folder) == {}
    assert not list((ours.sim.work_dir / "workers").glob(f"*/comfy/output/{folder}"))
    await assert_stored(ours.store, final.artifacts)


async def test_a_batch_through_two_save_nodes_keeps_every_image_and_no_preview(
    ours: Endpoint,
) -> None:
    batch = 3
    graph = blur_graph(96, batch, radius=3, prefix="a/img")
    graph["4"] = {"class_type": "ImageInvert", "inputs": {"image": [BLUR_NODE, 0]}}
    graph["5"] = save_node("4", "b/img")
    graph["6"] = {"class_type": "PreviewImage", "inputs": {"images": [BLUR_NODE, 0]}}
    final = await finish(ours.client, job_of(graph))
    assert final.state == JobState.COMPLETED, explain(final)
    for node, folder in ((SAVE_NODE, "/a/img"), ("5", "/b/img")):
        from_node = [a for a in final.artifacts if a.node_id == node]
        assert len(from_node) == batch, (node, final.artifacts)
        for artifact in from_node:
            prompt = await saved_by_comfyui(ours.store, artifact)
            assert prompt[node]["inputs"]["filename_prefix"].endswith(folder), prompt
            assert run_prefix(prompt, final.job_id)
    assert not [a for a in final.artifacts if a.node_id == "6"], "a preview is not an output"
    assert len(final.artifacts) == 2 * batch
    assert written_for(ours.sim, final.job_id) == {}, "stored, then removed from the worker"
    await assert_stored(ours.store, final.artifacts)


@pytest.mark.parametrize(
    "teardown_horizon_s",
    [None, SHORT_TEARDOWN_S],
    ids=["the-stop-ends-with-the-prompt", "the-horizon-passes-first"],
)
async def test_a_cancel_during_a_node_deaf_to_interrupts_past_the_lease(
    ours: Endpoint, teardown_horizon_s: float | None
) -> None:
    """ImageBlur notices the interrupt only at its end, tens of seconds after the cancel, far
    past the claim lease. The job must be terminal only once its worker's ComfyUI no longer
    holds the prompt (looked at the instant it is seen terminal) and its teardown CONFIRMED;
    or, with a teardown horizon shorter than the blur, with its teardown FAILED and the worker
    replaced. Either way a job sent right after the cancel, and one right after the end,
    neither queues behind the prompt nor pays for it."""
    client = ours.client
    job = job_of(blur_graph(*SLOW_BLUR))
    if teardown_horizon_s is not None:
        policy = job.policy.model_copy(update={"teardown_horizon_s": teardown_horizon_s})
        job = job.model_copy(update={"policy": policy})
    started = await client.submit(job)
    job_id = started.job_id
    running = await status_where(
        client, job_id, lambda s: s.progress.node == BLUR_NODE, "the blur runs"
    )
    worker_id = await worker_of(ours, submission_of(running))
    comfy = ours.comfy(worker_id)
    prompt_id = await running_prompt(comfy)
    async with PromptWatch(comfy, prompt_id) as watch:
        await asyncio.sleep(CANCEL_AFTER_S)
        cancelled_at = time.time()
        await client.cancel(job_id, "real test: cancel during a blur deaf to interrupts")
        during_stop = asyncio.create_task(finish(client, job_of(blur_graph(256, 1, radius=3))))
        ours.background.append(during_stop)
        final = await client.status(job_id)
        while not final.terminal:
            assert time.time() - cancelled_at < JOB_WITHIN_S, explain(final)
            await asyncio.sleep(STATUS_POLL_S)
            final = await client.status(job_id)
        seen_terminal_at = time.time()
        queue_at_end = await watch.queue_now()
    timing = (
        f"cancelled at 0 s, terminal seen at {seen_terminal_at - cancelled_at:.1f} s; "
        f"{watch.render(since=cancelled_at)}"
    )

    claim = await claim_of(ours, final)
    stop: StopRecord | None = claim.outcome.stop if claim and claim.outcome else None
    ledger = await ours.sim.ledger()
    # Shown when the test fails, whichever check it is.
    print(timing, final.teardown.model_dump_json(indent=1), stop, ledger.worker(worker_id))
    actions = [s.action for s in final.teardown.steps]
    if teardown_horizon_s is not None:
        # The handler gave up at its stop horizon: it recorded so, then replaced its worker
        # (ComfyUI killed mid-blur); the teardown fails at once, naming worker and prompt.
        assert final.teardown.state == "FAILED", (timing, final.teardown)
        assert stop is not None and stop.prompt == "still_running", (timing, claim)
        assert stop.worker_replaced, stop
        assert {"still_running", "worker_replaced"} <= set(actions), final.teardown
        assert worker_id in final.teardown.detail, final.teardown
        assert queue_at_end is None and watch.released_at is None, timing
        assert watch.unreachable_since is not None, timing
        # The verdict is written first, then ComfyUI killed: the job may be seen terminal a
        # moment (and a poll of the watch) before ComfyUI stops answering, never much later.
        assert watch.unreachable_since <= seen_terminal_at + REPLACED_WITHIN_S, timing
        assert ledger.worker(worker_id).stop_reason != "idle", ledger.worker(worker_id)
    else:
        assert final.state == JobState.CANCELLED, explain(final)
        assert final.teardown.state == "CONFIRMED", (timing, final.teardown)
        assert watch.released_at is not None and watch.released_at <= seen_terminal_at, timing
        if queue_at_end is not None:
            assert prompt_id not in queued_ids(queue_at_end), (timing, queue_at_end)
        else:
            # ComfyUI stopped with its worker, idle once the stop had ended; never before.
            assert watch.unreachable_since is not None, timing
            assert watch.unreachable_since >= watch.released_at, timing
            assert ledger.worker(worker_id).stop_reason == "idle", ledger.worker(worker_id)
        assert watch.entry is not None, timing
        events = events_of(watch.entry)
        assert "execution_interrupted" in events, watch.entry["status"]
        ended_at = events["execution_interrupted"]["timestamp"] / 1000
        assert ended_at - cancelled_at > CLAIM_LEASE_S, (
            f"the blur ended within the claim lease of the cancel ({timing}): the test needs a "
            "longer one"
        )
        assert stop is not None and stop.prompt == "interrupted", claim
        assert actions[-1] == "interrupted", final.teardown
    assert not [a for a in final.artifacts if a.node_id == SAVE_NODE], "the save never ran"

    # Sent while the prompt was being stopped, and right after the job ended: each well under
    # a second of work, on a ComfyUI with nothing else to do.
    after_end = await finish(client, job_of(blur_graph(256, 1, radius=3)))
    for quick in (await asyncio.wait_for(during_stop, JOB_WITHIN_S), after_end):
        assert quick.state == JobState.COMPLETED, explain(quick)
        ledger = await ours.sim.ledger()
        [quick_job] = ledger.jobs_for(submission_of(quick))
        assert quick_job.billed_s <= QUICK_JOB_MAX_S, (timing, quick_job)
        cost_matches(quick.cost, ledger, submission_of(quick))
        if quick_job.deliveries[-1].worker_id == worker_id:
            history = await comfy_get(comfy, "/history")
            [quick_prompt] = [
                p for p in history if p != prompt_id and safe_tag(quick.job_id) in str(history[p])
            ]
            started_ms = events_of(history[quick_prompt])["execution_start"]["timestamp"]
            assert watch.released_at is not None and started_ms / 1000 >= watch.released_at, (
                "the next prompt ran while the cancelled one was still held",
                timing,
            )


async def test_orchestrator_worker_kill_9_mid_prompt_completes_with_one_execution(
    ours: Endpoint, tmp_path: Path
) -> None:
    """`python worker.py` is SIGKILLed while the blur runs on the worker's real ComfyUI; its
    replacement re-attaches to the same RunPod job: one `got prompt`, one RunPod job."""
    task_queue = f"real-runpod-kill-{uuid.uuid4().hex[:8]}"
    env = {
        **ours.stack.worker_env(),
        "DURABLE_COMFY_TASK_QUEUE": task_queue,
        "DURABLE_COMFY_POOLS": json.dumps(
            {POOL: ours.pool.model_dump(mode="json", exclude_none=True)}
        ),
        "DURABLE_COMFY_DEFAULT_POOL": POOL,
        "RUNPOD_API_KEY": API_KEY,
    }
    fleet = WorkerFleet(env, tmp_path / "workers")
    temporal = await connect_temporal(ours.stack.temporal_address, ours.stack.namespace)
    client = JobClient(temporal, task_queue=task_queue, store=ours.store)
    try:
        first = await fleet.start("first")
        started = await client.submit(job_of(blur_graph(*MID_BLUR)))
        running = await status_where(
            client,
            started.job_id,
            lambda s: s.checkpoint is not None and s.checkpoint.prompt_id is not None,
            "the job is submitted",
        )
        # Mid-prompt by ComfyUI's own word: progress may reach the status too late for that.
        await running_prompt(ours.comfy(await worker_of(ours, submission_of(running))))
        await first.kill()
        await fleet.start("replacement")
        final = await asyncio.wait_for(client.wait(started.job_id), JOB_WITHIN_S)
    finally:
        await fleet.stop_all()
    assert fleet.running_pids() == []
    assert final.state == JobState.COMPLETED, explain(final)
    assert ours.logs.accepted_prompts() == 1, "the graph ran once"
    submission = submission_of(final)
    [provider_job] = await ours.provider_jobs(submission)
    assert provider_job.status == "COMPLETED" and len(provider_job.deliveries) == 1, provider_job
    assert len(final.artifacts) == MID_BLUR[1], final.artifacts
    for artifact in final.artifacts:
        run_prefix(await saved_by_comfyui(ours.store, artifact), final.job_id)
    assert written_for(ours.sim, final.job_id) == {}, "stored, then removed from the worker"
    await assert_stored(ours.store, final.artifacts)
    ledger = await ours.ledger_checks(client)
    cost_matches(final.cost, ledger, submission)


async def test_a_frozen_handler_mid_node_is_fenced_and_the_graph_completes_once(
    ours: Endpoint,
) -> None:
    """The handler's process group is SIGSTOPped while the blur runs on its worker's real
    ComfyUI (a hung handler: nothing renews the claim, ComfyUI runs on). Its watchdog stops the
    prompt (the blur ignores the interrupt, so ComfyUI is killed or the save is skipped) and
    takes the worker down; only then does the submission go out again: the graph completes
    once, on the second worker, and both RunPod jobs are in the cost."""
    started = await ours.client.submit(job_of(blur_graph(*SLOW_BLUR)))
    running = await status_where(
        ours.client,
        started.job_id,
        lambda s: s.checkpoint is not None and s.checkpoint.prompt_id is not None,
        "the job is submitted",
    )
    submission = submission_of(running)
    worker_id = await worker_of(ours, submission)
    comfy = ours.comfy(worker_id)
    prompt_id = await running_prompt(comfy)
    [frozen] = [w for w in (await ours.sim.ledger()).workers if w.id == worker_id]
    assert frozen.pid is not None, frozen
    frozen_at = time.time()
    async with PromptWatch(comfy, prompt_id) as watch:
        # The handler leads its process group (the worker's session): its ComfyUI and its
        # watchdog lead sessions of their own and run on, as in a hung container.
        os.killpg(frozen.pid, signal.SIGSTOP)
        final = await asyncio.wait_for(ours.client.wait(started.job_id), JOB_WITHIN_S)
        saw = watch.render(frozen_at)
    assert final.state == JobState.COMPLETED, explain(final)
    done = watch.entry is not None and watch.entry.get("status", {}).get("status_str") == "success"
    assert not done, f"the frozen worker's prompt completed: {saw}, {watch.entry}"
    output = ours.sim.work_dir / "workers" / worker_id / "comfy" / "output"
    saved = [p for p in output.glob(f"dc_{safe_tag(final.job_id)}_*/**/*") if p.is_file()]
    assert saved == [], f"the frozen worker saved its outputs: {saved}"
    ledger = await ours.ledger_checks()
    [gone] = [w for w in ledger.workers if w.id == worker_id]
    assert gone.stop_reason == "watchdog", gone
    assert gone.exited_at is not None, gone
    jobs = ledger.jobs_for(submission)
    assert len(jobs) == 2, jobs
    assert {d.provider_job_id for d in final.deliveries} == {j.id for j in jobs}
    assert [d.outcome for d in final.deliveries] == ["fenced", "completed"], final.deliveries
    for artifact in final.artifacts:
        run_prefix(await saved_by_comfyui(ours.store, artifact), final.job_id)
    cost_matches(final.cost, ledger, submission)


async def test_a_graph_comfyui_rejects_fails_with_its_reason_once_and_was_never_queued(
    ours: Endpoint,
) -> None:
    """ComfyUI's own validation refuses a value the node registry cannot judge."""
    graph = blur_graph(64, 1)
    graph[BLUR_NODE]["inputs"]["blur_radius"] = 0
    final = await finish(ours.client, job_of(graph))
    assert final.state == JobState.FAILED, explain(final)
    assert final.error is not None and final.error.type == ErrorType.PROMPT_REJECTED, final.error
    message = final.error.message
    reason = "Value 0 smaller than min of 1"
    assert f"node 2 (ImageBlur): input 'blur_radius': {reason}" in message, message
    assert message.count(reason) == 1, message
    assert [s.action for s in final.teardown.steps] == ["never_queued"], final.teardown
    logs = ours.logs.text()
    assert "invalid prompt:" in logs and accepted_prompts(logs) == 0, "refused, never queued"
    assert len(await ours.provider_jobs(submission_of(final))) == 1


async def test_a_bounded_runpod_pool_holds_one_job_at_the_provider_at_a_time(
    local_stack: RunningStack, ours_sim: RunpodSim
) -> None:
    """`max_running: 1` on a RunPod pool whose workers run a real ComfyUI: three jobs, each
    PENDING in our queue until the one before has ended; RunPod's ledger never holds two of
    them (queued or in progress), each worker's ComfyUI accepts each prompt once, every
    worker's bill is covered, and the queue is empty at the end."""
    await ours_sim.reset_faults()
    since = time.time()
    logs = ComfyLogs(ours_sim)
    pool = runpod_pool(
        ours_sim, claim_lease_s=CLAIM_LEASE_S, fence_after_s=FENCE_AFTER_S, max_running=1
    )
    async with serving(local_stack, {POOL: pool}) as (client, _store):
        started = [
            await client.submit(job_of(blur_graph(256, 1, radius=3, prefix=f"bound{n}")))
            for n in range(3)
        ]
        saw_pending = False
        async with asyncio.timeout(3 * JOB_WITHIN_S):
            while True:
                statuses = [await client.status(s.job_id) for s in started]
                saw_pending = saw_pending or any(s.state == JobState.PENDING for s in statuses)
                if all(s.terminal for s in statuses):
                    break
                await asyncio.sleep(0.2)
        ended = [await client.wait(s.job_id) for s in started]
        assert [s.state for s in ended] == [JobState.COMPLETED] * 3, [explain(s) for s in ended]
        assert saw_pending, "no job was seen waiting in our queue"
        line = await client.pool_queue(POOL)
        assert line.running == 0 and line.waiting == 0, line
        ledger = await settled_ledger(ours_sim)
        billing_matches(ledger, await ended_statuses(client, since=since))
    spans = provider_spans(ledger, ended)
    assert len(spans) == 3 and most_at_once(spans) == 1, spans
    assert logs.accepted_prompts() == 3


# -- the stock handler ---------------------------------------------------------------------------


@needs_stock
async def test_stock_happy_path_stores_the_bytes_its_comfyui_wrote(stock: Endpoint) -> None:
    final = await finish(stock.client, job_of(blur_graph(256, 1, radius=3, prefix="out")))
    assert final.state == JobState.COMPLETED, explain(final)
    written = written_for(stock.sim, final.job_id)
    assert len(written) == 1, written
    [artifact] = final.artifacts
    assert artifact.sha256 == next(iter(written.values())), (artifact, written)
    await assert_stored(stock.store, final.artifacts)
    submission = submission_of(final)
    [provider_job] = await stock.provider_jobs(submission)
    assert provider_job.status == "COMPLETED" and len(provider_job.deliveries) == 1
    cost_matches(final.cost, await stock.sim.ledger(), submission)


@needs_stock
async def test_stock_two_outputs_with_one_file_name_are_both_kept(stock: Endpoint) -> None:
    """Prefixes `a/out` and `b/out`: the stock result holds two `out_00001_.png` with different
    bytes and nothing else to tell them apart."""
    graph = blur_graph(64, 1, radius=3, prefix="a/out")
    graph["4"] = {"class_type": "ImageInvert", "inputs": {"image": [BLUR_NODE, 0]}}
    graph["5"] = save_node("4", "b/out")
    final = await finish(stock.client, job_of(graph))
    assert final.state == JobState.COMPLETED, explain(final)
    written = written_for(stock.sim, final.job_id)
    assert sorted(Path(p).name for p in written) == ["out_00001_.png"] * 2, written
    assert len(set(written.values())) == 2, "the two images differ"
    assert shas(final.artifacts) == sorted(written.values()), final.artifacts
    assert len({a.key for a in final.artifacts}) == 2, final.artifacts
    await assert_stored(stock.store, final.artifacts)


@needs_stock
async def test_stock_cancel_mid_prompt_says_only_what_is_known(stock: Endpoint) -> None:
    """The stock handler cannot be told to stop: RunPod's job is cancelled, the prompt runs to
    its end on the real ComfyUI and the handler's job-done comes late. The teardown must not
    claim an interrupt, and the cost is a lower bound."""
    client = stock.client
    started = await client.submit(job_of(blur_graph(*MID_BLUR)))
    running = await status_where(
        client, started.job_id, lambda s: s.state == JobState.RUNNING, "the job runs"
    )
    submission = submission_of(running)
    comfy = stock.comfy(await worker_of(stock, submission))
    prompt_id = await running_prompt(comfy)
    await asyncio.sleep(1.0)
    await client.cancel(started.job_id, "real test: cancel a stock job mid-prompt")
    final = await asyncio.wait_for(client.wait(started.job_id), JOB_WITHIN_S)
    assert final.state == JobState.CANCELLED, explain(final)
    teardown = final.teardown
    actions = [step.action for step in teardown.steps]
    assert "cancel_sent" in actions, teardown
    assert not {"interrupt_sent", "interrupted"} & set(actions), teardown
    assert teardown.state == "UNCONFIRMED", teardown
    [cost] = final.cost
    assert cost.lower_bound and cost.note, cost

    # What the teardown could not know: the prompt ran on to its end, uninterrupted.
    async def prompt_ended() -> dict[str, Any] | None:
        entry: dict[str, Any] | None = (await comfy_get(comfy, f"/history/{prompt_id}")).get(
            prompt_id
        )
        return entry

    entry = await until(prompt_ended, JOB_WITHIN_S, "the stock prompt ends")
    events = events_of(entry)
    assert "execution_success" in events and "execution_interrupted" not in events, events

    async def late_post() -> LedgerJob | None:
        [provider_job] = await stock.provider_jobs(submission)
        return provider_job if provider_job.late_posts else None

    provider_job = await until(late_post, 30, "the stock worker's late job-done")
    assert provider_job.status == "CANCELLED" and provider_job.late_posts == 1
    assert cost.provider_job_id == provider_job.id
