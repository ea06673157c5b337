"""The job as the gateway shows it: one function for GET, POST and every `status` event.

A view is the job's `JobStatus` (JSON), each artifact's `url` presigned afresh, and `links`.
What a view needs besides the status never changes for a job (its tenant, its links' lifetime),
so it is read from Temporal once per job and kept (`JobFacts`).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

from starter.client import JobClient
from starter.errors import JobNotFound
from workflows.contracts import Artifact, JobEvent, JobStatus

# Jobs whose facts are kept; the oldest read is forgotten first (it is read again if needed).
MAX_FACTS = 10_000
# What a client of the Python library sees but an HTTP client never does: where the job's
# worker pushes its steps (an address on the workers' network, for the gateway's own use).
INTERNAL: set[str] = {"live_progress"}


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


def etag(status: JobStatus) -> str:
    """`"<seq>.<step>.<digest>"`: the seq and step say how far the job is; the digest (of the
    status without links, whose presigned query strings change on every call) makes two
    answers with one tag the same answer, as a tag must, whatever else the step's heartbeat
    moved."""
    shown = status.model_dump(mode="json", exclude=INTERNAL)
    text = json.dumps(shown, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return f'"{status.seq}.{status.progress.step}.{digest}"'
