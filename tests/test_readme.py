"""The README's examples work as written: its Python example is `examples/quickstart.py` byte
for byte, and that script and the README's CLI lines run against the local stack.

The stack is the session's (tests/conftest.py, free loopback ports); the worker runs in this
process on a task queue of its own, and the script and the CLI get the environment
`. .devstack/env` would give them (tests/support/cli.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from devstack.models import RunningStack
from starter.cli.common import ExitCode
from tests.conftest import free_port
from tests.support.cli import ROOT, RunningWorker, cli_env, json_lines, run_cli, running_worker

README = ROOT / "README.md"
QUICKSTART = ROOT / "examples" / "quickstart.py"


def fenced_block(markdown: str, section: str, language: str) -> str:
    """The first ```language block under the `## section` heading."""
    body = markdown.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(rf"^```{language}\n(.*?)^```$", body, re.MULTILINE | re.DOTALL)
    assert match is not None, f"no {language} block under '## {section}'"
    return match.group(1)


def readme_cli_lines() -> list[list[str]]:
    """The README's `durable-comfy ...` lines, each as argv (comments dropped)."""
    block = fenced_block(README.read_text(), "From the shell", "sh")
    lines = [shlex.split(line, comments=True) for line in block.splitlines()]
    return [argv for argv in lines if argv and argv[0] == "durable-comfy"]


def test_the_readme_is_a_readme() -> None:
    assert len(README.read_bytes()) <= 12 * 1024
    assert "../shared" not in README.read_text()


def test_every_relative_link_of_the_readme_and_docs_resolves() -> None:
    broken = []
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for match in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            target = match.group(1)
            if (
                not target.startswith(("http://", "https://"))
                and not (page.parent / target).exists()
            ):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def test_the_python_example_is_the_quickstart_script_verbatim() -> None:
    assert fenced_block(README.read_text(), "From Python", "python") == QUICKSTART.read_text()


def test_the_readme_shows_six_cli_lines() -> None:
    assert len(readme_cli_lines()) == 6


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def worker(local_stack: RunningStack) -> AsyncIterator[RunningWorker]:
    async with running_worker(local_stack, "readme") as running:
        yield running


async def test_the_quickstart_script_runs_to_completed_with_presigned_urls(
    worker: RunningWorker, local_stack: RunningStack
) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(QUICKSTART),
        env=cli_env(local_stack, worker.task_queue),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode == 0, err.decode()[-2000:]
    lines = out.decode().splitlines()
    assert lines[0].startswith("submitted job-")
    assert any(line.startswith("COMPLETED") and "100%" in line for line in lines)
    artifacts = [line.split() for line in lines if "X-Amz-Signature=" in line]
    assert artifacts, "no artifact with a presigned URL"
    for _key, _sha, url in artifacts:
        assert url.startswith(local_stack.s3_endpoint)


async def test_the_readme_cli_lines_run_as_written(
    worker: RunningWorker, local_stack: RunningStack, tmp_path: Path
) -> None:
    env = cli_env(local_stack, worker.task_queue)
    job_id = ""
    ran: list[str] = []
    for argv in readme_cli_lines():
        assert job_id or "JOB_ID" not in argv, f"{shlex.join(argv)}: no JOB_ID submitted yet"
        replaced = {"JOB_ID": job_id, "./out": str(tmp_path / "out")}
        args = [replaced.get(arg, arg) for arg in argv[1:]]
        code, out, err = await run_cli(*args, env=env)
        assert code == ExitCode.OK, f"{shlex.join(argv)}: exit {code}\n{err[-2000:]}"
        if args[0] == "submit" and "--json" in args:
            [submitted] = json_lines(out)
            job_id = submitted["job_id"]
        ran.append(args[0])
    assert job_id and "result" in ran
    assert any((tmp_path / "out").rglob("*.png")), "result --download wrote no file"


# Everything that says where Temporal, S3 or RunPod is: what the README's env line must set.
STACK_VARIABLES = ("TEMPORAL_", "AWS_", "DURABLE_COMFY_", "RUNPOD_")


def readme_shell_script(env_file: Path, out: Path) -> str:
    """The README's shell block as one bash script for a stack whose env file is `env_file`
    (what the README says of a `CONFIG` stack: `<state_dir>/env` instead of `.devstack/env`),
    JOB_ID taken from the `--json` submit's line, as a user copies it."""
    block = fenced_block(README.read_text(), "From the shell", "sh")
    lines = ["set -euo pipefail"]
    for line in block.splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        if argv == [".", ".devstack/env"]:
            lines.append(f". {shlex.quote(str(env_file))}")
            continue
        command = shlex.join([str(out) if arg == "./out" else arg for arg in argv])
        command = command.replace("JOB_ID", '"$JOB_ID"')
        if argv[:2] == ["durable-comfy", "submit"] and "--json" in argv:
            read = "import json, sys; print(json.loads(sys.stdin.readline())['job_id'])"
            command = f"JOB_ID=$({command} | python -c {shlex.quote(read)})"
        lines.append(command)
    return "\n".join(lines) + "\n"


async def test_the_readme_shell_block_runs_on_a_moved_port_stack_from_its_env_file(
    local_stack: RunningStack, tmp_path: Path
) -> None:
    """The session's stack is a second stack as a user makes one (free ports, its state in a
    folder of its own): the README's lines, with its env file loaded instead of .devstack/env
    and nothing else of the environment saying where anything is, reach it."""
    env_file = local_stack.env_file
    assert env_file.exists() and not local_stack.temporal_address.endswith(":7233")
    env = {k: v for k, v in os.environ.items() if not k.startswith(STACK_VARIABLES)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    queue = await bash(
        f". {shlex.quote(str(env_file))} && python -c "
        "'from configuration.settings import ClientSettings; print(ClientSettings().task_queue)'",
        env,
    )
    async with running_worker(local_stack, "readme-shell", task_queue=queue.strip()):
        out = await bash(readme_shell_script(env_file, tmp_path / "out"), env, timeout_s=240)
    assert any((tmp_path / "out").rglob("*.png")), f"result --download wrote no file:\n{out}"
    assert "COMPLETED" in out, out


async def bash(script: str, env: dict[str, str], timeout_s: float = 60) -> str:
    """`script` run by bash in a session of its own, whose processes (a README line's
    background gateway among them) are all killed, by process group, when it ends."""
    process = await asyncio.create_subprocess_exec(
        "bash",
        "-c",
        script,
        env=env,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(process.communicate(), timeout=timeout_s)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    text = out.decode(errors="replace")
    assert process.returncode == 0, f"exit {process.returncode}:\n{script}\n{text[-3000:]}"
    return text


def readme_http_script(env_file: Path, port: int, log: Path) -> str:
    """The README's HTTP block as one bash script: its gateway on `port` (a second stack's
    gateway takes a port of its own) in the background, until it is ready; the POST's job_id
    kept for the lines that name JOB_ID; the event stream read to its end."""
    block = fenced_block(README.read_text(), "Over HTTP", "sh").replace("8080", str(port))
    block = block.replace(". .devstack/env", f". {shlex.quote(str(env_file))}")
    commands = [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]
    serve, post, *reads = commands
    read = "import json, sys; print(json.load(sys.stdin)['job_id'])"
    lines = [
        "set -euo pipefail",
        # The whole line in the background with its output in the log: nothing of it holds
        # the script's stdout, and `bash` kills what is left by process group.
        f"{{ {serve.split('#')[0].strip()}; }} > {shlex.quote(str(log))} 2>&1 &",
        f"until curl -sf localhost:{port}/readyz > /dev/null; do sleep 0.2; done",
        f"JOB_ID=$({post} | python -c {shlex.quote(read)})",
    ]
    for command in reads:
        command = command.replace("JOB_ID", '"$JOB_ID"')
        lines.append(f"timeout 120 {command}" if "/events" in command else command)
    return "\n".join(lines) + "\n"


async def test_the_readme_http_block_runs_on_a_moved_port_stack_from_its_env_file(
    local_stack: RunningStack, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(STACK_VARIABLES)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env_file = local_stack.env_file
    queue = await bash(
        f". {shlex.quote(str(env_file))} && python -c "
        "'from configuration.settings import ClientSettings; print(ClientSettings().task_queue)'",
        env,
    )
    script = readme_http_script(env_file, free_port(), tmp_path / "gateway.log")
    async with running_worker(local_stack, "readme-http", task_queue=queue.strip()):
        out = await bash(script, env, timeout_s=240)
    assert '"state":"COMPLETED"' in out.replace(" ", ""), out[-3000:]
    assert "event: end" in out, out[-3000:]
