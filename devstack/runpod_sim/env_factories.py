"""Per-worker environment: what a worker gets besides RunPod's own variables.

A WorkerEnvFactory is asked for variables before each worker starts (while it is "initializing",
billed, like a container booting) and told when the worker is gone. The integrator can give each
worker its own ComfyUI (`ComfySimPerWorker`, `--comfy-sim-per-worker`; it leaves `comfy.json`,
its URL and PID, in the worker's directory when it starts and `comfy-final.json`, its
`/sim/stats`, when the worker goes: a worker's ComfyUI dies with it, its execution counters must
not), bucket settings
(`--worker-env KEY=VALUE`) or anything else (`--worker-env-factory module:attr`, a callable that
returns a WorkerEnvFactory).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import aiohttp
import structlog

from devstack.files import write_atomic
from devstack.free_ports import free_port

from .procs import ChildProcess
from .settings import PROJECT_ROOT, SimSettings

log = structlog.get_logger("runpod_sim.env")
# In each worker's directory: its ComfyUI's URL and PID while it lives, and what its ComfyUI
# held (its counters) when the worker went.
COMFY_HANDLE_FILE = "comfy.json"
COMFY_FINAL_FILE = "comfy-final.json"


@dataclass(frozen=True)
class WorkerSlot:
    worker_id: str
    index: int
    work_dir: Path  # the worker's own directory (its log, its ComfyUI's files)


@runtime_checkable
class WorkerEnvFactory(Protocol):
    async def start(self, slot: WorkerSlot) -> dict[str, str]: ...

    async def stop(self, slot: WorkerSlot) -> None: ...


class StaticEnv:
    """The same variables for every worker (`--worker-env KEY=VALUE`)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)

    async def start(self, slot: WorkerSlot) -> dict[str, str]:
        return dict(self.env)

    async def stop(self, slot: WorkerSlot) -> None:
        return None


class ComfySimPerWorker:
    """Starts `python -m devstack.comfy_sim` (the app venv's python) on a free port for each
    worker, with its input, output and temp folders under the worker's `comfy/`, and stops it
    with the worker. The worker gets COMFY_URL (http://127.0.0.1:PORT), COMFY_HOST
    (127.0.0.1:PORT, worker-comfyui's form), COMFY_PID (its process, so a handler can tell a
    ComfyUI still starting from a dead one) and the folders (COMFY_INPUT_DIR, COMFY_OUTPUT_DIR,
    COMFY_TEMP_DIR), from which our handler removes each job's files."""

    def __init__(
        self,
        extra_args: Sequence[str] = (),
        python: str = sys.executable,
        startup_timeout_s: float = 30.0,
        stop_grace_s: float = 5.0,
    ) -> None:
        self.extra_args = list(extra_args)
        self.python = python
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self._procs: dict[str, ChildProcess] = {}
        self._urls: dict[str, str] = {}

    async def start(self, slot: WorkerSlot) -> dict[str, str]:
        port = free_port()
        folder = slot.work_dir / "comfy"
        # The temp folder named, not left to the simulator's default beside --output-dir, so
        # that the handler is told the one the simulator uses.
        argv = [
            self.python, "-m", "devstack.comfy_sim", "--host", "127.0.0.1", "--port", str(port),
            "--output-dir", str(folder / "output"), "--input-dir", str(folder / "input"),
            "--temp-dir", str(folder / "temp"), *self.extra_args,
        ]  # fmt: skip
        pythonpath = os.pathsep.join(
            p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH")) if p
        )
        proc = await ChildProcess.spawn(
            argv,
            env={**os.environ, "PYTHONPATH": pythonpath},
            cwd=PROJECT_ROOT,
            log_path=slot.work_dir / "comfy_sim.log",
        )
        self._procs[slot.worker_id] = proc
        url = f"http://127.0.0.1:{port}"
        await self._wait_ready(url, proc)
        log.info("ComfyUI simulator up", worker_id=slot.worker_id, url=url, pid=proc.pid)
        self._urls[slot.worker_id] = url
        _write_json(slot.work_dir / COMFY_HANDLE_FILE, {"url": url, "pid": proc.pid})
        return {
            "COMFY_URL": url,
            "COMFY_HOST": f"127.0.0.1:{port}",
            "COMFY_PID": str(proc.pid),
            "COMFY_INPUT_DIR": str(folder / "input"),
            "COMFY_OUTPUT_DIR": str(folder / "output"),
            # As ComfyUI's --temp-directory: the folder its `temp/` is in (the simulator's
            # --temp-dir names `temp/` itself).
            "COMFY_TEMP_DIR": str(folder),
        }

    async def _wait_ready(self, url: str, proc: ChildProcess) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        timeout = aiohttp.ClientTimeout(total=1)
        async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as http:
            while time.monotonic() < deadline:
                if proc.returncode is not None:
                    raise RuntimeError(f"ComfyUI simulator exited with {proc.returncode}")
                try:
                    async with http.get(f"{url}/system_stats") as response:
                        if response.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.05)
        raise RuntimeError(f"ComfyUI simulator at {url} not ready in {self.startup_timeout_s}s")

    async def final_state(self, url: str) -> dict[str, Any]:
        """What to keep of a ComfyUI simulator whose worker went: `{"stats": /sim/stats}`."""
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as http:
            async with http.get(f"{url}/sim/stats") as response:
                response.raise_for_status()
                return {"stats": await response.json()}

    async def stop(self, slot: WorkerSlot) -> None:
        url = self._urls.pop(slot.worker_id, None)
        if url is not None:
            try:
                final = await self.final_state(url)
            except Exception as exc:  # the worker's files must still say what happened
                final = {"error": f"{type(exc).__name__}: {exc}"}
            _write_json(slot.work_dir / COMFY_FINAL_FILE, final)
        proc = self._procs.pop(slot.worker_id, None)
        if proc is not None:
            await proc.terminate(self.stop_grace_s)


def _write_json(path: Path, body: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(body))


def load_factory(spec: str) -> WorkerEnvFactory:
    """`module:attr`, a callable (a class will do) returning a WorkerEnvFactory."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"worker env factory must be 'module:attr', got {spec!r}")
    factory = getattr(importlib.import_module(module_name), attr)()
    if not isinstance(factory, WorkerEnvFactory):
        raise TypeError(f"{spec} did not return a WorkerEnvFactory (start/stop coroutines)")
    return factory


def build_factories(settings: SimSettings) -> list[WorkerEnvFactory]:
    factories: list[WorkerEnvFactory] = []
    if settings.worker_env:
        factories.append(StaticEnv(settings.worker_env))
    if settings.comfy_sim_per_worker:
        factories.append(ComfySimPerWorker(settings.comfy_sim_args))
    if settings.worker_env_factory:
        factories.append(load_factory(settings.worker_env_factory))
    return factories
