"""The handler's small pieces without any server: its environment, input files, progress updates,
S3 retries, the rejection's wording, and the act that replaces a worker."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    ReadTimeoutError,
)
from pydantic import SecretStr

from endpoint.errors import InputProblem, SettingsError, UploadError
from endpoint.failures import failure_of
from endpoint.inputs import decode_image, read_input
from endpoint.outputs import S3Sink
from endpoint.reporting import ProgressReporter
from endpoint.s3 import S3, Patience, is_transient
from endpoint.settings import BucketSettings, EndpointSettings
from endpoint.stopping import StopSubject, stop_prompt
from endpoint.upload import MAX_IN_FLIGHT, PART_SIZE, stream_to_s3
from protocol import multipart
from protocol.comfyui.client import ComfyClient
from protocol.errors import ComfyPromptRejected
from protocol.progress import ProgressTracker
from protocol.runpod.contract import MAX_UPDATE_BYTES, ArtifactRecord, InputImage, ProgressUpdate

ROOT = Path(__file__).resolve().parents[2]

BUCKET_ENV = {
    "BUCKET_ENDPOINT_URL": "http://127.0.0.1:9000",
    "BUCKET_ACCESS_KEY_ID": "AKIDEXAMPLE",
    "BUCKET_SECRET_ACCESS_KEY": "s3cr3t-value",
}


def test_settings_from_the_workers_environment() -> None:
    bare = EndpointSettings.from_env({})
    assert bare.comfy_url == "http://127.0.0.1:8188" and bare.bucket is None
    assert bare.comfy_pid is None and not bare.refresh_worker

    env = {
        **BUCKET_ENV,
        "BUCKET_NAME": "stock",
        "COMFY_PID": "42",
        "RUNPOD_POD_ID": "pod-7",
        "REFRESH_WORKER": "true",
    }
    settings = EndpointSettings.from_env(env)
    assert settings.comfy_pid == 42 and settings.worker_id == "pod-7" and settings.refresh_worker
    assert settings.bucket is not None and settings.bucket.default_bucket == "stock"
    assert settings.bucket.secret_access_key.get_secret_value() == "s3cr3t-value"
    assert "s3cr3t" not in repr(settings)


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"BUCKET_ENDPOINT_URL": "http://s3"}, "BUCKET_ACCESS_KEY_ID"),
        ({"COMFY_PID": "abc"}, "COMFY_PID"),
        ({**BUCKET_ENV, "BUCKET_ADDRESSING_STYLE": "sideways"}, "BUCKET_ADDRESSING_STYLE"),
    ],
)
def test_a_bad_environment_names_the_variable(env: dict[str, str], names: str) -> None:
    with pytest.raises(SettingsError, match=names):
        EndpointSettings.from_env(env)


def test_input_files_in_base64_or_as_data_uris() -> None:
    data = b"\x89PNG-bytes"
    encoded = base64.b64encode(data).decode()
    assert decode_image(0, InputImage(name="a.png", image=encoded)) == data
    uri = InputImage(name="a.png", image=f"data:image/png;base64,{encoded}")
    assert decode_image(0, uri) == data
    wrapped = InputImage(name="a.png", image=encoded[:4] + "\n" + encoded[4:])
    assert decode_image(0, wrapped) == data
    with pytest.raises(InputProblem, match=r"images\[3\] \('b.png'\)"):
        decode_image(3, InputImage(name="b.png", image="not base64!"))
    with pytest.raises(InputProblem, match="data URI must be base64"):
        decode_image(0, InputImage(name="b.png", image="data:text/plain,hello"))


def test_the_workflow_may_come_as_a_json_string_and_so_may_the_input() -> None:
    assert read_input({"workflow": '{"1": {}}'}).workflow == {"1": {}}
    assert read_input('{"workflow": {"1": {}}}').workflow == {"1": {}}
    with pytest.raises(InputProblem, match="must be an object"):
        read_input([1])


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def reporter(interval_s: float = 1.0) -> tuple[ProgressReporter, list[ProgressUpdate], FakeClock]:
    clock = FakeClock()
    tracker = ProgressTracker({"5": 100}, 7, min_interval_s=interval_s, clock=clock)
    sent: list[ProgressUpdate] = []
    rep = ProgressReporter(
        lambda u: sent.append(ProgressUpdate.model_validate(u)),
        tracker,
        submission="sub-12345678",
        prompt_id="p",
        worker_id="w",
    )
    return rep, sent, clock


def record(n: int) -> ArtifactRecord:
    return ArtifactRecord(
        filename=f"f{n}.png", type="s3_url", data=f"s3://b/{'k' * 200}/{n}", size=1, sha256="0"
    )


def test_progress_is_rate_bounded_except_for_stages_and_artifacts() -> None:
    rep, sent, clock = reporter(interval_s=1.0)
    rep.set_stage("running")
    for step in range(1, 50):  # 49 steps within the same second: none goes out
        rep.tracker.on_progress("5", step)
        rep.moved()
    assert [u.stage for u in sent] == ["running"]
    clock.now = 1.5
    rep.tracker.on_progress("5", 50)
    rep.moved()
    assert sent[-1].step == 50 and sent[-1].total_steps == 100
    rep.set_stage("running")  # no change: nothing sent
    rep.add_artifact(record(1))  # always sent
    rep.set_stage("uploading")
    assert [u.seq for u in sent] == [1, 2, 3, 4]
    assert len(sent[-1].artifacts) == 1 and sent[-1].stage == "uploading"
    assert all(u.at.utcoffset() == timedelta(0) for u in sent)
    assert sent[-1].at <= datetime.now(UTC)


def test_an_update_stays_under_the_sdks_size_limit() -> None:
    rep, sent, _ = reporter()
    for n in range(3000):
        rep.artifacts.append(record(n))
    rep.add_artifact(record(3000))
    last = sent[-1]
    assert len(last.model_dump_json()) <= MAX_UPDATE_BYTES
    assert last.artifacts[-1].filename == "f3000.png"  # the newest are kept
    assert last.artifacts_omitted == 3001 - len(last.artifacts) > 0


def test_the_retry_budget_and_the_nodes_bucket_come_from_the_environment() -> None:
    assert EndpointSettings.from_env({}).bucket_retry_s == 300.0
    env = {
        **BUCKET_ENV,
        "BUCKET_RETRY_S": "42",
        "RUNPOD_ENDPOINT_ID": "ep-1",
        "DURABLE_COMFY_BUCKET": "orchestrator",
    }
    settings = EndpointSettings.from_env(env)
    assert settings.bucket_retry_s == 42.0 and settings.endpoint_id == "ep-1"
    assert settings.nodes_bucket == "orchestrator"
    with pytest.raises(SettingsError, match="BUCKET_RETRY_S"):
        EndpointSettings.from_env({"BUCKET_RETRY_S": "-1"})


def client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op"
    )


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (EndpointConnectionError(endpoint_url="http://s3"), True),
        (ReadTimeoutError(endpoint_url="http://s3"), True),
        (ConnectionClosedError(endpoint_url="http://s3"), True),
        (client_error("InternalError", 500), True),
        (client_error("ServiceUnavailable", 503), True),
        (client_error("SlowDown", 503), True),
        (client_error("", 429), True),
        (client_error("RequestTimeout", 400), True),
        (client_error("PreconditionFailed", 412), False),
        (client_error("NoSuchKey", 404), False),
        (client_error("AccessDenied", 403), False),
        (client_error("InvalidArgument", 400), False),
    ],
)
def test_only_what_can_recover_is_retried(exc: Exception, transient: bool) -> None:
    assert is_transient(exc) is transient


class FlakyClient:
    """A boto3 client whose put_object fails `failures` times with `error`, then succeeds."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures = failures
        self.error = error
        self.calls = 0

    def put_object(self, **_kwargs: Any) -> dict[str, str]:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return {"ETag": '"e"'}


def flaky_s3(retry_s: float, client: FlakyClient) -> S3:
    settings = BucketSettings(
        endpoint_url="http://127.0.0.1:9",
        access_key_id=SecretStr("key"),
        secret_access_key=SecretStr("secret"),
    )
    s3 = S3(settings, retry_s=retry_s)
    s3.client = client
    return s3


async def test_an_s3_call_rides_out_an_outage_within_its_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("endpoint.s3.FIRST_DELAY_S", 0.01)
    outage = FlakyClient(4, EndpointConnectionError(endpoint_url="http://s3"))
    assert await flaky_s3(5.0, outage).call("put_object", Bucket="b", Key="k") == {"ETag": '"e"'}
    assert outage.calls == 5

    answer = FlakyClient(1, client_error("PreconditionFailed", 412))
    with pytest.raises(ClientError):  # an answer, at once
        await flaky_s3(5.0, answer).call("put_object", Bucket="b", Key="k")
    assert answer.calls == 1

    down = FlakyClient(10**6, EndpointConnectionError(endpoint_url="http://s3"))
    started = time.monotonic()
    with pytest.raises(EndpointConnectionError):
        await flaky_s3(0.3, down).call("put_object", Bucket="b", Key="k")
    # Given up once its 0.3 s budget is spent, not at the next call's (60 s): the upper bound
    # is loose, a loaded machine (a CI run beside `make bench`) took 2.7 s.
    assert 0.3 <= time.monotonic() - started < 10 and down.calls > 2
    single = FlakyClient(10**6, EndpointConnectionError(endpoint_url="http://s3"))
    with pytest.raises(EndpointConnectionError):
        await flaky_s3(60.0, single).call("put_object", patience=Patience(0.0), Key="k")
    assert single.calls == 1


def test_a_patience_is_spent_from_its_first_failure() -> None:
    patience = Patience(0.2)
    waits = []
    while (wait := patience.next_wait()) is not None:
        waits.append(wait)
        time.sleep(wait)
    assert waits and sum(waits) <= 0.2 + 1e-6 and patience.spent
    assert Patience(0.0).next_wait() is None


def test_a_rejection_is_worded_once_per_node() -> None:
    rejected = ComfyPromptRejected(
        {"type": "prompt_outputs_failed_validation", "message": "Prompt outputs failed validation"},
        {
            "3": {
                "class_type": "KSampler",
                "errors": [
                    {
                        "type": "value_smaller_than_min",
                        "message": "Value -5 smaller than min of 0",
                        "details": "seed",
                        "extra_info": {"input_name": "seed", "received_value": -5},
                    }
                ],
            }
        },
    )
    failure = failure_of(rejected)
    assert failure.error_type == "PromptRejected" and failure.details == []
    assert failure.error == (
        "ComfyUI rejected the graph: Prompt outputs failed validation; "
        "node 3 (KSampler): input 'seed': Value -5 smaller than min of 0"
    )


def test_replacing_the_worker_kills_comfyui_and_terminates_the_handler() -> None:
    """The act itself, in a process of its own: SIGKILL to ComfyUI's pid, SIGTERM to ourselves
    (which the runpod SDK turns into a graceful shutdown)."""
    comfy = subprocess.Popen(["sleep", "60"])
    try:
        code = (
            "import time\n"
            "from endpoint.stopping import replace_this_worker\n"
            f"replace_this_worker({comfy.pid})()\n"
            "time.sleep(30)\n"
        )
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60)
        assert done.returncode == -signal.SIGTERM
        assert comfy.wait(timeout=10) == -signal.SIGKILL
    finally:
        comfy.kill()


def sent(body: Any) -> bytes:
    """What a call sends: a part's body is a buffer that the upload fills again once the call
    has returned, so a copy is kept."""
    if isinstance(body, bytes):
        return body
    with body.getbuffer() as view:
        return bytes(view)


class MultipartS3:
    """What an S3Sink calls of the handler's S3 client, over dicts; the first upload's second
    part finds its upload gone (NoSuchUpload, as after a lifecycle abort)."""

    def __init__(self) -> None:
        self.uploads: dict[str, dict[int, bytes]] = {}
        self.objects: dict[str, tuple[bytes, dict[str, str]]] = {}
        self.aborted: list[str] = []
        self.created = 0

    async def call(self, operation: str, patience: Patience | None = None, **kw: Any) -> Any:
        if operation == "create_multipart_upload":
            self.created += 1
            upload_id = f"u{self.created}"
            self.uploads[upload_id] = {}
            return {"UploadId": upload_id}
        if operation == "upload_part":
            if kw["UploadId"] == "u1" and kw["PartNumber"] == 2:
                raise client_error("NoSuchUpload", 404)
            self.uploads[kw["UploadId"]][kw["PartNumber"]] = sent(kw["Body"])
            return {"ETag": f'"p{kw["PartNumber"]}"'}
        if operation == "complete_multipart_upload":
            parts = self.uploads.pop(kw["UploadId"])
            self.objects[kw["Key"]] = (b"".join(parts[n] for n in sorted(parts)), {})
            return {"ETag": '"done"'}
        if operation == "copy_object":
            body, _ = self.objects[kw["Key"]]
            self.objects[kw["Key"]] = (body, dict(kw["Metadata"]))
            return {}
        if operation == "head_object":
            body, metadata = self.objects[kw["Key"]]
            return {"ContentLength": len(body), "Metadata": metadata}
        if operation == "abort_multipart_upload":
            self.aborted.append(kw["UploadId"])
            self.uploads.pop(kw["UploadId"], None)
            return {}
        raise AssertionError(f"unexpected S3 call {operation}")


async def test_an_upload_that_lost_its_multipart_upload_is_aborted_and_streamed_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("endpoint.s3.FIRST_DELAY_S", 0.01)
    body = bytes(range(256)) * (17 * 4096)  # 17 MiB: three parts
    opened: list[int] = []

    @contextlib.asynccontextmanager
    async def view() -> AsyncIterator[AsyncIterator[bytes]]:
        opened.append(len(opened) + 1)

        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(body), 1024 * 1024):
                yield body[start : start + 1024 * 1024]

        yield chunks()

    s3 = MultipartS3()
    sink = S3Sink(s3, "out", lambda node, name: f"jobs/j/0/{node}/{name}", retry_s=10)  # type: ignore[arg-type]
    record = await sink.store("8", {"filename": "big.bin"}, view)

    assert opened == [1, 2]  # read again from ComfyUI's output folder
    assert s3.aborted == ["u1"] and s3.uploads == {}  # nothing left open
    stored, metadata = s3.objects["jobs/j/0/8/big.bin"]
    assert stored == body and record.size == len(body)
    assert record.sha256 == metadata["sha256"] == hashlib.sha256(body).hexdigest()


class CountingS3(MultipartS3):
    """MultipartS3 without its lost upload, counting the parts sending at once."""

    def __init__(self) -> None:
        super().__init__()
        self.sending = 0
        self.most_sending = 0

    async def call(self, operation: str, patience: Patience | None = None, **kw: Any) -> Any:
        if operation == "put_object":
            self.objects[kw["Key"]] = (sent(kw["Body"]), dict(kw["Metadata"]))
            return {}
        if operation != "upload_part":
            return await super().call(operation, patience, **kw)
        self.sending += 1
        self.most_sending = max(self.most_sending, self.sending)
        try:
            before = sent(kw["Body"])
            await asyncio.sleep(0.01)
            assert sent(kw["Body"]) == before, "a part's buffer is refilled while it is sending"
            self.uploads[kw["UploadId"]][kw["PartNumber"]] = before
            return {"ETag": f'"p{kw["PartNumber"]}"'}
        finally:
            self.sending -= 1


@pytest.mark.parametrize("size", [0, 5, PART_SIZE, 5 * PART_SIZE + 12_345])
async def test_the_handler_streams_every_byte_in_order_and_hashes_all_of_them(size: int) -> None:
    body = bytes(range(251)) * (size // 251) + bytes(size % 251)
    s3 = CountingS3()

    async def chunks() -> AsyncIterator[bytes]:
        # An odd chunk size: part boundaries fall inside chunks.
        for start in range(0, len(body), 700_001):
            yield body[start : start + 700_001]

    stored = await stream_to_s3(
        s3,  # type: ignore[arg-type]
        bucket="out",
        key="k",
        chunks=chunks(),
        content_type="x/y",
        patience=Patience(1),
    )
    data, metadata = s3.objects["k"]
    assert stored.size == size and stored.sha256 == hashlib.sha256(body).hexdigest()
    assert data == body and metadata["sha256"] == stored.sha256
    assert s3.most_sending <= MAX_IN_FLIGHT
    assert s3.created == (1 if size >= PART_SIZE else 0)


async def one_chunk(data: bytes) -> AsyncIterator[bytes]:
    yield data


class EchoingS3(CountingS3):
    """CountingS3 whose PutObject answers with the sha256 it checked, as S3 does; counting
    HEADs."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = 0

    async def call(self, operation: str, patience: Patience | None = None, **kw: Any) -> Any:
        if operation == "head_object":
            self.heads += 1
        answer = await super().call(operation, patience, **kw)
        if operation == "put_object":
            return {"ETag": '"e"', "ChecksumSHA256": kw["ChecksumSHA256"]}
        return answer


async def test_a_put_the_store_confirmed_is_not_read_back_and_a_multipart_one_is() -> None:
    s3 = EchoingS3()
    for key, size in (("small", 5), ("large", PART_SIZE + 1)):
        body = bytes(size)
        stored = await stream_to_s3(
            s3,  # type: ignore[arg-type]
            bucket="out",
            key=key,
            chunks=one_chunk(body),
            content_type="x/y",
            patience=Patience(1),
        )
        assert stored.sha256 == hashlib.sha256(body).hexdigest()
    assert s3.heads == 1


async def test_an_output_past_the_parts_limit_is_not_streamed_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(multipart, "MAX_PARTS", 2)
    s3 = CountingS3()
    with pytest.raises(UploadError) as caught:
        await stream_to_s3(
            s3,  # type: ignore[arg-type]
            bucket="out",
            key="k",
            chunks=one_chunk(bytes(2 * PART_SIZE + 1)),
            content_type="x/y",
            patience=Patience(1),
        )
    assert not caught.value.again
    assert s3.aborted == ["u1"] and s3.uploads == {}


class CutMidPart:
    """A boto3 client whose first upload_part reads half its body and loses the connection."""

    def __init__(self) -> None:
        self.received: list[bytes] = []

    def upload_part(self, **kw: Any) -> dict[str, str]:
        if not self.received:
            self.received.append(kw["Body"].read(3))
            raise ConnectionClosedError(endpoint_url="http://s3")
        self.received.append(kw["Body"].read())
        return {"ETag": '"p1"'}


async def test_a_retried_call_sends_its_body_from_the_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("endpoint.s3.FIRST_DELAY_S", 0.01)
    client = CutMidPart()
    s3 = flaky_s3(5.0, client)  # type: ignore[arg-type]
    await s3.call("upload_part", Body=io.BytesIO(b"abcdef"), PartNumber=1)
    assert client.received == [b"abc", b"abcdef"]


class FakeQueue:
    """A ComfyUI's /queue, /interrupt and /history for one prompt, over httpx.MockTransport:
    `deaf` interrupts are ignored before one lands; `records` says whether history keeps it."""

    def __init__(self, where: str | None, *, deaf: int = 0, records: bool = True) -> None:
        self.where = where
        self.deaf = deaf
        self.records = records
        self.history: dict[str, Any] = {}
        self.requests: list[str] = []
        self.down = False

    def handle(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            return httpx.Response(500)
        path = request.url.path
        if path == "/queue" and request.method == "GET":
            item = [0, "p1", {}, {}, []]
            return httpx.Response(
                200,
                json={
                    "queue_running": [item] if self.where == "running" else [],
                    "queue_pending": [item] if self.where == "pending" else [],
                },
            )
        if path == "/queue":  # POST delete: an empty 200, as ComfyUI answers
            self.requests.append("dequeue")
            self.where = None
            return httpx.Response(200)
        if path == "/interrupt":
            self.requests.append("interrupt")
            if self.deaf > 0:
                self.deaf -= 1
            elif self.where == "running":
                self.where = None
                if self.records:
                    message = ["execution_interrupted", {"node_id": "5", "node_type": "KSampler"}]
                    self.history = {
                        "p1": {"status": {"status_str": "error", "messages": [message]}}
                    }
            return httpx.Response(200)
        if path == "/history/p1":
            return httpx.Response(200, json=self.history)
        raise AssertionError(f"unexpected {request.method} {path}")


def subject(*, posted: bool = True) -> StopSubject:
    graph = {"5": {"class_type": "KSampler", "inputs": {}}}
    return StopSubject("p1", posted, False, lambda: "5", graph)


async def stop_on(queue: FakeQueue, horizon_s: float = 10.0, *, posted: bool = True) -> Any:
    async with httpx.AsyncClient(transport=httpx.MockTransport(queue.handle)) as http:
        return await stop_prompt(
            ComfyClient("http://comfy", http),
            subject(posted=posted),
            horizon_s=horizon_s,
            since=time.monotonic(),
            started_at=datetime.now(UTC),
            worker_id="w-1",
        )


@pytest.mark.parametrize(
    ("queue", "fate", "requests"),
    [
        (FakeQueue("pending"), "dequeued", 1),
        (FakeQueue("running"), "interrupted", 1),
        (FakeQueue("running", deaf=2), "interrupted", 3),
        (FakeQueue("running", records=False), "gone", 1),
        (FakeQueue(None), "gone", 0),
    ],
    ids=["pending", "running", "deaf-twice", "no-history", "already-gone"],
)
async def test_the_stop_asks_until_the_prompt_is_gone_and_says_how_it_ended(
    queue: FakeQueue, fate: str, requests: int
) -> None:
    record = await stop_on(queue)
    assert record.prompt == fate and record.requests == requests == len(queue.requests)
    assert record.checks > record.requests and record.worker_id == "w-1"
    if fate == "interrupted":
        assert record.node == "5" and record.node_type == "KSampler"


async def test_the_stop_gives_up_at_the_horizon_and_never_calls_a_silent_comfyui_stopped() -> None:
    deaf = await stop_on(FakeQueue("running", deaf=10**6), horizon_s=1.2)
    assert deaf.prompt == "still_running" and deaf.requests == 2
    assert deaf.node == "5" and "still running" in deaf.detail
    silent = FakeQueue("running")
    silent.down = True
    unreachable = await stop_on(silent, horizon_s=0.5)
    assert unreachable.prompt == "still_running" and "did not answer" in unreachable.detail
    never = await stop_on(FakeQueue(None), posted=False)
    assert never.prompt == "never_submitted" and never.requests == 0
