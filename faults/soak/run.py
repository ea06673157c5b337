"""One soak, phase by phase: start the stack; for N minutes submit jobs and inject faults; stop
injecting; drain (wait, bounded, for every job to end); collect the evidence; stop everything by
PID (whatever happened: an exception, Ctrl-C, SIGTERM); audit.

The seed feeds three generators of their own (the job mix, the submission pace, the faults), so
the sequence of jobs does not change with how many faults a run happened to inject.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

import structlog

from faults.soak.audit import Audit, audit
from faults.soak.collect import collect
from faults.soak.driver import JobDriver
from faults.soak.endpoints import endpoint_specs
from faults.soak.evidence import Evidence, RunInfo
from faults.soak.injector import FaultInjector
from faults.soak.mix import JobMix, PoolChoice
from faults.soak.options import SoakOptions
from faults.soak.stack import COMFY_POOL, SoakStack, new_stack, running

log = structlog.get_logger("soak")


def _pools(stack: SoakStack) -> list[PoolChoice]:
    pools = [PoolChoice(COMFY_POOL, "comfyui", claims=False)]
    pools += [
        PoolChoice(name, "runpod", claims=endpoint.spec.claims)
        for name, endpoint in stack.endpoints.items()
    ]
    return pools


async def _run(options: SoakOptions, work_dir: Path, evidence: Evidence) -> None:
    specs = endpoint_specs(options.stock)
    stack = new_stack(work_dir, options.step_delay_ms)
    try:
        async with running(stack, specs):
            evidence.run.pools = stack.pools
            client = await stack.client()
            mix = JobMix(
                random.Random(f"{options.seed}-mix"),
                uuid.uuid4().hex[:6],
                _pools(stack),
                options.cancel_fraction,
            )
            driver = JobDriver(
                client, mix, random.Random(f"{options.seed}-pace"), options.jobs_per_minute
            )
            injector = FaultInjector(
                stack, random.Random(f"{options.seed}-faults"), options.fault_every_s
            )
            evidence.run.started_at = time.time()
            until = evidence.run.started_at + options.minutes * 60
            log.info("soak started", until=time.strftime("%H:%M:%S", time.localtime(until)))
            evidence.faults = injector.records
            try:
                try:
                    async with asyncio.TaskGroup() as group:
                        group.create_task(driver.run(until))
                        group.create_task(injector.run(until))
                except ExceptionGroup as failed:
                    raise failed.exceptions[0] from None  # a service that did not come back
                finally:
                    await injector.stop_injecting()
                evidence.run.injection_ended_at = time.time()
                log.info("faults stopped; draining", jobs=len(driver.records))
                await driver.drain(options.drain_timeout_s)
                evidence.run.drained_at = time.time()
            finally:
                await injector.close()
            log.info("drained; collecting the evidence")
            await collect(stack, driver.records, evidence)
    finally:
        evidence.leftover_processes = stack.leftovers()


async def run_soak(options: SoakOptions) -> tuple[Audit, Evidence]:
    """The whole soak; raises on a stack that cannot run (after stopping what it started)."""
    work_dir = Path(tempfile.mkdtemp(prefix="durable-comfy-soak-"))
    evidence = Evidence(
        run=RunInfo(
            minutes=options.minutes,
            fault_every_s=options.fault_every_s,
            seed=options.seed,
            jobs_per_minute=options.jobs_per_minute,
            work_dir=str(work_dir),
        )
    )
    main = asyncio.current_task()
    loop = asyncio.get_running_loop()
    if main is not None:
        # SIGTERM as Ctrl-C: cancel the run, so every `finally` stops what it started.
        loop.add_signal_handler(signal.SIGTERM, main.cancel)
    result: Audit | None = None
    try:
        await _run(options, work_dir, evidence)
        result = audit(evidence)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        (work_dir / "evidence.json").write_text(evidence.model_dump_json(indent=1))
        if result is None:  # interrupted or broken: say whether the clean-up was complete
            left = evidence.leftover_processes
            print(
                f"soak: still running after the stop: pids {left}"
                if left
                else "soak: everything it started has been stopped",
                file=sys.stderr,
            )
        # Kept when asked, and whenever something went wrong: its logs say what.
        if options.keep or result is None or not result.ok:
            print(f"soak: the run's logs and evidence are in {work_dir}", file=sys.stderr)
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    return result, evidence
