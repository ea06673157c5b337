"""Our handler (endpoint/handler.py) under the real runpod worker loop, run by the RunPod
simulator with a ComfyUI simulator per worker: what only the SDK can show about a stop.

A prompt that ignores interrupts past the job's stop horizon: the handler records it in the
claim, kills its ComfyUI and ends its own process (SIGTERM, which the SDK turns into a graceful
shutdown), the simulator sees the worker exit, and the next job runs on a fresh worker instead
of queueing behind the old prompt and paying for it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from devstack.runpod_sim import Ledger
from endpoint.claims import ClaimStore
from endpoint.s3 import S3
from protocol.runpod.contract import S3Target, claim_key
from tests.support.comfy_sim import basic_graph
from tests.support.endpoint import Bucket, bucket_env, orchestrated_input, seaweedfs
from tests.support.runpod_sim import ENDPOINT_VENV_MISSING, RunpodSim, run_runpod_sim

pytestmark = pytest.mark.skipif(
    ENDPOINT_VENV_MISSING is not None, reason=str(ENDPOINT_VENV_MISSING)
)


@pytest_asyncio.fixture(loop_scope="session")
async def bucket(tmp_path: Path) -> AsyncIterator[Bucket]:
    async with seaweedfs(tmp_path / "s3") as running:
        yield running


def deaf_graph(seconds: float) -> dict[str, Any]:
    graph: dict[str, Any] = basic_graph(f"deaf/{uuid.uuid4().hex[:8]}")
    graph["2"] = {"class_type": "SimSleep", "inputs": {"seconds": seconds, "images": ["1", 0]}}
    return graph


async def eventually(probe: Any, accept: Any, what: str, within: float = 30.0) -> Any:
    deadline = time.monotonic() + within
    last = None
    while time.monotonic() < deadline:
        last = await probe()
        if accept(last):
            return last
        await asyncio.sleep(0.2)
    raise AssertionError(f"{what}: not within {within}s (last: {last!r})")


class Api:
    def __init__(self, sim: RunpodSim) -> None:
        self.sim = sim

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.sim.api_url, headers=self.sim.headers, timeout=30, trust_env=False
        )

    async def run(self, job_input: dict[str, Any]) -> str:
        async with self.http() as http:
            response = await http.post("/run", json={"input": job_input})
        response.raise_for_status()
        job_id: str = response.json()["id"]
        return job_id

    async def status(self, job_id: str) -> dict[str, Any]:
        async with self.http() as http:
            body: dict[str, Any] = (await http.get(f"/status/{job_id}")).json()
        return body

    async def cancel(self, job_id: str) -> None:
        async with self.http() as http:
            (await http.post(f"/cancel/{job_id}")).raise_for_status()


def log_of(ledger: Ledger, worker_id: str) -> str:
    path = Path(ledger.worker(worker_id).log)
    return path.read_text(errors="replace")[-6000:] if path.exists() else "(no log)"


async def test_a_prompt_past_the_stop_horizon_replaces_the_worker_and_the_next_job_gets_a_new_one(
    tmp_path: Path, bucket: Bucket
) -> None:
    env = bucket_env(bucket)
    async with run_runpod_sim(
        tmp_path / "runpod",
        *(f"--worker-env={name}" for name in env),
        "--comfy-sim-per-worker", "--comfy-sim-args=--step-delay-ms 10",
        "--max-workers=1", "--idle-timeout=30",
        handler="endpoint/handler.py",
        env=env,
    ) as sim:  # fmt: skip
        api = Api(sim)
        job_input = orchestrated_input(
            deaf_graph(60.0), bucket.name, lease_s=10.0, stop_horizon_s=2.0
        )
        block = job_input["durable_comfy"]
        first = await api.run(job_input)
        running = await eventually(
            lambda: api.status(first),
            lambda b: (
                b["status"] == "IN_PROGRESS" and (b.get("output") or {}).get("stage") == "running"
            ),
            "the first job running",
            within=60,
        )
        worker_id = running["workerId"]
        await asyncio.sleep(1.0)  # inside the 60 s sleep
        await api.cancel(first)

        ledger = await eventually(
            sim.ledger,
            lambda led: led.worker(worker_id).state == "stopped",
            "the worker gone",
            within=30,
        )
        worker = ledger.worker(worker_id)
        assert worker.stop_reason == "exited" and worker.exit_code == 0, log_of(ledger, worker_id)
        key = claim_key(
            S3Target.model_validate(block["output"]), block["job_id"], block["submission"]
        )
        stored = await ClaimStore(S3(bucket.settings), bucket.name).read(key)
        assert stored is not None and stored.claim.outcome is not None
        stop = stored.claim.outcome.stop
        assert stop is not None, log_of(ledger, worker_id)
        assert stop.prompt == "still_running" and stop.worker_replaced
        assert stop.worker_id == worker_id and stop.node == "2"
        assert "worker_replaced" in log_of(ledger, worker_id)

        # The next job: a fresh worker, not a place in line behind a prompt that ran on.
        second = await api.run(
            orchestrated_input(basic_graph(f"next/{uuid.uuid4().hex[:8]}"), bucket.name)
        )
        done = await eventually(
            lambda: api.status(second),
            lambda b: b["status"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT"),
            "the second job done",
            within=60,
        )
        assert done["status"] == "COMPLETED", done
        assert done["workerId"] != worker_id
        assert done["executionTime"] < 10_000
