"""The webhook URL a request names is checked when the job is submitted (docs/http-api.md,
Webhooks): refused there with a 422 naming `webhook.url`, not discovered by the job's first
delivery hours later."""

from __future__ import annotations

from workflows.contracts import JobRequest


async def check_webhook(request: JobRequest) -> None:
    """Refuses (422 naming `webhook.url`) a webhook URL the job could not deliver to.

    The destination check itself (https, a public address: the SSRF guard of URL inputs) is
    `activities.webhook_target.check_webhook_url`; until that module is part of the product
    the job's own delivery applies it, and nothing is refused here.
    """
    del request
