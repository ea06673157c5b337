"""Our queue in front of a pool: who holds its slots, who waits, and who starts next.

Pure and deterministic (no Temporal, no clock of its own: every time is given), so the
dispatcher workflow (`workflows/pool_queue.py`) replays it and the tests drive it directly.

The order a waiting job starts in:

1. **priority** first: 1 before 2 ... before 5; a better priority starts before any worse one
   waiting for the same pool;
2. within one priority, **fair shares between tenants** by stride scheduling: each tenant has
   a pass (its virtual time); the tenant with waiting jobs and the lowest pass starts next and
   its pass grows by `1 / weight`, so over any stretch of starts each tenant with jobs waiting
   gets starts in proportion to its weight. A tenant that had nothing waiting comes back at
   the pass of the last start (never below it), so idling earns no credit to flood with later;
3. within one tenant, **first come, first served**.

A slot is held from the grant until the job says its prompt has provably ended (`release`).
A job whose teardown was not confirmed keeps its slot, `unsettled`, until something settles it
(the provider's execution timeout surely over, an operator's `pool release`, the orphan sweep).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# How many of a pool's latest hold times its wait estimate averages.
RECENT_HOLDS = 20
# The most jobs one pool's line holds, whatever `max_pending` says: the line is carried into the
# dispatcher's next run in one payload with up to 1,000 holders (Temporal caps a payload at
# 2 MiB; a waiter is 160 to 350 bytes of JSON, by its job id). Above it a new job is refused,
# QueueFull.
MAX_LINE = 4000
MIN_PRIORITY, DEFAULT_PRIORITY, MAX_PRIORITY = 1, 3, 5


class _Read(BaseModel):
    # What one version writes and another reads (a job on an old version signals a dispatcher
    # on a new one): a field it does not know is ignored.
    model_config = ConfigDict(extra="ignore")


class PoolBound(_Read):
    """A bounded pool's terms for one job, as the worker that checked it has them: the job
    asks the pool's queue for a slot before anything of it reaches the pool."""

    pool: str
    max_running: int
    # The job's tenant's weight in the pool's fair shares.
    weight: float = 1.0
    # How often the queue looks for holders whose job closed without releasing.
    reclaim_every_s: float = 60.0
    # The provider's own cap on a run (RunPod's executionTimeout): past a submission by this
    # much, an unconfirmed teardown is settled. None: the provider has none (a comfyui pool).
    settle_after_s: float | None = None
    # How many of the tenant's jobs, and of the pool's, may wait at once (None: no bound).
    tenant_max_pending: int | None = None
    pool_max_pending: int | None = None
    # A pool whose queue picks each job's server (a comfyui pool of `urls`, or `server_slots`):
    # its servers and how many jobs each holds at once. Empty: the pool is one backend.
    servers: list[str] = Field(default_factory=list)
    server_slots: int = 1
    # What the job's graph loads (activities/comfyui/graph.py `warm_key`): the queue prefers a
    # server that last started a job of the same key (its models are loaded).
    graph_key: str | None = None
    # A runpod pool: its queue watches the endpoint's `/health` (one watch per pool), holds its
    # jobs while no worker can take one, and counts a cold start into their wait.
    watch_endpoint: bool = False
    cold_start_s: float | None = None


class SlotRequest(_Read):
    """A job asks its pool's queue for a slot (signal `request`)."""

    job_id: str
    tenant: str
    priority: int = DEFAULT_PRIORITY
    weight: float = 1.0
    # The pool's bound as the asking job's worker has it: the queue keeps the latest it heard.
    max_running: int
    # When the job was accepted (its workflow's start): the queue's order within a tenant.
    accepted_at: datetime
    # How often the queue looks for holders that closed without releasing (a terminated job).
    reclaim_every_s: float = 60.0
    # How many may wait at once: the tenant's jobs, and the pool's in all (None: no bound).
    tenant_max_pending: int | None = None
    pool_max_pending: int | None = None
    # The asking follow waits for its grant itself, watching the queue (queries `holders` and
    # `places`): the queue signals it nothing. A request without it (the job's own, or the
    # follow's when it stops watching) has the grant and the places told by signal.
    in_follow: bool = False
    # The pool's servers as the asking job's worker has them (see `PoolBound.servers`), and
    # what its graph is (a server that last ran the same graph has its models loaded).
    servers: list[str] = Field(default_factory=list)
    server_slots: int = 1
    graph_key: str | None = None
    watch_endpoint: bool = False
    cold_start_s: float | None = None

    @classmethod
    def of_bound(
        cls,
        bound: PoolBound,
        *,
        job_id: str,
        tenant: str,
        priority: int,
        accepted_at: datetime,
        in_follow: bool = False,
    ) -> SlotRequest:
        """A job's request on the pool's terms as its worker has them (`bound`)."""
        return cls(
            job_id=job_id,
            tenant=tenant,
            priority=priority,
            weight=bound.weight,
            max_running=bound.max_running,
            accepted_at=accepted_at,
            reclaim_every_s=bound.reclaim_every_s,
            tenant_max_pending=bound.tenant_max_pending,
            pool_max_pending=bound.pool_max_pending,
            in_follow=in_follow,
            servers=bound.servers,
            server_slots=bound.server_slots,
            graph_key=bound.graph_key,
            watch_endpoint=bound.watch_endpoint,
            cold_start_s=bound.cold_start_s,
        )


class EndpointHealth(_Read):
    """A RunPod endpoint as its pool's queue last read its `/health` (activity
    `watch_endpoint_health`): workers by state, jobs queued and running, and what that means."""

    idle: int = 0
    initializing: int = 0
    ready: int = 0
    running: int = 0
    throttled: int = 0
    unhealthy_workers: int = 0
    in_queue: int = 0
    in_progress: int = 0
    # No worker can take a new job (none idle, ready or starting) and some are unhealthy or
    # throttled: why; None while it can. Its queue grants nothing meanwhile, and a job of a
    # group moves on.
    unhealthy: str | None = None
    # No worker idle or running (none up, or some starting): a job waits for a cold start.
    cold: bool = False
    as_of: datetime | None = None

    def same_as(self, other: EndpointHealth | None) -> bool:
        """Whether `other` says the same for routing (unhealthy, cold), whatever the counts."""
        return other is not None and (other.unhealthy, other.cold) == (self.unhealthy, self.cold)


class PoolMove(_Read):
    """A job of a group that left a pool before it started there (`admission.moves`)."""

    from_pool: str
    to_pool: str | None = None
    reason: str
    at: datetime


class PoolHealthView(_Read):
    """What a group's check asks each of its pools' queues (query `health`): whether it takes
    work, and how long a new job would wait."""

    pool: str
    unhealthy: str | None = None
    waiting: int = 0
    running: int = 0
    max_running: int | None = None
    # A new job's wait: the line ahead of it at the pool's recent pace, and a cold start.
    eta_s: float | None = None


class LinePlaces(_Read):
    """The places of some waiting jobs (query `places`): what a worker whose follows wait in
    line tells their jobs. A job neither placed here nor holding a slot is unknown to the
    queue."""

    places: dict[str, int] = Field(default_factory=dict)
    waiting: int = 0
    # Seconds per start, as `Admission.eta_s` counts them (None until the pool has some).
    per_start_s: float | None = None
    # The pool takes no work now (`Admission.unhealthy`): a follow waiting in line hands the
    # wait to its job, which may move to another pool of its group.
    unhealthy: str | None = None


class QueueRoom(_Read):
    """Whether a tenant's new job may join the pool's line (query `room`): refused above the
    tenant's `max_pending` or the pool's, with the time until there is room again."""

    full: bool = False
    reason: str = ""
    waiting: int = 0
    limit: int | None = None
    retry_after_s: float | None = None
    # When not full: how many more of the tenant's jobs fit (the tighter of its bound and the
    # pool's), so a client submitting many may count its own joins for a moment without asking
    # again. None: a queue of a version that did not say.
    headroom: int | None = None


class SlotRelease(_Read):
    """A job gives its slot or its place in line back (signal `release`)."""

    job_id: str
    # ended: its prompt provably ended; withdrawn: it left before its grant (cancel, failure);
    # settled: an operator or a sweep settled an unconfirmed teardown; reclaimed: its workflow
    # closed without releasing.
    reason: Literal["ended", "withdrawn", "settled", "reclaimed"] = "ended"


class SlotUnsettled(_Read):
    """A job ended with its teardown unconfirmed: its slot stays held until settled (signal
    `unsettled`). `settle_at`: when the provider's own execution timeout has surely ended the
    prompt (None: only an operator or the sweep can tell)."""

    job_id: str
    settle_at: datetime | None = None
    detail: str = ""


class Admission(_Read):
    """Where a job stands in its pool's queue: the queue's answer to the job (signal
    `admission`), and `JobStatus.admission` while it is PENDING."""

    pool: str
    job_id: str | None = None
    granted: bool = False
    # 1 = next to start; `ahead` = how many start before it (position - 1).
    position: int | None = None
    ahead: int | None = None
    # How many wait in all for the pool.
    waiting: int | None = None
    priority: int = DEFAULT_PRIORITY
    tenant: str = ""
    # From the pool's recent hold times and its bound; None until the pool has some.
    eta_s: float | None = None
    as_of: datetime | None = None
    # Why a job that may not start yet waits, besides a place in line: `budget`, its tenant's
    # spend today has reached its daily budget (workflows/budgets.py), until `resets_at`.
    held: str | None = None
    resets_at: datetime | None = None
    # With the grant, on a pool whose queue picks servers: the server the job runs on.
    server: str | None = None
    # While waiting: the pool takes no work now, and why (a RunPod endpoint none of whose
    # workers can take a job; every server of a pool of many unhealthy). A job of a group
    # moves to the next pool that does.
    unhealthy: str | None = None
    # Why `eta_s` is what it is beyond the line ("cold start: about 40 s").
    note: str | None = None
    # The pools the job left before it started (a group's failover), kept by the job.
    moves: list[PoolMove] = Field(default_factory=list)


# A waiting job hears its place again at most this often, and only among the first this many
# (the dispatcher telling a job waiting by itself, or a worker whose follow waits in line).
TELL_PLACES_EVERY_S = 10.0
TELL_PLACES_TO = 50


def placed(
    pool: str,
    job_id: str,
    position: int,
    *,
    waiting: int,
    priority: int,
    tenant: str,
    per_start_s: float | None,
    as_of: datetime,
    unhealthy: str | None = None,
    cold_start_s: float | None = None,
) -> Admission:
    """A waiting job's place as it hears it: 1 is next; its wait, `per_start_s` a start, and
    a cold start when its endpoint has no worker ready."""
    eta = None if per_start_s is None else position * per_start_s
    note = None
    if cold_start_s is not None:
        eta = (eta or 0.0) + cold_start_s
        note = f"cold start: about {_duration(cold_start_s)}"
    return Admission(
        pool=pool,
        job_id=job_id,
        position=position,
        ahead=position - 1,
        waiting=waiting,
        priority=priority,
        tenant=tenant,
        eta_s=None if eta is None else round(eta, 1),
        as_of=as_of,
        unhealthy=unhealthy,
        note=note,
    )


def worth_telling(told: int | None, position: int) -> bool:
    """Whether a waiting job last told `told` (None: never) hears its new `position`: when its
    place has halved since, or moved among the last three, or it was pushed back to twice as
    far (passed by better priorities). Each telling is a signal and a workflow task of the
    job's: a line that moves by one at each start would otherwise tell each of the first in
    line at every start."""
    if told is None:
        return True
    if position == told:
        return False
    return position <= 3 or position * 2 <= told or position >= told * 2


def clock(at: datetime) -> str:
    """ "17:00 UTC", or "17:00:20 UTC" when the time is not on a whole minute (a short day)."""
    at = at.astimezone(UTC)
    return at.strftime("%H:%M UTC" if at.second == 0 else "%H:%M:%S UTC")


def place_in_line(admission: Admission) -> str:
    """ "12th of 40 for pool gpu, about 3 min": where a PENDING job stands, in words; "held:
    over budget until 00:00 UTC" for a job its tenant's budget holds."""
    if admission.held == "budget":
        until = f" until {clock(admission.resets_at)}" if admission.resets_at else ""
        return f"held: over budget{until}"
    if admission.held is not None:
        return f"held: {admission.held}"
    position = admission.position
    if position is None:
        line = f"in line for pool {admission.pool}, its place not known yet"
    else:
        suffix = {1: "st", 2: "nd", 3: "rd"}.get(position % 10, "th")
        place = f"{position}{'th' if 10 <= position % 100 <= 20 else suffix}"
        line = f"{place} of {admission.waiting or '?'} for pool {admission.pool}"
    if admission.eta_s is not None:
        line += f", about {_duration(admission.eta_s)}"
    if admission.note:
        line += f" ({admission.note})"
    if admission.unhealthy:
        line += f"; the pool takes no work now: {admission.unhealthy}"
    return line


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class Holder(_Read):
    job_id: str
    tenant: str
    priority: int = DEFAULT_PRIORITY
    granted_at: datetime
    # When it asked: its wait in our queue is `granted_at - asked_at`.
    asked_at: datetime | None = None
    unsettled: bool = False
    settle_at: datetime | None = None
    detail: str = ""
    # Its follow waited in line itself: it learns of the grant by watching, not by signal.
    in_follow: bool = False
    # The server it was given (a pool whose queue picks servers), else None.
    server: str | None = None


class Waiter(_Read):
    job_id: str
    tenant: str
    priority: int = DEFAULT_PRIORITY
    accepted_at: datetime
    asked_at: datetime
    # Arrival order in the queue: first come, first served within a tenant.
    seq: int
    in_follow: bool = False
    graph_key: str | None = None


class ServerState(_Read):
    """One server of a pool whose queue picks servers, as its dispatcher has it."""

    # Given no new job: `unhealthy` (its health check failed: `reason`), `drained` (an
    # operator's `pool drain`: `reason` says by whom); None: takes work.
    unhealthy: str | None = None
    drained: str | None = None
    since: datetime | None = None
    # The graph it last started (its models are loaded), and how many jobs it was given.
    last_graph: str | None = None
    started: int = 0
    failures: int = 0


class ServerWatch(_Read):
    """What a pool's dispatcher asks its health watch (activity `watch_pool_servers`): report
    when any of `servers` is seen otherwise than `unhealthy` says (server -> why; a server
    not in it is healthy)."""

    pool: str
    servers: list[str]
    unhealthy: dict[str, str] = Field(default_factory=dict)


class ServerView(_Read):
    """One line of `pool status` for a server."""

    url: str
    health: Literal["healthy", "unhealthy", "drained"]
    running: int = 0
    slots: int = 1
    started: int = 0
    failures: int = 0
    last_error: str | None = None
    # `pool drain --server`: by whom.
    drained_by: str | None = None
    since: datetime | None = None


class QueueEntry(_Read):
    """One line of `durable-comfy pool queue`: a waiting job or a holder."""

    job_id: str
    tenant: str
    priority: int
    # waiting: in line (position set); running: holds a slot; unsettled: holds one until its
    # teardown is settled.
    state: Literal["waiting", "running", "unsettled"]
    position: int | None = None
    since: datetime
    detail: str = ""
    server: str | None = None


class PoolDrain(_Read):
    """`pool drain` / `pool undrain` (update `drain`): no new job for one server of the pool,
    or for the whole pool (`server` None), while drained; jobs running there finish."""

    server: str | None = None
    drain: bool = True
    # Who drained it (the CLI's user), shown in `pool status`.
    by: str = "operator"


class PoolQueueView(_Read):
    """The whole queue of a pool as its dispatcher has it (query `queue`)."""

    pool: str
    max_running: int | None = None
    # `pool drain POOL`: by whom; None: not drained.
    drained: str | None = None
    running: int = 0
    waiting: int = 0
    entries: list[QueueEntry] = Field(default_factory=list)
    # Tenant -> (waiting, running): what the gateway shows a tenant beside its own jobs.
    tenants: dict[str, tuple[int, int]] = Field(default_factory=dict)
    eta_s_per_start: float | None = None
    # A pool whose queue picks servers: each one's state (empty otherwise).
    servers: list[ServerView] = Field(default_factory=list)
    # A runpod pool whose endpoint its queue watches: its health as last read.
    endpoint: EndpointHealth | None = None
    # Why the pool takes no work now (None: it does).
    unhealthy: str | None = None


class QueueState(_Read):
    """Everything a dispatcher carries into its next run (continue-as-new)."""

    pool: str
    max_running: int | None = None
    reclaim_every_s: float = 60.0
    pool_max_pending: int | None = None
    tenant_max_pending: dict[str, int] = Field(default_factory=dict)
    holders: dict[str, Holder] = Field(default_factory=dict)
    waiters: list[Waiter] = Field(default_factory=list)
    passes: dict[str, float] = Field(default_factory=dict)
    weights: dict[str, float] = Field(default_factory=dict)
    last_pass: float = 0.0
    next_seq: int = 0
    recent_holds_s: list[float] = Field(default_factory=list)
    # A pool whose queue picks servers: its servers (as the latest ask named them), each
    # one's slots, and what the queue knows of each (health, drain, warm graph).
    servers: list[str] = Field(default_factory=list)
    server_slots: int = 1
    server_states: dict[str, ServerState] = Field(default_factory=dict)
    # The whole pool drained (`pool drain POOL`): no job is granted until `pool undrain`.
    drained: str | None = None
    # A runpod pool: its endpoint's health is watched, as last read, and its cold start.
    endpoint_watch: bool = False
    endpoint: EndpointHealth | None = None
    cold_start_s: float | None = None
    # Waiters that have not heard their place yet: the next run tells them, and only them (a
    # run that told every carried waiter again would fill its history before granting).
    untold: list[str] = Field(default_factory=list)
    # Holders granted that have not heard their grant yet (granted by an `ask` for another job,
    # or in the pass before the run continued as new): the next run tells them. Lost, such a
    # job would wait PENDING for good, its slot held for nothing.
    unheard: list[str] = Field(default_factory=list)
    # The dispatcher continues as new past this many events (its history stays quick to
    # replay); carried, so a test can make it small.
    history_limit: int = 4000


class PoolLine:
    """The queue of one pool: requests in, grants out."""

    def __init__(self, state: QueueState) -> None:
        self.state = state
        # tenant -> FIFO of its waiters, per priority.
        self._lines: dict[int, dict[str, deque[Waiter]]] = {}
        self._waiting: dict[str, Waiter] = {}
        for waiter in sorted(state.waiters, key=lambda w: w.seq):
            self._enqueue(waiter)

    # -- what comes in ------------------------------------------------------------------------

    def request(self, ask: SlotRequest, now: datetime) -> None:
        """A job in line (again: a repeated request changes nothing)."""
        state = self.state
        state.max_running = ask.max_running
        state.reclaim_every_s = ask.reclaim_every_s
        state.weights[ask.tenant] = ask.weight
        state.pool_max_pending = ask.pool_max_pending
        # The latest ask that names servers says what they are (one that names none may come
        # from a job of a version before them: it changes nothing).
        if ask.servers:
            state.servers, state.server_slots = list(ask.servers), max(ask.server_slots, 1)
        if ask.watch_endpoint:
            state.endpoint_watch, state.cold_start_s = True, ask.cold_start_s
        if ask.tenant_max_pending is None:
            state.tenant_max_pending.pop(ask.tenant, None)
        else:
            state.tenant_max_pending[ask.tenant] = ask.tenant_max_pending
        known = state.holders.get(ask.job_id) or self._waiting.get(ask.job_id)
        if known is not None:
            # Asked again: the follow that watched may have stopped watching (told by signal
            # from now on), or a new follow watches.
            known.in_follow = ask.in_follow
            return
        priority = min(max(ask.priority, MIN_PRIORITY), MAX_PRIORITY)
        if not self._tenant_waits(ask.tenant):
            # Back in line at the last start's pass, never below: no credit for idling.
            state.passes[ask.tenant] = max(state.passes.get(ask.tenant, 0.0), state.last_pass)
        waiter = Waiter(
            job_id=ask.job_id,
            tenant=ask.tenant,
            priority=priority,
            accepted_at=ask.accepted_at,
            asked_at=now,
            seq=state.next_seq,
            in_follow=ask.in_follow,
            graph_key=ask.graph_key,
        )
        state.next_seq += 1
        self._enqueue(waiter)

    def release(self, job_id: str, now: datetime) -> bool:
        """The job's slot, or its place in line, is free; False when it had neither."""
        state = self.state
        holder = state.holders.pop(job_id, None)
        if holder is not None:
            if not holder.unsettled:
                held = (now - holder.granted_at).total_seconds()
                state.recent_holds_s = [*state.recent_holds_s, max(held, 0.0)][-RECENT_HOLDS:]
            return True
        waiter = self._waiting.pop(job_id, None)
        if waiter is not None:
            self._lines[waiter.priority][waiter.tenant].remove(waiter)
            return True
        # Not here: released twice, or by an operator who named another job.
        return False

    def unsettled(self, note: SlotUnsettled) -> bool:
        holder = self.state.holders.get(note.job_id)
        if holder is None:
            return False
        holder.unsettled, holder.settle_at, holder.detail = True, note.settle_at, note.detail
        return True

    # -- what goes out ------------------------------------------------------------------------

    def grants(self, now: datetime) -> list[Holder]:
        """Start as many waiting jobs as there are free slots, in the queue's order."""
        granted: list[Holder] = []
        while self._waiting and self.free_slots() > 0:
            waiter = self._pick()
            server = self._server_for(waiter.graph_key) if self.state.servers else None
            holder = Holder(
                job_id=waiter.job_id,
                tenant=waiter.tenant,
                priority=waiter.priority,
                granted_at=now,
                asked_at=waiter.asked_at,
                in_follow=waiter.in_follow,
                server=server,
            )
            self.state.holders[waiter.job_id] = holder
            granted.append(holder)
        return granted

    def free_slots(self) -> int:
        state = self.state
        if state.drained is not None or (state.endpoint and state.endpoint.unhealthy):
            return 0
        bound = state.max_running
        free = len(self._waiting) if bound is None else max(bound - len(state.holders), 0)
        if state.servers:
            loads = self.server_loads()
            room = sum(
                max(state.server_slots - loads.get(s, 0), 0)
                for s in state.servers
                if self.takes_work(s)
            )
            free = min(free, room)
        return free

    # -- health (a pool of many servers, a watched RunPod endpoint) ---------------------------

    def unhealthy(self) -> str | None:
        """Why the pool takes no work now: its endpoint has no worker that can take a job, or
        every one of its servers is unhealthy or drained, at least one unhealthy. None: it
        takes work (or only an operator's drain holds it)."""
        state = self.state
        if state.endpoint is not None and state.endpoint.unhealthy:
            return state.endpoint.unhealthy
        if state.servers and not any(self.takes_work(s) for s in state.servers):
            reasons = [
                f"{s}: {known.unhealthy}"
                for s in state.servers
                if (known := state.server_states.get(s)) is not None and known.unhealthy
            ]
            if reasons:
                return "no server takes work (" + "; ".join(reasons) + ")"
        return None

    def set_endpoint(self, health: EndpointHealth) -> bool:
        """The endpoint's health as its watch read it; True when that changes the routing
        (unhealthy, cold)."""
        changed = not health.same_as(self.state.endpoint)
        self.state.endpoint = health
        return changed

    def cold_start_s(self) -> float | None:
        endpoint = self.state.endpoint
        return self.state.cold_start_s if endpoint is not None and endpoint.cold else None

    def health_view(self) -> PoolHealthView:
        """A new job's prospects here (query `health`), for a group's check."""
        per_start = self._seconds_per_start()
        eta = None if per_start is None else (len(self._waiting) + 1) * per_start
        cold = self.cold_start_s()
        if cold is not None:
            eta = (eta or 0.0) + cold
        return PoolHealthView(
            pool=self.state.pool,
            unhealthy=self.unhealthy(),
            waiting=len(self._waiting),
            running=len(self.state.holders),
            max_running=self.state.max_running,
            eta_s=None if eta is None else round(eta, 1),
        )

    # -- servers (a pool whose queue picks each job's server) --------------------------------

    def server_loads(self) -> dict[str, int]:
        loads: dict[str, int] = {}
        for holder in self.state.holders.values():
            if holder.server is not None:
                loads[holder.server] = loads.get(holder.server, 0) + 1
        return loads

    def takes_work(self, server: str) -> bool:
        known = self.state.server_states.get(server)
        return known is None or (known.unhealthy is None and known.drained is None)

    def set_health(self, server: str, unhealthy: str | None, now: datetime) -> bool:
        """A server's health as its check saw it (`unhealthy`: why not; None: healthy); True
        when that changed what the queue knew."""
        known = self.state.server_states.setdefault(server, ServerState())
        if (known.unhealthy is None) == (unhealthy is None):
            return False
        known.unhealthy, known.since = unhealthy, now
        if unhealthy is not None:
            known.failures += 1
        return True

    def drain(self, server: str | None, by: str | None, now: datetime) -> None:
        """No new job for `server` (None: for the whole pool) while `by` is set; None undrains.
        A job it runs finishes there."""
        if server is None:
            self.state.drained = by
            return
        known = self.state.server_states.setdefault(server, ServerState())
        known.drained, known.since = by, now

    def _server_for(self, graph_key: str | None) -> str:
        """The server a job starts on: the least loaded that takes work, then one that last ran
        the same graph (its models are warm), then the first named."""
        state, loads = self.state, self.server_loads()
        free = [
            (loads.get(s, 0), self._cold(s, graph_key), index, s)
            for index, s in enumerate(state.servers)
            if self.takes_work(s) and loads.get(s, 0) < state.server_slots
        ]
        server = min(free)[3]  # `free_slots` counted at least one
        known = state.server_states.setdefault(server, ServerState())
        known.started += 1
        if graph_key is not None:
            known.last_graph = graph_key
        return server

    def _cold(self, server: str, graph_key: str | None) -> int:
        known = self.state.server_states.get(server)
        warm = graph_key is not None and known is not None and known.last_graph == graph_key
        return 0 if warm else 1

    def server_views(self) -> list[ServerView]:
        state, loads = self.state, self.server_loads()
        views = []
        for server in state.servers:
            known = state.server_states.get(server) or ServerState()
            health: Literal["healthy", "unhealthy", "drained"] = "healthy"
            if known.drained is not None:
                health = "drained"
            elif known.unhealthy is not None:
                health = "unhealthy"
            views.append(
                ServerView(
                    url=server,
                    health=health,
                    running=loads.get(server, 0),
                    slots=state.server_slots,
                    started=known.started,
                    failures=known.failures,
                    last_error=known.unhealthy,
                    drained_by=known.drained,
                    since=known.since,
                )
            )
        return views

    def settle_due(self, now: datetime) -> list[str]:
        """Unsettled holders whose provider has surely ended their prompt by now."""
        return [
            h.job_id
            for h in self.state.holders.values()
            if h.unsettled and h.settle_at is not None and h.settle_at <= now
        ]

    def next_settle_at(self) -> datetime | None:
        times = [h.settle_at for h in self.state.holders.values() if h.unsettled and h.settle_at]
        return min(times) if times else None

    # -- where everyone stands ----------------------------------------------------------------

    def order(self) -> list[Waiter]:
        """Every waiting job in the order it would start if no one else came."""
        passes = dict(self.state.passes)
        heads = {
            p: {t: list(line) for t, line in lines.items() if line}
            for p, lines in self._lines.items()
        }
        ordered: list[Waiter] = []
        for priority in sorted(heads):
            tenants = heads[priority]
            heap = [(passes[t], line[0].seq, t) for t, line in tenants.items()]
            heapq.heapify(heap)
            cursor = dict.fromkeys(tenants, 0)
            while heap:
                tenant_pass, _seq, tenant = heapq.heappop(heap)
                line = tenants[tenant]
                ordered.append(line[cursor[tenant]])
                cursor[tenant] += 1
                passes[tenant] = tenant_pass + self._stride(tenant)
                if cursor[tenant] < len(line):
                    heapq.heappush(heap, (passes[tenant], line[cursor[tenant]].seq, tenant))
        return ordered

    def admission_of(self, job_id: str, now: datetime) -> Admission | None:
        if job_id in self.state.holders:
            return self.granted(job_id, now)
        for index, waiter in enumerate(self.order()):
            if waiter.job_id == job_id:
                return self._admission(waiter, index + 1, now)
        return None

    def positions(self, now: datetime) -> Iterator[Admission]:
        for index, waiter in enumerate(self.order()):
            yield self._admission(waiter, index + 1, now)

    def places(self) -> Iterator[tuple[str, int]]:
        """(job, position) for every waiting job, first first: `positions` without building
        an answer for each (the dispatcher tells only some of them)."""
        for index, waiter in enumerate(self.order()):
            yield waiter.job_id, index + 1

    def places_of(self, job_ids: Iterable[str]) -> LinePlaces:
        """The places of `job_ids` among the waiting (those not waiting are left out)."""
        wanted = set(job_ids) & self._waiting.keys()
        found: dict[str, int] = {}
        if wanted:
            for job_id, position in self.places():
                if job_id in wanted:
                    found[job_id] = position
                    if len(found) == len(wanted):
                        break
        return LinePlaces(
            places=found,
            waiting=len(self._waiting),
            per_start_s=self._seconds_per_start(),
            unhealthy=self.unhealthy(),
        )

    def watched(self, job_id: str) -> bool:
        """Whether the job's follow waits in line itself (nothing to tell it by signal)."""
        entry = self.state.holders.get(job_id) or self._waiting.get(job_id)
        return entry is not None and entry.in_follow

    def answer(self, job_id: str, position: int, now: datetime) -> Admission:
        """The place `position` (from `places`) as the waiting job hears it."""
        return self._admission(self._waiting[job_id], position, now)

    def granted(self, job_id: str, now: datetime) -> Admission:
        holder = self.state.holders[job_id]
        return Admission(
            pool=self.state.pool,
            job_id=job_id,
            granted=True,
            priority=holder.priority,
            tenant=holder.tenant,
            as_of=now,
            server=holder.server,
        )

    def view(self, now: datetime) -> PoolQueueView:
        state = self.state
        entries = [
            QueueEntry(
                job_id=w.job_id,
                tenant=w.tenant,
                priority=w.priority,
                state="waiting",
                position=i + 1,
                since=w.asked_at,
            )
            for i, w in enumerate(self.order())
        ]
        entries += [
            QueueEntry(
                job_id=h.job_id,
                tenant=h.tenant,
                priority=h.priority,
                state="unsettled" if h.unsettled else "running",
                since=h.granted_at,
                detail=h.detail,
                server=h.server,
            )
            for h in state.holders.values()
        ]
        return PoolQueueView(
            pool=state.pool,
            max_running=state.max_running,
            running=len(state.holders),
            waiting=len(self._waiting),
            entries=entries,
            tenants=self.tenant_counts(),
            eta_s_per_start=self._seconds_per_start(),
            servers=self.server_views(),
            drained=state.drained,
            endpoint=state.endpoint,
            unhealthy=self.unhealthy(),
        )

    def room(self, tenant: str) -> QueueRoom:
        """Whether a new job of `tenant` may join the line, as the workers' settings that the
        queue heard last bound it."""
        state = self.state
        mine = sum(1 for w in self._waiting.values() if w.tenant == tenant)
        pool_limit = min(state.pool_max_pending or MAX_LINE, MAX_LINE)
        checks = [
            (mine, state.tenant_max_pending.get(tenant), f"tenant {tenant!r}"),
            (len(self._waiting), pool_limit, f"pool {state.pool!r}"),
        ]
        per_start = self._seconds_per_start()
        headroom: int | None = None
        if tenant in state.weights:
            # Its bound heard (a tenant the queue never heard of may have one it does not know).
            headroom = min(limit - waiting for waiting, limit, _ in checks if limit is not None)
        for waiting, limit, whose in checks:
            if limit is not None and waiting >= limit:
                # Room comes when enough of the line has started: the first to start frees it.
                ahead = waiting - limit + 1
                retry = None if per_start is None else max(round(ahead * per_start, 1), 1.0)
                return QueueRoom(
                    full=True,
                    reason=f"{whose} has {waiting} jobs waiting for pool {state.pool!r}, "
                    f"its max_pending is {limit}",
                    waiting=waiting,
                    limit=limit,
                    retry_after_s=retry,
                )
        return QueueRoom(waiting=len(self._waiting), headroom=headroom)

    def tenant_counts(self) -> dict[str, tuple[int, int]]:
        """Tenant -> (waiting, running), without working out the order."""
        tenants: dict[str, tuple[int, int]] = {}
        for w in self._waiting.values():
            waiting, running = tenants.get(w.tenant, (0, 0))
            tenants[w.tenant] = (waiting + 1, running)
        for h in self.state.holders.values():
            waiting, running = tenants.get(h.tenant, (0, 0))
            tenants[h.tenant] = (waiting, running + 1)
        return tenants

    def snapshot(self, untold: Iterable[str] = (), unheard: Iterable[str] = ()) -> QueueState:
        """The state to carry into the next run, every waiter in arrival order."""
        self.state.waiters = sorted(self._waiting.values(), key=lambda w: w.seq)
        self.state.untold = sorted(j for j in untold if j in self._waiting)
        self.state.unheard = sorted(j for j in unheard if j in self.state.holders)
        return self.state

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def waiting_ids(self) -> Iterable[str]:
        return self._waiting.keys()

    # -- inside -------------------------------------------------------------------------------

    def _admission(self, waiter: Waiter, position: int, now: datetime) -> Admission:
        return placed(
            self.state.pool,
            waiter.job_id,
            position,
            waiting=len(self._waiting),
            priority=waiter.priority,
            tenant=waiter.tenant,
            per_start_s=self._seconds_per_start(),
            as_of=now,
            unhealthy=self.unhealthy(),
            cold_start_s=self.cold_start_s(),
        )

    def _seconds_per_start(self) -> float | None:
        """How long, on average, until the next slot frees: a hold time over the bound."""
        holds, bound = self.state.recent_holds_s, self.state.max_running
        if not holds or not bound:
            return None
        return sum(holds) / len(holds) / bound

    def _stride(self, tenant: str) -> float:
        weight = self.state.weights.get(tenant, 1.0)
        return 1.0 / weight if weight > 0 and math.isfinite(weight) else 1.0

    def _tenant_waits(self, tenant: str) -> bool:
        return any(lines.get(tenant) for lines in self._lines.values())

    def _enqueue(self, waiter: Waiter) -> None:
        self._lines.setdefault(waiter.priority, {}).setdefault(waiter.tenant, deque()).append(
            waiter
        )
        self._waiting[waiter.job_id] = waiter

    def _pick(self) -> Waiter:
        state = self.state
        priority = min(p for p, lines in self._lines.items() if any(lines.values()))
        lines = self._lines[priority]
        tenant = min(
            (t for t, line in lines.items() if line),
            key=lambda t: (state.passes.get(t, 0.0), lines[t][0].seq),
        )
        waiter = lines[tenant].popleft()
        del self._waiting[waiter.job_id]
        tenant_pass = state.passes.get(tenant, 0.0)
        state.last_pass = max(state.last_pass, tenant_pass)
        state.passes[tenant] = tenant_pass + self._stride(tenant)
        return waiter
