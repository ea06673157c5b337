"""Layers point one way, and the RunPod handler's image holds everything the handler imports.

    bench/      -> faults/, devstack/, starter/, activities/, protocol/, workflows/  (tooling)
    faults/     -> devstack/, starter/, activities/, protocol/, workflows/  (fault tooling)
    devstack/   -> starter/, activities/, protocol/, workflows/, endpoint/
    worker.py   -> starter/ (connection), activities/, configuration/, protocol/, workflows/
    gateway/    -> starter/, configuration/, workflows/, protocol/ (keys), S3 and URL-check
                   helpers of activities/
    starter/    -> configuration/, workflows/, the S3 helpers of activities/  (no worker code)
    endpoint/   -> protocol/ (the ComfyUI core, progress, keys, the RunPod wire contract)
    activities/ -> configuration/, protocol/, workflows/
    configuration/ -> workflows/  (the settings the worker, the client and the gateway read)
    workflows/  -> nothing of the project
    protocol/   -> nothing of the project (and no Temporal: the handler's venv has none)

Nothing in the product (workflows, activities, starter, worker.py, endpoint) imports the tooling
(devstack, faults, bench) or the tests, and `activities/` never imports `endpoint/`: the
orchestrator and the handler share the protocol core, and neither imports the other. devstack/
ships in the wheel (`durable-comfy dev` runs its stack and simulators) and the fault tooling does
not, so devstack/ never imports faults/.

The handler runs in a venv of its own (`endpoint/requirements.txt`, the `runpod` SDK, no
Temporal): every module `endpoint/handler.py` reaches, transitively, must lie in a folder that
`endpoint/Dockerfile` copies whole, need only what the requirements install, and import in
`.venv-endpoint` from a copy laid out as in the image.
"""

from __future__ import annotations

import ast
import builtins
import graphlib
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENDPOINT = ROOT / "endpoint"
HANDLER = ENDPOINT / "handler.py"
# Started beside the handler in the same image and venv (endpoint/start.sh).
WATCHDOG = ENDPOINT / "watchdog.py"
EP_PYTHON = ROOT / ".venv-endpoint" / "bin" / "python"
PROJECT = {
    "protocol",
    "configuration",
    "activities",
    "workflows",
    "starter",
    "gateway",
    "devstack",
    "faults",
    "bench",
    "worker",
    "endpoint",
    "tests",
}
TOOLING = {"devstack", "faults", "bench", "tests"}

FORBIDDEN = {
    "workflows": TOOLING
    | {"protocol", "configuration", "activities", "starter", "gateway", "worker", "endpoint"},
    # Shared by the worker and the handler's image: Temporal stays out (test below).
    "protocol": TOOLING
    | {"workflows", "configuration", "activities", "starter", "gateway", "worker", "endpoint"},
    # Below everything that reads a setting: it reads none of their code.
    "configuration": TOOLING
    | {"protocol", "activities", "starter", "gateway", "worker", "endpoint"},
    "activities": TOOLING | {"starter", "gateway", "worker", "endpoint"},
    "starter": TOOLING | {"gateway", "worker", "activities", "endpoint"},
    # The HTTP face is a client: JobClient's, with no worker code.
    "gateway": TOOLING | {"worker", "activities", "endpoint"},
    "worker.py": TOOLING | {"gateway", "endpoint"},
    # The handler's image has no Temporal: workflows/ (which imports it) stays out too.
    "endpoint": TOOLING
    | {"starter", "gateway", "worker", "workflows", "activities", "configuration"},
    "devstack": {"faults", "bench", "tests"},
    "faults": {"bench", "tests"},
    "bench": {"tests"},
}
# The client library may use these activity modules for S3 (downloads, presigning, logging):
# they are I/O helpers with no worker state, imported only where a command needs them.
ALLOWED = {
    ("starter", "activities.storage"),
    ("starter", "activities.storage_errors"),
    ("starter", "activities.log_setup"),
    # The gateway: the client's S3 helpers, and the SSRF guard of webhook URLs.
    ("gateway", "activities.storage"),
    ("gateway", "activities.log_setup"),
    ("gateway", "activities.public_address"),
    ("gateway", "activities.webhook_target"),
}
# Installed with runpod (runpod==1.12.0 requires boto3).
WITH_RUNPOD = {"boto3", "botocore"}
needs_endpoint_venv = pytest.mark.skipif(
    not EP_PYTHON.exists(), reason="no .venv-endpoint: `make install` builds it"
)


def imported_modules(path: Path) -> set[str]:
    """Absolute imports of a file, `from a import b` also as `a.b` (b may be a module). When
    every `b` is a module of the project, the import is of those modules, as `import a.b` is:
    not of what `a/__init__.py` itself imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            named = {f"{node.module}.{alias.name}" for alias in node.names}
            if not all(_is_project_module(name) for name in named):
                found.add(node.module)
            found.update(named)
    return found


def _is_project_module(name: str) -> bool:
    where = ROOT.joinpath(*name.split("."))
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def files_of(layer: str) -> list[Path]:
    target = ROOT / layer
    return [target] if target.is_file() else sorted(target.rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_point_one_way(layer: str) -> None:
    offences = sorted(
        {
            f"{path.relative_to(ROOT)} imports {module}"
            for path in files_of(layer)
            for module in imported_modules(path)
            if module.split(".")[0] in FORBIDDEN[layer]
            and (layer, module) not in ALLOWED
            and (layer, module.rsplit(".", 1)[0]) not in ALLOWED
        }
    )
    assert offences == []


def test_the_protocol_core_imports_no_temporal() -> None:
    """The worker and the handler share protocol/: a Temporal import there breaks the image."""
    offences = sorted(
        f"{path.relative_to(ROOT)} imports {module}"
        for path in files_of("protocol")
        for module in imported_modules(path)
        if module.split(".")[0] == "temporalio"
    )
    assert files_of("protocol") and offences == []


# --- the handler's image ---------------------------------------------------------------------


def project_files(module: str) -> list[Path]:
    """The files importing `module` runs: each package's __init__.py on the way, and the
    module's own file; none when the name is no module of the project (an attribute)."""
    parts = module.split(".")
    if parts[0] not in PROJECT:
        return []
    files: list[Path] = []
    for depth in range(1, len(parts) + 1):
        base = ROOT.joinpath(*parts[:depth])
        if (base / "__init__.py").is_file():
            files.append(base / "__init__.py")
        elif base.with_suffix(".py").is_file():
            files.append(base.with_suffix(".py"))
    return files


def reached_from(entry: Path) -> set[Path]:
    """Every project file `entry` imports, transitively (itself included)."""
    seen: set[Path] = set()
    todo = [entry]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for module in imported_modules(path):
            todo.extend(project_files(module))
    return seen


def dockerfile_copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY in endpoint/Dockerfile."""
    text = (ENDPOINT / "Dockerfile").read_text().replace("\\\n", " ")
    copies = []
    for line in text.splitlines():
        words = line.split()
        if words and words[0] == "COPY" and not any(w.startswith("--") for w in words):
            copies.append((words[1:-1], words[-1]))
    return copies


def copied_folders() -> list[Path]:
    return [
        ROOT / source
        for sources, _ in dockerfile_copies()
        for source in sources
        if (ROOT / source).is_dir()
    ]


def requirement_names() -> set[str]:
    names = set()
    for line in (ENDPOINT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(re.split(r"[<>=!~\[ ;]", line, maxsplit=1)[0].lower())
    return names


def endpoint_reach() -> set[Path]:
    """Every project file the image's two entry points (handler, watchdog) import."""
    return reached_from(HANDLER) | reached_from(WATCHDOG)


def test_the_handler_reaches_the_core_it_is_meant_to() -> None:
    """The walk itself: it finds the shared core and the contract, and nothing of Temporal's."""
    reached = {str(p.relative_to(ROOT)) for p in reached_from(HANDLER)}
    assert {
        "protocol/comfyui/follower.py",
        "protocol/comfyui/history.py",
        "protocol/runpod/contract.py",
        "endpoint/job.py",
    } <= reached
    assert "activities/comfyui/follow.py" not in reached, "the orchestrator's listener"


def test_the_dockerfile_copies_whole_folders_only() -> None:
    """Source goes in as folders; a single file only when it is no code (requirements.txt)."""
    files = [
        source
        for sources, _ in dockerfile_copies()
        for source in sources
        if not (ROOT / source).is_dir()
    ]
    assert all(not name.endswith(".py") for name in files), files
    assert {f.name for f in copied_folders()} == {"protocol", "endpoint"}


def test_every_module_the_handler_imports_is_in_the_image() -> None:
    folders = copied_folders()
    missing = sorted(
        str(path.relative_to(ROOT))
        for path in endpoint_reach()
        if not any(path.is_relative_to(folder) for folder in folders)
    )
    assert missing == []


def test_only_the_entry_point_imports_runpod() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for path in endpoint_reach()
        if path != HANDLER and any(m.split(".")[0] == "runpod" for m in imported_modules(path))
    ]
    assert offenders == []
    assert "runpod" in imported_modules(HANDLER)


def test_what_the_handler_imports_is_in_the_endpoints_requirements() -> None:
    """Transitively: a core module that picked up temporalio (or anything the handler's venv
    lacks) fails here, not in the GPU image."""
    third_party = {
        module.split(".")[0]
        for path in endpoint_reach()
        for module in imported_modules(path)
        if module.split(".")[0] not in sys.stdlib_module_names | PROJECT
    }
    missing = third_party - requirement_names() - WITH_RUNPOD
    assert missing == set()


def image_layout(target: Path) -> Path:
    """The repository files the Dockerfile copies, where it puts them (under `target`)."""
    for sources, destination in dockerfile_copies():
        dest = target / destination.lstrip("/")
        for source in sources:
            src = ROOT / source
            if src.is_dir():
                shutil.copytree(
                    src, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
                )
            elif destination.endswith("/"):
                dest.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / src.name)
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest)
    return target / "durable_comfy"


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


@needs_endpoint_venv
def test_the_handler_imports_in_the_endpoints_venv() -> None:
    """`import endpoint.handler` from the repository root, PYTHONPATH unset: the runpod SDK and
    every module the handler needs are there, and no temporalio is asked for."""
    done = subprocess.run(
        [str(EP_PYTHON), "-c", "import endpoint.handler, endpoint.watchdog"],
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
    assert not (root / "workflows").exists() and not (root / "activities").exists()
    done = subprocess.run(
        [str(EP_PYTHON), "-c", "import endpoint.handler, endpoint.job, endpoint.watchdog"],
        cwd=root,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]


# --- no import cycle --------------------------------------------------------------------------


def test_no_import_cycle_in_the_product() -> None:
    """No product module imports itself back, through any chain. Every import counts: one
    under `if TYPE_CHECKING:` or inside a function is a cycle all the same, only hidden."""
    modules: dict[str, Path] = {}
    for layer in sorted(PROJECT - TOOLING):
        for path in files_of("worker.py" if layer == "worker" else layer):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {
        name: {module for module in imported_modules(path) if module in modules} - {name}
        for name, path in modules.items()
    }
    assert {"worker", "workflows.inference_job", "starter.client"} <= set(graph)
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as cycle:
        pytest.fail(f"import cycle: {' -> '.join(cycle.args[1])}")


# --- one error tree per side ------------------------------------------------------------------

# Each side keeps its exception classes in one module, and each boundary maps them once (as
# httpx does): a class defined anywhere else is a tree grown on the side.
ERROR_TREES = {
    "workflows/errors.py",  # the workflow and the activities
    "protocol/errors.py",  # the core the worker and the handler share
    "configuration/errors.py",  # a setting, the production file or the codec's key ring
    "starter/errors.py",  # the client library
    "gateway/errors.py",  # the HTTP API
    "endpoint/errors.py",  # the RunPod handler
}
PRODUCT_CODE = (
    "workflows",
    "protocol",
    "activities",
    "configuration",
    "starter",
    "gateway",
    "endpoint",
    "worker.py",
)


class ExceptionClasses:
    """Which classes of the product's files are exceptions, read from the source alone (the
    handler's modules need a venv of their own): a base is followed through the file's imports
    to the project's class it names, or to the library's, which is imported and asked."""

    def __init__(self) -> None:
        self.files: dict[str, Path] = {}
        for layer in PRODUCT_CODE:
            for path in files_of(layer):
                parts = path.relative_to(ROOT).with_suffix("").parts
                self.files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
        self.trees = {name: ast.parse(path.read_text()) for name, path in self.files.items()}
        self.unresolved: set[str] = set()
        self._known: dict[tuple[str, str], bool] = {}

    def names(self, module: str) -> dict[str, str]:
        """What each top-level name of `module` is bound to: a dotted path, or `module.name`
        for its own classes."""
        bound: dict[str, str] = {}
        for node in self.trees[module].body:
            if isinstance(node, ast.ClassDef):
                bound[node.name] = f"{module}.{node.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        head = alias.name.split(".")[0]
                        bound[head] = head
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        return bound

    def is_exception(self, dotted: str) -> bool:
        module, _, name = dotted.rpartition(".")
        if not module:
            builtin = getattr(builtins, name, None)
            return isinstance(builtin, type) and issubclass(builtin, BaseException)
        if (module, name) in self._known:
            return self._known[module, name]
        self._known[module, name] = False  # a cycle of bases answers no
        if module in self.trees:
            found = self.names(module).get(name)
            if found is None:
                answer = False
            elif found == dotted:
                node = next(
                    n
                    for n in self.trees[module].body
                    if isinstance(n, ast.ClassDef) and n.name == name
                )
                answer = any(self.base_is_exception(module, base) for base in node.bases)
            else:
                answer = self.is_exception(found)
        else:
            answer = self.library_exception(module, name)
        self._known[module, name] = answer
        return answer

    def library_exception(self, module: str, name: str) -> bool:
        try:
            value = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            try:
                value = importlib.import_module(f"{module}.{name}")
            except ImportError:
                self.unresolved.add(f"{module}.{name}")
                return False
        return isinstance(value, type) and issubclass(value, BaseException)

    def base_is_exception(self, module: str, base: ast.expr) -> bool:
        if isinstance(base, ast.Subscript):
            base = base.value
        dotted = ast.unparse(base)
        if (
            not isinstance(base, ast.Name | ast.Attribute)
            or not dotted.replace(".", "").isidentifier()
        ):
            return False
        head, _, rest = dotted.partition(".")
        bound = self.names(module).get(head)
        if bound is None:
            return self.is_exception(head)
        return self.is_exception(f"{bound}.{rest}" if rest else bound)

    def defined_in(self) -> dict[str, list[str]]:
        """Each file defining an exception class (at any depth), with those classes."""
        found: dict[str, list[str]] = {}
        for module, tree in self.trees.items():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and any(
                    self.base_is_exception(module, base) for base in node.bases
                ):
                    where = str(self.files[module].relative_to(ROOT))
                    found.setdefault(where, []).append(node.name)
        return found


def test_exception_classes_are_defined_in_one_module_per_side() -> None:
    classes = ExceptionClasses()
    defined = classes.defined_in()
    strays = {where: names for where, names in defined.items() if where not in ERROR_TREES}
    assert strays == {}, "define these in their side's error module (ERROR_TREES)"
    assert classes.unresolved == set()
    # The walk itself: it sees every tree, through imports and library bases alike.
    assert set(defined) == ERROR_TREES
    assert sum(len(names) for names in defined.values()) >= 90
