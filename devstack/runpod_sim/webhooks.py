"""`webhook` of /run: one POST of the /status body when the job ends, retried twice 10 s
(simulator time) apart unless answered 200. Not a source of truth, on RunPod either."""

from __future__ import annotations

import asyncio

import aiohttp
import structlog

from .clock import SimClock
from .jobs import Job
from .views import status_body

log = structlog.get_logger("runpod_sim.webhooks")

ATTEMPTS = 3
RETRY_DELAY_S = 10.0


class Webhooks:
    def __init__(self, clock: SimClock) -> None:
        self.clock = clock
        self._tasks: set[asyncio.Task[None]] = set()

    def job_ended(self, job: Job) -> None:
        if not job.webhook:
            return
        task = asyncio.create_task(self._deliver(job, job.webhook))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _deliver(self, job: Job, url: str) -> None:
        body = status_body(job)
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as http:
            for attempt in range(ATTEMPTS):
                if attempt:
                    await self.clock.sleep(RETRY_DELAY_S)
                try:
                    async with http.post(url, json=body) as response:
                        job.webhook_answers.append(str(response.status))
                        if response.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError) as exc:
                    job.webhook_answers.append(type(exc).__name__)
                log.warning("webhook not accepted", job_id=job.id, answers=job.webhook_answers)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
