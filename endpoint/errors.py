"""Every exception the handler raises of its own; the protocol core's are protocol.errors'.

    SettingsError (ValueError)    the environment is not usable (names the variable to fix)
    InputProblem (ValueError)     the job's input cannot be run (the message is for the sender)
    StagedInputMissing            a staged input is not in the bucket
    UnsafePath (ValueError)       a name that would leave its folder
    ClaimError                    S3 could not read or write a claim: worth retrying later
    ClaimConflict                 a conditional write of a claim lost its race
    UploadError                   an output could not be stored, or not as streamed
    OutputTooLarge                base64 outputs would not fit in a RunPod result

endpoint.failures is the one place they (and the core's) become the `EndpointError` the handler
returns. Kept apart from it because failures.py imports the modules raising them.
"""

from __future__ import annotations


class SettingsError(ValueError):
    """The environment is not usable; the message names the variable to fix."""


class InputProblem(ValueError):
    """The job's input cannot be run; the message is for the sender."""


class StagedInputMissing(Exception):
    """A staged input is not in the bucket (deleted, or another bucket's credentials)."""


class UnsafePath(ValueError):
    """A name that would leave its folder (or names no file in it)."""


class ClaimError(Exception):
    """S3 could not be read or written (not a lost race): worth retrying later."""


class ClaimConflict(Exception):
    """A conditional write lost: someone else wrote the claim since we read it."""


class UploadError(Exception):
    """The object could not be stored, or is not stored as streamed. `again`: streaming the
    file once more may succeed."""

    def __init__(self, message: str, *, again: bool = False) -> None:
        super().__init__(message)
        self.again = again


class OutputTooLarge(Exception):
    """Base64 outputs would not fit in a RunPod result."""
