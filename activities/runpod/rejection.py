"""A stock worker-comfyui handler's refusal of a graph, read back into ComfyUI's own terms.

The stock handler (runpod-workers/worker-comfyui 5.x, `queue_workflow`) turns ComfyUI's 400 from
`/prompt` into one `ValueError` text, returned as `{"error": text}`, in three shapes:

    Workflow validation failed:                       node_errors present: one bullet per key
    • Node 5 (errors): [{'type': ..., 'message': ..., 'details': ..., 'extra_info': {...}}]
    • Node 5 (dependent_outputs): ['9']
    • Node 5 (class_type): KSampler
    (maybe followed by "Available checkpoint models: ...")

    Cannot execute because node KSamplerr does not exist.. Raw response: {"error": ..., ...}
                                                      no node_errors: ComfyUI's JSON verbatim

    ComfyUI validation failed (could not parse error response): <body>

The values after each bullet are Python reprs. `stock_rejection` recognises the shapes and says
the same as the ComfyUI pool would (`describe_rejection`: `node 5 (KSampler): input 'seed': ...`);
a value it cannot read is kept as plain text, bounded. Anything else is not a rejection (None).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from protocol.errors import describe_rejection

# The stock handler's words, from its queue_workflow (worker-comfyui 5.8.5).
_HEADS = ("Workflow validation failed", "Prompt outputs failed validation")
_UNPARSED = "ComfyUI validation failed (could not parse error response): "
_RAW = ". Raw response: "
_BULLET = re.compile(r"^• Node (?P<node>[^ ]{1,64}) \((?P<key>[A-Za-z_]{1,40})\): (?P<value>.*)$")
_NODE = re.compile(r"^• Node (?P<node>[^ ]{1,64}): (?P<value>.*)$")
# A repr longer than this is not parsed (literal_eval's cost grows with its input); its text is
# kept, cut.
MAX_REPR_CHARS = 64 * 1024
_MAX_TEXT = 300


def stock_rejection(text: str) -> str | None:
    """ComfyUI's reason in plain per-node words when `text` is a stock handler's rejection of
    the graph; None when it is not one."""
    if text.startswith(_UNPARSED):
        body = text.removeprefix(_UNPARSED)
        return _from_json(body) or f"ComfyUI refused the graph: {_cut(body)}"
    head, sep, rest = text.partition(":\n• ")
    if sep:
        described = _from_bullets(head, "• " + rest)
        if described is not None:
            return described
    head, sep, raw = text.partition(_RAW)
    if sep:
        return _from_json(raw) or f"{head.rstrip('.')}. ({_cut(raw)})"
    if text.startswith(_HEADS):
        return " ".join(text.split())[: _MAX_TEXT * 3]
    return None


def _from_bullets(head: str, body: str) -> str | None:
    node_errors: dict[str, dict[str, Any]] = {}
    loose: list[str] = []
    after: list[str] = []
    for line in body.splitlines():
        line = line.strip()
        if not line:
            continue
        bullet = _BULLET.match(line)
        if bullet is not None:
            entry = node_errors.setdefault(bullet["node"], {})
            key, value = bullet["key"], bullet["value"]
            entry[key] = _literal(value) if key in ("errors", "dependent_outputs") else value
            continue
        plain = _NODE.match(line)
        if plain is not None:
            loose.append(f"node {plain['node']}: {_cut(plain['value'])}")
        else:
            after.append(_cut(line))
    if not node_errors and not loose:
        return None  # bullets, but not the stock handler's: not a rejection we can read
    readable: dict[str, Any] = {}
    for node, entry in node_errors.items():
        errors = entry.get("errors")
        if isinstance(errors, list) and all(isinstance(e, dict) for e in errors):
            readable[node] = entry
        else:
            # Not ComfyUI's list of error objects (or a repr we could not read): keep the words.
            where = f"node {node} ({entry.get('class_type', '?')})"
            loose.append(f"{where}: {_cut(str(errors if errors is not None else entry))}")
    parts = [describe_rejection({"message": head.strip() or _HEADS[0]}, readable), *loose]
    return "; ".join([*parts, *after])


def _from_json(raw: str) -> str | None:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    node_errors = data.get("node_errors")
    if not isinstance(error, dict):
        error = {"message": str(error)} if error else {}
    return describe_rejection(error, node_errors if isinstance(node_errors, dict) else {})


def _literal(value: str) -> Any:
    """A Python repr as its value; the text itself where it is not one (or too big to read)."""
    if len(value) > MAX_REPR_CHARS:
        return value
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


def _cut(text: str) -> str:
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT] + "..."
