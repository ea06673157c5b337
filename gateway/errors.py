"""Every error the gateway answers, as JSON: `{"error": {"type", "message", ...}}`, and the
gateway's own exceptions:

    ApiError                 an answer other than success, ready to send
    └── BodyTooLarge         the body is over the gateway's limit (413)
    Unauthorized             no key, a malformed header, or a key nobody holds (401)
    starter.SettingsError
    └── ApiKeysError         the keys' configuration is unusable (names the variable or file)
    LimitExceeded            a refusal with a Retry-After
    ├── RateLimited          the tenant is over its requests per second (429)
    ├── TooManyJobs          the tenant has its limit of jobs in flight, every pool's, as the
    │                        gateway counts them (429)
    ├── QueueFull            the pool's queue holds as many waiting jobs as the workers'
    │                        `max_pending` lets it, the tenant's or the pool's (429)
    ├── BudgetExceeded       the tenant's daily budget is spent and its settings refuse new
    │                        jobs until the reset (429, Retry-After: the reset)
    └── Overloaded           this replica is at its limit of requests or streams (503)
    FollowFailed             a stream's follower stopped without the job ending
    Dropped                  a stream's subscriber fell too far behind (503)

One table, `api_error_for`, maps these and what the layers below raise (the client's
`ClientError`s, a request that does not validate) to a status, a type and the extra fields a
client needs (`job_id`, `batch_id`, `status`, `problems`, `pool`); docs/http-api.md lists
it. Nothing here quotes a key or an Authorization header.

Importable without the gateway extra (`durable-comfy gateway new-key` imports gateway.auth,
which raises these): FastAPI and Starlette are imported where a response is made.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import structlog
from pydantic import ValidationError

from gateway.views import INTERNAL
from starter import errors as client_errors
from workflows.batches import MAX_BATCH_JOBS
from workflows.errors import GraphRefused, RequestRefused
from workflows.shared import ErrorType

if TYPE_CHECKING:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

log = structlog.get_logger("gateway.errors")

# How soon to ask again when Temporal or a worker did not answer: a restart takes seconds.
UNAVAILABLE_RETRY_AFTER_S = 5
# How soon to ask again when a pool's queue is full but cannot tell when it will have room (no
# job of the pool has ended since its queue started, so it has no hold times to go by): jobs
# hold a slot for tens of seconds to minutes, so sooner would only be refused again.
QUEUE_FULL_RETRY_AFTER_S = 30
INVALID_REQUEST = "InvalidRequest"
# `POST /v1/batches`, under any base path: a body refused there is told how to be smaller.
BATCHES_PATH = re.compile(r"/v1/batches/?$")


class ApiError(Exception):
    """An answer other than success: the status, the body's type and message, its extra fields
    and headers (Retry-After)."""

    def __init__(
        self,
        status_code: int,
        error_type: str,
        message: str,
        *,
        headers: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.error_type = error_type
        self.message = message
        self.headers = dict(headers or {})
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {"error": {"type": self.error_type, "message": self.message, **self.extra}}

    def response(self) -> JSONResponse:
        from fastapi.responses import JSONResponse

        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


class BodyTooLarge(ApiError):
    """`path`: the route the body was sent to; a batch's answer says how to send it smaller."""

    def __init__(self, limit: int, path: str = "") -> None:
        message = f"the body is over the gateway's limit of {limit:,} bytes; "
        if BATCHES_PATH.search(path):
            message += (
                "send the graph once, as `request`, with `count` (its seeds varied) or "
                "`overrides` (each job's changed inputs) instead of every job whole in "
                f"`requests`, or split the jobs into several batches (at most {MAX_BATCH_JOBS:,} "
                "jobs each, each body under the limit); "
            )
        super().__init__(
            413,
            "RequestTooLarge",
            message + "pass big inputs by reference (an s3:// or https:// input), not inline",
            limit=limit,
        )


class Unauthorized(Exception):
    """No key, a malformed Authorization header, or a key nobody holds. Never quotes the key."""


class ApiKeysError(client_errors.SettingsError, ValueError):
    """The keys' configuration is unusable; names the variable or file and the entry, never a
    key (nor a tenant field that may be a key written in the wrong place)."""


class LimitExceeded(Exception):
    """Base of the refusals; `retry_after_s` (at least 1) is the Retry-After header's value."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = max(1, retry_after_s)


class RateLimited(LimitExceeded):
    """The tenant is over its requests per second (429)."""


class TooManyJobs(LimitExceeded):
    """The tenant has its limit of jobs in flight (429)."""


class QueueFull(LimitExceeded):
    """The pool's queue has no room for the tenant's job (429): as many of its jobs wait as the
    workers' `max_pending` lets them, the tenant's or the pool's. Nothing was started.

    `retry_after_s` is the queue's own estimate of when a place frees (rounded up to whole
    seconds), or `QUEUE_FULL_RETRY_AFTER_S` when it has none."""

    def __init__(
        self, message: str, pool: str, reason: str, retry_after_s: float | None = None
    ) -> None:
        wait = QUEUE_FULL_RETRY_AFTER_S if retry_after_s is None else math.ceil(retry_after_s)
        super().__init__(message, wait)
        self.pool = pool
        self.reason = reason
        self.estimate_s = retry_after_s

    @classmethod
    def of(cls, exc: client_errors.QueueFull) -> QueueFull:
        """The client library's refusal, in the same words."""
        return cls(str(exc), exc.pool, exc.reason, exc.retry_after_s)


class BudgetExceeded(LimitExceeded):
    """The tenant's spend today has reached its daily budget and its settings say `over_budget:
    refuse` (429): nothing was started; Retry-After is the time until the budget resets."""

    def __init__(self, exc: client_errors.BudgetExceeded) -> None:
        super().__init__(str(exc), exc.retry_after_s)
        self.tenant = exc.tenant
        self.reason = exc.reason
        self.resets_at = exc.resets_at
        self.spent = {"gpu_s": exc.spent_gpu_s, "usd": exc.spent_usd}
        self.limits = {
            "gpu_seconds_per_day": exc.gpu_seconds_per_day,
            "usd_per_day": exc.usd_per_day,
        }


class Overloaded(LimitExceeded):
    """This replica is at its limit of concurrent requests or open streams (503)."""


class FollowFailed(Exception):
    """The follower stopped without the job ending (Temporal lost past the reconnect horizon):
    the stream ends, and the client reconnects."""


class Dropped(Exception):
    """This subscriber fell too far behind and was dropped."""


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def not_found(job_id: str) -> ApiError:
    """One body for an unknown job and another tenant's: nothing tells them apart."""
    return ApiError(404, "JobNotFound", f"no job {job_id!r}", job_id=job_id)


def batch_not_found(batch_id: str) -> ApiError:
    """As `not_found`: an unknown batch and another tenant's answer the same."""
    return ApiError(404, "BatchNotFound", f"no batch {batch_id!r}", batch_id=batch_id)


def invalid(
    problems: Sequence[Mapping[str, Any]], error_type: str = INVALID_REQUEST, whole: str = "request"
) -> ApiError:
    """`whole`: what a problem of the whole body (an empty `loc`) is said to be about."""
    shown = "; ".join(
        f"{'.'.join(str(part) for part in p['loc']) or whole}: {p['message']}" for p in problems[:5]
    )
    return ApiError(422, error_type, shown or f"the {whole} is not valid", problems=list(problems))


def priority_not_allowed(message: str) -> ApiError:
    """A priority better than the tenant's `max_priority` (403): nothing was started."""
    return ApiError(403, ErrorType.PRIORITY_NOT_ALLOWED, message)


def retry_after(seconds: int) -> dict[str, str]:
    return {"Retry-After": str(max(1, seconds))}


def no_pool_queue(pool: str) -> ApiError:
    return ApiError(
        404,
        "NoPoolQueue",
        f"no queue runs for pool {pool!r}: it has no max_running (unbounded: its jobs never "
        "wait in our queue), no job has asked for one of its slots yet, or no such pool",
        pool=pool,
    )


def api_error_for(exc: Exception) -> ApiError:
    """What the client sees for `exc` (an `ApiError` as it is; anything unknown: 500)."""
    match exc:
        case ApiError():
            return exc
        case Dropped():
            message = "this stream fell too far behind: reconnect with Last-Event-ID"
            return ApiError(503, "StreamDropped", message)
        case Unauthorized():
            return ApiError(401, "Unauthorized", str(exc), headers={"WWW-Authenticate": "Bearer"})
        case Overloaded():
            return ApiError(503, "Overloaded", str(exc), headers=retry_after(exc.retry_after_s))
        case client_errors.QueueFull():
            return api_error_for(QueueFull.of(exc))
        case QueueFull():
            return ApiError(
                429,
                "QueueFull",
                str(exc),
                headers=retry_after(exc.retry_after_s),
                pool=exc.pool,
                reason=exc.reason,
                retry_after_s=exc.estimate_s,
            )
        case client_errors.BudgetExceeded():
            return api_error_for(BudgetExceeded(exc))
        case BudgetExceeded():
            return ApiError(
                429,
                "BudgetExceeded",
                str(exc),
                headers=retry_after(exc.retry_after_s),
                tenant=exc.tenant,
                reason=exc.reason,
                resets_at=exc.resets_at.isoformat(),
                spent=exc.spent,
                limits=exc.limits,
            )
        case LimitExceeded():
            return ApiError(
                429, type(exc).__name__, str(exc), headers=retry_after(exc.retry_after_s)
            )
        case client_errors.JobNotFound():
            return not_found(exc.job_id)
        case client_errors.NoPoolQueue():
            return no_pool_queue(str(exc))
        case client_errors.InvalidJobId():
            return ApiError(404, "JobNotFound", str(exc))
        case client_errors.BatchNotFound():
            return batch_not_found(exc.batch_id)
        case client_errors.BatchConflict():
            return ApiError(409, "BatchConflict", str(exc), batch_id=exc.batch_id)
        case client_errors.InvalidBatch():
            return invalid([{"loc": [], "message": str(exc)}], "InvalidBatch")
        case client_errors.JobConflict():
            return ApiError(409, "JobConflict", str(exc), job_id=exc.job_id)
        case client_errors.JobAlreadyEnded():
            status = exc.status.model_dump(mode="json", exclude=INTERNAL)
            return ApiError(409, "JobAlreadyEnded", str(exc), job_id=exc.job_id, status=status)
        case client_errors.ResumeRefused():
            return ApiError(409, "ResumeRefused", str(exc), job_id=exc.job_id, reason=exc.reason)
        case client_errors.RequestTooLarge():
            return ApiError(413, "RequestTooLarge", str(exc))
        case client_errors.InvalidOverride():
            return invalid([{"loc": ["segments"], "message": str(exc)}])
        case client_errors.InputNeedsStaging() | client_errors.InputFileError():
            return invalid([{"loc": ["inputs"], "message": str(exc)}])
        case ValidationError():
            return invalid(validation_problems(exc), _typed(exc))
        case client_errors.TemporalUnreachable():
            return ApiError(
                503,
                "TemporalUnavailable",
                "Temporal does not answer: try again shortly",
                headers=retry_after(UNAVAILABLE_RETRY_AFTER_S),
            )
        case client_errors.JobUnanswered():
            return ApiError(
                503,
                "JobUnanswered",
                "the job exists but no worker answered for it: try again shortly",
                headers=retry_after(UNAVAILABLE_RETRY_AFTER_S),
                job_id=exc.job_id,
            )
        case client_errors.StorageFailed():
            return ApiError(502, "StorageFailed", str(exc))
        case client_errors.SearchAttributesMissing():
            return ApiError(500, "SearchAttributesMissing", str(exc))
        case client_errors.ClientError():
            return ApiError(502, type(exc).__name__, str(exc))
    return ApiError(500, "InternalError", "the gateway failed this request; it is logged")


def validation_problems(
    exc: ValidationError, prefix: Sequence[str | int] = ()
) -> list[dict[str, Any]]:
    """Each problem with its `loc`: the field path, and for a graph the node and its field
    (`["graph", "3", "inputs.seed"]`, with `node` beside it)."""
    problems: list[dict[str, Any]] = []
    for error in exc.errors():
        loc = [*prefix, *error["loc"]]
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, GraphRefused):
            for problem in cause.problems:
                where = [*loc, problem.node] if problem.node is not None else list(loc)
                problems.append(
                    {
                        **problem.as_dict(),
                        "loc": [*where, problem.field],
                        "type": type(cause).__name__,
                    }
                )
            continue
        if isinstance(cause, RequestRefused):
            loc = [*prefix, *cause.field.split(".")]
        message = str(cause) if isinstance(cause, ValueError) else error["msg"]
        problems.append({"loc": loc, "message": message, "type": error["type"]})
    return problems


def _typed(exc: ValidationError) -> str:
    """`InvalidGraph` when every problem is the graph's: a client can branch on the type."""
    causes = [(e.get("ctx") or {}).get("error") for e in exc.errors()]
    if causes and all(isinstance(cause, GraphRefused) for cause in causes):
        return "InvalidGraph"
    return INVALID_REQUEST


def install_error_handlers(app: FastAPI) -> None:
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    async def known(request: Request, exc: Exception) -> JSONResponse:
        error = api_error_for(exc)
        if error.status_code >= 500 and not isinstance(exc, ApiError):
            log.warning(
                "request_failed",
                path=request.url.path,
                status=error.status_code,
                error=type(exc).__name__,
                detail=str(exc)[:300],
            )
        return error.response()

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kinds = {404: "NotFound", 405: "MethodNotAllowed"}
        error = ApiError(
            exc.status_code,
            kinds.get(exc.status_code, "HTTPError"),
            str(exc.detail),
            headers=dict(exc.headers or {}),
        )
        return error.response()

    async def request_invalid(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        problems = [
            {"loc": list(e["loc"]), "message": e["msg"], "type": e["type"]} for e in exc.errors()
        ]
        return invalid(problems).response()

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request_crashed", path=request.url.path, error=type(exc).__name__)
        return api_error_for(exc).response()

    for kind in (ApiError, Unauthorized, LimitExceeded, client_errors.ClientError, ValidationError):
        app.add_exception_handler(kind, known)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, request_invalid)
    app.add_exception_handler(Exception, unexpected)
