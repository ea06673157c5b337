"""The RunPod simulator's worker states in `GET /health` (devstack/runpod_sim/platform.py) and the
faults that set them (devstack/runpod_sim/faults.py): `unhealthy_workers`, `throttled_workers`,
and the slow cold start's `initializing`. For each: `/health` shows it, a job submitted while it
holds stays IN_QUEUE, and once it is cleared the job is taken and completes.

Each test runs a simulator of its own (tests/support/runpod_sim.py) with the cheap scripted
handler (tests/runpod_handlers/scripted.py); the real cost is the workers' boot (~2 s each).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack.runpod_sim import Ledger
from faults.wait import eventually
from tests.support.runpod_sim import (
    ENDPOINT_VENV_MISSING,
    RunpodSim,
    handler_script,
    run_runpod_sim,
)

pytestmark = pytest.mark.skipif(
    ENDPOINT_VENV_MISSING is not None, reason=ENDPOINT_VENV_MISSING or ""
)
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT"}
# Real seconds a fault is watched holding a job in the queue: several job-take long-polls and
# timer ticks (the simulator's clock runs 10x here: 15 simulated s).
HOLD_S = 1.5


def client(sim: RunpodSim) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=sim.api_url, headers=sim.headers, timeout=30, trust_env=False)


async def submit(sim: RunpodSim, job_input: dict[str, Any]) -> str:
    async with client(sim) as http:
        response = await http.post("/run", json={"input": job_input})
    assert response.status_code == 200, response.text
    job_id: str = response.json()["id"]
    return job_id


async def status(sim: RunpodSim, job_id: str) -> dict[str, Any]:
    async with client(sim) as http:
        response = await http.get(f"/status/{job_id}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def health(sim: RunpodSim) -> dict[str, Any]:
    async with client(sim) as http:
        response = await http.get("/health")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def workers(sim: RunpodSim) -> dict[str, int]:
    counts: dict[str, int] = (await health(sim))["workers"]
    return counts


async def wait_status(
    sim: RunpodSim, job_id: str, wanted: set[str], timeout_s: float = 30
) -> dict[str, Any]:
    return await eventually(
        lambda: status(sim, job_id),
        timeout_s=timeout_s,
        what=f"{job_id} in {wanted}",
        accept=lambda body: body["status"] in wanted,
    )


async def wait_ledger(sim: RunpodSim, what: str, accept: Any, timeout_s: float = 20) -> Ledger:
    return await eventually(sim.ledger, timeout_s=timeout_s, what=what, accept=accept)


async def stays_queued(sim: RunpodSim, job_ids: list[str], expected: dict[str, int]) -> None:
    """For HOLD_S: every job IN_QUEUE (never delivered), and `/health`'s workers as expected
    (the fields given)."""
    deadline = time.monotonic() + HOLD_S
    while time.monotonic() < deadline:
        for job_id in job_ids:
            assert (await status(sim, job_id))["status"] == "IN_QUEUE"
        counts = await workers(sim)
        assert {k: counts[k] for k in expected} == expected, counts
        await asyncio.sleep(0.2)
    ledger = await sim.ledger()
    assert all(ledger.job(job_id).deliveries == [] for job_id in job_ids)


async def test_unhealthy_workers_take_no_job_and_are_no_capacity_until_cleared(
    tmp_path: Path,
) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    async with run_runpod_sim(
        tmp_path / "sim", "--clock-speed", "10", "--max-workers", "2", "--idle-timeout", "600",
        handler=handler_script("scripted"),
    ) as sim:  # fmt: skip
        first = await submit(sim, {"sleep_s": 3, "marker_dir": str(markers)})
        running = await wait_status(sim, first, {"IN_PROGRESS"})
        worker_a = running["workerId"]
        # Any worker launched from now stays in its cold start: no second boot to pay for.
        armed = await sim.faults(unhealthy_workers=True, slow_cold_start_s=3600)
        assert armed["unhealthy_workers"] is True
        # A job already running on the worker runs on to its end: not killed, not cancelled.
        counts = await workers(sim)
        assert counts["running"] == 1 and counts["unhealthy"] == 0, counts
        done = await wait_status(sim, first, TERMINAL)
        assert done["status"] == "COMPLETED" and done["output"]["job_id"] == first, done
        assert not (markers / f"{first}.cancelled").exists()
        # Then the worker, alive and holding no job, is unhealthy: not idle, not ready.
        assert await workers(sim) == {
            "idle": 0, "initializing": 0, "ready": 0, "running": 0, "throttled": 0,
            "unhealthy": 1,
        }  # fmt: skip
        ledger = await sim.ledger()
        assert ledger.worker(worker_a).state == "idle" and ledger.worker(worker_a).events == []
        assert [d.outcome for d in ledger.job(first).deliveries] == ["completed"]

        # A new job: the unhealthy worker is no capacity, so the autoscaler starts another,
        # which is unhealthy from its start (reported so, not as initializing).
        second = await submit(sim, {"output": {"n": 2}})
        ledger = await wait_ledger(sim, "a second worker", lambda led: len(led.workers) == 2)
        [worker_b] = [w.id for w in ledger.workers if w.id != worker_a]
        await stays_queued(
            sim, [second], {"unhealthy": 2, "idle": 0, "initializing": 0, "ready": 0}
        )
        assert len((await sim.ledger()).workers) == 2  # bounded by max workers

        # Cleared: healthy again, and the queued job is taken by the worker that is up.
        cleared = await sim.faults(unhealthy_workers=False)
        assert cleared["unhealthy_workers"] is False
        done = await wait_status(sim, second, TERMINAL, timeout_s=10)
        assert done["status"] == "COMPLETED" and done["output"] == {"n": 2}, done
        assert done["workerId"] == worker_a
        counts = await workers(sim)
        assert counts["unhealthy"] == 0 and counts["initializing"] == 1, counts
        assert (await sim.ledger()).worker(worker_b).state == "initializing"


async def test_throttled_workers_are_not_started_until_cleared(tmp_path: Path) -> None:
    async with run_runpod_sim(
        tmp_path, "--clock-speed", "10", "--max-workers", "2", "--idle-timeout", "600",
        handler=handler_script("scripted"),
    ) as sim:  # fmt: skip
        armed = await sim.faults(throttled_workers=True)
        assert armed["throttled_workers"] is True
        jobs = [await submit(sim, {"output": {"n": 0}})]
        # As many as the autoscaler wants started: one per queued job...
        assert (await workers(sim))["throttled"] == 1
        jobs += [await submit(sim, {"output": {"n": n}}) for n in (1, 2)]
        # ...bounded by max workers; none of them starting.
        await stays_queued(
            sim, jobs, {"throttled": 2, "initializing": 0, "idle": 0, "ready": 0, "unhealthy": 0}
        )
        assert (await sim.ledger()).workers == []
        assert (await health(sim))["jobs"]["inQueue"] == 3

        # Cleared by POST /sim/reset: the autoscaler starts workers and the queue is served.
        await sim.reset_faults()
        for n, job_id in enumerate(jobs):
            done = await wait_status(sim, job_id, TERMINAL)
            assert done["status"] == "COMPLETED" and done["output"] == {"n": n}, done
        assert (await workers(sim))["throttled"] == 0
        ledger = await sim.ledger()
        assert len(ledger.workers) == 2
        assert all(w.state in ("idle", "running") for w in ledger.workers)

        # Workers already up keep working while throttled, and nothing is throttled when the
        # idle workers take the queue.
        await sim.faults(throttled_workers=True)
        late = await submit(sim, {"output": {"n": 3}})
        done = await wait_status(sim, late, TERMINAL, timeout_s=10)
        assert done["status"] == "COMPLETED" and done["output"] == {"n": 3}, done
        assert done["workerId"] in {w.id for w in ledger.workers}
        counts = await workers(sim)
        assert counts["throttled"] == 0 and counts["ready"] == 2, counts
        assert len((await sim.ledger()).workers) == 2


async def test_a_slow_cold_start_is_initializing_until_the_worker_is_ready(
    tmp_path: Path,
) -> None:
    async with run_runpod_sim(
        tmp_path, "--clock-speed", "10", "--idle-timeout", "600",
        handler=handler_script("scripted"),
    ) as sim:  # fmt: skip
        await sim.faults(slow_cold_start_s=30)  # 3 real s at clock speed 10
        job_id = await submit(sim, {"output": {"cold": True}})
        await stays_queued(
            sim,
            [job_id],
            {"initializing": 1, "idle": 0, "ready": 0, "running": 0, "unhealthy": 0},
        )
        done = await wait_status(sim, job_id, TERMINAL)
        assert done["status"] == "COMPLETED" and done["output"] == {"cold": True}, done
        counts = await workers(sim)
        assert counts["initializing"] == 0 and counts["ready"] == 1, counts
        worker = (await sim.ledger()).worker(done["workerId"])
        assert worker.cold_start_s == 30
        assert worker.ready_at is not None and worker.ready_at - worker.started_at >= 30
