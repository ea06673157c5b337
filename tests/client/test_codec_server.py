"""The codec server (starter/codec_server.py): Temporal's /encode and /decode protocol, CORS for
the UI's origin only, bearer auth; and `durable-comfy codec-server` refusing to start badly."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer
from google.protobuf import json_format
from pydantic import SecretStr
from temporalio.api.common.v1 import Payload

from configuration.codec_keys import KEYS_ENV, TOKEN_ENV, KeyRing
from configuration.settings import CodecServerSettings
from starter.codec import EncryptionCodec, new_entry
from starter.codec_server import build_codec_app
from tests.support.cli import run_cli

UI = "http://127.0.0.1:8233"
TOKEN = "tok-" + "7" * 40
MARKER = "marker-codec-server-51c2"


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def plain(text: str) -> dict[str, Any]:
    """A json/plain payload as the UI sends it (proto JSON: bytes in base64)."""
    return {"metadata": {"encoding": b64(b"json/plain")}, "data": b64(json.dumps(text).encode())}


@pytest.fixture(scope="module")
def ring() -> KeyRing:
    return KeyRing.parse(f"{new_entry('new')},{new_entry('old')}", KEYS_ENV)


@pytest_asyncio.fixture(loop_scope="session")
async def client(ring: KeyRing) -> AsyncIterator[TestClient[Any, Any]]:
    app = build_codec_app(EncryptionCodec(ring), UI, SecretStr(TOKEN))
    async with TestClient(TestServer(app)) as test_client:
        yield test_client


AUTH = {"Authorization": f"Bearer {TOKEN}", "Origin": UI, "X-Namespace": "default"}


async def test_encode_then_decode_round_trips_with_the_active_key(
    client: TestClient[Any, Any],
) -> None:
    sent = {"payloads": [plain(MARKER), plain("second")]}
    encoded = await client.post("/encode", json=sent, headers=AUTH)
    assert encoded.status == 200, await encoded.text()
    body = await encoded.json()
    metadata = body["payloads"][0]["metadata"]
    assert base64.b64decode(metadata["encoding"]) == b"binary/encrypted"
    assert base64.b64decode(metadata["encryption-key-id"]) == b"new"
    assert MARKER not in json.dumps(body) and b64(MARKER.encode())[:12] not in json.dumps(body)
    decoded = await client.post("/decode", json=body, headers=AUTH)
    assert decoded.status == 200
    assert await decoded.json() == sent


async def test_decode_of_an_unknown_key_names_it(client: TestClient[Any, Any]) -> None:
    other = EncryptionCodec(KeyRing.parse(new_entry("elsewhere"), KEYS_ENV))
    encoded = await build_client_encode(other, MARKER)
    answer = await client.post("/decode", json={"payloads": [encoded]}, headers=AUTH)
    assert answer.status == 422
    error = (await answer.json())["error"]
    assert error["type"] == "UnknownKeyId" and "'elsewhere'" in error["message"]


async def build_client_encode(codec: EncryptionCodec, text: str) -> dict[str, Any]:
    [sealed] = await codec.encode(
        [Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(text).encode())]
    )
    document: dict[str, Any] = json.loads(json_format.MessageToJson(sealed))
    return document


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": UI},
        {"Origin": UI, "Authorization": "Bearer wrong-token"},
        {"Origin": UI, "Authorization": f"Basic {TOKEN}"},
        {"Origin": UI, "Authorization": f"Bearer {TOKEN}x"},
    ],
    ids=["none", "wrong", "not-bearer", "longer"],
)
async def test_without_the_right_bearer_token_401(
    client: TestClient[Any, Any], headers: dict[str, str]
) -> None:
    for path in ("/decode", "/encode"):
        answer = await client.post(path, json={"payloads": [plain(MARKER)]}, headers=headers)
        assert answer.status == 401
        assert answer.headers["WWW-Authenticate"].startswith("Bearer")
        assert MARKER not in await answer.text()
        # The UI must be able to read the 401 to say why.
        assert answer.headers["Access-Control-Allow-Origin"] == UI


async def test_preflight_from_the_ui_origin_is_allowed_without_auth(
    client: TestClient[Any, Any],
) -> None:
    answer = await client.options(
        "/decode",
        headers={
            "Origin": UI,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,x-namespace,authorization",
        },
    )
    assert answer.status in (200, 204)
    assert answer.headers["Access-Control-Allow-Origin"] == UI
    assert "POST" in answer.headers["Access-Control-Allow-Methods"]
    allowed = {h.strip() for h in answer.headers["Access-Control-Allow-Headers"].split(",")}
    assert {"content-type", "x-namespace", "authorization"} <= allowed


async def test_other_origins_get_no_cors_headers(client: TestClient[Any, Any]) -> None:
    evil = "http://127.0.0.1:9999"
    preflight = await client.options(
        "/decode", headers={"Origin": evil, "Access-Control-Request-Method": "POST"}
    )
    assert preflight.status == 403
    assert "Access-Control-Allow-Origin" not in preflight.headers
    # Even a request the browser would send without a preflight: its answer stays unreadable.
    answer = await client.post(
        "/decode", json={"payloads": [plain("x")]}, headers={**AUTH, "Origin": evil}
    )
    assert "Access-Control-Allow-Origin" not in answer.headers


async def test_malformed_body_is_400(client: TestClient[Any, Any]) -> None:
    answer = await client.post("/decode", data="not json", headers=AUTH)
    assert answer.status == 400
    assert (await answer.json())["error"]["type"] == "BadRequest"


async def test_no_token_configured_means_no_auth(ring: KeyRing) -> None:
    app = build_codec_app(EncryptionCodec(ring), UI + "/", None)
    async with TestClient(TestServer(app)) as open_client:
        answer = await open_client.post(
            "/encode", json={"payloads": [plain("x")]}, headers={"Origin": UI}
        )
        assert answer.status == 200
        assert answer.headers["Access-Control-Allow-Origin"] == UI  # trailing slash ignored
        assert (await open_client.get("/health")).status == 200


async def run_module(*args: str, env: dict[str, str]) -> tuple[int, str]:
    """The CLI's exit code and everything it wrote (stdout then stderr)."""
    code, out, err = await run_cli(*args, env=env)
    return code, out + err


async def test_cli_refuses_to_start_without_keys_or_with_bad_ones_never_echoing_them() -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("DURABLE_COMFY_CODEC")}
    code, out = await run_module("codec-server", "--port", "1", env=base)
    assert code == 2 and "no key configured" in out and KEYS_ENV in out
    material = b64(b"s" * 31)
    bad = {**base, KEYS_ENV: f"k1:{material}"}
    code, out = await run_module("codec-server", "--port", "1", env=bad)
    assert code == 2 and "31 bytes" in out and material not in out
    # The job commands stop at start-up the same way, before any connection.
    code, out = await run_module("status", "some-job", env=bad)
    assert code == 2 and KEYS_ENV in out and material not in out and "Traceback" not in out


def test_the_token_comes_from_the_named_variable_or_the_default_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert CodecServerSettings.load().auth_token is None
    monkeypatch.setenv(TOKEN_ENV, "default-token")
    monkeypatch.setenv("MY_CODEC_TOKEN", "named-token")
    assert CodecServerSettings.load().auth_token == SecretStr("default-token")
    named = CodecServerSettings.load("MY_CODEC_TOKEN")
    assert named.auth_token == SecretStr("named-token")
    assert "named-token" not in repr(named)
