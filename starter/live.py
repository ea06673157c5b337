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
starts following it. A client that starts a job attached (`JobClient.start(detached=False)`,
as `durable-comfy submit --watch`) subscribes even before the job exists (`LiveRelay.hold`), and
keeps a connection no watch needs open for a while: on a busy machine a short job can run to
its end before its start call returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import time
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
# A connection to a worker no watch needs any more is kept this long, for the next one.
IDLE_S = 300.0
# An attached start waits at most this long for its job's subscription to be sent.
HOLD_WAIT_S = 1.0
# A job subscribed to before it starts (`LiveRelay.hold`) is let go after this long if no watch
# takes the subscription.
HELD_S = 60.0

Discover = Callable[[], Awaitable[list[str]]]


def pushable(url: str | None) -> bool:
    return url is not None and url.startswith(("ws://", "wss://")) and len(url) <= 500


class _WorkerLink:
    """The connection to one worker, while some job on it is wanted and `IDLE_S` after."""

    def __init__(self, relay: LiveRelay, url: str) -> None:
        self.relay = relay
        self.url = url
        self.wanted: dict[str, set[OnBeat]] = {}
        # What the worker was asked for on the open connection; `_written` is set (and replaced)
        # after each request sent.
        self.subscribed: set[str] = set()
        self._written = asyncio.Event()
        self._connection: ClientConnection | None = None  # while open
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

    async def until_sent(self, job_id: str) -> None:
        """Until the worker has been asked for `job_id` on an open connection: at once on one
        already open (a busy event loop may take seconds to get back to this link's task)."""
        connection = self._connection
        if connection is not None and job_id in self.wanted and job_id not in self.subscribed:
            self.subscribed.add(job_id)
            try:
                await connection.send(json.dumps({"subscribe": [job_id]}))
            except ConnectionClosed:
                return  # the link reconnects and asks again
            return
        while job_id in self.wanted and job_id not in self.subscribed and not self.task.done():
            await self._written.wait()

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
                        if await self._exchange(connection):
                            continue  # idle: closed, unless a job is wanted again meanwhile
                except (
                    OSError,
                    TimeoutError,
                    ConnectionClosed,
                    InvalidHandshake,
                    InvalidURI,
                ) as exc:
                    log.info("live_progress_lost", url=self.url, error=type(exc).__name__)
                finally:
                    self.subscribed = set()
                if not self.wanted:
                    break
                await asyncio.sleep(delay * (0.5 + random.random() / 2))
                delay = min(RECONNECT_MAX_S, delay * 2)
        finally:
            self._wrote()  # wakes `until_sent`, which sees the link is over
            self.relay._forget(self)

    def _wrote(self) -> None:
        self._written.set()
        self._written = asyncio.Event()

    async def _exchange(self, connection: ClientConnection) -> bool:
        """Keep the worker's subscriptions equal to `wanted` and hand out what it pushes, until
        the connection closes (False) or nothing was wanted for `IDLE_S` (True)."""
        reader = asyncio.create_task(self._read(connection))
        self._connection = connection
        try:
            while not reader.done():
                self._changed.clear()
                wanted = set(self.wanted)
                subscribe, unsubscribe = wanted - self.subscribed, self.subscribed - wanted
                asked: dict[str, list[str]] = {}
                if subscribe:
                    asked["subscribe"] = sorted(subscribe)
                if unsubscribe:
                    asked["unsubscribe"] = sorted(unsubscribe)
                if asked:
                    await connection.send(json.dumps(asked))
                    # Not `wanted`: `until_sent` may have sent one meanwhile.
                    self.subscribed = (self.subscribed | subscribe) - unsubscribe
                    self._wrote()
                changed = asyncio.create_task(self._changed.wait())
                try:
                    # Idle, the connection is kept a while: the next watch (a burst's, say)
                    # then subscribes without a handshake first.
                    done, _ = await asyncio.wait(
                        {reader, changed},
                        timeout=None if wanted else IDLE_S,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:
                    # Also when the link is closed meanwhile: a wait left pending is destroyed
                    # with the link, and asyncio logs it as an error.
                    changed.cancel()
                if not done:
                    return True
        finally:
            self._connection = None
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
                await reader
        if reader.done() and not reader.cancelled() and reader.exception() is not None:
            raise reader.exception()  # type: ignore[misc]
        return False

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
        self._held: dict[str, tuple[Pushed, asyncio.TimerHandle]] = {}

    async def hold(self, job_id: str) -> None:
        """Subscribe to a job before it starts, for the watch that follows its start (`take`):
        on a busy server a short job can run to its end before its start call returns, so a
        watch that subscribed only then would see none of its steps as they happened. Returns
        once the subscription is sent to every pushing worker, or after `HOLD_WAIT_S` (the
        subscription goes on meanwhile). Let go after `HELD_S` if no watch takes it."""
        if job_id in self._held:
            return
        pushed = Pushed(self, job_id)
        if self._workers_at != float("-inf"):
            # Now, not a loop turn later in a task; kept as the watch's candidates, which a
            # status naming no worker falls back to. A stale listing is refreshed meanwhile.
            pushed.candidates = list(self._workers)
            pushed.follow_any(pushed.candidates)
            self.list_soon()
        else:
            pushed.subscribe_early()  # once the first listing is in
        timer = asyncio.get_running_loop().call_later(HELD_S, self.release, job_id)
        self._held[job_id] = (pushed, timer)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(HOLD_WAIT_S):
                await pushed.sent()

    async def until_sent(self, url: str, job_id: str) -> None:
        link = self._links.get(url)
        if link is not None:
            await link.until_sent(job_id)

    def take(self, job_id: str) -> Pushed | None:
        """The subscription `hold` made for this job, now the caller's (None if there is none)."""
        held = self._held.pop(job_id, None)
        if held is None:
            return None
        held[1].cancel()
        return held[0]

    def release(self, job_id: str) -> None:
        """Let go of a held subscription nobody took."""
        pushed = self.take(job_id)
        if pushed is not None:
            pushed.close()

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
            self._workers = sorted(set(found))[:MAX_CANDIDATES]
        except Exception as exc:  # advisory: the watch subscribes where the job says
            # The last listing is kept (none at first): a busy server that fails one describe
            # must not leave the watches of the next `WORKERS_FRESH_S` subscribed nowhere.
            log.info("live_workers_unlisted", error=type(exc).__name__)
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
        for job_id in list(self._held):
            self.release(job_id)
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
        # The task queue's pushing workers (once listed), and whether a status named the job's.
        self.candidates: list[str] = []
        self._named = False
        self._early: asyncio.Task[None] | None = None

    def subscribe_early(self) -> None:
        """Subscribe on every pushing worker of the task queue, once they are listed
        (`LiveRelay.workers`), unless a status named the job's own worker by then."""
        if self._early is None:
            self._early = asyncio.create_task(self._on_candidates(), name=f"early {self.job_id}")

    async def _on_candidates(self) -> None:
        self.candidates = await self.relay.workers()
        if not self._named:
            self.follow_any(self.candidates)

    async def sent(self) -> None:
        """Until the subscription is sent to each worker (once they are listed, when
        `subscribe_early` waits for that). Awaited in turn, not gathered: on an open connection
        each is written at once, without waiting for the event loop to come round to a task."""
        if self._early is not None:
            await asyncio.wait({self._early})  # not cancelled with the caller, nor raising
        for url in list(self._at):
            await self.relay.until_sent(url, self.job_id)

    def follow_own(self, url: str | None) -> None:
        """Subscribe where the job's status says its worker pushes; while it names none (None),
        on every candidate."""
        self._named = url is not None
        self.follow_any([url] if url is not None else self.candidates)

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

    async def next_before(self, deadline: float) -> FollowHeartbeat | None:
        """The latest beat once one comes, or None at `deadline` (`time.monotonic()`) without
        one."""
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        # Not `asyncio.wait_for`: on Python 3.11 a cancel that lands as the beat arrives is
        # lost there (the beat is returned), and a stopped watch would go on for ever.
        try:
            async with asyncio.timeout(left):
                await self._arrived.wait()
        except TimeoutError:
            return None
        self._arrived.clear()
        return self.beat

    async def next_or(self, other: asyncio.Future[Any]) -> FollowHeartbeat | None:
        """The latest beat once one comes, or None once `other` is done first."""
        if other.done():
            return None
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
        if self._early is not None:
            self._early.cancel()
        self.follow_any([])

    def _on_beat(self, url: str, beat: FollowHeartbeat) -> None:
        self.beat, self._beat_from = beat, url
        self._arrived.set()
