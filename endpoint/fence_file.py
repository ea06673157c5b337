"""The fence file: what the handler tells its watchdog (endpoint/watchdog.py) about the claim it
holds, on the worker's own disk.

The handler is the one who renews its claim's lease and stops its prompt when it cannot
(endpoint/fencing.py). A handler that is frozen (SIGSTOP, a deadlock, starved of CPU) does
neither, and its ComfyUI runs on while the lease lapses and another delivery takes the
submission over. So on every successful claim write the handler says here, for a process that
does not depend on it, until when the claim is surely its own:

    {"holding": true, "pid": 4242, "submission": "...", "prompt_id": "...", "lease_s": 60.0,
     "fence_after_s": 30.0, "fence_by": 1767225600.5}

`fence_by` is epoch seconds (time.time()): when the handler fences itself unless a renewal
succeeds first (the send time of its last successful claim write, plus the lease, less the
fence margin); while it is fencing, the lease's end. Past it (and a grace), the watchdog stops
the prompt and ends the worker. `{"holding": false}` once the claim is finished, lost or let go,
and at the handler's start. Each write replaces the file whole (a temporary file renamed over
it), so a reader never sees half of one.

An orchestrated job's handler also says where its claim and outputs are and whose the claim is
(`claim`), and when its lease ends (`lease_end`, epoch seconds, by the same reckoning as
`fence_by`): a prompt that finished while the handler was frozen has its outputs stored and
recorded in the claim by the watchdog (endpoint/salvage.py) instead of being run again. Both
are optional: a file without them (an older handler's) still parses, and its watchdog only
fences.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import structlog
from pydantic import BaseModel, ConfigDict, ValidationError

from protocol.runpod.contract import S3Target

log = structlog.get_logger(__name__)

DEFAULT_FENCE_FILE = Path("/tmp/durable-comfy-fence.json")


class ClaimPlace(BaseModel):
    """Where the held claim and its job's outputs are, and whose the claim is: what the
    watchdog needs to store a finished prompt's outputs at the keys the handler uses and to
    record them in the claim (endpoint/salvage.py)."""

    model_config = ConfigDict(extra="ignore")

    # The RunPod job id holding the claim (`Claim.holder`), and its worker.
    holder: str
    worker_id: str = ""
    claim_bucket: str
    claim_key: str
    # `protocol.keys.artifact_key(output_prefix, job_id, segment, node_id, filename)` in
    # `output_bucket`, as the handler's S3Sink keys outputs.
    output_bucket: str
    output_prefix: str
    job_id: str
    segment: int = 0
    # The run's own output folder (`Orchestration.run_tag`): an output in another run's is
    # refused, as the handler refuses it.
    run_tag: str = ""


class FenceState(BaseModel):
    """The fence file's content."""

    model_config = ConfigDict(extra="ignore")

    holding: bool = False
    pid: int | None = None
    submission: str | None = None
    prompt_id: str | None = None
    lease_s: float | None = None
    fence_after_s: float | None = None
    # Epoch seconds (time.time()); set whenever `holding`.
    fence_by: float | None = None
    # Epoch seconds: the lease's end as the handler reckons it (no later than on the S3
    # server); `fence_by` is no later than this.
    lease_end: float | None = None
    claim: ClaimPlace | None = None


def read_fence(path: Path) -> FenceState | None:
    """The state the file holds; None when there is no file or it is not one of ours."""
    try:
        return FenceState.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError) as exc:
        log.warning("fence_file_unreadable", path=str(path), error=str(exc))
        return None


class FenceFile:
    """The handler's writer of one fence file. A failure to write is logged, never raised: the
    watchdog is a second line; the handler's own fence (endpoint/fencing.py) is the first."""

    def __init__(self, path: Path, *, output: S3Target | None = None, run_tag: str = "") -> None:
        self.path = path
        # The job's output folder: with it (and the claim's place, from `holding`), the
        # watchdog can store a finished prompt's outputs.
        self.output = output
        self.run_tag = run_tag

    def holding(
        self,
        *,
        submission: str,
        prompt_id: str,
        lease_s: float,
        fence_after_s: float,
        fence_by: float,
        lease_end: float | None = None,
        holder: str | None = None,
        worker_id: str = "",
        claim_bucket: str | None = None,
        claim_key: str | None = None,
        job_id: str | None = None,
        segment: int = 0,
    ) -> None:
        """We hold the claim; unless we say more, fence by `fence_by` (epoch seconds). The
        lease's end (epoch seconds) and the claim's place, when given, let the watchdog salvage
        a prompt that finished while we were frozen."""
        place = None
        if self.output is not None and holder and claim_bucket and claim_key and job_id:
            place = ClaimPlace(
                holder=holder,
                worker_id=worker_id,
                claim_bucket=claim_bucket,
                claim_key=claim_key,
                output_bucket=self.output.bucket,
                output_prefix=self.output.prefix,
                job_id=job_id,
                segment=segment,
                run_tag=self.run_tag,
            )
        self._write(
            FenceState(
                holding=True,
                pid=os.getpid(),
                submission=submission,
                prompt_id=prompt_id,
                lease_s=lease_s,
                fence_after_s=fence_after_s,
                fence_by=fence_by,
                lease_end=lease_end,
                claim=place,
            )
        )

    def released(self) -> None:
        """No claim held (finished, lost or let go), or no prompt of one left to stop."""
        self._write(FenceState(holding=False))

    def _write(self, state: FenceState) -> None:
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text(state.model_dump_json(exclude_none=True))
            os.replace(temporary, self.path)
        except OSError as exc:
            log.warning("fence_file_not_written", path=str(self.path), error=str(exc))


def epoch_of(monotonic_at: float) -> float:
    """time.time() at the moment time.monotonic() read `monotonic_at`."""
    return time.time() - (time.monotonic() - monotonic_at)
