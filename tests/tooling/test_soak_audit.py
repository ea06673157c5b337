"""The soak's audit and report (faults/soak) on synthetic evidence: no stack, no server.

Each broken promise must show in its check, in the table and in the JSON line, and make the
exit code non-zero; what the system is allowed to do under a fault (a crashed worker's partial
run, a prompt that died with its worker, an unhandled-command retry) must not.
"""

from __future__ import annotations

import json

from faults.soak.audit import AFTERMATH_S, Audit, audit, overlapping_faults
from faults.soak.collect import attribute_by_time, prompt_runs
from faults.soak.evidence import (
    ArtifactCheck,
    CostReading,
    Evidence,
    FaultRecord,
    JobEvidence,
    PromptRun,
    ProviderRun,
    QueueSnapshot,
    RunInfo,
    WorkerBill,
)
from faults.soak.report import json_line, table

SHA = "ab" * 32
T0 = 1_000_000.0


def artifact(key: str = "jobs/j/0/9/a.png", **fields: object) -> ArtifactCheck:
    values: dict[str, object] = {
        "bucket": "b",
        "key": key,
        "size": 10,
        "sha256": SHA,
        "head_ok": True,
        "downloaded": True,
        "download_ok": True,
    }
    return ArtifactCheck.model_validate(values | fields)


def job(job_id: str = "soak-1", **fields: object) -> JobEvidence:
    values: dict[str, object] = {
        "job_id": job_id,
        "pool": "runpod",
        "pool_kind": "runpod",
        "claims": True,
        "graph_kind": "long",
        "expected_outputs": 1,
        "submitted_at": T0,
        "ended": True,
        "ended_at": T0 + 30,
        "state": "COMPLETED",
        "teardown_state": "CONFIRMED",
        "artifacts": [artifact(f"jobs/{job_id}/0/9/a.png")],
        "submissions": [f"sub-{job_id}"],
        "costs": [CostReading(provider_job_id="r1", billed_s=25.0)] if job_id == "soak-1" else [],
    }
    return JobEvidence.model_validate(values | fields)


def clean() -> Evidence:
    """Two jobs that did everything right: one run each, nothing left, all verified."""
    return Evidence(
        run=RunInfo(minutes=2, fault_every_s=10, seed=7, jobs_per_minute=6, pools={}),
        jobs=[job("soak-1"), job("soak-2", pool="comfyui", pool_kind="comfyui")],
        faults=[
            FaultRecord(
                index=1, kind="s3_restart", target="s3", started_at=T0 + 10, ended_at=T0 + 25
            ),
        ],
        prompt_runs=[
            PromptRun(
                pool="runpod",
                sim="w1",
                prompt_id="sub-soak-1",
                job_id="soak-1",
                queued=1,
                executions=1,
                outcome="success",
            ),
            PromptRun(
                pool="comfyui",
                sim="pool",
                prompt_id="p2",
                job_id="soak-2",
                queued=1,
                executions=1,
                outcome="success",
            ),
        ],
        provider_runs=[
            ProviderRun(
                pool="runpod",
                runpod_job_id="r1",
                submission="sub-soak-1",
                status="COMPLETED",
                job_id="soak-1",
                delivery_outcomes=["completed"],
                ran_graph=True,
                billed_s=20.0,
            ),
        ],
        queues=[
            QueueSnapshot(pool="comfyui", sim="pool"),
            QueueSnapshot(pool="runpod", sim="w1", when="idle"),
        ],
        worker_bills=[
            WorkerBill(
                pool="runpod",
                worker_id="w1",
                billed_after_last_job_s=5.2,
                idle_timeout_s=5.0,
                stop_reason="idle",
            ),
        ],
    )


def failed_checks(result: Audit) -> set[str]:
    return {check.name for check in result.failed}


def test_clean_evidence_passes_with_exit_code_0() -> None:
    result = audit(clean())
    assert failed_checks(result) == set()
    assert result.ok and result.exit_code == 0
    summary = json.loads(json_line(result, clean().run))
    assert summary["ok"] is True and summary["failed"] == []
    assert "PASS" in table(result, clean().run)


def test_a_second_complete_run_on_another_worker_is_a_duplicate() -> None:
    evidence = clean()
    evidence.prompt_runs.append(
        PromptRun(
            pool="runpod",
            sim="w2",
            prompt_id="sub-soak-1",
            job_id="soak-1",
            queued=1,
            executions=1,
            outcome="success",
        )
    )
    result = audit(evidence)
    assert failed_checks(result) == {"duplicates"}
    assert result.exit_code == 1
    check = result.check("duplicates")
    assert check.value["comfy"] == 1 and check.value["jobs"][0]["job_id"] == "soak-1"
    summary = json.loads(json_line(result, evidence.run))
    assert summary["ok"] is False and summary["failed"] == ["duplicates"]
    assert "FAIL" in table(result, evidence.run)


def test_a_resubmission_that_ran_again_is_a_duplicate_in_the_ledger() -> None:
    evidence = clean()
    evidence.provider_runs.append(
        ProviderRun(
            pool="runpod",
            runpod_job_id="r2",
            submission="sub-2",
            status="COMPLETED",
            job_id="soak-1",
            delivery_outcomes=["completed"],
            ran_graph=True,
        )
    )
    result = audit(evidence)
    assert failed_checks(result) == {"duplicates"}
    assert result.check("duplicates").value["ledger"] == 1


def test_a_prompt_id_queued_twice_on_one_comfyui_is_a_duplicate() -> None:
    evidence = clean()
    evidence.prompt_runs[1] = evidence.prompt_runs[1].model_copy(
        update={"queued": 2, "executions": 2}
    )
    assert failed_checks(audit(evidence)) == {"duplicates"}


def test_a_run_cut_short_by_a_crash_then_one_complete_run_is_no_duplicate() -> None:
    """The crashed worker's ComfyUI started the prompt; another delivery ran it to the end."""
    evidence = clean()
    evidence.prompt_runs.append(
        PromptRun(
            pool="runpod",
            sim="w0",
            prompt_id="sub-soak-1",
            job_id="soak-1",
            queued=1,
            executions=1,
            outcome=None,
        )
    )
    evidence.queues.append(
        QueueSnapshot(pool="runpod", sim="w0", running=["sub-soak-1"], when="crash")
    )
    result = audit(evidence)
    assert failed_checks(result) == set()
    assert result.check("duplicates").value["cut_short"] == 1


def test_a_claimed_elsewhere_delivery_is_no_duplicate() -> None:
    evidence = clean()
    evidence.provider_runs.append(
        ProviderRun(
            pool="runpod",
            runpod_job_id="r9",
            submission="sub-soak-1",
            status="COMPLETED",
            job_id="soak-1",
            ran_graph=False,
        )
    )
    assert failed_checks(audit(evidence)) == set()


def test_a_provider_job_left_in_progress_fails() -> None:
    evidence = clean()
    evidence.provider_runs.append(
        ProviderRun(pool="runpod", runpod_job_id="r3", submission="sub-x", status="IN_PROGRESS")
    )
    result = audit(evidence)
    assert failed_checks(result) == {"left_running"}
    assert result.check("left_running").value["provider_jobs"] == 1


def test_a_provider_job_deleted_at_its_ttl_is_not_running() -> None:
    evidence = clean()
    evidence.provider_runs.append(
        ProviderRun(
            pool="runpod", runpod_job_id="r3", submission="sub-x", status="IN_QUEUE", gone="ttl"
        )
    )
    assert failed_checks(audit(evidence)) == set()


def test_a_prompt_left_in_a_queue_fails_unless_its_worker_crashed() -> None:
    evidence = clean()
    evidence.queues.append(QueueSnapshot(pool="comfyui", sim="pool", running=["p7"]))
    evidence.queues.append(QueueSnapshot(pool="runpod", sim="w4", pending=["p8"], when="idle"))
    evidence.queues.append(QueueSnapshot(pool="runpod", sim="w5", running=["p9"], when="crash"))
    result = audit(evidence)
    assert failed_checks(result) == {"left_running"}
    items = result.check("left_running").value["items"]
    assert len(items) == 2 and any("p7" in i for i in items) and any("p8" in i for i in items)


def test_a_job_failed_during_a_fault_names_the_fault() -> None:
    evidence = clean()
    evidence.jobs[0] = evidence.jobs[0].model_copy(
        update={
            "state": "FAILED",
            "error_type": "StorageError",
            "error_message": "S3 down",
            "artifacts": [],
        }
    )
    result = audit(evidence)
    assert failed_checks(result) == {"failed"}
    assert result.exit_code == 1
    check = result.check("failed")
    assert check.value["during_fault"] == 1 and check.value["by_type"] == {"StorageError": 1}
    assert check.value["jobs"][0]["faults"] == ["s3_restart#1"]
    assert "s3_restart#1" in check.details[0]


def test_a_job_failed_with_no_fault_around_fails_too_and_says_so() -> None:
    evidence = clean()
    evidence.faults = []
    evidence.jobs[0] = evidence.jobs[0].model_copy(
        update={"state": "FAILED", "error_type": "Timeout", "artifacts": []}
    )
    check = audit(evidence).check("failed")
    assert check.ok is False and check.value["during_fault"] == 0
    assert "no fault at the time" in check.details[0]


def test_fault_windows_count_their_aftermath_and_skip_faults_that_never_happened() -> None:
    fault = FaultRecord(
        index=1,
        kind="runpod_crash_stuck",
        target="runpod",
        started_at=T0,
        fired_at=T0 + 5,
        ended_at=T0 + 5,
        fired=True,
    )
    late = T0 + 5 + AFTERMATH_S - 1
    assert overlapping_faults([fault], late, late + 10) == [fault]
    assert overlapping_faults([fault], late + 2, late + 10) == []
    assert overlapping_faults([fault], T0 - 30, T0 + 2) == [], "armed, not yet in effect"
    unfired = fault.model_copy(update={"fired": False})
    assert overlapping_faults([unfired], T0, T0 + 10) == []


def test_a_job_not_ended_fails() -> None:
    evidence = clean()
    evidence.jobs[1] = evidence.jobs[1].model_copy(
        update={"ended": False, "ended_at": None, "state": "NEEDS_DECISION", "artifacts": []}
    )
    result = audit(evidence)
    assert failed_checks(result) == {"not_ended"}
    assert result.check("not_ended").value == ["soak-2"]


def test_end_states_a_cancel_explains_and_nothing_else_does() -> None:
    evidence = clean()
    evidence.jobs[0] = evidence.jobs[0].model_copy(update={"cancel_planned": True})
    evidence.jobs.append(job("soak-3", state="CANCELLED", cancel_planned=True, artifacts=[]))
    assert failed_checks(audit(evidence)) == set(), "cancelled, or done before the cancel"
    evidence.jobs.append(job("soak-4", state="CANCELLED", artifacts=[]))
    evidence.jobs.append(job("soak-5", state="ABANDONED", cancel_planned=True, artifacts=[]))
    result = audit(evidence)
    assert failed_checks(result) == {"unexpected_end"}
    assert result.check("unexpected_end").value == {"soak-4": "CANCELLED", "soak-5": "ABANDONED"}


def test_a_worker_billed_past_its_idle_timeout_fails() -> None:
    evidence = clean()
    evidence.worker_bills.append(
        WorkerBill(
            pool="runpod",
            worker_id="w2",
            billed_after_last_job_s=9.0,
            idle_timeout_s=5.0,
            stop_reason="idle",
        )
    )
    result = audit(evidence)
    assert failed_checks(result) == {"idle_billing"}
    assert result.check("idle_billing").value["over"] == ["w2"]


def test_an_artifact_not_verified_fails() -> None:
    for broken in (
        {"head_ok": False, "problem": "not in S3"},
        {"download_ok": False, "problem": "sha256 differs"},
    ):
        evidence = clean()
        evidence.jobs[0].artifacts = [artifact().model_copy(update=broken)]
        result = audit(evidence)
        assert failed_checks(result) == {"artifacts"}, broken
        assert result.check("artifacts").value["verified"] == 1


def test_a_completed_job_with_fewer_outputs_than_its_graph_fails() -> None:
    evidence = clean()
    evidence.jobs[0] = evidence.jobs[0].model_copy(update={"expected_outputs": 2})
    result = audit(evidence)
    assert failed_checks(result) == {"outputs_missing"}
    cancelled = clean()
    cancelled.jobs[0] = cancelled.jobs[0].model_copy(
        update={"expected_outputs": 2, "state": "CANCELLED", "cancel_planned": True}
    )
    assert failed_checks(audit(cancelled)) == set(), "a cancel keeps what finished, no more"


def test_an_open_multipart_upload_fails() -> None:
    evidence = clean()
    evidence.multipart_uploads = ["jobs/soak-1/0/9/big.png"]
    assert failed_checks(audit(evidence)) == {"multipart"}


def test_workflow_task_failures_fail_except_unhandled_command_retries() -> None:
    evidence = clean()
    evidence.jobs[0].task_failures = ["WORKFLOW_TASK_FAILED_CAUSE_UNHANDLED_COMMAND: new events"]
    result = audit(evidence)
    assert failed_checks(result) == set()
    assert result.check("task_failures").value["benign"] == 1
    evidence.jobs[1].task_failures = [
        "WORKFLOW_TASK_FAILED_CAUSE_WORKFLOW_WORKER_UNHANDLED_FAILURE: boom"
    ]
    result = audit(evidence)
    assert failed_checks(result) == {"task_failures"}
    assert result.check("task_failures").value["by_cause"] == {
        "WORKFLOW_TASK_FAILED_CAUSE_WORKFLOW_WORKER_UNHANDLED_FAILURE": 1
    }


def test_what_could_not_be_read_or_stopped_fails() -> None:
    evidence = clean()
    evidence.collection_errors = ["ledger of runpod: ConnectError"]
    evidence.leftover_processes = [4242]
    evidence.submit_failures = ["soak-9"]
    assert failed_checks(audit(evidence)) == {"collection", "cleanup", "jobs"}


def test_the_table_lists_each_failure_under_its_check() -> None:
    evidence = clean()
    evidence.jobs[0] = evidence.jobs[0].model_copy(
        update={"state": "FAILED", "error_type": "StorageError", "artifacts": []}
    )
    evidence.multipart_uploads = ["jobs/x"]
    result = audit(evidence)
    lines = table(result, evidence.run).splitlines()
    failed_row = next(i for i, line in enumerate(lines) if line.startswith("FAILED jobs"))
    assert lines[failed_row].endswith("FAIL")
    assert "soak-1" in lines[failed_row + 1] and "StorageError" in lines[failed_row + 1]
    assert lines[-1].startswith("FAIL:") and "open multipart uploads" in lines[-1]
    summary = json.loads(json_line(result, evidence.run))
    assert summary["failed"] == ["failed", "multipart"]
    assert summary["checks"]["multipart"]["value"] == ["jobs/x"]


def test_prompt_runs_read_whose_prompt_it_was_from_its_tag() -> None:
    snap = {
        "stats": {
            "prompts": {"a": 1, "b": 1, "c": 1},
            "executions": {"a": 1, "b": 1, "c": 1},
            "executed": {"a": "success", "b": "interrupted"},
        },
        "running": ["c"],
        "pending": [],
        "tags": {
            "a": {"durable_comfy": {"job_id": "soak-1", "segment": 0}},
            "b": {"durable_comfy_runpod": {"job_id": "soak-2", "runpod_job_id": "r2"}},
            "c": {"durable_comfy_runpod": {"runpod_job_id": "r3"}},
        },
    }
    runs = {run.prompt_id: run for run in prompt_runs("p", "w1", snap)}
    assert runs["a"].job_id == "soak-1" and runs["a"].outcome == "success"
    assert runs["b"].job_id == "soak-2" and runs["b"].runpod_job_id == "r2"
    assert runs["c"].job_id is None and runs["c"].runpod_job_id == "r3"
    assert runs["c"].outcome is None, "still running"


def test_an_untagged_prompt_belongs_to_the_job_its_worker_held_when_it_started() -> None:
    """A stock handler tags nothing: its prompts are matched to the ledger by time."""
    runs = [
        PromptRun(pool="stock", sim="w1", prompt_id="x", queued=1, executions=1),
        PromptRun(pool="stock", sim="w1", prompt_id="y", queued=1, executions=1),
        PromptRun(pool="stock", sim="w1", prompt_id="z", queued=1, executions=0),
    ]
    snap = {"stats": {"started_at": {"x": T0 + 2, "y": T0 + 12}}}
    held = [(T0, T0 + 10, "r1"), (T0 + 11, float("inf"), "r2")]
    attribute_by_time(runs, snap, held)
    assert [run.runpod_job_id for run in runs] == ["r1", "r2", None]


def test_a_prompt_started_just_after_the_last_job_belongs_to_the_next_one() -> None:
    """A busy stock worker takes its next job within a second of the last one's end: the
    slack for clock differences must not give the new prompt to the old job (which the first
    15-minute soak read as a duplicate execution)."""
    runs = [PromptRun(pool="stock", sim="w1", prompt_id="y", queued=1, executions=1)]
    snap = {"stats": {"started_at": {"y": T0 + 10.4}}}
    held = [(T0, T0 + 10.0, "r1"), (T0 + 10.2, T0 + 20, "r2")]
    attribute_by_time(runs, snap, held)
    assert runs[0].runpod_job_id == "r2"
    snap = {"stats": {"started_at": {"y": T0 + 10.1}}}  # between the two: the nearer one
    runs[0].runpod_job_id = None
    attribute_by_time(runs, snap, held)
    assert runs[0].runpod_job_id == "r1"


def test_faults_that_did_not_happen_are_listed_but_fail_nothing() -> None:
    evidence = clean()
    evidence.faults.append(
        FaultRecord(
            index=2,
            kind="runpod_crash_stuck",
            target="runpod",
            started_at=T0,
            fired=False,
            detail="its delivery ended before the kill",
        )
    )
    result = audit(evidence)
    assert failed_checks(result) == set()
    check = result.check("faults")
    assert check.value["injected"] == 2 and check.value["did_not_happen"] == 1
    assert any("runpod_crash_stuck#2" in line for line in check.details)


# -- a worker frozen or cut off from S3 after its work --------------------------------------------


def test_a_submission_run_to_its_end_on_two_workers_is_a_duplicate_within_the_segments() -> None:
    """A frozen handler's ComfyUI ran the graph on, then another delivery of the same
    submission ran it again: two complete runs of one submission, though the job's total (2)
    does not exceed its segments (2)."""
    evidence = clean()
    evidence.jobs[0] = evidence.jobs[0].model_copy(update={"segments": 2})
    evidence.prompt_runs.append(
        PromptRun(
            pool="runpod",
            sim="w2",
            prompt_id="sub-soak-1",
            job_id="soak-1",
            queued=1,
            executions=1,
            outcome="success",
        )
    )
    result = audit(evidence)
    assert failed_checks(result) == {"duplicates"}
    check = result.check("duplicates")
    assert check.value["per_submission"] == 1 and check.value["count"] == 1
    [row] = check.value["jobs"]
    assert row["submission"] == "sub-soak-1" and row["where"] == ["w1:sub-soak-1", "w2:sub-soak-1"]
    assert "submission sub-soak-1" in check.details[0]
    # Two submissions of a two-segment job, each run once, are not.
    evidence.prompt_runs[-1] = evidence.prompt_runs[-1].model_copy(
        update={"prompt_id": "sub-soak-1-b"}
    )
    assert failed_checks(audit(evidence)) == set()


def test_a_run_its_watchdog_cut_short_then_one_complete_run_is_no_duplicate_nor_left() -> None:
    """The watchdog interrupted the frozen worker's prompt and killed its handler; the
    worker's ComfyUI went with it, its prompt still listed; the next delivery ran it."""
    evidence = clean()
    evidence.prompt_runs.append(
        PromptRun(
            pool="runpod",
            sim="w0",
            prompt_id="sub-soak-1",
            job_id="soak-1",
            queued=1,
            executions=1,
            outcome="interrupted",
        )
    )
    evidence.queues.append(
        QueueSnapshot(pool="runpod", sim="w0", running=["sub-soak-1"], when="watchdog")
    )
    result = audit(evidence)
    assert failed_checks(result) == set()
    assert result.check("duplicates").value["cut_short"] == 1


def test_a_worker_still_billing_at_the_end_fails_and_names_its_jobs() -> None:
    evidence = clean()
    evidence.worker_bills.append(
        WorkerBill(
            pool="runpod",
            worker_id="w9",
            billed_after_last_job_s=None,
            idle_timeout_s=5.0,
            alive=True,
            billing=True,
            jobs=["r1"],
        )
    )
    # Being stopped (billing over, its process not gone yet) is not billing.
    evidence.worker_bills.append(
        WorkerBill(
            pool="runpod",
            worker_id="w8",
            billed_after_last_job_s=1.0,
            idle_timeout_s=5.0,
            alive=True,
            billing=False,
        )
    )
    result = audit(evidence)
    assert failed_checks(result) == {"still_billing"}
    check = result.check("still_billing")
    assert check.value == {"count": 1, "workers": ["w9"], "jobs": ["soak-1"]}
    assert check.figure == "1 of 3" and "r1 (soak-1)" in check.details[0]


def test_a_job_whose_cost_is_below_what_the_ledger_billed_fails() -> None:
    evidence = clean()
    # A re-delivered RunPod job: the ledger billed both deliveries, the cost read one.
    evidence.provider_runs[0] = evidence.provider_runs[0].model_copy(
        update={"delivery_outcomes": ["worker_lost", "completed"], "billed_s": 40.0}
    )
    result = audit(evidence)
    assert failed_checks(result) == {"cost_covers_bill"}
    [row] = result.check("cost_covers_bill").value["jobs"]
    assert row["job_id"] == "soak-1" and row["short"][0]["runpod_job_id"] == "r1"
    # A RunPod job of the job that its cost does not list at all.
    evidence = clean()
    evidence.provider_runs.append(
        ProviderRun(
            pool="runpod",
            runpod_job_id="r2",
            submission="sub-soak-1",
            status="TIMED_OUT",
            job_id="soak-1",
            delivery_outcomes=["worker_lost"],
            billed_s=8.0,
        )
    )
    check = audit(evidence).check("cost_covers_bill")
    assert check.ok is False and "r2 0.0 < 8.0 s (not in its cost)" in check.details[0]
    # Missing by less than the slack still fails: the slack is for a reading, not its absence.
    evidence.provider_runs[-1] = evidence.provider_runs[-1].model_copy(update={"billed_s": 0.3})
    assert failed_checks(audit(evidence)) == {"cost_covers_bill"}
    # Within a second per delivery (clock ticks, whole milliseconds), or on a comfyui pool: ok.
    evidence.provider_runs[-1] = evidence.provider_runs[-1].model_copy(update={"billed_s": 8.0})
    evidence.jobs[0].costs.append(CostReading(provider_job_id="r2", billed_s=7.2))
    assert failed_checks(audit(evidence)) == set()
    comfy = clean()
    comfy.jobs[0] = comfy.jobs[0].model_copy(update={"pool_kind": "comfyui", "costs": []})
    assert audit(comfy).check("cost_covers_bill").value["judged"] == 0
