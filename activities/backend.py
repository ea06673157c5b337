"""One interface to every kind of pool, and the activities that route to it.

The workflow schedules `prepare_prompt`, `follow_prompt`, `offload_outputs` and `stop_prompt`
by name and never asks what runs a pool. Each pool's `kind` (`comfyui`, `runpod`) picks the
`Backend` that does the work; adding a kind is one more implementation of this protocol,
registered in worker.py, with no change to the workflow.

A request that stages no input file has no prepare activity: its first follow carries the
check (`FollowInput.prepare`), done here before the backend submits anything. That takes an
activity, or a local activity's two extra workflow activations, off every such job's way to
its GPU. The workflow may then name no pool (None): each activity resolves it to the worker's
default before anything reads it, as prepare would have, and says which pool that was.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, TypeVar

import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.comfyui.graph import warm_key
from activities.errors import fatal, retryable
from activities.follow_common import send_progress
from activities.inputs import refuse_inputs_outside_area
from activities.slot_watch import SlotWatch
from activities.webhooks import WebhookDeliverer
from configuration.pools import COLD_START_S, PoolConfig
from configuration.settings import S3Settings
from configuration.tenants import TenantConfig, priority_refusal, tenant_config
from workflows import activity_io
from workflows.admission import Admission, PoolBound, PoolHealthView, SlotRelease, SlotRequest
from workflows.budgets import BudgetHold
from workflows.contracts import Checkpoint, ProgressReport
from workflows.failures import as_refused_before_submission
from workflows.shared import (
    ACTIVITY_FOLLOW,
    ACTIVITY_OFFLOAD,
    ACTIVITY_PREPARE,
    ACTIVITY_STOP,
    DEFAULT_TENANT,
    ErrorType,
)

log = structlog.get_logger(__name__)


class Backend(Protocol):
    """What a kind of pool must do. Each call runs inside its activity (heartbeats, signals)."""

    async def prepare(self, req: activity_io.PrepareInput, pool: str) -> activity_io.PreparedJob:
        """Check the graph against the pool and stage its inputs; no GPU time is spent."""
        ...

    async def follow(self, req: activity_io.FollowInput) -> activity_io.FollowResult:
        """Submit (when `req.graph` is set and the backend does not know the prompt yet), then
        follow to the end: heartbeat a `FollowHeartbeat` on every event, send `progress`
        signals, store each output as it appears. A broken path fails retryably with the
        heartbeat as details; a prompt the backend provably lost fails as `PromptLost`."""
        ...

    async def offload(self, req: activity_io.OffloadInput) -> activity_io.OffloadResult:
        """Make sure every output of the prompt is stored and verified (size, sha256)."""
        ...

    async def stop(self, req: activity_io.StopInput) -> activity_io.StopCheck:
        """One check of a stop: dequeue or interrupt if needed, then say where the work is."""
        ...


class Backends:
    """The pools of the worker's settings, each with the backend of its kind."""

    def __init__(
        self,
        pools: Mapping[str, PoolConfig],
        default_pool: str,
        by_kind: Mapping[str, Backend],
        groups: Mapping[str, list[str]] | None = None,
    ) -> None:
        self._pools = pools
        self._default = default_pool
        self._by_kind = by_kind
        self._groups = groups or {}

    def group(self, pool: str | None) -> tuple[str, list[str]] | None:
        """The group a request's `pool` (None: the default) names, with its pools in order;
        None when it names a pool."""
        name = self._default if pool is None else pool
        members = self._groups.get(name)
        return None if members is None else (name, list(members))

    def kind_of(self, pool: str) -> str:
        return self._pools[pool].kind

    def config_of(self, pool: str) -> PoolConfig:
        return self._pools[pool]

    def resolve(self, pool: str | None) -> tuple[str, Backend]:
        name = self._default if pool is None else pool
        if name in self._groups:
            # Only a check picks a group's pool; a stop or an offload of a job that has not
            # heard which it picked asks again once the job has.
            raise retryable(
                ErrorType.BACKEND_UNAVAILABLE,
                f"the job's pool in group {name!r} is not known yet",
                pool=name,
            )
        config = self._pools.get(name)
        if config is None:
            known = ", ".join(sorted(self._pools)) or "none"
            raise fatal(
                ErrorType.UNKNOWN_POOL,
                f"pool {name!r} is not configured on this worker (configured pools: {known})",
                pool=name,
            )
        backend = self._by_kind.get(config.kind)
        if backend is None:
            raise fatal(
                ErrorType.UNKNOWN_POOL,
                f"pool {name!r} is of kind {config.kind!r}, which this worker cannot run",
                pool=name,
            )
        return name, backend


class JobActivities:
    """The activities the workflow schedules, each routed to its pool's backend."""

    def __init__(
        self,
        backends: Backends,
        webhooks: WebhookDeliverer | None,
        storage: S3Settings,
        tenants: Mapping[str, TenantConfig] | None = None,
        reclaim_every_s: float = 60.0,
        ask_for_slot: Callable[[str, SlotRequest], Awaitable[Admission | None]] | None = None,
        release_slot: Callable[[str, SlotRelease], Awaitable[bool]] | None = None,
        slot_watch: SlotWatch | None = None,
        check_budget: Callable[[str, str, str], Awaitable[tuple[str | None, BudgetHold | None]]]
        | None = None,
        pool_health: Callable[[str], Awaitable[PoolHealthView | None]] | None = None,
    ) -> None:
        self._backends = backends
        self._webhooks = webhooks
        self._storage = storage
        self._tenants = tenants or {}
        self._reclaim_every_s = reclaim_every_s
        # The pool queue's signal-with-start (activities/pool_queue.py): a bounded pool's check
        # asks for the job's slot at once, so the queue's answer races the check's own result.
        self._ask_for_slot = ask_for_slot
        # And its release: the follow that saw a bounded job's last prompt end gives the slot
        # back itself, at once, rather than by the job's signal at its very end.
        self._release_slot = release_slot
        # A check told a place waits for its grant here, watching the queue (slot_watch.py).
        self._slot_watch = slot_watch
        # Tenants' daily budgets (activities/budgets.py): whether the job's tenant has one, and
        # whether its spend today holds the job until the reset.
        self._check_budget = check_budget
        # A group's check asks each of its pools' queues whether it takes work (query `health`).
        self._pool_health = pool_health

    @activity.defn(name=ACTIVITY_PREPARE)
    async def prepare_prompt(self, req: activity_io.PrepareInput) -> activity_io.PreparedJob:
        return await self._prepare(req)

    async def _prepare(
        self, req: activity_io.PrepareInput, *, in_follow: bool = False
    ) -> activity_io.PreparedJob:
        group = self._backends.group(req.pool)
        if group is not None:
            req = req.model_copy(update={"pool": await self._pool_of_group(req, *group)})
        prepared = await self._prepare_on_pool(req, in_follow=in_follow)
        if group is not None:
            prepared = prepared.model_copy(update={"group": group[0]})
        return prepared

    async def _pool_of_group(
        self, req: activity_io.PrepareInput, group: str, members: list[str]
    ) -> str:
        """The first pool of the group that takes work (by its queue: a pool with none always
        does) and, for a job with a start deadline, whose estimated start is within it; the
        pool the job is leaving is passed. None does: the one it is leaving (it stays in line
        there), else the group's first."""
        views: list[PoolHealthView | None] = [None] * len(members)
        if self._pool_health is not None:
            views = list(await asyncio.gather(*(self._pool_health(m) for m in members)))
        for pool, view in zip(members, views, strict=True):
            if pool == req.leaving:
                continue
            why = _passed(view, req.start_by_s)
            if why is None:
                return pool
            log.info("group_pool_passed", job_id=req.job_id, group=group, pool=pool, reason=why)
        return req.leaving or members[0]

    async def _prepare_on_pool(
        self, req: activity_io.PrepareInput, *, in_follow: bool = False
    ) -> activity_io.PreparedJob:
        pool, backend = self._backends.resolve(req.pool)
        # Here, once for every kind of pool, before any input is read: a tenant's job names
        # only its own files (workflows/tenancy.py).
        refuse_inputs_outside_area(req, self._storage)
        if req.webhook is not None:
            # Here, once for every kind of pool: a webhook that could never be sent refuses
            # the job before anything reaches a backend.
            if self._webhooks is None:
                raise fatal(ErrorType.INVALID_REQUEST, "webhook: this worker sends no webhooks")
            await self._webhooks.refuse_unusable(req.webhook, req.tenant)
        tenant = req.tenant or DEFAULT_TENANT
        terms = tenant_config(self._tenants, tenant)
        refusal = priority_refusal(self._tenants, tenant, req.priority)
        if refusal is not None:
            # Here, before anything is read or staged: the tenant's rights come first.
            raise fatal(
                ErrorType.PRIORITY_NOT_ALLOWED,
                refusal,
                priority=req.priority,
                max_priority=terms.max_priority,
            )
        prepared = await backend.prepare(req, pool)
        if self._check_budget is not None:
            # After the graph's check (a bad job fails now, not after the reset), before the
            # pool's queue is asked: a job held by its tenant's budget holds no place in line.
            budget, held = await self._check_budget(tenant, req.job_id, pool)
            if budget is not None:
                prepared = prepared.model_copy(update={"budget": budget, "held": held})
            if held is not None:
                return prepared
        bound = self._bound(pool, terms)
        if bound is None:
            return prepared
        if bound.servers:
            bound = bound.model_copy(update={"graph_key": warm_key(prepared.graph)})
        asked, admission = await self._asked(req, bound, in_follow=in_follow)
        return prepared.model_copy(
            update={"bound": bound, "slot_asked": asked, "admission": admission}
        )

    async def _asked(
        self, req: activity_io.PrepareInput, bound: PoolBound, *, in_follow: bool = False
    ) -> tuple[bool, Admission | None]:
        """Ask the pool's queue for the job's slot (idempotent): whether it was asked here
        (if not, the workflow asks itself), and its answer when it gave one at once."""
        if self._ask_for_slot is None or req.accepted_at is None:
            return False, None
        ask = _slot_request(req, bound, in_follow=in_follow)
        try:
            admission = await self._ask_for_slot(bound.pool, ask)
        except Exception as exc:  # the workflow asks by signal instead
            log.warning("pool_slot_not_asked", pool=bound.pool, error=str(exc))
            return False, None
        return True, admission

    def _bound(self, pool: str, terms: TenantConfig) -> PoolBound | None:
        config = self._backends.config_of(pool)
        bound = config.running_bound
        if bound is None:
            return None
        settle_after_s = None
        if config.kind == "runpod":
            # RunPod ends a job at its executionTimeout: past it (and the handler's fencing
            # margin) a prompt whose stop was never confirmed has surely stopped.
            timeout = config.execution_timeout_s
            settle_after_s = None if timeout is None else timeout + (config.fence_after_s or 30)
        return PoolBound(
            pool=pool,
            max_running=bound,
            weight=terms.weight,
            reclaim_every_s=self._reclaim_every_s,
            settle_after_s=settle_after_s,
            tenant_max_pending=terms.max_pending,
            pool_max_pending=config.max_pending,
            servers=config.servers if config.assigns_servers else [],
            server_slots=config.slots_per_server,
            watch_endpoint=config.kind == "runpod",
            cold_start_s=(config.cold_start_s or COLD_START_S) if config.kind == "runpod" else None,
        )

    @activity.defn(name=ACTIVITY_FOLLOW)
    async def follow_prompt(self, req: activity_io.FollowInput) -> activity_io.FollowResult:
        if req.prepare is None:
            pool, backend = self._backends.resolve(req.pool)
            return await self._given_back(req, pool, await backend.follow(_on_pool(req, pool)))
        # Told a place, this check waits in line itself (no grant signal, no second follow).
        watch = self._slot_watch
        waits = bool(req.slot_wait_s > 0 and not req.slot_held and watch and watch.has_room())
        try:
            prepared = await self._prepare(req.prepare, in_follow=waits)
        except ApplicationError as refusal:
            if not refusal.non_retryable:
                raise  # a pool slow or down: the workflow backs off and tries again
            raise as_refused_before_submission(refusal) from refusal
        pool, backend = self._backends.resolve(prepared.pool)
        if prepared.held is not None:
            # Its tenant's budget is spent for today: nothing is submitted before the reset.
            return activity_io.FollowResult(
                prompt_id=req.prompt_id,
                outcome="held",
                checkpoint=req.checkpoint or Checkpoint(job_id=req.job_id),
                pool=pool,
                kind=prepared.kind,
                budget=prepared.budget,
                held=prepared.held,
            )
        if prepared.budget is not None:
            # Before anything is submitted, the job hears whose budget counts it: however its
            # prompt ends (a failure, a cancel before any report), it tells that ledger.
            report = ProgressReport(attempt_client_id=req.client_id, budget=prepared.budget)
            await send_progress(req.job_id, report, log)
        if prepared.bound is not None and not req.slot_held:
            granted = prepared.admission is not None and prepared.admission.granted
            if not granted and waits and prepared.slot_asked:
                granted = await self._wait_in_line(req, req.prepare, prepared.bound, prepared)
                if granted:
                    server = await self._server_granted(req.job_id, prepared.bound)
                    grant = _grant(req.prepare, prepared.bound, server)
                    prepared = prepared.model_copy(update={"admission": grant})
            if not granted:
                # Checked, and nothing reaches a bounded pool without a slot of its queue.
                return activity_io.FollowResult(
                    prompt_id=req.prompt_id,
                    outcome="needs_slot",
                    checkpoint=req.checkpoint or Checkpoint(job_id=req.job_id),
                    pool=pool,
                    kind=prepared.kind,
                    bound=prepared.bound,
                    slot_asked=prepared.slot_asked,
                    admission=prepared.admission,
                    budget=prepared.budget,
                    group=prepared.group,
                )
            # The check's own ask was granted (an idle pool): submit now, in this attempt,
            # rather than hand the grant to the workflow for a second follow. Its reports and
            # its result tell the workflow it holds the slot.
            server = prepared.admission.server if prepared.admission else None
            req = req.model_copy(
                update={"slot_held": True, "slot_bound": prepared.bound, "server": server}
            )
        result = await backend.follow(_on_pool(req, pool))
        update: dict[str, Any] = {
            "pool": pool,
            "kind": prepared.kind,
            "budget": prepared.budget,
            "group": prepared.group,
        }
        if req.slot_bound is not None:
            update |= {"bound": prepared.bound, "slot_asked": True, "admission": prepared.admission}
        return await self._given_back(req, pool, result.model_copy(update=update))

    async def _wait_in_line(
        self,
        req: activity_io.FollowInput,
        check: activity_io.PrepareInput,
        bound: PoolBound,
        prepared: activity_io.PreparedJob,
    ) -> bool:
        """Until the check's job holds its slot (True), or its `slot_wait_s` is over (False):
        the job hears its place from here (a `progress` report with `admission`)."""
        assert self._slot_watch is not None

        async def tell(place: Admission) -> None:
            report = ProgressReport(attempt_client_id=req.client_id, slot=bound, admission=place)
            await send_progress(req.job_id, report, log)

        info = activity.info()
        beat = 5.0
        if info.heartbeat_timeout:
            beat = min(beat, info.heartbeat_timeout.total_seconds() / 3)
        return await self._slot_watch.wait(
            info.task_queue,
            bound.pool,
            _slot_request(check, bound, in_follow=True),
            prepared.admission,
            wait_s=req.slot_wait_s,
            tell=tell,
            heartbeat=activity.heartbeat,
            heartbeat_every_s=beat,
            leave_when_unhealthy=prepared.group is not None,
            start_by=_start_by(check) if prepared.group is not None else None,
        )

    async def _server_granted(self, job_id: str, bound: PoolBound) -> str | None:
        """The server the queue gave a job granted while its check waited in line (the watch
        sees who holds a slot, not where)."""
        if not bound.servers or self._slot_watch is None:
            return None
        grant = await self._slot_watch.admission_of(activity.info().task_queue, bound.pool, job_id)
        return grant.server if grant is not None else None

    async def _given_back(
        self, req: activity_io.FollowInput, pool: str, result: activity_io.FollowResult
    ) -> activity_io.FollowResult:
        """The result, with the job's slot given back when this was its last prompt and it
        ended (provably: the follow saw it end). False when the signal did not go: the job
        gives it back itself at its end, as for every other ending."""
        last = req.segment >= req.segments - 1
        if not (req.slot_held and last and result.outcome == "success"):
            return result
        if self._release_slot is None:
            return result
        released = await self._release_slot(pool, SlotRelease(job_id=req.job_id))
        return result.model_copy(update={"slot_released": released})

    @activity.defn(name=ACTIVITY_OFFLOAD)
    async def offload_outputs(self, req: activity_io.OffloadInput) -> activity_io.OffloadResult:
        pool, backend = self._backends.resolve(req.pool)
        return await backend.offload(_on_pool(req, pool))

    @activity.defn(name=ACTIVITY_STOP)
    async def stop_prompt(self, req: activity_io.StopInput) -> activity_io.StopCheck:
        pool, backend = self._backends.resolve(req.pool)
        check = await backend.stop(_on_pool(req, pool))
        update: dict[str, Any] = {}
        bound = self._bound(pool, tenant_config(self._tenants, DEFAULT_TENANT))
        if bound is not None:
            update["slot"] = bound
        if req.pool is None:
            update |= {"pool": pool, "kind": self._backends.kind_of(pool)}
        return check.model_copy(update=update) if update else check


def _start_by(check: activity_io.PrepareInput) -> datetime | None:
    """When the job must have begun running (its check's start deadline, left of it)."""
    if check.start_by_s is None or check.accepted_at is None:
        return None
    if check.leaving is not None:
        # Checked again: `start_by_s` is what was left of it then.
        return datetime.now(UTC) + timedelta(seconds=check.start_by_s)
    return check.accepted_at + timedelta(seconds=check.start_by_s)


def _passed(view: PoolHealthView | None, start_by_s: float | None) -> str | None:
    """Why a group's check passes a pool (None: it does not): it takes no work now, or a job
    with a start deadline would not start there in time by its queue's estimate."""
    if view is None:
        return None  # no queue (unbounded, or no job asked yet): nothing says it is not well
    if view.unhealthy:
        return view.unhealthy
    if start_by_s is not None and view.eta_s is not None and view.eta_s > start_by_s:
        return f"estimated start in {view.eta_s:.0f} s, past its start_by_s {start_by_s:.0f} s"
    return None


def _slot_request(
    req: activity_io.PrepareInput, bound: PoolBound, *, in_follow: bool
) -> SlotRequest:
    assert req.accepted_at is not None
    return SlotRequest.of_bound(
        bound,
        job_id=req.job_id,
        tenant=req.tenant or DEFAULT_TENANT,
        priority=req.priority,
        accepted_at=req.accepted_at,
        in_follow=in_follow,
    )


def _grant(req: activity_io.PrepareInput, bound: PoolBound, server: str | None = None) -> Admission:
    """The grant a check that waited in line saw (by the queue's holders, not an answer)."""
    return Admission(
        pool=bound.pool,
        job_id=req.job_id,
        granted=True,
        priority=req.priority,
        tenant=req.tenant or DEFAULT_TENANT,
        server=server,
    )


_Routed = TypeVar(
    "_Routed", activity_io.FollowInput, activity_io.OffloadInput, activity_io.StopInput
)


def _on_pool(req: _Routed, pool: str) -> _Routed:
    """The request with its pool named: a backend reads `req.named_pool`, a configured name."""
    return req if req.pool == pool else req.model_copy(update={"pool": pool})
