"""A follow attempt's quiet start (activities.follow_common.QUIET_START_S): it tells the
workflow nothing in its first moments, so a prompt that ends within them costs the job no
`progress` signal (each is about four history events and a workflow task), while clients read
its stage and steps from the heartbeats; a prompt still running when the quiet start ends sends
what came up meanwhile at once, without waiting for its next event."""

from __future__ import annotations

import pytest

from activities import follow_common
from tests.activities.follower_rig import Rig
from tests.support.comfy_fakes import (
    PNG,
    PROMPT_ID,
    FakeComfy,
    ScriptedSocket,
    comfy_on_loopback,
    executed,
    frame,
    image,
    pause,
    request,
    send,
)

QUIET_S = 0.3


@pytest.fixture(autouse=True)
def short_quiet_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(follow_common, "QUIET_START_S", QUIET_S)


def _finish() -> list[dict[str, object]]:
    return [
        frame("executing", node="9"),
        executed("9", image("img_00001_.png")),
        frame("execution_success"),
        frame("executing", node=None),
    ]


async def test_a_prompt_that_ends_within_the_quiet_start_sends_no_signal() -> None:
    comfy = FakeComfy(files={"img_00001_.png": PNG})
    socket = ScriptedSocket()
    steps = [frame("progress", node="3", value=step, max=10) for step in range(1, 11)]
    socket.scripts = [
        [send(frame("execution_start"), frame("executing", node="3"), *steps, *_finish())]
    ]
    comfy.running.append(PROMPT_ID)
    async with comfy_on_loopback(comfy, socket) as (base_url, http):
        rig = Rig(comfy, socket, base_url=base_url, http=http)
        result = await rig.follow(request(sampler_steps={"3": 10}))
    assert [a.node_id for a in result.artifacts] == ["9"]
    assert rig.signals.reports == [], "the result tells the workflow everything"
    assert any(beat.stage == "running" for beat in rig.heartbeats()), "clients see it running"


async def test_a_prompt_still_running_after_the_quiet_start_reports_without_a_new_event() -> None:
    comfy = FakeComfy(files={"img_00001_.png": PNG})
    socket = ScriptedSocket()
    steps = [frame("progress", node="3", value=step, max=10) for step in range(1, 4)]
    socket.scripts = [
        [
            send(frame("execution_start"), frame("executing", node="3"), *steps),
            # Silent past the quiet start (a slow step), then the rest.
            pause(3 * QUIET_S),
            send(*_finish()),
        ]
    ]
    comfy.running.append(PROMPT_ID)
    async with comfy_on_loopback(comfy, socket) as (base_url, http):
        rig = Rig(comfy, socket, base_url=base_url, http=http)
        # Polls (a third of the timeout) far apart: the pause is not a silence to act on.
        rig.with_heartbeat_timeout(3.0)
        await rig.follow(request(sampler_steps={"3": 10}))
    told = [(r.stage, r.step) for r in rig.signals.reports]
    # The first report, at step 3: the socket was silent from step 3 until after the quiet
    # start, so only the end of the quiet start can have sent it (the next event is step 10).
    assert told[0] == ("running", 3)
