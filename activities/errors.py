"""Turning failures into `ApplicationError`s the workflow can branch on.

Temporal owns retries, so each failure says whether retrying can help; the `type` strings come
from `workflows.shared.ErrorType` and clients see them in `JobStatus.error.type`.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from temporalio.exceptions import ApplicationError

from protocol.comfyui.events import is_fatal_device_error, is_out_of_memory
from protocol.errors import (
    ComfyError,
    ComfyHTTPError,
    ComfyPromptRejected,
    ComfyUnavailable,
    HistoryMissing,
    PromptLost,
)
from workflows.errors import StorageError
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


def from_comfy(exc: ComfyError | PromptLost | HistoryMissing, doing: str) -> ApplicationError:
    """The one place the protocol core's ComfyUI errors become activity failures."""
    if isinstance(exc, PromptLost):
        return fatal(ErrorType.PROMPT_LOST, str(exc))
    if isinstance(exc, HistoryMissing):
        # Written late, not lost: another attempt reads it again.
        return retryable(ErrorType.OUTPUT_MISSING, f"{doing}: {exc}")
    if isinstance(exc, ComfyPromptRejected):
        return fatal(
            ErrorType.PROMPT_REJECTED,
            f"ComfyUI rejected the graph: {exc}",
            error=exc.error,
            node_errors=exc.node_errors,
        )
    if isinstance(exc, ComfyUnavailable):
        return retryable(ErrorType.BACKEND_UNAVAILABLE, f"{doing}: ComfyUI unavailable: {exc}")
    if isinstance(exc, ComfyHTTPError) and exc.status_code == 413:
        return fatal(
            ErrorType.INVALID_REQUEST,
            f"{doing}: ComfyUI refused the request as too large (its --max-upload-size): {exc}",
            status_code=413,
        )
    if isinstance(exc, ComfyHTTPError) and 400 <= exc.status_code < 500:
        # Reachable, and refusing: not "unavailable", and no retry changes its answer.
        return fatal(ErrorType.BACKEND_ERROR, f"{doing}: {exc}", status_code=exc.status_code)
    return retryable(ErrorType.BACKEND_UNAVAILABLE, f"{doing}: {exc}")


def from_storage(exc: StorageError, doing: str) -> ApplicationError:
    """S3 failures: missing credentials or bucket are fatal; the rest is worth retrying."""
    message = f"{doing}: {exc}"
    if exc.retryable:
        return retryable(ErrorType.STORAGE_ERROR, message)
    return fatal(ErrorType.STORAGE_ERROR, message)


def execution_failure(data: Mapping[str, Any]) -> ApplicationError:
    node = f"node {data.get('node_id')} ({data.get('node_type')})"
    message = f"{node}: {data.get('exception_type')}: {data.get('exception_message')}"
    if is_out_of_memory(dict(data)):
        return fatal(ErrorType.OUT_OF_MEMORY, f"out of GPU memory at {message}")
    if is_fatal_device_error(dict(data)):
        return fatal(ErrorType.BACKEND_FAULT, f"unrecoverable device fault at {message}")
    return fatal(ErrorType.EXECUTION_ERROR, message)


def history_failure(messages: list[Any]) -> ApplicationError:
    for item in messages:
        if isinstance(item, list) and len(item) == 2 and item[0] == "execution_error":
            return execution_failure(item[1])
        if isinstance(item, list) and len(item) == 2 and item[0] == "execution_interrupted":
            return fatal(ErrorType.INTERRUPTED, "prompt was interrupted")
    return fatal(ErrorType.EXECUTION_ERROR, "prompt failed (history says error)")
