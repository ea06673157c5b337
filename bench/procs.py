"""What a process costs, read from /proc by PID: CPU seconds (its own and its descendants'),
resident memory now (VmRSS) and at its peak (VmHWM), sampled over a benchmark's timed part.

The parsers are pure (tests/tooling/test_bench_groups_2_5.py); the readers return None for a
process that is gone, or off Linux.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

PROC = Path("/proc")
MIB = 1024 * 1024


def ticks_per_second() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError, AttributeError):
        return 100


def parse_stat(text: str) -> tuple[int, float]:
    """(ppid, utime + stime in ticks) from the text of /proc/PID/stat. The command name (field
    2) is in parentheses and may hold spaces or parentheses itself: split after the last ')'."""
    rest = text[text.rindex(")") + 2 :].split()
    # rest[0] is field 3 (state): ppid is field 4, utime 14, stime 15.
    return int(rest[1]), float(rest[11]) + float(rest[12])


def status_kib(text: str, field: str) -> int | None:
    """A `Name:   1234 kB` line of /proc/PID/status, in KiB (None when absent)."""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0])
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def cpu_seconds(pid: int | str) -> float | None:
    text = _read(PROC / str(pid) / "stat")
    return None if text is None else parse_stat(text)[1] / ticks_per_second()


def descendants(pid: int) -> list[int]:
    """Every live process under `pid` (children, their children, ...)."""
    parents: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        text = _read(entry / "stat")
        if text is None:
            continue
        with contextlib.suppress(ValueError, IndexError):
            parents.setdefault(parse_stat(text)[0], []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and its live descendants (0 for a process that is gone)."""
    return sum(cpu_seconds(p) or 0.0 for p in (pid, *descendants(pid)))


def rss_bytes(pid: int | str) -> int | None:
    text = _read(PROC / str(pid) / "status")
    kib = None if text is None else status_kib(text, "VmRSS")
    return None if kib is None else kib * 1024


def hwm_bytes(pid: int | str) -> int | None:
    text = _read(PROC / str(pid) / "status")
    kib = None if text is None else status_kib(text, "VmHWM")
    return None if kib is None else kib * 1024


def reset_hwm(pid: int | str = "self") -> bool:
    """Set VmHWM back to the current RSS (`echo 5 > /proc/PID/clear_refs`): the peak from here."""
    try:
        (PROC / str(pid) / "clear_refs").write_text("5")
    except OSError:
        return False
    return True


class RssSampler:
    """VmRSS of one process every `interval_s` while the block runs: its peak and its samples."""

    def __init__(self, pid: int, interval_s: float = 0.25) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.samples: list[int] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def peak(self) -> int:
        return max(self.samples, default=0)

    async def __aenter__(self) -> Self:
        self._sample()
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._sample()

    def _sample(self) -> None:
        rss = rss_bytes(self.pid)
        if rss is not None:
            self.samples.append(rss)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self._sample()


class CpuMeter:
    """CPU seconds a process tree used between two reads (`start`, then `seconds`)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.began = tree_cpu_seconds(pid)

    def seconds(self) -> float:
        return tree_cpu_seconds(self.pid) - self.began


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of ys over xs; needs two distinct xs."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError("a line needs at least two distinct points")
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    return slope, mean_y - slope * mean_x
