"""A comfyui pool of many servers on the worker's side: its settings (`urls`, `server_slots`,
the bound they give), the key that says which graphs share loaded models, the clients a job's
server name may reach, and the health watch that tells the pool's queue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
import pytest_asyncio
from aiohttp import web
from pydantic import ValidationError
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.comfyui import server_health
from activities.comfyui.graph import warm_key
from activities.comfyui.pools import ComfyPools, find_prompt
from activities.comfyui.server_health import ServerHealthActivities
from activities.runpod.endpoint_health import read_health
from activities.runpod.models import RunPodHealth
from configuration.pools import PoolConfig
from configuration.settings import WorkerSettings
from devstack.free_ports import free_port
from starter.doctor import Outcome, Problem
from worker import comfyui_servers_health
from workflows.admission import ServerWatch

A, B = "http://127.0.0.1:8001", "http://127.0.0.1:8002"


def test_urls_make_a_pool_bounded_by_its_servers_slots() -> None:
    farm = PoolConfig(urls=[A, B + "/"])
    assert farm.servers == [A, B] and farm.assigns_servers
    assert farm.running_bound == 2
    assert PoolConfig(urls=[A, B], server_slots=3).running_bound == 6
    assert PoolConfig(urls=[A, B], max_running=1).running_bound == 1
    # One server stays as it was: unbounded, unless asked.
    single = PoolConfig(url=A)
    assert single.servers == [A] and not single.assigns_servers and single.running_bound is None
    assert PoolConfig(url=A, server_slots=2).running_bound == 2
    assert PoolConfig(url=A, max_running=4).running_bound == 4


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"url": A, "urls": [B]}, "url and urls"),
        ({"urls": []}, "at least 1"),
        ({"urls": [A, A + "/"]}, "twice"),
        ({"urls": ["ftp://host/"]}, "not an http.s. URL"),
        ({"urls": ["http://user:pw@host:8188"]}, "credentials"),
        ({"kind": "runpod", "endpoint_id": "e1", "urls": [A]}, "only for pools of kind 'comfyui'"),
        ({"urls": [A], "server_slots": 0}, "greater than or equal to 1"),
    ],
)
def test_bad_server_settings_say_what_to_fix(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        PoolConfig(**fields)


def graph(prompt: str, ckpt: str = "sdxl.safetensors") -> dict[str, Any]:
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": prompt, "clip": ["1", 1]}},
        "3": {"class_type": "KSampler", "inputs": {"seed": 1, "model": ["1", 0]}},
    }


def test_the_warm_key_is_the_loaded_models_not_the_prompt() -> None:
    assert warm_key(graph("a fox")) == warm_key(graph("a red barn"))
    assert warm_key(graph("a fox")) != warm_key(graph("a fox", ckpt="flux.safetensors"))
    other = graph("a fox")
    other["4"] = {"class_type": "SaveImage", "inputs": {"images": ["3", 0]}}
    assert warm_key(other) != warm_key(graph("a fox"))


def settings(pools: dict[str, PoolConfig]) -> WorkerSettings:
    return WorkerSettings(pools=pools, default_pool=next(iter(pools)))


async def test_a_job_reaches_only_a_server_of_its_pool() -> None:
    async with httpx.AsyncClient() as http:
        pools = ComfyPools(
            settings({"farm": PoolConfig(urls=[A, B]), "one": PoolConfig(url=A)}), http
        )
        assert pools.client("farm", B).base_url == B
        assert pools.client("one").base_url == A
        with pytest.raises(ApplicationError, match="not one of pool 'farm'") as refused:
            pools.client("farm", "http://169.254.169.254")
        assert refused.value.non_retryable
        # A grant that named no server yet: asked again, never a server picked here.
        with pytest.raises(ApplicationError, match="named none") as unnamed:
            pools.client("farm", None)
        assert not unnamed.value.non_retryable
        assert [c.base_url for c in pools.clients()["farm"]] == [A, B]
        assert pools.health_key("farm", pools.client("farm", A)) == f"farm {A}"
        assert pools.health_key("one", pools.client("one")) == "one"


class FakeServer:
    """A ComfyUI's `/queue` and `/history` on a loopback port, which can be made to fail."""

    def __init__(self) -> None:
        self.down = False
        self.queued: list[str] = []
        self.history: dict[str, Any] = {}
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _queue(self, _request: web.Request) -> web.Response:
        if self.down:
            return web.Response(status=503)
        return web.json_response(
            {"queue_running": [[0, p, {}, {}, []] for p in self.queued], "queue_pending": []}
        )

    async def _history(self, request: web.Request) -> web.Response:
        if self.down:
            return web.Response(status=503)
        prompt_id = request.match_info["prompt_id"]
        found = self.history.get(prompt_id)
        return web.json_response({prompt_id: found} if found else {})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/queue", self._queue)
        app.router.add_get("/history/{prompt_id}", self._history)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest_asyncio.fixture
async def two_servers() -> AsyncIterator[tuple[FakeServer, FakeServer]]:
    first, second = FakeServer(), FakeServer()
    await first.start()
    await second.start()
    try:
        yield first, second
    finally:
        await first.stop()
        await second.stop()


async def test_the_watch_reports_a_server_that_fails_twice_and_again_when_it_answers(
    two_servers: tuple[FakeServer, FakeServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = two_servers
    urls = [first.url, second.url]
    async with httpx.AsyncClient() as http:
        pools = ComfyPools(settings({"farm": PoolConfig(urls=urls)}), http)
        watch = ServerHealthActivities(pools, check_every_s=0.05)
        env = ActivityEnvironment()
        second.down = True
        seen = await asyncio.wait_for(
            env.run(watch.watch_pool_servers, ServerWatch(pool="farm", servers=urls)), 10
        )
        assert seen[first.url] is None
        reason = seen[second.url]
        assert reason is not None and "503" in reason
        second.down = False
        back = await asyncio.wait_for(
            env.run(
                watch.watch_pool_servers,
                ServerWatch(pool="farm", servers=urls, unhealthy={second.url: "down"}),
            ),
            10,
        )
        assert back == {first.url: None, second.url: None}
        # Nothing changes: the watch keeps watching (here, until its own end) and says so.
        monkeypatch.setattr(server_health, "WATCH_FOR_S", 0.3)
        same = await asyncio.wait_for(
            env.run(watch.watch_pool_servers, ServerWatch(pool="farm", servers=urls)), 10
        )
        assert same == {first.url: None, second.url: None}


async def test_a_prompt_whose_server_was_never_heard_of_is_found_or_left_unknown(
    two_servers: tuple[FakeServer, FakeServer],
) -> None:
    first, second = two_servers
    second.history["p-1"] = {"status": {"status_str": "success"}}
    async with httpx.AsyncClient() as http:
        pools = ComfyPools(settings({"farm": PoolConfig(urls=[first.url, second.url])}), http)
        clients = pools.clients_of("farm")
        found, unreachable = await find_prompt(clients, "p-1")
        assert found is not None and found.base_url == second.url and unreachable == []
        found, unreachable = await find_prompt(clients, "p-2")
        assert found is None and unreachable == []
        # A server that cannot be asked: "on none" is not known.
        second.down = True
        found, unreachable = await find_prompt(clients, "p-2")
        assert found is None and unreachable == [second.url]


@pytest.mark.parametrize(
    ("workers", "unhealthy", "cold"),
    [
        ({"idle": 1}, False, False),
        ({"running": 1, "unhealthy": 1}, True, False),
        ({"throttled": 2}, True, False),
        ({"unhealthy": 1, "initializing": 1}, False, True),
        ({"running": 1, "unhealthy": 1, "idle": 1}, False, False),
        ({"initializing": 2}, False, True),
        ({"running": 1, "initializing": 1}, False, False),
        ({}, False, True),
    ],
)
def test_what_an_endpoints_health_means_for_routing(
    workers: dict[str, int], unhealthy: bool, cold: bool
) -> None:
    health = RunPodHealth.model_validate({"workers": workers, "jobs": {"inQueue": 2}})
    read = read_health(health, datetime.now(UTC))
    assert (read.unhealthy is not None, read.cold) == (unhealthy, cold)
    assert read.in_queue == 2


async def test_the_doctor_names_each_server_that_does_not_answer_and_what_the_others_hold(
    two_servers: tuple[FakeServer, FakeServer],
) -> None:
    first, second = two_servers
    first.queued = ["p-1"]
    farm = PoolConfig(urls=[first.url, second.url])
    result = await comfyui_servers_health(settings({"farm": farm}))
    assert result.outcome is Outcome.OK, result
    assert result.message == f"farm: 2 of 2 server(s) answer ({first.url} holds 1)"
    second.down = True
    result = await comfyui_servers_health(settings({"farm": farm}))
    assert result.outcome is Outcome.FAIL and result.problem is Problem.UNREACHABLE
    assert result.message.startswith(f"{second.url} (pool 'farm') did not answer GET /queue")
    assert result.message.endswith("farm: 1 of 2 server(s) answer (" + first.url + " holds 1)")
