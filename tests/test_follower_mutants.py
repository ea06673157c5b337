"""PromptFollower: what a report, a heartbeat, a submission and a failure carry, word for word.

Written against mutmut's survivors on `activities/comfyui/follow.py` (README, "`make mutate`"):
each test pins something the workflow or an operator relies on and that the scenario tests in
test_follower_unit.py let drift. Same rig: scripted frames on a loopback socket, HTTP on a mock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import pytest_asyncio
from structlog.testing import capture_logs
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

import activities.comfyui.follow as follow_module
import activities.comfyui.follower as follower_module
from activities.comfyui.client import ComfyClient
from activities.comfyui.follow import FollowActivities, FollowAttempt
from activities.comfyui.pools import PoolHealth
from activities.follow_common import process_identity
from activities.orphans import TAG_KEY
from tests.comfy_unit_fakes import (
    GRAPH,
    KEY,
    PNG,
    PROMPT_ID,
    FakeComfy,
    FakeStore,
    ScriptedSocket,
    SignalRecorder,
    Step,
    call,
    comfy_on_loopback,
    executed,
    frame,
    image,
    pause,
    request,
    send,
)
from workflows.activity_io import FollowHeartbeat, FollowInput, FollowResult
from workflows.contracts import Checkpoint, ProgressReport
from workflows.shared import ErrorType

HEARTBEAT_TIMEOUT_S = 0.6


def a_full_run() -> list[Step]:
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


class AddressedRecorder(SignalRecorder):
    """Also keeps the workflow each report was addressed to; `failing` makes every send fail."""

    def __init__(self) -> None:
        super().__init__()
        self.addressed: list[str] = []
        self.failing = False

    def get_workflow_handle(self, workflow_id: str) -> Any:
        self.addressed.append(workflow_id)
        handle = super().get_workflow_handle(workflow_id)
        if self.failing:

            class Refusing:
                async def signal(self, name: str, arg: Any) -> None:
                    raise RuntimeError("workflow not found")

            return Refusing()
        return handle


class StubHealth(PoolHealth):
    """A pool the health probe finds broken (`broken` set), recording what it was asked."""

    def __init__(self, broken: str | None = None) -> None:
        super().__init__()
        self.broken = broken
        self.probed: list[tuple[str, Any]] = []

    async def probe(self, pool: str, client: ComfyClient) -> str | None:
        self.probed.append((pool, client))
        return self.broken


@dataclass
class Rig:
    comfy: FakeComfy
    socket: ScriptedSocket
    base_url: str
    http: httpx.AsyncClient
    store: FakeStore = field(default_factory=FakeStore)
    signals: AddressedRecorder = field(default_factory=AddressedRecorder)
    health: PoolHealth = field(default_factory=PoolHealth)
    beats: list[tuple[float, tuple[Any, ...]]] = field(default_factory=list)
    # HTTP answers that replace the fake's: (method, path) -> response.
    overrides: dict[tuple[str, str], httpx.Response] = field(default_factory=dict)
    env: ActivityEnvironment = field(init=False)

    def __post_init__(self) -> None:
        self.env = self.make_env(HEARTBEAT_TIMEOUT_S)

    def make_env(self, heartbeat_timeout_s: float | None) -> ActivityEnvironment:
        env = ActivityEnvironment(client=self.signals.as_client())
        timeout = timedelta(seconds=heartbeat_timeout_s) if heartbeat_timeout_s else None
        env.info = dataclasses.replace(env.info, heartbeat_timeout=timeout)
        env.on_heartbeat = lambda *details: self.beats.append((time.monotonic(), details))
        return env

    def with_heartbeat_timeout(self, seconds: float | None) -> None:
        self.env = self.make_env(seconds)

    def client(self) -> ComfyClient:
        return ComfyClient(self.base_url, self.http)

    async def follow(self, req: FollowInput, details: list[Any] | None = None) -> FollowResult:
        client = self.client()
        self.env.info = dataclasses.replace(self.env.info, heartbeat_details=details or [])

        async def follow_prompt(req: FollowInput) -> FollowResult:
            return await FollowAttempt(req, client, self.store, self.health).run()

        async with asyncio.timeout(8):  # a follower that never ends fails here, not by hanging
            result: FollowResult = await self.env.run(follow_prompt, req)
        return result

    async def failure(self, req: FollowInput) -> ApplicationError:
        with pytest.raises(ApplicationError) as caught:
            await self.follow(req)
        return caught.value

    def heartbeats(self) -> list[FollowHeartbeat]:
        return [FollowHeartbeat.model_validate(details[0]) for _, details in self.beats]

    def reports(self) -> list[ProgressReport]:
        return self.signals.reports


@pytest_asyncio.fixture
async def rig() -> AsyncIterator[Rig]:
    comfy = FakeComfy(files={"img_00001_.png": PNG, "img_00002_.png": PNG + b"2"})
    socket = ScriptedSocket()
    overrides: dict[tuple[str, str], httpx.Response] = {}

    async def handle(request: httpx.Request) -> httpx.Response:
        answer = overrides.get((request.method, request.url.path))
        if answer is not None:
            comfy.requests.append(f"{request.method} {request.url.path}")
            return answer
        return await comfy.handle(request)

    async with comfy_on_loopback(comfy, socket) as (base_url, _http):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as http:
            yield Rig(comfy, socket, base_url, http, overrides=overrides)


def until(condition: Callable[[], bool], within_s: float = 1.0) -> Step:
    """A script step that waits (at most `within_s`) for the follower to have done something."""

    async def step(_ws: Any) -> None:
        deadline = time.monotonic() + within_s
        # The follower's records set no event to wait on: poll them.
        while not condition() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)

    return step


# --- what the progress signals carry ---------------------------------------------------------


async def test_reports_go_to_the_job_and_name_node_artifact_checkpoint_and_worker(
    rig: Rig,
) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [a_full_run()]
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
    rig.socket.scripts = [a_full_run()]
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

    rig.comfy.before_queue = finish_on_second_look
    await rig.follow(request())
    stages = rig.signals.stages()
    assert stages[0] == ("queued", 1)
    assert ("finished", None) not in stages, "the result tells the end"


# --- heartbeats -------------------------------------------------------------------------------


async def test_heartbeats_are_plain_json_inside_the_timeout_and_dated_now(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [
        [send(frame("executing", node="3"), frame("progress", node="3", value=4, max=10))],
        a_full_run(),
    ]
    earlier = Checkpoint(
        job_id="job-1", prompt_id=PROMPT_ID, updated_at=datetime(2024, 1, 1, tzinfo=UTC)
    )
    started = time.monotonic()
    began = datetime.now(UTC)
    await rig.follow(
        request(), details=[FollowHeartbeat(checkpoint=earlier).model_dump(mode="json")]
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
    rig.socket.scripts = [[pause(0.35), *a_full_run()]]
    result = await rig.follow(request())
    assert result.outcome == "success" and rig.comfy.count("GET /queue") >= 3


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
    rig.socket.scripts = [a_full_run()]
    result = await rig.follow(request())
    assert [a.key for a in result.artifacts] == [KEY]
    times = [at for at, _ in rig.beats]
    assert max(b - a for a, b in itertools.pairwise(times)) < 0.3


# --- the socket -------------------------------------------------------------------------------


async def test_each_reopened_socket_gets_its_own_silence_allowance(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [[send(frame("execution_start"))], [], a_full_run()]
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
        a_full_run(),
    ]
    result = await rig.follow(request())
    assert result.outcome == "success" and rig.socket.connections == 2
    assert not played_out, "reopened while the chatter went on"


async def test_a_frame_over_a_mebibyte_is_read(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    big = frame("executed", node="7", output={"text": ["x" * (1 << 21)]})
    rig.socket.scripts = [[send(big), *a_full_run()]]
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


# --- ComfyUI's HTTP answers -------------------------------------------------------------------


async def test_comfyui_failing_mid_follow_is_retryable_and_says_what_it_was_doing(
    rig: Rig,
) -> None:
    rig.overrides[("GET", "/queue")] = httpx.Response(503)
    error = await rig.failure(request())
    assert error.type == ErrorType.BACKEND_UNAVAILABLE and error.non_retryable is False
    assert error.message.startswith("following the prompt: ComfyUI unavailable: GET /queue")
    assert FollowHeartbeat.model_validate(error.details[0]).checkpoint.prompt_id == PROMPT_ID


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


async def test_an_interrupt_names_the_node(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [[send(frame("execution_interrupted", node_id="3"))]]
    error = await rig.failure(request())
    assert error.message == "prompt interrupted at node 3"


async def test_a_lost_prompt_is_asked_about_twice_a_recheck_apart(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(follower_module, "LOST_RECHECK_S", 0.2)
    asked: list[float] = []
    rig.comfy.before_queue = lambda _n: asked.append(time.monotonic())
    error = await rig.failure(request())
    assert len(asked) == 2 and asked[1] - asked[0] >= 0.2
    assert error.message == (
        f"prompt {PROMPT_ID} is neither queued, running nor in history: "
        "ComfyUI lost it (restarted?)"
    )


async def test_a_prompt_the_jobs_api_calls_pending_is_not_lost(rig: Rig) -> None:
    rig.comfy.jobs[PROMPT_ID] = "pending"
    rig.socket.scripts = [a_full_run()]
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


async def test_a_history_error_without_messages_still_fails_typed(rig: Rig) -> None:
    rig.comfy.history[PROMPT_ID] = {"outputs": {}, "status": {"status_str": "error"}}
    error = await rig.failure(request())
    assert error.type == ErrorType.EXECUTION_ERROR and error.non_retryable


async def test_a_silent_running_prompt_is_reported_running_from_the_queue(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)

    def done_after_first_look(asked: int) -> None:
        if asked == 2:
            rig.comfy.finish(PROMPT_ID)

    rig.comfy.before_queue = done_after_first_look
    await rig.follow(request())
    assert rig.signals.stages()[0] == ("running", None)


# --- events -----------------------------------------------------------------------------------


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
        [pause(0.3), call(advance), pause(0.7), call(begin), until(running), *a_full_run()]
    ]
    await rig.follow(request())
    stages = rig.signals.stages()
    assert stages[:3] == [("queued", 2), ("queued", 1), ("running", None)]
    # Queued far longer than the silence allowance: the running prompt's socket was not reopened.
    assert rig.socket.connections == 1


# --- submitting -------------------------------------------------------------------------------


async def test_a_submission_says_its_place_in_line_before_the_first_poll(rig: Rig) -> None:
    rig.with_heartbeat_timeout(3.0)  # polls 1 s apart
    rig.comfy.on_post = "pending"
    rig.comfy.running.append("someone-elses")
    rig.socket.scripts = [[pause(0.3), call(lambda: rig.comfy.start(PROMPT_ID)), *a_full_run()]]
    await rig.follow(request(graph=GRAPH))
    assert rig.signals.stages()[0] == ("queued", 1)


async def test_a_submission_that_runs_at_once_is_tagged_and_never_reported_queued(
    rig: Rig,
) -> None:
    rig.socket.scripts = [a_full_run()]
    result = await rig.follow(request(graph=GRAPH, segment=1))
    (body,) = rig.comfy.posted
    tag = body["extra_data"][TAG_KEY]
    assert (tag["job_id"], tag["segment"]) == ("job-1", 1)
    assert all(stage != "queued" for stage, _ in rig.signals.stages())
    submitted = result.checkpoint.submitted_at
    assert submitted is not None and submitted.tzinfo is not None


async def test_a_submission_answer_without_node_errors_is_accepted(rig: Rig) -> None:
    rig.overrides[("POST", "/prompt")] = httpx.Response(200, json={"prompt_id": PROMPT_ID})
    rig.socket.scripts = [a_full_run()]
    result = await rig.follow(request(graph=GRAPH))
    assert rig.comfy.count("POST /prompt") == 1 and result.outcome == "success"


async def test_the_log_says_who_follows_what_was_submitted_and_what_comfyui_dropped(
    rig: Rig,
) -> None:
    dropped = {"12": {"errors": [{"type": "required_input_missing"}], "class_type": "SaveImage"}}
    answer = {"prompt_id": PROMPT_ID, "number": 7, "node_errors": dropped}
    rig.overrides[("POST", "/prompt")] = httpx.Response(200, json=answer)
    rig.socket.scripts = [a_full_run()]
    with capture_logs() as logs:
        await rig.follow(request(graph=GRAPH, segment=1))
    ours = [e for e in logs if e.get("prompt_id") == PROMPT_ID and e.get("job_id") == "job-1"]
    assert all(e["segment"] == 1 for e in ours)
    events = {e["event"]: e for e in ours}
    assert (events["follow_start"]["attempt"], events["follow_start"]["resumed_step"]) == (1, 0)
    assert events["outputs_dropped_by_comfyui"]["node_errors"] == dropped
    assert events["outputs_dropped_by_comfyui"]["log_level"] == "warning"
    assert (events["submitted"]["number"], events["submitted"]["dropped_outputs"]) == (7, 1)


async def test_a_known_prompt_is_logged_as_such_and_a_silent_socket_as_reopened(
    rig: Rig,
) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [[send(frame("execution_start"))], a_full_run()]
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


@pytest.mark.parametrize("known_to", ["history", "jobs"])
async def test_a_prompt_the_backend_knows_is_not_submitted_again(rig: Rig, known_to: str) -> None:
    if known_to == "history":
        rig.comfy.finish(PROMPT_ID, ("9", image("img_00001_.png")))
    else:
        rig.comfy.jobs[PROMPT_ID] = "in_progress"
    rig.socket.scripts = [a_full_run()]
    result = await rig.follow(request(graph=GRAPH))
    assert rig.comfy.posted == [] and result.checkpoint.submitted_at is not None


# --- the activity -----------------------------------------------------------------------------


async def test_the_activity_follows_with_the_pools_client_and_health(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [a_full_run()]
    asked: list[str] = []

    class Pools:
        health = StubHealth()

        def client(self, pool: str) -> ComfyClient:
            asked.append(pool)
            return rig.client()

    activities = FollowActivities(Pools(), rig.store)  # type: ignore[arg-type]
    result: FollowResult = await rig.env.run(activities.follow_prompt, request(graph=GRAPH))
    assert [a.key for a in result.artifacts] == [KEY] and asked == ["comfyui"]
    assert [pool for pool, _ in Pools.health.probed] == ["comfyui"]
