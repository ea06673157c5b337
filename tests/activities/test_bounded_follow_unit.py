"""A follow that checks a job on a bounded pool (activities/backend.py): granted by its own ask,
it submits in the same attempt and says it holds the slot; told a place, it submits nothing."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from temporalio.testing import ActivityEnvironment

from activities import backend as backend_module
from activities.backend import Backend, Backends, JobActivities
from configuration.pools import PoolConfig
from tests.activities.test_backend_routing import STORAGE, RecordingBackend, follow_input
from workflows.activity_io import FollowInput, FollowResult, PrepareInput
from workflows.admission import Admission, SlotRelease, SlotRequest
from workflows.contracts import Checkpoint, ProgressReport

GRAPH = {"1": {"class_type": "EmptyImage", "inputs": {}}}


class Followed(RecordingBackend):
    def __init__(self) -> None:
        super().__init__("comfyui")
        self.inputs: list[FollowInput] = []

    async def follow(self, req: FollowInput) -> FollowResult:
        self.inputs.append(req)
        checkpoint = Checkpoint(job_id=req.job_id, prompt_id=req.prompt_id)
        return FollowResult(prompt_id=req.prompt_id, outcome="success", checkpoint=checkpoint)


class Queue:
    """The pool queue's side: answers each ask with `answer`, records releases."""

    def __init__(self, answer: Admission | None) -> None:
        self.answer = answer
        self.asks: list[SlotRequest] = []
        self.releases: list[SlotRelease] = []

    async def ask(self, pool: str, request: SlotRequest) -> Admission | None:
        self.asks.append(request)
        return self.answer

    async def release(self, pool: str, release: SlotRelease) -> bool:
        self.releases.append(release)
        return True


class Watch:
    """A SlotWatch's side: granted (or not) after telling the job `places`."""

    def __init__(self, granted: bool, places: list[Admission], room: bool = True) -> None:
        self.granted, self.places, self.room = granted, places, room
        self.waits: list[tuple[str, SlotRequest, float]] = []

    def has_room(self) -> bool:
        return self.room

    async def wait(
        self, task_queue: str, pool: str, request: SlotRequest, answer: Admission | None, **kw: Any
    ) -> bool:
        self.waits.append((pool, request, kw["wait_s"]))
        for place in self.places:
            await kw["tell"](place)
        kw["heartbeat"]()
        return self.granted


def bounded(queue: Queue, watch: Watch | None = None) -> tuple[JobActivities, Followed]:
    backend = Followed()
    pools = {"gpu": PoolConfig(kind="comfyui", url="http://127.0.0.1:1", max_running=1)}
    by_kind: dict[str, Backend] = {"comfyui": backend}
    jobs = JobActivities(
        Backends(pools, "gpu", by_kind),
        None,
        STORAGE,
        ask_for_slot=queue.ask,
        release_slot=queue.release,
        slot_watch=watch,  # type: ignore[arg-type]
    )
    return jobs, backend


def checking() -> FollowInput:
    check = PrepareInput(job_id="j", pool="gpu", graph=GRAPH, accepted_at=datetime.now(UTC))
    return follow_input(None).model_copy(update={"prepare": check, "graph": GRAPH})


async def test_a_check_granted_at_once_submits_in_the_same_follow_and_gives_the_slot_back() -> None:
    queue = Queue(Admission(pool="gpu", job_id="j", granted=True))
    jobs, backend = bounded(queue)
    result = await jobs.follow_prompt(checking())
    assert result.outcome == "success"
    assert len(queue.asks) == 1 and len(backend.inputs) == 1
    sent = backend.inputs[0]
    # Its reports say the job holds the slot; so does its result.
    assert sent.slot_held and sent.slot_bound is not None and sent.slot_bound.pool == "gpu"
    assert result.bound is not None and result.bound.max_running == 1
    assert result.admission is not None and result.admission.granted
    # Its last prompt ended: the slot went back from here.
    assert result.slot_released and [r.job_id for r in queue.releases] == ["j"]


async def test_a_check_told_a_place_submits_nothing() -> None:
    queue = Queue(Admission(pool="gpu", job_id="j", position=3))
    jobs, backend = bounded(queue)
    result = await jobs.follow_prompt(checking())
    assert result.outcome == "needs_slot" and backend.inputs == []
    assert result.slot_asked and result.admission is not None and result.admission.position == 3
    assert queue.releases == []


async def test_a_check_whose_ask_went_by_signal_submits_nothing() -> None:
    queue = Queue(None)  # the request went by signal: its answer comes to the job
    jobs, backend = bounded(queue)
    result = await jobs.follow_prompt(checking())
    assert result.outcome == "needs_slot" and backend.inputs == []
    assert result.slot_asked and result.admission is None


def waiting_check() -> FollowInput:
    return checking().model_copy(update={"slot_wait_s": 600.0, "client_id": "c-1"})


@pytest.fixture
def reports(monkeypatch: pytest.MonkeyPatch) -> list[ProgressReport]:
    sent: list[ProgressReport] = []

    async def send(job_id: str, report: ProgressReport, log: Any) -> None:
        sent.append(report)

    monkeypatch.setattr(backend_module, "send_progress", send)
    return sent


async def test_a_check_told_a_place_waits_in_line_tells_its_place_then_submits_when_granted(
    reports: list[ProgressReport],
) -> None:
    place = Admission(pool="gpu", job_id="j", position=3, waiting=3)
    queue = Queue(place)
    watch = Watch(granted=True, places=[place])
    jobs, backend = bounded(queue, watch)
    result = await ActivityEnvironment().run(jobs.follow_prompt, waiting_check())
    # Asked as a follow that watches, and waited for as long as the workflow said.
    assert [a.in_follow for a in queue.asks] == [True]
    [(pool, request, wait_s)] = watch.waits
    assert (pool, request.job_id, request.in_follow, wait_s) == ("gpu", "j", True, 600.0)
    # Its job heard its place (PENDING) with the slot's terms, then the follow submitted.
    [report] = reports
    assert report.admission == place and report.slot is not None and report.slot.pool == "gpu"
    assert report.attempt_client_id == "c-1"
    assert result.outcome == "success" and len(backend.inputs) == 1
    assert backend.inputs[0].slot_held and backend.inputs[0].slot_bound is not None
    assert result.admission is not None and result.admission.granted
    assert result.slot_released


async def test_a_check_whose_wait_in_line_ran_out_hands_it_to_the_job(
    reports: list[ProgressReport],
) -> None:
    place = Admission(pool="gpu", job_id="j", position=3)
    jobs, backend = bounded(Queue(place), Watch(granted=False, places=[]))
    result = await ActivityEnvironment().run(jobs.follow_prompt, waiting_check())
    assert result.outcome == "needs_slot" and backend.inputs == []
    assert result.admission == place and result.slot_asked


async def test_a_check_finding_no_room_to_wait_in_line_asks_to_be_told_by_signal(
    reports: list[ProgressReport],
) -> None:
    queue = Queue(Admission(pool="gpu", job_id="j", position=3))
    watch = Watch(granted=True, places=[], room=False)
    jobs, backend = bounded(queue, watch)
    result = await ActivityEnvironment().run(jobs.follow_prompt, waiting_check())
    assert result.outcome == "needs_slot" and watch.waits == [] and backend.inputs == []
    assert [a.in_follow for a in queue.asks] == [False]
