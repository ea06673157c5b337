"""`python -m bench` (`make bench`): start the local stack, run the benchmarks, write results.

Options (make variables in brackets): `--only overhead,history` [BENCH] picks benchmarks (all by
default), `-n 30` [N] the measured repetitions where a benchmark repeats, `--warmup`,
`--history-steps`, `--latency-steps`, `--step-delay-ms` (the second simulator's time per step),
`--throughput-clients`, `--throughput-jobs`, `--recovery-heartbeat-s`, `--scale-jobs 100,300,1000`,
`--scale-serial-jobs`, `--offload-sizes 100,1024` (MiB; `100` skips the 1 GiB upload),
`--runpod-jobs 100` (group 9's running jobs per round), `--queue-slots 10`,
`--queue-rate-jobs 300`, `--queue-fair-jobs 300`, `--queue-priority-behind 1000`,
`--queue-backlog-jobs 2000`, `--queue-backlog-step-ms 10` (group 10, our queue; 100 lets the
simulator's slots set the backlog's pace instead of the machine's CPU),
`--batch-jobs 1000`, `--batch-reads 50` (group 11, batches), `--pools-jobs 24`,
`--pools-rounds 3` (group 12, pools of many servers),
`--keep` (leave the stack's temporary state and logs), `--note` [NOTE] (what else ran meanwhile,
recorded in RESULTS.md).
Writes bench/results.json and bench/RESULTS.md (or `--out DIR`). Exit code 1 when a benchmark
failed to run (its error is printed and written to RESULTS.md); a missed target is a result,
not a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

from activities.log_setup import configure_logging
from bench.outcome import BenchOptions, Outcome, Section
from bench.registry import PLANNED, UnknownBenchmark, select
from bench.report import GroupReport, Run, console_text, machine, results_json, results_markdown
from bench.stack import bench_stack

HERE = Path(__file__).resolve().parent


def _counts(text: str) -> tuple[int, ...]:
    """`100,300` -> (100, 300), sorted, each at least 1."""
    try:
        counts = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 100,300, not {text!r}") from None
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError(f"expected numbers of at least 1, not {text!r}")
    return counts


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--only", default=os.environ.get("BENCH", ""), help="e.g. overhead,history")
    defaults = BenchOptions()
    parser.add_argument("-n", type=int, default=defaults.n, help="measured repetitions")
    parser.add_argument(
        "--warmup", type=int, default=defaults.warmup, help="unmeasured rounds first"
    )
    parser.add_argument(
        "--history-steps", type=int, default=defaults.history_steps, help="group 6's job"
    )
    parser.add_argument(
        "--latency-steps", type=int, default=defaults.latency_steps, help="group 7's job"
    )
    parser.add_argument(
        "--step-delay-ms",
        type=int,
        default=defaults.timed_step_delay_ms,
        help="time per step of the second simulator (groups 6 and 7)",
    )
    parser.add_argument(
        "--throughput-clients", type=int, default=defaults.throughput_clients, help="group 2"
    )
    parser.add_argument(
        "--throughput-jobs",
        type=int,
        default=defaults.throughput_jobs,
        help="group 2: jobs each client runs, one after the other",
    )
    parser.add_argument(
        "--recovery-heartbeat-s",
        type=float,
        default=defaults.recovery_heartbeat_s,
        help="group 3: the killed job's policy.heartbeat_timeout_s",
    )
    parser.add_argument(
        "--scale-jobs",
        type=_counts,
        default=defaults.scale_jobs,
        help="group 4: batches of jobs at once on one worker, e.g. 100,300,1000",
    )
    parser.add_argument(
        "--scale-serial-jobs",
        type=int,
        default=defaults.scale_serial_jobs,
        help="group 4: jobs in the deep serial queue",
    )
    parser.add_argument(
        "--offload-sizes",
        type=_counts,
        default=defaults.offload_sizes_mib,
        help="group 5: output sizes in MiB (100 skips the 1 GiB one)",
    )
    parser.add_argument(
        "--runpod-jobs",
        type=int,
        default=defaults.runpod_jobs,
        help="group 9: running jobs per round on the RunPod path (a handler process each)",
    )
    parser.add_argument(
        "--queue-slots",
        type=int,
        default=defaults.queue_slots,
        help="group 10: max_running of the bounded pools",
    )
    parser.add_argument(
        "--queue-rate-jobs",
        type=int,
        default=defaults.queue_rate_jobs,
        help="group 10: jobs of the start-rate batch (a full queue drained)",
    )
    parser.add_argument(
        "--queue-fair-jobs",
        type=int,
        default=defaults.queue_fair_jobs,
        help="group 10: jobs of each of the two tenants in each fairness run",
    )
    parser.add_argument(
        "--queue-priority-behind",
        type=int,
        default=defaults.queue_priority_behind,
        help="group 10: jobs waiting ahead of the priority-1 job",
    )
    parser.add_argument(
        "--queue-backlog-jobs",
        type=int,
        default=defaults.queue_backlog_jobs,
        help="group 10: jobs of the backlog (RSS, history events, time to run them all)",
    )
    parser.add_argument(
        "--queue-backlog-step-ms",
        type=int,
        default=defaults.queue_backlog_step_ms,
        help="group 10: the backlog simulator's time per step (a job is 10 steps)",
    )
    parser.add_argument(
        "--batch-jobs",
        type=int,
        default=defaults.batch_jobs,
        help="group 11: jobs per phase (submitted one by one, 32 at once, as a batch; the "
        "batch read while they wait), at most 1000",
    )
    parser.add_argument(
        "--batch-reads",
        type=int,
        default=defaults.batch_reads,
        help="group 11: timed reads of the batch's status, while running and after",
    )
    parser.add_argument(
        "--pools-jobs",
        type=int,
        default=defaults.pools_jobs,
        help="group 12: jobs of 1 to 5 s spread over four servers (and round-robin)",
    )
    parser.add_argument(
        "--pools-rounds",
        type=int,
        default=defaults.pools_rounds,
        help="group 12: rounds of both sides of the spread (each side's median)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the stack's state and logs")
    parser.add_argument("--out", type=Path, default=HERE, help="where results.json/RESULTS.md go")
    parser.add_argument("--command", default=None, help="the command to record (make passes it)")
    parser.add_argument(
        "--note", default="", help="circumstances to record in RESULTS.md (what else ran)"
    )
    return parser.parse_args(argv)


async def bench(args: argparse.Namespace) -> int:
    benchmarks = select(args.only)
    options = BenchOptions(
        n=args.n,
        warmup=args.warmup,
        history_steps=args.history_steps,
        latency_steps=args.latency_steps,
        timed_step_delay_ms=args.step_delay_ms,
        throughput_clients=args.throughput_clients,
        throughput_jobs=args.throughput_jobs,
        recovery_heartbeat_s=args.recovery_heartbeat_s,
        scale_jobs=args.scale_jobs,
        scale_serial_jobs=args.scale_serial_jobs,
        offload_sizes_mib=args.offload_sizes,
        runpod_jobs=args.runpod_jobs,
        queue_slots=args.queue_slots,
        queue_rate_jobs=args.queue_rate_jobs,
        queue_fair_jobs=args.queue_fair_jobs,
        queue_priority_behind=args.queue_priority_behind,
        queue_backlog_jobs=args.queue_backlog_jobs,
        queue_backlog_step_ms=args.queue_backlog_step_ms,
        batch_jobs=args.batch_jobs,
        batch_reads=args.batch_reads,
        pools_jobs=args.pools_jobs,
        pools_rounds=args.pools_rounds,
    )
    command = args.command or shlex.join(["python", "-m", "bench", *sys.argv[1:]])
    host = machine()
    started = time.monotonic()
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    reports: list[GroupReport] = []
    failed = False
    print(
        f"bench: starting the local stack for {', '.join(b.name for b in benchmarks)}", flush=True
    )
    async with bench_stack(options, keep=args.keep) as ctx:
        for benchmark in benchmarks:
            print(f"bench: {benchmark.name} (group {benchmark.group}) ...", flush=True)
            began = time.monotonic()
            try:
                async with asyncio.timeout(benchmark.timeout_s):
                    outcome = await benchmark.run(ctx, options)
            except Exception as exc:  # one broken benchmark must not hide the others' figures
                failed = True
                traceback.print_exc()
                outcome = Outcome(
                    results=[],
                    sections=[Section(title=f"{benchmark.title}: FAILED", lines=[repr(exc)])],
                )
            print(f"bench: {benchmark.name} took {time.monotonic() - began:.0f} s", flush=True)
            reports.append(
                GroupReport(group=benchmark.group, title=benchmark.title, outcome=outcome)
            )
    host.load_after = os.getloadavg()
    run = Run(
        date=date,
        command=command,
        seconds=time.monotonic() - started,
        machine=host,
        selected=[b.name for b in benchmarks],
        note=args.note,
    )
    rows = [r for report in reports for r in report.outcome.results]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(results_json(rows))
    (args.out / "RESULTS.md").write_text(results_markdown(run, reports, PLANNED))
    print(console_text(reports))
    print(
        f"bench: wrote {args.out / 'results.json'} and {args.out / 'RESULTS.md'} "
        f"({run.seconds:.0f} s)"
    )
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    configure_logging("WARNING")
    try:
        sys.exit(asyncio.run(bench(args)))
    except UnknownBenchmark as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
