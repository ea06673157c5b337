"""The local stack with `codec.enabled`: the UI's codec endpoint, the key file, the codec server
started and stopped by PID, and what workers and the CLI are told. Off, nothing changes."""

from __future__ import annotations

import base64
import json
import stat
from pathlib import Path

import httpx
from google.protobuf import json_format
from temporalio.api.common.v1 import Payload
from temporalio.envconfig import ClientConfig

from configuration.codec_keys import KEYS_FILE_ENV
from devstack.codec_server import keys_file, start_codec_server, stop_codec_server
from devstack.config import StackConfig, load_stack_config
from devstack.free_ports import free_port, make_stack_config
from devstack.models import RunningStack
from devstack.services import StackPaths
from devstack.temporal_server import temporal_argv, write_temporal_toml
from starter.codec import codec_from_environ
from tests.support.cli import ROOT


def codec_on(tmp_path: Path) -> StackConfig:
    config = make_stack_config(tmp_path / "state")
    codec = config.codec.model_copy(update={"enabled": True, "port": free_port()})
    return config.model_copy(update={"codec": codec})


def test_off_by_default_and_the_temporal_argv_is_unchanged(tmp_path: Path) -> None:
    shipped = load_stack_config(ROOT / "temporal-dev.yaml")
    assert not shipped.codec.enabled
    assert "--ui-codec-endpoint" not in temporal_argv(shipped, tmp_path)
    on = codec_on(tmp_path)
    argv = temporal_argv(on, tmp_path)
    assert argv[argv.index("--ui-codec-endpoint") + 1] == on.codec.url
    # Everything else as it was: only the codec flag differs.
    off = on.model_copy(update={"codec": shipped.codec})
    rest = [a for a in argv if a not in ("--ui-codec-endpoint", on.codec.url)]
    assert rest == list(temporal_argv(off, tmp_path))


def test_the_profile_names_the_codec_server_for_the_temporal_cli_and_the_sdk_ignores_it(
    tmp_path: Path,
) -> None:
    config = codec_on(tmp_path)
    toml = tmp_path / "temporal.toml"
    write_temporal_toml(toml, config.temporal, config.codec.url)
    assert f'endpoint = "{config.codec.url}"' in toml.read_text()
    loaded = ClientConfig.load_client_connect_config(
        override_env_vars={"TEMPORAL_CONFIG_FILE": str(toml), "TEMPORAL_PROFILE": "durable-comfy"}
    )
    assert loaded == {"target_host": config.temporal.address, "namespace": "default"}


async def test_codec_server_starts_with_a_private_key_file_decodes_and_stops(
    tmp_path: Path,
) -> None:
    config = codec_on(tmp_path)
    base = tmp_path
    pid, action = await start_codec_server(config, base)
    try:
        assert action == "started"
        keys = keys_file(config, base)
        assert stat.S_IMODE(keys.stat().st_mode) == 0o600
        before = keys.read_text()
        assert (await start_codec_server(config, base)) == (pid, "already running")
        # What workers and the CLI get from the env file encrypts for this server.
        codec = codec_from_environ({KEYS_FILE_ENV: str(keys)})
        assert codec is not None and codec.active_id == "dev-1"
        [sealed] = await codec.encode(
            [Payload(metadata={"encoding": b"json/plain"}, data=b'"hello"')]
        )
        body = {"payloads": [json.loads(json_format.MessageToJson(sealed))]}
        async with httpx.AsyncClient(trust_env=False) as http:
            answer = await http.post(
                f"{config.codec.url}/decode",
                json=body,
                headers={"Origin": config.temporal.ui_url},
            )
        assert answer.status_code == 200, answer.text
        assert answer.headers["access-control-allow-origin"] == config.temporal.ui_url
        assert base64.b64decode(answer.json()["payloads"][0]["data"]) == b'"hello"'
    finally:
        assert await stop_codec_server(config, base) == pid
    record_file = StackPaths.of(config, base).pids / "codec_server.pid"
    assert not record_file.exists()
    # The keys stay: histories encrypted with them must remain readable after `down`.
    assert keys_file(config, base).read_text() == before


def test_env_file_exports_the_key_file_and_says_how_to_decode(tmp_path: Path) -> None:
    fields = dict(
        temporal_address="127.0.0.1:1",
        namespace="default",
        temporal_ui="http://127.0.0.1:2",
        s3_endpoint="http://127.0.0.1:3",
        bucket="b",
        region="us-east-1",
        access_key_id="AKID",
        secret_access_key="SECRET",
        comfyui_url="http://127.0.0.1:4",
        runpod_url="http://127.0.0.1:5/v2",
        runpod_endpoint_id="e",
        runpod_api_key="rk",
        state_dir=tmp_path,
        env_file=tmp_path / "env",
        temporal_config_file=tmp_path / "temporal.toml",
        temporal_profile="durable-comfy",
        config_file=tmp_path / "stack.yaml",
    )
    off = RunningStack.model_validate(fields)
    assert KEYS_FILE_ENV not in off.worker_env() and "codec" not in off.env_file_text()
    on = RunningStack.model_validate(
        fields | {"codec_keys_file": tmp_path / "keys", "codec_endpoint": "http://127.0.0.1:6"}
    )
    assert on.worker_env()[KEYS_FILE_ENV] == str(tmp_path / "keys")
    assert "--codec-endpoint http://127.0.0.1:6" in on.env_file_text()
    assert f"export {KEYS_FILE_ENV}=" in on.env_file_text()
