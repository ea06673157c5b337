"""A real ComfyUI (CPU only, no models) as a process tests can start, kill -9 and restart.

The install comes from the project's shared folder: `real-comfyui install DIR` unpacks ComfyUI
0.8.0 (GPL-3.0) and makes a venv in DIR. This module starts `main.py` from there the way that
script's `start` does (`--cpu --listen 127.0.0.1 --port P --disable-auto-launch`), but as a child
of the test process, so it is stopped by its own PID and reaped. Only model-free graphs run
on it (EmptyImage, ImageBlur, PrimitiveString, SaveImage, ...).

`RealComfyPerWorker` is the RunPod simulator's worker env factory for the same install
(`--worker-env-factory devstack.real_comfyui:RealComfyPerWorker`, REAL_COMFYUI_DIR in the
simulator's environment): each simulated RunPod worker gets a real ComfyUI of its own, as a
worker-comfyui container has, with its own folders, log and port.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
from pydantic import BaseModel

from devstack.free_ports import free_port
from devstack.runpod_sim.env_factories import WorkerSlot
from devstack.runpod_sim.procs import ChildProcess
from devstack.runpod_sim.workers import INHERITED_ENV

READY_PATH = "/object_info/SaveImage"
# What a worker's ComfyUI is, for tests to find it: in the worker's own directory.
WORKER_RECORD = "comfyui.json"


class RealComfyUIError(RuntimeError):
    pass


def installed_python(install_dir: Path) -> Path:
    """The install's venv python; RealComfyUIError when DIR holds no real ComfyUI."""
    python = install_dir / "venv" / "bin" / "python"
    if not python.exists() or not (install_dir / "ComfyUI" / "main.py").exists():
        raise RealComfyUIError(
            f"no real ComfyUI installed in {install_dir}: run "
            "`real-comfyui install DIR` from the shared comfyui folder (make test-real-comfyui "
            "does it)"
        )
    return python


def comfyui_argv(python: Path, port: int, *extra: str) -> list[str]:
    """`main.py` as the shared script's `start` runs it, run from the install's ComfyUI/."""
    return [
        str(python), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
        "--disable-auto-launch", *extra,
    ]  # fmt: skip


class RealComfyUI:
    """One real ComfyUI on 127.0.0.1:`port`, its log appended to across restarts."""

    def __init__(self, install_dir: Path, port: int) -> None:
        self.install_dir = install_dir.resolve()
        self.port = port
        self.log_file = self.install_dir / f"comfyui-{port}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._python = installed_python(self.install_dir)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def output_dir(self) -> Path:
        return self.install_dir / "ComfyUI" / "output"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, *, timeout_s: float = 180.0) -> None:
        """Start it (unless it runs) and wait until it answers; blocking."""
        if self.alive:
            return
        with self.log_file.open("ab") as log:
            self._proc = subprocess.Popen(
                comfyui_argv(self._python, self.port),
                cwd=self.install_dir / "ComfyUI",
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # a Ctrl-C on the test run does not reach it half-way
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        deadline = time.monotonic() + timeout_s
        with httpx.Client(trust_env=False, timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise RealComfyUIError(
                        f"ComfyUI exited with {self._proc.returncode}; see {self.log_file}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(self.url + READY_PATH).status_code == 200:
                        return
                time.sleep(0.25)
        self.kill()
        raise RealComfyUIError(f"ComfyUI did not answer within {timeout_s:.0f} s")

    def kill(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """Stop it by its own PID and reap it (SIGKILL: a crash, queue and history lost)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=20.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    async def restart_async(self) -> None:
        """kill -9, then start again on the same port; off the event loop."""
        await asyncio.to_thread(self.kill)
        await asyncio.to_thread(self.start)

    def log_text(self, since: int = 0) -> str:
        try:
            with self.log_file.open("rb") as f:
                f.seek(since)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_size(self) -> int:
        try:
            return self.log_file.stat().st_size
        except OSError:
            return 0


class WorkerComfyUI(BaseModel):
    """One RunPod-simulator worker's real ComfyUI, as `RealComfyPerWorker` started it."""

    url: str
    pid: int
    log_file: Path
    output_dir: Path
    input_dir: Path
    # ComfyUI's temp folder itself (`temp/` inside what --temp-directory names).
    temp_dir: Path

    @classmethod
    def of(cls, worker_dir: Path) -> WorkerComfyUI:
        """The ComfyUI of the worker whose directory (`{work_dir}/workers/{id}`) this is."""
        return cls.model_validate_json((worker_dir / WORKER_RECORD).read_text())

    def log_text(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")
        except OSError:
            return ""


class RealComfyPerWorker:
    """A RunPod-simulator WorkerEnvFactory: before each worker starts (while it initializes and
    bills, as a worker-comfyui container starts its ComfyUI), a real ComfyUI from
    REAL_COMFYUI_DIR on a free port with its own output, input, temp and user folders and
    database under the worker's directory (`comfy/`), its log in `comfyui.log`; stopped with the
    worker. The worker gets COMFY_URL, COMFY_HOST, COMFY_PID and the folders (COMFY_INPUT_DIR,
    COMFY_OUTPUT_DIR, COMFY_TEMP_DIR: as ComfyUI was given them), as with ComfySimPerWorker;
    `comfyui.json` in the worker's directory says the same to tests (WorkerComfyUI.of).

    ComfyUI gets the few variables a worker inherits, none of the simulator's secrets.
    REAL_COMFYUI_ARGS (split on spaces) adds flags to each ComfyUI's command line."""

    def __init__(
        self,
        install_dir: Path | None = None,
        extra_args: tuple[str, ...] | None = None,
        startup_timeout_s: float = 180.0,
        stop_grace_s: float = 10.0,
    ) -> None:
        if install_dir is None:
            named = os.environ.get("REAL_COMFYUI_DIR")
            if not named:
                raise RealComfyUIError("REAL_COMFYUI_DIR names no real ComfyUI install")
            install_dir = Path(named)
        self.install_dir = install_dir.resolve()
        self.python = installed_python(self.install_dir)
        if extra_args is None:
            extra_args = tuple(os.environ.get("REAL_COMFYUI_ARGS", "").split())
        self.extra_args = extra_args
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self._procs: dict[str, ChildProcess] = {}

    async def start(self, slot: WorkerSlot) -> dict[str, str]:
        port = free_port()
        folder = slot.work_dir / "comfy"
        dirs = {name: folder / name for name in ("output", "input", "temp", "user")}
        for path in dirs.values():
            path.mkdir(parents=True, exist_ok=True)
        argv = comfyui_argv(
            self.python, port,
            "--output-directory", str(dirs["output"]), "--input-directory", str(dirs["input"]),
            "--temp-directory", str(dirs["temp"]), "--user-directory", str(dirs["user"]),
            "--database-url", f"sqlite:///{folder / 'comfyui.db'}",
            *self.extra_args,
        )  # fmt: skip
        env = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}
        env |= {"PYTHONUNBUFFERED": "1", "TMPDIR": str(dirs["temp"])}
        log_file = slot.work_dir / "comfyui.log"
        proc = await ChildProcess.spawn(
            argv, env=env, cwd=self.install_dir / "ComfyUI", log_path=log_file
        )
        self._procs[slot.worker_id] = proc
        url = f"http://127.0.0.1:{port}"
        await self._wait_ready(url, proc, log_file)
        record = WorkerComfyUI(
            url=url,
            pid=proc.pid,
            log_file=log_file,
            output_dir=dirs["output"],
            input_dir=dirs["input"],
            temp_dir=dirs["temp"] / "temp",
        )
        (slot.work_dir / WORKER_RECORD).write_text(record.model_dump_json())
        return {
            "COMFY_URL": url,
            "COMFY_HOST": f"127.0.0.1:{port}",
            "COMFY_PID": str(proc.pid),
            # The handler removes each job's files from the folders this ComfyUI uses.
            "COMFY_INPUT_DIR": str(dirs["input"]),
            "COMFY_OUTPUT_DIR": str(dirs["output"]),
            "COMFY_TEMP_DIR": str(dirs["temp"]),
        }

    async def _wait_ready(self, url: str, proc: ChildProcess, log_file: Path) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        async with httpx.AsyncClient(trust_env=False, timeout=2.0) as http:
            while time.monotonic() < deadline:
                if proc.returncode is not None:
                    raise RealComfyUIError(f"ComfyUI exited with {proc.returncode}; see {log_file}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(url + READY_PATH)).status_code == 200:
                        return
                await asyncio.sleep(0.25)
        await proc.terminate(self.stop_grace_s)
        raise RealComfyUIError(f"ComfyUI at {url} did not answer within {self.startup_timeout_s} s")

    async def stop(self, slot: WorkerSlot) -> None:
        proc = self._procs.pop(slot.worker_id, None)
        if proc is not None:
            await proc.terminate(self.stop_grace_s)
