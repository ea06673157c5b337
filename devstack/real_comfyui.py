"""A real ComfyUI (CPU only, no models) as a process tests can start, kill -9 and restart.

The install comes from the project's shared folder: `real-comfyui install DIR` unpacks ComfyUI
0.8.0 (GPL-3.0) and makes a venv in DIR. This module starts `main.py` from there the way that
script's `start` does (`--cpu --listen 127.0.0.1 --port P --disable-auto-launch`), but as a child
of the test process, so it is stopped by its own PID and reaped. Only model-free graphs run
on it (EmptyImage, ImageBlur, PrimitiveString, SaveImage, ...).
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

READY_PATH = "/object_info/SaveImage"


class RealComfyUIError(RuntimeError):
    pass


class RealComfyUI:
    """One real ComfyUI on 127.0.0.1:`port`, its log appended to across restarts."""

    def __init__(self, install_dir: Path, port: int) -> None:
        self.install_dir = install_dir.resolve()
        self.port = port
        self.log_file = self.install_dir / f"comfyui-{port}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        python = self.install_dir / "venv" / "bin" / "python"
        if not python.exists() or not (self.install_dir / "ComfyUI" / "main.py").exists():
            raise RealComfyUIError(
                f"no real ComfyUI installed in {self.install_dir}: run "
                "`real-comfyui install DIR` from the shared comfyui folder (make test-real-comfyui "
                "does it)"
            )
        self._python = python

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
                [
                    str(self._python),
                    "main.py",
                    "--cpu",
                    "--listen",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--disable-auto-launch",
                ],
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
