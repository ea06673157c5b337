"""`python -m bench.burst_child ...`: the unwatched jobs of a scale burst, from a process of
their own, as the other clients of a burst would send them.

The scale group (bench/groups/scale.py) measures how late a watched job's steps reach its
client. When that client's process also sends the burst's other 990 starts, its own event loop
hands out the watched steps late; the project is not what is measured then. This process
connects, prints `ready`, waits for a line on stdin (the burst's start), submits `--jobs` jobs
at once (`JobClient.submit`, detached, under job IDs of its own, sent again while Temporal times
out) and waits for them all; then prints one JSON line: {"completed": n, "failed": [...]}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from bench.jobs import request, submit_idempotently
from starter import JobClient, JobState, JobStatus
from starter.connection import connect_temporal

READY = "ready"


async def _one(jobs: JobClient, steps: int, pool: str) -> JobStatus:
    submitted = await submit_idempotently(jobs, request(steps, pool))
    return await jobs.wait(submitted.job_id)


async def main(args: argparse.Namespace) -> dict[str, object]:
    temporal = await connect_temporal(args.address, args.namespace, environ={})
    jobs = JobClient(temporal, task_queue=args.task_queue)
    print(READY, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    finals = await asyncio.gather(*(_one(jobs, args.steps, args.pool) for _ in range(args.jobs)))
    failed = [f"{f.job_id}: {f.state.value}" for f in finals if f.state != JobState.COMPLETED]
    return {"completed": len(finals) - len(failed), "failed": failed[:10]}


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.burst_child")
    parser.add_argument("--address", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--task-queue", required=True)
    parser.add_argument("--pool", required=True)
    parser.add_argument("--jobs", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    return parser.parse_args()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(_args()))), flush=True)
