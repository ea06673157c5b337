"""Submit a ComfyUI graph, follow it to the end, print its outputs' presigned URLs.

With the local stack up and its environment loaded (`make demo`, then `. .devstack/env`):
    .venv/bin/python examples/quickstart.py [GRAPH.json]
"""

import asyncio
import sys

from starter import JobClient, JobRequest, JobState, exit_without_finalizing, load_graph


async def main(graph_file: str) -> int:
    # Temporal, the task queue and the artifact bucket: the same variables as the CLI.
    async with await JobClient.connect() as client:
        job = await client.submit(JobRequest(graph=load_graph(graph_file)))  # detached
        print("submitted", job.job_id)
        async for status in client.watch(job.job_id):
            print(f"{status.state.value:<12} {status.progress.fraction:4.0%}")
        final = await client.result(job.job_id)  # the final status, URLs presigned
        for artifact in final.artifacts:
            print(artifact.key, artifact.sha256[:12], artifact.url)
        return 0 if final.state == JobState.COMPLETED else 1


if __name__ == "__main__":
    # sys.exit, without the interpreter's teardown, which temporalio's threads can crash at
    # exit (SIGABRT after a clean run: temporalio/sdk-python#300).
    exit_without_finalizing(
        asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "examples/txt2img.json"))
    )
