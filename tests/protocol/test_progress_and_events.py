"""Progress units and throttling, reading ComfyUI's WebSocket frames, and reading back where a
follow attempt got to (its heartbeat, also its failure's details)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError, TimeoutError, TimeoutType

from protocol.comfyui.events import (
    for_prompt,
    is_fatal_device_error,
    is_out_of_memory,
    output_files,
    parse_frame,
)
from protocol.progress import ProgressTracker
from tests.support.workflow_fakes import after_activity
from workflows.activity_io import FollowHeartbeat
from workflows.contracts import Artifact, Checkpoint
from workflows.failures import recovered_progress


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_steps_are_the_unit_when_the_graph_has_samplers() -> None:
    tracker = ProgressTracker({"3": 10, "7": 10}, nodes_total=8)
    assert tracker.unit == "steps" and tracker.total == 20
    assert tracker.on_progress("3", 4)
    assert not tracker.on_progress("8", 1), "a non-sampler progress bar is not a step"
    assert not tracker.on_progress("3", 3), "steps never go backwards"
    tracker.on_node_done("3")
    assert tracker.step == 10 and tracker.fraction == 0.5


def test_nodes_are_the_unit_without_samplers() -> None:
    tracker = ProgressTracker({}, nodes_total=4)
    tracker.on_node_done("1")
    tracker.on_node_done("1")
    tracker.on_node_done("2")
    assert tracker.unit == "nodes" and tracker.step == 2 and tracker.fraction == 0.5


def test_restore_continues_from_the_checkpoint() -> None:
    tracker = ProgressTracker({"3": 20}, nodes_total=7)
    tracker.restore({"3": 12, "gone": 3}, ["4", "5"])
    assert tracker.step == 12
    assert not tracker.on_progress("3", 11)


def test_signals_are_throttled_by_fraction_and_time() -> None:
    clock = FakeClock()
    tracker = ProgressTracker({"3": 1000}, nodes_total=3, min_interval_s=1.0, clock=clock)
    sent = 0
    for step in range(1, 1001):
        clock.now += 0.01
        tracker.on_progress("3", step)
        sent += tracker.should_signal()
    # 10 s of sampling at ≥ 1 s apart: about 10 signals, never one per step.
    assert 5 <= sent <= 11
    assert tracker.should_signal(force=True)


def test_signals_per_segment_stay_bounded_for_long_jobs() -> None:
    clock = FakeClock()
    tracker = ProgressTracker({"3": 100_000}, nodes_total=3, min_interval_s=1.0, clock=clock)
    sent = 0
    for step in range(1, 100_001):
        clock.now += 1.0
        tracker.on_progress("3", step)
        sent += tracker.should_signal()
    assert sent <= 201


def test_frames_parse_and_binary_previews_are_ignored() -> None:
    frame = json.dumps({"type": "progress", "data": {"value": 3, "max": 9, "prompt_id": "p"}})
    event = parse_frame(frame)
    assert event is not None and event.type == "progress" and event.prompt_id == "p"
    assert parse_frame(b"\x00\x00\x00\x01\x00\x00\x00\x02PNG") is None
    assert parse_frame("not json") is None
    assert parse_frame(json.dumps([1, 2])) is None


def test_only_events_about_a_prompt_are_kept_and_broadcasts_are_not_decoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = {"type": "progress_state", "data": {"prompt_id": "p", "nodes": {"3": {"value": 1}}}}
    status = {"type": "status", "data": {"status": {"exec_info": {"queue_remaining": 3}}}}
    monitor = {"type": "crystools.monitor", "data": {"cpu_utilization": 12}}
    mentions = {"type": "progress", "data": {"prompt_id": "p", "value": 1, "status": "x"}}
    compact = json.dumps(state, separators=(",", ":"))  # not ComfyUI's: decoded, then dropped
    reordered = json.dumps({"data": {}, "type": "status"})
    assert parse_frame(compact) is None and parse_frame(reordered) is None
    decoded: list[str] = []
    loads = json.loads

    def counted_loads(text: str) -> Any:
        decoded.append(text)
        return loads(text)

    monkeypatch.setattr(json, "loads", counted_loads)
    for broadcast in (state, status, monitor):
        assert parse_frame(json.dumps(broadcast)) is None
    assert decoded == []  # known by their first bytes
    event = parse_frame(json.dumps(mentions))
    assert event is not None and event.type == "progress" and event.data["value"] == 1


def test_only_our_prompt_or_unaddressed_events_count() -> None:
    ours = parse_frame(json.dumps({"type": "executing", "data": {"node": "3", "prompt_id": "p"}}))
    theirs = parse_frame(json.dumps({"type": "executing", "data": {"node": "3", "prompt_id": "q"}}))
    bare = parse_frame(json.dumps({"type": "executing", "data": {"node": "3"}}))
    assert ours and theirs and bare
    assert for_prompt(ours, "p") and for_prompt(bare, "p") and not for_prompt(theirs, "p")


def test_every_output_list_with_filenames_is_walked() -> None:
    outputs = {
        "9": {"images": [{"filename": "a.png", "subfolder": "s", "type": "output"}]},
        "12": {"gifs": [{"filename": "b.webp", "subfolder": "", "type": "output"}]},
        "13": {"text": ["hello"]},
    }
    assert [(n, i["filename"]) for n, i in output_files(outputs)] == [
        ("9", "a.png"),
        ("12", "b.webp"),
    ]


def test_gpu_failures_are_classified() -> None:
    oom = {"exception_type": "torch.OutOfMemoryError", "exception_message": "CUDA out of memory."}
    fault = {"exception_message": "CUDA error: an illegal memory access was encountered"}
    assert is_out_of_memory(oom) and not is_fatal_device_error(oom)
    assert is_fatal_device_error(fault) and not is_out_of_memory(fault)


# --- where a follow attempt got to -----------------------------------------------------------

CHECKPOINT = Checkpoint(job_id="job-1", prompt_id="p-1", client_id="c-1", node_steps={"3": 6})
ARTIFACT = Artifact(
    key="jobs/job-1/0/9/a.png",
    uri="s3://out/jobs/job-1/0/9/a.png",
    size=3,
    sha256="a" * 64,
    content_type="image/png",
    node_id="9",
)
CHECKPOINT_JSON = CHECKPOINT.model_dump(mode="json")
ARTIFACT_JSON = ARTIFACT.model_dump(mode="json")
HEARTBEAT = FollowHeartbeat(checkpoint=CHECKPOINT, artifacts=[ARTIFACT])


def test_the_follow_heartbeat_is_one_detail_that_reads_back() -> None:
    details = [HEARTBEAT.model_dump(mode="json")]
    assert FollowHeartbeat.from_details(details) == HEARTBEAT
    failed = after_activity(ApplicationError("socket lost", *details, type="ConnectionLost"))
    assert recovered_progress(failed) == (CHECKPOINT, [ARTIFACT])
    died = after_activity(
        TimeoutError("heartbeat", type=TimeoutType.HEARTBEAT, last_heartbeat_details=details)
    )
    assert recovered_progress(died) == (CHECKPOINT, [ARTIFACT])


GARBAGE: list[list[Any]] = [
    [],
    [None],
    ["text"],
    [42, "x"],
    [{}],
    [{"pool": "comfyui"}],  # a fatal failure's own details
    [{"checkpoint": "not a checkpoint"}],
    [{"checkpoint": CHECKPOINT_JSON, "artifacts": [], "extra": 1}],
    [{"checkpoint": CHECKPOINT_JSON, "artifacts": "not a list"}],
    [HEARTBEAT.model_dump(mode="json"), HEARTBEAT.model_dump(mode="json")],
    [CHECKPOINT_JSON, "not a list"],
    [CHECKPOINT_JSON, None],
    [CHECKPOINT_JSON, [ARTIFACT_JSON]],  # the positional form of unreleased versions
    [CHECKPOINT_JSON],
    [CHECKPOINT_JSON, [{"key": "half an artifact"}]],
]


@pytest.mark.parametrize("details", GARBAGE)
def test_unreadable_details_recover_nothing_and_never_raise(details: list[Any]) -> None:
    assert FollowHeartbeat.from_details(details) is None
    failed = after_activity(ApplicationError("failed", *details, type="ConnectionLost"))
    assert recovered_progress(failed) == (None, [])
    died = after_activity(
        TimeoutError("heartbeat", type=TimeoutType.HEARTBEAT, last_heartbeat_details=details)
    )
    assert recovered_progress(died) == (None, [])


@pytest.mark.parametrize("details", [None, "text", b"bytes", 42, {"checkpoint": CHECKPOINT_JSON}])
def test_details_that_are_no_sequence_recover_nothing(details: Any) -> None:
    assert FollowHeartbeat.from_details(details) is None


def test_failures_without_details_recover_nothing() -> None:
    assert recovered_progress(after_activity(ApplicationError("failed"))) == (None, [])
    assert recovered_progress(after_activity(RuntimeError("no details at all"))) == (None, [])
    assert recovered_progress(ApplicationError("unwrapped", HEARTBEAT.model_dump(mode="json"))) == (
        CHECKPOINT,
        [ARTIFACT],
    )
