"""The gateway reads a status a newer worker wrote: on the real dev server, a stand-in
for a later version's `InferenceJob` answers the `status` and `events` queries with a state and
a journal kind this version does not know, and fields it does not have. The gateway's GET shows
the state by its name, its SSE stream passes the entries on and ends when the status says it is
`terminal`, whatever the state is called; the CLI's `status` and `watch`, and the page, do the
same."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest_asyncio
from temporalio import workflow
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.worker import Worker

from devstack.free_ports import free_port
from devstack.models import RunningStack
from starter import JobClient
from starter.client import TENANT_KEY
from tests.gateway.test_gateway_page import needs_chromium, page_state, set_field
from tests.support.chromium import Page, open_page
from tests.support.cli import cli_env, json_lines, run_cli
from tests.support.gateway import KEYS, RunningGateway, running_gateway, sse_events
from workflows.shared import QUERY_EVENTS, QUERY_STATUS, STATE_KEY

SIGNAL_FINISH = "finish_for_the_test"


@workflow.defn(name="InferenceJob", sandboxed=False)
class NewerInferenceJob:
    """What a later version's job answers: a `PAUSED` state, then an `ARCHIVED` one that has
    ended, a `queue_moved` journal kind, and fields this version lacks."""

    def __init__(self) -> None:
        self.state, self.terminal, self.seq = "PAUSED", False, 2

    @workflow.run
    async def run(self, _: Any) -> dict[str, Any]:
        await workflow.wait_condition(lambda: self.terminal)
        return self.status()

    @workflow.signal(name=SIGNAL_FINISH)
    def finish(self) -> None:
        self.state, self.terminal, self.seq = "ARCHIVED", True, 3

    @workflow.query(name=QUERY_STATUS)
    def status_query(self) -> dict[str, Any]:
        return self.status()

    @workflow.query(name=QUERY_EVENTS)
    def events_query(self, _: Any) -> dict[str, Any]:
        at = datetime(2026, 12, 6, tzinfo=UTC).isoformat()
        events = [
            {"seq": 1, "at": at, "kind": "state", "state": "QUEUED"},
            {"seq": 2, "at": at, "kind": "queue_moved", "position": 2, "tier": "gold"},
        ]
        if self.terminal:
            events.append({"seq": 3, "at": at, "kind": "state", "state": "ARCHIVED"})
        return {"status": self.status(), "events": events, "first_seq": 1, "window": 500}

    def status(self) -> dict[str, Any]:
        return {
            "job_id": workflow.info().workflow_id,
            "state": self.state,
            "terminal": self.terminal,
            "seq": self.seq,
            "detached": True,
            "queue": {"position": 2, "tier": "gold"},
            "progress": {"step": 0, "total_steps": 20, "fraction": 0.0, "eta_s": 30},
            "teardown": {"state": "PENDING", "budget_s": 30},
        }


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def newer(local_stack: RunningStack) -> AsyncIterator[tuple[RunningGateway, JobClient]]:
    task_queue = f"newer-{uuid.uuid4().hex[:8]}"
    client = await JobClient.connect(
        local_stack.temporal_address,
        local_stack.namespace,
        task_queue=task_queue,
        s3_from_environment=False,
    )

    async def factory() -> JobClient:
        return client

    async with (
        Worker(client.temporal, task_queue=task_queue, workflows=[NewerInferenceJob]),
        running_gateway(factory) as gateway,
    ):
        yield gateway, client


async def start_newer(client: JobClient) -> str:
    job_id = f"acme.newer-{uuid.uuid4().hex[:12]}"
    attributes = TypedSearchAttributes(
        [SearchAttributePair(TENANT_KEY, "acme"), SearchAttributePair(STATE_KEY, "PAUSED")]
    )
    await client.temporal.start_workflow(
        "InferenceJob",
        {},
        id=job_id,
        task_queue=client.task_queue,
        search_attributes=attributes,
    )
    return job_id


async def test_get_shows_a_newer_workers_state_by_its_name(
    newer: tuple[RunningGateway, JobClient],
) -> None:
    gateway, client = newer
    job_id = await start_newer(client)
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        answer = await http.get(f"{gateway.url}/v1/jobs/{job_id}", headers=gateway.auth())
    assert answer.status_code == 200, answer.text
    view = answer.json()
    assert (view["state"], view["terminal"]) == ("PAUSED", False), view
    assert "queue" not in view and "eta_s" not in view["progress"], view
    await client.temporal.get_workflow_handle(job_id).signal(SIGNAL_FINISH)


async def test_the_stream_passes_unknown_kinds_on_and_ends_on_terminal(
    newer: tuple[RunningGateway, JobClient],
) -> None:
    gateway, client = newer
    job_id = await start_newer(client)
    seen: list[tuple[str, dict[str, Any]]] = []
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        url = f"{gateway.url}/v1/jobs/{job_id}/events?since=0"
        async with asyncio.timeout(60):
            async for event in sse_events(http, url, gateway.auth()):
                seen.append((event.event, event.data))
                if event.event == "status" and event.data["state"] == "PAUSED":
                    await client.temporal.get_workflow_handle(job_id).signal(SIGNAL_FINISH)
                if event.event == "end":
                    break
    kinds = [kind for kind, _ in seen]
    assert "queue_moved" in kinds, seen
    statuses = [data for kind, data in seen if kind == "status"]
    assert statuses[0]["state"] == "PAUSED" and statuses[-1]["state"] == "ARCHIVED", seen
    assert seen[-1] == ("end", {"state": "ARCHIVED"}), seen


async def test_the_cli_shows_and_watches_a_newer_workers_state(
    newer: tuple[RunningGateway, JobClient], local_stack: RunningStack
) -> None:
    """`status` prints the unknown state by its name (exit 0); `watch` waits while the status
    says it has not ended and stops when it says it has, whatever the state is called."""
    _gateway, client = newer
    job_id = await start_newer(client)
    env = cli_env(local_stack, client.task_queue)
    code, out, err = await run_cli("status", job_id, "--json", env=env)
    assert code == 0, err
    [shown] = json_lines(out)
    assert (shown["state"], shown["terminal"]) == ("PAUSED", False), shown
    code, out, err = await run_cli("status", job_id, env=env)
    assert code == 0 and f"job {job_id}: PAUSED" in out, out + err
    watching = asyncio.create_task(run_cli("watch", job_id, "--json", env=env))
    await asyncio.sleep(3)
    assert not watching.done(), "a job that has not ended is watched on"
    await client.temporal.get_workflow_handle(job_id).signal(SIGNAL_FINISH)
    code, out, err = await asyncio.wait_for(watching, 60)
    assert json_lines(out)[-1]["state"] == "ARCHIVED", out
    assert code == 1, "ended, not COMPLETED"


async def page_until(page: Page, ok: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The page's state once `ok`; past a minute, the failure shows the last one seen."""
    shown: dict[str, Any] = {}
    deadline = asyncio.get_running_loop().time() + 60
    while asyncio.get_running_loop().time() < deadline:
        shown = await page_state(page)
        if ok(shown):
            return shown
        await asyncio.sleep(0.2)
    raise AssertionError(f"the page never got there: {shown}, console {page.console}")


@needs_chromium
async def test_the_page_shows_a_newer_workers_state_and_ends_on_terminal(
    newer: tuple[RunningGateway, JobClient], tmp_path: Path
) -> None:
    """The page (gateway/static/app.js, in a real Chromium) shows the unknown state by its name
    and stops following when the status says it has ended, not when a state it knows appears."""
    gateway, client = newer
    job_id = await start_newer(client)
    url = f"{gateway.url}/#job={job_id}"
    async with open_page(url, free_port(), tmp_path / "profile") as page:
        await page.record_console()
        # Without a key the page's first read is refused and it stops; the key then restarts it
        # (set before that answer, the key would race it).
        await page.wait_for(
            "document.getElementById('connection').dataset.connection == 'stopped'", 30
        )
        await page.evaluate(set_field("api-key", KEYS["acme"]))
        shown = await page_until(page, lambda seen: seen["state"] == "PAUSED")
        assert shown["connection"] != "ended", shown
        await client.temporal.get_workflow_handle(job_id).signal(SIGNAL_FINISH)
        shown = await page_until(page, lambda seen: seen["connection"] == "ended")
        assert shown["state"] == "ARCHIVED", shown
        # An ended job offers no cancel, by the status's word (the page knows no ARCHIVED).
        cancel_hidden = await page.evaluate("String(document.getElementById('cancel').hidden)")
        assert cancel_hidden == "true", shown
        assert not [line for line in page.console if line.startswith("uncaught")], page.console
