"""The handler's tests: a SeaweedFS bucket and a ComfyUI simulator per module, the handler's
settings pointed at both per test. A module that needs another shape (a fresh bucket per test, a
second ComfyUI) declares its own fixture of the same name."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from endpoint.settings import EndpointSettings
from tests.support.comfy_sim import run_simulator
from tests.support.endpoint import Bucket, endpoint_settings, seaweedfs


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def bucket(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> AsyncIterator[Bucket]:
    async with seaweedfs(tmp_path_factory.mktemp(f"{request.module.__name__}_s3")) as running:
        yield running


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[str]:
    with run_simulator(tmp_path_factory.mktemp(f"{request.module.__name__}_sim")) as url:
        yield url


@pytest.fixture
def settings(sim: str, bucket: Bucket) -> EndpointSettings:
    return endpoint_settings(sim, bucket)
