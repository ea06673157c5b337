"""Where a tenant's files live in the bucket, and which `s3://` objects a tenant's job may read.

A job whose request carries the `tenant` label (every job submitted through the gateway; an SDK
caller may set it too) is confined to its tenant's **area** of the job's bucket:

    jobs/{tenant}/{job}/...          what its jobs write (artifacts, staged inputs, claims)
    _staged/{tenant}/{sha256}/{name}  what it uploads (`POST /v1/uploads`, client staging)

An `s3://` input of such a job may name only that area, or a folder the operator allow-lists
(`allowed_input_prefixes`); anything else is refused before any GPU time
(`InputOutsideArea`). A job without the label is the single-tenant use of the SDK and CLI,
trusted with whatever the worker's credentials can read, and keeps the tenant-free layout
(`jobs/{job}/...`, `{prefix}/_staged/...`).

Pure: the gateway, the clients and the activities use these rules; the workflow uses none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from workflows.contracts import InputRef, S3Input
from workflows.errors import InputOutsideArea, OutputOutsideArea

JOBS_ROOT: Final = "jobs"
STAGING_ROOT: Final = "_staged"


def output_area(tenant: str) -> str:
    """The prefix a tenant's jobs store under (`jobs/{tenant}`): their `output.prefix`."""
    return f"{JOBS_ROOT}/{tenant}"


def staging_area(tenant: str) -> str:
    """The prefix a tenant's uploads are staged under (`_staged/{tenant}`)."""
    return f"{STAGING_ROOT}/{tenant}"


def staged_upload_key(tenant: str, sha256: str, safe_name: str) -> str:
    """`_staged/{tenant}/{sha256}/{name}`: content-addressed, so the same file sent twice is
    one object. `safe_name` is already a single safe key component."""
    return f"{staging_area(tenant)}/{sha256}/{safe_name}"


def split_uri(uri: str) -> tuple[str, str]:
    """`s3://BUCKET/KEY` as (bucket, key)."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


def key_levels_problem(key: str) -> str | None:
    """Why a key cannot be taken literally: an empty, `.` or `..` level, or a backslash (some
    stores map keys onto paths, where `jobs/a/../b` would be `jobs/b`)."""
    if "\\" in key:
        return "a key with a backslash"
    if any(level in ("", ".", "..") for level in key.split("/")):
        return "a key with an empty, '.' or '..' level"
    return None


def check_input_uri(
    name: str, uri: str, *, tenant: str, bucket: str, allowed: Iterable[str] = ()
) -> None:
    """Refuse (`InputOutsideArea`) an `s3://` input of a `tenant`'s job that names anything
    but that tenant's area of `bucket` (the job's bucket) or a folder in `allowed`
    (`s3://BUCKET/FOLDER/`, or `s3://BUCKET` for the whole bucket)."""
    source_bucket, key = split_uri(uri)
    problem = key_levels_problem(key)
    if problem is not None:
        raise InputOutsideArea(f"input {name!r}: {uri} is {problem}: name the object exactly")
    if source_bucket == bucket and any(
        key.startswith(area + "/") for area in (output_area(tenant), staging_area(tenant))
    ):
        return
    for folder in allowed:
        allowed_bucket, prefix = split_uri(folder)
        if source_bucket == allowed_bucket and key.startswith(prefix):
            return
    raise InputOutsideArea(
        f"input {name!r}: {uri} is outside tenant {tenant!r}'s own area "
        f"(s3://{bucket}/{output_area(tenant)}/ and s3://{bucket}/{staging_area(tenant)}/) "
        "and outside the folders this service allows: upload the file first (POST /v1/uploads "
        "answers with a uri to use), or send it inline or by https URL"
    )


def inputs_outside_area(
    inputs: Mapping[str, InputRef], *, tenant: str, bucket: str, allowed: Iterable[str] = ()
) -> list[tuple[str, InputOutsideArea]]:
    """Each `s3://` input of a tenant's request that `check_input_uri` refuses, with its name
    (every other kind of input is not the bucket's: not judged here)."""
    refused = []
    for name, ref in inputs.items():
        if not isinstance(ref, S3Input):
            continue
        try:
            check_input_uri(name, ref.uri, tenant=tenant, bucket=bucket, allowed=allowed)
        except InputOutsideArea as exc:
            refused.append((name, exc))
    return refused


def normalised_allowed_prefix(value: str) -> str:
    """An allow-list entry as a folder: `s3://BUCKET` (the whole bucket) or
    `s3://BUCKET/FOLDER/` (a missing trailing `/` is added, so `s3://b/shared` does not also
    allow `s3://b/shared-secrets/`). `ValueError` saying what is wrong."""
    if not value.startswith("s3://"):
        raise ValueError(f"{value!r} is not s3://BUCKET or s3://BUCKET/FOLDER/")
    bucket, key = split_uri(value)
    if not bucket:
        raise ValueError(f"{value!r} names no bucket")
    if not key:
        return f"s3://{bucket}/"
    folder = key if key.endswith("/") else key + "/"
    problem = key_levels_problem(folder[:-1])
    if problem is not None:
        raise ValueError(f"{value!r}: {problem}")
    return f"s3://{bucket}/{folder}"


def check_output(tenant: str, prefix: str, bucket: str | None, own_bucket: str | None) -> None:
    """Refuse (`OutputOutsideArea`) an `output.prefix` that is not the tenant's area or a
    folder in it, and an `output.bucket` other than `own_bucket` (the service's bucket).

    Levels are compared as given, `""` and `.` levels dropped as `protocol.keys.job_folder`
    drops them: the prefix the artifacts' keys are built from is then under the area."""
    area = output_area(tenant)
    levels = [level for level in prefix.split("/") if level not in ("", ".")]
    if levels[:2] != area.split("/") or ".." in levels or any("\\" in lv for lv in levels):
        raise OutputOutsideArea(
            "prefix",
            f"output.prefix {prefix!r} is outside tenant {tenant!r}'s area: leave it out "
            f"(jobs are stored under {area}/) or name a folder in it ({area}/FOLDER)",
        )
    if bucket is not None and bucket != own_bucket:
        raise OutputOutsideArea(
            "bucket",
            f"output.bucket {bucket!r}: a tenant's jobs are stored in the service's own "
            "bucket: leave output.bucket out",
        )
