"""Simulator-only fault injection (POST /sim/faults), so tests can make the ComfyUI side misbehave
on purpose. None of this exists in ComfyUI.

One-shot faults (`drop_ws_after_events`, `stall_ws_s`, `oom_next`, `cuda_error_next`,
`ignore_interrupt_s`) are taken by the next prompt that starts executing; `history_delay_ms` stays
until changed or reset. After a CUDA error every prompt fails the same way until POST /free or
POST /sim/reset.

`ignore_interrupt_s: X` makes that prompt deaf to interrupts: the first POST /interrupt that hits
it while it runs (its own prompt_id, or a global one) starts an X-second window; the request is
answered 200 as always, but every interrupt check inside the window (node boundaries, KSampler
steps) lets the prompt go on. The interrupt stays pending, so it lands at the first check after
the window: exactly what a real node without a progress hook (a model load, a big VAE decode)
does to an interrupt. If the prompt ends inside the window, the interrupt never lands. The
simulator logs "fault: ignoring interrupt" when the window opens.

Nodes that never check at all are not a fault: image nodes take `ms_per_megapixel` per megapixel
without checking, and SimSleep sleeps its `seconds` without checking.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

OOM_MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.65 GiB of "
    "which 1.12 GiB is free. Including non-PyTorch memory, this process has 22.51 GiB memory in "
    "use. Of the allocated memory 21.87 GiB is allocated by PyTorch, and 421.50 MiB is reserved "
    "by PyTorch but unallocated. (simulated by the durable-comfy ComfyUI simulator)"
)
OOM_TIPS = (
    "This error means you ran out of memory on your GPU.\n\nTIPS: If the workflow worked before "
    "you might have accidentally set the batch_size to a large number."
)
CUDA_ERROR_MESSAGE = (
    "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
    "asynchronously reported at some other API call, so the stacktrace below might be incorrect."
    "\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` "
    "to enable device-side assertions.\n(simulated by the durable-comfy ComfyUI simulator)"
)


class SimOutOfMemoryError(Exception):
    comfy_exception_type = "torch.OutOfMemoryError"


class SimCudaError(Exception):
    comfy_exception_type = "torch.AcceleratorError"


class FaultConfig(BaseModel):
    """The body of POST /sim/faults; fields left out keep their current value."""

    model_config = ConfigDict(extra="forbid")

    # Abort the TCP connection of the next prompt's socket after N events were sent to it,
    # counting from its execution_start (no close frame: the client sees an abrupt loss).
    drop_ws_after_events: int | None = Field(default=None, ge=1)
    # Drop every WebSocket event (all sockets) for X seconds, starting once
    # `stall_after_events` events of the next prompt reached its socket; execution continues.
    stall_ws_s: float | None = Field(default=None, gt=0)
    stall_after_events: int = Field(default=1, ge=0)
    # The next prompt fails at its first KSampler (or first executed node if it has none).
    oom_next: bool = False
    cuda_error_next: bool = False
    # The next prompt ignores interrupts until X s after the first one that hits it (see above).
    ignore_interrupt_s: float | None = Field(default=None, gt=0)
    # Delay between execution_success and the history entry being written (persistent).
    history_delay_ms: float | None = Field(default=None, ge=0)


@dataclass
class PromptFaults:
    """The one-shot faults one prompt took."""

    drop_after: int | None = None
    stall_s: float | None = None
    stall_after: int = 1
    oom: bool = False
    cuda_error: bool = False
    ignore_interrupt_s: float | None = None


class FaultState:
    def __init__(self) -> None:
        self.armed = FaultConfig()
        self.cuda_broken = False

    def arm(self, update: FaultConfig) -> None:
        changes = update.model_dump(exclude_unset=True)
        self.armed = self.armed.model_copy(update=changes)

    def take_for_prompt(self) -> PromptFaults:
        armed = self.armed
        taken = PromptFaults(
            drop_after=armed.drop_ws_after_events,
            stall_s=armed.stall_ws_s,
            stall_after=armed.stall_after_events,
            oom=armed.oom_next,
            cuda_error=armed.cuda_error_next or self.cuda_broken,
            ignore_interrupt_s=armed.ignore_interrupt_s,
        )
        if armed.cuda_error_next:
            self.cuda_broken = True
        self.armed = armed.model_copy(
            update={
                "drop_ws_after_events": None,
                "stall_ws_s": None,
                "oom_next": False,
                "cuda_error_next": False,
                "ignore_interrupt_s": None,
            }
        )
        return taken

    @property
    def history_delay_s(self) -> float:
        return (self.armed.history_delay_ms or 0) / 1000

    def recover(self) -> None:
        """What POST /free does in the simulator: a broken device works again."""
        self.cuda_broken = False

    def reset(self) -> None:
        self.armed = FaultConfig()
        self.cuda_broken = False

    def as_json(self) -> dict[str, object]:
        return {**self.armed.model_dump(), "cuda_broken": self.cuda_broken}
