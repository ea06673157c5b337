"""The RunPod serverless simulator (devstack/runpod_sim) against PROTOCOLS.md: the public API, the
real runpod 1.12.0 worker loop running tests/runpod_handlers/, scaling, every fault, the ledger.

Each simulator is a subprocess on its own free port (tests/support/runpod_sim.py), stopped by PID
at the end of its module fixture with a check that no worker process outlived it. Platform timers
run on a fast simulator clock; the real cost is the workers' boot (~2 s each: the SDK imports
py-cpuinfo, which probes the CPU at import time).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from aiohttp import web

from devstack.runpod_sim import Ledger, SimSettings
from devstack.runpod_sim.ledger import LedgerWorker
from devstack.runpod_sim.s3_proxy import TcpProxy
from faults.wait import eventually
from tests.support.aiohttp_servers import served
from tests.support.cli import example
from tests.support.runpod_sim import (
    ENDPOINT_VENV_MISSING,
    RunpodSim,
    completed_executions,
    handler_command,
    handler_script,
    prompt_executions,
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


# -- a worker's watchdog, freeze and partition -----------------------------------------------------

STANDIN = "tests/runpod_handlers/watchdog_standin.py"


def test_the_watchdog_is_on_for_our_handler_and_off_for_any_other(tmp_path: Path) -> None:
    ours = (".venv-endpoint/bin/python", "endpoint/handler.py")
    stock = (".venv-stock/bin/python", "tests/runpod_handlers/worker_comfyui.py")
    image = tmp_path / "image"
    (image / "endpoint").mkdir(parents=True)

    def argv(**settings: Any) -> tuple[str, ...] | None:
        return SimSettings(worker_cwd=image, **settings).watchdog_argv()

    # Before endpoint/watchdog.py exists, auto gives none; `on` insists.
    assert argv(worker_command=ours) is None
    assert argv(worker_command=ours, watchdog="on") == (ours[0], "endpoint/watchdog.py")
    (image / "endpoint" / "watchdog.py").write_text("")
    assert argv(worker_command=ours) == (ours[0], "endpoint/watchdog.py")
    assert argv(worker_command=ours, watchdog="off") is None
    assert argv(worker_command=stock) is None  # the stock handler has none
    other = ("python", "w.py")
    assert argv(worker_command=stock, watchdog="on", watchdog_command=other) == other


async def test_the_s3_proxy_cuts_open_connections_and_resets_new_ones_until_reopened() -> None:
    release = asyncio.Event()

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def slow(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"first")
        await release.wait()
        await response.write(b"second")
        return response

    app = web.Application()
    app.router.add_get("/", ok)
    app.router.add_get("/slow", slow)
    async with served(app) as port:
        proxy = TcpProxy("127.0.0.1", port, name="test")
        url = f"http://127.0.0.1:{await proxy.start()}"
        try:
            async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
                assert (await http.get(f"{url}/")).text == "ok"
            async with (
                httpx.AsyncClient(trust_env=False, timeout=5) as http,
                http.stream("GET", f"{url}/slow") as streaming,
            ):
                chunks = streaming.aiter_raw()
                assert await anext(chunks) == b"first"
                proxy.shut()  # a connection that is open: cut
                release.set()
                with pytest.raises(httpx.TransportError):
                    async for _ in chunks:
                        pass
            async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
                with pytest.raises(httpx.TransportError):  # a new one: reset
                    await http.get(f"{url}/")
            proxy.reopen()
            async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
                assert (await http.get(f"{url}/")).text == "ok"
            assert proxy.counters.cut == 1 and proxy.counters.refused >= 1
        finally:
            await proxy.close()


@dataclass
class FakeBucket:
    """An HTTP server standing for S3: every request it got, (epoch seconds, path)."""

    url: str = ""
    hits: list[tuple[float, str]] = field(default_factory=list)


@pytest_asyncio.fixture(scope="module")
async def fake_bucket() -> AsyncIterator[FakeBucket]:
    bucket = FakeBucket()

    async def anything(request: web.Request) -> web.Response:
        bucket.hits.append((time.time(), request.path))
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    async with served(app) as port:
        bucket.url = f"http://127.0.0.1:{port}"
        yield bucket


def probe_sim_args(bucket: FakeBucket, *more: str, watchdog: bool = True) -> list[str]:
    """Workers running tests/runpod_handlers/worker_probe.py beside a ComfyUI simulator each,
    the watchdog stand-in, and the fake bucket as theirs (through their S3 proxies)."""
    standin = ["--watchdog", "on", "--watchdog-command", handler_command(STANDIN)]
    return [
        "--comfy-sim-per-worker", "--comfy-sim-args", "--step-delay-ms 20",
        *(standin if watchdog else ["--watchdog", "off"]),
        "--worker-env", f"BUCKET_ENDPOINT_URL={bucket.url}",
        "--stop-grace", "2", "--take-poll", "1", *more,
    ]  # fmt: skip


@pytest_asyncio.fixture(scope="module")
async def probe_sim(
    tmp_path_factory: pytest.TempPathFactory, fake_bucket: FakeBucket
) -> AsyncIterator[RunpodSim]:
    async with run_runpod_sim(
        tmp_path_factory.mktemp("probe_sim"),
        *probe_sim_args(fake_bucket, "--max-workers", "2", "--idle-timeout", "4"),
        handler=handler_script("worker_probe"),
    ) as sim:
        yield sim


def standin_report(worker: LedgerWorker) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(
        (Path(worker.log).parent / "watchdog-standin.json").read_text()
    )
    return report


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of a live process; None once it is gone (or a zombie)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return None if fields[0] == "Z" else (fields[0], int(fields[2]))


def group_states(pgid: int) -> dict[int, str]:
    """The state of every live process in the group (T: stopped)."""
    states = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := proc_stat(int(entry.name))) and stat[1] == pgid:
            states[int(entry.name)] = stat[0]
    return states


def is_file(path: str) -> bool:
    return Path(path).is_file()


def gone(pid: int | None) -> bool:
    return pid is not None and proc_stat(pid) is None


def prompt_input(prompt_id: str, steps: int, **more: Any) -> dict[str, Any]:
    return {"prompt": {"graph": example(steps=steps), "prompt_id": prompt_id}, **more}


@needs_endpoint_venv
async def test_the_watchdog_runs_beside_the_handler_in_its_own_session_and_goes_with_it(
    probe_sim: RunpodSim, fake_bucket: FakeBucket
) -> None:
    names = ["COMFY_URL", "COMFY_PID", "DURABLE_COMFY_FENCE_FILE", "BUCKET_ENDPOINT_URL"]
    body = await wait_status(probe_sim, await submit(probe_sim, {"env": names}), TERMINAL, 30)
    assert body["status"] == "COMPLETED", body
    env = body["output"]["env"]
    worker = (await probe_sim.ledger()).worker(body["workerId"])
    folder = Path(worker.log).parent
    report = await eventually(
        lambda: asyncio.sleep(0, standin_report(worker)), timeout_s=10, what="the report"
    )
    assert worker.watchdog == "running" and worker.watchdog_pid == report["pid"]
    # A session and a group of its own, not the handler's: a freeze of the handler's group
    # does not reach it.
    assert report["sid"] == report["pgid"] == report["pid"]
    assert report["handler_pid"] == report["handler_pgid"] == worker.pid == body["output"]["pid"]
    assert report["argv"] == ["--pid", str(worker.pid)]
    # The handler's environment, with a fence file of the worker's own given to both.
    fence = str(folder / "fence")
    assert report["env"]["DURABLE_COMFY_FENCE_FILE"] == env["DURABLE_COMFY_FENCE_FILE"] == fence
    assert worker.fence_file == fence
    assert report["env"]["COMFY_URL"] == env["COMFY_URL"] == worker.comfy_url
    assert report["env"]["COMFY_PID"] == env["COMFY_PID"] == str(worker.comfy_pid)
    assert report["env"]["BUCKET_ENDPOINT_URL"] == env["BUCKET_ENDPOINT_URL"] == worker.s3_url
    assert worker.s3_proxied and worker.s3_url != fake_bucket.url  # through its S3 proxy
    assert worker.watchdog_log == str(folder / "watchdog.log")
    assert all(map(is_file, (worker.watchdog_log, worker.log)))
    # The worker goes (its idle timeout): its watchdog goes with it.
    ledger = await wait_ledger(
        probe_sim, "idle stop", lambda led: led.worker(worker.id).state == "stopped", 30
    )
    assert ledger.worker(worker.id).stop_reason == "idle"
    assert ledger.worker(worker.id).watchdog == "stopped"
    await eventually(
        lambda: asyncio.sleep(0, gone(worker.watchdog_pid)), timeout_s=10, what="watchdog gone"
    )


@needs_endpoint_venv
async def test_freeze_stops_the_handlers_group_not_its_comfyui_nor_its_watchdog_and_thaws(
    probe_sim: RunpodSim,
) -> None:
    prompt_id = f"freeze-{uuid.uuid4().hex[:8]}"
    # Frozen once the prompt is on ComfyUI (its progress update), for 6 s.
    await probe_sim.faults(freeze={"after_progress": 1, "thaw_after_s": 6})
    job_id = await submit(probe_sim, prompt_input(prompt_id, steps=40))
    ledger = await wait_ledger(
        probe_sim,
        "frozen",
        lambda led: any(e.job_id == job_id for w in led.workers for e in w.events_of("freeze")),
        timeout_s=30,
    )
    worker = next(w for w in ledger.workers if job_id in w.jobs)
    assert worker.frozen and worker.pid is not None and worker.watchdog_pid is not None
    # The handler and everything in its group stop; its ComfyUI and its watchdog do not.
    states = await eventually(
        lambda: asyncio.sleep(0, group_states(worker.pid or 0)),
        timeout_s=5,
        what="the handler's group stopped",
        accept=lambda found: bool(found) and set(found.values()) == {"T"},
    )
    assert worker.pid in states
    assert worker.comfy_pid is not None and worker.comfy_pid not in states
    for other in (worker.comfy_pid, worker.watchdog_pid):
        stat = proc_stat(other)
        assert stat is not None and stat[0] != "T" and stat[1] == other, stat
    ticks = standin_report(worker)["ticks"]
    # ComfyUI runs the prompt to its end while the handler is frozen.
    await eventually(
        lambda: completed_executions(probe_sim, prompt_id),
        timeout_s=5,
        what="the prompt done on ComfyUI",
        accept=lambda n: n == 1,
    )
    assert standin_report(worker)["ticks"] > ticks  # the watchdog lives on
    # The platform keeps the job running and the worker billed, as for a hung container.
    still = await probe_sim.ledger()
    assert still.job(job_id).status == "IN_PROGRESS"
    assert still.worker(worker.id).billed_s > worker.billed_s
    assert (await status(probe_sim, job_id)).json()["status"] == "IN_PROGRESS"
    # Thawed after its 6 s: the handler goes on and the job completes, the prompt run once.
    body = await wait_status(probe_sim, job_id, TERMINAL, timeout_s=30)
    assert body["status"] == "COMPLETED" and body["output"]["prompt"]["status_str"] == "success"
    ledger = await probe_sim.ledger()
    done = ledger.worker(worker.id)
    [freeze], [thaw] = done.events_of("freeze"), done.events_of("thaw")
    assert freeze.job_id == thaw.job_id == job_id
    assert 6 <= thaw.at - freeze.at < 7.5
    assert not done.frozen and "T" not in group_states(worker.pid).values()
    assert await completed_executions(probe_sim, prompt_id) == 1


@needs_endpoint_venv
async def test_a_frozen_handler_killed_by_its_watchdog_ends_the_worker_and_its_billing(
    probe_sim: RunpodSim,
) -> None:
    prompt_id = f"killed-{uuid.uuid4().hex[:8]}"
    await probe_sim.faults(freeze={"after_progress": 1})  # no thaw: frozen until it ends
    job_id = await submit(probe_sim, prompt_input(prompt_id, steps=20, sleep_s=60))
    ledger = await wait_ledger(
        probe_sim,
        "frozen",
        lambda led: any(e.job_id == job_id for w in led.workers for e in w.events_of("freeze")),
        timeout_s=30,
    )
    worker = next(w for w in ledger.workers if job_id in w.jobs)
    await eventually(
        lambda: completed_executions(probe_sim, prompt_id),
        timeout_s=10,
        what="the prompt done on ComfyUI",
        accept=lambda n: n == 1,
    )
    await asyncio.sleep(1.0)
    frozen = await probe_sim.ledger()
    assert frozen.worker(worker.id).frozen and frozen.job(job_id).status == "IN_PROGRESS"
    # The watchdog (here the stand-in, told so) kills the frozen handler.
    (Path(worker.log).parent / "watchdog-kill").touch()
    ledger = await wait_ledger(
        probe_sim, "worker gone", lambda led: led.worker(worker.id).state == "stopped", 15
    )
    dead = ledger.worker(worker.id)
    assert dead.stop_reason == "watchdog" and dead.exit_code == -9
    assert ledger.job(job_id).status == "TIMED_OUT"  # --worker-death's default
    assert ledger.job(job_id).deliveries[-1].outcome == "worker_lost"
    # Billing ended with the container, and its job's seconds are no idle time.
    assert dead.stop_requested_at is None and dead.exited_at is not None
    assert dead.billed_s == pytest.approx(dead.exited_at - dead.started_at, abs=0.01)
    assert dead.billed_after_last_job_s is not None and dead.billed_after_last_job_s < 0.5
    await asyncio.sleep(0.5)
    assert (await probe_sim.ledger()).worker(worker.id).billed_s == dead.billed_s
    assert not dead.frozen and [e.job_id for e in dead.events_of("thaw")].count(job_id) == 0
    # Nothing of it is left: its watchdog stopped with it, its ComfyUI too (its counters kept).
    await wait_ledger(
        probe_sim, "watchdog stopped", lambda led: led.worker(worker.id).watchdog == "stopped"
    )
    for pid in (worker.watchdog_pid, worker.comfy_pid, worker.pid):
        await eventually(lambda: asyncio.sleep(0, gone(pid)), timeout_s=10, what=f"{pid} gone")  # noqa: B023
    [seen] = await prompt_executions(probe_sim, prompt_id)
    assert seen.worker_id == worker.id and seen.complete == 1


@needs_endpoint_venv
async def test_completed_executions_add_up_across_workers_alive_or_gone(
    probe_sim: RunpodSim,
) -> None:
    prompt_id = f"twice-{uuid.uuid4().hex[:8]}"
    # The same prompt id on two workers at once (max 2): each ComfyUI runs it once.
    jobs = [await submit(probe_sim, prompt_input(prompt_id, steps=5, sleep_s=1)) for _ in "ab"]
    bodies = [await wait_status(probe_sim, j, TERMINAL, timeout_s=30) for j in jobs]
    assert [b["status"] for b in bodies] == ["COMPLETED"] * 2
    workers = {b["workerId"] for b in bodies}
    assert len(workers) == 2
    assert await completed_executions(probe_sim, prompt_id) == 2
    await wait_ledger(
        probe_sim,
        "both idle-stopped",
        lambda led: all(led.worker(w).state == "stopped" for w in workers),
        timeout_s=30,
    )
    # Gone, their ComfyUIs with them: the counters they left say the same.
    found = await prompt_executions(probe_sim, prompt_id)
    assert {run.worker_id for run in found} == workers
    assert await completed_executions(probe_sim, prompt_id) == 2


@needs_endpoint_venv
async def test_partition_cuts_one_worker_off_s3_while_another_keeps_it_and_heal_restores_it(
    tmp_path: Path, fake_bucket: FakeBucket
) -> None:
    async with run_runpod_sim(
        tmp_path,
        *probe_sim_args(fake_bucket, "--min-workers", "2", "--max-workers", "2", watchdog=False),
        handler=handler_script("worker_probe"),
    ) as sim:  # fmt: skip
        ledger = await wait_ledger(
            sim,
            "two workers ready",
            lambda led: [w.state for w in led.workers] == ["idle", "idle"],
            timeout_s=30,
        )
        cut, spared = (w.id for w in ledger.workers)
        # Per worker: its first delivery, after 5 probes; reopened 2.5 s later.
        await sim.faults(partition={"worker_id": cut, "after_progress": 5, "heal_after_s": 2.5})
        probe = {"s3_probe": {"seconds": 6, "every_s": 0.1}}
        jobs = [await submit(sim, probe) for _ in "ab"]
        bodies = {
            body["workerId"]: body
            for body in [await wait_status(sim, j, TERMINAL, timeout_s=30) for j in jobs]
        }
        assert set(bodies) == {cut, spared}
        ledger = await sim.ledger()
    worker = ledger.worker(cut)
    [partition], [heal] = worker.events_of("partition"), worker.events_of("heal")
    assert partition.job_id == heal.job_id == bodies[cut]["id"]
    assert 2.5 <= heal.at - partition.at < 3.5
    assert not ledger.worker(spared).events and not worker.partitioned
    start, end = ledger.epoch(partition.at), ledger.epoch(heal.at)
    probes = bodies[cut]["output"]["probes"]
    margin = 0.3  # the two clocks, and a probe in flight when the cut came
    before = [p["ok"] for p in probes if p["at"] < start - margin]
    during = [p["ok"] for p in probes if start + margin < p["at"] < end - margin]
    after = [p["ok"] for p in probes if p["at"] > end + margin]
    assert before and all(before), probes
    assert during and not any(during), probes
    assert after and all(after), probes
    assert all(p["ok"] for p in bodies[spared]["output"]["probes"])
    # The bucket heard from the other worker while this one was cut off, not from this one.
    window = [path for at, path in fake_bucket.hits if start + margin < at < end - margin]
    assert any(path.endswith(spared) for path in window)
    assert not any(path.endswith(cut) for path in window)


def test_a_delivery_fault_may_wait_for_a_number_of_stored_outputs() -> None:
    """`after_artifacts`: fired once a progress update of the delivery lists that many stored
    outputs (a worker lost between its uploads, or after them), not before."""
    from devstack.runpod_sim.faults import CrashFault, _plan
    from devstack.runpod_sim.platform import _artifacts_in

    plan = _plan("crash", CrashFault(after_artifacts=2), now=0.0)
    assert plan.at is None, "no time of its own"
    assert not plan.due(1000.0, progress_updates=50, artifacts=1)
    assert plan.due(1000.0, progress_updates=50, artifacts=2)
    update = {"artifacts": [{"filename": "a.png"}], "artifacts_omitted": 2}
    assert _artifacts_in(update) == 3 and _artifacts_in({"step": 4}) == 0


def test_a_delivery_fault_may_count_only_the_updates_of_one_stage() -> None:
    """`in_stage`: only updates at that stage count, so a crash can wait for the handler's
    "uploading" (its claim holds the prompt's end) however early the outputs were stored."""
    from devstack.runpod_sim.faults import CrashFault, _plan
    from devstack.runpod_sim.jobs import Delivery

    plan = _plan("crash", CrashFault(after_artifacts=2, in_stage="uploading"), now=0.0)
    delivery = Delivery(worker_id="w", taken_at=0.0)
    delivery.progress_updates, delivery.artifacts_reported = 9, 2
    delivery.updates_in_stage = {"running": 8, "uploading": 1}
    delivery.artifacts_in_stage = {"running": 2, "uploading": 1}
    assert not plan.due(1000.0, *delivery.heard(plan.in_stage))
    delivery.artifacts_in_stage["uploading"] = 2
    assert plan.due(1000.0, *delivery.heard(plan.in_stage))
    anywhere = _plan("crash", CrashFault(after_artifacts=2), now=0.0)
    assert delivery.heard(anywhere.in_stage) == (9, 2)
