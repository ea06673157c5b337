"""One interface to every kind of pool, and the activities that route to it.

The workflow schedules `prepare_prompt`, `follow_prompt`, `offload_outputs` and `stop_prompt`
by name and never asks what runs a pool. Each pool's `kind` (`comfyui`, `runpod`) picks the
`Backend` that does the work; adding a kind is one more implementation of this protocol,
registered in worker.py, with no change to the workflow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from temporalio import activity

from activities.errors import fatal
from activities.settings import PoolConfig
from activities.webhooks import WebhookDeliverer
from workflows.activity_io import (
    FollowInput,
    FollowResult,
    OffloadInput,
    OffloadResult,
    PreparedJob,
    PrepareInput,
    StopCheck,
    StopInput,
)
from workflows.shared import (
    ACTIVITY_FOLLOW,
    ACTIVITY_OFFLOAD,
    ACTIVITY_PREPARE,
    ACTIVITY_STOP,
    ErrorType,
)


class Backend(Protocol):
    """What a kind of pool must do. Each call runs inside its activity (heartbeats, signals)."""

    async def prepare(self, req: PrepareInput, pool: str) -> PreparedJob:
        """Check the graph against the pool and stage its inputs; no GPU time is spent."""
        ...

    async def follow(self, req: FollowInput) -> FollowResult:
        """Submit (when `req.graph` is set and the backend does not know the prompt yet), then
        follow to the end: heartbeat a `FollowHeartbeat` on every event, send `progress`
        signals, store each output as it appears. A broken path fails retryably with the
        heartbeat as details; a prompt the backend provably lost fails as `PromptLost`."""
        ...

    async def offload(self, req: OffloadInput) -> OffloadResult:
        """Make sure every output of the prompt is stored and verified (size, sha256)."""
        ...

    async def stop(self, req: StopInput) -> StopCheck:
        """One check of a stop: dequeue or interrupt if needed, then say where the work is."""
        ...


class Backends:
    """The pools of the worker's settings, each with the backend of its kind."""

    def __init__(
        self, pools: Mapping[str, PoolConfig], default_pool: str, by_kind: Mapping[str, Backend]
    ) -> None:
        self._pools = pools
        self._default = default_pool
        self._by_kind = by_kind

    def resolve(self, pool: str | None) -> tuple[str, Backend]:
        name = pool or self._default
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

    def __init__(self, backends: Backends, webhooks: WebhookDeliverer | None = None) -> None:
        self._backends = backends
        self._webhooks = webhooks

    @activity.defn(name=ACTIVITY_PREPARE)
    async def prepare_prompt(self, req: PrepareInput) -> PreparedJob:
        pool, backend = self._backends.resolve(req.pool)
        if req.webhook is not None:
            # Here, once for every kind of pool: a webhook that could never be sent refuses
            # the job before anything reaches a backend.
            if self._webhooks is None:
                raise fatal(ErrorType.INVALID_REQUEST, "webhook: this worker sends no webhooks")
            await self._webhooks.refuse_unusable(req.webhook, req.tenant)
        return await backend.prepare(req, pool)

    @activity.defn(name=ACTIVITY_FOLLOW)
    async def follow_prompt(self, req: FollowInput) -> FollowResult:
        return await self._backends.resolve(req.pool)[1].follow(req)

    @activity.defn(name=ACTIVITY_OFFLOAD)
    async def offload_outputs(self, req: OffloadInput) -> OffloadResult:
        return await self._backends.resolve(req.pool)[1].offload(req)

    @activity.defn(name=ACTIVITY_STOP)
    async def stop_prompt(self, req: StopInput) -> StopCheck:
        return await self._backends.resolve(req.pool)[1].stop(req)
