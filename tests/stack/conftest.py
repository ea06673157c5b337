"""The whole system on the local stack: a real Temporal server and SeaweedFS, the ComfyUI
simulator (or a real ComfyUI, `make test-real-comfyui`), worker processes, and for the `runpod`
pool the RunPod simulator running handlers under the real `runpod` loop. Shared fixtures:
`local_stack` and `worker` (tests/conftest.py); `runpod_sim` (our handler) and `runpod_worker` (a
worker with a `runpod` pool) and `fenced` (a client of a pool with a short lease) from
tests/support/runpod_e2e.py; and `stock_sim`."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

# The RunPod fixtures: the simulator running our handler, a worker with a `runpod` pool.
from tests.support.runpod_e2e import (  # noqa: F401 (fixtures)
    endpoint_sim,
    fenced,
    nothing_left_running,
    runpod_sim,
    runpod_worker,
)
from tests.support.runpod_sim import RunpodSim, handler_script


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stock_sim(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> AsyncIterator[RunpodSim]:
    """An endpoint whose workers run a stand-in of the stock worker-comfyui handler
    (tests/runpod_handlers/stock_comfyui.py): what most RunPod endpoints run, no bucket."""
    module = request.module.__name__.rsplit(".", 1)[-1]
    async with endpoint_sim(
        tmp_path_factory.mktemp(f"{module}-stock"), handler=handler_script("stock_comfyui")
    ) as sim:
        yield sim
