"""An async client for one RunPod serverless endpoint's public API (PROTOCOLS.md), on httpx.

Not the `runpod` SDK's client: it drops `policy`, raises KeyError on HTTP errors and loops
forever on CANCELLED streams (DESIGN.md §1). Errors are translated at this edge into
`workflows.errors`' `RunPodError`s; answers are `activities.runpod.models`.

Retries: 429 and 5xx / transport failures are retried here, briefly (`RetryPolicy`: a few
attempts, jittered, under a total budget), because RunPod's limits are per 10 s window and a
second later usually works. Past that budget the error goes to the caller and Temporal owns the
rest. `/run` is the exception: it has no idempotency key, so it is retried only when the
platform provably did not take it (429, or a connection that was never made). Once the request
may have reached RunPod, a failure is `RunPodSubmissionAmbiguous` and never retried here.

The API key is a `SecretStr` given at construction (read from the environment at start-up by
`configuration.settings.runpod_api_keys`), set per request as a header of the request only, and
kept out of every log line, repr and message: text from RunPod that goes into a message is
scrubbed of it first.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
import structlog
from pydantic import BaseModel, SecretStr, ValidationError

from activities.runpod.models import (
    ENDPOINT_ID_PATTERN,
    RunPodHealth,
    RunPodJob,
    RunPodPurged,
    RunPodState,
    RunPodStream,
    RunPolicy,
    is_job_id,
)
from activities.runpod.retry import RetryPolicy, parse_retry_after
from configuration.pools import RUNPOD_API_KEY_ENV, PoolConfig
from protocol.runpod.contract import EndpointInput
from workflows.errors import (
    RunPodAuthError,
    RunPodJobGone,
    RunPodRateLimited,
    RunPodRefused,
    RunPodRequestTooLarge,
    RunPodSubmissionAmbiguous,
    RunPodUnavailable,
)

log = structlog.get_logger(__name__)

# `/run` takes at most "10 MB". Read as 10^7 bytes, the stricter of the two readings: a body
# that passes here passes RunPod whichever it means.
MAX_RUN_BYTES = 10 * 1000 * 1000

# Transport failures raised before the request left this process: RunPod never saw it.
_NEVER_SENT: tuple[type[httpx.TransportError], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.ProxyError,
    httpx.UnsupportedProtocol,
)
_REDACTED = "[redacted]"

Model = TypeVar("Model", bound=BaseModel)
Sleep = Callable[[float], Awaitable[None]]


def run_body(job_input: EndpointInput, policy: RunPolicy) -> bytes:
    """The exact bytes `/run` is sent: measured before sending, sent as measured."""
    payload = {
        # exclude_none: a stock client's input carries no `durable_comfy` block at all.
        "input": job_input.model_dump(mode="json", exclude_none=True),
        "policy": policy.wire(),
    }
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


class RunPodClient:
    """HTTP calls to one serverless endpoint. Build with a shared `httpx.AsyncClient`.

    `sleep` and `rng` are the waits' clock and dice (tests pass their own); the default dice
    are the system's, so two workers throttled together do not wait alike.
    """

    def __init__(
        self,
        base_url: str,
        endpoint_id: str,
        api_key: SecretStr,
        http: httpx.AsyncClient,
        *,
        api_key_env: str = RUNPOD_API_KEY_ENV,
        retry: RetryPolicy | None = None,
        sleep: Sleep = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        if not ENDPOINT_ID_PATTERN.match(endpoint_id):
            raise ValueError("not a RunPod endpoint id (letters, digits, '-' and '_' only)")
        self.base_url = base_url.rstrip("/")
        self.endpoint_id = endpoint_id
        self.api_key_env = api_key_env
        self._api_key = api_key
        self._http = http
        self._retry = retry or RetryPolicy()
        self._sleep = sleep
        self._rng = rng or random.SystemRandom()

    @classmethod
    def for_pool(
        cls, pool: PoolConfig, api_key: SecretStr, http: httpx.AsyncClient, **options: Any
    ) -> RunPodClient:
        """The client of a validated `kind: runpod` pool (its url and endpoint id are set)."""
        if pool.kind != "runpod" or not pool.url or not pool.endpoint_id:
            raise ValueError("not a validated runpod pool")
        return cls(
            pool.url,
            pool.endpoint_id,
            api_key,
            http,
            api_key_env=pool.api_key_env or RUNPOD_API_KEY_ENV,
            **options,
        )

    def __repr__(self) -> str:
        return f"RunPodClient(base_url={self.base_url!r}, endpoint_id={self.endpoint_id!r})"

    # --- the API ------------------------------------------------------------------------------

    async def run(self, job_input: EndpointInput, policy: RunPolicy) -> RunPodJob:
        """`POST /run`: a new job, `IN_QUEUE`. Bodies over `MAX_RUN_BYTES` are never sent.

        Raises `RunPodSubmissionAmbiguous` when the request may have reached RunPod but no
        usable answer came back; every other error means no job was created.
        """
        body = run_body(job_input, policy)
        submission = job_input.durable_comfy.submission if job_input.durable_comfy else None
        if len(body) > MAX_RUN_BYTES:
            raise RunPodRequestTooLarge(
                f"endpoint {self.endpoint_id}: the /run body is {len(body):,} bytes, over "
                f"RunPod's limit of {MAX_RUN_BYTES:,}; not sent (inputs this large go to S3 "
                "and are passed by reference)",
                size=len(body),
                limit=MAX_RUN_BYTES,
                status_code=None,
            )
        data = await self._call("POST", "/run", body=body, submitting=True)
        try:
            job = RunPodJob.model_validate(data)
        except ValidationError:
            job = None
        if job is None or not is_job_id(job.id):
            raise RunPodSubmissionAmbiguous(
                f"endpoint {self.endpoint_id}: POST /run answered without a readable job id: "
                f"{self._scrub(json.dumps(data))[:200]}; a job may exist"
            )
        # `job_id` is ours in every log line: RunPod's goes by `runpod_job_id`. The follow logs
        # `runpod_submitted` with the job's context; this line adds the endpoint and the size.
        log.info(
            "runpod_run_answered",
            endpoint_id=self.endpoint_id,
            runpod_job_id=job.id,
            submission=submission,
            body_bytes=len(body),
        )
        return job

    async def status(self, job_id: str) -> RunPodJob:
        """`GET /status/{id}`. `RunPodJobGone` (404) once the TTL or the result's retention
        expired, or for an id RunPod never issued."""
        data = await self._call("GET", self._job_route("status", job_id), job_id=job_id)
        return self._model(RunPodJob, data, f"GET /status/{job_id}")

    async def stream(self, job_id: str) -> RunPodStream:
        """`GET /stream/{id}`: what a generator handler yielded since the last call."""
        data = await self._call("GET", self._job_route("stream", job_id), job_id=job_id)
        return self._model(RunPodStream, data, f"GET /stream/{job_id}")

    async def cancel(self, job_id: str) -> RunPodJob:
        """`POST /cancel/{id}` -> `{id, status}`. Cancelling a finished job changes nothing;
        read the state back with `status` to confirm."""
        data = await self._call("POST", self._job_route("cancel", job_id), job_id=job_id)
        return self._model(RunPodJob, data, f"POST /cancel/{job_id}")

    async def cancelled_unless_ended(self, job_id: str) -> tuple[RunPodJob, RunPodState | None]:
        """The job as `status` reads it, cancelled first unless it had ended, and the state it
        was in when this cancelled it (None: it had ended, and nothing was sent)."""
        job = await self.status(job_id)
        if job.state is None or job.state.terminal:
            return job, None
        await self.cancel(job_id)
        return await self.status(job_id), job.state

    async def retry(self, job_id: str) -> RunPodJob:
        """`POST /retry/{id}`: a FAILED or TIMED_OUT job back to IN_QUEUE under the same id
        (and the same input, so the same submission token). Other states are refused (4xx),
        which is also the answer to a second /retry when the first one's answer was lost: read
        the status before concluding anything from a refusal."""
        data = await self._call("POST", self._job_route("retry", job_id), job_id=job_id)
        return self._model(RunPodJob, data, f"POST /retry/{job_id}")

    async def purge_queue(self) -> RunPodPurged:
        """`POST /purge-queue`: every *queued* job of the endpoint removed (running ones stay).
        The whole endpoint's queue, other jobs' too: an operator's tool, not teardown's."""
        data = await self._call("POST", "/purge-queue")
        return self._model(RunPodPurged, data, "POST /purge-queue")

    async def health(self) -> RunPodHealth:
        """`GET /health`: job counts and workers by state."""
        data = await self._call("GET", "/health")
        return self._model(RunPodHealth, data, "GET /health")

    # --- one request, translated --------------------------------------------------------------

    def _job_route(self, action: str, job_id: str) -> str:
        if not is_job_id(job_id):
            # Ids also come from outputs (a claim holder): nothing unchecked goes into a path.
            raise RunPodRefused(f"not a RunPod job id: {job_id[:80]!r}; not sent", None)
        return f"/{action}/{job_id}"

    async def _call(
        self,
        method: str,
        route: str,
        *,
        job_id: str | None = None,
        body: bytes | None = None,
        submitting: bool = False,
    ) -> Any:
        """One call with the client's own bounded waits on `RunPodUnavailable` (429 included).
        `RunPodSubmissionAmbiguous` is not a `RunPodUnavailable`: it is never retried here."""
        attempt, waited = 0, 0.0
        calling = log.bind(endpoint_id=self.endpoint_id, route=route)
        while True:
            try:
                return await self._once(method, route, job_id, body, submitting)
            except RunPodUnavailable as exc:
                retry_after = exc.retry_after if isinstance(exc, RunPodRateLimited) else None
                delay = self._retry.delay(attempt, retry_after, self._rng.random())
                if attempt + 1 >= self._retry.attempts or waited + delay > self._retry.budget_s:
                    calling.warning(
                        "runpod_giving_up",
                        attempts=attempt + 1,
                        waited_s=round(waited, 3),
                        error=str(exc),
                    )
                    raise
                calling.info(
                    "runpod_retrying",
                    attempt=attempt + 1,
                    delay_s=round(delay, 3),
                    retry_after_s=retry_after,
                    error=str(exc),
                )
                await self._sleep(delay)
                waited += delay
                attempt += 1

    async def _once(
        self, method: str, route: str, job_id: str | None, body: bytes | None, submitting: bool
    ) -> Any:
        where = f"endpoint {self.endpoint_id}: {method} {route}"
        headers = {
            "Authorization": f"Bearer {self._api_key.get_secret_value()}",
            "Accept": "application/json",
        }
        if body is not None:
            headers["Content-Type"] = "application/json"
        try:
            response = await self._http.request(
                method,
                self.base_url + f"/{self.endpoint_id}" + route,
                content=body,
                headers=headers,
            )
        except httpx.TransportError as exc:
            # `from None` here and below: httpx's exception holds the request, headers and all,
            # and its text is not ours to scrub; everything worth knowing is in the message.
            what = f"{where}: {type(exc).__name__}: {self._scrub(str(exc))}"
            if submitting and not isinstance(exc, _NEVER_SENT):
                raise RunPodSubmissionAmbiguous(
                    f"{what}; the request was sent and its answer lost: a job may exist"
                ) from None
            raise RunPodUnavailable(what) from None

        status = response.status_code
        if status in (401, 403):
            raise RunPodAuthError(
                f"{where}: HTTP {status}: RunPod refused the API key; set {self.api_key_env} "
                f"to a key with access to endpoint {self.endpoint_id}",
                status,
                self.api_key_env,
            )
        if status == 429:
            raise RunPodRateLimited(
                f"{where}: HTTP 429: rate limited",
                parse_retry_after(response.headers.get("Retry-After")),
            )
        if status >= 500:
            what = f"{where}: HTTP {status}: {self._excerpt(response)}"
            if submitting:
                # A gateway's 5xx does not say whether the platform behind it created the job.
                raise RunPodSubmissionAmbiguous(f"{what}; a job may exist")
            raise RunPodUnavailable(what)
        if status == 404 and job_id is not None:
            raise RunPodJobGone(
                f"{where}: HTTP 404: RunPod does not know job {job_id} (its TTL or its result's "
                "retention expired, or the id is not this endpoint's)",
                job_id,
            )
        if status == 404:
            raise RunPodRefused(
                f"{where}: HTTP 404: no endpoint {self.endpoint_id} at {self.base_url} "
                "(check the pool's endpoint_id and url)",
                status,
            )
        if status == 413:
            size = len(body or b"")
            raise RunPodRequestTooLarge(
                f"{where}: HTTP 413: the {size:,}-byte body is too large for RunPod",
                size=size,
                limit=MAX_RUN_BYTES,
                status_code=status,
            )
        if not 200 <= status < 300:
            raise RunPodRefused(f"{where}: HTTP {status}: {self._excerpt(response)}", status)
        try:
            return response.json()
        except ValueError:
            what = f"{where}: HTTP {status} with an unreadable body: {self._excerpt(response)}"
            if submitting:
                raise RunPodSubmissionAmbiguous(f"{what}; a job may exist") from None
            raise RunPodUnavailable(what) from None

    def _model(self, model: type[Model], data: Any, what: str) -> Model:
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            # A proxy's error page or a half-written answer: asking again may well work.
            raise RunPodUnavailable(
                f"endpoint {self.endpoint_id}: {what}: unexpected answer "
                f"({exc.error_count()} problem(s)): {self._scrub(json.dumps(data))[:200]}"
            ) from None

    def _excerpt(self, response: httpx.Response) -> str:
        # Scrubbed before it is cut: a cut could leave half a key that no longer matches.
        return self._scrub(response.text)[:300] or "(empty body)"

    def _scrub(self, text: str) -> str:
        """`text` without the API key: an echoing proxy or error page must not carry it on."""
        secret = self._api_key.get_secret_value()
        return text.replace(secret, _REDACTED) if secret else text
