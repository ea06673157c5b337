"""A follow that checks a job on a bounded pool (activities/backend.py): granted by its own ask,
it submits in the same attempt and says it holds the slot; told a place, it submits nothing."""

from __future__ import annotations

from datetime import UTC, datetime

from activities.backend import Backend, Backends, JobActivities
from configuration.pools import PoolConfig
from tests.activities.test_backend_routing import STORAGE, RecordingBackend, follow_input
from workflows.activity_io import FollowInput, FollowResult, PrepareInput
from workflows.admission import Admission, SlotRelease, SlotRequest
from workflows.contracts import Checkpoint

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


def bounded(queue: Queue) -> tuple[JobActivities, Followed]:
    backend = Followed()
    pools = {"gpu": PoolConfig(kind="comfyui", url="http://127.0.0.1:1", max_running=1)}
    by_kind: dict[str, Backend] = {"comfyui": backend}
    jobs = JobActivities(
        Backends(pools, "gpu", by_kind),
        None,
        STORAGE,
        ask_for_slot=queue.ask,
        release_slot=queue.release,
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
