"""`python -m bench.worker_main`: the project's worker (worker.py's `run_worker`, unchanged) with
one setting the environment cannot reach: `max_concurrent_activities` (100 in WorkerSettings,
so one worker follows at most 100 prompts at once) from BENCH_MAX_CONCURRENT_ACTIVITIES.

Only group 4 (scale) uses it, to measure N > 100 concurrently monitored jobs in one process;
everything else in the worker is read from the environment exactly as `python worker.py` does.
"""

from __future__ import annotations

import asyncio
import os

from activities.log_setup import configure_logging
from activities.settings import WorkerSettings
from activities.storage import S3Settings
from starter.connection import TemporalSettings
from starter.exit import exit_without_finalizing
from worker import run_worker

MAX_VAR = "BENCH_MAX_CONCURRENT_ACTIVITIES"


def main() -> None:
    settings = WorkerSettings()
    if MAX_VAR in os.environ:
        settings = settings.model_copy(
            update={"max_concurrent_activities": int(os.environ[MAX_VAR])}
        )
    configure_logging(settings.log_level)
    asyncio.run(run_worker(settings, S3Settings.from_env(), temporal=TemporalSettings()))
    exit_without_finalizing(0)


if __name__ == "__main__":
    main()
