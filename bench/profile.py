"""Where a process spends its CPU, by py-spy (a sampling profiler that attaches to a running
process by PID from outside: nothing in the measured code changes).

`record` runs `py-spy record --format raw` (collapsed stacks: `frame;frame;... count` per line)
for a while; `summarize` turns that into the functions with the most samples, on their own
(self) and with what they call (inclusive). Pure, so tests/tooling/test_bench_groups_2_5.py
checks it.
py-spy is a dev dependency (pyproject.toml); without it a benchmark says so instead of a profile.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench.results import fmt


def py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


@dataclass
class Profile:
    samples: int
    self_counts: Counter[str]
    inclusive_counts: Counter[str]


def _short(frame: str) -> str:
    """`run (activities/comfyui/follow.py:120)` -> `run (comfyui/follow.py)`: the function and
    the last two parts of its file, without the line (one row per function, not per line)."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = path.replace("\\", "/").split("/")
    return f"{name} ({'/'.join(parts[-2:])})" if path else name


# Samples that say nothing about the work: a thread waiting (its leaf is a wait), or the
# interpreter importing modules at start-up.
IDLE_LEAVES = (
    "Condition.wait (",
    "_worker (futures/thread.py)",
    "select (selectors.py)",
    "Event.wait (",
    "_wait_for_tstate_lock",
)
STARTUP = ("_find_and_load (", "_compile_bytecode (")


def parse_collapsed(text: str) -> Profile:
    """Idle and import-time samples are left out (IDLE_LEAVES, STARTUP)."""
    self_counts: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count_text = line.strip().rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_short(f) for f in stack.split(";") if f]
        if not frames or frames[-1].startswith(IDLE_LEAVES):
            continue
        if any(f.startswith(STARTUP) for f in frames):
            continue
        total += count
        self_counts[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    return Profile(total, self_counts, inclusive)


def summarize(text: str, top: int = 12, skip: tuple[str, ...] = ()) -> list[str]:
    """Markdown: the `top` functions by self samples and by inclusive samples (in % of all).
    `skip`: substrings of functions too generic to say anything inclusively (the event loop)."""
    profile = parse_collapsed(text)
    if profile.samples == 0:
        return ["(py-spy recorded no samples)"]

    def rows(counts: Counter[str], keep: bool) -> list[str]:
        chosen = [
            (name, n)
            for name, n in counts.most_common()
            if keep or not any(s in name for s in skip)
        ][:top]
        return [f"| {name} | {n} | {fmt(100 * n / profile.samples)}% |" for name, n in chosen]

    return [
        f"{profile.samples} samples on CPU (waiting threads and imports left out).",
        "",
        "| on CPU itself (self) | samples | share |",
        "|---|---|---|",
        *rows(profile.self_counts, keep=True),
        "",
        "| with what it calls (inclusive) | samples | share |",
        "|---|---|---|",
        *rows(profile.inclusive_counts, keep=False),
    ]


async def record(pid: int, seconds: float, out: Path, rate: int = 100) -> str | None:
    """py-spy's collapsed stacks of `pid` over `seconds` (all threads, idle ones left out), or
    None when py-spy is missing or failed (its error goes to `out` + '.err')."""
    binary = py_spy()
    if binary is None:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    err = out.with_suffix(out.suffix + ".err")
    with err.open("wb") as errors:
        proc = await asyncio.create_subprocess_exec(
            binary,
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(max(1, round(seconds))),
            "--rate",
            str(rate),
            "--format",
            "raw",
            "--nonblocking",
            "--output",
            str(out),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=errors,
            stderr=errors,
        )
        await proc.wait()
    return _read_profile(out) if proc.returncode == 0 else None


async def record_command(
    argv: list[str], out: Path, env: dict[str, str], cwd: Path, rate: int = 100
) -> tuple[str | None, bytes]:
    """Run `argv` under py-spy from its start: (collapsed stacks or None, its stdout)."""
    binary = py_spy()
    if binary is None:
        return None, b""
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = await asyncio.create_subprocess_exec(
        binary,
        "record",
        "--rate",
        str(rate),
        "--format",
        "raw",
        "--output",
        str(out),
        "--",
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=cwd,
    )
    stdout, _ = await proc.communicate()
    return (_read_profile(out) if proc.returncode == 0 else None), stdout


def _read_profile(out: Path) -> str | None:
    try:
        return out.read_text(errors="replace")
    except OSError:
        return None


def profile_lines(text: str | None, what: str, top: int = 12) -> list[str]:
    if text is None:
        return [f"(no profile of {what}: py-spy is not installed or could not attach)"]
    return [f"py-spy on {what}:", "", *summarize(text, top, skip=EVENT_LOOP)]


# Frames every asyncio stack goes through: inclusive counts of these say nothing.
EVENT_LOOP = (
    "run_forever",
    "_run_once",
    "_run (asyncio/events.py)",
    "run (asyncio/runners.py)",
    "run_until_complete",
    "<module>",
    "main (",
    "run_worker",
    "asyncio.run",
    "_run_code (",
    "_run_module_as_main (",
    "Thread._bootstrap",
    "Thread.run (",
    "Context.run (",
    "Handle._run (",
)
