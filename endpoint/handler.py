"""The RunPod serverless entry point: `python endpoint/handler.py` (in the worker image, or
`.venv-endpoint/bin/python endpoint/handler.py` against the local RunPod simulator).

Thin on purpose: the SDK's worker loop (`runpod.serverless.start`), its `progress_update`, and
`refresh_worker`. Everything else is in endpoint/job.py, which never imports `runpod`, so the
tests drive it from the app's venv. An `async` handler: the SDK cancels its task when the
platform stops the job (`CancelledError`, again on every re-sent job-stop), which job.py turns
into dequeue/interrupt of the prompt until ComfyUI no longer holds it and a cancelled claim.
While the handler's task runs the SDK takes no other job; a prompt that outlives the job's stop
horizon has its worker replaced (`stopping.replace_this_worker`: SIGKILL to ComfyUI, SIGTERM to
this process, which the SDK turns into a graceful exit once the task has returned).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

# Run as a script, Python puts endpoint/ (not the repository or image root) on sys.path; the
# handler imports `endpoint.*` and the shared `activities.*` modules from that root.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import runpod  # type: ignore[import-not-found,unused-ignore]  # noqa: E402

from endpoint.fence_file import FenceFile  # noqa: E402
from endpoint.job import run_job  # noqa: E402
from endpoint.logs import configure_logging  # noqa: E402
from endpoint.nodes import publish_at_start  # noqa: E402
from endpoint.settings import EndpointSettings  # noqa: E402
from endpoint.stopping import replace_this_worker  # noqa: E402


@functools.cache
def settings() -> EndpointSettings:
    """Read once, at the first job (or at start-up from main)."""
    return EndpointSettings.from_env()


async def handler(job: dict[str, Any]) -> dict[str, Any]:
    """One job: `{"id", "input"}` in, the contract's EndpointOutput / EndpointError out."""

    def progress(update: dict[str, Any]) -> None:
        runpod.serverless.progress_update(job, update)

    replace = replace_this_worker(settings().comfy_pid)
    return await run_job(job, settings(), progress, replace_worker=replace)


def main() -> None:
    configure_logging()
    # No claim is held yet: a fence file left by an earlier handler process must not make the
    # watchdog end this one (endpoint/fence_file.py).
    fence_file = settings().fence_file
    if fence_file is not None:
        FenceFile(fence_file).released()
    # The node registry, in a daemon thread: neither the SDK nor the process waits for it.
    publish_at_start(settings())
    runpod.serverless.start(
        {
            "handler": handler,
            # worker-comfyui's REFRESH_WORKER: a fresh worker after every job.
            "refresh_worker": settings().refresh_worker,
        }
    )


if __name__ == "__main__":
    main()
