"""Where a webhook may be POSTed: the URL-input rules (activities/url_fetch.py), for webhooks.

A webhook URL is chosen by whoever submits the job, and the worker POSTs to it from inside our
network, so it gets the checks a URL input gets: `https` only, no credentials in it, port 443,
and every address its host resolves to public (activities/public_address.py). The worker then
dials one of exactly the checked addresses (`WebhookTarget.addresses`, with
activities/pinned_connection.py), so a second DNS answer cannot steer it elsewhere.

`allow_hosts` (DURABLE_COMFY_WEBHOOK_ALLOW_HOSTS) lets the named hosts through over http, on any
port and at any address: a developer's or a test's receiver on 127.0.0.1. Never in production.

The gateway calls `check_webhook_url` when a job is submitted; the prepare activity calls it
again before any GPU time (activities/webhooks.py), and each delivery resolves afresh with
`webhook_target`.
"""

from __future__ import annotations

import socket
from collections.abc import Collection
from dataclasses import dataclass

import httpx

from activities import public_address
from activities.pinned_connection import Resolver, resolve
from workflows.errors import UnsafeWebhookUrl, WebhookUnresolved


@dataclass(frozen=True)
class WebhookTarget:
    url: httpx.URL
    host: str
    port: int
    # Where to connect: the checked addresses, in the resolver's order.
    addresses: tuple[str, ...]


def shown(url: httpx.URL | str) -> str:
    """The URL without its query or fragment: a token in them is never logged or shown."""
    text = str(url)
    return text.split("#", 1)[0].split("?", 1)[0]


async def check_webhook_url(
    url: str, allow_hosts: Collection[str] = (), *, resolver: Resolver = resolve
) -> None:
    """Raise `UnsafeWebhookUrl` unless the worker may POST to `url`. A DNS failure that may
    pass is no refusal (deliveries are retried); a name that does not exist is one."""
    try:
        await webhook_target(url, allow_hosts, resolver=resolver)
    except WebhookUnresolved:
        return


async def webhook_target(
    url: str, allow_hosts: Collection[str] = (), *, resolver: Resolver = resolve
) -> WebhookTarget:
    """The checked URL and the addresses to dial; `UnsafeWebhookUrl` when it is refused,
    `WebhookUnresolved` when its host cannot be resolved now."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise UnsafeWebhookUrl(f"not a URL: {exc}") from None
    host = parsed.raw_host.decode("ascii").lower()
    if not host:
        raise UnsafeWebhookUrl(f"{shown(parsed)} names no host")
    allowed = host in {h.lower() for h in allow_hosts}
    if parsed.scheme != "https" and not (allowed and parsed.scheme == "http"):
        raise UnsafeWebhookUrl(
            f"{shown(parsed)}: a webhook URL must be https, not {parsed.scheme or 'schemeless'}"
        )
    if parsed.userinfo:
        raise UnsafeWebhookUrl(f"{shown(parsed)}: credentials in a webhook URL are not accepted")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    if port != 443 and not allowed:
        raise UnsafeWebhookUrl(f"{shown(parsed)}: port {port} is not allowed (only 443)")
    addresses = await _addresses(host, port, resolver)
    refused = None if allowed else public_address.first_refused(addresses)
    if refused is not None:
        address, why = refused
        via = "" if address == host else f"{host} resolves to "
        raise UnsafeWebhookUrl(
            f"{shown(parsed)}: {via}{address}: {why}; webhooks go to public addresses only"
        )
    return WebhookTarget(url=parsed, host=host, port=port, addresses=tuple(addresses))


async def _addresses(host: str, port: int, resolver: Resolver) -> list[str]:
    try:
        return [str(public_address.parse(host.strip("[]")))]
    except ValueError:
        pass  # a name, not an address literal
    try:
        answers = list(await resolver(host, port))
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)):
            raise UnsafeWebhookUrl(f"{host} does not resolve: no such name") from None
        raise WebhookUnresolved(f"{host} does not resolve now: {exc}") from exc
    if not answers:
        raise WebhookUnresolved(f"{host} resolved to nothing")
    return answers
