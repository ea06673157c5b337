"""The `durable-comfy` CLI's contract: one exit-code table, stdout for results only.

Unit tests call the commands in-process (no server); the rest run the CLI as a subprocess
against the real local stack, with a worker of this module's own. Every `--json` stdout is
parsed as exactly one JSON document per line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
from temporalio.client import WorkflowExecutionStatus
from typer.testing import CliRunner

from activities.log_setup import configure_logging
from devstack.models import RunningStack
from starter import JobRequest, JobState, JobStatus
from starter.cli import build_app
from starter.cli.common import ExitCode
from starter.cli.control import table_lines
from starter.cli.render import Followed, stream_json, summary_lines
from starter.errors import InvalidOverride, RequestTooLarge
from starter.requests import check_segment_overrides, request_from_files, request_sha256
from tests.conftest import free_port
from tests.support.cli import (
    EXAMPLE,
    ROOT,
    RunningWorker,
    cli_env,
    example,
    interrupt_cli,
    json_lines,
    run_cli,
    start_cli,
)
from workflows.contracts import Decision, JobPolicy, Progress, S3Input
from workflows.shared import ErrorType

# -- without a server ---------------------------------------------------------------------------


def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(build_app(), list(args), env=env)
    return result.exit_code, result.stdout, result.stderr


def test_the_documented_exit_code_table_is_the_one_the_cli_uses() -> None:
    cli_doc = (ROOT / "docs" / "cli.md").read_text()
    table = cli_doc.split("### Exit codes", 1)[1].split("\n\n| code | meaning |", 1)[1]
    documented = [int(code) for code in re.findall(r"^\| (\d+) \|", table, re.MULTILINE)]
    assert documented == [int(code) for code in ExitCode]


def test_an_override_of_an_input_the_node_lacks_is_refused_naming_node_and_input(
    tmp_path: Path,
) -> None:
    graph = example()
    with pytest.raises(InvalidOverride, match=r"node '3' \(KSampler\) has no input 'sede'"):
        check_segment_overrides(graph, [{"3": {"seed": 1}}, {"3": {"sede": 1}}])
    with pytest.raises(InvalidOverride, match="segment 0: node '42' is not in the graph"):
        check_segment_overrides(graph, [{"42": {"seed": 1}}])
    check_segment_overrides(graph, [{"3": {"seed": 1, "steps": 2}}, {"5": {"width": 64}}])

    segments = tmp_path / "segments.json"
    segments.write_text(json.dumps([{"3": {"sede": 1}}]))
    # A dead address: the refusal must come before any connection is tried.
    env = {"TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}"}
    code, out, err = invoke("submit", str(EXAMPLE), "--segments", str(segments), env=env)
    assert (code, out) == (ExitCode.BAD_INPUT, "")
    assert "node '3' (KSampler) has no input 'sede'" in err and "seed" in err


def test_list_refuses_a_state_that_does_not_exist_and_names_the_valid_ones() -> None:
    code, out, err = invoke("list", "--state", "BOGUS", "--json")
    assert (code, out) == (ExitCode.BAD_INPUT, "")
    assert "'BOGUS' is not a job state" in err
    assert all(state.value in err for state in JobState)


@pytest.mark.parametrize(
    "args",
    [
        ["status", "bad id"],
        ["watch", "bad id", "--json"],
        ["result", "bad/id"],
        ["cancel", "bad id"],
        ["resume", "bad id"],
        ["submit", str(EXAMPLE), "--job-id", "bad id"],
    ],
    ids=lambda args: args[0],
)
def test_an_invalid_job_id_is_one_line_and_exit_2(args: list[str]) -> None:
    code, out, err = invoke(*args, env={"TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}"})
    assert (code, out) == (ExitCode.BAD_INPUT, "")
    assert err.startswith("error: job id ") and err.count("\n") == 1, err


@pytest.mark.parametrize("kind", ["png", "directory", "missing", "not-json", "list"])
def test_an_unreadable_graph_file_is_one_line_and_exit_2(tmp_path: Path, kind: str) -> None:
    """docs/cli.md: bad input is one line on stderr and exit 2, never a traceback (a PNG given
    as the graph raised UnicodeDecodeError, a directory IsADirectoryError, exit 1)."""
    path = tmp_path / "graph.json"
    if kind == "png":
        path = tmp_path / "cat.png"
        path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    elif kind == "directory":
        path.mkdir()
    elif kind == "not-json":
        path.write_text("{nodes: 1}")
    elif kind == "list":
        path.write_text("[]")
    code, out, err = invoke(
        "submit", str(path), env={"TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}"}
    )
    assert (code, out) == (ExitCode.BAD_INPUT, ""), err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and str(path) in err


def test_a_client_that_dialled_the_default_address_says_so_and_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No TEMPORAL_ADDRESS, no profile: the client dials Temporal's default, which on a shared
    machine may be someone else's server; when nothing answers it names the address and why."""
    nobody = f"127.0.0.1:{free_port()}"
    monkeypatch.setattr("starter.connection.DEFAULT_ADDRESS", nobody)
    unset = {k: None for k in os.environ if k.startswith("TEMPORAL_")}
    env: dict[str, str | None] = unset | {"HOME": str(tmp_path)}
    result = CliRunner().invoke(build_app(), ["status", "some-job"], env=env)
    code, out, err = result.exit_code, result.stdout, result.stderr
    assert (code, out) == (ExitCode.UNREACHABLE, ""), err
    assert f"cannot reach Temporal at {nobody}" in err, err
    assert "no TEMPORAL_ADDRESS is set and no temporal.toml profile names one" in err, err
    # Named by a variable, it is that address, without the default's warning.
    result = CliRunner().invoke(
        build_app(), ["status", "some-job"], env=env | {"TEMPORAL_ADDRESS": nobody}
    )
    assert result.exit_code == ExitCode.UNREACHABLE and "default" not in result.stderr


def test_an_s3_input_travels_as_a_reference(tmp_path: Path) -> None:
    request = request_from_files(EXAMPLE, inputs=["face.png=s3://inputs/faces/1.png"])
    assert request.inputs == {"face.png": S3Input(uri="s3://inputs/faces/1.png")}
    code, _out, err = invoke("submit", str(EXAMPLE), "--input", "face.png=s3://bucket-only")
    assert code == ExitCode.BAD_INPUT and "not s3://BUCKET/KEY" in err


def test_the_request_fingerprint_ignores_key_order() -> None:
    graph = example()
    shuffled = json.loads(json.dumps({key: graph[key] for key in reversed(list(graph))}))
    assert request_sha256(JobRequest(graph=graph)) == request_sha256(JobRequest(graph=shuffled))
    graph["3"]["inputs"]["seed"] += 1
    assert request_sha256(JobRequest(graph=graph)) != request_sha256(JobRequest(graph=shuffled))


def test_list_table_never_cuts_a_job_id() -> None:
    long_id = "render-" + "x" * 180
    rows: list[dict[str, str | int | None]] = [
        {"job_id": long_id, "state": "RUNNING", "progress": 5, "pool": "a", "started": "t"},
        {"job_id": "short", "state": None, "progress": None, "pool": None, "started": "t"},
    ]
    lines = table_lines(rows)
    assert lines[1].startswith(long_id + "  RUNNING")
    assert lines[2].split()[0] == "short"


def test_human_status_shows_progress_queue_place_and_the_decision() -> None:
    waiting = JobStatus(
        job_id="j",
        state=JobState.WAITING,
        progress=Progress(step=3, total_steps=20, fraction=0.15, queue_position=2),
        abandon_after_s=300,
    )
    lines = summary_lines(waiting)
    assert lines[0] == "progress 15%, 3/20 steps, #2 in the backend's queue"
    assert "attached: abandoned after 300 s without a watcher" in lines
    paused = JobStatus(
        job_id="j",
        state=JobState.NEEDS_DECISION,
        decision=Decision(
            reason="the backend lost the prompt twice",
            options={"resume --resubmit": "runs it again", "cancel": "ends it"},
        ),
    )
    lines = summary_lines(paused)
    assert "decision needed: the backend lost the prompt twice" in lines
    assert "  durable-comfy resume --resubmit j: runs it again" in lines
    assert "  durable-comfy cancel j: ends it" in lines


def test_an_interrupt_says_what_becomes_of_the_job() -> None:
    followed = Followed("j")
    followed.seen(JobStatus(job_id="j", state=JobState.RUNNING, abandon_after_s=120))
    note = followed.on_interrupt()
    assert "ABANDONED" in note and "after 120 s" in note and "durable-comfy watch j" in note
    followed.seen(JobStatus(job_id="j", state=JobState.RUNNING, detached=True))
    assert "keeps running" in followed.on_interrupt()


def test_watch_json_after_submit_skips_only_a_repeat_of_submits_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`submit --watch --json` printed submit's status already; the watch's first answer
    repeats it and is left out, but a step pushed under the same seq is a new line."""

    def status(state: JobState, step: int, seq: int = 0) -> JobStatus:
        return JobStatus(
            job_id="j",
            state=state,
            seq=seq,
            progress=Progress(step=step, total_steps=20, segments=1),
        )

    submitted = status(JobState.QUEUED, 0)
    watched = [
        status(JobState.QUEUED, 0),  # the repeat: skipped
        status(JobState.RUNNING, 4),  # pushed before the first answer, still seq 0
        status(JobState.RUNNING, 4, seq=3),
        status(JobState.QUEUED, 0),  # once anything else was printed, nothing is a repeat
        status(JobState.COMPLETED, 20, seq=9),
    ]

    async def statuses() -> AsyncIterator[JobStatus]:
        for each in watched:
            yield each

    last = asyncio.run(stream_json(statuses(), already_shown=submitted))
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(p["state"], p["seq"], p["progress"]["step"]) for p in printed] == [
        ("RUNNING", 0, 4),
        ("RUNNING", 3, 4),
        ("QUEUED", 0, 0),
        ("COMPLETED", 9, 20),
    ]
    assert last == watched[-1]


def test_logs_go_to_stderr_as_json_lines_when_it_is_not_a_terminal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    try:
        configure_logging("INFO")
        structlog.get_logger("t").warning("something_happened", job_id="j")
        logging.getLogger("temporalio.core").warning("core says %s", "hi")
        out, err = capsys.readouterr()
    finally:
        structlog.reset_defaults()
        for handler in logging.getLogger().handlers[:]:
            if type(handler).__name__ == "_StderrHandler":
                logging.getLogger().removeHandler(handler)
    assert out == ""
    events = [json.loads(line) for line in err.splitlines()]
    assert [e["event"] for e in events] == ["something_happened", "core says hi"]
    assert events[0]["job_id"] == "j" and events[1]["logger"] == "temporalio.core"


# -- against the local stack --------------------------------------------------------------------


def tiny_graph(prefix: str = "cli") -> dict[str, Any]:
    """Three quick nodes and one PNG artifact."""
    return {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": 16, "height": 16, "batch_size": 1, "color": uuid.uuid4().int % 99},
        },
        "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": prefix}},
    }


def write_graph(tmp_path: Path, graph: dict[str, Any], name: str = "graph.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(graph))
    return path


def unique_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def until_the_simulator_runs_a_prompt(stack: RunningStack, within_s: float = 30) -> None:
    """ComfyUI's own `/queue` lists a running prompt (the module's tests run one at a time)."""
    async with httpx.AsyncClient(trust_env=False) as http:
        deadline = asyncio.get_running_loop().time() + within_s
        while asyncio.get_running_loop().time() < deadline:
            queue = (await http.get(f"{stack.comfyui_url}/queue")).json()
            if queue.get("queue_running"):
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"no prompt ran within {within_s} s")


async def until_running(worker: RunningWorker, job_id: str) -> JobStatus:
    """Until the job itself says RUNNING (or has ended). Not a watch: it shows the follow's
    heartbeat, which says RUNNING before the job hears of it in the follow's first report,
    and the job's own messages (resume, cancel) answer from the job's state."""
    async with asyncio.timeout(60):
        while True:
            status = (await worker.client.events(job_id)).status
            if status.state == JobState.RUNNING or status.terminal:
                return status
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("args", [["status", "some-job"], ["list"]], ids=lambda a: a[0])
async def test_a_namespace_the_server_lacks_says_how_to_fix_it(
    local_stack: RunningStack, args: list[str]
) -> None:
    """As `doctor` says it: exit 2, one line naming the namespace and the server, and the
    command that creates it (it was exit 3, "Temporal refused", and no hint)."""
    env = cli_env(local_stack, "cli-no-namespace") | {"TEMPORAL_NAMESPACE": "no-such-namespace"}
    code, out, err = await run_cli(*args, env=env)
    assert (code, out) == (ExitCode.BAD_INPUT, ""), err
    assert "namespace 'no-such-namespace' does not exist on" in err, err
    assert "temporal operator namespace create --namespace no-such-namespace" in err
    assert err.count("\n") == 1 and "Traceback" not in err, err


async def test_exit_0_and_stdout_holds_only_json_lines(
    worker: RunningWorker, local_stack: RunningStack, tmp_path: Path
) -> None:
    env = cli_env(local_stack, worker.task_queue)
    # A long ID: `list` must print it whole even at 80 columns (stdout is not a terminal here).
    job_id = unique_id("cli-" + "long" * 40)
    graph_file = write_graph(tmp_path, tiny_graph())
    code, out, err = await run_cli("submit", str(graph_file), "--job-id", job_id, "--json", env=env)
    assert code == ExitCode.OK, err
    [submitted] = json_lines(out)
    assert submitted["job_id"] == job_id and submitted["existed"] is False

    code, out, err = await run_cli("watch", job_id, "--json", env=env)
    assert code == ExitCode.OK, err
    assert json_lines(out)[-1]["state"] == "COMPLETED"

    download = tmp_path / "out"
    (code, out, err), (s_code, s_out, s_err), (l_code, l_out, l_err) = await asyncio.gather(
        run_cli("result", job_id, "--download", str(download), "--json", env=env),
        run_cli("status", job_id, "--json", env=env),
        run_cli("list", "--limit", "200", env=env),
    )
    assert (code, s_code, l_code) == (ExitCode.OK, ExitCode.OK, ExitCode.OK), err + s_err + l_err
    [final] = json_lines(out)
    assert final["state"] == "COMPLETED" and final["artifacts"][0]["url"].startswith("http")
    assert [p.suffix for p in download.rglob("*") if p.is_file()] == [".png"]
    assert json_lines(s_out)[0]["state"] == "COMPLETED"
    assert any(line.split()[0] == job_id for line in l_out.splitlines()), l_out


async def test_exit_0_for_the_same_request_under_an_id_and_4_for_another(
    worker: RunningWorker, local_stack: RunningStack, tmp_path: Path
) -> None:
    env = cli_env(local_stack, worker.task_queue)
    job_id = unique_id("idem")
    # 30 s: still running while three CLI processes (slow to start on a loaded machine: a few
    # seconds each) submit; cancelled once they have answered.
    graph = example(steps=1500)
    same = write_graph(tmp_path, graph, "same.json")
    graph["3"]["inputs"]["seed"] = 1
    other = write_graph(tmp_path, graph, "other.json")
    code, _out, err = await run_cli("submit", str(same), "--job-id", job_id, "--json", env=env)
    assert code == ExitCode.OK, err
    running = await until_running(worker, job_id)
    assert running.state == JobState.RUNNING

    (code, out, err), (c_code, c_out, c_err), (h_code, h_out, h_err) = await asyncio.gather(
        run_cli("submit", str(same), "--job-id", job_id, "--json", env=env),
        run_cli("submit", str(other), "--job-id", job_id, "--json", env=env),
        run_cli("submit", str(same), "--job-id", job_id, env=env),
    )
    assert code == ExitCode.OK, err
    [again] = json_lines(out)
    assert again["existed"] is True and again["state"] == "RUNNING" and again["seq"] > 0
    assert "job_already_exists" in err
    assert h_code == ExitCode.OK and "already exists (RUNNING)" in h_out, h_err
    assert (c_code, c_out) == (ExitCode.CONFLICT, "")
    assert f"job ID {job_id!r} is already used by a different request" in c_err

    await worker.client.cancel(job_id)
    final = await worker.client.wait(job_id)
    assert final.state == JobState.CANCELLED
    code, out, err = await run_cli("submit", str(same), "--job-id", job_id, "--json", env=env)
    assert code == ExitCode.OK, err
    [ended] = json_lines(out)
    assert ended["existed"] is True and ended["state"] == "CANCELLED"


async def test_exit_1_when_the_job_ends_otherwise_than_completed(
    worker: RunningWorker, local_stack: RunningStack, tmp_path: Path
) -> None:
    env = cli_env(local_stack, worker.task_queue)
    graph_file = write_graph(tmp_path, tiny_graph())
    code, out, err = await run_cli(
        "submit", str(graph_file), "--pool", "no-such-pool", "--watch", "--json", env=env
    )
    assert code == ExitCode.JOB_NOT_COMPLETED, err
    lines = json_lines(out)
    assert lines[0]["existed"] is False
    assert lines[-1]["state"] == "FAILED" and lines[-1]["error"]["type"] == ErrorType.UNKNOWN_POOL
    code, out, err = await run_cli("result", lines[-1]["job_id"], "--json", env=env)
    assert code == ExitCode.JOB_NOT_COMPLETED, err
    assert json_lines(out)[0]["state"] == "FAILED"


async def test_exit_2_for_a_missing_job_a_request_too_large_or_downloads_without_s3(
    worker: RunningWorker, local_stack: RunningStack, tmp_path: Path
) -> None:
    env = cli_env(local_stack, worker.task_queue)
    no_s3 = {k: v for k, v in env.items() if not k.startswith("AWS_")}
    no_s3.pop("DURABLE_COMFY_BUCKET", None)
    inputs = []
    for name in ("a.png", "b.png"):  # each under the inline limit, together over it
        (tmp_path / name).write_bytes(os.urandom(1024 * 1024))
        inputs += ["--input", f"{name}={tmp_path / name}"]
    missing = unique_id("missing")
    done = await worker.client.submit(JobRequest(graph=tiny_graph()))
    results = await asyncio.gather(
        run_cli("status", missing, "--json", env=env),
        run_cli("watch", missing, env=env),
        run_cli("cancel", missing, env=env),
        run_cli("submit", str(EXAMPLE), *inputs, "--json", env=no_s3),  # nowhere to stage
        run_cli("result", done.job_id, "--download", str(tmp_path / "dl"), "--json", env=no_s3),
    )
    for code, out, _err in results:
        assert (code, out) == (ExitCode.BAD_INPUT, "")  # `watch` drew no bar either
    errors = [err for _code, _out, err in results]
    for err in errors[:3]:
        assert err == f"error: no job {missing!r} in this namespace\n"
    assert "inline inputs together over 1,048,576 bytes do not fit" in errors[3]
    assert "DURABLE_COMFY_BUCKET" in errors[3] and "=s3://BUCKET/KEY" in errors[3]
    assert errors[4].startswith("error: downloading needs the artifact bucket")
    assert errors[4].count("\n") == 1

    # Past the client's own size check, the server's rejection reads the same. (Inputs no
    # longer make a request that large: the client stages them. Thousands of long segment
    # overrides still can.)
    segments = tmp_path / "segments.json"
    segments.write_text(json.dumps([{"6": {"text": f"{i} " + "x" * 300}} for i in range(8000)]))
    request = request_from_files(EXAMPLE, segments_path=segments)
    worker.client.max_request_bytes = 10 * 2**20
    try:
        with pytest.raises(RequestTooLarge, match="over the server's limit"):
            await worker.client.submit(request)
    finally:
        worker.client.max_request_bytes = 2 * 2**20


async def test_exit_3_when_temporal_or_a_worker_does_not_answer(
    worker: RunningWorker, local_stack: RunningStack, tmp_path: Path
) -> None:
    unreachable = {k: v for k, v in os.environ.items() if not k.startswith("TEMPORAL_")}
    unreachable["TEMPORAL_ADDRESS"] = f"127.0.0.1:{free_port()}"
    code, out, err = await run_cli("status", "some-job", "--json", env=unreachable)
    assert (code, out) == (ExitCode.UNREACHABLE, "")
    assert err.startswith("error: cannot reach Temporal") and "hint: is the stack up?" in err

    nobody = unique_id("nobody")
    env = cli_env(local_stack, nobody) | {"DURABLE_COMFY_QUERY_TIMEOUT_S": "1"}
    graph_file = write_graph(tmp_path, tiny_graph())
    code, out, err = await run_cli("submit", str(graph_file), "--json", env=env)
    assert code == ExitCode.OK, err
    job_id = json_lines(out)[0]["job_id"]
    code, out, err = await run_cli("status", job_id, "--json", env=env)
    assert (code, out) == (ExitCode.UNREACHABLE, "")
    assert "no worker answered" in err and repr(nobody) in err

    # Terminated from outside: Temporal alone can say so, no worker needed.
    await worker.client.handle(job_id).terminate("test: the job nobody ran")
    code, out, err = await run_cli("status", job_id, "--json", env=env)
    assert code == ExitCode.OK, err
    [status] = json_lines(out)
    assert status["state"] == "TERMINATED" and "use cancel, not terminate" in str(status["error"])


async def test_a_terminated_job_ends_watch_as_terminated_and_cannot_be_cancelled(
    worker: RunningWorker, local_stack: RunningStack
) -> None:
    env = cli_env(local_stack, worker.task_queue)
    submitted = await worker.client.submit(JobRequest(graph=example(steps=100)), detached=True)
    await until_running(worker, submitted.job_id)
    await worker.client.handle(submitted.job_id).terminate("test: from outside")
    (w_code, w_out, w_err), (c_code, c_out, c_err), (s_code, s_out, s_err) = await asyncio.gather(
        run_cli("watch", submitted.job_id, "--json", env=env),
        run_cli("cancel", submitted.job_id, env=env),
        run_cli("status", submitted.job_id, env=env),
    )
    assert w_code == ExitCode.JOB_NOT_COMPLETED, w_err
    last = json_lines(w_out)[-1]
    assert last["state"] == "TERMINATED" and last["error"]["type"] == "Terminated"
    assert (c_code, c_out) == (ExitCode.CONFLICT, "")
    assert f"job {submitted.job_id!r} already ended TERMINATED" in c_err
    assert s_code == ExitCode.OK, s_err
    assert "TERMINATED" in s_out and "teardown did not run" in s_out


async def test_exit_4_when_resume_is_refused_or_the_job_has_ended(
    worker: RunningWorker, local_stack: RunningStack
) -> None:
    env = cli_env(local_stack, worker.task_queue)
    # 30 s (it is cancelled long before): still running while CLI processes start under load.
    submitted = await worker.client.submit(JobRequest(graph=example(steps=1500)), detached=True)
    await until_running(worker, submitted.job_id)
    code, out, err = await run_cli("resume", submitted.job_id, "--json", env=env)
    assert (code, out) == (ExitCode.CONFLICT, "")
    assert f"job {submitted.job_id!r} refused to resume: the job is RUNNING" in err

    code, out, err = await run_cli(
        "cancel", submitted.job_id, "--reason", "cli test", "--json", env=env
    )
    assert code == ExitCode.OK, err
    assert json_lines(out)[0]["state"] == "RUNNING"
    final = await asyncio.wait_for(worker.client.wait(submitted.job_id), timeout=30)
    assert final.state == JobState.CANCELLED
    assert final.error is not None and final.error.message == "cli test"
    description = await worker.client.handle(submitted.job_id).describe()
    assert description.status == WorkflowExecutionStatus.CANCELED

    (c_code, c_out, c_err), (r_code, r_out, r_err) = await asyncio.gather(
        run_cli("cancel", submitted.job_id, env=env),
        run_cli("resume", submitted.job_id, env=env),
    )
    assert (c_code, c_out, r_code, r_out) == (ExitCode.CONFLICT, "", ExitCode.CONFLICT, "")
    assert "already ended CANCELLED" in c_err and "nothing to cancel" in c_err
    assert "already ended CANCELLED" in r_err and "nothing to resume" in r_err


async def test_exit_5_when_a_downloaded_artifact_does_not_match_its_sha256(
    worker: RunningWorker, local_stack: RunningStack, tmp_path: Path
) -> None:
    env = cli_env(local_stack, worker.task_queue)
    done = await worker.client.submit(JobRequest(graph=tiny_graph()))
    final = await worker.client.wait(done.job_id)
    [artifact] = final.artifacts

    async def tampered() -> AsyncIterator[bytes]:
        yield b"not the bytes that were stored"

    await worker.store.upload_stream(artifact.key, tampered(), content_type="image/png")
    code, out, err = await run_cli(
        "result", done.job_id, "--download", str(tmp_path / "dl"), "--json", env=env
    )
    assert (code, out) == (ExitCode.STORAGE, "")
    assert "sha256" in err and err.count("\n") == 1


async def test_an_input_passed_by_s3_reference_reaches_its_load_node(
    worker: RunningWorker, local_stack: RunningStack, tmp_path: Path
) -> None:
    env = cli_env(local_stack, worker.task_queue)
    key = f"inputs/{uuid.uuid4().hex}/face.png"

    async def face() -> AsyncIterator[bytes]:
        yield b"\x89PNG\r\n\x1a\n" + os.urandom(64)

    await worker.store.upload_stream(key, face(), content_type="image/png")
    graph = {
        "1": {"class_type": "LoadImage", "inputs": {"image": "face.png"}},
        "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "s3"}},
    }
    uri = f"s3://{local_stack.bucket}/{key}"
    graph_file = write_graph(tmp_path, graph)
    args = ("submit", str(graph_file), "--input", f"face.png={uri}", "--watch", "--json")
    code, out, err = await run_cli(*args, env=env)
    lines = json_lines(out)
    assert code == ExitCode.OK, (lines[-1], err)
    assert lines[-1]["state"] == "COMPLETED" and len(lines[-1]["artifacts"]) == 1


async def test_ctrl_c_in_submit_watch_says_when_the_attached_job_is_abandoned(
    worker: RunningWorker, local_stack: RunningStack, tmp_path: Path
) -> None:
    env = cli_env(local_stack, worker.task_queue)
    graph_file = write_graph(tmp_path, example(steps=100))
    process = await start_cli("submit", str(graph_file), "--watch", "--json", env=env)
    assert process.stdout is not None
    first = json.loads(await asyncio.wait_for(process.stdout.readline(), timeout=30))
    job_id = first["job_id"]
    # Ready when the simulator runs the prompt (what the CLI watches is what is under test).
    await until_the_simulator_runs_a_prompt(local_stack)
    code, out, err = await interrupt_cli(process)
    assert code == ExitCode.INTERRUPTED, err
    json_lines(out)
    policy = JobPolicy()
    assert (
        f"job {job_id} is attached: it will be ABANDONED (its prompt stopped) after "
        f"{policy.abandon_after_s:g} s without a watcher unless watched again: "
        f"`durable-comfy watch {job_id}`"
    ) in err
    await worker.client.cancel(job_id, "test over")
    await asyncio.wait_for(worker.client.wait(job_id), timeout=30)


async def test_download_takes_credentials_from_botocores_default_chain(
    worker: RunningWorker, local_stack: RunningStack, tmp_path: Path
) -> None:
    # No AWS_* keys in the environment: a shared credentials file, as `aws configure` writes.
    env = {k: v for k, v in cli_env(local_stack, worker.task_queue).items()}
    key_id, secret = env.pop("AWS_ACCESS_KEY_ID"), env.pop("AWS_SECRET_ACCESS_KEY")
    credentials = tmp_path / "credentials"
    credentials.write_text(
        f"[default]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\n"
    )
    env["AWS_SHARED_CREDENTIALS_FILE"] = str(credentials)
    env["AWS_CONFIG_FILE"] = str(tmp_path / "no-config")
    done = await worker.client.submit(JobRequest(graph=tiny_graph()))
    await worker.client.wait(done.job_id)
    code, out, err = await run_cli(
        "result", done.job_id, "--download", str(tmp_path / "dl"), "--json", env=env
    )
    assert code == ExitCode.OK, err
    # The key ID is part of every presigned URL (X-Amz-Credential); the secret never shows.
    assert secret not in out + err
    downloaded = [p for p in (tmp_path / "dl").rglob("*") if p.is_file()]
    assert downloaded, out
