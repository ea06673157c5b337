"""The one place benchmarks are registered: add a group's module here (and drop it from
PLANNED) and `make bench` runs it, prints it and writes it into results.json and RESULTS.md."""

from __future__ import annotations

from bench.groups import client_latency, history_size, overhead
from bench.outcome import Benchmark

BENCHMARKS: tuple[Benchmark, ...] = (
    overhead.BENCHMARK,
    history_size.BENCHMARK,
    client_latency.BENCHMARK,
)

# Issue 10's groups without a module yet: listed in RESULTS.md as not yet measured.
PLANNED: dict[int, str] = {
    2: "Throughput: short jobs per second with 50 concurrent clients vs the same clients on the "
    "simulator directly (ratio >= 0.5), server CPU per job",
    3: "Recovery: kill -9 of the worker mid-job to the next step a client sees "
    "(<= heartbeat_timeout_s + 2 s), no resubmission; the parts of that time",
    4: "Scale: 1,000 concurrently monitored jobs in one worker (RSS <= 300 MB, throughput "
    ">= 0.9x direct with a deep queue, lag p99 <= 2 s), RSS at 100/300/1,000 jobs",
    5: "Offload: a 1 GiB output /view -> S3 vs a raw multipart upload (ratio >= 0.9), peak RSS "
    "growth <= 64 MiB, the same at 100 MiB",
}


class UnknownBenchmark(ValueError):
    pass


def select(names: str | None) -> list[Benchmark]:
    """`overhead,history` -> those benchmarks in registry order; empty or None -> all."""
    wanted = [n.strip() for n in (names or "").split(",") if n.strip()]
    known = {b.name: b for b in BENCHMARKS}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise UnknownBenchmark(
            f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(known)}"
        )
    return [b for b in BENCHMARKS if not wanted or b.name in wanted]
