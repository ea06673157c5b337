"""The fault primitives (faults/inject.py) against the simulators they arm: each fault is one the
simulator accepts and reads back as armed, untaken until something takes it, and disarmed by its
handle. Whether each fires is the chaos tests' and the soak's to see; a service that does not
come back is said so here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

import faults.inject as inject
from devstack.config import StackConfig
from devstack.free_ports import make_stack_config
from devstack.models import ServiceState
from devstack.services import ServiceName
from faults.inject import ComfyFaults, DidNotComeBack, RunpodFaults, ServiceFaults
from tests.support.comfy_sim import run_simulator
from tests.support.runpod_sim import RunpodSim, run_runpod_sim


@pytest.fixture(scope="module")
def comfy_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with run_simulator(tmp_path_factory.mktemp("comfy-faults")) as url:
        yield url


@pytest_asyncio.fixture
async def comfy(comfy_url: str, tmp_path: Path) -> AsyncIterator[ComfyFaults]:
    async with httpx.AsyncClient(trust_env=False) as http:
        yield ComfyFaults(comfy_url, http, tmp_path / "comfy_sim.log")
        await http.post(f"{comfy_url}/sim/reset")


async def test_each_comfy_fault_is_armed_untaken_and_disarmed_by_its_handle(
    comfy: ComfyFaults,
) -> None:
    for arm, field, value in (
        (comfy.cut_socket(after_events=7), "drop_ws_after_events", 7),
        (comfy.stall_socket(for_s=2.5, after_events=4), "stall_ws_s", 2.5),
        (comfy.out_of_memory(), "oom_next", True),
        (comfy.ignore_interrupts(for_s=3.0), "ignore_interrupt_s", 3.0),
    ):
        armed = await arm
        assert armed.field == field and (await comfy.armed())[field] == value
        assert not await armed.taken()
        assert armed.needle is None or not armed.fired()
        await armed.disarm()
        assert not (await comfy.armed())[field]
    assert (await comfy.armed())["stall_after_events"] == 4


async def test_a_comfy_fault_that_logs_nothing_cannot_be_seen_to_fire(comfy: ComfyFaults) -> None:
    oom = await comfy.out_of_memory()
    with pytest.raises(ValueError, match="logs nothing"):
        oom.fired()
    await oom.disarm()


@pytest_asyncio.fixture
async def sim(tmp_path: Path) -> AsyncIterator[RunpodSim]:
    async with run_runpod_sim(tmp_path, "--max-workers=0") as sim:
        yield sim


async def test_each_runpod_fault_is_armed_untaken_and_disarmed_by_its_handle(
    sim: RunpodSim,
) -> None:
    runpod = RunpodFaults(sim.base_url)
    crash = await runpod.crash("stuck", after_progress=8)
    freeze = await runpod.freeze(after_s=2.0, thaw_after_s=None)
    partition = await runpod.partition(after_s=1.5, heal_after_s=30.0)
    state = await runpod.state()
    assert state["crash"]["outcome"] == "stuck" and state["crash"]["on_delivery"] == 1
    assert state["crash"]["after_progress"] == 8 and state["crash"]["after_s"] is None
    assert state["freeze"]["after_s"] == 2.0 and state["freeze"]["thaw_after_s"] is None
    assert state["partition"]["heal_after_s"] == 30.0
    for armed in (crash, freeze, partition):
        assert armed.baseline == 0 and not await armed.taken()
        assert await armed.left() == 0, "a delivery fault is no count"
        await armed.disarm()
        assert (await runpod.state())[armed.name] is None

    burst = await runpod.burst_5xx(4, status=502, routes=["status", "cancel"])
    state = await runpod.state()
    assert (state["burst_5xx"], state["burst_5xx_status"]) == (4, 502)
    assert state["burst_5xx_routes"] == ["status", "cancel"]
    assert await burst.left() == 4
    await burst.disarm()
    assert await burst.left() == 0
    for count in (runpod.burst_429(3), runpod.drop_run_answer(), runpod.lost_result(2)):
        armed = await count
        assert await armed.left() >= 1 and not await armed.taken()
        await armed.disarm()
        assert await armed.left() == 0


async def test_a_burst_is_taken_by_requests_and_over_when_answered(sim: RunpodSim) -> None:
    runpod = RunpodFaults(sim.base_url)
    burst = await runpod.burst_429(2, routes=["health"])
    async with httpx.AsyncClient(trust_env=False, headers=sim.headers) as http:
        answers = [(await http.get(f"{sim.api_url}/health")).status_code for _ in range(3)]
    assert answers[:2] == [429, 429] and answers[2] != 429
    assert await burst.taken() and await burst.left() == 0
    await runpod.reset()
    assert (await runpod.state())["burst_429"] == 0


async def test_a_service_that_does_not_start_again_did_not_come_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tried: list[ServiceName] = []

    async def refused(config: StackConfig, base_dir: Path, name: ServiceName) -> ServiceState:
        tried.append(name)
        raise OSError("address already in use")

    monkeypatch.setattr(inject, "start_service", refused)
    monkeypatch.setattr(inject, "RETRY_AFTER_S", 0.0)
    services = ServiceFaults(make_stack_config(tmp_path / "state"), tmp_path)
    with pytest.raises(DidNotComeBack, match="temporal did not come back: address already"):
        await services.start("temporal", attempts=3)
    assert tried == ["temporal"] * 3
