"""A holder that cannot renew its claim fences itself, and a takeover respects the fence and keeps
what is done (endpoint/fencing.py, endpoint/lease.py, endpoint/claims.py, endpoint/takeover.py):
our RunPod handler driven directly, against the ComfyUI simulator and a real S3 (SeaweedFS),
reached through a `Gate` that cuts it on demand.

The promises: a handler cut off from S3 stops its prompt before its lease ends and records
the fence once S3 is back; nobody takes a claim over before its lease has run out by the job's
`fence_after_s`, unless the claim records a fence; a delivery that takes over after the holder
finished its prompt and stored its outputs runs nothing, and after a partly stored one runs
only the output node whose output is missing.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from structlog.testing import capture_logs

from endpoint.claims import ClaimStore, StoredClaim, fresh_claim
from endpoint.errors import ClaimError
from endpoint.fence_file import read_fence
from endpoint.job import run_job
from endpoint.lease import Lease, fence_margin_s
from endpoint.s3 import S3
from endpoint.settings import EndpointSettings
from protocol.runpod.contract import Claim, ClaimOutcome, FenceRecord, S3Target, claim_key
from tests.support.comfy_sim import basic_graph, ksampler_graph, run_simulator
from tests.support.endpoint import (
    Bucket,
    Gate,
    Progress,
    endpoint_settings,
    orchestrated_input,
    read_claim,
    sha256,
    sim_get,
    sim_post,
    until,
)


@pytest.fixture(scope="module")
def other_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Another worker's ComfyUI."""
    with run_simulator(tmp_path_factory.mktemp("fence_sim_b")) as url:
        yield url


@pytest_asyncio.fixture(loop_scope="session")
async def gate(bucket: Bucket) -> AsyncIterator[Gate]:
    async with Gate(bucket.settings.endpoint_url) as opened:
        yield opened


def behind(gate: Gate, bucket: Bucket, sim: str, **overrides: Any) -> EndpointSettings:
    gated = Bucket(bucket.settings.model_copy(update={"endpoint_url": gate.url}), bucket.name)
    return endpoint_settings(sim, gated, **overrides)


def job(job_input: Any, job_id: str | None = None) -> dict[str, Any]:
    return {"id": job_id or f"rp-{uuid.uuid4().hex[:10]}", "input": job_input}


def key_of(block: dict[str, Any]) -> str:
    return claim_key(S3Target.model_validate(block["output"]), block["job_id"], block["submission"])


def store_of(bucket: Bucket) -> ClaimStore:
    return ClaimStore(S3(bucket.settings), bucket.name)


async def stats(sim: str) -> dict[str, Any]:
    result: dict[str, Any] = await sim_get(sim, "/sim/stats")
    return result


async def prompt_runs(sim: str, prompt_id: str) -> int:
    return int((await stats(sim))["prompts"].get(prompt_id, 0))


# --- the fence -------------------------------------------------------------------------------


async def test_a_handler_cut_off_from_s3_mid_prompt_fences_itself_before_its_lease_ends(
    sim: str, bucket: Bucket, gate: Gate, tmp_path: Path
) -> None:
    """S3 goes away while the prompt samples: before the lease (by the S3 server's clock)
    ends, the prompt is interrupted, prompt-scoped, and the watchdog told nothing is left to
    stop; once S3 is back the claim records the fence and the job answers PromptLost, fenced.
    Another delivery then takes the claim over at once, and runs the prompt again."""
    lease_s, fence_after_s = 8.0, 20.0
    steps = 2000  # 20 s: still sampling when the fence comes, 6 to 9 s after the cut
    graph = ksampler_graph(f"fence/{uuid.uuid4().hex[:8]}", steps=steps, seed=7)
    job_input = orchestrated_input(
        graph, bucket.name, lease_s=lease_s, fence_after_s=fence_after_s, sampler_steps={"5": steps}
    )
    block = job_input["durable_comfy"]
    prompt_id = block["prompt_id"]
    fence_file = tmp_path / "fence.json"
    progress = Progress()
    task = asyncio.create_task(
        run_job(
            job(job_input, "rp-cut"), behind(gate, bucket, sim, fence_file=fence_file), progress
        )
    )
    await until(lambda: any(u.step > 0 for u in progress.updates), within=30)
    state = read_fence(fence_file)
    assert state is not None and state.holding and state.prompt_id == prompt_id
    assert state.fence_after_s == fence_after_s and state.fence_by is not None
    assert time.time() < state.fence_by < time.time() + lease_s

    await gate.shut()
    cut_at = time.time()
    await asyncio.sleep(0.5)  # a write cut in flight has landed, or never will
    _, head = bucket.read(key_of(block))
    # Last-Modified is whole seconds (rounded down): the lease ends no earlier than this.
    lease_end = head["LastModified"].timestamp() + lease_s

    await until(lambda: _ended(sim, prompt_id), within=lease_s + 5)
    seen = await stats(sim)
    assert seen["executed"][prompt_id] == "interrupted"  # the run did not complete
    assert prompt_id in seen["interrupts"] and None not in seen["interrupts"]
    ended = seen["ended_at"][prompt_id]
    assert ended < lease_end
    # Not at the first failed renewal (a third of a lease after the cut at the latest), but a
    # lease less the margin after the last one that succeeded.
    assert ended > cut_at + lease_s - lease_s / 3 - fence_margin_s(lease_s) - 0.5
    # Stopped: nothing left for the watchdog to do (said by the lease's end); the fence's
    # record waits for S3.
    await until(lambda: _released(fence_file), within=lease_end - time.time())
    assert not task.done()
    claim = await read_claim(bucket, block)
    assert claim is not None and claim.fenced is None

    await gate.open()
    result = await asyncio.wait_for(task, timeout=15)
    assert result["error_type"] == "PromptLost", result
    assert result["details"] == ["fenced: interrupted"] and result["claim_recorded"] is False
    assert "fenced itself" in result["error"]
    claim = await read_claim(bucket, block)
    assert claim is not None and claim.outcome is None and claim.holder == "rp-cut"
    assert claim.fenced is not None and claim.fenced.action == "interrupted"
    assert claim.fenced.worker_id == "worker-a"
    recorded_at = time.monotonic()

    # A fenced claim is taken over at once: this worker's ComfyUI forgets the interrupted
    # prompt and runs it again (then the platform stops that job).
    other = endpoint_settings(sim, bucket, worker_id="worker-b")
    again = asyncio.create_task(run_job(job(job_input, "rp-next"), other, Progress()))
    await until(lambda: _prompts(sim, prompt_id, 2), within=10)
    assert time.monotonic() - recorded_at < fence_after_s
    taken = await read_claim(bucket, block)
    assert taken is not None and taken.holder == "rp-next" and taken.takeovers == 1
    again.cancel()
    with pytest.raises(asyncio.CancelledError):
        await again
    done = await read_claim(bucket, block)
    assert done is not None and done.outcome is not None and done.outcome.state == "cancelled"


async def test_a_fence_during_a_stop_kills_a_prompt_that_will_not_stop_by_the_lease_end(
    sim: str, bucket: Bucket, gate: Gate
) -> None:
    """The platform stops the job while a node that ignores interrupts runs (the stop would
    wait for it up to its horizon, a minute), and S3 goes away: the fence takes the stop over,
    replaces the worker (kills its ComfyUI) by the lease's end, and records `still_running`
    in the claim once S3 is back; no outcome."""
    lease_s = 8.0
    graph = {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": 8, "height": 8, "batch_size": 1, "color": 0},
        },
        "2": {"class_type": "SimSleep", "inputs": {"seconds": 25.0, "images": ["1", 0]}},
        "3": {
            "class_type": "SaveImage",
            "inputs": {"images": ["2", 0], "filename_prefix": f"fence/{uuid.uuid4().hex[:8]}"},
        },
    }
    job_input = orchestrated_input(graph, bucket.name, lease_s=lease_s, stop_horizon_s=60.0)
    block = job_input["durable_comfy"]
    replaced: list[float] = []
    task = asyncio.create_task(
        run_job(
            job(job_input, "rp-deaf"),
            behind(gate, bucket, sim),
            Progress(),
            replace_worker=lambda: replaced.append(time.time()),
        )
    )
    await until(lambda: _running(sim, block["prompt_id"]), within=15)
    await gate.shut()
    await asyncio.sleep(0.5)
    last = await read_claim(bucket, block)
    assert last is not None
    # The last write that landed was sent just after it was stamped (`renewed_at`, this
    # machine's clock) and landed after it was sent: its lease, by the S3 server's clock, ends
    # after `renewed_at + lease_s`.
    lease_end = last.renewed_at.timestamp() + lease_s
    task.cancel()  # the platform's job-stop

    await until(lambda: replaced, within=lease_end - time.time() + 2.0)
    # Killed at the lease's end (by the handler's reckoning), not a minute later at the stop's
    # horizon; before anyone may take over (fence_after_s later).
    assert lease_end - fence_margin_s(lease_s) < replaced[0] < lease_end + 0.3
    await gate.open()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=15)
    claim = await read_claim(bucket, block)
    assert claim is not None and claim.outcome is None and claim.stopping_since is not None
    assert claim.fenced is not None and claim.fenced.action == "still_running"
    # The simulator's prompt is not killed here (replace_worker is a fake): let it go.
    await sim_post(sim, "/interrupt", {"prompt_id": block["prompt_id"]})
    await until(lambda: _ended(sim, block["prompt_id"]), within=40)


async def test_a_takeover_waits_until_the_lease_has_run_out_by_fence_after_s(
    sim: str, bucket: Bucket
) -> None:
    """A holder gone silent (no fence recorded): its lease ends, and only fence_after_s later
    (by the S3 server's clock) does another delivery take the claim over and run the graph."""
    lease_s, fence_after_s = 2.0, 4.0
    job_input = orchestrated_input(
        basic_graph(f"fence/{uuid.uuid4().hex[:8]}"), bucket.name, fence_after_s=fence_after_s
    )
    block = job_input["durable_comfy"]
    silent = _claim(block, "rp-silent")
    written = time.monotonic()
    await store_of(bucket).create(key_of(block), fresh_claim(silent, lease_s))

    await asyncio.sleep(lease_s + 2.5 - (time.monotonic() - written))  # run out, not by 4 s
    early = await run_job(job(job_input, "rp-early"), endpoint_settings(sim, bucket))
    assert early["status"] == "claimed_elsewhere" and early["claim_holder"] == "rp-silent"
    assert await prompt_runs(sim, block["prompt_id"]) == 0

    # Takeable by the S3 server's whole-second clock: a second or two past lease + fence.
    await _takeable(bucket, block, fence_after_s=fence_after_s)
    assert time.monotonic() - written > lease_s + fence_after_s
    late = await run_job(job(job_input, "rp-late"), endpoint_settings(sim, bucket))
    assert late["status"] == "success", late
    assert await prompt_runs(sim, block["prompt_id"]) == 1
    claim = await read_claim(bucket, block)
    assert claim is not None and claim.holder == "rp-late" and claim.takeovers == 1
    assert claim.outcome is not None and claim.outcome.state == "completed"


async def test_a_recorded_fence_is_taken_over_at_once(sim: str, bucket: Bucket) -> None:
    job_input = orchestrated_input(basic_graph(f"fence/{uuid.uuid4().hex[:8]}"), bucket.name)
    block = job_input["durable_comfy"]
    fence = FenceRecord(action="dequeued", at=datetime.now(UTC), worker_id="worker-x")
    # Even a lease that has not run out: the holder said it stopped.
    fenced = _claim(block, "rp-fenced").model_copy(update={"fenced": fence})
    await store_of(bucket).create(key_of(block), fresh_claim(fenced, 60.0))

    result = await run_job(job(job_input, "rp-taker"), endpoint_settings(sim, bucket))

    assert result["status"] == "success", result
    claim = await read_claim(bucket, block)
    assert claim is not None and claim.holder == "rp-taker" and claim.fenced is None
    assert claim.outcome is not None and claim.outcome.state == "completed"


# --- what a takeover keeps -------------------------------------------------------------------


def two_outputs() -> dict[str, Any]:
    """txt2img saved by node 7, and node 8 writing a file of its own, linked to nothing."""
    prefix = f"fence/{uuid.uuid4().hex[:8]}"
    graph: dict[str, Any] = ksampler_graph(prefix, steps=20, seed=uuid.uuid4().int % 10**9)
    graph["8"] = {
        "class_type": "SimLargeOutput",
        "inputs": {"size_mib": 1, "seed": 5, "filename_prefix": prefix},
    }
    return graph


async def died_before_recording(
    sim: str, bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A first delivery that ran the prompt and stored both outputs, then died before the
    claim recorded its outcome (its `finish` never writes). Returns the job input and the
    first delivery's answer (which the orchestrator never got)."""
    job_input = orchestrated_input(two_outputs(), bucket.name, lease_s=5.0, fence_after_s=1.0)
    block = job_input["durable_comfy"]

    async def dies(self: Lease, outcome: ClaimOutcome) -> StoredClaim:
        # Everything the lease had to say is written (news at most a second apart): then the
        # handler is gone.
        async def all_written() -> bool:
            claim = await read_claim(bucket, block)
            return claim is not None and claim.prompt_end is not None and len(claim.stored) == 2

        await until(all_written, within=10)
        raise ClaimError("the handler died here")

    with monkeypatch.context() as patched:
        patched.setattr(Lease, "finish", dies)
        first = await run_job(job(job_input, "rp-first"), endpoint_settings(sim, bucket))
    assert first["status"] == "success", first
    return job_input, first


async def test_the_claim_says_when_the_prompt_ended_and_what_is_stored(
    sim: str, bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_input, first = await died_before_recording(sim, bucket, monkeypatch)
    claim = await read_claim(bucket, job_input["durable_comfy"])
    assert claim is not None and claim.outcome is None
    assert claim.prompt_end is not None and claim.prompt_end.outcome == "success"
    listed = {(o.node_id, o.filename) for o in claim.prompt_end.outputs}
    assert listed == {(r["node_id"], r["filename"]) for r in first["images"]}
    assert [r.model_dump(mode="json", exclude_none=True) for r in claim.stored] == first["images"]


async def test_a_takeover_after_a_finished_and_stored_prompt_runs_nothing(
    sim: str, bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_input, first = await died_before_recording(sim, bucket, monkeypatch)
    block = job_input["durable_comfy"]
    # The lease runs out (5 s), then by fence_after_s (1 s) and the clock's second.
    await _takeable(bucket, block, fence_after_s=1.0)
    progress = Progress()

    result = await run_job(
        job(job_input, "rp-second"), endpoint_settings(sim, bucket, worker_id="worker-b"), progress
    )

    assert result["status"] == "success" and result["replayed"] is True, result
    assert result["images"] == first["images"] and result["claim_holder"] == "rp-first"
    assert set(progress.stages()) <= {"claiming"}  # nothing ran
    assert await prompt_runs(sim, block["prompt_id"]) == 1
    claim = await read_claim(bucket, block)
    assert claim is not None and claim.holder == "rp-second"
    assert claim.outcome is not None and claim.outcome.state == "completed"
    assert [r.model_dump(mode="json", exclude_none=True) for r in claim.outcome.images] == (
        first["images"]
    )


@pytest.mark.parametrize("worker", ["another", "the-same"])
async def test_a_takeover_after_a_partly_stored_prompt_runs_only_the_missing_output_node(
    sim: str, other_sim: str, bucket: Bucket, monkeypatch: pytest.MonkeyPatch, worker: str
) -> None:
    """Node 8's output is not in the claim's `stored`. On another worker only node 8 runs
    (the sampler and node 7 stay idle); on the same worker nothing runs: the delivery finds the
    prompt in ComfyUI's history and stores node 8's file from its output folder."""
    job_input, first = await died_before_recording(sim, bucket, monkeypatch)
    block = job_input["durable_comfy"]
    kept = next(r for r in first["images"] if r["node_id"] == "7")
    store = store_of(bucket)
    current = await store.read(key_of(block))
    assert current is not None
    # As if the holder died before its write of node 8's record, and fenced meanwhile.
    partial = current.claim.model_copy(
        update={
            "stored": [r for r in current.claim.stored if r.node_id == "7"],
            "fenced": FenceRecord(action="ended", at=datetime.now(UTC)),
        }
    )
    await store.replace(key_of(block), partial, current.etag)
    comfy = other_sim if worker == "another" else sim
    runs_before = await prompt_runs(comfy, block["prompt_id"])

    with capture_logs() as logs:
        result = await run_job(
            job(job_input, "rp-second"), endpoint_settings(comfy, bucket, worker_id="worker-b")
        )

    assert result["status"] == "success", result
    # Node 7's file is not stored again, even where ComfyUI lists it again.
    assert [e["key"].split("/")[-2] for e in logs if e["event"] == "artifact_stored"] == ["8"]
    images = result["images"]
    assert [r["node_id"] for r in images] == ["7", "8"] and images[0] == kept
    for record in images:
        assert sha256(bucket.read(record["key"])[0]) == record["sha256"]
    history = (await sim_get(comfy, f"/history/{block['prompt_id']}"))[block["prompt_id"]]
    if worker == "another":
        assert await prompt_runs(comfy, block["prompt_id"]) == runs_before + 1
        assert set(history["outputs"]) == {"8"}  # node 7 did not run
        # The sampler (node 5, the graph's only node with a progress bar) stayed idle.
        progress = await sim_get(comfy, f"/sim/progress?prompt_id={block['prompt_id']}")
        assert progress["events"] == []
    else:
        assert await prompt_runs(comfy, block["prompt_id"]) == runs_before  # nothing ran
        assert images[1] == next(r for r in first["images"] if r["node_id"] == "8")
    assert await prompt_runs(sim, block["prompt_id"]) == 1
    claim = await read_claim(bucket, block)
    assert claim is not None and claim.outcome is not None
    assert [r.model_dump(mode="json", exclude_none=True) for r in claim.outcome.images] == images
    assert claim.prompt_end is not None
    assert [o.node_id for o in claim.prompt_end.outputs] == ["7", "8"]


def _claim(block: dict[str, Any], holder: str) -> Claim:
    now = datetime.now(UTC)
    return Claim(
        submission=block["submission"],
        job_id=block["job_id"],
        prompt_id=block["prompt_id"],
        holder=holder,
        worker_id="worker-x",
        lease_until=now,
        renewed_at=now,
    )


async def _takeable(bucket: Bucket, block: dict[str, Any], *, fence_after_s: float) -> None:
    async def takeable() -> bool:
        current = await store_of(bucket).read(key_of(block))
        return current is not None and current.takeable(fence_after_s)

    await until(takeable, within=30, interval=0.25)


def _released(fence_file: Path) -> bool:
    state = read_fence(fence_file)
    return state is not None and not state.holding


async def _running(sim: str, prompt_id: str) -> bool:
    queue = await sim_get(sim, "/queue")
    return prompt_id in [item[1] for item in queue["queue_running"]]


async def _ended(sim: str, prompt_id: str) -> bool:
    return prompt_id in (await stats(sim))["ended_at"]


async def _prompts(sim: str, prompt_id: str, count: int) -> bool:
    return await prompt_runs(sim, prompt_id) >= count
