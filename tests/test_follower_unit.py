"""PromptFollower in-process: scripted ComfyUI frames on a loopback socket, HTTP on a mock.

No Temporal server: `ActivityEnvironment` gives the follower its activity context, captures its
heartbeats, and a recorder stands in for the client its progress signals go to. Timings are
shrunk through the heartbeat timeout (the follower polls at a third of it).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
import pytest_asyncio
import websockets
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

import activities.comfyui.follower as follower_module
from activities.comfyui.client import ComfyClient
from activities.comfyui.follow import FollowAttempt
from activities.comfyui.pools import PoolHealth
from activities.progress import ProgressTracker
from activities.storage_errors import StorageError
from tests.comfy_unit_fakes import (
    CLIENT_ID,
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
    cut,
    executed,
    frame,
    image,
    pause,
    request,
    send,
    wait_for,
)
from workflows.activity_io import FollowHeartbeat, FollowInput, FollowResult
from workflows.contracts import Artifact, Checkpoint
from workflows.shared import ErrorType


def a_full_run() -> list[Step]:
    """Frames of a prompt that samples (node 3), saves (node 9) and finishes."""
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


@dataclass
class Rig:
    comfy: FakeComfy
    socket: ScriptedSocket
    store: FakeStore = field(default_factory=FakeStore)
    signals: SignalRecorder = field(default_factory=SignalRecorder)
    beats: list[tuple[Any, ...]] = field(default_factory=list)
    base_url: str = ""
    http: Any = None

    def env(self, heartbeat_details: list[Any] | None = None) -> ActivityEnvironment:
        env = ActivityEnvironment(client=self.signals.as_client())
        env.info = dataclasses.replace(
            env.info,
            heartbeat_timeout=timedelta(seconds=0.6),
            heartbeat_details=heartbeat_details or [],
        )
        env.on_heartbeat = lambda *details: self.beats.append(details)
        return env

    async def follow(
        self, req: FollowInput, heartbeat_details: list[Any] | None = None
    ) -> FollowResult:
        client = ComfyClient(self.base_url, self.http)

        async def follow_prompt(req: FollowInput) -> FollowResult:
            return await FollowAttempt(req, client, self.store, PoolHealth()).run()

        result: FollowResult = await self.env(heartbeat_details).run(follow_prompt, req)
        return result

    async def failure(self, req: FollowInput) -> ApplicationError:
        with pytest.raises(ApplicationError) as caught:
            await self.follow(req)
        return caught.value

    def heartbeats(self) -> list[FollowHeartbeat]:
        """Every heartbeat, each one detail: a `FollowHeartbeat`'s JSON."""
        assert all(len(beat) == 1 for beat in self.beats), "one detail per heartbeat"
        return [FollowHeartbeat.model_validate(beat[0]) for beat in self.beats]


@pytest_asyncio.fixture
async def rig() -> AsyncIterator[Rig]:
    comfy = FakeComfy(files={"img_00001_.png": PNG})
    socket = ScriptedSocket()
    async with comfy_on_loopback(comfy, socket) as (base_url, http):
        yield Rig(comfy, socket, base_url=base_url, http=http)


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
    assert rig.comfy.posted == [], "re-attaching never submits"
    # Every report names this attempt's socket, so the workflow can drop stale ones.
    assert {r.attempt_client_id for r in rig.signals.reports} == {CLIENT_ID}
    stages = [stage for stage, _ in rig.signals.stages()]
    # The output stored after the prompt ended, and the end itself, are told by the result.
    assert stages[0] == "running" and "finished" not in stages and "uploading" not in stages
    # The progress step seen mid-run (4 of 10) was heartbeated before the node finished.
    assert any(beat.checkpoint.step == 4 for beat in rig.heartbeats())
    assert [a.key for a in rig.heartbeats()[-1].artifacts] == [KEY]


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


async def test_silence_asks_the_queue_and_history_says_it_is_done(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)

    def done_after_first_look(asked: int) -> None:
        if asked == 2:  # the first look is on connect; the second after a silent poll
            rig.comfy.finish(PROMPT_ID, ("9", image("img_00001_.png")))

    rig.comfy.before_queue = done_after_first_look
    rig.socket.scripts = [[send(frame("execution_start"))]]
    result = await rig.follow(request())
    assert [a.key for a in result.artifacts] == [KEY]
    assert rig.comfy.count("GET /history/") >= 1
    assert rig.socket.connections == 1


async def test_a_running_prompt_silent_for_two_polls_gets_its_socket_reopened(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [[send(frame("execution_start"))], a_full_run()]
    result = await rig.follow(request())
    assert rig.socket.connections == 2
    assert rig.socket.paths[0] == rig.socket.paths[1], "the same client_id registers again"
    assert [a.key for a in result.artifacts] == [KEY]


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


async def test_a_prompt_nobody_knows_is_lost(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(follower_module, "LOST_RECHECK_S", 0.01)
    error = await rig.failure(request())
    assert error.type == ErrorType.PROMPT_LOST and error.non_retryable
    assert rig.comfy.count("GET /queue") == 2, "asked twice before calling it lost"
    assert rig.comfy.count("GET /api/jobs/") == 2


async def test_a_prompt_only_the_jobs_api_knows_is_not_lost(rig: Rig) -> None:
    rig.comfy.jobs[PROMPT_ID] = "in_progress"
    rig.socket.scripts = [a_full_run()]
    result = await rig.follow(request())
    assert result.outcome == "success"


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


async def test_submission_skips_the_post_when_the_backend_already_has_it(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [a_full_run()]
    result = await rig.follow(request(graph=GRAPH))
    assert rig.comfy.posted == []
    assert result.checkpoint.submitted_at is not None


async def test_a_submitted_checkpoint_is_never_submitted_again(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [a_full_run()]
    earlier = Checkpoint(job_id="job-1", prompt_id=PROMPT_ID, submitted_at="2024-01-01T00:00:00Z")
    await rig.follow(request(graph=GRAPH, checkpoint=earlier))
    assert rig.comfy.posted == [] and rig.comfy.count("GET /history/") == 0


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


async def test_an_interrupted_prompt_is_fatal(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    rig.socket.scripts = [[send(frame("execution_interrupted", node_id="3"))]]
    error = await rig.failure(request())
    assert error.type == ErrorType.INTERRUPTED and error.non_retryable


async def test_a_history_entry_with_an_error_fails_the_job(rig: Rig) -> None:
    messages = [["execution_error", {"node_id": "3", "exception_message": "out of memory"}]]
    rig.comfy.history[PROMPT_ID] = {
        "outputs": {},
        "status": {"status_str": "error", "messages": messages},
    }
    error = await rig.failure(request())
    assert error.type == ErrorType.OUT_OF_MEMORY


async def test_events_of_other_prompts_are_ignored(rig: Rig) -> None:
    rig.comfy.running.append(PROMPT_ID)
    theirs = {"type": "execution_success", "data": {"prompt_id": "other"}}
    rig.socket.scripts = [
        [send(theirs, frame("executing", node="3"), {"type": "status", "data": {}}), *a_full_run()]
    ]
    result = await rig.follow(request())
    assert result.checkpoint.nodes_done == ["1", "2", "3", "9"]


# --- the shared follower with the handler's policy -------------------------------------------
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
    with pytest.raises(follower_module.ComfyGone, match="ComfyUI unreachable"):
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
            until_called(listener, "stage"),
            call(lambda: rig.comfy.finish(PROMPT_ID)),
            send(frame("execution_success")),
        ]
    ]
    follower = core_follower(rig, listener, graph=GRAPH)
    assert await asyncio.wait_for(follower.follow(), 5) == "success"
    assert rig.comfy.posted == [] and follower.attached and follower.maybe_queued
    assert listener.calls[:2] == [("submitted", None), ("stage", ("queued", 1))]


def until_called(listener: RecordingListener, kind: str) -> Step:
    async def step(_ws: Any) -> None:
        for _ in range(100):
            if listener.said(kind):
                return
            await asyncio.sleep(0.01)

    return step
