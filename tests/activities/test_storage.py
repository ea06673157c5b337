"""ArtifactStore against a real S3 server: SeaweedFS `weed mini` with real signature checks.

The tests reach S3 only through one fixture, `s3_settings`, which starts a private `weed mini`
for this module. To run against the shared stack instead, replace it with

    @pytest.fixture(scope="module")
    def s3_settings(local_stack: RunningStack) -> S3Settings:
        return S3Settings(endpoint_url=local_stack.s3_endpoint, region=local_stack.region,
                          bucket=local_stack.bucket,
                          access_key_id=SecretStr(local_stack.access_key_id),
                          secret_access_key=local_stack.secret_access_key)

and drop `_seaweedfs` and the helpers above it.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import threading
import time
import tracemalloc
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aioboto3
import boto3
import httpx
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from botocore.httpchecksum import Crc32Checksum
from pydantic import SecretStr, ValidationError
from structlog.testing import capture_logs

from activities import s3_multipart
from activities.storage import ArtifactStore, StoredObject
from configuration.settings import S3Settings
from protocol import multipart
from workflows.errors import (
    IntegrityError,
    ObjectMissing,
    SourceStreamError,
    StorageConfigError,
    StorageError,
)

MiB = 1024 * 1024
WEED = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "weed"
BUCKET = "durable-comfy-test"


# --- a private SeaweedFS for this module ------------------------------------------------------


@dataclass
class _Weed:
    proc: subprocess.Popen[bytes]
    endpoint: str
    ports: list[int]
    log_path: Path


def _free_port(taken: set[int]) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in taken and port + 10_000 not in taken:
            taken.add(port)
            return port


def _admin_port(taken: set[int]) -> int:
    # weed mini's built-in maintenance worker dials admin.port + 10000 whatever -admin.port.grpc
    # says, so the admin gRPC port must sit exactly there.
    while True:
        port = _free_port(taken)
        if port + 10_000 <= 65_535:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 10_000))
            except OSError:
                continue
            taken.add(port + 10_000)
            return port


def _start_weed(workdir: Path, access_key: str, secret_key: str) -> _Weed:
    taken: set[int] = set()
    names = ["master", "volume", "filer", "s3"]
    ports = {name: _free_port(taken) for name in names}
    grpc = {name: _free_port(taken) for name in names}
    admin = _admin_port(taken)
    config = workdir / "s3.json"
    identity = {
        "name": "tests",
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    config.write_text(json.dumps({"identities": [identity]}))
    config.chmod(0o600)
    (workdir / "data").mkdir()
    args = [
        str(WEED),
        "mini",
        f"-dir={workdir / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        *(f"-{name}.port={ports[name]}" for name in names),
        *(f"-{name}.port.grpc={grpc[name]}" for name in names),
        f"-admin.port={admin}",
        f"-admin.port.grpc={admin + 10_000}",
        "-admin.ui=false",
        "-webdav=false",
        f"-webdav.port={_free_port(taken)}",  # disabled, but never the shared default
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        "-volume.preStopSeconds=0",
        f"-s3.config={config}",
        f"-s3.localSocket={workdir / 's3.sock'}",
        f"-filer.localSocket={workdir / 'filer.sock'}",
    ]
    log_path = workdir / "weed.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            args, cwd=workdir, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    all_ports = [*ports.values(), *grpc.values(), admin, admin + 10_000]
    return _Weed(proc, f"http://127.0.0.1:{ports['s3']}", all_ports, log_path)


def _stop_weed(weed: _Weed) -> None:
    if weed.proc.poll() is None:
        weed.proc.send_signal(signal.SIGTERM)
        try:
            weed.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            weed.proc.kill()
            weed.proc.wait(timeout=10)
    # SeaweedFS puts gRPC unix sockets in /tmp named after their ports; a clean exit removes
    # them, a SIGKILL does not.
    for port in weed.ports:
        for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
            path.unlink(missing_ok=True)


def _wait_ready(weed: _Weed, access_key: str, secret_key: str) -> None:
    client = boto3.client(
        "s3",
        endpoint_url=weed.endpoint,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )
    deadline = time.monotonic() + 30
    while True:
        if weed.proc.poll() is not None:
            tail = weed.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"weed mini exited with {weed.proc.returncode}:\n{tail}")
        try:
            client.list_buckets()  # signed: proves the identities file is loaded
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    client.create_bucket(Bucket=BUCKET)
    client.close()


@pytest.fixture(scope="module")
def _seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    access_key = "AK" + secrets.token_hex(8).upper()
    secret_key = secrets.token_urlsafe(30)
    weed = _start_weed(tmp_path_factory.mktemp("weed"), access_key, secret_key)
    try:
        _wait_ready(weed, access_key, secret_key)
        yield weed.endpoint, access_key, secret_key
    finally:
        _stop_weed(weed)


@pytest.fixture(scope="module")
def s3_settings(_seaweedfs: tuple[str, str, str]) -> S3Settings:
    endpoint, access_key, secret_key = _seaweedfs
    return S3Settings(
        endpoint_url=endpoint,
        region="us-east-1",
        bucket=BUCKET,
        access_key_id=SecretStr(access_key),
        secret_access_key=SecretStr(secret_key),
    )


@pytest.fixture
async def store(s3_settings: S3Settings) -> AsyncIterator[ArtifactStore]:
    async with ArtifactStore(s3_settings) as opened:
        yield opened


@pytest.fixture
async def raw_s3(s3_settings: S3Settings) -> AsyncIterator[Any]:
    """A plain client, independent of the code under test, for looking behind its back."""
    assert s3_settings.access_key_id and s3_settings.secret_access_key
    session = aioboto3.Session(
        aws_access_key_id=s3_settings.access_key_id.get_secret_value(),
        aws_secret_access_key=s3_settings.secret_access_key.get_secret_value(),
        region_name=s3_settings.region,
    )
    config = Config(s3={"addressing_style": "path"})
    async with session.client("s3", endpoint_url=s3_settings.endpoint_url, config=config) as c:
        yield c


@pytest.fixture
def prefix() -> str:
    return f"t/{uuid.uuid4().hex}"


# --- helpers ----------------------------------------------------------------------------------


async def _stream(data: bytes, chunk: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), chunk):
        yield data[start : start + chunk]


async def _random_stream(
    total: int, chunk: int, hasher: Any, seed: int = 7
) -> AsyncIterator[bytes]:
    """Fresh bytes for every chunk, as a real producer would allocate them."""
    rng = random.Random(seed)
    sent = 0
    while sent < total:
        piece = rng.randbytes(min(chunk, total - sent))
        hasher.update(piece)
        sent += len(piece)
        yield piece


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- round trips ------------------------------------------------------------------------------


async def test_small_object_single_put_round_trip(
    store: ArtifactStore, raw_s3: Any, prefix: str, tmp_path: Path
) -> None:
    data = b"small artifact " * 1000
    stored = await store.upload_stream(
        f"{prefix}/a.png", _stream(data, 4000), content_type="image/png", metadata={"node": "9"}
    )
    assert stored == StoredObject(
        bucket=store.settings.bucket,
        key=f"{prefix}/a.png",
        uri=f"s3://{store.settings.bucket}/{prefix}/a.png",
        size=len(data),
        sha256=_sha(data),
        content_type="image/png",
    )
    assert await store.head(f"{prefix}/a.png") == stored
    raw = await raw_s3.head_object(Bucket=store.settings.bucket, Key=f"{prefix}/a.png")
    assert "-" not in raw["ETag"]  # a plain PutObject
    assert raw["Metadata"] == {"node": "9", "sha256": _sha(data)}
    out = await store.download(f"{prefix}/a.png", tmp_path / "a.png", expected_sha256=_sha(data))
    assert out.read_bytes() == data


async def test_empty_stream_is_an_empty_object(store: ArtifactStore, prefix: str) -> None:
    stored = await store.upload_stream(f"{prefix}/e", _stream(b"", 1), content_type="text/plain")
    assert (stored.size, stored.sha256) == (0, _sha(b""))


async def test_multipart_round_trip(
    store: ArtifactStore, raw_s3: Any, prefix: str, tmp_path: Path
) -> None:
    data = random.Random(1).randbytes(20 * MiB + 123)
    key = f"{prefix}/big.mp4"
    # An odd chunk size makes part boundaries fall inside chunks.
    stored = await store.upload_stream(key, _stream(data, 1_000_003), content_type="video/mp4")
    assert (stored.size, stored.sha256, stored.content_type) == (len(data), _sha(data), "video/mp4")
    raw = await raw_s3.head_object(Bucket=store.settings.bucket, Key=key)
    assert raw["ETag"].strip('"').endswith("-3")  # 8 + 8 + 4 MiB
    assert raw["Metadata"]["sha256"] == _sha(data)
    assert await store.verify(stored)
    out = await store.download(key, tmp_path / "big.mp4", expected_sha256=stored.sha256)
    assert out.read_bytes() == data
    assert await store.list_multipart_uploads(prefix) == []


async def test_part_buffers_are_reused_and_every_byte_arrives(
    store: ArtifactStore, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # More parts than buffers: later parts are filled into buffers whose parts were stored.
    made = 0
    presized = multipart._presized

    def counted(size: int) -> io.BytesIO:
        nonlocal made
        made += 1
        return presized(size)

    monkeypatch.setattr(multipart, "_presized", counted)
    data = random.Random(3).randbytes(9 * s3_multipart.PART_SIZE + 4321)
    key = f"{prefix}/reused.bin"
    stored = await store.upload_stream(key, _stream(data, 777_777), content_type="x/y")
    assert (stored.size, stored.sha256) == (len(data), _sha(data))
    out = await store.download(key, tmp_path / "reused.bin", expected_sha256=_sha(data))
    assert out.read_bytes() == data
    # The first part's buffer grows on its own; at most MAX_IN_FLIGHT more are ever made.
    assert 1 <= made <= s3_multipart.MAX_IN_FLIGHT


async def test_exactly_one_part_size(store: ArtifactStore, prefix: str) -> None:
    data = random.Random(2).randbytes(8 * MiB)
    stored = await store.upload_stream(f"{prefix}/p", _stream(data, MiB), content_type="x/y")
    assert (stored.size, stored.sha256) == (len(data), _sha(data))


async def test_parts_go_out_while_the_sha256_is_still_on_an_earlier_part(
    store: ArtifactStore, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The object's sha256 no longer holds up the upload: part 1's hashing is held until part 3
    # has been sent. Each part is still hashed after the one before it (the digest is the
    # object's), and only once every part is both stored and hashed does the upload finish.
    data = random.Random(4).randbytes(3 * 8 * MiB + 5)
    real_upload_part = store.client.upload_part
    real_hash_part = multipart.hash_part
    third_sent = threading.Event()
    hashed_first: list[int] = []

    async def upload_part(**kwargs: Any) -> Any:
        if kwargs["PartNumber"] == 3:
            third_sent.set()
        return await real_upload_part(**kwargs)

    def hash_part(hasher: Any, part: multipart.Part) -> None:
        with part.body.getbuffer() as view:
            first = bytes(view[:64]) == data[:64]
        if first:
            # Without overlap this waits in vain: part 3 would wait for this very hashing.
            hashed_first.append(3 if third_sent.wait(10) else 0)
        real_hash_part(hasher, part)

    monkeypatch.setattr(store.client, "upload_part", upload_part)
    monkeypatch.setattr(multipart, "hash_part", hash_part)
    stored = await store.upload_stream(f"{prefix}/o", _stream(data, 1_000_003), content_type="x/y")
    assert hashed_first == [3], "part 3 was not sent while part 1 was hashing"
    assert (stored.size, stored.sha256) == (len(data), _sha(data))
    assert await store.list_multipart_uploads(prefix) == []


async def test_each_part_carries_the_crc32_botocore_would_compute(
    store: ArtifactStore, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The uploader computes the x-amz-checksum-crc32 header itself (in a thread, in place), so
    # botocore skips its own: it must be the very value botocore would send, or S3 refuses it.
    data = random.Random(5).randbytes(2 * 8 * MiB + 7)
    real_upload_part = store.client.upload_part
    sent: list[tuple[int, str, str]] = []

    async def upload_part(**kwargs: Any) -> Any:
        theirs = Crc32Checksum()
        theirs.update(kwargs["Body"].getvalue())
        sent.append((kwargs["PartNumber"], kwargs["ChecksumCRC32"], theirs.b64digest()))
        return await real_upload_part(**kwargs)

    monkeypatch.setattr(store.client, "upload_part", upload_part)
    stored = await store.upload_stream(f"{prefix}/c", _stream(data, MiB), content_type="x/y")
    assert (stored.size, stored.sha256) == (len(data), _sha(data))
    assert sorted(number for number, _, _ in sent) == [1, 2, 3]
    assert all(ours == theirs for _, ours, theirs in sent), sent


def test_part_crc32_matches_botocore() -> None:
    for size in (0, 1, 4095, MiB + 17):
        data = random.Random(size).randbytes(size)
        theirs = Crc32Checksum()
        theirs.update(data)
        assert s3_multipart.crc32_part(io.BytesIO(data)) == theirs.b64digest()


async def test_peak_memory_is_bounded(store: ArtifactStore, prefix: str) -> None:
    total = 64 * MiB
    hasher = hashlib.sha256()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        started = time.perf_counter()
        stored = await store.upload_stream(
            f"{prefix}/huge.bin",
            _random_stream(total, MiB, hasher),
            content_type="application/octet-stream",
        )
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"64 MiB upload: {elapsed:.2f} s under tracemalloc, peak {peak / MiB:.1f} MiB traced")
    assert (stored.size, stored.sha256) == (total, hasher.hexdigest())
    # (MAX_IN_FLIGHT + 1) x 8 MiB is the design bound; reading ahead would blow well past it.
    assert peak < 60_000_000, f"peak {peak / MiB:.1f} MiB"


async def test_metadata_stamped_by_part_copy_above_copy_limit(
    store: ArtifactStore, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The >5 GiB path, scaled down: CopyObject is skipped and the object is rewritten server-side
    # in part copies carrying the new metadata.
    monkeypatch.setattr(multipart, "COPY_OBJECT_LIMIT", 8 * MiB)
    monkeypatch.setattr(multipart, "COPY_PART_SIZE", 8 * MiB)
    data = random.Random(3).randbytes(20 * MiB)
    stored = await store.upload_stream(f"{prefix}/c", _stream(data, MiB), content_type="x/y")
    assert (stored.size, stored.sha256) == (len(data), _sha(data))
    out = await store.download(f"{prefix}/c", tmp_path / "c", expected_sha256=_sha(data))
    assert out.read_bytes() == data
    assert await store.list_multipart_uploads(prefix) == []


# --- failures ---------------------------------------------------------------------------------


async def test_source_failure_aborts_multipart(store: ArtifactStore, prefix: str) -> None:
    async def failing() -> AsyncIterator[bytes]:
        for _ in range(2):
            yield os.urandom(8 * MiB)
        yield os.urandom(MiB)
        raise RuntimeError("ComfyUI went away")

    with pytest.raises(SourceStreamError) as caught:
        await store.upload_stream(f"{prefix}/x", failing(), content_type="image/png")
    assert isinstance(caught.value, StorageError)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert await store.list_multipart_uploads(prefix) == []
    assert await store.head(f"{prefix}/x") is None


async def test_part_failure_aborts_multipart(
    store: ArtifactStore, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_upload_part = store.client.upload_part

    async def flaky_upload_part(**kwargs: Any) -> Any:
        if kwargs["PartNumber"] == 3:
            error = {
                "Error": {"Code": "InternalError"},
                "ResponseMetadata": {"HTTPStatusCode": 500},
            }
            raise ClientError(error, "UploadPart")
        return await real_upload_part(**kwargs)

    monkeypatch.setattr(store.client, "upload_part", flaky_upload_part)
    data = os.urandom(30 * MiB)
    with pytest.raises(StorageError) as caught:
        await store.upload_stream(f"{prefix}/x", _stream(data, MiB), content_type="x/y")
    assert not isinstance(caught.value, SourceStreamError)
    assert caught.value.retryable
    assert await store.list_multipart_uploads(prefix) == []


async def test_cancellation_aborts_multipart(store: ArtifactStore, prefix: str) -> None:
    two_parts_read = asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        for _ in range(2):
            yield os.urandom(8 * MiB)
        two_parts_read.set()
        await asyncio.Event().wait()  # a backend that stops sending
        yield b""

    task = asyncio.create_task(store.upload_stream(f"{prefix}/x", stalls(), content_type="x/y"))
    await asyncio.wait_for(two_parts_read.wait(), 10)
    assert await store.list_multipart_uploads(prefix) == [f"{prefix}/x"]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await store.list_multipart_uploads(prefix) == []


async def test_abort_completes_even_if_cancelled_again(
    store: ArtifactStore, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Temporal may deliver a second cancellation while cleanup runs: the abort must still finish
    # before the cancellation is let through.
    real_abort = store.client.abort_multipart_upload
    aborting = asyncio.Event()

    async def slow_abort(**kwargs: Any) -> Any:
        aborting.set()
        await asyncio.sleep(0.5)
        return await real_abort(**kwargs)

    monkeypatch.setattr(store.client, "abort_multipart_upload", slow_abort)

    stalled = asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        yield os.urandom(8 * MiB)
        stalled.set()  # asked for a second part: the upload has been created
        await asyncio.Event().wait()
        yield b""

    task = asyncio.create_task(store.upload_stream(f"{prefix}/x", stalls(), content_type="x/y"))
    await asyncio.wait_for(stalled.wait(), 10)
    assert await store.list_multipart_uploads(prefix) == [f"{prefix}/x"]
    task.cancel()
    await asyncio.wait_for(aborting.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await store.list_multipart_uploads(prefix) == []


async def test_too_many_parts_is_fatal_and_aborted(
    store: ArtifactStore, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(multipart, "MAX_PARTS", 2)
    with pytest.raises(StorageError) as caught:
        data = os.urandom(20 * MiB)
        await store.upload_stream(f"{prefix}/x", _stream(data, MiB), content_type="x/y")
    assert not caught.value.retryable
    assert await store.list_multipart_uploads(prefix) == []


async def test_a_put_is_confirmed_by_the_stores_own_sha256_without_a_head(
    store: ArtifactStore, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    heads: list[str] = []
    real_head = store.client.head_object

    async def counted_head(**kwargs: Any) -> Any:
        heads.append(kwargs["Key"])
        return await real_head(**kwargs)

    monkeypatch.setattr(store.client, "head_object", counted_head)
    stored = await store.upload_stream(f"{prefix}/x", _stream(b"abc", 1), content_type="x/y")
    assert (stored.size, stored.sha256, stored.content_type) == (3, _sha(b"abc"), "x/y")
    assert heads == []
    assert await store.verify(stored)


async def test_a_put_the_store_received_damaged_is_refused_and_retryable(
    store: ArtifactStore, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the store hashes is not what we hashed: the checksum is the store's check, not ours.
    real_put = store.client.put_object

    async def damaged_put(**kwargs: Any) -> Any:
        return await real_put(**{**kwargs, "Body": kwargs["Body"].getvalue()[:-1] + b"?"})

    monkeypatch.setattr(store.client, "put_object", damaged_put)
    with pytest.raises(StorageError) as caught:
        await store.upload_stream(f"{prefix}/x", _stream(b"abc", 1), content_type="x/y")
    assert "BadDigest" in str(caught.value) and caught.value.retryable
    assert await store.head(f"{prefix}/x") is None


async def test_a_store_that_does_not_echo_the_checksum_is_asked_with_a_head(
    store: ArtifactStore, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_put, real_head = store.client.put_object, store.client.head_object

    async def silent_put(**kwargs: Any) -> Any:
        resp = await real_put(**kwargs)
        return {k: v for k, v in resp.items() if k != "ChecksumSHA256"}

    async def lying_head(**kwargs: Any) -> Any:
        resp = await real_head(**kwargs)
        return {**resp, "ContentLength": resp["ContentLength"] + 1}

    monkeypatch.setattr(store.client, "put_object", silent_put)
    monkeypatch.setattr(store.client, "head_object", lying_head)
    with pytest.raises(IntegrityError):
        await store.upload_stream(f"{prefix}/x", _stream(b"abc", 1), content_type="x/y")


async def test_wrong_credentials(s3_settings: S3Settings, prefix: str) -> None:
    wrong = s3_settings.model_copy(update={"secret_access_key": SecretStr("not-the-secret")})
    async with ArtifactStore(wrong) as store:
        with pytest.raises(StorageConfigError) as caught:
            await store.upload_stream(f"{prefix}/x", _stream(b"abc", 1), content_type="x/y")
        assert isinstance(caught.value, StorageError) and not caught.value.retryable
        with pytest.raises(StorageConfigError):
            await store.head(f"{prefix}/x")


# --- head, verify, presign, download ----------------------------------------------------------


async def test_head_absent_is_none(store: ArtifactStore, prefix: str) -> None:
    assert await store.head(f"{prefix}/nothing-here") is None


async def test_verify(store: ArtifactStore, prefix: str) -> None:
    stored = await store.upload_stream(f"{prefix}/v", _stream(b"v" * 100, 7), content_type="x/y")
    assert await store.verify(stored)
    assert not await store.verify(stored.model_copy(update={"sha256": "0" * 64}))
    assert not await store.verify(stored.model_copy(update={"size": 99}))
    assert not await store.verify(stored.model_copy(update={"key": f"{prefix}/gone"}))


async def test_presigned_url_fetches_then_expires(store: ArtifactStore, prefix: str) -> None:
    data = b"presigned bytes"
    await store.upload_stream(f"{prefix}/p.txt", _stream(data, 5), content_type="text/plain")
    # SigV4 dates have one-second resolution: sign just after a second boundary so a 1 s URL is
    # certainly still valid for the first fetch.
    await asyncio.sleep(1 - time.time() % 1 + 0.01)
    url = await store.presign_get(f"{prefix}/p.txt", ttl_s=1)
    async with httpx.AsyncClient(trust_env=False) as http:
        first = await http.get(url)
        assert (first.status_code, first.content) == (200, data)
        await asyncio.sleep(2)
        assert (await http.get(url)).status_code == 403
    with pytest.raises(ValueError):
        await store.presign_get(f"{prefix}/p.txt", ttl_s=0)


async def test_a_presigned_put_stores_that_one_file_until_it_expires(
    store: ArtifactStore, prefix: str
) -> None:
    """The signature holds the PUT to the declared length, type, sha256 and metadata; a header
    added is refused too; and the URL stops working at `expires_at` (the store's own expiry is
    never earlier). What each refusal looks like through the gateway: test_gateway_uploads.py."""
    data = os.urandom(2000)
    digest = hashlib.sha256(data).hexdigest()
    key = f"{prefix}/upload.png"
    declared: dict[str, Any] = {
        "size": len(data),
        "sha256": digest,
        "content_type": "image/png",
        "ttl_s": 2,
    }
    await asyncio.sleep(1 - time.time() % 1 + 0.01)  # SigV4 dates have whole seconds
    put = await store.presign_put(key, **declared)
    assert "X-Amz-Signature" in put.url
    ttl = timedelta(seconds=declared["ttl_s"])
    assert datetime.now(UTC) + ttl - timedelta(seconds=1.5) <= put.expires_at
    assert put.expires_at <= datetime.now(UTC) + ttl
    async with httpx.AsyncClient(trust_env=False) as http:
        added = await http.put(put.url, content=data, headers=put.headers | {"x-amz-acl": "x"})
        assert added.status_code == 403, added.text
        stored = await http.put(put.url, content=data, headers=put.headers)
        assert stored.status_code == 200, stored.text
        found = await store.head(key)
        assert found is not None
        assert (found.size, found.sha256, found.content_type) == (len(data), digest, "image/png")
        await asyncio.sleep(max(0.0, (put.expires_at - datetime.now(UTC)).total_seconds()) + 1.1)
        late = await http.put(put.url, content=data, headers=put.headers)
        assert late.status_code == 403, late.text
    wrong: list[dict[str, Any]] = [
        {"ttl_s": 0},
        {"ttl_s": 7 * 24 * 3600 + 1},
        {"sha256": digest.upper()},
        {"sha256": digest[:-1]},
        {"size": -1},
        {"content_type": "image/png\r\nx-amz-acl: public-read"},
    ]
    for changed in wrong:
        with pytest.raises(ValueError):
            await store.presign_put(key, **(declared | changed))


async def test_download_checks_sha256_and_leaves_nothing_on_mismatch(
    store: ArtifactStore, prefix: str, tmp_path: Path
) -> None:
    data = os.urandom(3 * MiB)
    stored = await store.upload_stream(f"{prefix}/d", _stream(data, MiB), content_type="x/y")
    dest = tmp_path / "out" / "d.bin"
    with pytest.raises(IntegrityError):
        await store.download(f"{prefix}/d", dest, expected_sha256="0" * 64)
    assert not dest.exists()
    assert _listing(dest.parent) == []  # no partial file either
    await store.download(f"{prefix}/d", dest, expected_sha256=stored.sha256.upper())
    assert dest.read_bytes() == data


async def test_download_missing_object(store: ArtifactStore, prefix: str, tmp_path: Path) -> None:
    with pytest.raises(ObjectMissing):
        await store.download(f"{prefix}/none", tmp_path / "x", expected_sha256="0" * 64)
    assert _listing(tmp_path) == []


async def test_abort_leftover_uploads(store: ArtifactStore, raw_s3: Any, prefix: str) -> None:
    # What a SIGKILLed attempt leaves behind: an upload nobody will complete.
    await raw_s3.create_multipart_upload(Bucket=store.settings.bucket, Key=f"{prefix}/orphan")
    assert await store.list_multipart_uploads(prefix) == [f"{prefix}/orphan"]
    assert await store.abort_multipart_uploads(prefix) == 1
    assert await store.list_multipart_uploads(prefix) == []


# --- settings ---------------------------------------------------------------------------------


async def test_secrets_never_shown(s3_settings: S3Settings, store: ArtifactStore) -> None:
    assert s3_settings.secret_access_key is not None
    secret = s3_settings.secret_access_key.get_secret_value()
    with capture_logs() as logs:
        await store.upload_stream("t/secret-check", _stream(b"x", 1), content_type="x/y")
    shown = [repr(s3_settings), str(s3_settings), s3_settings.model_dump_json(), repr(logs)]
    shown.append(json.dumps(s3_settings.model_dump(mode="json")))
    for text in shown:
        assert secret not in text


def test_settings_from_env() -> None:
    env = {
        "DURABLE_COMFY_S3_ENDPOINT": "http://127.0.0.1:9000/",
        "DURABLE_COMFY_BUCKET": "artifacts",
        "AWS_ACCESS_KEY_ID": "AKID",
        "AWS_SECRET_ACCESS_KEY": "s3cr3t-value",
        "AWS_REGION": "eu-west-1",
    }
    settings = S3Settings.from_env(env)
    assert settings.endpoint_url == "http://127.0.0.1:9000"
    assert (settings.bucket, settings.region) == ("artifacts", "eu-west-1")
    assert settings.secret_access_key and settings.secret_access_key.get_secret_value() == (
        "s3cr3t-value"
    )
    bare = S3Settings.from_env({"DURABLE_COMFY_BUCKET": "artifacts"})
    assert (bare.endpoint_url, bare.access_key_id, bare.region) == (None, None, "us-east-1")


@pytest.mark.parametrize(
    ("missing", "named"),
    [
        ("DURABLE_COMFY_BUCKET", "DURABLE_COMFY_BUCKET"),
        ("AWS_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY"),
        ("AWS_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID"),
    ],
)
def test_settings_name_the_missing_variable(missing: str, named: str) -> None:
    env = {
        "DURABLE_COMFY_BUCKET": "artifacts",
        "AWS_ACCESS_KEY_ID": "AKID",
        "AWS_SECRET_ACCESS_KEY": "s3cr3t-value",
    }
    env[missing] = ""  # empty counts as unset
    with pytest.raises(StorageConfigError, match=named):
        S3Settings.from_env(env)


def test_invalid_settings_do_not_echo_values() -> None:
    env = {
        "DURABLE_COMFY_BUCKET": "artifacts",
        "DURABLE_COMFY_S3_ENDPOINT": "http://user:s3cr3t-value@127.0.0.1:9000",
    }
    with pytest.raises(StorageConfigError) as caught:
        S3Settings.from_env(env)
    assert "s3cr3t-value" not in str(caught.value)
    with pytest.raises(StorageConfigError, match="bucket"):
        S3Settings.from_env({"DURABLE_COMFY_BUCKET": "Not_A_Bucket"})
    with pytest.raises(ValidationError) as direct:
        S3Settings(bucket="artifacts", endpoint_url="https://u:s3cr3t-value@example.com")
    assert "s3cr3t-value" not in str(direct.value)
