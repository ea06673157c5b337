"""What endpoint/ may import, and that the worker image holds everything it does import.

- only endpoint/handler.py imports `runpod` (the rest is tested from the app's venv);
- from the orchestrator, endpoint/ imports only the self-contained modules the Dockerfile copies
  (activities/comfyui/client.py, events.py, activities/progress.py, keys.py), and those import
  nothing else of the project;
- every third-party import is in endpoint/requirements.txt (boto3/botocore come with runpod);
- the files the Dockerfile copies, laid out as in the image, import in .venv-endpoint.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENDPOINT = ROOT / "endpoint"
EP_PYTHON = ROOT / ".venv-endpoint" / "bin" / "python"
SHARED = {
    "activities.comfyui.client",
    "activities.comfyui.events",
    "activities.progress",
    "activities.keys",
}
PROJECT = {"activities", "workflows", "starter", "devstack", "worker", "endpoint", "tests"}
# Installed with runpod (runpod==1.12.0 requires boto3).
WITH_RUNPOD = {"boto3", "botocore"}
needs_endpoint_venv = pytest.mark.skipif(
    not EP_PYTHON.exists(), reason="no .venv-endpoint: `make install` builds it"
)


def imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def module_path(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


def endpoint_files() -> list[Path]:
    return sorted(ENDPOINT.glob("*.py"))


def requirement_names() -> set[str]:
    names = set()
    for line in (ENDPOINT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(re.split(r"[<>=!~\[ ;]", line, maxsplit=1)[0].lower())
    return names


def test_only_the_entry_point_imports_runpod() -> None:
    offenders = [
        path.name
        for path in endpoint_files()
        if path.name != "handler.py" and any(m.split(".")[0] == "runpod" for m in imports(path))
    ]
    assert offenders == []
    assert "runpod" in imports(ENDPOINT / "handler.py")


def test_endpoint_uses_only_the_self_contained_shared_modules() -> None:
    borrowed = {
        module
        for path in endpoint_files()
        for module in imports(path)
        if module.split(".")[0] in PROJECT - {"endpoint"}
    }
    assert borrowed <= SHARED, borrowed - SHARED
    for module in sorted(SHARED):
        project_imports = {m for m in imports(module_path(module)) if m.split(".")[0] in PROJECT}
        assert project_imports == set(), f"{module} imports {project_imports}"


def test_third_party_imports_are_in_the_endpoints_requirements() -> None:
    files = [*endpoint_files(), *(module_path(m) for m in SHARED)]
    third_party = {
        module.split(".")[0]
        for path in files
        for module in imports(path)
        if module.split(".")[0] not in sys.stdlib_module_names | PROJECT
    }
    missing = third_party - requirement_names() - WITH_RUNPOD
    assert missing == set()


def dockerfile_copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY in endpoint/Dockerfile."""
    text = (ENDPOINT / "Dockerfile").read_text().replace("\\\n", " ")
    copies = []
    for line in text.splitlines():
        words = line.split()
        if words and words[0] == "COPY" and not any(w.startswith("--") for w in words):
            copies.append((words[1:-1], words[-1]))
    return copies


def image_layout(target: Path) -> Path:
    """The repository files the Dockerfile copies, where it puts them (under `target`)."""
    for sources, destination in dockerfile_copies():
        dest = target / destination.lstrip("/")
        for source in sources:
            src = ROOT / source
            if src.is_dir():
                shutil.copytree(src, dest, dirs_exist_ok=True)
            elif destination.endswith("/"):
                dest.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / src.name)
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest)
    return target / "durable_comfy"


def test_the_image_gets_the_shared_modules_the_endpoint_imports() -> None:
    copied = {
        source.removesuffix(".py").replace("/", ".")
        for sources, _ in dockerfile_copies()
        for source in sources
        if source.startswith("activities/") and not source.endswith("__init__.py")
    }
    assert copied == SHARED


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


@needs_endpoint_venv
def test_the_handler_imports_in_the_endpoints_venv() -> None:
    """`import endpoint.handler` from the repository root, PYTHONPATH unset: the runpod SDK and
    every module the handler needs are there."""
    done = subprocess.run(
        [str(EP_PYTHON), "-c", "import endpoint.handler"],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]


@needs_endpoint_venv
def test_the_image_layout_imports_with_only_the_copied_files(tmp_path: Path) -> None:
    root = image_layout(tmp_path)
    assert not (root / "workflows").exists()
    done = subprocess.run(
        [str(EP_PYTHON), "-c", "import endpoint.handler, endpoint.job"],
        cwd=root,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
