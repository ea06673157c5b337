"""The worker's watchdog: ends a worker whose handler holds a claim it no longer renews.

    python endpoint/watchdog.py --pid <PID of the process to end>

run with the endpoint venv's python, in a session of its own (`setsid`: a signal to the
handler's process group does not reach it), beside the handler; endpoint/start.sh starts it.
Environment: `COMFY_URL` (default http://127.0.0.1:8188), `COMFY_PID` (ComfyUI's process, to
kill when the prompt will not stop; optional), `DURABLE_COMFY_FENCE_FILE` (default
/tmp/durable-comfy-fence.json), and the handler's bucket settings (`BUCKET_ENDPOINT_URL`,
`BUCKET_ACCESS_KEY_ID`, `BUCKET_SECRET_ACCESS_KEY`, ...: endpoint/settings.py; without them there
is no salvage). It exits by itself once `--pid` is gone.

Why: the handler fences itself when it cannot renew its claim (endpoint/fencing.py), but a
handler that is frozen (SIGSTOP, a deadlock, starved of CPU) cannot, and its ComfyUI runs the
prompt on while another delivery takes the submission over and runs it too. The handler writes
the fence file (endpoint/fence_file.py) on every successful claim write, saying until when
(`fence_by`) the claim is surely its own. The watchdog reads it every POLL_S; once the file says
`holding` and `fence_by` is more than a grace past (so that the handler's own fence goes first:
a fencing handler moves `fence_by` to its lease's end), it

1. posts ComfyUI's prompt-scoped `/interrupt` and deletes the prompt from the pending queue;
2. waits for `/queue` to hold the prompt no more (the interrupt again every second: interrupts
   are cooperative), for at most the stop wait;
3. SIGKILLs `COMFY_PID` if the prompt is still there (or ComfyUI did not say);
4. SIGKILLs `--pid`, the container's main process: the container exits and RunPod stops
   billing and replaces the worker;
5. when the prompt had left the queue, salvages it (endpoint/salvage.py): a prompt that
   finished with success while the handler was frozen has its outputs stored at the handler's
   keys and recorded in the claim, with a fence (`action: ended`), so that the orchestrator
   completes the job from the claim instead of running the graph again;

and exits. Each HTTP call of steps 1 to 3 is cut off at what is left of the stop wait. A SIGTERM
during the salvage (a worker's companions are stopped once its main process is gone) waits for
it, which ends by its deadline.

The bound. `fence_by` is no later than the lease's end as the S3 server sees it (the handler
reckons its lease from when it sent its last successful write, before the server stamped it).
The watchdog sees `fence_by` pass within POLL_S + grace, then spends at most the stop wait, so
it is done by

    lease end + POLL_S + min(GRACE_S, fence_after_s / 4) + min(STOP_WAIT_S, fence_after_s / 4)

that is at most 7.5 s after the lease's end by default, and never more than half of
`fence_after_s` plus POLL_S, while a takeover waits until the lease has run out by
`fence_after_s` plus a second (endpoint/claims.py). It reads the local wall clock, as the
handler wrote it: a step of that clock between a write and its reading shifts the bound by the
step.

The salvage does not move that bound: it comes after the prompt is known to be gone from
ComfyUI and the handler is dead, so nothing of the submission runs on here meanwhile. It ends
by the lease's end plus `fence_after_s` less a margin (salvage.SALVAGE_MARGIN_S), before anyone
may take the claim over, and its claim write is guarded by If-Match on a claim it read still
held by this handler: a takeover meanwhile wins, and the salvage writes nothing over it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

# Run as a script, Python puts endpoint/ (not the repository or image root) on sys.path; the
# watchdog imports `endpoint.*` and the shared `activities.*` modules from that root.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import httpx  # noqa: E402
import structlog  # noqa: E402

from endpoint.comfy import process_alive  # noqa: E402
from endpoint.errors import SettingsError  # noqa: E402
from endpoint.fence_file import DEFAULT_FENCE_FILE, FenceState, read_fence  # noqa: E402
from endpoint.logs import configure_logging  # noqa: E402
from endpoint.salvage import salvage  # noqa: E402
from endpoint.settings import DEFAULT_COMFY_URL, BucketSettings, EndpointSettings  # noqa: E402
from protocol.comfyui.client import ComfyClient  # noqa: E402
from protocol.errors import ComfyError  # noqa: E402

log = structlog.get_logger("endpoint.watchdog")

T = TypeVar("T")

# How often the fence file (and --pid) is looked at.
POLL_S = 0.5
# How long past `fence_by` the handler's own fence may take to show (it moves `fence_by` to
# its lease's end when it starts): at most a quarter of the job's fence_after_s.
GRACE_S = 2.0
# How long the prompt gets to leave ComfyUI after the interrupt before ComfyUI is killed: at
# most a quarter of the job's fence_after_s.
STOP_WAIT_S = 5.0
# Between looks at /queue, and between interrupts.
CHECK_S = 0.2
INTERRUPT_AGAIN_S = 1.0


@dataclass(frozen=True)
class Watch:
    pid: int
    fence_file: Path
    comfy_url: str
    comfy_pid: int | None = None
    poll_s: float = POLL_S
    # The handler's bucket settings: without them, no salvage.
    bucket: BucketSettings | None = None


def grace_s(state: FenceState) -> float:
    return min(GRACE_S, _quarter(state))


def stop_wait_s(state: FenceState) -> float:
    return min(STOP_WAIT_S, _quarter(state))


def _quarter(state: FenceState) -> float:
    return state.fence_after_s / 4 if state.fence_after_s else GRACE_S


async def watch(config: Watch) -> str:
    """Until `--pid` is gone ("pid_gone") or the worker has been ended ("fenced")."""
    log.info(
        "watchdog_started",
        pid=config.pid,
        fence_file=str(config.fence_file),
        comfy_url=config.comfy_url,
        comfy_pid=config.comfy_pid,
        salvage=config.bucket is not None,
    )
    while True:
        if not process_alive(config.pid):
            log.info("watchdog_exiting", reason="the process it watches is gone", pid=config.pid)
            return "pid_gone"
        state = read_fence(config.fence_file)
        if state is not None and state.holding and state.fence_by is not None:
            late_s = time.time() - state.fence_by
            if late_s > grace_s(state):
                await end_worker(config, state, late_s)
                return "fenced"
        await asyncio.sleep(config.poll_s)


async def end_worker(config: Watch, state: FenceState, late_s: float) -> None:
    """Stop the prompt the frozen handler holds, kill ComfyUI if it will not let go, then end
    the worker's main process; then salvage the prompt if it had left the queue."""
    bound = log.bind(submission=state.submission, prompt_id=state.prompt_id)
    bound.warning(
        "watchdog_fencing",
        late_s=round(late_s, 1),
        handler_pid=state.pid,
        pid=config.pid,
        lease_s=state.lease_s,
        fence_after_s=state.fence_after_s,
    )
    deadline = time.monotonic() + stop_wait_s(state)
    held: bool | None = None  # None: ComfyUI did not say
    if state.prompt_id:
        held = await stop_prompt(config.comfy_url, state.prompt_id, deadline, bound)
    if held is False:
        bound.info("watchdog_prompt_gone")
    elif config.comfy_pid is not None:
        _kill(config.comfy_pid, "comfyui", bound, prompt_held=held)
    else:
        bound.warning("watchdog_comfyui_not_killed", reason="COMFY_PID unknown", prompt_held=held)
    salvaging = held is False and config.bucket is not None and state.claim is not None
    if salvaging:
        # Before the kill: the handler's end is what brings the SIGTERM (its companions go).
        _defer_sigterm(bound)
    # First the handler, dead before the salvage starts: nothing of it writes the claim or
    # the outputs any more.
    killed = _kill(config.pid, "worker", bound)
    if not salvaging:
        return
    try:
        if not killed:
            bound.warning("watchdog_salvage_skipped", reason="the handler may live on")
        elif config.bucket is not None:
            await salvage(state, config.comfy_url, config.bucket, bound)
    except Exception:
        # The worker is ended already; a salvage that breaks only costs a rerun.
        bound.exception("watchdog_salvage_failed")
    finally:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)


def _defer_sigterm(bound: Any) -> None:
    """A SIGTERM waits for the salvage (which ends by its deadline); a SIGKILL does not."""

    def deferred() -> None:
        bound.warning("watchdog_sigterm_deferred", reason="salvaging; it ends by its deadline")

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, deferred)


async def stop_prompt(url: str, prompt_id: str, deadline: float, bound: Any) -> bool | None:
    """Interrupt and dequeue the prompt, then wait for ComfyUI to let go of it until
    `deadline` (time.monotonic()). False: it is gone; True: still held; None: no answer."""
    async with httpx.AsyncClient(timeout=STOP_WAIT_S, trust_env=False) as http:
        client = ComfyClient(url, http)
        held: bool | None = None
        interrupted_at = float("-inf")
        while True:
            if time.monotonic() - interrupted_at >= INTERRUPT_AGAIN_S:
                interrupted_at = time.monotonic()
                interrupted = await _within(_interrupt(client, prompt_id), deadline)
                await _within(client.delete_pending(prompt_id), deadline)
                bound.info("watchdog_interrupt_sent", answered=interrupted is not None)
            place = await _within(client.queue_place(prompt_id), deadline)
            if place is not None:
                held = place.where is not None
                if not held:
                    return False
            if time.monotonic() + CHECK_S >= deadline:
                return held
            await asyncio.sleep(CHECK_S)


async def _interrupt(client: ComfyClient, prompt_id: str) -> bool:
    await client.interrupt(prompt_id)
    return True


async def _within(call: Awaitable[T], deadline: float) -> T | None:
    """`call`'s answer, or None when ComfyUI failed or the deadline came first."""
    left = deadline - time.monotonic()
    if left <= 0:
        if asyncio.iscoroutine(call):
            call.close()
        return None
    try:
        async with asyncio.timeout(left):
            return await call
    except (TimeoutError, ComfyError, ValueError):
        return None


def _kill(pid: int, what: str, bound: Any, **facts: object) -> bool:
    """SIGKILL `pid`; False when that was refused (it may live on)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        bound.info("watchdog_already_gone", process=what, pid=pid)
        return True
    except PermissionError as exc:
        bound.error("watchdog_kill_refused", process=what, pid=pid, error=str(exc))
        return False
    bound.warning("watchdog_killed", process=what, pid=pid, **facts)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="End this worker when its handler holds a claim it no longer renews."
    )
    parser.add_argument("--pid", type=int, required=True, help="the process to end")
    args = parser.parse_args(argv)
    configure_logging()
    comfy_pid = os.environ.get("COMFY_PID")
    config = Watch(
        pid=args.pid,
        fence_file=Path(os.environ.get("DURABLE_COMFY_FENCE_FILE") or DEFAULT_FENCE_FILE),
        comfy_url=os.environ.get("COMFY_URL") or DEFAULT_COMFY_URL,
        comfy_pid=int(comfy_pid) if comfy_pid else None,
        bucket=_bucket_from_env(),
    )
    asyncio.run(watch(config))
    return 0


def _bucket_from_env() -> BucketSettings | None:
    """The handler's bucket, as the handler reads it; None (said once) without one."""
    try:
        bucket = EndpointSettings.from_env().bucket
    except SettingsError as exc:
        log.warning(
            "watchdog_salvage_off", reason="the handler's settings are not usable", error=str(exc)
        )
        return None
    if bucket is None:
        log.info("watchdog_salvage_off", reason="no bucket settings (BUCKET_ENDPOINT_URL)")
    return bucket


if __name__ == "__main__":
    sys.exit(main())
