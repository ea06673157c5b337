"""The one place benchmarks are registered: add a group's module here (and drop it from
PLANNED) and `make bench` runs it, prints it and writes it into results.json and RESULTS.md."""

from __future__ import annotations

from bench.groups import (
    batch,
    client_latency,
    history_size,
    offload,
    overhead,
    pools,
    push,
    queue,
    recovery,
    runpod_path,
    scale,
    throughput,
)
from bench.outcome import Benchmark

BENCHMARKS: tuple[Benchmark, ...] = (
    overhead.BENCHMARK,
    throughput.BENCHMARK,
    recovery.BENCHMARK,
    scale.BENCHMARK,
    offload.BENCHMARK,
    history_size.BENCHMARK,
    client_latency.BENCHMARK,
    push.BENCHMARK,
    runpod_path.BENCHMARK,
    queue.BENCHMARK,
    batch.BENCHMARK,
    pools.BENCHMARK,
)

# Planned groups without a module yet: listed in RESULTS.md as not yet measured.
PLANNED: dict[int, str] = {}


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
