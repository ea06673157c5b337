"""A request's input file as bytes: inline base64, an s3:// object or a public https URL, with
what to fix when it cannot be read; and the rule on which `s3://` objects a tenant's job may name
(`refuse_inputs_outside_area`, workflows/tenancy.py).

URL inputs go through `activities.url_fetch` (public addresses only, pinned connections, bounded
size); its refusals become `InvalidRequest` (the request asked for something it may not have)
and its failures `MissingInput` (the file is not to be had there; retryable when a later attempt
may find it).
"""

from __future__ import annotations

import base64
import binascii

import structlog
from temporalio.exceptions import ApplicationError

from activities.errors import fatal, from_storage, retryable
from activities.storage import ArtifactStore
from activities.url_fetch import UrlFetcher, default_fetcher
from configuration.settings import S3Settings
from workflows.activity_io import PrepareInput
from workflows.contracts import MAX_INLINE_INPUT_BYTES, InlineInput, InputRef, S3Input, UrlInput
from workflows.errors import FetchFailed, ObjectMissing, StorageError, UrlFetchError
from workflows.shared import ErrorType
from workflows.tenancy import inputs_outside_area

log = structlog.get_logger(__name__)


async def input_bytes(
    store: ArtifactStore,
    name: str,
    ref: InputRef,
    *,
    limit: int,
    fetcher: UrlFetcher | None = None,
) -> bytes:
    """`limit` is what the caller's backend accepts for one file; a URL input is also held to
    the fetcher's own cap. `fetcher` defaults to the worker-wide one (`default_fetcher`)."""
    if isinstance(ref, InlineInput):
        try:
            data = base64.b64decode(ref.data_b64, validate=True)
        except binascii.Error as exc:
            raise fatal(ErrorType.MISSING_INPUT, f"input {name!r} is not valid base64") from exc
        if len(data) > MAX_INLINE_INPUT_BYTES:
            raise fatal(
                ErrorType.INVALID_REQUEST,
                f"input {name!r} is {len(data)} bytes inline; inline inputs are limited to "
                f"{MAX_INLINE_INPUT_BYTES}: pass an s3:// reference instead",
            )
        return data
    if isinstance(ref, S3Input):
        bucket, _, key = ref.uri.removeprefix("s3://").partition("/")
        try:
            return await store.read_bytes(key, bucket=bucket, limit=limit)
        except ObjectMissing as exc:
            raise fatal(ErrorType.MISSING_INPUT, f"input {name!r}: {exc}") from exc
        except StorageError as exc:
            raise from_storage(exc, f"reading input {name!r}") from exc
    if isinstance(ref, UrlInput):
        try:
            fetched = await (fetcher or default_fetcher()).fetch(ref.url, limit=limit)
        except UrlFetchError as exc:
            raise from_url_fetch(exc, name) from exc
        return fetched.data
    raise fatal(ErrorType.INVALID_REQUEST, f"input {name!r}: unknown input kind")


def refuse_inputs_outside_area(req: PrepareInput, storage: S3Settings) -> None:
    """Every `s3://` input of a tenant's job must be in that tenant's area of the job's bucket
    or in a folder of `storage.allowed_input_prefixes`: else `InvalidRequest` naming the input
    and the rule, before anything is read or any backend asked. The worker's credentials can
    read every tenant's files; this is what keeps one tenant from naming another's. A job
    without a tenant (the SDK's single-tenant use) is not confined."""
    if req.tenant is None:
        return
    refused = inputs_outside_area(
        req.inputs,
        tenant=req.tenant,
        bucket=req.output.bucket or storage.bucket,
        allowed=storage.allowed_input_prefixes,
    )
    if refused:
        name, exc = refused[0]
        log.warning("s3_input.refused", job_id=req.job_id, tenant=req.tenant, input=name)
        raise fatal(ErrorType.INVALID_REQUEST, str(exc), input=name, rule="tenant_area") from exc


def from_url_fetch(exc: UrlFetchError, name: str) -> ApplicationError:
    """The one place URL-input failures become activity failures; details name the rule."""
    message = f"input {name!r}: {exc}"
    log.warning(
        "url_input.refused",
        input=name,
        reason=exc.reason,
        host=exc.host,
        address=exc.address,
        retryable=exc.retryable,
    )
    if isinstance(exc, FetchFailed) and exc.retryable:
        return retryable(
            ErrorType.MISSING_INPUT, message, reason=exc.reason, host=exc.host, address=exc.address
        )
    error_type = (
        ErrorType.MISSING_INPUT if isinstance(exc, FetchFailed) else ErrorType.INVALID_REQUEST
    )
    return fatal(error_type, message, reason=exc.reason, host=exc.host, address=exc.address)
