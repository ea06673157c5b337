"""The soak's own stack, on free loopback ports in a directory of its own, and the levers the
fault injector pulls (inject.py's faults, on this stack).

- the Temporal dev server, SeaweedFS and a ComfyUI simulator (for the `comfyui` pool), started
  and stopped by devstack's launcher, by PID (`services`): a kill -9 and a restart of Temporal
  or SeaweedFS comes back on the same database file or data directory;
- a RunPod simulator per endpoint (endpoints.py);
- two orchestrator workers, `python worker.py` subprocesses (`KillableWorker`) serving every pool.

`running` stops everything it started by PID, in reverse order, however the block ends; what
outlived that is in `leftovers()`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from temporalio.client import Client

from activities.storage import ArtifactStore, S3Settings
from devstack.config import StackConfig
from devstack.free_ports import make_stack_config
from devstack.models import ServiceState
from devstack.processes import PidRecord, is_alive, read_pid_file
from devstack.seaweed import load_credentials
from devstack.services import ServiceName, StackPaths
from devstack.stack import stop_service
from faults.inject import ServiceFaults
from faults.soak.endpoints import EndpointSpec, RunpodEndpoint
from faults.worker_proc import KillableWorker
from starter import JobClient
from starter.connection import connect_temporal

log = structlog.get_logger("soak.stack")

COMFY_POOL = "comfyui"
WORKERS = 2
# Seconds between each worker's orphan sweeps (the product's default is a minute).
ORPHAN_SWEEP_S = 10.0
# Started in this order (Temporal last: it takes random ephemeral ports for its internals).
SERVICES: tuple[ServiceName, ...] = ("s3", "comfyui_sim", "temporal")
RESTART_ATTEMPTS = 3


class SoakStackError(RuntimeError):
    """The stack could not be started or brought back: the soak cannot go on."""


@dataclass
class SoakStack:
    work_dir: Path
    config: StackConfig
    endpoints: dict[str, RunpodEndpoint]
    task_queue: str
    api_key: str
    step_delay_ms: int
    workers: list[KillableWorker] = field(default_factory=list)
    # Every service process ever started (restarts too), for the leftover check.
    service_records: list[PidRecord] = field(default_factory=list)

    @property
    def base_dir(self) -> Path:
        return self.work_dir

    @property
    def paths(self) -> StackPaths:
        return StackPaths.of(self.config, self.work_dir)

    @property
    def services(self) -> ServiceFaults:
        return ServiceFaults(self.config, self.work_dir)

    @property
    def comfy_url(self) -> str:
        return self.config.comfyui_sim.url

    @property
    def pools(self) -> dict[str, str]:
        kinds = {COMFY_POOL: "comfyui"}
        kinds.update({name: ep.spec.kind_label for name, ep in self.endpoints.items()})
        return kinds

    def s3_settings(self) -> S3Settings:
        return S3Settings.from_env(self._base_env())

    def _base_env(self) -> dict[str, str]:
        creds = load_credentials(self.paths.s3_credentials)
        if creds is None:
            raise SoakStackError("no S3 credentials in the soak's state dir")
        s3, temporal = self.config.s3, self.config.temporal
        return {
            "TEMPORAL_ADDRESS": temporal.address,
            "TEMPORAL_NAMESPACE": temporal.namespace,
            "DURABLE_COMFY_S3_ENDPOINT": s3.endpoint_url,
            "DURABLE_COMFY_BUCKET": s3.bucket,
            "AWS_ACCESS_KEY_ID": creds.access_key_id,
            "AWS_SECRET_ACCESS_KEY": creds.secret_access_key.get_secret_value(),
            "AWS_REGION": s3.region,
            "AWS_DEFAULT_REGION": s3.region,
            "AWS_ENDPOINT_URL_S3": s3.endpoint_url,
        }

    def bucket_env(self) -> dict[str, str]:
        """The bucket as our handler reads it (worker-comfyui's names)."""
        env = self._base_env()
        return {
            "BUCKET_ENDPOINT_URL": env["DURABLE_COMFY_S3_ENDPOINT"],
            "BUCKET_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"],
            "BUCKET_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"],
            "BUCKET_REGION": env["AWS_REGION"],
        }

    def worker_env(self) -> dict[str, str]:
        pools: dict[str, Any] = {COMFY_POOL: {"kind": "comfyui", "url": self.comfy_url}}
        pools.update({name: ep.pool_config() for name, ep in self.endpoints.items()})
        return {
            **self._base_env(),
            "RUNPOD_API_KEY": self.api_key,
            "DURABLE_COMFY_TASK_QUEUE": self.task_queue,
            "DURABLE_COMFY_POOLS": json.dumps(pools),
            "DURABLE_COMFY_DEFAULT_POOL": COMFY_POOL,
            "DURABLE_COMFY_ORPHAN_SWEEP_S": str(ORPHAN_SWEEP_S),
        }

    # -- levers -------------------------------------------------------------------------------

    async def start_service(self, name: ServiceName) -> None:
        """Start it with its flags, ports and data; waits until it answers."""
        self._remember(name, await self.services.start(name, attempts=RESTART_ATTEMPTS))

    async def restart_service(self, name: ServiceName, *, down_s: float) -> None:
        """kill -9 its process group (a crash: no shutdown of any kind), start it again
        `down_s` later."""
        state = await self.services.restart(name, down_s=down_s, attempts=RESTART_ATTEMPTS)
        self._remember(name, state)

    def _remember(self, name: ServiceName, state: ServiceState) -> None:
        record = read_pid_file(self.paths.pid_file(name))
        if record is not None and record.pid == state.pid:
            self.service_records.append(record)

    async def client(self) -> JobClient:
        temporal = await self.temporal_client()
        return JobClient(temporal, task_queue=self.task_queue)

    async def temporal_client(self) -> Client:
        t = self.config.temporal
        return await connect_temporal(t.address, t.namespace, environ={})

    def store(self) -> ArtifactStore:
        return ArtifactStore(self.s3_settings())

    # -- what outlived the stop ------------------------------------------------------------------

    def leftovers(self) -> list[int]:
        alive = [pid for w in self.workers for pid in w.running_pids()]
        for endpoint in self.endpoints.values():
            alive += endpoint.alive_pids()
        alive += [record.pid for record in self.service_records if is_alive(record)]
        return sorted(set(alive))


async def _stop_services(config: StackConfig, work_dir: Path) -> None:
    for name in reversed(SERVICES):
        try:
            await stop_service(config, work_dir, name)
        except Exception as exc:  # stop the others whatever this one did
            log.error("service did not stop", service=name, error=str(exc))


async def _stop_workers(workers: list[KillableWorker]) -> None:
    await asyncio.gather(*(w.terminate(grace_s=15.0) for w in workers), return_exceptions=True)


def new_stack(work_dir: Path, step_delay_ms: int) -> SoakStack:
    """The stack's description (ports, task queue, keys); nothing runs yet."""
    return SoakStack(
        work_dir=work_dir,
        config=make_stack_config(work_dir / "state", step_delay_ms=step_delay_ms),
        endpoints={},
        task_queue=f"soak-{uuid.uuid4().hex[:8]}",
        api_key=f"soak-{secrets.token_hex(16)}",
        step_delay_ms=step_delay_ms,
    )


@asynccontextmanager
async def running(stack: SoakStack, specs: list[EndpointSpec]) -> AsyncIterator[SoakStack]:
    """Start everything; on the way out, however it is left, stop it all in reverse order."""
    work_dir = stack.work_dir
    async with AsyncExitStack() as cleanup:
        cleanup.push_async_callback(_stop_services, stack.config, work_dir)
        for name in SERVICES:
            log.info("starting service", service=name)
            await stack.start_service(name)
        for spec in specs:
            endpoint = RunpodEndpoint(
                spec,
                work_dir / "runpod" / spec.pool,
                stack.api_key,
                stack.bucket_env(),
                stack.step_delay_ms,
            )
            stack.endpoints[spec.pool] = endpoint
            cleanup.push_async_callback(endpoint.stop)
            log.info("starting RunPod simulator", pool=spec.pool, port=endpoint.port)
            await endpoint.start()
        cleanup.push_async_callback(_stop_workers, stack.workers)
        env = stack.worker_env()
        for index in range(WORKERS):
            label = f"worker-{index + 1}"
            worker = KillableWorker(env, work_dir / "logs" / f"{label}.log", name=label)
            stack.workers.append(worker)
            await worker.start()
            log.info("orchestrator worker started", worker=label, pid=worker.pid)
        yield stack
