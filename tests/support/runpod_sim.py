"""Start and stop the RunPod simulator for tests: `python -m devstack.runpod_sim` as a subprocess
on a free 127.0.0.1 port, stopped by PID afterwards (SIGTERM, then SIGKILL), with a check that
none of its workers outlived it.

    async with run_runpod_sim(tmp_path, "--clock-speed", "10", handler=handler_script("echo")) as s:
        httpx.post(f"{s.api_url}/run", headers=s.headers, json={"input": {...}})
        ledger = await s.ledger()
        assert await completed_executions(s, prompt_id) == 1  # across every worker's ComfyUI

Plain helpers, no pytest fixtures here. Worker processes run in .venv-endpoint (the app venv
cannot import runpod): check `ENDPOINT_VENV_MISSING` and skip when it is set; the stock
worker-comfyui handler runs in .venv-stock: check `STOCK_MISSING`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from devstack.free_ports import free_port
from devstack.runpod_sim import Ledger
from devstack.runpod_sim.env_factories import COMFY_FINAL_FILE
from devstack.runpod_sim.ledger import LedgerWorker
from faults.inject import RunpodFaults

REPO_ROOT = Path(__file__).resolve().parents[2]
ENDPOINT_PYTHON = REPO_ROOT / ".venv-endpoint" / "bin" / "python"
ENDPOINT_VENV_MISSING: str | None = (
    None
    if ENDPOINT_PYTHON.exists()
    else f"{ENDPOINT_PYTHON} is missing: `make install` builds the endpoint's venv (runpod SDK)"
)


# The stock worker-comfyui handler (a test fixture outside the repository, AGPL-3.0) runs under
# tests/runpod_handlers/worker_comfyui.py in a venv of its own (its runpod~=1.7.12).
STOCK_LAUNCHER = "tests/runpod_handlers/worker_comfyui.py"
STOCK_PYTHON = REPO_ROOT / ".venv-stock" / "bin" / "python"


def stock_fixture_dir() -> Path:
    """$STOCK_WORKER_COMFYUI (the Makefile's variable; relative to the repo), by default
    ../shared/worker-comfyui."""
    folder = Path(
        os.environ.get("STOCK_WORKER_COMFYUI") or REPO_ROOT.parent / "shared/worker-comfyui"
    )
    return folder if folder.is_absolute() else (REPO_ROOT / folder).resolve()


def _stock_missing() -> str | None:
    folder = stock_fixture_dir()
    if not (folder / "handler.py").is_file():
        return f"no stock worker-comfyui handler in {folder} (set STOCK_WORKER_COMFYUI)"
    if not STOCK_PYTHON.exists():
        return f"{STOCK_PYTHON} is missing: `make install` builds it from {folder}/requirements.txt"
    return None


STOCK_MISSING: str | None = _stock_missing()


def handler_command(script: str) -> str:
    """The --worker-command running `script` (relative to the repo) in its venv: the endpoint's,
    or .venv-stock for the stock handler's launcher."""
    python = STOCK_PYTHON if script == STOCK_LAUNCHER else ENDPOINT_PYTHON
    return f"{python} {script}"


def handler_script(name: str) -> str:
    """One of tests/runpod_handlers/ (echo, scripted, stream, stock_comfyui, worker_comfyui)."""
    return f"tests/runpod_handlers/{name}.py"


@dataclass
class RunpodSim:
    base_url: str
    api_key: str
    endpoint_id: str
    pid: int
    work_dir: Path
    log_path: Path
    # Every worker process group the simulator reported, for the leak check at the end: its
    # leader's pid -> the leader's start time then (None: already gone when seen).
    seen_worker_pids: dict[int, int | None] = field(default_factory=dict)

    @property
    def api_url(self) -> str:
        """The public API's base: `{base_url}/v2/{endpoint_id}`."""
        return f"{self.base_url}/v2/{self.endpoint_id}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    async def _sim(self, method: str, path: str, body: Any = None) -> Any:
        async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
            response = await http.request(method, f"{self.base_url}{path}", json=body)
        response.raise_for_status()
        return response.json()

    async def ledger(self) -> Ledger:
        ledger = Ledger.model_validate(await self._sim("GET", "/sim/ledger"))
        # Each of these leads a process group of its own: the worker, its watchdog, its ComfyUI.
        for worker in ledger.workers:
            for pid in (worker.pid, worker.watchdog_pid, worker.comfy_pid):
                if pid and pid not in self.seen_worker_pids:
                    self.seen_worker_pids[pid] = _started(pid)
        return ledger

    async def faults(self, **faults: Any) -> dict[str, Any]:
        """POST /sim/faults (see devstack/runpod_sim/faults.py), through the fault tooling's
        one client of it (faults/inject.py)."""
        return await RunpodFaults(self.base_url).arm(faults)

    async def reset_faults(self) -> None:
        await RunpodFaults(self.base_url).reset()


def _started(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # After the command's closing parenthesis, field 22 of stat is the 20th.
    return int(stat.rsplit(")", 1)[1].split()[19])


def _still_ours(pgid: int, started: int | None) -> bool:
    """Whether the group `pgid` is still the worker's: its leader the same process (this
    machine wraps PIDs within minutes, and a new process may lead a group of the same id), or
    the leader gone and members of its group left (the id cannot be reused while they live)."""
    if not _group_alive(pgid):
        return False
    now = _started(pgid)
    return now is None or now == started


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def _wait_ready(sim: RunpodSim, proc: asyncio.subprocess.Process, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    async with httpx.AsyncClient(timeout=1, trust_env=False) as http:
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                raise RuntimeError(f"RunPod simulator exited early:\n{sim.log_path.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(f"{sim.base_url}/sim/health")).status_code == 200:
                    return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"RunPod simulator did not come up:\n{sim.log_path.read_text()}")


async def _stop(proc: asyncio.subprocess.Process, within_s: float) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout=within_s)
        except TimeoutError:
            proc.kill()
    await asyncio.wait_for(proc.wait(), timeout=5)


def _log_file(work_dir: Path) -> Path:
    work_dir.mkdir(parents=True, exist_ok=True)
    return work_dir / "runpod_sim.log"


@contextlib.asynccontextmanager
async def run_runpod_sim(
    work_dir: Path,
    *args: str,
    handler: str | None = None,
    api_key: str = "test-api-key",
    endpoint_id: str = "test-endpoint",
    env: Mapping[str, str] | None = None,
    check_leaks: bool = True,
) -> AsyncIterator[RunpodSim]:
    """The simulator on a free port; `handler` (a script path relative to the repo) becomes the
    --worker-command in the endpoint's venv; `args` are more CLI flags; `env` is added to the
    simulator's environment (secrets go there, and reach workers with `--worker-env NAME`). On
    exit the simulator gets SIGTERM (it stops its workers) and, if it lingers, SIGKILL; a worker
    process group still alive afterwards is killed and, with `check_leaks`, fails the test."""
    log_path = _log_file(work_dir)
    port = free_port()
    argv = [
        sys.executable, "-m", "devstack.runpod_sim", "--host", "127.0.0.1", "--port", str(port),
        "--endpoint-id", endpoint_id, "--work-dir", str(work_dir),
        *(("--worker-command", handler_command(handler)) if handler else ()), *args,
    ]  # fmt: skip
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=REPO_ROOT,
            # The key by environment, not argv: a command line is readable by any local user.
            env={**os.environ, **(env or {}), "RUNPOD_SIM_API_KEY": api_key},
            stdout=log_file,
            stderr=asyncio.subprocess.STDOUT,
        )
    sim = RunpodSim(f"http://127.0.0.1:{port}", api_key, endpoint_id, proc.pid, work_dir, log_path)
    try:
        await _wait_ready(sim, proc, within_s=20)
        yield sim
    finally:
        with contextlib.suppress(Exception):
            await sim.ledger()  # the last word on which workers exist
        await _stop(proc, within_s=30)
        seen = sim.seen_worker_pids
        leaked = sorted(pgid for pgid, started in seen.items() if _still_ours(pgid, started))
        for pgid in leaked:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
    if leaked and check_leaks:
        raise AssertionError(f"worker process groups left running after shutdown: {leaked}")


# -- GPU executions across workers -----------------------------------------------------------------

# How long a stopped worker's ComfyUI counters may take to reach its folder: the simulator asks
# the ComfyUI for them, writes them, then stops it, just after the ledger says the worker went.
FINAL_COUNTERS_WAIT_S = 15.0


@dataclass(frozen=True)
class PromptExecutions:
    """One prompt id on one worker's ComfyUI simulator, from its `/sim/stats`."""

    worker_id: str
    queued: int  # POST /prompt accepted with this id
    executions: int  # runs started
    outcome: str | None  # its latest run: success, error, interrupted; None while running

    @property
    def complete(self) -> int:
        """Complete executions: the latest run when it succeeded, and every earlier run of the
        id on the same ComfyUI, whatever became of it (nothing should queue an id twice
        there, so those count against a test rather than for it)."""
        return max(0, self.executions - 1) + (1 if self.outcome == "success" else 0)


async def _comfy_stats(worker: LedgerWorker) -> dict[str, Any] | None:
    """The worker's ComfyUI counters: asked while the worker lives, read from what the
    simulator kept (`comfy-final.json`) once it is gone; None without a ComfyUI."""
    final = Path(worker.log).parent / COMFY_FINAL_FILE
    deadline = time.monotonic() + FINAL_COUNTERS_WAIT_S
    while True:
        if final.exists():
            kept: dict[str, Any] = json.loads(final.read_text())
            if "stats" not in kept:
                raise RuntimeError(f"{worker.id}'s ComfyUI left no counters: {kept}")
            stats: dict[str, Any] = kept["stats"]
            return stats
        if worker.comfy_url is None:
            return None
        if worker.exited_at is None:
            with contextlib.suppress(httpx.TransportError):
                async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
                    answer = await http.get(f"{worker.comfy_url}/sim/stats")
                answer.raise_for_status()
                live: dict[str, Any] = answer.json()
                return live
        if time.monotonic() > deadline:
            raise RuntimeError(f"no counters from {worker.id}'s ComfyUI ({worker.comfy_url})")
        await asyncio.sleep(0.1)


async def prompt_executions(sim: RunpodSim, prompt_id: str) -> list[PromptExecutions]:
    """`prompt_id` on every worker's ComfyUI the simulator ever started (`--comfy-sim-per-worker`
    or a factory built on `ComfySimPerWorker`), alive or gone: the workers that saw it."""
    found = []
    for worker in (await sim.ledger()).workers:
        stats = await _comfy_stats(worker)
        if stats is None:
            continue
        queued = int((stats.get("prompts") or {}).get(prompt_id, 0))
        executions = int((stats.get("executions") or {}).get(prompt_id, 0))
        if not queued and not executions:
            continue
        # A run started and not ended is still running: its outcome is not the latest one.
        running = prompt_id in (stats.get("started_at") or {}) and prompt_id not in (
            stats.get("ended_at") or {}
        )
        outcome = None if running else (stats.get("executed") or {}).get(prompt_id)
        found.append(PromptExecutions(worker.id, queued, executions, outcome))
    return found


async def completed_executions(sim: RunpodSim, prompt_id: str) -> int:
    """How many times `prompt_id` ran to its end, summed across every worker's ComfyUI: a
    test says "the graph completed once" with `== 1`."""
    return sum(run.complete for run in await prompt_executions(sim, prompt_id))
