"""durable-comfy's RunPod serverless simulator: a stand-in for RunPod's control plane, so the
orchestrator's RunPod backend and the `endpoint/` handler run end to end without an account or a
GPU. It is a simulator, not RunPod: ids end in "-sim", worker ids start with "sim-worker-",
/sim/health says so, and logs are tagged [runpod-sim].

Run it with `python -m devstack.runpod_sim --port P --api-key KEY --endpoint-id ID
[--worker-command "..."] [--clock-speed N] ...`, or build the aiohttp application in-process
with `create_app(SimSettings(...))`.

What it simulates (PROTOCOLS.md, "RunPod serverless"):
- The public API under /v2/{endpoint_id}/: run, runsync (?wait=), status, stream, cancel, retry,
  purge-queue, health; Bearer auth (401); IN_QUEUE -> IN_PROGRESS -> COMPLETED / FAILED /
  CANCELLED / TIMED_OUT with delayTime, executionTime and workerId; the latest progress update as
  `output` while IN_PROGRESS; policy.executionTimeout (exceeding it fails the job and stops the
  worker) and policy.ttl (from submission, whatever the state; then 404); results kept 30 min
  (run) or 1 min (runsync) after the end; body limits (run 10 MB, runsync 20 MB: 413); 1 MB stream
  chunks; per-10-s rate limits (429 with Retry-After); webhooks.
- The worker-facing API of runpod 1.12.0's `runpod.serverless.start` loop (job-take, job-stop,
  job-done, job-stream, ping; routes_worker.py), driven by real, unmodified worker processes;
  runpod 1.7.x's loop (the stock worker-comfyui handler's) uses the same routes but never asks
  for job-stop: a job cancelled under it runs on, and its late job-done is accepted, changes
  nothing in `/status` and is counted in the ledger (`late_posts`).
- Each worker its own temporary directory (TMPDIR, under the work dir), as a container has its
  own /tmp; the working directory is the image's root (`--worker-cwd`), shared by every worker.
- Workers on demand: scale from zero, max workers, active (min) workers, cold start, idle
  timeout, replacement after refresh_worker, the job of a dead worker (TIMED_OUT, re-delivered,
  or stuck until the execution timeout). Every platform timer runs on a simulator clock
  `--clock-speed` times faster than real.
- Beside each worker's handler, as endpoint/start.sh does on the image, its watchdog
  (worker_watchdog.py; `--watchdog auto|on|off`, on for endpoint/handler.py), and its own road
  to the bucket, a TCP proxy (s3_proxy.py) that a `partition` fault shuts.
- A ledger (GET /sim/ledger, ledger.py) and fault injection (POST /sim/faults, faults.py): on
  the platform (bursts, dropped answers, lost results, slow cold starts, unhealthy or throttled
  workers) and on a job's worker (crash, freeze, partition; worker_faults.py), each of the
  latter an event in the ledger.

What it does not: GPUs, regions, network volumes, FlashBoot, the active workers' discount,
lowPriority (accepted, no effect), concurrency modifiers beyond what the SDK does itself, the
GraphQL and REST management APIs, per-account limits, the exact wording of RunPod's error bodies
(ours are `{"error": "..."}`), and a 413/400 exactly where RunPod draws the line (limits are MiB
here). What happens to a dead worker's job is undocumented at RunPod: the simulator offers the
three behaviours seen in the wild. Pings are recorded, never used to judge a worker: the
simulator owns the processes and sees them die (a frozen one keeps its job and its bill, as a
hung container does on RunPod, until its watchdog or a timeout ends it).
`health.workers.ready` counts idle plus running workers (the simulator's reading of a field
RunPod does not define); `unhealthy` and `throttled` are 0 but under the `unhealthy_workers`
fault (the workers holding no job, which take none meanwhile) and the `throttled_workers` fault
(the workers the autoscaler would start and cannot). A simulator killed with SIGKILL
cannot stop its workers (each runs in its own session): stop it with SIGTERM or SIGINT and give
it --stop-grace plus a few seconds.
"""

from .ledger import Ledger
from .server import create_app
from .settings import SIM_VERSION, SimSettings

__all__ = ["SIM_VERSION", "Ledger", "SimSettings", "create_app"]
