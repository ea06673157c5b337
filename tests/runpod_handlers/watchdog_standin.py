"""A stand-in for endpoint/watchdog.py, for the RunPod simulator's own tests: same command line
(`watchdog_standin.py --pid <handler pid>`), none of its judgement. It tells the test what it was
started as and does what the test asks:

- `watchdog-standin.json` beside its DURABLE_COMFY_FENCE_FILE, rewritten every 0.1 s: its pid,
  process group and session, its parent, argv, the variables a watchdog reads, and `ticks`
  (how often it woke up: a frozen watchdog's ticks stop);
- when a file `watchdog-kill` appears there, it SIGKILLs the handler (`killed_at` in the report);
- once the handler is gone it exits, as the watchdog follows its handler out (and the
  simulator, as endpoint/start.sh, waits for that before the worker's container is gone).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

REPORT = "watchdog-standin.json"
KILL = "watchdog-kill"
VARIABLES = (
    "COMFY_URL",
    "COMFY_PID",
    "DURABLE_COMFY_FENCE_FILE",
    "BUCKET_ENDPOINT_URL",
    "RUNPOD_POD_ID",
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pid", type=int, required=True)
    args = parser.parse_args()
    folder = Path(os.environ["DURABLE_COMFY_FENCE_FILE"]).parent
    report: dict[str, object] = {
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "sid": os.getsid(0),
        "ppid": os.getppid(),
        "handler_pid": args.pid,
        "handler_pgid": os.getpgid(args.pid),
        "argv": sys.argv[1:],
        "env": {name: os.environ.get(name) for name in VARIABLES},
        "ticks": 0,
        "killed_at": None,
    }
    ticks = 0
    while _alive(args.pid):
        if report["killed_at"] is None and (folder / KILL).exists():
            os.kill(args.pid, signal.SIGKILL)
            report["killed_at"] = time.time()
        ticks += 1
        report["ticks"] = ticks
        tmp = folder / f".{REPORT}.tmp"
        tmp.write_text(json.dumps(report))
        tmp.replace(folder / REPORT)
        time.sleep(0.1)


if __name__ == "__main__":
    main()
