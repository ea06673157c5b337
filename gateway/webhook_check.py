"""The webhook URL a request names is checked when the job is submitted (docs/http-api.md,
Webhooks): refused there with a 422 naming `webhook.url`, not found out by the job's prepare.

The rules are the worker's (`activities.webhook_target`: https, no credentials, port 443, every
address the host resolves to public); the job's prepare and each delivery check again, so this
is the early answer, not the only guard.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from activities.webhook_target import check_webhook_url
from gateway.errors import invalid
from workflows.contracts import JobRequest
from workflows.errors import UnsafeWebhookUrl


async def check_webhook(request: JobRequest, allow_hosts: Collection[str] = ()) -> None:
    """422 naming `webhook.url` when the worker would refuse to POST there."""
    if request.webhook is None:
        return
    await check_webhook_at(request.webhook.url, ["webhook", "url"], allow_hosts)


async def check_webhook_at(
    url: str, loc: Sequence[str | int], allow_hosts: Collection[str] = ()
) -> None:
    """422 naming `loc` (a batch's job: `["requests", 3, "webhook", "url"]`) when the worker
    would refuse to POST to `url`."""
    try:
        await check_webhook_url(url, allow_hosts)
    except UnsafeWebhookUrl as exc:
        raise invalid([{"loc": list(loc), "message": str(exc)}]) from None
