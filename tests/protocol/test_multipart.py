"""protocol.multipart, the streamed upload the worker and the handler share, against an S3 held in
memory (`MemoryS3`): every byte in order, the sha256 stamped by a pinned copy, memory bounded
with buffers reused and never refilled while sending, failures and cancellations aborting.
Parts are 64 KiB here (PART_SIZE patched) so that an object has many of them."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from structlog.testing import capture_logs

from protocol import multipart
from protocol.errors import TooManyParts
from protocol.multipart import upload_stream

P = 64 * 1024


@pytest.fixture(autouse=True)
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(multipart, "PART_SIZE", P)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def snapshot(body: io.BytesIO) -> bytes:
    with body.getbuffer() as view:
        return bytes(view)


class MemoryS3:
    """`S3Calls` over dicts, checking what S3 would (the part list, a copy's condition, a PUT's
    checksum), and recording what a test asks about: the calls, the parts sending at once, the
    buffers the parts came in."""

    def __init__(self, *, echo_checksum: bool = True) -> None:
        self.echo_checksum = echo_checksum
        # key -> (bytes, metadata, content type, etag)
        self.objects: dict[str, tuple[bytes, dict[str, str], str, str]] = {}
        self.uploads: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.aborted: list[str] = []
        self.completed: list[str] = []  # the ETags CompleteMultipartUpload answered
        self.buffers: set[int] = set()
        self.sending = 0
        self.most_sending = 0
        self.created = 0
        self.versions = 0
        # Set by a test: awaited inside a call, or raised from it.
        self.part_gate: Callable[[int], Awaitable[None]] | None = None
        self.fail_part: dict[int, BaseException] = {}
        self.abort_gate: asyncio.Event | None = None
        self.aborting = asyncio.Event()
        self.abort_error: BaseException | None = None
        self.after_complete: Callable[[str], None] | None = None
        self.fail_part_copy: BaseException | None = None

    def _etag(self) -> str:
        self.versions += 1
        return f'"v{self.versions}"'

    def open_uploads(self) -> list[str]:
        return sorted(self.uploads)

    async def put_object(self, **kw: Any) -> Any:
        self.calls.append(("put_object", {k: v for k, v in kw.items() if k != "Body"}))
        assert kw["Body"].tell() == 0
        data = snapshot(kw["Body"])
        checksum = base64.b64encode(hashlib.sha256(data).digest()).decode()
        if kw["ChecksumSHA256"] != checksum:
            raise ValueError("BadDigest")
        etag = self._etag()
        self.objects[kw["Key"]] = (data, dict(kw["Metadata"]), kw["ContentType"], etag)
        answer = {"ETag": etag}
        return answer | ({"ChecksumSHA256": checksum} if self.echo_checksum else {})

    async def create_multipart_upload(self, **kw: Any) -> Any:
        self.calls.append(("create_multipart_upload", dict(kw)))
        self.created += 1
        upload_id = f"u{self.created}"
        self.uploads[upload_id] = {"key": kw["Key"], "parts": {}, "create": dict(kw)}
        return {"UploadId": upload_id}

    async def upload_part(self, **kw: Any) -> Any:
        number = kw["PartNumber"]
        self.calls.append(("upload_part", {k: v for k, v in kw.items() if k != "Body"}))
        body: io.BytesIO = kw["Body"]
        assert body.tell() == 0
        self.buffers.add(id(body))
        before = snapshot(body)
        self.sending += 1
        self.most_sending = max(self.most_sending, self.sending)
        try:
            if self.part_gate is not None:
                await self.part_gate(number)
            await asyncio.sleep(0)
            if number in self.fail_part:
                raise self.fail_part[number]
            assert snapshot(body) == before, f"part {number}'s buffer was refilled while sending"
            etag = f'"p{number}-{hashlib.md5(before).hexdigest()[:8]}"'
            self.uploads[kw["UploadId"]]["parts"][number] = (before, etag)
            return {"ETag": etag}
        finally:
            self.sending -= 1

    async def complete_multipart_upload(self, **kw: Any) -> Any:
        self.calls.append(("complete_multipart_upload", dict(kw)))
        upload = self.uploads.pop(kw["UploadId"])
        listed = kw["MultipartUpload"]["Parts"]
        numbers = [p["PartNumber"] for p in listed]
        assert numbers == sorted(upload["parts"]) == list(range(1, len(numbers) + 1))
        assert all(upload["parts"][p["PartNumber"]][1] == p["ETag"] for p in listed)
        data = b"".join(upload["parts"][n][0] for n in numbers)
        etag = f'"{self._etag().strip(chr(34))}-{len(numbers)}"'
        create = upload["create"]
        self.objects[kw["Key"]] = (data, dict(create["Metadata"]), create["ContentType"], etag)
        self.completed.append(etag)
        if self.after_complete is not None:
            self.after_complete(kw["Key"])
        return {"ETag": etag}

    async def abort_multipart_upload(self, **kw: Any) -> Any:
        self.calls.append(("abort_multipart_upload", dict(kw)))
        self.aborting.set()
        if self.abort_gate is not None:
            await self.abort_gate.wait()
        if self.abort_error is not None:
            raise self.abort_error
        self.uploads.pop(kw["UploadId"], None)
        self.aborted.append(kw["UploadId"])
        return {}

    def _source(self, kw: dict[str, Any]) -> tuple[bytes, dict[str, str], str, str]:
        assert kw["CopySource"] == {"Bucket": kw["Bucket"], "Key": kw["Key"]}
        found = self.objects[kw["Key"]]
        if kw["CopySourceIfMatch"] != found[3]:
            raise PermissionError("PreconditionFailed")
        return found

    async def copy_object(self, **kw: Any) -> Any:
        self.calls.append(("copy_object", dict(kw)))
        data, _, _, _ = self._source(kw)
        assert kw["MetadataDirective"] == "REPLACE"
        self.objects[kw["Key"]] = (data, dict(kw["Metadata"]), kw["ContentType"], self._etag())
        return {}

    async def upload_part_copy(self, **kw: Any) -> Any:
        self.calls.append(("upload_part_copy", dict(kw)))
        if self.fail_part_copy is not None:
            raise self.fail_part_copy
        data, _, _, _ = self._source(kw)
        start, end = (int(x) for x in kw["CopySourceRange"].removeprefix("bytes=").split("-"))
        piece = data[start : end + 1]
        etag = f'"c{kw["PartNumber"]}"'
        self.uploads[kw["UploadId"]]["parts"][kw["PartNumber"]] = (piece, etag)
        return {"CopyPartResult": {"ETag": etag}}

    def ops(self, name: str) -> list[dict[str, Any]]:
        return [kw for op, kw in self.calls if op == name]


async def stream(data: bytes, chunk: int, read: list[int] | None = None) -> AsyncIterator[bytes]:
    for start in range(0, len(data), chunk):
        await asyncio.sleep(0)  # as a network source would, letting the parts' tasks run
        if read is not None:
            read.append(min(start + chunk, len(data)))
        yield data[start : start + chunk]


async def upload(s3: MemoryS3, data: bytes, chunk: int = 7_777, **kw: Any) -> multipart.Uploaded:
    options: dict[str, Any] = {"max_in_flight": 3, "content_type": "x/y"} | kw
    return await upload_stream(s3, bucket="b", key="k", chunks=stream(data, chunk), **options)


# --- every byte, in order, with its sha256 ----------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, P - 1, P, P + 1, 2 * P, 23 * P + 123])
@pytest.mark.parametrize("max_in_flight", [1, 2, 4])
async def test_every_byte_is_stored_in_order_with_its_sha256(size: int, max_in_flight: int) -> None:
    data = random.Random(size).randbytes(size)
    s3 = MemoryS3()
    done = await upload(s3, data, max_in_flight=max_in_flight, metadata={"node": "9"})
    stored, metadata, content_type, _ = s3.objects["k"]
    assert stored == data and content_type == "x/y"
    assert metadata == {"node": "9", "sha256": sha(data)}
    assert (done.size, done.sha256) == (size, sha(data))
    if size < P:
        assert done.parts == 0 and s3.created == 0 and len(s3.ops("put_object")) == 1
    else:
        assert done.parts == -(-size // P) == len(s3.ops("upload_part")) and s3.created == 1
        assert not done.confirmed
    assert s3.open_uploads() == [] and s3.aborted == []
    assert s3.most_sending <= max_in_flight


async def test_a_put_carries_its_sha256_and_is_confirmed_only_when_the_store_echoes_it() -> None:
    data = b"small output"
    checksum = base64.b64encode(hashlib.sha256(data).digest()).decode()
    echoing, silent = MemoryS3(), MemoryS3(echo_checksum=False)
    assert (await upload(echoing, data)).confirmed
    assert not (await upload(silent, data)).confirmed
    [put] = echoing.ops("put_object")
    assert put["ChecksumSHA256"] == checksum and put["Metadata"] == {"sha256": sha(data)}


async def test_parts_are_hashed_in_order_even_when_they_are_stored_out_of_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = random.Random(1).randbytes(6 * P + 5)
    hashed: list[bytes] = []
    real_hash_part = multipart.hash_part

    def hash_part(hasher: Any, part: multipart.Part) -> None:
        hashed.append(snapshot(part.body)[:16])
        real_hash_part(hasher, part)

    async def later_parts_first(number: int) -> None:
        await asyncio.sleep(0.002 * (8 - number))

    monkeypatch.setattr(multipart, "hash_part", hash_part)
    s3 = MemoryS3()
    s3.part_gate = later_parts_first
    done = await upload(s3, data, max_in_flight=4)
    assert done.sha256 == sha(data) and s3.objects["k"][0] == data
    assert hashed == [data[start : start + 16] for start in range(0, len(data), P)]


# --- the digest, stamped by a copy pinned to our object ---------------------------------------


async def test_the_digest_is_stamped_by_a_copy_pinned_to_the_completed_object() -> None:
    data = random.Random(2).randbytes(3 * P)
    s3 = MemoryS3()
    await upload(s3, data, metadata={"node": "9"}, content_type="video/mp4")
    [create] = s3.ops("create_multipart_upload")
    assert create["Metadata"] == {"node": "9"} and create["ContentType"] == "video/mp4"
    [copy] = s3.ops("copy_object")
    assert copy["CopySourceIfMatch"] == s3.completed[0]
    assert copy["Metadata"] == {"node": "9", "sha256": sha(data)}
    assert copy["ContentType"] == "video/mp4"
    assert s3.objects["k"][1:3] == ({"node": "9", "sha256": sha(data)}, "video/mp4")


async def test_a_concurrent_writer_never_receives_our_digest() -> None:
    data = random.Random(3).randbytes(2 * P)
    s3 = MemoryS3()

    def overwritten(key: str) -> None:
        s3.objects[key] = (b"theirs", {}, "x/y", '"theirs"')

    s3.after_complete = overwritten
    with pytest.raises(PermissionError, match="PreconditionFailed"):
        await upload(s3, data)
    assert s3.objects["k"] == (b"theirs", {}, "x/y", '"theirs"')


async def test_above_the_copy_limit_the_digest_is_stamped_by_pinned_part_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(multipart, "COPY_OBJECT_LIMIT", 2 * P)
    monkeypatch.setattr(multipart, "COPY_PART_SIZE", P + 1)
    data = random.Random(4).randbytes(3 * P + 7)
    s3 = MemoryS3()
    await upload(s3, data, metadata={"node": "9"})
    stored, metadata, _, _ = s3.objects["k"]
    assert stored == data and metadata == {"node": "9", "sha256": sha(data)}
    assert s3.ops("copy_object") == []
    copies = s3.ops("upload_part_copy")
    ranges = [c["CopySourceRange"] for c in copies]
    assert ranges == [
        f"bytes={s}-{min(s + P + 1, len(data)) - 1}" for s in range(0, len(data), P + 1)
    ]
    assert {c["CopySourceIfMatch"] for c in copies} == {s3.completed[0]}
    assert s3.open_uploads() == []


async def test_a_failed_part_copy_aborts_its_upload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(multipart, "COPY_OBJECT_LIMIT", P)
    s3 = MemoryS3()
    s3.fail_part_copy = failure = ConnectionResetError("cut")
    with pytest.raises(ConnectionResetError) as caught:
        await upload(s3, random.Random(5).randbytes(2 * P))
    assert caught.value is failure
    assert s3.aborted == ["u2"] and s3.open_uploads() == []


# --- memory: bounded, buffers reused, never refilled while sending ------------------------------


async def test_the_source_never_runs_ahead_of_the_parts_in_flight() -> None:
    data = random.Random(6).randbytes(20 * P)
    release = asyncio.Event()

    async def held(number: int) -> None:
        await release.wait()

    s3 = MemoryS3()
    s3.part_gate = held
    read: list[int] = []
    task = asyncio.create_task(
        upload_stream(
            s3,
            bucket="b",
            key="k",
            chunks=stream(data, 5_000, read),
            content_type="x/y",
            max_in_flight=3,
        )
    )
    for _ in range(50):
        await asyncio.sleep(0)
    # Three parts held by the store, none being filled: not a byte more than 3 parts (and the
    # chunk that completed the third) has been read.
    assert s3.sending == 3
    assert read[-1] < 3 * P + 5_000
    release.set()
    done = await task
    assert done.sha256 == sha(data) and s3.objects["k"][0] == data


async def test_part_buffers_are_reused_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    made = 0
    presized = multipart._presized

    def counted(size: int) -> io.BytesIO:
        nonlocal made
        made += 1
        return presized(size)

    monkeypatch.setattr(multipart, "_presized", counted)
    data = random.Random(7).randbytes(40 * P + 3)
    s3 = MemoryS3()
    done = await upload(s3, data, max_in_flight=3)
    assert done.parts == 41 and s3.objects["k"][0] == data
    # The first part's buffer grows on its own; at most max_in_flight more are ever made, and
    # the 41 parts went out in no more buffers than that.
    assert 1 <= made <= 3
    assert len(s3.buffers) <= 4


# --- failures and cancellation: the upload is aborted, the error goes on ------------------------


async def test_a_failed_part_aborts_the_upload_early_and_its_error_surfaces_unchanged() -> None:
    data = random.Random(8).randbytes(50 * P)
    s3 = MemoryS3()
    s3.fail_part[1] = failure = ConnectionResetError("cut")
    read: list[int] = []
    with pytest.raises(ConnectionResetError) as caught:
        await upload_stream(
            s3,
            bucket="b",
            key="k",
            chunks=stream(data, P // 4, read),
            content_type="x/y",
            max_in_flight=8,
        )
    assert caught.value is failure
    assert s3.aborted == ["u1"] and s3.open_uploads() == [] and "k" not in s3.objects
    assert s3.ops("complete_multipart_upload") == []
    # Seen as the loop comes round, not once all 8 slots are taken.
    assert read[-1] <= 3 * P, "the failure waited for the parts in flight to fill up"


async def test_a_failing_source_aborts_the_upload() -> None:
    failure = OSError("ComfyUI went away")

    async def failing() -> AsyncIterator[bytes]:
        yield bytes(2 * P + 1)
        raise failure

    s3 = MemoryS3()
    with pytest.raises(OSError) as caught:
        await upload_stream(
            s3, bucket="b", key="k", chunks=failing(), content_type="x/y", max_in_flight=2
        )
    assert caught.value is failure
    assert s3.aborted == ["u1"] and s3.open_uploads() == []


async def test_too_many_parts_is_refused_and_aborted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(multipart, "MAX_PARTS", 2)
    s3 = MemoryS3()
    with pytest.raises(TooManyParts):
        await upload(s3, bytes(2 * P + 1))
    assert s3.aborted == ["u1"] and s3.open_uploads() == []


async def stalled_upload(s3: MemoryS3, cancel_waits_for_abort: bool) -> asyncio.Task[Any]:
    """An upload with its multipart upload open, waiting for a source that stopped sending."""
    asked = asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        yield bytes(P)
        asked.set()
        await asyncio.Event().wait()
        yield b""

    task = asyncio.create_task(
        upload_stream(
            s3,
            bucket="b",
            key="k",
            chunks=stalls(),
            content_type="x/y",
            max_in_flight=2,
            cancel_waits_for_abort=cancel_waits_for_abort,
        )
    )
    await asyncio.wait_for(asked.wait(), 5)
    assert s3.open_uploads() == ["u1"]
    return task


async def test_a_cancelled_upload_is_aborted() -> None:
    s3 = MemoryS3()
    task = await stalled_upload(s3, True)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert s3.aborted == ["u1"] and s3.open_uploads() == []


async def test_a_second_cancel_waits_for_the_abort() -> None:
    s3 = MemoryS3()
    s3.abort_gate = asyncio.Event()
    task = await stalled_upload(s3, True)
    task.cancel()
    await asyncio.wait_for(s3.aborting.wait(), 5)
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done(), "the cancellation went through before the abort finished"
    s3.abort_gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert s3.aborted == ["u1"]


async def test_a_second_cancel_can_leave_the_abort_running_in_the_background() -> None:
    s3 = MemoryS3()
    s3.abort_gate = asyncio.Event()
    task = await stalled_upload(s3, False)
    task.cancel()
    await asyncio.wait_for(s3.aborting.wait(), 5)
    with capture_logs() as logs:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 1)
        assert s3.aborted == []
        s3.abort_gate.set()
        for _ in range(20):
            await asyncio.sleep(0)
    assert s3.aborted == ["u1"] and s3.open_uploads() == []
    events = [e["event"] for e in logs]
    assert events == ["multipart_abort_left_running", "multipart_aborted"]


async def test_an_abort_that_fails_is_logged_and_the_first_error_goes_on() -> None:
    s3 = MemoryS3()
    s3.fail_part[2] = failure = ConnectionResetError("cut")
    s3.abort_error = TimeoutError("no answer")
    with capture_logs() as logs:
        with pytest.raises(ConnectionResetError) as caught:
            await upload(s3, bytes(3 * P))
    assert caught.value is failure
    [logged] = [e for e in logs if e["event"] == "multipart_abort_failed"]
    assert logged["upload_id"] == "u1" and "TimeoutError" in logged["error"]


async def test_an_abort_that_hangs_is_given_up_after_its_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(multipart, "ABORT_TIMEOUT_S", 0.05)
    s3 = MemoryS3()
    s3.fail_part[1] = failure = ConnectionResetError("cut")
    s3.abort_gate = asyncio.Event()
    try:
        with pytest.raises(ConnectionResetError) as caught:
            # Left running past the test's own bound, as the handler does, so that an abort
            # without a timeout fails the test instead of hanging it.
            slow = upload(s3, bytes(2 * P), cancel_waits_for_abort=False)
            await asyncio.wait_for(slow, 5)
        assert caught.value is failure and s3.aborted == []
    finally:
        s3.abort_gate.set()
