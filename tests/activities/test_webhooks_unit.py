"""Webhooks without Temporal: the signature (Standard Webhooks' own test vector, and the test
receiver's independent check), the body, the secrets' settings, the URL checks, the retry delay,
the journal's order of delivery, and one attempt against a local receiver per answer."""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic import ValidationError
from structlog.testing import capture_logs
from temporalio.exceptions import ApplicationError

from activities.backend import Backend, Backends, JobActivities
from activities.pinned_connection import Resolver
from activities.webhook_target import check_webhook_url, webhook_target
from activities.webhooks import WebhookDeliverer, signature, webhook_body
from configuration.pools import PoolConfig
from configuration.settings import WebhookSettings
from configuration.values import webhook_signing_key
from tests.activities.test_backend_routing import GRAPH, STORAGE, RecordingBackend
from tests.support.webhook_receiver import (
    SPEC_VECTOR_SECRET,
    WebhookReceiver,
    signature_valid,
    signing_secret,
)
from workflows.activity_io import PrepareInput, WebhookDeliveryInput
from workflows.contracts import Artifact, JobError, JobEvent, JobState, WebhookSpec, shown_url
from workflows.errors import UnsafeWebhookUrl
from workflows.shared import ErrorType
from workflows.webhooks import (
    BEFORE_EVERYTHING,
    due,
    retry_delay,
    webhook_event,
    webhook_id,
)

SECRET = signing_secret("webhooks unit")
AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def test_the_signature_is_standard_webhooks_own_test_vector() -> None:
    key = webhook_signing_key(SPEC_VECTOR_SECRET)
    body = b'{"test": 2432232314}'
    got = signature(key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body)
    assert got == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    headers = {
        "webhook-id": "msg_p5jXN8AQM9LWM0D4loKWxJek",
        "webhook-timestamp": "1614265330",
        "webhook-signature": f"v1,bogus= {got}",
    }
    assert signature_valid(SPEC_VECTOR_SECRET, headers, body), "the receiver's own check agrees"
    assert not signature_valid(SPEC_VECTOR_SECRET, headers, body + b" ")


def artifact() -> Artifact:
    return Artifact(
        key="jobs/j/0/9/out.png",
        uri="s3://bucket/jobs/j/0/9/out.png",
        size=3,
        sha256="a" * 64,
        content_type="image/png",
        node_id="9",
        url="https://s3.example/presigned?X-Amz-Signature=secret",
    )


def test_the_body_names_the_event_and_never_a_presigned_url() -> None:
    entry = JobEvent(seq=7, at=AT, kind="output_stored", artifact=artifact())
    req = WebhookDeliveryInput(
        job_id="j", tenant="acme", url="https://x", webhook_id="msg_1", event="output_stored",
        entry=entry,
    )  # fmt: skip
    body = webhook_body(req)
    assert b"X-Amz-Signature" not in body and b'"url"' not in body
    document = json.loads(body)
    assert document["type"] == "job.output_stored"
    assert document["timestamp"] == AT.isoformat()
    assert document["data"]["job_id"] == "j" and document["data"]["seq"] == 7
    assert document["data"]["artifact"]["sha256"] == "a" * 64
    assert webhook_body(req) == body, "the same bytes on every attempt"
    failed = JobEvent(
        seq=9, at=AT, kind="state", state=JobState.FAILED, error=JobError(type="T", message="m")
    )
    failed_body = json.loads(
        webhook_body(req.model_copy(update={"entry": failed, "event": "failed"}))
    )
    assert failed_body["data"]["state"] == "FAILED"
    assert failed_body["data"]["error"]["type"] == "T"


def test_webhook_settings_read_tenants_secrets_from_the_variable_or_the_file(
    tmp_path: Path,
) -> None:
    settings = WebhookSettings.from_env(
        {
            "DURABLE_COMFY_WEBHOOK_SECRETS": f"acme:{SECRET}, local:{SECRET}",
            "DURABLE_COMFY_WEBHOOK_ALLOW_HOSTS": "127.0.0.1, LocalHost",
        }
    )
    assert settings.signing_key("acme") == webhook_signing_key(SECRET)
    assert settings.signing_key("nobody") is None
    assert settings.allow_hosts == ("127.0.0.1", "localhost")
    assert SECRET not in repr(settings) and SECRET not in str(settings.model_dump())
    file = tmp_path / "secrets"
    file.write_text(f"# the tenants\nacme:{SECRET}\n\n")
    from_file = WebhookSettings.from_env({"DURABLE_COMFY_WEBHOOK_SECRETS_FILE": str(file)})
    assert from_file.signing_key("acme") == webhook_signing_key(SECRET)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("acme", "expected tenant:whsec_<base64>"),
        ("acme:secret-without-prefix", "whsec_"),
        ("acme:whsec_!!notbase64", "not base64"),
        ("acme:whsec_c2hvcnQ=", "at least 16 bytes"),
        (f"acme:{SECRET},acme:{SECRET}", "has a secret already"),
    ],
)
def test_a_bad_secret_is_refused_without_showing_it(value: str, message: str) -> None:
    with pytest.raises(ValidationError) as refused:
        WebhookSettings.from_env({"DURABLE_COMFY_WEBHOOK_SECRETS": value})
    assert message in str(refused.value)
    assert SECRET.split("_", 1)[1] not in str(refused.value)
    assert "notbase64" not in str(refused.value)


def resolver(answers: dict[str, Sequence[str] | int]) -> Resolver:
    async def resolve(host: str, port: int) -> Sequence[str]:
        answer = answers[host]
        if isinstance(answer, int):
            raise socket.gaierror(answer, "lookup failed")
        return answer

    return resolve


FAKE_DNS = resolver(
    {
        "hooks.example.com": ["93.184.215.14"],
        "inside.example.com": ["93.184.215.14", "192.168.1.5"],
        "metadata.example.com": ["169.254.169.254"],
        "gone.example.com": socket.EAI_NONAME,
        "flaky.example.com": socket.EAI_AGAIN,
    }
)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://hooks.example.com/h", "must be https, not http"),
        ("http://10.0.0.1/", "must be https"),
        ("https://10.0.0.1/", "10.0.0.1: private (10/8)"),
        ("https://127.0.0.1/", "loopback"),
        ("https://[::1]/", "loopback"),
        ("https://user:pw@hooks.example.com/", "credentials"),
        ("https://hooks.example.com:8443/", "port 8443 is not allowed"),
        ("https://inside.example.com/", "resolves to 192.168.1.5: private"),
        ("https://metadata.example.com/", "cloud metadata service"),
        ("https://gone.example.com/", "does not resolve"),
        ("ftp://hooks.example.com/", "must be https"),
    ],
)
async def test_check_webhook_url_refuses(url: str, message: str) -> None:
    with pytest.raises(UnsafeWebhookUrl) as refused:
        await check_webhook_url(url, (), resolver=FAKE_DNS)
    assert message in str(refused.value)
    assert "token" not in str(refused.value)


async def test_check_webhook_url_lets_public_and_allow_listed_hosts_through() -> None:
    await check_webhook_url("https://hooks.example.com/h?token=x", (), resolver=FAKE_DNS)
    await check_webhook_url("https://flaky.example.com/", (), resolver=FAKE_DNS)  # may pass
    await check_webhook_url("http://127.0.0.1:8080/h", ("127.0.0.1",), resolver=FAKE_DNS)
    target = await webhook_target("https://hooks.example.com/h", (), resolver=FAKE_DNS)
    assert target.addresses == ("93.184.215.14",) and target.port == 443
    with pytest.raises(UnsafeWebhookUrl):
        await check_webhook_url("http://10.0.0.1/", ("127.0.0.1",), resolver=FAKE_DNS)


def test_the_retry_delay_is_full_jitter_under_a_ceiling() -> None:
    day = 24 * 3600.0
    assert retry_delay(0, day, 0.0) == 0.0
    assert retry_delay(0, day, 0.999) < 1.0
    assert retry_delay(3, day, 0.5) == 4.0
    assert retry_delay(40, day, 0.999) < 600.0 and retry_delay(40, day, 0.5) == 300.0
    assert retry_delay(40, 60.0, 0.5) == 3.0, "a short horizon: a tenth of it at most"


def test_due_entries_are_the_subscribed_ones_after_the_cursor_in_journal_order() -> None:
    journal = [
        JobEvent(seq=1, at=AT, kind="state", state=JobState.QUEUED),
        JobEvent(seq=5, at=AT, kind="state", state=JobState.RUNNING),
        JobEvent(seq=8, at=AT, kind="output_stored", artifact=artifact()),
        JobEvent(seq=8, at=AT, kind="output_stored", artifact=artifact()),
        JobEvent(seq=8, at=AT, kind="progress", percent=50),
        JobEvent(seq=12, at=AT, kind="state", state=JobState.COMPLETED),
    ]
    everything = due(journal, BEFORE_EVERYTHING, ["output_stored", "progress", "completed"])
    assert [(key, event) for key, _, event in everything] == [
        ((8, 0), "output_stored"),
        ((8, 1), "output_stored"),
        ((8, 2), "progress"),
        ((12, 0), "completed"),
    ]
    assert [key for key, _, _ in due(journal, (8, 1), ["output_stored", "completed"])] == [(12, 0)]
    assert due(journal, (12, 0), ["completed"]) == []
    assert webhook_event(journal[1]) is None, "RUNNING is no webhook event"
    assert (
        webhook_id("j", "r", (8, 0)) == webhook_id("j", "r", (8, 0)) != webhook_id("j", "r", (8, 1))
    )
    assert webhook_id("j", "r", (8, 0)).startswith("msg_")
    assert shown_url("https://h/p?token=x#f") == "https://h/p"


def delivery(url: str, tenant: str = "acme") -> WebhookDeliveryInput:
    entry = JobEvent(seq=3, at=AT, kind="state", state=JobState.COMPLETED)
    return WebhookDeliveryInput(
        job_id="j", tenant=tenant, url=url, webhook_id="msg_x", event="completed", entry=entry
    )


@pytest.mark.parametrize(
    ("answer", "outcome"), [(None, "delivered"), (503, "retry"), (302, "retry"), (410, "gone")]
)
async def test_one_attempt_against_a_receiver(answer: int | None, outcome: str) -> None:
    receiver = WebhookReceiver(SECRET, answer=answer)
    await receiver.start()
    try:
        settings = WebhookSettings(secrets={"acme": SECRET}, allow_hosts=("127.0.0.1",))
        with capture_logs() as logs:
            attempt = await WebhookDeliverer(settings).deliver_webhook(delivery(receiver.url))
    finally:
        await receiver.stop()
    [line] = [entry for entry in logs if entry["event"] == "webhook.attempt"]
    assert line["job_id"] == "j" and line["webhook_id"] == "msg_x"
    assert line["status_code"] == (answer or 200)
    assert "query-secret" not in str(logs) and SECRET.split("_", 1)[1] not in str(logs)
    assert attempt.outcome == outcome
    assert attempt.status_code == (answer or 200)
    [received] = receiver.received
    assert received.signature_valid and received.webhook_id == "msg_x"
    assert received.path == "/hooks/jobs?token=query-secret"
    assert received.type == "job.completed"


async def test_a_receiver_that_is_down_is_retried_and_a_refused_url_or_tenant_is_not() -> None:
    receiver = WebhookReceiver(SECRET)  # never started: connections are refused
    settings = WebhookSettings(secrets={"acme": SECRET}, allow_hosts=("127.0.0.1",))
    deliverer = WebhookDeliverer(settings)
    down = await deliverer.deliver_webhook(delivery(receiver.url))
    assert down.outcome == "retry" and down.status_code is None and down.error
    private = await deliverer.deliver_webhook(delivery("https://10.0.0.1/hook"))
    assert private.outcome == "refused" and "private" in (private.error or "")
    no_secret = await deliverer.deliver_webhook(delivery(receiver.url, tenant="other"))
    assert no_secret.outcome == "refused" and "other" in (no_secret.error or "")


@pytest.mark.parametrize("pool", ["local", "cloud"])
@pytest.mark.parametrize(
    ("url", "tenant", "message"),
    [
        ("https://10.0.0.1/hook", "acme", "private (10/8)"),
        ("http://hooks.example.com/", "acme", "must be https"),
        ("https://hooks.example.com/", "nobody", "no signing secret for tenant 'nobody'"),
    ],
)
async def test_prepare_refuses_an_unusable_webhook_on_every_kind_of_pool(
    pool: str, url: str, tenant: str, message: str
) -> None:
    comfy, runpod = RecordingBackend("comfyui"), RecordingBackend("runpod")
    pools = {
        "local": PoolConfig(kind="comfyui", url="http://127.0.0.1:1"),
        "cloud": PoolConfig(kind="runpod", endpoint_id="abc"),
    }
    by_kind: dict[str, Backend] = {"comfyui": comfy, "runpod": runpod}
    settings = WebhookSettings(secrets={"acme": SECRET})
    jobs = JobActivities(
        Backends(pools, "local", by_kind),
        WebhookDeliverer(settings, resolver=FAKE_DNS),
        STORAGE,
    )
    req = PrepareInput(
        job_id="j", pool=pool, graph=GRAPH, webhook=WebhookSpec(url=url), tenant=tenant
    )
    with pytest.raises(ApplicationError) as refused:
        await jobs.prepare_prompt(req)
    assert refused.value.type == ErrorType.INVALID_REQUEST and refused.value.non_retryable
    assert message in str(refused.value)
    assert comfy.calls == [] and runpod.calls == [], "nothing reached a backend"
    fine = req.model_copy(update={"webhook": WebhookSpec(url="https://hooks.example.com/")})
    assert (await jobs.prepare_prompt(fine.model_copy(update={"tenant": "acme"}))).pool == pool
