"""Runs queued prompts one at a time, emitting ComfyUI's WebSocket events in ComfyUI's order
(main.py prompt_worker + execution.PromptExecutor), and writes the history entries.

In parallel mode (simulator only, SimSettings.parallel > 1) several executors take prompts from
the one queue, each running one at a time with its own node cache and interrupt flag, and a
prompt's `progress_state` goes to its own client only (as from a server of its own)."""

from __future__ import annotations

import asyncio
import math
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import structlog

from .behaviours import BEHAVIOURS
from .faults import (
    CUDA_ERROR_MESSAGE,
    OOM_MESSAGE,
    OOM_TIPS,
    FaultState,
    PromptFaults,
    SimCudaError,
    SimOutOfMemoryError,
)
from .hub import Hub
from .nodes import REGISTRY
from .scheduling import CacheEntry, ExecutionList, is_link, signatures
from .settings import SimSettings
from .state import PromptQueue, QueueItem, SimStats
from .validation import full_type_name
from .values import format_value

log = structlog.get_logger("comfy_sim.executor")


class InterruptProcessingError(Exception):
    """comfy.model_management.InterruptProcessingException."""


def _now_ms() -> int:
    return int(time.time() * 1000)


def sim_option(extra_data: dict[str, Any], key: str, default: float) -> float:
    """A per-prompt override from extra_data.sim (a real ComfyUI ignores that key). A value that
    is not a finite number >= 0 falls back to the server's setting instead of failing the run."""
    options = extra_data.get("sim")
    if not isinstance(options, dict) or key not in options:
        return default
    try:
        value = float(options[key])
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        log.warning("ignoring bad extra_data.sim option", key=key, value=options[key])
        return default
    return value


@dataclass
class _Run:
    """One prompt's execution: what the node context and the events need."""

    executor: Executor
    prompt_id: str
    prompt: dict[str, Any]
    extra_data: dict[str, Any]
    client_id: str | None
    faults: PromptFaults
    step_delay_s: float
    ms_per_megapixel: float
    node_id: str = ""
    # While the ignore_interrupt_s fault holds interrupts back: until this time.monotonic().
    deaf_until: float | None = None
    fault_class: str | None = None  # where an OOM/CUDA fault strikes; None = first node run
    current_inputs: dict[str, list[Any]] = field(default_factory=dict)
    sigs: dict[str, str] = field(default_factory=dict)  # node_id -> cache signature
    messages: list[list[Any]] = field(default_factory=list)
    node_progress: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The history's `outputs`, in the order the nodes produced (or re-announced) them.
    ui_outputs: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def settings(self) -> SimSettings:
        return self.executor.settings

    def add_message(self, event: str, data: dict[str, Any], broadcast: bool) -> None:
        data = {**data, "timestamp": _now_ms()}
        self.messages.append([event, data])
        if self.client_id is not None or broadcast:
            self.executor.hub.send_sync(event, data, self.client_id)

    def to_client(self, event: str, data: dict[str, Any]) -> None:
        if self.client_id is not None:
            self.executor.hub.send_sync(event, data, self.client_id)

    def set_progress(self, node_id: str, state: str, value: float, maximum: float) -> None:
        """comfy_execution.progress + WebUIProgressHandler: `progress_state` is broadcast."""
        self.node_progress[node_id] = {"state": state, "value": value, "max": maximum}
        nodes = {
            nid: {
                **entry,
                "node_id": nid,
                "prompt_id": self.prompt_id,
                "display_node_id": nid,
                "parent_node_id": None,
                "real_node_id": nid,
            }
            for nid, entry in self.node_progress.items()
        }
        # In parallel mode each executor stands for a ComfyUI server of its own, whose sockets
        # are its prompt's client: the broadcast reaches that client only (else N prompts would
        # send every step to all N sockets, which N separate servers never do).
        parallel = self.settings.parallel > 1 and self.client_id is not None
        sid = self.client_id if parallel else None
        data = {"prompt_id": self.prompt_id, "nodes": nodes}
        self.executor.hub.send_sync("progress_state", data, sid)

    def check_interrupt(self) -> None:
        """comfy.model_management.throw_exception_if_processing_interrupted(): the only place an
        interrupt can land. A deaf prompt leaves the flag set, so it lands at a later check."""
        if not self.executor.interrupt_flag:
            return
        if self.deaf_until is not None and time.monotonic() < self.deaf_until:
            return
        self.executor.interrupt_flag = False
        raise InterruptProcessingError("Processing interrupted")

    async def progress(self, value: int, total: int) -> None:
        """The progress hook main.py installs: interrupt check, progress_state, then progress
        (to the prompt's client, or to everyone when the prompt has none)."""
        self.check_interrupt()
        self.set_progress(self.node_id, "running", value, total)
        event = {"value": value, "max": total, "prompt_id": self.prompt_id, "node": self.node_id}
        self.executor.hub.send_sync("progress", event, self.client_id)
        self.executor.stats.record_progress(self.prompt_id, self.node_id, value, total)
        await asyncio.sleep(0)


class Executor:
    def __init__(
        self,
        settings: SimSettings,
        queue: PromptQueue,
        hub: Hub,
        faults: FaultState,
        stats: SimStats,
    ) -> None:
        self.settings = settings
        self.queue = queue
        self.hub = hub
        self.faults = faults
        self.stats = stats
        self.cache: dict[str, CacheEntry] = {}
        self.client_id: str | None = None
        self.last_node_id: str | None = None
        self.running_prompt_id: str | None = None
        self.current: _Run | None = None
        self.interrupt_flag = False
        # None: no /free pending; else whether it asked for free_memory.
        self.free_requested: bool | None = None

    def interrupt(self) -> None:
        self.interrupt_flag = True
        run = self.current
        deaf_for = run.faults.ignore_interrupt_s if run is not None else None
        if run is not None and deaf_for is not None and run.deaf_until is None:
            run.deaf_until = time.monotonic() + deaf_for
            log.info("fault: ignoring interrupt", prompt_id=run.prompt_id, seconds=deaf_for)

    def request_free(self, free_memory: bool) -> None:
        """POST /free acts between prompts: now when idle, else after the running prompt."""
        self.free_requested = bool(self.free_requested) or free_memory
        if self.running_prompt_id is None:
            self._apply_free()

    def _apply_free(self) -> None:
        if self.free_requested is None:
            return
        if self.free_requested:  # free_memory also drops the node output cache
            self.cache.clear()
        self.free_requested = None
        self.faults.recover()

    async def run_forever(self) -> None:
        while True:
            item, task_id = await self.queue.get()
            try:
                await self.run_item(item, task_id)
            except Exception:
                # A simulator bug must not kill the worker: log it and keep serving the queue.
                log.exception("simulator failure while running a prompt", prompt_id=item[1])
                self.queue.running.pop(task_id, None)
                self.stats.ended_at[str(item[1])] = time.time()
                self.running_prompt_id = None
                self.current = None

    async def run_item(self, item: QueueItem, task_id: int) -> None:
        _number, prompt_id, prompt, extra_data, outputs = item
        started = time.perf_counter()
        self.stats.started_at[prompt_id] = time.time()
        self.stats.ended_at.pop(prompt_id, None)
        self.stats.progress_started(prompt_id)
        self.running_prompt_id = prompt_id
        self.interrupt_flag = False
        faults = self.faults.take_for_prompt()
        run = _Run(
            self,
            prompt_id,
            prompt,
            extra_data,
            extra_data.get("client_id"),
            faults,
            sim_option(extra_data, "step_delay_ms", self.settings.step_delay_ms) / 1000,
            sim_option(extra_data, "ms_per_megapixel", self.settings.ms_per_megapixel),
        )
        self.current = run
        self.client_id = run.client_id
        self.hub.watch_prompt(run.client_id, faults.drop_after, faults.stall_s, faults.stall_after)
        outcome, result = await self._execute(run, outputs)
        if outcome == "success":
            await asyncio.sleep(self.faults.history_delay_s)
        status = {
            "status_str": "success" if outcome == "success" else "error",
            "completed": outcome == "success",
            "messages": run.messages,
        }
        self.queue.task_done(task_id, result, status)
        self.stats.ended_at[prompt_id] = time.time()
        run.to_client("executing", {"node": None, "prompt_id": prompt_id})
        self.stats.executed[prompt_id] = outcome
        self.stats.executions[prompt_id] += 1
        self.running_prompt_id = None
        self.current = None
        log.info(
            "Prompt executed",
            prompt_id=prompt_id,
            outcome=outcome,
            seconds=round(time.perf_counter() - started, 3),
        )
        self._apply_free()

    async def _execute(self, run: _Run, outputs: list[str]) -> tuple[str, dict[str, Any]]:
        run.add_message("execution_start", {"prompt_id": run.prompt_id}, broadcast=False)
        sigs = run.sigs = signatures(run.prompt, outputs, self.settings)
        if self.settings.cache_none:
            self.cache.clear()
        wanted = set(sigs.values())
        self.cache = {key: entry for key, entry in self.cache.items() if key in wanted}
        cached = [nid for nid in run.prompt if nid in sigs and sigs[nid] in self.cache]
        run.add_message(
            "execution_cached", {"nodes": cached, "prompt_id": run.prompt_id}, broadcast=False
        )
        plan = ExecutionList(run.prompt, set(cached))
        for node_id in outputs:
            plan.add_node(node_id)
        if any(run.prompt[n]["class_type"] == "KSampler" for n in plan.pending if n not in cached):
            run.fault_class = "KSampler"
        executed: list[str] = []
        outcome = "success"
        while not plan.is_empty():
            node_id = plan.next_node()
            error = await self._run_node(run, node_id, sigs[node_id], executed)
            if error is not None:
                outcome = self._report(run, node_id, error, executed, cached)
                break
            plan.complete(node_id)
        else:
            run.add_message("execution_success", {"prompt_id": run.prompt_id}, broadcast=False)
        result: dict[str, Any] = {"outputs": {}, "meta": {}}
        for node_id, ui in run.ui_outputs.items():
            result["outputs"][node_id] = ui
            result["meta"][node_id] = {
                "node_id": node_id,
                "display_node": node_id,
                "parent_node": None,
                "real_node_id": node_id,
            }
        self.last_node_id = None
        return outcome, result

    async def _run_node(
        self, run: _Run, node_id: str, sig: str, executed: list[str]
    ) -> Exception | None:
        cached = self.cache.get(sig)
        if cached is not None:
            # A cached output node re-announces its old output, without `executing`. ComfyUI
            # copies it into the history only when the prompt has a client: a fully cached
            # prompt without client_id ends with empty history outputs.
            if run.client_id is not None and cached.ui is not None:
                run.ui_outputs[node_id] = cached.ui
            run.to_client(
                "executed",
                {
                    "node": node_id,
                    "display_node": node_id,
                    "output": cached.ui,
                    "prompt_id": run.prompt_id,
                },
            )
            run.set_progress(node_id, "finished", 1, 1)
            return None
        node = run.prompt[node_id]
        run.node_id = node_id
        run.current_inputs = {}
        run.set_progress(node_id, "running", 0.0, 1.0)  # floats, as start_progress() sets them
        try:
            inputs = self._inputs(run, node)
            run.current_inputs = {name: [format_value(v)] for name, v in inputs.items()}
            if run.client_id is not None:
                self.last_node_id = node_id
            run.to_client(
                "executing", {"node": node_id, "display_node": node_id, "prompt_id": run.prompt_id}
            )
            run.check_interrupt()  # nodes.before_node_execution()
            self._inject_fault(run, node["class_type"])
            result = await BEHAVIOURS[node["class_type"]](run, inputs)
        except InterruptProcessingError as ex:
            return ex
        except Exception as ex:
            log.error("!!! Exception during processing !!!", node_id=node_id, error=str(ex))
            return ex
        if result.ui:
            run.ui_outputs[node_id] = result.ui
            run.to_client(
                "executed",
                {
                    "node": node_id,
                    "display_node": node_id,
                    "output": result.ui,
                    "prompt_id": run.prompt_id,
                },
            )
        self.cache[sig] = CacheEntry(result.outputs, result.ui)
        maximum = run.node_progress[node_id]["max"]
        run.set_progress(node_id, "finished", maximum, maximum)
        executed.append(node_id)
        return None

    def _inputs(self, run: _Run, node: dict[str, Any]) -> dict[str, Any]:
        spec = REGISTRY[node["class_type"]]
        declared = set(spec.required) | set(spec.optional)
        values: dict[str, Any] = {}
        for name, value in node["inputs"].items():
            if name not in declared:
                continue
            if is_link(value):
                values[name] = self.cache[run.sigs[value[0]]].outputs[value[1]]
            else:
                values[name] = value
        return values

    def _inject_fault(self, run: _Run, class_type: str) -> None:
        """OOM / CUDA faults hit the prompt's first KSampler, or its first executed node."""
        faults = run.faults
        if not (faults.oom or faults.cuda_error):
            return
        if run.fault_class is not None and class_type != run.fault_class:
            return
        if faults.cuda_error:
            faults.cuda_error = False
            raise SimCudaError(CUDA_ERROR_MESSAGE)
        faults.oom = False
        raise SimOutOfMemoryError(OOM_MESSAGE)

    def _report(
        self, run: _Run, node_id: str, error: Exception, executed: list[str], cached: list[str]
    ) -> str:
        """PromptExecutor.handle_execution_error."""
        base = {
            "prompt_id": run.prompt_id,
            "node_id": node_id,
            "node_type": run.prompt[node_id]["class_type"],
            "executed": list(executed),
        }
        if isinstance(error, InterruptProcessingError):
            log.info("Processing interrupted", prompt_id=run.prompt_id, node_id=node_id)
            self.stats.interrupted.append(run.prompt_id)
            run.add_message("execution_interrupted", base, broadcast=True)
            return "interrupted"
        tips = OOM_TIPS if isinstance(error, SimOutOfMemoryError) else ""
        details = {
            "exception_message": f"{error}\n{tips}",
            "exception_type": full_type_name(error),
            "traceback": traceback.format_tb(error.__traceback__),
            "current_inputs": run.current_inputs,
            "current_outputs": list(cached),
        }
        run.add_message("execution_error", base | details, broadcast=False)
        return "error"
