"""`pool status`, `pool drain` and `pool undrain` without a server: the lines a pool and its
servers are shown in, the `drain` update the client sends (server, drain or undrain, by whom),
and a server the pool does not have, refused with its servers named."""

from __future__ import annotations

import getpass
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode
from typer.testing import CliRunner

from configuration.processes import CliConfig
from starter import JobClient
from starter.cli import build_app, pools
from starter.cli.common import ExitCode, exit_code_for
from starter.cli.pools import drain_line, status_lines
from starter.errors import ClientError, DrainRefused, NoPoolQueue, UnknownServer
from starter.queues import drain_pool, operator_name
from tests.conftest import free_port
from tests.support.cli import logging_restored
from workflows.admission import EndpointHealth, PoolDrain, PoolQueueView, ServerView
from workflows.shared import QUERY_POOL_QUEUE, UPDATE_POOL_DRAIN, pool_queue_id

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
A, B, C = "http://gpu-a:8188", "http://gpu-b:8188", "http://gpu-c:8188"


def three_servers(**pool: Any) -> PoolQueueView:
    """A pool of three servers: one healthy running a job, one unhealthy, one drained."""
    return PoolQueueView(
        pool="gpu",
        max_running=3,
        running=1,
        waiting=4,
        servers=[
            ServerView(url=A, health="healthy", running=1, slots=1, started=7),
            ServerView(
                url=B,
                health="unhealthy",
                slots=1,
                started=2,
                failures=3,
                last_error="GET /system_stats: connection refused",
                since=NOW - timedelta(seconds=90),
            ),
            ServerView(url=C, health="drained", slots=1, since=NOW - timedelta(seconds=600)),
        ],
        **pool,
    )


# -- `pool status`'s lines ----------------------------------------------------------------------


def test_a_pool_of_one_backend_is_one_line() -> None:
    view = PoolQueueView(pool="cpu", max_running=2, running=2, waiting=5)
    assert status_lines(view, NOW) == ["pool cpu: 2 running, 5 waiting (max_running 2)"]


def test_a_drained_pool_says_by_whom() -> None:
    view = PoolQueueView(pool="cpu", max_running=2, waiting=5, drained="alice")
    assert status_lines(view, NOW) == [
        "pool cpu: 0 running, 5 waiting (max_running 2), drained by alice"
    ]


def test_each_server_is_a_line_with_its_health_load_and_last_error() -> None:
    assert status_lines(three_servers(), NOW) == [
        "pool gpu: 1 running, 4 waiting (max_running 3)",
        f"{'server':17}  {'health':9}  running  started  failures  {'since':8}  last error",
        f"{A}  {'healthy':9}  {'1/1':7}  {'7':7}  {'0':8}  {'-':8}  -",
        f"{B}  unhealthy  {'0/1':7}  {'2':7}  {'3':8}  {'90s ago':8}  "
        "GET /system_stats: connection refused",
        f"{C}  {'drained':9}  {'0/1':7}  {'0':7}  {'0':8}  600s ago  -",
    ]


def test_a_drained_pool_of_servers_shows_both() -> None:
    lines = status_lines(three_servers(drained="bob"), NOW)
    assert lines[0] == "pool gpu: 1 running, 4 waiting (max_running 3), drained by bob"
    assert [line.split()[1] for line in lines[2:]] == ["healthy", "unhealthy", "drained"]


# -- what a drain says it left ------------------------------------------------------------------


def test_a_drained_server_says_what_still_runs_there() -> None:
    view = three_servers()
    assert drain_line(view, A, drain=True) == (
        f"drained server {A} of pool gpu: no new job goes there; 1 running job finishes there"
    )
    assert drain_line(view, C, drain=True) == (
        f"drained server {C} of pool gpu: no new job goes there; nothing runs there"
    )
    # The URL as the pool names it, whatever slash it was given with.
    assert drain_line(view, A + "/", drain=True).startswith(f"drained server {A} of")


def test_an_undrained_server_says_when_it_takes_work_again() -> None:
    view = three_servers()
    assert drain_line(view, A, drain=False) == (
        f"undrained server {A} of pool gpu: it takes new jobs again"
    )
    assert drain_line(view, B, drain=False) == (
        f"undrained server {B} of pool gpu: it takes new jobs once healthy again "
        "(unhealthy: GET /system_stats: connection refused)"
    )
    assert drain_line(three_servers(drained="bob"), A, drain=False) == (
        f"undrained server {A} of pool gpu: it takes new jobs once the pool is undrained "
        "(drained by bob)"
    )


def test_a_drained_pool_says_what_runs_and_waits() -> None:
    assert drain_line(three_servers(drained="alice"), None, drain=True) == (
        "drained pool gpu: no new job starts until `pool undrain gpu`; 1 running job finishes, "
        "4 waiting"
    )
    idle = PoolQueueView(pool="cpu", max_running=2, running=3, drained="alice")
    assert drain_line(idle, None, drain=True).endswith("; 3 running jobs finish, 0 waiting")
    assert drain_line(three_servers(), None, drain=False) == (
        "undrained pool gpu: its jobs start again, 4 waiting"
    )


# -- the update the client sends ------------------------------------------------------------------


class FakeQueue:
    """The Temporal client and the dispatcher's handle at once: answers the `queue` query with
    `view` and records each update (a drain applied to the view it answers), or raises
    `refusal` for it; `missing`: no dispatcher runs."""

    def __init__(
        self,
        view: PoolQueueView,
        *,
        refusal: BaseException | None = None,
        missing: bool = False,
    ) -> None:
        self.view, self.refusal, self.missing = view, refusal, missing
        self.updates: list[tuple[str, PoolDrain]] = []
        self.handles: list[str] = []
        self.queries = 0

    def get_workflow_handle(self, workflow_id: str) -> FakeQueue:
        self.handles.append(workflow_id)
        return self

    def _gone(self) -> RPCError:
        return RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")

    async def query(self, name: str, *, result_type: object, rpc_timeout: object) -> PoolQueueView:
        assert name == QUERY_POOL_QUEUE and result_type is PoolQueueView
        self.queries += 1
        if self.missing:
            raise self._gone()
        return self.view

    async def execute_update(
        self, name: str, order: PoolDrain, *, result_type: object, rpc_timeout: object
    ) -> PoolQueueView:
        assert result_type is PoolQueueView
        self.updates.append((name, order))
        if self.refusal is not None:
            raise self.refusal
        servers = [
            s.model_copy(update={"health": "drained" if order.drain else "healthy"})
            if s.url == order.server
            else s
            for s in self.view.servers
        ]
        drained = self.view.drained
        if order.server is None:
            drained = order.by if order.drain else None
        return self.view.model_copy(update={"servers": servers, "drained": drained})


async def test_a_drain_sends_the_server_the_flag_and_who() -> None:
    queue = FakeQueue(three_servers())
    view = await drain_pool(queue, "tq", "gpu", server=A, drain=True, by="alice")  # type: ignore[arg-type]
    assert queue.updates == [(UPDATE_POOL_DRAIN, PoolDrain(server=A, drain=True, by="alice"))]
    assert set(queue.handles) == {pool_queue_id("tq", "gpu")}
    assert [s.health for s in view.servers] == ["drained", "unhealthy", "drained"]
    # An undrain, of the URL as the pool names it (a trailing slash dropped).
    await drain_pool(queue, "tq", "gpu", server=C + "/", drain=False, by="bob")  # type: ignore[arg-type]
    assert queue.updates[-1] == (UPDATE_POOL_DRAIN, PoolDrain(server=C, drain=False, by="bob"))


async def test_a_drain_of_the_whole_pool_names_no_server() -> None:
    queue = FakeQueue(PoolQueueView(pool="cpu", max_running=2))
    view = await drain_pool(queue, "tq", "cpu", server=None, drain=True, by="alice")  # type: ignore[arg-type]
    assert queue.updates == [(UPDATE_POOL_DRAIN, PoolDrain(server=None, drain=True, by="alice"))]
    assert view.drained == "alice"


async def test_job_client_drains_as_the_os_user_and_undrains(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(getpass, "getuser", lambda: "carol")
    queue = FakeQueue(three_servers())
    client = JobClient(queue, task_queue="tq")  # type: ignore[arg-type]
    await client.drain_pool("gpu", B)
    await client.undrain_pool("gpu", B, by="dave")
    await client.drain_pool("gpu", by="erin")
    await client.undrain_pool("gpu")
    assert [order for _, order in queue.updates] == [
        PoolDrain(server=B, drain=True, by="carol"),
        PoolDrain(server=B, drain=False, by="dave"),
        PoolDrain(server=None, drain=True, by="erin"),
        PoolDrain(server=None, drain=False, by="carol"),
    ]


def test_who_drains_is_operator_when_the_os_has_no_user(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_user() -> str:
        raise OSError("No username set in the environment")

    monkeypatch.setattr(getpass, "getuser", no_user)
    assert operator_name() == "operator"


# -- refusals -------------------------------------------------------------------------------------


async def test_a_server_the_pool_lacks_is_refused_before_anything_is_sent() -> None:
    queue = FakeQueue(three_servers())
    with pytest.raises(UnknownServer) as refused:
        await drain_pool(queue, "tq", "gpu", server="http://gpu-z:8188", drain=True, by="a")  # type: ignore[arg-type]
    assert queue.updates == []
    assert refused.value.servers == [A, B, C] and refused.value.server == "http://gpu-z:8188"
    assert str(refused.value) == (
        "pool 'gpu''s queue refused the drain: http://gpu-z:8188 is not one of its servers "
        f"({A}, {B}, {C})"
    )
    assert isinstance(refused.value, ClientError) and isinstance(refused.value, LookupError)
    assert exit_code_for(refused.value) == ExitCode.BAD_INPUT


async def test_a_server_of_a_pool_without_servers_is_refused_too() -> None:
    queue = FakeQueue(PoolQueueView(pool="cpu", max_running=2))
    with pytest.raises(UnknownServer) as refused:
        await drain_pool(queue, "tq", "cpu", server=A, drain=False, by="a")  # type: ignore[arg-type]
    assert queue.updates == [] and refused.value.servers == []
    assert "refused the undrain" in str(refused.value)
    assert "picks no servers" in str(refused.value) and "drain the whole pool" in str(refused.value)


async def test_the_queues_own_refusal_of_a_server_is_an_unknown_server() -> None:
    """The dispatcher's validator refuses a server its pool no longer has (its servers changed
    between the client's look and the update)."""
    why = ApplicationError(
        f"{A} is not a server of pool 'gpu' (its servers: {B})", type="ValueError"
    )
    queue = FakeQueue(three_servers(), refusal=WorkflowUpdateFailedError(why))
    with pytest.raises(UnknownServer) as refused:
        await drain_pool(queue, "tq", "gpu", server=A, drain=True, by="a")  # type: ignore[arg-type]
    assert refused.value.server == A and refused.value.servers == [A, B, C]
    assert queue.queries == 2, "the servers it has are asked again"


async def test_any_other_refusal_is_a_drain_refused() -> None:
    why = ApplicationError("update handler for drain expected but not found", type="Whatever")
    queue = FakeQueue(three_servers(), refusal=WorkflowUpdateFailedError(why))
    client = JobClient(queue, task_queue="tq")  # type: ignore[arg-type]
    with pytest.raises(DrainRefused) as refused:
        await client.drain_pool("gpu", by="a")
    assert not isinstance(refused.value, UnknownServer)
    assert str(refused.value) == (
        "pool 'gpu''s queue refused the drain: update handler for drain expected but not found"
    )


async def test_no_dispatcher_is_no_pool_queue_and_none_is_started() -> None:
    queue = FakeQueue(three_servers(), missing=True)
    client = JobClient(queue, task_queue="tq")  # type: ignore[arg-type]
    with pytest.raises(NoPoolQueue):
        await client.drain_pool("gpu", A)
    assert queue.updates == []


# -- the commands -------------------------------------------------------------------------------


class FakeClient:
    def __init__(self, view: PoolQueueView, error: Exception | None = None) -> None:
        self.view, self.error = view, error
        self.calls: list[tuple[str, str, str | None, str | None]] = []

    async def pool_queue(self, pool: str) -> PoolQueueView:
        if self.error is not None:
            raise self.error
        return self.view

    async def drain_pool(
        self, pool: str, server: str | None = None, *, by: str | None = None
    ) -> PoolQueueView:
        self.calls.append(("drain", pool, server, by))
        if self.error is not None:
            raise self.error
        return self.view

    async def undrain_pool(
        self, pool: str, server: str | None = None, *, by: str | None = None
    ) -> PoolQueueView:
        self.calls.append(("undrain", pool, server, by))
        if self.error is not None:
            raise self.error
        return self.view


def with_client(monkeypatch: pytest.MonkeyPatch, client: FakeClient) -> FakeClient:
    @asynccontextmanager
    async def job_client(_config: CliConfig, with_store: bool = False) -> AsyncIterator[Any]:
        yield client

    monkeypatch.setattr(pools, "job_client", job_client)
    return client


def invoke(*args: str) -> tuple[int, str, str]:
    env = {"TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}"}
    with logging_restored():
        result = CliRunner().invoke(build_app(), list(args), env=env)
    return result.exit_code, result.stdout, result.stderr


def test_pool_status_prints_the_pool_then_its_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    with_client(monkeypatch, FakeClient(three_servers(drained="alice")))
    code, out, err = invoke("pool", "status", "gpu")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "pool gpu: 1 running, 4 waiting (max_running 3), drained by alice"
    assert [line.split()[:3] for line in lines[2:]] == [
        [A, "healthy", "1/1"],
        [B, "unhealthy", "0/1"],
        [C, "drained", "0/1"],
    ]
    code, out, _ = invoke("pool", "status", "gpu", "--json")
    assert code == 0
    document = json.loads(out)
    assert document["drained"] == "alice"
    assert [s["health"] for s in document["servers"]] == ["healthy", "unhealthy", "drained"]


def test_pool_status_of_a_pool_without_a_queue_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    with_client(monkeypatch, FakeClient(three_servers(), NoPoolQueue("gpu")))
    code, out, err = invoke("pool", "status", "gpu")
    assert code == ExitCode.BAD_INPUT and out == ""
    assert "pool 'gpu' has no queue" in err


def test_pool_drain_sends_the_server_and_who_and_says_what_runs_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = with_client(monkeypatch, FakeClient(three_servers()))
    code, out, err = invoke("pool", "drain", "gpu", "--server", A, "--by", "alice")
    assert code == 0, err
    assert client.calls == [("drain", "gpu", A, "alice")]
    assert out == (
        f"drained server {A} of pool gpu: no new job goes there; 1 running job finishes there\n"
    )
    code, out, err = invoke("pool", "drain", "gpu")
    assert code == 0, err
    assert client.calls[-1] == ("drain", "gpu", None, None)  # by: the client's default
    assert out.startswith("drained pool gpu: no new job starts")


def test_pool_undrain_sends_an_undrain(monkeypatch: pytest.MonkeyPatch) -> None:
    client = with_client(monkeypatch, FakeClient(three_servers()))
    code, out, err = invoke("pool", "undrain", "gpu", "--server", A)
    assert code == 0, err
    assert client.calls == [("undrain", "gpu", A, None)]
    assert out == f"undrained server {A} of pool gpu: it takes new jobs again\n"
    code, out, _ = invoke("pool", "undrain", "gpu")
    assert client.calls[-1] == ("undrain", "gpu", None, None)
    assert out == "undrained pool gpu: its jobs start again, 4 waiting\n"


def test_an_unknown_server_exits_2_naming_the_pools_servers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refused = UnknownServer("gpu", "http://gpu-z:8188", [A, B])
    with_client(monkeypatch, FakeClient(three_servers(), refused))
    code, out, err = invoke("pool", "drain", "gpu", "--server", "http://gpu-z:8188")
    assert code == ExitCode.BAD_INPUT and out == ""
    assert err.splitlines() == [
        f"error: pool 'gpu''s queue refused the drain: http://gpu-z:8188 is not one of its "
        f"servers ({A}, {B})",
        "hint: `durable-comfy pool status gpu` lists its servers",
    ]


def test_a_drain_of_a_pool_without_a_queue_says_when_it_can(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with_client(monkeypatch, FakeClient(three_servers(), NoPoolQueue("gpu")))
    code, out, err = invoke("pool", "undrain", "gpu")
    assert code == ExitCode.BAD_INPUT and out == ""
    assert "pool 'gpu' has no queue" in err and "nothing to undrain" in err
    assert "once its first job has asked" in err


def test_a_drained_server_says_by_whom() -> None:
    view = PoolQueueView(
        pool="gpu",
        max_running=1,
        servers=[ServerView(url=A, health="drained", drained_by="carol")],
    )
    assert status_lines(view, NOW)[2].split("  ")[1] == "drained by carol"


def test_a_watched_endpoint_shows_its_workers_and_why_it_takes_no_work() -> None:
    view = PoolQueueView(
        pool="rp",
        max_running=2,
        waiting=3,
        unhealthy="no worker can take a job: 2 unhealthy, 0 throttled, 1 running",
        endpoint=EndpointHealth(running=1, unhealthy_workers=2, in_queue=0, in_progress=1),
    )
    lines = status_lines(view, NOW)
    assert lines[1] == (
        "takes no work now: no worker can take a job: 2 unhealthy, 0 throttled, 1 running"
    )
    assert lines[2] == (
        "endpoint: 0 idle, 0 starting, 1 running, 2 unhealthy, 0 throttled; 0 in its queue, "
        "1 in progress"
    )
