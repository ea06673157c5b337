"""The rig the follower tests drive PromptFollower with, in-process and without a Temporal server.

ComfyUI is `FakeComfy` (HTTP on an `httpx.MockTransport`, with per-test answers that replace
its own) and a `ScriptedSocket` on a loopback port; outputs go to a `FakeStore`.
`ActivityEnvironment` gives the follower its activity context and captures its heartbeats, with
when each came; `AddressedRecorder` stands in for the client its progress signals go to.
Timings are shrunk through the heartbeat timeout (the follower polls at a third of it); the
heartbeat budget is unlimited and the follow's quiet start off (`no_quiet_start`), unless a test
says otherwise.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import httpx
import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities import follow_common
from activities.comfyui.follow import FollowAttempt
from activities.comfyui.pools import PoolHealth
from activities.heartbeat_budget import HeartbeatBudget
from protocol.comfyui.client import ComfyClient
from tests.support.comfy_fakes import (
    PNG,
    FakeComfy,
    FakeStore,
    ScriptedSocket,
    SignalRecorder,
    Step,
    comfy_on_loopback,
)
from workflows.activity_io import FollowHeartbeat, FollowInput, FollowResult
from workflows.contracts import ProgressReport

HEARTBEAT_TIMEOUT_S = 0.6
# A follow that has not ended by then fails its test instead of hanging it.
FOLLOW_DEADLINE_S = 8.0


class AddressedRecorder(SignalRecorder):
    """Also keeps the workflow each report was addressed to; `failing` makes every send fail."""

    def __init__(self) -> None:
        super().__init__()
        self.addressed: list[str] = []
        self.failing = False

    def get_workflow_handle(self, workflow_id: str) -> Any:
        self.addressed.append(workflow_id)
        handle = super().get_workflow_handle(workflow_id)
        if self.failing:

            class Refusing:
                async def signal(self, name: str, arg: Any) -> None:
                    raise RuntimeError("workflow not found")

            return Refusing()
        return handle


class StubHealth(PoolHealth):
    """A pool the health probe finds broken (`broken` set), recording what it was asked."""

    def __init__(self, broken: str | None = None) -> None:
        super().__init__()
        self.broken = broken
        self.probed: list[tuple[str, Any]] = []

    async def probe(self, pool: str, client: ComfyClient) -> str | None:
        self.probed.append((pool, client))
        return self.broken


@dataclass
class Rig:
    comfy: FakeComfy
    socket: ScriptedSocket
    base_url: str
    http: httpx.AsyncClient
    store: FakeStore = field(default_factory=FakeStore)
    signals: AddressedRecorder = field(default_factory=AddressedRecorder)
    health: PoolHealth = field(default_factory=PoolHealth)
    # No limit: every frame with news is heartbeated at once (the pacing is tested on its own).
    budget: HeartbeatBudget = field(default_factory=lambda: HeartbeatBudget(float("inf"), 0.0))
    # Every heartbeat: (time.monotonic() when it came, its details).
    beats: list[tuple[float, tuple[Any, ...]]] = field(default_factory=list)
    # HTTP answers that replace the fake's: (method, path) -> response.
    overrides: dict[tuple[str, str], httpx.Response] = field(default_factory=dict)
    env: ActivityEnvironment = field(init=False)
    # The last attempt `follow` ran.
    attempt: FollowAttempt | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.env = self.make_env(HEARTBEAT_TIMEOUT_S)

    def make_env(self, heartbeat_timeout_s: float | None) -> ActivityEnvironment:
        env = ActivityEnvironment(client=self.signals.as_client())
        timeout = timedelta(seconds=heartbeat_timeout_s) if heartbeat_timeout_s else None
        env.info = dataclasses.replace(env.info, heartbeat_timeout=timeout)
        env.on_heartbeat = lambda *details: self.beats.append((time.monotonic(), details))
        return env

    def with_heartbeat_timeout(self, seconds: float | None) -> None:
        """Follow with this heartbeat timeout (None: the activity has none) instead of 0.6 s."""
        self.env = self.make_env(seconds)

    def client(self) -> ComfyClient:
        return ComfyClient(self.base_url, self.http)

    async def follow(
        self,
        req: FollowInput,
        heartbeat_details: list[Any] | None = None,
        *,
        read_history: bool = False,
    ) -> FollowResult:
        """Run one follow attempt as the activity would, resuming from `heartbeat_details`
        (`read_history`: as `ComfyBackend.follow` runs it)."""
        client = self.client()
        self.env.info = dataclasses.replace(
            self.env.info, heartbeat_details=heartbeat_details or []
        )

        async def follow_prompt(req: FollowInput) -> FollowResult:
            self.attempt = FollowAttempt(req, client, self.store, self.health, self.budget)
            return await self.attempt.run(read_history=read_history)

        async with asyncio.timeout(FOLLOW_DEADLINE_S):
            result: FollowResult = await self.env.run(follow_prompt, req)
        return result

    async def failure(self, req: FollowInput) -> ApplicationError:
        with pytest.raises(ApplicationError) as caught:
            await self.follow(req)
        return caught.value

    def heartbeats(self) -> list[FollowHeartbeat]:
        """Every heartbeat, each one detail: a `FollowHeartbeat`'s JSON."""
        assert all(len(details) == 1 for _, details in self.beats), "one detail per heartbeat"
        return [FollowHeartbeat.model_validate(details[0]) for _, details in self.beats]

    def reports(self) -> list[ProgressReport]:
        return self.signals.reports


@asynccontextmanager
async def open_rig() -> AsyncIterator[Rig]:
    """A fresh rig; the follower test module's `rig` fixture yields one per test."""
    comfy = FakeComfy(files={"img_00001_.png": PNG, "img_00002_.png": PNG + b"2"})
    socket = ScriptedSocket()
    overrides: dict[tuple[str, str], httpx.Response] = {}

    async def handle(request: httpx.Request) -> httpx.Response:
        answer = overrides.get((request.method, request.url.path))
        if answer is not None:
            comfy.requests.append(f"{request.method} {request.url.path}")
            return answer
        return await comfy.handle(request)

    async with comfy_on_loopback(comfy, socket) as (base_url, _http):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as http:
            yield Rig(comfy, socket, base_url, http, overrides=overrides)


def until(condition: Callable[[], bool], within_s: float = 1.0) -> Step:
    """A script step that waits (at most `within_s`) for the follower to have done something."""

    async def step(_ws: Any) -> None:
        deadline = time.monotonic() + within_s
        # The follower's records set no event to wait on: poll them.
        while not condition() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)

    return step


@pytest.fixture
def no_quiet_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Follow attempts signal from their first event (no `QUIET_START_S`): the milestone rules
    are what these tests look at, in runs far shorter than a second."""
    monkeypatch.setattr(follow_common, "QUIET_START_S", 0.0)
