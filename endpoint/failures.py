"""What went wrong, as the handler returns it (contract.EndpointError).

`error_type` uses the orchestrator's ErrorType names, so its RunPod client maps a failed job
onto the same failures as the ComfyUI backend's. `refresh_worker` is set where the worker itself
is broken (a CUDA fault, ComfyUI gone), so the platform replaces it.
"""

from __future__ import annotations

import structlog

from endpoint.errors import (
    ClaimConflict,
    ClaimError,
    InputProblem,
    OutputTooLarge,
    SettingsError,
    StagedInputMissing,
    UploadError,
)
from endpoint.s3 import S3_FAILURES, error_code
from protocol.comfyui.events import is_fatal_device_error, is_out_of_memory
from protocol.comfyui.follower import PromptEnd
from protocol.errors import (
    ComfyGone,
    ComfyHTTPError,
    ComfyPromptRejected,
    ComfyUnavailable,
    HistoryMissing,
    PromptLost,
    UnsafeOutputName,
)
from protocol.runpod.contract import EndpointError

log = structlog.get_logger(__name__)


def failure_of(exc: BaseException) -> EndpointError:
    """The EndpointError for an exception raised while running a job."""
    if isinstance(exc, InputProblem):
        return EndpointError(error=str(exc), error_type="InvalidRequest")
    if isinstance(exc, StagedInputMissing):
        return EndpointError(error=str(exc), error_type="MissingInput")
    if isinstance(exc, ComfyPromptRejected):
        # ComfyUI's reason once, per node, as the ComfyUI pool words it ("node 3 (KSampler):
        # input 'seed': ..."); no `details`, which readers append to the error.
        return EndpointError(
            error=f"ComfyUI rejected the graph: {exc}", error_type="PromptRejected"
        )
    if isinstance(exc, ComfyGone):
        return EndpointError(error=str(exc), error_type="BackendUnavailable", refresh_worker=True)
    if isinstance(exc, ComfyUnavailable):
        return EndpointError(error=f"ComfyUI unreachable: {exc}", error_type="BackendUnavailable")
    if isinstance(exc, ComfyHTTPError):
        return EndpointError(error=f"ComfyUI refused a call: {exc}", error_type="BackendError")
    if isinstance(exc, PromptLost):
        return EndpointError(error=str(exc), error_type="PromptLost")
    if isinstance(exc, HistoryMissing):
        return EndpointError(error=str(exc), error_type="OutputMissing")
    if isinstance(exc, OutputTooLarge):
        return EndpointError(error=str(exc), error_type="OutputTooLarge")
    if isinstance(exc, UnsafeOutputName):
        # A name ComfyUI gave that /view must not be asked for: that output is not stored.
        return EndpointError(error=str(exc), error_type="OutputMissing")
    if isinstance(exc, (UploadError, ClaimError, ClaimConflict, *S3_FAILURES)):
        text = error_code(exc) if isinstance(exc, S3_FAILURES) else str(exc)
        return EndpointError(error=f"storage: {text}", error_type="StorageError")
    if isinstance(exc, SettingsError):
        return EndpointError(error=str(exc), error_type="BackendError")
    log.error("unexpected_failure", exc_info=exc)
    return EndpointError(
        error=f"unexpected handler error: {type(exc).__name__}: {exc}", error_type="BackendError"
    )


def failure_of_end(end: PromptEnd) -> EndpointError | None:
    """None for a prompt that succeeded; else why it did not."""
    if end.outcome == "success":
        return None
    where = f"node {end.node} ({end.node_type})" if end.node else "the prompt"
    if end.outcome == "interrupted":
        return EndpointError(
            error=f"ComfyUI interrupted {where} (not this handler: someone else's /interrupt)",
            error_type="Interrupted",
        )
    detail = _execution_detail(end)
    if is_fatal_device_error(end.error):
        return EndpointError(
            error=f"unrecoverable GPU fault at {where}: {end.message}; the worker is replaced",
            error_type="BackendFault",
            details=[detail],
            refresh_worker=True,
        )
    if is_out_of_memory(end.error):
        return EndpointError(
            error=f"out of memory at {where}: {end.message}",
            error_type="OutOfMemory",
            details=[detail],
        )
    return EndpointError(
        error=f"workflow failed at {where}: {end.message}",
        error_type="ExecutionError",
        details=[detail],
    )


def _execution_detail(end: PromptEnd) -> str:
    """worker-comfyui's wording for an execution error."""
    return (
        f"Workflow execution error: Node Type: {end.node_type}, Node ID: {end.node}, "
        f"Message: {end.error.get('exception_message', end.message)}"
    )
