"""The soak's RunPod worker faults (faults/soak/injector.py, armed through faults/inject.py: a
handler frozen, a worker cut off from S3) against a scripted endpoint: what is armed, and each
fault's window read back from the ledger's worker events. No stack, no server.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest_asyncio

from devstack.runpod_sim import Ledger
from faults.inject import RunpodFaults
from faults.soak.endpoints import CLAIMS_FAULTS, STOCK_FAULTS
from faults.soak.evidence import FaultRecord
from faults.soak.injector import FaultInjector, FaultKind
from faults.soak.stack import SoakStack

STARTED_AT = 1_000_000.0
SPEED = 1.0


def worker(worker_id: str, *events: tuple[str, float], **fields: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "id": worker_id,
        "pid": 4242,
        "state": "running",
        "started_at": 0.0,
        "cold_start_s": 0.0,
        "ready_at": 1.0,
        "stop_requested_at": None,
        "exited_at": None,
        "stop_reason": None,
        "exit_code": None,
        "billed_s": 1.0,
        "jobs": ["r1"],
        "last_job_end_at": None,
        "billed_after_last_job_s": None,
        "pings": 0,
        "last_ping_at": None,
        "last_ping_jobs": [],
        "fitness_failures": [],
        "env_keys": [],
        "log": f"/tmp/{worker_id}/worker.log",
        "events": [{"kind": kind, "at": at, "job_id": "r1"} for kind, at in events],
    }
    return values | fields


def ledger(*workers: dict[str, Any]) -> Ledger:
    return Ledger.model_validate(
        {
            "simulator": "sim",
            "clock_speed": SPEED,
            "now": 100.0,
            "started_at_unix": STARTED_AT,
            "idle_timeout_s": 5.0,
            "max_workers": 2,
            "min_workers": 0,
            "jobs": [],
            "workers": list(workers),
            "totals": {
                "worker_billed_s": 0,
                "job_billed_s": 0,
                "workers_alive": 0,
                "workers_stopping": 0,
                "jobs_in_progress": 0,
            },
        }
    )


class ScriptedFaults(RunpodFaults):
    """The simulator's fault routes, answered from the endpoint's fields."""

    def __init__(self, endpoint: ScriptedEndpoint) -> None:
        super().__init__("http://scripted.invalid")
        self.endpoint = endpoint

    async def _get(self, path: str) -> dict[str, Any]:
        assert path == "/sim/faults", path
        return self.endpoint.state

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        assert path == "/sim/faults", path
        self.endpoint.armed.append(body)
        return self.endpoint.state


class ScriptedEndpoint:
    """What the injector asks of a RunPod simulator, answered from fields the test sets."""

    def __init__(self, pool: str = "runpod", faults: frozenset[str] = CLAIMS_FAULTS) -> None:
        self.spec = type("Spec", (), {"pool": pool, "faults": faults})()
        self.now = ledger(worker("w0", ("freeze", 2.0), ("thaw", 3.0)))
        self.state: dict[str, Any] = {"taken": {}}
        self.armed: list[dict[str, Any]] = []
        self.faults = ScriptedFaults(self)

    async def ledger(self) -> Ledger:
        return self.now


class Injector(FaultInjector):
    def __init__(self, *endpoints: ScriptedEndpoint) -> None:
        stack = type("Stack", (), {"endpoints": {e.spec.pool: e for e in endpoints}})()
        super().__init__(cast(SoakStack, stack), random.Random(7), every_s=10)

    async def inject(self, kind: FaultKind) -> FaultRecord | None:
        record = FaultRecord(index=1, kind=kind, target="", started_at=STARTED_AT)
        return record if await self._apply(kind, record) else None

    async def check(self) -> bool:
        return await self._pending[-1].check()


@pytest_asyncio.fixture
async def endpoint() -> AsyncIterator[ScriptedEndpoint]:
    yield ScriptedEndpoint()


async def test_a_thawed_freeze_is_in_effect_from_its_freeze_event_to_its_thaw(
    endpoint: ScriptedEndpoint,
) -> None:
    injector = Injector(endpoint)
    try:
        record = await injector.inject("runpod_freeze_thaw")
        assert record is not None and record.target == "runpod"
        [armed] = endpoint.armed
        freeze = armed["freeze"]
        assert freeze["on_delivery"] == 1 and 1.0 <= freeze["after_s"] <= 8.0
        assert 3.0 <= freeze["thaw_after_s"] <= 90.0
        assert not await injector.check(), "not taken yet"
        endpoint.state = {"taken": {"freeze": 1}}
        assert not await injector.check(), "taken, not fired yet (the earlier freeze is old)"
        assert record.fired is None
        endpoint.now = ledger(
            worker("w0", ("freeze", 2.0), ("thaw", 3.0)), worker("w1", ("freeze", 10.0))
        )
        assert not await injector.check(), "frozen, not thawed yet"
        assert record.fired and record.fired_at == STARTED_AT + 10.0 and record.ended_at is None
        assert "w1, RunPod job r1" in record.detail
        endpoint.now = ledger(
            worker("w0", ("freeze", 2.0), ("thaw", 3.0)),
            worker("w1", ("freeze", 10.0), ("thaw", 40.0)),
        )
        assert await injector.check()
        assert record.ended_at == STARTED_AT + 40.0
    finally:
        await injector.close()


async def test_a_freeze_without_thaw_ends_with_its_worker(endpoint: ScriptedEndpoint) -> None:
    injector = Injector(endpoint)
    try:
        record = await injector.inject("runpod_freeze")
        assert record is not None and endpoint.armed[0]["freeze"]["thaw_after_s"] is None
        assert "until its worker ends" in record.detail
        endpoint.state = {"taken": {"freeze": 1}}
        endpoint.now = ledger(
            worker("w0", ("freeze", 2.0), ("thaw", 3.0)),
            worker(
                "w1",
                ("freeze", 10.0),
                state="stopped",
                exited_at=25.0,
                stop_reason="watchdog",
            ),
        )
        assert await injector.check()
        assert record.fired_at == STARTED_AT + 10.0 and record.ended_at == STARTED_AT + 25.0
        assert "ended with its worker (watchdog)" in record.detail
    finally:
        await injector.close()


async def test_a_partition_is_in_effect_until_its_heal(endpoint: ScriptedEndpoint) -> None:
    endpoint.now = ledger(worker("w0"))
    injector = Injector(endpoint)
    try:
        record = await injector.inject("runpod_partition")
        assert record is not None
        partition = endpoint.armed[0]["partition"]
        assert 3.0 <= partition["heal_after_s"] <= 90.0 and "thaw_after_s" not in partition
        endpoint.state = {"taken": {"partition": 1}}
        endpoint.now = ledger(worker("w0", ("partition", 5.0), ("heal", 50.0)))
        assert await injector.check()
        assert (record.fired_at, record.ended_at) == (STARTED_AT + 5.0, STARTED_AT + 50.0)
    finally:
        await injector.close()


async def test_one_delivery_fault_armed_at_a_time_per_endpoint(
    endpoint: ScriptedEndpoint,
) -> None:
    """A second freeze armed over a pending one would replace it in the simulator's slot; a
    partition or a crash armed beside an untaken freeze would land on the same delivery. Only
    our handler's endpoint gets them: the stock handler has no watchdog."""
    injector = Injector(endpoint, ScriptedEndpoint("stock", STOCK_FAULTS))
    try:
        assert await injector.inject("runpod_freeze") is not None
        for other in ("runpod_freeze_thaw", "runpod_partition", "runpod_crash_stuck"):
            assert await injector.inject(other) is None, other
        endpoint.state = {"taken": {"freeze": 1}}  # taken by a delivery: the next one is free
        assert await injector.inject("runpod_freeze_thaw") is None, "its own slot: not over"
        assert await injector.inject("runpod_partition") is not None
        assert await injector.inject("runpod_crash_stuck") is None, "the partition is untaken"
        assert [next(iter(body)) for body in endpoint.armed] == ["freeze", "partition"]
    finally:
        await injector.close()


async def test_a_kind_with_no_target_now_is_drawn_first_next_time(
    endpoint: ScriptedEndpoint,
) -> None:
    injector = Injector(endpoint)
    tried: list[str] = []

    async def apply(kind: FaultKind, record: FaultRecord) -> bool:
        tried.append(kind)
        return kind != "runpod_partition"  # armed there already, say

    injector._apply = apply  # type: ignore[method-assign]
    injector._deck = ["runpod_429", "runpod_5xx", "runpod_partition"]
    try:
        await injector.inject_one()
        assert tried == ["runpod_partition", "runpod_5xx"]
        assert injector._deck == ["runpod_429", "runpod_partition"]
        await injector.inject_one()
        assert tried[2:] == ["runpod_partition", "runpod_429"]
    finally:
        await injector.close()
