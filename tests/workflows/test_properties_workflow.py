"""Hostile input through a real `InferenceJob` on the local stack (Temporal dev server, the
ComfyUI simulator, a RunPod simulator that never starts a worker), bypassing every client check.

Each generated start argument goes to Temporal as it is (a raw payload, as `temporal workflow
start --input` or another SDK would send it). The job either completes, or fails as a
*workflow* with a typed, non-retryable error; no workflow task ever fails; and a refused job
sends nothing to a backend: the ComfyUI simulator counts no prompt (`/sim/stats`) and the
RunPod simulator's ledger no job (`/sim/ledger`).
"""

from __future__ import annotations

import asyncio
import copy
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import pytest_asyncio
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import EventType
from temporalio.client import (
    Client,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowUpdateFailedError,
)
from temporalio.common import RawValue
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.worker import Replayer

from configuration.pools import PoolConfig
from devstack.models import RunningStack
from starter import JobClient
from tests.support.cli import example
from tests.support.properties import FIXED, json_values, near_valid_cases
from tests.support.runpod_e2e import bucket_env, endpoint_sim, runpod_pool, serving
from tests.support.runpod_sim import RunpodSim
from workflows.activity_io import PreparedJob
from workflows.contracts import JobRequest, JobState, JobStatus
from workflows.inference_job import InferenceJob
from workflows.job_input import JobCarry
from workflows.shared import WORKFLOW_TYPE, ErrorType

EXAMPLE_CLASSES = sorted({node["class_type"] for node in example().values()})
REPLAYER = Replayer(workflows=[InferenceJob], data_converter=pydantic_data_converter)
REFUSED_TYPES = {
    ErrorType.INVALID_GRAPH,
    ErrorType.INVALID_REQUEST,
    ErrorType.MISSING_INPUT,
    ErrorType.UNKNOWN_POOL,
}


@dataclass
class Stack:
    temporal: Client
    client: JobClient
    comfyui_url: str
    runpod: RunpodSim


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    local_stack: RunningStack, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    work_dir = tmp_path_factory.mktemp("runpod-hostile")
    # No RunPod worker ever starts: a job that reached it would wait in its queue (and show).
    async with endpoint_sim(
        work_dir, "--max-workers=0", handler=None, env=bucket_env(local_stack)
    ) as sim:
        pools = {
            "comfyui": PoolConfig(kind="comfyui", url=local_stack.comfyui_url),
            "locked": PoolConfig(
                kind="comfyui", url=local_stack.comfyui_url, allowed_node_classes=EXAMPLE_CLASSES
            ),
            "gpu": runpod_pool(sim),
            "gpu-locked": runpod_pool(sim, allowed_node_classes=EXAMPLE_CLASSES),
        }
        async with serving(local_stack, pools, default_pool="comfyui") as (client, _store):
            yield Stack(client.temporal, client, local_stack.comfyui_url, sim)


@dataclass
class Probe:
    """A start argument, and whether the job must complete (else: be refused untouched)."""

    argument: Any
    completes: bool
    what: str


def runnable(steps: int, seed: int, text: str) -> dict[str, Any]:
    graph = example(steps)
    graph["3"]["inputs"]["seed"] = seed
    graph["6"]["inputs"]["text"] = text
    return graph


RUNNABLE = st.builds(runnable, st.integers(1, 2), st.integers(0, 2**48), st.text(max_size=30))


# Every kind in every example (a drawn kind would leave some out: derandomized generation is
# far from uniform).
KINDS = ["valid", "near", "registry", "allow", "pool", "request", "carry", "garbage"]


@st.composite
def probes(draw: st.DrawFn, kind: str) -> Probe:
    graph = draw(RUNNABLE)
    if kind == "valid":
        pool = draw(st.sampled_from([None, "comfyui", "locked"]))
        return Probe({"request": {"graph": graph, "pool": pool}}, True, kind)
    if kind == "near":
        # One mutation the client refuses; sent anyway, to either kind of pool.
        case = draw(near_valid_cases())
        pool = draw(st.sampled_from([None, "gpu", "gpu-locked", "locked"]))
        return Probe({"graph": case.graph, "pool": pool}, False, f"near:{case.mutation}")
    if kind == "registry":
        # Valid to the client; the pool's node registry refuses it at prepare.
        broken = copy.deepcopy(graph)
        mutation = draw(st.sampled_from(["unknown_class", "output_index", "no_output_node"]))
        if mutation == "unknown_class":
            broken["4"]["class_type"] = "NoSuchNode"
        elif mutation == "output_index":
            broken["8"]["inputs"]["vae"] = ["4", 7]
        else:
            del broken["9"]
        return Probe({"graph": broken}, False, f"registry:{mutation}")
    if kind == "allow":
        extra = copy.deepcopy(graph)
        extra["10"] = {"class_type": "PreviewImage", "inputs": {"images": ["8", 0]}}
        pool = draw(st.sampled_from(["locked", "gpu-locked"]))
        return Probe({"graph": extra, "pool": pool}, False, f"allow:{pool}")
    if kind == "carry":
        # What a job hands its own continuation (prepare skipped), forged by a client.
        prepared = PreparedJob(pool="comfyui", kind="comfyui", graph=graph)
        carry = JobCarry(status=JobStatus(job_id="forged"), prepared=prepared, next_segment=0)
        argument = {"request": {"graph": graph}, "carry": carry.model_dump(mode="json")}
        return Probe(argument, False, kind)
    if kind == "pool":
        return Probe({"graph": graph, "pool": "no-such-pool"}, False, kind)
    if kind == "request":
        field, value = draw(
            st.sampled_from(
                [
                    ("policy", {"execution_timeout_s": 1e12}),
                    ("policy", {"execution_timeout_s": "soon"}),
                    ("labels", {"tenant": "t" * 5000}),
                    ("segments", [{"3": 5}]),
                    ("unknown", 1),
                    ("pool", "../etc"),
                ]
            )
        )
        return Probe({"graph": graph, "pool": "gpu", field: value}, False, f"request:{field}")
    garbage = draw(json_values(20))
    wrapped = draw(st.sampled_from(["bare", "request", "graph"]))
    argument = {"bare": garbage, "request": {"request": garbage}, "graph": {"graph": garbage}}
    return Probe(argument[wrapped], False, f"garbage:{wrapped}")


def nested_json(depth: int) -> RawValue:
    """A JSON payload nested `depth` lists deep, sent as it is (no client would encode it)."""
    data = b"[" * depth + b"0" + b"]" * depth
    return RawValue(Payload(metadata={"encoding": b"json/plain"}, data=data))


async def prompts_sent(stack: Stack) -> int:
    async with httpx.AsyncClient(trust_env=False) as http:
        response = await http.get(f"{stack.comfyui_url}/sim/stats")
    response.raise_for_status()
    return sum(response.json()["prompts"].values())


async def workflow_task_failures(handle: WorkflowHandle[Any, Any]) -> list[str]:
    return [
        event.workflow_task_failed_event_attributes.failure.message
        async for event in handle.fetch_history_events()
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
    ]


async def ended(handle: WorkflowHandle[Any, Any], within_s: float = 30) -> Any:
    """The workflow's result (or its failure raised); fails at once if a workflow task fails,
    rather than at the timeout (a failing task is retried, and the workflow never ends)."""
    result = asyncio.ensure_future(handle.result())
    try:
        async with asyncio.timeout(within_s):
            while True:
                done, _ = await asyncio.wait({result}, timeout=1.0)
                if done:
                    return result.result()
                failures = await workflow_task_failures(handle)
                assert failures == [], f"a workflow task failed: {failures}"
    finally:
        result.cancel()


def client_accepts(argument: Any) -> bool:
    data = argument.get("request", argument) if isinstance(argument, dict) else argument
    try:
        JobRequest.model_validate(data)
    except ValidationError:
        return False
    return True


@settings(FIXED, max_examples=5)
@given(st.data())
async def test_a_raw_start_completes_or_fails_typed_and_a_refused_one_reaches_no_backend(
    stack: Stack, data: st.DataObject
) -> None:
    for kind in KINDS:
        await check_probe(stack, data.draw(probes(kind), label=kind))


async def check_probe(stack: Stack, probe: Probe) -> None:
    if probe.completes:
        assert client_accepts(probe.argument), probe.what
    sent_before = await prompts_sent(stack)
    ledger_before = len((await stack.runpod.ledger()).jobs)
    handle = await stack.temporal.start_workflow(
        WORKFLOW_TYPE,
        probe.argument,
        id=f"hostile-{uuid.uuid4().hex[:12]}",
        task_queue=stack.client.task_queue,
    )
    try:
        result = await ended(handle)
    except WorkflowFailureError as failure:
        cause = failure.cause
        assert isinstance(cause, ApplicationError), (probe.what, cause)
        assert not probe.completes, (probe.what, cause.message)
        assert cause.type in REFUSED_TYPES and cause.non_retryable, (probe.what, cause)
        status = JobStatus.model_validate(cause.details[0])
        assert status.state == JobState.FAILED and status.error is not None
        assert status.error.type == cause.type and status.teardown.state == "SKIPPED"
        assert await prompts_sent(stack) == sent_before, f"{probe.what}: a prompt was sent"
        assert len((await stack.runpod.ledger()).jobs) == ledger_before, probe.what
    else:
        assert probe.completes, (probe.what, result)
        assert JobStatus.model_validate(result).state == JobState.COMPLETED
        assert await prompts_sent(stack) == sent_before + 1
    assert await workflow_task_failures(handle) == [], probe.what
    if not probe.completes:
        # Its history replays against this code: the refusal path (and its patch) is
        # deterministic. (Completed jobs: the committed histories cover their path.)
        await REPLAYER.replay_workflow(await handle.fetch_history())


@settings(FIXED, max_examples=6)
@given(st.lists(json_values(10), min_size=4, max_size=4))
async def test_garbage_signals_and_updates_never_fail_a_workflow_task(
    stack: Stack, payloads: list[Any]
) -> None:
    """A job waiting in RunPod's queue (no worker ever starts) gets a garbage payload on every
    signal and update; it keeps answering, and ends as asked."""
    request = JobRequest(graph=example(1), pool="gpu")
    status = await stack.client.submit(request, detached=True)
    handle = stack.temporal.get_workflow_handle(status.job_id)
    for payload in payloads:
        for signal in ("cancel_reason", "client_seen", "resume", "progress"):
            await handle.signal(signal, payload)
        for update in ("attach", "resume"):
            if update == "attach" and payload in (None, {}):
                continue  # a valid attach
            with pytest.raises(WorkflowUpdateFailedError):
                await handle.execute_update(update, payload)
    await handle.signal("progress", nested_json(5000))  # past the decoder's limit: dropped
    answered = JobStatus.model_validate(await handle.query("status"))
    assert not answered.terminal
    await handle.signal("cancel", {"reason": "enough"})
    final = JobStatus.model_validate(await ended(handle))
    assert final.state == JobState.CANCELLED
    assert final.error is not None and final.error.message == "enough"
    assert await workflow_task_failures(handle) == []


async def test_a_start_argument_nested_past_every_parser_limit_fails_the_job_typed(
    stack: Stack,
) -> None:
    sent_before = await prompts_sent(stack)
    handle = await stack.temporal.start_workflow(
        WORKFLOW_TYPE,
        nested_json(100_000),
        id=f"hostile-deep-{uuid.uuid4().hex[:8]}",
        task_queue=stack.client.task_queue,
    )
    with pytest.raises(WorkflowFailureError) as caught:
        await ended(handle)
    cause = caught.value.cause
    assert isinstance(cause, ApplicationError) and cause.non_retryable
    assert cause.type == ErrorType.INVALID_REQUEST
    assert "cannot be decoded" in cause.message
    assert await workflow_task_failures(handle) == []
    assert await prompts_sent(stack) == sent_before
