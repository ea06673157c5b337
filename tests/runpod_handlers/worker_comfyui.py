"""The stock runpod-workers/worker-comfyui handler as a RunPod simulator worker.

The handler is a test fixture outside the repository (worker-comfyui 5.8.5, AGPL-3.0, in
$STOCK_WORKER_COMFYUI, by default ../shared/worker-comfyui): this launcher imports its module
unmodified from there and starts the `runpod` worker loop on it, in .venv-stock (the handler's
own requirements: runpod~=1.7.12). It does what the worker-comfyui image's start.sh does around
the handler, for a worker whose ComfyUI is its own (the simulator's ComfySimPerWorker):

- `handler.COMFY_HOST` is the worker's ComfyUI (COMFY_HOST), not the image's 127.0.0.1:8188;
- start.sh writes ComfyUI's pid to /tmp/comfyui.pid, which the handler watches while it waits
  for ComfyUI: here the pid (COMFY_PID) goes to a file in the worker's own temporary directory,
  and `handler.COMFY_PID_FILE` names it, so no test touches the machine's /tmp;
- the image runs the handler from its own root: runpod 1.7.x keeps its in-progress job list in
  its working directory (.runpod_jobs.pkl), so the worker runs from its own temporary directory
  (TMPDIR, one per worker in the simulator), never from the repository shared by every worker.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_FIXTURE = REPO_ROOT.parent / "shared" / "worker-comfyui"


def fixture_dir() -> Path:
    folder = Path(os.environ.get("STOCK_WORKER_COMFYUI") or DEFAULT_FIXTURE)
    return folder if folder.is_absolute() else (REPO_ROOT / folder).resolve()


def main() -> None:
    folder = fixture_dir()
    if not (folder / "handler.py").is_file():
        raise SystemExit(f"no stock worker-comfyui handler.py in {folder}")
    private = Path(tempfile.gettempdir())
    os.chdir(private)  # before runpod is imported: its job list's place is fixed at import
    sys.path.insert(0, str(folder))  # `handler` and its own `network_volume`

    import handler  # type: ignore[import-not-found]
    import runpod  # type: ignore[import-not-found,unused-ignore]

    handler.COMFY_HOST = os.environ["COMFY_HOST"]
    comfy_pid = os.environ.get("COMFY_PID")
    if comfy_pid:
        pid_file = private / "comfyui.pid"
        pid_file.write_text(comfy_pid)
        handler.COMFY_PID_FILE = str(pid_file)
    runpod.serverless.start({"handler": handler.handler})


if __name__ == "__main__":
    main()
