"""The worker's watchdog (endpoint/watchdog.py), run as the image runs it: its own process, the
endpoint venv's python, against a fake ComfyUI (an aiohttp app that answers /queue and records
/interrupt) with `sleep` processes standing in for the worker's main process (`--pid`) and for
ComfyUI's (`COMFY_PID`). And endpoint/start.sh, which starts it beside the handler.

The promise: once the fence file says the claim is held and `fence_by` (plus a grace) has
passed, not before, the watchdog interrupts the prompt, kills ComfyUI if the prompt will not
leave its queue, and kills the worker's main process, all within the bound its docstring gives;
with no claim held it does nothing, and it exits once the process it watches is gone.

And the salvage (endpoint/salvage.py), against a real S3 (SeaweedFS): a prompt that finished
while the handler was frozen (our handler itself, SIGSTOPped, on the ComfyUI simulator) has its
outputs stored at the handler's keys and recorded in the claim with a fence; a claim taken over
meanwhile, or a salvage not done by its deadline, leaves the claim as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
from aiohttp import web

from endpoint.claims import ClaimStore, fresh_claim
from endpoint.fence_file import ClaimPlace, FenceState, read_fence
from endpoint.s3 import S3
from endpoint.salvage import SALVAGE_MARGIN_S, Salvage
from endpoint.takeover import what_is_left
from endpoint.watchdog import GRACE_S, POLL_S, STOP_WAIT_S
from protocol.keys import artifact_key
from protocol.runpod.contract import Claim, OutputFile, PromptEnd, S3Target, claim_key
from tests.support.aiohttp_servers import served
from tests.support.comfy_sim import REPO_ROOT, ksampler_graph
from tests.support.endpoint import (
    Bucket,
    bucket_env,
    orchestrated_input,
    read_claim,
    sha256,
    sim_get,
    take_over,
    until,
)

EP_PYTHON = REPO_ROOT / ".venv-endpoint" / "bin" / "python"
WATCHDOG = REPO_ROOT / "endpoint" / "watchdog.py"
START = REPO_ROOT / "endpoint" / "start.sh"

pytestmark = pytest.mark.skipif(
    not EP_PYTHON.exists(), reason="no .venv-endpoint: `make install` builds it"
)


@dataclass
class FakeComfy:
    """Runs one prompt; an interrupt ends it unless `stubborn`. `history`: its history entry
    (none by default); `files`: what `/view` serves, by (subfolder, filename); `on_view`
    runs before each `/view` answers."""

    prompt_id: str
    stubborn: bool = False
    running: bool = True
    interrupts: list[tuple[float, Any]] = field(default_factory=list)
    deletes: list[Any] = field(default_factory=list)
    history: dict[str, Any] | None = None
    files: dict[tuple[str, str], bytes] = field(default_factory=dict)
    on_view: Callable[[], Awaitable[None]] | None = None
    views: list[tuple[str, str, str]] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/queue", self.queue)
        app.router.add_post("/queue", self.delete)
        app.router.add_post("/interrupt", self.interrupt)
        app.router.add_get("/history/{prompt_id}", self.history_of)
        app.router.add_get("/view", self.view)
        return app

    async def history_of(self, request: web.Request) -> web.Response:
        found = request.match_info["prompt_id"] == self.prompt_id and self.history is not None
        return web.json_response({self.prompt_id: self.history} if found else {})

    async def view(self, request: web.Request) -> web.Response:
        q = request.query
        self.views.append((q.get("subfolder", ""), q["filename"], q.get("type", "output")))
        if self.on_view is not None:
            await self.on_view()
        body = self.files.get((q.get("subfolder", ""), q["filename"]))
        if body is None:
            return web.Response(status=404)
        return web.Response(body=body, content_type="image/png")

    async def queue(self, _request: web.Request) -> web.Response:
        running = [[0, self.prompt_id, {}, {}, []]] if self.running else []
        return web.json_response({"queue_running": running, "queue_pending": []})

    async def interrupt(self, request: web.Request) -> web.Response:
        self.interrupts.append((time.monotonic(), (await request.json()).get("prompt_id")))
        if not self.stubborn:
            self.running = False
        return web.Response()

    async def delete(self, request: web.Request) -> web.Response:
        self.deletes.append((await request.json()).get("delete"))
        return web.Response()


@dataclass
class Process:
    """A child process and when it ended (time.monotonic())."""

    proc: asyncio.subprocess.Process
    ended: asyncio.Task[float]

    @classmethod
    async def start(cls, *argv: str, **kwargs: Any) -> Process:
        proc = await asyncio.create_subprocess_exec(*argv, **kwargs)

        async def ended() -> float:
            await proc.wait()
            return time.monotonic()

        return cls(proc, asyncio.create_task(ended()))

    @property
    def alive(self) -> bool:
        return not self.ended.done()

    async def stop(self) -> None:
        if self.alive:
            self.proc.kill()
        await self.ended


@dataclass
class Run:
    comfy: FakeComfy
    worker: Process
    comfy_process: Process
    watchdog: Process
    fence_file: Path

    async def logs(self) -> list[dict[str, Any]]:
        await asyncio.wait_for(asyncio.shield(self.watchdog.ended), timeout=15)
        assert self.watchdog.proc.stdout is not None
        text = (await self.watchdog.proc.stdout.read()).decode()
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def write_fence(path: Path, state: FenceState) -> None:
    path.write_text(state.model_dump_json(exclude_none=True))


@pytest.fixture
def fence_file(tmp_path: Path) -> Path:
    return tmp_path / "fence.json"


def clean_env() -> dict[str, str]:
    """This process's environment without what would steer the endpoint venv's python, or
    give the watchdog a bucket the test did not."""
    dropped = ("PYTHONPATH", "PYTHONHOME")
    return {k: v for k, v in os.environ.items() if k not in dropped and "BUCKET_" not in k}


@contextlib.asynccontextmanager
async def running(
    fence_file: Path,
    *,
    stubborn: bool = False,
    comfy: FakeComfy | None = None,
    env: dict[str, str] | None = None,
) -> AsyncIterator[Run]:
    """The fake ComfyUI, two `sleep`s (the worker, ComfyUI) and the watchdog; all ended after."""
    comfy = comfy or FakeComfy(str(uuid.uuid4()), stubborn=stubborn)
    async with served(comfy.app()) as port:
        worker = await Process.start("sleep", "120")
        comfy_process = await Process.start("sleep", "120")
        env = clean_env() | (env or {})
        env |= {
            "COMFY_URL": f"http://127.0.0.1:{port}",
            "COMFY_PID": str(comfy_process.proc.pid),
            "DURABLE_COMFY_FENCE_FILE": str(fence_file),
        }
        watchdog = await Process.start(
            str(EP_PYTHON),
            str(WATCHDOG),
            "--pid",
            str(worker.proc.pid),
            env=env,
            cwd="/",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield Run(comfy, worker, comfy_process, watchdog, fence_file)
        finally:
            for process in (watchdog, worker, comfy_process):
                await process.stop()


def holding(comfy: FakeComfy, pid: int, fence_by: float, fence_after_s: float) -> FenceState:
    return FenceState(
        holding=True,
        pid=pid,
        submission="sub-12345678",
        prompt_id=comfy.prompt_id,
        lease_s=60.0,
        fence_after_s=fence_after_s,
        fence_by=fence_by,
    )


async def test_past_fence_by_the_prompt_is_interrupted_then_the_worker_killed(
    fence_file: Path,
) -> None:
    async with running(fence_file) as run:
        fence_by = time.time() + 1.5
        write_fence(fence_file, holding(run.comfy, run.worker.proc.pid, fence_by, 30.0))
        # Not before fence_by and the grace (the handler's own fence goes first).
        await asyncio.sleep(fence_by + GRACE_S - 0.3 - time.time())
        assert run.worker.alive and run.comfy.interrupts == []
        acted_by = time.monotonic() + 0.3 + POLL_S + STOP_WAIT_S + 1.0
        died = await asyncio.wait_for(asyncio.shield(run.worker.ended), timeout=15)
        assert died <= acted_by
        assert run.comfy.interrupts and run.comfy.interrupts[0][0] < died
        assert {prompt for _, prompt in run.comfy.interrupts} == {run.comfy.prompt_id}
        assert run.comfy.deletes[0] == [run.comfy.prompt_id]
        # The prompt left the queue: ComfyUI lives on (the container goes with the worker).
        assert run.comfy_process.alive
        logs = await run.logs()
        assert run.watchdog.proc.returncode == 0
        events = [e["event"] for e in logs]
        assert events.index("watchdog_fencing") < events.index("watchdog_killed")
        assert [e["process"] for e in logs if e["event"] == "watchdog_killed"] == ["worker"]


async def test_a_prompt_that_will_not_stop_costs_comfyui_then_the_worker(
    fence_file: Path,
) -> None:
    async with running(fence_file, stubborn=True) as run:
        # fence_after_s 8: a grace and a stop wait of a quarter of it each (2 s).
        write_fence(fence_file, holding(run.comfy, run.worker.proc.pid, time.time(), 8.0))
        comfy_died = await asyncio.wait_for(asyncio.shield(run.comfy_process.ended), timeout=15)
        worker_died = await asyncio.wait_for(asyncio.shield(run.worker.ended), timeout=5)
        first = run.comfy.interrupts[0][0]
        assert len(run.comfy.interrupts) >= 2  # again every second meanwhile
        assert first + 2.0 - 0.3 <= comfy_died <= first + 2.0 + 1.0  # the stop wait
        assert comfy_died <= worker_died + 0.2
        logs = await run.logs()
        killed = [e for e in logs if e["event"] == "watchdog_killed"]
        assert [e["process"] for e in killed] == ["comfyui", "worker"]
        assert killed[0]["prompt_held"] is True


async def test_without_a_claim_held_it_waits_and_exits_once_the_worker_is_gone(
    fence_file: Path,
) -> None:
    async with running(fence_file) as run:
        write_fence(fence_file, FenceState(holding=False))
        await asyncio.sleep(2.0)
        assert run.worker.alive and run.watchdog.alive and run.comfy.interrupts == []
        # A claim held, its fence_by far ahead: still nothing.
        far = holding(run.comfy, run.worker.proc.pid, time.time() + 60, 30.0)
        write_fence(fence_file, far)
        await asyncio.sleep(1.5)
        assert run.worker.alive and run.watchdog.alive and run.comfy.interrupts == []
        await run.worker.stop()
        exited = await asyncio.wait_for(asyncio.shield(run.watchdog.ended), timeout=5)
        assert exited - await run.worker.ended < 2 * POLL_S + 1.0
        logs = await run.logs()
        assert run.watchdog.proc.returncode == 0
        assert [e["event"] for e in logs][-1] == "watchdog_exiting"
        assert run.comfy_process.alive and run.comfy.interrupts == []


# --- endpoint/start.sh ------------------------------------------------------------------------

FAKE_COMFY = """
import os, time
open(os.environ["FAKE_COMFY_PID_FILE"], "w").write(str(os.getpid()))
time.sleep(120)
"""

# Holds a claim from the start and then freezes (sleeps), as a stopped handler would.
FAKE_HANDLER = """
import json, os, sys, time
path = os.environ["DURABLE_COMFY_FENCE_FILE"]
state = {"holding": True, "pid": os.getpid(), "submission": "sub-12345678",
         "prompt_id": "p-1", "lease_s": 60.0, "fence_after_s": 8.0, "fence_by": time.time()}
open(path + ".tmp", "w").write(json.dumps(state))
os.replace(path + ".tmp", path)
open(os.environ["FAKE_HANDLER_PID_FILE"], "w").write(str(os.getpid()))
time.sleep(120)
"""


def gone(pid: int) -> bool:
    """No such process, or a zombie waiting for a parent to reap it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


async def test_start_sh_runs_the_watchdog_beside_a_handler_it_can_end(tmp_path: Path) -> None:
    """start.sh as the image runs it (other paths): a handler that holds a claim and freezes is
    killed by the watchdog start.sh started, ComfyUI with it (it does not answer: the prompt
    may be there), and start.sh, the container's main process, exits with it."""
    (tmp_path / "comfy.py").write_text(FAKE_COMFY)
    (tmp_path / "handler.py").write_text(FAKE_HANDLER)
    env = clean_env()
    env |= {
        "ENDPOINT_PYTHON": str(EP_PYTHON),
        "ENDPOINT_HANDLER": str(tmp_path / "handler.py"),
        "ENDPOINT_WATCHDOG": str(WATCHDOG),
        "COMFY_PYTHON": sys.executable,
        "COMFY_MAIN": str(tmp_path / "comfy.py"),
        # Nothing listens there: ComfyUI does not answer.
        "COMFY_URL": "http://127.0.0.1:9",
        "DURABLE_COMFY_FENCE_FILE": str(tmp_path / "fence.json"),
        "FAKE_COMFY_PID_FILE": str(tmp_path / "comfy.pid"),
        "FAKE_HANDLER_PID_FILE": str(tmp_path / "handler.pid"),
    }
    script = await asyncio.create_subprocess_exec(
        "bash",
        str(START),
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(script.communicate(), timeout=30)
        text = out.decode(errors="replace")
        assert script.returncode == 128 + signal.SIGKILL, text  # the handler's end
        handler_pid = int((tmp_path / "handler.pid").read_text())
        comfy_pid = int((tmp_path / "comfy.pid").read_text())
        assert gone(handler_pid) and gone(comfy_pid), text
        assert '"watchdog_killed"' in text and '"process": "comfyui"' in text, text
    finally:
        if script.returncode is None:
            os.killpg(script.pid, signal.SIGKILL)
            await script.wait()


# --- the salvage: a prompt that finished while the handler was frozen --------------------------


# Our handler's job logic (endpoint/job.py) in a process of its own, to be frozen.
HANDLER = """
import asyncio, json, os, sys
sys.path.insert(0, os.environ["REPO_ROOT"])
from endpoint.job import run_job
from endpoint.logs import configure_logging
from endpoint.settings import EndpointSettings
configure_logging()
asyncio.run(run_job(json.loads(os.environ["RUNPOD_JOB"]), EndpointSettings.from_env()))
"""

HOLDER = "rp-held"
OUTPUT = ("", "out_00001_.png")
PNG = b"\x89PNG\r\n\x1a\n" + os.urandom(3000)


def finished_comfy() -> FakeComfy:
    """A ComfyUI whose prompt has ended with success: one output, and a preview (no output)."""
    comfy = FakeComfy(str(uuid.uuid4()), running=False)
    comfy.history = {
        "status": {"status_str": "success", "completed": True, "messages": []},
        "outputs": {
            "9": {
                "images": [
                    {"filename": OUTPUT[1], "subfolder": OUTPUT[0], "type": "output"},
                    {"filename": "preview_00001_.png", "subfolder": "", "type": "temp"},
                ]
            }
        },
    }
    comfy.files = {OUTPUT: PNG, ("", "preview_00001_.png"): b"preview"}
    return comfy


def store_of(bucket: Bucket) -> ClaimStore:
    return ClaimStore(S3(bucket.settings), bucket.name)


async def held_claim(bucket: Bucket, prompt_id: str) -> ClaimPlace:
    """A claim HOLDER holds on worker-a, and where it is, as the handler's fence file says."""
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    key = claim_key(S3Target(bucket=bucket.name, prefix="jobs"), job_id, "sub-12345678")
    now = datetime.now(UTC)
    claim = Claim(
        submission="sub-12345678",
        job_id=job_id,
        prompt_id=prompt_id,
        holder=HOLDER,
        worker_id="worker-a",
        lease_until=now,
        renewed_at=now,
    )
    await store_of(bucket).create(key, fresh_claim(claim, 60))
    return ClaimPlace(
        holder=HOLDER,
        worker_id="worker-a",
        claim_bucket=bucket.name,
        claim_key=key,
        output_bucket=bucket.name,
        output_prefix="jobs",
        job_id=job_id,
    )


def salvageable(run: Run, place: ClaimPlace, lease_end: float, fence_after_s: float) -> FenceState:
    """The fence file of a frozen handler whose lease ended at `lease_end` (its fence_by too)."""
    state = holding(run.comfy, run.worker.proc.pid, lease_end, fence_after_s)
    return state.model_copy(update={"lease_end": lease_end, "claim": place})


def events_of(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == event]


def missing(bucket: Bucket, key: str) -> bool:
    try:
        bucket.client().head_object(Bucket=bucket.name, Key=key)
    except Exception as exc:  # botocore's ClientError: 404
        return "404" in str(exc) or "Not Found" in str(exc)
    return False


async def test_a_prompt_that_finished_while_the_handler_was_frozen_is_salvaged(
    bucket: Bucket, sim: str, tmp_path: Path
) -> None:
    """Our handler runs a short prompt and is frozen (SIGSTOP) while it samples: the prompt
    ends meanwhile, the claim knows nothing of it. Past fence_by the watchdog kills the handler,
    stores the outputs at the handler's keys (sha256 metadata) and writes the claim: the
    prompt's end, the records, and a fence (`ended`), so the job completes from the claim."""
    steps = 150  # 1.5 s of sampling at 10 ms a step: it ends while the handler is frozen
    graph = ksampler_graph(f"salvage/{uuid.uuid4().hex[:8]}", steps=steps, seed=11)
    job_input = orchestrated_input(
        graph, bucket.name, lease_s=5.0, fence_after_s=8.0, sampler_steps={"5": steps}
    )
    block = job_input["durable_comfy"]
    prompt_id = block["prompt_id"]
    fence_file = tmp_path / "fence.json"
    (tmp_path / "handler.py").write_text(HANDLER)
    env = clean_env() | bucket_env(bucket)
    env |= {
        "REPO_ROOT": str(REPO_ROOT),
        "RUNPOD_JOB": json.dumps({"id": "rp-frozen", "input": job_input}),
        "RUNPOD_POD_ID": "worker-a",
        "COMFY_URL": sim,
        "DURABLE_COMFY_FENCE_FILE": str(fence_file),
        "BUCKET_RETRY_S": "20",
    }
    with (tmp_path / "handler.log").open("wb") as handler_log:
        handler = await Process.start(
            str(EP_PYTHON),
            str(tmp_path / "handler.py"),
            env=env,
            cwd=str(REPO_ROOT),
            stdout=handler_log,
            stderr=asyncio.subprocess.STDOUT,
        )
    # No COMFY_PID: the simulator serves the whole module, and the prompt leaves its queue.
    watchdog = await Process.start(
        str(EP_PYTHON),
        str(WATCHDOG),
        "--pid",
        str(handler.proc.pid),
        env=env,
        cwd="/",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    run = Run(FakeComfy(prompt_id), handler, handler, watchdog, fence_file)
    try:
        await until(lambda: _running_on(sim, prompt_id), within=30, interval=0.02)
        os.kill(handler.proc.pid, signal.SIGSTOP)
        frozen_at = time.time()
        ended_at = await until(lambda: _ended_at(sim, prompt_id), within=10)
        assert ended_at > frozen_at  # it finished during the freeze
        before = await read_claim(bucket, block)
        assert before is not None and before.prompt_end is None and before.fenced is None
        state = read_fence(fence_file)
        assert state is not None and state.claim is not None and state.lease_end is not None
        assert state.claim.holder == "rp-frozen" and state.claim.output_prefix == "jobs"
        await asyncio.wait_for(asyncio.shield(handler.ended), timeout=15)
        assert handler.proc.returncode == -signal.SIGKILL
        logs = await run.logs()
    finally:
        for process in (watchdog, handler):
            await process.stop()

    events = [e["event"] for e in logs]
    assert events.index("watchdog_killed") < events.index("watchdog_salvaged"), events
    claim = await read_claim(bucket, block)
    assert claim is not None and claim.holder == "rp-frozen" and claim.outcome is None
    assert claim.fenced is not None and claim.fenced.action == "ended"
    assert claim.fenced.worker_id == "worker-a" and "watchdog" in claim.fenced.detail
    end = claim.prompt_end
    assert end is not None and end.outcome == "success" and end.outputs
    history = (await sim_get(sim, f"/history/{prompt_id}"))[prompt_id]
    listed = [
        (node, item["subfolder"], item["filename"])
        for node, out in history["outputs"].items()
        for item in out.get("images", [])
        if item.get("type") == "output"
    ]
    assert [(o.node_id, o.subfolder, o.filename) for o in end.outputs] == listed
    assert len(claim.stored) == len(listed)
    for output, record in zip(end.outputs, claim.stored, strict=True):
        key = artifact_key("jobs", block["job_id"], 0, output.node_id, output.filename)
        body, head = bucket.read(key)
        async with httpx.AsyncClient(trust_env=False) as http:
            params = {"filename": output.filename, "subfolder": output.subfolder, "type": "output"}
            assert body == (await http.get(f"{sim}/view", params=params)).content
        assert head["Metadata"]["sha256"] == sha256(body) == record.sha256
        assert head["ContentType"] == "image/png" == record.content_type
        assert (record.key, record.bucket, record.type) == (key, bucket.name, "s3_url")
        assert record.data == f"s3://{bucket.name}/{key}" and record.size == len(body)
        assert (record.node_id, record.subfolder, record.filename) == (
            output.node_id,
            output.subfolder,
            output.filename,
        )
    # A delivery taking it over runs nothing, and the graph ran once.
    assert what_is_left(claim, graph).done
    stats = await sim_get(sim, "/sim/stats")
    assert stats["executions"][prompt_id] == 1


async def _running_on(sim: str, prompt_id: str) -> bool:
    queue = await sim_get(sim, "/queue")
    return any(item[1] == prompt_id for item in queue["queue_running"])


async def _ended_at(sim: str, prompt_id: str) -> float | None:
    ended: float | None = (await sim_get(sim, "/sim/stats"))["ended_at"].get(prompt_id)
    return ended


async def test_a_claim_taken_over_during_the_salvage_is_left_to_its_taker(
    bucket: Bucket, fence_file: Path
) -> None:
    """The claim is this handler's when the salvage starts, another delivery's by the time the
    outputs are stored: the watchdog does not write it. Previews are not outputs."""
    comfy = finished_comfy()
    place = await held_claim(bucket, comfy.prompt_id)
    taken = asyncio.Event()

    async def take_it_over() -> None:
        if not taken.is_set():
            await take_over(bucket, place.claim_key, "rp-taker", "worker-b")
            taken.set()

    comfy.on_view = take_it_over
    async with running(fence_file, comfy=comfy, env=bucket_env(bucket)) as run:
        write_fence(fence_file, salvageable(run, place, time.time() - 1.0, 8.0))
        logs = await run.logs()
    assert taken.is_set()
    assert comfy.views == [(*OUTPUT, "output")]
    current = await store_of(bucket).read(place.claim_key)
    assert current is not None
    assert current.claim.holder == "rp-taker" and current.claim.fenced is None
    assert current.claim.prompt_end is None and current.claim.stored == []
    assert events_of(logs, "watchdog_salvaged") == []
    skipped = events_of(logs, "watchdog_salvage_skipped")
    assert skipped and "rp-taker" in skipped[-1]["reason"], logs


async def test_a_claim_changed_since_it_was_read_is_not_written(bucket: Bucket) -> None:
    """The write goes If-Match on the claim as read: a write landing in between (here the
    holder's own renewal, in flight when it was killed) makes it a 412, and nothing changes."""
    prompt_id = str(uuid.uuid4())
    place = await held_claim(bucket, prompt_id)
    store = store_of(bucket)
    read = await store.read(place.claim_key)
    assert read is not None
    await store.replace(place.claim_key, fresh_claim(read.claim, 60), read.etag)
    salvaging = Salvage(
        place, prompt_id, "http://127.0.0.1:9", S3(bucket.settings), structlog.get_logger()
    )
    end = PromptEnd(
        outcome="success", at=datetime.now(UTC), outputs=[OutputFile(node_id="9", filename="x.png")]
    )
    assert await salvaging.record(read, end, [], time.monotonic() + 10) == "taken_over"
    after = await store.read(place.claim_key)
    assert after is not None and after.claim.fenced is None and after.claim.prompt_end is None


async def test_a_salvage_not_done_by_its_deadline_writes_no_claim(
    bucket: Bucket, fence_file: Path
) -> None:
    """Reading the output hangs: at the lease's end plus fence_after_s less the margin the
    watchdog gives up, with nothing stored and the claim as it was, and exits."""
    comfy = finished_comfy()
    place = await held_claim(bucket, comfy.prompt_id)
    release = asyncio.Event()

    async def hang() -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(release.wait(), 30)

    comfy.on_view = hang
    fence_after_s = 8.0
    lease_end = time.time() - 2.5
    deadline = lease_end + fence_after_s - SALVAGE_MARGIN_S  # 2.5 s from now
    async with running(fence_file, comfy=comfy, env=bucket_env(bucket)) as run:
        try:
            write_fence(fence_file, salvageable(run, place, lease_end, fence_after_s))
            exited = await asyncio.wait_for(asyncio.shield(run.watchdog.ended), timeout=15)
            exited_epoch = time.time() - (time.monotonic() - exited)
            logs = await run.logs()
        finally:
            release.set()  # the fake ComfyUI's server stops once its answers are out
    assert comfy.views, "the salvage never reached the output"
    assert exited_epoch <= deadline + 1.5
    assert events_of(logs, "watchdog_salvage_gave_up"), logs
    assert events_of(logs, "watchdog_salvaged") == []
    current = await store_of(bucket).read(place.claim_key)
    assert current is not None and current.claim.holder == HOLDER
    assert current.claim.fenced is None and current.claim.prompt_end is None
    key = artifact_key("jobs", place.job_id, 0, "9", OUTPUT[1])
    assert missing(bucket, key)
