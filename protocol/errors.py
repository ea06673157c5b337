"""Errors of the protocol core's own making, shared by the worker and the RunPod handler; each
side translates them at its edge into its own (a `StorageError`, an `UploadError`)."""

from __future__ import annotations


class TooManyParts(ValueError):
    """The stream is longer than S3's 10,000 parts of the upload's part size: no retry fits it."""
