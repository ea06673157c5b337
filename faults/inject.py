"""Every fault the fault tooling injects, each implemented once here: the chaos tests
(tests/stack/test_chaos.py, tests/stack/test_runpod_chaos.py), `make demo-chaos` (demo.py) and
`make soak` (soak/injector.py) break things through this module and nowhere else.

- An orchestrator worker `kill -9`ed and started again in its slot (`crash_worker`).
- A service of a local stack (the Temporal dev server, SeaweedFS, the ComfyUI simulator)
  `kill -9`ed by its recorded PID and started again with the same flags, ports and data
  (`ServiceFaults`).
- A ComfyUI simulator's one-shot faults, each taken by the next prompt that starts there: its
  socket cut or stalled, an out-of-memory, interrupts ignored for a while (`ComfyFaults`).
- A RunPod simulator's faults, each taken by the next delivery or request: a worker crashed, its
  handler frozen, its worker cut off from S3, 429 or 5xx bursts, a `/run` answer dropped, a result
  lost (`RunpodFaults`).

A fault armed on a simulator comes back as a handle (`ArmedComfyFault`, `ArmedRunpodFault`) that
says whether something took it, whether it fired by the simulator's own word, and how to disarm
it: a fault that silently never fires makes a chaos run pass for the wrong reason.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import structlog

from devstack.comfy_sim.faults import FaultConfig as ComfyFaultConfig
from devstack.config import StackConfig
from devstack.models import ServiceState
from devstack.runpod_sim.faults import CrashFault, FreezeFault, PartitionFault, PublicRoute
from devstack.runpod_sim.faults import FaultConfig as RunpodFaultConfig
from devstack.runpod_sim.settings import DeathOutcome
from devstack.services import ServiceName
from devstack.stack import start_service, stop_service
from faults.wait import eventually
from faults.worker_proc import KillableWorker

log = structlog.get_logger("faults")

# What the ComfyUI simulator logs as each socket or interrupt fault fires.
DROP_LOGGED = "fault: dropping websocket"
STALL_LOGGED = "fault: stalling websocket delivery"
DEAF_LOGGED = "fault: ignoring interrupt"
# A service that failed to start (a port taken meanwhile, a slow probe) is tried again after this.
RETRY_AFTER_S = 2.0


class DidNotComeBack(RuntimeError):
    """What a fault took down could not be started again: whatever runs on it cannot go on."""


class LogWatch:
    """Watches a log file from "now" on, for the line that proves a fault really fired (the
    simulators log each one they inject); restarts append to the same file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def text(self) -> str:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def seen(self, needle: str) -> bool:
        return needle in self.text()

    async def wait(self, needle: str, *, timeout_s: float) -> None:
        async def probe() -> bool:
            return self.seen(needle)

        await eventually(probe, timeout_s=timeout_s, what=f"{self.path.name} logs {needle!r}")


# -- processes -------------------------------------------------------------------------------------


async def crash_worker(
    worker: KillableWorker,
    *,
    down_s: float = 0.0,
    attempts: int = 1,
    on_killed: Callable[[], object] | None = None,
) -> int:
    """`kill -9` the worker (no cleanup of any kind runs in it), then, `down_s` later, a new
    process in its slot: the replacement machine. Its PID; DidNotComeBack if it never started."""
    await worker.kill()
    if on_killed is not None:
        on_killed()
    await asyncio.sleep(down_s)
    last: Exception | None = None
    for _ in range(attempts):
        try:
            return await worker.start()
        except Exception as exc:
            last = exc
            log.warning("worker start failed", worker=worker.name, error=str(exc))
    raise DidNotComeBack(f"{worker.name} did not come back: {last}") from last


class ServiceFaults:
    """A local stack's services, by the PIDs devstack's launcher recorded: a kill takes the
    whole process group at once; a start uses the same flags, ports and data (Temporal its
    SQLite file, SeaweedFS its data directory) and waits until the service answers."""

    def __init__(self, config: StackConfig, base_dir: Path) -> None:
        self.config = config
        self.base_dir = base_dir

    async def kill(self, name: ServiceName, sig: signal.Signals = signal.SIGKILL) -> ServiceState:
        """SIGKILL by default: a crash, not a shutdown."""
        return await stop_service(self.config, self.base_dir, name, sig)

    async def start(self, name: ServiceName, *, attempts: int = 1) -> ServiceState:
        last: Exception | None = None
        for attempt in range(1, attempts + 1):
            try:
                return await start_service(self.config, self.base_dir, name)
            except Exception as exc:
                last = exc
                log.warning("service start failed", service=name, error=str(exc))
                if attempt < attempts:
                    await asyncio.sleep(RETRY_AFTER_S)
        raise DidNotComeBack(f"{name} did not come back: {last}") from last

    async def restart(
        self,
        name: ServiceName,
        *,
        down_s: float = 0.0,
        attempts: int = 1,
        on_killed: Callable[[], object] | None = None,
    ) -> ServiceState:
        """Killed, down for `down_s`, started again."""
        await self.kill(name)
        if on_killed is not None:
            on_killed()
        await asyncio.sleep(down_s)
        return await self.start(name, attempts=attempts)


# -- a ComfyUI simulator ---------------------------------------------------------------------------


@dataclass
class ArmedComfyFault:
    """A one-shot fault armed on a ComfyUI simulator."""

    sim: ComfyFaults
    field: str  # the simulator's field that holds it until a prompt takes it
    off: ComfyFaultConfig  # what disarms it
    needle: str | None  # the simulator's log line when it fires (None: it logs none)
    watch: LogWatch | None

    async def taken(self) -> bool:
        """A prompt took it (it may still end before the fault fires)."""
        return not (await self.sim.armed()).get(self.field)

    def fired(self) -> bool:
        return self._watch().seen(self._needle())

    async def wait_fired(self, *, timeout_s: float) -> None:
        await self._watch().wait(self._needle(), timeout_s=timeout_s)

    async def disarm(self) -> None:
        await self.sim.arm(self.off)

    def _watch(self) -> LogWatch:
        if self.watch is None:
            raise ValueError(f"{self.field}: no log file to tell whether it fired")
        return self.watch

    def _needle(self) -> str:
        if self.needle is None:
            raise ValueError(f"{self.field}: the simulator logs nothing when it fires")
        return self.needle


class ComfyFaults:
    """A ComfyUI simulator's one-shot faults (POST /sim/faults, devstack/comfy_sim/faults.py),
    each taken by the next prompt that starts executing there. With its `log_file`, whether each
    fired is read from its log."""

    def __init__(self, url: str, http: httpx.AsyncClient, log_file: Path | None = None) -> None:
        self.url = url.rstrip("/")
        self.http = http
        self.log_file = log_file

    async def arm(self, faults: ComfyFaultConfig) -> dict[str, Any]:
        """Fields left unset keep their value in the simulator."""
        body = faults.model_dump(mode="json", exclude_unset=True)
        response = await self.http.post(f"{self.url}/sim/faults", json=body, timeout=5.0)
        response.raise_for_status()
        armed: dict[str, Any] = response.json()
        return armed

    async def armed(self) -> dict[str, Any]:
        response = await self.http.get(f"{self.url}/sim/faults", timeout=5.0)
        response.raise_for_status()
        armed: dict[str, Any] = response.json()
        return armed

    async def cut_socket(self, *, after_events: int) -> ArmedComfyFault:
        """The next prompt's socket is aborted (no close frame) after that many events."""
        return await self._one_shot(
            ComfyFaultConfig(drop_ws_after_events=after_events),
            ComfyFaultConfig(drop_ws_after_events=None),
            DROP_LOGGED,
        )

    async def stall_socket(self, *, for_s: float, after_events: int = 1) -> ArmedComfyFault:
        """Every socket event is dropped for `for_s` once the next prompt's socket had that
        many; the prompt runs on."""
        return await self._one_shot(
            ComfyFaultConfig(stall_ws_s=for_s, stall_after_events=after_events),
            ComfyFaultConfig(stall_ws_s=None),
            STALL_LOGGED,
        )

    async def out_of_memory(self) -> ArmedComfyFault:
        """The next prompt fails with CUDA's out-of-memory error at its first sampler."""
        return await self._one_shot(
            ComfyFaultConfig(oom_next=True), ComfyFaultConfig(oom_next=False), None
        )

    async def ignore_interrupts(self, *, for_s: float) -> ArmedComfyFault:
        """The next prompt goes on for `for_s` after the first interrupt that hits it, as a node
        without a progress hook does."""
        return await self._one_shot(
            ComfyFaultConfig(ignore_interrupt_s=for_s),
            ComfyFaultConfig(ignore_interrupt_s=None),
            DEAF_LOGGED,
        )

    async def _one_shot(
        self, on: ComfyFaultConfig, off: ComfyFaultConfig, needle: str | None
    ) -> ArmedComfyFault:
        # Watched from before it is armed: a prompt may take it and log it at once.
        watch = LogWatch(self.log_file) if self.log_file is not None else None
        await self.arm(on)
        [field] = off.model_fields_set
        return ArmedComfyFault(self, field, off, needle, watch)


# -- a RunPod simulator ----------------------------------------------------------------------------


@dataclass
class ArmedRunpodFault:
    """A fault armed on a RunPod simulator."""

    sim: RunpodFaults
    name: str  # its field in the simulator's faults and its `taken` counter
    baseline: int  # that counter when it was armed
    off: RunpodFaultConfig  # what disarms it

    async def taken(self) -> bool:
        """A delivery or a request took it (a delivery fault then fires in that delivery,
        unless the delivery ends first)."""
        return await self.sim.taken(self.name) > self.baseline

    async def left(self) -> int:
        """Requests a burst or a count still answers so (0: done, or never a count)."""
        value = (await self.sim.state()).get(self.name)
        return value if isinstance(value, int) else 0

    async def disarm(self) -> None:
        await self.sim.arm(self.off)


class RunpodFaults:
    """A RunPod simulator's faults (POST /sim/faults, devstack/runpod_sim/faults.py). The three
    delivery faults (crash, freeze, partition) are taken by the `on_delivery`-th delivery from
    now and fire in it `after_s` simulator seconds or `after_progress` progress updates in; each
    fired one is an event of its worker in the ledger."""

    def __init__(self, base_url: str, http: httpx.AsyncClient | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = http

    async def arm(self, faults: RunpodFaultConfig | Mapping[str, Any]) -> dict[str, Any]:
        """Fields left unset keep their value in the simulator; the answer is its state."""
        config = RunpodFaultConfig.model_validate(faults)
        return await self._post("/sim/faults", config.model_dump(mode="json", exclude_unset=True))

    async def state(self) -> dict[str, Any]:
        """What is armed, and how often each fault was taken (`taken`)."""
        return await self._get("/sim/faults")

    async def reset(self) -> None:
        """Every fault disarmed (a worker frozen or cut off stays so until its own timer)."""
        await self._post("/sim/reset", {})

    async def taken(self, name: str) -> int:
        return int((await self.state()).get("taken", {}).get(name, 0))

    async def crash(
        self,
        outcome: DeathOutcome,
        *,
        after_s: float | None = None,
        after_progress: int | None = None,
        on_delivery: int = 1,
    ) -> ArmedRunpodFault:
        """That delivery's worker `kill -9`ed, its whole process group; its job then goes
        TIMED_OUT, is delivered again, or stays IN_PROGRESS (`outcome`)."""
        when = _when(on_delivery, after_s, after_progress)
        fault = CrashFault(outcome=outcome, **when)
        return await self._armed("crash", RunpodFaultConfig(crash=fault))

    async def freeze(
        self, *, after_s: float, thaw_after_s: float | None, on_delivery: int = 1
    ) -> ArmedRunpodFault:
        """That delivery's handler SIGSTOPped, thawed after `thaw_after_s` (None: never)."""
        fault = FreezeFault(**_when(on_delivery, after_s, None), thaw_after_s=thaw_after_s)
        return await self._armed("freeze", RunpodFaultConfig(freeze=fault))

    async def partition(
        self, *, after_s: float, heal_after_s: float | None, on_delivery: int = 1
    ) -> ArmedRunpodFault:
        """That delivery's worker cut off from S3, healed after `heal_after_s` (None: never)."""
        fault = PartitionFault(**_when(on_delivery, after_s, None), heal_after_s=heal_after_s)
        return await self._armed("partition", RunpodFaultConfig(partition=fault))

    async def burst_429(
        self, count: int, *, routes: Sequence[PublicRoute] | None = None
    ) -> ArmedRunpodFault:
        """The next `count` public API requests (of `routes`; None: any) answered 429."""
        config = RunpodFaultConfig(burst_429=count, burst_429_routes=_routes(routes))
        return await self._armed("burst_429", config)

    async def burst_5xx(
        self, count: int, *, status: int = 503, routes: Sequence[PublicRoute] | None = None
    ) -> ArmedRunpodFault:
        """The next `count` public API requests (of `routes`; None: any) answered `status`."""
        config = RunpodFaultConfig(
            burst_5xx=count, burst_5xx_status=status, burst_5xx_routes=_routes(routes)
        )
        return await self._armed("burst_5xx", config)

    async def drop_run_answer(self, count: int = 1) -> ArmedRunpodFault:
        """The next `count` /run requests create their job, then lose the connection."""
        return await self._armed("drop_run_answer", RunpodFaultConfig(drop_run_answer=count))

    async def lost_result(self, count: int = 1) -> ArmedRunpodFault:
        """The next `count` final results refused; their jobs COMPLETED without output."""
        return await self._armed("lost_result", RunpodFaultConfig(lost_result=count))

    async def _armed(self, name: str, config: RunpodFaultConfig) -> ArmedRunpodFault:
        baseline = await self.taken(name)
        await self.arm(config)
        # A count disarms at 0, a delivery fault at None.
        off = {name: 0 if isinstance(getattr(config, name), int) else None}
        return ArmedRunpodFault(self, name, baseline, RunpodFaultConfig.model_validate(off))

    async def _get(self, path: str) -> dict[str, Any]:
        return await self._request("GET", path, None)

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._request("POST", path, body)

    async def _request(self, method: str, path: str, body: Any) -> dict[str, Any]:
        url = f"{self.base_url}{path}"
        if self.http is not None:
            response = await self.http.request(method, url, json=body)
        else:
            async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
                response = await http.request(method, url, json=body)
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        return answer


def _when(on_delivery: int, after_s: float | None, after_progress: int | None) -> dict[str, Any]:
    """A delivery fault's timing, only what was given (the simulator's default: 1 s in)."""
    when: dict[str, Any] = {"on_delivery": on_delivery}
    if after_s is not None:
        when["after_s"] = after_s
    if after_progress is not None:
        when["after_progress"] = after_progress
    return when


def _routes(routes: Sequence[PublicRoute] | None) -> list[PublicRoute] | None:
    return None if routes is None else list(routes)
