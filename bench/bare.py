"""The baseline for durability's cost: a bare workflow with one no-op activity.

The workflow is in bench/bare_workflow.py; this is its worker (`python -m bench.bare`), a
process of its own as the job's worker is, on the same Temporal server, so the two differ only
in what the workflows do.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from temporalio.worker import Worker

from bench.bare_workflow import BareWorkflow, noop
from starter.connection import connect_temporal

READY_MARK = "bench_bare_worker_started"


async def serve(address: str, namespace: str, task_queue: str) -> None:
    client = await connect_temporal(address, namespace, environ={})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with Worker(client, task_queue=task_queue, workflows=[BareWorkflow], activities=[noop]):
        print(READY_MARK, flush=True)
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bare")
    parser.add_argument("--address", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--task-queue", required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.address, args.namespace, args.task_queue))


if __name__ == "__main__":
    main()
