"""The gateway's API keys (gateway.auth): where they come from, how they are held and compared,
what a bad entry says (never the key), and the open mode's loopback-only rule. No server."""

from __future__ import annotations

import hashlib
import hmac
import logging
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from pydantic import SecretStr

from configuration.settings import AuthSettings
from gateway import auth
from gateway.auth import ApiKeys, TenantLimits, hash_key, new_key_line
from gateway.errors import ApiKeysError, Unauthorized

ACME_KEY = "acme-key-0123456789abcdefghijklmnop"
GLOBEX_KEY = "globex-key-9876543210zyxwvutsrqponm"


@pytest.fixture(autouse=True)
def environ(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    monkeypatch.delenv(auth.KEYS_ENV, raising=False)
    monkeypatch.delenv(auth.KEYS_FILE_ENV, raising=False)
    monkeypatch.delenv("DURABLE_COMFY_SETTINGS_FILE", raising=False)
    yield monkeypatch


def keys_of(value: str | None = None, file: Path | None = None) -> ApiKeys:
    secret = None if value is None else SecretStr(value)
    values = {auth.KEYS_ENV: secret, auth.KEYS_FILE_ENV: file}
    return ApiKeys.from_settings(
        AuthSettings.model_validate({k: v for k, v in values.items() if v is not None})
    )


def keys_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "keys"
    path.write_text(text)
    path.chmod(mode)
    return path


# --- where keys come from --------------------------------------------------------------------


def test_keys_from_the_variable_name_their_tenants(environ: pytest.MonkeyPatch) -> None:
    environ.setenv(auth.KEYS_ENV, f"acme:{ACME_KEY}, globex:{GLOBEX_KEY}")
    keys = ApiKeys.from_settings(AuthSettings())

    assert not keys.open
    assert keys.tenants == ["acme", "globex"]
    assert keys.tenant_for(f"Bearer {ACME_KEY}") == "acme"
    assert keys.tenant_for(f"bearer  {GLOBEX_KEY} ") == "globex"


def test_keys_from_the_file_plain_hashed_commented_and_with_limits(
    environ: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = keys_file(
        tmp_path,
        "# the tenants of the staging gateway\n"
        "\n"
        f"acme:{ACME_KEY}   # rotated in March\n"
        f"globex:sha256:{hash_key(GLOBEX_KEY)} max_jobs=5 rps=2\n"
        f"acme:sha256:{hash_key('acme-second-key-for-rotation-xyz').upper()}\n",
    )
    environ.setenv(auth.KEYS_FILE_ENV, str(path))
    keys = ApiKeys.from_settings(AuthSettings())

    assert keys.tenant_for(f"Bearer {ACME_KEY}") == "acme"
    assert keys.tenant_for("Bearer acme-second-key-for-rotation-xyz") == "acme"
    assert keys.tenant_for(f"Bearer {GLOBEX_KEY}") == "globex"
    assert keys.limits == {"globex": TenantLimits(max_jobs=5, rps=2.0)}


def test_the_variable_and_the_file_together(tmp_path: Path) -> None:
    path = keys_file(tmp_path, f"globex:sha256:{hash_key(GLOBEX_KEY)}\n")
    keys = keys_of(f"acme:{ACME_KEY}", path)
    assert {keys.tenant_for(f"Bearer {k}") for k in (ACME_KEY, GLOBEX_KEY)} == {"acme", "globex"}


def test_keys_are_held_only_as_digests(tmp_path: Path) -> None:
    keys = keys_of(f"acme:{ACME_KEY},globex:{GLOBEX_KEY}")
    held = pickle.dumps(keys) + repr(keys).encode() + str(vars(keys)).encode()
    for key in (ACME_KEY, GLOBEX_KEY):
        assert key.encode() not in held
        assert hashlib.sha256(key.encode()).digest() in held


def test_a_file_of_plain_keys_readable_by_others_is_warned_about(tmp_path: Path) -> None:
    with structlog.testing.capture_logs() as logs:
        keys_of(file=keys_file(tmp_path, f"acme:{ACME_KEY}\n", mode=0o644))
    [warning] = [e for e in logs if e["event"] == "api_keys_file_readable_by_others"]
    assert warning["mode"] == "0o644" and warning["log_level"] == "warning"
    assert ACME_KEY not in str(logs)

    # Owner-only, or hashes only: nothing to say.
    with structlog.testing.capture_logs() as logs:
        keys_of(file=keys_file(tmp_path, f"acme:{ACME_KEY}\n", mode=0o600))
        keys_of(file=keys_file(tmp_path, f"acme:sha256:{hash_key(ACME_KEY)}\n", mode=0o644))
    assert [e for e in logs if e["event"] == "api_keys_file_readable_by_others"] == []


def test_a_short_key_is_warned_about_without_showing_it() -> None:
    with structlog.testing.capture_logs() as logs:
        keys = keys_of("acme:hunter2")
    assert keys.tenant_for("Bearer hunter2") == "acme"
    [warning] = [e for e in logs if e["event"] == "api_key_short"]
    assert warning["tenant"] == "acme" and "hunter2" not in str(logs)


# --- the check -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "says"),
    [
        (None, "no API key"),
        ("", "no API key"),
        ("   ", "no API key"),
        (f"Basic {ACME_KEY}", "must be `Bearer <key>`"),
        (ACME_KEY, "must be `Bearer <key>`"),
        ("Bearer", "must be `Bearer <key>`"),
        ("Bearer    ", "must be `Bearer <key>`"),
        (f"Bearer {ACME_KEY}x", "not valid"),
        (f"Bearer {ACME_KEY[:-1]}", "not valid"),
        (f"Bearer sha256:{hash_key(ACME_KEY)}", "not valid"),
    ],
)
def test_a_missing_malformed_or_unknown_key_is_unauthorized_without_echoing_it(
    header: str | None, says: str
) -> None:
    keys = keys_of(f"acme:{ACME_KEY}")
    with pytest.raises(Unauthorized, match=says) as raised:
        keys.tenant_for(header)
    assert ACME_KEY[:12] not in str(raised.value)


def test_every_key_is_compared_whichever_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    """No early exit: the first key, the last and none cost the same comparisons."""
    many = ",".join(f"t{n}:key-number-{n:02d}-abcdefghijklmnopqrstuvw" for n in range(10))
    keys = keys_of(many)
    compared: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append(1)
        return real(a, b)

    monkeypatch.setattr("gateway.auth.hmac.compare_digest", counting)
    for header, tenant in (
        ("Bearer key-number-00-abcdefghijklmnopqrstuvw", "t0"),
        ("Bearer key-number-09-abcdefghijklmnopqrstuvw", "t9"),
        ("Bearer key-number-99-abcdefghijklmnopqrstuvw", None),
    ):
        compared.clear()
        if tenant is None:
            with pytest.raises(Unauthorized):
                keys.tenant_for(header)
        else:
            assert keys.tenant_for(header) == tenant
        assert len(compared) == 10


# --- bad entries -----------------------------------------------------------------------------

SECRETISH = "zz-SECRET-never-shown-0123456789"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (SECRETISH, "entry 2: expected tenant:key"),
        ("acme:", "entry 2: expected tenant:key"),
        (f"{SECRETISH}!:{SECRETISH}", "entry 2: the tenant name"),
        (f"{'t' * 65}:{SECRETISH}", "entry 2: the tenant name"),
        (f"acme:sha256:{SECRETISH}", "entry 2: a sha256 entry holds exactly 64 hex"),
        (f"acme:sha256:{'a' * 63}", "entry 2: a sha256 entry holds exactly 64 hex"),
        (f"acme:{SECRETISH} {SECRETISH}", "entry 2: after the key, only max_jobs=N"),
        (f"acme:{SECRETISH} max_jobs=many", "entry 2: max_jobs and burst are whole numbers"),
        (f"acme:{SECRETISH} rps=0", "entry 2: max_jobs, rps and burst are above 0"),
        (f"acme:{SECRETISH} rps=nan", "entry 2: max_jobs, rps and burst are above 0"),
        (f"acme:{SECRETISH} rps=1 rps=2", "entry 2: after the key"),
    ],
)
def test_a_malformed_entry_in_the_variable_is_named_never_quoted(text: str, says: str) -> None:
    with pytest.raises(ApiKeysError, match=f"{auth.KEYS_ENV} {says}") as raised:
        keys_of(f"globex:{GLOBEX_KEY},{text}")
    assert SECRETISH[:10] not in str(raised.value)
    assert GLOBEX_KEY[:10] not in str(raised.value)


def test_one_key_for_two_tenants_is_refused_without_showing_it() -> None:
    with pytest.raises(
        ApiKeysError, match="one key is given to two tenants, acme and globex"
    ) as raised:
        keys_of(f"acme:{GLOBEX_KEY},globex:sha256:{hash_key(GLOBEX_KEY)}")
    assert GLOBEX_KEY[:10] not in str(raised.value)


def test_a_malformed_line_in_the_file_is_named_by_its_number(tmp_path: Path) -> None:
    path = keys_file(tmp_path, f"# header\n\nacme:{ACME_KEY}\n{SECRETISH}\n")
    with pytest.raises(ApiKeysError, match=f"{path} line 4: expected tenant:key") as raised:
        keys_of(file=path)
    assert SECRETISH[:10] not in str(raised.value)


def test_two_different_limits_for_one_tenant_are_refused(tmp_path: Path) -> None:
    path = keys_file(tmp_path, f"acme:{ACME_KEY} rps=2\nacme:{GLOBEX_KEY} rps=3\n")
    with pytest.raises(ApiKeysError, match="acme is given two different sets of limits"):
        keys_of(file=path)
    same = keys_file(tmp_path, f"acme:{ACME_KEY} rps=2\nacme:{GLOBEX_KEY} rps=2\n")
    assert keys_of(file=same).limits == {"acme": TenantLimits(rps=2.0)}


def test_an_unreadable_or_empty_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ApiKeysError, match=f"cannot read {tmp_path / 'absent'}"):
        keys_of(file=tmp_path / "absent")
    with pytest.raises(ApiKeysError, match="holds no key entries"):
        keys_of(file=keys_file(tmp_path, "# nobody yet\n"))


# --- open mode -------------------------------------------------------------------------------


def test_without_keys_everyone_is_local(environ: pytest.MonkeyPatch) -> None:
    keys = ApiKeys.from_settings(AuthSettings())
    assert keys.open and keys.tenants == ["local"]
    assert keys.tenant_for(None) == "local"
    assert keys.tenant_for(f"Bearer {ACME_KEY}") == "local"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost"])
def test_open_mode_listens_on_loopback(host: str) -> None:
    keys_of().check_bind(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.0.0.5", "192.168.1.2", "gateway.lan"])
def test_open_mode_refuses_any_other_address(host: str) -> None:
    with pytest.raises(ValueError, match="loopback address only") as raised:
        keys_of().check_bind(host)
    assert auth.KEYS_ENV in str(raised.value)
    keys_of(f"acme:{ACME_KEY}").check_bind(host)  # with keys: anywhere


# --- new keys --------------------------------------------------------------------------------


def test_a_new_key_line_lets_its_key_in_and_holds_only_its_hash(tmp_path: Path) -> None:
    key, line = new_key_line("acme")
    other, _ = new_key_line("acme")
    assert key != other and len(key) >= 43
    assert line == f"acme:sha256:{hashlib.sha256(key.encode()).hexdigest()}"
    assert key not in line
    keys = keys_of(file=keys_file(tmp_path, line + "\n", mode=0o644))
    assert keys.tenant_for(f"Bearer {key}") == "acme"
    with pytest.raises(ValueError, match="tenant name"):
        new_key_line("no spaces")


def test_nothing_is_logged_at_import_or_by_the_stdlib(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        keys = keys_of(f"acme:{ACME_KEY}")
        with pytest.raises(Unauthorized):
            keys.tenant_for(f"Bearer {GLOBEX_KEY}")
    assert ACME_KEY not in caplog.text and GLOBEX_KEY not in caplog.text
