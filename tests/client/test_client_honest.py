"""`JobClient` does what a script expects: the CLI's settings, detached submits, `ClientError`s.

On the time-skipping server, no worker needed: `connect()` opens the bucket from the same
variables as the CLI (so `result` can presign), `submit()` is detached by default, and the SDK's
and the bucket's errors reach a caller as the client's own, every one exported from `starter`.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.client import RPCTimeoutOrCancelledError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

import starter
from starter import (
    ClientError,
    JobClient,
    JobPolicy,
    JobRequest,
    NamespaceMissing,
    StorageFailed,
    StorageNotConfigured,
    TemporalRefused,
    TemporalUnreachable,
    load_graph,
    request_from_files,
)
from tests.support.workflow_fakes import GRAPH
from workflows.errors import IntegrityError, StorageConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "txt2img.json"
S3_VARIABLES = {
    "DURABLE_COMFY_BUCKET": "artifacts",
    "DURABLE_COMFY_S3_ENDPOINT": "http://127.0.0.1:9",  # never reached: presigning is local
    "AWS_ACCESS_KEY_ID": "test-key",
    "AWS_SECRET_ACCESS_KEY": "test-secret",
}


def target_of(env: WorkflowEnvironment) -> str:
    return env.client.service_client.config.target_host


@pytest.fixture
def no_bucket(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in [*S3_VARIABLES, "DURABLE_COMFY_TASK_QUEUE", "DURABLE_COMFY_QUERY_TIMEOUT_S"]:
        monkeypatch.delenv(name, raising=False)
    yield


async def test_connect_opens_the_bucket_the_environment_names_and_presigns(
    env: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch, no_bucket: None
) -> None:
    for name, value in S3_VARIABLES.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DURABLE_COMFY_TASK_QUEUE", "from-the-environment")
    async with await JobClient.connect(target_of(env), env.client.namespace) as client:
        assert client.task_queue == "from-the-environment"
        assert client.store is not None and client.store.settings.bucket == "artifacts"
        url = await client.store.presign_get("job/out.png", 60)
        assert url.startswith("http://127.0.0.1:9/artifacts/job/out.png?")
    assert client.store is None, "closing the client closes the store it opened"


async def test_connect_without_a_bucket_has_no_store(
    env: WorkflowEnvironment, no_bucket: None
) -> None:
    async with await JobClient.connect(target_of(env), env.client.namespace) as client:
        assert client.store is None
        assert client.task_queue == "durable-comfy"


async def test_a_bad_bucket_variable_is_a_client_error_naming_it(
    env: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch, no_bucket: None
) -> None:
    monkeypatch.setenv("DURABLE_COMFY_BUCKET", "artifacts")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "only-half-a-pair")
    with pytest.raises(StorageNotConfigured, match="AWS_SECRET_ACCESS_KEY"):
        await JobClient.connect(target_of(env), env.client.namespace)


async def test_submit_is_detached_by_default_and_attached_when_asked(
    env: WorkflowEnvironment,
) -> None:
    client = JobClient(env.client, task_queue=f"nobody-{uuid.uuid4()}")
    policy = JobPolicy(abandon_after_s=120)
    detached = await client.submit(JobRequest(graph=GRAPH, policy=policy))
    attached = await client.submit(JobRequest(graph=GRAPH, policy=policy), detached=False)
    assert detached.detached and detached.abandon_after_s is None
    assert not attached.detached and attached.abandon_after_s == 120
    for job in (detached, attached):
        await env.client.get_workflow_handle(job.job_id).terminate()


async def test_temporal_errors_reach_the_caller_as_client_errors(
    env: WorkflowEnvironment,
) -> None:
    client = JobClient(env.client)
    refused = RPCError("request unauthorized", RPCStatusCode.PERMISSION_DENIED, b"")
    with pytest.raises(TemporalRefused) as raised, client.translated_errors():
        raise refused
    assert raised.value.status == "PERMISSION_DENIED" and raised.value.__cause__ is refused
    # A namespace the server lacks is a setting to fix, said as `doctor` says it.
    missing = RPCError("Namespace nowhere is not found.", RPCStatusCode.NOT_FOUND, b"")
    with pytest.raises(NamespaceMissing, match="temporal operator namespace create"):
        with client.translated_errors():
            raise missing
    down = RPCError("connection refused", RPCStatusCode.UNAVAILABLE, b"")
    with pytest.raises(TemporalUnreachable, match=target_of(env)), client.translated_errors():
        raise down
    with pytest.raises(TemporalUnreachable), client.translated_errors():
        raise RPCTimeoutOrCancelledError("timed out")


def test_storage_errors_reach_the_caller_as_client_errors() -> None:
    client = JobClient.__new__(JobClient)
    with pytest.raises(StorageFailed) as raised, client.translated_errors():
        raise IntegrityError("sha256 differs", retryable=False)
    assert not raised.value.retryable, "the bucket's word on retrying is kept"
    with pytest.raises(StorageNotConfigured), client.translated_errors():
        raise StorageConfigError("AccessDenied")


async def test_a_job_client_call_on_a_closed_server_raises_a_client_error() -> None:
    """No RPCError escapes a public method (here: nothing listens at that address)."""
    with pytest.raises(TemporalUnreachable):
        await JobClient.connect("127.0.0.1:9", "default")


def test_every_public_job_client_method_translates_errors() -> None:
    """Each public coroutine method goes through `translated_errors` (watch does it inline)."""
    for name, member in vars(JobClient).items():
        if name.startswith("_") or not inspect.iscoroutinefunction(member):
            continue
        if name in {"connect", "close"}:
            continue  # connect translates the store's errors itself; close raises none
        assert hasattr(member, "__wrapped__"), f"JobClient.{name} lets the SDK's errors out"
    assert "translated_errors" in inspect.getsource(JobClient.watch)


def test_every_client_error_is_exported_from_starter() -> None:
    def subclasses(cls: type[Exception]) -> set[type[Exception]]:
        found: set[type[Exception]] = {cls}
        for sub in cls.__subclasses__():
            found |= subclasses(sub)
        return found

    ours = {c for c in subclasses(ClientError) if c.__module__.startswith("starter.")}
    exported = {getattr(starter, name) for name in starter.__all__}
    assert len(ours) >= 18  # the base, and the 17 kinds starter.errors draws
    assert ours <= exported, {c.__name__ for c in ours - exported}


def test_load_graph_takes_a_str_or_a_path() -> None:
    assert load_graph(str(EXAMPLE)) == load_graph(EXAMPLE)
    assert request_from_files(str(EXAMPLE)).graph == load_graph(EXAMPLE)
