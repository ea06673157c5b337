"""SilenceTimer: a follower's allowance for a silent socket. It must time out a wait that gets
nothing, never count the time between waits, keep one timer per socket however many frames
come, and never swallow or disguise someone else's cancel (the Python 3.11 trap that rules out
`asyncio.wait_for` in protocol/comfyui/follower.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from protocol.comfyui.silence import SilenceTimer

# Long enough that a loaded machine (four test processes on two cores) does not delay a frame
# due at 0.6 of it past the whole of it: at 0.05 s one run saw the timer fire first.
ALLOWANCE_S = 0.25


async def test_a_wait_that_gets_nothing_times_out_after_its_allowance() -> None:
    never: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    started = time.monotonic()
    with SilenceTimer(ALLOWANCE_S) as silence, pytest.raises(TimeoutError):
        await silence.wait(never)
    assert ALLOWANCE_S <= time.monotonic() - started < 10 * ALLOWANCE_S
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_frames_inside_the_allowance_are_returned_and_each_wait_gets_a_fresh_one() -> None:
    loop = asyncio.get_running_loop()
    with SilenceTimer(ALLOWANCE_S) as silence:
        # Ten waits of 60% of the allowance each: twelve allowances in all, none silent.
        for frame in range(10):
            arriving: asyncio.Future[int] = loop.create_future()
            loop.call_later(0.6 * ALLOWANCE_S, arriving.set_result, frame)
            assert await silence.wait(arriving) == frame


async def test_time_between_waits_never_counts_as_silence() -> None:
    loop = asyncio.get_running_loop()
    with SilenceTimer(ALLOWANCE_S) as silence:
        await silence.wait(asyncio.sleep(0, "first frame"))
        # Handling a frame (an upload) takes three allowances; the timer fires meanwhile.
        await asyncio.sleep(3 * ALLOWANCE_S)
        arriving: asyncio.Future[str] = loop.create_future()
        loop.call_later(0.6 * ALLOWANCE_S, arriving.set_result, "next frame")
        assert await silence.wait(arriving) == "next frame"


async def test_one_timer_serves_a_stream_of_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()
    armed: list[float] = []
    call_at = loop.call_at

    def counting_call_at(when: float, callback, *args, **kwargs):  # type: ignore[no-untyped-def]
        if getattr(callback, "__self__", None) is silence:
            armed.append(when)
        return call_at(when, callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_at", counting_call_at)
    frames = 0
    started = loop.time()
    with SilenceTimer(ALLOWANCE_S) as silence:
        while loop.time() - started < 4 * ALLOWANCE_S:
            await silence.wait(asyncio.sleep(ALLOWANCE_S / 50))
            frames += 1
    assert frames > 50
    # Once when first armed, then once per allowance that passed: not once per frame.
    assert len(armed) <= 6


async def test_a_cancel_while_waiting_is_a_cancel_not_a_timeout() -> None:
    never: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    with SilenceTimer(ALLOWANCE_S) as silence:
        waiting = asyncio.create_task(silence.wait(never))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting


async def test_a_cancel_landing_as_a_frame_arrives_is_not_swallowed() -> None:
    """asyncio.wait_for on 3.11 returns the frame here and the cancel is lost for good."""
    arriving: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    with SilenceTimer(ALLOWANCE_S) as silence:
        waiting = asyncio.create_task(silence.wait(arriving))
        await asyncio.sleep(0)
        arriving.set_result("frame")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting


async def test_a_cancel_landing_with_the_silence_is_a_cancel_not_a_timeout() -> None:
    loop = asyncio.get_running_loop()
    never: asyncio.Future[str] = loop.create_future()
    with SilenceTimer(ALLOWANCE_S) as silence:
        waiting = asyncio.create_task(silence.wait(never))
        await asyncio.sleep(0)
        # Both fire in one turn of the loop, the silence first, before the task runs again.
        loop.call_at(silence.deadline + 1e-6, waiting.cancel)
        time.sleep(2 * ALLOWANCE_S)  # noqa: ASYNC251 -- blocks the loop past both on purpose
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert waiting.cancelling() == 1  # theirs is left standing, ours was taken back
