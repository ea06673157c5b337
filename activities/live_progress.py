"""Live progress: the steps of the prompts this worker follows, pushed to the gateways that ask.

A client reads a running job's step from the follow activity's heartbeat, which it polls
(`starter.progress`): at least a poll interval late. A gateway whose SSE or WebSocket clients
follow a job wants the step as it happens, so a worker may serve a WebSocket of its own
(`WorkerSettings.live_progress_port`) and put its address in every follow heartbeat
(`FollowHeartbeat.live`). A gateway that reads that address from a job's description connects
(one connection per worker, however many jobs), subscribes to the job by id, and gets each
new step of it as it happens. Temporal stays the record: the push carries nothing the next
heartbeat does not, and a gateway that loses it falls back to polling.

The protocol, JSON text messages on `ws://<host>:<port>/v1/live`, the key in an
`Authorization: Bearer <key>` header (a shared secret, `DURABLE_COMFY_LIVE_PROGRESS_KEY`):

    gateway → worker   {"subscribe": ["<job id>", ...]}   {"unsubscribe": [...]}
    worker → gateway   {"beats": [{"job_id": "<job id>", "beat": <FollowHeartbeat>}, ...]}

A subscription to a job the worker follows is answered at once with its current beat; later
beats go whenever the prompt moves. A connection's beats are coalesced: at most one message
per `FLUSH_GAP_S`, each job in it once, at its latest, so a slow reader costs the worker one
pending entry per job, never a queue. A beat is built only when it is sent: a step of a job
nobody subscribed to costs one dictionary lookup.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import AsyncIterator, Callable, Iterator
from http import HTTPStatus
from typing import Any

import structlog
from pydantic import SecretStr
from temporalio.common import MetricCounter, MetricMeter
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from activities.metrics import PREFIX
from workflows.activity_io import FollowHeartbeat
from workflows.shared import LIVE_IN_IDENTITY

log = structlog.get_logger(__name__)

PATH = "/v1/live"
# At most one message per connection this often: below it the beats of many jobs share one.
FLUSH_GAP_S = 0.01
# A subscription message names at most this many jobs, and a connection holds at most this many.
MAX_SUBSCRIBED = 100_000
MAX_MESSAGE_BYTES = 1024 * 1024

BeatBuilder = Callable[[], FollowHeartbeat]


class _Subscriber:
    """One gateway's connection: the jobs it asked for, and their beats waiting to be sent."""

    def __init__(self, connection: ServerConnection) -> None:
        self.connection = connection
        self.jobs: set[str] = set()
        self.pending: dict[str, BeatBuilder] = {}
        self.wake = asyncio.Event()

    def offer(self, job_id: str, build: BeatBuilder) -> None:
        self.pending[job_id] = build
        self.wake.set()

    async def send_forever(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            batch, self.pending = self.pending, {}
            beats = []
            for job_id, build in batch.items():
                try:
                    beat = build().model_dump(mode="json", exclude={"artifacts"})
                except Exception:  # a beat that cannot be built is one not pushed: never fatal
                    log.warning("live_beat_unbuilt", job_id=job_id, exc_info=True)
                    continue
                beats.append({"job_id": job_id, "beat": beat})
            if beats:
                await self.connection.send(json.dumps({"beats": beats}, separators=(",", ":")))
            await asyncio.sleep(FLUSH_GAP_S)


def poller_identity(identity: str, url: str | None) -> str:
    """The identity the worker polls under: its own, and where it pushes (when it does), so a
    client that lists the task queue's pollers (`starter.pollers`) can subscribe to a job
    there before the job's status names its worker (`starter.live`)."""
    return identity if url is None else f"{identity}{LIVE_IN_IDENTITY}{url}"


class LiveProgress:
    """The followed prompts of this worker and the gateways subscribed to them.

    `following(job_id, build)` registers a follow attempt for as long as it runs; `moved(job_id)`
    says its beat changed. Without a server (`url` None) both cost nothing.

    With a `meter` (and a server) it counts whether each follow's steps could be pushed from
    its first: `live_follows{subscribed}` (a gateway had asked for the job before its follow
    began, or not) and `live_subscribed_late` (one asked while the follow ran). A job whose
    watcher subscribed late had its first steps seen only at the watcher's poll pace."""

    def __init__(self, url: str | None = None, meter: MetricMeter | None = None) -> None:
        self.url = url
        self._builders: dict[str, BeatBuilder] = {}
        self._subscribers: dict[str, set[_Subscriber]] = {}
        self._follows: MetricCounter | None = None
        self._subscribed_late: MetricCounter | None = None
        if meter is not None and url is not None:
            self._follows = meter.create_counter(
                PREFIX + "live_follows", "Follow attempts begun, by whether a gateway awaited them"
            )
            self._subscribed_late = meter.create_counter(
                PREFIX + "live_subscribed_late", "Subscriptions to a job whose follow had begun"
            )

    @contextlib.contextmanager
    def following(self, job_id: str, build: BeatBuilder) -> Iterator[None]:
        if self._follows is not None:
            awaited = "yes" if self._subscribers.get(job_id) else "no"
            self._follows.add(1, {"subscribed": awaited})
        self._builders[job_id] = build
        try:
            self.moved(job_id)
            yield
        finally:
            if self._builders.get(job_id) is build:
                del self._builders[job_id]

    def moved(self, job_id: str) -> None:
        subscribers = self._subscribers.get(job_id)
        if not subscribers:
            return
        build = self._builders.get(job_id)
        if build is None:
            return
        for subscriber in subscribers:
            subscriber.offer(job_id, build)

    def _subscribe(self, subscriber: _Subscriber, job_ids: list[str]) -> None:
        for job_id in job_ids:
            if job_id in subscriber.jobs or len(subscriber.jobs) >= MAX_SUBSCRIBED:
                continue
            subscriber.jobs.add(job_id)
            self._subscribers.setdefault(job_id, set()).add(subscriber)
            build = self._builders.get(job_id)
            if build is not None:
                subscriber.offer(job_id, build)
                if self._subscribed_late is not None:
                    self._subscribed_late.add(1)

    def _unsubscribe(self, subscriber: _Subscriber, job_ids: list[str] | set[str]) -> None:
        for job_id in list(job_ids):
            subscriber.jobs.discard(job_id)
            subscriber.pending.pop(job_id, None)
            others = self._subscribers.get(job_id)
            if others is not None:
                others.discard(subscriber)
                if not others:
                    del self._subscribers[job_id]

    async def serve_connection(self, connection: ServerConnection) -> None:
        """One gateway's connection, until it closes."""
        subscriber = _Subscriber(connection)
        sender = asyncio.create_task(subscriber.send_forever(), name="live-progress-send")
        try:
            async for message in connection:
                asked = _read_request(message)
                if asked is None:
                    await connection.close(1008, "not a live-progress request")
                    return
                self._subscribe(subscriber, asked.get("subscribe", []))
                self._unsubscribe(subscriber, asked.get("unsubscribe", []))
        except ConnectionClosed:
            pass
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
                await sender
            self._unsubscribe(subscriber, set(subscriber.jobs))


def _read_request(message: str | bytes) -> dict[str, list[str]] | None:
    """`{"subscribe": [...], "unsubscribe": [...]}`, either optional; None if it is not one."""
    try:
        asked: Any = json.loads(message)
    except ValueError:
        return None
    if not isinstance(asked, dict) or not set(asked) <= {"subscribe", "unsubscribe"}:
        return None
    for ids in asked.values():
        if not isinstance(ids, list) or len(ids) > MAX_SUBSCRIBED:
            return None
        if not all(isinstance(i, str) and 0 < len(i) <= 1000 for i in ids):
            return None
    return asked


def authorized(key: SecretStr) -> Callable[[ServerConnection, Request], Response | None]:
    """The handshake check: the path, and the shared key (compared in constant time)."""
    expected = f"Bearer {key.get_secret_value()}".encode()

    def check(connection: ServerConnection, request: Request) -> Response | None:
        if request.path != PATH:
            return connection.respond(HTTPStatus.NOT_FOUND, "not found\n")
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return connection.respond(HTTPStatus.UNAUTHORIZED, "a live-progress key is needed\n")
        return None

    return check


@contextlib.asynccontextmanager
async def serving(
    live: LiveProgress, host: str, port: int, key: SecretStr
) -> AsyncIterator[Server]:
    """Serve `live` on host:port while the block runs."""
    server = await serve(
        live.serve_connection,
        host.strip("[]"),
        port,
        process_request=authorized(key),
        max_size=MAX_MESSAGE_BYTES,
        # The gateway's connection is long-lived and idle between jobs: pings find a dead peer.
        ping_interval=20,
        ping_timeout=20,
        compression=None,
    )
    log.info("live_progress_serving", url=live.url)
    try:
        yield server
    finally:
        server.close()
        await server.wait_closed()
