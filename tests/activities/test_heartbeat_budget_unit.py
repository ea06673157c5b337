"""The worker's heartbeat budget (activities/heartbeat_budget.py), rule by rule.

A fake clock says what time the budget and its pacers see; the pacer's timer is a real asyncio
timer, so the tests that need it wait for it on the running loop (a fraction of a second).
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Iterator, MutableMapping
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

import activities.heartbeat_budget as heartbeat_budget
from activities.heartbeat_budget import FRESHNESS_S, HeartbeatBudget, HeartbeatPacer


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Prompt:
    """One followed prompt: its state (the pacer's mark) and the heartbeats sent for it."""

    def __init__(self, budget: HeartbeatBudget, keepalive_s: float = 5.0) -> None:
        self.state = 0
        self.sent: list[int] = []  # the state each heartbeat carried, as `send` built it
        self.sending = asyncio.Event()  # set at each send
        self.pacer: HeartbeatPacer = budget.pacer(self._send, self._mark, keepalive_s)

    def _send(self) -> None:
        self.sent.append(self.state)
        self.sending.set()

    def _mark(self) -> Hashable:
        return self.state


@contextmanager
def following(budget: HeartbeatBudget, count: int) -> Iterator[list[Prompt]]:
    """`count` prompts followed (their pacers entered) for the block."""
    with ExitStack() as stack:
        prompts = [Prompt(budget) for _ in range(count)]
        for prompt in prompts:
            stack.enter_context(prompt.pacer)
        yield prompts


async def yield_to_loop(times: int = 5) -> None:
    """Let the loop run whatever is ready now (a timer due at once would be)."""
    for _ in range(times):
        await asyncio.sleep(0)


async def until_sent(prompt: Prompt, count: int, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while len(prompt.sent) < count:
            prompt.sending.clear()
            await prompt.sending.wait()


# -- the interval ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompts", "interval"),
    [
        (0, 0.4),  # nobody followed: the fastest
        (1, 0.4),
        (4, 0.4),  # 4 / 10 per second: exactly the fastest
        (6, 0.6),  # the budget's share: following / per_s
        (8, 0.8),
        (10, 1.0),  # exactly once a second
        (11, 1.0),  # past the budget: still once a second, never slower
        (40, 1.0),
        (1000, 1.0),
    ],
)
def test_the_interval_is_the_budgets_share_between_the_fastest_and_one_second(
    prompts: int, interval: float
) -> None:
    budget = HeartbeatBudget(10, 0.4, clock=FakeClock())
    with following(budget, prompts):
        assert budget.following == prompts
        assert budget.interval() == pytest.approx(interval)
    assert budget.interval() == pytest.approx(0.4)


def test_a_fastest_interval_above_a_second_is_held_to_a_second() -> None:
    budget = HeartbeatBudget(1000, 5.0, clock=FakeClock())
    assert FRESHNESS_S == 1.0
    assert budget.interval() == pytest.approx(1.0)
    with following(budget, 1):
        assert budget.interval() == pytest.approx(1.0)


# -- news within and past the interval ---------------------------------------------------------


async def test_news_within_the_interval_waits_for_its_turn_and_goes_once_with_the_latest() -> None:
    clock = FakeClock()
    budget = HeartbeatBudget(5, 0.1, clock=clock)  # one prompt: interval max(0.1, 1/5) = 0.2
    prompt = Prompt(budget)
    with prompt.pacer:
        assert budget.interval() == pytest.approx(0.2)
        prompt.state = 1
        prompt.pacer.beat()  # the first news: nothing sent yet, so at once
        assert prompt.sent == [1]

        clock.now += 0.05
        prompt.state = 2
        prompt.pacer.beat()  # 0.05 s after the last send: its turn is in 0.15 s
        clock.now += 0.05
        prompt.state = 3
        prompt.pacer.beat()
        clock.now += 0.05
        prompt.state = 4
        prompt.pacer.beat()
        await yield_to_loop()
        assert prompt.sent == [1], "news within the interval must wait for the prompt's turn"
        assert prompt.pacer.sent == 1

        # The timer waits for what is left of the interval (0.2 - 0.05 s), set by the first
        # beat that had news; later beats do not move it.
        timer = prompt.pacer._timer
        assert timer is not None
        left = timer.when() - asyncio.get_running_loop().time()
        assert 0.1 < left <= 0.15 + 1e-6

        clock.now += 0.05  # the turn has come
        await until_sent(prompt, 2)
        await asyncio.sleep(0.3)  # time for a second (wrong) send to show
        assert prompt.sent == [1, 4], "one heartbeat at its turn, carrying the latest state"
        assert prompt.pacer.sent == 2
        assert prompt.pacer._timer is None


async def test_news_after_the_interval_goes_at_once() -> None:
    clock = FakeClock()
    budget = HeartbeatBudget(5, 0.1, clock=clock)  # interval 0.2
    prompt = Prompt(budget)
    with prompt.pacer:
        prompt.state = 1
        prompt.pacer.beat()
        clock.now += 0.2
        prompt.state = 2
        prompt.pacer.beat()
        assert prompt.sent == [1, 2]
        clock.now += 0.5
        prompt.state = 3
        prompt.pacer.beat()
        assert prompt.sent == [1, 2, 3]
        assert prompt.pacer._timer is None


async def test_a_timer_whose_news_was_sent_meanwhile_sends_nothing() -> None:
    clock = FakeClock()
    budget = HeartbeatBudget(5, 0.1, clock=clock)  # interval 0.2
    prompt = Prompt(budget)
    with prompt.pacer:
        prompt.state = 1
        prompt.pacer.beat()
        clock.now += 0.05
        prompt.state = 2
        prompt.pacer.beat()  # scheduled
        prompt.pacer.beat(now=True)  # a milestone carries it first
        assert prompt.sent == [1, 2]
        clock.now += 0.5
        await asyncio.sleep(0.3)
        assert prompt.sent == [1, 2]


async def test_a_timer_whose_news_went_back_to_what_was_sent_sends_nothing() -> None:
    clock = FakeClock()
    budget = HeartbeatBudget(5, 0.1, clock=clock)  # interval 0.2
    prompt = Prompt(budget)
    with prompt.pacer:
        prompt.state = 1
        prompt.pacer.beat()
        clock.now += 0.05
        prompt.state = 2
        prompt.pacer.beat()  # scheduled
        prompt.state = 1  # what the last heartbeat already carried
        clock.now += 0.5
        await asyncio.sleep(0.3)
        assert prompt.sent == [1]


# -- no news, and now ---------------------------------------------------------------------------


async def test_without_news_only_a_keepalive_once_it_is_due() -> None:
    clock = FakeClock()
    budget = HeartbeatBudget(5, 0.1, clock=clock)  # interval 0.2
    prompt = Prompt(budget, keepalive_s=3.0)
    with prompt.pacer:
        prompt.state = 1
        prompt.pacer.beat()
        assert prompt.sent == [1]
        for _ in range(29):  # 2.9 s of beats every 0.1 s, nothing new
            clock.now += 0.1
            prompt.pacer.beat()
        await asyncio.sleep(0.3)
        assert prompt.sent == [1], "nothing new and no keep-alive due: nothing is sent"
        assert prompt.pacer._timer is None

        clock.now += 0.1  # 3.0 s after the last send
        prompt.pacer.beat()
        assert prompt.sent == [1, 1], "a keep-alive once keepalive_s passed"
        clock.now += 2.9
        prompt.pacer.beat()
        assert prompt.sent == [1, 1], "the keep-alive counts from the last send"
        clock.now += 0.1
        prompt.pacer.beat()
        assert prompt.sent == [1, 1, 1]


async def test_now_always_sends() -> None:
    clock = FakeClock()
    budget = HeartbeatBudget(5, 0.1, clock=clock)  # interval 0.2
    prompt = Prompt(budget, keepalive_s=3.0)
    with prompt.pacer:
        prompt.state = 1
        prompt.pacer.beat(now=True)
        prompt.pacer.beat(now=True)  # nothing new, no time passed
        clock.now += 0.01
        prompt.state = 2
        prompt.pacer.beat(now=True)  # news well within the interval
        assert prompt.sent == [1, 1, 2]
        assert prompt.pacer.sent == 3


# -- who is followed ----------------------------------------------------------------------------


async def test_entering_and_leaving_pacers_counts_the_prompts_followed() -> None:
    budget = HeartbeatBudget(10, 0.4, clock=FakeClock())
    first, second = Prompt(budget), Prompt(budget)
    assert budget.following == 0
    with first.pacer:
        assert budget.following == 1
        with second.pacer:
            assert budget.following == 2
        assert budget.following == 1
    assert budget.following == 0
    with pytest.raises(RuntimeError), first.pacer:
        assert budget.following == 1
        raise RuntimeError("the follow failed")
    assert budget.following == 0, "a pacer left by an exception is no longer counted"


async def test_the_budget_knows_which_jobs_it_follows_while_their_pacers_are_entered() -> None:
    # The orphan sweep asks it: a job whose prompt this worker follows is not described.
    budget = HeartbeatBudget(10, 0.4, clock=FakeClock())
    noop = lambda: None  # noqa: E731
    first = budget.pacer(noop, lambda: 0, 5.0, job_id="job-a")
    retry = budget.pacer(noop, lambda: 0, 5.0, job_id="job-a")  # an overlapping attempt
    assert not budget.is_following("job-a")
    with first:
        assert budget.is_following("job-a") and not budget.is_following("job-b")
        with retry:
            assert budget.is_following("job-a")
        assert budget.is_following("job-a"), "still followed by the first attempt"
    assert not budget.is_following("job-a")
    with pytest.raises(RuntimeError), first:
        raise RuntimeError("the follow failed")
    assert not budget.is_following("job-a")


async def test_leaving_cancels_a_pending_send() -> None:
    clock = FakeClock()
    budget = HeartbeatBudget(5, 0.1, clock=clock)  # interval 0.2
    prompt = Prompt(budget)
    with prompt.pacer:
        prompt.state = 1
        prompt.pacer.beat()
        clock.now += 0.05
        prompt.state = 2
        prompt.pacer.beat()  # due in 0.15 s
        assert prompt.pacer._timer is not None
    clock.now += 1.0
    await asyncio.sleep(0.4)
    assert prompt.sent == [1], "no heartbeat after the prompt is no longer followed"


# -- the log -------------------------------------------------------------------------------------


def test_exceeding_the_budget_is_logged_once_when_crossing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    budget = HeartbeatBudget(2, 0.4, clock=FakeClock())
    with capture_logs() as logs:
        # A logger made under capture_logs: another test may have configured structlog to cache
        # the module's logger on first use.
        monkeypatch.setattr(
            heartbeat_budget, "log", structlog.get_logger(heartbeat_budget.__name__)
        )

        def named(event: str) -> list[MutableMapping[str, Any]]:
            return [entry for entry in logs if entry["event"] == event]

        with following(budget, 2):
            assert named("heartbeat_budget_exceeded") == [], "2 prompts at 1/s fit 2/s"
            with following(budget, 1):
                [exceeded] = named("heartbeat_budget_exceeded")
                assert exceeded["log_level"] == "warning"
                assert (exceeded["following"], exceeded["budget_per_s"]) == (3, 2)
                with following(budget, 5):
                    assert len(named("heartbeat_budget_exceeded")) == 1, (
                        "logged once, not per prompt"
                    )
                assert named("heartbeat_budget_kept") == []
            [kept] = named("heartbeat_budget_kept")
            assert kept["following"] == 2
            with following(budget, 1):
                assert len(named("heartbeat_budget_exceeded")) == 2, "crossing again: logged again"
    assert len(named("heartbeat_budget_kept")) == 2
    assert len(named("heartbeat_budget_exceeded")) == 2
