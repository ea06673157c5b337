"""The run's outputs: the printed table, bench/results.json and bench/RESULTS.md.

Rendering is pure (tests/tooling/test_bench_results.py); only `machine()` reads the host.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel

from bench.outcome import Outcome
from bench.results import Result, fmt

COLUMNS = ("name", "value", "unit", "baseline", "ratio", "target", "meets")


class Machine(BaseModel):
    cores: int
    cpu: str
    ram_gib: float
    python: str
    system: str
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float] | None = None


class Run(BaseModel):
    """Everything RESULTS.md says about one run, besides the benchmarks' outcomes."""

    date: str  # ISO 8601, UTC
    command: str
    seconds: float
    machine: Machine
    selected: list[str]
    note: str = ""  # what else ran meanwhile, as the person running it says


class GroupReport(BaseModel):
    group: int
    title: str
    outcome: Outcome


def machine(load_before: tuple[float, float, float] | None = None) -> Machine:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram_gib = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram_gib = int(line.split()[1]) / 1024 / 1024
                break
    except OSError:
        pass
    return Machine(
        cores=os.cpu_count() or 0,
        cpu=cpu,
        ram_gib=round(ram_gib, 1),
        python=platform.python_version(),
        system=f"{platform.system()} {platform.release()}",
        load_before=load_before or os.getloadavg(),
    )


def cells(row: Result) -> list[str]:
    return [
        row.name,
        fmt(row.value),
        row.unit,
        fmt(row.baseline),
        "-" if row.ratio is None else f"{fmt(row.ratio)}x",
        row.target.text(row.unit) if row.target else "-",
        {True: "yes", False: "NO", None: "-"}[row.meets],
    ]


def table_text(rows: Sequence[Result]) -> str:
    """Fixed-width, for the terminal."""
    body = [list(COLUMNS), *(cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in body) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in body
    )


def table_markdown(rows: Sequence[Result]) -> list[str]:
    return [
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
        *("| " + " | ".join(cells(r)) + " |" for r in rows),
    ]


def results_json(rows: Sequence[Result]) -> str:
    """A list of {name, value, unit, baseline, ratio, target, meets}."""
    return json.dumps([r.model_dump(mode="json") for r in rows], indent=2) + "\n"


def _load(load: tuple[float, float, float] | None) -> str:
    return "-" if load is None else " / ".join(f"{x:.2f}" for x in load)


def results_markdown(run: Run, groups: Sequence[GroupReport], planned: dict[int, str]) -> str:
    m = run.machine
    rows = [r for g in groups for r in g.outcome.results]
    lines = [
        "# Benchmark results",
        "",
        "Written by `make bench` (bench/); see bench/README.md for what each figure is.",
        "",
        f"- date: {run.date}",
        f"- command: `{run.command}` ({fmt(run.seconds)} s)",
        f"- machine: {m.cores} cores ({m.cpu}), {fmt(m.ram_gib)} GiB RAM, Python {m.python}, "
        f"{m.system}",
        f"- load average (1/5/15 min): {_load(m.load_before)} before, {_load(m.load_after)} "
        "after. Other work may share this machine: the figures are as noisy as its load.",
        f"- benchmarks run: {', '.join(run.selected)}",
        *([f"- note: {run.note}"] if run.note else []),
        "",
        "## Results",
        "",
        *table_markdown(rows),
        "",
        "`ratio` is value / baseline; `meets` says whether the target holds (`-`: no target).",
        "",
    ]
    if planned:
        lines += ["## Not yet measured", ""]
        lines += [f"- group {number}: {text}" for number, text in sorted(planned.items())]
        lines.append("")
    missed = [r for r in rows if r.meets is False]
    if missed:
        lines += ["## Missed targets: where the time goes", ""]
        # Figures explained by the same lines (p50 and its ratio, say) share one section.
        explained: dict[tuple[str, ...], list[Result]] = {}
        for row in missed:
            where = next(
                (g.outcome.where[row.name] for g in groups if row.name in g.outcome.where), []
            )
            explained.setdefault(tuple(where), []).append(row)
        for explanation, named in explained.items():
            heading = "; ".join(
                f"{r.name}: {fmt(r.value)} {r.unit}"
                + (f" ({fmt(r.ratio)}x)" if r.target and r.target.metric == "ratio" else "")
                + f", target {r.target.text(r.unit) if r.target else '-'}"
                for r in named
            )
            lines += [f"### {heading}", ""]
            lines += [*(explanation or ("(the benchmark gave no breakdown for this figure)",)), ""]
    for g in groups:
        lines += [f"## Group {g.group}: {g.title}", ""]
        for section in g.outcome.sections:
            lines += [f"### {section.title}", "", *section.lines, ""]
    return "\n".join(lines).rstrip() + "\n"


def console_text(groups: Sequence[GroupReport]) -> str:
    """The table, then each group's details, for the terminal (markdown reads fine there)."""
    rows = [r for g in groups for r in g.outcome.results]
    parts = [table_text(rows), ""]
    for g in groups:
        for section in g.outcome.sections:
            if section.console:
                parts += [f"== {section.title}", *section.lines, ""]
    return "\n".join(parts)
