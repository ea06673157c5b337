"""Live progress (activities/live_progress.py, gateway/live.py): a worker pushes each followed
job's steps to the gateways subscribed to it, so an SSE client sees a step as it happens and
not at the gateway's next poll; the push is refused without the key, coalesced for a slow
reader, and a worker that cannot be reached costs freshness, never the job."""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import pytest_asyncio
import websockets
from pydantic import SecretStr, ValidationError
from websockets.asyncio.client import connect

import starter.live
from activities.live_progress import LiveProgress, serving
from configuration.settings import GatewaySettings, WorkerSettings
from devstack.free_ports import free_port
from devstack.models import RunningStack
from starter import JobClient
from starter.live import LiveRelay
from starter.pollers import Poller, live_pollers, workflow_pollers
from tests.support.cli import RunningWorker, running_worker, s3_settings
from tests.support.gateway import (
    KEYS,
    TEST_SETTINGS,
    RunningGateway,
    job_body,
    serving_app,
    sse_events,
)
from workflows.activity_io import FollowHeartbeat
from workflows.contracts import Checkpoint

KEY = "live-" + uuid.uuid4().hex
KEY_S = SecretStr(KEY)
# The gateway's poll, slowed so that it shows few of the steps between a job's milestones: a
# stream that sees many of them got them by push. (The poll still finds where the job's worker
# pushes from: a stream subscribes there at its first poll of the running job.)
SLOW_POLL_S = 1.0


def beat_at(step: int) -> FollowHeartbeat:
    checkpoint = Checkpoint(
        job_id="job", prompt_id="p-1", client_id="c-1", step=step, total_steps=100
    )
    return FollowHeartbeat(checkpoint=checkpoint, stage="running")


@asynccontextmanager
async def live_server(live: LiveProgress) -> AsyncIterator[str]:
    port = free_port()
    live.url = f"ws://127.0.0.1:{port}/v1/live"
    async with serving(live, "127.0.0.1", port, SecretStr(KEY)):
        yield live.url


async def received(connection: Any, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    message = await asyncio.wait_for(connection.recv(), timeout_s)
    beats: list[dict[str, Any]] = json.loads(message)["beats"]
    return beats


# --- the worker's server ----------------------------------------------------------------------


async def test_a_subscriber_gets_the_current_step_at_once_then_the_latest_of_each_burst() -> None:
    live = LiveProgress()
    at = {"step": 3}
    async with live_server(live) as url:
        with (
            live.following("job-1", lambda: beat_at(at["step"])),
            live.following("job-2", lambda: beat_at(0)),
        ):
            headers = {"Authorization": f"Bearer {KEY}"}
            async with connect(url, additional_headers=headers) as connection:
                await connection.send(json.dumps({"subscribe": ["job-1", "job-unknown"]}))
                [first] = await received(connection)
                assert first["job_id"] == "job-1" and first["beat"]["checkpoint"]["step"] == 3
                assert "artifacts" not in first["beat"]
                for step in range(4, 204):
                    at["step"] = step
                    live.moved("job-1")
                    live.moved("job-2")  # nobody asked for it: never sent
                messages = 0
                last = -1
                while last < 203:
                    beats = await received(connection)
                    messages += 1
                    assert {b["job_id"] for b in beats} == {"job-1"}
                    last = beats[-1]["beat"]["checkpoint"]["step"]
                # Two hundred moves in one burst reach the reader as its latest step, not as
                # two hundred messages queued behind one another.
                assert messages <= 3, messages
                await connection.send(json.dumps({"unsubscribe": ["job-1"]}))
                await asyncio.sleep(0.1)
                at["step"] = 500
                live.moved("job-1")
                with pytest.raises(TimeoutError):
                    await received(connection, timeout_s=0.5)


class CountingMeter:
    """A stand-in for the worker's metric meter: each counter's adds, by labels."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[tuple[tuple[str, str], ...], int]] = {}

    def create_counter(self, name: str, description: str | None = None) -> Any:
        counts = self.counts.setdefault(name, {})

        class Counter:
            def add(self, value: int, labels: dict[str, str] | None = None) -> None:
                key = tuple(sorted((labels or {}).items()))
                counts[key] = counts.get(key, 0) + value

        return Counter()


async def test_the_worker_counts_follows_begun_subscribed_and_subscriptions_that_came_late() -> (
    None
):
    """What a benchmark's late step is told by: was the watcher subscribed before the follow?"""
    meter = CountingMeter()
    live = LiveProgress("ws://placeholder", meter)  # type: ignore[arg-type]
    async with live_server(live) as url:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with connect(url, additional_headers=headers) as connection:
            await connection.send(json.dumps({"subscribe": ["awaited"]}))
            await until(lambda: "awaited" in live._subscribers)
            with live.following("awaited", lambda: beat_at(1)):
                await received(connection)
            with live.following("alone", lambda: beat_at(2)):
                await connection.send(json.dumps({"subscribe": ["alone"]}))
                [late] = await received(connection)
                assert late["job_id"] == "alone"
    follows = meter.counts["durable_comfy_live_follows"]
    assert follows == {(("subscribed", "yes"),): 1, (("subscribed", "no"),): 1}
    assert meter.counts["durable_comfy_live_subscribed_late"] == {(): 1}
    # A worker that serves no live progress counts nothing.
    quiet = CountingMeter()
    with LiveProgress(None, quiet).following("job", lambda: beat_at(0)):  # type: ignore[arg-type]
        pass
    assert quiet.counts == {}


async def test_a_relay_closed_while_connected_leaves_no_wait_pending() -> None:
    """A link closed while it waits for a change must not leave that wait behind: asyncio
    logs a pending task destroyed with its link as an error (seen in `make bench`)."""
    live = LiveProgress()
    relay = LiveRelay(SecretStr(KEY))
    got: list[int] = []
    with live.following("job-1", lambda: beat_at(4)):
        async with live_server(live) as url:
            relay.subscribe(url, "job-1", lambda beat: got.append(beat.checkpoint.step))
            await until(lambda: got == [4])
            await relay.close()
    current = asyncio.current_task()
    left = [
        task
        for task in asyncio.all_tasks()
        if task is not current and "Event.wait" in repr(task.get_coro())
    ]
    assert left == []


@pytest.mark.parametrize("given", [None, "a-wrong-key-of-32-characters-abc"])
async def test_a_connection_without_the_key_is_refused(given: str | None) -> None:
    live = LiveProgress()
    async with live_server(live) as url:
        headers = {} if given is None else {"Authorization": f"Bearer {given}"}
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with connect(url, additional_headers=headers):
                pass
        assert refused.value.response.status_code == 401


async def test_the_relay_resubscribes_after_the_worker_comes_back() -> None:
    live = LiveProgress()
    port = free_port()
    live.url = f"ws://127.0.0.1:{port}/v1/live"
    relay = LiveRelay(SecretStr(KEY))
    got: list[int] = []
    step = 1
    try:
        with live.following("job-1", lambda: beat_at(step)):
            async with serving(live, "127.0.0.1", port, SecretStr(KEY)):
                relay.subscribe(live.url, "job-1", lambda beat: got.append(beat.checkpoint.step))
                await until(lambda: got == [1])
                assert relay.connections == 1
            # The worker's server is gone (a restart), and comes back on the same address.
            step = 7
            async with serving(live, "127.0.0.1", port, SecretStr(KEY)):
                await until(lambda: got[-1:] == [7], timeout_s=20)
    finally:
        await relay.close()
    assert relay.connections == 0


async def until(check: Any, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


# --- end to end: a worker of the local stack, a gateway in front of it -------------------------


@asynccontextmanager
async def gateway_for(
    stack: RunningStack, worker: RunningWorker, poll_s: float
) -> AsyncIterator[RunningGateway]:
    keys = ",".join(f"{tenant}:{key}" for tenant, key in KEYS.items())
    given: dict[str, Any] = {
        **TEST_SETTINGS,
        "DURABLE_COMFY_API_KEYS": keys,
        "DURABLE_COMFY_GATEWAY_POLL_S": poll_s,
    }
    settings = GatewaySettings(**given)

    async def connect() -> JobClient:
        # The gateway's client reads the key from DURABLE_COMFY_LIVE_PROGRESS_KEY, as any does.
        return await JobClient.connect(
            stack.temporal_address,
            stack.namespace,
            task_queue=worker.task_queue,
            s3=s3_settings(stack),
            live_progress_key=SecretStr(KEY),
        )

    async with serving_app(settings, connect) as running:
        yield running


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def pushing_worker(local_stack: RunningStack) -> AsyncIterator[RunningWorker]:
    async with running_worker(
        local_stack,
        "live",
        live_progress_port=free_port(),
        live_progress_key=SecretStr(KEY),
    ) as running:
        yield running


async def followed(
    http: httpx.AsyncClient, gateway: RunningGateway, steps: int
) -> tuple[str, list[dict[str, Any]]]:
    """A job submitted through the gateway and its SSE status events, to its end."""
    answer = await http.post(
        f"{gateway.url}/v1/jobs", json=job_body(steps=steps), headers=gateway.auth()
    )
    assert answer.status_code == 201, answer.text
    job_id: str = answer.json()["job_id"]
    statuses = [
        event.data
        async for event in sse_events(
            http, f"{gateway.url}/v1/jobs/{job_id}/events", gateway.auth()
        )
        if event.event == "status"
    ]
    return job_id, statuses


def steps_between_milestones(statuses: list[dict[str, Any]]) -> int:
    """Status events that moved the step without the job's own status changing (its seq)."""
    return sum(
        1
        for before, after in itertools.pairwise(statuses)
        if after["seq"] == before["seq"] and after["progress"]["step"] > before["progress"]["step"]
    )


async def test_a_stream_sees_the_steps_between_milestones_by_push(
    local_stack: RunningStack, pushing_worker: RunningWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(starter.live, "IDLE_S", 1.0)
    async with (
        gateway_for(local_stack, pushing_worker, SLOW_POLL_S) as gateway,
        httpx.AsyncClient(trust_env=False, timeout=60) as http,
    ):
        relay = (await gateway.state.client()).live
        assert relay is not None
        connections: set[int] = set()

        async def count_connections() -> None:
            while True:
                connections.add(relay.connections)
                await asyncio.sleep(0.05)

        counting = asyncio.create_task(count_connections())
        try:
            both = await asyncio.gather(*(followed(http, gateway, steps=300) for _ in range(2)))
        finally:
            counting.cancel()
        # One connection to the worker served both jobs; once no stream follows a job there,
        # the gateway keeps it idle for a while (IDLE_S, shortened here), then lets it go.
        assert max(connections) == 1, connections
        await until(lambda: relay.connections == 0)
        # The worker's address is the gateway's business: no HTTP client sees it.
        job_id = both[0][0]
        answer = await http.get(f"{gateway.url}/v1/jobs/{job_id}", headers=gateway.auth())
        assert answer.status_code == 200 and "live_progress" not in answer.json()
    for _, statuses in both:
        assert statuses[-1]["state"] == "COMPLETED"
        # 300 steps of 20 ms run 6 s, with a milestone at each tenth of the steps: a poll every
        # second moves the step between milestones about 6 times, the push dozens.
        assert steps_between_milestones(statuses) >= 30, [
            (s["seq"], s["progress"]["step"]) for s in statuses
        ]
        steps = [s["progress"]["step"] for s in statuses]
        assert steps == sorted(steps), "a stream never goes back"
        assert all("live_progress" not in s for s in statuses)


async def test_a_pushing_worker_says_where_in_its_poller_identity(
    pushing_worker: RunningWorker,
) -> None:
    """A watch subscribes there before its job's status names the worker (starter/live.py)."""
    temporal = pushing_worker.client.temporal
    pollers: list[Poller] = []
    async with asyncio.timeout(20):  # listed once its first poll reaches the server
        while not pollers:
            pollers = live_pollers(await workflow_pollers(temporal, pushing_worker.task_queue))
            await asyncio.sleep(0.1)
    assert all(" live=" not in poller.identity for poller in pollers)
    watcher = JobClient(temporal, task_queue=pushing_worker.task_queue, live_progress_key=KEY_S)
    try:
        assert watcher.live is not None
        found = await watcher.live.workers()
    finally:
        await watcher.close()
    assert len(found) == 1 and found[0].startswith("ws://127.0.0.1:")
    assert found == [poller.live for poller in pollers if poller.live is not None]


async def test_a_worker_whose_push_cannot_be_reached_is_followed_by_polling(
    local_stack: RunningStack,
) -> None:
    # The worker serves its push on one port but names another, where nothing listens.
    nowhere = f"ws://127.0.0.1:{free_port()}/v1/live"
    async with (
        running_worker(
            local_stack,
            "live-lost",
            live_progress_port=free_port(),
            live_progress_url=nowhere,
            live_progress_key=SecretStr(KEY),
        ) as worker,
        gateway_for(local_stack, worker, poll_s=0.2) as gateway,
        httpx.AsyncClient(trust_env=False, timeout=60) as http,
    ):
        _, statuses = await followed(http, gateway, steps=100)
    assert statuses[-1]["state"] == "COMPLETED"
    assert len({s["progress"]["step"] for s in statuses}) >= 5


def test_a_push_needs_its_key_and_an_address_gateways_can_reach() -> None:
    with pytest.raises(ValidationError, match="DURABLE_COMFY_LIVE_PROGRESS_KEY"):
        WorkerSettings(live_progress_port=7441)
    with pytest.raises(ValidationError, match="DURABLE_COMFY_LIVE_PROGRESS_KEY"):
        WorkerSettings(live_progress_port=7441, live_progress_key=SecretStr("short"))
    with pytest.raises(ValidationError, match="DURABLE_COMFY_LIVE_PROGRESS_URL"):
        WorkerSettings(
            live_progress_port=7441, live_progress_host="0.0.0.0", live_progress_key=SecretStr(KEY)
        )
    with pytest.raises(ValidationError):
        WorkerSettings(live_progress_url="http://10.0.0.5:7441/v1/live")
    on_loopback = WorkerSettings(live_progress_port=7441, live_progress_key=SecretStr(KEY))
    assert on_loopback.live_progress_address == "ws://127.0.0.1:7441/v1/live"
    assert KEY not in repr(on_loopback)
    assert WorkerSettings().live_progress_address is None
