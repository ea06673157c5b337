"""Group 5, offload: a large output streamed from ComfyUI's /view into S3 by the project's code
path, against a raw multipart upload of the same bytes from the local file.

The simulator makes the output (its SimLargeOutput node: `size_mib` MiB of deterministic bytes
in its output directory). Each upload runs in a process of its own (bench/offload_child.py) so
that its peak RSS is its own: VmHWM reset right before the upload, read right after, minus the
RSS before it (also sampled every 10 ms, a second witness).

- **project**: `OutputUploader.upload`, what `follow_prompt` and `offload_outputs` run: GET /view
  streamed with aiohttp (chunks as read, up to 256 KiB) into `ArtifactStore.upload_stream` (8 MiB
  parts in reused buffers, up to 4 in flight, sha256 and CRC32 in threads on the way, then the
  sha256 stamped on the object as metadata and read back);
- **raw**: aioboto3 `create_multipart_upload` / `upload_part` / `complete_multipart_upload` of the
  same file read from disk, with the same part size and parts in flight; nothing else.

Per size (`--offload-sizes`, MiB; 100 and 1024 by default): throughput (MiB/s, target >= 0.95x
raw) and peak RSS growth (target <= 64 MiB, flat in the size). One run cannot resolve
5 %, and other work on the machine moves a single upload's time by far more: each size is
measured in rounds (5 up to 256 MiB, 3 above), each round one raw and one project upload, back to
back, the side that goes first alternating; before each upload the bucket's writes are flushed to
disk (`sync`) and SeaweedFS is let go idle, so no upload pays for the one before it. The
throughput result compares the medians of the two sides over the same rounds; the details give
each round's ratio (their spread says how far the median can be trusted) and each side's CPU per
GiB in the uploading process, which other work disturbs far less than the time.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from typing import Any

from bench.outcome import Benchmark, BenchOptions, Outcome, Section
from bench.procs import MIB, cpu_seconds
from bench.profile import profile_lines, record_command
from bench.results import Result, Target, fmt, result
from bench.stack import ROOT, BenchContext, SimProcess, extra_sim
from faults.worker_proc import clean_environ

THROUGHPUT_MIN_RATIO = 0.95  # raised from 0.9 on 2026-12-02
RSS_GROWTH_MAX_MIB = 64.0
ROUNDS_SMALL = 5  # rounds for sizes up to SMALL_UP_TO_MIB
ROUNDS_LARGE = 3
SMALL_UP_TO_MIB = 256
MODES = ("raw", "project")
# Before each upload: SeaweedFS below this share of a core over SETTLE_WINDOW_S, at most
# SETTLE_MAX_S of waiting.
SETTLE_CPU_SHARE = 0.05
SETTLE_WINDOW_S = 0.25
SETTLE_MAX_S = 15.0


async def _make_output(ctx: BenchContext, sim: SimProcess, size_mib: int) -> dict[str, str]:
    graph = {
        "1": {
            "class_type": "SimLargeOutput",
            "inputs": {
                "size_mib": size_mib,
                "seed": int(uuid.uuid4().int % 2**32),
                "filename_prefix": f"bench/offload_{size_mib}",
            },
        }
    }
    response = await ctx.http.post(f"{sim.pool.url}/prompt", json={"prompt": graph})
    response.raise_for_status()
    prompt_id = response.json()["prompt_id"]
    deadline = time.monotonic() + 60 + size_mib / 10
    while time.monotonic() < deadline:
        history = (await ctx.http.get(f"{sim.pool.url}/history/{prompt_id}")).json()
        if prompt_id in history:
            files = history[prompt_id]["outputs"]["1"]["files"]
            return {k: str(v) for k, v in files[0].items()}
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the simulator did not write {size_mib} MiB in time")


def _argv(mode: str, sim: SimProcess, item: dict[str, str]) -> list[str]:
    argv = [sys.executable, "-m", "bench.offload_child", mode]
    if mode == "project":
        return [
            *argv,
            "--url",
            sim.pool.url,
            "--filename",
            item["filename"],
            "--subfolder",
            item.get("subfolder", ""),
        ]
    path = sim.output_dir / item.get("subfolder", "") / item["filename"]
    return [*argv, "--path", str(path)]


def _env(ctx: BenchContext) -> dict[str, str]:
    return {**clean_environ(), **ctx.stack.worker_env(), "PYTHONUNBUFFERED": "1"}


async def _child(ctx: BenchContext, argv: list[str]) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=_env(ctx),
        cwd=ROOT,
    )
    stdout, stderr = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[2:4])} failed:\n{stderr.decode()[-2000:]}")
    measured: dict[str, Any] = json.loads(stdout.decode().strip().splitlines()[-1])
    return measured


def mib_per_s(run: dict[str, Any]) -> float:
    return float(run["bytes"]) / MIB / float(run["seconds"])


def growth_mib(run: dict[str, Any]) -> float:
    return (float(run["peak_rss"]) - float(run["rss_before"])) / MIB


def cpu_s_per_gib(run: dict[str, Any]) -> float:
    return float(run["cpu_seconds"]) / (float(run["bytes"]) / MIB / 1024)


def rounds_for(size_mib: int) -> int:
    return ROUNDS_SMALL if size_mib <= SMALL_UP_TO_MIB else ROUNDS_LARGE


def round_order(index: int) -> tuple[str, str]:
    """Raw first in even rounds, the project first in odd ones: neither side always follows the
    other's upload."""
    return MODES if index % 2 == 0 else (MODES[1], MODES[0])


def median_speed(runs: list[dict[str, Any]]) -> float:
    return statistics.median(mib_per_s(r) for r in runs)


def round_ratios(runs: dict[str, list[dict[str, Any]]]) -> list[float]:
    """Each round's project / raw throughput (the two uploads ran back to back)."""
    return [mib_per_s(p) / mib_per_s(r) for p, r in zip(runs["project"], runs["raw"], strict=True)]


async def settle(s3_pid: int | None) -> float:
    """Flush what the bucket wrote to disk and wait until SeaweedFS is idle, so that an upload
    does not pay for the one before it. Returns the seconds waited."""
    began = time.monotonic()
    await asyncio.to_thread(os.sync)
    while s3_pid is not None and time.monotonic() - began < SETTLE_MAX_S:
        before = cpu_seconds(s3_pid)
        await asyncio.sleep(SETTLE_WINDOW_S)
        after = cpu_seconds(s3_pid)
        if before is None or after is None or (after - before) / SETTLE_WINDOW_S < SETTLE_CPU_SHARE:
            break
    return time.monotonic() - began


async def run(ctx: BenchContext, options: BenchOptions) -> Outcome:
    results: list[Result] = []
    rows: list[str] = []
    summary: list[str] = []
    where: dict[str, list[str]] = {}
    missed: list[tuple[int, SimProcess, dict[str, str]]] = []
    async with extra_sim(ctx, "offload", step_delay_ms=0) as sim:
        for size in options.offload_sizes_mib:
            item = await _make_output(ctx, sim, size)
            runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
            for index in range(rounds_for(size)):
                for mode in round_order(index):
                    await settle(ctx.s3_pid)
                    measured = await _child(ctx, _argv(mode, sim, item))
                    measured["round"] = index + 1
                    runs[mode].append(measured)
            speed = result(
                f"offload.{size}mib.throughput",
                median_speed(runs["project"]),
                "MiB/s",
                baseline=median_speed(runs["raw"]),
                target=Target(metric="ratio", op=">=", limit=THROUGHPUT_MIN_RATIO),
            )
            # Growth is the worst of the runs: the peak is what a worker must have room for.
            growth = max(growth_mib(r) for r in runs["project"])
            memory = result(
                f"offload.{size}mib.peak_rss_growth",
                growth,
                "MiB",
                baseline=max(growth_mib(r) for r in runs["raw"]),
                target=Target(limit=RSS_GROWTH_MAX_MIB),
            )
            results += [speed, memory]
            ratios = round_ratios(runs)
            cpu = {m: statistics.median(cpu_s_per_gib(r) for r in runs[m]) for m in MODES}
            summary.append(
                f"| {size} | {len(ratios)} | {fmt(speed.ratio or 0.0)} | "
                f"{fmt(min(ratios))} - {fmt(max(ratios))} | {fmt(cpu['project'])} | "
                f"{fmt(cpu['raw'])} |"
            )
            for mode in MODES:
                for r in runs[mode]:
                    rows.append(
                        f"| {size} | {r['round']} | {mode} | {fmt(float(r['seconds']))} | "
                        f"{fmt(mib_per_s(r))} | {fmt(cpu_s_per_gib(r))} | "
                        f"{fmt(float(r['rss_before']) / MIB)} | {fmt(growth_mib(r))} | "
                        f"{fmt((float(r['peak_sampled']) - float(r['rss_before'])) / MIB)} |"
                    )
            if not (speed.meets and memory.meets):
                missed.append((size, sim, item))
        # Evidence for a missed target: the project's side once more, under py-spy (unmeasured).
        profiled: list[str] = []
        if missed:
            size, _, item = min(missed, key=lambda m: m[0])
            out = ctx.work_dir / "profiles" / f"offload-{size}.txt"
            text, _ = await record_command(_argv("project", sim, item), out, _env(ctx), ROOT)
            profiled = profile_lines(text, f"the project's upload of {size} MiB (run again)")
    for row in results:
        if row.meets is False:
            where[row.name] = _where(row, profiled)
    sections = [
        Section(
            title="Offload: medians",
            lines=[
                "Each size in rounds of one raw and one project upload back to back (the first "
                "side alternating), `sync` and SeaweedFS idle before each. `ratio` = median "
                "project MiB/s / median raw MiB/s; `rounds' ratios` = the lowest and highest "
                "of each round's own ratio; CPU = the uploading process's CPU seconds per GiB "
                "(median), all its threads.",
                "",
                "| MiB | rounds | ratio | rounds' ratios | CPU s/GiB project | CPU s/GiB raw |",
                "|---|---|---|---|---|---|",
                *summary,
            ],
        ),
        Section(
            title="Offload: each upload",
            lines=[
                "Each upload in a process of its own; `peak growth` = VmHWM (reset right before "
                "the upload) - RSS before it; `sampled` = the highest RSS seen every 10 ms.",
                "",
                "| MiB | round | side | s | MiB/s | CPU s/GiB | RSS before (MiB) | "
                "peak growth (MiB) | sampled (MiB) |",
                "|---|---|---|---|---|---|---|---|---|",
                *rows,
            ],
        ),
    ]
    if profiled:
        sections.append(Section(title="Offload: profile", lines=profiled, console=False))
    return Outcome(results=results, sections=sections, where=where)


def _where(missed: Result, profiled: list[str]) -> list[str]:
    if missed.name.endswith("throughput"):
        head = (
            f"The project's path streams GET /view (aiohttp, up to 256 KiB a read) into 8 MiB "
            f"parts (buffers reused), hashing every byte (sha256, in a thread) on the way and, "
            f"once complete, stamping the sha256 on the object (a copy inside S3) and reading it "
            f"back (HEAD); the raw upload reads the file in 8 MiB parts and sends them. "
            f"{fmt(missed.value)} MiB/s against {fmt(missed.baseline)} MiB/s (medians)."
        )
    else:
        head = (
            f"Peak RSS growth {fmt(missed.value)} MiB (raw: {fmt(missed.baseline)} MiB): the "
            "uploader holds up to 4 parts of 8 MiB in flight plus the one being filled."
        )
    return [head, "", *profiled] if profiled else [head]


# Six uploads of 1 GiB and ten of 100 MiB, each after a settle: about 3 minutes on 2 cores.
BENCHMARK = Benchmark(name="offload", group=5, title="Offload", run=run, timeout_s=600.0)
