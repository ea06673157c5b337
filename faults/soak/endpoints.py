"""The soak's RunPod endpoints: a RunPod simulator each, on a free port, stopped by PID.

Which endpoints run is pluggable (`EndpointSpec`): our handler (endpoint/handler.py, claims on)
always; a stock worker-comfyui endpoint for a `claims: false` pool when asked or available —
the real handler from `../shared/worker-comfyui` in `.venv-stock` through its launcher
(tests/runpod_handlers/worker_comfyui.py), or the project's stand-in
(tests/runpod_handlers/stock_comfyui.py, in `.venv-endpoint`). Each worker gets a ComfyUI
simulator of its own from `faults.soak.comfy_factory`, which keeps its counters when it goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from devstack.free_ports import free_port
from devstack.processes import PidRecord, is_alive, log_tail, spawn_detached, terminate
from devstack.runpod_sim import Ledger, SimSettings
from devstack.runpod_sim.faults import PublicRoute
from faults.inject import RunpodFaults
from faults.soak.comfy_factory import ARGS_VAR, FINAL_FILE, HANDLE_FILE
from faults.soak.options import StockMode

ROOT = Path(__file__).resolve().parents[2]
ENDPOINT_PYTHON = ROOT / ".venv-endpoint" / "bin" / "python"
STOCK_PYTHON = ROOT / ".venv-stock" / "bin" / "python"
STOCK_LAUNCHER = ROOT / "tests" / "runpod_handlers" / "worker_comfyui.py"
STANDIN_HANDLER = ROOT / "tests" / "runpod_handlers" / "stock_comfyui.py"
FACTORY = "faults.soak.comfy_factory:SoakComfyPerWorker"
IDLE_TIMEOUT_S = 5.0
# The simulator stops its workers on SIGTERM: job-stop signals, each worker's grace, its ComfyUI.
STOP_GRACE_S = 40.0
WORKER_STOP_GRACE_S = 5.0

# Faults that make sense on an endpoint of each kind. Without claims nobody can tell whether a
# lost /run answer made a job, or whether a crashed worker's prompt ran: such a job waits for a
# person's decision by design (README, `claims`), so those faults are not injected there.
CLAIMS_FAULTS = frozenset(
    {
        "runpod_429",
        "runpod_5xx",
        "drop_run_answer",
        "runpod_crash_timed_out",
        "runpod_crash_redeliver",
        "runpod_crash_stuck",
        # Our handler's endpoint only: its watchdog (endpoint/watchdog.py, started beside each
        # handler by the simulator) is what ends a frozen or cut-off worker's run.
        "runpod_freeze",
        "runpod_freeze_thaw",
        "runpod_partition",
        "comfy_socket_cut",
        "comfy_socket_stall",
    }
)
STOCK_FAULTS = frozenset({"runpod_429", "runpod_5xx"})
# A 5xx to /run may have made a job: without claims that is a decision for a person too, so a
# stock endpoint's 5xx bursts hit its other routes only.
STOCK_5XX_ROUTES: tuple[PublicRoute, ...] = (
    "status",
    "cancel",
    "stream",
    "retry",
    "purge-queue",
    "health",
)


@dataclass(frozen=True)
class EndpointSpec:
    pool: str
    endpoint_id: str
    worker_command: tuple[str, ...]
    claims: bool
    # The workers get the stack's bucket (our handler stores outputs and claims there).
    bucket: bool
    max_workers: int
    faults: frozenset[str]
    # The public routes a 5xx burst may hit (None: all of them).
    burst_5xx_routes: tuple[PublicRoute, ...] | None = None
    handler: str = "our handler"

    @property
    def kind_label(self) -> str:
        watchdog = ", watchdog" if self.runs_watchdog else ""
        return f"runpod, {self.handler}{watchdog}" + ("" if self.claims else ", claims: false")

    @property
    def runs_watchdog(self) -> bool:
        """The simulator starts a watchdog beside each worker (its `--watchdog auto`)."""
        settings = SimSettings(worker_command=self.worker_command, worker_cwd=ROOT)
        return settings.watchdog_argv() is not None


def ours() -> EndpointSpec:
    return EndpointSpec(
        pool="runpod",
        endpoint_id="soak-ours",
        worker_command=(str(ENDPOINT_PYTHON), "endpoint/handler.py"),
        claims=True,
        bucket=True,
        max_workers=2,
        faults=CLAIMS_FAULTS,
    )


def stock(mode: StockMode) -> EndpointSpec | None:
    """The claims: false endpoint `mode` asks for, or None."""
    real_ready = STOCK_PYTHON.exists() and STOCK_LAUNCHER.exists()
    if mode == "off" or (mode == "auto" and not real_ready):
        return None
    if mode in ("real", "auto"):
        if not real_ready:
            raise FileNotFoundError(
                f"--stock real needs {STOCK_PYTHON} and {STOCK_LAUNCHER} (make .venv-stock)"
            )
        command: tuple[str, ...] = (str(STOCK_PYTHON), str(STOCK_LAUNCHER.relative_to(ROOT)))
        handler = "stock worker-comfyui"
    else:
        command = (str(ENDPOINT_PYTHON), str(STANDIN_HANDLER.relative_to(ROOT)))
        handler = "stock stand-in"
    return EndpointSpec(
        pool="stock",
        endpoint_id="soak-stock",
        worker_command=command,
        claims=False,
        bucket=False,
        max_workers=1,
        faults=STOCK_FAULTS,
        burst_5xx_routes=STOCK_5XX_ROUTES,
        handler=handler,
    )


def endpoint_specs(mode: StockMode) -> list[EndpointSpec]:
    if not ENDPOINT_PYTHON.exists():
        raise FileNotFoundError(f"{ENDPOINT_PYTHON} is missing: `make install` builds it")
    specs = [ours()]
    other = stock(mode)
    if other is not None:
        specs.append(other)
    return specs


@dataclass(frozen=True)
class WorkerComfy:
    worker_id: str
    url: str
    pid: int


class RunpodEndpoint:
    """One RunPod simulator process and what the soak asks of it."""

    def __init__(
        self,
        spec: EndpointSpec,
        work_dir: Path,
        api_key: str,
        bucket_env: Mapping[str, str],
        step_delay_ms: int,
    ) -> None:
        self.spec = spec
        self.work_dir = work_dir
        self.api_key = api_key
        self.port = free_port()
        self.bucket_env = dict(bucket_env) if spec.bucket else {}
        self.step_delay_ms = step_delay_ms
        self.record: PidRecord | None = None
        # Every worker and worker-ComfyUI process group seen: killed at the end if they
        # outlive the simulator (a simulator that had to be SIGKILLed cannot stop them).
        self.seen_groups: set[int] = set()
        self._http = httpx.AsyncClient(timeout=10, trust_env=False)
        self.faults = RunpodFaults(self.base_url, self._http)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pool_url(self) -> str:
        return f"{self.base_url}/v2"

    @property
    def log_file(self) -> Path:
        return self.work_dir / "runpod_sim.log"

    def pool_config(self) -> dict[str, Any]:
        return {
            "kind": "runpod",
            "url": self.pool_url,
            "endpoint_id": self.spec.endpoint_id,
            "claims": self.spec.claims,
            "usd_per_second": 0.0004,
            "idle_timeout_s": IDLE_TIMEOUT_S,
        }

    def _argv(self) -> list[str]:
        worker_env = [f"--worker-env={name}" for name in self.bucket_env]
        return [
            sys.executable,
            "-m",
            "devstack.runpod_sim",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--endpoint-id",
            self.spec.endpoint_id,
            "--work-dir",
            str(self.work_dir),
            "--worker-command",
            shlex.join(self.spec.worker_command),
            "--worker-cwd",
            str(ROOT),
            *worker_env,
            "--worker-env-factory",
            FACTORY,
            "--idle-timeout",
            str(IDLE_TIMEOUT_S),
            "--max-workers",
            str(self.spec.max_workers),
            "--stop-grace",
            str(WORKER_STOP_GRACE_S),
        ]

    async def start(self) -> None:
        pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {
            **self.bucket_env,
            # Secrets by environment, never on a command line any local user can read.
            "RUNPOD_SIM_API_KEY": self.api_key,
            ARGS_VAR: f"--step-delay-ms {self.step_delay_ms}",
            "PYTHONPATH": pythonpath,
        }
        self.record = spawn_detached(
            self._argv(),
            self.log_file,
            ROOT,
            self.work_dir / "runpod_sim.pid",
            env,
            unset_env=("RUNPOD_API_KEY",),
        )
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await self._http.get(f"{self.base_url}/sim/health")).status_code == 200:
                    return
            if not is_alive(self.record) or time.monotonic() > deadline:
                raise RuntimeError(
                    f"RunPod simulator for {self.spec.pool} did not start:\n"
                    f"{log_tail(self.log_file)}"
                )
            await asyncio.sleep(0.1)

    # -- the simulator's own API ---------------------------------------------------------------

    async def ledger(self) -> Ledger:
        response = await self._http.get(f"{self.base_url}/sim/ledger")
        response.raise_for_status()
        ledger = Ledger.model_validate(response.json())
        # Each leads a process group of its own: the worker, its watchdog, its ComfyUI.
        for worker in ledger.workers:
            pids = (worker.pid, worker.watchdog_pid, worker.comfy_pid)
            self.seen_groups.update(pid for pid in pids if pid)
        return ledger

    async def job_output(self, runpod_job_id: str) -> Any:
        """The RunPod job's `output`, as its public /status shows it."""
        response = await self._http.get(
            f"{self.pool_url}/{self.spec.endpoint_id}/status/{runpod_job_id}",
            headers={"Authorization": f"Bearer {self.api_key}"},
        )
        response.raise_for_status()
        return response.json().get("output")

    # -- the workers' ComfyUI simulators -------------------------------------------------------

    def worker_dir(self, worker_id: str) -> Path:
        return self.work_dir / "workers" / worker_id

    def worker_comfy(self, worker_id: str) -> WorkerComfy | None:
        try:
            handle = json.loads((self.worker_dir(worker_id) / HANDLE_FILE).read_text())
        except (OSError, ValueError):
            return None
        self.seen_groups.add(int(handle["pid"]))
        return WorkerComfy(worker_id, str(handle["url"]), int(handle["pid"]))

    def final_snapshot(self, worker_id: str) -> dict[str, Any] | None:
        """What the worker's ComfyUI held when the worker went (comfy_factory), if it has."""
        try:
            final: dict[str, Any] = json.loads(
                (self.worker_dir(worker_id) / FINAL_FILE).read_text()
            )
        except (OSError, ValueError):
            return None
        return final

    def _all_worker_comfies(self) -> None:
        folder = self.work_dir / "workers"
        if folder.is_dir():
            for child in folder.iterdir():
                self.worker_comfy(child.name)

    # -- stopping --------------------------------------------------------------------------------

    async def stop(self) -> None:
        """SIGTERM (the simulator stops its workers and their ComfyUIs), SIGKILL after the grace;
        then any worker or ComfyUI group that outlived it is killed by group id."""
        with contextlib.suppress(Exception):
            await self.ledger()  # the last word on which workers exist
        self._all_worker_comfies()
        try:
            if self.record is not None:
                await terminate(self.record, signal.SIGTERM, grace_s=STOP_GRACE_S)
        finally:
            for pgid in sorted(self.seen_groups):
                if _group_alive(pgid):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pgid, signal.SIGKILL)
            await self._http.aclose()

    def alive_pids(self) -> list[int]:
        alive = [pgid for pgid in sorted(self.seen_groups) if _group_alive(pgid)]
        if self.record is not None and is_alive(self.record):
            alive.append(self.record.pid)
        return alive


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
