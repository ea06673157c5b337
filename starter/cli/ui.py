"""Links into the Temporal UI for a job."""

from __future__ import annotations

from urllib.parse import quote

from configuration.settings import TemporalSettings


def workflow_url(temporal: TemporalSettings, job_id: str) -> str:
    base = temporal.ui_url.rstrip("/")
    namespace = temporal.ui_namespace()
    return f"{base}/namespaces/{quote(namespace)}/workflows/{quote(job_id, safe='')}"
