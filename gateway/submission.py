"""What `POST /v1/jobs` turns a body into: the `JobRequest`, how it is followed, its job ID.

The job ID is the tenant's: `<tenant>.<sha256 of the Idempotency-Key, 32 hex>` (the same key
always names the same job, and two tenants' keys never collide), or `<tenant>.<random>` without
a key. The request's `tenant` label is set to the caller's tenant whatever the body said: the
`Tenant` search attribute, which every later route checks, is taken from it.

Storage is the tenant's own (workflows/tenancy.py): `output.prefix` defaults to `jobs/<tenant>`
and may only name a folder in it, `output.bucket` only the gateway's own bucket, and an `s3://`
input only the tenant's area or a folder the operator allows. The worker checks the inputs
again before it reads any; refusing here saves the job a start.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from typing import Any

from pydantic import ValidationError

from configuration.settings import S3Settings
from gateway.errors import bad_request, invalid, validation_problems
from workflows.admission import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY
from workflows.contracts import JobRequest
from workflows.errors import OutputOutsideArea
from workflows.tenancy import check_output, inputs_outside_area, output_area

IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e][\x20-\x7e]{0,198}[\x21-\x7e]$|^[\x21-\x7e]$")
# What a field of the queue takes, said after pydantic's own words when its value is refused.
FIELD_RULES: dict[tuple[str | int, ...], str] = {
    ("priority",): (
        f"the priority is a whole number from {MIN_PRIORITY} (starts first) to {MAX_PRIORITY} "
        f"(starts last), {DEFAULT_PRIORITY} when left out"
    ),
    ("policy", "start_by_s"): (
        "start_by_s is the seconds after acceptance by which the job's prompt must have begun "
        "to run (a number above 0), else the job ends EXPIRED; null or left out: no deadline"
    ),
}


def job_id_for(tenant: str, idempotency_key: str | None) -> str:
    if idempotency_key is None:
        return f"{tenant}.{uuid.uuid4().hex}"
    if not IDEMPOTENCY_KEY.match(idempotency_key):
        raise bad_request("Idempotency-Key is 1-200 printable ASCII characters")
    return f"{tenant}.{hashlib.sha256(idempotency_key.encode()).hexdigest()[:32]}"


def parse_body(raw: bytes, what: str = "JobRequest", whole: str = "request") -> dict[str, Any]:
    """The body's JSON object; `what` it should be, and `whole`: what `invalid` calls it."""
    if not raw.strip():
        message = f"the body is empty: send a {what} as JSON"
        raise invalid([{"loc": [], "message": message}], whole=whole)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        message = f"the body is a JSON object (a {what})"
        raise invalid([{"loc": [], "message": message}], whole=whole)
    return body


def job_request(
    body: dict[str, Any], tenant: str, storage: S3Settings | None = None
) -> tuple[JobRequest, bool]:
    """The request and whether it is detached; 422 naming every field that is wrong.

    `storage`: the gateway's bucket and the operator's allowed input folders (None: the gateway
    has no bucket, and names none: a request naming one is refused, its inputs left to the
    worker's check)."""
    body = dict(body)
    detached = body.pop("detached", True)
    if not isinstance(detached, bool):
        raise invalid([{"loc": ["detached"], "message": "true or false"}])
    labels = body.get("labels")
    if labels is None or isinstance(labels, dict):
        body["labels"] = {**(labels or {}), "tenant": tenant}
    output = body.get("output")
    if isinstance(output, dict) and "prefix" not in output:
        body["output"] = {**output, "prefix": output_area(tenant)}
    elif output is None:
        body["output"] = {"prefix": output_area(tenant)}
    try:
        request = JobRequest.model_validate(body)
    except ValidationError as exc:
        problems = [_with_rule(problem) for problem in validation_problems(exc)]
        graph_only = all(p["loc"][:1] == ["graph"] for p in problems)
        raise invalid(problems, "InvalidGraph" if graph_only else "InvalidRequest") from None
    _check_storage(request, tenant, storage)
    return request, detached


def _with_rule(problem: dict[str, Any]) -> dict[str, Any]:
    rule = FIELD_RULES.get(tuple(problem["loc"]))
    if rule is None:
        return problem
    return {**problem, "message": f"{problem['message']}: {rule}"}


def _check_storage(request: JobRequest, tenant: str, storage: S3Settings | None) -> None:
    own_bucket = storage.bucket if storage is not None else None
    try:
        check_output(tenant, request.output.prefix, request.output.bucket, own_bucket)
    except OutputOutsideArea as exc:
        raise invalid([{"loc": ["output", exc.field], "message": str(exc)}]) from None
    if storage is None:
        return
    refused = inputs_outside_area(
        request.inputs,
        tenant=tenant,
        bucket=request.output.bucket or storage.bucket,
        allowed=storage.allowed_input_prefixes,
    )
    if refused:
        raise invalid(
            [{"loc": ["inputs", name, "uri"], "message": str(exc)} for name, exc in refused]
        )


def cancel_reason(raw: bytes) -> str | None:
    """The optional `{"reason": "..."}` of a cancel (at most 500 characters)."""
    if not raw.strip():
        return None
    body = parse_body(raw)
    reason = body.get("reason")
    if set(body) - {"reason"}:
        raise invalid([{"loc": [sorted(set(body) - {"reason"})[0]], "message": "unknown field"}])
    if reason is not None and (not isinstance(reason, str) or len(reason) > 500):
        raise invalid([{"loc": ["reason"], "message": "a string of at most 500 characters"}])
    return reason


def resubmit_of(raw: bytes) -> bool:
    if not raw.strip():
        return False
    body = parse_body(raw)
    resubmit = body.get("resubmit", False)
    if set(body) - {"resubmit"} or not isinstance(resubmit, bool):
        raise invalid([{"loc": ["resubmit"], "message": 'the body is {"resubmit": true|false}'}])
    return resubmit
