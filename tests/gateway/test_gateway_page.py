"""The gateway's browser page follows a job through a gateway `kill -9` to its image
(`make test-ui`).

Headless Chromium (Debian's `chromium`) opens the page of a gateway run as a user runs it
(`durable-comfy gateway`, a subprocess, so it can be killed), with an API key: the page loads
the example, submits it and shows the progress moving. The gateway is then `kill -9`ed mid-job:
the page must say "reconnecting…", and once a new gateway listens on the same port it must
follow the job again to COMPLETED and show the image from its presigned URL (an <img> that
loaded). A second browser (a profile of its own, no key yet) opened at `/#job=ID` shows the same
job, once given the key, without submitting anything. Screenshots of both pages are kept in the
test's temporary folder (printed, and named in every failure message).

Skipped when no Chromium is installed, unless REQUIRE_CHROMIUM is set (as `make test-ui` does).
The files test needs no browser: the page's files are served with their content types and
load nothing from another origin.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import secrets
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import pytest

from activities.comfyui.activities import upload_name
from devstack.models import RunningStack
from starter import JobClient, JobState
from tests.conftest import HOST, free_port
from tests.support.chromium import CHROMIUM, Page, open_page
from tests.support.cli import ROOT, cli_env, running_worker
from workflows.contracts import TERMINAL_STATES

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("REQUIRE_CHROMIUM"),
    reason="needs headless Chromium: make test-ui (apt-get install chromium)",
)

STATIC = ROOT / "gateway" / "static"
GATEWAY = Path(sys.executable).parent / "durable-comfy"
# 20 s at the test stack's 20 ms a step: time to kill a gateway, start another and reconnect
# while the job still runs, on a loaded machine too (on an idle one the page is live again on
# the new gateway about 3 s after the submit, near step 130).
STEPS = 1000

# What the test reads off the page: the elements app.js keeps up to date.
PAGE_STATE = """JSON.stringify({
  state: document.getElementById('state').textContent,
  step: Number(document.getElementById('progress-text').dataset.step || 0),
  progress: document.getElementById('progress-text').textContent,
  connection: document.getElementById('connection').dataset.connection,
  connectionText: document.getElementById('connection').textContent,
  job: document.getElementById('job-id').textContent,
  outputs: [...document.querySelectorAll('#outputs li')].map(li => li.textContent),
  images: [...document.querySelectorAll('#gallery img')].map(
    img => ({src: img.src, loaded: img.complete && img.naturalWidth > 0})),
  teardown: document.getElementById('teardown').textContent,
  errors: document.getElementById('job-error').textContent
    + document.getElementById('submit-error').textContent,
})"""


async def page_state(page: Page) -> dict[str, Any]:
    state: dict[str, Any] = json.loads(await page.evaluate(PAGE_STATE))
    return state


def set_field(element_id: str, value: str) -> str:
    """JavaScript that types `value` into a field, as a person would (the change event too)."""
    return (
        f"(f => {{ f.value = {json.dumps(value)}; f.dispatchEvent(new Event('change')); }})"
        f"(document.getElementById({json.dumps(element_id)}))"
    )


@asynccontextmanager
async def running_gateway(
    env: dict[str, str], port: int, log: Path, until: str = "/readyz"
) -> AsyncIterator[asyncio.subprocess.Process]:
    """`durable-comfy gateway` on 127.0.0.1:`port`, once `until` (/readyz: it reaches Temporal;
    /healthz: it serves) answers 200; killed by its PID on the way out if it still runs."""
    with log.open("ab") as out:
        process = await asyncio.create_subprocess_exec(
            str(GATEWAY), "gateway", "--host", HOST, "--port", str(port),
            env=env, cwd=ROOT, stdout=out, stderr=out,
        )  # fmt: skip
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=2.0) as http:
            for _ in range(300):
                assert process.returncode is None, f"the gateway exited: {tail(log)}"
                with suppress(httpx.HTTPError):
                    if (await http.get(f"http://{HOST}:{port}{until}")).status_code == 200:
                        break
                await asyncio.sleep(0.2)
            else:
                raise AssertionError(f"the gateway was never ready: {tail(log)}")
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


async def evidence(page: Page, folder: Path, name: str) -> str:
    """A full-page screenshot, and what a failure message should show of the page."""
    shot = folder / f"{name}.png"
    with suppress(Exception):
        await page.screenshot(shot, full_page=True)
    with suppress(Exception):
        return f"screenshot {shot}; page {await page_state(page)}; console {page.console[-20:]}"
    return f"screenshot {shot}"


async def submit_example(page: Page, key: str, steps: int = STEPS) -> str:
    """Types the key, loads the example with `steps` steps and a fresh seed, submits; the job
    ID."""
    await page.wait_for("document.body.dataset.config", 30)
    assert await page.evaluate("!document.getElementById('key-section').hidden"), (
        "the key field must show when the gateway has keys"
    )
    await page.evaluate(set_field("api-key", key))
    await page.click_text("Load the example")
    graph = json.loads(await page.wait_for("document.getElementById('graph').value", 10))
    assert graph["3"]["class_type"] == "KSampler", graph
    graph["3"]["inputs"]["steps"] = steps
    # A seed of its own: the simulator would answer a graph it ran before from its cache.
    graph["3"]["inputs"]["seed"] = uuid.uuid4().int % 2**32
    await page.evaluate(set_field("graph", json.dumps(graph)))
    await page.click_text("Submit")
    found = await page.wait_for("location.hash.startsWith('#job=') && location.hash", 30)
    return str(found).removeprefix("#job=")


async def until_ended(page: Page, timeout_s: float) -> list[dict[str, Any]]:
    """The page's states, sampled until its image loaded (or the job ended otherwise)."""
    seen: list[dict[str, Any]] = []
    async with asyncio.timeout(timeout_s):
        while True:
            seen.append(await page_state(page))
            last = seen[-1]
            if last["images"] and all(image["loaded"] for image in last["images"]):
                return seen
            if last["state"] not in ("COMPLETED", "—") and last["connection"] == "ended":
                return seen
            await asyncio.sleep(0.2)


@needs_chromium
async def test_the_page_follows_a_job_through_a_gateway_kill(
    local_stack: RunningStack, tmp_path: Path
) -> None:
    key = secrets.token_urlsafe(32)
    port = free_port()
    url = f"http://{HOST}:{port}/"
    async with running_worker(local_stack, "page") as worker:
        env = cli_env(local_stack, worker.task_queue) | {"DURABLE_COMFY_API_KEYS": f"page:{key}"}
        job_id = ""
        try:
            async with open_page(url, free_port(), tmp_path / "profile") as page:
                await page.record_console()
                await page.record_requests()
                try:
                    async with running_gateway(env, port, tmp_path / "gateway-1.log") as first:
                        job_id = await submit_example(page, key)
                        submits = [r for r in page.requests if r["method"] == "POST"]
                        # Progress moves on the page, pushed live.
                        moving = "Number(document.getElementById('progress-text').dataset.step)"
                        step = await page.wait_for(f"{moving} > 0 && {moving}", 60)
                        await page.wait_for(f"{moving} > {step}", 60)
                        assert (await page_state(page))["connection"] == "live"
                        os.kill(first.pid, signal.SIGKILL)
                        await first.wait()
                    await page.wait_for(
                        "document.getElementById('connection').dataset.connection == "
                        "'reconnecting'",
                        30,
                    )
                    down = await page_state(page)
                    assert "reconnecting…" in down["connectionText"], down
                    during = await worker.client.status(job_id)
                    assert not during.terminal, "the kill must land mid-job"
                    # Past the contact horizon (shortened: the policy's numbers are one object)
                    # the page says so, and that the job goes on without it.
                    await page.evaluate("RETRY.contactHorizonMs = 0")
                    await page.click_text("Retry now")  # the next try now, not after its wait
                    await page.wait_for(
                        "document.getElementById('connection').dataset.connection == 'lost'", 30
                    )
                    lost = await page_state(page)
                    await page.evaluate("RETRY.contactHorizonMs = 60000")
                    async with running_gateway(env, port, tmp_path / "gateway-2.log"):
                        before_restart = len(page.requests)
                        await page.click_text("Retry now")  # the slow retry, woken
                        seen = await until_ended(page, 120)
                        resumed = page.requests[before_restart:]
                        shown = await evidence(page, tmp_path, "page")
                        # A second browser, no key yet, opens the job's link.
                        second = await reopen(f"{url}#job={job_id}", key, tmp_path)
                except BaseException as failure:
                    failure.add_note(await evidence(page, tmp_path, "failure"))
                    failure.add_note(f"gateway logs: {tmp_path}/gateway-*.log")
                    raise
            ended = await worker.client.status(job_id)
        finally:
            await settle(worker.client, job_id)
    print(shown)
    final = seen[-1]
    assert ended.state == JobState.COMPLETED, ended.error
    assert final["job"] == job_id and final["state"] == "COMPLETED", (final, shown)
    assert final["progress"].startswith(f"{STEPS} / {STEPS} steps"), (final, shown)
    # Sampled from the new gateway's start: the page went back to the live stream while the
    # job ran (reconnected with Last-Event-ID), not only polled it to its end.
    assert any(s["connection"] == "live" and s["state"] == "RUNNING" for s in seen), shown
    streams = [r for r in resumed if r["url"].endswith(f"/v1/jobs/{job_id}/events")]
    assert streams and all(header(r, "Last-Event-ID") for r in streams), streams
    # One POST: detached (the job outlives the tab), with its Idempotency-Key.
    assert [json.loads(r["postData"])["detached"] for r in submits] == [True], submits
    assert all(len(header(r, "Idempotency-Key")) >= 16 for r in submits), submits
    assert "contact lost" in lost["connectionText"], lost
    assert "goes on server-side" in lost["connectionText"], lost
    # Its image, from the job's own artifact's presigned URL, loaded.
    keys = [artifact.key for artifact in ended.artifacts]
    assert final["images"] and all(image["loaded"] for image in final["images"]), shown
    assert [any(k in image["src"] for k in keys) for image in final["images"]] == [True], keys
    assert len(final["outputs"]) == len(keys), (final["outputs"], keys)
    assert final["teardown"].startswith("Teardown: CONFIRMED"), (final, shown)
    assert not [line for line in page.console if line.startswith("uncaught")], page.console
    assert second["job"] == job_id and second["state"] == "COMPLETED", second
    assert second["images"] and all(image["loaded"] for image in second["images"]), second


# A graph that loads the file the page uploads, by its name.
UPLOAD_GRAPH = {
    "1": {"class_type": "LoadImage", "inputs": {"image": "photo.png"}},
    "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
    "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "page"}},
}
UPLOAD_ROWS = "[...document.querySelectorAll('#uploads li')].map(li => li.textContent)"


async def pick_files(page: Page, element_id: str, *paths: Path) -> None:
    """Choose files in a file input, as a person would in the browser's file dialog."""
    root = await page.call("DOM.getDocument")
    found = await page.call(
        "DOM.querySelector", nodeId=root["root"]["nodeId"], selector=f"#{element_id}"
    )
    await page.call("DOM.setFileInputFiles", nodeId=found["nodeId"], files=[str(p) for p in paths])


@needs_chromium
async def test_the_page_uploads_an_input_file_that_the_job_loads(
    local_stack: RunningStack, tmp_path: Path
) -> None:
    """A file picked in "Input files" is hashed, presigned, PUT to the bucket, and named as an
    `s3` input of the job, whose LoadImage gets its very bytes."""
    key = secrets.token_urlsafe(32)
    port = free_port()
    photo = tmp_path / "photo.png"
    data = b"\x89PNG\r\n\x1a\n" + os.urandom(200_000)
    photo.write_bytes(data)
    notes = tmp_path / "notes.txt"
    notes.write_text("not an image")
    async with running_worker(local_stack, "page-upload") as worker:
        env = cli_env(local_stack, worker.task_queue) | {"DURABLE_COMFY_API_KEYS": f"up:{key}"}
        job_id = ""
        try:
            async with (
                running_gateway(env, port, tmp_path / "gateway.log"),
                open_page(f"http://{HOST}:{port}/", free_port(), tmp_path / "profile") as page,
            ):
                await page.record_console()
                await page.record_requests()
                try:
                    await page.wait_for("document.body.dataset.config == 'loaded'", 30)
                    await page.evaluate(set_field("api-key", key))
                    await page.evaluate(set_field("graph", json.dumps(UPLOAD_GRAPH)))
                    # A file of a type ComfyUI does not load is refused before it is read.
                    await pick_files(page, "files", notes)
                    await page.click_text("Submit")
                    refused = await page.wait_for(
                        "document.getElementById('submit-error').textContent", 10
                    )
                    await pick_files(page, "files", photo)
                    await page.click_text("Submit")
                    found = await page.wait_for(
                        "location.hash.startsWith('#job=') && location.hash", 60
                    )
                    job_id = str(found).removeprefix("#job=")
                    seen = await until_ended(page, 60)
                    rows = json.loads(await page.evaluate(f"JSON.stringify({UPLOAD_ROWS})"))
                    shown = await evidence(page, tmp_path, "page-upload")
                except BaseException as failure:
                    failure.add_note(await evidence(page, tmp_path, "failure-upload"))
                    failure.add_note(f"gateway log: {tmp_path}/gateway.log")
                    raise
            ended = await worker.client.status(job_id)
            async with httpx.AsyncClient(trust_env=False) as http:
                received = await http.get(
                    f"{local_stack.comfyui_url}/view",
                    params={"filename": upload_name(job_id, "photo.png"), "type": "input"},
                )
        finally:
            await settle(worker.client, job_id)
    print(shown)
    assert ended.state == JobState.COMPLETED, ended.error
    assert seen[-1]["state"] == "COMPLETED", (seen[-1], shown)
    assert refused.startswith("notes.txt: not an input file this gateway takes"), refused
    assert ".png" in refused, refused
    assert rows == [f"photo.png: uploaded ✓ ({len(data)} bytes)"], (rows, shown)
    presigns = [r for r in page.requests if r["url"].endswith("/v1/uploads")]
    puts = [r for r in page.requests if r["method"] == "PUT"]
    [job_post] = [r for r in page.requests if r["url"].endswith("/v1/jobs")]
    assert [json.loads(r["postData"])["filename"] for r in presigns] == ["photo.png"], presigns
    assert [r["url"].split("?")[0] for r in puts] == [
        f"{local_stack.s3_endpoint}/{local_stack.bucket}/_staged/up/"
        f"{hashlib.sha256(data).hexdigest()}/photo.png"
    ], puts
    inputs = json.loads(job_post["postData"])["inputs"]
    assert inputs == {
        "photo.png": {
            "kind": "s3",
            "uri": puts[0]["url"].split("?")[0].replace(f"{local_stack.s3_endpoint}/", "s3://"),
        }
    }, inputs
    assert received.status_code == 200 and received.content == data, "ComfyUI got other bytes"
    assert not [line for line in page.console if line.startswith("uncaught")], page.console


def header(request: dict[str, Any], name: str) -> str:
    found = [v for k, v in request["headers"].items() if k.lower() == name.lower()]
    return str(found[0]) if found else ""


async def reopen(url: str, key: str, folder: Path) -> dict[str, Any]:
    async with open_page(url, free_port(), folder / "profile-2") as page:
        await page.record_console()
        try:
            await page.wait_for(
                "document.getElementById('connection').dataset.connection == 'stopped'", 30
            )
            refused = await page_state(page)
            assert "API key" in refused["connectionText"], refused
            await page.evaluate(set_field("api-key", key))
            seen = await until_ended(page, 60)
            await evidence(page, folder, "page-reopened")
        except BaseException as failure:
            failure.add_note(await evidence(page, folder, "failure-reopened"))
            raise
        assert not [line for line in page.console if line.startswith("uncaught")], page.console
        return seen[-1]


async def settle(client: JobClient, job_id: str) -> None:
    """A job the test leaves running is cancelled and waited for: its worker stops next."""
    if not job_id:
        return
    with suppress(Exception):
        if not (await client.status(job_id)).terminal:
            await client.cancel(job_id, "page test done")
        await asyncio.wait_for(client.wait(job_id), timeout=60)


BACKOFF_SAMPLES = """JSON.stringify({retry: RETRY, waits: [0, 1, 2, 3, 4, 5, 8, 30].map(
  n => ({n, ms: Array.from({length: 2000}, () => backoffMs(n, RETRY.ceilingMs))}))})"""


@needs_chromium
async def test_the_reconnect_waits_are_full_jitter_under_the_ceiling(tmp_path: Path) -> None:
    """random(0, min(ceiling, base·2^n)): spread over the whole range, never past it."""
    async with open_page((STATIC / "index.html").as_uri(), free_port(), tmp_path / "p") as page:
        await page.wait_for("document.body.dataset.config", 30)  # no gateway: "missing"
        sampled = json.loads(await page.evaluate(BACKOFF_SAMPLES))
    retry = sampled["retry"]
    assert retry["baseMs"] < retry["ceilingMs"] < retry["contactHorizonMs"], retry
    for wait in sampled["waits"]:
        bound = min(retry["ceilingMs"], retry["baseMs"] * 2 ** wait["n"])
        ms = wait["ms"]
        assert 0 <= min(ms) and max(ms) <= bound, (wait["n"], bound, min(ms), max(ms))
        # Full jitter, not "equal" jitter (bound/2 + random) nor a fixed wait: 2,000 uniform
        # draws reach both tenths of the range and average near its middle.
        assert min(ms) < 0.1 * bound and max(ms) > 0.9 * bound, (wait["n"], min(ms), max(ms))
        assert 0.4 * bound < sum(ms) / len(ms) < 0.6 * bound, (wait["n"], sum(ms) / len(ms))
    assert max(sampled["waits"][-1]["ms"]) <= retry["ceilingMs"]


def shown(status: dict[str, Any]) -> str:
    """JavaScript: the page's job section after it rendered `status`, as a person reads it."""
    return (
        f"(renderNewJob('j1'), renderStatus({json.dumps(status)}),"
        " JSON.stringify([...document.querySelectorAll('#job-section *')]"
        ".filter(e => !e.closest('[hidden]') && e.children.length == 0 && e.textContent.trim())"
        ".map(e => e.textContent.trim())))"
    )


# Every status the gateway serves says whether it is terminal (a computed field of JobStatus).
WAITING = {
    "state": "WAITING",
    "terminal": False,
    "seq": 3,
    "progress": {"queue_position": 2, "fraction": 0},
}
DECIDING = {
    "state": "NEEDS_DECISION",
    "terminal": False,
    "seq": 9,
    "progress": {"step": 4, "total_steps": 20, "fraction": 0.2, "unit": "steps"},
    "decision": {
        "reason": "the backend lost prompt p1 again",
        "options": {"resume --resubmit": "submit it once more", "cancel": "end the job"},
        "reattach_possible": False,
    },
}
FAILED = {
    "state": "FAILED",
    "terminal": True,
    "seq": 12,
    "progress": {"step": 4, "total_steps": 20, "fraction": 0.2, "unit": "steps"},
    "error": {"type": "OutOfMemory", "message": "CUDA out of memory at node 3"},
    "teardown": {"state": "CONFIRMED", "detail": "freed memory"},
    "webhook": {"url": "https://hooks.example/x", "delivered": 2, "failed": 1, "pending": 0},
}
INVALID = {
    "error": {
        "type": "InvalidGraph",
        "message": "the graph does not validate",
        "problems": [{"loc": ["graph", "3", "inputs", "seed"], "message": "must be >= 0"}],
    }
}


@needs_chromium
async def test_the_page_shows_what_the_status_says(tmp_path: Path) -> None:
    """Queue position, a decision and its ways out, an error, the teardown and the webhook's
    deliveries; a refused request names the field and node."""
    async with open_page((STATIC / "index.html").as_uri(), free_port(), tmp_path / "p") as page:
        await page.wait_for("document.body.dataset.config", 30)
        waiting = json.loads(await page.evaluate(shown(WAITING)))
        deciding = json.loads(await page.evaluate(shown(DECIDING)))
        buttons = await page.evaluate(
            "JSON.stringify(['resume', 'resubmit', 'cancel'].map(id => "
            "!document.getElementById(id).hidden))"
        )
        failed = json.loads(await page.evaluate(shown(FAILED)))
        refused = await page.evaluate(
            f"errorText(new Response({json.dumps(json.dumps(INVALID))}, {{status: 422}}))",
            await_promise=True,
        )
    assert "WAITING" in waiting and "(queue position 2; 1 is next)" in waiting, waiting
    assert "the backend lost prompt p1 again" in deciding, deciding
    assert "resume --resubmit: submit it once more" in deciding, deciding
    assert "4 / 20 steps · 20 %" in deciding, deciding
    # No re-attach possible: only "submit it again" and cancel are offered.
    assert json.loads(buttons) == [False, True, True], buttons
    assert "OutOfMemory: CUDA out of memory at node 3" in failed, failed
    assert "Teardown: CONFIRMED — freed memory" in failed, failed
    assert any(line.startswith("Webhook") and "1 failed" in line for line in failed), failed
    assert not any("Resume" in line or "Cancel" in line for line in failed), failed
    assert refused == "InvalidGraph:\n  graph.3.inputs.seed: must be >= 0", refused


# A job in our queue for a bounded pool, and one that waited past its start_by_s.
ADMISSION: dict[str, Any] = {
    "pool": "gpu",
    "granted": False,
    "position": 12,
    "ahead": 11,
    "waiting": 40,
    "priority": 3,
    "eta_s": 180.0,
}
PENDING = {
    "state": "PENDING",
    "terminal": False,
    "seq": 2,
    "progress": {"fraction": 0},
    "admission": ADMISSION,
}
EXPIRED = {
    "state": "EXPIRED",
    "terminal": True,
    "seq": 5,
    "progress": {"fraction": 0},
    "error": {"type": "Expired", "message": "not started by start_by_s (2 s)"},
    "teardown": {"state": "SKIPPED", "detail": "nothing was sent"},
    "admission": ADMISSION,
}
# The state line after each status in `shown` (a list), then whether following a job stops
# at `EXPIRED`: `(shown, expired) => JSON`.
QUEUE_LINES = """((shown, pending, expired) => {
  const line = (status) => (renderNewJob("j1"), renderStatus(status),
    document.getElementById("state").parentElement.textContent.replace(/\\s+/g, " ").trim());
  const lines = shown.map(line);
  const run = {id: "j1", status: null, outputs: new Map(), abort: new AbortController(),
               ended: false};
  renderNewJob("j1");
  applyStatus(run, pending);
  const afterPending = run.ended;
  applyStatus(run, expired);
  return JSON.stringify({lines, afterPending, ended: run.ended,
    cancel: !document.getElementById("cancel").hidden,
    connection: document.getElementById("connection").dataset.connection});
})"""


@needs_chromium
async def test_the_page_shows_a_pending_jobs_place_and_ends_on_expired(tmp_path: Path) -> None:
    first = {**PENDING, "admission": {**ADMISSION, "position": 1, "ahead": 0}}
    no_eta = {**PENDING, "admission": {**ADMISSION, "position": 2, "eta_s": None}}
    shown = json.dumps([PENDING, first, no_eta, EXPIRED])
    script = f"{QUEUE_LINES}({shown}, {json.dumps(PENDING)}, {json.dumps(EXPIRED)})"
    async with open_page((STATIC / "index.html").as_uri(), free_port(), tmp_path / "p") as page:
        await page.wait_for("document.body.dataset.config", 30)
        result = json.loads(await page.evaluate(script))
    assert result["lines"] == [
        "State: PENDING — 12th of 40 for pool gpu, about 3 min",
        "State: PENDING — 1st of 40 for pool gpu, about 3 min",
        "State: PENDING — 2nd of 40 for pool gpu",
        # Ended: the place it had is not shown any more.
        "State: EXPIRED",
    ], result
    # PENDING follows on; EXPIRED ends the following, and there is nothing left to cancel.
    assert result["afterPending"] is False and result["ended"] is True, result
    assert result["cancel"] is False and result["connection"] == "ended", result


# Two clicks on Submit against a gateway whose first answer is lost and second is "busy".
TWO_SUBMITS = """(async () => {
  const sent = [];
  const answers = [
    () => { throw new TypeError("Failed to fetch"); },
    () => new Response('{"error": {"type": "Overloaded", "message": "busy"}}',
                       {status: 503, headers: {"Retry-After": "0"}}),
    () => new Response('{"job_id": "j1"}', {status: 201}),
    () => new Response('{"job_id": "j2"}', {status: 201}),
  ];
  const real = window.fetch;
  window.fetch = async (url, init) => {
    if (url !== "v1/jobs") return real(url, init);
    sent.push({key: init.headers["Idempotency-Key"], body: JSON.parse(init.body)});
    return answers[sent.length - 1]();
  };
  RETRY.baseMs = 1;
  document.getElementById("graph").value = '{"1": {"class_type": "X", "inputs": {}}}';
  try {
    await submit();
    const first = location.hash;
    document.getElementById("stop-on-close").checked = true;
    await submit();
    return JSON.stringify({sent, first, second: location.hash});
  } finally {
    window.fetch = real;
  }
})()"""


@needs_chromium
async def test_a_submit_sent_again_carries_the_same_idempotency_key(tmp_path: Path) -> None:
    async with open_page((STATIC / "index.html").as_uri(), free_port(), tmp_path / "p") as page:
        await page.wait_for("document.body.dataset.config", 30)
        result = json.loads(await page.evaluate(TWO_SUBMITS, await_promise=True))
    keys = [sent["key"] for sent in result["sent"]]
    # The first click's POST sent three times (no answer, busy, created) with one key; the
    # second click is another job, with a key of its own.
    assert len(keys) == 4 and keys[0] == keys[1] == keys[2] != keys[3], keys
    assert all(len(key) >= 16 for key in keys), keys
    # Detached by default (following is a view, not a lease); attached when the page was asked
    # to stop the job once it closes.
    assert [sent["body"]["detached"] for sent in result["sent"]] == [True, True, True, False]
    assert (result["first"], result["second"]) == ("#job=j1", "#job=j2"), result


# Two polls of a job while its stream is down: the second asks with the first one's ETag.
TWO_POLLS = """(async () => {
  const sent = [];
  const running = {job_id: "j", state: "RUNNING", seq: 4,
                   progress: {step: 3, total_steps: 10, fraction: 0.3, unit: "steps"}};
  const real = window.fetch;
  window.fetch = async (url, init) => {
    sent.push({url, ifNoneMatch: init.headers["If-None-Match"] || null});
    return sent.length === 1
      ? new Response(JSON.stringify(running), {status: 200, headers: {ETag: '"4.3"'}})
      : new Response(null, {status: 304});
  };
  const run = {id: "j", etag: null, status: null, outputs: new Map(), abort: new AbortController()};
  renderNewJob("j");
  let answers = 0;
  try {
    await pollStatus(run, () => answers++);
    await pollStatus(run, () => answers++);
  } finally {
    window.fetch = real;
  }
  return JSON.stringify({sent, answers, state: document.getElementById("state").textContent,
                         progress: document.getElementById("progress-text").textContent});
})()"""


@needs_chromium
async def test_a_poll_asks_with_the_last_etag(tmp_path: Path) -> None:
    async with open_page((STATIC / "index.html").as_uri(), free_port(), tmp_path / "p") as page:
        await page.wait_for("document.body.dataset.config", 30)
        result = json.loads(await page.evaluate(TWO_POLLS, await_promise=True))
    assert result["sent"] == [
        {"url": "v1/jobs/j", "ifNoneMatch": None},
        {"url": "v1/jobs/j", "ifNoneMatch": '"4.3"'},
    ], result
    # Both answers count as contact; the 304 leaves the page as the 200 drew it.
    assert result["answers"] == 2, result
    assert (result["state"], result["progress"]) == ("RUNNING", "3 / 10 steps · 30 %"), result


# --- the files, without a browser --------------------------------------------------------

PAGE_FILES = {
    "/": ("index.html", "text/html"),
    "/index.html": ("index.html", "text/html"),
    "/app.js": ("app.js", "javascript"),
    "/style.css": ("style.css", "text/css"),
}


def test_the_page_loads_nothing_from_another_origin() -> None:
    for name in ("index.html", "app.js", "style.css"):
        text = (STATIC / name).read_text()
        assert not re.search(r"https?://", text, re.IGNORECASE), name
        # Protocol-relative references (//cdn...) and @import reach other origins too.
        assert not re.search(r"""(src|href)\s*=\s*["']?//|url\(\s*["']?//|@import""", text), name
        # Every request the page makes is relative, so it works under a proxy's base path.
        assert not re.search(r"""fetch\(\s*[`"']/""", text), name


def test_the_page_spells_no_end_state_of_its_own() -> None:
    """The page learns the terminal states from `GET /v1/config` (workflows.contracts.ENDINGS
    defines them): a list of its own would drift from the workers'."""
    text = (STATIC / "app.js").read_text()
    assert [s.value for s in TERMINAL_STATES if f'"{s.value}"' in text] == []


async def test_the_page_files_are_served(local_stack: RunningStack, tmp_path: Path) -> None:
    port = free_port()
    env = cli_env(local_stack, f"page-files-{uuid.uuid4().hex[:8]}")
    async with (
        running_gateway(env, port, tmp_path / "gateway.log"),
        httpx.AsyncClient(base_url=f"http://{HOST}:{port}", trust_env=False) as http,
    ):
        for path, (name, content_type) in PAGE_FILES.items():
            response = await http.get(path)
            assert response.status_code == 200, (path, response.status_code)
            assert content_type in response.headers["content-type"], (path, response.headers)
            assert response.text == (STATIC / name).read_text(), path
        config = (await http.get("/v1/config")).json()
        assert config["auth_required"] is False, config  # no keys: an open gateway on loopback
        assert config["example_graph"]["3"]["class_type"] == "KSampler", config
        assert config["terminal_states"] == sorted(s.value for s in TERMINAL_STATES), config
