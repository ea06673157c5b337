"""Reading and settling a bounded pool's queue (workflows/pool_queue.py) from a client.

The queue is one workflow per pool and task queue: `durable-comfy pool queue` and `pool status`
query it, `pool release` settles a slot whose teardown was never confirmed, `pool drain` and
`pool undrain` take a server of the pool (or the whole pool) out of its assignments and back
(the update `drain`), and a PENDING job's status is given the queue's latest word on its place
(the job itself hears it only every few seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import time
from dataclasses import dataclass, field
from datetime import timedelta

from temporalio.client import (
    Client,
    RPCTimeoutOrCancelledError,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
)
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from starter.errors import DrainRefused, NoPoolQueue, UnknownServer
from workflows.admission import Admission, PoolDrain, PoolQueueView, QueueRoom, SlotRelease
from workflows.contracts import JobState, JobStatus
from workflows.shared import (
    QUERY_ADMISSION,
    QUERY_POOL_QUEUE,
    QUERY_ROOM,
    SIGNAL_SLOT_RELEASE,
    UPDATE_POOL_DRAIN,
    pool_queue_id,
)

# How many times the room check asks a queue whose worker failed to answer (0.2 s apart, then
# twice as long each time: about 3 s in all before the submission goes on unchecked).
ROOM_ATTEMPTS = 5
# How long a client trusts a queue's answer that there is room, counting its own joins against
# the headroom it was told: a client submitting hundreds of jobs asks about once a second, not
# once a job (the server buffers one query per busy workflow and refuses the rest).
ROOM_FRESH_S = 1.0


async def pool_queue(
    temporal: Client, task_queue: str, pool: str, *, rpc_timeout: timedelta | None = None
) -> PoolQueueView:
    handle = temporal.get_workflow_handle(pool_queue_id(task_queue, pool))
    try:
        view: PoolQueueView = await handle.query(
            QUERY_POOL_QUEUE, result_type=PoolQueueView, rpc_timeout=rpc_timeout
        )
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise NoPoolQueue(pool) from None
        raise
    return view


async def queue_room(temporal: Client, task_queue: str, pool: str, tenant: str) -> QueueRoom:
    """Whether a new job of `tenant` may join `pool`'s line (room, too, when no queue runs).

    A query the queue's worker failed to answer (a busy worker's deadlock detector, a queue of
    an older version without the query), or that a busy queue's server refused, is asked again
    for about 3 s; after that the submission goes on: the queue itself never refuses a job, so a
    missed check costs one job over the bound."""
    handle = temporal.get_workflow_handle(pool_queue_id(task_queue, pool))
    for attempt in range(ROOM_ATTEMPTS):
        try:
            room: QueueRoom = await handle.query(QUERY_ROOM, tenant, result_type=QueueRoom)
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return QueueRoom()
            if exc.status != RPCStatusCode.RESOURCE_EXHAUSTED:
                raise
            # A queue too busy to take another query now ("consistent query buffer is full"):
            # as a query its worker failed to answer.
        except WorkflowQueryFailedError:
            pass
        else:
            return room
        if attempt + 1 < ROOM_ATTEMPTS:
            await asyncio.sleep(0.2 * 2**attempt)
    return QueueRoom()


@dataclass
class _Answer:
    room: QueueRoom
    at: float
    joined: int = 0


@dataclass
class RoomCheck:
    """`queue_room` for one client, asked once per pool and tenant at a time and trusted for
    `ROOM_FRESH_S` while the client's own joins stay within the headroom it was told."""

    temporal: Client
    task_queue: str
    _answers: dict[tuple[str, str], _Answer] = field(default_factory=dict)
    _asking: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)

    async def join(self, pool: str, tenant: str) -> QueueRoom:
        """The room for one more job of `tenant` in `pool`, counted as joined when there is."""
        key = (pool, tenant)
        async with self._asking.setdefault(key, asyncio.Lock()):
            answer = self._answers.get(key)
            if answer is None or not self._usable(answer):
                room = await queue_room(self.temporal, self.task_queue, pool, tenant)
                answer = self._answers[key] = _Answer(room, time.monotonic())
            if not answer.room.full:
                answer.joined += 1
            return answer.room

    @staticmethod
    def _usable(answer: _Answer) -> bool:
        room = answer.room
        if time.monotonic() - answer.at > ROOM_FRESH_S or room.full:
            return False
        return room.headroom is not None and answer.joined < room.headroom


async def release_slot(temporal: Client, task_queue: str, pool: str, job_id: str) -> bool:
    """Settle the job's slot (or take it out of line): False when the queue had no such job."""
    view = await pool_queue(temporal, task_queue, pool)
    if not any(entry.job_id == job_id for entry in view.entries):
        return False
    handle = temporal.get_workflow_handle(pool_queue_id(task_queue, pool))
    await handle.signal(SIGNAL_SLOT_RELEASE, SlotRelease(job_id=job_id, reason="settled"))
    return True


async def drain_pool(
    temporal: Client,
    task_queue: str,
    pool: str,
    *,
    server: str | None,
    drain: bool,
    by: str,
    rpc_timeout: timedelta | None = None,
) -> PoolQueueView:
    """Drain (`drain=True`) or undrain one server of `pool` (`server` None: the whole pool) on
    its running dispatcher, and return the queue as it is then. A drained server is given no new
    job (a drained pool grants none); what runs there finishes.

    `NoPoolQueue` when no dispatcher runs. None is started for the drain: the client cannot tell
    a pool from a typo, nor one of many servers from an unbounded pool (whose jobs never ask a
    queue: a drain recorded there would stop nothing), and a dispatcher, once started, runs for
    good. Every pool whose jobs have asked for a slot has one.

    `server` is checked against the servers the queue has before anything is sent (a URL given
    with a trailing `/` is taken as the queue names it): `UnknownServer` names them (none: the
    queue picks no servers, and records nothing it would never consult). The queue's own
    refusal of the server (its servers changed in between) is `UnknownServer` too; any other
    refusal is `DrainRefused`."""
    before = await pool_queue(temporal, task_queue, pool, rpc_timeout=rpc_timeout)
    if server is not None:
        server = _server_of(before, server, drain=drain)
    handle = temporal.get_workflow_handle(pool_queue_id(task_queue, pool))
    order = PoolDrain(server=server, drain=drain, by=by)
    try:
        view: PoolQueueView = await handle.execute_update(
            UPDATE_POOL_DRAIN, order, result_type=PoolQueueView, rpc_timeout=rpc_timeout
        )
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise NoPoolQueue(pool) from None
        raise
    except WorkflowUpdateFailedError as refused:
        cause = refused.cause
        reason = cause.message if isinstance(cause, ApplicationError) else str(cause)
        if (
            server is not None
            and isinstance(cause, ApplicationError)
            and cause.type == "ValueError"
        ):
            # The validator's refusal of a server the pool no longer has.
            servers = [s.url for s in before.servers]
            with contextlib.suppress(
                RPCError, RPCTimeoutOrCancelledError, WorkflowQueryFailedError, NoPoolQueue
            ):
                now = await pool_queue(temporal, task_queue, pool, rpc_timeout=rpc_timeout)
                servers = [s.url for s in now.servers]
            raise UnknownServer(pool, server, servers, drain=drain) from None
        raise DrainRefused(pool, reason or "no reason given", drain=drain) from None
    return view


def operator_name() -> str:
    """Who drains, as `pool status` shows it: the OS user, else "operator"."""
    try:
        return getpass.getuser() or "operator"
    except (OSError, KeyError, ImportError):
        return "operator"


def _server_of(view: PoolQueueView, server: str, *, drain: bool) -> str:
    """`server` as the queue names it (the pool's settings drop a trailing `/`)."""
    names = [s.url for s in view.servers]
    for candidate in (server, server.rstrip("/")):
        if candidate in names:
            return candidate
    raise UnknownServer(view.pool, server, names, drain=drain)


async def with_queue_position(temporal: Client, task_queue: str, status: JobStatus) -> JobStatus:
    """A PENDING job's status with its place in line as the queue has it now."""
    admission = status.admission
    if status.state != JobState.PENDING or admission is None or admission.held is not None:
        return status  # not in line (a job its tenant's budget holds is in none)
    handle = temporal.get_workflow_handle(pool_queue_id(task_queue, admission.pool))
    try:
        raw = await handle.query(QUERY_ADMISSION, status.job_id)
        latest = Admission.model_validate(raw) if raw else None
    except (RPCError, WorkflowQueryFailedError, ValueError):
        return status  # the job's own word stands
    if latest is None or latest.granted:
        return status
    return status.model_copy(update={"admission": latest.model_copy(update={"job_id": None})})
