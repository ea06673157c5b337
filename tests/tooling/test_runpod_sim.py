"""The RunPod serverless simulator (devstack/runpod_sim) against PROTOCOLS.md: the public API, the
real runpod 1.12.0 worker loop running tests/runpod_handlers/, scaling, every fault, the ledger.

Each simulator is a subprocess on its own free port (tests/runpod_sim_support.py), stopped by PID
at the end of its module fixture with a check that no worker process outlived it. Platform timers
run on a fast simulator clock; the real cost is the workers' boot (~2 s each: the SDK imports
py-cpuinfo, which probes the CPU at import time).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from aiohttp import web

from devstack.chaos.wait import eventually
from devstack.runpod_sim import Ledger
from tests.aiohttp_support import served
from tests.runpod_sim_support import (
    ENDPOINT_VENV_MISSING,
    RunpodSim,
    handler_script,
    run_runpod_sim,
)

needs_endpoint_venv = pytest.mark.skipif(
    ENDPOINT_VENV_MISSING is not None, reason=ENDPOINT_VENV_MISSING or ""
)
MiB = 1024 * 1024
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT"}


def client(sim: RunpodSim) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=sim.api_url, headers=sim.headers, timeout=60, trust_env=False)


async def submit(sim: RunpodSim, job_input: Any, **extra: Any) -> str:
    async with client(sim) as http:
        response = await http.post("/run", json={"input": job_input, **extra})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "IN_QUEUE" and set(body) == {"id", "status"}
    job_id: str = body["id"]
    return job_id


async def status(sim: RunpodSim, job_id: str) -> httpx.Response:
    async with client(sim) as http:
        return await http.get(f"/status/{job_id}")


async def wait_status(
    sim: RunpodSim, job_id: str, wanted: set[str], timeout_s: float = 20
) -> dict[str, Any]:
    async def probe() -> dict[str, Any]:
        response = await status(sim, job_id)
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    return await eventually(
        probe,
        timeout_s=timeout_s,
        what=f"{job_id} in {wanted}",
        accept=lambda b: b["status"] in wanted,
    )


async def wait_gone(sim: RunpodSim, job_id: str, timeout_s: float = 10) -> None:
    async def probe() -> int:
        return (await status(sim, job_id)).status_code

    await eventually(probe, timeout_s=timeout_s, what=f"{job_id} 404", accept=lambda c: c == 404)


async def wait_ledger(sim: RunpodSim, what: str, accept: Any, timeout_s: float = 20) -> Ledger:
    return await eventually(sim.ledger, timeout_s=timeout_s, what=what, accept=accept)


# -- the public API without workers (max-workers 0: jobs stay queued) ------------------------------


@pytest_asyncio.fixture(scope="module")
async def queue_sim(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunpodSim]:
    async with run_runpod_sim(
        tmp_path_factory.mktemp("queue_sim"),
        "--max-workers", "0", "--clock-speed", "20",
        "--run-retention", "20", "--runsync-retention", "10",
    ) as sim:  # fmt: skip
        yield sim


async def test_bearer_auth_and_endpoint_id(queue_sim: RunpodSim) -> None:
    sim = queue_sim
    async with httpx.AsyncClient(base_url=sim.base_url, trust_env=False) as http:
        health = f"/v2/{sim.endpoint_id}/health"
        assert (await http.get(health)).status_code == 401
        wrong = {"Authorization": "Bearer not-the-key"}
        assert (await http.get(health, headers=wrong)).status_code == 401
        run = await http.post(f"/v2/{sim.endpoint_id}/run", json={"input": {}})
        assert run.status_code == 401
        # RunPod also takes the bare key (its own curl examples send it so).
        assert (await http.get(health, headers={"Authorization": sim.api_key})).status_code == 200
        other = await http.get("/v2/another-endpoint/health", headers=sim.headers)
        assert other.status_code == 404
    ledger = await sim.ledger()
    assert ledger.jobs == []  # the refused /run created nothing


async def test_run_then_status_while_queued(queue_sim: RunpodSim) -> None:
    job_input = {"durable_comfy": {"submission": "sub-queued-1"}, "workflow": {}}
    job_id = await submit(queue_sim, job_input)
    response = await status(queue_sim, job_id)
    assert response.status_code == 200
    assert response.json() == {"id": job_id, "status": "IN_QUEUE"}
    missing = await status(queue_sim, "no-such-job")
    assert missing.status_code == 404 and "error" in missing.json()
    [job] = (await queue_sim.ledger()).jobs_for("sub-queued-1")
    assert job.id == job_id and job.status == "IN_QUEUE" and job.deliveries == []
    assert [s.status for s in job.states] == ["IN_QUEUE"]


async def test_bad_bodies_and_policies_are_refused(queue_sim: RunpodSim) -> None:
    async with client(queue_sim) as http:
        for body in (
            {"nothing": 1},
            {"input": {}, "policy": {"executionTimeout": 4999}},  # RunPod's minimum is 5 s
            {"input": {}, "policy": {"ttl": 9999}},  # and 10 s
            {"input": {}, "policy": {"ttl": 8 * 24 * 3600 * 1000}},  # at most 7 days
        ):
            response = await http.post("/run", json=body)
            assert response.status_code == 400, body
        garbage = await http.post("/run", content=b"{not json")
        assert garbage.status_code == 400


async def test_body_limits_are_10_mb_for_run_and_20_mb_for_runsync(queue_sim: RunpodSim) -> None:
    eleven = json.dumps({"input": {"blob": "x" * (11 * MiB)}}).encode()
    twenty_one = json.dumps({"input": {"blob": "x" * (21 * MiB)}}).encode()
    headers = {"Content-Type": "application/json"}
    async with client(queue_sim) as http:
        assert (await http.post("/run", content=eleven, headers=headers)).status_code == 413
        accepted = await http.post("/runsync?wait=1000", content=eleven, headers=headers)
        assert accepted.status_code == 200 and accepted.json()["status"] == "IN_QUEUE"
        too_big = await http.post("/runsync", content=twenty_one, headers=headers)
        assert too_big.status_code == 413


async def test_runsync_answers_the_in_flight_status_after_its_wait(queue_sim: RunpodSim) -> None:
    async with client(queue_sim) as http:
        started = time.monotonic()
        # 500 ms is below RunPod's range: clamped to 1 s, i.e. 50 ms at clock speed 20.
        response = await http.post("/runsync?wait=500", json={"input": {"q": 1}})
        elapsed = time.monotonic() - started
    body = response.json()
    assert response.status_code == 200 and set(body) == {"id", "status"}
    assert body["status"] == "IN_QUEUE"
    assert 0.04 <= elapsed < 2
    assert (await queue_sim.ledger()).job(body["id"]).sync


async def test_cancel_a_queued_job_then_its_result_expires(queue_sim: RunpodSim) -> None:
    job_id = await submit(queue_sim, {"c": 1})
    async with client(queue_sim) as http:
        cancelled = await http.post(f"/cancel/{job_id}")
        assert cancelled.json() == {"id": job_id, "status": "CANCELLED"}
        again = await http.post(f"/cancel/{job_id}")  # idempotent: still CANCELLED
        assert again.json() == {"id": job_id, "status": "CANCELLED"}
        assert (await http.post(f"/retry/{job_id}")).status_code == 400  # not FAILED/TIMED_OUT
    assert (await status(queue_sim, job_id)).json()["status"] == "CANCELLED"
    # /run results are kept --run-retention (20 simulated s = 1 real s here), then 404.
    await wait_gone(queue_sim, job_id)
    job = (await queue_sim.ledger()).job(job_id)
    assert job.gone == "retention"
    assert [s.status for s in job.states] == ["IN_QUEUE", "CANCELLED", "DELETED:retention"]


async def test_ttl_is_a_hard_limit_from_submission(queue_sim: RunpodSim) -> None:
    job_id = await submit(queue_sim, {"t": 1}, policy={"ttl": 10_000, "executionTimeout": 5_000})
    assert (await status(queue_sim, job_id)).status_code == 200
    await wait_gone(queue_sim, job_id)  # 10 simulated s = 0.5 real s
    job = (await queue_sim.ledger()).job(job_id)
    assert job.gone == "ttl" and job.ttl_s == 10 and job.execution_timeout_s == 5
    assert job.states[-1].status == "DELETED:ttl"
    # Never early; late by at most the timer loop's lag (a loaded machine stretches it).
    assert 10 <= job.states[-1].at - job.submitted_at < 20
    async with client(queue_sim) as http:
        assert (await http.post(f"/cancel/{job_id}")).status_code == 404


async def test_purge_queue_and_health_counts(queue_sim: RunpodSim) -> None:
    async with client(queue_sim) as http:
        await http.post("/purge-queue")  # whatever earlier tests left queued
        ids = [await submit(queue_sim, {"p": n}) for n in range(2)]
        health = (await http.get("/health")).json()
        assert health["jobs"]["inQueue"] == 2 and health["jobs"]["inProgress"] == 0
        assert set(health["jobs"]) == {"completed", "failed", "inProgress", "inQueue", "retried"}
        assert health["workers"] == {
            "idle": 0, "initializing": 0, "ready": 0, "running": 0, "throttled": 0,
            "unhealthy": 0,
        }  # fmt: skip
        purged = await http.post("/purge-queue")
        assert purged.json() == {"removed": 2, "status": "completed"}
        assert (await http.get("/health")).json()["jobs"]["inQueue"] == 0
    for job_id in ids:
        assert (await status(queue_sim, job_id)).status_code == 404
    ledger = await queue_sim.ledger()
    assert {ledger.job(i).gone for i in ids} == {"purged"}


async def test_webhook_gets_the_status_body_once_the_job_ends(queue_sim: RunpodSim) -> None:
    received: list[Any] = []

    async def hook(request: web.Request) -> web.Response:
        received.append(await request.json())
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/hook", hook)
    async with served(app) as port:
        job_id = await submit(queue_sim, {"w": 1}, webhook=f"http://127.0.0.1:{port}/hook")
        async with client(queue_sim) as http:
            await http.post(f"/cancel/{job_id}")
        await eventually(lambda: asyncio.sleep(0, received), timeout_s=5, what="webhook")
    assert received == [{"id": job_id, "status": "CANCELLED"}]
    assert (await queue_sim.ledger()).job(job_id).webhook_answers == ["200"]


async def test_fault_bursts_answer_429_and_5xx_before_anything_else(queue_sim: RunpodSim) -> None:
    job_id = await submit(queue_sim, {"b": 1})
    await queue_sim.faults(burst_429=2, burst_429_routes=["status"])
    try:
        for _ in range(2):
            limited = await status(queue_sim, job_id)
            assert limited.status_code == 429 and limited.headers["Retry-After"] == "1"
        await submit(queue_sim, {"b": 2})  # another route: not in the burst
        assert (await status(queue_sim, job_id)).status_code == 200
        await queue_sim.faults(burst_5xx=1, burst_5xx_status=502, burst_5xx_routes=None)
        async with client(queue_sim) as http:
            assert (await http.get("/health")).status_code == 502
            assert (await http.get("/health")).status_code == 200
    finally:
        await queue_sim.reset_faults()


async def test_a_429_burst_armed_over_a_route_limited_5xx_burst_leaves_its_routes_alone(
    queue_sim: RunpodSim,
) -> None:
    # The soak arms a 5xx burst on a stock endpoint's routes but /run (a 5xx there is an
    # ambiguous submission by design), then maybe a 429 burst on every route before the first
    # is used up: the 5xx burst must still spare /run.
    await queue_sim.faults(burst_5xx=2, burst_5xx_status=502, burst_5xx_routes=["status"])
    await queue_sim.faults(burst_429=1, burst_429_routes=None)
    try:
        async with client(queue_sim) as http:
            assert (await http.get("/health")).status_code == 429
            assert (await http.get("/health")).status_code == 200
        job_id = await submit(queue_sim, {"b": 3})  # /run: not in the 5xx burst's routes
        assert (await status(queue_sim, job_id)).status_code == 502
    finally:
        await queue_sim.reset_faults()


async def test_dropped_run_answer_leaves_a_job_the_client_never_heard_of(
    queue_sim: RunpodSim,
) -> None:
    await queue_sim.faults(drop_run_answer=1)
    body = {"input": {"durable_comfy": {"submission": "sub-dropped-1"}}}
    async with client(queue_sim) as http:
        with pytest.raises(httpx.TransportError):
            await http.post("/run", json=body)
        assert (await http.post("/run", json=body)).status_code == 200  # one drop only
    jobs = (await queue_sim.ledger()).jobs_for("sub-dropped-1")
    # No idempotency key: the retried /run is a second job with the same token.
    assert len(jobs) == 2 and {j.status for j in jobs} == {"IN_QUEUE"}
    assert (await queue_sim.faults())["taken"]["drop_run_answer"] == 1


async def test_rate_limits_per_window_answer_429_with_retry_after(tmp_path: Path) -> None:
    async with run_runpod_sim(
        tmp_path, "--max-workers", "0", "--rate-limit-run", "2", "--rate-limit-status", "3",
        "--rate-limit-cancel", "1", "--rate-window", "10",
    ) as sim, client(sim) as http:  # fmt: skip
        job_id = await submit(sim, {"r": 1})
        assert (await http.post("/runsync?wait=1000", json={"input": {}})).status_code == 200
        refused = await http.post("/run", json={"input": {}})  # run and runsync share a bucket
        assert refused.status_code == 429
        assert 1 <= int(refused.headers["Retry-After"]) <= 10
        for _ in range(3):
            assert (await http.get(f"/status/{job_id}")).status_code == 200
        assert (await http.get(f"/stream/{job_id}")).status_code == 429  # status's bucket
        assert (await http.post(f"/cancel/{job_id}")).status_code == 200
        assert (await http.post(f"/cancel/{job_id}")).status_code == 429
        assert (await http.get("/health")).status_code == 200  # not limited
        assert (await sim.ledger()).jobs[0].status == "CANCELLED"


async def test_a_worker_dying_at_boot_is_relaunched_with_backoff(tmp_path: Path) -> None:
    broken = f"{sys.executable} -c 'raise SystemExit(2)'"
    async with run_runpod_sim(tmp_path, "--worker-command", broken) as sim:
        job_id = await submit(sim, {"never": "runs"})
        await wait_ledger(
            sim,
            "two failed boots",
            lambda led: len(led.workers) == 2 and led.workers[1].state == "stopped",
            timeout_s=10,
        )
        await asyncio.sleep(0.5)  # the third launch waits 2 s after the second failure
        ledger = await sim.ledger()
        assert len(ledger.workers) == 2
        for worker in ledger.workers:
            assert worker.stop_reason == "crash" and worker.exit_code == 2
            assert worker.ready_at is None and worker.jobs == []
        assert (await status(sim, job_id)).json()["status"] == "IN_QUEUE"


async def test_max_workers_bounds_the_launches(tmp_path: Path) -> None:
    # Workers that stay in their cold start: launched, billed, never spawned.
    async with run_runpod_sim(
        tmp_path, "--max-workers", "2", "--cold-start", "3600", "--worker-command", "false"
    ) as sim, client(sim) as http:  # fmt: skip
        for n in range(5):
            await submit(sim, {"n": n})
        health = (await http.get("/health")).json()
        assert health["workers"]["initializing"] == 2 and health["jobs"]["inQueue"] == 5
        ledger = await sim.ledger()
        assert [w.state for w in ledger.workers] == ["initializing"] * 2
        assert all(w.pid is None and w.billed_s > 0 for w in ledger.workers)


# -- the real runpod worker loop -------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module")
async def worker_sim(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunpodSim]:
    async with run_runpod_sim(
        tmp_path_factory.mktemp("worker_sim"),
        # Two active workers: a crashed or stopped one is replaced in the background, so the
        # next test does not wait for a boot.
        "--clock-speed", "10", "--min-workers", "2", "--max-workers", "3",
        "--ping-interval-ms", "1000", "--stop-grace", "2", "--take-poll", "1", "--stop-poll", "2",
        "--max-result-mb", "1", handler=handler_script("scripted"),
    ) as sim:  # fmt: skip
        yield sim


@needs_endpoint_venv
async def test_runsync_runs_the_job_on_a_worker(worker_sim: RunpodSim) -> None:
    async with client(worker_sim) as http:
        response = await http.post(
            "/runsync?wait=300000", json={"input": {"output": {"answer": 42}}}
        )
    body = response.json()
    assert body["status"] == "COMPLETED", body
    assert body["output"] == {"answer": 42}
    assert body["workerId"].startswith("sim-worker-")
    assert body["delayTime"] >= 0 and body["executionTime"] >= 0
    ledger = await worker_sim.ledger()
    job = ledger.job(body["id"])
    assert job.sync and [d.outcome for d in job.deliveries] == ["completed"]
    worker = ledger.worker(body["workerId"])
    assert worker.ready_at is not None and body["id"] in worker.jobs


@needs_endpoint_venv
async def test_progress_updates_show_as_output_and_pings_carry_the_job(
    worker_sim: RunpodSim,
) -> None:
    job_id = await submit(worker_sim, {"sleep_s": 2.0, "steps": 4})
    seen: list[Any] = []

    async def progress() -> dict[str, Any]:
        body: dict[str, Any] = (await status(worker_sim, job_id)).json()
        if body["status"] == "IN_PROGRESS" and "output" in body:
            seen.append(body["output"])
        return body

    await eventually(progress, timeout_s=15, what="step 2", accept=lambda b: bool(seen)
                     and seen[-1]["step"] >= 2)  # fmt: skip
    assert seen[-1]["total"] == 4
    ledger = await wait_ledger(
        worker_sim,
        "a ping with the running job",
        lambda led: any(w.last_ping_jobs == [job_id] for w in led.workers),
    )
    body = await wait_status(worker_sim, job_id, TERMINAL)
    assert body["status"] == "COMPLETED" and body["output"]["job_id"] == job_id
    steps = [s["step"] for s in seen]
    assert steps == sorted(steps)
    ledger = await worker_sim.ledger()
    assert ledger.job(job_id).deliveries[0].progress_updates == 4


@needs_endpoint_venv
async def test_failed_job_is_retried_under_the_same_id(worker_sim: RunpodSim) -> None:
    # The simulator is shared by the module's tests, which run in any order: /health's counts
    # are compared with their values before this test's job (the ledger below is exact).
    async with client(worker_sim) as http:
        before = (await http.get("/health")).json()["jobs"]
    job_id = await submit(worker_sim, {"error": "boom"})
    failed = await wait_status(worker_sim, job_id, TERMINAL)
    assert failed["status"] == "FAILED" and failed["error"] == "boom"
    async with client(worker_sim) as http:
        retried = await http.post(f"/retry/{job_id}")
        assert retried.json() == {"id": job_id, "status": "IN_QUEUE"}
        again = await wait_status(worker_sim, job_id, TERMINAL)
        assert again["status"] == "FAILED"
        jobs = (await http.get("/health")).json()["jobs"]
        # (at least: a job an earlier test left behind may end meanwhile)
        assert jobs["retried"] - before["retried"] >= 1
        assert jobs["failed"] - before["failed"] >= 2
    job = (await worker_sim.ledger()).job(job_id)
    assert [s.status for s in job.states] == [
        "IN_QUEUE", "IN_PROGRESS", "FAILED", "IN_QUEUE", "IN_PROGRESS", "FAILED",
    ]  # fmt: skip
    assert job.retries == 1 and len(job.deliveries) == 2


@needs_endpoint_venv
async def test_handler_exception_empty_output_and_output_errors(worker_sim: RunpodSim) -> None:
    raised = await submit(worker_sim, {"raise": "kaput"})
    empty = await submit(worker_sim, {"empty": True})
    partial = await submit(worker_sim, {"output": {"images": [], "errors": ["node 9 failed"]}})
    body = await wait_status(worker_sim, raised, TERMINAL)
    assert body["status"] == "FAILED"
    assert json.loads(body["error"])["error_message"] == "kaput"  # the SDK's error record
    body = await wait_status(worker_sim, empty, TERMINAL)
    # The SDK drops an empty dict: COMPLETED without output, as the worker sent it.
    assert body["status"] == "COMPLETED" and "output" not in body
    # Errors inside the output are the client's to judge: reported as sent, still COMPLETED.
    body = await wait_status(worker_sim, partial, TERMINAL)
    assert body["status"] == "COMPLETED"
    assert body["output"] == {"images": [], "errors": ["node 9 failed"]}


@needs_endpoint_venv
async def test_cancel_reaches_the_async_handler_through_job_stop(
    worker_sim: RunpodSim, tmp_path: Path
) -> None:
    job_id = await submit(worker_sim, {"sleep_s": 60, "marker_dir": str(tmp_path)})
    running = await wait_status(worker_sim, job_id, {"IN_PROGRESS"})
    async with client(worker_sim) as http:
        cancelled = await http.post(f"/cancel/{job_id}")
    assert cancelled.json() == {"id": job_id, "status": "CANCELLED"}
    marker = tmp_path / f"{job_id}.cancelled"
    await eventually(lambda: asyncio.sleep(0, marker.exists()), timeout_s=10, what="CancelledError")
    assert marker.read_text() == running["workerId"]
    assert (await status(worker_sim, job_id)).json()["status"] == "CANCELLED"
    # The worker is free again once it asks for work, and was not stopped.
    ledger = await wait_ledger(
        worker_sim, "worker idle", lambda led: led.worker(running["workerId"]).state == "idle"
    )
    assert ledger.job(job_id).deliveries[0].outcome == "cancelled"
    assert ledger.job(job_id).late_posts == 0  # a cancelled job posts no result


@needs_endpoint_venv
async def test_execution_timeout_fails_the_job_and_stops_the_worker(
    worker_sim: RunpodSim, tmp_path: Path
) -> None:
    job_id = await submit(
        worker_sim,
        {"sleep_s": 60, "marker_dir": str(tmp_path)},
        policy={"executionTimeout": 5000},  # 0.5 real s at clock speed 10
    )
    body = await wait_status(worker_sim, job_id, TERMINAL)
    assert body["status"] == "TIMED_OUT"
    assert 5000 <= body["executionTime"] < 10_000
    ledger = await wait_ledger(
        worker_sim, "worker stopped", lambda led: led.worker(body["workerId"]).state == "stopped"
    )
    worker = ledger.worker(body["workerId"])
    assert worker.stop_reason == "execution_timeout"
    assert ledger.job(job_id).deliveries[0].outcome == "execution_timeout"
    # job-stop went out before the SIGTERM: the handler saw CancelledError.
    assert (tmp_path / f"{job_id}.cancelled").exists()


@needs_endpoint_venv
async def test_refresh_worker_replaces_the_worker(worker_sim: RunpodSim) -> None:
    job_id = await submit(worker_sim, {"refresh": True, "output": {"r": 1}})
    body = await wait_status(worker_sim, job_id, TERMINAL)
    assert body["status"] == "COMPLETED" and body["output"] == {"r": 1}  # the SDK pops the flag
    ledger = await wait_ledger(
        worker_sim, "refreshed", lambda led: led.worker(body["workerId"]).state == "stopped"
    )
    assert ledger.worker(body["workerId"]).stop_reason == "refresh"


@needs_endpoint_venv
async def test_lost_result_fault_and_oversized_result_complete_without_output(
    worker_sim: RunpodSim,
) -> None:
    await worker_sim.faults(lost_result=1)
    lost = await submit(worker_sim, {"output": {"small": "result"}})
    body = await wait_status(worker_sim, lost, TERMINAL)
    assert body["status"] == "COMPLETED" and "output" not in body
    after = await wait_status(worker_sim, await submit(worker_sim, {}), TERMINAL)
    assert after["status"] == "COMPLETED" and "output" in after  # one result only
    # A result over the job-done limit (--max-result-mb 1 here, 20 by default) is refused the
    # same way: what users report for worker-comfyui's big base64 images.
    big = await submit(worker_sim, {"output": {"blob": "x" * (MiB + 1000)}})
    body = await wait_status(worker_sim, big, TERMINAL)
    assert body["status"] == "COMPLETED" and "output" not in body
    ledger = await worker_sim.ledger()
    assert [ledger.job(j).deliveries[0].outcome for j in (lost, big)] == ["result_lost"] * 2


@needs_endpoint_venv
async def test_crash_fault_on_the_second_job_then_retry(worker_sim: RunpodSim) -> None:
    await worker_sim.faults(crash={"on_delivery": 2, "after_progress": 1, "outcome": "timed_out"})
    spared = await submit(worker_sim, {"sleep_s": 0.3, "steps": 1})
    assert (await wait_status(worker_sim, spared, TERMINAL))["status"] == "COMPLETED"
    job_id = await submit(worker_sim, {"sleep_s": 1.5, "steps": 3})
    body = await wait_status(worker_sim, job_id, TERMINAL)
    assert body["status"] == "TIMED_OUT"
    ledger = await wait_ledger(
        worker_sim, "crashed", lambda led: led.worker(body["workerId"]).state == "stopped"
    )
    worker = ledger.worker(body["workerId"])
    assert worker.stop_reason == "crash" and worker.exit_code == -9
    assert ledger.job(job_id).deliveries[0].outcome == "worker_lost"
    # Its job ended when it died: no idle time is billed after it (the soak's idle check).
    after_last = worker.billed_after_last_job_s
    assert after_last is not None and after_last < 0.5, after_last
    async with client(worker_sim) as http:  # TIMED_OUT can be retried, under the same id
        assert (await http.post(f"/retry/{job_id}")).json()["status"] == "IN_QUEUE"
    assert (await wait_status(worker_sim, job_id, TERMINAL))["status"] == "COMPLETED"


@needs_endpoint_venv
async def test_crash_fault_redelivers_to_another_worker(worker_sim: RunpodSim) -> None:
    await worker_sim.faults(crash={"after_progress": 1, "outcome": "redeliver"})
    submission = {"submission": "sub-redelivered-1"}
    job_id = await submit(worker_sim, {"sleep_s": 1.5, "steps": 3, "durable_comfy": submission})
    body = await wait_status(worker_sim, job_id, TERMINAL, timeout_s=30)
    assert body["status"] == "COMPLETED"
    ledger = await worker_sim.ledger()
    [job] = ledger.jobs_for("sub-redelivered-1")
    first, second = job.deliveries
    assert first.outcome == "worker_lost" and second.outcome == "completed"
    assert first.worker_id != second.worker_id == body["workerId"]
    assert ledger.worker(first.worker_id).stop_reason == "crash"
    assert [s.status for s in job.states] == [
        "IN_QUEUE", "IN_PROGRESS", "IN_QUEUE", "IN_PROGRESS", "COMPLETED",
    ]  # fmt: skip


@needs_endpoint_venv
async def test_crash_fault_stuck_until_the_execution_timeout(worker_sim: RunpodSim) -> None:
    await worker_sim.faults(crash={"after_s": 0.5, "outcome": "stuck"})
    job_id = await submit(worker_sim, {"sleep_s": 60}, policy={"executionTimeout": 20_000})
    running = await wait_status(worker_sim, job_id, {"IN_PROGRESS"})
    ledger = await wait_ledger(
        worker_sim, "crashed", lambda led: led.worker(running["workerId"]).state == "stopped"
    )
    assert ledger.job(job_id).status == "IN_PROGRESS"  # on a dead worker
    body = await wait_status(worker_sim, job_id, TERMINAL)
    assert body["status"] == "TIMED_OUT" and body["executionTime"] >= 20_000


@needs_endpoint_venv
async def test_a_worker_that_dies_by_itself(worker_sim: RunpodSim) -> None:
    job_id = await submit(worker_sim, {"exit": 3, "sleep_s": 0.4})
    body = await wait_status(worker_sim, job_id, TERMINAL)
    assert body["status"] == "TIMED_OUT"  # --worker-death's default
    ledger = await wait_ledger(
        worker_sim, "dead", lambda led: led.worker(body["workerId"]).state == "stopped"
    )
    assert ledger.worker(body["workerId"]).stop_reason == "crash"
    assert ledger.worker(body["workerId"]).exit_code == 3


# -- streaming -------------------------------------------------------------------------------------


@needs_endpoint_venv
async def test_stream_chunks_and_the_1_mb_chunk_limit(tmp_path: Path) -> None:
    async with run_runpod_sim(
        tmp_path, "--clock-speed", "10", "--idle-timeout", "600", "--take-poll", "1",
        handler=handler_script("stream"),
    ) as sim:  # fmt: skip
        job_id = await submit(sim, {"chunks": 3, "gap_s": 0.1})
        chunks: list[Any] = []
        async with client(sim) as http:
            while True:
                answer = (await http.get(f"/stream/{job_id}")).json()
                chunks += [c["output"] for c in answer["stream"]]
                if answer["status"] in TERMINAL:
                    break
            assert chunks == [{"n": 0}, {"n": 1}, {"n": 2}]
            final = (await http.get(f"/status/{job_id}")).json()
            assert final["status"] == "COMPLETED" and final["output"] == chunks  # aggregated
            big = await submit(sim, {"big_bytes": MiB + 1, "chunks": 1, "gap_s": 0})
            await wait_status(sim, big, TERMINAL)
            streamed = (await http.get(f"/stream/{big}")).json()["stream"]
        assert [c["output"] for c in streamed] == [{"n": 0}]  # the >1 MB chunk was refused
        assert (await sim.ledger()).job(big).deliveries[0].stream_chunks == 1


# -- scaling down, cold starts, per-worker ComfyUI, the bill ---------------------------------------


@needs_endpoint_venv
async def test_idle_scale_down_cold_start_and_billing(tmp_path: Path) -> None:
    async with run_runpod_sim(
        tmp_path, "--clock-speed", "20", "--idle-timeout", "20", "--cold-start", "2",
        "--comfy-sim-per-worker", "--comfy-sim-args", "--step-delay-ms 5",
        "--worker-env", "SIM_SECRET_FOR_WORKERS", "--worker-env", "PLAIN=1",
        handler=handler_script("scripted"),
        env={"SIM_SECRET_FOR_WORKERS": "s3cret", "SIM_PRIVATE": "not for workers"},
    ) as sim:  # fmt: skip
        await sim.faults(slow_cold_start_s=3)
        assert (await sim.ledger()).workers == []
        async with client(sim) as http:
            names = ["COMFY_URL", "COMFY_HOST", "SIM_SECRET_FOR_WORKERS", "PLAIN", "SIM_PRIVATE"]
            job_id = await submit(sim, {"env": names})
            # Scale from zero: a worker is launched on submission, not at a later tick.
            assert (await http.get("/health")).json()["workers"]["initializing"] == 1
            body = await wait_status(sim, job_id, TERMINAL)
            assert body["status"] == "COMPLETED", body
            env = body["output"]["env"]
            comfy_url = env["COMFY_URL"]
            assert comfy_url.endswith(env["COMFY_HOST"])
            # A worker sees the platform's variables and what it is given, not the simulator's.
            assert env["SIM_SECRET_FOR_WORKERS"] == "s3cret" and env["PLAIN"] == "1"
            assert env["SIM_PRIVATE"] is None
            # The worker's own ComfyUI simulator is up while the worker lives...
            async with httpx.AsyncClient(trust_env=False) as comfy:
                assert (await comfy.get(f"{comfy_url}/system_stats")).status_code == 200
            ledger = await wait_ledger(
                sim,
                "idle stop",
                lambda led: led.worker(body["workerId"]).state == "stopped",
            )
            # ...and stopped with it.
            async with httpx.AsyncClient(trust_env=False) as comfy:
                with pytest.raises(httpx.TransportError):
                    await comfy.get(f"{comfy_url}/system_stats")
            health = (await http.get("/health")).json()
        assert health["workers"]["idle"] == health["workers"]["running"] == 0
        worker = ledger.worker(body["workerId"])
        job = ledger.job(body["id"])
        assert worker.stop_reason == "idle" and worker.exit_code == 0
        assert worker.started_at - job.submitted_at < 0.1
        assert worker.cold_start_s == 5  # --cold-start 2 + the slow cold start fault's 3
        assert worker.ready_at is not None and worker.ready_at - worker.started_at >= 5
        assert worker.env_keys == [
            "COMFY_HOST", "COMFY_INPUT_DIR", "COMFY_OUTPUT_DIR", "COMFY_PID", "COMFY_TEMP_DIR",
            "COMFY_URL", "PLAIN", "SIM_SECRET_FOR_WORKERS",
        ]  # fmt: skip
        # Billed from launch (cold start included) to the idle stop; never past the idle timeout.
        assert worker.stop_requested_at is not None
        assert worker.billed_s == pytest.approx(
            worker.stop_requested_at - worker.started_at, abs=0.01
        )
        assert worker.billed_after_last_job_s is not None
        assert 20 <= worker.billed_after_last_job_s < 26
        assert job.billed_s == pytest.approx(body["executionTime"] / 1000, abs=0.01)
        assert ledger.totals.workers_alive == 0 and ledger.totals.jobs_in_progress == 0
