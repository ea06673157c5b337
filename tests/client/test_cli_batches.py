"""The batch commands against the real local stack: `submit --count` and `submit --batch`, then
`batch status`, `watch`, `cancel` and `result`, each run as a user runs the CLI (a subprocess
with the stack's environment), with this module's own worker."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

from temporalio.api.enums.v1 import EventType

from devstack.models import RunningStack
from starter import JobRequest, JobState
from starter.cli.common import ExitCode
from tests.support.cli import RunningWorker, cli_env, example, json_lines, run_cli
from workflows.batches import BatchStatus
from workflows.job_input import JobInput


def unique_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def job_request_of(worker: RunningWorker, job_id: str) -> JobRequest:
    """The request the job was started with, from the first event of its history."""
    client = worker.client
    # The batch's workflow starts its jobs: the submission may have answered before.
    await client._until_started(job_id)
    async for event in client.handle(job_id).fetch_history_events():
        assert event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED
        payloads = event.workflow_execution_started_event_attributes.input.payloads
        [raw] = await client.temporal.data_converter.decode(payloads, [JobInput])
        assert isinstance(raw, JobInput)
        return raw.request
    raise AssertionError("no history")


async def until_a_job_runs(worker: RunningWorker, batch_id: str) -> BatchStatus:
    async with asyncio.timeout(60):
        while True:
            status = await worker.client.batch_status(batch_id)
            if status.counts.get(JobState.RUNNING.value, 0) >= 1:
                return status
            await asyncio.sleep(0.1)


async def test_count_3_ends_with_three_completed_jobs_whose_seeds_differ(
    worker: RunningWorker, local_stack: RunningStack, tmp_path: Path
) -> None:
    env = cli_env(local_stack, worker.task_queue)
    graph = example(steps=2)
    graph_file = tmp_path / "graph.json"
    graph_file.write_text(json.dumps(graph))
    code, out, err = await run_cli(
        "submit", str(graph_file), "--count", "3", "--watch", "--json", env=env
    )
    assert code == ExitCode.OK, err
    lines = json_lines(out)
    submitted, final = lines[0], lines[-1]
    assert submitted["existed"] is False and submitted["started"] == 3
    batch_id = submitted["batch_id"]
    job_ids = [job["job_id"] for job in submitted["jobs"]]
    assert job_ids == [f"{batch_id}-000{n}" for n in (1, 2, 3)]
    assert all(line["batch_id"] == batch_id for line in lines)
    assert final["state"] == "COMPLETED" and final["counts"] == {"COMPLETED": 3}
    assert final["ended"] == 3 and final["progress"] == 1.0 and final["artifacts"] == 3

    seeds = [
        (await job_request_of(worker, job_id)).graph["3"]["inputs"]["seed"] for job_id in job_ids
    ]
    base = graph["3"]["inputs"]["seed"]
    assert seeds == [base, base + 1, base + 2]
    for job_id in job_ids:
        assert (await worker.client.status(job_id)).state == JobState.COMPLETED

    # Without --json: the batch's ID, a line per change, and how it ended.
    code, out, err = await run_cli("submit", str(graph_file), "--count", "2", "--watch", env=env)
    assert code == ExitCode.OK, err
    first, *changes, last = out.splitlines()
    assert first.startswith("submitted batch batch-") and "2 job(s)" in first, out
    assert changes and "COMPLETED" in changes[-1] and "2/2 ended" in changes[-1], out
    assert last.startswith("batch batch-") and "ended COMPLETED: 2 of 2 jobs COMPLETED" in last


async def test_a_batch_file_of_two_lines_then_its_status_watch_and_result(
    worker: RunningWorker, local_stack: RunningStack, tmp_path: Path
) -> None:
    env = cli_env(local_stack, worker.task_queue)
    batch_id = unique_id("cli-batch")
    jobs = tmp_path / "jobs.jsonl"
    lines = [
        json.dumps({"graph": example(steps=1), "labels": {"n": "one"}}),
        "",
        json.dumps({"graph": example(steps=2), "priority": 2, "labels": {"n": "two"}}),
    ]
    jobs.write_text("\n".join(lines) + "\n")
    code, out, err = await run_cli(
        "submit", "--batch", str(jobs), "--batch-id", batch_id, "--json", env=env
    )
    assert code == ExitCode.OK, err
    [submitted] = json_lines(out)
    assert submitted["batch_id"] == batch_id and submitted["total"] == 2
    assert [job["job_id"] for job in submitted["jobs"]] == [f"{batch_id}-0001", f"{batch_id}-0002"]
    started = [await job_request_of(worker, f"{batch_id}-000{n}") for n in (1, 2)]
    assert [(r.labels["n"], r.priority) for r in started] == [("one", 3), ("two", 2)]

    code, out, err = await run_cli("batch", "watch", batch_id, "--json", env=env)
    assert code == ExitCode.OK, err
    assert json_lines(out)[-1]["state"] == "COMPLETED"

    (s_code, s_out, s_err), (h_code, h_out, h_err), (r_code, r_out, r_err) = await asyncio.gather(
        run_cli("batch", "status", batch_id, "--json", env=env),
        run_cli("batch", "status", batch_id, env=env),
        run_cli("batch", "result", batch_id, "--json", env=env),
    )
    assert (s_code, h_code, r_code) == (ExitCode.OK,) * 3, s_err + h_err + r_err
    [status] = json_lines(s_out)
    assert status["state"] == "COMPLETED" and status["counts"] == {"COMPLETED": 2}
    assert status["total"] == 2 and status["ended"] == 2 and status["artifacts"] == 2
    assert [(job["job_id"], job["state"]) for job in status["jobs"]] == [
        (f"{batch_id}-0001", "COMPLETED"),
        (f"{batch_id}-0002", "COMPLETED"),
    ]
    assert h_out.startswith(f"batch {batch_id}: COMPLETED\n"), h_out
    assert "2 jobs, 2 ended: COMPLETED 2" in h_out and "progress 100%" in h_out
    assert any(line.split()[:2] == [f"{batch_id}-0002", "COMPLETED"] for line in h_out.splitlines())

    [results] = json_lines(r_out)
    assert results["state"] == "COMPLETED"
    ends = results["ends"]
    assert [(end["job_id"], end["state"]) for end in ends] == [
        (f"{batch_id}-0001", "COMPLETED"),
        (f"{batch_id}-0002", "COMPLETED"),
    ]
    for end in ends:
        [artifact] = end["artifacts"]
        assert artifact["key"].startswith(f"jobs/{end['job_id']}/")
        assert artifact["url"].startswith("http") and artifact["content_type"] == "image/png"

    # Other jobs under its ID are a conflict.
    jobs.write_text(lines[0] + "\n")
    code, out, err = await run_cli("submit", "--batch", str(jobs), "--batch-id", batch_id, env=env)
    assert (code, out) == (ExitCode.CONFLICT, ""), err
    assert f"batch ID {batch_id!r} is already used by a batch of other jobs" in err


async def test_batch_cancel_stops_every_job_of_a_batch_of_slow_jobs(
    worker: RunningWorker, local_stack: RunningStack, tmp_path: Path
) -> None:
    env = cli_env(local_stack, worker.task_queue)
    # 60 s a job at 20 ms a step: the cancel ends them long before.
    graph_file = tmp_path / "slow.json"
    graph_file.write_text(json.dumps(example(steps=3000)))
    batch_id = unique_id("cli-slow")
    submit = ("submit", str(graph_file), "--count", "2", "--batch-id", batch_id, "--json")
    code, out, err = await run_cli(*submit, env=env)
    assert code == ExitCode.OK, err
    [submitted] = json_lines(out)
    assert submitted["batch_id"] == batch_id and submitted["started"] == 2
    await until_a_job_runs(worker, batch_id)

    # The same batch again under its ID starts nothing.
    code, out, err = await run_cli(*submit, env=env)
    assert code == ExitCode.OK, err
    [again] = json_lines(out)
    assert again["existed"] is True and again["started"] == 0 and again["state"] == "RUNNING"
    assert "batch_already_exists" in err

    code, out, err = await run_cli("batch", "cancel", batch_id, "--reason", "not needed", env=env)
    assert code == ExitCode.OK, err
    assert out.startswith(f"cancel requested for batch {batch_id} (was RUNNING, 2 job(s)"), out

    code, out, err = await run_cli("batch", "watch", batch_id, "--json", env=env)
    assert code == ExitCode.JOB_NOT_COMPLETED, err
    final = json_lines(out)[-1]
    assert final["state"] == "CANCELLED" and final["counts"] == {"CANCELLED": 2}
    assert final["cancel_reason"] == "not needed"
    for job in final["jobs"]:
        status = await worker.client.status(job["job_id"])
        assert status.state == JobState.CANCELLED
        assert status.error is not None and status.error.message == "not needed"
        assert status.progress.step < 500

    results = await asyncio.gather(
        run_cli("batch", "cancel", batch_id, env=env),
        run_cli("batch", "result", batch_id, "--json", env=env),
        run_cli("batch", "status", unique_id("no-such-batch"), env=env),
    )
    (c_code, c_out, c_err), (r_code, r_out, r_err), (m_code, m_out, m_err) = results
    assert (c_code, c_out) == (ExitCode.CONFLICT, ""), c_err
    assert c_err.startswith(f"error: batch {batch_id!r} already ended CANCELLED"), c_err
    assert r_code == ExitCode.JOB_NOT_COMPLETED, r_err
    assert [end["state"] for end in json_lines(r_out)[0]["ends"]] == ["CANCELLED"] * 2
    assert (m_code, m_out) == (ExitCode.BAD_INPUT, "")
    assert m_err.startswith("error: no batch 'no-such-batch-") and m_err.count("\n") == 1
