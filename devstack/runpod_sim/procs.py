"""Child processes of the simulator (workers, per-worker ComfyUI simulators): each in its own
session, so it and everything it forks (the SDK's heartbeat process, a ComfyUI) form one process
group that is signalled by its id, never by name."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import structlog

log = structlog.get_logger("runpod_sim.procs")
# Real seconds to wait for a killed group's last members: a child orphaned by the SIGKILL (the
# runpod 1.7 SDK's heartbeat process) is a zombie until whoever adopts it reaps it, which can
# take a second or more.
GROUP_GONE_S = 5.0


class ChildProcess:
    def __init__(self, proc: asyncio.subprocess.Process, argv: Sequence[str]) -> None:
        self.proc = proc
        self.argv = list(argv)
        # start_new_session: the child leads its own group, whose id is its pid.
        self.pgid = proc.pid

    @classmethod
    async def spawn(
        cls, argv: Sequence[str], *, env: Mapping[str, str], cwd: Path, log_path: Path
    ) -> ChildProcess:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as out:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=cwd,
                env=dict(env),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        return cls(proc, argv)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait(self) -> int:
        return await self.proc.wait()

    def kill_group(self) -> None:
        """SIGKILL the whole group: what a container's death does to everything in it.

        Safe after the leader exited: while any member lives, its pgid cannot be reused."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signal.SIGKILL)

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    async def group_gone(self, within_s: float = GROUP_GONE_S) -> bool:
        """Wait until no process of the group is left (the leader must have been reaped): a
        worker is gone once nothing of its container remains."""
        deadline = time.monotonic() + within_s
        while self.group_alive():
            if time.monotonic() >= deadline:
                log.warning("process group outlived its kill", pgid=self.pgid)
                return False
            await asyncio.sleep(0.05)
        return True

    async def terminate(self, grace_s: float) -> None:
        """SIGTERM the leader (the runpod SDK finishes its in-flight job, then exits), SIGKILL the
        group after `grace_s`, and in any case sweep the group of whatever the leader left."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout=grace_s)
            except TimeoutError:
                log.warning("process ignored SIGTERM, killing its group", pid=self.pid)
        self.kill_group()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), timeout=5)
            await self.group_gone()
