"""Who is calling: bearer API keys, each naming a tenant (docs/http-api.md, Authentication).

Keys come from DURABLE_COMFY_API_KEYS (`tenant:key,tenant:key`) and/or the file
DURABLE_COMFY_API_KEYS_FILE names: one entry a line, `tenant:key` or `tenant:sha256:<64 hex>`
(the key's sha256, so the file holds no key), `#` comments, blank lines. An entry may end with
per-tenant limits, `max_jobs=N rps=R burst=B` (gateway.limits). A tenant may hold several keys
(rotation); one key may not name two tenants.

Only the keys' sha256 digests are held. A bearer key is hashed and compared with every digest
with `hmac.compare_digest`, without stopping at a match, so the time taken says neither whether
nor where a key matched. sha256 (not a slow password hash) is enough for keys drawn from 256
random bits (`new_key_line`); a short key a person chose is warned about, not refused.

With no key configured the gateway is open: every caller is the tenant `local`, and
`check_bind` lets it listen on a loopback address only.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog
from pydantic import SecretStr

from configuration.settings import API_KEYS_FILE_VAR, API_KEYS_VAR
from gateway.errors import ApiKeysError, Unauthorized

log = structlog.get_logger("gateway.auth")

KEYS_ENV = API_KEYS_VAR
KEYS_FILE_ENV = API_KEYS_FILE_VAR
OPEN_TENANT = "local"
TENANT_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
TENANT_RULE = "1-64 of A-Z a-z 0-9 _ -"
_HASHED = re.compile(r"sha256:([0-9a-fA-F]{64})")
# Below this, a plain key is guessable enough to say so (new_key_line's are 43 characters).
_SHORT_KEY = 24
_LIMIT_NAMES = ("max_jobs", "rps", "burst")


@dataclass(frozen=True)
class TenantLimits:
    """Limits an entry sets for its tenant, over the gateway's defaults (None: the default)."""

    max_jobs: int | None = None
    rps: float | None = None
    burst: int | None = None


class KeySources(Protocol):
    """What `ApiKeys.from_settings` reads: configuration.settings' `AuthSettings`, or a settings
    class embedding it (`GatewaySettings`)."""

    @property
    def api_keys(self) -> SecretStr | None: ...

    @property
    def api_keys_file(self) -> Path | None: ...


def hash_key(key: str) -> str:
    """The hex sha256 of a key: what a keys file may hold instead of it."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key_line(tenant: str) -> tuple[str, str]:
    """A fresh key for `tenant` (256 random bits) and the line that lets it in, which holds
    only its hash: `tenant:sha256:<hex>`. The key is shown once, to give to the tenant."""
    check_tenant(tenant)
    key = secrets.token_urlsafe(32)
    return key, f"{tenant}:sha256:{hash_key(key)}"


def check_tenant(tenant: str) -> str:
    if not TENANT_PATTERN.fullmatch(tenant):
        raise ValueError(f"a tenant name is {TENANT_RULE}")
    return tenant


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 (bracketed or not) and `localhost`; a wildcard or any other name is not."""
    name = host.strip().strip("[]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class _Entry:
    tenant: str
    digest: bytes
    plain: bool
    limits: TenantLimits


class ApiKeys:
    """The configured keys as (sha256 digest, tenant) pairs, and each tenant's own limits."""

    def __init__(
        self,
        digests: Iterable[tuple[bytes, str]],
        limits: Mapping[str, TenantLimits] | None = None,
    ) -> None:
        self._digests = tuple(digests)
        self.limits: dict[str, TenantLimits] = dict(limits or {})

    def __repr__(self) -> str:
        return f"ApiKeys(tenants={self.tenants!r}, keys={len(self._digests)})"

    @property
    def open(self) -> bool:
        """No key configured: every caller is the tenant `local`, on loopback only."""
        return not self._digests

    @property
    def tenants(self) -> list[str]:
        return sorted({tenant for _, tenant in self._digests}) or [OPEN_TENANT]

    @classmethod
    def from_settings(cls, settings: KeySources) -> ApiKeys:
        """Both sources, the variable's entries first; `ApiKeysError` naming the bad entry."""
        entries: list[_Entry] = []
        if settings.api_keys is not None:
            text = settings.api_keys.get_secret_value()
            entries += _parse(
                (f"{KEYS_ENV} entry {n}", e) for n, e in enumerate(text.split(","), start=1)
            )
        if settings.api_keys_file is not None:
            entries += _read_file(settings.api_keys_file)
        return cls._of(entries)

    @classmethod
    def _of(cls, entries: list[_Entry]) -> ApiKeys:
        owners: dict[bytes, str] = {}
        limits: dict[str, TenantLimits] = {}
        for entry in entries:
            owner = owners.setdefault(entry.digest, entry.tenant)
            if owner != entry.tenant:
                # Which tenant would the caller be? Refused rather than guessed.
                raise ApiKeysError(
                    f"one key is given to two tenants, {owner} and {entry.tenant}: "
                    "each key must name one tenant"
                )
            if entry.limits != TenantLimits():
                known = limits.setdefault(entry.tenant, entry.limits)
                if known != entry.limits:
                    raise ApiKeysError(
                        f"tenant {entry.tenant} is given two different sets of limits; "
                        "give them on one entry or the same on each"
                    )
        return cls(((digest, tenant) for digest, tenant in owners.items()), limits)

    def tenant_for(self, authorization: str | None) -> str:
        """The tenant an `Authorization: Bearer <key>` header names; `Unauthorized` otherwise."""
        if self.open:
            return OPEN_TENANT
        if not authorization or not authorization.strip():
            raise Unauthorized("no API key: send the header `Authorization: Bearer <key>`")
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise Unauthorized("the Authorization header must be `Bearer <key>`")
        digest = hashlib.sha256(key.encode()).digest()
        found: str | None = None
        # Every digest is compared, the match included, whatever came before it.
        for known, tenant in self._digests:
            if hmac.compare_digest(known, digest):
                found = tenant
        if found is None:
            raise Unauthorized("the API key is not valid")
        return found

    def check_bind(self, host: str) -> None:
        """Refuses (ValueError) to serve without keys anywhere but a loopback address."""
        if self.open and not is_loopback(host):
            raise ValueError(
                f"no API keys are configured, so the gateway serves anyone as tenant "
                f"{OPEN_TENANT!r}: it listens on a loopback address only (127.0.0.1, ::1, "
                f"localhost), not {host!r}. Set {KEYS_ENV} or {KEYS_FILE_ENV} "
                "(`durable-comfy gateway new-key TENANT` makes a key) to listen on it."
            )


def _read_file(path: Path) -> list[_Entry]:
    try:
        text = path.read_text()
        mode = path.stat().st_mode
    except OSError as exc:
        raise ApiKeysError(f"{KEYS_FILE_ENV}: cannot read {path}: {exc.strerror}") from None
    lines = (
        (f"{KEYS_FILE_ENV} {path} line {n}", line.split("#", 1)[0])
        for n, line in enumerate(text.splitlines(), start=1)
    )
    entries = _parse(lines)
    if not entries:
        raise ApiKeysError(f"{KEYS_FILE_ENV} {path} holds no key entries")
    if any(entry.plain for entry in entries) and mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(
            "api_keys_file_readable_by_others",
            path=str(path),
            mode=oct(stat.S_IMODE(mode)),
            hint="it holds plain keys: chmod 600 it, or hold only tenant:sha256:<hex> lines",
        )
    return entries


def _parse(located: Iterable[tuple[str, str]]) -> list[_Entry]:
    entries: list[_Entry] = []
    for where, raw in located:
        if raw.strip():
            entries.append(_entry(where, raw.strip()))
    return entries


def _entry(where: str, text: str) -> _Entry:
    head, *options = text.split()
    tenant, sep, secret = head.partition(":")
    if not sep or not secret:
        raise ApiKeysError(f"{where}: expected tenant:key or tenant:sha256:<64 hex digits>")
    if not TENANT_PATTERN.fullmatch(tenant):
        raise ApiKeysError(f"{where}: the tenant name (before the first ':') is {TENANT_RULE}")
    if hashed := _HASHED.fullmatch(secret):
        return _Entry(tenant, bytes.fromhex(hashed.group(1)), False, _limits(where, options))
    if secret.lower().startswith("sha256:"):
        raise ApiKeysError(f"{where}: a sha256 entry holds exactly 64 hex digits after 'sha256:'")
    if len(secret) < _SHORT_KEY:
        log.warning("api_key_short", where=where, tenant=tenant, at_least=_SHORT_KEY)
    digest = hashlib.sha256(secret.encode()).digest()
    return _Entry(tenant, digest, True, _limits(where, options))


def _limits(where: str, options: list[str]) -> TenantLimits:
    values: dict[str, str] = {}
    for option in options:
        name, sep, value = option.partition("=")
        if not sep or name not in _LIMIT_NAMES or name in values:
            # The option's text is not quoted: a key pasted with a space would land here.
            raise ApiKeysError(
                f"{where}: after the key, only {', '.join(f'{n}=N' for n in _LIMIT_NAMES)} "
                "(each once) may follow"
            )
        values[name] = value
    try:
        limits = TenantLimits(
            max_jobs=int(values["max_jobs"]) if "max_jobs" in values else None,
            rps=float(values["rps"]) if "rps" in values else None,
            burst=int(values["burst"]) if "burst" in values else None,
        )
    except ValueError:
        raise ApiKeysError(f"{where}: max_jobs and burst are whole numbers, rps a number") from None
    given = [v for v in (limits.max_jobs, limits.rps, limits.burst) if v is not None]
    if any(not v > 0 or v != v or v == float("inf") for v in given):
        raise ApiKeysError(f"{where}: max_jobs, rps and burst are above 0 and finite")
    return limits
