"""`durable-comfy doctor` and the worker's start-up checks: each check, broken on purpose, fails
with its one-line hint and a non-zero exit; a healthy stack passes every one.

Everything runs against the session's local stack with one variable changed per case. The
cases that need a process of their own (the healthy stack, an unreachable or bare Temporal,
`submit`, the worker) run as subprocesses, all at once in one module fixture: starting the CLI
costs seconds of CPU each. The rest call the same CLI in-process (typer's runner). A bare
Temporal dev server (none of our search attributes) is started once for the module and stopped
by PID.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NamedTuple

import pytest
import pytest_asyncio
from typer.testing import CliRunner

from devstack.config import StackConfig
from devstack.free_ports import free_port, make_stack_config
from devstack.models import RunningStack
from devstack.stack import start_service, stop_service
from starter.cli import build_app
from starter.cli.common import ExitCode
from starter.client import SEARCH_ATTRIBUTES
from starter.doctor import Check, CheckResult, DoctorExit, Outcome, Problem, fail, refuses_start
from starter.pollers import workflow_pollers
from tests.support.cli import (
    EXAMPLE,
    ROOT,
    RunningWorker,
    cli_env,
    json_lines,
    logging_restored,
    run_cli,
)
from tests.support.cli import running_worker as in_process_worker

# Every check but the gateway's, which runs only when `--gateway URL` names one.
ALL_CHECKS = [check.value for check in Check if check is not Check.GATEWAY]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def worker(local_stack: RunningStack) -> AsyncIterator[RunningWorker]:
    async with in_process_worker(local_stack, "doctor") as running:
        # Polling before any test asks: the in-process tests block this loop while they run.
        async with asyncio.timeout(30):
            while True:
                if await workflow_pollers(running.client.temporal, running.task_queue):
                    break
                await asyncio.sleep(0.1)
        yield running


@pytest.fixture(scope="module")
def healthy_env(local_stack: RunningStack, worker: RunningWorker) -> dict[str, str]:
    """The stack's environment (its pools: RunPod simulator and ComfyUI simulator), on the
    task queue the module's worker polls."""
    return cli_env(local_stack, worker.task_queue)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def bare_temporal(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    """A Temporal dev server with none of our search attributes registered; its address."""
    base = make_stack_config(tmp_path_factory.mktemp("bare") / "state")
    temporal = base.temporal.model_copy(update={"search_attributes": {}})
    config: StackConfig = base.model_copy(update={"temporal": temporal})
    base_dir = Path(config.state_dir).parent
    try:
        await start_service(config, base_dir, "temporal")
        yield config.temporal.address
    finally:
        await stop_service(config, base_dir, "temporal")


Results = dict[str, dict[str, str | None]]


def by_check(out: str, err: str) -> Results:
    """`doctor --json`'s documents, by check: one per check, in order, no traceback."""
    documents = json_lines(out)
    assert [d["check"] for d in documents] == ALL_CHECKS, (out, err)
    assert "Traceback" not in err, err
    return {d["check"]: d for d in documents}


def failed_only(results: Results, *checks: Check) -> None:
    """Exactly `checks` failed, each with a one-line message; every other check passed."""
    outcomes = {name: r["outcome"] for name, r in results.items()}
    expected = {c.value: ("fail" if c in checks else "ok") for c in Check if c.value in ALL_CHECKS}
    assert outcomes == expected, results
    for check in checks:
        assert "\n" not in str(results[check.value]["message"])


class Ran(NamedTuple):
    code: int
    out: str
    err: str


async def run_worker_script(env: dict[str, str]) -> tuple[int, str, str]:
    """`python worker.py`, as a process manager starts it."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "worker.py",
        env=env,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


DEAD_TEMPORAL = f"127.0.0.1:{free_port()}"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def ran(healthy_env: dict[str, str], bare_temporal: str) -> dict[str, Ran]:
    """Every subprocess case, run concurrently; by case name."""
    dead = healthy_env | {"TEMPORAL_ADDRESS": DEAD_TEMPORAL}
    bare = healthy_env | {"TEMPORAL_ADDRESS": bare_temporal}
    bad_settings = healthy_env | {
        "DURABLE_COMFY_METRICS_PORT": "abc",
        "DURABLE_COMFY_ORPHAN_SWEEP_S": "x",
    }
    cases = {
        "healthy": run_cli("doctor", env=healthy_env),
        "unreachable": run_cli("doctor", "--json", env=dead),
        "bare": run_cli("doctor", "--json", env=bare),
        "submit_bare": run_cli("submit", str(EXAMPLE), "--json", env=bare),
        "worker_unreachable": run_worker_script(dead),
        "worker_bad_settings": run_cli("worker", env=bad_settings),
    }
    done = await asyncio.gather(*cases.values())
    return {name: Ran(*result) for name, result in zip(cases, done, strict=True)}


def doctor_in_process(env: dict[str, str]) -> tuple[int, Results]:
    """`doctor --json` through the CLI's own app, in this process, with exactly `env`'s
    Temporal and AWS variables."""
    unset: dict[str, str | None] = {
        name: None for name in os.environ if name.startswith(("TEMPORAL_", "AWS_", "DURABLE_"))
    }
    with logging_restored():
        result = CliRunner().invoke(build_app(), ["doctor", "--json"], env=unset | env)
    return result.exit_code, by_check(result.stdout, result.stderr)


# --- subprocesses ---------------------------------------------------------------------------------


def test_a_healthy_stack_passes_every_check(ran: dict[str, Ran]) -> None:
    code, out, err = ran["healthy"]
    assert code == DoctorExit.OK, (out, err)
    lines = out.splitlines()
    assert len(lines) == len(ALL_CHECKS) and all(line.startswith("ok  ") for line in lines), out
    assert "Traceback" not in err


def test_an_unreachable_temporal_is_one_line_naming_the_address_and_exits_3(
    ran: dict[str, Ran],
) -> None:
    code, out, err = ran["unreachable"]
    results = by_check(out, err)
    assert code == DoctorExit.UNREACHABLE == int(ExitCode.UNREACHABLE)
    message = str(results["temporal"]["message"])
    assert f"cannot reach Temporal at {DEAD_TEMPORAL}" in message and "TEMPORAL_ADDRESS" in message
    for needs_temporal in (Check.NAMESPACE, Check.SEARCH_ATTRIBUTES, Check.WORKER):
        assert str(results[needs_temporal.value]["message"]).startswith("skipped (needs ")
        assert results[needs_temporal.value]["outcome"] == "skipped"
    others = (Check.BUCKET, Check.RUNPOD, Check.ENCRYPTION)
    assert [results[c.value]["outcome"] for c in others] == ["ok"] * len(others)


def test_missing_search_attributes_give_both_registration_commands(ran: dict[str, Ran]) -> None:
    code, out, err = ran["bare"]
    results = by_check(out, err)
    assert code == DoctorExit.CONFIGURATION
    message = str(results["search_attributes"]["message"])
    create = "temporal operator search-attribute create --namespace default " + " ".join(
        f"--name {name} --type {kind}" for name, kind in SEARCH_ATTRIBUTES.items()
    )
    cloud = "tcld namespace search-attributes add --namespace default " + " ".join(
        f"--search-attribute {name}={kind}" for name, kind in SEARCH_ATTRIBUTES.items()
    )
    assert create in message and cloud in message, message
    assert "--name JobState --type Keyword" in create
    # Nobody polls on that server either; the configuration problem decides the exit code.
    assert results["worker"]["outcome"] == "fail"


def test_submit_to_a_namespace_without_search_attributes_exits_2_with_the_command(
    ran: dict[str, Ran],
) -> None:
    code, out, err = ran["submit_bare"]
    assert (code, out) == (ExitCode.BAD_INPUT, ""), err
    assert "temporal operator search-attribute create --namespace default" in err
    assert "--name JobState --type Keyword" in err and "tcld namespace" in err
    assert "Traceback" not in err and "is the stack up" not in err


def test_the_worker_refuses_to_start_in_one_line_when_temporal_is_unreachable(
    ran: dict[str, Ran],
) -> None:
    code, out, err = ran["worker_unreachable"]
    assert code == DoctorExit.UNREACHABLE, err
    assert "Traceback" not in err and out == ""
    problems = [line for line in err.splitlines() if line.startswith("worker: FAIL")]
    assert len(problems) == 1, err
    assert f"cannot reach Temporal at {DEAD_TEMPORAL}" in problems[0], err


def test_the_worker_names_each_bad_setting_on_its_own_line(ran: dict[str, Ran]) -> None:
    code, out, err = ran["worker_bad_settings"]
    assert code != 0 and out == "" and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert all(line.startswith("worker: invalid settings: DURABLE_COMFY_") for line in lines)
    named = {line.split(": ")[2] for line in lines}
    assert named == {"DURABLE_COMFY_METRICS_PORT", "DURABLE_COMFY_ORPHAN_SWEEP_S"}, lines


# --- in-process -----------------------------------------------------------------------------------


def test_a_namespace_that_does_not_exist_is_named_with_how_to_create_it(
    healthy_env: dict[str, str],
) -> None:
    code, results = doctor_in_process(healthy_env | {"TEMPORAL_NAMESPACE": "no-such-namespace"})
    assert code == DoctorExit.CONFIGURATION
    assert "'no-such-namespace' does not exist" in str(results["namespace"]["message"])
    assert results["search_attributes"]["message"] == "skipped (needs namespace)"


def test_no_worker_on_the_task_queue_exits_3(healthy_env: dict[str, str]) -> None:
    code, results = doctor_in_process(
        healthy_env | {"DURABLE_COMFY_TASK_QUEUE": "doctor-nobody-polls"}
    )
    assert code == DoctorExit.UNREACHABLE
    failed_only(results, Check.WORKER)
    assert "no worker polls task queue 'doctor-nobody-polls'" in str(results["worker"]["message"])


def test_a_bucket_that_does_not_exist_is_named(healthy_env: dict[str, str]) -> None:
    code, results = doctor_in_process(
        healthy_env | {"DURABLE_COMFY_BUCKET": "doctor-no-such-bucket"}
    )
    assert code == DoctorExit.CONFIGURATION
    failed_only(results, Check.BUCKET)
    message = str(results["bucket"]["message"])
    assert "bucket 'doctor-no-such-bucket' does not exist" in message, message


def test_a_refused_runpod_key_names_the_variable_and_the_endpoint(
    healthy_env: dict[str, str], local_stack: RunningStack
) -> None:
    code, results = doctor_in_process(healthy_env | {"RUNPOD_API_KEY": "not-the-key"})
    assert code == DoctorExit.CONFIGURATION
    failed_only(results, Check.RUNPOD)
    message = str(results["runpod"]["message"])
    refused = f"the key in RUNPOD_API_KEY is refused by endpoint {local_stack.runpod_endpoint_id}"
    assert refused in message and "not-the-key" not in message, message


@pytest.mark.parametrize("keys", ["missing", "empty"])
def test_encryption_configured_without_usable_keys_fails(
    healthy_env: dict[str, str], tmp_path: Path, keys: str
) -> None:
    keys_file = tmp_path / "codec-keys"
    if keys == "empty":
        keys_file.write_text("# no keys yet\n")
    code, results = doctor_in_process(
        healthy_env | {"DURABLE_COMFY_CODEC_KEYS_FILE": str(keys_file)}
    )
    assert code == DoctorExit.CONFIGURATION
    failed_only(results, Check.ENCRYPTION)
    assert "DURABLE_COMFY_CODEC_KEYS_FILE" in str(results["encryption"]["message"])


def test_a_check_result_is_one_json_document_with_these_fields() -> None:
    line = CheckResult(check=Check.BUCKET, outcome=Outcome.OK, message="fine").model_dump_json()
    assert json.loads(line) == {
        "check": "bucket",
        "outcome": "ok",
        "message": "fine",
        "problem": None,
    }


@pytest.mark.parametrize(
    ("check", "problem", "refused"),
    [
        # Down for now: the worker starts and its activities ride the outage out.
        (Check.BUCKET, Problem.UNREACHABLE, False),
        (Check.RUNPOD, Problem.UNREACHABLE, False),
        # Without Temporal a worker is nothing; a wrong setting never fixes itself.
        (Check.TEMPORAL, Problem.UNREACHABLE, True),
        (Check.BUCKET, Problem.CONFIGURATION, True),
        (Check.RUNPOD, Problem.CONFIGURATION, True),
        (Check.SEARCH_ATTRIBUTES, Problem.CONFIGURATION, True),
    ],
)
def test_the_worker_starts_through_an_s3_or_runpod_outage_but_not_a_wrong_setting(
    check: Check, problem: Problem, refused: bool
) -> None:
    assert refuses_start(fail(check, "what was found", problem)) is refused
