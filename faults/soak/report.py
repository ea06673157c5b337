"""The soak's output: one table for people, one JSON line for machines.

The table has a row per check (figure and verdict: `ok`, `FAIL`, or blank for a figure shown
for the record) with what went wrong indented under it. The JSON line is the last line of
stdout, `{"soak": {...}, "ok": ..., "checks": {name: {"ok", "figure", "value"}}}`.
"""

from __future__ import annotations

import json
from typing import Any

from faults.soak.audit import Audit, Check
from faults.soak.evidence import RunInfo

MAX_DETAILS = 15
LABEL_WIDTH = 40


def _verdict(check: Check) -> str:
    if check.ok is None:
        return ""
    return "ok" if check.ok else "FAIL"


def _title(run: RunInfo) -> str:
    pools = ", ".join(f"{name} ({kind})" for name, kind in run.pools.items())
    return (
        f"durable-comfy soak: {run.minutes:g} min of jobs, a fault every ~{run.fault_every_s:g} s, "
        f"seed {run.seed}, {run.jobs_per_minute:g} jobs/min on {pools}"
    )


def table(audit: Audit, run: RunInfo) -> str:
    rows = [(check.label, check.figure, _verdict(check), check.details) for check in audit.checks]
    figure_width = min(70, max(len(figure) for _, figure, _, _ in rows))
    rule = "-" * (LABEL_WIDTH + figure_width + 10)
    lines = [_title(run), rule, f"{'check':<{LABEL_WIDTH}}  {'figure':<{figure_width}}  verdict"]
    lines.append(rule)
    for label, figure, verdict, details in rows:
        lines.append(f"{label:<{LABEL_WIDTH}}  {figure:<{figure_width}}  {verdict}".rstrip())
        for detail in details[:MAX_DETAILS]:
            lines.append(f"    {detail}")
        if len(details) > MAX_DETAILS:
            lines.append(f"    ... and {len(details) - MAX_DETAILS} more (see the JSON line)")
    lines.append(rule)
    failed = [check.label for check in audit.failed]
    lines.append("PASS: every promise held" if audit.ok else f"FAIL: {'; '.join(failed)}")
    return "\n".join(lines)


def json_line(audit: Audit, run: RunInfo) -> str:
    summary: dict[str, Any] = {
        "soak": run.model_dump(mode="json"),
        "ok": audit.ok,
        "failed": [check.name for check in audit.failed],
        "checks": {
            check.name: {"ok": check.ok, "figure": check.figure, "value": check.value}
            for check in audit.checks
        },
    }
    return json.dumps(summary, separators=(",", ":"), sort_keys=False, default=str)
