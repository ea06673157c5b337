"""The browser page submits a batch (a count above 1) and follows it (`make test-ui`).

Headless Chromium opens the page of a gateway run as a user runs it (`durable-comfy gateway`, a
subprocess), with an API key, in front of a worker on the local stack. The page submits the
example with a count: one `POST /v1/batches` (`{"request": ..., "count": N}`), then `#batch=<id>`
in the address, and it shows the batch (its state, its jobs by state, a progress bar, cost,
artifacts and each job linking to the page's own view of it) followed over its event stream to
the end. A batch of 3 ends COMPLETED with its 3 jobs listed; one cancelled from the page ends
CANCELLED; the batch's link, reloaded or opened in another browser, shows the same batch.
Screenshots are kept in the test's temporary folder (named in every failure message).

The tests without a stack drive the page's own functions with a stand-in `fetch`: a resent
batch submit carries its first key, and a batch whose stream the gateway refuses is polled
(with `If-None-Match`) to its end, and server text is shown as text.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest

from devstack.models import RunningStack
from starter import BatchState, JobClient
from tests.conftest import HOST, free_port
from tests.gateway.test_gateway_page import (
    STATIC,
    header,
    needs_chromium,
    page_state,
    running_gateway,
    set_field,
    until_ended,
)
from tests.support.chromium import Page, open_page
from tests.support.cli import cli_env, running_worker

# What the test reads off the page's batch section.
BATCH_STATE = """JSON.stringify({
  shown: !document.getElementById('batch-section').hidden,
  jobShown: !document.getElementById('job-section').hidden,
  batch: document.getElementById('batch-id').textContent,
  state: document.getElementById('batch-state').textContent,
  counts: [...document.querySelectorAll('#batch-counts li')].map(li => li.textContent),
  bar: document.getElementById('batch-bar').value,
  progress: document.getElementById('batch-progress-text').textContent,
  cost: document.getElementById('batch-cost').textContent,
  artifacts: document.getElementById('batch-artifacts').textContent,
  cancelled: document.getElementById('batch-cancelled').hidden
    ? '' : document.getElementById('batch-cancelled').textContent,
  connection: document.getElementById('batch-connection').dataset.connection,
  connectionText: document.getElementById('batch-connection').textContent,
  cancel: !document.getElementById('batch-cancel').hidden,
  jobs: [...document.querySelectorAll('#batch-jobs li')].map(li => ({
    id: li.dataset.job, state: li.dataset.state, text: li.textContent,
    href: li.querySelector('a').getAttribute('href')})),
  errors: document.getElementById('batch-error').textContent
    + document.getElementById('submit-error').textContent,
  hash: location.hash,
})"""
BATCH_ENDED = "document.getElementById('batch-connection').dataset.connection == 'ended'"


async def batch_state(page: Page) -> dict[str, Any]:
    state: dict[str, Any] = json.loads(await page.evaluate(BATCH_STATE))
    return state


async def evidence(page: Page, folder: Path, name: str) -> str:
    """A full-page screenshot, and what a failure message should show of the page."""
    shot = folder / f"{name}.png"
    with suppress(Exception):
        await page.screenshot(shot, full_page=True)
    with suppress(Exception):
        return f"screenshot {shot}; batch {await batch_state(page)}; console {page.console[-20:]}"
    return f"screenshot {shot}"


async def submit_batch(page: Page, key: str, count: int, steps: int) -> str:
    """Types the key, loads the example with `steps` steps and a fresh seed, sets the count,
    submits; the batch ID."""
    await page.wait_for("document.body.dataset.config == 'loaded'", 30)
    await page.evaluate(set_field("api-key", key))
    await page.click_text("Load the example")
    graph = json.loads(await page.wait_for("document.getElementById('graph').value", 10))
    graph["3"]["inputs"]["steps"] = steps
    # A seed of its own: the simulator would answer a graph it ran before from its cache.
    graph["3"]["inputs"]["seed"] = uuid.uuid4().int % 2**32
    await page.evaluate(set_field("graph", json.dumps(graph)))
    await page.evaluate(set_field("count", str(count)))
    await page.click_text("Submit")
    found = await page.wait_for("location.hash.startsWith('#batch=') && location.hash", 60)
    return str(found).removeprefix("#batch=")


async def settle_batch(client: JobClient, batch_id: str) -> None:
    """A batch the test leaves running is cancelled and waited for: its worker stops next."""
    if not batch_id:
        return
    with suppress(Exception):
        if not (await client.batch_status(batch_id)).terminal:
            await client.cancel_batch(batch_id, "page test done")
        await asyncio.wait_for(client.wait_batch(batch_id, interval_s=0.5), timeout=90)


def posts(page: Page) -> list[dict[str, Any]]:
    return [r for r in page.requests if r["method"] == "POST"]


@needs_chromium
async def test_the_page_submits_a_batch_of_3_and_follows_it_to_completed(
    local_stack: RunningStack, tmp_path: Path
) -> None:
    key = secrets.token_urlsafe(32)
    port = free_port()
    async with running_worker(local_stack, "page-batch") as worker:
        env = cli_env(local_stack, worker.task_queue) | {"DURABLE_COMFY_API_KEYS": f"pb:{key}"}
        batch_id = ""
        try:
            async with (
                running_gateway(env, port, tmp_path / "gateway.log"),
                open_page(f"http://{HOST}:{port}/", free_port(), tmp_path / "profile") as page,
            ):
                await page.record_console()
                await page.record_requests()
                try:
                    batch_id = await submit_batch(page, key, count=3, steps=20)
                    await page.wait_for(BATCH_ENDED, 120)
                    ended = await batch_state(page)
                    shown = await evidence(page, tmp_path, "batch")
                    # A job of the list opens the page's view of that job, which links back.
                    second = f"{batch_id}-0002"
                    await page.evaluate(
                        f"document.querySelector('#batch-jobs li[data-job={json.dumps(second)}]"
                        " a').click()"
                    )
                    await page.wait_for(f"location.hash == {json.dumps(f'#job={second}')}", 10)
                    job_seen = await until_ended(page, 60)
                    opened = await batch_state(page)
                    back = await page.evaluate(
                        "document.getElementById('job-batch').hidden ? '' : "
                        "document.getElementById('job-batch-link').textContent"
                    )
                    await evidence(page, tmp_path, "job-of-batch")
                    await page.click_text(batch_id)  # the job's link back to its batch
                    await page.wait_for(BATCH_ENDED, 30)
                    again = await batch_state(page)
                except BaseException as failure:
                    failure.add_note(await evidence(page, tmp_path, "failure"))
                    failure.add_note(f"gateway log: {tmp_path}/gateway.log")
                    raise
            final = await worker.client.batch_status(batch_id)
        finally:
            await settle_batch(worker.client, batch_id)
    print(shown)
    assert final.state == BatchState.COMPLETED and final.counts == {"COMPLETED": 3}, final
    assert ended["shown"] and not ended["jobShown"], (ended, shown)
    assert ended["batch"] == batch_id and ended["hash"] == f"#batch={batch_id}", ended
    assert ended["state"] == "COMPLETED" and ended["counts"] == ["COMPLETED: 3"], (ended, shown)
    assert ended["bar"] == 100 and ended["progress"] == "3 of 3 jobs ended · 100 %", ended
    assert ended["artifacts"] == f"Artifacts: {final.artifacts}" and final.artifacts == 3, ended
    assert ended["cost"].startswith("Cost: "), ended
    assert not ended["cancel"] and not ended["errors"], ended
    ids = [f"{batch_id}-000{n}" for n in (1, 2, 3)]
    assert [j["id"] for j in ended["jobs"]] == ids, ended["jobs"]
    assert [j["state"] for j in ended["jobs"]] == ["COMPLETED"] * 3, ended["jobs"]
    assert [j["href"] for j in ended["jobs"]] == [f"#job={i}" for i in ids], ended["jobs"]
    # One POST, to /v1/batches: the single job's request (without `detached`, which is the
    # batch's) and the count, with an Idempotency-Key.
    [sent] = posts(page)
    assert sent["url"].endswith("/v1/batches"), sent
    body = json.loads(sent["postData"])
    assert set(body) == {"request", "count", "detached"}, body
    assert body["count"] == 3 and body["detached"] is True, body
    assert set(body["request"]) == {"graph"} and body["request"]["graph"]["3"], body
    assert len(header(sent, "Idempotency-Key")) >= 16, sent
    streams = [r for r in page.requests if r["url"].endswith(f"/v1/batches/{batch_id}/events")]
    assert streams, "the batch is followed over its event stream"
    # The job's own view: its image; the batch out of sight meanwhile, and linked back.
    job_final = job_seen[-1]
    assert job_final["job"] == second and job_final["state"] == "COMPLETED", job_final
    assert job_final["images"] and all(image["loaded"] for image in job_final["images"])
    assert not opened["shown"] and opened["jobShown"], opened
    assert back == batch_id, back
    assert again["batch"] == batch_id and again["state"] == "COMPLETED", again
    assert not [line for line in page.console if line.startswith("uncaught")], page.console


@needs_chromium
async def test_a_batch_cancelled_from_the_page_ends_cancelled(
    local_stack: RunningStack, tmp_path: Path
) -> None:
    key = secrets.token_urlsafe(32)
    port = free_port()
    # The batch's counts say a job runs (a job's own live state is not in its default view).
    running_job = (
        "[...document.querySelectorAll('#batch-counts li')]"
        ".some(li => li.textContent.startsWith('RUNNING'))"
    )
    async with running_worker(local_stack, "page-batch-cancel") as worker:
        env = cli_env(local_stack, worker.task_queue) | {"DURABLE_COMFY_API_KEYS": f"pc:{key}"}
        batch_id = ""
        try:
            async with (
                running_gateway(env, port, tmp_path / "gateway.log"),
                open_page(f"http://{HOST}:{port}/", free_port(), tmp_path / "profile") as page,
            ):
                await page.record_console()
                await page.record_requests()
                try:
                    # 60 s a job at the test stack's 20 ms a step: cancelled long before.
                    batch_id = await submit_batch(page, key, count=3, steps=3000)
                    await page.wait_for(running_job, 60)
                    running = await batch_state(page)
                    during = await worker.client.batch_status(batch_id)
                    await page.click_text("Cancel the batch")
                    await page.wait_for(BATCH_ENDED, 90)
                    ended = await batch_state(page)
                    shown = await evidence(page, tmp_path, "batch-cancelled")
                except BaseException as failure:
                    failure.add_note(await evidence(page, tmp_path, "failure"))
                    failure.add_note(f"gateway log: {tmp_path}/gateway.log")
                    raise
            final = await worker.client.batch_status(batch_id)
        finally:
            await settle_batch(worker.client, batch_id)
    print(shown)
    assert running["state"] == "RUNNING" and running["cancel"], running
    assert during.state == BatchState.RUNNING, "the cancel must land mid-batch"
    assert final.state == BatchState.CANCELLED and final.ended == 3, final
    assert ended["state"] == "CANCELLED" and ended["batch"] == batch_id, (ended, shown)
    shown_counts = sorted(f"{state}: {n}" for state, n in final.counts.items())
    assert ended["counts"] == shown_counts and "CANCELLED: 3" in shown_counts, (ended, final)
    assert [j["state"] for j in ended["jobs"]] == ["CANCELLED"] * 3, ended["jobs"]
    assert ended["cancelled"] == "Cancelled: cancelled from the browser page", ended
    assert not ended["cancel"] and not ended["errors"], ended
    cancels = [r for r in posts(page) if r["url"].endswith(f"/v1/batches/{batch_id}/cancel")]
    assert len(cancels) == 1, posts(page)
    assert not [line for line in page.console if line.startswith("uncaught")], page.console


@needs_chromium
async def test_the_batch_link_reloaded_or_opened_elsewhere_shows_the_same_batch(
    local_stack: RunningStack, tmp_path: Path
) -> None:
    key = secrets.token_urlsafe(32)
    port = free_port()
    url = f"http://{HOST}:{port}/"
    async with running_worker(local_stack, "page-batch-reload") as worker:
        env = cli_env(local_stack, worker.task_queue) | {"DURABLE_COMFY_API_KEYS": f"pr:{key}"}
        batch_id = ""
        try:
            async with running_gateway(env, port, tmp_path / "gateway.log"):
                async with open_page(url, free_port(), tmp_path / "profile") as page:
                    await page.record_console()
                    await page.record_requests()
                    try:
                        # About 6 s a job: reloaded while the batch still runs.
                        batch_id = await submit_batch(page, key, count=2, steps=300)
                        await page.wait_for(
                            "document.getElementById('batch-state').textContent != '—'", 30
                        )
                        before = await batch_state(page)
                        sent = len(page.requests)
                        # Marked, so that the old document cannot pass for the reloaded one.
                        await page.evaluate("window.beforeReload = true; location.reload()")
                        await page.wait_for(
                            "!window.beforeReload && document.body?.dataset.config == 'loaded'"
                            " && document.getElementById('batch-state').textContent != '—'",
                            30,
                        )
                        reloaded = await batch_state(page)
                        await page.wait_for(BATCH_ENDED, 120)
                        ended = await batch_state(page)
                        after_reload = page.requests[sent:]
                        await evidence(page, tmp_path, "batch-reloaded")
                    except BaseException as failure:
                        failure.add_note(await evidence(page, tmp_path, "failure"))
                        failure.add_note(f"gateway log: {tmp_path}/gateway.log")
                        raise
                # A second browser (no key yet) opens the batch's link.
                other = await reopen_batch(f"{url}#batch={batch_id}", key, tmp_path)
            final = await worker.client.batch_status(batch_id)
        finally:
            await settle_batch(worker.client, batch_id)
    assert final.state == BatchState.COMPLETED, final
    assert before["batch"] == batch_id and before["state"] == "RUNNING", before
    assert reloaded["shown"] and reloaded["batch"] == batch_id, reloaded
    assert reloaded["hash"] == f"#batch={batch_id}", reloaded
    # Reloaded, the page submits nothing: it follows the batch its address names.
    assert not [r for r in after_reload if r["method"] == "POST"], after_reload
    assert any(r["url"].endswith(f"/v1/batches/{batch_id}/events") for r in after_reload)
    assert ended["state"] == "COMPLETED" and ended["counts"] == ["COMPLETED: 2"], ended
    assert [j["id"] for j in ended["jobs"]] == [f"{batch_id}-0001", f"{batch_id}-0002"], ended
    assert other["batch"] == batch_id and other["state"] == "COMPLETED", other
    assert other["counts"] == ["COMPLETED: 2"] and len(other["jobs"]) == 2, other


async def reopen_batch(url: str, key: str, folder: Path) -> dict[str, Any]:
    async with open_page(url, free_port(), folder / "profile-2") as page:
        await page.record_console()
        try:
            await page.wait_for(
                "document.getElementById('batch-connection').dataset.connection == 'stopped'", 30
            )
            refused = await batch_state(page)
            assert "API key" in refused["connectionText"], refused
            await page.evaluate(set_field("api-key", key))
            await page.wait_for(BATCH_ENDED, 60)
            seen = await batch_state(page)
            await evidence(page, folder, "batch-reopened")
        except BaseException as failure:
            failure.add_note(await evidence(page, folder, "failure-reopened"))
            raise
        assert not [line for line in page.console if line.startswith("uncaught")], page.console
        return seen


# --- the page's own functions, with a stand-in fetch (no stack) ---------------------------

# Three clicks on Submit: a batch whose first answer is lost and second is "busy", then a count
# of 1 (a single job, as before), then a batch again.
BATCH_SUBMITS = """(async () => {
  const sent = [];
  const answers = [
    () => { throw new TypeError("Failed to fetch"); },
    () => new Response('{"error": {"type": "Overloaded", "message": "busy"}}',
                       {status: 503, headers: {"Retry-After": "0"}}),
    () => new Response('{"batch_id": "b1"}', {status: 201}),
    () => new Response('{"job_id": "j1"}', {status: 201}),
    () => new Response('{"batch_id": "b2"}', {status: 201}),
  ];
  const real = window.fetch;
  window.fetch = async (url, init) => {
    if (url !== "v1/batches" && url !== "v1/jobs") return real(url, init);
    sent.push({url, key: init.headers["Idempotency-Key"], body: JSON.parse(init.body)});
    return answers[sent.length - 1]();
  };
  RETRY.baseMs = 1;
  const count = (n) => {
    const field = document.getElementById("count");
    field.value = String(n);
    field.dispatchEvent(new Event("input"));
    return document.getElementById("stop-on-close").disabled;
  };
  document.getElementById("graph").value =
    '{"3": {"class_type": "KSampler", "inputs": {"seed": 5, "steps": 2}}}';
  document.getElementById("stop-on-close").checked = true;
  try {
    const hashes = [];
    const disabled = [count(3)];
    await submit();
    hashes.push(location.hash);
    disabled.push(count(1));
    await submit();
    hashes.push(location.hash);
    disabled.push(count(2));
    await submit();
    hashes.push(location.hash);
    document.getElementById("count").value = "";
    await submit();
    const refused = document.getElementById("submit-error").textContent;
    return JSON.stringify({sent, hashes, disabled, refused});
  } finally {
    window.fetch = real;
  }
})()"""


@needs_chromium
async def test_a_batch_submit_sent_again_carries_the_same_idempotency_key(tmp_path: Path) -> None:
    async with open_page((STATIC / "index.html").as_uri(), free_port(), tmp_path / "p") as page:
        await page.wait_for("document.body.dataset.config", 30)
        result = json.loads(await page.evaluate(BATCH_SUBMITS, await_promise=True))
    sent = result["sent"]
    assert [s["url"] for s in sent] == ["v1/batches"] * 3 + ["v1/jobs", "v1/batches"], sent
    keys = [s["key"] for s in sent]
    # The first click's POST sent three times (no answer, busy, created) with one key; each
    # later click has a key of its own.
    assert keys[0] == keys[1] == keys[2] and len(set(keys[2:])) == 3, keys
    assert all(len(key) >= 16 for key in keys), keys
    graph = {"3": {"class_type": "KSampler", "inputs": {"seed": 5, "steps": 2}}}
    # A batch: the job's request and the count, detached beside them (a batch runs to its end
    # whatever the page does: "stop when I close this page" is a single job's, and disabled).
    assert sent[0]["body"] == {"request": {"graph": graph}, "count": 3, "detached": True}
    assert sent[4]["body"] == {"request": {"graph": graph}, "count": 2, "detached": True}
    # A count of 1 is the single job as ever, attached as the checked box asks.
    assert sent[3]["body"] == {"graph": graph, "detached": False}, sent[3]
    assert result["hashes"] == ["#batch=b1", "#job=j1", "#batch=b2"], result
    assert result["disabled"] == [True, False, True], result
    assert result["refused"].startswith("Count: "), result


# A batch whose stream the gateway refuses (busy): polled until its end, the second poll with
# the first one's ETag; then nothing more is asked.
BATCH_POLLS = """(async () => {
  const sent = [];
  const job = (n, state, percent) => ({job_id: `b-000${n}`, state, percent, error: null,
                                       artifacts: state === null ? 0 : 1});
  const running = {batch_id: "b", state: "RUNNING", terminal: false, seq: 4, total: 2,
                   ended: 1, counts: {COMPLETED: 1, RUNNING: 1}, progress: 0.75,
                   cost: {gpu_s: 1.5, usd: 0.0012}, artifacts: 1, cancel_reason: null,
                   jobs: [job(1, "COMPLETED", null), job(2, "RUNNING", 50)]};
  const done = {...running, state: "COMPLETED", terminal: true, seq: 5, ended: 2,
                counts: {COMPLETED: 2}, progress: 1, artifacts: 2,
                jobs: [job(1, "COMPLETED", null), job(2, "COMPLETED", null)]};
  const lines = [];
  const shown = [];
  let polls = 0;
  const real = window.fetch;
  window.fetch = async (url, init) => {
    sent.push({url, ifNoneMatch: init.headers["If-None-Match"] || null});
    lines.push(document.getElementById("batch-connection").textContent);
    if (url.endsWith("/events")) {
      return new Response('{"error": {"type": "Overloaded", "message": "busy"}}',
                          {status: 503, headers: {"Retry-After": "0"}});
    }
    polls += 1;
    shown.push(document.getElementById("batch-progress-text").textContent);
    if (polls === 1) return new Response(JSON.stringify(running), {headers: {ETag: '"4.a"'}});
    if (polls === 2) return new Response(null, {status: 304});
    return new Response(JSON.stringify(done), {headers: {ETag: '"5.b"'}});
  };
  RETRY.baseMs = 1;
  try {
    startFollowingBatch("b");
    for (let i = 0; i < 200 && !batch.ended; i++) await sleep(10);
    const asked = sent.length;
    await sleep(200);
    return JSON.stringify({
      sent, asked, after: sent.length, lines, shown,
      state: document.getElementById("batch-state").textContent,
      counts: [...document.querySelectorAll("#batch-counts li")].map(li => li.textContent),
      bar: document.getElementById("batch-bar").value,
      cost: document.getElementById("batch-cost").textContent,
      connection: document.getElementById("batch-connection").dataset.connection,
    });
  } finally {
    window.fetch = real;
  }
})()"""


@needs_chromium
async def test_a_batch_whose_stream_is_refused_is_polled_to_its_end(tmp_path: Path) -> None:
    async with open_page((STATIC / "index.html").as_uri(), free_port(), tmp_path / "p") as page:
        await page.wait_for("document.body.dataset.config", 30)
        result = json.loads(await page.evaluate(BATCH_POLLS, await_promise=True))
    sent = result["sent"]
    assert [s["url"] for s in sent] == [
        "v1/batches/b/events",
        "v1/batches/b",
        "v1/batches/b/events",
        "v1/batches/b",
        "v1/batches/b/events",
        "v1/batches/b",
    ], sent
    assert [s["ifNoneMatch"] for s in sent[1::2]] == [None, '"4.a"', '"4.a"'], sent
    assert any("reconnecting… " in line and "polling the batch" in line for line in result["lines"])
    assert "1 of 2 jobs ended · 75 %" in result["shown"], result
    assert result["state"] == "COMPLETED" and result["counts"] == ["COMPLETED: 2"], result
    assert result["bar"] == 100 and result["connection"] == "ended", result
    assert result["cost"] == "Cost: 1.5 GPU-seconds billed (about $0.0012)", result
    # Ended: no more streams nor polls.
    assert result["after"] == result["asked"], result


HOSTILE = "<img src=x onerror=\"document.body.dataset.owned='yes'\">"


def batch_shown(status: dict[str, Any]) -> str:
    """JavaScript: the page's batch section after it rendered `status`, as a person reads it."""
    return (
        f"(renderNewBatch('b'), renderBatch({json.dumps(status)}),"
        " JSON.stringify({lines: [...document.querySelectorAll('#batch-section *')]"
        ".filter(e => !e.closest('[hidden]') && e.children.length == 0 && e.textContent.trim())"
        ".map(e => e.textContent.trim()),"
        " images: document.querySelectorAll('#batch-section img').length,"
        " cancel: !document.getElementById('batch-cancel').hidden}))"
    )


CANCELLING = {
    "batch_id": "b",
    "state": "CANCELLING",
    "terminal": False,
    "seq": 7,
    "total": 3,
    "ended": 1,
    "counts": {"FAILED": 1, "RUNNING": 1},
    "progress": 0.5,
    "cost": {"gpu_s": 0.0, "usd": None},
    "artifacts": 0,
    "cancel_reason": HOSTILE,
    "webhook": None,
    "jobs": [
        {
            "job_id": HOSTILE,
            "state": "FAILED",
            "percent": None,
            "error": {"type": "OutOfMemory", "message": HOSTILE},
            "artifacts": 0,
        },
        {"job_id": "b-0002", "state": "RUNNING", "percent": 40, "error": None, "artifacts": 0},
        {"job_id": "b-0003", "state": None, "percent": None, "error": None, "artifacts": 0},
    ],
}


@needs_chromium
async def test_the_page_shows_what_a_batch_status_says_as_text(tmp_path: Path) -> None:
    async with open_page((STATIC / "index.html").as_uri(), free_port(), tmp_path / "p") as page:
        await page.wait_for("document.body.dataset.config", 30)
        result = json.loads(await page.evaluate(batch_shown(CANCELLING)))
        owned = await page.evaluate("document.body.dataset.owned || ''")
    lines = result["lines"]
    assert "CANCELLING" in lines and "FAILED: 1" in lines and "RUNNING: 1" in lines, lines
    assert "1 of 3 jobs ended · 50 %" in lines, lines
    assert "Cost: 0 GPU-seconds billed" in lines and "Artifacts: 0" in lines, lines
    # Server text is text: a job ID, an error and a reason that look like HTML stay words.
    assert f"Cancelled: {HOSTILE}" in lines and HOSTILE in lines, lines
    assert f"— OutOfMemory: {HOSTILE}" in lines, lines
    assert "RUNNING · 40 %" in lines and "—" in lines, lines
    assert result["images"] == 0 and owned == "", (result, owned)
    # Cancelling already: nothing more to cancel.
    assert result["cancel"] is False, result


@pytest.mark.parametrize("hash_", ["#batch=b%2F1", "#job=j1"])
@needs_chromium
async def test_the_address_names_what_the_page_follows(tmp_path: Path, hash_: str) -> None:
    """`#batch=<id>` follows a batch, `#job=<id>` a job: one section shows, the other not."""
    url = (STATIC / "index.html").as_uri() + hash_
    async with open_page(url, free_port(), tmp_path / "p") as page:
        await page.wait_for("document.body.dataset.config", 30)
        state = await batch_state(page)
        job = await page_state(page)
        followed = await page.evaluate("JSON.stringify([job && job.id, batch && batch.id])")
    if hash_.startswith("#batch="):
        assert state["shown"] and not state["jobShown"] and state["batch"] == "b/1", state
        assert json.loads(followed) == [None, "b/1"], followed
    else:
        assert state["jobShown"] and not state["shown"] and job["job"] == "j1", (state, job)
        assert json.loads(followed) == ["j1", None], followed
