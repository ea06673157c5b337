"""Errors of the client library.

    ClientError
    ├── JobNotFound      no job with that ID in this namespace
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


class InputFileError(ClientError):
    """An input file named on the command line cannot be used."""
