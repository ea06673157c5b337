"""PromptFollower and the follow activity, in-process: what a follow uploads, reports, heartbeats,
submits and fails with, word for word.

ComfyUI is scripted frames on a loopback socket and HTTP on a mock; there is no Temporal server
(the rig is tests/activities/follower_rig.py). Besides whole scenarios (a run, a cut socket, a
retry, a queued prompt, a submission), the tests pin the exact messages, counts and timings the
workflow, the RunPod handler and an operator rely on; last, `PromptFollower` itself with the
handler's reconnect policy.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
import pytest_asyncio
import websockets
from structlog.testing import capture_logs
from temporalio.exceptions import ApplicationError

import activities.comfyui.follow as follow_module
import protocol.comfyui.follower as follower_module
from activities.comfyui.backend import ComfyBackend
from activities.comfyui.follow import FollowActivities
from activities.follow_common import process_identity
from activities.orphans import TAG_KEY
from activities.storage import StoredObject
from configuration.pools import PoolConfig
from protocol.comfyui.client import ComfyClient
from protocol.errors import ComfyGone
from protocol.progress import ProgressTracker
from tests.activities.follower_rig import (
    HEARTBEAT_TIMEOUT_S,
    Rig,
    StubHealth,
    no_quiet_start,
    open_rig,
    until,
)
from tests.support.comfy_fakes import (
    CLIENT_ID,
    GRAPH,
    KEY,
    PNG,
    PROMPT_ID,
    Step,
    call,
    cut,
    executed,
    frame,
    image,
    pause,
    request,
    send,
    wait_for,
)
from workflows.activity_io import FollowHeartbeat, FollowResult
from workflows.contracts import Artifact, Checkpoint
from workflows.errors import StorageError
from workflows.shared import ErrorType

# The milestone rules from the first event (tests/activities/follower_rig.py's `no_quiet_start`).
pytestmark = pytest.mark.usefixtures(no_quiet_start.__name__)


@pytest_asyncio.fixture
async def rig() -> AsyncIterator[Rig]:
    async with open_rig() as made:
        yield made


def a_full_run() -> list[Step]:
    """Frames of a prompt that finds nodes 1 and 2 cached, samples (node 3), saves (node 9),
    succeeds and says `executing None`."""
    return [
        send(
            frame("execution_start"),
            frame("execution_cached", nodes=["1", "2"]),
            frame("executing", node="3"),
            frame("progress", node="3", value=4, max=10),
            frame("executing", node="9"),
            executed("9", image("img_00001_.png")),
            frame("execution_success"),
            frame("executing", node=None),
        )
    ]


def a_plain_run() -> list[Step]:
    """The same prompt with nothing cached and no `executing None` after its success."""
    return [
        send(
            frame("execution_start"),
            frame("executing", node="3"),
            frame("progress", node="3", value=4, max=10),
            frame("executing", node="9"),
            executed("9", image("img_00001_.png")),
            frame("execution_success"),
        )
    ]


# --- following a prompt to its end: outputs, checkpoint, result -------------------------------


async def test_events_upload_outputs_and_report_where_the_prompt_got(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [a_full_run()]
    result = await rig.follow(request())
    assert result.outcome == "success" and result.prompt_id == PROMPT_ID
    assert [a.key for a in result.artifacts] == [KEY]
    assert result.artifacts[0].size == len(PNG) and result.artifacts[0].node_id == "9"
    assert rig.store.uploads == [KEY]
    checkpoint = result.checkpoint
    assert checkpoint.nodes_done == ["1", "2", "3", "9"]
    assert checkpoint.step == 10 and checkpoint.total_steps == 10
    assert checkpoint.uploaded == [KEY]
    assert rig.socket.paths == [f"/ws?clientId={CLIENT_ID}"]
    # ComfyUI would deflate every frame, and each followed prompt hold a zlib window here.
    assert rig.socket.offered_extensions == [None], "no permessage-deflate offered"
    assert rig.comfy.posted == [], "re-attaching never submits"
    # Every report names this attempt's socket, so the workflow can drop stale ones.
    assert {r.attempt_client_id for r in rig.signals.reports} == {CLIENT_ID}
    stages = [stage for stage, _ in rig.signals.stages()]
    # The output stored after the prompt ended, and the end itself, are told by the result.
    assert stages[0] == "running" and "finished" not in stages and "uploading" not in stages
    # The progress step seen mid-run (4 of 10) was heartbeated before the node finished.
    assert any(beat.checkpoint.step == 4 for beat in rig.heartbeats())
    assert [a.key for a in rig.heartbeats()[-1].artifacts] == [KEY]


async def test_a_retry_resumes_from_its_heartbeat_and_uploads_nothing_twice(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    earlier = Checkpoint(
        job_id="job-1", prompt_id=PROMPT_ID, client_id=CLIENT_ID, node_steps={"3": 7}
    )
    stored = Artifact(
        key=KEY,
        uri=f"s3://out/{KEY}",
        size=len(PNG),
        sha256="b" * 64,
        node_id="9",
        content_type="image/png",
    )
    rig.socket.scripts = [
        [
            send(
                frame("executing", node="9"),
                executed("9", image("img_00001_.png")),
                frame("execution_success"),
            )
        ]
    ]
    details = [FollowHeartbeat(checkpoint=earlier, artifacts=[stored]).model_dump(mode="json")]
    result = await rig.follow(request(), heartbeat_details=details)
    assert rig.store.uploads == [], "the output the earlier attempt stored is not fetched again"
    assert [a.sha256 for a in result.artifacts] == ["b" * 64]
    assert result.checkpoint.step == 10
    # Before anything happened the first heartbeat already said step 7, not 0.
    assert rig.heartbeats()[0].checkpoint.node_steps == {"3": 7}


async def test_the_prompts_run_is_measured_from_running_to_its_end(rig: Rig) -> None:
    """What the tenant's budget counts on a comfyui pool (`Checkpoint.ran_s`): the time the
    follow saw the prompt running, on its monotonic clock, added to what an earlier attempt
    measured (its heartbeat)."""
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [
        [
            send(frame("execution_start"), frame("executing", node="3")),
            pause(0.3),
            send(
                frame("executing", node="9"),
                executed("9", image("img_00001_.png")),
                frame("execution_success"),
            ),
        ]
    ]
    earlier = Checkpoint(job_id="job-1", prompt_id=PROMPT_ID, client_id=CLIENT_ID, ran_s=5.0)
    details = [FollowHeartbeat(checkpoint=earlier).model_dump(mode="json")]
    result = await rig.follow(request(), heartbeat_details=details)
    assert 5.25 <= result.checkpoint.ran_s <= 7.0, result.checkpoint


async def test_duplicate_executed_frames_upload_the_file_once(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    saved = executed("9", image("img_00001_.png"))
    preview = executed("8", image("preview.png", subfolder="", kind="temp"))
    rig.socket.scripts = [
        [
            send(frame("executing", node="9"), saved, saved, preview),
            wait_for(rig.store.stored),
            send(saved, frame("execution_success")),
        ]
    ]
    result = await rig.follow(request())
    assert rig.store.uploads == [KEY] and rig.comfy.count("GET /view") == 1
    assert [a.key for a in result.artifacts] == [KEY], "previews are not artifacts"


async def test_two_outputs_are_both_uploaded(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [
        [
            send(
                executed("9", image("img_00001_.png")),
                executed("10", image("img_00002_.png")),
                frame("execution_success"),
            )
        ]
    ]
    result = await rig.follow(request())
    assert sorted(rig.store.uploads) == ["jobs/job-1/0/10/img_00002_.png", KEY]
    assert len(result.artifacts) == 2


# --- what the progress signals carry ----------------------------------------------------------


async def test_reports_go_to_the_job_and_name_node_artifact_checkpoint_and_worker(
    rig: Rig,
) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [a_plain_run()]
    await rig.follow(request())
    reports = rig.reports()
    assert set(rig.signals.addressed) == {"job-1"}, "signals go to the job's workflow"
    assert all(r.worker_id == process_identity() for r in reports)
    assert all(r.checkpoint is not None and r.checkpoint.prompt_id == PROMPT_ID for r in reports)
    assert {r.node for r in reports if r.stage == "running"} >= {"3", "9"}
    assert all(r.artifact is None for r in reports if r.stage != "uploading")
    assert any(r.stage == "running" and r.step == 4 for r in reports)
    # The prompt ended before its output was stored: the result tells both, no signal does.
    assert all(r.stage not in ("uploading", "finished") for r in reports)


async def test_an_output_stored_while_the_prompt_runs_is_told_at_once(rig: Rig) -> None:
    """A node's output stored before the prompt ends (an early SaveImage, a preview) is a
    milestone: the workflow hears of it without waiting for the end."""
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [
        [
            send(
                frame("execution_start"),
                frame("executing", node="9"),
                executed("9", image("img_00001_.png")),
                frame("executing", node="3"),
            ),
            pause(0.1),  # the upload finishes while node 3 still runs
            send(frame("execution_success")),
        ]
    ]
    await rig.follow(request())
    (uploading,) = [r for r in rig.reports() if r.stage == "uploading"]
    assert uploading.artifact is not None and uploading.artifact.key == KEY


async def test_a_signal_that_cannot_be_sent_never_fails_the_follow(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.signals.failing = True
    rig.socket.scripts = [a_plain_run()]
    result = await rig.follow(request())
    assert result.outcome == "success" and rig.signals.addressed


async def test_each_step_is_reported_when_the_interval_allows(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    steps = [frame("progress", node="3", value=n, max=10) for n in range(1, 10)]
    rig.socket.scripts = [[send(frame("executing", node="3"), *steps, frame("execution_success"))]]
    await rig.follow(request(progress_interval_s=0.0))
    assert [r.step for r in rig.reports() if r.stage == "running"] == list(range(10))


async def test_steps_are_throttled_by_the_requested_interval(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    steps = [frame("progress", node="3", value=n, max=10) for n in range(1, 10)]
    rig.socket.scripts = [[send(frame("executing", node="3"), *steps, frame("execution_success"))]]
    await rig.follow(request(progress_interval_s=60.0))
    # Only the stage change is forced through; the steps wait for the interval.
    assert [(r.stage, r.step) for r in rig.reports()] == [("running", 0)]


async def test_without_samplers_cached_nodes_are_the_progress(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [
        [
            send(
                frame("execution_start"),
                frame("execution_cached", nodes=["1", "2"]),
                frame("executing", node="9"),
                executed("9", image("img_00001_.png")),
                frame("execution_success"),
            )
        ]
    ]
    result = await rig.follow(request(sampler_steps={}, nodes_total=4))
    assert any(r.stage == "running" and (r.step, r.total_steps) == (2, 4) for r in rig.reports())
    assert (result.checkpoint.step, result.checkpoint.total_steps) == (3, 4)


async def test_a_prompt_found_finished_while_queued_reports_no_place_in_line(rig: Rig) -> None:
    rig.comfy.pending.append(PROMPT_ID)

    def finish_on_second_look(asked: int) -> None:
        if asked == 2:
            rig.comfy.finish(PROMPT_ID, ("9", image("img_00001_.png")))

    rig.comfy.before_look = finish_on_second_look
    await rig.follow(request())
    stages = rig.signals.stages()
    assert stages[0] == ("queued", 1)
    assert ("finished", None) not in stages, "the result tells the end"


# --- heartbeats -------------------------------------------------------------------------------


async def test_heartbeats_are_plain_json_inside_the_timeout_and_dated_now(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [
        [send(frame("executing", node="3"), frame("progress", node="3", value=4, max=10))],
        a_plain_run(),
    ]
    earlier = Checkpoint(
        job_id="job-1", prompt_id=PROMPT_ID, updated_at=datetime(2024, 1, 1, tzinfo=UTC)
    )
    started = time.monotonic()
    began = datetime.now(UTC)
    await rig.follow(
        request(), heartbeat_details=[FollowHeartbeat(checkpoint=earlier).model_dump(mode="json")]
    )
    times = [started] + [at for at, _ in rig.beats]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) < HEARTBEAT_TIMEOUT_S, "a silent socket still heartbeats in time"
    for _, details in rig.beats:
        assert len(details) == 1 and json.loads(json.dumps(details[0])) == details[0]
    beats = rig.heartbeats()
    assert any(b.checkpoint.node_steps == {"3": 4} for b in beats)
    for beat in beats:
        updated = beat.checkpoint.updated_at
        assert updated is not None and updated.tzinfo is not None and updated >= began


async def test_without_a_heartbeat_timeout_the_silence_check_paces_the_polls(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(follow_module, "SILENCE_CHECK_S", 0.1)
    rig.with_heartbeat_timeout(None)
    rig.comfy.pending.append(PROMPT_ID)  # queued: quiet, so never reopened
    rig.socket.scripts = [[pause(0.35), *a_plain_run()]]
    result = await rig.follow(request())
    assert result.outcome == "success" and rig.comfy.looks() >= 3


async def test_a_slow_last_upload_is_heartbeated_while_it_drains(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(follow_module, "SILENCE_CHECK_S", 0.1)
    store = rig.store
    upload = store.upload_stream

    async def slow_upload(key: str, chunks: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.5)
        return await upload(key, chunks, **kwargs)

    monkeypatch.setattr(store, "upload_stream", slow_upload)
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [a_plain_run()]
    result = await rig.follow(request())
    assert [a.key for a in result.artifacts] == [KEY]
    times = [at for at, _ in rig.beats]
    assert max(b - a for a, b in itertools.pairwise(times)) < 0.3


# --- events -----------------------------------------------------------------------------------


async def test_events_of_other_prompts_are_ignored(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    theirs = {"type": "execution_success", "data": {"prompt_id": "other"}}
    rig.socket.scripts = [
        [send(theirs, frame("executing", node="3"), {"type": "status", "data": {}}), *a_full_run()]
    ]
    result = await rig.follow(request())
    assert result.checkpoint.nodes_done == ["1", "2", "3", "9"]


@pytest.mark.parametrize(
    ("event", "starts_running"),
    [
        (frame("execution_start"), True),
        (frame("execution_cached", nodes=[]), True),
        (frame("executing", node="3"), True),
        # A progress bar of a node that is no sampler (an upscaler): no step, yet it runs.
        (frame("progress", node="8", value=1, max=4), True),
        (frame("executing", node=None), False),
    ],
)
async def test_which_events_say_a_queued_prompt_runs(
    rig: Rig, event: dict[str, Any], starts_running: bool
) -> None:
    rig.comfy.pending.append(PROMPT_ID)  # /queue never catches up: only the event can tell

    def running() -> bool:
        return ("running", None) in rig.signals.stages()

    said: list[bool] = []
    rig.socket.scripts = [
        [
            until(lambda: bool(rig.reports())),
            send(event),
            until(running, within_s=0.5 if starts_running else 0.1),
            call(lambda: said.append(running())),
            send(frame("execution_success")),
        ]
    ]
    await rig.follow(request())
    if starts_running:
        assert said == [True], "reported running on the event, not a poll later"
    else:
        assert ("running", None) not in rig.signals.stages()


async def test_the_queue_moving_is_reported_once_per_place_and_silence_counts_from_the_start(
    rig: Rig,
) -> None:
    rig.comfy.running.append("someone-elses")
    rig.comfy.pending.extend(["ahead-of-us", PROMPT_ID])

    def advance() -> None:
        rig.comfy.running.remove("someone-elses")
        rig.comfy.start("ahead-of-us")

    def begin() -> None:
        rig.comfy.running.remove("ahead-of-us")
        rig.comfy.start(PROMPT_ID)

    def running() -> bool:
        return ("running", None) in rig.signals.stages()

    rig.socket.scripts = [
        [pause(0.3), call(advance), pause(0.7), call(begin), until(running), *a_plain_run()]
    ]
    await rig.follow(request())
    stages = rig.signals.stages()
    assert stages[:3] == [("queued", 2), ("queued", 1), ("running", None)]
    # Queued far longer than the silence allowance: the running prompt's socket was not reopened.
    assert rig.socket.connections == 1


async def test_a_prompt_that_ends_with_executing_none_alone_is_done(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)  # and /queue never says otherwise
    rig.socket.scripts = [
        [
            send(
                frame("executing", node="9"),
                executed("9", image("img_00001_.png")),
                frame("executing", node=None),
            )
        ]
    ]
    result = await rig.follow(request())
    assert [a.key for a in result.artifacts] == [KEY]


async def test_frames_missing_their_optional_fields_change_nothing(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    bare_progress = {"type": "progress", "data": {"prompt_id": PROMPT_ID, "node": "3"}}
    rig.socket.scripts = [
        [
            send(
                frame("execution_start"),
                {"type": "execution_cached", "data": {"prompt_id": PROMPT_ID}},
                bare_progress,
                frame("execution_success"),
            )
        ]
    ]
    result = await rig.follow(request())
    assert result.outcome == "success"
    assert [b.checkpoint.step for b in rig.heartbeats()[:-1]] == [0] * (len(rig.beats) - 1)


# --- the socket: lost, silent, reopened -------------------------------------------------------


async def test_a_socket_cut_mid_prompt_is_retryable_and_carries_the_checkpoint(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [
        [
            send(
                frame("execution_start"),
                frame("executing", node="3"),
                frame("progress", node="3", value=6, max=10),
                frame("executing", node="9"),
                executed("9", image("img_00001_.png")),
            ),
            wait_for(rig.store.stored),
            pause(0.05),
            cut,
        ]
    ]
    error = await rig.failure(request())
    assert error.type == ErrorType.CONNECTION_LOST and not error.non_retryable
    (detail,) = error.details  # one detail: the follow heartbeat, as the workflow reads it
    left = FollowHeartbeat.model_validate(detail)
    checkpoint = left.checkpoint
    assert checkpoint.prompt_id == PROMPT_ID and checkpoint.step == 10
    assert checkpoint.nodes_done == ["3", "9"] and checkpoint.uploaded == [KEY]
    assert [a.key for a in left.artifacts] == [KEY]


async def test_a_lost_socket_says_how_it_was_lost(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)

    async def cut(ws: Any) -> None:
        ws.transport.abort()

    rig.socket.scripts = [[send(frame("executing", node="3")), pause(0.05), cut]]
    error = await rig.failure(request())
    assert error.type == ErrorType.CONNECTION_LOST and error.non_retryable is False
    assert error.message.startswith("ComfyUI socket lost: ConnectionClosedError: ")
    (detail,) = error.details
    assert json.loads(json.dumps(detail)) == detail


async def test_a_running_prompt_silent_for_two_polls_gets_its_socket_reopened(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [[send(frame("execution_start"))], a_full_run()]
    result = await rig.follow(request())
    assert rig.socket.connections == 2
    assert rig.socket.paths[0] == rig.socket.paths[1], "the same client_id registers again"
    assert [a.key for a in result.artifacts] == [KEY]


async def test_each_reopened_socket_gets_its_own_silence_allowance(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [[send(frame("execution_start"))], [], a_plain_run()]
    started = time.monotonic()
    result = await rig.follow(request())
    assert result.outcome == "success" and rig.socket.connections == 3
    assert time.monotonic() - started < 4, "reopened after about two silent polls, not later"


async def test_broadcast_frames_do_not_keep_a_deaf_socket_open(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    played_out: list[bool] = []
    # Status frames go to every client, other prompts' events to theirs: neither proves ours live.
    status = {"type": "status", "data": {"status": {"exec_info": {"queue_remaining": 1}}}}
    theirs = frame("progress", prompt_id="someone-elses", node="3", value=1, max=10)
    chatter: list[Step] = [step for _ in range(25) for step in (send(status, theirs), pause(0.08))]
    rig.socket.scripts = [
        [send(frame("execution_start")), *chatter, call(lambda: played_out.append(True))],
        a_plain_run(),
    ]
    result = await rig.follow(request())
    assert result.outcome == "success" and rig.socket.connections == 2
    assert not played_out, "reopened while the chatter went on"


async def test_a_queued_prompt_is_quiet_not_deaf_and_says_its_place(rig: Rig) -> None:
    rig.comfy.running.append("someone-elses")
    rig.comfy.pending.extend(["ahead-of-us", PROMPT_ID])
    rig.socket.scripts = [[pause(0.7), call(lambda: rig.comfy.start(PROMPT_ID)), *a_full_run()]]
    result = await rig.follow(request())
    assert result.outcome == "success"
    assert rig.socket.connections == 1, "a queued prompt owes us no events: no reopening"
    stages = rig.signals.stages()
    assert stages[0] == ("queued", 2)
    assert ("running", None) in stages


async def test_a_frame_over_a_mebibyte_is_read(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    big = frame("executed", node="7", output={"text": ["x" * (1 << 21)]})
    rig.socket.scripts = [[send(big), *a_plain_run()]]
    result = await rig.follow(request())
    assert rig.socket.connections == 1 and "7" in result.checkpoint.nodes_done


async def test_a_worker_shutting_down_ends_the_attempt_with_its_checkpoint(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [
        [
            send(frame("executing", node="3"), frame("progress", node="3", value=6, max=10)),
            until(lambda: bool(rig.beats)),
            call(rig.env.worker_shutdown),
        ]
    ]
    error = await rig.failure(request())
    assert (error.type, error.message) == (ErrorType.CONNECTION_LOST, "worker shutting down")
    assert error.non_retryable is False
    assert FollowHeartbeat.model_validate(error.details[0]).checkpoint.step == 6


# --- ComfyUI's queue, history and jobs API ----------------------------------------------------


async def test_silence_asks_the_queue_and_history_says_it_is_done(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)

    def done_after_first_look(asked: int) -> None:
        if asked == 2:  # the first look is on connect; the second after a silent poll
            rig.comfy.finish(PROMPT_ID, ("9", image("img_00001_.png")))

    rig.comfy.before_look = done_after_first_look
    rig.socket.scripts = [[send(frame("execution_start"))]]
    result = await rig.follow(request())
    assert [a.key for a in result.artifacts] == [KEY]
    assert rig.comfy.count("GET /history/") >= 1
    assert rig.socket.connections == 1


async def test_a_silent_running_prompt_is_reported_running_from_the_queue(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)

    def done_after_first_look(asked: int) -> None:
        if asked == 2:
            rig.comfy.finish(PROMPT_ID)

    rig.comfy.before_look = done_after_first_look
    await rig.follow(request())
    assert rig.signals.stages()[0] == ("running", None)


async def test_comfyui_failing_mid_follow_is_retryable_and_says_what_it_was_doing(
    rig: Rig,
) -> None:
    rig.overrides[("GET", f"/api/jobs/{PROMPT_ID}")] = httpx.Response(503)
    error = await rig.failure(request())
    assert error.type == ErrorType.BACKEND_UNAVAILABLE and error.non_retryable is False
    assert error.message.startswith("following the prompt: ComfyUI unavailable: GET /api/jobs/")
    assert FollowHeartbeat.model_validate(error.details[0]).checkpoint.prompt_id == PROMPT_ID


async def test_a_prompt_nobody_knows_is_lost(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(follower_module, "LOST_RECHECK_S", 0.01)
    error = await rig.failure(request())
    assert error.type == ErrorType.PROMPT_LOST and error.non_retryable
    assert rig.comfy.count("GET /api/jobs/") == 2, "asked twice before calling it lost"
    assert rig.comfy.count("GET /queue") == 0, "the jobs API answers without every graph"


async def test_a_comfyui_without_the_jobs_api_is_asked_through_its_queue(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(follower_module, "LOST_RECHECK_S", 0.01)
    rig.comfy.jobs_api = False
    error = await rig.failure(request())
    assert error.type == ErrorType.PROMPT_LOST
    assert rig.comfy.count("GET /queue") == 2 and rig.comfy.count("GET /history/") == 2
    assert rig.comfy.count("GET /api/jobs/") == 1, "asked once, then known to be missing"


@pytest.mark.parametrize("jobs_api", [True, False])
async def test_a_fresh_submission_reads_no_queue_and_gets_its_place_in_line(
    rig: Rig, jobs_api: bool
) -> None:
    rig.comfy.jobs_api = jobs_api
    rig.comfy.pending += ["earlier-1", "earlier-2"]
    rig.comfy.on_post = "pending"
    rig.socket.scripts = [a_plain_run()]
    await rig.follow(request(graph=GRAPH))
    assert len(rig.comfy.posted) == 1
    assert rig.signals.stages()[0] == ("queued", 3)
    # Before and after the POST: /queue (every queued graph) only on a ComfyUI without the API.
    assert (rig.comfy.count("GET /queue") == 0) is jobs_api


@pytest.mark.parametrize("first_post", [True, False])
async def test_only_a_first_post_goes_without_asking_whether_comfyui_has_the_prompt(
    rig: Rig, first_post: bool
) -> None:
    rig.comfy.on_post = "pending"
    rig.socket.scripts = [a_plain_run()]
    await rig.follow(request(graph=GRAPH, first_post=first_post))
    before_post = rig.comfy.requests[: rig.comfy.requests.index("POST /prompt")]
    looked = [r for r in before_post if r.startswith(("GET /api/jobs/", "GET /queue"))]
    assert bool(looked) is not first_post
    assert len(rig.comfy.posted) == 1


async def test_a_lost_prompt_is_asked_about_twice_a_recheck_apart(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(follower_module, "LOST_RECHECK_S", 0.2)
    asked: list[float] = []
    rig.comfy.before_look = lambda _n: asked.append(time.monotonic())
    error = await rig.failure(request())
    assert len(asked) == 2 and asked[1] - asked[0] >= 0.2
    assert error.message == (
        f"prompt {PROMPT_ID} is neither queued, running nor in history: "
        "ComfyUI lost it (restarted?)"
    )


async def test_a_prompt_only_the_jobs_api_knows_is_not_lost(rig: Rig) -> None:
    rig.comfy.jobs[PROMPT_ID] = "in_progress"
    rig.socket.scripts = [a_full_run()]
    result = await rig.follow(request())
    assert result.outcome == "success"


async def test_a_prompt_the_jobs_api_calls_pending_is_not_lost(rig: Rig) -> None:
    rig.comfy.jobs[PROMPT_ID] = "pending"
    rig.socket.scripts = [a_plain_run()]
    assert (await rig.follow(request())).outcome == "success"


@pytest.mark.parametrize(
    ("entry", "artifacts"),
    [
        ({"outputs": {"9": {"images": [image("img_00001_.png")]}}}, [KEY]),
        ({"status": {"status_str": "success"}}, []),
    ],
)
async def test_a_terse_history_entry_still_finishes_the_prompt(
    rig: Rig, entry: dict[str, Any], artifacts: list[str]
) -> None:
    rig.comfy.history[PROMPT_ID] = entry
    result = await rig.follow(request())
    assert [a.key for a in result.artifacts] == artifacts


# --- failures ---------------------------------------------------------------------------------


async def test_an_output_that_cannot_be_fetched_fails_the_attempt(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.comfy.view_status = 503
    rig.socket.scripts = [[send(executed("9", image("img_00001_.png")))]]
    error = await rig.failure(request())
    assert error.type == ErrorType.BACKEND_UNAVAILABLE and not error.non_retryable
    assert "img_00001_.png" in error.message


async def test_an_output_the_store_refuses_fails_the_job(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.store.fail[KEY] = StorageError("AccessDenied", retryable=False)
    rig.socket.scripts = [a_full_run()]
    error = await rig.failure(request())
    assert error.type == ErrorType.STORAGE_ERROR and error.non_retryable


@pytest.mark.parametrize(
    ("message", "error_type"),
    [
        ("CUDA out of memory. Tried to allocate 2 GiB", ErrorType.OUT_OF_MEMORY),
        ("an illegal memory access was encountered", ErrorType.BACKEND_FAULT),
        ("mat1 and mat2 shapes cannot be multiplied", ErrorType.EXECUTION_ERROR),
    ],
)
async def test_an_execution_error_is_typed_and_fatal(
    rig: Rig, message: str, error_type: str
) -> None:
    rig.comfy.running.append(PROMPT_ID)
    error_frame = frame(
        "execution_error",
        node_id="3",
        node_type="KSampler",
        exception_type="RuntimeError",
        exception_message=message,
    )
    rig.socket.scripts = [[send(frame("executing", node="3"), error_frame)]]
    error = await rig.failure(request())
    assert error.type == error_type and error.non_retryable
    assert "node 3 (KSampler)" in error.message


@pytest.mark.parametrize(
    ("message", "marks_pool"),
    [("an illegal memory access was encountered", True), ("CUDA out of memory", False)],
)
async def test_a_device_fault_marks_the_pool_unhealthy(
    rig: Rig, message: str, marks_pool: bool
) -> None:
    rig.comfy.running.append(PROMPT_ID)
    error_frame = frame(
        "execution_error", node_id="3", node_type="KSampler", exception_message=message
    )
    rig.socket.scripts = [[send(error_frame)]]
    error = await rig.failure(request())
    assert rig.health.reason("comfyui") == (error.message if marks_pool else None)


async def test_an_interrupted_prompt_is_fatal(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [[send(frame("execution_interrupted", node_id="3"))]]
    error = await rig.failure(request())
    assert error.type == ErrorType.INTERRUPTED and error.non_retryable


async def test_an_interrupt_names_the_node(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [[send(frame("execution_interrupted", node_id="3"))]]
    error = await rig.failure(request())
    assert error.message == "prompt interrupted at node 3"


async def test_a_history_entry_with_an_error_fails_the_job(rig: Rig) -> None:
    messages = [["execution_error", {"node_id": "3", "exception_message": "out of memory"}]]
    rig.comfy.history[PROMPT_ID] = {
        "outputs": {},
        "status": {"status_str": "error", "messages": messages},
    }
    error = await rig.failure(request())
    assert error.type == ErrorType.OUT_OF_MEMORY


async def test_a_history_error_without_messages_still_fails_typed(rig: Rig) -> None:
    rig.comfy.history[PROMPT_ID] = {"outputs": {}, "status": {"status_str": "error"}}
    error = await rig.failure(request())
    assert error.type == ErrorType.EXECUTION_ERROR and error.non_retryable


# --- submitting -------------------------------------------------------------------------------


async def test_submission_posts_once_with_our_ids_after_the_socket_is_open(rig: Rig) -> None:
    rig.comfy.on_post = "pending"
    rig.comfy.running.append("someone-elses")
    rig.socket.scripts = [[pause(0.3), call(lambda: rig.comfy.start(PROMPT_ID)), *a_full_run()]]
    result = await rig.follow(request(graph=GRAPH))
    assert len(rig.comfy.posted) == 1
    body = rig.comfy.posted[0]
    assert body["prompt_id"] == PROMPT_ID and body["client_id"] == CLIENT_ID
    assert body["prompt"] == GRAPH and body["extra_data"]
    assert result.checkpoint.submitted_at is not None
    assert rig.signals.stages()[0] == ("queued", 1)
    assert rig.socket.connections == 1


async def test_a_submission_says_its_place_in_line_before_the_first_poll(rig: Rig) -> None:
    rig.with_heartbeat_timeout(3.0)  # polls 1 s apart
    rig.comfy.on_post = "pending"
    rig.comfy.running.append("someone-elses")
    rig.socket.scripts = [[pause(0.3), call(lambda: rig.comfy.start(PROMPT_ID)), *a_plain_run()]]
    await rig.follow(request(graph=GRAPH))
    assert rig.signals.stages()[0] == ("queued", 1)


async def test_a_submission_that_runs_at_once_is_tagged_and_never_reported_queued(
    rig: Rig,
) -> None:
    rig.socket.scripts = [a_plain_run()]
    result = await rig.follow(request(graph=GRAPH, segment=1))
    (body,) = rig.comfy.posted
    tag = body["extra_data"][TAG_KEY]
    assert (tag["job_id"], tag["segment"]) == ("job-1", 1)
    assert all(stage != "queued" for stage, _ in rig.signals.stages())
    submitted = result.checkpoint.submitted_at
    assert submitted is not None and submitted.tzinfo is not None


async def test_a_submission_answer_without_node_errors_is_accepted(rig: Rig) -> None:
    rig.overrides[("POST", "/prompt")] = httpx.Response(200, json={"prompt_id": PROMPT_ID})
    rig.socket.scripts = [a_plain_run()]
    result = await rig.follow(request(graph=GRAPH))
    assert rig.comfy.count("POST /prompt") == 1 and result.outcome == "success"


async def test_the_log_says_who_follows_what_was_submitted_and_what_comfyui_dropped(
    rig: Rig,
) -> None:
    dropped = {"12": {"errors": [{"type": "required_input_missing"}], "class_type": "SaveImage"}}
    answer = {"prompt_id": PROMPT_ID, "number": 7, "node_errors": dropped}
    rig.overrides[("POST", "/prompt")] = httpx.Response(200, json=answer)
    rig.socket.scripts = [a_plain_run()]
    with capture_logs() as logs:
        await rig.follow(request(graph=GRAPH, segment=1))
    ours = [e for e in logs if e.get("prompt_id") == PROMPT_ID and e.get("job_id") == "job-1"]
    assert all(e["segment"] == 1 for e in ours)
    events = {e["event"]: e for e in ours}
    assert (events["follow_start"]["attempt"], events["follow_start"]["resumed_step"]) == (1, 0)
    assert events["outputs_dropped_by_comfyui"]["node_errors"] == dropped
    assert events["outputs_dropped_by_comfyui"]["log_level"] == "warning"
    assert (events["submitted"]["number"], events["submitted"]["dropped_outputs"]) == (7, 1)


async def test_a_prompt_the_queue_holds_is_not_submitted_again(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [a_full_run()]
    result = await rig.follow(request(graph=GRAPH))
    assert rig.comfy.posted == []
    assert result.checkpoint.submitted_at is not None


@pytest.mark.parametrize("known_to", ["history", "jobs"])
async def test_a_prompt_in_history_or_the_jobs_api_is_not_submitted_again(
    rig: Rig, known_to: str
) -> None:
    if known_to == "history":
        rig.comfy.finish(PROMPT_ID, ("9", image("img_00001_.png")))
    else:
        rig.comfy.jobs[PROMPT_ID] = "in_progress"
    rig.socket.scripts = [a_plain_run()]
    result = await rig.follow(request(graph=GRAPH))
    assert rig.comfy.posted == [] and result.checkpoint.submitted_at is not None


async def test_a_submitted_checkpoint_is_never_submitted_again(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [a_full_run()]
    earlier = Checkpoint(job_id="job-1", prompt_id=PROMPT_ID, submitted_at="2024-01-01T00:00:00Z")
    await rig.follow(request(graph=GRAPH, checkpoint=earlier))
    assert rig.comfy.posted == [] and rig.comfy.count("GET /history/") == 0


async def test_the_history_is_read_while_the_last_output_is_still_being_stored(rig: Rig) -> None:
    """`ComfyBackend.follow` confirms the outputs by the prompt's history: the attempt begins
    that read as the prompt ends, not once its last upload is done (a short job waits on it)."""
    rig.socket.scripts = [a_full_run()]
    history_reads_meanwhile: list[int] = []
    store_upload = rig.store.upload_stream

    async def slow_upload(key: str, chunks: AsyncIterable[bytes], **kwargs: Any) -> StoredObject:
        rig.comfy.finish(PROMPT_ID, ("9", image("img_00001_.png")))
        before = rig.comfy.count("GET /history/")
        await asyncio.sleep(0.2)
        history_reads_meanwhile.append(rig.comfy.count("GET /history/") - before)
        return await store_upload(key, chunks, **kwargs)

    rig.store.upload_stream = slow_upload  # type: ignore[method-assign]
    await rig.follow(request(graph=GRAPH), read_history=True)
    assert history_reads_meanwhile == [1]
    assert rig.attempt is not None and rig.attempt.history is not None
    entry = await rig.attempt.history
    assert set(entry["outputs"]) == {"9"}


async def test_a_follow_whose_last_upload_fails_stops_its_history_read(rig: Rig) -> None:
    """Nobody awaits the history read of a follow that failed: it is cancelled, not left to
    poll ComfyUI for its entry (`HISTORY_WAIT_S`) and fail unheard."""
    rig.socket.scripts = [a_full_run()]  # ComfyUI writes no history entry meanwhile

    async def failing_upload(key: str, chunks: AsyncIterable[bytes], **kwargs: Any) -> StoredObject:
        await asyncio.sleep(0.2)  # the prompt has ended and its history read begun
        raise StorageError("AccessDenied", retryable=False)

    rig.store.upload_stream = failing_upload  # type: ignore[method-assign]
    with pytest.raises(ApplicationError):
        await rig.follow(request(graph=GRAPH), read_history=True)
    assert rig.attempt is not None and rig.attempt.history is not None
    await asyncio.sleep(0)
    assert rig.attempt.history.cancelled()


async def test_a_known_prompt_is_logged_as_such_and_a_silent_socket_as_reopened(
    rig: Rig,
) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [[send(frame("execution_start"))], a_plain_run()]
    with capture_logs() as logs:
        await rig.follow(request(graph=GRAPH))
    names = [e["event"] for e in logs if e.get("prompt_id") == PROMPT_ID]
    assert "submit_already_known" in names and "socket_silent_reopening" in names


async def test_an_unhealthy_pool_is_probed_and_nothing_is_submitted(rig: Rig) -> None:
    health = StubHealth(broken="GPU fell off the bus")
    rig.health = health
    error = await rig.failure(request(graph=GRAPH))
    assert error.type == ErrorType.BACKEND_UNAVAILABLE and error.non_retryable is False
    assert error.message == "pool 'comfyui' is unhealthy: GPU fell off the bus"
    assert [(pool, type(client)) for pool, client in health.probed] == [("comfyui", ComfyClient)]
    assert rig.comfy.posted == []


async def test_a_busy_pool_is_not_submitted_to(rig: Rig) -> None:
    rig.health.mark_busy("comfyui", "stuck-prompt", "job-0")
    rig.comfy.running.append("stuck-prompt")
    error = await rig.failure(request(graph=GRAPH))
    assert error.type == ErrorType.BACKEND_UNAVAILABLE and error.non_retryable is False
    assert error.message == (
        "pool 'comfyui' is busy: prompt stuck-prompt of job job-0 is still running on it "
        "after its teardown horizon"
    )
    assert rig.comfy.posted == []


# --- the activity -----------------------------------------------------------------------------


async def test_the_activity_follows_with_the_pools_client_and_health(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [a_plain_run()]
    asked: list[str] = []

    class Pools:
        health = StubHealth()

        def client(self, pool: str, server: str | None = None) -> ComfyClient:
            asked.append(pool)
            return rig.client()

        def health_key(self, pool: str, client: ComfyClient) -> str:
            return pool

    activities = FollowActivities(Pools(), rig.store, rig.budget)  # type: ignore[arg-type]
    result: FollowResult = await rig.env.run(activities.follow_prompt, request(graph=GRAPH))
    assert [a.key for a in result.artifacts] == [KEY] and asked == ["comfyui"]
    assert [pool for pool, _ in Pools.health.probed] == ["comfyui"]


async def test_the_worker_knows_it_follows_the_job_while_the_follow_runs(rig: Rig) -> None:
    # The orphan sweep skips the prompts of the jobs this worker follows (budget.is_following).
    job_id = request().job_id
    seen: list[bool] = []
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [
        [
            call(lambda: seen.append(rig.budget.is_following(job_id))),
            *a_plain_run(),
        ]
    ]
    await rig.follow(request())
    assert seen == [True] and not rig.budget.is_following(job_id)


async def test_the_follow_activity_does_not_ask_s3_again_for_what_it_just_stored(
    rig: Rig,
) -> None:
    # ComfyBackend.follow: the follow stores the output (confirmed by upload_stream), then the
    # offload reconciles with /history in the same activity, without a HEAD of that output.
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [a_plain_run()]
    rig.comfy.finish(PROMPT_ID, ("9", image("img_00001_.png")))

    class Pools:
        health = StubHealth()

        def client(self, pool: str, server: str | None = None) -> ComfyClient:
            return rig.client()

        def health_key(self, pool: str, client: ComfyClient) -> str:
            return pool

        def resolve(self, pool: str) -> str:
            return pool

        def config(self, pool: str) -> PoolConfig:
            return PoolConfig(kind="comfyui", url="http://127.0.0.1:1")

    backend = ComfyBackend(Pools(), rig.store, rig.budget)  # type: ignore[arg-type]
    result: FollowResult = await rig.env.run(backend.follow, request(graph=GRAPH))
    assert [a.key for a in result.artifacts] == [KEY] and rig.store.uploads == [KEY]
    # The follower's own read (the prompt had ended when it looked) and the one that confirms
    # the outputs, begun by the follow and awaited by the offload: not one more.
    assert rig.comfy.count(f"GET /history/{PROMPT_ID}") == 2
    assert rig.store.heads == []


# --- the shared follower with the handler's policy --------------------------------------------
# `PromptFollower` itself, with a recording listener: what endpoint/execution.py relies on.


@dataclass
class RecordingListener:
    """Every listener call, in order; `fail_after` makes `check` raise once that many ran."""

    calls: list[tuple[str, Any]] = field(default_factory=list)

    async def submitted(self) -> None:
        self.calls.append(("submitted", None))

    async def stage(self, stage: str, position: int | None) -> None:
        self.calls.append(("stage", (stage, position)))

    async def node(self, node: str) -> None:
        self.calls.append(("node", node))

    async def moved(self) -> None:
        self.calls.append(("moved", None))

    async def executed(self, node: str, output: dict[str, Any]) -> None:
        self.calls.append(("executed", node))

    async def outputs(self, outputs: dict[str, Any]) -> None:
        self.calls.append(("outputs", sorted(outputs)))

    def beat(self) -> None:
        pass

    def check(self) -> None:
        pass

    def said(self, kind: str) -> list[Any]:
        return [value for name, value in self.calls if name == kind]


def core_follower(
    rig: Rig, listener: RecordingListener, **policy: Any
) -> follower_module.PromptFollower:
    return follower_module.PromptFollower(
        ComfyClient(rig.base_url, rig.http),
        listener,
        prompt_id=PROMPT_ID,
        client_id=CLIENT_ID,
        tracker=ProgressTracker({"3": 10}, 4),
        poll_s=0.2,
        **policy,
    )


async def test_the_handlers_follower_reconnects_a_lost_socket_and_reads_the_end_from_history(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(follower_module, "RECONNECT_DELAY_S", 0.01)
    listener = RecordingListener()
    rig.socket.scripts = [
        [send(frame("executing", node="3")), pause(0.05), cut],
        [
            call(lambda: rig.comfy.finish(PROMPT_ID, ("9", image("img_00001_.png")))),
            send(executed("9", image("img_00001_.png")), frame("execution_success")),
        ],
    ]
    follower = core_follower(rig, listener, graph=GRAPH, reconnect_for_s=30.0)
    end = await asyncio.wait_for(follower.run(), 5)
    assert rig.socket.connections == 2 and len(rig.comfy.posted) == 1, "reconnected, not resent"
    assert end.outcome == "success" and follower.submitted and not follower.attached
    assert listener.said("node") == ["3"] and listener.said("outputs") == [["9"]]


async def test_the_handlers_follower_gives_comfyui_up_once_silent_past_its_allowance(
    rig: Rig,
) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [[send(frame("executing", node="3")), pause(0.05), cut]]
    follower = core_follower(rig, RecordingListener(), graph=GRAPH, reconnect_for_s=0.0)
    with pytest.raises(ComfyGone, match="ComfyUI unreachable"):
        await asyncio.wait_for(follower.run(), 5)


async def test_without_a_reconnect_allowance_a_lost_socket_is_raised_as_it_came(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [[send(frame("executing", node="3")), pause(0.05), cut]]
    follower = core_follower(rig, RecordingListener(), submitted=True)
    with pytest.raises(websockets.exceptions.ConnectionClosedError):
        await asyncio.wait_for(follower.follow(), 5)
    assert rig.comfy.posted == [], "nothing submitted without a graph"


async def test_an_execution_error_ends_the_follow_with_its_data_and_the_history_says_where(
    rig: Rig,
) -> None:
    rig.comfy.running.append(PROMPT_ID)
    error = {"node_id": "3", "node_type": "KSampler", "exception_type": "RuntimeError"}
    messages = [["execution_error", error | {"exception_message": "boom"}]]

    def fail() -> None:
        rig.comfy.running.remove(PROMPT_ID)
        rig.comfy.history[PROMPT_ID] = {
            "outputs": {},
            "status": {"status_str": "error", "messages": messages},
        }

    rig.socket.scripts = [[pause(0.1), send(frame("execution_error", **error)), call(fail)]]
    follower = core_follower(rig, RecordingListener(), submitted=True)
    assert (
        await asyncio.wait_for(follower.follow(), 5) == "error"
        and follower.end_data["node_id"] == "3"
    )
    end = await follower.ending()
    assert (end.outcome, end.node, end.message) == ("error", "3", "RuntimeError: boom")


async def test_a_prompt_found_in_the_queue_is_attached_to_not_posted(rig: Rig) -> None:
    rig.comfy.pending.append(PROMPT_ID)
    listener = RecordingListener()
    rig.socket.scripts = [
        [
            until(lambda: bool(listener.said("stage"))),
            call(lambda: rig.comfy.finish(PROMPT_ID)),
            send(frame("execution_success")),
        ]
    ]
    follower = core_follower(rig, listener, graph=GRAPH)
    assert await asyncio.wait_for(follower.follow(), 5) == "success"
    assert rig.comfy.posted == [] and follower.attached and follower.maybe_queued
    assert listener.calls[:2] == [("submitted", None), ("stage", ("queued", 1))]
