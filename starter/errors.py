"""Errors of the client library.

    ClientError
    ├── JobNotFound      no job with that ID in this namespace
    ├── ContactLost      Temporal unreachable past the reconnect horizon (the job runs on)
    └── InputFileError   an `--input NAME=PATH` that cannot be read
Validation problems with a request are pydantic `ValidationError`s raised before anything is
sent: they say which field is wrong and how to fix it.
"""

from __future__ import annotations


class ClientError(Exception):
    """Base of the client library's own errors."""


class JobNotFound(ClientError):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job {job_id!r} in this namespace")
        self.job_id = job_id


class ContactLost(ClientError):
    """The client could not reach Temporal for longer than the reconnect horizon.

    The job itself is unaffected: its state lives server-side. Watch it again by ID later; an
    attached job that hears from nobody for `abandon_after_s` is abandoned and torn down.
    """

    def __init__(self, job_id: str, attempts: int, last_error: BaseException) -> None:
        super().__init__(
            f"lost contact with job {job_id!r} after {attempts} attempt(s): {last_error}; "
            "the job keeps running server-side"
        )
        self.job_id = job_id
        self.attempts = attempts


class InputFileError(ClientError):
    """An input file named on the command line cannot be used."""
