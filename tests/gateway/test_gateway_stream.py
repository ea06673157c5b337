"""The gateway's pushed routes (docs/http-api.md, Events): SSE and WebSocket streams that say
what polling says, replay after a drop without missing or repeating anything, share one
follower per job, and keep an attached job alive only while someone follows or polls it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any, cast

import httpx
import pytest
import websockets

from gateway.feed import Cursor, Follower, Hub, Published, StreamEvent, Subscription, stream_events
from gateway.views import JobFacts, JobViews
from starter import JobClient, JobState, JobStatus
from tests.support.cli import RunningWorker
from tests.support.gateway import (
    JOURNAL_KINDS,
    RunningGateway,
    SseEvent,
    job_body,
    journal_key,
    sse_events,
    wait_state,
    without_query_strings,
)
from workflows.contracts import JobEvent, JobEvents


async def submit(http: httpx.AsyncClient, gateway: RunningGateway, body: dict[str, Any]) -> str:
    answer = await http.post(f"{gateway.url}/v1/jobs", json=body, headers=gateway.auth())
    assert answer.status_code == 201, answer.text
    job_id: str = answer.json()["job_id"]
    return job_id


async def full_journal(worker: RunningWorker, job_id: str) -> list[tuple[Any, ...]]:
    journal = await worker.client.events(job_id, 0)
    assert journal.first_seq <= 1, "the whole journal is still held"
    return [journal_key(entry.model_dump(mode="json")) for entry in journal.events]


async def test_a_stream_cancelled_as_an_event_arrives_ends() -> None:
    """Python 3.11's `asyncio.wait_for` returns what it awaited when a cancel lands as that
    completes, and loses the cancel: a stream whose client left would go on."""
    subscription = Subscription(cast(Follower, None), 4)
    waiting = asyncio.ensure_future(subscription.next(10))
    await asyncio.sleep(0)  # it waits for the next event
    subscription.offer(Published(dropped=True))  # one comes...
    waiting.cancel()  # ...as the stream is closed
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_pushed_and_polled_status_are_the_same_object(
    gateway: RunningGateway, http: httpx.AsyncClient, worker: RunningWorker
) -> None:
    job_id = await submit(http, gateway, job_body(steps=200))
    url = f"{gateway.url}/v1/jobs/{job_id}"
    pushed: list[dict[str, Any]] = []
    polled: list[dict[str, Any]] = []

    async def push() -> None:
        async for event in sse_events(http, f"{url}/events", gateway.auth()):
            if event.event == "status":
                pushed.append(event.data)

    async def poll() -> None:
        while not push_task.done():
            answer = await http.get(url, headers=gateway.auth())
            polled.append(answer.json())
            await asyncio.sleep(0.05)

    push_task = asyncio.create_task(push())
    await asyncio.gather(push_task, poll())
    polled.append((await http.get(url, headers=gateway.auth())).json())

    def key(view: dict[str, Any]) -> tuple[Any, ...]:
        return (view["seq"], view["progress"]["step"], json.dumps(view["checkpoint"]))

    by_key = {key(view): without_query_strings(view) for view in polled}
    compared = 0
    for view in pushed:
        if key(view) in by_key:
            assert without_query_strings(view) == by_key[key(view)]
            compared += 1
    assert pushed[-1]["state"] == "COMPLETED" and compared >= 2, (compared, len(pushed))
    assert pushed[-1]["links"]["self"] == f"/v1/jobs/{job_id}"
    assert pushed[-1]["artifacts"][0]["url"].startswith("http")


async def test_a_stream_resumed_from_its_last_id_misses_nothing_and_repeats_nothing(
    gateway: RunningGateway, http: httpx.AsyncClient, worker: RunningWorker
) -> None:
    job_id = await submit(http, gateway, job_body(steps=100))
    url = f"{gateway.url}/v1/jobs/{job_id}/events"
    received: list[SseEvent] = []
    last_id: str | None = None
    connections = 0
    ended = False
    while not ended:
        connections += 1
        # The first connection asks for everything (since=0), the others from their last id.
        headers = gateway.auth() | ({"Last-Event-ID": last_id} if last_id else {})
        taken = 0
        async for event in sse_events(http, f"{url}?since=0", headers):
            received.append(event)
            last_id = event.id or last_id
            if event.event == "end":
                ended = True
                break
            taken += 1
            if taken == 3:
                break  # drop the connection mid-job
    entries = [journal_key(e.data) for e in received if e.event in JOURNAL_KINDS]
    assert connections > 3, "the job outlived several connections"
    assert entries == await full_journal(worker, job_id)
    assert ("COMPLETED" in {e[2] for e in entries}) and any(
        e[1] == "output_stored" for e in entries
    )
    output = next(e for e in received if e.event == "output_stored")
    assert output.data["artifact"]["url"].startswith("http")


async def test_the_websocket_resumed_with_since_misses_nothing_and_repeats_nothing(
    gateway: RunningGateway, http: httpx.AsyncClient, worker: RunningWorker
) -> None:
    job_id = await submit(http, gateway, job_body(steps=100))
    base = f"{gateway.url.replace('http', 'ws')}/v1/jobs/{job_id}/ws"
    key = gateway.auth()["Authorization"]
    received: list[dict[str, Any]] = []
    since = "0"
    connections = 0
    ended = False
    while not ended:
        connections += 1
        url = f"{base}?since={since}"
        async with websockets.connect(url) as socket:
            await socket.send(json.dumps({"authorization": key}))
            for _ in range(3):
                message = json.loads(await socket.recv())
                assert message["event"] != "error", message
                received.append(message)
                since = message["id"]
                if message["event"] == "end":
                    ended = True
                    break
    entries = [journal_key(m["data"]) for m in received if m["event"] in JOURNAL_KINDS]
    assert connections > 3
    assert entries == await full_journal(worker, job_id)


async def test_many_streams_of_one_job_share_one_follower(
    gateway: RunningGateway, http: httpx.AsyncClient, worker: RunningWorker
) -> None:
    job_id = await submit(http, gateway, job_body(steps=60))
    url = f"{gateway.url}/v1/jobs/{job_id}/events?since=0"
    followed = asyncio.Event()
    counts: list[int] = []

    async def follow() -> list[tuple[Any, ...]]:
        entries = []
        async for event in sse_events(http, url, gateway.auth()):
            if event.event == "status" and not followed.is_set():
                subscribers = len(gateway.hub.followers[job_id].subscribers)
                counts.append(subscribers)
                if subscribers == 6:
                    followed.set()
            if event.event in JOURNAL_KINDS:
                entries.append(journal_key(event.data))
        return entries

    streams = await asyncio.gather(*(follow() for _ in range(6)))
    assert followed.is_set(), counts
    assert gateway.hub.started[job_id] == 1, "one follower for six streams"
    assert len({tuple(s) for s in streams}) == 1, "every stream saw the same entries"
    assert job_id not in gateway.hub.followers, "the follower left with the job's end"


async def ended_quietly(worker: RunningWorker, job_id: str) -> JobStatus:
    """The job's end, read by status queries, which are no client contact."""
    while True:
        status = await worker.client.status(job_id)
        if status.terminal:
            return status
        await asyncio.sleep(0.2)


async def test_an_attached_job_lives_while_followed_or_polled_and_is_abandoned_when_not(
    gateway: RunningGateway, http: httpx.AsyncClient, worker: RunningWorker
) -> None:
    policy = {"abandon_after_s": 2.0}
    url = f"{gateway.url}/v1/jobs"
    polled = await submit(http, gateway, job_body(steps=5000, detached=False, policy=policy))

    async def poll() -> list[str]:
        """Only polled, every half second, past its horizon several times over."""
        states = []
        for _ in range(16):
            answer = await http.get(f"{url}/{polled}", headers=gateway.auth())
            states.append(answer.json()["state"])
            await asyncio.sleep(0.5)
        return states

    polling = asyncio.create_task(poll())
    left = await submit(http, gateway, job_body(steps=5000, detached=False, policy=policy))
    # Followed past its horizon (the follower keeps it), then the stream is closed.
    async for event in sse_events(http, f"{url}/{left}/events", gateway.auth()):
        if event.event == "status" and event.data["last_client_contact_at"] is not None:
            if event.data["seq"] > 12:
                break
    # (It waits behind the other on the simulator's one queue: attached all the same.)
    assert not (await worker.client.status(left)).terminal
    final = await ended_quietly(worker, left)
    assert final.state == JobState.ABANDONED, final.error
    assert left not in gateway.hub.followers, "its follower left after the grace period"
    states = await polling
    assert states[-1] == "RUNNING" and "ABANDONED" not in states, states
    cancel = await http.post(f"{url}/{polled}/cancel", headers=gateway.auth())
    assert cancel.status_code == 202
    assert (await wait_state(http, gateway, polled))["state"] == "CANCELLED"


# -- where a stream resumes, when several entries share a seq (no stack needed) ---------------

AT = datetime(2026, 1, 1, tzinfo=UTC)
JOURNAL = [
    JobEvent(seq=1, at=AT, kind="state", state=JobState.QUEUED),
    JobEvent(seq=5, at=AT, kind="state", state=JobState.RUNNING),
    JobEvent(seq=5, at=AT, kind="progress", percent=10),
    JobEvent(seq=7, at=AT, kind="progress", percent=50),
    JobEvent(seq=9, at=AT, kind="state", state=JobState.COMPLETED),
    JobEvent(seq=9, at=AT, kind="progress", percent=100),
]


class EndedJobClient:
    """What a stream asks of `JobClient`, for a job that has ended with `JOURNAL`."""

    store = None
    final = JobStatus(job_id="acme.done", state=JobState.COMPLETED, seq=9)

    async def watch(self, job_id: str, **_: Any) -> AsyncIterator[JobStatus]:
        yield self.final

    async def journal(self, job_id: str, since: int = 0) -> JobEvents:
        return JobEvents(status=self.final, events=[e for e in JOURNAL if e.seq > since])

    async def status(self, job_id: str) -> JobStatus:
        return self.final


async def replayed(since: str) -> list[StreamEvent]:
    client = cast(JobClient, EndedJobClient())

    async def connect() -> JobClient:
        return client

    hub = Hub(connect, JobViews(client, JobFacts()), grace_s=0)
    stream = stream_events(hub, client, "acme.done", Cursor.parse(since), heartbeat_s=5)
    return [event async for event in stream if event is not None]


async def test_a_stream_cut_between_entries_of_one_seq_resumes_at_the_next_entry() -> None:
    everything = await replayed("0")
    assert [e.id for e in everything] == ["1", "5.0", "5", "7", "9.0", "9", "9", "9"]
    assert [e.kind for e in everything][-2:] == ["status", "end"]
    entries = [e for e in everything if e.kind in JOURNAL_KINDS]
    expected = [journal_key(e.model_dump(mode="json")) for e in JOURNAL]
    for cut, last in enumerate(entries):
        rest = [e for e in await replayed(last.id) if e.kind in JOURNAL_KINDS]
        assert [journal_key(e.data) for e in entries[: cut + 1] + rest] == expected, last.id
