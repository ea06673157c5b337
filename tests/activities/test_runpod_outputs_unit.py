"""No output of a RunPod job is dropped, and a storage failure the orchestrator can recover from
does not fail the job: against the scripted RunPod and the
in-memory bucket of test_runpod_backend_unit, no server.

Stock records carry no node id and no subfolder: two images both named `out_00001_.png` are two
artifacts, under keys a re-attempt computes again. Our handler's StorageError is final only once
its claim says so.
"""

from __future__ import annotations

import base64
import hashlib
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError

from activities.runpod.artifacts import record_keys
from protocol.runpod.contract import ArtifactRecord, ClaimOutcome
from tests.activities.test_runpod_backend_unit import (
    JOB_ID,
    OUR_KEY,
    PNG,
    RUNPOD_JOB,
    MemoryStore,
    ScriptedRunPod,
    backend,
    env,
    follow_input,
    record,
)
from tests.activities.test_runpod_stop_unit import WORKER, put_claim
from workflows.activity_io import FollowHeartbeat
from workflows.contracts import Checkpoint
from workflows.errors import KeyCollision
from workflows.shared import ErrorType

A, B = b"\x89PNG image from a/out", b"\x89PNG image from b/out, other bytes"
PROMPT_ID = follow_input().prompt_id


def inline(data: bytes, filename: str = "out_00001_.png") -> dict[str, Any]:
    return {"filename": filename, "type": "base64", "data": base64.b64encode(data).decode()}


def stock_done(images: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": RUNPOD_JOB,
        "status": "COMPLETED",
        "workerId": "w1",
        "executionTime": 2000,
        "output": {"images": images, "status": "success"},
    }


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- one key per record ---------------------------------------------------------------------------


async def test_two_stock_outputs_of_one_name_are_two_artifacts() -> None:
    """`a/out` and `b/out` both write out_00001_.png; one artifact used to be kept, silently."""
    store = MemoryStore()
    runpod = ScriptedRunPod(statuses=[stock_done([inline(A), inline(B)])])
    heartbeats: list[Any] = []
    result = await env(heartbeats).run(backend(runpod, store, claims=False).follow, follow_input())
    assert sorted(a.sha256 for a in result.artifacts) == sorted([sha(A), sha(B)])
    keys = [a.key for a in result.artifacts]
    assert keys == [
        f"jobs/{JOB_ID}/0/output/out_00001_.png",
        f"jobs/{JOB_ID}/0/output/out_00001_-1.png",
    ]
    for artifact, data in zip(result.artifacts, (A, B), strict=True):
        assert store.objects[("artifacts", artifact.key)][0] == data

    # A re-attempt of the same follow (its heartbeat says what was kept) maps each record to
    # the same key and stores nothing again.
    kept = FollowHeartbeat.model_validate(heartbeats[-1])
    uploads: list[str] = []
    original = store.upload_stream

    async def counting(key: str, *args: Any, **kwargs: Any) -> Any:
        uploads.append(key)
        return await original(key, *args, **kwargs)

    store.upload_stream = counting  # type: ignore[method-assign]
    known = Checkpoint(job_id=JOB_ID, prompt_id=PROMPT_ID, provider_job_id=RUNPOD_JOB)
    runpod = ScriptedRunPod(statuses=[stock_done([inline(A), inline(B)])])
    again = await env([], [kept.model_dump(mode="json")]).run(
        backend(runpod, store, claims=False).follow, follow_input(checkpoint=known)
    )
    assert uploads == [] and sorted(a.key for a in again.artifacts) == sorted(keys)


def test_keys_use_node_and_subfolder_where_a_record_has_them() -> None:
    records = [
        ArtifactRecord.model_validate(inline(A) | {"node_id": "9", "subfolder": "a"}),
        ArtifactRecord.model_validate(inline(B) | {"node_id": "9", "subfolder": "b"}),
        ArtifactRecord.model_validate(inline(B) | {"node_id": "12"}),
    ]
    keys = record_keys(records, "jobs", JOB_ID, 0)
    assert len(set(keys)) == 3
    assert keys[0].startswith(f"jobs/{JOB_ID}/0/9/a_out_00001_")
    assert keys[1].startswith(f"jobs/{JOB_ID}/0/9/b_out_00001_")
    assert keys[2] == f"jobs/{JOB_ID}/0/12/out_00001_.png"


async def test_outputs_that_would_still_share_a_key_fail_the_job_rather_than_lose_one() -> None:
    # Record 2 is a second out.png (indexed: out-2.png), and record 1 is already named so.
    images = [inline(A, "out.png"), inline(B, "out-2.png"), inline(B + b"!", "out.png")]
    with pytest.raises(KeyCollision):
        record_keys([ArtifactRecord.model_validate(i) for i in images], "jobs", JOB_ID, 0)
    store = MemoryStore()
    runpod = ScriptedRunPod(statuses=[stock_done(images)])
    with pytest.raises(ApplicationError) as failed:
        await env([]).run(backend(runpod, store, claims=False).follow, follow_input())
    assert failed.value.type == ErrorType.OUTPUT_MISSING and failed.value.non_retryable
    assert "would both be stored as" in failed.value.message
    assert not [k for _b, k in store.objects if k.endswith(".png")], "nothing half-kept"


def test_our_handlers_record_told_twice_is_one_output_but_two_on_one_key_are_refused() -> None:
    ours = ArtifactRecord.model_validate(record(OUR_KEY))
    assert record_keys([ours, ours], "jobs", JOB_ID, 0) == [OUR_KEY, OUR_KEY]
    other = ArtifactRecord.model_validate(record(OUR_KEY, b"other bytes"))
    with pytest.raises(KeyCollision):
        record_keys([ours, other], "jobs", JOB_ID, 0)


# -- a StorageError of our handler ---------------------------------------------------------------


def storage_failed() -> dict[str, Any]:
    output = {"error_type": "StorageError", "submission": PROMPT_ID, "claim_recorded": False}
    return {
        "id": RUNPOD_JOB,
        "status": "FAILED",
        "workerId": WORKER,  # the claim's holder (put_claim) on its worker
        "executionTime": 42_000,
        "error": "storage: EndpointConnectionError",
        "output": output,
    }


async def test_a_storage_failure_with_a_completed_claim_is_a_success() -> None:
    store = MemoryStore()
    store.put(OUR_KEY, PNG)
    done = ClaimOutcome(
        state="completed",
        images=[ArtifactRecord.model_validate(record(OUR_KEY))],
        at=datetime.now(UTC),
    )
    put_claim(store, outcome=done)
    runpod = ScriptedRunPod(statuses=[storage_failed()])
    result = await env([]).run(backend(runpod, store).follow, follow_input())
    assert [a.key for a in result.artifacts] == [OUR_KEY]
    assert result.artifacts[0].sha256 == sha(PNG), "verified as any other record"
    assert result.cost is not None and result.cost.execution_s == 42.0


async def test_a_storage_failure_the_handler_could_not_record_is_submitted_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The handler's outcome never reached the claim. Worker trouble: submitted
    again (PromptLost, the workflow resubmits the same token), once the lease has run out."""
    monkeypatch.setattr("activities.runpod.follow.TAKEOVER_MARGIN_S", 0.2)
    for claimed in (True, False):
        store = MemoryStore()
        # Before the claim is written: its lease runs from then.
        began = datetime.now(UTC)
        if claimed:
            put_claim(store, lease_left_s=0.1)
        runpod = ScriptedRunPod(statuses=[storage_failed()])
        with pytest.raises(ApplicationError) as lost:
            follow = backend(runpod, store, fence_after_s=1).follow
            await env([]).run(follow, follow_input())
        assert lost.value.type == ErrorType.PROMPT_LOST and lost.value.non_retryable, claimed
        details = lost.value.details[0]
        assert details["cause_type"] == ErrorType.STORAGE_ERROR
        assert details["cost"]["execution_s"] == 42.0, "the failed run was paid for"
        waited = datetime.now(UTC) - began
        if claimed:
            # The lease, the server clock's second, the fence and the margin.
            assert waited >= timedelta(seconds=0.1 + 1 + 1 + 0.2), "not before the fence"
            assert "its claim records no outcome" in lost.value.message
        else:
            assert "it holds no claim" in lost.value.message


async def test_a_storage_failure_the_handler_recorded_as_failed_is_final() -> None:
    store = MemoryStore()
    failed = ClaimOutcome(
        state="failed",
        error="storage: NoSuchBucket",
        error_type="StorageError",
        at=datetime.now(UTC),
    )
    put_claim(store, outcome=failed)
    runpod = ScriptedRunPod(statuses=[storage_failed()])
    with pytest.raises(ApplicationError) as final:
        await env([]).run(backend(runpod, store).follow, follow_input())
    assert final.value.type == ErrorType.STORAGE_ERROR and final.value.non_retryable

    # The handler's answer says it recorded the failure: final too, whatever the claim read
    # shows (`EndpointError.claim_recorded`).
    store = MemoryStore()
    recorded = storage_failed()
    recorded["output"]["claim_recorded"] = True
    runpod = ScriptedRunPod(statuses=[recorded])
    with pytest.raises(ApplicationError) as final:
        await env([]).run(backend(runpod, store).follow, follow_input())
    assert final.value.type == ErrorType.STORAGE_ERROR and final.value.non_retryable
