"""GET /api/jobs/{id} (newer ComfyUI, comfy_execution/jobs.py): one call that says pending /
in_progress / completed / failed, shaped like ComfyUI's normalised job dicts."""

from __future__ import annotations

from typing import Any

PREVIEWABLE = frozenset({"images", "video", "audio"})


def _prune(data: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in data.items() if value is not None}


def _queue_job(item: list[Any], status: str) -> dict[str, Any]:
    priority, prompt_id, _, extra_data, _ = item
    workflow = (extra_data.get("extra_pnginfo") or {}).get("workflow") or {}
    return _prune(
        {
            "id": prompt_id,
            "status": status,
            "priority": priority,
            "create_time": extra_data.get("create_time"),
            "outputs_count": 0,
            "workflow_id": workflow.get("id") if isinstance(workflow, dict) else None,
        }
    )


def _outputs_summary(outputs: dict[str, Any]) -> tuple[int, dict[str, Any] | None]:
    count, preview, fallback = 0, None, None
    for node_id, node_outputs in outputs.items():
        if not isinstance(node_outputs, dict):
            continue
        for media_type, items in node_outputs.items():
            if media_type == "animated" or not isinstance(items, list):
                continue
            for item in items:
                if not isinstance(item, dict):
                    continue
                count += 1
                if preview is None and media_type in PREVIEWABLE:
                    enriched = {**item, "nodeId": node_id, "mediaType": media_type}
                    if item.get("type") == "output":
                        preview = enriched
                    elif fallback is None:
                        fallback = enriched
    return count, preview or fallback


def _history_job(prompt_id: str, entry: dict[str, Any]) -> dict[str, Any]:
    priority, _, prompt, extra_data, _ = entry["prompt"]
    status_info = entry.get("status") or {}
    failed = status_info.get("status_str") == "error"
    start = end = error = None
    for event, data in status_info.get("messages", []):
        if event == "execution_start":
            start = data.get("timestamp")
        elif event in ("execution_success", "execution_error", "execution_interrupted"):
            end = data.get("timestamp")
            if event == "execution_error":
                error = data
    count, preview = _outputs_summary(entry.get("outputs", {}))
    workflow = (extra_data.get("extra_pnginfo") or {}).get("workflow") or {}
    job = _prune(
        {
            "id": prompt_id,
            "status": "failed" if failed else "completed",
            "priority": priority,
            "create_time": extra_data.get("create_time"),
            "execution_start_time": start,
            "execution_end_time": end,
            "execution_error": error,
            "outputs_count": count,
            "preview_output": preview,
            "workflow_id": workflow.get("id") if isinstance(workflow, dict) else None,
        }
    )
    job["outputs"] = entry.get("outputs", {})
    job["execution_status"] = status_info
    job["workflow"] = {"prompt": prompt, "extra_data": extra_data}
    return job


def get_job(
    prompt_id: str, running: list[list[Any]], pending: list[list[Any]], history: dict[str, Any]
) -> dict[str, Any] | None:
    if prompt_id in history:
        return _history_job(prompt_id, history[prompt_id])
    for item in running:
        if item[1] == prompt_id:
            return _queue_job(item, "in_progress")
    for item in pending:
        if item[1] == prompt_id:
            return _queue_job(item, "pending")
    return None
