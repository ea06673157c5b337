"""The local stack a benchmark run measures on, started and stopped by the harness.

Everything binds to 127.0.0.1 on free ports, with its state in a temporary directory, exactly as
the integration tests start it (`devstack.free_ports.make_stack_config` picks the ports; devstack's
`start_stack` / `start_service` start the services and `stop_stack` / `stop_service` stop them by
PID). On top of the stack:

- a second ComfyUI simulator with a real time per step (20 ms by default), for the jobs whose
  progress must be real (groups 6 and 7); the stack's own simulator runs with step delay 0;
- the project's worker (`python worker.py`, a process of its own) serving both as pools
  `comfyui` and `comfyui_timed`;
- the bare baseline's worker (`python -m bench.bare`), a process of its own too.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
from temporalio.client import Client

from activities.storage import ArtifactStore, S3Settings
from bench.bare import READY_MARK
from bench.calls import CallLog, counted_client
from bench.outcome import BenchOptions
from devstack.config import StackConfig
from devstack.free_ports import free_port, make_stack_config
from devstack.models import RunningStack
from devstack.processes import PidRecord, is_alive, log_tail, spawn_detached, terminate
from devstack.services import ENDPOINT_HANDLER, ENDPOINT_PYTHON, RUNPOD_SIM_KEY_VAR
from devstack.stack import start_service, start_stack, stop_service, stop_stack
from faults.worker_proc import KillableWorker
from starter import JobClient
from starter.connection import connect_temporal

ROOT = Path(__file__).resolve().parent.parent
FAST_POOL = "comfyui"  # the stack's simulator, step delay 0
TIMED_POOL = "comfyui_timed"  # the second simulator, a real time per step


@dataclass(frozen=True)
class Pool:
    name: str
    url: str
    step_delay_ms: int


@dataclass
class BenchContext:
    """What a benchmark module gets: the running stack and clients on it."""

    stack: RunningStack
    # A plain client for the harness's own reads (histories): never counted as the job's calls.
    temporal: Client
    store: ArtifactStore
    http: httpx.AsyncClient
    task_queue: str  # the project's worker
    bare_task_queue: str  # the bare baseline's worker
    fast: Pool
    timed: Pool
    work_dir: Path
    worker_log: Path  # the project's worker's JSON log lines (what it did, when)
    worker_pid: int | None = None  # the project's worker's process (for py-spy)
    # The Temporal dev server's Prometheus metrics (bench/server_calls.py): calls it served.
    temporal_metrics_url: str = ""

    def job_client(self, task_queue: str | None = None) -> tuple[JobClient, CallLog]:
        """A `JobClient` on the project's task queue (or `task_queue`: a group's own worker's)
        whose Temporal calls are recorded."""
        temporal, log = counted_client(self.temporal)
        queue = task_queue or self.task_queue
        return JobClient(temporal, task_queue=queue, store=self.store), log

    @property
    def temporal_pid(self) -> int | None:
        """The Temporal dev server's process (its CPU time is read from /proc)."""
        service = self.stack.services.get("temporal")
        return None if service is None else service.pid

    @property
    def s3_pid(self) -> int | None:
        """SeaweedFS's process (`weed mini`)."""
        service = self.stack.services.get("s3")
        return None if service is None else service.pid


def _timed_sim_config(config: StackConfig, state_dir: Path, step_delay_ms: int) -> StackConfig:
    """The stack's config with only its ComfyUI simulator moved: own port, own state dir (so
    its PID file is its own), its own time per step."""
    sim = config.comfyui_sim.model_copy(
        update={"port": free_port(), "step_delay_ms": step_delay_ms}
    )
    return config.model_copy(update={"state_dir": str(state_dir), "comfyui_sim": sim})


def _worker_env(stack: RunningStack, task_queue: str, fast: Pool, timed: Pool) -> dict[str, str]:
    pools = {pool.name: {"kind": "comfyui", "url": pool.url} for pool in (fast, timed)}
    return {
        **stack.worker_env(),
        "DURABLE_COMFY_TASK_QUEUE": task_queue,
        # Replaces the stack file's pools: no RunPod pool, nothing but the two simulators.
        "DURABLE_COMFY_POOLS": json.dumps(pools),
        "DURABLE_COMFY_DEFAULT_POOL": fast.name,
    }


async def _start_bare_worker(stack: RunningStack, task_queue: str, work_dir: Path) -> PidRecord:
    log_file = work_dir / "logs" / "bare-worker.log"
    argv = [
        sys.executable,
        "-m",
        "bench.bare",
        "--address",
        stack.temporal_address,
        "--namespace",
        stack.namespace,
        "--task-queue",
        task_queue,
    ]
    record = spawn_detached(argv, log_file, ROOT, work_dir / "pids" / "bare-worker.pid")
    deadline = time.monotonic() + 60
    while READY_MARK not in log_file.read_text(errors="replace"):
        if not is_alive(record) or time.monotonic() > deadline:
            await terminate(record, grace_s=5)
            raise RuntimeError(f"the bare worker did not start:\n{log_tail(log_file)}")
        await asyncio.sleep(0.05)
    return record


@asynccontextmanager
async def bench_stack(options: BenchOptions, keep: bool = False) -> AsyncIterator[BenchContext]:
    """Start everything, yield the context, stop everything this started by PID (also after a
    failure). The temporary state is removed unless `keep` (its logs say what went wrong)."""
    work_dir = Path(tempfile.mkdtemp(prefix="durable-comfy-bench-"))
    config = make_stack_config(work_dir / "state", step_delay_ms=0)
    timed_config = _timed_sim_config(config, work_dir / "timed-sim", options.timed_step_delay_ms)
    failed = True
    async with AsyncExitStack() as cleanup:
        cleanup.push_async_callback(stop_stack, config, work_dir)
        stack = await start_stack(config, work_dir)
        cleanup.push_async_callback(stop_service, timed_config, work_dir, "comfyui_sim")
        await start_service(timed_config, work_dir, "comfyui_sim")
        fast = Pool(FAST_POOL, config.comfyui_sim.url, 0)
        timed = Pool(TIMED_POOL, timed_config.comfyui_sim.url, options.timed_step_delay_ms)

        task_queue = f"bench-{uuid.uuid4().hex[:8]}"
        worker_log = work_dir / "logs" / "worker.log"
        worker = KillableWorker(_worker_env(stack, task_queue, fast, timed), worker_log)
        cleanup.push_async_callback(worker.terminate)
        await worker.start()
        bare_queue = f"bench-bare-{uuid.uuid4().hex[:8]}"
        bare = await _start_bare_worker(stack, bare_queue, work_dir)
        cleanup.push_async_callback(terminate, bare, grace_s=10)

        temporal = await connect_temporal(stack.temporal_address, stack.namespace, environ={})
        s3 = S3Settings.from_env(stack.worker_env())
        store = await cleanup.enter_async_context(ArtifactStore(s3))
        http = await cleanup.enter_async_context(httpx.AsyncClient(trust_env=False, timeout=30))
        try:
            yield BenchContext(
                stack,
                temporal,
                store,
                http,
                task_queue,
                bare_queue,
                fast,
                timed,
                work_dir,
                worker_log,
                worker.pid,
                f"http://127.0.0.1:{config.temporal.metrics_port}/metrics",
            )
            failed = False
        finally:
            if failed or keep:
                print(f"bench: the stack's state and logs are kept in {work_dir}", file=sys.stderr)
    if not (failed or keep):
        shutil.rmtree(work_dir, ignore_errors=True)


def logged_at(log_file: Path, event: str) -> dict[str, float]:
    """job_id -> epoch seconds of the worker's last `event` log line for it (JSON lines)."""
    found: dict[str, float] = {}
    for line in log_file.read_text(errors="replace").splitlines():
        if f'"{event}"' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == event and "job_id" in record and "timestamp" in record:
            found[record["job_id"]] = datetime.fromisoformat(record["timestamp"]).timestamp()
    return found


@dataclass(frozen=True)
class SimProcess:
    pool: Pool
    record: PidRecord
    output_dir: Path
    log_file: Path


@asynccontextmanager
async def extra_sim(
    ctx: BenchContext,
    name: str,
    *,
    step_delay_ms: float,
    parallel: int = 1,
    progress_log_prompts: int | None = None,
) -> AsyncIterator[SimProcess]:
    """One more ComfyUI simulator (`python -m devstack.comfy_sim`) for one benchmark, on a free
    port with its own directories under the run's work dir; stopped by PID when the block ends.
    `parallel` > 1: that many prompts run at once (the simulator's parallel mode)."""
    base = ctx.work_dir / "sims" / name
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "devstack.comfy_sim",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--output-dir",
        str(base / "output"),
        "--input-dir",
        str(base / "input"),
        "--step-delay-ms",
        str(step_delay_ms),
        "--parallel",
        str(parallel),
    ]
    if progress_log_prompts is not None:
        argv += ["--progress-log-prompts", str(progress_log_prompts)]
    log_file = ctx.work_dir / "logs" / f"sim-{name}.log"
    record = spawn_detached(argv, log_file, ROOT, ctx.work_dir / "pids" / f"sim-{name}.pid")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if (await ctx.http.get(f"{url}/system_stats", timeout=2)).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if not is_alive(record) or time.monotonic() > deadline:
                raise RuntimeError(f"simulator {name} did not start:\n{log_tail(log_file)}")
            await asyncio.sleep(0.1)
        yield SimProcess(Pool(name, url, int(step_delay_ms)), record, base / "output", log_file)
    finally:
        await terminate(record, grace_s=10)


@dataclass
class BenchWorker:
    """A worker process of one benchmark's own, on a task queue of its own."""

    task_queue: str
    log_file: Path
    killable: KillableWorker  # `python worker.py` (can be kill -9'ed, restarted)

    @property
    def pid(self) -> int:
        pid = self.killable.pid
        if pid is None:
            raise RuntimeError("the worker is not running")
        return pid


@asynccontextmanager
async def extra_worker(
    ctx: BenchContext,
    name: str,
    pools: list[Pool],
    *,
    max_concurrent_activities: int | None = None,
    env: dict[str, str] | None = None,
    pool_settings: dict[str, dict[str, object]] | None = None,
) -> AsyncIterator[BenchWorker]:
    """The project's worker (`python worker.py` as it ships) serving `pools` on a task queue of
    its own, stopped by PID at the end; `max_concurrent_activities` sets
    DURABLE_COMFY_MAX_CONCURRENT_ACTIVITIES (how many prompts it follows at once); `env`: more
    of its variables; `pool_settings`: the pools as DURABLE_COMFY_POOLS takes them, instead
    of a `comfyui` pool per simulator of `pools`."""
    task_queue = f"bench-{name}-{uuid.uuid4().hex[:8]}"
    variables = {
        **ctx.stack.worker_env(),
        "DURABLE_COMFY_TASK_QUEUE": task_queue,
        "DURABLE_COMFY_POOLS": json.dumps(
            pool_settings or {pool.name: {"kind": "comfyui", "url": pool.url} for pool in pools}
        ),
        "DURABLE_COMFY_DEFAULT_POOL": pools[0].name,
    }
    if max_concurrent_activities is not None:
        variables["DURABLE_COMFY_MAX_CONCURRENT_ACTIVITIES"] = str(max_concurrent_activities)
    variables.update(env or {})
    log_file = ctx.work_dir / "logs" / f"worker-{name}.log"
    killable = KillableWorker(variables, log_file, name=f"worker-{name}")
    try:
        await killable.start()
        yield BenchWorker(task_queue, log_file, killable=killable)
    finally:
        await killable.terminate(grace_s=10)


@dataclass(frozen=True)
class RunPodSimProcess:
    api_url: str  # the public API's base, `{url}/v2/{endpoint_id}`
    url: str
    endpoint_id: str
    api_key: str
    record: PidRecord


@asynccontextmanager
async def extra_runpod_sim(
    ctx: BenchContext, name: str, comfy_url: str, *, max_workers: int
) -> AsyncIterator[RunPodSimProcess]:
    """A RunPod simulator (`python -m devstack.runpod_sim`) whose workers run our handler
    (endpoint/handler.py under the real `runpod` loop, from the endpoint's venv) against one
    shared ComfyUI simulator at `comfy_url`, with the stack's bucket; no watchdog and no S3
    proxy per worker (a benchmark of the API path, not of fencing: two processes fewer per
    worker), each handler at idle CPU priority. Stopped by PID at the end; it stops its
    workers itself."""
    port = free_port()
    endpoint_id = f"bench-{name}"
    api_key = f"bench-{uuid.uuid4().hex}"
    stack = ctx.stack
    bucket = {
        "BUCKET_ENDPOINT_URL": stack.s3_endpoint,
        "BUCKET_ACCESS_KEY_ID": stack.access_key_id,
        "BUCKET_SECRET_ACCESS_KEY": stack.secret_access_key.get_secret_value(),
        "BUCKET_REGION": stack.region,
    }
    argv = [
        sys.executable,
        "-m",
        "devstack.runpod_sim",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--endpoint-id",
        endpoint_id,
        "--worker-command",
        # At idle priority (SCHED_IDLE): on RunPod each runs on a machine of its own, and a
        # hundred of them here would otherwise take the CPU the measured worker needs.
        f"chrt --idle 0 {ENDPOINT_PYTHON} {ENDPOINT_HANDLER}",
        "--worker-cwd",
        str(ROOT),
        *(f"--worker-env={variable}" for variable in bucket),
        f"--worker-env=COMFY_URL={comfy_url}",
        "--work-dir",
        str(ctx.work_dir / "runpod" / name),
        "--watchdog",
        "off",
        "--no-s3-proxy",
        "--max-workers",
        str(max_workers),
        "--idle-timeout",
        "120",
        "--stop-grace",
        "5",
    ]
    log_file = ctx.work_dir / "logs" / f"runpod-{name}.log"
    record = spawn_detached(
        argv,
        log_file,
        ROOT,
        ctx.work_dir / "pids" / f"runpod-{name}.pid",
        env={**bucket, RUNPOD_SIM_KEY_VAR: api_key},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if (await ctx.http.get(f"{url}/sim/health", timeout=2)).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if not is_alive(record) or time.monotonic() > deadline:
                raise RuntimeError(f"RunPod simulator {name} did not start:\n{log_tail(log_file)}")
            await asyncio.sleep(0.1)
        yield RunPodSimProcess(f"{url}/v2/{endpoint_id}", url, endpoint_id, api_key, record)
    finally:
        await terminate(record, grace_s=60)
