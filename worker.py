"""`python worker.py` (or `durable-comfy worker`): the Temporal worker for InferenceJob.

It only wires things together: settings read once from the environment at start-up
(`configuration.processes.WorkerConfig`), one httpx client, one S3 client,
the activities built on them, and a graceful shutdown on SIGTERM/SIGINT so a running
`follow_prompt` hands its prompt to another worker at once instead of after a heartbeat timeout.
It polls as one version of a Worker Deployment, with InferenceJob pinned to the version a job
started on (`activities.versioning`, docs/upgrading.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import resource
import signal
import sys
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Annotated

import httpx
import structlog
import typer
from pydantic import SecretStr, ValidationError
from pydantic_settings import SettingsError
from temporalio.client import Client
from temporalio.runtime import Runtime
from temporalio.worker import PollerBehaviorAutoscaling, Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from activities import live_progress
from activities.backend import Backend, Backends, JobActivities
from activities.batches import BatchActivities
from activities.budgets import BudgetActivities
from activities.comfyui.backend import ComfyBackend
from activities.comfyui.pools import ComfyPools
from activities.comfyui.server_health import ServerHealthActivities
from activities.heartbeat_budget import HeartbeatBudget
from activities.live_progress import LiveProgress
from activities.log_setup import configure_logging
from activities.metrics import count_swept, prometheus_runtime
from activities.orphans import OrphanSweeper, RunPodSweep
from activities.pool_queue import PoolQueueActivities
from activities.runpod.backend import RunPodBackend
from activities.runpod.client import RunPodClient
from activities.runpod.endpoint_health import EndpointHealthActivities, read_health
from activities.runpod.nodes import check_captured_registries
from activities.runpod.retry import NO_RETRY
from activities.slot_watch import SlotWatch, waiters_room
from activities.storage import ArtifactStore
from activities.versioning import deployment_config, settle_and_report
from activities.webhooks import WebhookDeliverer
from configuration.pools import PoolConfig
from configuration.processes import WorkerConfig
from configuration.settings import (
    S3Settings,
    TemporalSettings,
    WebhookSettings,
    WorkerSettings,
    runpod_api_keys,
)
from protocol.comfyui.client import ComfyClient
from protocol.errors import ComfyError
from starter import doctor
from starter.client import JobClient
from starter.connection import forwarded_core_logs
from starter.errors import ChecksFailed
from starter.exit import exit_without_finalizing
from workflows.budget_ledger import TenantLedger
from workflows.errors import RunPodAuthError, RunPodError, RunPodRefused, StorageConfigError
from workflows.inference_job import InferenceJob
from workflows.job_batch import JobBatch
from workflows.pool_queue import PoolQueue

log = structlog.get_logger("worker")

GRACEFUL_SHUTDOWN = timedelta(seconds=5)
STICKY_TIMEOUT = timedelta(seconds=3)
# The SDK's own hold on an activity's newest heartbeat: short, the follow paces its own.
SDK_HEARTBEAT_THROTTLE = timedelta(seconds=0.05)
# The start-up check's GET /health, per endpoint.
RUNPOD_CHECK_TIMEOUT_S = 15.0
# How long the doctor waits for a ComfyUI server's answer.
POOL_CHECK_TIMEOUT_S = 5.0
# Open files a worker needs besides its slots (Temporal, S3, logs, the metrics server).
BASE_OPEN_FILES = 256
# Per slot: a followed ComfyUI prompt's WebSocket, and an HTTP connection for its calls.
OPEN_FILES_PER_SLOT = 2
# HTTP connections beyond one per slot (prepare's uploads, the orphan sweep, webhooks).
EXTRA_HTTP_CONNECTIONS = 64
# The RunPod API's own pool, apart from the shared one: every follow reads `/status` about once
# a second, and httpcore looks at each connection of its pool for every request it places (a
# syscall each), so at a hundred jobs a pool sized for a thousand slots took half the worker's
# event loop, and one of 32 a quarter (`make bench BENCH=runpod`). Sixteen carry RunPod's 200
# calls a second per endpoint at 80 ms a call.
RUNPOD_HTTP_LIMITS = httpx.Limits(max_connections=16, max_keepalive_connections=16)


async def run_worker(
    settings: WorkerSettings,
    s3: S3Settings,
    stop: asyncio.Event | None = None,
    client: Client | None = None,
    temporal: TemporalSettings | None = None,
    runpod_keys: Mapping[str, SecretStr] | None = None,
    webhooks: WebhookSettings | None = None,
) -> None:
    """Serve InferenceJob until `stop` is set (by default: SIGTERM or SIGINT).

    Without `client` it connects where `temporal` says (None: Temporal's own environment
    configuration alone), after the checks `durable-comfy doctor` runs (starter.doctor; all but
    "a worker polls"): a failing one raises `ChecksFailed` before anything polls.
    `runpod_keys`: each runpod pool's API key (None: read them from the environment now);
    `webhooks`: the webhook secrets and allow-list (None: from the environment now).
    """
    keys = runpod_api_keys(settings.pools) if runpod_keys is None else runpod_keys
    webhooks = WebhookSettings() if webhooks is None else webhooks
    stop = stop or _stop_on_signals()
    if client is None:
        runtime = None
        if settings.metrics_port is not None:
            runtime = prometheus_runtime(
                settings.metrics_port, forwarded_core_logs(), host=settings.metrics_host
            )
            address = f"{settings.metrics_host}:{settings.metrics_port}"
            log.info("metrics_serving", url=f"http://{address}/metrics")
        inputs = doctor.Inputs.of(
            temporal,
            settings.task_queue,
            s3,
            functools.partial(runpod_health, settings, keys),
            functools.partial(comfyui_servers_health, settings),
        )
        client = await doctor.connect_checked(inputs, runtime)
    # Temporal owns retries: no transport-level retries here.
    timeout = httpx.Timeout(30.0, connect=5.0)
    limits = http_limits(settings.max_concurrent_activities)
    async with (
        httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as http,
        httpx.AsyncClient(timeout=timeout, limits=RUNPOD_HTTP_LIMITS, trust_env=False) as api,
        ArtifactStore(s3) as store,
        contextlib.AsyncExitStack() as serving_live,
    ):
        pools = ComfyPools(settings, http)
        budget = HeartbeatBudget(settings.heartbeat_budget_per_s, settings.heartbeat_throttle_s)
        meter = (client.service_client.config.runtime or Runtime.default()).metric_meter
        live = LiveProgress(settings.live_progress_address, meter)
        comfy = ComfyBackend(pools, store, budget, live)
        on_runpod = runpod_clients(settings, keys, api)
        runpod = RunPodBackend(settings.pools, on_runpod, store, live=live)
        by_kind: dict[str, Backend] = {"comfyui": comfy, "runpod": runpod}
        deliverer = WebhookDeliverer(webhooks)
        sweeper = OrphanSweeper(
            client,
            pools.clients(),
            runpod=RunPodSweep(
                store, {name: (settings.pools[name], rp) for name, rp in on_runpod.items()}
            ),
            on_swept=lambda orphan: count_swept(meter, orphan.pool, orphan.action),
            followed_here=budget.is_following,
        )
        queues = PoolQueueActivities(client, sweeper)
        server_health = ServerHealthActivities(pools)
        endpoint_health = EndpointHealthActivities(on_runpod)
        # A batch's workflow starts its jobs as a client would: the same start, on this queue.
        starter = JobClient(client, task_queue=settings.task_queue)
        batches = BatchActivities(client, starter.start_batch_job)
        budgets = BudgetActivities(client, settings.tenants, settings.budget_day_s)
        jobs = JobActivities(
            Backends(settings.pools, settings.default_pool, by_kind, settings.groups),
            deliverer,
            s3,
            tenants=settings.tenants,
            reclaim_every_s=settings.orphan_sweep_interval_s or 60.0,
            ask_for_slot=queues.ask,
            release_slot=queues.release,
            slot_watch=SlotWatch(
                client, queues.request_on, waiters_room(settings.max_concurrent_activities)
            ),
            check_budget=budgets.check,
            pool_health=queues.health,
        )
        worker = Worker(
            client,
            task_queue=settings.task_queue,
            identity=live_progress.poller_identity(client.identity, live.url),
            workflows=[InferenceJob, PoolQueue, JobBatch, TenantLedger],
            activities=[
                jobs.prepare_prompt,
                jobs.follow_prompt,
                jobs.offload_outputs,
                jobs.stop_prompt,
                deliverer.deliver_webhook,
                queues.open_pool_queue,
                queues.closed_jobs,
                server_health.watch_pool_servers,
                endpoint_health.watch_endpoint_health,
                batches.cancel_batch_jobs,
                batches.ended_batch_jobs,
                batches.start_batch_jobs,
                budgets.record_spend,
            ],
            max_concurrent_activities=settings.max_concurrent_activities,
            max_cached_workflows=settings.max_cached_workflows,
            graceful_shutdown_timeout=GRACEFUL_SHUTDOWN,
            # After a worker is killed its workflows' tasks wait on its sticky queue this long
            # before another worker gets them (SDK default 10 s).
            sticky_queue_schedule_to_start_timeout=STICKY_TIMEOUT,
            # The SDK's default is 5 polls, one of them on the shared queue: a new job's first
            # task, and any task that waited on a busy worker's sticky queue past STICKY_TIMEOUT,
            # then share one poller. Following hundreds of jobs, that queue grew minutes deep
            # and new jobs did not start (bench/RESULTS.md). Scaled on the server's backlog.
            workflow_task_poller_behavior=PollerBehaviorAutoscaling(),
            # A ComfyUI follow paces its own heartbeats (the worker's budget, at most every
            # heartbeat_throttle_s: activities/heartbeat_budget.py) and sends a milestone (the
            # submission, a new stage) at once: the SDK must not hold one back (its default
            # throttle is 0.8 x the heartbeat timeout). The other activities heartbeat about
            # once a second at most.
            max_heartbeat_throttle_interval=SDK_HEARTBEAT_THROTTLE,
            # One version of a Worker Deployment; InferenceJob is pinned to the version it
            # started on (docs/upgrading.md). None: an unversioned worker.
            deployment_config=deployment_config(settings),
            workflow_runner=workflow_runner(),
        )
        sweeping: asyncio.Task[None] | None = None
        if settings.live_progress_port is not None and settings.live_progress_key is not None:
            await serving_live.enter_async_context(
                live_progress.serving(
                    live,
                    settings.live_progress_host,
                    settings.live_progress_port,
                    settings.live_progress_key,
                )
            )
        async with worker:
            # Polling has begun: the server registers the version, which may then be made
            # current. Only then is the worker started: new jobs reach it (or the log says why
            # not), which is what `make demo` waits for.
            routing = await settle_and_report(client, settings)
            log.info(
                "worker_started",
                task_queue=settings.task_queue,
                pools=sorted(settings.pools),
                namespace=client.namespace,
                version=routing.version if routing else None,
                current=routing.is_current if routing else None,
            )
            if settings.orphan_sweep_interval_s > 0:
                sweeping = asyncio.create_task(
                    sweeper.run(settings.orphan_sweep_interval_s, stop), name="orphan-sweep"
                )
            await stop.wait()
            log.info("worker_stopping")
            if sweeping is not None:
                await sweeping
    log.info("worker_stopped")


def workflow_runner() -> SandboxedWorkflowRunner:
    """The sandbox InferenceJob runs in, with the project's `workflows` package passed through.

    By default the sandbox imports the workflow's own module afresh for every workflow run (and
    with it any module that module imports as `from workflows import x`), compiling it from
    source where no bytecode cache was written (PYTHONDONTWRITEBYTECODE on a source checkout, as
    in `make bench`) and applying `@workflow.defn` again (bursts of 300 short jobs, nine rounds
    each: the worker's CPU per job 72 ms with that, 57 ms without). Every module of `workflows/`
    is deterministic and keeps no state between runs, and the others were already imported
    passed through; the sandbox's other restrictions stay as they are, and the tests
    (tests/workflows/test_replay_histories.py, the workflow tests' workers) still run the
    workflow under the default sandbox."""
    restrictions = SandboxRestrictions.default.with_passthrough_modules("workflows")
    return SandboxedWorkflowRunner(restrictions=restrictions)


def http_limits(slots: int) -> httpx.Limits:
    """The shared HTTP client's pool, sized to the slots: httpx's default (100 connections)
    would make 1,000 followed jobs queue for a connection for their POST /prompt, /history and
    /view calls. Idle connections kept: a fifth of the slots (at least httpx's 20)."""
    return httpx.Limits(
        max_connections=slots + EXTRA_HTTP_CONNECTIONS,
        max_keepalive_connections=max(20, slots // 5),
    )


def open_files_needed(slots: int) -> int:
    return slots * OPEN_FILES_PER_SLOT + BASE_OPEN_FILES


def raise_open_files_limit(slots: int) -> None:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit when it is below what `slots`
    followed jobs need (`open_files_needed`): a common soft limit is 1,024, which 1,000 slots'
    sockets exceed. Logs a warning with the numbers when even the hard limit is too low (the
    worker still starts: a job past the limit fails its follow, and is retried)."""
    needed = open_files_needed(slots)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else hard
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning(
                "open_files_limit_unchanged", soft=soft, hard=hard, needed=needed, error=str(exc)
            )
            return
        log.info("open_files_limit_raised", was=soft, now=target, needed=needed, slots=slots)
    if target < needed:
        log.warning(
            "open_files_limit_low",
            limit=target,
            needed=needed,
            slots=slots,
            hint="raise the hard limit (ulimit -Hn, LimitNOFILE=, --ulimit nofile=) or lower "
            "DURABLE_COMFY_MAX_CONCURRENT_ACTIVITIES",
        )


def runpod_clients(
    settings: WorkerSettings, keys: Mapping[str, SecretStr], http: httpx.AsyncClient
) -> dict[str, RunPodClient]:
    """One client per runpod pool, on the worker's HTTP client for the RunPod API."""
    return {
        name: RunPodClient.for_pool(pool, keys[name], http)
        for name, pool in settings.pools.items()
        if pool.kind == "runpod"
    }


async def runpod_health(
    settings: WorkerSettings, keys: Mapping[str, SecretStr]
) -> doctor.CheckResult:
    """The doctor's `runpod` check: each runpod pool's endpoint answers `GET /health` with the
    pool's key. One try each (no retries): a doctor says what it sees now."""
    pools = {name: pool for name, pool in settings.pools.items() if pool.kind == "runpod"}
    if not pools:
        return doctor.CheckResult(
            check=doctor.Check.RUNPOD, outcome=doctor.Outcome.OK, message="no runpod pools"
        )
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=5.0), trust_env=False) as http:
        answers = [
            (name, await _endpoint_health(name, pool, keys[name], http))
            for name, pool in sorted(pools.items())
        ]
    failures = [answer for _, answer in answers if not isinstance(answer, str)]
    if not failures:
        answered = "; ".join(f"{name}: GET /health answered: {answer}" for name, answer in answers)
        return doctor.CheckResult(
            check=doctor.Check.RUNPOD, outcome=doctor.Outcome.OK, message=answered
        )
    refused = any(problem is doctor.Problem.CONFIGURATION for problem, _ in failures)
    return doctor.CheckResult(
        check=doctor.Check.RUNPOD,
        outcome=doctor.Outcome.FAIL,
        message="; ".join(message for _, message in failures),
        problem=doctor.Problem.CONFIGURATION if refused else doctor.Problem.UNREACHABLE,
    )


async def _endpoint_health(
    name: str, pool: PoolConfig, key: SecretStr, http: httpx.AsyncClient
) -> tuple[doctor.Problem, str] | str:
    """What the pool's endpoint's workers and jobs are when it answers; else what kind of
    problem, and what to do."""
    client = RunPodClient.for_pool(pool, key, http, retry=NO_RETRY)
    where = f"endpoint {pool.endpoint_id} (pool {name!r})"
    try:
        async with asyncio.timeout(RUNPOD_CHECK_TIMEOUT_S):
            health = read_health(await client.health(), datetime.now(UTC))
    except RunPodAuthError as exc:
        return doctor.Problem.CONFIGURATION, (
            f"the key in {exc.variable} is refused by {where}, HTTP {exc.status_code}: set "
            f"{exc.variable} to a key of that endpoint's account"
        )
    except RunPodRefused as exc:
        return doctor.Problem.CONFIGURATION, (
            f"{where} refused GET /health ({doctor.one_line(exc)}): check the pool's "
            "endpoint_id and url"
        )
    except (RunPodError, TimeoutError) as exc:
        return doctor.Problem.UNREACHABLE, (
            f"{where} did not answer GET /health at {pool.url} "
            f"({doctor.one_line(exc) or 'no answer in time'})"
        )
    said = (
        f"{health.idle} idle, {health.initializing} starting, {health.running} running, "
        f"{health.unhealthy_workers} unhealthy, {health.throttled} throttled; "
        f"{health.in_queue} in queue"
    )
    if health.unhealthy is not None:
        said += f" (takes no work: {health.unhealthy})"
    return said


async def comfyui_servers_health(settings: WorkerSettings) -> doctor.CheckResult:
    """The doctor's `pools` check: every server of each comfyui pool answers `GET /queue`,
    and what it holds. One try each: a doctor says what it sees now."""
    pools = {name: pool for name, pool in settings.pools.items() if pool.kind == "comfyui"}
    if not pools:
        return doctor.CheckResult(
            check=doctor.Check.POOLS, outcome=doctor.Outcome.OK, message="no comfyui pools"
        )
    timeout = httpx.Timeout(POOL_CHECK_TIMEOUT_S, connect=POOL_CHECK_TIMEOUT_S)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as http:

        async def look(url: str) -> tuple[str, str | None, int]:
            """(server, why it did not answer or None, prompts it holds)."""
            try:
                queue = await ComfyClient(url, http).queue()
            except ComfyError as exc:
                return url, doctor.one_line(exc) or "no answer", 0
            held = sum(len(queue.get(key, [])) for key in ("queue_running", "queue_pending"))
            return url, None, held

        seen = {
            name: await asyncio.gather(*(look(url) for url in pool.servers))
            for name, pool in sorted(pools.items())
        }
    failures = [
        f"{url} (pool {name!r}) did not answer GET /queue ({error})"
        for name, answers in seen.items()
        for url, error, _ in answers
        if error is not None
    ]
    lines = []
    for name, answers in seen.items():
        up = sum(1 for _, error, _ in answers if error is None)
        busy = [f"{url} holds {held}" for url, error, held in answers if error is None and held]
        lines.append(
            f"{name}: {up} of {len(answers)} server(s) answer"
            + (f" ({', '.join(busy)})" if busy else "")
        )
    if failures:
        return doctor.CheckResult(
            check=doctor.Check.POOLS,
            outcome=doctor.Outcome.FAIL,
            message="; ".join(failures + lines),
            problem=doctor.Problem.UNREACHABLE,
        )
    return doctor.CheckResult(
        check=doctor.Check.POOLS, outcome=doctor.Outcome.OK, message="; ".join(lines)
    )


def doctor_pools_check() -> doctor.PoolsCheck:
    """The `pools` check for `durable-comfy doctor` (through the `worker` plugin, as
    `doctor_runpod_check`)."""
    try:
        settings = WorkerSettings()
    except (ValidationError, SettingsError) as exc:
        return _refused_check(doctor.Check.POOLS, exc)
    return functools.partial(comfyui_servers_health, settings)


def doctor_runpod_check() -> doctor.RunPodCheck:
    """The `runpod` check for `durable-comfy doctor`, with the worker's settings read now
    (the CLI finds it through the `worker` plugin: starter.cli.doctor). Settings that do not
    load fail the check, one line naming each variable."""
    try:
        settings = WorkerSettings()
        keys = runpod_api_keys(settings.pools)
    except (ValidationError, SettingsError) as exc:
        return _refused_check(doctor.Check.RUNPOD, exc)
    return functools.partial(runpod_health, settings, keys)


def _refused_check(check: doctor.Check, exc: ValidationError | SettingsError) -> doctor.RunPodCheck:
    """A doctor check of the worker's that fails: its settings do not load (one line naming
    each variable)."""
    message = "; ".join(problem_lines(exc))

    async def refused() -> doctor.CheckResult:
        return doctor.CheckResult(
            check=check,
            outcome=doctor.Outcome.FAIL,
            message=f"invalid worker settings: {message}",
            problem=doctor.Problem.CONFIGURATION,
        )

    return refused


class SetCurrentOption(StrEnum):
    """`--set-current` for typer, which takes an Enum for a choice: `SetCurrent`'s values (a
    test holds them equal)."""

    FIRST = "first"
    ALWAYS = "always"
    NEVER = "never"


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def serve(flags: Mapping[str, object]) -> None:
    """Read every setting once (`flags`, the command's options, winning over the variables),
    then serve until SIGTERM or SIGINT. A bad setting stops the worker, naming its variable."""
    try:
        config = WorkerConfig.load(**flags)
        check_captured_registries(config.settings.pools)
    except (ValidationError, SettingsError, StorageConfigError) as exc:
        sys.exit("\n".join(f"worker: invalid settings: {line}" for line in problem_lines(exc)))
    settings = config.settings
    configure_logging(settings.log_level)
    raise_open_files_limit(settings.max_concurrent_activities)
    try:
        asyncio.run(
            run_worker(
                settings,
                config.s3,
                temporal=config.temporal,
                runpod_keys=config.runpod_keys,
                webhooks=config.webhooks,
            )
        )
    except ChecksFailed as refused:
        # The doctor's lines, no traceback: each says what to fix.
        for line in refused.lines:
            print(f"worker: {line}", file=sys.stderr)
        exit_without_finalizing(refused.exit_code)
    exit_without_finalizing(0)


def problem_lines(exc: Exception) -> list[str]:
    """One line per problem, each naming its variable (never a value)."""
    if not isinstance(exc, ValidationError):
        return [str(exc)]
    return [
        f"{where} is not set"
        if error["type"] == "missing"
        else f"{where}: {str(error['msg']).removeprefix('Value error, ')}"
        for error in exc.errors()
        for where in [".".join(str(part) for part in error["loc"]) or "settings"]
    ]


def cli_command(
    metrics_port: Annotated[
        int | None,
        typer.Option(
            help="Serve Prometheus metrics on HOST:PORT/metrics (DURABLE_COMFY_METRICS_PORT; "
            "HOST: DURABLE_COMFY_METRICS_HOST, default 127.0.0.1)."
        ),
    ] = None,
    build_id: Annotated[
        str | None,
        typer.Option(
            help="Build ID of this worker's version (DURABLE_COMFY_BUILD_ID; default: the "
            "package version)."
        ),
    ] = None,
    set_current: Annotated[
        SetCurrentOption | None,
        typer.Option(
            help="Make this worker's version current: first (only a deployment's first "
            "version), always, never (an operator does; docs/upgrading.md) "
            "(DURABLE_COMFY_SET_CURRENT; default: first)."
        ),
    ] = None,
) -> None:
    """Run the Temporal worker (pools from temporal-dev.yaml or the environment)."""
    # An option not given leaves its variable (then the file, then the default) to decide.
    flags = {
        "metrics_port": metrics_port,
        "build_id": build_id,
        "set_current": set_current.value if set_current is not None else None,
    }
    serve({name: value for name, value in flags.items() if value is not None})


def main(argv: list[str] | None = None) -> None:
    """`python worker.py [OPTIONS]`: the command `durable-comfy worker` runs, options and all."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(cli_command)
    app(args=argv, prog_name="worker.py")


if __name__ == "__main__":
    main()
