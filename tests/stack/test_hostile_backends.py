"""Hostile backends: output names and artifact records are untrusted.

Every name a backend hands us (ComfyUI's `filename`, `subfolder` and `type`; a RunPod worker's
records) is refused before anything is asked for or read, or ends up in a key inside the job's
folder. The unit tests need no server: ComfyUI and RunPod answer on httpx mock transports, S3 is
a dict that records every call. The last test runs one job on the local stack (the ComfyUI
simulator, a real worker) whose graph saves into another run's folder.
"""

from __future__ import annotations

import base64
import hashlib
import ntpath
import posixpath
import unicodedata
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast
from urllib.parse import unquote

import httpx
import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from temporalio.client import Client
from temporalio.exceptions import ApplicationError

from activities.runpod.models import RunPodJob
from activities.runpod.outcome import Failed, read_job
from activities.storage import ArtifactStore
from devstack.models import RunningStack
from endpoint.failures import failure_of
from endpoint.job import OrchestratedJob
from endpoint.outputs import OutputCollector
from protocol.comfyui.client import ComfyClient, check_view_request
from protocol.errors import UnsafeOutputName
from protocol.keys import job_folder
from protocol.runpod.contract import EndpointInput, Orchestration, S3Target
from starter import JobClient, JobRequest, JobState
from starter.errors import UnsafeArtifactKey
from tests.activities.test_runpod_backend_unit import (
    BUCKET,
    JOB_ID,
    OUR_KEY,
    PNG,
    RecordingStore,
    ScriptedRunPod,
    backend,
    completed,
    env,
    follow_input,
    record,
)
from tests.activities.test_uploader_unit import Offload
from tests.support.cli import example, running_worker
from tests.support.comfy_fakes import PROMPT_ID, RUN_TAG, FakeComfy, image
from tests.support.endpoint import endpoint_settings
from workflows.contracts import Artifact, JobStatus
from workflows.shared import ErrorType

BASE_URL = "http://127.0.0.1:1"  # never dialled: the mock transports answer
COMFY_FOLDER = "jobs/job-1"  # job_folder("jobs", "job-1"), the ComfyUI fakes' job
RUNPOD_FOLDER = job_folder("jobs", JOB_ID)

# The hostile names, each a ComfyUI output `filename`.
HOSTILE_FILENAMES = {
    "traversal": "../../x",
    "absolute": "/etc/passwd",
    "NUL": "a\x00b.png",
    "newline": "a\nb.png",
    "percent-encoded traversal": "%2e%2e/%2e%2e/x",
    "percent-encoded dots": "%2e%2e",
    "backslashes": "..\\..\\x",
    "fullwidth dots": "\uff0e\uff0e\uff0fx",
    "right-to-left override": "\u202egnp.exe",
    "folder annotation": "x.png [input]",
    "very long": "x" * 300 + ".png",
}
HOSTILE_SUBFOLDERS = {
    "up two": "../..",
    "absolute": "/etc",
    "percent-encoded": "%2e%2e/%2e%2e",
    "windows drive": "C:\\Windows",
    "dots Windows trims to ..": ".. /... ",
    "fullwidth dots": "\uff0e\uff0e",
    "NUL": RUN_TAG + "\x00",
}
HOSTILE_TYPES = {"input": "input", "empty": "", "traversal": "../output", "unknown": "models"}


def hostile_records() -> list[Any]:
    """(filename, subfolder, type) triples `/view` must never be asked for."""
    return [
        *(
            pytest.param(n, RUN_TAG, "output", id=f"filename {k}")
            for k, n in HOSTILE_FILENAMES.items()
        ),
        *(
            pytest.param("a.png", s, "output", id=f"subfolder {k}")
            for k, s in HOSTILE_SUBFOLDERS.items()
        ),
        *(pytest.param("a.png", RUN_TAG, t, id=f"type {k}") for k, t in HOSTILE_TYPES.items()),
    ]


def assert_inside(key: str, folder: str) -> None:
    """`key` is in `folder`, relative, and no level of it can climb or hide anything."""
    assert key.startswith(folder + "/"), key
    levels = key.split("/")
    assert all(level and level.strip(".") for level in levels), key  # no "", ".", ".." level
    assert ".." not in key and "\\" not in key and "%" not in key, key
    assert all(unicodedata.category(ch)[0] != "C" for ch in key), ascii(key)


def assert_printable(message: str) -> None:
    """No control character, newline or look-alike reaches a log line or the UI's details."""
    assert message.isascii() and message.isprintable(), ascii(message)


class ViewLog:
    """ComfyUI's `/view`: serves any name, and keeps every query it was asked."""

    def __init__(self) -> None:
        self.queries: list[dict[str, str]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.queries.append(dict(request.url.params))
        return httpx.Response(200, content=b"bytes of " + request.url.params["filename"].encode())


# --- /view: the one door to ComfyUI's files, for the orchestrator and the handler alike ---------


@pytest.mark.parametrize(("filename", "subfolder", "kind"), hostile_records())
async def test_view_refuses_a_name_that_could_leave_the_output_folders_before_asking(
    filename: str, subfolder: str, kind: str
) -> None:
    comfy = ViewLog()
    async with httpx.AsyncClient(transport=httpx.MockTransport(comfy.handle)) as http:
        with pytest.raises(UnsafeOutputName) as refused:
            async with ComfyClient(BASE_URL, http).view(filename, subfolder, kind):
                pass
    assert comfy.queries == [], "nothing is asked for a refused name"
    assert_printable(str(refused.value))


@pytest.mark.parametrize(
    ("filename", "subfolder", "kind"),
    [
        ("ComfyUI_00001_.png", RUN_TAG, "output"),
        ("preview_00001_.png", "", "temp"),
        ("100%.png", RUN_TAG + "/sub/dir", "output"),
        ("a..b.png", RUN_TAG, "output"),
        ("\u65e5\u672c\u8a9e.png", RUN_TAG, "output"),
        ("a b#?&=[1].png", "my stuff", "output"),
        ("x" * 250 + ".png", RUN_TAG, "output"),
    ],
)
async def test_view_asks_for_harmless_names_exactly_as_given(
    filename: str, subfolder: str, kind: str
) -> None:
    comfy = ViewLog()
    async with httpx.AsyncClient(transport=httpx.MockTransport(comfy.handle)) as http:
        async with ComfyClient(BASE_URL, http).view(filename, subfolder, kind) as chunks:
            body = b"".join([chunk async for chunk in chunks])
    assert comfy.queries == [{"filename": filename, "subfolder": subfolder, "type": kind}]
    assert body == b"bytes of " + filename.encode()


def _readings(value: str) -> list[str]:
    once = unquote(value)
    forms = [value, once, unquote(once)]
    return forms + [unicodedata.normalize("NFKC", form) for form in forms]


_PATHY = st.text(
    alphabet=st.sampled_from(list("./\\%2eE:a [input]\x00\n\uff0e\uff0f\u2024\u202e"))
    | st.characters(),
    max_size=16,
)


@settings(
    max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(filename=_PATHY, subfolder=_PATHY)
def test_an_accepted_name_resolves_inside_the_folder_however_it_is_read(
    filename: str, subfolder: str
) -> None:
    """Whatever `check_view_request` lets through stays inside the output folder on POSIX and
    Windows paths, as given, percent-decoded (once or twice) or NFKC-normalised."""
    try:
        check_view_request(filename, subfolder, "output")
    except UnsafeOutputName:
        return
    for name in _readings(filename):
        for sub in _readings(subfolder):
            posix = posixpath.normpath(posixpath.join("/out", sub, name))
            assert posix.startswith("/out/"), (filename, subfolder)
            windows = ntpath.normpath(ntpath.join("C:\\out", sub, name))
            assert windows.startswith("C:\\out\\"), (filename, subfolder)
            assert "\x00" not in posix


# --- the orchestrator's ComfyUI backend (OutputUploader, offload_outputs) -----------------------


class ViewingComfy(FakeComfy):
    """FakeComfy that serves any file name and keeps every `/view` query."""

    def __init__(self) -> None:
        super().__init__()
        self.views: list[dict[str, str]] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/view":
            self.views.append(dict(request.url.params))
            return httpx.Response(200, content=b"file " + request.url.params["filename"].encode())
        return await super().handle(request)


@pytest.fixture
async def hostile_comfy() -> AsyncIterator[Offload]:
    comfy = ViewingComfy()
    async with httpx.AsyncClient(transport=httpx.MockTransport(comfy.handle)) as http:
        yield Offload(comfy, http)


def viewed(offload: Offload) -> list[dict[str, str]]:
    comfy = offload.comfy
    assert isinstance(comfy, ViewingComfy)
    return comfy.views


@pytest.mark.parametrize(("filename", "subfolder", "kind"), hostile_records())
async def test_a_hostile_output_record_is_refused_and_the_others_are_kept(
    hostile_comfy: Offload, filename: str, subfolder: str, kind: str
) -> None:
    offload = hostile_comfy
    offload.comfy.finish(
        PROMPT_ID,
        ("9", image("good_00001_.png")),
        ("9", image(filename, subfolder, kind)),
        ("12", image("good_00002_.png")),
    )
    if kind == "output":
        with pytest.raises(ApplicationError) as refused:
            await offload.run()
        error = refused.value
        assert error.type == ErrorType.OUTPUT_MISSING and error.non_retryable
        assert "refused" in error.message and "node `9`" in error.message
        assert_printable(error.message)
    kept = await offload.run(partial=True)
    assert sorted(a.key for a in kept.artifacts) == [
        f"{COMFY_FOLDER}/0/12/good_00002_.png",
        f"{COMFY_FOLDER}/0/9/good_00001_.png",
    ]
    asked = {q["filename"] for q in viewed(offload)}
    assert asked == {"good_00001_.png", "good_00002_.png"}, "the hostile one is never asked for"
    for key in offload.store.uploads:
        assert_inside(key, COMFY_FOLDER)


async def test_another_runs_folder_is_not_ours_but_a_folder_outside_every_run_is(
    hostile_comfy: Offload,
) -> None:
    uploader = hostile_comfy.uploader()
    with pytest.raises(ApplicationError) as refused:
        await uploader.upload("9", image("ComfyUI_00001_.png", "dc_other-job_0_0123abcd"))
    assert refused.value.type == ErrorType.OUTPUT_MISSING
    assert "another run's folder" in refused.value.message
    assert viewed(hostile_comfy) == []
    # A prefix linked from a PrimitiveString is not rewritten into the run's folder: still ours.
    artifact = await uploader.upload("9", image("ComfyUI_00001_.png", "my_outputs/day1"))
    assert artifact.key == f"{COMFY_FOLDER}/0/9/ComfyUI_00001_.png"
    artifact = await uploader.upload("9", image("x.png", RUN_TAG + "/nested"))
    assert artifact.key == f"{COMFY_FOLDER}/0/9/x.png"


@pytest.mark.parametrize(
    "filename",
    ['a b<>|:*?".png', "\uff41\uff42\uff43.png", "x" * 250 + ".png", "CON.png", "-rf .png"],
)
async def test_odd_names_comfyui_may_serve_are_stored_under_a_key_in_the_jobs_folder(
    hostile_comfy: Offload, filename: str
) -> None:
    artifact = await hostile_comfy.uploader().upload("9", image(filename))
    assert_inside(artifact.key, f"{COMFY_FOLDER}/0/9")
    assert viewed(hostile_comfy) == [{"filename": filename, "subfolder": RUN_TAG, "type": "output"}]


# --- the orchestrator's RunPod backend: records ------------------------------------------------


def s3_record(bucket: str, key: str, *, data: str | None = None) -> dict[str, Any]:
    return record(OUR_KEY) | {"bucket": bucket, "key": key, "data": data or f"s3://{bucket}/{key}"}


ELSEWHERE = {
    "another bucket": s3_record("other-bucket", OUR_KEY),
    "another job's folder": s3_record(BUCKET, "jobs/other-job/0/1/x.png"),
    "outside the prefix": s3_record(BUCKET, "secrets/x.png"),
    "a .. level after the folder": s3_record(BUCKET, f"{RUNPOD_FOLDER}/../other-job/0/1/x.png"),
    "an absolute key": s3_record(BUCKET, f"/{OUR_KEY}"),
    "a NUL in the key": s3_record(BUCKET, f"{RUNPOD_FOLDER}/0/1/a\x00b.png"),
    "a newline in the key": s3_record(BUCKET, f"{RUNPOD_FOLDER}/0/1/a\nb.png"),
    "percent-encoded dots": s3_record(BUCKET, f"{RUNPOD_FOLDER}/%2e%2e/%2e%2e/x.png"),
    "a backslash": s3_record(BUCKET, f"{RUNPOD_FOLDER}/0/1/..\\..\\x.png"),
    "an empty level": s3_record(BUCKET, f"{RUNPOD_FOLDER}//x.png"),
    "data naming another object": s3_record(BUCKET, OUR_KEY, data="s3://other-bucket/x.png"),
}


@pytest.mark.parametrize("hostile", list(ELSEWHERE.values()), ids=list(ELSEWHERE))
async def test_an_s3_record_naming_another_bucket_or_key_is_refused_without_any_read(
    hostile: dict[str, Any],
) -> None:
    store = RecordingStore()
    store.put(OUR_KEY, PNG)
    store.objects[(hostile["bucket"], hostile["key"])] = (PNG, hashlib.sha256(PNG).hexdigest())
    runpod = ScriptedRunPod(statuses=[completed([hostile])])
    with pytest.raises(ApplicationError) as refused:
        await env([]).run(backend(runpod, store, claims=False).follow, follow_input())
    assert refused.value.type == ErrorType.OUTPUT_MISSING and refused.value.non_retryable
    assert "refused" in refused.value.message
    assert_printable(refused.value.message)
    assert store.calls == [], "no S3 call at all for a record that is not the job's"


async def test_a_refused_record_leaves_the_usable_ones_with_the_failure() -> None:
    good, hostile = record(OUR_KEY), ELSEWHERE["a .. level after the folder"]
    outcome = read_job(RunPodJob.model_validate(completed([good, hostile])))
    assert isinstance(outcome, Failed) and outcome.error_type == ErrorType.OUTPUT_MISSING
    assert [r.key for r in outcome.artifacts] == [OUR_KEY]
    assert "1 output(s) refused" in outcome.message


@pytest.mark.parametrize(
    "filename",
    [*HOSTILE_FILENAMES.values(), *(f"{s}/a.png" for s in HOSTILE_SUBFOLDERS.values())],
)
async def test_an_inline_output_is_stored_inside_the_jobs_folder_whatever_its_name(
    filename: str,
) -> None:
    """A stock worker's base64 answer: the orchestrator stores the bytes itself, under a key
    built from the record's filename (node id included), never from a path of its own."""
    store = RecordingStore()
    inline = {
        "filename": filename,
        "type": "base64",
        "data": base64.b64encode(PNG).decode(),
        "node_id": "../../9",
    }
    answer = completed([inline])
    del answer["output"]["submission"]  # a stock worker-comfyui answer
    runpod = ScriptedRunPod(statuses=[answer])
    result = await env([]).run(backend(runpod, store, claims=False).follow, follow_input())
    [artifact] = result.artifacts
    assert_inside(artifact.key, f"{RUNPOD_FOLDER}/0")
    assert store.calls[0] == ("upload", BUCKET, artifact.key)
    assert {key for _op, _bucket, key in store.calls} == {artifact.key}


# --- our RunPod handler (endpoint/): reads through /view, writes under the job's folder ---------


class HandlerS3:
    """What `endpoint.upload.stream_to_s3` calls of the handler's S3 client, over a dict."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], tuple[bytes, str]] = {}

    async def call(self, operation: str, **kwargs: Any) -> Any:
        if operation == "put_object":
            body = kwargs["Body"]
            sha = kwargs["Metadata"]["sha256"]
            self.objects[(kwargs["Bucket"], kwargs["Key"])] = (body, sha)
            return {}
        if operation == "head_object":
            body, sha = self.objects[(kwargs["Bucket"], kwargs["Key"])]
            return {"ContentLength": len(body), "Metadata": {"sha256": sha}}
        raise AssertionError(f"unexpected S3 call {operation}")


async def test_the_handler_writes_outputs_only_inside_the_jobs_folder_whatever_comfyui_names() -> (
    None
):
    comfy = ViewLog()
    s3 = HandlerS3()
    block = Orchestration(
        job_id="job-7",
        submission="sub-0001",
        prompt_id=PROMPT_ID,
        client_id="c1",
        output=S3Target(bucket="out", prefix="tenants/a"),
    )
    request = EndpointInput(workflow={}, durable_comfy=block)
    settings_ = endpoint_settings(BASE_URL, None)
    harmless = ["ok_00001_.png", "a b<>|:*?.png", "\uff41.png", "x" * 250 + ".png"]
    outputs = {
        "9": {"images": [image(name) for name in [*harmless, *HOSTILE_FILENAMES.values()]]},
        "../../10": {"images": [image("ok.png", sub) for sub in HOSTILE_SUBFOLDERS.values()]},
        "11": {"images": [image("ok.png", kind="input")]},
    }
    async with httpx.AsyncClient(transport=httpx.MockTransport(comfy.handle)) as http:
        client = ComfyClient(BASE_URL, http)
        job = OrchestratedJob("rp-1", request, block, client, s3, settings_, None)  # type: ignore[arg-type]
        collector = OutputCollector(client, job._sink(), lambda _record: None)
        collector.add(outputs)
        await collector.drain()
    assert sorted(q["filename"] for q in comfy.queries) == sorted(harmless)
    assert all(q["type"] == "output" for q in comfy.queries)
    folder = job_folder("tenants/a", "job-7")
    assert len(s3.objects) == len(harmless)
    for bucket, key in s3.objects:
        assert bucket == "out"
        assert_inside(key, folder)
    assert isinstance(collector.failure(), UnsafeOutputName), "the job fails, naming one"
    assert [r.key for r in collector.records()] == [key for _, key in s3.objects]


async def test_the_handler_reads_nothing_from_another_runs_folder() -> None:
    """A warm RunPod worker keeps earlier jobs' outputs: a record in another run's folder (a
    linked save prefix, a hostile node) is refused unread, and the job's own outputs are kept."""
    comfy = ViewLog()
    s3 = HandlerS3()
    ours = "dc_job-7_0_7d7c6a1e"
    block = Orchestration(
        job_id="job-7",
        submission="sub-0001",
        prompt_id=PROMPT_ID,
        client_id="c1",
        run_tag=ours,
        output=S3Target(bucket="out", prefix="tenants/a"),
    )
    request = EndpointInput(workflow={}, durable_comfy=block)
    outputs = {
        "9": {"images": [image("mine.png", ours), image("free.png", "")]},
        "10": {"images": [image("theirs.png", "dc_job-6_0_0a1b2c3d/x")]},
    }
    async with httpx.AsyncClient(transport=httpx.MockTransport(comfy.handle)) as http:
        client = ComfyClient(BASE_URL, http)
        settings_ = endpoint_settings(BASE_URL, None)
        job = OrchestratedJob("rp-1", request, block, client, s3, settings_, None)  # type: ignore[arg-type]
        collector = OutputCollector(client, job._sink(), lambda _record: None, run_tag=ours)
        collector.add(outputs)
        collector.add(outputs)  # reported again: refused once, not read
        await collector.drain()
    assert sorted(q["filename"] for q in comfy.queries) == ["free.png", "mine.png"]
    assert len(s3.objects) == 2
    refused = collector.failure()
    assert isinstance(refused, UnsafeOutputName) and "another run's folder" in str(refused)
    assert failure_of(refused).error_type == "OutputMissing"


# --- log lines ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "renderer",
    [structlog.dev.ConsoleRenderer(colors=False), structlog.processors.JSONRenderer()],
    ids=["key-value", "json"],
)
def test_log_renderers_escape_what_a_backend_puts_in_a_name(renderer: Any) -> None:
    """The renderers activities/log_setup.py and endpoint/logs.py use: a value with newlines
    or control characters stays on one line, so a name cannot forge a log entry."""
    forged = "a.png\n2026-01-01T00:00:00Z [info] job_completed job_id=victim\x1b[2K\r\x00"
    line = renderer(None, "warning", {"event": "output_refused", "filename": forged})
    assert isinstance(line, str)
    assert "\n" not in line and "\r" not in line and "\x1b" not in line and "\x00" not in line


# --- end to end: the local stack's ComfyUI simulator, a real worker -----------------------------


async def test_a_job_whose_output_lands_in_another_runs_folder_fails_and_keeps_its_others(
    local_stack: RunningStack,
) -> None:
    """A save prefix built at run time is not rewritten, so a graph can make ComfyUI save into
    another run's folder (a literal naming one is refused before the job starts; a string put
    together by a node is not seen then); that record is refused (never fetched), the job
    fails naming it, and the output of the graph's other SaveImage is kept."""
    graph = example(steps=2)
    graph["30"] = {
        "class_type": "StringConcatenate",
        "inputs": {"string_a": "dc", "string_b": "other-job_0_0123abcd/stolen", "delimiter": "_"},
    }
    graph["31"] = {
        "class_type": "SaveImage",
        "inputs": {"images": ["8", 0], "filename_prefix": ["30", 0]},
    }
    async with running_worker(local_stack, "hostile") as worker:
        submitted = await worker.client.submit(JobRequest(graph=graph))
        final = await worker.client.wait(submitted.job_id)
    assert final.state == JobState.FAILED
    assert final.error is not None and final.error.type == ErrorType.OUTPUT_MISSING
    assert "node `31`" in final.error.message and "another run's folder" in final.error.message
    assert [a.node_id for a in final.artifacts] == ["9"], "the other output is kept"
    folder = job_folder("jobs", submitted.job_id)
    assert_inside(final.artifacts[0].key, folder)


def test_our_handler_reports_a_refused_output_name_as_output_missing() -> None:
    """Not an unexpected handler error (a BackendError with a traceback): the job's other
    outputs are kept and the orchestrator knows which output is missing, and why."""
    error = failure_of(UnsafeOutputName("../../x.png", "", "output", "traversal"))
    assert error.error_type == "OutputMissing"
    assert "refused, not fetched: traversal" in error.error


class DownloadRecorder:
    def __init__(self) -> None:
        self.downloads: list[str] = []

    async def download(self, key: str, dest: Any, **_: Any) -> Any:
        self.downloads.append(key)
        return dest


@pytest.mark.parametrize(
    "key", ["../../x.png", "jobs/j/../../../etc/x", "/etc/passwd", "jobs\\..\\x", "jobs/a\x00b"]
)
async def test_the_client_downloads_nothing_outside_its_directory(key: str, tmp_path: Path) -> None:
    """The status is data: a key that would leave the download directory stops the download
    before anything is fetched or written."""
    store = DownloadRecorder()
    client = JobClient(cast(Client, object()), store=cast(ArtifactStore, store))
    good = Artifact(
        key="jobs/j/0/9/a.png",
        uri="s3://b/jobs/j/0/9/a.png",
        size=1,
        sha256="0" * 64,
        content_type="image/png",
        node_id="9",
    )
    status = JobStatus(job_id="j", artifacts=[good, good.model_copy(update={"key": key})])
    with pytest.raises(UnsafeArtifactKey, match="outside"):
        await client.download(status, tmp_path / "out")
    assert store.downloads == ["jobs/j/0/9/a.png"]
