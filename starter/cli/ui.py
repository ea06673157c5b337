"""Links into the Temporal UI for a job."""

from __future__ import annotations

import os
from urllib.parse import quote


def workflow_url(job_id: str) -> str:
    base = os.environ.get("TEMPORAL_UI_URL", "http://127.0.0.1:8233").rstrip("/")
    namespace = os.environ.get("TEMPORAL_NAMESPACE", "default")
    return f"{base}/namespaces/{quote(namespace)}/workflows/{quote(job_id, safe='')}"
