"""Where an output record's bytes are, and the checks a record must pass before it is used.

Three shapes reach the orchestrator in `output.images`:

    "s3"      our handler's record: `s3://bucket/key` with size and sha256, stored before the
              job ended; the orchestrator verifies both in S3 and copies nothing
    "url"     stock worker-comfyui with a bucket: a presigned https URL and nothing to verify
              against; the orchestrator downloads it and streams it to S3 itself
    "inline"  stock worker-comfyui without a bucket: base64 (or a data URI) in the answer; the
              orchestrator decodes it and streams it to S3 itself

Filenames in records come from the worker and are untrusted: keys are built by
`activities.keys`, never from a record's own path.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Literal

from endpoint.contract import ArtifactRecord

ArtifactSource = Literal["s3", "url", "inline"]

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_DATA_URI = re.compile(r"^data:[^,]{0,200};base64,", re.IGNORECASE)


class UnusableArtifact(ValueError):
    """A record that names no bytes the orchestrator can fetch, or cannot be verified."""


def artifact_source(record: ArtifactRecord, *, verifiable: bool) -> ArtifactSource:
    """Which kind of record this is; `UnusableArtifact` when it is none of them.

    `verifiable`: the record comes from our handler, which promises size and sha256 for what it
    stored: a record without them could be a truncated upload nobody could tell apart.
    """
    name = record.filename or "(no filename)"
    if record.type == "base64":
        if not record.data:
            raise UnusableArtifact(f"output {name!r}: empty base64 data")
        return "inline"
    if record.data.startswith("s3://") or (record.bucket and record.key):
        if not (record.bucket and record.key) and not _s3_parts(record.data):
            raise UnusableArtifact(f"output {name!r}: no bucket and key in {record.data[:100]!r}")
        if verifiable and (record.size is None or not _SHA256.match(record.sha256 or "")):
            raise UnusableArtifact(
                f"output {name!r}: stored in S3 without its size and sha256, so it cannot be "
                "verified"
            )
        return "s3"
    if record.data.startswith("https://") or record.data.startswith("http://"):
        return "url"
    raise UnusableArtifact(f"output {name!r}: unrecognised reference {record.data[:40]!r}")


def s3_location(record: ArtifactRecord) -> tuple[str, str]:
    """(bucket, key) of an "s3" record: the explicit fields, else parsed from `data`."""
    if record.bucket and record.key:
        return record.bucket, record.key
    parts = _s3_parts(record.data)
    if parts is None:
        raise UnusableArtifact(f"output {record.filename!r}: not an s3:// reference")
    return parts


def inline_bytes(record: ArtifactRecord) -> bytes:
    """The bytes of an "inline" record (plain base64 or a data URI), strictly decoded."""
    data = _DATA_URI.sub("", record.data, count=1)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise UnusableArtifact(f"output {record.filename!r}: not valid base64 ({exc})") from None


def _s3_parts(data: str) -> tuple[str, str] | None:
    if not data.startswith("s3://"):
        return None
    bucket, _, key = data.removeprefix("s3://").partition("/")
    return (bucket, key) if bucket and key else None
