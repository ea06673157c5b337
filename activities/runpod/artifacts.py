"""Where an output record's bytes are, and the checks a record must pass before it is used.

Three shapes reach the orchestrator in `output.images`:

    "s3"      our handler's record: `s3://bucket/key` with size and sha256, stored before the
              job ended; the orchestrator verifies both in S3 and copies nothing
    "url"     stock worker-comfyui with a bucket: a presigned https URL and nothing to verify
              against; the orchestrator downloads it and streams it to S3 itself
    "inline"  stock worker-comfyui without a bucket: base64 (or a data URI) in the answer; the
              orchestrator decodes it and streams it to S3 itself

Records come from the worker and are untrusted. Keys for what the orchestrator stores itself
("url", "inline") are built by `protocol.keys` from the record's filename, never from a path
the record gives. An "s3" record's key is refused (`UnusableArtifact`, before anything reads it)
unless it is a key `protocol.keys` could have built: non-empty levels that are each already a
safe component, so no absolute key, no `.`/`..` level, no control character, backslash or `%`.
Whether its bucket and folder are this job's is checked where the job is known, before any
read (`activities.runpod.follow`).

Stock records carry no node id and no subfolder, so two saves of one name (`a/out` and `b/out`
both write `out_00001_.png`) are told apart only by their place in the output: `record_keys`
gives every record its own key, the same on every attempt of the same follow, and refuses
(`KeyCollision`) what it still cannot tell apart. No output is ever skipped for its name.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from typing import Literal

from protocol.keys import MAX_KEY_BYTES, artifact_key, safe_component, shown
from protocol.runpod.contract import ArtifactRecord
from workflows.errors import KeyCollision, UnusableArtifact

ArtifactSource = Literal["s3", "url", "inline"]

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_DATA_URI = re.compile(r"^data:[^,]{0,200};base64,", re.IGNORECASE)
_EXTENSION = re.compile(r"\.[A-Za-z0-9]{1,10}$")


def record_keys(
    records: Sequence[ArtifactRecord], prefix: str, job_id: str, segment: int
) -> list[str]:
    """The key each of `records` (one answer's outputs, in its order) is kept under.

    Our handler's S3 records keep the key they were stored under. The others are keyed like
    the ComfyUI backend's outputs (node id, or "output", and the file name with its subfolder
    where the record has one); a name already given to an earlier record of the same answer
    gets the record's index (`out_00001_-1.png`), so a re-attempt reading the same answer maps
    each record to the same key. Two records still on one key: `KeyCollision`.
    """
    keys: list[str] = []
    for index, record in enumerate(records):
        if _stored_by_handler(record):
            keys.append(record.key or "")
            continue
        name = f"{record.subfolder}/{record.filename}" if record.subfolder else record.filename
        key = artifact_key(prefix, job_id, segment, record.node_id or "output", name)
        if key in keys:
            key = artifact_key(
                prefix, job_id, segment, record.node_id or "output", _indexed(name, index)
            )
        keys.append(key)
    first: dict[str, int] = {}
    for index, key in enumerate(keys):
        earlier = first.setdefault(key, index)
        if earlier != index and not same_output(records[earlier], records[index]):
            raise KeyCollision(
                f"outputs {earlier} ({shown(records[earlier].filename)}) and {index} "
                f"({shown(records[index].filename)}) would both be stored as {shown(key, 160)}; "
                "refusing to keep one in place of the other"
            )
    return keys


def same_output(a: ArtifactRecord, b: ArtifactRecord) -> bool:
    """Whether two records are one output told twice (an S3 record in a progress update and
    again in the result): the same stored object, the same size and sha256."""
    return (
        _stored_by_handler(a)
        and _stored_by_handler(b)
        and (a.bucket, a.key, a.size, a.sha256) == (b.bucket, b.key, b.size, b.sha256)
    )


def _stored_by_handler(record: ArtifactRecord) -> bool:
    return record.type == "s3_url" and bool(record.key)


def _indexed(name: str, index: int) -> str:
    match = _EXTENSION.search(name)
    cut = match.start() if match and match.start() > 0 else len(name)
    return f"{name[:cut]}-{index}{name[cut:]}"


def artifact_source(record: ArtifactRecord, *, verifiable: bool) -> ArtifactSource:
    """Which kind of record this is; `UnusableArtifact` when it is none of them.

    `verifiable`: the record comes from our handler, which promises size and sha256 for what it
    stored: a record without them could be a truncated upload nobody could tell apart.
    """
    name = shown(record.filename or "(no filename)")
    if record.type == "base64":
        if not record.data:
            raise UnusableArtifact(f"output {name}: empty base64 data")
        return "inline"
    if record.data.startswith("s3://") or (record.bucket and record.key):
        if not (record.bucket and record.key) and not _s3_parts(record.data):
            raise UnusableArtifact(f"output {name}: no bucket and key in {shown(record.data)}")
        s3_location(record)
        if verifiable and (record.size is None or not _SHA256.match(record.sha256 or "")):
            raise UnusableArtifact(
                f"output {name}: stored in S3 without its size and sha256, so it cannot be verified"
            )
        return "s3"
    if record.data.startswith("https://") or record.data.startswith("http://"):
        return "url"
    raise UnusableArtifact(f"output {name}: unrecognised reference {shown(record.data, 40)}")


def s3_location(record: ArtifactRecord) -> tuple[str, str]:
    """(bucket, key) of an "s3" record: the explicit fields, else parsed from `data`; refused
    when the two disagree or the key is not one `protocol.keys` builds (module docstring)."""
    parts = _s3_parts(record.data)
    if record.bucket and record.key:
        if parts is not None and parts != (record.bucket, record.key):
            raise UnusableArtifact(
                f"output {shown(record.filename)}: its bucket and key "
                f"({shown(record.bucket)}, {shown(record.key)}) are not its data "
                f"{shown(record.data)}"
            )
        parts = record.bucket, record.key
    if parts is None:
        raise UnusableArtifact(f"output {shown(record.filename)}: not an s3:// reference")
    bucket, key = parts
    # Bucket names are lower case, digits, dots and hyphens: never anything the sanitising changes.
    problem = key_problem(key) or (None if safe_component(bucket) == bucket else "not a bucket")
    if problem is not None:
        raise UnusableArtifact(
            f"output {shown(record.filename)} points at {shown(f's3://{bucket}/{key}', 160)}: "
            f"{problem}; refused, not read"
        )
    return bucket, key


def inline_bytes(record: ArtifactRecord) -> bytes:
    """The bytes of an "inline" record (plain base64 or a data URI), strictly decoded."""
    data = _DATA_URI.sub("", record.data, count=1)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise UnusableArtifact(
            f"output {shown(record.filename)}: not valid base64 ({exc})"
        ) from None


def key_problem(key: str) -> str | None:
    """Why `key` cannot be a key our handler stored (None: it can)."""
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        return f"a key longer than {MAX_KEY_BYTES} bytes"
    if key.startswith("/"):
        return "an absolute key"
    for level in key.split("/"):
        if not level:
            return "an empty level in the key"
        if safe_component(level) != level:
            # Our handler's keys are built by `artifact_key`, whose levels are left as they are
            # by the same sanitising: anything else is not a key of ours.
            return f"a key level ({shown(level, 40)}) that is not a sanitised name"
    return None


def _s3_parts(data: str) -> tuple[str, str] | None:
    if not data.startswith("s3://"):
        return None
    bucket, _, key = data.removeprefix("s3://").partition("/")
    return (bucket, key) if bucket and key else None
