"""Every exception the workflow and the activities raise of their own, one tree a section.

    ValueError
    ├── GraphFormatError          the graph is not an API-format prompt (its tree below)
    ├── RequestRefused            a part of the request out of bounds (`field` names it)
    ├── AreaError                 storage outside the tenant's area
    │   ├── InputOutsideArea      an `s3://` input
    │   └── OutputOutsideArea     `output.prefix` or `output.bucket`
    ├── UnsafeWebhookUrl          a webhook URL the worker will not POST to
    └── UnusableArtifact          a RunPod output record that names no bytes to fetch or verify
        └── KeyCollision          two outputs would be stored under one key
    StorageError                  S3 failed, or its settings (its tree below)
    UrlFetchError                 a URL input could not be fetched: unsafe, unacceptable, failed
    WebhookUnresolved             a webhook's host did not resolve now
    RunPodError                   RunPod's API failed or refused (its tree below)
    CompletedFromClaim            the RunPod follow's way out when a gone holder did the work

Here, not in activities/, because the client, the gateway and the configuration raise and
read them too, and they may import workflows/ but not the activities. Where they cross into
Temporal each is mapped once to an `ApplicationError` typed with `workflows.shared.ErrorType`:
storage errors by activities/errors.py, RunPod's by activities/runpod/failures.py, the rest by
the activity raising them. Temporal records anything unmapped by its class name, so none is
ever renamed. Sandboxed workflow modules import this module inside
`workflow.unsafe.imports_passed_through()`, as every other workflows import:
`failure_exception_types` must hold the very class the graph checks raise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# -- the graph ---------------------------------------------------------------------------------

# Problems a refusal's message lists before "and N more".
SHOWN_PROBLEMS = 20


class GraphFormatError(ValueError):
    """The graph is not a ComfyUI API-format prompt. The message says what to fix.

    Subclasses (all `GraphRefused`) carry the problems one by one, each naming its node and
    field, so a caller can point at them (`JobError` details, an editor):

        GraphRefused
        ├── GraphShapeError        not `{node_id: {class_type, inputs}}`, or a dangling link
        ├── GraphTooLarge          over a size bound: bytes, nodes, inputs, a string, nesting
        ├── GraphNameError         a node id or class_type too long or with control characters
        ├── GraphLinkError         a link's output index is not a small whole number
        ├── GraphCycleError        the links go round in a circle
        ├── UndeclaredInputFile    a load node names a file that is not a declared input
        ├── ForeignFileReference   a value that reaches for a file not the job's own: an
        │                          `[output]`/`[temp]` annotation, a path, another job's file
        ├── UnclassifiedNode       a class the pool's registry cannot describe, on a pool
        │                          that refuses those (`unclassified_inputs: refuse`)
        └── NodeClassNotAllowed    a class outside the pool's allow-list
    """


@dataclass(frozen=True)
class GraphProblem:
    """One thing wrong with a graph. `node` is None for the graph as a whole; `field` is
    `graph`, `class_type`, `inputs` or `inputs.<name>`."""

    node: str | None
    field: str
    message: str

    def as_dict(self) -> dict[str, str | None]:
        """JSON-safe: a lone surrogate in a hostile name would fail the payload's encoding."""
        node = None if self.node is None else safe_text(self.node)
        return {"node": node, "field": safe_text(self.field), "message": safe_text(self.message)}


def safe_text(text: str) -> str:
    """`text` with anything that has no UTF-8 form (lone surrogates) escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class GraphRefused(GraphFormatError):
    """One or more `GraphProblem`s of one kind; the message lists them (at most
    `SHOWN_PROBLEMS`, then how many more)."""

    summary = "invalid API-format graph"

    def __init__(self, problems: Sequence[GraphProblem], *, summary: str | None = None) -> None:
        if not problems:
            raise ValueError("a refusal needs at least one problem")
        self.problems = list(problems)
        summary = summary if summary is not None else self.summary
        shown = "; ".join(p.message for p in self.problems[:SHOWN_PROBLEMS])
        more = len(self.problems) - SHOWN_PROBLEMS
        if more > 0:
            shown += f"; and {more} more"
        super().__init__(f"{summary}: {shown}" if summary else shown)

    @property
    def node(self) -> str | None:
        """The node of the first problem (None: the graph as a whole)."""
        return self.problems[0].node

    @property
    def field(self) -> str:
        return self.problems[0].field


class GraphShapeError(GraphRefused):
    pass


class GraphTooLarge(GraphRefused):
    summary = "graph too large"


class GraphNameError(GraphRefused):
    summary = "invalid node id or class_type"


class GraphLinkError(GraphRefused):
    summary = "invalid link"


class GraphCycleError(GraphRefused):
    summary = "the graph has a cycle (ComfyUI cannot run it)"


class UndeclaredInputFile(GraphRefused):
    summary = "input file not declared"


class ForeignFileReference(GraphRefused):
    summary = "a node reads a file that is not the job's own"


class UnclassifiedNode(GraphRefused):
    summary = "node class unknown to the pool's registry"


class NodeClassNotAllowed(GraphRefused):
    summary = "node class not allowed"


# -- the rest of the request -------------------------------------------------------------------


class RequestRefused(ValueError):
    """A part of the request out of bounds. `field` is its dotted path in the request."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class AreaError(ValueError):
    """A request names storage outside its tenant's area. The message says what to send."""


class InputOutsideArea(AreaError):
    """An `s3://` input outside the tenant's area and every allowed prefix."""


class OutputOutsideArea(AreaError):
    """`output.prefix` or `output.bucket` (`field`) outside the tenant's area."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# -- storage -----------------------------------------------------------------------------------


class StorageError(Exception):
    """Base of the storage errors; `.retryable` tells Temporal whether trying again may help.

        StorageError
        ├── ObjectMissing         the key does not exist
        ├── IntegrityError        size or sha256 differs from what was written or expected
        ├── StorageConfigError    settings missing/invalid, or credentials/bucket rejected by S3
        └── SourceStreamError     the caller's byte stream raised mid-upload (upload aborted)

    activities.storage_errors makes botocore's errors these; the S3 settings raise
    StorageConfigError too (configuration/ imports it from here). Messages name the operation,
    bucket, key and S3 error code, never a credential or a presigned URL: they end up in
    Temporal history.
    """

    retryable: bool = True

    def __init__(self, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(message)
        if retryable is not None:
            self.retryable = retryable


class ObjectMissing(StorageError):
    retryable = False


class IntegrityError(StorageError):
    retryable = True  # a fresh upload or download usually cures it


class SourceStreamError(StorageError):
    """The chunk iterator given to `upload_stream` raised; `__cause__` is its exception."""


class StorageConfigError(StorageError):
    retryable = False


# -- URL inputs and webhooks ------------------------------------------------------------------

# Which rule refused a URL input, or which step of fetching it failed.
FetchReason = Literal[
    "scheme",
    "credentials",
    "port",
    "host",
    "address",
    "redirects",
    "too_large",
    "content_type",
    "content_encoding",
    "status",
    "dns",
    "tls",
    "connect",
    "timeout",
]


class UrlFetchError(Exception):
    """A URL input that could not be fetched: `reason` says which rule or step, `retryable`
    whether a later try may succeed."""

    def __init__(
        self,
        reason: FetchReason,
        message: str,
        *,
        host: str,
        address: str | None = None,
        retryable: bool = False,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.host = host
        self.address = address
        self.retryable = retryable


class UnsafeUrl(UrlFetchError):
    """The request asks for something the worker must not connect to."""


class UnacceptableBody(UrlFetchError):
    """The server answered, with something that cannot be an input file."""


class FetchFailed(UrlFetchError):
    """The file could not be had from that URL (now, or at all: see `retryable`)."""


class UnsafeWebhookUrl(ValueError):
    """The worker will not POST to this URL; the message says which rule refuses it."""


class WebhookUnresolved(Exception):
    """The host did not resolve now (a DNS failure that may pass): try again later."""


# -- RunPod ------------------------------------------------------------------------------------


class RunPodError(Exception):
    """Base of every error talking to RunPod's serverless API, as types the caller can branch on.

        RunPodError                    base; `.retryable`: whether asking again later may help
        ├── RunPodAuthError            401/403: the key is missing, wrong, or has no access
        ├── RunPodRefused              any other 4xx: the platform said no, and will again
        │   ├── RunPodRequestTooLarge  a `/run` body over 10 MB (refused before sending), a 413
        │   └── RunPodPolicyError      a policy outside the platform's ranges (not sent)
        ├── RunPodJobGone              404 on a job: TTL expired, result expired, or no such id
        ├── RunPodUnavailable          5xx, transport errors, unreadable answers: retry later
        │   └── RunPodRateLimited      429 beyond the client's own waiting budget; `.retry_after`
        └── RunPodSubmissionAmbiguous  `/run` was sent and its answer lost: a job may exist

    `RunPodSubmissionAmbiguous` is deliberately not a `RunPodUnavailable`: `/run` has no
    idempotency key, so an `except RunPodUnavailable: try again` must never resubmit a job that
    may be running. Every refusal of `/run` (auth, 4xx, 429, 5xx on reads, a connection never
    made) means no job.

    Messages name the endpoint, the route and the status, never the API key: they end up in
    logs and in Temporal history.
    """

    retryable = False


class RunPodAuthError(RunPodError):
    """401/403. Fatal: no retry brings a key. The message says which variable to set."""

    def __init__(self, message: str, status_code: int, variable: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.variable = variable


class RunPodRefused(RunPodError):
    """The request was refused; `status_code` is None when refused here, before sending."""

    def __init__(self, message: str, status_code: int | None) -> None:
        super().__init__(message)
        self.status_code = status_code


class RunPodRequestTooLarge(RunPodRefused):
    """`/run` takes at most 10 MB: larger inputs go to S3 and travel by reference."""

    def __init__(self, message: str, size: int, limit: int, status_code: int | None) -> None:
        super().__init__(message, status_code)
        self.size = size
        self.limit = limit


class RunPodPolicyError(RunPodRefused):
    """An `executionTimeout` or `ttl` outside what RunPod accepts (5 s-7 days, 10 s-7 days)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, None)


class RunPodJobGone(RunPodError):
    """RunPod no longer knows the job: its TTL expired (a hard limit, counted from submission),
    its result's retention ran out (30 min after completion), or the id was never RunPod's."""

    def __init__(self, message: str, job_id: str) -> None:
        super().__init__(message)
        self.job_id = job_id


class RunPodUnavailable(RunPodError):
    """Could not get a usable answer: worth asking again later."""

    retryable = True


class RunPodRateLimited(RunPodUnavailable):
    """429 for longer than the client waits by itself; `retry_after` is RunPod's hint (s)."""

    def __init__(self, message: str, retry_after: float | None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RunPodSubmissionAmbiguous(RunPodError):
    """`/run` left this process and no readable answer came back (a read timeout, a reset
    connection, a 5xx from a proxy that may have passed it on, a garbled 200).

    A job may exist and be billed. Not retryable by the client: whether to submit again is the
    workflow's decision (safe with claims, a person's without).
    """


class UnusableArtifact(ValueError):
    """A record that names no bytes the orchestrator can fetch, or cannot be verified."""


class KeyCollision(UnusableArtifact):
    """Two different outputs would be stored under one key: one would be lost."""


class CompletedFromClaim(Exception):
    """The submission's work turned out done, by a holder that is gone: its claim says the
    prompt succeeded and every output is in the bucket. Raised from wherever the RunPod follow
    finds that, answered by its `run` with `result`, a `workflows.activity_io.FollowResult`
    (not imported: activity_io imports this module's graph errors, through workflows.graph)."""

    def __init__(self, result: object) -> None:
        super().__init__("completed from the claim")
        self.result = result
