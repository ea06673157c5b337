"""POST /prompt validation, following ComfyUI's execution.validate_prompt / validate_inputs: same
error types, messages, details and extra_info, and the same tolerance (a prompt with one good
output runs it and reports the bad ones in node_errors).

One deliberate difference: a dependency cycle. ComfyUI recurses until Python's recursion limit
and answers a `prompt_outputs_failed_validation` whose node_errors may be empty; the simulator
answers the same top-level type with a `dependency_cycle` error on every node of the cycle.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any

from .files import input_file_exists
from .nodes import REGISTRY, NodeSpec
from .settings import SimSettings

Error = dict[str, Any]


@dataclass
class ValidationResult:
    ok: bool
    error: Error | None
    outputs: list[str]
    node_errors: dict[str, Any]


def full_type_name(exc: BaseException) -> str:
    kind = type(exc)
    override = getattr(exc, "comfy_exception_type", None)
    if isinstance(override, str):
        return override
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def _error(kind: str, message: str, details: str, **extra: Any) -> Error:
    return {"type": kind, "message": message, "details": details, "extra_info": extra}


def types_match(received: Any, expected: Any) -> bool:
    """comfy_execution.validation.validate_node_input (non-strict)."""
    if received == expected:
        return True
    if not isinstance(received, str) or not isinstance(expected, str):
        return False
    got = {t.strip() for t in received.split(",")}
    want = {t.strip() for t in expected.split(",")}
    return "*" in got or "*" in want or bool(got & want)


def _custom_check(spec: NodeSpec, name: str, value: Any, settings: SimSettings) -> str | bool:
    """The VALIDATE_INPUTS hooks: LoadImage needs the file; any checkpoint name is accepted."""
    if spec.name == "LoadImage" and name == "image":
        if not isinstance(value, str) or not input_file_exists(value, settings):
            return f"Invalid image file: {value}"
    return True


@dataclass
class _Validator:
    prompt: dict[str, Any]
    settings: SimSettings
    validated: dict[str, tuple[bool, list[Error], str]] = field(default_factory=dict)
    stack: list[str] = field(default_factory=list)
    cycle_errors: dict[str, list[Error]] = field(default_factory=dict)

    def node(self, unique_id: str) -> tuple[bool, list[Error], str]:
        if unique_id in self.validated:
            return self.validated[unique_id]
        self.stack.append(unique_id)
        try:
            result = self._node(unique_id)
        finally:
            self.stack.pop()
        self.validated[unique_id] = result
        return result

    def _node(self, unique_id: str) -> tuple[bool, list[Error], str]:
        inputs = self.prompt[unique_id]["inputs"]
        spec = REGISTRY[self.prompt[unique_id]["class_type"]]
        declared = spec.input_types(self.settings)
        categories = {name: "required" for name in declared["required"]}
        categories |= {name: "optional" for name in declared.get("optional", {})}
        errors: list[Error] = []
        valid = True
        for x, category in categories.items():
            if x not in inputs:
                if category == "required":
                    errors.append(
                        _error(
                            "required_input_missing", "Required input is missing", x, input_name=x
                        )
                    )
                continue
            info = declared[category][x]
            input_type = info[0]
            opts: dict[str, Any] = info[1] if len(info) > 1 else {}
            config = [input_type, opts]
            val = inputs[x]
            if isinstance(val, list):
                problem = self._link(x, val, input_type, config)
                if problem is not None:
                    errors.append(problem)
                elif not self._linked_ok(x, val, config):
                    valid = False
                continue
            problem = self._constant(spec, inputs, x, val, input_type, opts, config)
            if problem is not None:
                errors.append(problem)
        for x in spec.custom_validated:
            if x in inputs and not isinstance(inputs[x], list):
                verdict = _custom_check(spec, x, inputs[x], self.settings)
                if verdict is not True:
                    details = x if verdict is False else f"{x} - {verdict}"
                    errors.append(
                        _error(
                            "custom_validation_failed",
                            "Custom validation failed for node",
                            details,
                            input_name=x,
                        )
                    )
        errors.extend(self.cycle_errors.get(unique_id, []))
        if errors or not valid:
            return (False, errors, unique_id)
        return (True, [], unique_id)

    def _link(self, x: str, val: list[Any], input_type: Any, config: list[Any]) -> Error | None:
        if len(val) != 2:
            return _error(
                "bad_linked_input",
                "Bad linked input, must be a length-2 list of [node_id, slot_index]",
                x,
                input_name=x,
                input_config=config,
                received_value=val,
            )
        # Same lookups as ComfyUI, so a dangling link raises the same KeyError/IndexError.
        source_class = self.prompt[val[0]]["class_type"]
        received_type = REGISTRY[source_class].outputs[val[1]]
        if not types_match(received_type, input_type):
            return _error(
                "return_type_mismatch",
                "Return type mismatch between linked nodes",
                f"{x}, received_type({received_type}) mismatch input_type({input_type})",
                input_name=x,
                input_config=config,
                received_type=received_type,
                linked_node=val,
            )
        if val[0] in self.stack:
            cycle = [*self.stack[self.stack.index(val[0]) :], val[0]]
            for member in set(cycle):
                self.cycle_errors.setdefault(member, []).append(
                    _error(
                        "dependency_cycle",
                        "Dependency cycle detected",
                        " -> ".join(cycle),
                        cycle=cycle,
                    )
                )
        return None

    def _linked_ok(self, x: str, val: list[Any], config: list[Any]) -> bool:
        if val[0] in self.stack:
            return False
        try:
            return self.node(val[0])[0]
        except Exception as ex:
            reasons = [
                _error(
                    "exception_during_inner_validation",
                    "Exception when validating inner node",
                    str(ex),
                    input_name=x,
                    input_config=config,
                    exception_message=str(ex),
                    exception_type=full_type_name(ex),
                    traceback=traceback.format_tb(ex.__traceback__),
                    linked_node=val,
                )
            ]
            self.validated[val[0]] = (False, reasons, val[0])
            return False

    def _constant(
        self,
        spec: NodeSpec,
        inputs: dict[str, Any],
        x: str,
        val: Any,
        input_type: Any,
        opts: dict[str, Any],
        config: list[Any],
    ) -> Error | None:
        try:
            if isinstance(val, dict) and "__value__" in val:
                val = inputs[x] = val["__value__"]
            converter = {"INT": int, "FLOAT": float, "STRING": str, "BOOLEAN": bool}
            if isinstance(input_type, str) and input_type in converter:
                val = inputs[x] = converter[input_type](val)
        except Exception as ex:
            return _error(
                "invalid_input_type",
                f"Failed to convert an input value to a {input_type} value",
                f"{x}, {val}, {ex}",
                input_name=x,
                input_config=config,
                received_value=val,
                exception_message=str(ex),
            )
        if x in spec.custom_validated:
            return None
        if "min" in opts and val < opts["min"]:
            return _error(
                "value_smaller_than_min",
                f"Value {val} smaller than min of {opts['min']}",
                x,
                input_name=x,
                input_config=config,
                received_value=val,
            )
        if "max" in opts and val > opts["max"]:
            return _error(
                "value_bigger_than_max",
                f"Value {val} bigger than max of {opts['max']}",
                x,
                input_name=x,
                input_config=config,
                received_value=val,
            )
        # V1 choices are the type itself; a V3 COMBO keeps them in its options.
        options = opts.get("options", []) if input_type == "COMBO" else input_type
        if isinstance(options, list) and val not in options:
            big = len(options) > 20
            listing = f"(list of length {len(options)})" if big else str(options)
            return _error(
                "value_not_in_list",
                "Value not in list",
                f"{x}: '{val}' not in {listing}",
                input_name=x,
                input_config=None if big else config,
                received_value=val,
            )
        return None


def validate_prompt(
    prompt: dict[str, Any], settings: SimSettings, partial_targets: list[str] | None = None
) -> ValidationResult:
    outputs: list[str] = []
    for x, node in prompt.items():
        if not isinstance(node, dict) or "class_type" not in node:
            message = "Cannot execute because a node is missing the class_type property."
            return ValidationResult(
                False, _error("invalid_prompt", message, f"Node ID '#{x}'"), [], {}
            )
        spec = REGISTRY.get(node["class_type"])
        if spec is None:
            message = f"Cannot execute because node {node['class_type']} does not exist."
            return ValidationResult(
                False, _error("invalid_prompt", message, f"Node ID '#{x}'"), [], {}
            )
        if spec.output_node and (partial_targets is None or x in partial_targets):
            outputs.append(x)
    if not outputs:
        error = _error("prompt_no_outputs", "Prompt has no outputs", "")
        return ValidationResult(False, error, [], {})

    checker = _Validator(prompt, settings)
    good: list[str] = []
    failures: list[tuple[str, list[Error]]] = []
    node_errors: dict[str, Any] = {}
    for o in outputs:
        try:
            valid, reasons, _ = checker.node(o)
        except Exception as ex:
            valid = False
            reasons = [
                _error(
                    "exception_during_validation",
                    "Exception when validating node",
                    str(ex),
                    exception_type=full_type_name(ex),
                    traceback=traceback.format_tb(ex.__traceback__),
                )
            ]
            checker.validated[o] = (False, reasons, o)
        if valid:
            good.append(o)
            continue
        failures.append((o, reasons))
        for node_id, (node_valid, node_reasons, _) in checker.validated.items():
            # Downstream nodes of a bad node are invalid without reasons: not reported.
            if node_valid or not node_reasons:
                continue
            entry = node_errors.setdefault(
                node_id,
                {
                    "errors": node_reasons,
                    "dependent_outputs": [],
                    "class_type": prompt[node_id]["class_type"],
                },
            )
            entry["dependent_outputs"].append(o)
    if not good:
        details = "\n".join(f"{e['message']}: {e['details']}" for _, es in failures for e in es)
        error = _error(
            "prompt_outputs_failed_validation", "Prompt outputs failed validation", details
        )
        return ValidationResult(False, error, [], node_errors)
    return ValidationResult(True, None, good, node_errors)
