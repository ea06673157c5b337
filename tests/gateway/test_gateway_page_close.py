"""The page's job outlives its closed tab, unless "Stop the job when I close this page" was
chosen (`make test-ui`).

Two headless Chromiums open the page of one gateway, each submits the example. The first leaves
the choice unchecked (detached: following is a view, not a lease); the second checks it
(attached: a closed page stops following, and a job nobody follows for its policy's
`abandon_after_s` is abandoned, its GPU work stopped). Both browsers are closed while their jobs
run (one after the other: the stack's ComfyUI runs one prompt at a time). The horizon is 300 s
by default, so "alive ten minutes after the tab closed" is two horizons; here each POST the page
sends is given a horizon of HORIZON_S (its body rewritten in the browser: the one thing the test
changes in the page), the attached job is ABANDONED within three horizons of its browser
closing, and the detached one is alive four horizons after its own closed.
"""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

from devstack.models import RunningStack
from starter import JobClient, JobState
from tests.conftest import HOST, free_port
from tests.gateway.test_gateway_page import (
    evidence,
    needs_chromium,
    running_gateway,
    set_field,
    settle,
    submit_example,
)
from tests.support.chromium import open_page
from tests.support.cli import cli_env, running_worker

HORIZON_S = 5.0
# 60 s at the test stack's 20 ms a step: the detached job still runs when it is looked at.
STEPS = 3000

# Every POST /v1/jobs the page sends carries the short horizon (the page itself sends none).
SHORT_HORIZON = (
    "(() => { const send = window.fetch; window.fetch = (url, init) => {"
    " if (String(url).endsWith('v1/jobs') && init && init.method === 'POST') {"
    "   const body = JSON.parse(init.body);"
    f"   body.policy = {{abandon_after_s: {HORIZON_S}}};"
    "   init = Object.assign({}, init, {body: JSON.stringify(body)}); }"
    " return send(url, init); }; })()"
)
STEP_SHOWN = "Number(document.getElementById('progress-text').dataset.step)"


async def submitted_then_closed(url: str, key: str, folder: Path, *, stop_on_close: bool) -> str:
    """A browser submits the example (the choice checked or not), follows it until a step
    shows, and is closed; the job ID."""
    async with open_page(url, free_port(), folder / "profile") as page:
        try:
            await page.wait_for("document.body.dataset.config", 30)
            await page.evaluate(SHORT_HORIZON)
            if stop_on_close:
                await page.evaluate(
                    "(box => { box.checked = true; box.dispatchEvent(new Event('change')); })"
                    "(document.getElementById('stop-on-close'))"
                )
            await page.evaluate(set_field("api-key", key))
            job_id = await submit_example(page, key, steps=STEPS)
            await page.wait_for(f"{STEP_SHOWN} > 0", 60)
        except BaseException as failure:
            failure.add_note(await evidence(page, folder, "failure"))
            raise
    return job_id


@needs_chromium
async def test_the_pages_job_outlives_its_tab_unless_asked_to_stop(
    local_stack: RunningStack, tmp_path: Path
) -> None:
    key = secrets.token_urlsafe(32)
    port = free_port()
    url = f"http://{HOST}:{port}/"
    async with running_worker(local_stack, "page-close") as worker:
        env = cli_env(local_stack, worker.task_queue) | {"DURABLE_COMFY_API_KEYS": f"page:{key}"}
        client: JobClient = worker.client
        kept = stopped = ""
        try:
            async with running_gateway(env, port, tmp_path / "gateway.log"):
                # One after the other: the stack's ComfyUI runs one prompt at a time.
                stopped = await submitted_then_closed(
                    url, key, tmp_path / "stopped", stop_on_close=True
                )
                ended = await asyncio.wait_for(client.wait(stopped), timeout=3 * HORIZON_S + 30)
                kept = await submitted_then_closed(url, key, tmp_path / "kept", stop_on_close=False)
                await asyncio.sleep(4 * HORIZON_S)
                alive = await client.status(kept)
        finally:
            await settle(client, kept)
            await settle(client, stopped)
    assert alive.detached and alive.state == JobState.RUNNING, alive.model_dump_json(indent=1)
    assert 0 < alive.progress.step < STEPS, alive.progress
    assert not ended.detached and ended.state == JobState.ABANDONED, ended.model_dump_json()
    assert ended.abandon_after_s == HORIZON_S, ended.abandon_after_s
    assert ended.teardown.state == "CONFIRMED", ended.teardown
