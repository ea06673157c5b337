"""Our RunPod handler leaves nothing of a job in its ComfyUI's folders (endpoint/job_files.py):
endpoint/job.py driven directly, as in test_endpoint_job.py, against the ComfyUI simulator
(whose input, output and temp folders the handler is given) and a real S3 (SeaweedFS), behind
a `Gate` where a storage outage is needed.

What goes, and when: the job's input files and previews once its prompt has ended, its outputs
once stored and the run's outcome is settled; an output that could not be stored stays, and a
later delivery of the same submission stores it from there.
"""

from __future__ import annotations

import asyncio
import base64
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from structlog.testing import capture_logs

from endpoint.claims import ClaimStore
from endpoint.job import run_job
from endpoint.s3 import S3
from endpoint.settings import EndpointSettings
from protocol.runpod.contract import S3Target, claim_key, inputs_folder
from tests.support.comfy_sim import make_png, run_simulator
from tests.support.endpoint import (
    Bucket,
    Gate,
    Progress,
    endpoint_settings,
    orchestrated_input,
    read_claim,
    sha256,
    sim_get,
    sim_post,
    take_over,
    until,
)


@dataclass(frozen=True)
class Comfy:
    """The simulator and its folders (`run_simulator` puts them in its work dir)."""

    url: str
    root: Path

    def files(self) -> set[str]:
        """Every file in the input, output and temp folders, as `folder/relative path`."""
        return self._walk(files=True)

    def folders(self) -> set[str]:
        return self._walk(files=False)

    def _walk(self, *, files: bool) -> set[str]:
        # os.walk, not Path.rglob: the handler removes a job's folders while this
        # looks (the test samples them during the run), and rglob raises on a
        # folder that went between listing and entering it; os.walk skips it.
        found: set[str] = set()
        for folder in ("input", "output", "temp"):
            for parent, dirs, names in os.walk(self.root / folder):
                for name in names if files else dirs:
                    found.add(str((Path(parent) / name).relative_to(self.root)))
        return found


@pytest.fixture(scope="module")
def comfy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Comfy]:
    root = tmp_path_factory.mktemp("files_sim")
    # ComfyUI's own layout, which COMFY_DIR names: input/, output/, temp/ under one root.
    with run_simulator(root, "--temp-dir", str(root / "temp")) as url:
        yield Comfy(url, root)


@pytest.fixture
def settings(comfy: Comfy, bucket: Bucket) -> EndpointSettings:
    return endpoint_settings(comfy.url, bucket, comfy_dir=comfy.root)


@pytest_asyncio.fixture(loop_scope="session")
async def gate(bucket: Bucket) -> AsyncIterator[Gate]:
    async with Gate(bucket.settings.endpoint_url) as opened:
        yield opened


def job(job_input: Any, job_id: str | None = None) -> dict[str, Any]:
    return {"id": job_id or f"rp-{uuid.uuid4().hex[:10]}", "input": job_input}


def run_folder(block: dict[str, Any]) -> str:
    """The run's save folder, as the orchestrator names it (workflows/graph.py `run_tag`)."""
    return f"dc_{block['job_id']}_0_{block['prompt_id'][:8]}"


def files_job(
    bucket: Bucket, *, slow_steps: int = 0, preview: bool = True, **block: Any
) -> tuple[dict[str, Any], list[str]]:
    """An orchestrated job with an input staged in S3 and one inline, both loaded, saved into
    the run's folder (as the orchestrator rewrites a literal prefix) and previewed; with
    `slow_steps`, also a txt2img branch that samples that many steps (10 ms each) and saves
    after the quick one. Returns the job input and its input file names."""
    job_input = orchestrated_input({}, bucket.name, **block)
    o = job_input["durable_comfy"]
    o["run_tag"] = tag = run_folder(o)
    staged, inline = f"staged-{uuid.uuid4().hex[:8]}.png", f"inline-{uuid.uuid4().hex[:8]}.png"
    graph: dict[str, Any] = {
        "11": {"class_type": "LoadImage", "inputs": {"image": staged}},
        "12": {"class_type": "LoadImage", "inputs": {"image": inline}},
        "13": {"class_type": "ImageInvert", "inputs": {"image": ["11", 0]}},
        "14": {"class_type": "SaveImage",
               "inputs": {"images": ["13", 0], "filename_prefix": f"{tag}/a/quick"}},
        "15": {"class_type": "SaveImage",
               "inputs": {"images": ["12", 0], "filename_prefix": f"{tag}/inline"}},
    }  # fmt: skip
    if preview:
        graph["16"] = {"class_type": "PreviewImage", "inputs": {"images": ["13", 0]}}
    if slow_steps:
        graph |= {
            "1": {"class_type": "CheckpointLoaderSimple",
                  "inputs": {"ckpt_name": "sim.safetensors"}},
            "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "fox", "clip": ["1", 1]}},
            "4": {"class_type": "EmptyLatentImage",
                  "inputs": {"width": 64, "height": 64, "batch_size": 1}},
            "5": {"class_type": "KSampler",
                  "inputs": {"model": ["1", 0], "seed": uuid.uuid4().int % 10**9,
                             "steps": slow_steps, "cfg": 7.0, "sampler_name": "euler",
                             "scheduler": "normal", "positive": ["2", 0], "negative": ["2", 0],
                             "latent_image": ["4", 0], "denoise": 1.0}},
            "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
            "7": {"class_type": "SaveImage",
                  "inputs": {"images": ["6", 0], "filename_prefix": f"{tag}/slow"}},
        }  # fmt: skip
        o["sampler_steps"] = {"5": slow_steps}
    job_input["workflow"] = graph
    data = make_png(8, 6, (200, 10, 10))
    key = f"{inputs_folder(S3Target.model_validate(o['output']), o['job_id'])}/{staged}"
    bucket.client().put_object(Bucket=bucket.name, Key=key, Body=data)
    o["inputs"] = [{"name": staged, "key": key, "size": len(data), "sha256": sha256(data)}]
    inline_png = make_png(4, 4, (1, 2, 3))
    job_input["images"] = [{"name": inline, "image": base64.b64encode(inline_png).decode()}]
    return job_input, [staged, inline]


def of_job(files: set[str], names: list[str], tag: str) -> set[str]:
    """The files that are the job's: its inputs by name, anything in its run folder."""
    return {f for f in files if f in {f"input/{n}" for n in names} or f"/{tag}/" in f"/{f}"}


async def prompt_runs(comfy: Comfy, prompt_id: str) -> int:
    return int((await sim_get(comfy.url, "/sim/stats"))["prompts"].get(prompt_id, 0))


# --- a finished job ---------------------------------------------------------------------------


@pytest.mark.parametrize("claims", [True, False], ids=["claimed", "unclaimed"])
async def test_a_completed_job_leaves_no_file_in_comfyuis_folders(
    comfy: Comfy, bucket: Bucket, settings: EndpointSettings, claims: bool
) -> None:
    job_input, names = files_job(bucket, claims=claims)
    block = job_input["durable_comfy"]
    before, folders_before = comfy.files(), comfy.folders()
    seen: set[str] = set()

    def look() -> None:
        seen.update(comfy.files())

    progress = Progress()
    with capture_logs() as logs:
        task = asyncio.create_task(run_job(job(job_input), settings, progress))
        while not task.done():  # what the run put in the folders while it ran
            look()
            await asyncio.sleep(0.01)
        result = await task

    assert result["status"] == "success", result
    # The run did write its files there: both inputs, its outputs, its preview.
    written = seen - before
    assert {f"input/{n}" for n in names} <= written, written
    assert len([f for f in written if f.startswith(f"output/{run_folder(block)}/")]) == 2
    assert any(f.startswith("temp/") for f in written), written
    # And left none of them, nor the run's folders.
    assert comfy.files() == before
    assert comfy.folders() == folders_before
    # Its outputs are in S3, as recorded.
    assert len(result["images"]) == 2
    for record in result["images"]:
        body, _ = bucket.read(record["key"])
        assert sha256(body) == record["sha256"]
    claim = await read_claim(bucket, block)
    if claims:
        assert claim is not None and claim.outcome is not None
        assert claim.outcome.state == "completed"
    else:
        assert claim is None
    [removed] = [e for e in logs if e["event"] == "comfy_files_removed"]
    assert (removed["inputs"], removed["outputs"], removed["previews"]) == (2, 2, 1)


async def test_a_stock_job_leaves_no_file_once_its_answer_holds_the_outputs(
    comfy: Comfy, settings: EndpointSettings
) -> None:
    """No bucket for stock answers: the outputs are read into the base64 answer, then go."""
    name = f"stock-{uuid.uuid4().hex[:8]}.png"
    png = make_png(4, 4, (9, 9, 9))
    graph = {
        "1": {"class_type": "LoadImage", "inputs": {"image": name}},
        "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "s/t"}},
        "3": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}},
    }
    before = comfy.files()
    image = {"name": name, "image": base64.b64encode(png).decode()}

    result = await run_job(job({"workflow": graph, "images": [image]}), settings)

    [output] = result["images"]
    assert output["type"] == "base64" and base64.b64decode(output["data"])[:4] == b"\x89PNG"
    assert comfy.files() == before
    assert not (comfy.root / "output" / "s").exists()


async def test_the_same_stock_job_twice_saves_its_output_again_rather_than_answer_from_cache(
    comfy: Comfy, settings: EndpointSettings
) -> None:
    """The first job's output is removed once answered: a second identical graph must not be
    answered from ComfyUI's cache with that file's name (a 404 at /view)."""
    name = f"twice-{uuid.uuid4().hex[:8]}.png"
    image = {"name": name, "image": base64.b64encode(make_png(4, 4, (7, 7, 7))).decode()}
    graph = {
        "1": {"class_type": "LoadImage", "inputs": {"image": name}},
        "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "tw"}},
    }
    before = comfy.files()
    answers = [
        await run_job(job({"workflow": graph, "images": [image]}), settings) for _ in range(2)
    ]
    for answer in answers:
        assert answer.get("status") != "error", answer
        [output] = answer["images"]
        assert base64.b64decode(output["data"])[:4] == b"\x89PNG"
    assert comfy.files() == before


# --- a failed or cancelled job ----------------------------------------------------------------


async def test_a_failed_job_leaves_no_input_behind(
    comfy: Comfy, bucket: Bucket, settings: EndpointSettings
) -> None:
    job_input, names = files_job(bucket, slow_steps=20)
    block = job_input["durable_comfy"]
    before = comfy.files()
    await sim_post(comfy.url, "/sim/faults", {"oom_next": True})  # at the KSampler

    result = await run_job(job(job_input), settings)

    assert result["error_type"] == "OutOfMemory", result
    assert result["claim_recorded"] is True
    # Whatever it stored before the failure went too: the claim has the records.
    assert of_job(comfy.files(), names, run_folder(block)) == set()
    assert comfy.files() == before
    claim = await read_claim(bucket, block)
    assert claim is not None and claim.outcome is not None and claim.outcome.state == "failed"
    assert len(claim.outcome.images) == len(result["images"])


async def test_a_cancelled_job_leaves_neither_its_inputs_nor_what_it_stored(
    comfy: Comfy, bucket: Bucket, settings: EndpointSettings
) -> None:
    job_input, names = files_job(bucket, slow_steps=1500)
    block = job_input["durable_comfy"]
    before = comfy.files()
    progress = Progress()
    task = asyncio.create_task(run_job(job(job_input), settings, progress))
    # The quick outputs are stored, the sampler runs: then the platform stops the job.
    await until(
        lambda: any(len(u.artifacts) == 2 and u.step > 0 for u in progress.updates), within=30.0
    )
    assert of_job(comfy.files(), names, run_folder(block)), "the run's files are there"

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert of_job(comfy.files(), names, run_folder(block)) == set()
    assert comfy.files() == before
    claim = await read_claim(bucket, block)
    assert claim is not None and claim.outcome is not None
    assert claim.outcome.state == "cancelled" and len(claim.outcome.images) == 2
    for record in claim.outcome.images:
        assert record.key is not None and sha256(bucket.read(record.key)[0]) == record.sha256


async def test_a_delivery_that_lost_its_claim_leaves_its_outputs_for_the_new_holder(
    comfy: Comfy, bucket: Bucket, settings: EndpointSettings
) -> None:
    """Another delivery took the submission over (our lease had lapsed): it answers for the
    run and may re-attach to the prompt on this worker, so the outputs stay; the inputs go (a
    delivery stages its own)."""
    job_input, names = files_job(bucket, slow_steps=800, preview=False)
    block = job_input["durable_comfy"]
    tag = run_folder(block)
    progress = Progress()
    task = asyncio.create_task(run_job(job(job_input, "rp-slow"), settings, progress))
    await until(
        lambda: any(len(u.artifacts) == 2 and u.step > 0 for u in progress.updates), within=30.0
    )
    key = claim_key(S3Target.model_validate(block["output"]), block["job_id"], block["submission"])
    await take_over(bucket, key, "rp-taker", "worker-b")

    result = await asyncio.wait_for(task, timeout=20)

    assert result["status"] == "claimed_elsewhere", result
    left = of_job(comfy.files(), names, tag)
    assert {f for f in left if f.startswith("input/")} == set(), left
    assert len([f for f in left if f.startswith(f"output/{tag}/")]) == 2, left


# --- an output that could not be stored -------------------------------------------------------


def behind(gate: Gate, bucket: Bucket, comfy: Comfy, **overrides: Any) -> EndpointSettings:
    gated = Bucket(bucket.settings.model_copy(update={"endpoint_url": gate.url}), bucket.name)
    return endpoint_settings(comfy.url, gated, comfy_dir=comfy.root, **overrides)


@pytest.mark.parametrize("back_in_time", [True, False], ids=["claim-recorded", "claim-not-written"])
async def test_an_output_that_could_not_be_stored_stays_for_a_later_delivery(
    comfy: Comfy, bucket: Bucket, gate: Gate, back_in_time: bool
) -> None:
    """Two outputs are stored; then S3 goes away, past the budget of the sampler's output:
    the job fails StorageError, its inputs and preview go, and the output it could not store
    stays in ComfyUI's output folder. When the claim records the failure, the stored outputs go
    too. When it could not, the orchestrator sends the submission again once the lease has run
    out, and that delivery, on the same worker, re-attaches to the prompt and stores every
    output from the folder: so every output stays until then, and goes after it."""
    budget_s = 3.0
    # Recorded: no renewal falls in the outage, whose end is timed against the upload's
    # budget. Not written: a lease short enough for the later delivery to take the claim over
    # soon, long enough that the handler gives the output up (the upload's budget, then the
    # finish's) before its fence point (a quarter of the lease before its end, counted from a
    # renewal up to a third of the lease before the outage), and a short fence_after_s.
    lease_s, fence_after_s = (60.0, 30.0) if back_in_time else (24.0, 2.0)
    job_input, names = files_job(
        bucket, slow_steps=200, lease_s=lease_s, fence_after_s=fence_after_s
    )
    block = job_input["durable_comfy"]
    tag = run_folder(block)
    settings = behind(gate, bucket, comfy, bucket_retry_s=budget_s)
    progress = Progress()
    with capture_logs() as logs:
        task = asyncio.create_task(run_job(job(job_input), settings, progress))
        await until(
            lambda: any(len(u.artifacts) == 2 and u.step > 0 for u in progress.updates), within=30.0
        )
        if back_in_time:
            cut = gate.shut_after(1)  # the next request is the sampler's output's upload
            await asyncio.wait_for(cut.wait(), timeout=30)
            # Back once the handler gave the output up, within the claim's finish's budget.
            await until(lambda: any(e["event"] == "output_not_stored" for e in logs), within=30.0)
            await gate.open()
        else:
            await gate.shut()  # until the job has failed: its claim cannot be finished
        failed = await asyncio.wait_for(task, timeout=60)
    await gate.open()

    assert failed["error_type"] == "StorageError", failed
    assert failed["claim_recorded"] is back_in_time
    assert len(failed["images"]) == 2
    left = of_job(comfy.files(), names, tag)
    slow = {f for f in left if f.startswith(f"output/{tag}/slow")}
    assert len(slow) == 1, left
    [kept] = [e for e in logs if e["event"] == "comfy_outputs_kept"]
    if back_in_time:
        assert left == slow, left
        assert (kept["outputs"], kept["stored"]) == (1, 0), kept
        return
    assert len(left) == 3 and not {f for f in left if f.startswith("input/")}, left
    assert (kept["outputs"], kept["stored"]) == (3, 2), kept

    # The orchestrator's resubmission of the same submission, once the lease has run out by
    # fence_after_s (by the S3 server's whole-second clock, as the handler judges it).
    claim = await read_claim(bucket, block)
    assert claim is not None and claim.outcome is None
    store = ClaimStore(S3(bucket.settings), bucket.name)
    key = claim_key(S3Target.model_validate(block["output"]), block["job_id"], block["submission"])

    async def takeable() -> bool:
        current = await store.read(key)
        return current is not None and current.takeable(fence_after_s)

    await until(takeable, within=lease_s + fence_after_s + 10, interval=0.25)
    settings = endpoint_settings(comfy.url, bucket, comfy_dir=comfy.root)
    again = await run_job(job(job_input), settings)

    assert again["status"] == "success", again
    assert await prompt_runs(comfy, block["prompt_id"]) == 1, "re-attached, not run again"
    assert len(again["images"]) == 3
    for record in again["images"]:
        assert sha256(bucket.read(record["key"])[0]) == record["sha256"]
    assert of_job(comfy.files(), names, tag) == set()
