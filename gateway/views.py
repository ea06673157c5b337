"""The job as the gateway shows it: one function for GET, POST and every `status` event; a
batch likewise (`batch_view`); and a bounded pool's queue as one tenant may see it
(`queue_view`).

A view is the job's `JobStatus` (JSON), each artifact's `url` presigned afresh, and `links`.
What a view needs besides the status never changes for a job (its tenant, its links' lifetime),
so it is read from Temporal once per job and kept (`JobFacts`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from datetime import datetime
from typing import Any, Final

from temporalio.common import SearchAttributeKey
from temporalio.service import RPCError, RPCStatusCode

from starter.client import JobClient
from starter.errors import BatchNotFound, JobNotFound
from workflows.admission import PoolQueueView
from workflows.batches import BATCH_ID_PATTERN, BatchStatus
from workflows.contracts import Artifact, JobEvent, JobStatus
from workflows.shared import BATCH_WORKFLOW_TYPE, SA_TENANT

# Jobs whose facts are kept; the oldest read is forgotten first (it is read again if needed).
MAX_FACTS = 10_000
# What a client of the Python library sees but an HTTP client never does: where the job's
# worker pushes its steps (an address on the workers' network, for the gateway's own use); and
# of its place in its pool's queue, the tenant (the caller's own) and the job's ID (the job's).
INTERNAL: dict[str, Any] = {"live_progress": True, "admission": {"tenant": True, "job_id": True}}
_TENANT_KEY: Final = SearchAttributeKey.for_keyword(SA_TENANT)


class _Bounded(OrderedDict[str, Any]):
    def keep(self, key: str, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > MAX_FACTS:
            self.popitem(last=False)


class JobFacts:
    """What never changes about a job, read once: its tenant and its links' lifetime."""

    def __init__(self) -> None:
        self._tenants = _Bounded()
        self._ttls = _Bounded()
        # Batches apart from jobs: a job's ID given as a batch's must not pass for one.
        self._batch_tenants = _Bounded()

    async def check_tenant(self, client: JobClient, job_id: str, tenant: str) -> None:
        """`JobNotFound` unless the job is `tenant`'s: another tenant's job, and one started
        without a tenant, look exactly like no job at all."""
        owner = self._tenants.get(job_id)
        if owner is None:
            owner = await client.tenant_of(job_id) or ""
            self._tenants.keep(job_id, owner)
        if owner != tenant:
            raise JobNotFound(job_id)

    def record_tenant(self, job_id: str, tenant: str) -> None:
        """A job this gateway started: its tenant is known without asking."""
        self._tenants.keep(job_id, tenant)

    async def check_batch_tenant(self, client: JobClient, batch_id: str, tenant: str) -> None:
        """`BatchNotFound` unless the batch is `tenant`'s: as for a job, another tenant's
        batch, and a workflow that is no batch (a job's ID), look like no batch at all."""
        owner = self._batch_tenants.get(batch_id)
        if owner is None:
            owner = await batch_owner(client, batch_id)
            self._batch_tenants.keep(batch_id, owner)
        if owner != tenant:
            raise BatchNotFound(batch_id)

    def record_batch_tenant(self, batch_id: str, job_ids: list[str], tenant: str) -> None:
        """A batch this gateway started, and its jobs: their tenant is known without asking."""
        self._batch_tenants.keep(batch_id, tenant)
        for job_id in job_ids:
            self._tenants.keep(job_id, tenant)

    async def presign_ttl(self, client: JobClient, job_id: str) -> int:
        ttl = self._ttls.get(job_id)
        if ttl is None:
            ttl = await client.presign_ttl(job_id)
            self._ttls.keep(job_id, ttl)
        return int(ttl)


class JobViews:
    """Builds views of one gateway's jobs (its client, its facts, its links' base path)."""

    def __init__(self, client: JobClient, facts: JobFacts, base_path: str = "") -> None:
        self.client = client
        self.facts = facts
        self.base_path = base_path

    def links(self, job_id: str) -> dict[str, str]:
        own = f"{self.base_path}/v1/jobs/{job_id}"
        names = ("events", "ws", "artifacts", "cancel", "resume")
        return {"self": own, **{name: f"{own}/{name}" for name in names}}

    async def artifacts(self, job_id: str, artifacts: list[Artifact]) -> list[dict[str, Any]]:
        if not artifacts or self.client.store is None:
            return [a.model_dump(mode="json") for a in artifacts]
        ttl_s = await self.facts.presign_ttl(self.client, job_id)
        return [(await self.client.presigned(a, ttl_s)).model_dump(mode="json") for a in artifacts]

    async def status(self, status: JobStatus) -> dict[str, Any]:
        """The job: what GET answers and every `status` event carries."""
        view = status.model_dump(mode="json", exclude=INTERNAL)
        view["artifacts"] = await self.artifacts(status.job_id, status.artifacts)
        view["links"] = self.links(status.job_id)
        return view

    async def entry(self, job_id: str, event: JobEvent) -> dict[str, Any]:
        """A journal entry, its artifact's link presigned afresh."""
        view = event.model_dump(mode="json", exclude_none=True)
        if event.artifact is not None:
            [view["artifact"]] = await self.artifacts(job_id, [event.artifact])
        return view


async def batch_owner(client: JobClient, batch_id: str) -> str:
    """The batch's tenant (its workflow's `Tenant`), or "" for a workflow that is not a batch or
    has no tenant. `BatchNotFound` when there is none by that ID."""
    if not re.match(BATCH_ID_PATTERN, batch_id):
        raise BatchNotFound(batch_id)
    with client.translated_errors():
        try:
            description = await client.temporal.get_workflow_handle(batch_id).describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                raise BatchNotFound(batch_id) from None
            raise
    if description.workflow_type != BATCH_WORKFLOW_TYPE:
        return ""
    return description.typed_search_attributes.get(_TENANT_KEY) or ""


def batch_links(base_path: str, batch_id: str) -> dict[str, str]:
    own = f"{base_path}/v1/batches/{batch_id}"
    return {"self": own, **{name: f"{own}/{name}" for name in ("events", "results", "cancel")}}


def batch_view(status: BatchStatus, base_path: str = "") -> dict[str, Any]:
    """The batch: what GET answers and every `status` event of its stream carries; each job
    with the link to its own status."""
    view = status.model_dump(mode="json")
    view["terminal"] = status.terminal
    for job in view["jobs"]:
        job["links"] = {"self": f"{base_path}/v1/jobs/{job['job_id']}"}
    view["links"] = batch_links(base_path, status.batch_id)
    return view


def batch_etag(status: BatchStatus) -> str:
    """`"<seq>.<digest>"`: the jobs' live states and progress change between two of the
    batch's own changes, so the digest of the whole status makes one tag one answer."""
    text = json.dumps(status.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return f'"{status.seq}.{hashlib.sha256(text.encode()).hexdigest()[:12]}"'


def etag_matches(if_none_match: str, tag: str) -> bool:
    offered = [t.strip().removeprefix("W/") for t in if_none_match.split(",")]
    return "*" in offered or tag in offered


def etag(status: JobStatus) -> str:
    """`"<seq>.<step>.<digest>"`: the seq and step say how far the job is; the digest (of the
    status without links, whose presigned query strings change on every call) makes two
    answers with one tag the same answer, as a tag must, whatever else the step's heartbeat
    moved."""
    shown = status.model_dump(mode="json", exclude=INTERNAL)
    text = json.dumps(shown, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return f'"{status.seq}.{status.progress.step}.{digest}"'


def queue_view(view: PoolQueueView, tenant: str, now: datetime) -> dict[str, Any]:
    """A pool's queue as `tenant` may see it: its own jobs, waiting and running (ID, state,
    place, priority, age), and of everyone else's only totals: no other tenant's job ID or name.

    `eta_s_per_start` is the queue's estimate of the time between two starts (a recent hold
    time over the bound); a waiting job's `eta_s` is its position times that, and the queue's
    `eta_s` how long until every job waiting now has started. None until a job of the pool
    has ended since its queue started."""
    per_start = view.eta_s_per_start
    jobs: list[dict[str, Any]] = []
    for entry in view.entries:
        if entry.tenant != tenant:
            continue
        job: dict[str, Any] = {
            "job_id": entry.job_id,
            "state": entry.state,
            "position": entry.position,
            "priority": entry.priority,
            "since": entry.since.isoformat(),
            "age_s": round(max((now - entry.since).total_seconds(), 0.0), 1),
            "eta_s": None,
        }
        if entry.position is not None and per_start is not None:
            job["eta_s"] = round(entry.position * per_start, 1)
        if entry.detail:
            job["detail"] = entry.detail
        jobs.append(job)
    # Waiting first, in the order they will start; then the slots held, oldest first.
    jobs.sort(key=lambda j: (j["position"] is None, j["position"] or 0, j["since"]))
    waiting, running = view.tenants.get(tenant, (0, 0))
    return {
        "pool": view.pool,
        "max_running": view.max_running,
        "running": view.running,
        "waiting": view.waiting,
        "eta_s_per_start": None if per_start is None else round(per_start, 1),
        "eta_s": None if per_start is None else round(view.waiting * per_start, 1),
        "mine": {"waiting": waiting, "running": running},
        "others": {
            "waiting": max(view.waiting - waiting, 0),
            "running": max(view.running - running, 0),
        },
        "jobs": jobs,
    }
