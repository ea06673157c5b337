"""The batch commands without a server: a JSONL batch file read (or refused by its line), the
option combinations `submit` refuses before reading or connecting, what `--count` sends, and how
a batch is shown and what it exits with."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from configuration.processes import CliConfig
from starter.batches import BatchSubmitted
from starter.cli import batches, build_app
from starter.cli.batches import (
    FollowedBatch,
    batch_code,
    jobs_table,
    parse_batch_lines,
    result_lines,
    status_lines,
    submitted_json,
    watch_line,
)
from starter.cli.common import ExitCode, exit_code_for
from starter.errors import BatchConflict, InvalidBatch
from tests.conftest import free_port
from tests.support.cli import EXAMPLE, ROOT, example, logging_restored
from workflows.batches import (
    MAX_BATCH_JOBS,
    BatchCost,
    BatchJob,
    BatchJobEnd,
    BatchRequest,
    BatchResults,
    BatchState,
    BatchStatus,
)
from workflows.contracts import Artifact, JobError, JobRequest


def dead_env() -> dict[str, str]:
    """A Temporal address nobody answers: a refusal must come before any connection."""
    return {"TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}"}


def invoke(*args: str, env: dict[str, str] | None = None, stdin: str | None = None) -> Any:
    with logging_restored():
        result = CliRunner().invoke(build_app(), list(args), env=env or dead_env(), input=stdin)
    return result.exit_code, result.stdout, result.stderr


def request_line(**fields: Any) -> str:
    return json.dumps({"graph": example(steps=1), **fields})


def unseeded_graph() -> dict[str, Any]:
    return {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": 16, "height": 16, "batch_size": 1, "color": 1},
        },
        "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "u"}},
    }


# -- the batch file -----------------------------------------------------------------------------


def test_a_batch_file_is_one_request_per_line_and_blank_lines_are_skipped() -> None:
    lines = ["", request_line(pool="gpu"), "   ", request_line(priority=2), ""]
    requests = parse_batch_lines(lines, "jobs.jsonl")
    assert [(r.pool, r.priority) for r in requests] == [("gpu", 3), (None, 2)]
    assert all(isinstance(r, JobRequest) for r in requests)


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        ('{"graph": ', "jobs.jsonl, line 3 is not JSON"),
        ("[1, 2]", "jobs.jsonl, line 3 is a JSON list, not a job request"),
        (request_line(colour=1), "jobs.jsonl, line 3: colour: Extra inputs are not permitted"),
        ('{"pool": "gpu"}', "jobs.jsonl, line 3: graph: Field required"),
        (request_line(priority=9), "jobs.jsonl, line 3: priority: Input should be less than"),
        (
            request_line(segments=[{"3": {"sede": 1}}]),
            "jobs.jsonl, line 3: segment 0: node '3' (KSampler) has no input 'sede'",
        ),
    ],
    ids=["not-json", "not-an-object", "unknown-field", "no-graph", "bad-field", "bad-override"],
)
def test_a_line_that_is_not_a_request_is_refused_by_its_number(bad: str, said: str) -> None:
    with pytest.raises(InvalidBatch) as caught:
        parse_batch_lines([request_line(), "", bad, request_line()], "jobs.jsonl")
    assert str(caught.value).startswith(said), caught.value


def test_an_empty_batch_file_or_one_over_the_limit_is_refused() -> None:
    with pytest.raises(InvalidBatch, match="holds no request"):
        parse_batch_lines(["", "  "], "jobs.jsonl")
    line = request_line()
    parse_batch_lines([line] * MAX_BATCH_JOBS, "jobs.jsonl")
    with pytest.raises(InvalidBatch, match=f"line {MAX_BATCH_JOBS + 2} is request 1,001"):
        parse_batch_lines([""] + [line] * (MAX_BATCH_JOBS + 1), "jobs.jsonl")


def test_submit_refuses_a_bad_line_naming_it_before_connecting(tmp_path: Path) -> None:
    path = tmp_path / "jobs.jsonl"
    path.write_text("\n".join([request_line(), "", request_line(), '{"graph": 3}']) + "\n")
    code, out, err = invoke("submit", "--batch", str(path), "--json")
    assert (code, out) == (ExitCode.BAD_INPUT, ""), err
    assert err.startswith(f"error: {path}, line 4: graph: "), err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("kind", ["missing", "directory", "binary"])
def test_an_unreadable_batch_file_is_one_line_and_exit_2(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "jobs.jsonl"
    if kind == "directory":
        path.mkdir()
    elif kind == "binary":
        path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    code, out, err = invoke("submit", "--batch", str(path))
    assert (code, out) == (ExitCode.BAD_INPUT, ""), err
    assert err.startswith("error: ") and err.count("\n") == 1 and str(path) in err, err


def test_a_batch_file_can_come_from_stdin() -> None:
    code, out, err = invoke("submit", "--batch", "-", stdin=request_line() + "\nnot json\n")
    assert (code, out) == (ExitCode.BAD_INPUT, ""), err
    assert err.startswith("error: stdin, line 2 is not JSON"), err


# -- submit's options ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["GRAPH", "--batch", "JOBS"], "give GRAPH or --batch, not both"),
        ([], "give the graph to submit"),
        (["GRAPH", "--count", "2", "--batch", "JOBS"], "give GRAPH or --batch, not both"),
        (["--count", "2", "--batch", "JOBS"], "--count makes a batch of GRAPH; --batch reads"),
        (["--batch", "JOBS", "--pool", "gpu", "--priority", "2"], "--pool, --priority with"),
        (["GRAPH", "--count", "2", "--job-id", "j"], "--job-id names one job; a batch's ID is"),
        (["--batch", "JOBS", "--job-id", "j"], "--job-id names one job; a batch's ID is"),
        (["GRAPH", "--batch-id", "b"], "--batch-id names a batch: add --count N"),
        (["GRAPH", "--count", "2", "--batch-id", "bad id"], "batch id 'bad id' is not valid"),
    ],
    ids=[
        "graph-and-batch",
        "neither",
        "graph-count-batch",
        "count-and-batch",
        "options-with-batch",
        "job-id-with-count",
        "job-id-with-batch",
        "batch-id-for-a-job",
        "bad-batch-id",
    ],
)
def test_submit_refuses_options_that_make_neither_one_job_nor_one_batch(
    tmp_path: Path, args: list[str], said: str
) -> None:
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(request_line() + "\n")
    paths = {"GRAPH": str(EXAMPLE), "JOBS": str(jobs)}
    code, out, err = invoke("submit", *[paths.get(arg, arg) for arg in args], "--json")
    assert (code, out) == (ExitCode.BAD_INPUT, ""), err
    assert err.startswith(f"error: {said}"), err
    assert "Traceback" not in err


def test_count_of_a_graph_without_seeds_is_refused_saying_why(tmp_path: Path) -> None:
    graph = tmp_path / "graph.json"
    graph.write_text(json.dumps(unseeded_graph()))
    code, out, err = invoke("submit", str(graph), "--count", "3")
    assert (code, out) == (ExitCode.BAD_INPUT, ""), err
    assert "--count varies the graph's seeds" in err and "no literal `seed`" in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize("count", ["0", str(MAX_BATCH_JOBS + 1)])
def test_a_count_out_of_range_is_bad_input(count: str) -> None:
    code, out, err = invoke("submit", str(EXAMPLE), "--count", count)
    assert (code, out) == (ExitCode.BAD_INPUT, "")
    assert "Invalid value for '--count'" in err, err


class FakeClient:
    """What `submit` asks of a client for a batch, recorded."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, str | None]] = []

    async def submit_batch(self, batch: Any, *, batch_id: str | None = None) -> BatchSubmitted:
        self.sent.append((batch, batch_id))
        assert batch_id is not None
        total = len(batch.expanded()) if isinstance(batch, BatchRequest) else len(batch)
        job_ids = [f"{batch_id}-{n + 1:04d}" for n in range(total)]
        status = BatchStatus(
            batch_id=batch_id, total=total, jobs=[BatchJob(job_id=j) for j in job_ids]
        )
        return BatchSubmitted(
            batch_id=batch_id, existed=False, job_ids=job_ids, started=total, status=status
        )


@pytest.fixture
def fake_client(monkeypatch: pytest.MonkeyPatch) -> FakeClient:
    client = FakeClient()

    @asynccontextmanager
    async def job_client(_config: CliConfig, with_store: bool = False) -> AsyncIterator[Any]:
        yield client

    monkeypatch.setattr(batches, "job_client", job_client)
    return client


def test_count_sends_one_request_whose_options_every_job_gets(
    fake_client: FakeClient, tmp_path: Path
) -> None:
    code, out, err = invoke(
        "submit",
        str(EXAMPLE),
        "--count",
        "3",
        "--pool",
        "gpu",
        "--priority",
        "2",
        "--start-by",
        "60",
        "--batch-id",
        "my-batch",
        "--json",
    )
    assert code == ExitCode.OK, err
    [(batch, batch_id)] = fake_client.sent
    assert batch_id == "my-batch" and isinstance(batch, BatchRequest) and batch.count == 3
    jobs = batch.expanded()
    assert [(j.pool, j.priority, j.policy.start_by_s) for j in jobs] == [("gpu", 2, 60.0)] * 3
    assert len({j.graph["3"]["inputs"]["seed"] for j in jobs}) == 3
    [line] = out.splitlines()
    document = json.loads(line)
    assert document["batch_id"] == "my-batch" and document["total"] == 3
    assert document["existed"] is False and document["started"] == 3
    assert [job["job_id"] for job in document["jobs"]] == [
        "my-batch-0001",
        "my-batch-0002",
        "my-batch-0003",
    ]


def test_a_batch_file_is_sent_as_its_requests_and_its_id_printed(
    fake_client: FakeClient, tmp_path: Path
) -> None:
    path = tmp_path / "jobs.jsonl"
    path.write_text(f"{request_line(pool='a')}\n\n{request_line(pool='b')}\n")
    code, out, err = invoke("submit", "--batch", str(path))
    assert code == ExitCode.OK, err
    [(batch, batch_id)] = fake_client.sent
    assert [request.pool for request in batch] == ["a", "b"]
    assert batch_id is not None and batch_id.startswith("batch-")
    assert f"submitted batch {batch_id}: 2 job(s), {batch_id}-0001 to {batch_id}-0002" in out
    assert f"durable-comfy batch watch {batch_id}" in out


# -- the batch commands ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [["status", "bad id"], ["watch", "bad id", "--json"], ["cancel", "bad/id"], ["result", "b d"]],
    ids=lambda args: args[0],
)
def test_an_invalid_batch_id_is_one_line_and_exit_2(args: list[str]) -> None:
    code, out, err = invoke("batch", *args)
    assert (code, out) == (ExitCode.BAD_INPUT, "")
    assert err.startswith("error: batch id ") and err.count("\n") == 1, err


def test_a_batch_under_an_id_another_batch_holds_is_a_conflict() -> None:
    assert exit_code_for(BatchConflict("b")) == ExitCode.CONFLICT
    assert exit_code_for(InvalidBatch("two tenants")) == ExitCode.BAD_INPUT


def running_status() -> BatchStatus:
    return BatchStatus(
        batch_id="b1",
        state=BatchState.RUNNING,
        total=4,
        ended=2,
        counts={"COMPLETED": 1, "FAILED": 1, "RUNNING": 1},
        progress=0.6,
        cost=BatchCost(gpu_s=12.5, usd=0.0123),
        artifacts=1,
        jobs=[
            BatchJob(job_id="b1-0001", state="COMPLETED", artifacts=1),
            BatchJob(
                job_id="b1-0002", state="FAILED", error=JobError(type="InvalidGraph", message="x")
            ),
            BatchJob(job_id="b1-0003-" + "long" * 30, state="RUNNING", percent=40),
            BatchJob(job_id="b1-0004"),
        ],
    )


def test_status_says_state_counts_progress_cost_and_every_job() -> None:
    lines = status_lines(running_status())
    assert lines[:6] == [
        "batch b1: RUNNING",
        "  4 jobs, 2 ended: COMPLETED 1, FAILED 1, RUNNING 1, 1 not started",
        "  progress 60%",
        "  cost 12.5 GPU s ($0.0123)",
        "  1 artifact(s)",
        "",
    ]
    table = lines[6:]
    assert table[0].split() == ["job", "state", "progress", "%", "artifacts", "error"]
    assert table[1].split() == ["b1-0001", "COMPLETED", "1"]
    assert table[2].split() == ["b1-0002", "FAILED", "0", "InvalidGraph:", "x"]
    assert table[3].split()[:3] == ["b1-0003-" + "long" * 30, "RUNNING", "40"]
    assert table[4].split() == ["b1-0004", "-", "0"]


def test_the_jobs_table_never_cuts_a_job_id() -> None:
    long_id = "batch-" + "x" * 180 + "-0001"
    [_header, row] = jobs_table([BatchJob(job_id=long_id, state="COMPLETED")])
    assert row.split()[0] == long_id


def test_a_watch_line_says_state_ended_progress_and_counts() -> None:
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert watch_line(running_status(), at).split() == (
        "03:04:05 RUNNING 2/4 ended 60% COMPLETED 1, FAILED 1, RUNNING 1, 1 not started".split()
    )


def test_exit_0_only_when_every_job_completed() -> None:
    done = BatchStatus(batch_id="b", state="COMPLETED", total=2, ended=2, counts={"COMPLETED": 2})
    assert batch_code(done) == ExitCode.OK
    mixed = done.model_copy(update={"counts": {"COMPLETED": 1, "FAILED": 1}})
    assert batch_code(mixed) == ExitCode.JOB_NOT_COMPLETED
    cancelled = done.model_copy(update={"state": "CANCELLED", "counts": {"CANCELLED": 2}})
    assert batch_code(cancelled) == ExitCode.JOB_NOT_COMPLETED
    assert batch_code(None) == ExitCode.JOB_NOT_COMPLETED


def test_result_lists_each_job_its_error_and_its_artifacts_with_urls() -> None:
    artifact = Artifact(
        key="jobs/b1-0001/0/9/a.png",
        uri="s3://bucket/jobs/b1-0001/0/9/a.png",
        size=10,
        sha256="0" * 64,
        content_type="image/png",
        node_id="9",
        url="https://s3.example/a.png?sig",
    )
    results = BatchResults(
        batch_id="b1",
        state="COMPLETED",
        ends=[
            BatchJobEnd(job_id="b1-0001", state="COMPLETED", artifacts=[artifact]),
            BatchJobEnd(
                job_id="b1-0002", state="FAILED", error=JobError(type="Oom", message="no memory")
            ),
        ],
    )
    status = BatchStatus(
        batch_id="b1", state="COMPLETED", total=2, counts={"COMPLETED": 1, "FAILED": 1}
    )
    assert result_lines(results, status) == [
        "batch b1: COMPLETED, 1 of 2 jobs COMPLETED",
        "b1-0001  COMPLETED",
        f"  {artifact.uri}  10 bytes  sha256 {'0' * 64}",
        "    https://s3.example/a.png?sig",
        "b1-0002  FAILED",
        "  error Oom: no memory",
    ]


def test_the_submit_line_is_a_batch_status_plus_existed_and_started() -> None:
    status = running_status()
    submitted = BatchSubmitted(
        batch_id="b1", existed=True, job_ids=["b1-0001"], started=0, status=status
    )
    document = json.loads(submitted_json(submitted))
    assert document.pop("existed") is True and document.pop("started") == 0
    assert BatchStatus.model_validate(document) == status


def test_an_interrupt_says_what_becomes_of_the_batch() -> None:
    followed = FollowedBatch("b1", submitting=True)
    assert "--batch-id b1 starts only the jobs it lacks" in followed.on_interrupt()
    followed.submitting = False
    assert "durable-comfy batch watch b1" in followed.on_interrupt()
    followed.status = BatchStatus(batch_id="b1", state="CANCELLED")
    assert followed.on_interrupt() == "batch b1 had already ended CANCELLED"


def test_the_docs_name_every_batch_command_and_option() -> None:
    section = (ROOT / "docs" / "cli.md").read_text().split("### Batches", 1)[1]
    for name in ("status", "watch", "cancel", "result"):
        assert f"batch {name}" in section
    for option in ("--count", "--batch ", "--batch-id", "--reason", "--json", "--watch"):
        assert option in section, option
