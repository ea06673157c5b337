"""The benchmark harness's pure parts: percentiles, ratios, targets, the table and the files it
writes. No stack, no timing: `make bench` measures, these only check the arithmetic and format."""

from __future__ import annotations

import json

import pytest

from bench.outcome import Outcome, Section
from bench.registry import BENCHMARKS, PLANNED, UnknownBenchmark, select
from bench.report import (
    GroupReport,
    Machine,
    Run,
    console_text,
    results_json,
    results_markdown,
    table_text,
)
from bench.results import Target, fmt, percentile, result


def test_percentile_interpolates_between_closest_ranks() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([10.0, 20.0], 95) == pytest.approx(19.5)
    assert percentile([7.0], 95) == 7.0
    assert percentile([1.0, 2.0, 3.0], 0) == 1.0 and percentile([1.0, 2.0, 3.0], 100) == 3.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_result_computes_ratio_and_whether_the_target_is_met() -> None:
    row = result("x.added", 150.0, "ms", baseline=50.0, target=Target(limit=100))
    assert (row.ratio, row.meets) == (3.0, False)
    on_ratio = result("x.vs", 150.0, "ms", baseline=50.0, target=Target(metric="ratio", limit=3))
    assert on_ratio.meets is True  # 3.0 <= 3
    at_least = result("x.tp", 0.4, "ratio", target=Target(op=">=", limit=0.5))
    assert at_least.meets is False
    assert result("x.bare", 5.0, "ms").model_dump() == {
        "name": "x.bare",
        "value": 5.0,
        "unit": "ms",
        "baseline": None,
        "ratio": None,
        "target": None,
        "meets": None,
    }


def test_a_ratio_target_without_a_usable_baseline_is_undecided() -> None:
    target = Target(metric="ratio", limit=2.5)
    assert result("x", 10.0, "ms", target=target).meets is None
    assert result("x", 10.0, "ms", baseline=0.0, target=target).ratio is None


def test_targets_and_numbers_read_short() -> None:
    assert Target(limit=100).text("ms") == "<= 100 ms"
    assert Target(metric="ratio", limit=2.5).text("ms") == "<= 2.50x baseline"
    assert Target(op=">=", limit=0.9).text("") == ">= 0.9"
    assert [fmt(x) for x in (None, 138.0, 138.44, 27.35, 5.123, 0.01234)] == [
        "-",
        "138",
        "138",
        "27.4",
        "5.12",
        "0.0123",
    ]


def _report() -> tuple[Run, list[GroupReport]]:
    rows = [
        result("overhead.added_p50", 140.0, "ms", baseline=28.0, target=Target(limit=100)),
        result(
            "overhead.added_vs_bare",
            140.0,
            "ms",
            baseline=28.0,
            target=Target(metric="ratio", limit=2.5),
        ),
        result("overhead.bare_p50", 28.0, "ms"),
        result("history.events", 120.0, "events", baseline=55.0, target=Target(limit=150)),
    ]
    groups = [
        GroupReport(
            group=1,
            title="Overhead",
            outcome=Outcome(
                results=rows[:3],
                sections=[
                    Section(title="Round trips", lines=["- workflow tasks: 7"]),
                    Section(title="Event by event", lines=["| 0 | started |"], console=False),
                ],
                where={
                    "overhead.added_p50": ["workflow code: 112 ms"],
                    "overhead.added_vs_bare": ["workflow code: 112 ms"],
                },
            ),
        ),
        GroupReport(group=6, title="History", outcome=Outcome(results=rows[3:])),
    ]
    run = Run(
        date="2025-01-01 12:00 UTC",
        command="make bench N=30",
        seconds=95.0,
        machine=Machine(
            cores=2,
            cpu="Some CPU",
            ram_gib=23.4,
            python="3.11.7",
            system="Linux 6",
            load_before=(1.0, 0.5, 0.25),
            load_after=(2.0, 1.0, 0.5),
        ),
        selected=["overhead", "history"],
        note="a test suite ran beside it",
    )
    return run, groups


def test_results_json_is_a_list_of_exactly_the_seven_fields() -> None:
    _, groups = _report()
    rows = [r for g in groups for r in g.outcome.results]
    data = json.loads(results_json(rows))
    assert [set(row) for row in data] == [
        {"name", "value", "unit", "baseline", "ratio", "target", "meets"}
    ] * 4
    assert data[0]["target"] == {"metric": "value", "op": "<=", "limit": 100.0}
    assert (data[0]["ratio"], data[0]["meets"], data[3]["meets"]) == (5.0, False, True)


def test_results_markdown_has_the_table_the_run_and_a_section_per_missed_target() -> None:
    run, groups = _report()
    text = results_markdown(run, groups, {2: "Throughput: jobs per second"})
    assert "`make bench N=30`" in text
    assert "- note: a test suite ran beside it" in text
    assert "2 cores (Some CPU), 23.4 GiB RAM, Python 3.11.7" in text
    assert "1.00 / 0.50 / 0.25 before, 2.00 / 1.00 / 0.50 after" in text
    assert "| name | value | unit | baseline | ratio | target | meets |" in text
    assert "| overhead.added_p50 | 140 | ms | 28 | 5x | <= 100 ms | NO |" in text
    assert "| history.events | 120 | events | 55 | 2.18x | <= 150 events | yes |" in text
    assert "## Not yet measured\n\n- group 2: Throughput: jobs per second" in text
    missed = text.split("## Missed targets: where the time goes")[1]
    # The two figures the same lines explain share one section.
    assert (
        "### overhead.added_p50: 140 ms, target <= 100 ms; overhead.added_vs_bare: 140 ms (5x), "
        "target <= 2.50x baseline\n\nworkflow code: 112 ms\n\n##"
    ) in missed
    assert "### history.events" not in missed  # met: no section
    assert "### Event by event\n\n| 0 | started |" in text  # every section is in the file


def test_the_console_shows_the_table_and_only_the_short_sections() -> None:
    _, groups = _report()
    text = console_text(groups)
    assert text.startswith(table_text([r for g in groups for r in g.outcome.results]))
    assert "== Round trips" in text and "Event by event" not in text
    header, first = table_text([r for g in groups for r in g.outcome.results]).splitlines()[:2]
    assert header.split() == ["name", "value", "unit", "baseline", "ratio", "target", "meets"]
    assert first.split()[:2] == ["overhead.added_p50", "140"]


def test_benchmarks_are_selected_by_name_in_registry_order() -> None:
    assert [b.name for b in select(None)] == [b.name for b in BENCHMARKS]
    assert [b.name for b in select("client_latency, overhead")] == ["overhead", "client_latency"]
    with pytest.raises(UnknownBenchmark, match="nope"):
        select("overhead,nope")
    measured = {b.group for b in BENCHMARKS}
    # Groups 1 to 12: the first seven, the push path (8), the RunPod path (9), our queue (10),
    # batches (11), pools of many servers (12).
    assert measured.isdisjoint(PLANNED) and measured | set(PLANNED) == set(range(1, 13))
    assert [b.name for b in select("batch")] == ["batch"]
    assert len({b.name for b in BENCHMARKS}) == len(BENCHMARKS)
