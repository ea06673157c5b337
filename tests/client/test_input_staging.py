"""Client-side staging of inputs too large for a job's request (starter/staging.py): unit tests
on an in-memory store. The end-to-end path (CLI -> S3 -> worker -> ComfyUI simulator) is in
tests/client/test_input_staging_e2e.py."""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import pytest

from activities.storage import StoredObject
from configuration.settings import S3Settings
from starter.errors import InputFileError, InputNeedsStaging
from starter.requests import request_from_files
from starter.staging import oversized_inputs, require_staging, stage_inputs, staged_key
from tests.support.cli import EXAMPLE
from workflows.contracts import (
    MAX_INLINE_INPUT_BYTES,
    InlineInput,
    JobRequest,
    OutputSpec,
    S3Input,
    UrlInput,
)


class MemoryStore:
    """The two calls staging makes, on a dict; counts uploads."""

    def __init__(self) -> None:
        self.settings = S3Settings(bucket="artifacts")
        self.objects: dict[tuple[str, str], StoredObject] = {}
        self.data: dict[tuple[str, str], bytes] = {}
        self.uploads = 0

    async def head(self, key: str, *, bucket: str | None = None) -> StoredObject | None:
        return self.objects.get((bucket or self.settings.bucket, key))

    async def upload_stream(
        self,
        key: str,
        chunks: AsyncIterator[bytes],
        *,
        content_type: str,
        bucket: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> StoredObject:
        bucket = bucket or self.settings.bucket
        data = b"".join([chunk async for chunk in chunks])
        self.uploads += 1
        self.data[bucket, key] = data
        stored = StoredObject(
            bucket=bucket,
            key=key,
            uri=f"s3://{bucket}/{key}",
            size=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
            content_type=content_type,
        )
        self.objects[bucket, key] = stored
        return stored


def inline(data: bytes, filename: str = "big.png") -> InlineInput:
    return InlineInput(filename=filename, data_b64=base64.b64encode(data).decode())


BIG = os.urandom(MAX_INLINE_INPUT_BYTES + 1)
SMALL = os.urandom(MAX_INLINE_INPUT_BYTES)  # exactly the limit: still inline


def request(**inputs: InlineInput | S3Input) -> JobRequest:
    return JobRequest(graph={"1": {"class_type": "X", "inputs": {}}}, inputs=inputs)


async def test_an_input_over_the_inline_limit_is_uploaded_under_its_hash_and_sent_by_ref() -> None:
    store = MemoryStore()
    other = S3Input(uri="s3://mine/faces/1.png")
    refs: dict[str, InlineInput | S3Input] = {
        "big.png": inline(BIG, "my big.png"),
        "small.png": inline(SMALL),
        "s3.png": other,
    }
    sent = request(**refs)
    staged = await stage_inputs(sent, store)
    digest = hashlib.sha256(BIG).hexdigest()
    key = f"jobs/_staged/{digest}/my_big.png"
    assert staged.inputs["big.png"] == S3Input(uri=f"s3://artifacts/{key}")
    assert staged.inputs["small.png"] == sent.inputs["small.png"]
    assert staged.inputs["s3.png"] == other
    assert store.data["artifacts", key] == BIG
    assert store.objects["artifacts", key].content_type == "image/png"
    assert oversized_inputs(staged) == {}


async def test_staging_the_same_file_again_uploads_nothing_and_gives_the_same_request() -> None:
    store = MemoryStore()
    first = await stage_inputs(request(**{"big.png": inline(BIG)}), store)
    again = await stage_inputs(request(**{"big.png": inline(BIG)}), store)
    assert store.uploads == 1
    assert again == first


async def test_an_object_at_the_key_with_other_content_is_replaced() -> None:
    store = MemoryStore()
    key = staged_key("jobs", hashlib.sha256(BIG).hexdigest(), "big.png")
    store.objects["artifacts", key] = StoredObject(
        bucket="artifacts", key=key, uri="", size=3, sha256="0" * 64, content_type="image/png"
    )
    await stage_inputs(request(**{"big.png": inline(BIG)}), store)
    assert store.uploads == 1 and store.data["artifacts", key] == BIG


async def test_staging_goes_to_the_requests_output_bucket_and_prefix() -> None:
    store = MemoryStore()
    sent = request(**{"big.png": inline(BIG)}).model_copy(
        update={"output": OutputSpec(bucket="team-bucket", prefix="renders/2026/")}
    )
    staged = await stage_inputs(sent, store)
    ref = staged.inputs["big.png"]
    assert isinstance(ref, S3Input)
    assert ref.uri.startswith("s3://team-bucket/renders/2026/_staged/")


async def test_without_s3_an_oversized_input_is_refused_with_what_to_set() -> None:
    sent = request(**{"small.png": inline(SMALL), "big.png": inline(BIG)})
    with pytest.raises(InputNeedsStaging) as refused:
        await stage_inputs(sent, None)
    assert refused.value.name == "big.png" and refused.value.size == len(BIG)
    assert "DURABLE_COMFY_BUCKET" in str(refused.value)
    assert "--input big.png=s3://BUCKET/KEY" in str(refused.value)
    require_staging(request(**{"small.png": inline(SMALL)}), can_stage=False)  # nothing to stage


async def test_a_small_request_is_returned_as_it_is_without_touching_s3() -> None:
    sent = request(**{"small.png": inline(SMALL)})
    assert await stage_inputs(sent, None) is sent


def test_the_cli_reads_a_file_over_the_inline_limit_for_staging(tmp_path: Path) -> None:
    (tmp_path / "big.png").write_bytes(BIG)
    built = request_from_files(EXAMPLE, inputs=[f"big.png={tmp_path / 'big.png'}"])
    assert oversized_inputs(built) == {"big.png": len(BIG)}


def test_the_cli_sends_https_sources_as_url_inputs_and_refuses_plain_http() -> None:
    built = request_from_files(EXAMPLE, inputs=["face.png=https://images.example.test/f.png"])
    assert built.inputs["face.png"] == UrlInput(url="https://images.example.test/f.png")
    with pytest.raises(InputFileError, match="must be https"):
        request_from_files(EXAMPLE, inputs=["face.png=http://images.example.test/f.png"])


async def test_inputs_each_under_the_limit_but_too_large_together_stage_the_largest() -> None:
    """Several files under the per-file limit can still overflow the request: the largest are
    staged until the rest fit inline together, and no more."""
    a, b, c = os.urandom(700_000), os.urandom(500_000), os.urandom(300_000)
    sent = request(
        **{"a.png": inline(a, "a.png"), "b.png": inline(b, "b.png"), "c.png": inline(c, "c.png")}
    )
    assert oversized_inputs(sent) == {"a.png": len(a)}
    store = MemoryStore()
    staged = await stage_inputs(sent, store)
    assert isinstance(staged.inputs["a.png"], S3Input)
    assert staged.inputs["b.png"] == sent.inputs["b.png"]
    assert staged.inputs["c.png"] == sent.inputs["c.png"]
    assert store.uploads == 1 and oversized_inputs(staged) == {}
    with pytest.raises(InputNeedsStaging, match="together over 1,048,576 bytes") as refused:
        await stage_inputs(sent, None)
    assert refused.value.name == "a.png"
