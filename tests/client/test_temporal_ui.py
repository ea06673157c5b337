"""The Temporal UI shows a running job's live progress (`make test-ui`).

Headless Chromium (Debian's `chromium` package; `make test-ui` installs it) loads the job's page
in the dev server's own UI, as an operator would, and the rendered page must show the job's
Current Details with the progress the workflow's own `status` query reports at that moment, not
"0 %". Current Details move on the follow activity's milestones (each tenth of the steps), like
the query; `JobClient.status` also lays the activity's heartbeat over it, so it runs ahead of
them and is not what the page is compared with. A screenshot is kept next to the test's
temporary files for a person to look at.

Skipped when no Chromium is installed, unless REQUIRE_CHROMIUM is set (as `make test-ui` does).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from devstack.models import RunningStack
from starter import JobClient, JobRequest, JobState, JobStatus
from tests.conftest import free_port
from tests.support.chromium import CHROMIUM, open_page
from tests.support.cli import EXAMPLE, running_worker
from workflows.shared import QUERY_STATUS

pytestmark = pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("REQUIRE_CHROMIUM"),
    reason="needs headless Chromium: make test-ui (apt-get install chromium)",
)


@pytest_asyncio.fixture(loop_scope="session")
async def ui_client(local_stack: RunningStack) -> AsyncIterator[JobClient]:
    async with running_worker(local_stack, "ui") as worker:
        yield worker.client


async def test_current_details_show_the_live_progress(
    ui_client: JobClient, local_stack: RunningStack, tmp_path: Path
) -> None:
    graph: dict[str, Any] = json.loads(EXAMPLE.read_text())
    graph["3"]["inputs"]["steps"] = 5000  # 100 s at the stack's 20 ms a step; 10 s a tenth
    graph["3"]["inputs"]["seed"] = uuid.uuid4().int % 2**32
    job = await ui_client.submit(JobRequest(graph=graph), detached=True)
    url = f"{local_stack.temporal_ui}/namespaces/{local_stack.namespace}/workflows/{job.job_id}"
    shown: list[int] = []

    async def queried() -> JobStatus:
        """What the workflow itself says (and shows as Current Details): no heartbeat."""
        status: JobStatus = await ui_client.handle(job.job_id).query(
            QUERY_STATUS, result_type=JobStatus
        )
        return status

    try:
        async with asyncio.timeout(60):
            while (await queried()).progress.fraction < 0.05:  # noqa: ASYNC110
                await asyncio.sleep(0.2)
        # Read before the page opens: the UI may fetch the details once, as the page loads, and
        # only reveal them on the click, so what it shows is at least this far and at most what
        # the query says after the text was read.
        before = await queried()
        async with open_page(url, free_port(), tmp_path / "profile") as page:
            async with asyncio.timeout(60):
                while not shown:
                    await page.click_text("User Metadata")
                    text = await page.text()
                    after = await queried()
                    # The Markdown renderer may turn "/" into a fraction slash: match loosely.
                    shown = [int(p) for p in re.findall(r"RUNNING\W+(\d+)\s*%", text)]
                    await asyncio.sleep(0.5)
            await page.screenshot(tmp_path / "temporal-ui.png")
    finally:
        await ui_client.cancel(job.job_id, "UI test done")
        # Its worker stops with this test: the teardown must have run before then.
        await asyncio.wait_for(ui_client.wait(job.job_id), timeout=60)
    print(f"screenshot: {tmp_path / 'temporal-ui.png'}")
    assert before.state == JobState.RUNNING
    low, high = int(before.progress.fraction * 100), int(after.progress.fraction * 100)
    assert any(low <= p <= high for p in shown), (shown, low, high, text[-800:])
    assert low >= 5, "Current Details must follow progress, not stay at 0 %"
    # The static summary the client set at start.
    assert "-node ComfyUI graph on" in text and "KSampler x1" in text, text[:1500]
    shot = (tmp_path / "temporal-ui.png").read_bytes()
    assert shot.startswith(b"\x89PNG") and len(shot) > 10_000
