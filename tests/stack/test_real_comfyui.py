"""End to end against a real ComfyUI 0.8.0 (CPU, no models): `make test-real-comfyui`.

Skipped unless REAL_COMFYUI_DIR names a real ComfyUI installed by the shared `real-comfyui
install DIR` (the make target installs it into .cache/real-comfyui). The rest of the stack is
the usual one (Temporal dev server, SeaweedFS) and the workers are `python worker.py`
subprocesses whose `comfyui` pool is the real server. Graphs are model-free: big blurs stand in
for slow GPU nodes, since ImageBlur has no progress hook and ignores interrupts until it ends.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError

from activities.storage import ArtifactStore
from devstack.real_comfyui import RealComfyUI
from faults.graphs import chaos_policy
from faults.harness import ChaosCase, ChaosStack, SimControl, StepWatcher, Timeline
from starter.connection import connect_temporal
from tests.conftest import StackConfigFactory, free_port
from workflows.contracts import JobRequest, JobState, JobStatus
from workflows.graph import safe_tag
from workflows.shared import WORKFLOW_TYPE, ErrorType

REAL_DIR = os.environ.get("REAL_COMFYUI_DIR")
pytestmark = pytest.mark.skipif(
    not REAL_DIR, reason="needs a real ComfyUI: make test-real-comfyui (REAL_COMFYUI_DIR)"
)

BLUR_NODE = "2"
SAVE_NODE = "3"
JOB_DEADLINE_S = 180.0


def accepted_prompts(log: str) -> int:
    """POST /prompt answers ComfyUI queued, from its own log: it logs "got prompt" for every
    POST and "invalid prompt: ..." for those it rejected."""
    return log.count("got prompt") - log.count("invalid prompt:")


def blur_graph(size: int, batch: int, *, radius: int = 31, prefix: str = "real") -> dict[str, Any]:
    """EmptyImage -> ImageBlur -> SaveImage. On 2 CPU cores a radius-31 blur of 1536x1536 x4
    takes ~12 s and of 2048x2048 x4 ~20 s; a fresh colour keeps ComfyUI's cache out of it."""
    return {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {
                "width": size,
                "height": size,
                "batch_size": batch,
                "color": uuid.uuid4().int % 0xFFFFFF,
            },
        },
        BLUR_NODE: {
            "class_type": "ImageBlur",
            "inputs": {"image": ["1", 0], "blur_radius": radius, "sigma": 10.0},
        },
        SAVE_NODE: {
            "class_type": "SaveImage",
            "inputs": {"images": [BLUR_NODE, 0], "filename_prefix": prefix},
        },
    }


class RealEnv:
    def __init__(
        self, stack: ChaosStack, real: RealComfyUI, store: ArtifactStore, http: httpx.AsyncClient
    ) -> None:
        self.stack = stack
        self.real = real
        self.store = store
        self.http = http


@pytest.fixture(scope="module")
def real_comfyui() -> Iterator[RealComfyUI]:
    assert REAL_DIR is not None
    real = RealComfyUI(Path(REAL_DIR), free_port())
    real.start()
    try:
        yield real
    finally:
        real.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def real_env(
    stack_config_factory: StackConfigFactory, real_comfyui: RealComfyUI
) -> AsyncIterator[RealEnv]:
    config = stack_config_factory("real")
    stack = await ChaosStack.start(config, Path(config.state_dir).parent)
    try:
        async with (
            httpx.AsyncClient(trust_env=False, timeout=30.0) as http,
            ArtifactStore(stack.s3_settings()) as store,
        ):
            yield RealEnv(stack, real_comfyui, store, http)
    finally:
        await stack.stop()


@pytest_asyncio.fixture(loop_scope="session")
async def case(
    real_env: RealEnv, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[ChaosCase]:
    real = real_env.real
    if not real.alive:  # an earlier test may have failed with it down
        await real.restart_async()
    temporal = await connect_temporal(
        real_env.stack.running.temporal_address, real_env.stack.running.namespace
    )
    name = "real-" + request.node.name.removeprefix("test_").split("[")[0].replace("_", "-")[:18]
    control = SimControl(real.url, real_env.http)  # only ComfyUI's own routes are used
    async with StepWatcher(real.url) as watcher:
        chaos = ChaosCase(
            real_env.stack,
            temporal,
            real_env.store,
            control,
            watcher,
            tmp_path,
            name=name,
            comfyui_url=real.url,
        )
        try:
            yield chaos
        finally:
            leftovers = await chaos.cleanup()
            # Captured output: pytest shows it only when the test failed, which is when it helps.
            print(chaos.report())
    assert leftovers == [], f"worker processes still running after the test: {leftovers}"


def explain(final: JobStatus, timeline: Timeline) -> str:
    return f"final: {final.model_dump_json(indent=1)}\ntimeline:\n{timeline.render()}"


async def history(env: RealEnv, prompt_id: str) -> dict[str, Any]:
    response = await env.http.get(f"{env.real.url}/history/{prompt_id}")
    response.raise_for_status()
    entry: dict[str, Any] = response.json().get(prompt_id, {})
    return entry


def assert_artifacts_are_comfyuis_files(
    env: RealEnv, final: JobStatus, node: str, count: int = 1, folder: str | None = None
) -> None:
    """Each stored object is byte for byte the file ComfyUI wrote (sha256 of both).

    The file is looked up in the run's own folder on ComfyUI (`dc_<job>_<segment>_...` for a
    literal prefix) or in `folder` (a linked prefix names its own).
    """
    artifacts = [a for a in final.artifacts if a.node_id == node]
    assert len(artifacts) == count, final.artifacts
    run_folder = f"dc_{safe_tag(final.job_id)}_"
    for artifact in artifacts:
        filename = artifact.key.rsplit("/", 1)[-1]
        matches = [
            path
            for path in env.real.output_dir.rglob(filename)
            if (path.parent.name == folder if folder else path.parent.name.startswith(run_folder))
        ]
        assert len(matches) == 1, (filename, matches)
        on_disk = matches[0].read_bytes()
        assert len(on_disk) == artifact.size
        assert hashlib.sha256(on_disk).hexdigest() == artifact.sha256


async def test_happy_path_stores_comfyuis_own_file(case: ChaosCase, real_env: RealEnv) -> None:
    await case.workers.start()
    log_from = real_env.real.log_size()
    job_id = await case.submit(JobRequest(graph=blur_graph(256, 1, radius=3)))
    async with case.timeline(job_id) as timeline:
        final = await timeline.wait_terminal(timeout_s=JOB_DEADLINE_S)
    assert final.state == JobState.COMPLETED, explain(final, timeline)
    assert_artifacts_are_comfyuis_files(real_env, final, SAVE_NODE)
    stored = await case.store.head(final.artifacts[0].key)
    assert stored is not None and stored.sha256 == final.artifacts[0].sha256
    assert final.checkpoint is not None and sorted(final.checkpoint.nodes_done) == ["1", "2", "3"]
    assert final.teardown.state == "CONFIRMED"
    assert [s.action for s in final.teardown.steps] == ["finished"]
    assert accepted_prompts(real_env.real.log_text(log_from)) == 1
    await case.assert_nothing_left(job_id)


async def test_linked_save_prefix_completes_with_its_artifact(
    case: ChaosCase, real_env: RealEnv
) -> None:
    graph = blur_graph(128, 1, radius=3)
    prefix = f"linked-{uuid.uuid4().hex[:8]}/out"
    graph["4"] = {"class_type": "PrimitiveString", "inputs": {"value": prefix}}
    graph[SAVE_NODE]["inputs"]["filename_prefix"] = ["4", 0]
    await case.workers.start()
    job_id = await case.submit(JobRequest(graph=graph))
    async with case.timeline(job_id) as timeline:
        final = await timeline.wait_terminal(timeout_s=JOB_DEADLINE_S)
    assert final.state == JobState.COMPLETED, explain(final, timeline)
    # Named by the linked string, not by the run tag: found from the prompt's own record.
    assert_artifacts_are_comfyuis_files(real_env, final, SAVE_NODE, folder=prefix.split("/")[0])
    await case.assert_nothing_left(job_id)


async def test_another_runs_output_is_out_of_every_loaders_reach(
    case: ChaosCase, real_env: RealEnv
) -> None:
    """A job saves an image; `LoadImageOutput` of it and an `[output]`-annotated `LoadImage` of
    it are refused, in the client and, sent raw past it, by the workflow: no prompt reaches
    ComfyUI. `LoadImageOutput` of a file the job sends runs (it reads the input folder)."""
    await case.workers.start()
    job_id = await case.submit(JobRequest(graph=blur_graph(64, 1, radius=1)))
    # And one saved outside every run folder (a linked prefix is not rewritten).
    linked = blur_graph(64, 1, radius=1)
    folder = f"linked-{uuid.uuid4().hex[:8]}"
    linked["4"] = {"class_type": "PrimitiveString", "inputs": {"value": f"{folder}/out"}}
    linked[SAVE_NODE]["inputs"]["filename_prefix"] = ["4", 0]
    linked_id = await case.submit(JobRequest(graph=linked))
    for saving in (job_id, linked_id):
        async with case.timeline(saving) as timeline:
            saved = await timeline.wait_terminal(timeout_s=JOB_DEADLINE_S)
        assert saved.state == JobState.COMPLETED, explain(saved, timeline)
    [path] = [
        p.relative_to(real_env.real.output_dir)
        for p in real_env.real.output_dir.rglob("*.png")
        if p.parent.name.startswith(f"dc_{safe_tag(job_id)}_")
    ]
    theirs = path.as_posix()
    [other] = [p.name for p in (real_env.real.output_dir / folder).iterdir()]
    history_before = (await real_env.http.get(f"{real_env.real.url}/history")).json()
    log_from = real_env.real.log_size()

    def loading(class_type: str, image: str) -> dict[str, Any]:
        return {
            "1": {"class_type": class_type, "inputs": {"image": image}},
            "2": {
                "class_type": "SaveImage",
                "inputs": {"images": ["1", 0], "filename_prefix": "x"},
            },
        }

    hostile = [
        loading("LoadImageOutput", theirs),
        loading("LoadImage", f"{theirs} [output]"),
        loading("LoadImageOutput", f"{folder}/{other}"),
    ]
    for graph in hostile:
        with pytest.raises(ValueError, match="not the job's own"):
            JobRequest(graph=graph)
        handle = await case.client.temporal.start_workflow(
            WORKFLOW_TYPE,
            {"graph": graph},
            id=f"{case.name}-raw-{uuid.uuid4().hex[:8]}",
            task_queue=case.task_queue,
        )
        case.job_ids.append(handle.id)
        with pytest.raises(WorkflowFailureError) as refused:
            await handle.result()
        cause = refused.value.cause
        assert isinstance(cause, ApplicationError) and cause.type == ErrorType.INVALID_GRAPH
        assert graph["1"]["inputs"]["image"].split(" ")[0] in str(cause.message)
    assert accepted_prompts(real_env.real.log_text(log_from)) == 0
    history_after = (await real_env.http.get(f"{real_env.real.url}/history")).json()
    assert history_after == history_before, "no prompt reached ComfyUI"

    mine = (real_env.real.output_dir / path).read_bytes()
    own = JobRequest(
        graph=loading("LoadImageOutput", "mine.png"),
        inputs={
            "mine.png": {
                "kind": "inline",
                "filename": "mine.png",
                "data_b64": base64.b64encode(mine).decode(),
            }
        },
    )
    job_id = await case.submit(own)
    async with case.timeline(job_id) as timeline:
        final = await timeline.wait_terminal(timeout_s=JOB_DEADLINE_S)
    assert final.state == JobState.COMPLETED, explain(final, timeline)
    await case.assert_nothing_left(job_id)


async def test_rejected_graph_fails_with_comfyuis_reason_and_queues_nothing(
    case: ChaosCase, real_env: RealEnv
) -> None:
    graph = blur_graph(64, 1)
    graph[BLUR_NODE]["inputs"]["blur_radius"] = 0
    await case.workers.start()
    log_from = real_env.real.log_size()
    job_id = await case.submit(JobRequest(graph=graph))
    async with case.timeline(job_id) as timeline:
        final = await timeline.wait_terminal(timeout_s=JOB_DEADLINE_S)
    assert final.state == JobState.FAILED, explain(final, timeline)
    assert final.error is not None and final.error.type == ErrorType.PROMPT_REJECTED
    message = final.error.message
    assert "node 2 (ImageBlur): input 'blur_radius': Value 0 smaller than min of 1" in message
    assert accepted_prompts(real_env.real.log_text(log_from)) == 0
    assert (await case.sim.queue()).empty
    assert [s.action for s in final.teardown.steps] == ["never_queued"]
    await case.assert_nothing_left(job_id)


async def test_worker_sigkill_mid_node_reattaches_and_runs_the_prompt_once(
    case: ChaosCase, real_env: RealEnv
) -> None:
    worker = await case.workers.start()
    log_from = real_env.real.log_size()
    job_id = await case.submit(JobRequest(graph=blur_graph(1536, 4), policy=chaos_policy()))
    async with case.timeline(job_id) as timeline:
        await timeline.wait_for(
            lambda s: s.progress.node == BLUR_NODE, timeout_s=60, what="the blur runs"
        )
        await worker.kill()
        timeline.mark("worker killed (SIGKILL)")
        await worker.start()
        timeline.mark("worker restarted")
        final = await timeline.wait_terminal(timeout_s=JOB_DEADLINE_S)
    assert final.state == JobState.COMPLETED, explain(final, timeline)
    assert accepted_prompts(real_env.real.log_text(log_from)) == 1, "submitted exactly once"
    assert final.reconnects >= 1, explain(final, timeline)
    assert_artifacts_are_comfyuis_files(real_env, final, SAVE_NODE, count=4)
    await case.assert_nothing_left(job_id)


async def test_comfyui_killed_and_restarted_mid_prompt_is_resubmitted_once(
    case: ChaosCase, real_env: RealEnv
) -> None:
    await case.workers.start()
    log_from = real_env.real.log_size()
    job_id = await case.submit(JobRequest(graph=blur_graph(1536, 4), policy=chaos_policy()))
    async with case.timeline(job_id) as timeline:
        await timeline.wait_for(
            lambda s: s.progress.node == BLUR_NODE, timeout_s=60, what="the blur runs"
        )
        await real_env.real.restart_async()
        timeline.mark("ComfyUI killed (SIGKILL) and restarted: queue and history lost")
        final = await timeline.wait_terminal(timeout_s=JOB_DEADLINE_S)
    assert final.state == JobState.COMPLETED, explain(final, timeline)
    # Once before the crash, once after it: the restarted ComfyUI provably lost the prompt.
    assert accepted_prompts(real_env.real.log_text(log_from)) == 2
    assert_artifacts_are_comfyuis_files(real_env, final, SAVE_NODE, count=4)
    await case.assert_nothing_left(job_id)


async def test_cancel_during_a_slow_node_ends_only_when_the_prompt_is_gone(
    case: ChaosCase, real_env: RealEnv
) -> None:
    await case.workers.start()
    job_id = await case.submit(JobRequest(graph=blur_graph(2048, 4), policy=chaos_policy()))
    async with case.timeline(job_id) as timeline:
        await timeline.wait_for(
            lambda s: s.progress.node == BLUR_NODE, timeout_s=60, what="the blur runs"
        )
        await case.client.cancel(job_id, "real test: cancel during a blur")
        timeline.mark("cancelled during the blur")
        final = await timeline.wait_terminal(timeout_s=JOB_DEADLINE_S)
        queue_at_end = await case.sim.queue()
    assert final.state == JobState.CANCELLED, explain(final, timeline)
    assert final.checkpoint is not None and final.checkpoint.prompt_id is not None
    prompt_id = final.checkpoint.prompt_id
    assert prompt_id not in queue_at_end.running + queue_at_end.pending
    entry = await history(real_env, prompt_id)
    events = {event: data for event, data in entry["status"]["messages"]}
    assert "execution_interrupted" in events, entry["status"]
    assert final.updated_at is not None
    assert events["execution_interrupted"]["timestamp"] / 1000 <= final.updated_at.timestamp()
    assert final.teardown.state == "CONFIRMED", final.teardown
    actions = [s.action for s in final.teardown.steps]
    assert actions == ["interrupt_sent", "interrupted"], final.teardown
    sent, landed = final.teardown.steps
    # The blur ignores the interrupt until it ends: seconds, not a step.
    assert (landed.at - sent.at).total_seconds() >= 3.0, final.teardown
    assert not [a for a in final.artifacts if a.node_id == SAVE_NODE], "the save never ran"
    await case.assert_nothing_left(job_id)


async def test_a_bounded_pool_sends_the_real_comfyui_one_prompt_at_a_time(
    case: ChaosCase, real_env: RealEnv
) -> None:
    """`max_running: 1` on the real server: three jobs, each PENDING in our queue until the one
    before has ended; ComfyUI never holds two of them, accepts each once, and the slot comes
    back from the follow that saw the last prompt end (the queue empty at the end)."""
    pools = json.loads(case.workers.env["DURABLE_COMFY_POOLS"])
    pools["comfyui"]["max_running"] = 1
    case.workers.env["DURABLE_COMFY_POOLS"] = json.dumps(pools)
    await case.workers.start()
    log_from = real_env.real.log_size()
    job_ids = [
        await case.submit(JobRequest(graph=blur_graph(512, 1, radius=9, prefix=f"bound{n}")))
        for n in range(3)
    ]
    most_at_comfyui = 0
    saw_pending = False
    async with asyncio.timeout(JOB_DEADLINE_S):
        while True:
            queue = await case.sim.queue()
            most_at_comfyui = max(most_at_comfyui, len(queue.running) + len(queue.pending))
            statuses = [await case.client.status(job_id) for job_id in job_ids]
            saw_pending = saw_pending or any(s.state == JobState.PENDING for s in statuses)
            if all(s.state.terminal for s in statuses):
                break
            await asyncio.sleep(0.1)
    assert [s.state for s in statuses] == [JobState.COMPLETED] * 3, statuses
    assert most_at_comfyui == 1, most_at_comfyui
    assert saw_pending, "no job was seen waiting in our queue"
    assert accepted_prompts(real_env.real.log_text(log_from)) == 3
    for final in statuses:
        assert_artifacts_are_comfyuis_files(real_env, final, SAVE_NODE)
    line = await case.client.pool_queue("comfyui")
    assert line.running == 0 and line.waiting == 0, line


async def test_two_real_comfyuis_in_one_pool_one_killed_mid_prompt_and_restarted(
    case: ChaosCase, real_env: RealEnv
) -> None:
    """A pool of two real servers (`urls`): two jobs run one on each; the server of one is
    killed (SIGKILL) mid-blur and restarted. Its job re-attaches, finds the prompt gone (a
    restarted ComfyUI keeps neither queue nor history) and sends it again to the same server,
    where it runs once to its end; the other server's job is untouched."""
    assert REAL_DIR is not None
    second = RealComfyUI(Path(REAL_DIR), free_port())
    await asyncio.to_thread(second.start)
    try:
        first = real_env.real
        pools = {"comfyui": {"kind": "comfyui", "urls": [first.url, second.url]}}
        case.workers.env["DURABLE_COMFY_POOLS"] = json.dumps(pools)
        await case.workers.start()
        logs_from = {first.url: first.log_size(), second.url: second.log_size()}
        job_ids = [
            await case.submit(
                JobRequest(graph=blur_graph(1024, 4, prefix=f"two{n}"), policy=chaos_policy())
            )
            for n in range(2)
        ]
        async with asyncio.timeout(JOB_DEADLINE_S):
            while True:
                statuses = [await case.client.status(job_id) for job_id in job_ids]
                servers = {s.backend.server for s in statuses if s.backend is not None}
                if servers == {first.url, second.url} and all(
                    s.progress.node == BLUR_NODE for s in statuses
                ):
                    break
                await asyncio.sleep(0.2)
        victim = next(s.job_id for s in statuses if s.backend and s.backend.server == second.url)
        await second.restart_async()
        finals = {
            job_id: await asyncio.wait_for(case.client.wait(job_id), JOB_DEADLINE_S)
            for job_id in job_ids
        }
    finally:
        await asyncio.to_thread(second.stop)
    for job_id, final in finals.items():
        assert final.state == JobState.COMPLETED, final.model_dump_json(indent=1)
        assert final.backend is not None
        assert final.checkpoint is not None and final.checkpoint.server == final.backend.server
        assert_artifacts_are_comfyuis_files(real_env, final, SAVE_NODE, count=4)
        await case.assert_nothing_left(job_id)
    victim_backend = finals[victim].backend
    assert victim_backend is not None and victim_backend.server == second.url
    # The killed server took the victim's prompt twice (before the kill, and once provably
    # gone); the other server took its own job's prompt once. Nothing moved between them.
    assert accepted_prompts(second.log_text(logs_from[second.url])) == 2
    assert accepted_prompts(first.log_text(logs_from[first.url])) == 1
