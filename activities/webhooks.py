"""Sending a job's webhook: one signed POST per attempt, to a checked address only.

The body is `{"type": "job.<event>", "timestamp": <the event's time>, "data": {...}}`, signed per
Standard Webhooks (https://www.standardwebhooks.com/): `webhook-id` (the same on every attempt
at one event), `webhook-timestamp` (this attempt's Unix seconds) and `webhook-signature:
v1,<base64 of HMAC-SHA256(key, "<id>.<timestamp>.<body>")>`, the key being the base64 part of
the tenant's `whsec_` secret (activities/settings.py `WebhookSettings`). The secret never leaves
this process: not in an activity's input or result, not in a log line.

The URL is checked and its host resolved on every attempt (activities/webhook_target.py), the
connection goes to a checked address (activities/pinned_connection.py), and a redirect is not
followed. 2xx is delivered; 410 Gone ends the event's retries; any other answer, a timeout or a
connection error is retried by the workflow (workflows/webhooks.py), which owns the backoff.
Logs carry the job, the webhook-id and the answer, never the URL's query or the secret.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import ssl
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Final, Literal

import httpcore
import httpx
import structlog
from temporalio import activity

from activities.errors import fatal
from activities.pinned_connection import Dialer, PinnedBackend, Resolver, dial, resolve
from activities.webhook_target import WebhookTarget, shown, webhook_target
from configuration.settings import WebhookSettings
from workflows.activity_io import WebhookAttempt, WebhookDeliveryInput
from workflows.contracts import WebhookSpec
from workflows.errors import UnsafeWebhookUrl, WebhookUnresolved
from workflows.shared import ACTIVITY_DELIVER_WEBHOOK, DEFAULT_TENANT, ErrorType

log = structlog.get_logger(__name__)

Outcome = Literal["delivered", "retry", "gone", "refused"]

_USER_AGENT: Final = "durable-comfy-webhook"
# Below the activity's 30 s start-to-close timeout, so an attempt reports its own timeout.
ATTEMPT_TIMEOUT_S: Final = 20.0
CONNECT_TIMEOUT_S: Final = 10.0
# A receiver's answer is not used: read this much at most, then close.
_MAX_ANSWER_BYTES: Final = 4096


def webhook_body(req: WebhookDeliveryInput) -> bytes:
    """The event as JSON; the same bytes on every attempt. An artifact goes without a presigned
    URL (it would expire long before some retries): `uri` and `key` name it in the bucket. A
    batch's end is its summary (workflows/job_batch.py)."""
    entry = req.entry
    if entry is None:
        at = (req.batch or {}).get("ended_at")
        batch = {"type": f"batch.{req.event}", "timestamp": at, "data": req.batch or {}}
        return json.dumps(batch, separators=(",", ":")).encode()
    data: dict[str, Any] = {
        "job_id": req.job_id,
        "seq": entry.seq,
        "state": entry.state.value if entry.state is not None else None,
        "error": entry.error.model_dump(mode="json") if entry.error is not None else None,
    }
    if entry.artifact is not None:
        data["artifact"] = entry.artifact.model_dump(mode="json", exclude={"url"})
    if entry.percent is not None:
        data["percent"] = entry.percent
    payload = {"type": f"job.{req.event}", "timestamp": entry.at.isoformat(), "data": data}
    return json.dumps(payload, separators=(",", ":")).encode()


def signature(key: bytes, webhook_id: str, timestamp: int, body: bytes) -> str:
    """`v1,<base64 HMAC-SHA256>` of `<id>.<timestamp>.<body>` (Standard Webhooks)."""
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def tenant_of(tenant: str | None) -> str:
    return tenant or DEFAULT_TENANT


class WebhookDeliverer:
    """The `deliver_webhook` activity, and the check prepare makes before any GPU time."""

    def __init__(
        self,
        settings: WebhookSettings,
        *,
        resolver: Resolver = resolve,
        dialer: Dialer = dial,
        ssl_context: ssl.SSLContext | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._settings = settings
        self._resolve = resolver
        self._dial = dialer
        self._ssl = ssl_context or httpx.create_ssl_context()
        self._clock = clock

    async def refuse_unusable(self, spec: WebhookSpec | None, tenant: str | None) -> None:
        """Fail the job (InvalidRequest) when its webhook could never be sent: a URL the worker
        must not POST to, or a tenant it holds no secret for."""
        if spec is None:
            return
        tenant = tenant_of(tenant)
        if self._settings.signing_key(tenant) is None:
            raise fatal(
                ErrorType.INVALID_REQUEST,
                f"webhook: this worker holds no signing secret for tenant {tenant!r} "
                "(DURABLE_COMFY_WEBHOOK_SECRETS)",
                field="webhook",
            )
        try:
            await webhook_target(spec.url, self._settings.allow_hosts, resolver=self._resolve)
        except UnsafeWebhookUrl as exc:
            raise fatal(
                ErrorType.INVALID_REQUEST, f"webhook.url: {exc}", field="webhook.url"
            ) from None
        except WebhookUnresolved:
            pass  # may pass: the deliveries retry it

    @activity.defn(name=ACTIVITY_DELIVER_WEBHOOK)
    async def deliver_webhook(self, req: WebhookDeliveryInput) -> WebhookAttempt:
        attempt = await self._attempt(req)
        log.info(
            "webhook.attempt",
            job_id=req.job_id,
            webhook_id=req.webhook_id,
            webhook_event=req.event,
            attempt=req.attempt,
            outcome=attempt.outcome,
            status_code=attempt.status_code,
            error=attempt.error,
            url=shown(req.url),
        )
        return attempt

    async def _attempt(self, req: WebhookDeliveryInput) -> WebhookAttempt:
        key = self._settings.signing_key(tenant_of(req.tenant))
        if key is None:
            return self._answer("refused", error=f"no signing secret for tenant {req.tenant!r}")
        try:
            target = await webhook_target(
                req.url, self._settings.allow_hosts, resolver=self._resolve
            )
        except UnsafeWebhookUrl as exc:
            return self._answer("refused", error=str(exc))
        except WebhookUnresolved as exc:
            return self._answer("retry", error=str(exc))
        body = webhook_body(req)
        timestamp = int(self._clock())
        headers = [
            (b"Host", target.url.netloc),
            (b"User-Agent", _USER_AGENT.encode()),
            (b"Content-Type", b"application/json"),
            (b"Content-Length", str(len(body)).encode()),
            (b"webhook-id", req.webhook_id.encode()),
            (b"webhook-timestamp", str(timestamp).encode()),
            (b"webhook-signature", signature(key, req.webhook_id, timestamp, body).encode()),
        ]
        try:
            async with asyncio.timeout(ATTEMPT_TIMEOUT_S):
                status = await self._post(target, headers, body)
        except TimeoutError:
            return self._answer("retry", error=f"no answer within {ATTEMPT_TIMEOUT_S:g} s")
        except httpcore.TimeoutException as exc:
            return self._answer("retry", error=f"timed out: {type(exc).__name__}")
        except (httpcore.NetworkError, httpcore.ProtocolError, OSError) as exc:
            return self._answer("retry", error=_gist(exc))
        if 200 <= status < 300:
            return self._answer("delivered", status_code=status)
        if status == 410:
            return self._answer(
                "gone", status_code=status, error="410 Gone: the receiver wants no more"
            )
        error = "redirects are not followed" if 300 <= status < 400 else f"HTTP {status}"
        return self._answer("retry", status_code=status, error=error)

    async def _post(
        self, target: WebhookTarget, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> int:
        url = target.url
        request = httpcore.Request(
            "POST",
            httpcore.URL(
                scheme=url.scheme.encode(), host=url.raw_host, port=target.port, target=url.raw_path
            ),
            headers=headers,
            content=body,
            extensions={
                "timeout": {
                    "connect": CONNECT_TIMEOUT_S,
                    "read": ATTEMPT_TIMEOUT_S,
                    "write": ATTEMPT_TIMEOUT_S,
                    "pool": CONNECT_TIMEOUT_S,
                }
            },
        )
        backend = PinnedBackend(target.host, target.addresses, self._dial)
        pool = httpcore.AsyncConnectionPool(
            ssl_context=self._ssl, network_backend=backend, max_connections=1, retries=0
        )
        async with pool:
            response = await pool.handle_async_request(request)
            try:
                read = 0
                async for chunk in response.aiter_stream():
                    read += len(chunk)
                    if read >= _MAX_ANSWER_BYTES:
                        break
            finally:
                await response.aclose()
        return response.status

    def _answer(
        self, outcome: Outcome, *, status_code: int | None = None, error: str | None = None
    ) -> WebhookAttempt:
        return WebhookAttempt(
            outcome=outcome,
            status_code=status_code,
            error=error,
            at=datetime.fromtimestamp(self._clock(), UTC),
        )


def _gist(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."
