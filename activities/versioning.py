"""Worker Versioning: the Worker Deployment Version a worker polls as, and making it current.

A worker polls as one version (`deployment_name` + `build_id`) of a Worker Deployment, and every
InferenceJob it starts is *pinned* to that version (the worker's default versioning behaviour):
the job runs to its end there, its continue-as-new runs included, while new jobs go to the
deployment's current version. So an upgrade is new workers beside the old ones, not a patch
branch in the workflow (docs/upgrading.md).

Which version is current is the deployment's routing: an operator changes it with `temporal
worker deployment set-current-version`, or the worker does once it polls, as its `set_current`
setting says (`first`: only a deployment's very first version, when nothing else could serve a
job; `always`: every start, what the dev stack wants; `never`). Either way the worker says in its
log whether new jobs reach it (`worker_version_current` or `worker_version_not_current`, the
latter with the command that makes it current): a versioned worker nobody made current receives
no new job, and that must never be silent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from functools import partial
from typing import TypeVar

import structlog
from pydantic import BaseModel, ConfigDict
from temporalio.api.deployment.v1 import WorkerDeploymentVersion as VersionProto
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.workflowservice.v1 import (
    DescribeWorkerDeploymentRequest,
    DescribeWorkerDeploymentResponse,
    DescribeWorkerDeploymentVersionRequest,
    SetWorkerDeploymentCurrentVersionRequest,
)
from temporalio.client import Client
from temporalio.common import VersioningBehavior, WorkerDeploymentVersion
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import WorkerDeploymentConfig

from configuration.settings import WorkerSettings
from configuration.values import SetCurrent

log = structlog.get_logger("worker.versioning")

# How long a starting worker spends on its version's routing before it reports what it has: the
# server lists a version with its task queue about a second after the first poll.
SETTLE_DEADLINE_S = 30.0
POLL_EVERY_S = 0.5
MAX_BACKOFF_S = 2.0
RPC_TIMEOUT = timedelta(seconds=5)
# A conflicting routing change (another worker or an operator in between) is re-read and retried.
CONFLICT_RETRIES = 5
# Answers that mean "not now": a deployment's reads and writes go through a system workflow of
# its own that takes a few at a time ("too many requests issued to Worker Deployment"), the
# server is restarting, a call ran out of time.
TRANSIENT = frozenset(
    {RPCStatusCode.RESOURCE_EXHAUSTED, RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED}
)

T = TypeVar("T")


def worker_version(settings: WorkerSettings) -> WorkerDeploymentVersion | None:
    """The version this worker polls as; None for an unversioned worker."""
    if not settings.versioning:
        return None
    assert settings.build_id is not None, "WorkerSettings resolves it when versioning is on"
    return WorkerDeploymentVersion(settings.deployment_name, settings.build_id)


def deployment_config(settings: WorkerSettings) -> WorkerDeploymentConfig | None:
    """The Worker's deployment options: InferenceJob (no behaviour of its own) runs PINNED."""
    version = worker_version(settings)
    if version is None:
        return None
    return WorkerDeploymentConfig(
        version=version,
        use_worker_versioning=True,
        default_versioning_behavior=VersioningBehavior.PINNED,
    )


class Routing(BaseModel):
    """Where the deployment sends new jobs, as this worker found (and maybe left) it."""

    model_config = ConfigDict(frozen=True)

    version: str  # this worker's, `deployment.build_id`
    current: str | None  # the deployment's current version; None: unversioned workers
    made_current: bool = False
    problem: str | None = None  # why this worker could not make itself current

    @property
    def is_current(self) -> bool:
        return self.current == self.version


def set_current_command(version: WorkerDeploymentVersion) -> str:
    return (
        "temporal worker deployment set-current-version "
        f"--deployment-name {version.deployment_name} --build-id {version.build_id}"
    )


async def settle_routing(
    client: Client,
    version: WorkerDeploymentVersion,
    task_queue: str,
    set_current: SetCurrent,
    deadline_s: float = SETTLE_DEADLINE_S,
) -> Routing:
    """Once the server lists `version` polling `task_queue`, make it current if `set_current`
    says so, and return the routing as it then is. Call it after the worker began polling.

    Raises `RPCError` when the server refuses to say (still busy at the deadline, or a server
    without Worker Deployments)."""
    own = version.to_canonical_string()
    deadline = time.monotonic() + deadline_s
    registered = await _wait_until_registered(client, version, task_queue, deadline)
    current: str | None = None
    for _ in range(CONFLICT_RETRIES):
        described = await _retrying(
            lambda: _describe_deployment(client, version.deployment_name), deadline
        )
        current = _current_of(described)
        if current == own or not _should_set(set_current, current):
            return Routing(version=own, current=current)
        if not registered:
            problem = f"the server did not list it on {task_queue!r} in {deadline_s:.0f} s"
            return Routing(version=own, current=current, problem=problem)
        request = SetWorkerDeploymentCurrentVersionRequest(
            namespace=client.namespace,
            deployment_name=version.deployment_name,
            build_id=version.build_id,
            conflict_token=described.conflict_token if described else b"",
            identity=client.identity,
        )
        try:
            set_current_version = client.workflow_service.set_worker_deployment_current_version
            await _retrying(partial(set_current_version, request, timeout=RPC_TIMEOUT), deadline)
        except RPCError as err:
            if _is_conflict(err):
                # The routing changed since we read it (often: a worker of the same version,
                # started at the same moment, made it current): read it again.
                continue
            return Routing(version=own, current=current, problem=err.message)
        return Routing(version=own, current=own, made_current=True)
    return Routing(version=own, current=current, problem="the routing kept changing")


async def settle_and_report(client: Client, settings: WorkerSettings) -> Routing | None:
    """`settle_routing` for a worker with these settings, then `report`; None when unversioned
    or when the server could not say (logged: the worker serves on regardless)."""
    version = worker_version(settings)
    if version is None:
        return None
    try:
        routing = await settle_routing(client, version, settings.task_queue, settings.set_current)
    except RPCError as err:
        log.error(
            "worker_version_unknown",
            version=version.to_canonical_string(),
            error=err.message,
            check=f"temporal worker deployment describe --name {version.deployment_name}",
        )
        return None
    report(routing, version, settings.set_current)
    return routing


def report(routing: Routing, version: WorkerDeploymentVersion, set_current: SetCurrent) -> None:
    """One log line: whether new jobs reach this worker, and if not, what makes them."""
    if routing.is_current:
        log.info(
            "worker_version_current",
            version=routing.version,
            made_current=routing.made_current,
        )
        return
    log.warning(
        "worker_version_not_current",
        version=routing.version,
        current=routing.current or "unversioned workers",
        set_current=set_current,
        problem=routing.problem,
        # New jobs go to the current version; this worker serves only jobs pinned to its own.
        make_current=set_current_command(version),
    )


def _is_conflict(err: RPCError) -> bool:
    """A stale conflict token: ABORTED, or (as the dev server answers it) a refusal whose
    message says so."""
    return err.status == RPCStatusCode.ABORTED or "conflict token" in err.message.lower()


def _should_set(set_current: SetCurrent, current: str | None) -> bool:
    if set_current == "always":
        return True
    # `first`: a deployment with no current version sends new jobs to unversioned workers, and a
    # deployment's first version has none to replace; any later version waits for an operator.
    return set_current == "first" and current is None


def _current_of(described: DescribeWorkerDeploymentResponse | None) -> str | None:
    if described is None:
        return None
    routing = described.worker_deployment_info.routing_config
    current = routing.current_deployment_version
    if not current.build_id:
        return None
    return WorkerDeploymentVersion(current.deployment_name, current.build_id).to_canonical_string()


async def _describe_deployment(
    client: Client, deployment_name: str
) -> DescribeWorkerDeploymentResponse | None:
    """None while the deployment does not exist (no version of it has polled yet)."""
    try:
        return await client.workflow_service.describe_worker_deployment(
            DescribeWorkerDeploymentRequest(
                namespace=client.namespace, deployment_name=deployment_name
            ),
            timeout=RPC_TIMEOUT,
        )
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            return None
        raise


async def _retrying(call: Callable[[], Awaitable[T]], deadline: float) -> T:
    """`call()`, again after a growing pause while the server answers "not now" (`TRANSIENT`)
    and the deadline (a `time.monotonic()`) allows."""
    pause = POLL_EVERY_S
    while True:
        try:
            return await call()
        except RPCError as err:
            if err.status not in TRANSIENT or time.monotonic() + pause > deadline:
                raise
        await asyncio.sleep(pause)
        pause = min(pause * 2, MAX_BACKOFF_S)


async def _wait_until_registered(
    client: Client, version: WorkerDeploymentVersion, task_queue: str, deadline: float
) -> bool:
    """Whether the server lists `version` with `task_queue`'s workflow tasks by `deadline`.

    Routing applies to the task queues a version has registered: made current (or found
    current) before that, the worker's own task queue could still send its new jobs elsewhere.
    """
    request = DescribeWorkerDeploymentVersionRequest(
        namespace=client.namespace,
        deployment_version=VersionProto(
            deployment_name=version.deployment_name, build_id=version.build_id
        ),
    )
    while True:
        try:
            described = await client.workflow_service.describe_worker_deployment_version(
                request, timeout=RPC_TIMEOUT
            )
            if any(
                queue.name == task_queue and queue.type == TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW
                for queue in described.version_task_queues
            ):
                return True
        except RPCError as err:
            # NOT_FOUND: no poll of this version has reached the server yet.
            if err.status != RPCStatusCode.NOT_FOUND and err.status not in TRANSIENT:
                raise
        if time.monotonic() + POLL_EVERY_S > deadline:
            return False
        await asyncio.sleep(POLL_EVERY_S)
