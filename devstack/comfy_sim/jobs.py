"""GET /api/jobs/{id} and GET /api/jobs (ComfyUI 0.8, comfy_execution/jobs.py): one prompt's
status (pending / in_progress / completed / failed), or a filtered, sorted page of them, shaped
like ComfyUI's normalised job dicts (no graphs, unlike /queue)."""

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


def _history_job(
    prompt_id: str, entry: dict[str, Any], include_outputs: bool = True
) -> dict[str, Any]:
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
    if not include_outputs:
        return job
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


STATUSES = ("pending", "in_progress", "completed", "failed")


def get_all_jobs(
    running: list[list[Any]],
    pending: list[list[Any]],
    history: dict[str, Any],
    statuses: list[str],
    workflow_id: str | None,
    sort_by: str,
    sort_order: str,
    limit: int | None,
    offset: int,
) -> tuple[list[dict[str, Any]], int]:
    jobs: list[dict[str, Any]] = []
    if "in_progress" in statuses:
        jobs += [_queue_job(item, "in_progress") for item in running]
    if "pending" in statuses:
        jobs += [_queue_job(item, "pending") for item in pending]
    if "completed" in statuses or "failed" in statuses:
        for prompt_id, entry in history.items():
            failed = (entry.get("status") or {}).get("status_str") == "error"
            if ("failed" if failed else "completed") in statuses:
                jobs.append(_history_job(prompt_id, entry, include_outputs=False))
    if workflow_id:
        jobs = [job for job in jobs if job.get("workflow_id") == workflow_id]
    jobs.sort(
        key=_duration if sort_by == "execution_duration" else _created, reverse=sort_order == "desc"
    )
    total = len(jobs)
    if offset > 0:
        jobs = jobs[offset:]
    if limit is not None:
        jobs = jobs[:limit]
    return jobs, total


def _created(job: dict[str, Any]) -> Any:
    return job.get("create_time", 0)


def _duration(job: dict[str, Any]) -> Any:
    start, end = job.get("execution_start_time", 0), job.get("execution_end_time", 0)
    return end - start if end and start else 0
