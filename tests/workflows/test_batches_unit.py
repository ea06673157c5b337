"""A batch's request: its three forms, and the jobs each expands to (workflows/batches.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from workflows.batches import (
    MAX_BATCH_JOBS,
    SEED_LIMIT,
    BatchJobEnd,
    BatchRequest,
    batch_job_id,
    compact_jobs,
    seed_inputs,
)
from workflows.contracts import Artifact, JobCost, JobRequest, JobState, JobStatus
from workflows.errors import GraphFormatError


def graph(seed: int = 7, noise_seed: int | None = None) -> dict[str, Any]:
    nodes: dict[str, Any] = {
        "1": {"class_type": "EmptyLatentImage", "inputs": {"width": 8, "height": 8}},
        "3": {"class_type": "KSampler", "inputs": {"seed": seed, "steps": 2, "latent": ["1", 0]}},
    }
    if noise_seed is not None:
        nodes["4"] = {"class_type": "RandomNoise", "inputs": {"noise_seed": noise_seed}}
    return nodes


def test_count_varies_every_literal_seed_and_keeps_the_first_job_as_sent() -> None:
    batch = BatchRequest(request=JobRequest(graph=graph(7, noise_seed=100)), count=4)
    jobs = batch.expanded()
    assert [job.graph["3"]["inputs"]["seed"] for job in jobs] == [7, 8, 9, 10]
    assert [job.graph["4"]["inputs"]["noise_seed"] for job in jobs] == [100, 101, 102, 103]
    # Nothing else of the request changes.
    assert all(job.graph["1"] == graph()["1"] for job in jobs)


def test_seeds_wrap_inside_comfyuis_unsigned_64_bits() -> None:
    jobs = BatchRequest(request=JobRequest(graph=graph(SEED_LIMIT - 1)), count=2).expanded()
    assert [job.graph["3"]["inputs"]["seed"] for job in jobs] == [SEED_LIMIT - 1, 0]


def test_a_linked_seed_is_not_a_literal_and_a_graph_without_one_cannot_take_count() -> None:
    linked = graph()
    linked["3"]["inputs"]["seed"] = ["1", 0]
    assert seed_inputs(linked) == []
    with pytest.raises(ValidationError, match="no literal `seed`"):
        BatchRequest(request=JobRequest(graph=linked), count=3)


def test_overrides_give_one_job_each_and_a_node_that_is_not_there_is_refused() -> None:
    batch = BatchRequest(
        request=JobRequest(graph=graph()),
        overrides=[{"3": {"steps": 5}}, {"3": {"seed": 1, "steps": 9}}],
    )
    jobs = batch.expanded()
    assert [(j.graph["3"]["inputs"]["seed"], j.graph["3"]["inputs"]["steps"]) for j in jobs] == [
        (7, 5),
        (1, 9),
    ]
    with pytest.raises(GraphFormatError, match="'99'"):
        BatchRequest(request=JobRequest(graph=graph()), overrides=[{"99": {"x": 1}}]).expanded()


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({}, "a batch needs its jobs"),
        ({"request": {"graph": graph()}}, "exactly one of `count` and `overrides`"),
        (
            {"request": {"graph": graph()}, "count": 2, "overrides": [{}]},
            "exactly one of `count` and `overrides`",
        ),
        (
            {"requests": [{"graph": graph()}], "request": {"graph": graph()}},
            "not both",
        ),
        ({"request": {"graph": graph()}, "count": MAX_BATCH_JOBS + 1}, "less than or equal"),
        ({"requests": []}, "at least 1"),
        ({"request": {"graph": graph()}, "count": "3"}, "valid integer"),
        ({"request": {"graph": graph()}, "count": 2, "extra": 1}, "Extra inputs"),
    ],
)
def test_a_batch_that_is_not_one_form_is_refused_saying_what_to_send(
    body: dict[str, Any], words: str
) -> None:
    with pytest.raises(ValidationError, match=words):
        BatchRequest.model_validate_json(json.dumps(body))


def test_jobs_are_named_after_the_batch_in_order() -> None:
    assert [batch_job_id("b", n) for n in (0, 9, 999)] == ["b-0001", "b-0010", "b-1000"]


def test_a_jobs_end_carries_its_cost_in_seconds_and_dollars_and_its_artifacts() -> None:
    artifact = Artifact(
        key="k", uri="s3://b/k", size=1, sha256="0" * 64, content_type="image/png", node_id="9"
    )
    status = JobStatus(
        job_id="b-0001",
        state=JobState.COMPLETED,
        artifacts=[artifact],
        cost=[
            JobCost(execution_s=2.0, billed_after_end_s=1.0, usd_per_second=0.5),
            JobCost(execution_s=4.0),
        ],
        gpu_s=6.0,
        usd=1.5,
    )
    end = BatchJobEnd.of(status, datetime(2026, 12, 7, tzinfo=UTC))
    # The job's own figures, as its tenant's budget counts them (not recomputed here).
    assert end.gpu_s == 6.0 and end.usd == 1.5
    assert end.artifacts == [artifact] and end.state == JobState.COMPLETED


# -- a batch's jobs in short, for its workflow to start (`compact_jobs`) ------------------------


def test_jobs_by_count_overrides_or_requests_that_differ_in_values_go_in_short() -> None:
    request = JobRequest(graph=graph(7, noise_seed=100))
    by_count = BatchRequest(request=request, count=1000).expanded()
    jobs = compact_jobs(by_count, detached=True)
    assert jobs is not None and jobs.detached
    assert jobs.inputs[0] == {} and jobs.inputs[2] == {"3": {"seed": 9}, "4": {"noise_seed": 102}}
    # Each job rebuilt is the job sent, exactly (its JSON, so its fingerprint).
    for index in (0, 1, 999):
        assert jobs.request(index).model_dump_json() == by_count[index].model_dump_json()
    # A thousand jobs by count: a few dozen bytes each, not a graph each.
    assert len(jobs.model_dump_json()) < 60 * 1000
    # Whole requests that differ only in input values go in short too.
    prompts = [JobRequest(graph=graph(seed)) for seed in (1, 5, 5)]
    short = compact_jobs(prompts, detached=False)
    assert short is not None and short.inputs == [{}, {"3": {"seed": 5}}, {"3": {"seed": 5}}]
    assert not short.detached


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(JobRequest(graph=graph(7, noise_seed=1)), id="a node the first lacks"),
        pytest.param(JobRequest(graph=graph(7), pool="other"), id="another pool"),
        pytest.param(JobRequest(graph=graph(7), labels={"tenant": "b"}), id="other labels"),
        pytest.param(
            JobRequest(graph={**graph(7), "1": {"class_type": "Other", "inputs": {}}}),
            id="another node class",
        ),
        pytest.param(
            JobRequest(graph={**graph(7), "1": {"class_type": "EmptyLatentImage", "inputs": {}}}),
            id="an input missing",
        ),
    ],
)
def test_jobs_that_differ_in_more_than_values_do_not_go_in_short(other: JobRequest) -> None:
    assert compact_jobs([JobRequest(graph=graph(7)), other], detached=True) is None


def test_a_value_equal_in_python_but_not_in_json_is_kept_as_sent() -> None:
    """8.0 == 8 (and True == 1) in Python; rebuilt from the first job's 8, the job would be
    another request, with another fingerprint."""
    nodes = graph(7)
    nodes["1"] = {"class_type": "EmptyLatentImage", "inputs": {"width": 8.0, "height": 8}}
    other = JobRequest(graph=nodes)
    jobs = compact_jobs([JobRequest(graph=graph(7)), other], detached=True)
    assert jobs is not None and jobs.inputs[1] == {"1": {"width": 8.0}}
    assert jobs.request(1).model_dump_json() == other.model_dump_json()
