"""A watch on a job nobody works on says so within seconds, and keeps watching.

Each test uses a task queue of its own that no worker polls at first, then (for `submit
--watch`) starts a worker on it in this process and sees the job through, or (for `watch`)
ends the job from outside and sees the watch end with it.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devstack.models import RunningStack
from starter import JobClient, JobRequest, JobState, JobStatus
from starter.cli.common import ExitCode
from starter.connection import connect_temporal
from tests.support.cli import cli_env, example, json_lines, run_cli, running_worker, start_cli

# The promise: the no-worker line within this long of the job's line (seconds).
NOTICE_WITHIN_S = 5.0


def long_job() -> dict[str, Any]:
    """A graph that runs ~6 s on the test stack (300 steps of 20 ms), so it still runs for
    several of the watch's 2 s presence checks after the worker comes: a short job, or one
    ComfyUI answers from its cache, can end before the first, and the watch with it, without
    the "a worker polls now" line. A seed of its own: never the cached result of another test."""
    graph = example(steps=300)
    graph["3"]["inputs"]["seed"] = random.randrange(2**32)
    return graph


def fresh_queue() -> str:
    return f"no-worker-{uuid.uuid4().hex[:8]}"


async def cli_startup_s(env: dict[str, str]) -> float:
    """How long the CLI takes to start and exit doing nothing (`--help`)."""
    started_at = time.monotonic()
    code, _, err = await run_cli("--help", env=env)
    assert code == 0, err
    return time.monotonic() - started_at


async def line_where(
    stream: asyncio.StreamReader | None, matches: Callable[[str], bool], timeout_s: float
) -> tuple[str, float, list[str]]:
    """The first line that matches, when it came (monotonic), and the lines before it."""
    assert stream is not None
    before: list[str] = []
    deadline = time.monotonic() + timeout_s
    while True:
        raw = await asyncio.wait_for(stream.readline(), timeout=deadline - time.monotonic())
        assert raw, f"the stream ended without the line; it had: {before}"
        line = raw.decode().rstrip("\n")
        if matches(line):
            return line, time.monotonic(), before
        before.append(line)


async def test_submit_watch_says_no_worker_polls_then_goes_on_when_one_does(
    local_stack: RunningStack, tmp_path: Path
) -> None:
    queue = fresh_queue()
    graph_file = tmp_path / "graph.json"
    graph_file.write_text(json.dumps(long_job()))
    process = await start_cli("submit", str(graph_file), "--watch", env=cli_env(local_stack, queue))
    try:
        job_line, job_at, _ = await line_where(
            process.stdout, lambda line: line.startswith("job "), timeout_s=30
        )
        notice = f"no worker polls task queue {queue!r} (start one: durable-comfy worker); "
        _, notice_at, before = await line_where(
            process.stderr, lambda line: line.startswith(notice), timeout_s=NOTICE_WITHIN_S + 1
        )
        assert notice_at - job_at <= NOTICE_WITHIN_S, (job_line, before)
        assert process.returncode is None  # still watching
        async with running_worker(local_stack, "no-worker", queue):
            rest, err = await asyncio.wait_for(process.communicate(), timeout=60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == ExitCode.OK, err.decode()
    assert f"a worker polls task queue {queue!r} now" in err.decode()
    assert "COMPLETED" in rest.decode()


async def test_watch_json_has_a_no_worker_event_then_a_worker_polling_one(
    local_stack: RunningStack,
) -> None:
    queue = fresh_queue()
    temporal = await connect_temporal(local_stack.temporal_address, local_stack.namespace)
    client = JobClient(temporal, task_queue=queue)
    submitted = await client.submit(JobRequest(graph=long_job()))
    env = cli_env(local_stack, queue)
    # `watch` prints nothing before the event: it is timed from the process's start, less what
    # starting the CLI takes here (seconds on a busy machine), measured the same way.
    startup_s = await cli_startup_s(env)
    started_at = time.monotonic()
    process = await start_cli("watch", submitted.job_id, "--json", env=env)
    try:
        line, seen_at, before = await line_where(
            process.stdout,
            lambda line: '"event"' in line,
            timeout_s=startup_s + NOTICE_WITHIN_S + 2,
        )
        assert seen_at - started_at <= startup_s + NOTICE_WITHIN_S, (
            seen_at - started_at,
            startup_s,
        )
        assert json.loads(line) == {
            "event": "no_worker",
            "job_id": submitted.job_id,
            "task_queue": queue,
            "workers": [],
        }
        assert process.returncode is None  # still watching
        async with running_worker(local_stack, "no-worker", queue):
            out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == ExitCode.OK, err.decode()
    lines = [json.loads(line) for line in before] + json_lines(out.decode())
    events = [doc["event"] for doc in lines if "event" in doc]
    assert events == ["worker_polling"], lines
    assert lines[-1]["state"] == "COMPLETED"


async def test_a_watch_outlives_unanswered_queries_until_a_worker_comes(
    local_stack: RunningStack,
) -> None:
    """Nobody answers the status query or the attach update for several of their timeouts:
    each is retried on the watch's backoff (not raised at the first as a `ClientError`), and
    the watch goes on to the job's end once a worker comes."""
    queue = fresh_queue()
    temporal = await connect_temporal(local_stack.temporal_address, local_stack.namespace)
    client = JobClient(temporal, task_queue=queue, query_timeout_s=0.5)
    submitted = await client.submit(JobRequest(graph=example(steps=2)))
    seen: list[JobStatus] = []

    async def watch() -> None:
        async for status in client.watch(submitted.job_id, poll_interval_s=0.2):
            seen.append(status)

    watching = asyncio.create_task(watch())
    # A query, then updates on the reconnect backoff (1 s, 2 s, ... with jitter), unanswered.
    await asyncio.sleep(6)
    assert not watching.done(), watching.exception()
    async with running_worker(local_stack, "no-worker", queue):
        await asyncio.wait_for(watching, timeout=60)
    assert seen[-1].state is JobState.COMPLETED
