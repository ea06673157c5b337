"""Shared fixtures: the real local stack (Temporal dev server, SeaweedFS, ComfyUI simulator), and
a time-skipping Temporal test server for the workflow tests.

Every stack gets its own free ports on 127.0.0.1 and its own state dir under pytest's tmp dir, so
tests never touch a developer's `.devstack` or the default ports. Whatever a factory-made stack
left running is stopped by PID when the session ends, also after failures.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from temporalio.testing import WorkflowEnvironment

from devstack.config import StackConfig
from devstack.free_ports import HOST, free_port, make_stack_config, port_is_free
from devstack.models import RunningStack
from devstack.stack import start_stack, stop_stack
from tests.support.cli import RunningWorker, running_worker
from tests.support.workflow_fakes import start_time_skipping

# The free-port helpers live in devstack/ (bench/ uses them too); imported here for the tests
# that take them from conftest.
__all__ = ["HOST", "StackConfigFactory", "free_port", "make_stack_config", "port_is_free"]


StackConfigFactory = Callable[[str], StackConfig]


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def stack_config_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[StackConfigFactory]:
    """Fresh configs (own ports, own state dir); all their services are stopped at session end."""
    made: list[StackConfig] = []

    def make(name: str) -> StackConfig:
        config = make_stack_config(tmp_path_factory.mktemp(name) / "state")
        made.append(config)
        return config

    try:
        yield make
    finally:
        for config in made:
            # state_dir is absolute, so the base dir does not matter.
            await stop_stack(config, Path(config.state_dir))


@pytest.fixture(scope="session")
def stack_config(stack_config_factory: StackConfigFactory) -> StackConfig:
    return stack_config_factory("stack")


@pytest.fixture(scope="session")
def stack_base_dir(stack_config: StackConfig) -> Path:
    """What to pass as `base_dir` with `stack_config` (e.g. to stop_service / start_service)."""
    return Path(stack_config.state_dir).parent


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def local_stack(
    stack_config: StackConfig, stack_base_dir: Path
) -> AsyncIterator[RunningStack]:
    """The whole stack, started once per session and stopped by PID at the end."""
    try:
        yield await start_stack(stack_config, stack_base_dir)
    finally:
        await stop_stack(stack_config, stack_base_dir)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def env() -> AsyncIterator[WorkflowEnvironment]:
    """A time-skipping test server (our search attributes registered), one per test module.

    Per module, not per session: the server skips time for everyone on it, and an activity or
    timer a module leaves behind would hold up (or jump) the clock of the next. Starting one
    takes about 0.1 s. A test that needs a server nobody else touched starts its own (see
    `clean_env` in tests/workflows/test_workflow_durability.py).
    """
    environment = await start_time_skipping()
    yield environment
    await environment.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def worker(
    local_stack: RunningStack, request: pytest.FixtureRequest
) -> AsyncIterator[RunningWorker]:
    """A worker process on the local stack for the module, on a task queue of the module's own
    (named after it), so no module's jobs land on another's worker."""
    name = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_").replace("_", "-")
    async with running_worker(local_stack, name) as running:
        yield running


# No test takes near this long (the longest run about two minutes on a loaded machine). A test
# that hangs (a job that never ends, a server that never answers) dumps every thread's stack and
# ends its process instead of holding `make test` until CI gives up on it.
HUNG_TEST_S = 600


# The test each process is running, in a file of its own that outlives the process: a process
# that died (a hang's dump lost, a signal) names what it was doing. Removed when it ends well.
RUNNING_DIR = Path(tempfile.gettempdir()) / "durable-comfy-tests"


def _running_file() -> Path:
    return RUNNING_DIR / f"running-{os.getpid()}"


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    RUNNING_DIR.mkdir(exist_ok=True)
    stamp = time.strftime("%H:%M:%S")
    _running_file().write_text(f"{stamp} {os.environ.get('PYTEST_XDIST_WORKER', '-')} {nodeid}\n")


def pytest_sessionfinish(session: pytest.Session) -> None:
    _running_file().unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def _hung_test_watchdog() -> Iterator[None]:
    # The process's own stderr: pytest's capture of sys.stderr is gone once the process exits.
    stream = sys.__stderr__
    assert stream is not None
    faulthandler.dump_traceback_later(HUNG_TEST_S, exit=True, file=stream)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


# --- where the suite's time goes ---------------------------------------------------------------

# --- the order files run in --------------------------------------------------------------------

# The longest files, longest first (the "slowest files" `make test` prints). `make test` runs
# `--dist loadfile --no-loadscope-reorder`: each process takes the next file in collection order
# when it is free, so the longest start first and the many short ones even out the end. (xdist's
# own order, files with the most tests first, started a two-minute file of two tests last.)
LONGEST_FILES = (
    "tests/stack/test_chaos.py",
    "tests/stack/test_runpod_fencing.py",
    "tests/stack/test_runpod_chaos.py",
    "tests/stack/test_runpod_budgets.py",
    "tests/stack/test_pool_queue.py",
    "tests/tooling/test_runpod_sim.py",
    "tests/tooling/test_devstack.py",
    "tests/gateway/test_gateway_batches.py",
    "tests/endpoint/test_endpoint_fence.py",
    "tests/stack/test_runpod_e2e.py",
    "tests/test_package_install.py",
    "tests/endpoint/test_endpoint_outage.py",
    "tests/stack/test_runpod_budget_refusal.py",
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: index for index, path in enumerate(LONGEST_FILES)}
    # A stable sort: each file's tests, and the other files, keep their order.
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


# Seconds per test file (setup, call and teardown of its tests), summed in the process that
# reports them: with xdist, the controller hears every worker's reports.
_FILE_SECONDS: dict[str, float] = {}
SLOWEST_FILES = 24


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The slowest files: with `--dist loadfile` a file runs in one process, so these bound
    how evenly the processes can share the suite (docs/testing.md, make test's time)."""
    if not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.section(f"slowest {SLOWEST_FILES} files (of {total:.0f} s in all)")
    slowest = sorted(_FILE_SECONDS.items(), key=lambda item: item[1], reverse=True)
    for path, seconds in slowest[:SLOWEST_FILES]:
        terminalreporter.write_line(f"{seconds:8.1f}s {path}")
