"""Turning failures into `ApplicationError`s the workflow can branch on.

Temporal owns retries, so each failure says whether retrying can help; the `type` strings come
from `workflows.shared.ErrorType` and clients see them in `JobStatus.error.type`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio.exceptions import ApplicationError

from activities.comfy_client import (
    ComfyError,
    ComfyHTTPError,
    ComfyPromptRejected,
    ComfyUnavailable,
)
from activities.storage_errors import StorageError
from workflows.shared import ErrorType


def fatal(error_type: str, message: str, **details: Any) -> ApplicationError:
    """A failure no retry can fix: bad input, a rejected graph, an OOM."""
    return ApplicationError(message, details or None, type=error_type, non_retryable=True)


def retryable(
    error_type: str, message: str, *, next_retry_delay: float | None = None, **details: Any
) -> ApplicationError:
    delay = timedelta(seconds=next_retry_delay) if next_retry_delay is not None else None
    return ApplicationError(
        message, details or None, type=error_type, non_retryable=False, next_retry_delay=delay
    )


def from_comfy(exc: ComfyError, doing: str) -> ApplicationError:
    """The one place ComfyUI client errors become activity failures."""
    if isinstance(exc, ComfyPromptRejected):
        return fatal(
            ErrorType.PROMPT_REJECTED,
            f"ComfyUI rejected the graph: {exc}",
            error=exc.error,
            node_errors=exc.node_errors,
        )
    if isinstance(exc, ComfyUnavailable):
        return retryable(ErrorType.BACKEND_UNAVAILABLE, f"{doing}: ComfyUI unavailable: {exc}")
    if isinstance(exc, ComfyHTTPError) and 400 <= exc.status_code < 500:
        return fatal(ErrorType.BACKEND_UNAVAILABLE, f"{doing}: {exc}")
    return retryable(ErrorType.BACKEND_UNAVAILABLE, f"{doing}: {exc}")


def from_storage(exc: StorageError, doing: str) -> ApplicationError:
    """S3 failures: missing credentials or bucket are fatal; the rest is worth retrying."""
    message = f"{doing}: {exc}"
    if exc.retryable:
        return retryable(ErrorType.STORAGE_ERROR, message)
    return fatal(ErrorType.STORAGE_ERROR, message)
