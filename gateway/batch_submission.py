"""What `POST /v1/batches` turns a body into: the `BatchRequest`, every job's request, whether
the jobs are followed, and the batch's ID.

Every job gets what a single job's body gets (`gateway.submission.job_request`): its `tenant`
label set to the caller's, its output in the tenant's area, its storage checked. A refusal names
the job by its place in `loc`: `["requests", 3, "graph", "8", "class_type"]` for a whole job,
`["request", "output", "prefix"]` for the one sent with `count` or `overrides`, and
`["overrides", 41, "graph", "8", "inputs.samples"]` for a job whose overrides make a graph the
worker would refuse (each job's graph is checked again after its overrides: an override may link
to a node the graph lacks, or name a file the job has no input for).

The batch ID is the tenant's as a job's is: `<tenant>.batch-<sha256 of the Idempotency-Key, 32
hex>`, or `<tenant>.batch-<random>` without a key; its jobs are `<batch>-0001`, ...
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from pydantic import ValidationError

from configuration.settings import S3Settings
from gateway.errors import INVALID_REQUEST, ApiError, api_error_for, bad_request, invalid
from gateway.submission import IDEMPOTENCY_KEY, job_request
from starter.errors import InvalidOverride
from starter.requests import check_segment_overrides
from workflows.batches import MAX_BATCH_JOBS, BatchRequest
from workflows.contracts import JobRequest
from workflows.graph import apply_overrides

# A batch of a thousand jobs with one mistake repeated would list a thousand problems: the
# first of them say what to fix.
MAX_PROBLEMS: Final = 20
INVALID_GRAPH: Final = "InvalidGraph"
# What a problem of the whole body is said to be about (`request` is one of its fields).
BATCH: Final = "batch"


@dataclass(frozen=True)
class ParsedBatch:
    batch: BatchRequest
    # Every job's request, in order, as it will start (seeds varied, overrides applied).
    jobs: list[JobRequest]
    detached: bool


def batch_id_for(tenant: str, idempotency_key: str | None) -> str:
    if idempotency_key is None:
        return f"{tenant}.batch-{uuid.uuid4().hex}"
    if not IDEMPOTENCY_KEY.match(idempotency_key):
        raise bad_request("Idempotency-Key is 1-200 printable ASCII characters")
    return f"{tenant}.batch-{hashlib.sha256(idempotency_key.encode()).hexdigest()[:32]}"


class _Problems:
    """Problems gathered over the jobs, each at its job's place; the type stays `InvalidGraph`
    while every one is a graph's, as a single job's refusal is typed."""

    def __init__(self) -> None:
        self.problems: list[dict[str, Any]] = []
        self.graph_only = True

    @property
    def full(self) -> bool:
        return len(self.problems) >= MAX_PROBLEMS

    def add(self, loc: Sequence[str | int], error: ApiError) -> None:
        given = error.extra.get("problems") or [{"loc": [], "message": error.message}]
        self.problems += [{**p, "loc": [*loc, *p["loc"]]} for p in given]
        self.graph_only = self.graph_only and error.error_type == INVALID_GRAPH

    def refuse(self, loc: Sequence[str | int], message: str) -> None:
        self.add(loc, invalid([{"loc": [], "message": message}]))

    def raise_any(self) -> None:
        if self.problems:
            shown = self.problems[:MAX_PROBLEMS]
            error_type = INVALID_GRAPH if self.graph_only else INVALID_REQUEST
            raise invalid(shown, error_type, BATCH)


def batch_request(
    body: dict[str, Any], tenant: str, storage: S3Settings | None = None
) -> ParsedBatch:
    """The batch and its jobs; 422 naming every field that is wrong, with its job's place."""
    body = dict(body)
    detached = body.pop("detached", True)
    if not isinstance(detached, bool):
        raise invalid([{"loc": ["detached"], "message": "true or false"}], whole=BATCH)
    problems = _Problems()
    fields = dict(body)
    requests = body.get("requests")
    # Anything else (not a list, too long) is left to the model, which says what it takes.
    if isinstance(requests, list) and len(requests) <= MAX_BATCH_JOBS:
        checked = []
        for index, item in enumerate(requests):
            checked.append(_job(item, ["requests", index], tenant, storage, problems))
            if problems.full:
                break
        fields["requests"] = checked
    template = body.get("request")
    if isinstance(template, dict):
        fields["request"] = _job(template, ["request"], tenant, storage, problems)
    problems.raise_any()
    try:
        batch = BatchRequest.model_validate(fields)
    except ValidationError as exc:
        error = api_error_for(exc)
        shown = [_with_rule(p) for p in error.extra.get("problems", [])]
        raise invalid(shown, error.error_type, BATCH) from None
    return ParsedBatch(batch, _expanded(batch, problems), detached)


def _with_rule(problem: dict[str, Any]) -> dict[str, Any]:
    if problem["loc"] not in (["requests"], ["overrides"], ["count"]):
        return problem
    rule = (
        f"a batch holds 1 to {MAX_BATCH_JOBS:,} jobs (`count`, or one entry of `requests` or "
        "`overrides` each): send more as several batches"
    )
    return {**problem, "message": f"{problem['message']}: {rule}"}


def _job(
    item: Any, loc: list[str | int], tenant: str, storage: S3Settings | None, problems: _Problems
) -> JobRequest | None:
    if not isinstance(item, dict):
        problems.refuse(loc, "a job request: a JSON object with its `graph`")
        return None
    if "detached" in item:
        problems.refuse(
            [*loc, "detached"], "`detached` is the batch's: send it once, beside the jobs"
        )
        return None
    try:
        job, _ = job_request(item, tenant, storage)
        check_segment_overrides(job.graph, job.segments)
    except ApiError as exc:
        problems.add(loc, exc)
        return None
    except InvalidOverride as exc:
        problems.refuse([*loc, "segments"], str(exc))
        return None
    return job


def _expanded(batch: BatchRequest, problems: _Problems) -> list[JobRequest]:
    if batch.overrides is None:
        return batch.expanded()
    assert batch.request is not None
    template = batch.request.model_dump()
    jobs: list[JobRequest] = []
    for index, values in enumerate(batch.overrides):
        job = _overridden(template, values, ["overrides", index], problems)
        if job is not None:
            jobs.append(job)
        if problems.full:
            break
    problems.raise_any()
    return jobs


def _overridden(
    template: dict[str, Any],
    values: Mapping[str, Mapping[str, Any]],
    loc: list[str | int],
    problems: _Problems,
) -> JobRequest | None:
    graph: dict[str, Any] = template["graph"]
    fits = True
    # As a segment's overrides are (starter.requests.check_segment_overrides): ComfyUI ignores
    # an input its node does not have, so a typo (`sede`) would run every job alike.
    for node_id, inputs in values.items():
        node = graph.get(node_id)
        if not isinstance(node, dict):
            problems.refuse([*loc, node_id], f"the graph of `request` has no node {node_id!r}")
            fits = False
            continue
        known = node.get("inputs") or {}
        for name in inputs:
            if name not in known:
                problems.refuse(
                    [*loc, node_id, name],
                    f"node {node_id!r} ({node.get('class_type')}) has no input {name!r} (its "
                    f"inputs: {', '.join(sorted(known)) or 'none'})",
                )
                fits = False
    if not fits:
        return None
    try:
        return JobRequest.model_validate({**template, "graph": apply_overrides(graph, values)})
    except ValidationError as exc:
        problems.add(loc, api_error_for(exc))
        return None
