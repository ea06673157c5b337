"""What the end-to-end and CLI tests share: an in-process worker, the example graph, and running
the `durable-comfy` CLI as a user would (a subprocess with the stack's environment)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import structlog

from activities.storage import ArtifactStore
from configuration.settings import S3Settings, WorkerSettings
from devstack.config import PoolConfig
from devstack.models import RunningStack
from starter import JobClient
from starter.connection import connect_temporal
from worker import run_worker

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "txt2img.json"


def s3_settings(stack: RunningStack) -> S3Settings:
    return S3Settings(
        endpoint_url=stack.s3_endpoint,
        region=stack.region,
        bucket=stack.bucket,
        access_key_id=stack.access_key_id,
        secret_access_key=stack.secret_access_key,
    )


class RunningWorker:
    def __init__(self, task_queue: str, client: JobClient, store: ArtifactStore) -> None:
        self.task_queue = task_queue
        self.client = client
        self.store = store


@asynccontextmanager
async def running_worker(
    stack: RunningStack, prefix: str, task_queue: str | None = None, **settings_given: Any
) -> AsyncIterator[RunningWorker]:
    """A worker in this process on `task_queue` (else one of its own, named after `prefix`),
    stopped on the way out; `settings_given`: more `WorkerSettings` (max_concurrent_activities,
    ...)."""
    task_queue = task_queue or f"{prefix}-{uuid.uuid4().hex[:8]}"
    settings = WorkerSettings(
        task_queue=task_queue,
        pools={"comfyui": PoolConfig(kind="comfyui", url=stack.comfyui_url)},
        **settings_given,
    )
    temporal = await connect_temporal(stack.temporal_address, stack.namespace)
    stop = asyncio.Event()
    task = asyncio.create_task(run_worker(settings, s3_settings(stack), stop=stop, client=temporal))
    try:
        async with ArtifactStore(s3_settings(stack)) as store:
            yield RunningWorker(
                task_queue, JobClient(temporal, task_queue=task_queue, store=store), store
            )
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)


def example(steps: int = 8) -> dict[str, Any]:
    graph: dict[str, Any] = json.loads(EXAMPLE.read_text())
    graph["3"]["inputs"]["steps"] = steps
    return graph


def cli_env(stack: RunningStack, task_queue: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TEMPORAL_", "AWS_"))}
    env.update(stack.worker_env())
    env["DURABLE_COMFY_TASK_QUEUE"] = task_queue
    return env


# A suite started in the background (`cmd &`, nohup) hands its children SIGINT ignored, and
# Python then installs no KeyboardInterrupt handler: the CLI would sleep through the Ctrl-C a
# test sends it. So the CLI is started with the handler a terminal's foreground process gets.
# Not by a `preexec_fn`: Python code between fork and exec in this many-threaded process (the
# Temporal SDK's threads) can deadlock on a lock another thread held at the fork, and a CI run
# hung there in `Popen._execute_child`.
_CLI_AS_FROM_A_TERMINAL = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('starter.cli', run_name='__main__', alter_sys=True)"
)


async def start_cli(*args: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CLI_AS_FROM_A_TERMINAL,
        *args,
        env=env,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def run_cli(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    process = await start_cli(*args, env=env)
    out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def interrupt_cli(process: asyncio.subprocess.Process) -> tuple[int, str, str]:
    """Ctrl-C, as a terminal sends it, then the process's exit code and output."""
    process.send_signal(signal.SIGINT)
    out, err = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def json_lines(out: str) -> list[dict[str, Any]]:
    """stdout of a --json command: exactly one JSON object per line, nothing else."""
    assert out.endswith("\n") or out == "", f"stdout does not end a line: {out[-200:]!r}"
    documents: list[dict[str, Any]] = []
    for line in out.splitlines():
        document = json.loads(line)  # fails on anything that is not exactly one document
        assert isinstance(document, dict), line
        documents.append(document)
    return documents


@contextmanager
def logging_restored() -> Iterator[None]:
    """The CLI configures logging onto the `sys.stderr` it finds, which CliRunner swaps for a
    stream it closes afterwards: every later test in this process would then log into a closed
    file (`ValueError: I/O operation on closed file`). Put back what was there."""
    config = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        structlog.configure(**config)
        root.handlers[:] = handlers
        root.setLevel(level)
