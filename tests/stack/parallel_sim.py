"""A ComfyUI simulator of a test's own in parallel mode (every job's prompt runs at once, as if
each had a GPU), started as a process on a free loopback port and stopped by PID by the test."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx

from devstack.free_ports import free_port
from devstack.processes import PidRecord, is_alive, log_tail, spawn_detached, terminate
from tests.support.cli import ROOT

START_TIMEOUT_S = 30.0


async def start_parallel_sim(
    base: Path, *, step_delay_ms: int, parallel: int, port: int | None = None
) -> tuple[PidRecord, str]:
    """`python -m devstack.comfy_sim --parallel N` in `base`: its record and its URL, once it
    answers; its log is `base/sim.log` (appended to: a restart on the same `port` keeps the
    log of the one before)."""
    port = port or free_port()
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
    log_file = base / "sim.log"
    record = spawn_detached(argv, log_file, ROOT, base / "sim.pid")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    async with httpx.AsyncClient(trust_env=False) as http:
        while True:
            try:
                if (await http.get(f"{url}/system_stats", timeout=2)).status_code == 200:
                    return record, url
            except httpx.TransportError:
                pass
            if not is_alive(record) or time.monotonic() > deadline:
                await terminate(record, grace_s=5)
                raise RuntimeError(f"the simulator did not start:\n{log_tail(log_file)}")
            await asyncio.sleep(0.1)
