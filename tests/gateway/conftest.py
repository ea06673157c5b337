"""The gateway's tests: a gateway per module, in front of the module's worker (`worker`, in
tests/conftest.py), and one HTTP client per test (an SSE stream one test leaves open must not
hold up the next)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest_asyncio

from devstack.models import RunningStack
from tests.support.cli import RunningWorker
from tests.support.gateway import RunningGateway, running_gateway, stack_client_factory


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gateway(
    local_stack: RunningStack, worker: RunningWorker
) -> AsyncIterator[RunningGateway]:
    async with running_gateway(stack_client_factory(local_stack, worker)) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="session")
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
        yield client
