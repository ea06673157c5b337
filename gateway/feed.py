"""One follower per job per process, fanned out to every stream of it (docs/http-api.md, Events).

A `Follower` runs `JobClient.watch` on its job (which also keeps an attached job alive while
anyone follows it) and, whenever the job's `seq` moves, reads the journal entries since its
cursor (`JobClient.journal`); it publishes the entries, then the status, to its subscribers'
bounded queues. A subscriber that falls behind is dropped, never the follower: its stream
ends and the client reconnects with the last id it saw. The follower stops after the terminal
status, or `follower_grace_s` after its last subscriber left.

A stream (`stream_events`) subscribes first, then replays what the client missed from the
job itself (`journal` after its `Last-Event-ID`), then passes on what the follower published
meanwhile and after, skipping what it already sent: every entry once, in order.

Live progress. When the gateway's client holds the workers' live-progress key, `watch` also
takes the steps the job's worker pushes (starter/live.py): the stream sees a step as it
happens rather than at the next poll, at most one every `PUSH_GAP_S`; the poll goes on as the
record.

Event ids. Several entries can share one seq (a state change and the progress it completed);
an id must say where in them a stream stopped, so an entry that is not the last of its seq is
`<seq>.<k>` (its index among them) and every other id is a bare `<seq>`: everything up to that
seq was sent.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import structlog

from gateway.errors import Dropped, FollowFailed
from gateway.views import JobViews
from starter.client import JobClient
from starter.progress import carried_forward
from workflows.contracts import JobEvent, JobStatus, WorkerWait

log = structlog.get_logger("gateway.feed")

# Jobs whose follower starts are counted (introspection); the oldest is forgotten first.
MAX_COUNTED = 10_000
# A follower publishes a pushed step at most this often (`JobClient.watch`'s `push_gap_s`):
# steps that come faster are coalesced, the latest winning, so a job costs the gateway at most
# 1/PUSH_GAP_S status views a second whatever its step rate.
PUSH_GAP_S = 0.025
_CURSOR = re.compile(r"^(\d{1,18})(?:\.(\d{1,6}))?$")


@dataclass(frozen=True, order=True)
class Cursor:
    """Where a stream is: every entry of a seq below `seq` sent, and of `seq` itself the
    entries up to `index` (None: all of them)."""

    seq: int
    index: float = float("inf")

    @classmethod
    def parse(cls, text: str) -> Cursor:
        """`17` or `17.2`; ValueError for anything else."""
        found = _CURSOR.match(text.strip())
        if found is None:
            raise ValueError(f"an event id is <seq> or <seq>.<index>, not {text[:40]!r}")
        seq, index = found.groups()
        return cls(int(seq)) if index is None else cls(int(seq), int(index))

    def __str__(self) -> str:
        return str(self.seq) if self.index == float("inf") else f"{self.seq}.{int(self.index)}"

    def covers(self, other: Cursor) -> bool:
        return other <= self


@dataclass(frozen=True)
class Entry:
    """A journal entry and its place among the entries of its seq."""

    event: JobEvent
    cursor: Cursor


def placed(events: list[JobEvent]) -> list[Entry]:
    """Each entry with its id: `<seq>.<k>` unless it is the last of its seq."""
    entries: list[Entry] = []
    index = 0
    for position, event in enumerate(events):
        if position and events[position - 1].seq != event.seq:
            index = 0
        last = position + 1 == len(events) or events[position + 1].seq != event.seq
        entries.append(Entry(event, Cursor(event.seq) if last else Cursor(event.seq, index)))
        index += 1
    return entries


StreamKind = Literal["state", "output_stored", "progress", "status", "end"]


@dataclass(frozen=True)
class StreamEvent:
    """One event of a stream: SSE's `event`, `id` and `data`, or a WebSocket message."""

    # A `StreamKind`, or a journal kind from a newer worker, passed on under its own name.
    kind: StreamKind | str
    id: str
    data: dict[str, Any]


@dataclass(frozen=True)
class Published:
    """What a follower hands its subscribers: an entry, a status (with its view, built once
    for all of them), its end, or its failure."""

    entry: Entry | None = None
    entry_view: dict[str, Any] | None = None
    status: JobStatus | None = None
    status_view: dict[str, Any] | None = None
    failure: BaseException | None = None
    dropped: bool = False


class Subscription:
    def __init__(self, follower: Follower, size: int) -> None:
        self.follower = follower
        self.queue: asyncio.Queue[Published] = asyncio.Queue(size)

    def offer(self, item: Published) -> bool:
        """False when the queue is full: the subscriber is then told it was dropped."""
        try:
            self.queue.put_nowait(item)
            return True
        except asyncio.QueueFull:
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queue.put_nowait(Published(dropped=True))
            return False

    async def ready(self, timeout_s: float) -> bool:
        """True once the follower has its first status; False after `timeout_s` without it
        (the follower's failure, if it failed first, is raised)."""
        # Not `asyncio.wait_for` here nor below: on Python 3.11 a cancel that lands as what it
        # awaits completes is lost there, and a stream whose client left would go on.
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(self.follower.ready)
        except TimeoutError:
            return False
        return True

    async def next(self, timeout_s: float) -> Published | None:
        """The next thing published, or None after `timeout_s` of silence."""
        try:
            async with asyncio.timeout(timeout_s):
                return await self.queue.get()
        except TimeoutError:
            return None


ClientGetter = Callable[[], Awaitable[JobClient]]


class Follower:
    """Follows one job for every subscriber of this process."""

    def __init__(
        self,
        hub: Hub,
        job_id: str,
    ) -> None:
        self.hub = hub
        self.job_id = job_id
        self.subscribers: set[Subscription] = set()
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.cursor = 0
        self._idle: asyncio.TimerHandle | None = None
        self.task = asyncio.create_task(self._run(), name=f"follow {job_id}")

    @property
    def done(self) -> bool:
        return self.task.done()

    def add(self, subscription: Subscription) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        self.subscribers.add(subscription)

    def remove(self, subscription: Subscription) -> None:
        self.subscribers.discard(subscription)
        if not self.subscribers and not self.done:
            self._idle = asyncio.get_running_loop().call_later(self.hub.grace_s, self._stop_if_idle)

    def _stop_if_idle(self) -> None:
        self._idle = None
        if not self.subscribers:
            log.info("follower_idle", job_id=self.job_id)
            self.task.cancel()

    def _publish(self, item: Published) -> None:
        for subscription in list(self.subscribers):
            if not subscription.offer(item):
                log.warning("subscriber_dropped", job_id=self.job_id)
                self.subscribers.discard(subscription)

    async def _run(self) -> None:
        try:
            client = await self.hub.client()
            # An async generator (declared as an iterator): closed as soon as the job ends.
            updates = cast(
                AsyncGenerator[JobStatus, None],
                client.watch(
                    self.job_id,
                    poll_interval_s=self.hub.poll_interval_s,
                    keepalive_s=self.hub.keepalive_s,
                    push_gap_s=PUSH_GAP_S,
                    # The journal cursor starts at the first status's seq: the job's own.
                    record_first=False,
                ),
            )
            async with aclosing(updates):
                async for watched in updates:
                    if await self._on(client, watched):
                        return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("follower_failed", job_id=self.job_id, error=type(exc).__name__)
            if not self.ready.done():
                self.ready.set_exception(exc)
                self.ready.exception()  # retrieved: a subscriber may not be waiting for it
            self._publish(Published(failure=exc))
        finally:
            if self._idle is not None:
                self._idle.cancel()
            self.hub.forget(self)

    async def _on(self, client: JobClient, watched: JobStatus) -> bool:
        """Publishes what `watched` brings; True once the job has ended."""
        if not self.ready.done():
            # Entries up to here are before this follower's time: a subscriber replays them
            # from the job itself once this is set.
            self.cursor = watched.seq
            await self._publish_status(watched)
            self.ready.set_result(None)
            return watched.terminal
        status = watched
        if watched.seq > self.cursor or watched.terminal:
            journal = await client.journal(self.job_id, since=self.cursor)
            if journal.status.seq > watched.seq:
                status = carried_forward(journal.status, watched)
            for entry in placed([e for e in journal.events if e.seq > self.cursor]):
                view = await self.hub.views.entry(self.job_id, entry.event)
                self._publish(Published(entry=entry, entry_view=view))
            self.cursor = max(self.cursor, status.seq, *(e.seq for e in journal.events))
        await self._publish_status(status)
        return status.terminal

    async def _publish_status(self, status: JobStatus) -> None:
        if self.subscribers:
            self._publish(Published(status=status, status_view=await self.hub.views.status(status)))


@dataclass
class Hub:
    """The followers of this process, one per job followed."""

    client: ClientGetter
    views: JobViews
    grace_s: float
    poll_interval_s: float = 0.5
    keepalive_s: float | None = None
    queue_size: int = 1000
    followers: dict[str, Follower] = field(default_factory=dict)
    # How many followers each job has had: what the fan-out promise is checked by.
    started: dict[str, int] = field(default_factory=dict)

    @asynccontextmanager
    async def subscribe(self, job_id: str) -> AsyncIterator[Subscription]:
        follower = self.followers.get(job_id)
        if follower is None or follower.done:
            follower = self.followers[job_id] = Follower(self, job_id)
            self.started[job_id] = self.started.pop(job_id, 0) + 1
            if len(self.started) > MAX_COUNTED:
                del self.started[next(iter(self.started))]  # the job followed longest ago
        subscription = Subscription(follower, self.queue_size)
        follower.add(subscription)
        try:
            yield subscription
        finally:
            follower.remove(subscription)

    def forget(self, follower: Follower) -> None:
        if self.followers.get(follower.job_id) is follower:
            del self.followers[follower.job_id]

    async def close(self) -> None:
        followers = list(self.followers.values())
        for follower in followers:
            follower.task.cancel()
        await asyncio.gather(*(f.task for f in followers), return_exceptions=True)


@dataclass
class _Sent:
    """What one stream has sent: the journal up to `cursor`, and its last status (how far,
    and its worker wait)."""

    cursor: Cursor
    status: tuple[int, int] = (-1, -1)
    wait: WorkerWait | None = None
    state: str | None = None  # None: not known, no state change is news

    def news(self, status: JobStatus) -> bool:
        """Further than the last status sent, or as far in another state (a pushed step shows a
        SUBMITTING job RUNNING before the workflow hears of it) or with another worker wait."""
        at = (status.seq, status.progress.step)
        if at != self.status:
            return at > self.status
        moved_on = self.state is not None and status.state.value != self.state
        return status.worker_wait != self.wait or moved_on


async def stream_events(
    hub: Hub,
    client: JobClient,
    job_id: str,
    since: Cursor | None,
    heartbeat_s: float,
) -> AsyncIterator[StreamEvent | None]:
    """The stream of one client: the replay after `since` (or the job as it is now), then
    live, each entry once and in order; None for each `heartbeat_s` of silence. Ends after
    the terminal status with an `end` event; raises `FollowFailed` or `Dropped` when the
    follower gives up or drops it."""
    views = hub.views
    async with hub.subscribe(job_id) as subscription:
        # A job no worker answers for keeps its follower waiting: the stream stays open
        # (heartbeats) meanwhile, as it would between events.
        while not await subscription.ready(heartbeat_s):
            yield None
        sent = _Sent(Cursor(-1))
        if since is None:
            status = await client.status(job_id)
            sent.cursor = Cursor(status.seq)
        else:
            # `17.1`: the rest of seq 17 is still to come, so the journal is read from 16.
            after = since.seq if since.index == float("inf") else since.seq - 1
            journal = await client.journal(job_id, since=max(0, after))
            sent.cursor = since
            for entry in placed(journal.events):
                if not sent.cursor.covers(entry.cursor):
                    yield StreamEvent(
                        entry.event.kind, str(entry.cursor), await views.entry(job_id, entry.event)
                    )
                    sent.cursor = entry.cursor
            status = journal.status
        yield _status_event(sent, status, await views.status(status))
        if status.terminal:
            yield StreamEvent("end", str(sent.cursor), {"state": status.state.value})
            return
        while True:
            item = await subscription.next(heartbeat_s)
            if item is None:
                yield None
            elif item.dropped:
                raise Dropped(job_id)
            elif item.failure is not None:
                raise FollowFailed(str(item.failure)) from item.failure
            elif item.entry is not None and item.entry_view is not None:
                if not sent.cursor.covers(item.entry.cursor):
                    sent.cursor = item.entry.cursor
                    yield StreamEvent(item.entry.event.kind, str(sent.cursor), item.entry_view)
            elif item.status is not None and item.status_view is not None:
                status = item.status
                if sent.news(status):
                    yield _status_event(sent, status, item.status_view)
                if status.terminal:
                    yield StreamEvent("end", str(sent.cursor), {"state": status.state.value})
                    return


def _status_event(sent: _Sent, status: JobStatus, view: dict[str, Any]) -> StreamEvent:
    """Everything up to a status's seq was sent before it, so its id is that seq."""
    sent.cursor = max(sent.cursor, Cursor(status.seq))
    sent.status = (status.seq, status.progress.step)
    sent.wait = status.worker_wait
    sent.state = status.state.value
    return StreamEvent("status", str(sent.cursor), view)
