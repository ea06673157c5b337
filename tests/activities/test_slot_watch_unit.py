"""A follow waiting in line itself (activities/slot_watch.py): it sees its grant among the
queue's holders, tells its job its place (first, then when it has halved among the first 50),
asks again when the queue does not know it, and hands the wait to its job when its time is up."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from temporalio.client import WorkflowQueryFailedError

from activities import slot_watch
from activities.slot_watch import SlotWatch, waiters_room
from workflows.admission import Admission, LinePlaces, PoolHealthView, SlotRequest
from workflows.shared import QUERY_LINE_PLACES, QUERY_POOL_HEALTH, QUERY_SLOT_HOLDERS


class Dispatcher:
    """The pool's dispatcher as the watch sees it: its queries' answers, set by the test."""

    def __init__(self) -> None:
        self.holders: list[str] = []
        self.places: dict[str, int] = {}
        self.waiting = 0
        self.queries: list[str] = []
        self.knows_queries = True
        self.unhealthy: str | None = None

    async def query(self, name: str, *args: Any, result_type: Any = None) -> Any:
        self.queries.append(name)
        if not self.knows_queries:
            raise WorkflowQueryFailedError(f"unknown query type {name!r}")
        if name == QUERY_SLOT_HOLDERS:
            return list(self.holders)
        if name == QUERY_POOL_HEALTH:
            return PoolHealthView(pool="gpu", unhealthy=self.unhealthy)
        assert name == QUERY_LINE_PLACES
        [ids] = args
        wanted = {j: p for j, p in self.places.items() if j in ids}
        return LinePlaces(places=wanted, waiting=self.waiting, per_start_s=2.0)


class Client:
    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    def get_workflow_handle(self, workflow_id: str) -> Dispatcher:
        assert workflow_id == "durable-comfy-pool-queue:tq:gpu"
        return self.dispatcher


class World:
    def __init__(self) -> None:
        self.dispatcher = Dispatcher()
        self.asked: list[SlotRequest] = []
        self.told: list[Admission] = []
        self.beats = 0
        self.watch = SlotWatch(Client(self.dispatcher), self.ask, capacity=2)  # type: ignore[arg-type]

    async def ask(self, task_queue: str, pool: str, request: SlotRequest) -> None:
        self.asked.append(request)

    async def tell(self, place: Admission) -> None:
        self.told.append(place)

    def beat(self) -> None:
        self.beats += 1

    def wait(
        self,
        job_id: str,
        answer: Admission | None = None,
        wait_s: float = 30.0,
        *,
        leave_when_unhealthy: bool = False,
        start_by: datetime | None = None,
    ) -> Any:
        request = SlotRequest(
            job_id=job_id,
            tenant="t",
            priority=2,
            max_running=1,
            accepted_at=datetime.now(UTC),
            in_follow=True,
        )
        return self.watch.wait(
            "tq",
            "gpu",
            request,
            answer,
            wait_s=wait_s,
            tell=self.tell,
            heartbeat=self.beat,
            heartbeat_every_s=0.05,
            leave_when_unhealthy=leave_when_unhealthy,
            start_by=start_by,
        )


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> World:
    monkeypatch.setattr(slot_watch, "POLL_S", 0.01)
    monkeypatch.setattr(slot_watch, "MAX_POLL_S", 0.01)
    monkeypatch.setattr(slot_watch, "PLACES_AT_MOST_EVERY_S", 0.02)
    monkeypatch.setattr(slot_watch, "PLACES_EVERY_S", 0.05)
    monkeypatch.setattr(slot_watch, "ASK_AGAIN_EVERY_S", 0.05)
    return World()


async def until(condition: Any, what: str) -> None:
    for _ in range(300):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_a_waiting_follow_tells_its_place_and_goes_on_when_its_job_holds_a_slot(
    world: World,
) -> None:
    world.dispatcher.places, world.dispatcher.waiting = {"j": 80}, 80
    waiting = asyncio.create_task(world.wait("j"))
    # Asked by signal (no answer): its first place, read from the queue, is told.
    await until(lambda: world.told, "its place told")
    [first] = world.told
    assert (first.position, first.ahead, first.waiting) == (80, 79, 80)
    assert (first.priority, first.tenant, first.eta_s) == (2, "t", 160.0)
    # Moving from 80 to 60 is not worth a word (not among the first 50); 40, then 20, are.
    world.dispatcher.places = {"j": 60}
    await asyncio.sleep(0.15)
    assert [t.position for t in world.told] == [80]
    world.dispatcher.places = {"j": 40}
    await until(lambda: len(world.told) == 2, "40 told")
    world.dispatcher.places = {"j": 30}
    await asyncio.sleep(0.15)
    world.dispatcher.places = {"j": 20}
    await until(lambda: len(world.told) == 3, "20 told")
    assert [t.position for t in world.told] == [80, 40, 20]
    assert not waiting.done()
    world.dispatcher.places, world.dispatcher.holders = {}, ["j"]
    assert await asyncio.wait_for(waiting, 2) is True
    assert world.beats >= 1 and world.asked == []


async def test_the_checks_answer_is_told_at_once_and_a_grant_ends_the_wait(world: World) -> None:
    answer = Admission(pool="gpu", job_id="j", position=3, waiting=3)
    waiting = asyncio.create_task(world.wait("j", answer))
    await until(lambda: world.told, "the answer told")
    assert world.told == [answer]
    world.dispatcher.holders = ["j"]
    assert await asyncio.wait_for(waiting, 2) is True


async def test_a_waiter_the_queue_does_not_know_asks_again(world: World) -> None:
    waiting = asyncio.create_task(world.wait("lost"))
    await until(lambda: world.asked, "asked again")
    assert world.asked[0].job_id == "lost" and world.asked[0].in_follow
    world.dispatcher.holders = ["lost"]
    assert await asyncio.wait_for(waiting, 2) is True


async def test_its_time_up_the_wait_goes_to_the_job_told_by_signal_from_then(world: World) -> None:
    world.dispatcher.places = {"j": 5}
    assert await world.wait("j", wait_s=0.2) is False
    # Asked again without `in_follow`: the queue tells the job its grant by signal.
    assert [(a.job_id, a.in_follow) for a in world.asked] == [("j", False)]


async def test_a_worker_has_room_for_so_many_waiters(world: World) -> None:
    world.dispatcher.places = {"a": 1, "b": 2}
    assert world.watch.has_room()
    first = asyncio.create_task(world.wait("a"))
    second = asyncio.create_task(world.wait("b"))
    await until(lambda: not world.watch.has_room(), "full")
    world.dispatcher.holders = ["a", "b"]
    assert list(await asyncio.gather(first, second)) == [True, True]
    assert world.watch.has_room()
    # All a worker's activity slots but a hundred, and never more than half of a small one.
    assert (waiters_room(1000), waiters_room(100), waiters_room(2100)) == (900, 50, 2000)


async def test_a_queue_that_cannot_be_watched_hands_the_wait_to_the_job(world: World) -> None:
    world.dispatcher.knows_queries = False  # a dispatcher of a version before the queries
    assert await asyncio.wait_for(world.wait("j"), 5) is False
    assert [(a.job_id, a.in_follow) for a in world.asked] == [("j", False)]


async def test_a_job_of_a_group_leaves_the_line_of_a_pool_that_takes_no_work(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slot_watch, "HEALTH_EVERY_S", 0.02)
    world.dispatcher.places, world.dispatcher.waiting = {"g": 3, "plain": 2}, 3
    group_job = asyncio.create_task(world.wait("g", leave_when_unhealthy=True))
    plain_job = asyncio.create_task(world.wait("plain"))
    await until(lambda: len(world.told) == 2, "both places told")
    await asyncio.sleep(0.1)
    assert not group_job.done()
    world.dispatcher.unhealthy = "no worker can take a job"
    # Handed to its job (which moves): the queue is asked to tell it by signal from now on.
    assert await asyncio.wait_for(group_job, 2) is False
    assert [(a.job_id, a.in_follow) for a in world.asked] == [("g", False)]
    # A job of no group waits on.
    await asyncio.sleep(0.1)
    assert not plain_job.done()
    world.dispatcher.holders = ["plain"]
    assert await asyncio.wait_for(plain_job, 2) is True


async def test_a_job_of_a_group_leaves_a_line_that_would_start_it_after_its_deadline(
    world: World,
) -> None:
    # 2 s a start: 3rd in line is 6 s away; one deadline is 10 s away, the other 4 s.
    world.dispatcher.places, world.dispatcher.waiting = {"patient": 3, "hurried": 3}, 3
    soon = datetime.now(UTC) + timedelta(seconds=4)
    later = datetime.now(UTC) + timedelta(seconds=10)
    hurried = asyncio.create_task(world.wait("hurried", leave_when_unhealthy=True, start_by=soon))
    patient = asyncio.create_task(world.wait("patient", leave_when_unhealthy=True, start_by=later))
    assert await asyncio.wait_for(hurried, 2) is False
    assert [a.job_id for a in world.asked] == ["hurried"]
    await asyncio.sleep(0.1)
    assert not patient.done()
    world.dispatcher.holders = ["patient"]
    assert await asyncio.wait_for(patient, 2) is True
