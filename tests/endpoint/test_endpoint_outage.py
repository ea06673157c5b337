"""Our RunPod handler through a storage outage (endpoint/s3.py's retries, endpoint/outputs.py's
second tries), against the ComfyUI simulator and a real S3 (SeaweedFS) behind a `Gate`: a relay
that refuses connections and cuts the open ones on demand, as a SeaweedFS that died looks to its
clients, and comes back on the same port.

The promise: an outage shorter than BUCKET_RETRY_S, and short enough that the claim's lease is
renewed before its fence point (endpoint/lease.py), costs time, not the GPU run: one execution,
every output stored and verified, the claim finished; past the budget the job fails StorageError
and says whether its claim could record it. (A longer one fences the job:
tests/endpoint/test_endpoint_fence.py.)
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from structlog.testing import capture_logs

from endpoint.claims import ClaimStore
from endpoint.job import run_job
from endpoint.s3 import S3
from endpoint.settings import EndpointSettings
from faults.wait import eventually
from protocol.runpod.contract import Claim, S3Target, claim_key
from tests.support.comfy_sim import ksampler_graph
from tests.support.endpoint import (
    Bucket,
    Gate,
    Progress,
    endpoint_settings,
    orchestrated_input,
    sha256,
    sim_get,
)

MIB = 1024 * 1024
# Long enough for several failed tries at the backoff's cap, short enough for a test.
OUTAGE_S = 10.0


@pytest_asyncio.fixture(loop_scope="session")
async def gate(bucket: Bucket) -> AsyncIterator[Gate]:
    async with Gate(bucket.settings.endpoint_url) as opened:
        yield opened


def behind(gate: Gate, bucket: Bucket, sim: str, **overrides: Any) -> EndpointSettings:
    """The handler's settings with its bucket reached through `gate`."""
    gated = Bucket(bucket.settings.model_copy(update={"endpoint_url": gate.url}), bucket.name)
    return endpoint_settings(sim, gated, **overrides)


def graph(steps: int, large_mib: int = 0) -> dict[str, Any]:
    prefix = f"outage/{uuid.uuid4().hex[:8]}"
    built: dict[str, Any] = ksampler_graph(prefix, steps=steps, seed=uuid.uuid4().int % 10**9)
    if large_mib:
        # Above 8 MiB: a multipart upload.
        built["8"] = {
            "class_type": "SimLargeOutput",
            "inputs": {"size_mib": large_mib, "seed": 3, "filename_prefix": prefix},
        }
    return built


def job(job_input: Any) -> dict[str, Any]:
    return {"id": f"rp-{uuid.uuid4().hex[:10]}", "input": job_input}


async def read_claim(bucket: Bucket, block: dict[str, Any]) -> Claim | None:
    key = claim_key(S3Target.model_validate(block["output"]), block["job_id"], block["submission"])
    stored = await ClaimStore(S3(bucket.settings), bucket.name).read(key)
    return stored.claim if stored is not None else None


async def prompt_runs(sim: str, prompt_id: str) -> int:
    return int((await sim_get(sim, "/sim/stats"))["prompts"].get(prompt_id, 0))


async def until(check: Any, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition not met within {within}s")


def open_uploads(bucket: Bucket, job_id: str) -> list[Any]:
    listed = bucket.client().list_multipart_uploads(Bucket=bucket.name, Prefix=f"jobs/{job_id}")
    return list(listed.get("Uploads") or [])


async def test_outages_while_claiming_and_mid_upload_cost_time_not_the_run(
    sim: str, bucket: Bucket, gate: Gate
) -> None:
    """S3 down while the handler reads its claim, and again halfway through a multipart
    upload: the job completes, with one GPU execution and every output verified. The lease is
    long enough for the second outage: renewed a third of a lease before it at worst, it is
    renewed again a second after it, well before its fence point (a quarter of the lease
    before its end)."""
    lease_s = 36.0
    job_input = orchestrated_input(graph(steps=100, large_mib=9), bucket.name, lease_s=lease_s)
    block = job_input["durable_comfy"]
    settings = behind(gate, bucket, sim)
    await gate.shut()
    progress = Progress()
    with capture_logs() as logs:
        task = asyncio.create_task(run_job(job(job_input), settings, progress))

        # No claim yet, so no lease: "claiming" every third of the lease says the handler
        # lives (the orchestrator gives a delivery silent for a lease up for dead). The second
        # comes a third of a lease after the first, itself sent once the handler is up (later,
        # under load): waited for up to half a lease, which a handler silent for a lease misses.
        async def claiming() -> int:
            return len([u for u in progress.updates if u.stage == "claiming"])

        await eventually(
            claiming, accept=lambda n: n >= 2, timeout_s=lease_s / 2, what="a second 'claiming'"
        )
        assert not task.done() and await prompt_runs(sim, block["prompt_id"]) == 0
        # Back, until 3 MiB more went up: a cut in the middle of the large file's first part.
        cut = gate.shut_after(3 * MIB)
        await gate.open()
        await asyncio.wait_for(cut.wait(), timeout=60)
        assert not task.done()
        await asyncio.sleep(OUTAGE_S)
        await gate.open()
        result = await asyncio.wait_for(task, timeout=120)

    assert result["status"] == "success", result
    assert await prompt_runs(sim, block["prompt_id"]) == 1
    records = result["images"]
    assert {r["node_id"] for r in records} == {"7", "8"}
    for record in records:
        body, head = bucket.read(record["key"])
        assert sha256(body) == record["sha256"] == head["Metadata"]["sha256"]
    assert next(r for r in records if r["node_id"] == "8")["size"] == 9 * MIB
    claim = await read_claim(bucket, block)
    assert claim is not None and claim.outcome is not None
    assert claim.outcome.state == "completed" and len(claim.outcome.images) == 2
    assert open_uploads(bucket, block["job_id"]) == []
    retried = {e["operation"] for e in logs if e["event"] == "s3_retrying"}
    assert "get_object" in retried  # the claim, read through the first outage
    assert retried & {"upload_part", "complete_multipart_upload", "head_object", "copy_object"}


@pytest.mark.parametrize("back_in_time", [True, False], ids=["claim-recorded", "claim-not-written"])
async def test_past_the_budget_the_job_fails_storageerror_saying_whether_the_claim_has_it(
    sim: str, bucket: Bucket, gate: Gate, back_in_time: bool
) -> None:
    """The upload gives up after BUCKET_RETRY_S; the claim's finish has a budget of its own:
    S3 back within it, the claim records the failure; never back, the answer says it could
    not."""
    budget_s = 4.0
    job_input = orchestrated_input(
        graph(steps=300), bucket.name, lease_s=60.0, sampler_steps={"5": 300}
    )
    block = job_input["durable_comfy"]
    settings = behind(gate, bucket, sim, bucket_retry_s=budget_s)
    progress = Progress()
    task = asyncio.create_task(run_job(job(job_input), settings, progress))
    await until(lambda: any(u.step > 0 for u in progress.updates))
    # The next request (the output's upload, or the claim's news that the prompt ended: no
    # renewal is due) shuts the gate for both.
    cut = gate.shut_after(1)
    await asyncio.wait_for(cut.wait(), timeout=30)
    if back_in_time:
        # After the upload's budget ran out, within the finish's.
        await asyncio.sleep(1.5 * budget_s)
        await gate.open()
    result = await asyncio.wait_for(task, timeout=60)
    await gate.open()

    assert result["error_type"] == "StorageError", result
    assert result["claim_recorded"] is back_in_time
    assert await prompt_runs(sim, block["prompt_id"]) == 1
    claim = await read_claim(bucket, block)
    assert claim is not None
    if back_in_time:
        assert claim.outcome is not None and claim.outcome.state == "failed"
        assert claim.outcome.error_type == "StorageError"
    else:
        assert claim.outcome is None


async def test_a_stop_while_the_claim_is_being_read_through_an_outage_records_it(
    sim: str, bucket: Bucket, gate: Gate
) -> None:
    """Stopped before anything ran, while S3 is down: once S3 is back the claim the handler
    took is finished cancelled (never_submitted), so no later delivery runs the submission."""
    job_input = orchestrated_input(graph(steps=10), bucket.name)
    block = job_input["durable_comfy"]
    await gate.shut()
    task = asyncio.create_task(run_job(job(job_input), behind(gate, bucket, sim), Progress()))
    await asyncio.sleep(1.0)

    async def stop_repeatedly() -> None:
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.4)

    stopping = asyncio.create_task(stop_repeatedly())
    await asyncio.sleep(3.0)
    assert not task.done()  # it waits for S3, whatever the stops
    await gate.open()
    await asyncio.wait_for(stopping, timeout=30)
    with pytest.raises(asyncio.CancelledError):
        task.result()

    claim = await read_claim(bucket, block)
    assert claim is not None and claim.outcome is not None
    assert claim.outcome.state == "cancelled"
    assert claim.outcome.stop is not None and claim.outcome.stop.prompt == "never_submitted"
    assert await prompt_runs(sim, block["prompt_id"]) == 0
