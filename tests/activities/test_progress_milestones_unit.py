"""When a follow attempt signals the workflow (`Milestones`), and that both followers heartbeat
every step while they signal only on milestones. No server: a fake clock for the rule, the
followers' in-process rigs (scripted ComfyUI socket, scripted RunPod) for the rest."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import ValidationError
from temporalio.testing import ActivityEnvironment

from activities.follow_common import Milestones, tenth
from configuration.settings import WorkerSettings
from tests.activities.follower_rig import Rig, no_quiet_start
from tests.activities.test_runpod_backend_unit import (
    OUR_KEY,
    RUNPOD_JOB,
    MemoryStore,
    ScriptedRunPod,
    backend,
    completed,
    follow_input,
    progress,
    record,
)
from tests.activities.test_runpod_backend_unit import PNG as RUNPOD_PNG
from tests.support.comfy_fakes import (
    PNG,
    PROMPT_ID,
    FakeComfy,
    ScriptedSocket,
    SignalRecorder,
    comfy_on_loopback,
    executed,
    frame,
    image,
    request,
    send,
)
from workflows.activity_io import FollowHeartbeat

# The milestone rules from the first event (tests/activities/follower_rig.py's `no_quiet_start`).
pytestmark = pytest.mark.usefixtures(no_quiet_start.__name__)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_tenths_of_the_steps() -> None:
    assert [tenth(step, 5000) for step in (0, 499, 500, 2499, 2500, 4999, 5000)] == [
        0,
        0,
        1,
        4,
        5,
        9,
        10,
    ]
    assert tenth(7, 0) == 0, "no total yet: no tenth"
    assert tenth(12, 10) == 10 and tenth(-1, 10) == 0


def test_the_first_report_each_tenth_and_the_stage_changes_are_milestones() -> None:
    clock = Clock()
    told = Milestones(2.0, clock=clock)
    assert told.due("queued", 0, 100), "the first report"
    assert not told.due("queued", 0, 100), "nothing new"
    assert told.due("running", 0, 100), "a stage change, however soon"
    steps_told = []
    for step in range(1, 101):
        clock.now += 1.0  # 1 s a step: tenths 10 s apart, well past the interval
        if told.due("running", step, 100):
            steps_told.append(step)
    assert steps_told == [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    assert told.due("running", 100, 100, force=True), "an artifact, the end: forced"
    assert told.due("finished", 100, 100)


def test_a_tenth_is_told_no_sooner_than_the_interval_and_never_dropped() -> None:
    clock = Clock()
    told = Milestones(2.0, clock=clock)
    assert told.due("running", 0, 10)
    clock.now = 0.5
    assert not told.due("running", 3, 10), "three tenths in 0.5 s: held back"
    clock.now = 2.0
    assert told.due("running", 3, 10), "held back, then told at the next report"
    assert not told.due("running", 3, 10)
    clock.now = 10.0
    assert not told.due("running", 3, 10), "time alone is no milestone"


def test_news_waits_for_the_interval_like_a_tenth() -> None:
    clock = Clock()
    told = Milestones(2.0, clock=clock)
    assert told.due("queued", 0, 10)
    clock.now = 1.0
    assert not told.due("queued", 0, 10, news=True)
    clock.now = 2.5
    assert told.due("queued", 0, 10, news=True)


def test_a_long_job_sends_a_dozen_signals_not_one_per_interval() -> None:
    clock = Clock()
    told = Milestones(2.0, clock=clock)
    sent = told.due("queued", 0, 5000) + told.due("running", 0, 5000)
    for step in range(1, 5001):
        clock.now += 0.02
        sent += told.due("running", step, 5000)
    sent += told.due("running", 5000, 5000, force=True)  # the artifact
    sent += told.due("finished", 5000, 5000, force=True)
    # 100 s of sampling: 2 + 10 tenths + 2, where a 2 s throttle sent about 50.
    assert sent == 14 and told.sent == 14


async def test_the_comfyui_follower_heartbeats_every_step_and_signals_milestones() -> None:
    comfy = FakeComfy(files={"img_00001_.png": PNG})
    socket = ScriptedSocket()
    steps = [frame("progress", node="3", value=step, max=100) for step in range(1, 101)]
    socket.scripts = [
        [
            send(frame("execution_start"), frame("executing", node="3"), *steps),
            send(
                frame("executing", node="9"),
                executed("9", image("img_00001_.png")),
                frame("execution_success"),
                frame("executing", node=None),
            ),
        ]
    ]
    comfy.running.append(PROMPT_ID)
    async with comfy_on_loopback(comfy, socket) as (base_url, http):
        rig = Rig(comfy, socket, base_url=base_url, http=http)
        result = await rig.follow(request(sampler_steps={"3": 100}))
    assert result.checkpoint.step == 100
    beaten = {beat.checkpoint.step for beat in rig.heartbeats()}
    assert set(range(1, 101)) <= beaten, "every step is heartbeated"
    told = [(r.stage, r.step) for r in rig.signals.reports]
    # The first report (running) and each tenth (progress_interval_s is 0 here): never one per
    # step or per node. The artifact stored after the prompt ended, and the end itself, are
    # told by the result, not by signals.
    assert told[0] == ("running", 0)
    assert [step for stage, step in told if stage == "running"][1:] == list(range(10, 101, 10))
    assert len(told) == 11
    assert [a.node_id for a in result.artifacts] == ["9"]


@pytest.mark.parametrize("queued_polls", [1, 3])
async def test_the_runpod_follower_heartbeats_every_poll_and_signals_milestones(
    queued_polls: int,
) -> None:
    store = MemoryStore()
    store.put(OUR_KEY, RUNPOD_PNG)
    statuses: list[dict[str, Any]] = [{"id": RUNPOD_JOB, "status": "IN_QUEUE"}] * queued_polls
    statuses += [
        {
            "id": RUNPOD_JOB,
            "status": "IN_PROGRESS",
            "output": progress(step, step, total=50, node="3"),
        }
        for step in range(1, 51)
    ]
    statuses.append(completed([record(OUR_KEY)]))
    runpod = ScriptedRunPod(statuses=statuses)
    signals = SignalRecorder()
    beats: list[Any] = []
    environment = ActivityEnvironment(client=signals.as_client())
    environment.on_heartbeat = lambda *d: beats.append(d[0])
    environment.info = dataclasses.replace(environment.info, heartbeat_details=[])
    result = await environment.run(backend(runpod, store).follow, follow_input())
    assert result.checkpoint.step == 50
    beaten = {FollowHeartbeat.model_validate(beat).checkpoint.step for beat in beats}
    assert set(range(1, 51)) <= beaten, "every poll's step is heartbeated"
    told = [(r.stage, r.step) for r in signals.reports]
    assert told[0] == ("queued", 0), "the first report; more queued polls tell nothing new"
    assert told[1] == ("running", 1), "queued -> running"
    assert [step for stage, step in told[2:] if stage == "running"] == list(range(5, 51, 5))
    assert told[-1] == ("running", 50), "the end is told by the result"
    assert len(told) == 12


def test_the_heartbeat_throttle_is_a_worker_setting() -> None:
    # Without it the SDK holds heartbeats for 0.8 x the heartbeat timeout (16 s by default),
    # and clients would see a running job's step that late.
    assert WorkerSettings.from_env({}).heartbeat_throttle_s == 0.4
    variable = "DURABLE_COMFY_HEARTBEAT_THROTTLE_S"
    assert WorkerSettings.from_env({variable: "0.25"}).heartbeat_throttle_s == 0.25
    with pytest.raises(ValidationError, match=variable):
        WorkerSettings.from_env({variable: "0"})
