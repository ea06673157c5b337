"""`python -m faults.soak --minutes N --fault-every F [--seed S] [--jobs-per-minute J] [--keep]`
(`make soak`): the soak test of docs/reliability.md.

stdout carries the table and, as its last line, the JSON summary; progress goes to stderr.
Exit codes: 0 every promise held, 1 one did not, 2 the soak could not run (its stack did not
start or come back), 130 interrupted (Ctrl-C or SIGTERM; everything it started is stopped).
"""

from __future__ import annotations

import asyncio
import sys

from activities.log_setup import configure_logging
from faults.soak.options import parse_args
from faults.soak.report import json_line, table
from faults.soak.run import run_soak


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    configure_logging("INFO", json=False)
    print(
        f"soak: {options.minutes:g} min, a fault every ~{options.fault_every_s:g} s, "
        f"seed {options.seed} (rerun the same mix and faults with --seed {options.seed})",
        file=sys.stderr,
        flush=True,
    )
    try:
        result, evidence = asyncio.run(run_soak(options))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("soak: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"soak: could not run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(table(result, evidence.run))
    print(json_line(result, evidence.run), flush=True)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
