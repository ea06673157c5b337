"""`POST /v1/uploads` (docs/http-api.md, Uploads): a presigned PUT for one input file, into the
caller's own staging area of the bucket (`_staged/{tenant}/{sha256}/{name}`,
workflows/tenancy.py), answered with the `s3://` URI a job of the same tenant names it by.

The gateway never carries the file: the client PUTs it to the bucket, held by the signature to
the size, type and sha256 it declared here. The key is the content's hash, so the same file sent
twice is one object, and a file already there is said to be (`exists`): its PUT may be skipped.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

import structlog
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from gateway.deps import caller, request_slot
from gateway.errors import ApiError
from gateway.state import gateway_of
from gateway.uploads import read_upload
from workflows.tenancy import staged_upload_key

log = structlog.get_logger("gateway.uploads")

router = APIRouter(prefix="/v1", dependencies=[Depends(request_slot)], tags=["uploads"])

Tenant = Annotated[str, Depends(caller)]

UPLOADS_UNAVAILABLE = (
    "this gateway has no bucket to take uploads: set DURABLE_COMFY_BUCKET on the gateway (with "
    "DURABLE_COMFY_S3_ENDPOINT off AWS, and credentials: AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY, or a profile), the workers' bucket"
)


class UploadAnswer(BaseModel):
    """Where the file goes and how to send it."""

    uri: str = Field(description="the file's s3:// URI: a job input of this tenant's jobs")
    put_url: str = Field(description="PUT the file's bytes here (a bearer credential)")
    expires_at: datetime = Field(description="when put_url stops working (UTC)")
    headers: dict[str, str] = Field(
        description="send each with the PUT, as it is: the signature covers them"
    )
    exists: bool = Field(
        description="the file is already stored (same sha256 and size): the PUT may be skipped"
    )


UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/UploadRequest"}}},
    }
}


@router.post(
    "/uploads",
    status_code=201,
    response_model=UploadAnswer,
    openapi_extra=UPLOAD_BODY,
    summary="Presign the upload of an input file",
)
async def presign_upload(request: Request, tenant: Tenant) -> JSONResponse:
    """A presigned PUT for one input file of at most the gateway's upload limit, in the caller's
    staging area; its `uri` is an `s3` input of the caller's jobs (and no one else's)."""
    gateway = gateway_of(request)
    upload = read_upload(await request.body(), gateway.settings.upload_max_bytes)
    client = await gateway.client()
    store = client.store
    if store is None:
        raise ApiError(503, "UploadsUnavailable", UPLOADS_UNAVAILABLE)
    key = staged_upload_key(tenant, upload.sha256, upload.key_name)
    with client.translated_errors():
        found = await store.head(key)
        put = await store.presign_put(
            key,
            size=upload.size,
            sha256=upload.sha256,
            content_type=upload.content_type,
            ttl_s=gateway.settings.upload_ttl_s,
        )
    exists = found is not None and (found.size, found.sha256) == (upload.size, upload.sha256)
    log.info("upload_presigned", tenant=tenant, key=key, size=upload.size, exists=exists)
    answer = UploadAnswer(
        uri=f"s3://{store.settings.bucket}/{key}",
        put_url=put.url,
        expires_at=put.expires_at,
        headers=put.headers,
        exists=exists,
    )
    return JSONResponse(answer.model_dump(mode="json"), status_code=201)
