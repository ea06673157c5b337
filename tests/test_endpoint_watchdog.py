"""The worker's watchdog (endpoint/watchdog.py), run as the image runs it: its own process, the
endpoint venv's python, against a fake ComfyUI (an aiohttp app that answers /queue and records
/interrupt) with `sleep` processes standing in for the worker's main process (`--pid`) and for
ComfyUI's (`COMFY_PID`). And endpoint/start.sh, which starts it beside the handler.

The promise: once the fence file says the claim is held and `fence_by` (plus a grace) has
passed, not before, the watchdog interrupts the prompt, kills ComfyUI if the prompt will not
leave its queue, and kills the worker's main process, all within the bound its docstring gives;
with no claim held it does nothing, and it exits once the process it watches is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from endpoint.fence_file import FenceState
from endpoint.watchdog import GRACE_S, POLL_S, STOP_WAIT_S
from tests.aiohttp_support import served
from tests.comfy_sim_support import REPO_ROOT

EP_PYTHON = REPO_ROOT / ".venv-endpoint" / "bin" / "python"
WATCHDOG = REPO_ROOT / "endpoint" / "watchdog.py"
START = REPO_ROOT / "endpoint" / "start.sh"

pytestmark = pytest.mark.skipif(
    not EP_PYTHON.exists(), reason="no .venv-endpoint: `make install` builds it"
)


@dataclass
class FakeComfy:
    """Runs one prompt; an interrupt ends it unless `stubborn`."""

    prompt_id: str
    stubborn: bool = False
    running: bool = True
    interrupts: list[tuple[float, Any]] = field(default_factory=list)
    deletes: list[Any] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/queue", self.queue)
        app.router.add_post("/queue", self.delete)
        app.router.add_post("/interrupt", self.interrupt)
        return app

    async def queue(self, _request: web.Request) -> web.Response:
        running = [[0, self.prompt_id, {}, {}, []]] if self.running else []
        return web.json_response({"queue_running": running, "queue_pending": []})

    async def interrupt(self, request: web.Request) -> web.Response:
        self.interrupts.append((time.monotonic(), (await request.json()).get("prompt_id")))
        if not self.stubborn:
            self.running = False
        return web.Response()

    async def delete(self, request: web.Request) -> web.Response:
        self.deletes.append((await request.json()).get("delete"))
        return web.Response()


@dataclass
class Process:
    """A child process and when it ended (time.monotonic())."""

    proc: asyncio.subprocess.Process
    ended: asyncio.Task[float]

    @classmethod
    async def start(cls, *argv: str, **kwargs: Any) -> Process:
        proc = await asyncio.create_subprocess_exec(*argv, **kwargs)

        async def ended() -> float:
            await proc.wait()
            return time.monotonic()

        return cls(proc, asyncio.create_task(ended()))

    @property
    def alive(self) -> bool:
        return not self.ended.done()

    async def stop(self) -> None:
        if self.alive:
            self.proc.kill()
        await self.ended


@dataclass
class Run:
    comfy: FakeComfy
    worker: Process
    comfy_process: Process
    watchdog: Process
    fence_file: Path

    async def logs(self) -> list[dict[str, Any]]:
        await asyncio.wait_for(asyncio.shield(self.watchdog.ended), timeout=15)
        assert self.watchdog.proc.stdout is not None
        text = (await self.watchdog.proc.stdout.read()).decode()
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def write_fence(path: Path, state: FenceState) -> None:
    path.write_text(state.model_dump_json(exclude_none=True))


@pytest.fixture
def fence_file(tmp_path: Path) -> Path:
    return tmp_path / "fence.json"


@contextlib.asynccontextmanager
async def running(fence_file: Path, *, stubborn: bool = False) -> AsyncIterator[Run]:
    """The fake ComfyUI, two `sleep`s (the worker, ComfyUI) and the watchdog; all ended after."""
    comfy = FakeComfy(str(uuid.uuid4()), stubborn=stubborn)
    async with served(comfy.app()) as port:
        worker = await Process.start("sleep", "120")
        comfy_process = await Process.start("sleep", "120")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env |= {
            "COMFY_URL": f"http://127.0.0.1:{port}",
            "COMFY_PID": str(comfy_process.proc.pid),
            "DURABLE_COMFY_FENCE_FILE": str(fence_file),
        }
        watchdog = await Process.start(
            str(EP_PYTHON),
            str(WATCHDOG),
            "--pid",
            str(worker.proc.pid),
            env=env,
            cwd="/",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield Run(comfy, worker, comfy_process, watchdog, fence_file)
        finally:
            for process in (watchdog, worker, comfy_process):
                await process.stop()


def holding(comfy: FakeComfy, pid: int, fence_by: float, fence_after_s: float) -> FenceState:
    return FenceState(
        holding=True,
        pid=pid,
        submission="sub-12345678",
        prompt_id=comfy.prompt_id,
        lease_s=60.0,
        fence_after_s=fence_after_s,
        fence_by=fence_by,
    )


async def test_past_fence_by_the_prompt_is_interrupted_then_the_worker_killed(
    fence_file: Path,
) -> None:
    async with running(fence_file) as run:
        fence_by = time.time() + 1.5
        write_fence(fence_file, holding(run.comfy, run.worker.proc.pid, fence_by, 30.0))
        # Not before fence_by and the grace (the handler's own fence goes first).
        await asyncio.sleep(fence_by + GRACE_S - 0.3 - time.time())
        assert run.worker.alive and run.comfy.interrupts == []
        acted_by = time.monotonic() + 0.3 + POLL_S + STOP_WAIT_S + 1.0
        died = await asyncio.wait_for(asyncio.shield(run.worker.ended), timeout=15)
        assert died <= acted_by
        assert run.comfy.interrupts and run.comfy.interrupts[0][0] < died
        assert {prompt for _, prompt in run.comfy.interrupts} == {run.comfy.prompt_id}
        assert run.comfy.deletes[0] == [run.comfy.prompt_id]
        # The prompt left the queue: ComfyUI lives on (the container goes with the worker).
        assert run.comfy_process.alive
        logs = await run.logs()
        assert run.watchdog.proc.returncode == 0
        events = [e["event"] for e in logs]
        assert events.index("watchdog_fencing") < events.index("watchdog_killed")
        assert [e["process"] for e in logs if e["event"] == "watchdog_killed"] == ["worker"]


async def test_a_prompt_that_will_not_stop_costs_comfyui_then_the_worker(
    fence_file: Path,
) -> None:
    async with running(fence_file, stubborn=True) as run:
        # fence_after_s 8: a grace and a stop wait of a quarter of it each (2 s).
        write_fence(fence_file, holding(run.comfy, run.worker.proc.pid, time.time(), 8.0))
        comfy_died = await asyncio.wait_for(asyncio.shield(run.comfy_process.ended), timeout=15)
        worker_died = await asyncio.wait_for(asyncio.shield(run.worker.ended), timeout=5)
        first = run.comfy.interrupts[0][0]
        assert len(run.comfy.interrupts) >= 2  # again every second meanwhile
        assert first + 2.0 - 0.3 <= comfy_died <= first + 2.0 + 1.0  # the stop wait
        assert comfy_died <= worker_died + 0.2
        logs = await run.logs()
        killed = [e for e in logs if e["event"] == "watchdog_killed"]
        assert [e["process"] for e in killed] == ["comfyui", "worker"]
        assert killed[0]["prompt_held"] is True


async def test_without_a_claim_held_it_waits_and_exits_once_the_worker_is_gone(
    fence_file: Path,
) -> None:
    async with running(fence_file) as run:
        write_fence(fence_file, FenceState(holding=False))
        await asyncio.sleep(2.0)
        assert run.worker.alive and run.watchdog.alive and run.comfy.interrupts == []
        # A claim held, its fence_by far ahead: still nothing.
        far = holding(run.comfy, run.worker.proc.pid, time.time() + 60, 30.0)
        write_fence(fence_file, far)
        await asyncio.sleep(1.5)
        assert run.worker.alive and run.watchdog.alive and run.comfy.interrupts == []
        await run.worker.stop()
        exited = await asyncio.wait_for(asyncio.shield(run.watchdog.ended), timeout=5)
        assert exited - await run.worker.ended < 2 * POLL_S + 1.0
        logs = await run.logs()
        assert run.watchdog.proc.returncode == 0
        assert [e["event"] for e in logs][-1] == "watchdog_exiting"
        assert run.comfy_process.alive and run.comfy.interrupts == []


# --- endpoint/start.sh ------------------------------------------------------------------------

FAKE_COMFY = """
import os, time
open(os.environ["FAKE_COMFY_PID_FILE"], "w").write(str(os.getpid()))
time.sleep(120)
"""

# Holds a claim from the start and then freezes (sleeps), as a stopped handler would.
FAKE_HANDLER = """
import json, os, sys, time
path = os.environ["DURABLE_COMFY_FENCE_FILE"]
state = {"holding": True, "pid": os.getpid(), "submission": "sub-12345678",
         "prompt_id": "p-1", "lease_s": 60.0, "fence_after_s": 8.0, "fence_by": time.time()}
open(path + ".tmp", "w").write(json.dumps(state))
os.replace(path + ".tmp", path)
open(os.environ["FAKE_HANDLER_PID_FILE"], "w").write(str(os.getpid()))
time.sleep(120)
"""


def gone(pid: int) -> bool:
    """No such process, or a zombie waiting for a parent to reap it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


async def test_start_sh_runs_the_watchdog_beside_a_handler_it_can_end(tmp_path: Path) -> None:
    """start.sh as the image runs it (other paths): a handler that holds a claim and freezes is
    killed by the watchdog start.sh started, ComfyUI with it (it does not answer: the prompt
    may be there), and start.sh, the container's main process, exits with it."""
    (tmp_path / "comfy.py").write_text(FAKE_COMFY)
    (tmp_path / "handler.py").write_text(FAKE_HANDLER)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env |= {
        "ENDPOINT_PYTHON": str(EP_PYTHON),
        "ENDPOINT_HANDLER": str(tmp_path / "handler.py"),
        "ENDPOINT_WATCHDOG": str(WATCHDOG),
        "COMFY_PYTHON": sys.executable,
        "COMFY_MAIN": str(tmp_path / "comfy.py"),
        # Nothing listens there: ComfyUI does not answer.
        "COMFY_URL": "http://127.0.0.1:9",
        "DURABLE_COMFY_FENCE_FILE": str(tmp_path / "fence.json"),
        "FAKE_COMFY_PID_FILE": str(tmp_path / "comfy.pid"),
        "FAKE_HANDLER_PID_FILE": str(tmp_path / "handler.pid"),
    }
    script = await asyncio.create_subprocess_exec(
        "bash",
        str(START),
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(script.communicate(), timeout=30)
        text = out.decode(errors="replace")
        assert script.returncode == 128 + signal.SIGKILL, text  # the handler's end
        handler_pid = int((tmp_path / "handler.pid").read_text())
        comfy_pid = int((tmp_path / "comfy.pid").read_text())
        assert gone(handler_pid) and gone(comfy_pid), text
        assert '"watchdog_killed"' in text and '"process": "comfyui"' in text, text
    finally:
        if script.returncode is None:
            os.killpg(script.pid, signal.SIGKILL)
            await script.wait()
