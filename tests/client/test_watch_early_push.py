"""A watch's first seconds (starter/live.py, starter/progress.py): the steps a worker pushes
before the job's first status answers.

On a busy server a short job can run to its end before its watcher's first describe and query
answer. So a watch subscribes from its start on every pushing worker of the task queue (each
says where in its poller identity), and lays what they push over the status its submit
answered; the first answer, written before the job heard of any step, then takes nothing back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import pytest
from pydantic import SecretStr
from temporalio.api.enums.v1 import WorkflowExecutionStatus as RawStatus
from temporalio.client import Client, WorkflowExecutionDescription

import starter.live
from activities.live_progress import LiveProgress, poller_identity, serving
from devstack.free_ports import free_port
from starter import JobClient, JobRequest, SubmitOutcome
from starter.errors import JobConflict
from starter.live import WORKERS_FRESH_S, LiveRelay, Pushed
from starter.pollers import split_identity
from starter.progress import overlaid
from tests.client.test_client_progress_unit import JOB, beat, checkpoint, description, running
from tests.support.no_ledger import NoLedgers
from workflows.activity_io import FollowHeartbeat
from workflows.contracts import JobState, JobStatus, Progress
from workflows.shared import ACTIVITY_FOLLOW

KEY = SecretStr("early-push-key-0123456789abcdef")


def submitted(segments: int = 1) -> JobStatus:
    """What `JobClient.submit` answers for a new job."""
    return JobStatus(job_id=JOB, progress=Progress(segments=segments))


# -- a status from before the submission --------------------------------------------------------


def test_a_status_from_before_the_submission_takes_a_follow_heartbeat_of_the_job() -> None:
    queued = submitted(segments=2)
    started = overlaid(queued, [beat(1250, stage="running")])
    assert (started.state, started.progress.step) == (JobState.RUNNING, 1250)
    # As the job's own status will count it: half the job is this segment.
    assert started.progress.fraction == pytest.approx(1250 / 5000 / 2)
    assert started.checkpoint == checkpoint(1250, at=12.5)
    waiting = overlaid(queued, [beat(0, stage="queued", queue_position=2)])
    assert (waiting.state, waiting.progress.queue_position) == (JobState.WAITING, 2)
    assert overlaid(queued, [beat(0)]).state == JobState.SUBMITTING, "no stage yet"


@pytest.mark.parametrize("other", [{"job_id": "job-other"}, {"segment": 1}, {"prompt_id": None}])
def test_a_heartbeat_of_another_job_or_segment_lifts_nothing(other: dict[str, Any]) -> None:
    queued = submitted()
    assert overlaid(queued, [beat(10, stage="running", **other)]) == queued


@pytest.mark.parametrize("state", [JobState.UPLOADING, JobState.COMPLETED, JobState.CANCELLED])
def test_a_job_past_its_submissions_is_not_lifted(state: JobState) -> None:
    status = JobStatus(job_id=JOB, state=state)
    assert overlaid(status, [beat(10, stage="running")]) == status


# -- where a worker pushes, from its poller identity --------------------------------------------


def test_a_pushing_workers_identity_says_where_and_reads_back() -> None:
    url = "ws://10.0.0.7:9410/v1/live"
    assert split_identity(poller_identity("123@gpu-host", url)) == ("123@gpu-host", url)
    assert poller_identity("123@gpu-host", None) == "123@gpu-host"
    assert split_identity("123@gpu-host") == ("123@gpu-host", None)
    assert split_identity("odd live=") == ("odd live=", None)


async def test_the_pushing_workers_are_listed_once_for_many_watches_and_kept_fresh() -> None:
    listed: list[list[str]] = [
        ["ws://127.0.0.1:1/v1/live", "http://no"],
        ["ws://127.0.0.1:2/v1/live"],
    ]
    calls = 0
    release = asyncio.Event()

    async def discover() -> list[str]:
        nonlocal calls
        calls += 1
        await release.wait()
        return listed[calls - 1]

    relay = LiveRelay(KEY, discover)
    waiting = [asyncio.create_task(relay.workers()) for _ in range(5)]
    await asyncio.sleep(0.01)
    release.set()
    assert [await w for w in waiting] == [["ws://127.0.0.1:1/v1/live"]] * 5 and calls == 1
    assert await relay.workers() == ["ws://127.0.0.1:1/v1/live"] and calls == 1, "still fresh"
    relay._workers_at -= WORKERS_FRESH_S  # stale: answered at once, listed again meanwhile
    assert await relay.workers() == ["ws://127.0.0.1:1/v1/live"]
    await asyncio.sleep(0.01)
    assert calls == 2 and await relay.workers() == ["ws://127.0.0.1:2/v1/live"]
    await relay.close()


async def test_workers_that_cannot_be_listed_are_none() -> None:
    async def discover() -> list[str]:
        raise RuntimeError("no server")

    assert await LiveRelay(KEY, discover).workers() == []
    assert await LiveRelay(KEY).workers() == []


async def test_a_listing_that_fails_keeps_the_workers_listed_before() -> None:
    answers: list[list[str] | Exception] = [["ws://127.0.0.1:1/v1/live"], RuntimeError("busy")]

    async def discover() -> list[str]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    relay = LiveRelay(KEY, discover)
    assert await relay.workers() == ["ws://127.0.0.1:1/v1/live"]
    relay._workers_at -= WORKERS_FRESH_S
    relay.list_soon()
    assert relay._listing is not None
    await relay._listing  # failed
    assert not answers and await relay.workers() == ["ws://127.0.0.1:1/v1/live"]
    await relay.close()


# -- one watch's subscriptions ------------------------------------------------------------------


class Recorded:
    """A relay that records what a `Pushed` asks of it, and hands beats to the callbacks."""

    def __init__(self) -> None:
        self.at: dict[str, Any] = {}

    def subscribe(self, url: str, job_id: str, on_beat: Any) -> None:
        self.at[url] = on_beat

    def unsubscribe(self, url: str, job_id: str, on_beat: Any) -> None:
        assert self.at.pop(url) is on_beat


def test_a_watch_subscribed_on_every_worker_keeps_only_the_one_its_job_names() -> None:
    relay = Recorded()
    pushed = Pushed(cast(LiveRelay, relay), JOB)
    a, b = "ws://127.0.0.1:1/v1/live", "ws://127.0.0.1:2/v1/live"
    pushed.follow_any([a, b, "http://not-a-socket", None])
    assert set(relay.at) == {a, b}
    relay.at[b](beat(7, stage="running"))
    assert pushed.beat is not None and pushed.beat.checkpoint.step == 7
    pushed.follow(b)  # the job's status names b, which sent the beat: it stays
    assert set(relay.at) == {b} and pushed.beat is not None
    pushed.follow(a)  # another worker now: b's beat says nothing of a's attempt
    assert set(relay.at) == {a} and pushed.beat is None
    pushed.close()
    assert relay.at == {}


@pytest.mark.parametrize("wait", ["next_before", "next_or"])
async def test_a_watch_cancelled_as_a_beat_arrives_ends(wait: str) -> None:
    """Python 3.11's `asyncio.wait_for` returns the result of what it awaited when a cancel
    lands as that completes, and the cancel is lost: a watch stopped then (the bench's
    window) kept polling forever and the task that stopped it never ended."""
    relay = Recorded()
    pushed = Pushed(cast(LiveRelay, relay), JOB)
    url = "ws://127.0.0.1:1/v1/live"
    pushed.follow_any([url])
    never = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(
        pushed.next_before(time.monotonic() + 10)
        if wait == "next_before"
        else pushed.next_or(never)
    )
    await asyncio.sleep(0)  # it waits for a beat
    relay.at[url](beat(7, stage="running"))  # one arrives...
    waiting.cancel()  # ...as the watch is stopped
    with pytest.raises(asyncio.CancelledError):
        await waiting
    pushed.close()


# -- a watch whose job's first answer is late ---------------------------------------------------


@asynccontextmanager
async def pushing_worker(live: LiveProgress) -> AsyncIterator[str]:
    port = free_port()
    live.url = f"ws://127.0.0.1:{port}/v1/live"
    async with serving(live, "127.0.0.1", port, KEY):
        yield live.url


class LateFirstAnswer:
    """A JobClient on a busy server: its first describe waits until `released`; then the job's
    first answer (SUBMITTING at step 0, written before it heard of any step), then its end."""

    def __init__(self, url: str | None) -> None:
        self.released = asyncio.Event()
        self.described = 0
        self.client = JobClient(cast(Client, NoLedgers()), live_progress_key=KEY)

        self.listed = asyncio.Event()

        async def workers() -> list[str]:
            self.listed.set()
            return [url] if url is not None else []

        self.client.live = LiveRelay(KEY, workers)
        done = running(5000, seq=12)
        done.state = JobState.COMPLETED
        self.done = done

        async def describe(job_id: str) -> WorkflowExecutionDescription:
            self.described += 1
            await self.released.wait()
            if self.described <= 2:
                return await description((ACTIVITY_FOLLOW, beat(300)), history_length=20)
            return await description(
                history_length=30, status=RawStatus.WORKFLOW_EXECUTION_STATUS_COMPLETED
            )

        async def query(job_id: str) -> JobStatus:
            return running(0, state=JobState.SUBMITTING, seq=3)

        async def recorded_end(
            job_id: str, description: WorkflowExecutionDescription
        ) -> JobStatus | None:
            return None if self.described <= 2 else self.done

        async def client_seen(job_id: str) -> None:
            return None

        self.client._describe = describe  # type: ignore[method-assign]
        self.client._query = query  # type: ignore[method-assign]
        self.client._recorded_end = recorded_end  # type: ignore[method-assign]
        self.client._client_seen = client_seen  # type: ignore[method-assign]


def pushed_beat(step: int) -> FollowHeartbeat:
    return beat(step, stage="running")


async def test_steps_pushed_before_the_jobs_first_answer_are_seen_and_never_taken_back() -> None:
    live = LiveProgress()
    current = pushed_beat(0)
    seen: list[tuple[str, int]] = []
    async with pushing_worker(live) as url:
        late = LateFirstAnswer(url)
        try:
            with live.following(JOB, lambda: current):
                async with asyncio.timeout(20):
                    async for status in late.client.watch(
                        JOB, since=submitted(), poll_interval_s=0.02, keepalive_s=3600
                    ):
                        seen.append((status.state, status.progress.step))
                        if status.progress.step == 0 and status.state == JobState.RUNNING:
                            current = pushed_beat(100)  # the prompt moves
                            live.moved(JOB)
                        elif status.progress.step == 100:
                            # Seen while the first describe still waits: by push alone.
                            assert late.described == 1 and not late.released.is_set()
                            late.released.set()
        finally:
            await late.client.close()
    assert seen[:2] == [(JobState.RUNNING, 0), (JobState.RUNNING, 100)]
    # The first answer (SUBMITTING, step 0) and the describe's heartbeat (step 300): forward.
    steps = [step for _, step in seen]
    assert steps == sorted(steps) and (JobState.RUNNING, 300) in seen
    assert all(state != JobState.SUBMITTING for state, _ in seen)
    assert seen[-1] == (JobState.COMPLETED, 5000)


async def test_without_the_submits_answer_early_steps_wait_for_the_first_answer() -> None:
    """With nothing to lay them over, the pushed steps are laid over the job's first answer:
    shown then, at the furthest pushed."""
    live = LiveProgress()
    async with pushing_worker(live) as url:
        late = LateFirstAnswer(url)
        try:
            with live.following(JOB, lambda: pushed_beat(250)):
                seen: list[tuple[str, int]] = []

                async def watch() -> None:
                    async for status in late.client.watch(
                        JOB, poll_interval_s=0.02, keepalive_s=3600
                    ):
                        seen.append((status.state, status.progress.step))

                watching = asyncio.create_task(watch())
                async with asyncio.timeout(10):
                    await late.listed.wait()
                    await asyncio.sleep(0.3)  # the beat arrives, with nothing to show it on
                    assert seen == []
                    late.released.set()
                    await watching
        finally:
            await late.client.close()
    # RUNNING from the pushed beat (the describe's heartbeat, further, names no stage).
    assert seen[0] == (JobState.RUNNING, 300)
    assert seen[-1] == (JobState.COMPLETED, 5000)


async def test_a_watch_without_a_pushing_worker_is_the_polled_watch() -> None:
    late = LateFirstAnswer(None)
    late.released.set()
    try:
        seen = [
            (s.state, s.progress.step)
            async for s in late.client.watch(
                JOB, since=submitted(), poll_interval_s=0.02, keepalive_s=3600
            )
        ]
    finally:
        await late.client.close()
    assert seen == [(JobState.SUBMITTING, 300), (JobState.COMPLETED, 5000)]


# -- an attached start subscribes before the job exists -----------------------------------------


def attached_start(late: LateFirstAnswer, during: Any) -> None:
    """`late.client.start` without a server: its start call runs `during()` (what the worker
    does meanwhile) and then answers, as `start` does, with the new job's QUEUED status."""

    async def start_new(request: JobRequest, job_id: str, fingerprint: str) -> SubmitOutcome:
        await during()
        return SubmitOutcome(job_id=job_id, existed=False, status=submitted())

    async def check_size(request: JobRequest) -> None:
        return None

    late.client._start_new = start_new  # type: ignore[method-assign]
    late.client._check_size = check_size  # type: ignore[method-assign]


def a_request() -> JobRequest:
    return JobRequest(graph={"1": {"class_type": "X", "inputs": {}}})


async def test_a_job_that_ran_during_its_attached_start_is_seen_by_the_watch_at_once() -> None:
    """On a busy server a 200 ms job can run to its end before its start call returns. Started
    attached (as `submit --watch` does), it was subscribed to from before it existed: its watch
    shows the furthest step pushed meanwhile at once, before the job's first answer."""
    live = LiveProgress()
    async with pushing_worker(live) as url:
        late = LateFirstAnswer(url)
        assert late.client.live is not None
        relay = late.client.live

        async def the_prompt_runs() -> None:
            at = [0]
            with live.following(JOB, lambda: pushed_beat(at[0])):
                for step in (0, 40, 100):
                    at[0] = step
                    live.moved(JOB)
                    await asyncio.sleep(0.02)
                for _ in range(1000):  # until the held subscription has the last step
                    held = relay._held[JOB][0].beat
                    if held is not None and held.checkpoint.step == 100:
                        break
                    await asyncio.sleep(0.01)
            # The worker follows the prompt no more: a subscription made now would get nothing.

        attached_start(late, the_prompt_runs)
        seen: list[tuple[str, int]] = []
        try:
            outcome = await late.client.start(a_request(), job_id=JOB, detached=False)
            async with asyncio.timeout(20):
                async for status in late.client.watch(
                    JOB, since=outcome.status, poll_interval_s=0.02, keepalive_s=3600
                ):
                    if not seen:
                        assert late.described <= 1 and not late.released.is_set()
                        late.released.set()
                    seen.append((status.state, status.progress.step))
        finally:
            await late.client.close()
    assert seen[0] == (JobState.RUNNING, 100)
    assert seen[-1] == (JobState.COMPLETED, 5000)


async def test_a_detached_or_failed_start_holds_no_subscription() -> None:
    late = LateFirstAnswer("ws://127.0.0.1:1/v1/live")
    assert late.client.live is not None

    async def nothing() -> None:
        return None

    async def refused() -> None:
        raise JobConflict(JOB, "a", "b")

    try:
        attached_start(late, nothing)
        await late.client.start(a_request(), job_id=JOB)
        assert late.client.live.take(JOB) is None, "detached: nobody said a watch follows"
        attached_start(late, refused)
        with pytest.raises(JobConflict):
            await late.client.start(a_request(), job_id=JOB, detached=False)
        assert late.client.live.take(JOB) is None
    finally:
        await late.client.close()


async def test_a_held_subscription_is_taken_once_or_let_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(starter.live, "HELD_S", 0.05)

    async def no_workers() -> list[str]:
        return []

    relay = LiveRelay(KEY, no_workers)
    await relay.hold(JOB)
    taken = relay.take(JOB)
    assert taken is not None and relay.take(JOB) is None
    taken.close()
    await relay.hold("job-unwatched")
    await asyncio.sleep(0.2)
    assert relay.take("job-unwatched") is None, "let go when no watch took it"
    await relay.hold("job-open")
    await relay.close()
    assert relay.take("job-open") is None


class Deaf(asyncio.Event):
    def set(self) -> None:
        return None


async def test_a_hold_returns_once_sent_and_an_idle_connection_is_kept_for_the_next() -> None:
    """An attached start sends its job's subscription before the start itself (so the worker
    has it before the job can run), and a connection no watch needs stays open for the next
    one: a burst after a quiet minute subscribes without a handshake first."""
    live = LiveProgress()
    async with pushing_worker(live) as url:

        async def workers() -> list[str]:
            return [url]

        relay = LiveRelay(KEY, workers)
        try:
            await relay.hold(JOB)
            link = relay._links[url]
            assert JOB in link.subscribed, "hold returned before the subscription was sent"
            await relay.hold("job-named-later")
            held = relay.take("job-named-later")
            assert held is not None
            held.follow_own(None)  # a status that names no worker yet: the candidates stay
            assert "job-named-later" in link.wanted
            held.close()
            relay.release(JOB)
            await asyncio.sleep(0.2)
            assert relay.connections == 1 and link.subscribed == set(), "idle, still open"
            # The link's own task is not woken (as on an event loop busy with a burst): the
            # hold writes on the open connection itself.
            link._changed = Deaf()
            await relay.hold("job-next")
            assert relay._links[url] is link and "job-next" in link.subscribed
            for _ in range(100):
                if "job-next" in live._subscribers:
                    break
                await asyncio.sleep(0.01)
            assert "job-next" in live._subscribers, "the worker has it"
        finally:
            await relay.close()
