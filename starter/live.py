"""A client's side of live progress: steps pushed by the worker that follows a job.

A job's description names where the worker following it pushes its steps
(`JobStatus.live_progress`, from the follow heartbeat; activities/live_progress.py has the
protocol). A client holding the workers' key (`DURABLE_COMFY_LIVE_PROGRESS_KEY`) subscribes
there while it watches the job (`JobClient.watch`) and sees each step as it happens instead of
at its next poll. `LiveRelay` keeps one connection per worker address, shared by every job
watched on it, subscribes and unsubscribes as watches come and go, and reconnects with backoff
while anyone still wants that worker. The push is only a faster way to see the job: polling
goes on underneath, so a worker that cannot be reached, or a connection that drops, costs
freshness, never correctness.

A job's status names its worker only once the job's first answer comes back, which on a busy
server can be seconds after a short job has run. So a watch also subscribes, from its start, on
every worker that polls the task queue and pushes (each says where in its poller identity:
`starter.pollers.split_identity`), until a status names the one that follows the job. A worker
keeps the subscription of a job it does not follow yet and pushes the job's first step when it
starts following it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import structlog
from pydantic import SecretStr, ValidationError
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from workflows.activity_io import FollowHeartbeat

log = structlog.get_logger("starter.live")

OnBeat = Callable[[FollowHeartbeat], None]
# Reconnecting to a worker: the first wait, doubled up to the last, each jittered.
RECONNECT_FIRST_S = 0.5
RECONNECT_MAX_S = 15.0
OPEN_TIMEOUT_S = 5.0
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# The task queue's pushing workers are listed again after this long (one DescribeTaskQueue for
# every watch of the client meanwhile), and at most this many are subscribed on before a status
# names the job's own.
WORKERS_FRESH_S = 15.0
MAX_CANDIDATES = 16

Discover = Callable[[], Awaitable[list[str]]]


def pushable(url: str | None) -> bool:
    return url is not None and url.startswith(("ws://", "wss://")) and len(url) <= 500


class _WorkerLink:
    """The connection to one worker, for as long as some job on it is wanted."""

    def __init__(self, relay: LiveRelay, url: str) -> None:
        self.relay = relay
        self.url = url
        self.wanted: dict[str, set[OnBeat]] = {}
        self._changed = asyncio.Event()
        self.task = asyncio.create_task(self._run(), name=f"live {url}")

    def want(self, job_id: str, on_beat: OnBeat) -> None:
        self.wanted.setdefault(job_id, set()).add(on_beat)
        self._changed.set()

    def drop(self, job_id: str, on_beat: OnBeat) -> None:
        callbacks = self.wanted.get(job_id)
        if callbacks is None:
            return
        callbacks.discard(on_beat)
        if not callbacks:
            del self.wanted[job_id]
            self._changed.set()

    async def _run(self) -> None:
        delay = RECONNECT_FIRST_S
        headers = {"Authorization": f"Bearer {self.relay.key.get_secret_value()}"}
        try:
            while self.wanted:
                try:
                    async with connect(
                        self.url,
                        additional_headers=headers,
                        open_timeout=OPEN_TIMEOUT_S,
                        max_size=MAX_MESSAGE_BYTES,
                        compression=None,
                        ping_interval=20,
                        ping_timeout=20,
                    ) as connection:
                        log.info("live_progress_connected", url=self.url)
                        delay = RECONNECT_FIRST_S
                        await self._exchange(connection)
                except (
                    OSError,
                    TimeoutError,
                    ConnectionClosed,
                    InvalidHandshake,
                    InvalidURI,
                ) as exc:
                    log.info("live_progress_lost", url=self.url, error=type(exc).__name__)
                if not self.wanted:
                    break
                await asyncio.sleep(delay * (0.5 + random.random() / 2))
                delay = min(RECONNECT_MAX_S, delay * 2)
        finally:
            self.relay._forget(self)

    async def _exchange(self, connection: ClientConnection) -> None:
        """Keep the worker's subscriptions equal to `wanted` and hand out what it pushes, until
        the connection closes or nothing is wanted."""
        reader = asyncio.create_task(self._read(connection))
        subscribed: set[str] = set()
        try:
            while self.wanted and not reader.done():
                self._changed.clear()
                wanted = set(self.wanted)
                asked: dict[str, list[str]] = {}
                if wanted - subscribed:
                    asked["subscribe"] = sorted(wanted - subscribed)
                if subscribed - wanted:
                    asked["unsubscribe"] = sorted(subscribed - wanted)
                if asked:
                    await connection.send(json.dumps(asked))
                    subscribed = wanted
                changed = asyncio.create_task(self._changed.wait())
                await asyncio.wait({reader, changed}, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
                await reader
        if reader.done() and not reader.cancelled() and reader.exception() is not None:
            raise reader.exception()  # type: ignore[misc]

    async def _read(self, connection: ClientConnection) -> None:
        async for message in connection:
            for job_id, beat in _beats(message):
                for on_beat in list(self.wanted.get(job_id, ())):
                    on_beat(beat)


def _beats(message: str | bytes) -> list[tuple[str, FollowHeartbeat]]:
    """The beats of one pushed message; what cannot be read is left out."""
    try:
        pushed: Any = json.loads(message)
    except ValueError:
        return []
    found: list[tuple[str, FollowHeartbeat]] = []
    for item in pushed.get("beats", []) if isinstance(pushed, dict) else []:
        if not isinstance(item, dict) or not isinstance(item.get("job_id"), str):
            continue
        try:
            found.append((item["job_id"], FollowHeartbeat.model_validate(item.get("beat"))))
        except ValidationError:
            continue
    return found


class LiveRelay:
    """This gateway's connections to the workers that push live progress, one per address.

    `discover`: the addresses of the workers that push, as the task queue's pollers say (None:
    a watch subscribes only where its job's status says)."""

    def __init__(self, key: SecretStr, discover: Discover | None = None) -> None:
        self.key = key
        self._links: dict[str, _WorkerLink] = {}
        self._discover = discover
        self._workers: list[str] = []
        self._workers_at = float("-inf")
        self._listing: asyncio.Future[list[str]] | None = None

    async def workers(self) -> list[str]:
        """The pushing workers of the task queue (at most `MAX_CANDIDATES`), listed at most
        every `WORKERS_FRESH_S` whoever asks; none when they cannot be listed. Only the first
        listing is waited for: after it, the last one is answered at once and a stale one is
        listed again meanwhile (a burst's watches would otherwise all wait on a busy server,
        for workers that seldom change)."""
        if self._discover is None:
            return []
        self.list_soon()
        if self._workers_at == float("-inf"):
            assert self._listing is not None
            return await asyncio.shield(self._listing)
        return self._workers

    def list_soon(self) -> None:
        """Start listing the pushing workers when the last listing is stale (or none was made)
        and none is under way, without waiting: a client that submits a job lists them while
        its submission goes, and has them by the time it watches the job."""
        if self._discover is None:
            return
        stale = asyncio.get_running_loop().time() - self._workers_at >= WORKERS_FRESH_S
        if stale and (self._listing is None or self._listing.done()):
            self._listing = asyncio.ensure_future(self._list(self._discover))

    async def _list(self, discover: Discover) -> list[str]:
        try:
            found = [url for url in await discover() if pushable(url)]
        except Exception as exc:  # advisory: the watch subscribes where the job says
            log.info("live_workers_unlisted", error=type(exc).__name__)
            found = []
        self._workers = sorted(set(found))[:MAX_CANDIDATES]
        self._workers_at = asyncio.get_running_loop().time()
        return self._workers

    def subscribe(self, url: str, job_id: str, on_beat: OnBeat) -> None:
        link = self._links.get(url)
        if link is None or link.task.done():
            link = self._links[url] = _WorkerLink(self, url)
        link.want(job_id, on_beat)

    def unsubscribe(self, url: str, job_id: str, on_beat: OnBeat) -> None:
        link = self._links.get(url)
        if link is not None:
            link.drop(job_id, on_beat)

    @property
    def connections(self) -> int:
        return len(self._links)

    def _forget(self, link: _WorkerLink) -> None:
        if self._links.get(link.url) is link:
            del self._links[link.url]

    async def close(self) -> None:
        if self._listing is not None:
            self._listing.cancel()
        links = list(self._links.values())
        for link in links:
            link.task.cancel()
        await asyncio.gather(*(link.task for link in links), return_exceptions=True)


class Pushed:
    """One watch's subscription to its job's pushed steps: the latest beat, and a wake-up."""

    def __init__(self, relay: LiveRelay, job_id: str) -> None:
        self.relay = relay
        self.job_id = job_id
        # Where it is subscribed, each with its own callback (so a beat's source is known).
        self._at: dict[str, OnBeat] = {}
        self.beat: FollowHeartbeat | None = None
        self._beat_from: str | None = None
        self._arrived = asyncio.Event()

    def follow(self, url: str | None) -> None:
        """Subscribe at `url` only (None or not a WebSocket address: nowhere)."""
        self.follow_any([url])

    def follow_any(self, urls: Iterable[str | None]) -> None:
        """Subscribe at each of `urls` that is a WebSocket address, leaving any other; the
        latest beat is forgotten when the worker that sent it is left."""
        wanted = {url for url in urls if url is not None and pushable(url)}
        for url in set(self._at) - wanted:
            self.relay.unsubscribe(url, self.job_id, self._at.pop(url))
        for url in wanted - set(self._at):
            on_beat = self._at[url] = functools.partial(self._on_beat, url)
            self.relay.subscribe(url, self.job_id, on_beat)
        if self._beat_from not in self._at:
            self.beat, self._beat_from = None, None

    async def next(self, timeout_s: float) -> FollowHeartbeat | None:
        """The latest beat once one comes, or None after `timeout_s` without one."""
        try:
            await asyncio.wait_for(self._arrived.wait(), timeout_s)
        except TimeoutError:
            return None
        self._arrived.clear()
        return self.beat

    async def next_or(self, other: asyncio.Future[Any]) -> FollowHeartbeat | None:
        """The latest beat once one comes, or None once `other` is done first."""
        arrived = asyncio.ensure_future(self._arrived.wait())
        try:
            await asyncio.wait({arrived, other}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            arrived.cancel()
        if not self._arrived.is_set():
            return None
        self._arrived.clear()
        return self.beat

    def close(self) -> None:
        self.follow_any([])

    def _on_beat(self, url: str, beat: FollowHeartbeat) -> None:
        self.beat, self._beat_from = beat, url
        self._arrived.set()
